"""Bad input: every invalid constructor argument and call input raises a ValueError or
TypeError naming the argument and what was received, and a rejected call leaves the
layer exactly as it was (weights, their number, built state), ready for the next call."""

import re

import numpy as np
import pytest
from keras import ops

from keras_mha import MultiHeadAttention

VALID = dict(num_heads=2, key_dim=3)


def _param(id_, kwargs, name, received):
    return pytest.param(kwargs, name, received, id=id_)


CONSTRUCTOR_CASES = [
    _param("num_heads-zero", {"num_heads": 0}, "num_heads", "0"),
    _param("num_heads-negative", {"num_heads": -2}, "num_heads", "-2"),
    _param("num_heads-float", {"num_heads": 2.0}, "num_heads", "2.0"),
    _param("num_heads-str", {"num_heads": "2"}, "num_heads", "'2'"),
    _param("num_heads-bool", {"num_heads": True}, "num_heads", "True"),
    _param("num_heads-none", {"num_heads": None}, "num_heads", "None"),
    _param("key_dim-zero", {"key_dim": 0}, "key_dim", "0"),
    _param("key_dim-none", {"key_dim": None}, "key_dim", "None"),
    _param("key_dim-list", {"key_dim": [3]}, "key_dim", "[3]"),
    _param("value_dim-zero", {"value_dim": 0}, "value_dim", "0"),
    _param("value_dim-str", {"value_dim": "4"}, "value_dim", "'4'"),
    _param("dropout-negative", {"dropout": -0.1}, "dropout", "-0.1"),
    _param("dropout-one", {"dropout": 1.0}, "dropout", "1.0"),
    _param("dropout-large", {"dropout": 2}, "dropout", "2"),
    _param("dropout-str", {"dropout": "0.1"}, "dropout", "'0.1'"),
    _param("dropout-nan", {"dropout": float("nan")}, "dropout", "nan"),
    _param("use_bias-str", {"use_bias": "yes"}, "use_bias", "'yes'"),
    _param("use_bias-float", {"use_bias": 1.0}, "use_bias", "1.0"),
    _param("output_shape-zero", {"output_shape": 0}, "output_shape", "0"),
    _param("output_shape-empty", {"output_shape": ()}, "output_shape", "()"),
    _param("output_shape-negative-dim", {"output_shape": (2, -1)}, "output_shape", "(2, -1)"),
    _param("output_shape-float-dim", {"output_shape": (2.5,)}, "output_shape", "(2.5,)"),
    _param("output_shape-str", {"output_shape": "8"}, "output_shape", "'8'"),
    _param("attention_axes-batch", {"attention_axes": 0}, "attention_axes", "0"),
    _param("attention_axes-with-batch", {"attention_axes": (0, 1)}, "attention_axes", "(0, 1)"),
    _param("attention_axes-repeated", {"attention_axes": (1, 1)}, "attention_axes", "(1, 1)"),
    _param("attention_axes-empty", {"attention_axes": ()}, "attention_axes", "()"),
    _param("attention_axes-float", {"attention_axes": (1.5,)}, "attention_axes", "(1.5,)"),
    _param("attention_axes-str", {"attention_axes": "1"}, "attention_axes", "'1'"),
    _param("sliding_window-zero", {"sliding_window": 0}, "sliding_window", "0"),
    _param("sliding_window-float", {"sliding_window": 2.5}, "sliding_window", "2.5"),
    _param("flash_attention-str", {"flash_attention": "yes"}, "flash_attention", "'yes'"),
    _param("use_gate-str", {"use_gate": "False"}, "use_gate", "'False'"),
    _param("seed-str", {"seed": "7"}, "seed", "'7'"),
    _param("seed-float", {"seed": 1.5}, "seed", "1.5"),
    _param(
        "return_attention_scores-str",
        {"return_attention_scores": "yes"},
        "return_attention_scores",
        "'yes'",
    ),
    _param("implementation-unknown", {"implementation": "flash"}, "implementation", "'flash'"),
    _param("implementation-int", {"implementation": 1}, "implementation", "1"),
    _param("chunk_size-zero", {"chunk_size": 0}, "chunk_size", "0"),
    _param("chunk_size-negative", {"chunk_size": -512}, "chunk_size", "-512"),
    _param("chunk_size-float", {"chunk_size": 128.0}, "chunk_size", "128.0"),
    _param("num_key_value_heads-zero", {"num_key_value_heads": 0}, "num_key_value_heads", "0"),
    _param(
        "num_key_value_heads-not-divisor",
        {"num_heads": 4, "num_key_value_heads": 3},
        "num_key_value_heads",
        "3",
    ),
    _param("normalize_qk-str", {"normalize_qk": "yes"}, "normalize_qk", "'yes'"),
    _param(
        "sliding_window-pair-negative", {"sliding_window": (2, -1)}, "sliding_window", "(2, -1)"
    ),
    _param("sliding_window-triple", {"sliding_window": (1, 2, 3)}, "sliding_window", "(1, 2, 3)"),
    _param("sliding_window-pair-float", {"sliding_window": [1.5, 2]}, "sliding_window", "[1.5, 2]"),
    _param(
        "sliding_window-pair-bool", {"sliding_window": (True, 2)}, "sliding_window", "(True, 2)"
    ),
    _param("scale-zero", {"scale": 0.0}, "scale", "0.0"),
    _param("scale-negative", {"scale": -0.5}, "scale", "-0.5"),
    _param("scale-inf", {"scale": float("inf")}, "scale", "inf"),
    _param("scale-str", {"scale": "0.1"}, "scale", "'0.1'"),
    _param("use_output_bias-str", {"use_output_bias": "no"}, "use_output_bias", "'no'"),
    _param("norm_epsilon-zero", {"norm_epsilon": 0}, "norm_epsilon", "0"),
    _param("norm_epsilon-none", {"norm_epsilon": None}, "norm_epsilon", "None"),
    _param("norm_unit_offset-str", {"norm_unit_offset": "yes"}, "norm_unit_offset", "'yes'"),
    _param("normalize_value-float", {"normalize_value": 1.0}, "normalize_value", "1.0"),
    _param("dropout_on-unknown", {"dropout_on": "logits"}, "dropout_on", "'logits'"),
    _param("dropout_on-none", {"dropout_on": None}, "dropout_on", "None"),
]


def _assert_names(error, name, received):
    # Keras appends the call's arguments to errors raised in `call`; only ours counts.
    message = str(error.value).split("Arguments received by")[0]
    assert f"`{name}`" in message, message
    assert re.search(rf"{re.escape(name)}\W*=?.*{re.escape(received)}", message), message


@pytest.mark.parametrize("kwargs, name, received", CONSTRUCTOR_CASES)
def test_invalid_constructor_argument_is_rejected(kwargs, name, received):
    with pytest.raises((ValueError, TypeError)) as error:
        MultiHeadAttention(**{**VALID, **kwargs})
    _assert_names(error, name, received)


# ---------------------------------------------------------------------- call inputs
B, T, S, DIM = 2, 5, 7, 6


def _x(*shape, dtype="float32"):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(dtype)


QUERY, VALUE = _x(B, T, DIM), _x(B, S, DIM)


def _call(query=QUERY, value=VALUE, **kwargs):
    return dict(query=query, value=value, **kwargs)


CALL_CASES = [
    _param("query-rank-2", _call(query=_x(T, DIM), value=_x(S, DIM)), "query", "(5, 6)"),
    _param("query-rank-4", _call(query=_x(B, T, 1, DIM)), "value", "(2, 7, 6)"),
    _param("value-rank-2", _call(value=_x(S, DIM)), "value", "(7, 6)"),
    _param("key-rank-4", _call(key=_x(B, S, 1, DIM)), "key", "(2, 7, 1, 6)"),
    _param("key-length-differs", _call(key=_x(B, S + 1, DIM)), "key", "(2, 8, 6)"),
    _param("value-batch-differs", _call(value=_x(B + 1, S, DIM)), "value", "(3, 7, 6)"),
    _param(
        "attention_mask-wrong-shape",
        _call(attention_mask=np.ones((B, T, S - 1), bool)),
        "attention_mask",
        "(2, 5, 6)",
    ),
    _param(
        "attention_mask-wrong-batch",
        _call(attention_mask=np.ones((B + 1, T, S), bool)),
        "attention_mask",
        "(3, 5, 7)",
    ),
    _param(
        "attention_mask-rank-4-wrong-heads",
        _call(attention_mask=np.ones((B, 3, T, S), bool)),
        "attention_mask",
        "(2, 3, 5, 7)",
    ),
    _param(
        "attention_mask-rank-5",
        _call(attention_mask=np.ones((B, 1, 2, T, S), bool)),
        "attention_mask",
        "(2, 1, 2, 5, 7)",
    ),
    _param(
        "attention_mask-complex",
        _call(attention_mask=np.ones((B, T, S), np.complex64)),
        "attention_mask",
        "complex64",
    ),
    _param(
        "attention_mask-str",
        _call(attention_mask=np.full((B, T, S), "a")),
        "attention_mask",
        "dtype",
    ),
    _param(
        "query_mask-wrong-length",
        _call(query_mask=np.ones((B, T + 1), bool)),
        "query_mask",
        "(2, 6)",
    ),
    _param(
        "value_mask-wrong-length",
        _call(value_mask=np.ones((B, S - 1), bool)),
        "value_mask",
        "(2, 6)",
    ),
    _param(
        "key_mask-wrong-batch",
        _call(key_mask=np.ones((B + 1, S), bool)),
        "key_mask",
        "(3, 7)",
    ),
    _param(
        "value_mask-str",
        _call(value_mask=np.full((B, S), "x")),
        "value_mask",
        "dtype",
    ),
    _param(
        "return_attention_scores-str",
        _call(return_attention_scores="yes"),
        "return_attention_scores",
        "'yes'",
    ),
    _param("use_causal_mask-str", _call(use_causal_mask="no"), "use_causal_mask", "'no'"),
]

# Only meaningful once the layer is built with other dims.
BUILT_ONLY_CASES = [
    _param("query-last-dim-differs", _call(query=_x(B, T, DIM + 2)), "query", "(2, 5, 8)"),
    _param("value-last-dim-differs", _call(value=_x(B, S, DIM - 2)), "value", "(2, 7, 4)"),
    _param(
        "key-last-dim-differs",
        _call(key=_x(B, S, DIM + 1)),
        "key",
        "(2, 7, 7)",
    ),
]


def _snapshot(layer):
    return layer.built, [ops.convert_to_numpy(w).copy() for w in layer.weights]


def _assert_unchanged(layer, snapshot):
    built, weights = snapshot
    assert layer.built == built
    assert len(layer.weights) == len(weights)
    for before, after in zip(weights, layer.weights):
        np.testing.assert_array_equal(ops.convert_to_numpy(after), before)


@pytest.mark.parametrize("kwargs, name, received", CALL_CASES + BUILT_ONLY_CASES)
def test_rejected_call_on_a_built_layer_changes_nothing(kwargs, name, received):
    layer = MultiHeadAttention(**VALID)
    before = ops.convert_to_numpy(layer(QUERY, VALUE))
    snapshot = _snapshot(layer)
    with pytest.raises((ValueError, TypeError)) as error:
        layer(**kwargs)
    _assert_names(error, name, received)
    _assert_unchanged(layer, snapshot)
    np.testing.assert_array_equal(ops.convert_to_numpy(layer(QUERY, VALUE)), before)


@pytest.mark.parametrize("kwargs, name, received", CALL_CASES)
def test_rejected_first_call_leaves_the_layer_unbuilt(kwargs, name, received):
    layer = MultiHeadAttention(**VALID)
    with pytest.raises((ValueError, TypeError)) as error:
        layer(**kwargs)
    _assert_names(error, name, received)
    assert not layer.built
    assert layer.weights == []
    assert ops.convert_to_numpy(layer(QUERY, VALUE)).shape == (B, T, DIM)


@pytest.mark.parametrize(
    "attention_axes, query_shape",
    [
        pytest.param((2,), (B, T, DIM), id="feature-axis-rank-3"),
        pytest.param((-1,), (B, T, DIM), id="negative-feature-axis-rank-3"),
        pytest.param((3,), (B, 3, 4, DIM), id="feature-axis-rank-4"),
        pytest.param((-4,), (B, 3, 4, DIM), id="batch-axis-negative-rank-4"),
        pytest.param((1, -3), (B, 3, 4, DIM), id="same-axis-twice-rank-4"),
        pytest.param((4,), (B, 3, 4, DIM), id="beyond-rank-4"),
    ],
)
def test_attention_axes_out_of_range_for_the_input_rank(attention_axes, query_shape):
    layer = MultiHeadAttention(**VALID, attention_axes=attention_axes)
    query = _x(*query_shape)
    with pytest.raises(ValueError) as error:
        layer(query, query)
    _assert_names(error, "attention_axes", repr(tuple(attention_axes)))
    assert not layer.built and layer.weights == []
