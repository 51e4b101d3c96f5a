"""Grouped-query / multi-query attention (`num_key_value_heads`)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_mha

B, T, S, D = 2, 5, 4, 6
HEADS, HEAD_DIM = 4, 3


def _gqa_pair(kv_heads, **kwargs):
    reference = keras.layers.GroupQueryAttention(
        head_dim=HEAD_DIM,
        num_query_heads=HEADS,
        num_key_value_heads=kv_heads,
        bias_initializer="random_normal",
        **kwargs,
    )
    ours = keras_mha.MultiHeadAttention(
        num_heads=HEADS, key_dim=HEAD_DIM, num_key_value_heads=kv_heads, **kwargs
    )
    return reference, ours


def _build_both(reference, ours, query_shape, value_shape, key_shape=None):
    reference.build(query_shape, value_shape, key_shape)
    ours.build(query_shape, value_shape, key_shape)
    ours.set_weights(reference.get_weights())


@pytest.mark.parametrize(
    "kv_heads,use_bias",
    [
        pytest.param(1, True, id="mqa"),
        pytest.param(2, False, id="gqa_no_bias"),
        pytest.param(4, True, id="mha"),
    ],
)
def test_weights_match_group_query_attention(kv_heads, use_bias):
    reference, ours = _gqa_pair(kv_heads, use_bias=use_bias)
    _build_both(reference, ours, (B, T, D), (B, S, D + 1), (B, S, D + 2))
    assert [w.shape for w in ours.weights] == [w.shape for w in reference.weights]
    names = [w.path.split("/", 1)[1] for w in ours.weights]
    assert names == [w.path.split("/", 1)[1] for w in reference.weights]
    assert ours.key_dense.kernel.shape == (D + 2, kv_heads, HEAD_DIM)
    assert ours.value_dense.kernel.shape == (D + 1, kv_heads, HEAD_DIM)


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize(
    "call_kwargs",
    [
        pytest.param({}, id="plain"),
        pytest.param({"use_causal_mask": True}, id="causal"),
        pytest.param({"masks": True}, id="masks"),
    ],
)
def test_outputs_match_group_query_attention(rng, kv_heads, call_kwargs):
    reference, ours = _gqa_pair(kv_heads)
    query = rng.normal(size=(B, T, D)).astype("float32")
    value = rng.normal(size=(B, T, D)).astype("float32")
    _build_both(reference, ours, query.shape, value.shape)
    kwargs = dict(call_kwargs)
    if kwargs.pop("masks", False):
        mask = rng.random((B, T, T)) > 0.4
        mask[..., 0] = True
        kwargs["attention_mask"] = mask
        kwargs["value_mask"] = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=bool)
    expected, expected_scores = reference(query, value, return_attention_scores=True, **kwargs)
    expected, expected_scores = (
        ops.convert_to_numpy(expected),
        ops.convert_to_numpy(expected_scores),
    )
    output, scores = ours(query, value, return_attention_scores=True, **kwargs)
    np.testing.assert_allclose(ops.convert_to_numpy(output), expected, atol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(scores), expected_scores, atol=1e-5)
    if not call_kwargs:
        return
    # Every kernel gives the same answer with causal or explicit masks.
    for implementation in ("explicit", "fused", "chunked"):
        ours._implementation = implementation
        output = ours(query, value, **kwargs)
        np.testing.assert_allclose(ops.convert_to_numpy(output), expected, atol=1e-5)


def test_gate_matches_group_query_attention(rng):
    reference, ours = _gqa_pair(2, use_gate=True)
    query = rng.normal(size=(B, T, D)).astype("float32")
    _build_both(reference, ours, query.shape, query.shape)
    expected = ops.convert_to_numpy(reference(query, query))
    np.testing.assert_allclose(ops.convert_to_numpy(ours(query, query)), expected, atol=1e-5)


def test_repeat_convention_is_adjacent_query_heads(rng):
    # Key/value head j serves query heads j * r ... j * r + r - 1: with the keys of
    # head 0 zeroed, query heads 0 and 1 (and only they) get uniform attention.
    layer = keras_mha.MultiHeadAttention(num_heads=4, key_dim=2, num_key_value_heads=2)
    x = rng.normal(size=(1, 3, 4)).astype("float32")
    layer(x, x)
    kernel = ops.convert_to_numpy(layer.key_dense.kernel).copy()
    kernel[:, 0] = 0.0
    layer.key_dense.kernel.assign(kernel)
    layer.key_dense.bias.assign(np.zeros((2, 2), "float32"))
    _, scores = layer(x, x, return_attention_scores=True)
    uniform = np.allclose(ops.convert_to_numpy(scores), 1.0 / 3.0, atol=1e-6, rtol=0)
    per_head = [np.allclose(ops.convert_to_numpy(scores)[0, h], 1.0 / 3.0) for h in range(4)]
    assert per_head == [True, True, False, False] and not uniform


def test_num_key_value_heads_equal_to_num_heads_is_plain_attention(rng):
    x = rng.normal(size=(B, T, D)).astype("float32")
    plain = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM)
    grouped = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, num_key_value_heads=HEADS)
    plain(x, x)
    grouped(x, x)
    grouped.set_weights(plain.get_weights())
    np.testing.assert_array_equal(
        ops.convert_to_numpy(grouped(x, x)), ops.convert_to_numpy(plain(x, x))
    )


def test_default_weights_match_builtin_layer():
    builtin = keras.layers.MultiHeadAttention(HEADS, HEAD_DIM)
    ours = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM)
    builtin.build((B, T, D), (B, S, D))
    ours.build((B, T, D), (B, S, D))
    assert ours.num_key_value_heads == HEADS
    assert [(w.path.split("/", 1)[1], w.shape) for w in ours.weights] == [
        (w.path.split("/", 1)[1], w.shape) for w in builtin.weights
    ]


@pytest.mark.parametrize(
    "value,expected",
    [
        pytest.param(3, "a divisor of num_heads=4", id="not_a_divisor"),
        pytest.param(0, "a positive integer", id="zero"),
        pytest.param(-2, "a positive integer", id="negative"),
        pytest.param(2.0, "a positive integer", id="float"),
        pytest.param(8, "a divisor of num_heads=4", id="more_than_heads"),
    ],
)
def test_invalid_num_key_value_heads(value, expected):
    with pytest.raises(ValueError, match="num_key_value_heads") as info:
        keras_mha.MultiHeadAttention(num_heads=4, key_dim=2, num_key_value_heads=value)
    assert expected in str(info.value) and f"num_key_value_heads={value!r}" in str(info.value)


def test_serialization_round_trip(rng, tmp_path):
    x = rng.normal(size=(B, T, D)).astype("float32")
    inputs = keras.Input((T, D))
    layer = keras_mha.MultiHeadAttention(HEADS, HEAD_DIM, num_key_value_heads=1)
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    assert layer.get_config()["num_key_value_heads"] == 1
    clone = keras_mha.MultiHeadAttention.from_config(layer.get_config())
    assert clone.num_key_value_heads == 1
    path = tmp_path / "gqa.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(
        ops.convert_to_numpy(loaded(x)), ops.convert_to_numpy(model(x)), atol=1e-6
    )
    assert loaded.layers[-1].key_dense.kernel.shape == (D, 1, HEAD_DIM)
