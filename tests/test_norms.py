"""QK-norm (`normalize_qk=True`): RMS-normalised queries and keys with learned scales."""

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
