"""`keras_mha.masks`: the factored mask (`AttentionMask`) the kernels read block by
block, `describe` (a call's masks -> one `AttentionMask`), `merge_masks` (the dense
form) and the key ranges that let a chunk skip keys no query of it can see. Each is
checked against masks written out in NumPy."""

import itertools

import numpy as np
import pytest
from helpers import to_numpy
from keras import ops
from reference import in_window

from keras_mha import masks

B, N, T, S = 2, 3, 7, 9


def _numpy_mask(
    query_valid=None,
    key_valid=None,
    causal=False,
    offset=0,
    window=None,
    dense=None,
    query_segments=None,
    key_segments=None,
):
    """The whole `(B, N, T, S)` mask the factors stand for, written out."""
    allowed = np.ones((B, N, T, S), bool)
    if query_segments is not None:  # same document, and not padding (id 0)
        rows, cols = query_segments[:, None, :, None], key_segments[:, None, None, :]
        allowed &= (rows == cols) & (rows != 0)
    rows, cols = np.arange(T)[:, None] + offset, np.arange(S)[None, :]
    if query_valid is not None:
        allowed &= query_valid[:, None, :, None]
    if key_valid is not None:
        allowed &= key_valid[:, None, None, :]
    if causal:
        allowed &= rows >= cols
    if window is not None:
        allowed &= in_window(rows - cols, window)
    if dense is not None:
        allowed &= dense
    return allowed


FACTORS = {
    "padding": dict(query_valid=True, key_valid=True),
    "causal": dict(causal=True),
    "causal+offset": dict(causal=True, offset=2),
    "window": dict(window=3),
    "causal+window+offset": dict(causal=True, window=4, offset=2),
    "window-pair": dict(window=(1, 2)),
    "window-pair+offset": dict(window=(3, 0), offset=2),
    "causal+window-pair+offset": dict(causal=True, window=(2, 4), offset=1),
    "dense": dict(dense=(B, 1, T, S)),
    "dense-heads": dict(dense=(B, N, T, S)),
    "dense-broadcast": dict(dense=(1, 1, 1, S)),
    "everything": dict(query_valid=True, key_valid=True, causal=True, window=5, dense=(B, N, T, S)),
    "segments": dict(query_segments=True),
    "segments+everything": dict(
        query_segments=True, query_valid=True, key_valid=True, causal=True, window=5, offset=2
    ),
}


def _factors(rng, spec):
    factors = dict(spec)
    if factors.get("query_valid"):
        factors["query_valid"] = rng.random((B, T)) < 0.8
    if factors.get("key_valid"):
        factors["key_valid"] = rng.random((B, S)) < 0.8
    if "dense" in factors:
        factors["dense"] = rng.random(factors["dense"]) < 0.7
    if factors.get("query_segments"):  # ids 0 (padding) to 3, in runs
        factors["query_segments"] = np.sort(rng.integers(0, 4, (B, T)), axis=1).astype("int32")
        factors["key_segments"] = np.sort(rng.integers(0, 4, (B, S)), axis=1).astype("int32")
    return factors


def _tensors(factors):
    return {
        k: ops.convert_to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in factors.items()
    }


@pytest.mark.parametrize("name", list(FACTORS))
@pytest.mark.parametrize("query_chunk, key_chunk", [(T, S), (3, 4), (1, 9), (7, 2)])
def test_blocks_tile_the_whole_mask(rng, name, query_chunk, key_chunk):
    factors = _factors(rng, FACTORS[name])
    expected = _numpy_mask(**factors)
    mask = masks.AttentionMask(**_tensors(factors))
    for t0, s0 in itertools.product(range(0, T, query_chunk), range(0, S, key_chunk)):
        q, k = min(query_chunk, T - t0), min(key_chunk, S - s0)
        block = np.broadcast_to(to_numpy(mask.block(t0, q, s0, k)), (B, N, q, k))
        np.testing.assert_array_equal(block, expected[:, :, t0 : t0 + q, s0 : s0 + k])


def test_an_empty_mask_has_no_block():
    mask = masks.AttentionMask()
    assert mask.is_empty and mask.block(0, T, 0, S) is None


def test_block_needs_sizes_for_positions():
    with pytest.raises(ValueError, match="axis 2"):
        masks.AttentionMask(causal=True).block(0, None, 0, S)


@pytest.mark.parametrize("name", list(FACTORS))
def test_visible_range_holds_every_key_a_chunk_sees(rng, name):
    """Every key some query of a chunk sees lies in the chunk's `visible_range`,
    which is empty for a chunk none of whose queries is valid; `visible_keys` is the
    same range where it has a key, and one key otherwise."""
    factors = _factors(rng, FACTORS[name])
    if factors.get("query_valid") is not None:
        factors["query_valid"][:, 3:6] = False  # the chunk [3, 6) is padding
    expected = _numpy_mask(**factors).any(axis=(0, 1))  # (T, S)
    mask = masks.AttentionMask(**_tensors(factors))
    for start in range(0, T, 3):
        size = min(3, T - start)
        lo, hi = (int(to_numpy(x)) for x in mask.visible_range(start, size, S))
        seen = np.flatnonzero(expected[start : start + size].any(axis=0))
        assert 0 <= lo <= hi <= S
        if seen.size:
            assert lo <= seen[0] and seen[-1] < hi
        if factors.get("query_valid") is not None and start == 3:
            assert lo == hi
        keys = tuple(int(to_numpy(x)) for x in mask.visible_keys(start, size, S))
        if mask.data_dependent:
            assert keys == (lo, hi) if hi > lo else keys[1] == keys[0] + 1


@pytest.mark.parametrize(
    "mask, start, size, expected",
    [
        (masks.AttentionMask(), 4, 4, (0, 20)),
        (masks.AttentionMask(causal=True), 4, 4, (0, 8)),
        (masks.AttentionMask(causal=True, offset=3), 4, 4, (0, 11)),
        (masks.AttentionMask(window=3), 8, 4, (6, 14)),
        (masks.AttentionMask(causal=True, window=3), 8, 4, (6, 12)),
        # (left, right): queries 8..11 see keys 8 - 1 .. 11 + 2.
        (masks.AttentionMask(window=(1, 2)), 8, 4, (7, 14)),
        (masks.AttentionMask(window=(5, 0), offset=2), 8, 4, (5, 14)),
        (masks.AttentionMask(window=(0, 3)), 8, 4, (8, 15)),
        (masks.AttentionMask(causal=True, offset=ops.convert_to_tensor(2)), 4, 4, (0, 20)),
    ],
)
def test_key_range_bounds_what_a_chunk_can_see(mask, start, size, expected):
    assert mask.key_range(start, size, 20) == expected
    # Every key outside the range is masked for every query of the chunk.
    lo, hi = expected
    block = mask.block(start, size, 0, 20)
    if block is not None:
        seen = np.broadcast_to(to_numpy(block), (1, 1, size, 20)).any(axis=(0, 1, 2))
        assert not seen[:lo].any() and not seen[hi:].any()


def test_key_range_is_tight():
    """The first and last key of the range are seen by some query of the chunk."""
    mask = masks.AttentionMask(causal=True, window=3, offset=1)
    for start in range(0, 12, 4):
        lo, hi = mask.key_range(start, 4, 16)
        seen = to_numpy(mask.block(start, 4, 0, 16)).reshape(4, 16).any(axis=0)
        assert seen[lo] and seen[hi - 1]


# ------------------------------------------------------------------------ describe
@pytest.mark.parametrize("dtype", ["bool", "int32", "float32"])
def test_describe_keeps_the_factors_apart(rng, dtype):
    query_mask = rng.random((B, T)) < 0.8
    value_mask, key_mask = rng.random((B, S)) < 0.8, rng.random((B, S)) < 0.8
    mask = masks.describe(
        query_mask=ops.convert_to_tensor(query_mask.astype(dtype)),
        value_mask=ops.convert_to_tensor(value_mask.astype(dtype)),
        key_mask=ops.convert_to_tensor(key_mask.astype(dtype)),
        use_causal_mask=1,
        sliding_window=4,
        offset=2,
    )
    assert mask.dense is None and mask.causal is True and mask.window == 4
    np.testing.assert_array_equal(to_numpy(mask.query_valid), query_mask)
    np.testing.assert_array_equal(to_numpy(mask.key_valid), value_mask & key_mask)
    expected = _numpy_mask(query_mask, value_mask & key_mask, True, 2, 4)
    got = np.broadcast_to(to_numpy(mask.block(0, T, 0, S)), (B, N, T, S))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("shape", [(T, S), (B, T, S), (1, T, S), (B, N, T, S), (B, 1, 1, S)])
def test_describe_gives_a_dense_mask_a_heads_axis(rng, shape):
    dense = rng.random(shape) < 0.6
    mask = masks.describe(attention_mask=dense.astype("float32"))
    assert len(mask.dense.shape) == 4
    if len(shape) < 4:  # the built-in's (B, T, S) mask broadcasts over the heads
        dense = dense.reshape((1,) * (3 - len(shape)) + shape)[:, None]
    expected = np.broadcast_to(dense, (B, N, T, S))
    got = np.broadcast_to(to_numpy(mask.block(0, T, 0, S)), (B, N, T, S))
    np.testing.assert_array_equal(got, expected)


def test_describe_of_nothing_is_none():
    assert masks.describe() is None
    assert masks.describe(use_causal_mask=0, sliding_window=None) is None


# --------------------------------------------------------------------- merge_masks
def test_merge_masks_is_the_builtin_merge(rng):
    query_mask, value_mask = rng.random((B, T)) < 0.8, rng.random((B, S)) < 0.8
    dense = rng.random((B, T, S)) < 0.7
    merged = masks.merge_masks(
        T,
        S,
        query_mask=ops.convert_to_tensor(query_mask),
        value_mask=ops.convert_to_tensor(value_mask.astype("int32")),
        attention_mask=ops.convert_to_tensor(dense),
        use_causal_mask=True,
        sliding_window=5,
        offset=1,
    )
    expected = _numpy_mask(query_mask, value_mask, True, 1, 5, dense[:, None])[:, 0]
    np.testing.assert_array_equal(to_numpy(merged), expected)


def test_merge_masks_aligns_the_parts_with_a_heads_axis(rng):
    """The user's `(B, N, T, S)` mask: the `(B, T, S)` parts broadcast over N, not B."""
    query_mask, dense = rng.random((B, T)) < 0.8, rng.random((B, N, T, S)) < 0.7
    merged = masks.merge_masks(
        T,
        S,
        query_mask=ops.convert_to_tensor(query_mask),
        attention_mask=ops.convert_to_tensor(dense),
        use_causal_mask=True,
    )
    np.testing.assert_array_equal(
        to_numpy(merged), _numpy_mask(query_mask, causal=True, dense=dense)
    )


def test_merge_masks_of_nothing_is_none():
    assert masks.merge_masks(T, S) is None


def test_expand_to_scores_inserts_the_batch_like_axes():
    mask = ops.ones((B, 4, 5, 6, 7), "bool")  # 2-d attention: (B, t1, t2, s1, s2)
    assert tuple(masks.expand_to_scores(mask, 6, 2).shape) == (B, 1, 4, 5, 6, 7)
    mask = ops.ones((B, T, S), "bool")
    assert tuple(masks.expand_to_scores(mask, 5, 1).shape) == (B, 1, 1, T, S)


# -------------------------------------------------------------------- empty rows
@pytest.mark.parametrize(
    "factors",
    [
        dict(query=True),
        dict(key=True),
        dict(key=True, causal=True),
        dict(key=True, causal=True, offset=2),
        dict(key=True, window=2),
        dict(query=True, key=True, causal=True, window=3, offset=1),
        dict(key=True, window=(0, 1)),
        dict(query=True, key=True, window=(2, 0), offset=1),
        dict(causal=True, offset=-3),
        dict(key=True, dense=True),
    ],
    ids=lambda f: "-".join(sorted(f)),
)
def test_empty_rows_are_the_rows_the_written_out_mask_leaves_empty(factors):
    rng = np.random.default_rng(4)
    query_valid = rng.random((B, T)) > 0.3 if factors.get("query") else None
    key_valid = None
    if factors.get("key"):
        key_valid = rng.random((B, S)) > 0.5
        key_valid[0, :4] = False  # left padding: early causal rows see nothing
        key_valid[1] = False  # no key at all
        key_valid[1, -1] = factors.get("dense", False)
    dense = rng.random((1, N, T, S)) > 0.6 if factors.get("dense") else None
    offset = factors.get("offset", 0)
    mask = masks.AttentionMask(
        query_valid=None if query_valid is None else ops.convert_to_tensor(query_valid),
        key_valid=None if key_valid is None else ops.convert_to_tensor(key_valid),
        causal=factors.get("causal", False),
        offset=offset,
        window=factors.get("window"),
        dense=None if dense is None else ops.convert_to_tensor(dense),
    )
    expected = ~_numpy_mask(
        query_valid, key_valid, factors.get("causal", False), offset, factors.get("window"), dense
    ).any(-1)
    assert expected.any() and not expected.all()  # the check can fail either way
    got = to_numpy(mask.empty_rows(T, S))
    np.testing.assert_array_equal(np.broadcast_to(got, expected.shape), expected)


def test_empty_rows_with_document_ids():
    ids = np.array([[1, 1, 2, 2, 0, 0, 0], [3, 3, 3, 0, 0, 0, 0]], "int32")
    keys = np.array([[1, 1, 0, 0, 0, 0, 0, 0, 0], [4, 4, 4, 4, 4, 4, 4, 4, 4]], "int32")
    mask = masks.describe(segment_ids=ids, key_segment_ids=keys)
    expected = ~((ids[:, :, None] == keys[:, None, :]) & (ids[:, :, None] != 0)).any(-1)
    assert expected.any() and not expected.all()
    got = to_numpy(mask.empty_rows(T, S))
    np.testing.assert_array_equal(np.broadcast_to(got, (B, 1, T))[:, 0], expected)


def test_empty_rows_is_none_when_nothing_is_masked():
    assert masks.AttentionMask().empty_rows(T, S) is None
    assert not to_numpy(masks.AttentionMask(causal=True).empty_rows(T, S)).any()


def test_describe_carries_segment_ids_and_merge_masks_builds_them(rng):
    """`describe` keeps the ids (the keys' default to the queries'); `merge_masks`
    gives the same block-diagonal mask, densely."""
    ids = np.array([[1, 1, 2, 2, 2, 0, 0], [4, 4, 4, 4, 1, 1, 1]], "int32")
    mask = masks.describe(segment_ids=ids)
    assert not mask.is_empty
    assert mask.key_segments is mask.query_segments
    expected = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)
    np.testing.assert_array_equal(to_numpy(mask.block(0, 7, 0, 7))[:, 0], expected)
    dense = masks.merge_masks(7, 7, segment_ids=ids, use_causal_mask=True)
    np.testing.assert_array_equal(to_numpy(dense), expected & np.tri(7, dtype=bool))
    keys = np.array([[1, 2, 0], [1, 1, 4]], "int32")
    cross = masks.describe(segment_ids=ids, key_segment_ids=keys)
    expected = (ids[:, :, None] == keys[:, None, :]) & (ids[:, :, None] != 0)
    np.testing.assert_array_equal(to_numpy(cross.block(0, 7, 0, 3))[:, 0], expected)


@pytest.mark.parametrize("window", [3, (1, 2), (0, 0), (4, 0)])
def test_merge_masks_builds_the_window_the_description_holds(window):
    """The dense form (the built-in's hooks, N-d attention) and the described one agree
    on symmetric and `(left, right)` windows, with a decoding offset."""
    dense = masks.merge_masks(T, S, sliding_window=window, offset=2)
    rows, cols = np.arange(T)[:, None] + 2, np.arange(S)[None, :]
    expected = in_window(rows - cols, window)
    assert expected.any() and not expected.all()
    np.testing.assert_array_equal(to_numpy(dense)[0], expected)
    described = masks.describe(sliding_window=window, offset=2)
    np.testing.assert_array_equal(to_numpy(described.block(0, T, 0, S))[0, 0], expected)
