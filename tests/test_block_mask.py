"""`keras_mha.block_mask`: masks as code (`mask_mod`) and their block maps.

The patterns are attention-gym's and FlashAttention 4's test masks, written anew here
from their published definitions, each twice: as a `mask_mod` in `keras.ops` and as a
dense NumPy mask. The block map is checked against the dense mask; every kernel,
forward against the float64 reference and backward against the explicit kernel given
the dense mask; the layer with GQA and a KV cache; and the blocks a compiled loop
visits are counted.
"""

import dataclasses

import hypothesis
import keras
import numpy as np
import pytest
from helpers import BACKEND, compiled, fingerprint, to_numpy, value_and_grads
from hypothesis import strategies as st
from keras import ops
from reference import reference_attention

import keras_mha
from keras_mha import block_mask as bm_lib
from keras_mha import equations, masks
from keras_mha.kernels import chunked, explicit, fused, policy

B, N, H = 2, 2, 4
BLOCK = (4, 3)  # query and key blocks: T and S below are no multiples of them
ATOL = 3e-5
EQUATIONS = equations.attention_equations(4, (1,))[:2] + (1,)


# ---------------------------------------------------------------------- patterns
# Each: (t, s) -> (mask_mod, batch, heads, dense (B or 1, N or 1, t, s)).
def _grid(t, s):
    return np.arange(t)[:, None], np.arange(s)[None, :]


def _causal(t, s):
    q, k = _grid(t, s)
    return lambda b, h, qi, ki: ops.greater_equal(qi, ki), None, None, (q >= k)[None, None]


def _causal_offset(t, s):  # FlashAttention 4: bottom-right aligned when t != s
    q, k = _grid(t, s)
    d = s - t
    return (lambda b, h, qi, ki: ops.less_equal(ki, qi + d)), None, None, (k <= q + d)[None, None]


def _sliding_window(t, s, w=4):  # attention-gym: causal, the last `w` keys
    q, k = _grid(t, s)

    def mod(b, h, qi, ki):
        return ops.logical_and(ops.greater_equal(qi, ki), ops.less_equal(qi - ki, w))

    return mod, None, None, ((q >= k) & (q - k <= w))[None, None]


def _left_right(t, s, left=3, right=2):  # FA4's local window (left, right), offset s - t
    q, k = _grid(t, s)
    d = s - t

    def mod(b, h, qi, ki):
        after_left = ops.greater_equal(ki, qi + d - left)
        return ops.logical_and(after_left, ops.less_equal(ki, qi + d + right))

    return mod, None, None, ((k >= q + d - left) & (k <= q + d + right))[None, None]


def _prefix_lm(t, s, prefix=5):
    q, k = _grid(t, s)

    def mod(b, h, qi, ki):
        return ops.logical_or(ops.greater_equal(qi, ki), ops.less(ki, prefix))

    return mod, None, None, ((q >= k) | (k < prefix))[None, None]


def _document_ids(s):
    ids = np.zeros((B, s), "int32")
    ids[0, :5], ids[0, 5:11], ids[0, 11:] = 0, 1, 2
    ids[1, :3], ids[1, 3:] = 4, 5
    return ids


def _document(t, s):  # packed causal, per batch row (batchified ids)
    ids = _document_ids(s)
    flat = ops.convert_to_tensor(ids.reshape(-1))

    def mod(b, h, qi, ki):
        same = ops.equal(ops.take(flat, b * s + qi), ops.take(flat, b * s + ki))
        return ops.logical_and(same, ops.greater_equal(qi, ki))

    q, k = _grid(t, s)
    dense = (ids[:, :t, None] == ids[:, None, :]) & (q >= k)
    return mod, B, None, dense[:, None]


def _dilated(t, s, w=6, dilation=2):  # attention-gym's dilated sliding window
    q, k = _grid(t, s)

    def mod(b, h, qi, ki):
        diff = ops.abs(qi - ki)
        return ops.logical_and(ops.less_equal(diff, w), ops.equal(diff % dilation, 0))

    diff = np.abs(q - k)
    return mod, None, None, ((diff <= w) & (diff % dilation == 0))[None, None]


def _global_sliding(t, s, w=2, g=2):  # global tokens see and are seen by all
    q, k = _grid(t, s)

    def mod(b, h, qi, ki):
        local = ops.less_equal(ops.abs(qi - ki), w)
        return ops.logical_or(local, ops.logical_or(ops.less(qi, g), ops.less(ki, g)))

    return mod, None, None, ((np.abs(q - k) <= w) | (q < g) | (k < g))[None, None]


def _batchified(t, s):  # per-row key lengths, causal
    lengths = np.array([s - 4, s], "int32")
    lens = ops.convert_to_tensor(lengths)

    def mod(b, h, qi, ki):
        return ops.logical_and(ops.less(ki, ops.take(lens, b)), ops.greater_equal(qi, ki))

    q, k = _grid(t, s)
    return mod, B, None, ((k[None] < lengths[:, None, None]) & (q >= k)[None])[:, None]


def _per_head(t, s):  # a causal window as wide as 2 h + 1
    q, k = _grid(t, s)

    def mod(b, h, qi, ki):
        return ops.logical_and(ops.greater_equal(qi, ki), ops.less_equal(qi - ki, 2 * h + 1))

    dense = (q >= k) & (q - k <= 2 * np.arange(N)[:, None, None] + 1)
    return mod, None, N, dense[None]


def _natten(t, s, width=4, radius=1):  # 2-D neighbourhood on a grid `width` wide
    q, k = _grid(t, s)

    def mod(b, h, qi, ki):
        near_x = ops.less_equal(ops.abs(qi % width - ki % width), radius)
        near_y = ops.less_equal(ops.abs(qi // width - ki // width), radius)
        return ops.logical_and(near_x, near_y)

    dense = (np.abs(q % width - k % width) <= radius) & (np.abs(q // width - k // width) <= radius)
    return mod, None, None, dense[None, None]


def _mini_causal(t, s, m=5):  # FA4: (q % m) >= (kv % m)
    q, k = _grid(t, s)
    return (
        (lambda b, h, qi, ki: ops.greater_equal(qi % m, ki % m)),
        None,
        None,
        ((q % m) >= (k % m))[None, None],
    )


def _block_diagonal(t, s, m=5):  # FA4: q // m == kv // m
    q, k = _grid(t, s)
    return (
        (lambda b, h, qi, ki: ops.equal(qi // m, ki // m)),
        None,
        None,
        (q // m == k // m)[None, None],
    )


PATTERNS = {
    "causal": _causal,
    "causal-offset": _causal_offset,
    "sliding-window": _sliding_window,
    "left-right-window": _left_right,
    "prefix-lm": _prefix_lm,
    "document": _document,
    "dilated": _dilated,
    "global+sliding": _global_sliding,
    "batchified": _batchified,
    "per-head": _per_head,
    "natten-2d": _natten,
    "mini-causal": _mini_causal,
    "block-diagonal": _block_diagonal,
}
LENGTHS = (9, 14)  # T, S


def _block_mask(name, t, s, block=BLOCK):
    mod, batch, heads, dense = PATTERNS[name](t, s)
    return bm_lib.create_block_mask(mod, batch, heads, t, s, block_size=block), dense


# ------------------------------------------------------------------- block map
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("lengths", [(13, 14), (12, 12)], ids=["ragged", "whole-blocks"])
def test_block_map_classifies_blocks_as_the_dense_mask(name, lengths):
    t, s = lengths
    mask, dense = _block_mask(name, t, s)
    np.testing.assert_array_equal(mask.to_dense(), np.broadcast_to(dense, mask.shape))
    qb, kb = BLOCK
    full = np.broadcast_to(dense, mask.shape)
    for i in range(mask.kinds.shape[2]):
        for j in range(mask.kinds.shape[3]):
            block = full[:, :, i * qb : (i + 1) * qb, j * kb : (j + 1) * kb]
            want = np.where(
                block.all(axis=(2, 3)),
                bm_lib.FULL,
                np.where(block.any(axis=(2, 3)), bm_lib.PARTIAL, bm_lib.EMPTY),
            )
            np.testing.assert_array_equal(mask.kinds[:, :, i, j], want)


def test_and_or_masks_and_named_patterns():
    t = s = 11
    q, k = _grid(t, s)
    window = bm_lib.sliding_window(3)
    both = bm_lib.create_block_mask(
        bm_lib.and_masks(bm_lib.causal(), window), None, None, t, s, block_size=4
    )
    np.testing.assert_array_equal(both.to_dense()[0, 0], (q >= k) & (q - k <= 3))
    prefix = bm_lib.create_block_mask(bm_lib.prefix_lm(4), None, None, t, s, block_size=4)
    np.testing.assert_array_equal(prefix.to_dense()[0, 0], (q >= k) | (k < 4))
    either = bm_lib.create_block_mask(
        bm_lib.or_masks(bm_lib.causal(), bm_lib.sliding_window(0, 2)), None, None, t, s, 4
    )
    np.testing.assert_array_equal(either.to_dense()[0, 0], (q >= k) | ((k >= q) & (k <= q + 2)))
    ids = np.array([1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    docs = bm_lib.create_block_mask(bm_lib.document(ids), None, None, t, s, block_size=4)
    np.testing.assert_array_equal(docs.to_dense()[0, 0], (ids[:, None] == ids) & (q >= k))
    assert docs.density < 1.0 and "BlockMask" in repr(docs) and "." in docs.picture()


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
    lengths=st.tuples(st.integers(1, 40), st.integers(1, 40)),
    blocks=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    pattern=st.sampled_from(["causal", "sliding_window", "prefix_lm"]),
    arguments=st.tuples(st.integers(0, 12), st.integers(0, 12)),
)
# Blocks whose range of `q - kv` ends exactly at the window's edges.
@hypothesis.example(lengths=(8, 8), blocks=(2, 2), pattern="sliding_window", arguments=(3, 0))
@hypothesis.example(lengths=(8, 8), blocks=(2, 2), pattern="sliding_window", arguments=(1, 3))
def test_named_patterns_block_maps_from_their_bounds_equal_their_evaluation(
    lengths, blocks, pattern, arguments
):
    """`causal`, `sliding_window` and `prefix_lm` are classified without evaluating an
    entry: the same map as evaluating the same function entry by entry."""
    named = {
        "causal": bm_lib.causal(),
        "sliding_window": bm_lib.sliding_window(*arguments),
        "prefix_lm": bm_lib.prefix_lm(arguments[0]),
    }[pattern]
    t, s = lengths
    fast = bm_lib.create_block_mask(named, None, None, t, s, block_size=blocks)
    evaluated = bm_lib.create_block_mask(
        lambda b, h, q, k: named(b, h, q, k), None, None, t, s, block_size=blocks
    )
    np.testing.assert_array_equal(fast.kinds, evaluated.kinds)


def test_create_block_mask_rejects_bad_arguments():
    with pytest.raises(ValueError, match="argument `mask_mod`"):
        bm_lib.create_block_mask("causal", None, None, 4, 4)
    with pytest.raises(ValueError, match="argument `T`"):
        bm_lib.create_block_mask(bm_lib.causal(), None, None, 0, 4)
    with pytest.raises(ValueError, match="argument `block_size`"):
        bm_lib.create_block_mask(bm_lib.causal(), None, None, 4, 4, block_size=(2, 0))


@pytest.mark.parametrize("budget, key_sizes", [(8 * 64, {61}), (8 * 16, {16, 13})])
def test_block_map_is_built_by_tiles_of_blocks(monkeypatch, budget, key_sizes):
    """The mask_mod never sees the whole `(T, S)` grid at once: tiles of whole blocks,
    a row of blocks split along the keys where it holds more than the budget, give
    the map and the dense view of one evaluation of the whole grid."""

    def mod(b, h, qi, ki):
        seen.append((qi.shape[2], ki.shape[3]))
        return ops.logical_or(ops.greater_equal(qi, ki), ops.equal(ki, 17))

    seen = []
    whole = bm_lib.create_block_mask(mod, None, None, 60, 61, block_size=8)
    assert seen == [(60, 61)]  # within the default budget: one tile
    seen.clear()
    monkeypatch.setattr(bm_lib, "_GRID_BUDGET", budget)
    mask = bm_lib.create_block_mask(mod, None, None, 60, 61, block_size=8)
    assert {q for q, _ in seen} == {8, 4} and {k for _, k in seen} == key_sizes
    np.testing.assert_array_equal(mask.kinds, whole.kinds)
    assert {bm_lib.EMPTY, bm_lib.PARTIAL, bm_lib.FULL} <= set(mask.kinds.ravel())
    np.testing.assert_array_equal(mask.to_dense(), whole.to_dense())


# ---------------------------------------------------------------------- kernels
# "in-place": unrolled, the key and value gradients summed into one buffer (torch's row);
# "units": a compiled loop visiting two of the map's key blocks at a time.
KERNELS = ["explicit", "fused", "chunked", "in-place", "looped", "units"] + (
    ["dynamic"] if BACKEND != "jax" else []
)


def _run(kernel, mask):
    def fn(q, k, v):
        options = dict(scale=H**-0.5, mask=mask)
        if kernel == "explicit":
            return explicit.attention(q, k, v, equations=EQUATIONS, **options)[0]
        if kernel == "fused":
            return fused.attention(q, k, v, chunk_size=4, **options)
        loop, dynamic = kernel in ("looped", "units", "dynamic"), kernel == "dynamic"
        return chunked.attention(
            q,
            k,
            v,
            chunk_size=4,
            key_block=7 if kernel == "units" else 5,
            loop=loop,
            dynamic=dynamic,
            in_place_sums=kernel == "in-place",
            **options,
        )

    return fn


def _inputs(rng, t, s):
    q = rng.standard_normal((B, t, N, H)).astype("float32")
    k = rng.standard_normal((B, s, N, H)).astype("float32")
    v = rng.standard_normal((B, s, N, H)).astype("float32")
    return q, k, v


# The explicit kernel's gradients given a dense mask, by the mask and the inputs: the
# kernels compared with them on the same inputs share one run.
_DENSE_GRADIENTS = {}


def _dense_gradients(run, dense, arrays, *options):
    """`value_and_grads(run(AttentionMask(dense=dense)), arrays)`, once per inputs."""
    key = fingerprint((dense, tuple(arrays), options))
    if key not in _DENSE_GRADIENTS:
        dense_mask = masks.AttentionMask(dense=ops.convert_to_tensor(dense))
        _DENSE_GRADIENTS[key] = value_and_grads(run(dense_mask), arrays)
    return _DENSE_GRADIENTS[key]


def _assert_matches(rng, kernel, attention_mask, dense, t, s):
    arrays = _inputs(rng, t, s)
    want, _ = reference_attention(*arrays, mask=np.broadcast_to(dense, (B,) + dense.shape[1:]))
    out, grads = value_and_grads(_run(kernel, attention_mask), arrays)
    np.testing.assert_allclose(out, want, atol=ATOL)
    _, expected = _dense_gradients(lambda mask: _run("explicit", mask), dense, arrays)
    for got, wanted in zip(grads, expected):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, wanted, atol=ATOL)


# T != S, neither a multiple of its block size (the block map's own test takes whole
# blocks too).
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", list(PATTERNS))
def test_every_kernel_matches_the_reference_forward_and_backward(rng, kernel, name):
    t, s = LENGTHS
    mask, dense = _block_mask(name, t, s)
    _assert_matches(rng, kernel, masks.AttentionMask(block_mask=mask), dense, t, s)


@pytest.mark.parametrize("kernel", KERNELS)
def test_block_mask_ands_with_the_named_masks(rng, kernel):
    """A block mask with causality, a window offset and key padding: all ANDed."""
    t, s = 9, 14
    mask, dense = _block_mask("global+sliding", s, s)
    valid = np.ones((B, s), bool)
    valid[0, 11:] = False
    q, k = _grid(t, s)
    offset = s - t
    named = (q + offset >= k) & (q + offset - k <= 6) & valid[:, None, None, :]
    attention_mask = masks.AttentionMask(
        block_mask=mask, causal=True, window=(6, 0), offset=offset, key_valid=valid
    )
    _assert_matches(rng, kernel, attention_mask, dense[:, :, offset:] & named, t, s)


def test_fully_masked_rows_give_zero_output(rng):
    """Queries 0..3 see nothing: zero output, on every kernel."""
    t = s = 10
    mod = lambda b, h, qi, ki: ops.logical_and(ops.greater_equal(qi, 4), ops.greater_equal(qi, ki))  # noqa: E731
    mask = bm_lib.create_block_mask(mod, None, None, t, s, block_size=4)
    assert (mask.kinds[0, 0, 0] == bm_lib.EMPTY).all()
    arrays = _inputs(rng, t, s)
    for kernel in KERNELS:
        out = to_numpy(_run(kernel, masks.AttentionMask(block_mask=mask))(*arrays))
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out[:, :4], 0.0)


def test_policy_takes_the_fused_kernel_for_a_block_mask_only_where_its_row_says():
    mask, _ = _block_mask("causal", 13, 13)
    call = policy.Call(mask=masks.AttentionMask(block_mask=mask), score_entries=10**9)
    assert policy.choose("fused", call, policy.Policy("fused")) == "chunked"
    assert policy.choose(None, call, policy.Policy("fused")) == "chunked"
    row = policy.Policy("fused", fused_block_mask=True)
    assert policy.choose(None, call, row) == "fused"
    # A score function still takes the chunked kernel.
    assert policy.choose(None, dataclasses.replace(call, score_mod=True), row) == "chunked"


def test_fused_gathers_each_chunks_runs_of_blocks(rng, monkeypatch):
    """With gaps of empty blocks inside a chunk's key range, the fused kernel gets
    the keys of the runs of non-empty blocks only, joined (and their mask), and the
    output is the reference's."""
    t = s = 24
    mod, _, _, dense = PATTERNS["global+sliding"](t, s)
    mask = bm_lib.create_block_mask(mod, None, None, t, s, block_size=(4, 3))
    widths = []
    original = fused._Kernel.__call__

    def spy(self, query, key, value, *rest):
        widths.append(key.shape[1])
        return original(self, query, key, value, *rest)

    monkeypatch.setattr(fused._Kernel, "__call__", spy)
    arrays = _inputs(rng, t, s)
    out = to_numpy(_run("fused", masks.AttentionMask(block_mask=mask))(*arrays))
    expected, _ = reference_attention(*arrays, mask=np.broadcast_to(dense, (B, 1, t, s))[:, 0])
    np.testing.assert_allclose(out, expected, atol=ATOL)
    # Chunks of 4 queries: the last ones see the global keys [0, 3) and their window,
    # not the empty blocks between them.
    nonempty = mask.kinds[0, 0] != bm_lib.EMPTY
    seen = [3 * int(nonempty[i // 4 : i // 4 + 1].any(axis=0).sum()) for i in range(0, t, 4)]
    assert sorted(widths) == sorted(min(w, s) for w in seen)
    assert max(widths[: len(widths) // 2]) < s


# ------------------------------------------------------------- skipped blocks
@pytest.mark.parametrize("name", ["causal", "document", "dilated", "block-diagonal"])
@pytest.mark.parametrize("key_block, unit", [(5, 1), (7, 2)])
def test_loop_visits_only_the_non_empty_blocks(name, key_block, unit):
    """The compiled loop's plan: each chunk visits the key blocks its block map leaves
    non-empty, no other, and they are the ones the dense mask has a true in. A loop's
    `key_block` of several of the map's blocks visits whole units of them: those
    holding a non-empty block."""
    t, s = 13, 14
    mask, dense = _block_mask(name, t, s)
    attention_mask = masks.AttentionMask(block_mask=mask)
    q = np.zeros((1, t, 1, H), "float32")
    k = np.zeros((1, s, 1, H), "float32")
    plan = chunked._Plan.make(q, k, attention_mask, 4, None, True, False, key_block=key_block)
    width = BLOCK[1] * unit
    assert plan.key_block == width
    any_dense = np.broadcast_to(dense, mask.shape).any(axis=(0, 1))
    for start in range(0, t, 4):
        size = min(4, t - start)
        order, count = plan.key_blocks(start, size)
        count = int(to_numpy(count))
        visited = sorted(int(j) for j in to_numpy(order)[:count])
        rows = any_dense[start : start + size]
        units = -(-s // width)
        want = [j for j in range(units) if rows[:, j * width : j * width + width].any()]
        assert visited == want


@pytest.mark.skipif(BACKEND != "torch", reason="torch runs the loop in Python: blocks counted")
def test_loop_computes_only_the_non_empty_blocks_forward_and_backward(rng, monkeypatch):
    t, s = 13, 14
    mask, _ = _block_mask("block-diagonal", t, s)
    computed = []
    logits = chunked._Block.logits

    def counting(block):
        computed.append(block)
        return logits(block)

    monkeypatch.setattr(chunked._Block, "logits", counting)
    arrays = _inputs(rng, t, s)
    value_and_grads(_run("looped", masks.AttentionMask(block_mask=mask)), arrays)
    nonempty = 0
    for start in range(0, t, 4):  # chunks of 4 queries are the map's query blocks
        nonempty += int((mask.kinds[0, 0, start // 4] != bm_lib.EMPTY).sum())
    assert len(computed) == 2 * nonempty  # forward and backward
    assert nonempty < 2 * mask.kinds[0, 0].size // 2


def test_key_ranges_narrow_by_the_block_map():
    mask, _ = _block_mask("block-diagonal", 13, 14)
    attention_mask = masks.AttentionMask(block_mask=mask)
    # Queries 8..11 see documents 5..9 and 10..14: key blocks 1..4 of 3 keys.
    assert attention_mask.key_range(8, 4, 14) == (3, 14)
    lo, hi = attention_mask.key_range(ops.convert_to_tensor(8), 4, 14)
    assert (int(to_numpy(lo)), int(to_numpy(hi))) == (3, 14)
    # Queries 0..3 see keys 0..4: blocks 0 and 1.
    assert attention_mask.key_range(0, 4, 14) == (0, 6)


# ------------------------------------------------------------------------ layer
D, L = 8, 11


def _layer(**kwargs):
    config = {"num_heads": N, "key_dim": H, "bias_initializer": "random_normal"}
    layer = keras_mha.MultiHeadAttention(**{**config, **kwargs})
    layer.build((None, None, D), (None, None, D))
    return layer


def _dense_mask(dense, batch=B):
    """A dense `(B, N, T, S)` mask for the layer's `attention_mask` (per head)."""
    return np.broadcast_to(dense, (batch, N) + dense.shape[2:]).copy()


@pytest.mark.parametrize(
    "name,config",
    [
        ("prefix-lm", {}),
        ("per-head", {"num_key_value_heads": 1}),
        ("document", {"implementation": "chunked", "chunk_size": 4}),
        ("natten-2d", {"implementation": "explicit"}),
    ],
)
def test_layer_mask_mod_equals_its_dense_mask(rng, name, config):
    layer = _layer(**config)
    x = rng.normal(size=(B, L, D)).astype("float32")
    mod, batch, heads, dense = PATTERNS[name](L, L)
    want = to_numpy(layer(x, x, attention_mask=_dense_mask(dense)))
    built = bm_lib.create_block_mask(mod, batch, heads, L, L, block_size=BLOCK)
    np.testing.assert_allclose(to_numpy(layer(x, x, mask_mod=built)), want, atol=1e-5)
    if batch is None and heads is None:  # a bare function, built by the layer
        np.testing.assert_allclose(to_numpy(layer(x, x, mask_mod=mod)), want, atol=1e-5)


@pytest.mark.parametrize("t,s", [(7, 7), (5, 9), (9, 5)])
def test_a_causal_mask_mod_is_found_exactly(t, s):
    """`is_causal` is set where the mask is `kv <= q` entry by entry: the named
    `causal()` and a function of your own, blocks no multiple of the lengths; not
    where one entry on the diagonal differs, nor for a window or a causal offset."""
    build = lambda mod: bm_lib.create_block_mask(mod, None, None, t, s, block_size=BLOCK)  # noqa: E731
    assert build(bm_lib.causal()).is_causal
    assert build(_causal(t, s)[0]).is_causal
    assert build(_causal(t, s)[0]).kinds.tolist() == build(bm_lib.causal()).kinds.tolist()

    def all_but_one(b, h, q, k):  # causal, but query 4 does not see itself
        return ops.logical_and(ops.greater_equal(q, k), ops.logical_or(q != 4, k != 4))

    assert not build(all_but_one).is_causal
    assert not build(lambda b, h, q, k: ops.greater(q, k)).is_causal
    assert not build(_sliding_window(t, s, w=2)[0]).is_causal
    assert not build(bm_lib.sliding_window(2)).is_causal
    assert not build(_causal_offset(t, s)[0]).is_causal or s == t


@pytest.mark.parametrize("t,s", [(17, 17), (13, 9), (6, 11)])
def test_causal_from_is_where_every_later_row_is_exactly_causal(t, s):
    """`causal_from`: from that query on, every row of the mask is `kv <= q` entry by
    entry (the one before it is not, or it is 0); named patterns exactly, functions
    by rows of blocks. `T` where no row from some position on is."""
    build = lambda mod: bm_lib.create_block_mask(mod, None, None, t, s, block_size=BLOCK)  # noqa: E731
    q, k = _grid(t, s)

    def last_rows(m):  # the largest set of trailing rows equal to causality
        dense, causal = m.to_dense()[0, 0], q >= k
        rows = [i for i in range(t) if (dense[i:] == causal[i:]).all()]
        return rows[0] if rows else t

    def late_extra(b, h, qi, ki):  # causal, but the last two queries also see key 0..s
        return ops.logical_or(ops.greater_equal(qi, ki), ops.greater_equal(qi, t - 2))

    mods = {
        "named causal": bm_lib.causal(),
        "named prefix": bm_lib.prefix_lm(3),
        "prefix": _prefix_lm(t, s, prefix=3)[0],
        "causal": _causal(t, s)[0],
        "window": bm_lib.sliding_window(2),
        "late extra": late_extra,
    }
    for name, mod in mods.items():
        m = build(mod)
        exact = last_rows(m)
        assert m.is_causal == (m.causal_from == 0), name
        if name.startswith("named") or exact in (0, t):
            assert m.causal_from == exact, name
        else:  # functions: the first whole block of rows from which on all are causal
            q_block = BLOCK[0]
            assert m.causal_from == min(t, -(-exact // q_block) * q_block), name


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("which", ["named", "function"])
def test_prefix_lm_rows_past_the_prefix_run_causal(rng, monkeypatch, kernel, which):
    """A prefix-LM (`T = S`, a short prefix): every kernel gives the float64
    reference's outputs and gradients; the fused kernel takes the rows past the prefix
    from one call of its causal kernel (`is_causal`), the rest by chunks."""
    t = s = 17
    mod, _, _, dense = _prefix_lm(t, s, prefix=3)
    mask = bm_lib.create_block_mask(bm_lib.prefix_lm(3) if which == "named" else mod,
                                    None, None, t, s, block_size=BLOCK)  # fmt: skip
    assert 0 < 4 * mask.causal_from <= t
    calls = []
    original = fused._Kernel.__call__
    monkeypatch.setattr(
        fused._Kernel,
        "__call__",
        lambda self, q, *a: calls.append((q.shape[1], a[4])) or original(self, q, *a),
    )
    _assert_matches(rng, kernel, masks.AttentionMask(block_mask=mask), dense, t, s)
    if kernel == "fused":
        assert (t, True) in calls and all(rows <= mask.causal_from for rows, c in calls if not c)


@pytest.mark.parametrize("which", ["named", "function"])
def test_a_causal_mask_mod_runs_as_use_causal_mask(rng, monkeypatch, which):
    """The layer and the functional entry point hand an exactly causal `mask_mod` to
    the kernels as causality (`use_causal_mask=True`, the backends' causal kernels),
    not as a block mask: the same outputs, with and without a KV cache."""
    from keras_mha import kernels

    seen = []
    original = kernels.attention
    monkeypatch.setattr(
        kernels, "attention", lambda *a, **k: seen.append(k["mask"]) or original(*a, **k)
    )
    layer = _layer()
    x = rng.normal(size=(B, L, D)).astype("float32")
    mod = bm_lib.causal() if which == "named" else _causal(L, L)[0]
    want = to_numpy(layer(x, x, use_causal_mask=True))
    np.testing.assert_allclose(to_numpy(layer(x, x, mask_mod=mod)), want, atol=1e-6)
    assert seen[-1].causal and seen[-1].block_mask is None
    cache = layer.init_cache(B, L)
    out, cache = layer(x[:, :4], x[:, :4], cache=cache, cache_update_index=0, mask_mod=mod)
    step, _ = layer(x[:, 4:5], x[:, 4:5], cache=cache, cache_update_index=4, mask_mod=mod)
    np.testing.assert_allclose(to_numpy(step), want[:, 4:5], atol=1e-5)
    assert seen[-1].causal and seen[-1].block_mask is None
    q, k, v = (rng.normal(size=(B, L, N, H)).astype("float32") for _ in range(3))
    got = keras_mha.attention(q, k, v, mask_mod=mod)
    expected = keras_mha.attention(q, k, v, use_causal_mask=True)
    np.testing.assert_allclose(to_numpy(got), to_numpy(expected), atol=1e-6)
    assert seen[-1].causal and seen[-1].block_mask is None


@pytest.mark.parametrize("kind", ["int", "tensor"])
def test_layer_decoding_with_a_cache_follows_the_positions(rng, kind):
    """Prefill 4 tokens, then decode one at a time: `q_idx` is the cache position."""
    layer = _layer(num_key_value_heads=1)
    x = rng.normal(size=(B, L, D)).astype("float32")
    mod, _, _, dense = _sliding_window(L, L)
    built = bm_lib.create_block_mask(mod, None, None, L, L, block_size=BLOCK)
    want = to_numpy(layer(x, x, mask_mod=built))
    dense_out = to_numpy(layer(x, x, attention_mask=_dense_mask(dense)))
    np.testing.assert_allclose(want, dense_out, atol=1e-5)
    cache = layer.init_cache(B, L)

    def index(t):
        return t if kind == "int" else ops.convert_to_tensor(t, "int32")

    out, cache = layer(x[:, :4], x[:, :4], cache=cache, cache_update_index=index(0), mask_mod=built)
    outputs = [to_numpy(out)]
    for t in range(4, L):
        step = x[:, t : t + 1]
        out, cache = layer(step, step, cache=cache, cache_update_index=index(t), mask_mod=built)
        outputs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), want, atol=1e-5)


def test_layer_mask_mod_in_a_functional_model_and_compiled(rng):
    layer = _layer()
    mod, _, _, dense = _global_sliding(L, L)
    built = bm_lib.create_block_mask(mod, None, None, L, L, block_size=BLOCK)
    x = rng.normal(size=(B, L, D)).astype("float32")
    want = to_numpy(layer(x, x, attention_mask=_dense_mask(dense)))
    inputs = keras.Input((L, D))
    model = keras.Model(inputs, layer(inputs, inputs, mask_mod=built))
    np.testing.assert_allclose(to_numpy(model(x)), want, atol=1e-5)
    step = compiled(lambda x: layer(x, x, mask_mod=mod))  # a function, built while tracing
    np.testing.assert_allclose(to_numpy(step(ops.convert_to_tensor(x))), want, atol=1e-5)


def test_layer_mask_mod_trains(rng):
    """Gradients reach the layer's weights through the chunked kernel's backward."""
    layer = _layer(implementation="chunked", chunk_size=4)
    mod, _, _, dense = _dilated(L, L)
    built = bm_lib.create_block_mask(mod, None, None, L, L, block_size=BLOCK)
    inputs = keras.Input((L, D))
    model = keras.Model(inputs, layer(inputs, inputs, mask_mod=built))
    model.compile(optimizer="sgd", loss="mse")
    x = rng.normal(size=(B, L, D)).astype("float32")
    before = to_numpy(model(x))
    model.fit(x, np.zeros_like(x), epochs=1, verbose=0)
    assert np.abs(to_numpy(model(x)) - before).max() > 0


@pytest.mark.parametrize(
    "mask_mod,match",
    [
        ("causal", "a function"),
        (bm_lib.create_block_mask(bm_lib.causal(), None, None, L, L + 1), "S=11 keys"),
        (bm_lib.create_block_mask(bm_lib.causal(), 3, None, L, L), "batch size 2"),
        (bm_lib.create_block_mask(bm_lib.causal(), None, 5, L, L), "2 heads"),
        (bm_lib.create_block_mask(bm_lib.causal(), None, None, L - 1, L), "11 query positions"),
    ],
    ids=["not-a-function", "keys", "batch", "heads", "queries"],
)
def test_layer_rejects_a_mask_mod_that_does_not_fit(rng, mask_mod, match):
    layer = _layer()
    x = rng.normal(size=(B, L, D)).astype("float32")
    with pytest.raises(ValueError, match=f"argument `mask_mod`.*{match}"):
        layer(x, x, mask_mod=mask_mod)


@pytest.mark.parametrize("kernel", ["chunked"] + (["dynamic"] if BACKEND != "jax" else []))
@pytest.mark.parametrize("name", ["global+sliding", "natten-2d", "dilated", "block-diagonal"])
def test_chunks_compute_only_the_runs_of_non_empty_blocks(rng, name, kernel, monkeypatch):
    """Unrolled chunks (torch's and eager TensorFlow's path) and a dynamic loop's
    (TensorFlow graphs): a chunk whose block map leaves empty key blocks inside its
    range computes each run of non-empty blocks on its own, forward and backward; no
    key block computed is empty for all the chunk's query blocks (a dynamic loop's
    chunks start from the last query, across the map's query blocks)."""
    t, s = 13, 14
    mask, dense = _block_mask(name, t, s)
    computed = []
    logits = chunked._Block.logits

    def recording(block):
        sizes = (block.start, block.size, block.lo, block.keys)
        computed.append(tuple(int(to_numpy(x)) for x in sizes))
        return logits(block)

    monkeypatch.setattr(chunked._Block, "logits", recording)
    _assert_matches(rng, kernel, masks.AttentionMask(block_mask=mask), dense, t, s)
    nonempty = (mask.kinds != bm_lib.EMPTY).any(axis=(0, 1))
    qb, kb = BLOCK
    chunks = set()
    for start, size, lo, keys in computed:
        chunks.add(start)
        for j in range(lo // kb, (lo + keys - 1) // kb + 1):
            assert nonempty[start // qb : (start + size - 1) // qb + 1, j].any()
    if name == "global+sliding":  # holes inside a chunk's key range
        assert len(computed) > 2 * len(chunks)  # some chunk took several runs


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("sinks", [False, True], ids=["bias", "bias+sinks"])
def test_block_mask_with_bias_soft_cap_and_sinks(rng, kernel, sinks):
    """The logit features beside a block mask (the bias's gradient summed over a
    chunk's runs of blocks); with sinks, a chunk takes its key range whole."""
    t, s = 13, 14
    mask, dense = _block_mask("global+sliding", t, s)
    arrays = list(_inputs(rng, t, s)) + [rng.standard_normal((1, N, t, s)).astype("float32")]
    if sinks:
        arrays.append(rng.standard_normal((N,)).astype("float32"))
    if kernel == "fused" and sinks:
        pytest.skip("the fused kernel takes no sinks")

    def run(kernel, attention_mask):
        def fn(q, k, v, bias, *rest):
            extra = dict(bias=bias)
            if kernel != "fused":
                extra.update(soft_cap=2.0, sinks=rest[0] if rest else None)
            if kernel == "explicit":
                return explicit.attention(
                    q, k, v, scale=0.5, equations=EQUATIONS, mask=attention_mask, **extra
                )[0]
            if kernel == "fused":
                return fused.attention(
                    q, k, v, scale=0.5, mask=attention_mask, chunk_size=4, **extra
                )
            loop, dynamic = kernel in ("looped", "dynamic"), kernel == "dynamic"
            return chunked.attention(
                q, k, v, scale=0.5, mask=attention_mask, chunk_size=4, key_block=5,
                loop=loop, dynamic=dynamic, **extra,
            )  # fmt: skip

        return fn

    out, grads = value_and_grads(run(kernel, masks.AttentionMask(block_mask=mask)), arrays)
    against = kernel if kernel == "fused" else "explicit"
    want, want_grads = _dense_gradients(lambda mask: run(against, mask), dense, arrays, against)
    np.testing.assert_allclose(out, want, atol=ATOL)
    for got, wanted in zip(grads, want_grads):
        np.testing.assert_allclose(got, wanted, atol=ATOL)


def test_compiled_decoding_step_with_a_block_mask(rng):
    """One compiled decode step (`jax.jit`, `tf.function` with XLA) for every index:
    the block mask's map is read at the traced cache position."""
    layer = _layer(num_key_value_heads=1)
    x = rng.normal(size=(B, L, D)).astype("float32")
    mod, _, _, _ = _global_sliding(L, L)  # made causal: decoding sees no later key
    causal = bm_lib.and_masks(bm_lib.causal(), mod)
    built = bm_lib.create_block_mask(causal, None, None, L, L, block_size=BLOCK)
    want = to_numpy(layer(x, x, mask_mod=built))
    step = compiled(
        lambda token, cache, index: layer(
            token, token, cache=cache, cache_update_index=index, mask_mod=built
        )
    )
    cache = layer.init_cache(B, L)
    outputs = []
    for t in range(L):
        token = ops.convert_to_tensor(x[:, t : t + 1])
        out, cache = step(token, cache, ops.convert_to_tensor(t, dtype="int32"))
        outputs.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), want, atol=1e-5)


@pytest.mark.parametrize("implementation", ["explicit", "fused", "chunked"])
def test_rows_with_no_key_as_the_builtin_gives_them(rng, implementation):
    """`fully_masked_rows="builtin"`: a row the block mask leaves without keys gets the
    values' mean where the built-in's would, as with the same dense mask; the empty
    rows are found one block of queries at a time."""
    layer = _layer(fully_masked_rows="builtin", implementation=implementation, chunk_size=4)
    x = rng.normal(size=(B, L, D)).astype("float32")

    def late_start(b, h, q_idx, kv_idx):  # queries 0..4 see nothing
        return ops.logical_and(ops.greater_equal(q_idx, 5), ops.greater_equal(q_idx, kv_idx))

    built = bm_lib.create_block_mask(late_start, None, None, L, L, block_size=BLOCK)
    dense = built.to_dense()
    want = to_numpy(layer(x, x, attention_mask=_dense_mask(dense)))
    np.testing.assert_allclose(to_numpy(layer(x, x, mask_mod=built)), want, atol=1e-5)
    empty = masks.AttentionMask(block_mask=built).empty_rows(L, L)
    np.testing.assert_array_equal(to_numpy(empty)[0, 0], ~dense[0, 0].any(axis=-1))


@pytest.mark.parametrize("implementation", [None, "explicit", "chunked"])
@pytest.mark.parametrize("name", ["dilated", "block-diagonal"])
def test_functional_attention_takes_a_mask_mod(rng, implementation, name):
    """`keras_mha.attention(..., mask_mod=)`: a function or a prebuilt `BlockMask`, with
    one key/value head serving both query heads, against the reference forward and
    backward (through the explicit kernel on the dense mask)."""
    t, s = 13, 14
    mod, batch, heads, dense = PATTERNS[name](t, s)
    built, _ = _block_mask(name, t, s)
    q, k, v = _inputs(rng, t, s)
    k, v = k[:, :, :1], v[:, :, :1]
    dense = np.broadcast_to(dense, (B, N, t, s))
    want, _ = reference_attention(q, np.repeat(k, N, axis=2), np.repeat(v, N, axis=2), dense)
    for given in (mod, built):

        def fn(q, k, v, given=given):
            return keras_mha.attention(
                q, k, v, mask_mod=given, implementation=implementation, chunk_size=4
            )

        out, grads = value_and_grads(fn, [q, k, v])
        np.testing.assert_allclose(out, want, atol=ATOL)

        def dense_fn(q, k, v):
            return keras_mha.attention(q, k, v, mask=ops.convert_to_tensor(dense))

        _, expected = value_and_grads(dense_fn, [q, k, v])
        for got, wanted in zip(grads, expected):
            np.testing.assert_allclose(got, wanted, atol=ATOL)


# ------------------------------------------------------------------------ saving
@keras.saving.register_keras_serializable(package="keras_mha_tests")
def _even_keys(b, h, q_idx, kv_idx):
    """A user's own `mask_mod`, registered as Keras saves functions."""
    return ops.equal(kv_idx % 2, 0)


SAVED_LENGTH = 13
SAVED_PATTERNS = {
    "named": lambda: bm_lib.and_masks(
        bm_lib.sliding_window(3), bm_lib.document([0] * 6 + [1] * 7, causal_within=False)
    ),
    "block_mask": lambda: bm_lib.create_block_mask(
        bm_lib.or_masks(bm_lib.prefix_lm(2), bm_lib.causal()),
        None,
        None,
        SAVED_LENGTH,
        SAVED_LENGTH,
        block_size=4,
    ),
    "registered_function": lambda: bm_lib.or_masks(_even_keys, bm_lib.causal()),
}


@pytest.mark.parametrize("which", sorted(SAVED_PATTERNS))
def test_a_functional_model_passing_a_mask_mod_saves_and_loads(which, tmp_path, rng):
    """The call argument `mask_mod` of a functional model (a named pattern, a
    `BlockMask`, a registered function of one's own) is saved with the model and
    applied after loading: the loaded model is the layer under the dense mask."""
    mask_mod = SAVED_PATTERNS[which]()
    x = keras.Input((SAVED_LENGTH, 8))
    layer = keras_mha.MultiHeadAttention(2, 4, name="attention")
    model = keras.Model(x, layer(x, x, mask_mod=mask_mod))
    data = rng.standard_normal((2, SAVED_LENGTH, 8)).astype("float32")
    path = tmp_path / f"{which}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    dense = mask_mod.to_dense() if isinstance(mask_mod, bm_lib.BlockMask) else None
    if dense is None:
        dense = bm_lib.create_block_mask(
            mask_mod, None, None, SAVED_LENGTH, SAVED_LENGTH
        ).to_dense()
    assert not dense.all() and dense.any(axis=-1).all()
    mask = np.broadcast_to(dense[0], (2, SAVED_LENGTH, SAVED_LENGTH))
    expected = to_numpy(loaded.get_layer("attention")(data, data, attention_mask=mask))
    unmasked = to_numpy(loaded.get_layer("attention")(data, data))
    assert np.abs(expected - unmasked).max() > 1e-3  # the mask matters
    np.testing.assert_allclose(to_numpy(loaded(data)), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(model(data)), expected, atol=1e-5)


def test_named_patterns_rebuild_from_their_config():
    patterns = [
        bm_lib.causal(),
        bm_lib.sliding_window(2, 1),
        bm_lib.prefix_lm(3),
        bm_lib.document([[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]]),
        bm_lib.and_masks(bm_lib.causal(), bm_lib.or_masks(bm_lib.sliding_window(1), _even_keys)),
    ]
    for pattern in patterns:
        config = keras.saving.serialize_keras_object(pattern)
        rebuilt = keras.saving.deserialize_keras_object(config)
        assert type(rebuilt) is bm_lib.MaskMod and rebuilt.get_config() == pattern.get_config()
        batch = 2 if pattern.name == "document" else None
        a, b = (bm_lib.create_block_mask(p, batch, None, 7, 7, 2) for p in (pattern, rebuilt))
        np.testing.assert_array_equal(a.to_dense(), b.to_dense())
        np.testing.assert_array_equal(a.kinds, b.kinds)
    with pytest.raises(ValueError, match="`name`.*Received: name='nope'"):
        bm_lib.MaskMod("nope")
