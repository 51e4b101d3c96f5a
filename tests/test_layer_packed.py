"""Packed rows through the layer (`segment_ids`, `key_segment_ids`, `positions`): each
document gets, outputs and gradients, what it gets alone in its own row, on every
kernel, with RoPE restarting per document, GQA, QK-norm, soft cap, sinks, causality
and windows; against the float64 reference with a dense block-diagonal mask; scores
zero across documents; cross-attention, a cache, an unknown `T`, saving."""

import keras
import numpy as np
import pytest
from helpers import compiled, output_and_gradients, to_numpy
from keras import ops
from reference import reference_mha

import keras_mha
from keras_mha import rope

DIM, HEADS, KEY_DIM = 8, 4, 4
ATOL = 3e-5
# Documents of 3, 5 and 4 tokens, then 2 of padding (id 0).
LENGTHS = (3, 5, 4)
T = sum(LENGTHS) + 2
FEATURES = {
    "plain": {},
    "rope+gqa+qk_norm": {
        "rope_max_wavelength": 50.0,
        "num_key_value_heads": 2,
        "normalize_qk": True,
    },
    "all": {
        "rope_max_wavelength": 50.0,
        "rope_scaling_factor": 2.0,
        "num_key_value_heads": 2,
        "normalize_qk": True,
        "logit_soft_cap": 1.5,
        "use_sinks": True,
        "sliding_window": 3,
    },
}


def _layer(features, implementation=None, seed=0):
    keras.utils.set_random_seed(seed)
    layer = keras_mha.MultiHeadAttention(
        HEADS, KEY_DIM, implementation=implementation, chunk_size=4, **FEATURES[features]
    )
    layer.build((1, T, DIM), (1, T, DIM))
    if layer._use_sinks:
        layer._sinks.sinks.assign(np.linspace(-1.0, 1.5, HEADS).astype("float32"))
    return layer


def segment_ids(lengths=LENGTHS, total=T, first_id=1):
    """`(1, total)` int32: document `i` gets id `first_id + i`, the rest 0 (padding)."""
    ids = np.zeros((1, total), "int32")
    start = 0
    for i, length in enumerate(lengths):
        ids[0, start : start + length] = first_id + i
        start += length
    return ids


def _spans(lengths=LENGTHS):
    starts = np.cumsum((0,) + tuple(lengths))
    return [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


@pytest.mark.parametrize(
    "features, implementation, causal",
    [
        ("plain", "explicit", False),
        ("all", "explicit", True),
        ("all", "chunked", True),
        ("rope+gqa+qk_norm", "fused", True),
    ],
)
def test_packed_row_equals_each_document_alone(rng, features, implementation, causal):
    """Outputs, input gradients and weight gradients (summed over the documents)."""
    layer = _layer(features, implementation)
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    w = rng.standard_normal((1, T, DIM)).astype("float32")
    w[:, sum(LENGTHS) :] = 0.0  # padding positions carry no loss

    def loss_of(weights):
        return lambda y: ops.sum(y * ops.convert_to_tensor(weights))

    ids = segment_ids()
    # Each output comes from the call that computes its gradients (one program on JAX).
    packed, _, packed_in, packed_w = output_and_gradients(
        layer, {"query": x, "value": x}, loss_of(w), segment_ids=ids, use_causal_mask=causal
    )
    summed = [np.zeros_like(g) for g in packed_w]
    for start, end in _spans():
        part = x[:, start:end]
        alone, _, alone_in, alone_w = output_and_gradients(
            layer, {"query": part, "value": part}, loss_of(w[:, start:end]), use_causal_mask=causal
        )
        np.testing.assert_allclose(packed[:, start:end], alone, atol=ATOL)
        for name in ("query", "value"):
            np.testing.assert_allclose(
                packed_in[name][:, start:end], alone_in[name], atol=ATOL, err_msg=name
            )
        summed = [a + b for a, b in zip(summed, alone_w)]
    for name in ("query", "value"):  # padding's inputs reach no loss
        np.testing.assert_allclose(packed_in[name][:, sum(LENGTHS) :], 0.0, atol=ATOL)
    for got, want in zip(packed_w, summed):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_padding_queries_attend_to_nothing(rng):
    """Id 0: the attention output there is zero (the layer's output is its bias)."""
    layer = _layer("plain", "chunked")
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    out = to_numpy(layer(x, x, segment_ids=segment_ids()))
    bias = to_numpy(layer.output_dense.bias)
    np.testing.assert_allclose(out[0, sum(LENGTHS) :], np.tile(bias, (2, 1)), atol=1e-6)


def _block_diagonal(query_ids, key_ids):
    rows, cols = query_ids[:, :, None], key_ids[:, None, :]
    return (rows == cols) & (rows != 0)


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_matches_float64_reference_with_a_dense_block_diagonal_mask(rng, implementation):
    """Two rows, key padding, causality, a window, soft cap, sinks and a bias."""
    keras.utils.set_random_seed(1)
    layer = keras_mha.MultiHeadAttention(
        HEADS, KEY_DIM, implementation=implementation, chunk_size=4, sliding_window=4
    )
    x = rng.standard_normal((2, T, DIM)).astype("float32")
    ids = np.concatenate([segment_ids(), segment_ids((6, 2, 4), first_id=5)])
    padding = np.ones((2, T), bool)
    padding[1, 3] = False
    bias = rng.standard_normal((1, HEADS, T, T)).astype("float32")
    out = layer(
        x, x, value_mask=padding, use_causal_mask=True, attention_bias=bias, segment_ids=ids
    )
    mask = _block_diagonal(ids, ids) & padding[:, None, :]
    expected, _ = reference_mha(
        layer, x, x, mask=mask, use_causal_mask=True, sliding_window=4, attention_bias=bias
    )
    np.testing.assert_allclose(to_numpy(out), expected, atol=ATOL)


def test_scores_are_zero_across_documents(rng):
    layer = _layer("all")
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    ids = segment_ids()
    _, scores = layer(x, x, segment_ids=ids, return_attention_scores=True)
    scores = to_numpy(scores)
    across = ~_block_diagonal(ids, ids)[:, None]
    assert np.abs(np.where(across, scores, 0.0)).max() == 0.0
    assert np.abs(np.where(~across, scores, 0.0)).min() >= 0.0
    assert scores[0, :, 0, :3].sum() > 0.1  # within a document the weights are there


def test_keras_masks_and_dropout_combine(rng):
    """A Keras mask (padding) on the inputs with the ids: the float64 reference with
    both masks; in training, dropout acts and padding rows stay empty."""
    keras.utils.set_random_seed(3)
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, dropout=0.3, implementation="chunked")
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    ids = segment_ids((3, 5, 4), T, first_id=2)
    padding = np.ones((1, T), bool)
    padding[0, 4] = False  # a padded token inside document 2
    x[~padding] = 0.0
    tokens = keras.layers.Masking()(x)
    inference = to_numpy(layer(tokens, tokens, segment_ids=ids))
    mask = _block_diagonal(ids, ids) & padding[:, None] & padding[:, :, None]
    reference, _ = reference_mha(layer, x, x, mask=mask)
    np.testing.assert_allclose(inference, reference, atol=ATOL)
    tokens = keras.layers.Masking()(x)  # the call took the masks off, as the built-in does
    training = to_numpy(layer(tokens, tokens, segment_ids=ids, training=True))
    assert np.abs(training - inference).max() > 1e-3
    bias = to_numpy(layer.output_dense.bias)
    empty = training[0, ~(padding[0] & (ids[0] != 0))]
    np.testing.assert_allclose(empty, np.broadcast_to(bias, empty.shape), atol=1e-6)


def test_explicit_positions_replace_the_derived_ones(rng):
    """`positions` given: the same as derived from the ids; shifted positions change
    nothing RoPE cannot see (relative), but other positions do."""
    layer = _layer("rope+gqa+qk_norm", "chunked")
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    ids = segment_ids()
    derived = to_numpy(layer(x, x, segment_ids=ids, use_causal_mask=True))
    positions = to_numpy(rope.segment_positions(ids))
    given = to_numpy(layer(x, x, segment_ids=ids, positions=positions, use_causal_mask=True))
    np.testing.assert_allclose(given, derived, atol=1e-6)
    shifted = to_numpy(layer(x, x, segment_ids=ids, positions=positions + 7, use_causal_mask=True))
    np.testing.assert_allclose(shifted, derived, atol=ATOL)  # RoPE is relative
    scrambled = to_numpy(
        layer(x, x, segment_ids=ids, positions=positions[:, ::-1].copy(), use_causal_mask=True)
    )
    assert np.abs(scrambled - derived).max() > 1e-3


def test_cross_attention_with_key_segment_ids(rng):
    """Queries of 2 documents over keys of the same 2 documents, other lengths."""
    keras.utils.set_random_seed(2)
    layer = keras_mha.MultiHeadAttention(HEADS, KEY_DIM, implementation="chunked", chunk_size=2)
    query = rng.standard_normal((1, 7, DIM)).astype("float32")
    value = rng.standard_normal((1, 10, DIM)).astype("float32")
    query_ids = segment_ids((3, 4), 7)
    key_ids = segment_ids((6, 3), 10)
    out = to_numpy(layer(query, value, segment_ids=query_ids, key_segment_ids=key_ids))
    first = to_numpy(layer(query[:, :3], value[:, :6]))
    second = to_numpy(layer(query[:, 3:], value[:, 6:9]))
    np.testing.assert_allclose(out, np.concatenate([first, second], axis=1), atol=ATOL)


def test_cached_decoding_of_a_packed_row(rng):
    """A few tokens at a time into a cache, with the keys' ids over the cache and
    explicit positions: the steps together equal the causal packed call."""
    layer = _layer("rope+gqa+qk_norm", "chunked")
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    ids = segment_ids()
    positions = to_numpy(rope.segment_positions(ids))
    full = to_numpy(layer(x, x, segment_ids=ids, use_causal_mask=True))
    cache = layer.init_cache(1, T)
    steps = []
    for start, end in ((0, 5), (5, 6), (6, T)):
        out, cache = layer(
            x[:, start:end],
            x[:, start:end],
            cache=cache,
            cache_update_index=start,
            use_causal_mask=True,
            segment_ids=ids[:, start:end],
            key_segment_ids=ids,
            positions=positions[:, start:end],
        )
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)


def test_compiled_step_and_a_model_of_unknown_length(rng):
    """Ids as data of a compiled step, and a functional model built with `T` unknown."""
    layer = _layer("all", "chunked")
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    ids = segment_ids()
    eager = to_numpy(layer(x, x, segment_ids=ids, use_causal_mask=True))
    step = compiled(lambda x, ids: layer(x, x, segment_ids=ids, use_causal_mask=True))
    got = to_numpy(step(ops.convert_to_tensor(x), ops.convert_to_tensor(ids)))
    np.testing.assert_allclose(got, eager, atol=ATOL)

    tokens = keras.Input((None, DIM))
    document_ids = keras.Input((None,), dtype="int32")
    outputs = layer(tokens, tokens, segment_ids=document_ids, use_causal_mask=True)
    model = keras.Model([tokens, document_ids], outputs)
    np.testing.assert_allclose(to_numpy(model([x, ids])), eager, atol=ATOL)


def test_saved_model_keeps_packed_calls(rng, tmp_path):
    layer = _layer("rope+gqa+qk_norm")
    tokens = keras.Input((T, DIM))
    document_ids = keras.Input((T,), dtype="int32")
    outputs = layer(tokens, tokens, segment_ids=document_ids, use_causal_mask=True)
    model = keras.Model([tokens, document_ids], outputs)
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    ids = segment_ids()
    path = tmp_path / "packed.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded([x, ids])), to_numpy(model([x, ids])), atol=1e-6)


@pytest.mark.parametrize("implementation", ["explicit", "chunked"])
def test_subclass_overriding_compute_attention_gets_the_block_diagonal_mask(rng, implementation):
    """An override written for the built-in receives a dense mask with the ids merged."""
    seen = []

    class Spy(keras_mha.MultiHeadAttention):
        def _compute_attention(
            self, query, key, value, attention_mask=None, training=None, scores=False, **kw
        ):
            seen.append(to_numpy(attention_mask))
            return super()._compute_attention(
                query, key, value, attention_mask, training, scores, **kw
            )

    keras.utils.set_random_seed(0)
    layer = Spy(HEADS, KEY_DIM, implementation=implementation)
    x = rng.standard_normal((1, T, DIM)).astype("float32")
    ids = segment_ids()
    out = to_numpy(layer(x, x, segment_ids=ids))
    np.testing.assert_array_equal(seen[-1], _block_diagonal(ids, ids))
    expected, _ = reference_mha(layer, x, x, mask=_block_diagonal(ids, ids))
    np.testing.assert_allclose(out, expected, atol=ATOL)
