"""Attention patterns as code: a `mask_mod` and the block map built from it.

A `mask_mod(b, h, q_idx, kv_idx) -> bool` says whether query `q_idx` of batch row `b`
and head `h` may attend to key `kv_idx`. It is written in `keras.ops` and called on
broadcast int32 index tensors, `b` `(B, 1, 1, 1)`, `h` `(1, H, 1, 1)`, `q_idx`
`(1, 1, q, 1)` and `kv_idx` `(1, 1, 1, k)`, so one definition runs on TensorFlow, JAX
and torch:

    def causal(b, h, q_idx, kv_idx):
        return ops.greater_equal(q_idx, kv_idx)

`create_block_mask` evaluates it once, eagerly, a tile of whole blocks at a time (at
most 2 Mi entries: never the whole `(T, S)` grid), and records for every (query block,
key block) pair whether it is empty (no query sees any key: never computed), full (every
query sees every key: no mask needed) or partial. The named patterns `causal`,
`sliding_window` and `prefix_lm` are classified from each block's first and last
positions instead, without evaluating an entry: the same map, from `(T / q_block) x (S /
kv_block)` pairs. The `BlockMask` is plain NumPy plus the function: build it once, pass
it to every layer and every step. Kernels read it through
`masks.AttentionMask.block_mask`, ANDed with the call's other masks.

Positions are absolute: with a KV cache, `q_idx` is `cache_update_index + t`, so the
block mask of a decoder is built for `T = S = max_length`.

Saving: the named patterns below (and `and_masks` / `or_masks` of them) are `MaskMod`
objects, saved by name and arguments, and a `BlockMask` saves its `mask_mod` and sizes
(its block map is rebuilt on loading): a functional model that passes either as the
call argument `mask_mod` saves and loads. A function of your own saves as Keras saves
functions: register it with `keras.saving.register_keras_serializable()`.
"""

import math

import keras
import numpy as np
from keras import ops

EMPTY, PARTIAL, FULL = 0, 1, 2

# Entries of the `(B, H, q, k)` grid evaluated at once by `create_block_mask` and
# `to_dense` (a tile of whole blocks; at least one block).
_GRID_BUDGET = 1 << 21


@keras.saving.register_keras_serializable(package="keras_mha")
class BlockMask:
    """A `mask_mod` with its block map: which blocks are empty, partial or full.

    Made by `create_block_mask`; read by the kernels.

    Args:
        mask_mod: `fn(b, h, q_idx, kv_idx) -> bool tensor`, in `keras.ops`.
        kinds: int8 NumPy array `(B or 1, H or 1, ceil(T / q_block),
            ceil(S / kv_block))` of `EMPTY`, `PARTIAL`, `FULL`.
        query_length: `T`, the number of query positions described.
        key_length: `S`, the number of key positions described.
        block_size: `(q_block, kv_block)`.
        batch: `B`, or `None` when the mask is the same for every batch row
            (`mask_mod` is then called with `b = 0`).
        heads: `H`, or `None` when the same for every head (`h = 0`).
        causal_from: a query position from which every query's row is exactly
            causal, key `kv` seen by query `q` where `kv <= q` (found by
            `create_block_mask`; `None`: no such row). 0: the mask is causal
            (`is_causal`), which the kernels take as `use_causal_mask=True`
            (`masks.with_block_mask`), with the backend's own causal kernel where it
            has one; between 0 and `T` (a prefix-LM's queries past its prefix), the
            fused kernel takes those rows from its causal kernel
            (`kernels.fused`).
    """

    def __init__(
        self, mask_mod, kinds, query_length, key_length, block_size, batch, heads, causal_from=None
    ):
        self.mask_mod = mask_mod
        self.kinds = kinds
        self.query_length, self.key_length = int(query_length), int(key_length)
        causal_from = self.query_length if causal_from is None else int(causal_from)
        self.causal_from = min(causal_from, self.query_length)
        self.is_causal = self.causal_from == 0
        self.block_size = tuple(int(x) for x in block_size)
        self.batch, self.heads = batch, heads
        nonempty = (kinds != EMPTY).any(axis=(0, 1))  # (nq, nk): some batch row or head
        self._visible = nonempty
        blocks = np.arange(nonempty.shape[1])
        self._first = np.where(nonempty, blocks, nonempty.shape[1]).min(axis=1).astype("int32")
        self._stop = np.where(nonempty, blocks + 1, 0).max(axis=1).astype("int32")
        self._all_full = (kinds == FULL).all(axis=(0, 1))  # (nq, nk)

    def __repr__(self):
        q_block, kv_block = self.block_size
        return (
            f"BlockMask(T={self.query_length}, S={self.key_length}, "
            f"block_size=({q_block}, {kv_block}), batch={self.batch}, heads={self.heads}, "
            f"density={self.density:.3f})"
        )

    def get_config(self):
        """The `mask_mod` (serialized as Keras serializes objects) and the arguments
        of `create_block_mask`; the block map is rebuilt from them (`from_config`)."""
        return {
            "mask_mod": keras.saving.serialize_keras_object(self.mask_mod),
            "B": self.batch,
            "H": self.heads,
            "T": self.query_length,
            "S": self.key_length,
            "block_size": list(self.block_size),
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        mask_mod = keras.saving.deserialize_keras_object(config.pop("mask_mod"))
        return create_block_mask(mask_mod, **config)

    @property
    def shape(self):
        """`(B or 1, H or 1, T, S)`: the dense mask this describes."""
        return self.kinds.shape[:2] + (self.query_length, self.key_length)

    @property
    def density(self):
        """The fraction of (query block, key block) pairs that are not empty."""
        return float((self.kinds != EMPTY).mean())

    def picture(self):
        """The block map as text, one line per query block: `#` full, `+` partial,
        `.` empty (batch row 0, head 0)."""
        chars = np.array([".", "+", "#"])
        return "\n".join("".join(chars[row]) for row in self.kinds[0, 0])

    def to_dense(self):
        """The whole mask as a NumPy bool array `(B or 1, H or 1, T, S)`, for
        debugging and tests (it holds `T x S` entries)."""
        dense = np.empty(self.kinds.shape[:2] + (self.query_length, self.key_length), bool)
        for (q0, qn, k0, kn), grid in _grids(self):
            dense[:, :, q0 : q0 + qn, k0 : k0 + kn] = grid
        return dense

    def _tiles(self):
        """`(query_start, query_size, key_start, key_size)` of the grid's tiles, in
        order: whole blocks, at most `_GRID_BUDGET` entries each (at least one block),
        a row of query blocks split along the keys only where it holds more."""
        (q_block, kv_block), lead = self.block_size, int(np.prod(self.kinds.shape[:2]))
        per_key_block = lead * q_block * kv_block
        key_step = max(1, _GRID_BUDGET // per_key_block) * kv_block
        key_step = min(key_step, self.kinds.shape[3] * kv_block)  # at most the whole row
        query_step = max(1, _GRID_BUDGET // (lead * q_block * key_step)) * q_block
        return [
            (q0, min(query_step, self.query_length - q0), k0, min(key_step, self.key_length - k0))
            for q0 in range(0, self.query_length, query_step)
            for k0 in range(0, self.key_length, key_step)
        ]

    def evaluate(self, query_start, query_size, key_start, key_size):
        """The mask of query positions `[query_start, +query_size)` against keys
        `[key_start, +key_size)`: a boolean tensor broadcastable to
        `(B, H, q, k)`. Starts may be scalar tensors (a compiled loop's)."""
        batch, heads = self.kinds.shape[:2]
        b, h = _indices(0, batch, 0), _indices(0, heads, 1)
        q_idx, kv_idx = _indices(query_start, query_size, 2), _indices(key_start, key_size, 3)
        return _apply(self.mask_mod, b, h, q_idx, kv_idx)

    def block(self, query_start, query_size, key_start, key_size):
        """Like `evaluate`, but `None` where the block map says every entry is true
        (all the blocks covered are full: the mask is skipped)."""
        if self.covers_full(query_start, query_size, key_start, key_size):
            return None
        return self.evaluate(query_start, query_size, key_start, key_size)

    def covers_full(self, query_start, query_size, key_start, key_size):
        """Whether, with static ints, every block the range touches is full."""
        sizes = (query_start, query_size, key_start, key_size)
        if not all(isinstance(x, (int, np.integer)) for x in sizes) or 0 in sizes[1::2]:
            return False
        q_block, kv_block = self.block_size
        rows = slice(query_start // q_block, (query_start + query_size - 1) // q_block + 1)
        cols = slice(key_start // kv_block, (key_start + key_size - 1) // kv_block + 1)
        return bool(self._all_full[rows, cols].all())

    def key_range(self, first_query, last_query):
        """`(lo, hi)`: the keys some query among positions `[first_query,
        last_query]` may see by the block map (whole key blocks); `lo >= hi` when
        none. Python ints for ints, int32 scalar tensors for tensors."""
        q_block, kv_block = self.block_size
        last_block = self._first.shape[0] - 1
        if isinstance(first_query, (int, np.integer)) and isinstance(last_query, (int, np.integer)):
            first = max(0, min(int(first_query) // q_block, last_block))
            last = max(0, min(int(last_query) // q_block, last_block))
            if last < first:
                return 0, 0
            lo = int(self._first[first : last + 1].min()) * kv_block
            hi = min(int(self._stop[first : last + 1].max()) * kv_block, self.key_length)
            return lo, hi
        inside = self._query_blocks(first_query, last_query)
        nk = self._visible.shape[1]
        lo = ops.min(ops.where(inside, ops.convert_to_tensor(self._first), nk)) * kv_block
        hi = ops.max(ops.where(inside, ops.convert_to_tensor(self._stop), 0)) * kv_block
        return lo, ops.minimum(hi, self.key_length)

    def segments(self, first_query, last_query, lo, hi):
        """The runs of consecutive non-empty key blocks that some query among
        positions `[first_query, last_query]` may see, within keys `[lo, hi)`: a
        list of `(lo, hi)` key ranges, ascending (static ints only)."""
        q_block, kv_block = self.block_size
        last_block = self._visible.shape[0] - 1
        first = max(0, min(first_query // q_block, last_block))
        last = max(0, min(last_query // q_block, last_block))
        nonempty = self._visible[first : last + 1].any(axis=0)
        runs, begin = [], None
        for j, visible in enumerate(list(nonempty) + [False]):
            if visible and begin is None:
                begin = j
            elif not visible and begin is not None:
                start, stop = max(lo, begin * kv_block), min(hi, j * kv_block)
                if start < stop:
                    runs.append((start, stop))
                begin = None
        return runs

    def _query_blocks(self, first_query, last_query):
        """`(nq,)` boolean tensor: the query blocks holding positions in
        `[first_query, last_query]`."""
        q_block = self.block_size[0]
        blocks = ops.arange(self._first.shape[0], dtype="int32")
        first = ops.cast(first_query, "int32") // q_block
        last = ops.cast(last_query, "int32") // q_block
        return ops.logical_and(ops.greater_equal(blocks, first), ops.less_equal(blocks, last))

    def visit_order(self, first_query, last_query, lo, hi, key_length, unit=1):
        """`(order, count)`, int32 tensors: the units of `unit` consecutive key
        blocks (`unit * kv_block` keys) some query among positions `[first_query,
        last_query]` may see, that also overlap keys `[lo, hi)`, are `order[:count]`,
        ascending (the rest of `order` is the other units). A compiled loop visits
        those and no other."""
        kv_block = self.block_size[1] * unit
        inside = self._query_blocks(first_query, last_query)  # (nq,)
        visible = self._visible
        if unit > 1:  # a unit is visible where one of its blocks is
            nq, nk = visible.shape
            padded = np.zeros((nq, -(-nk // unit) * unit), bool)
            padded[:, :nk] = visible
            visible = padded.reshape(nq, -1, unit).any(axis=2)
        nk = visible.shape[1]
        visible = ops.convert_to_tensor(visible)  # (nq, nk)
        nonempty = ops.any(ops.logical_and(visible, inside[:, None]), axis=0)  # (nk,)
        blocks = ops.arange(nk, dtype="int32")
        starts = blocks * kv_block
        overlaps = ops.logical_and(
            ops.less(starts, hi), ops.greater(ops.minimum(starts + kv_block, key_length), lo)
        )
        nonempty = ops.logical_and(nonempty, overlaps)
        order = ops.cast(ops.argsort(ops.where(nonempty, blocks, blocks + nk)), "int32")
        return order, ops.sum(ops.cast(nonempty, "int32"))


def create_block_mask(mask_mod, B, H, T, S, block_size=128):
    """Evaluates `mask_mod` tile by tile and records its block map.

    The mask is evaluated eagerly, in tiles of whole blocks holding at most 2 Mi
    entries of the `(B, H, T, S)` grid (a row of query blocks split along the keys
    where it holds more), and reduced per block on the host;
    only the map `(B, H, T / q_block, S / kv_block)` is kept. Build it once (outside
    any `jit` or `tf.function`) and reuse it for every layer and step.

    Args:
        mask_mod: `fn(b, h, q_idx, kv_idx) -> bool`, written in `keras.ops` over the
            broadcast int32 index tensors `b` `(B, 1, 1, 1)`, `h` `(1, H, 1, 1)`,
            `q_idx` `(1, 1, q, 1)` and `kv_idx` `(1, 1, 1, k)`. Index captured
            tensors with `ops.take`, not Python indexing.
        B: batch size, or `None` when the mask does not depend on `b`.
        H: number of (query) heads, or `None` when it does not depend on `h`.
        T: number of query positions (with a KV cache: the cache's length).
        S: number of key positions.
        block_size: an int, or `(q_block, kv_block)`.

    Returns:
        A `BlockMask`.
    """
    from keras_mha import checks

    if not callable(mask_mod):
        raise checks.invalid("mask_mod", "a function `(b, h, q_idx, kv_idx) -> bool`", mask_mod)
    for name, value in (("B", B), ("H", H)):
        checks.positive_int(name, value, allow_none=True)
    for name, value in (("T", T), ("S", S)):
        checks.positive_int(name, value)
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise checks.invalid("block_size", "an int or a pair of ints", block_size)
        for value in block_size:
            checks.positive_int("block_size", value)
        block_size = tuple(int(x) for x in block_size)
    else:
        block_size = (checks.positive_int("block_size", block_size),) * 2
    q_block, kv_block = block_size
    lead = (B or 1, H or 1)
    nq, nk = math.ceil(T / q_block), math.ceil(S / kv_block)
    if isinstance(mask_mod, MaskMod) and mask_mod.name in _BLOCK_KINDS:
        queries, keys = _block_bounds(T, q_block), _block_bounds(S, kv_block)
        bounds = (*queries[:, :, None], *keys[:, None, :])
        by_block = _BLOCK_KINDS[mask_mod.name](*bounds, **mask_mod.config)
        kinds = np.broadcast_to(by_block.astype(np.int8), lead + (nq, nk)).copy()
        causal_from = _CAUSAL_FROM.get(mask_mod.name, lambda **_: None)(**mask_mod.config)
        return BlockMask(mask_mod, kinds, T, S, block_size, B, H, causal_from)
    kinds = np.empty(lead + (nq, nk), np.int8)
    draft = BlockMask(mask_mod, np.ones(lead + (nq, nk), np.int8), T, S, block_size, B, H)
    queries, keys = _block_bounds(T, q_block), _block_bounds(S, kv_block)
    causal = _causal_kinds(*queries[:, :, None], *keys[:, None, :])  # (nq, nk)
    causal_rows = np.ones(nq, bool)  # per query block: its rows exactly causal
    for (q0, _, k0, _), dense in _grids(draft):
        some, every = _reduce(dense, q_block, kv_block)
        rows = slice(q0 // q_block, q0 // q_block + some.shape[2])
        cols = slice(k0 // kv_block, k0 // kv_block + some.shape[3])
        kinds[:, :, rows, cols] = _kinds(every, some)
        tile_kinds, tile_causal = kinds[:, :, rows, cols], causal[rows, cols]
        causal_rows[rows] &= _causal_rows(dense, tile_kinds, tile_causal, q0, k0, draft)
    first = len(causal_rows) - np.argmin(causal_rows[::-1]) if not causal_rows.all() else 0
    return BlockMask(mask_mod, kinds, T, S, block_size, B, H, min(first * q_block, T))


def _causal_rows(dense, kinds, causal, q_start, k_start, mask):
    """Per row of blocks of a tile from query `q_start` and key `k_start` (`dense`,
    its evaluated `(B, H, q, k)` grid; `kinds`, its blocks), whether its part of the
    row is exactly causal: its blocks' kinds are causal's (`causal`), and each
    partial block holds `kv <= q` entry by entry (causal's diagonal: a few blocks per
    row, read from the grid already evaluated)."""
    rows = (kinds == np.broadcast_to(causal, kinds.shape)).all(axis=(0, 1, 3))
    q_block, kv_block = mask.block_size
    for i, j in zip(*np.nonzero(causal == PARTIAL)):
        if not rows[i]:
            continue
        q0, k0 = i * q_block, j * kv_block
        block = dense[:, :, q0 : q0 + q_block, k0 : k0 + kv_block]
        q = np.arange(q_start + q0, q_start + q0 + block.shape[2])[:, None]
        kv = np.arange(k_start + k0, k_start + k0 + block.shape[3])
        rows[i] = np.array_equal(block, np.broadcast_to(q >= kv, block.shape))
    return rows


def _block_bounds(length, block):
    """`(2, n)` int64: each block's first and last position."""
    first = np.arange(0, length, block, dtype=np.int64)
    return np.stack([first, np.minimum(first + block, length) - 1])


def _kinds(every, some):
    return np.where(every, FULL, np.where(some, PARTIAL, EMPTY))


def _indices(start, size, axis):
    """int32 indices `[start, start + size)` along `axis` of a 4-D tensor; `start` may
    be a scalar tensor (a compiled loop's). From NumPy where it is an int: one op
    (describing a mask calls this for every tile: TensorFlow's eager ops are slow)."""
    shape = [1, 1, 1, 1]
    shape[axis] = size
    if isinstance(start, (int, np.integer)):
        return ops.convert_to_tensor(np.arange(start, start + size, dtype=np.int32).reshape(shape))
    return ops.reshape(ops.arange(size, dtype="int32") + start, shape)


def _apply(mask_mod, b, h, q_idx, kv_idx):
    """`mask_mod` on the index tensors, as a 4-D bool tensor."""
    out = ops.convert_to_tensor(mask_mod(b, h, q_idx, kv_idx))
    if "bool" not in str(out.dtype):
        out = ops.cast(out, "bool")
    while len(out.shape) < 4:
        out = ops.expand_dims(out, 0)
    return out


def _grids(mask):
    """`((query_start, query_size, key_start, key_size), grid)` for each of `mask`'s
    tiles, `grid` its `(B or 1, H or 1, q, k)` NumPy bool values: the index tensors
    made once per row and column of tiles, not per tile."""
    lead = mask.kinds.shape[:2]
    b, h = _indices(0, lead[0], 0), _indices(0, lead[1], 1)
    row, q_idx, columns = None, None, {}
    for q0, qn, k0, kn in mask._tiles():
        if row != q0:  # the tiles go row by row
            row, q_idx = q0, _indices(q0, qn, 2)
        if k0 not in columns:
            columns[k0] = _indices(k0, kn, 3)
        grid = _apply(mask.mask_mod, b, h, q_idx, columns[k0])
        grid = np.asarray(ops.convert_to_numpy(grid), bool)
        yield (q0, qn, k0, kn), np.broadcast_to(grid, lead + (qn, kn))


# A word of 8 true bytes: `_reduce` reads a grid of whole blocks 8 entries at a time.
_TRUE_WORD = np.frombuffer(np.ones(8, bool).tobytes(), np.uint64)[0]


def _reduce(dense, q_block, kv_block):
    """`(some, every)` per block of a `(B, H, q, k)` grid (from a block's start):
    whether some entry, and every entry that exists, is true."""
    batch, heads, rows, keys = dense.shape
    nq, nk = math.ceil(rows / q_block), math.ceil(keys / kv_block)
    pad = ((0, 0), (0, 0), (0, nq * q_block - rows), (0, nk * kv_block - keys))
    shape = (batch, heads, nq, q_block, nk, kv_block)
    if not any(after for _, after in pad) and kv_block % 8 == 0:
        # Whole blocks: the grid as words of 8 entries, ORed and ANDed over each block's
        # query rows (whole rows at a time), then over each block's words.
        words = np.ascontiguousarray(dense).view(np.uint64)
        words = words.reshape(batch, heads, nq, q_block, -1)
        some, every = np.bitwise_or.reduce(words, axis=3), np.bitwise_and.reduce(words, axis=3)
        some = np.bitwise_or.reduce(some.reshape(batch, heads, nq, nk, -1), axis=4)
        every = np.bitwise_and.reduce(every.reshape(batch, heads, nq, nk, -1), axis=4)
        return some != 0, every == _TRUE_WORD
    some = np.pad(dense, pad, constant_values=False).reshape(shape).any(axis=(3, 5))
    every = np.pad(dense, pad, constant_values=True).reshape(shape).all(axis=(3, 5))
    return some, every


# ----------------------------------------------------------------- combining masks
def and_masks(*mask_mods):
    """A `mask_mod` true where all of `mask_mods` are."""
    _check_mask_mods(mask_mods)
    return MaskMod("and", mask_mods=list(mask_mods))


def or_masks(*mask_mods):
    """A `mask_mod` true where any of `mask_mods` is."""
    _check_mask_mods(mask_mods)
    return MaskMod("or", mask_mods=list(mask_mods))


def _check_mask_mods(mask_mods):
    if not mask_mods or not all(callable(m) for m in mask_mods):
        from keras_mha import checks

        raise checks.invalid("mask_mods", "one or more functions", mask_mods)


def _combined(op):
    def build(mask_mods):
        def combined(b, h, q_idx, kv_idx):
            out = mask_mods[0](b, h, q_idx, kv_idx)
            for mask_mod in mask_mods[1:]:
                out = op(out, mask_mod(b, h, q_idx, kv_idx))
            return out

        return combined

    return build


# -------------------------------------------------------------- named patterns
def causal():
    """Query `q` sees keys `kv <= q`."""
    return MaskMod("causal")


def sliding_window(left, right=0):
    """Query `q` sees keys `q - left <= kv <= q + right` (`right=0`: causal window
    of `left + 1` keys)."""
    return MaskMod("sliding_window", left=int(left), right=int(right))


def prefix_lm(prefix_length):
    """Causal, and every query sees the first `prefix_length` keys (PaliGemma's
    bidirectional prefix)."""
    return MaskMod("prefix_lm", prefix_length=int(prefix_length))


def document(ids, causal_within=True):
    """Packed rows: a query sees keys of its own document (ids `(S,)` or `(B, S)`,
    positions of queries and keys alike), causally unless `causal_within=False`."""
    ids = np.asarray(ops.convert_to_numpy(ids) if hasattr(ids, "dtype") else ids)
    return MaskMod("document", ids=ids.astype("int32").tolist(), causal_within=bool(causal_within))


def _causal():
    def mask_mod(b, h, q_idx, kv_idx):
        return ops.greater_equal(q_idx, kv_idx)

    return mask_mod


def _sliding_window(left, right):
    def mask_mod(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return ops.logical_and(ops.less_equal(distance, left), ops.greater_equal(distance, -right))

    return mask_mod


def _prefix_lm(prefix_length):
    causal_mask = _causal()

    def mask_mod(b, h, q_idx, kv_idx):
        return ops.logical_or(causal_mask(b, h, q_idx, kv_idx), ops.less(kv_idx, prefix_length))

    return mask_mod


def _document(ids, causal_within):
    ids = ops.convert_to_tensor(np.asarray(ids, "int32"))
    length = ids.shape[-1]
    flat = ops.reshape(ids, (-1,))

    def mask_mod(b, h, q_idx, kv_idx):
        row = b * length if len(ids.shape) == 2 else 0
        same = ops.equal(ops.take(flat, row + q_idx), ops.take(flat, row + kv_idx))
        return ops.logical_and(same, ops.greater_equal(q_idx, kv_idx)) if causal_within else same

    return mask_mod


# The named patterns: name -> a builder of the function from the pattern's arguments.
_PATTERNS = {
    "causal": _causal,
    "sliding_window": _sliding_window,
    "prefix_lm": _prefix_lm,
    "document": _document,
    "and": _combined(ops.logical_and),
    "or": _combined(ops.logical_or),
}


# Named patterns whose block map follows from each block's bounds: name -> a function of
# the query blocks' first and last positions `(qs, qe)` and the key blocks' `(ks, ke)`
# (broadcast arrays) and the pattern's arguments, returning the blocks' kinds. Exact:
# over a block, `q - kv` takes every value from `qs - ke` to `qe - ks`.
def _causal_kinds(qs, qe, ks, ke):
    return _kinds(qs >= ke, qe >= ks)


def _sliding_window_kinds(qs, qe, ks, ke, left, right):
    low, high = qs - ke, qe - ks  # the block's range of `q - kv`
    return _kinds((low >= -right) & (high <= left), (high >= -right) & (low <= left))


def _prefix_lm_kinds(qs, qe, ks, ke, prefix_length):
    return _kinds(ke <= np.maximum(prefix_length - 1, qs), (ks < prefix_length) | (qe >= ks))


_BLOCK_KINDS = {
    "causal": _causal_kinds,
    "sliding_window": _sliding_window_kinds,
    "prefix_lm": _prefix_lm_kinds,
}

# Named patterns whose rows are exactly causal from a query position on: name -> a
# function of the pattern's arguments giving that position (a prefix-LM's query
# `q >= prefix_length - 1` sees `kv <= q`, its prefix included: causal).
_CAUSAL_FROM = {
    "causal": lambda: 0,
    "prefix_lm": lambda prefix_length: max(0, prefix_length - 1),
}


@keras.saving.register_keras_serializable(package="keras_mha")
class MaskMod:
    """A named `mask_mod` (`causal()`, `sliding_window(...)`, `and_masks(...)`, ...):
    called as the function it names, saved by its name and arguments.

    Args:
        name: one of `causal`, `sliding_window`, `prefix_lm`, `document`, `and`, `or`.
        **config: the pattern's arguments, plain data (`and` / `or`: `mask_mods`, a
            list of functions).
    """

    def __init__(self, name, **config):
        if name not in _PATTERNS:
            from keras_mha import checks

            raise checks.invalid("name", f"one of {sorted(_PATTERNS)}", name)
        self.name, self.config = name, config
        self._fn = _PATTERNS[name](**config)

    def __call__(self, b, h, q_idx, kv_idx):
        return self._fn(b, h, q_idx, kv_idx)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items() if k != "ids")
        return f"{self.name}({args})"

    def get_config(self):
        config = dict(self.config)
        if "mask_mods" in config:
            config["mask_mods"] = [
                keras.saving.serialize_keras_object(m) for m in config["mask_mods"]
            ]
        return {"name": self.name, **config}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if "mask_mods" in config:
            config["mask_mods"] = [
                keras.saving.deserialize_keras_object(m) for m in config["mask_mods"]
            ]
        return cls(**config)


# ------------------------------------------------------------------ a layer's call
# Block masks the layer built from a bare `mask_mod`, by (mask_mod, T, S): the same
# function on the same lengths is evaluated once. Oldest first; a few kept.
_BUILT = {}
_BUILT_KEPT = 16


def for_call(mask_mod, batch, heads, query_length, key_length, offset, cached):
    """The `BlockMask` of a layer call's `mask_mod` argument, checked against the call.

    Args:
        mask_mod: a `BlockMask`, or a function: then built (once per function and
            lengths) with `B = H = None`, eagerly (outside any graph being traced).
        batch: the call's `B` (`None` when unknown).
        heads: the layer's number of heads.
        query_length: `T` of the call (`None` when unknown).
        key_length: `S` (with a KV cache, its length).
        offset: position of the first query: `None`, an int or a scalar tensor.
        cached: a KV cache is used: queries sit anywhere in `[0, S)`, so a function
            is built for `T = S`.
    """
    from keras_mha import checks

    if isinstance(mask_mod, BlockMask):
        checks.block_mask(mask_mod, batch, heads, query_length, key_length, offset)
        return mask_mod
    if not callable(mask_mod):
        raise checks.invalid(
            "mask_mod", "a function `(b, h, q_idx, kv_idx) -> bool` or a `BlockMask`", mask_mod
        )
    positions = key_length if cached else query_length
    if not (checks.is_known(positions) and checks.is_known(key_length)):
        raise checks.invalid(
            "mask_mod",
            "a `BlockMask` (`keras_mha.block_mask.create_block_mask`) where the lengths are "
            "unknown when tracing; a function needs static `T` and `S`",
            mask_mod,
            f"with T={query_length}, S={key_length}",
        )
    key = (mask_mod, int(positions), int(key_length))
    if key not in _BUILT:
        while len(_BUILT) >= _BUILT_KEPT:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = _eagerly(lambda: create_block_mask(mask_mod, None, None, *key[1:]))
    built = _BUILT[key]
    checks.block_mask(built, batch, heads, query_length, key_length, offset)
    return built


def _eagerly(build):
    """`build()` outside the graph being traced: TensorFlow's `tf.function`, or
    JAX's `jit` (its ops on concrete arrays then run at once)."""
    from keras import backend

    if backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.init_scope():
            return build()
    if backend.backend() == "jax":
        import jax

        with jax.ensure_compile_time_eval():
            return build()
    return build()
