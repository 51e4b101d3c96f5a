"""Export for serving from the current backend, run outside Keras, same outputs.

What Keras 3.15 supports (keras/src/export/), and so what each backend's run checks:

- tf_saved_model: tensorflow and jax (via jax2tf) export it, TensorFlow runs it; torch
  needs `torch_xla` (its StableHLO bridge) and raises a clear ImportError without it.
- onnx: torch exports it, onnxruntime runs it; tensorflow needs `tf2onnx` and jax
  needs `jax2onnx`, each a clear ImportError when missing.

Where the converter is missing, the test asserts Keras's ImportError naming it; where it
is installed, the same test exports and runs the artifact. Nothing is skipped.
"""

import importlib.util

import keras
import numpy as np
import pytest

import keras_mha

BACKEND = keras.backend.backend()
ATOL = 1e-5
BATCH, T, DIM = 2, 5, 8


def _model():
    x = keras.Input((T, DIM), name="x")
    y = keras_mha.MultiHeadAttention(2, 4, name="attention")(x, x, use_causal_mask=True)
    return keras.Model(x, keras.layers.Dense(3, name="head")(y))


def _data(rng, batch=BATCH):
    return rng.normal(size=(batch, T, DIM)).astype("float32")


def _fixed_signature():
    return [keras.InputSpec(shape=(BATCH, T, DIM), dtype="float32")]


def _installed(module):
    return importlib.util.find_spec(module) is not None


def _run_tf_saved_model(path, data):
    import tensorflow as tf

    serving = tf.saved_model.load(str(path)).signatures["serving_default"]
    (output,) = serving(x=tf.constant(data)).values()
    return output.numpy()


def _run_onnx(path, data):
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: data})[0]


def test_export_tf_saved_model(tmp_path, rng):
    model = _model()
    path = tmp_path / "saved_model"
    if BACKEND == "torch" and not _installed("torch_xla"):
        # torch -> SavedModel goes through torch_xla's StableHLO bridge. (A fixed
        # signature: without one, Keras 3.15's torch.export call fails before that.)
        with pytest.raises(ImportError, match="torch_xla"):
            model.export(path, format="tf_saved_model", input_signature=_fixed_signature())
        assert not (path / "saved_model.pb").exists()
        return
    model.export(path, format="tf_saved_model", verbose=False)
    # The batch axis stays dynamic: serve a batch size the model was never called with.
    for batch in (BATCH, 3):
        data = _data(rng, batch)
        expected = keras.ops.convert_to_numpy(model(data))
        np.testing.assert_allclose(_run_tf_saved_model(path, data), expected, atol=ATOL, rtol=0)


def test_export_onnx(tmp_path, rng):
    model = _model()
    path = tmp_path / "model.onnx"
    converter = {"tensorflow": "tf2onnx", "jax": "jax2onnx", "torch": None}[BACKEND]
    if converter and not _installed(converter):
        model(_data(rng))  # called, so the failure is the missing converter
        with pytest.raises(ImportError, match=converter):
            model.export(path, format="onnx", verbose=False)
        assert not path.exists()
        return
    # torch exports static shapes only (Keras would replace a `None` batch with 1).
    signature = _fixed_signature() if BACKEND == "torch" else None
    model.export(path, format="onnx", verbose=False, input_signature=signature)
    data = _data(rng)
    expected = keras.ops.convert_to_numpy(model(data))
    np.testing.assert_allclose(_run_onnx(path, data), expected, atol=ATOL, rtol=0)


def test_export_of_a_reloaded_model(tmp_path, rng):
    """The deploy path: train, save `.keras`, reload elsewhere, export that."""
    model = _model()
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras", safe_mode=True)
    data = _data(rng)
    expected = keras.ops.convert_to_numpy(model(data))
    if BACKEND == "torch":
        path = tmp_path / "model.onnx"
        loaded.export(path, format="onnx", verbose=False, input_signature=_fixed_signature())
        got = _run_onnx(path, data)
    else:
        path = tmp_path / "saved_model"
        loaded.export(path, format="tf_saved_model", verbose=False)
        got = _run_tf_saved_model(path, data)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
