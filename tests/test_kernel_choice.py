"""Every attention implementation against the float64 NumPy reference.

The layer is run with `implementation="explicit"`, `"fused"`, `"chunked"` (with a
small `chunk_size`, so several chunks run) and the automatic choice; each agrees with
the explicit one and with `reference.reference_mha`, in which a query row without keys
gets zero weights. A spy on the kernels checks that the requested kernel really ran.
"""

import keras
import numpy as np
import pytest
from helpers import (
    BACKEND,
    gradients,
    random_inputs,
    to_numpy,
)
from reference import reference_attention, reference_mha

import keras_mha
from keras_mha import kernels, masks

ATOL = 1e-5
B, T, S, DIM = 2, 5, 7, 8  # the shapes of the other test files: JAX compiles once
IMPLEMENTATIONS = ["explicit", "fused", "chunked", None]

# name -> (config, value shape, call options)
CASES = {
    "self": (dict(num_heads=2, key_dim=4), (B, T, DIM), {}),
    "cross": (dict(num_heads=2, key_dim=4), (B, S, 6), {}),
    "value_dim": (dict(num_heads=3, key_dim=4, value_dim=2), (B, S, 6), {}),
    "mask_with_empty_rows": (dict(num_heads=2, key_dim=4), (B, S, 6), {"mask": True}),
    "causal_cross": (dict(num_heads=2, key_dim=4), (B, S, 6), {"causal": True}),
    "causal_and_mask": (dict(num_heads=2, key_dim=4), (B, T, DIM), {"causal": True, "mask": True}),
    "sliding_window": (dict(num_heads=2, key_dim=4, sliding_window=2), (B, T, DIM), {}),
    "no_bias_gate": (dict(num_heads=2, key_dim=4, use_bias=False, use_gate=True), (B, S, 6), {}),
}


def _inputs(name, rng):
    _, v_shape, opts = CASES[name]
    q, v = random_inputs(rng, (B, T, DIM), v_shape)
    mask = None
    if opts.get("mask"):
        mask = rng.random((B, T, v_shape[1])) > 0.4
        mask[0, 1] = False  # a query row with no key at all
        mask[1, :, 2:5] = False  # keys masked across a chunk boundary
    return q, v, mask


def _layer(name, implementation, q, v):
    config, _, _ = CASES[name]
    keras.utils.set_random_seed(0)
    layer = keras_mha.MultiHeadAttention(**config, implementation=implementation, chunk_size=4)
    layer.build(q.shape, v.shape)
    return layer


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of each kernel function."""
    calls = {"explicit": 0, "fused": 0, "chunked": 0}
    for name in list(calls):
        module = getattr(kernels, name)
        original = module.attention

        def wrapper(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "attention", wrapper)
    return calls


MATRIX = [(name, impl) for name in CASES for impl in IMPLEMENTATIONS[:3]] + [
    (name, None) for name in ("causal_and_mask", "value_dim")
]


@pytest.mark.parametrize("name, implementation", MATRIX, ids=str)
def test_implementation_matches_reference(name, implementation, rng, spy):
    config, _, opts = CASES[name]
    q, v, mask = _inputs(name, rng)
    layer = _layer(name, implementation, q, v)
    causal = opts.get("causal", False)
    mask_tensor = None if mask is None else keras.ops.convert_to_tensor(mask)
    out = to_numpy(layer(q, v, attention_mask=mask_tensor, use_causal_mask=causal))

    expected_kernel = implementation
    # JAX's fused kernel needs key_dim == value_dim: the lean chunked kernel runs.
    if implementation == "fused" and BACKEND == "jax" and "value_dim" in config:
        expected_kernel = "chunked"
    if expected_kernel is not None:
        assert spy[expected_kernel] == 1, spy

    ref_out, _ = reference_mha(
        layer, q, v, mask=mask, use_causal_mask=causal, sliding_window=config.get("sliding_window")
    )
    np.testing.assert_allclose(out, ref_out, atol=ATOL)
    explicit = _layer(name, "explicit", q, v)
    explicit.set_weights(layer.get_weights())
    expected = to_numpy(explicit(q, v, attention_mask=mask_tensor, use_causal_mask=causal))
    np.testing.assert_allclose(out, expected, atol=ATOL)


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_scores_request_uses_explicit_and_same_output(implementation, rng, spy):
    q, v, mask = _inputs("mask_with_empty_rows", rng)
    layer = _layer("mask_with_empty_rows", implementation, q, v)
    mask_tensor = keras.ops.convert_to_tensor(mask)
    out = to_numpy(layer(q, v, attention_mask=mask_tensor))
    with_scores, scores = to_numpy(
        layer(q, v, attention_mask=mask_tensor, return_attention_scores=True)
    )
    assert spy["explicit"] >= 1
    np.testing.assert_allclose(out, with_scores, atol=ATOL)
    _, ref_scores = reference_mha(layer, q, v, mask=mask)
    np.testing.assert_allclose(scores, ref_scores, atol=ATOL)
    np.testing.assert_array_equal(scores[0, :, 1], 0.0)


def test_chunked_gradients_match_explicit(rng):
    q, v, mask = _inputs("causal_and_mask", rng)
    mask_tensor = keras.ops.convert_to_tensor(mask)
    results = []
    for implementation in ("explicit", "chunked"):
        layer = _layer("causal_and_mask", implementation, q, v)
        results.append(
            gradients(
                layer,
                {"query": q, "value": v},
                attention_mask=mask_tensor,
                use_causal_mask=True,
            )
        )
    (loss_a, in_a, w_a), (loss_b, in_b, w_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for key in in_a:
        np.testing.assert_allclose(in_a[key], in_b[key], atol=1e-4)
    for a, b in zip(w_a, w_b):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("chunk_size", [1, 3, 9, 64])
def test_chunked_kernel_alone_matches_reference(chunk_size, rng):
    q, k = random_inputs(rng, (B, T, 2, 4), (B, S, 2, 4))
    (v,) = random_inputs(rng, (B, S, 2, 3))
    mask = rng.random((B, 1, T, S)) > 0.5
    mask[1, 0, 3] = False
    out = kernels.chunked.attention(
        q,
        k,
        v,
        scale=0.5,
        mask=masks.AttentionMask(dense=keras.ops.convert_to_tensor(mask), causal=True),
        chunk_size=chunk_size,
    )
    causal = np.tril(np.ones((T, S), bool))
    ref, _ = reference_attention(q, k, v, (mask[:, 0] & causal))
    np.testing.assert_allclose(to_numpy(out), ref, atol=ATOL)


def test_reference_itself_on_a_tiny_case():
    """The NumPy reference against a hand computation (so the oracle can fail too)."""
    q = np.array([[[[1.0, 0.0]]]])  # (B=1, T=1, N=1, H=2)
    k = np.array([[[[1.0, 0.0]], [[0.0, 0.0]]]])  # S=2
    v = np.array([[[[2.0]], [[4.0]]]])
    out, weights = reference_attention(q, k, v)
    a = np.exp(1 / np.sqrt(2))
    expected = np.array([a, 1.0]) / (a + 1.0)
    np.testing.assert_allclose(weights[0, 0, 0], expected)
    np.testing.assert_allclose(out[0, 0, 0, 0], expected @ np.array([2.0, 4.0]))
    _, masked = reference_attention(q, k, v, mask=np.zeros((1, 1, 2), bool))
    np.testing.assert_array_equal(masked, 0.0)


def test_single_attention_axis_on_a_rank5_input(rng):
    """Frames attending over frames of a video `(B, F, H, W, C)`: rank-6 scores,
    beyond TensorFlow's rank-5 softmax kernel (the built-in fails there)."""
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=3, attention_axes=1)
    video = rng.standard_normal((2, 4, 2, 3, 5)).astype("float32")
    output, scores = layer(video, video, return_attention_scores=True)
    expected_output, expected_scores = reference_mha(layer, video, video)
    assert tuple(scores.shape) == (2, 2, 3, 2, 4, 4)
    np.testing.assert_allclose(to_numpy(output), expected_output, atol=1e-5)
    np.testing.assert_allclose(to_numpy(scores), expected_scores, atol=1e-5)
