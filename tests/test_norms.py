"""QK-norm (`normalize_qk=True`): RMS-normalised queries and keys with learned scales."""

import contextlib

import keras
import numpy as np
import pytest
from keras import ops
from reference import reference_mha, rms_norm

import keras_mha
from keras_mha.norms import RMSNorm

B, T, S, D = 2, 4, 5, 6
HEADS, HEAD_DIM = 2, 3
EPS = 1e-6


@pytest.mark.parametrize("kv_heads", [HEADS, 1], ids=["mha", "mqa"])
def test_matches_numpy_reference(rng, kv_heads):
    layer = keras_mha.MultiHeadAttention(
        HEADS, HEAD_DIM, normalize_qk=True, num_key_value_heads=kv_heads
    )
    query = rng.normal(size=(B, T, D)).astype("float32")
    value = rng.normal(size=(B, S, D)).astype("float32")
    layer.build(query.shape, value.shape)
    weights = [rng.normal(size=w.shape).astype("float32") for w in layer.weights]
    layer.set_weights(weights)
    expected, _ = reference_mha(layer, query, value)
    np.testing.assert_allclose(ops.convert_to_numpy(layer(query, value)), expected, atol=1e-5)
    # Without the norm the result differs: the test sees whether the norm ran.
    plain = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, num_key_value_heads=kv_heads)
    plain.build(query.shape, value.shape)
    plain.set_weights(weights[:8])
    assert np.abs(ops.convert_to_numpy(plain(query, value)) - expected).max() > 1e-3


def test_norm_weights_come_after_the_builtin_weights():
    builtin = keras.layers.MultiHeadAttention(HEADS, HEAD_DIM)
    ours = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, normalize_qk=True)
    builtin.build((B, T, D), (B, S, D))
    ours.build((B, T, D), (B, S, D))
    names = [(w.path.split("/", 1)[1], tuple(w.shape)) for w in ours.weights]
    assert names[:8] == [(w.path.split("/", 1)[1], tuple(w.shape)) for w in builtin.weights]
    assert names[8:] == [("query_norm/scale", (HEAD_DIM,)), ("key_norm/scale", (HEAD_DIM,))]
    assert all(w.trainable for w in ours.weights[8:])
    np.testing.assert_array_equal(ops.convert_to_numpy(ours.weights[8]), 1.0)


def test_rms_norm_layer(rng):
    x = rng.normal(size=(3, 4, 5)).astype("float32") * 10.0
    norm = RMSNorm(epsilon=EPS)
    norm.build(x.shape)
    scale = rng.normal(size=(5,)).astype("float32")
    norm.scale.assign(scale)
    np.testing.assert_allclose(ops.convert_to_numpy(norm(x)), rms_norm(x, scale, EPS), rtol=1e-5)
    mixed = RMSNorm(epsilon=EPS, dtype="mixed_float16")
    mixed.build(x.shape)
    mixed.scale.assign(scale)
    half = mixed(x)
    assert "float16" in str(half.dtype) and "float32" in str(mixed.scale.dtype)
    np.testing.assert_allclose(
        ops.convert_to_numpy(ops.cast(half, "float32")),
        rms_norm(x, scale, EPS),
        rtol=2e-3,
        atol=2e-3,
    )
    assert RMSNorm.from_config(norm.get_config()).epsilon == EPS


def test_scales_are_trained(rng):
    inputs = keras.Input((T, D))
    layer = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, normalize_qk=True)
    model = keras.Model(inputs, layer(inputs, inputs))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = rng.normal(size=(B, T, D)).astype("float32")
    y = rng.normal(size=(B, T, D)).astype("float32")
    model.fit(x, y, epochs=2, verbose=0)
    assert np.abs(ops.convert_to_numpy(layer._query_norm.scale) - 1.0).max() > 0.0
    assert np.abs(ops.convert_to_numpy(layer._key_norm.scale) - 1.0).max() > 0.0


def test_serialization_round_trip(rng, tmp_path):
    inputs = keras.Input((T, D))
    layer = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, normalize_qk=True)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    layer._query_norm.scale.assign(rng.normal(size=(HEAD_DIM,)).astype("float32"))
    layer._key_norm.scale.assign(rng.normal(size=(HEAD_DIM,)).astype("float32"))
    assert layer.get_config()["normalize_qk"] is True
    assert keras_mha.MultiHeadAttention.from_config(layer.get_config())._normalize_qk
    path = tmp_path / "qk_norm.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = rng.normal(size=(B, T, D)).astype("float32")
    np.testing.assert_allclose(
        ops.convert_to_numpy(loaded(x)), ops.convert_to_numpy(model(x)), atol=1e-6
    )


def test_invalid_normalize_qk():
    # Flags take bools and ints, as the built-in's do; a string is not a flag.
    with pytest.raises(ValueError, match="`normalize_qk`.*normalize_qk='yes'"):
        keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, normalize_qk="yes")


# ------------------------------------------------- the kinds of keras-hub's models
def _hub(module, name):
    hub = pytest.importorskip("keras_hub")  # noqa: F841
    import importlib

    return getattr(importlib.import_module(f"keras_hub.src.models.{module}"), name)


@pytest.mark.parametrize(
    "module, name, ours, hub_kwargs",
    [
        # x * (1 + w), w from zeros: Gemma 3 (and T5Gemma 2, which imports it).
        ("gemma3.gemma3_layers", "RMSNormalization", dict(unit_offset=True), {}),
        ("gemma.rms_normalization", "RMSNormalization", dict(unit_offset=True), {}),
        ("qwen3_5.qwen3_5_layers", "Qwen3_5LayerNorm", dict(unit_offset=True), {}),
        # x * w, w from ones, an epsilon of its own: Qwen3, Gemma 4.
        ("qwen3.qwen3_layernorm", "Qwen3LayerNorm", {}, {}),
        ("gemma4.gemma4_layers", "RMSNormalization", {}, {}),
        # No weight: the value norms of Gemma 4 and Gemma 3n.
        ("gemma4.gemma4_layers", "Gemma4VNorm", dict(use_scale=False), {}),
        ("gemma3n.rms_normalization", "Gemma3nRMSNorm", dict(use_scale=False), "dim"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
@pytest.mark.parametrize("epsilon", [1e-6, 0.3])
def test_matches_keras_hubs_norm_layer(rng, module, name, ours, hub_kwargs, epsilon):
    """Our norm kinds against keras-hub's own layers (code we did not write), with the
    same learned weight, in float32: its epsilon, its parametrisation, no weight."""
    x = rng.normal(size=(2, 3, 4, 8)).astype("float32") * 3.0
    eps_name = "eps" if name == "Gemma3nRMSNorm" else "epsilon"
    extra = {"dim": 8, "with_scale": False} if hub_kwargs == "dim" else hub_kwargs
    hub_norm = _hub(module, name)(**{eps_name: epsilon}, **extra)
    hub_norm.build(x.shape)
    norm = RMSNorm(epsilon=epsilon, **ours)
    norm.build(x.shape)
    assert len(norm.weights) == len(hub_norm.weights)
    if norm.weights:
        w = rng.normal(size=(8,)).astype("float32")
        norm.scale.assign(w)
        hub_norm.scale.assign(w)
        initial = RMSNorm(**ours)
        initial.build(x.shape)
        fresh = _hub(module, name)(**extra)
        fresh.build(x.shape)  # the same initial weights: ones, or zeros for 1 + w
        np.testing.assert_array_equal(
            ops.convert_to_numpy(initial.scale), ops.convert_to_numpy(fresh.scale)
        )
    expected = ops.convert_to_numpy(hub_norm(x))
    np.testing.assert_allclose(ops.convert_to_numpy(norm(x)), expected, rtol=1e-6, atol=1e-6)
    plain = RMSNorm(epsilon=1e-6 if epsilon != 1e-6 else 0.3, **ours)
    plain.build(x.shape)
    for a, b in zip(plain.weights, norm.weights):
        a.assign(b)
    assert np.abs(ops.convert_to_numpy(plain(x)) - expected).max() > 1e-4  # epsilon counts


def test_unit_offset_is_the_plain_scale_plus_one(rng):
    """`x_hat * (1 + w)` and `x_hat * s` with `s = 1 + w`: the same outputs, and the
    same gradient for `w` as for `s`."""
    x = rng.normal(size=(2, 5, 6)).astype("float32")
    w = rng.normal(size=(6,)).astype("float32")
    offset, plain = RMSNorm(unit_offset=True), RMSNorm()
    offset.build(x.shape)
    plain.build(x.shape)
    offset.scale.assign(w)
    plain.scale.assign(1.0 + w)
    np.testing.assert_allclose(
        ops.convert_to_numpy(offset(x)), ops.convert_to_numpy(plain(x)), atol=1e-6
    )
    np.testing.assert_allclose(
        ops.convert_to_numpy(offset(x)), rms_norm(x, 1.0 + w, EPS), rtol=1e-5, atol=1e-6
    )
    from helpers import gradients

    grads = [gradients(norm, {"x": x})[2][0] for norm in (offset, plain)]
    assert np.abs(grads[0]).max() > 0
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_value_norm_has_no_weight_and_round_trips():
    norm = RMSNorm(epsilon=0.01, use_scale=False, unit_offset=False)
    norm.build((2, 3, 4))
    assert norm.weights == []
    config = norm.get_config()
    again = RMSNorm.from_config(config)
    assert (again.epsilon, again.use_scale, again.unit_offset) == (0.01, False, False)
    x = np.arange(24, dtype="float32").reshape(2, 3, 4)
    np.testing.assert_allclose(ops.convert_to_numpy(norm(x)), rms_norm(x, 1.0, 0.01), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(normalize_qk=True, norm_epsilon=1e-3),
        dict(normalize_qk=True, norm_unit_offset=True),
        dict(normalize_value=True, norm_epsilon=0.2),
    ],
)
def test_layer_norms_match_numpy_reference(rng, kwargs):
    """The layer's norms (its epsilon, `1 + w`, the value norm) in the float64
    reference, with random weights."""
    layer = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, **kwargs)
    query = rng.normal(size=(B, T, D)).astype("float32")
    value = rng.normal(size=(B, S, D)).astype("float32")
    layer.build(query.shape, value.shape)
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.weights])
    expected, _ = reference_mha(layer, query, value)
    np.testing.assert_allclose(ops.convert_to_numpy(layer(query, value)), expected, atol=1e-5)


def test_recomputed_norms_train_as_kept_norms(rng, monkeypatch):
    """`Policy.remat_norms` (JAX's row): the QK and value norms recomputed in the
    backward pass (`keras.remat`) give the same outputs and train the same weights as
    kept ones, in Keras's own train step, the norms' scales included. Also on torch
    (`torch.utils.checkpoint`). TensorFlow's row keeps them: `tf.recompute_grad` in
    a compiled train step gave other weights in about one run in six (the policy's
    docstring); there the test checks that nothing is recomputed."""
    remats = []
    remat = keras.remat

    def counted(f):
        remats.append(f)
        return remat(f)

    monkeypatch.setattr(keras, "remat", counted)
    if keras.backend.backend() == "torch":
        # Eager torch calls hold data; as in a compiled one, the layer sees none here.
        monkeypatch.setattr(keras_mha.kernels.trim, "holds_data", lambda x: False)
    query = rng.normal(size=(B, T, D)).astype("float32")
    target = rng.normal(size=(B, T, D)).astype("float32")
    inputs = keras.Input((T, D))
    layer = keras_mha.MultiHeadAttention(
        HEADS, 4, normalize_qk=True, normalize_value=True, rope_max_wavelength=100
    )
    model = keras.Model(inputs, layer(inputs, inputs))
    model.set_weights([rng.normal(size=w.shape).astype("float32") for w in model.weights])
    start = model.get_weights()
    results = {}
    # TensorFlow: its own row only (`None`: no override).
    cases = (None,) if keras.backend.backend() == "tensorflow" else (False, True)
    for recomputed in cases:
        model.set_weights(start)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        del remats[:]
        with contextlib.ExitStack() as stack:
            if recomputed is not None:
                stack.enter_context(keras_mha.kernels.policy.overriding(remat_norms=recomputed))
            loss = model.train_on_batch(query, target)
            output = model.predict_on_batch(query)
        assert bool(remats) is bool(recomputed)
        results[recomputed] = [loss, output, *model.get_weights()]
    if recomputed is None:
        return
    names = ["loss", "output"] + [w.path for w in model.weights]
    for name, kept, recomputed, first in zip(names, results[False], results[True], [0, 0, *start]):
        if name.endswith("norm/scale"):
            assert np.abs(kept - first).max() > 1e-4, name  # trained
        np.testing.assert_allclose(recomputed, kept, rtol=1e-5, atol=1e-6, err_msg=name)
