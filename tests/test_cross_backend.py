"""A `.keras` file saved under each of tensorflow, jax and torch loads under the current
backend with the same outputs.

Each backend's test run covers its own column of the 3 x 3 matrix: it saves one model
under each of the two other backends in a subprocess (`KERAS_BACKEND` set, both in
parallel) and one here, then loads all three files here, with `safe_mode=True` and no
`custom_objects`. Run as a script, this file is the saver:

    KERAS_BACKEND=jax python tests/test_cross_backend.py save OUT_DIR
"""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_mha

BACKENDS = ("tensorflow", "jax", "torch")
ROOT = Path(__file__).resolve().parent.parent
ATOL = 1e-5


def build_model():
    """Tokens with a padding mask -> causal self-attention -> cross-attention to a
    context with S != T and value_dim != key_dim, returning output and scores."""
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    context = keras.Input((3, 6), name="context")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = keras_mha.MultiHeadAttention(2, 4, name="self_attention")(x, x, use_causal_mask=True)
    y, scores = keras_mha.MultiHeadAttention(
        2, key_dim=4, value_dim=3, output_shape=(2, 4), name="cross_attention"
    )(x, context, return_attention_scores=True)
    return keras.Model([tokens, context], [y, scores])


def save(out_dir):
    """Saves the model, its inputs and outputs under `out_dir` (the saver's side)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(0)
    model = build_model()
    rng = np.random.default_rng(0)
    tokens = np.array([[4, 9, 2, 0, 0], [7, 1, 3, 8, 5]], "int32")
    context = rng.normal(size=(2, 3, 6)).astype("float32")
    outputs = [keras.ops.convert_to_numpy(o) for o in model([tokens, context])]
    model.save(out_dir / "model.keras")
    np.savez(out_dir / "data.npz", tokens=tokens, context=context, y=outputs[0], s=outputs[1])
    (out_dir / "backend.txt").write_text(keras.backend.backend())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One directory per backend, each written by a subprocess under that backend."""
    root = tmp_path_factory.mktemp("cross_backend")
    procs = {}
    for backend in BACKENDS:
        if backend == keras.backend.backend():
            continue
        env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONPATH": str(ROOT)}
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        # Saving needs no TensorFlow under jax or torch; importing it costs seconds.
        block_tf = "" if backend == "tensorflow" else "sys.modules['tensorflow'] = None; "
        runner = (
            f"import runpy, sys; {block_tf}"
            "sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        procs[backend] = subprocess.Popen(
            [sys.executable, "-c", runner, __file__, "save", str(root / backend)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    save(root / keras.backend.backend())  # while the others run
    for backend, proc in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"saving under {backend} failed:\n{output[-3000:]}"
    return root


@pytest.mark.parametrize("source", BACKENDS)
def test_file_saved_under_each_backend_loads_here_with_same_outputs(saved, source):
    directory = saved / source
    assert (directory / "backend.txt").read_text() == source
    data = np.load(directory / "data.npz")

    loaded = keras.saving.load_model(directory / "model.keras", safe_mode=True)

    attention = [loaded.get_layer(n) for n in ("self_attention", "cross_attention")]
    assert all(type(layer) is keras_mha.MultiHeadAttention for layer in attention)
    y, scores = loaded([data["tokens"], data["context"]])
    assert tuple(y.shape) == (2, 5, 2, 4) and tuple(scores.shape) == (2, 2, 5, 3)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(y), data["y"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(scores), data["s"], atol=ATOL, rtol=0)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "save":
        sys.exit(f"usage: KERAS_BACKEND=... {sys.argv[0]} save OUT_DIR")
    save(sys.argv[2])  # keras was imported above, under $KERAS_BACKEND
