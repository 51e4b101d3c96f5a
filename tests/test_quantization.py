"""Quantization through the projection sublayers (`keras_mha/projections.py`): ours beside
the built-in, from the same weights. `model.quantize(mode)` (int8, float8, int4) gives the
built-in's quantized weights and outputs; a `DTypePolicyMap` naming the projections
(`"mha/query"`) builds them quantized, as it does the built-in's; `get_config` records the
projections' quantized policies, so a layer rebuilt from it takes their weights. Saving a
quantized model to `.keras` is in `test_saving.py`.
"""

import json

import keras
import numpy as np
import pytest
from helpers import make_pair, random_inputs, to_numpy

import keras_mha

B, T, S, DIM = 2, 5, 7, 8
CONFIG = dict(num_heads=2, key_dim=4, name="mha")
MODES = ("int8", "float8", "int4")
PROJECTIONS = ("query_dense", "key_dense", "value_dense", "output_dense")


def _pair_in_models():
    """(ours, built-in) with the same weights, each in its own functional model."""
    ours, builtin = make_pair(CONFIG, (B, T, DIM), (B, S, DIM))
    models = []
    for layer in (ours, builtin):
        query, value = keras.Input((T, DIM)), keras.Input((S, DIM))
        models.append(keras.Model([query, value], layer(query, value)))
    return ours, builtin, models


def _weights(layer):
    return [
        (w.path, keras.backend.standardize_dtype(w.dtype), tuple(w.shape)) for w in layer.weights
    ]


@pytest.mark.parametrize("mode", MODES)
def test_quantize_gives_the_quantized_builtin_and_its_config_rebuilds_it(mode, rng):
    ours, builtin, (ours_model, builtin_model) = _pair_in_models()
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    full = to_numpy(ours_model([q, v]))
    for model in (ours_model, builtin_model):
        model.quantize(mode)

    for name in PROJECTIONS:
        dense = getattr(ours, name)
        assert dense.quantization_mode == mode, name
        assert dense.dtype_policy.name == getattr(builtin, name).dtype_policy.name, name
    assert _weights(ours) == _weights(builtin)
    for got, want in zip(ours.get_weights(), builtin.get_weights()):
        np.testing.assert_array_equal(got, want)
    expected = to_numpy(builtin_model([q, v]))
    quantized = to_numpy(ours_model([q, v]))
    np.testing.assert_allclose(quantized, expected, atol=1e-6, rtol=0)
    # Quantized for real: close to the float outputs, not equal to them.
    error = np.abs(quantized - full).max() / np.abs(full).max()
    assert 0 < error < 0.2, error
    _assert_config_rebuilds_quantized(ours, mode, q, v)


def _quantized_pair(mode):
    """(ours, built-in) with the same weights, every projection quantized in `mode`."""
    ours, builtin = make_pair(CONFIG, (B, T, DIM), (B, S, DIM))
    for layer in (ours, builtin):
        for name in PROJECTIONS:
            getattr(layer, name).quantize(mode)
    return ours, builtin


def test_dtype_policy_map_quantizes_the_named_projections_at_build(rng):
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    # The policies `quantize` gives: int8 for the query, int4 (per 128-row block) for
    # the output projection; key and value stay float32.
    sources = _quantized_pair("int8"), _quantized_pair("int4")
    built = []
    for index, base in enumerate((keras_mha.MultiHeadAttention, keras.layers.MultiHeadAttention)):
        int8, int4 = (pair[index] for pair in sources)
        policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
        policy_map["mha/query"] = int8.query_dense.dtype_policy.name
        policy_map["mha/attention_output"] = int4.output_dense.dtype_policy.name
        layer = base(**{**CONFIG, "dtype": policy_map})
        layer.build((B, T, DIM), (B, S, DIM))
        modes = [getattr(layer, name).quantization_mode for name in PROJECTIONS]
        assert modes == ["int8", None, None, "int4"], base
        # The quantized weights of `quantize` load into it.
        float_pair = make_pair(CONFIG, (B, T, DIM), (B, S, DIM))[index]
        for name, source in (("query_dense", int8), ("output_dense", int4)):
            getattr(layer, name).set_weights(getattr(source, name).get_weights())
        for name in ("key_dense", "value_dense"):
            getattr(layer, name).set_weights(getattr(float_pair, name).get_weights())
        built.append(layer)
    ours, builtin = built
    assert _weights(ours) == _weights(builtin)
    expected = to_numpy(builtin(q, v))
    np.testing.assert_allclose(to_numpy(ours(q, v)), expected, atol=1e-6, rtol=0)
    assert np.abs(expected).max() > 0


def _assert_config_rebuilds_quantized(ours, mode, q, v):
    """`get_config` -> `from_config` rebuilds the projections quantized (`mode`)."""
    expected = to_numpy(ours(q, v))

    config = json.loads(json.dumps(ours.get_config()))  # plain data only
    rebuilt = keras_mha.MultiHeadAttention.from_config(config)
    rebuilt.build_from_config(json.loads(json.dumps(ours.get_build_config())))
    # Same variables; float8's come in another order (a layer built quantized creates
    # its scales before its kernel, as Keras's EinsumDense does), so matched by path.
    assert sorted(_weights(rebuilt)) == sorted(_weights(ours))
    for name in PROJECTIONS:
        assert getattr(rebuilt, name).quantization_mode == mode, name
    assert rebuilt.compute_dtype == ours.compute_dtype == "float32"
    values = {w.path: w for w in ours.weights}
    for variable in rebuilt.weights:
        variable.assign(values[variable.path])
    np.testing.assert_array_equal(to_numpy(rebuilt(q, v)), expected)
    assert json.loads(json.dumps(rebuilt.get_config())) == config


def test_unquantized_config_keeps_the_plain_policy():
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, dtype="mixed_bfloat16")
    layer.build((B, T, DIM), (B, S, DIM))
    builtin = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dtype="mixed_bfloat16")
    assert layer.get_config()["dtype"] == builtin.get_config()["dtype"]
