"""Keras's inference-only backends: the layer under `KERAS_BACKEND=numpy` and
`KERAS_BACKEND=openvino`, outputs and scores against the float64 NumPy reference.

`tests/run_backends.py` runs this file once per inference backend; conftest.py keeps
these tests (marked `inference_backend`) out of the training backends' runs, and
every other test out of these.
"""

import keras
import numpy as np
import pytest
from helpers import BACKEND, random_inputs, to_numpy
from reference import reference_mha

import keras_mha

pytestmark = pytest.mark.inference_backend

INFERENCE_BACKENDS = ("numpy", "openvino")
ATOL = 1e-5
B, T, S, DIM = 2, 5, 6, 8


def test_runs_under_an_inference_backend():
    assert BACKEND in INFERENCE_BACKENDS, (
        f"this suite is for {INFERENCE_BACKENDS}; the {BACKEND!r} backend has its own "
        "(run it through tests/run_backends.py)"
    )


def _mask(rng, shape):
    mask = rng.random(shape) > 0.3
    mask[..., 0] = True
    return mask


CASES = {
    "self": (dict(num_heads=2, key_dim=4), (B, T, DIM), (B, T, DIM), {}),
    "cross": (dict(num_heads=2, key_dim=4), (B, T, DIM), (B, S, 6), {}),
    "value_dim_gate": (
        dict(num_heads=2, key_dim=4, value_dim=3, use_gate=True),
        (B, T, DIM),
        (B, S, DIM),
        {},
    ),
    "causal": (dict(num_heads=2, key_dim=4), (B, T, DIM), (B, T, DIM), {"causal": True}),
    "attention_mask": (dict(num_heads=3, key_dim=2), (B, T, DIM), (B, S, DIM), {"mask": True}),
    "sliding_window": (
        dict(num_heads=2, key_dim=4, sliding_window=2),
        (B, T, DIM),
        (B, T, DIM),
        {"causal": True},
    ),
    "rank4_axis2": (dict(num_heads=2, key_dim=3, attention_axes=2), (B, 3, 4, DIM), None, {}),
}


@pytest.mark.parametrize("implementation", [None, "explicit", "fused", "chunked"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_and_scores_match_the_float64_reference(case, implementation, rng):
    config, query_shape, value_shape, options = CASES[case]
    value_shape = value_shape or query_shape
    q, v = random_inputs(rng, query_shape, value_shape)
    keras.utils.set_random_seed(1)
    layer = keras_mha.MultiHeadAttention(
        **config, implementation=implementation, chunk_size=2, bias_initializer="random_normal"
    )
    mask = _mask(rng, (B, T, value_shape[1])) if options.get("mask") else None
    causal = options.get("causal", False)
    output, scores = to_numpy(
        layer(q, v, attention_mask=mask, use_causal_mask=causal, return_attention_scores=True)
    )
    expected, expected_scores = reference_mha(
        layer,
        q,
        v,
        mask=mask,
        use_causal_mask=causal,
        sliding_window=config.get("sliding_window"),
    )
    np.testing.assert_allclose(output, expected, atol=ATOL)
    np.testing.assert_allclose(scores, expected_scores, atol=ATOL)
    # Without scores the chosen kernel runs (not necessarily the explicit one).
    plain = to_numpy(layer(q, v, attention_mask=mask, use_causal_mask=causal))
    np.testing.assert_allclose(plain, expected, atol=ATOL)


def test_grouped_query_attention_matches_its_expanded_heads(rng):
    q, v = random_inputs(rng, (B, T, DIM), (B, S, DIM))
    layer = keras_mha.MultiHeadAttention(num_heads=4, key_dim=2, num_key_value_heads=2)
    output = to_numpy(layer(q, v, use_causal_mask=True))
    full = keras_mha.MultiHeadAttention(num_heads=4, key_dim=2)
    full.build(q.shape, v.shape)
    weights = []
    for w, sub in zip(layer.get_weights(), full.get_weights()):
        weights.append(np.repeat(w, 2, axis=-2) if w.shape != sub.shape else w)
    full.set_weights(weights)
    expected, _ = reference_mha(full, q, v, use_causal_mask=True)
    np.testing.assert_allclose(output, expected, atol=ATOL)


def test_implicit_masks_and_a_saved_model(rng, tmp_path):
    """An Embedding's padding mask flows in; a `.keras` file loads and agrees."""
    tokens = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]])
    inputs = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(6, DIM, mask_zero=True)(inputs)
    model = keras.Model(inputs, keras_mha.MultiHeadAttention(num_heads=2, key_dim=4)(x, x))
    output = to_numpy(model(tokens))
    embedded = to_numpy(model.layers[1](tokens))
    valid = tokens != 0
    expected, _ = reference_mha(
        model.layers[2], embedded, embedded, mask=valid[:, :, None] & valid[:, None, :]
    )
    np.testing.assert_allclose(output[valid], expected[valid], atol=ATOL)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(to_numpy(loaded(tokens)), output, atol=ATOL)
