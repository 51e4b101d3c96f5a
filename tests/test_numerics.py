"""Numerics at the edges: float16 logits that overflow, fully masked rows (values and
gradients), very long and length-1 sequences, batch sizes 1 and 0, on every kernel."""

import numpy as np
import pytest
from helpers import call, gradients, to_numpy
from reference import reference_mha

from keras_mha import MultiHeadAttention

IMPLEMENTATIONS = ["explicit", "fused", "chunked"]
FLOAT16_MAX = 65504.0


def _layer(dim, value_dim=None, seed=0, std=0.5, **config):
    """A built rank-3 layer with normal weights (biases included) drawn from `seed`."""
    config = {"num_heads": 2, "key_dim": 4, **config}
    layer = MultiHeadAttention(**config)
    layer.build((None, None, dim), (None, None, value_dim or dim))
    rng = np.random.default_rng(seed)
    layer.set_weights([rng.normal(0.0, std, w.shape).astype("float32") for w in layer.weights])
    return layer


def _copy(layer, dim, **config):
    twin = MultiHeadAttention(**{**layer.get_config(), **config})
    twin.build((None, None, dim), (None, None, dim))
    twin.set_weights(layer.get_weights())
    return twin


# ----------------------------------------------------------------------- float16
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_mixed_float16_with_overflowing_logits_is_finite_and_close_to_float32(implementation):
    dim = 8
    layer32 = _layer(dim, std=1.0, key_dim=8, implementation=implementation, chunk_size=3)
    layer16 = _copy(layer32, dim, dtype="mixed_float16")
    assert layer16.compute_dtype == "float16"
    rng = np.random.default_rng(1)
    query = (100.0 * rng.standard_normal((2, 5, dim))).astype("float32")
    value = (100.0 * rng.standard_normal((2, 7, dim))).astype("float32")

    # The logits really overflow float16: a float16 softmax would see inf.
    _, logits = _float64_logits(layer32, query, value)
    assert np.abs(logits).max() > FLOAT16_MAX

    expected = call(layer32, query, value)
    output = call(layer16, query, value)
    assert output.dtype == np.float16
    assert np.all(np.isfinite(output))
    scale = np.abs(expected).max()
    np.testing.assert_allclose(output.astype("float32"), expected, rtol=0, atol=2e-2 * scale)

    output, scores = call(layer16, query, value, return_attention_scores=True)
    assert np.all(np.isfinite(output)) and np.all(np.isfinite(scores))
    np.testing.assert_allclose(scores.astype("float32").sum(-1), 1.0, atol=5e-3)
    _, expected_scores = call(layer32, query, value, return_attention_scores=True)
    np.testing.assert_allclose(scores.astype("float32"), expected_scores, rtol=0, atol=2e-2)


def _float64_logits(layer, query, value):
    """`(B, N, T, S)` float64 logits `q k^T / sqrt(H)` from the layer's weights."""
    weights = [np.asarray(w, np.float64) for w in layer.get_weights()]
    q_kernel, q_bias, k_kernel, k_bias = weights[:4]
    q = np.einsum("btd,dnh->btnh", query, q_kernel) + q_bias
    k = np.einsum("bsd,dnh->bsnh", value, k_kernel) + k_bias
    return q, np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])


# ----------------------------------------------------------------- masked rows
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fully_masked_rows_give_finite_outputs_and_gradients(implementation):
    dim = 6
    layer = _layer(dim, implementation=implementation, chunk_size=2)
    rng = np.random.default_rng(2)
    query = rng.standard_normal((3, 4, dim)).astype("float32")
    value = rng.standard_normal((3, 5, dim)).astype("float32")
    mask = rng.random((3, 4, 5)) < 0.6
    mask[0, 1] = False  # one fully masked row
    mask[1] = False  # a whole batch fully masked
    mask[2, :, 0] = True  # every other row has a key

    output = call(layer, query, value, attention_mask=mask)
    expected, _ = reference_mha(layer, query, value, mask=mask)
    np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)
    # A row with no key gets a zero context: its output is the output bias.
    bias = to_numpy(layer.output_dense.bias)
    np.testing.assert_allclose(output[0, 1], bias, atol=1e-6)
    np.testing.assert_allclose(output[1], np.broadcast_to(bias, output[1].shape), atol=1e-6)

    loss, input_grads, weight_grads = gradients(
        layer, {"query": query, "value": value}, attention_mask=mask
    )
    assert np.isfinite(loss)
    for name, grad in input_grads.items():
        assert grad is not None and np.all(np.isfinite(grad)), name
    assert all(g is not None and np.all(np.isfinite(g)) for g in weight_grads)
    # Masked rows contribute nothing through attention, so their query gets no gradient.
    np.testing.assert_allclose(input_grads["query"][1], 0.0, atol=1e-6)
    np.testing.assert_allclose(input_grads["query"][0, 1], 0.0, atol=1e-6)
    # Nothing attends to batch 1's values: no gradient flows into them either.
    np.testing.assert_allclose(input_grads["value"][1], 0.0, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_query_mask_and_causal_mask_rows_are_finite(implementation):
    dim = 4
    layer = _layer(dim, implementation=implementation, chunk_size=2)
    rng = np.random.default_rng(3)
    query = rng.standard_normal((2, 6, dim)).astype("float32")
    value = rng.standard_normal((2, 3, dim)).astype("float32")
    query_mask = np.array([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    value_mask = np.array([[0, 1, 1], [1, 1, 1]], bool)
    kwargs = dict(query_mask=query_mask, value_mask=value_mask, use_causal_mask=True)
    output = call(layer, query, value, **kwargs)
    mask = query_mask[:, :, None] & value_mask[:, None, :]
    expected, _ = reference_mha(layer, query, value, mask=mask, use_causal_mask=True)
    np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)
    _, input_grads, weight_grads = gradients(layer, {"query": query, "value": value}, **kwargs)
    assert all(np.all(np.isfinite(g)) for g in [*input_grads.values(), *weight_grads])


# ---------------------------------------------------------------- sequence lengths
@pytest.mark.parametrize("implementation", ["chunked", None])
def test_very_long_sequences(implementation):
    length, dim = 4096, 4
    layer = _layer(dim, num_heads=1, key_dim=2, implementation=implementation)
    rng = np.random.default_rng(4)
    query = rng.standard_normal((1, length, dim)).astype("float32")
    value = rng.standard_normal((1, length, dim)).astype("float32")
    output = call(layer, query, value, use_causal_mask=True)
    assert output.shape == (1, length, dim)
    assert np.all(np.isfinite(output))
    rows = np.r_[0:3, 511:514, 2048, length - 2, length - 1]
    causal = rows[:, None] >= np.arange(length)[None, :]
    expected, _ = reference_mha(layer, query[:, rows], value, mask=causal[None])
    np.testing.assert_allclose(output[:, rows], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "query_length, key_length, causal",
    [(1, 1, False), (1, 1, True), (1, 5, False), (1, 5, True), (5, 1, True)],
    ids=["1x1", "1x1-causal", "1x5", "1x5-causal", "5x1-causal"],
)
def test_length_one_sequences(query_length, key_length, causal):
    dim = 3
    rng = np.random.default_rng(5)
    query = rng.standard_normal((2, query_length, dim)).astype("float32")
    value = rng.standard_normal((2, key_length, dim)).astype("float32")
    base = _layer(dim, seed=5)
    expected, expected_scores = reference_mha(base, query, value, use_causal_mask=causal)
    for implementation in IMPLEMENTATIONS:
        layer = _copy(base, dim, implementation=implementation, chunk_size=2)
        output = call(layer, query, value, use_causal_mask=causal)
        np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5, err_msg=implementation)
    _, scores = call(base, query, value, use_causal_mask=causal, return_attention_scores=True)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- batch size
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_batch_size_one(implementation):
    dim = 5
    layer = _layer(dim, implementation=implementation, chunk_size=2)
    rng = np.random.default_rng(6)
    query = rng.standard_normal((1, 3, dim)).astype("float32")
    value = rng.standard_normal((1, 4, dim)).astype("float32")
    mask = rng.random((1, 3, 4)) < 0.5
    output = call(layer, query, value, attention_mask=mask, use_causal_mask=True)
    expected, _ = reference_mha(layer, query, value, mask=mask, use_causal_mask=True)
    np.testing.assert_allclose(output, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_batch_size_zero_gives_empty_results(implementation):
    dim = 5
    layer = _layer(dim, implementation=implementation, chunk_size=2, output_shape=(2, 3))
    query = np.zeros((0, 3, dim), "float32")
    value = np.zeros((0, 4, dim), "float32")
    for kwargs in (
        {},
        {"use_causal_mask": True},
        {"attention_mask": np.ones((0, 3, 4), bool)},
        {"query_mask": np.ones((0, 3), bool), "value_mask": np.ones((0, 4), bool)},
    ):
        output = call(layer, query, value, **kwargs)
        assert output.shape == (0, 3, 2, 3), kwargs
        output, scores = call(layer, query, value, return_attention_scores=True, **kwargs)
        assert output.shape == (0, 3, 2, 3) and scores.shape == (0, 2, 3, 4), kwargs
    _, input_grads, _ = gradients(layer, {"query": query, "value": value})
    assert input_grads["query"].shape == query.shape


def test_batch_size_zero_with_nd_attention():
    layer = MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=(1, 2))
    layer.build((None, 2, 3, 4), (None, 2, 3, 4))
    query = np.zeros((0, 2, 3, 4), "float32")
    output, scores = call(layer, query, query, return_attention_scores=True)
    assert output.shape == (0, 2, 3, 4)
    assert scores.shape == (0, 2, 2, 3, 2, 3)
