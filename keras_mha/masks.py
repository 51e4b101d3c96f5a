"""Attention masks, described rather than materialised.

A call's masks arrive in pieces: padding of the queries and of the keys (Keras implicit
masks, `query_mask`, `value_mask`, `key_mask`), causality with an offset (KV-cache
decoding), a sliding window, document ids of packed rows (`segment_ids`), and perhaps
a dense `attention_mask` from the user.
`AttentionMask` keeps them apart. Kernels ask it for the block they are working on
(`block`) and for the keys a block of queries can see at all (`key_range`), so no
`(B, ..., T, S)` tensor exists unless the user passed one.

Every boolean mask here means `True` = "may attend". The dense form, for the explicit
kernel and for subclasses written against the built-in layer, is `merge_masks`.

Packed rows: each position carries an integer document id; a query sees only keys of
its own document. Id 0 is padding (MaxText's convention): a query with id 0 attends to
nothing (zero output), a key with id 0 is seen by no query.
"""

import dataclasses
from typing import Any

from keras import backend, ops

from keras_mha._keras_private import get_keras_mask, set_keras_mask  # noqa: F401


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may attend to, as factors that are ANDed.

    Attributes:
        query_valid: `(B, T)` boolean padding of the queries, or `None`. A padded
            query attends to nothing: zero weights, zero context.
        key_valid: `(B, S)` boolean padding of the keys, or `None`.
        causal: query `t` sees keys `s <= t + offset`.
        offset: position of query 0 among the keys (KV-cache decoding): a Python
            int, or an int32 scalar tensor.
        window: `None`; an int `w`: query `t` sees keys with `|t + offset - s| < w`;
            or a pair `(left, right)`: keys with
            `t + offset - left <= s <= t + offset + right` (`w` is `(w - 1, w - 1)`).
        dense: `None` or the user's boolean mask, rank 4, broadcastable to
            `(B, N, T, S)`. For N-d attention, the whole merged mask in the scores'
            layout (the explicit kernel is the only one that runs then).
        query_segments: `(B, T)` integer document ids of the queries (packed rows),
            or `None`. Id 0 is padding: such a query attends to nothing.
        key_segments: `(B, S)` integer document ids of the keys; given whenever
            `query_segments` is. A key with id 0 is seen by no query.
        block_mask: `None` or a `block_mask.BlockMask`: a `mask_mod` over absolute
            positions (query `t` at `t + offset`) with its block map. `block`
            evaluates it on the block asked for only (not at all where the map says
            the block is full); `key_range` narrows by the map.
    """

    query_valid: Any = None
    key_valid: Any = None
    causal: bool = False
    offset: Any = 0
    window: int | tuple | None = None
    dense: Any = None
    query_segments: Any = None
    key_segments: Any = None
    block_mask: Any = None

    @property
    def is_empty(self):
        """Nothing is masked."""
        return (
            self.query_valid is None
            and self.key_valid is None
            and not self.causal
            and self.window is None
            and self.dense is None
            and self.query_segments is None
            and self.block_mask is None
        )

    @property
    def window_sides(self):
        """`(before, after)`: how many keys before and after its own position a query
        may see by the window (the module's `window_sides`), or `None` without one."""
        return window_sides(self.window)

    @property
    def static_offset(self):
        """The offset as a Python int, or `None` when it is a tensor."""
        return self.offset if isinstance(self.offset, int) else None

    def block_runs(self, query_start, query_size, lo, hi):
        """The runs of consecutive non-empty key blocks of the block mask that queries
        `[query_start, +query_size)` may see within keys `[lo, hi)`, as a list of
        `(lo, hi)` (`BlockMask.segments`); `None` without a block mask or where a size,
        the range or the offset is not a static int."""
        offset = self.static_offset
        sizes = (query_start, query_size, lo, hi)
        if self.block_mask is None or offset is None or not all(isinstance(x, int) for x in sizes):
            return None
        first = query_start + offset
        return self.block_mask.segments(first, first + query_size - 1, lo, hi)

    def key_range(self, query_start, query_size, key_length):
        """`(lo, hi)`: the keys that queries `[query_start, query_start + query_size)`
        may see at all, by causality and the window.

        Static ints for static arguments; scalar tensors where the start or a length is
        one (a chunk of a graph loop). The whole `(0, key_length)` when the offset is
        not static or a length is `None`.
        """
        offset = self.static_offset
        if offset is None or query_size is None or key_length is None:
            return 0, key_length
        lo, hi = 0, key_length
        last = query_start + query_size - 1 + offset
        if self.causal:
            hi = _minimum(hi, last + 1)
        if self.window is not None:
            before, after = self.window_sides
            hi = _minimum(hi, last + (after + 1))
            lo = _maximum(lo, query_start + offset - before)
        if self.block_mask is not None:
            first = query_start + offset
            b_lo, b_hi = self.block_mask.key_range(first, first + query_size - 1)
            lo, hi = _maximum(lo, b_lo), _minimum(hi, b_hi)
        hi = _maximum(0, hi)
        if isinstance(lo, int) and lo == 0:  # hi >= 0
            return 0, hi
        return _minimum(lo, hi), hi

    @property
    def data_dependent(self):
        """Whether the keys a chunk may see depend on data (query or key padding,
        document ids), known only at run time (`visible_keys`)."""
        keys = self.key_valid is not None and len(self.key_valid.shape) == 2
        return keys or self._query_padding or self.query_segments is not None

    @property
    def _query_padding(self):
        """A `(B, T)` query padding (not one broadcast along the queries)."""
        rows = self.query_valid
        return rows is not None and len(rows.shape) == 2 and rows.shape[1] != 1

    def visible_keys(self, query_start, query_size, key_length):
        """`(lo, hi)` like `key_range`, narrowed by every factor known only at run
        time: the keys that some query `[query_start, query_start + query_size)` of
        some batch row may see by its query and key padding and document ids, as well
        as by causality and the window. int32 scalar tensors; the range is never empty
        (a chunk that sees no key, or has no valid query, gets one, masked), so a
        block always has a key.

        A chunk of one document in packed rows sees only that document's keys: the
        cost of packed attention grows with the sum of squared document lengths.
        Needs a static `query_size` and `key_length` (else: `key_range`).
        """
        if not self.data_dependent or query_size is None or key_length is None:
            return self.key_range(query_start, query_size, key_length)
        lo, hi = self.visible_range(query_start, query_size, key_length)
        lo = ops.minimum(lo, key_length - 1)
        return lo, ops.maximum(hi, lo + 1)

    def visible_range(self, query_start, query_size, key_length):
        """`(lo, hi)` as int32 scalar tensors, like `visible_keys` but empty
        (`hi == lo`) where no query of the chunk, in any batch row, may see a key:
        a chunk whose queries are all padding, or whose documents' keys all lie
        outside its causal or window range. The compiled loop visits the key
        blocks of this range only (`chunked._Plan.key_blocks`).

        Needs a static `query_size` and `key_length`.
        """
        lo, hi = (_int32(x) for x in self.key_range(query_start, query_size, key_length))
        visible = None  # (B, S): some query of the chunk, in that batch row, may see it
        if self.query_segments is not None:
            rows = slice_along(self.query_segments, 1, query_start, query_size)
            same = same_segment(rows, self.key_segments)  # (B, q, S)
            if self.query_valid is not None:
                same = ops.logical_and(same, self._valid_rows(query_start, query_size))
            visible = ops.any(same, axis=1)
        if self.key_valid is not None and len(self.key_valid.shape) == 2:
            visible = logical_and(visible, self.key_valid)
        if visible is not None:
            visible = ops.any(visible, axis=0)  # (S,), or (1,) from a (B, 1) padding
            keys = ops.arange(key_length, dtype="int32")
            first = ops.min(ops.where(visible, keys, key_length))
            last = ops.max(ops.where(visible, keys, -1)) + 1
            lo, hi = ops.maximum(first, lo), ops.minimum(last, hi)
        if self.query_valid is not None and self.query_segments is None:
            # A chunk none of whose queries is valid sees no key.
            valid = ops.any(self._valid_rows(query_start, query_size))
            hi = ops.where(valid, hi, lo)
        return lo, ops.maximum(hi, lo)

    def _valid_rows(self, query_start, query_size):
        """`(B, q, 1)` query padding of the chunk (broadcast along the queries where
        it is `(B, 1)`)."""
        rows = self.query_valid
        if self._query_padding:
            rows = slice_along(rows, 1, query_start, query_size)
        return rows[:, :, None]

    def block(self, query_start, query_size, key_start, key_size):
        """The mask of queries `[query_start, +query_size)` against keys
        `[key_start, +key_size)`: boolean, broadcastable to `(B, N, q, k)`, or `None`.

        `query_size`/`key_size` of `None` mean "to the end" (from a start of 0).
        """
        parts = []
        if self.query_valid is not None:
            rows = slice_along(self.query_valid, 1, query_start, query_size)
            parts.append(rows[:, None, :, None])
        if self.key_valid is not None:
            cols = slice_along(self.key_valid, 1, key_start, key_size)
            parts.append(cols[:, None, None, :])
        if self.causal or self.window is not None:
            rows, cols = self._positions(query_start, query_size, key_start, key_size)
            if self.causal:
                parts.append(ops.greater_equal(rows, cols))
            if self.window is not None:
                parts.append(_in_window(rows - cols, self.window))
        if self.query_segments is not None:
            rows = slice_along(self.query_segments, 1, query_start, query_size)
            cols = slice_along(self.key_segments, 1, key_start, key_size)
            parts.append(same_segment(rows, cols)[:, None])
        if self.dense is not None:
            parts.append(block_of(self.dense, query_start, query_size, key_start, key_size))
        if self.block_mask is not None:
            query_size = self._length(query_size, 2)
            key_size = self._length(key_size, 3)
            first = query_start + self.offset
            parts.append(self.block_mask.block(first, query_size, key_start, key_size))
        return logical_and(*parts)

    def empty_rows(self, query_length, key_length):
        """Which query rows may see no key at all: boolean `(B or 1, N or 1, T)`, or
        `None` when every row sees one.

        The padding, causal and window factors are counted in `O(B * (T + S))`: the
        visible keys of row `t` form one range, and a prefix sum of the keys' padding
        counts the valid ones in it. A dense mask, or document ids, are reduced over
        the keys of the whole `(T, S)` block.
        """
        if self.block_mask is not None and isinstance(query_length, int):
            return self._empty_rows_by_blocks(query_length, key_length)
        if self.dense is not None or self.query_segments is not None or self.block_mask is not None:
            visible = self.block(0, query_length, 0, key_length)
            if visible is None:  # a block mask whose every block is full
                return None
            return ops.logical_not(ops.any(visible, axis=-1))
        if self.key_valid is None and not self.causal and self.window is None:
            if self.query_valid is None:
                return None
            return ops.logical_not(self.query_valid)[:, None, :]
        rows = ops.arange(query_length, dtype="int32") + self.offset  # (T,)
        lo = ops.zeros_like(rows)
        hi = ops.full_like(rows, key_length)
        if self.causal:
            hi = ops.minimum(hi, rows + 1)
        if self.window is not None:
            before, after = self.window_sides
            hi = ops.minimum(hi, rows + (after + 1))
            lo = ops.maximum(lo, rows - before)
        lo, hi = (ops.clip(x, 0, key_length) for x in (lo, hi))
        if self.key_valid is None:
            count = (hi - lo)[None, :]
        else:
            valid = ops.cast(self.key_valid, "int32")
            before = ops.concatenate([ops.zeros_like(valid[:, :1]), ops.cumsum(valid, 1)], 1)
            count = ops.take(before, hi, axis=1) - ops.take(before, lo, axis=1)  # (B, T)
        empty = ops.less_equal(count, 0)
        if self.query_valid is not None:
            empty = ops.logical_or(empty, ops.logical_not(self.query_valid))
        return empty[:, None, :]

    def _empty_rows_by_blocks(self, query_length, key_length):
        """`empty_rows` with a block mask, one block of query rows at a time over the
        keys its map leaves visible: never the whole `(T, S)` mask."""
        step = self.block_mask.block_size[0]
        parts = []
        for start in range(0, query_length, step):
            size = min(step, query_length - start)
            lo, hi = self.key_range(start, size, key_length)
            if isinstance(hi, int) and isinstance(lo, int) and hi <= lo:
                parts.append(ops.ones((1, 1, size), "bool"))
                continue
            visible = self.block(start, size, lo, hi - lo)
            if visible is None:
                parts.append(ops.zeros((1, 1, size), "bool"))
                continue
            parts.append(ops.logical_not(ops.any(visible, axis=-1)))
        lead = [tuple(p.shape[:2]) for p in parts]
        if not all(isinstance(d, int) for dims in lead for d in dims):  # unknown batch
            visible = self.block(0, query_length, 0, key_length)
            return ops.logical_not(ops.any(visible, axis=-1))
        batch, heads = (max(dims[i] for dims in lead) for i in (0, 1))
        parts = [ops.broadcast_to(p, (batch, heads, p.shape[2])) for p in parts]
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=-1)

    def _positions(self, query_start, query_size, key_start, key_size):
        """`(1, 1, q, 1)` query positions (offset added) and `(1, 1, 1, k)` key positions."""
        query_size = self._length(query_size, 2)
        key_size = self._length(key_size, 3)
        rows = ops.arange(query_size, dtype="int32") + (query_start + self.offset)
        cols = ops.arange(key_size, dtype="int32") + key_start
        return rows[None, None, :, None], cols[None, None, None, :]

    def _length(self, size, axis):
        if size is not None:
            return size
        raise ValueError(f"AttentionMask.block needs a size along axis {axis}")


def describe(
    query_mask=None,
    value_mask=None,
    key_mask=None,
    attention_mask=None,
    use_causal_mask=False,
    sliding_window=None,
    offset=None,
    segment_ids=None,
    key_segment_ids=None,
):
    """An `AttentionMask` from a call's arguments (rank-3 inputs), or `None`.

    Args:
        query_mask: `(B, T)`; value_mask, key_mask: `(B, S)`: bool, int or float.
        attention_mask: broadcastable to `(B, T, S)`, or with a heads axis to
            `(B, N, T, S)`.
        use_causal_mask: causal masking.
        sliding_window: `None`, a positive int or a `(left, right)` pair (see
            `AttentionMask.window`).
        offset: position of the first query among the keys; `None` means 0.
        segment_ids: `(B, T)` integer document ids of the queries (0 = padding), or
            `None`.
        key_segment_ids: `(B, S)` document ids of the keys; `None` takes
            `segment_ids` (self-attention, `S == T`).
    """
    dense = as_bool(attention_mask)
    if dense is not None:
        while len(dense.shape) < 3:
            dense = ops.expand_dims(dense, 0)
        if len(dense.shape) == 3:
            dense = ops.expand_dims(dense, 1)  # the heads axis
    mask = AttentionMask(
        query_valid=as_bool(query_mask),
        key_valid=logical_and(value_mask, key_mask),
        causal=bool(use_causal_mask),
        offset=0 if offset is None else offset,
        window=sliding_window,
        dense=dense,
        **segments(segment_ids, key_segment_ids),
    )
    return None if mask.is_empty else mask


def with_block_mask(mask, block_mask, offset):
    """`mask` (an `AttentionMask` or `None`) ANDed with a call's `block_mask.BlockMask`
    (its first query at `offset`, `None` for 0). A block mask that is exactly causal
    (`BlockMask.is_causal`) becomes causality itself, as `use_causal_mask=True`: the
    backends' causal kernels take it, no mask evaluated."""
    mask = mask or AttentionMask(offset=0 if offset is None else offset)
    if block_mask.is_causal:
        return dataclasses.replace(mask, causal=True)
    return dataclasses.replace(mask, block_mask=block_mask)


def segments(segment_ids, key_segment_ids=None):
    """`{"query_segments": ..., "key_segments": ...}` as int32 tensors (the keys'
    ids default to the queries'), or `{}` when no ids are given."""
    if segment_ids is None:
        return {}
    queries = as_int(segment_ids)
    keys = queries if key_segment_ids is None else as_int(key_segment_ids)
    return {"query_segments": queries, "key_segments": keys}


def same_segment(query_segments, key_segments):
    """`(B, q, k)` boolean: query and key in the same document, and not padding (id 0).

    Args:
        query_segments: `(B, q)` integer ids; key_segments: `(B, k)`.
    """
    rows, cols = query_segments[:, :, None], key_segments[:, None, :]
    return ops.logical_and(ops.equal(rows, cols), ops.not_equal(rows, 0))


def as_int(ids):
    """Integer ids (a tensor, NumPy array or list) as an int32 tensor."""
    if not hasattr(ids, "dtype"):
        ids = ops.convert_to_tensor(ids)
    if backend.standardize_dtype(ids.dtype) != "int32":
        ids = ops.cast(ids, "int32")
    return ids


def causal_mask(query_length, key_length, offset=0):
    """`(1, T, S)` lower-triangular mask: query `t` sees keys `s <= t + offset`.

    `offset` shifts query positions, as in KV-cache decoding where the `T` new queries
    sit at positions `offset ... offset + T - 1` of the cache.
    """
    rows = ops.expand_dims(ops.arange(query_length, dtype="int32") + offset, -1)
    cols = ops.expand_dims(ops.arange(key_length, dtype="int32"), 0)
    return ops.expand_dims(ops.greater_equal(rows, cols), 0)


def sliding_window_mask(query_length, key_length, window, offset=0):
    """`(1, T, S)` band: query `t` sees keys with `|t + offset - s| < window`, or with
    `window` a pair `(left, right)`, keys `t + offset - left <= s <= t + offset + right`."""
    rows = ops.expand_dims(ops.arange(query_length, dtype="int32") + offset, -1)
    cols = ops.expand_dims(ops.arange(key_length, dtype="int32"), 0)
    return ops.expand_dims(_in_window(rows - cols, window), 0)


def window_sides(window):
    """`(before, after)` of a window: an int `w` (`|t - s| < w`) sees `w - 1` keys on
    each side, a pair `(left, right)` sees `left` before and `right` after; `None`
    without a window."""
    if window is None:
        return None
    if isinstance(window, (tuple, list)):
        return int(window[0]), int(window[1])
    return window - 1, window - 1


def _in_window(distance, window):
    """Boolean: `distance = t - s` (query position minus key position) lies in the
    window. The symmetric int window is the one comparison it always was."""
    if not isinstance(window, (tuple, list)):
        return ops.less(ops.abs(distance), window)
    before, after = window_sides(window)
    return ops.logical_and(ops.less_equal(distance, before), ops.greater_equal(distance, -after))


def logical_and(*masks):
    """AND of the given masks (`None` entries ignored); `None` when all are `None`."""
    merged = None
    for mask in masks:
        if mask is None:
            continue
        mask = as_bool(mask)
        merged = mask if merged is None else ops.logical_and(merged, mask)
    return merged


def as_bool(mask):
    """Boolean view of a mask given as bool, integers or floats (nonzero is kept), as
    the built-in's `ops.cast(mask, "bool")` does; NumPy arrays and lists are converted."""
    if mask is None:
        return None
    if not hasattr(mask, "dtype"):
        mask = ops.convert_to_tensor(mask)
    if "bool" in str(mask.dtype):
        return mask
    return ops.cast(mask, "bool")


def merge_masks(
    query_length,
    key_length,
    query_mask=None,
    value_mask=None,
    key_mask=None,
    attention_mask=None,
    use_causal_mask=False,
    sliding_window=None,
    offset=0,
    segment_ids=None,
    key_segment_ids=None,
):
    """The built-in layer's mask merge, as one dense `(B or 1, T, S)` boolean mask.

    For N-d attention and for subclasses whose `_compute_attention` expects the
    built-in's dense mask; `None` when nothing is masked.

    Args:
        query_length, key_length: `T` and `S` (ints or scalar tensors).
        query_mask: `(B, T)` padding mask of the query; masks whole query rows.
        value_mask, key_mask: `(B, S)` padding masks of value / key; mask columns.
        attention_mask: user mask broadcastable to `(B, T, S)`.
        use_causal_mask: AND a causal mask (see `causal_mask`).
        sliding_window: AND a `sliding_window_mask` of this width.
        offset: position of the first query, for causal and window masks.
        segment_ids, key_segment_ids: document ids of packed rows (see `describe`);
            AND the block-diagonal mask of `same_segment`.
    """
    parts = []
    if query_mask is not None:
        parts.append(ops.expand_dims(as_bool(query_mask), -1))
    if value_mask is not None:
        parts.append(ops.expand_dims(as_bool(value_mask), -2))
    if key_mask is not None:
        parts.append(ops.expand_dims(as_bool(key_mask), -2))
    if use_causal_mask:
        parts.append(causal_mask(query_length, key_length, offset))
    if sliding_window is not None:
        parts.append(sliding_window_mask(query_length, key_length, sliding_window, offset))
    if segment_ids is not None:
        ids = segments(segment_ids, key_segment_ids)
        parts.append(same_segment(ids["query_segments"], ids["key_segments"]))
    merged = logical_and(*parts)
    if attention_mask is not None and merged is not None:
        # A user mask with a heads axis, (B, N, T, S): the (B or 1, T, S) parts get
        # theirs before T, as the scores do, instead of aligning B with N.
        merged = expand_to_scores(merged, len(attention_mask.shape), 1)
    return logical_and(attention_mask, merged)


def expand_to_scores(mask, scores_rank, num_attention_axes):
    """Inserts the heads (and other batch) axes so `mask` broadcasts to the scores."""
    if mask is None:
        return None
    axis = -2 * num_attention_axes - 1
    for _ in range(scores_rank - len(mask.shape)):
        mask = ops.expand_dims(mask, axis=axis)
    return mask


def _int32(x):
    """An int, or an integer scalar tensor, as an int32 scalar tensor."""
    if ops.is_tensor(x):
        return x if backend.standardize_dtype(x.dtype) == "int32" else ops.cast(x, "int32")
    return ops.convert_to_tensor(x, "int32")


def _minimum(a, b):
    """`min` of ints (or torch.export's symbolic ints), `ops.minimum` of tensors."""
    return ops.minimum(a, b) if ops.is_tensor(a) or ops.is_tensor(b) else min(a, b)


def _maximum(a, b):
    return ops.maximum(a, b) if ops.is_tensor(a) or ops.is_tensor(b) else max(a, b)


def slice_along(x, axis, start, size):
    """`x[..., start:start + size, ...]` along `axis`; `size=None` keeps the rest.

    Returns `x` itself when the slice is all of it (no copy)."""
    static_start = isinstance(start, int)
    if size is None:
        return (
            x if static_start and start == 0 else x[(slice(None),) * axis + (slice(start, None),)]
        )
    # A size given as a tensor (a graph loop's) is never compared: not a Python bool.
    if static_start and start == 0 and not ops.is_tensor(size) and x.shape[axis] == size:
        return x
    starts = [0] * len(x.shape)
    starts[axis] = start
    shape = list(ops.shape(x))
    shape[axis] = size
    return ops.slice(x, starts, shape)


def pad_along(x, axis, before, after):
    """`x` with `before` and `after` zeros along `axis` (static widths).

    Zeros joined on, not `ops.pad`: Keras's `pad` makes an `Operation` per call, whose
    name it registers in a global dict, which `torch.compile` cannot trace inside a
    custom gradient (the chunked kernel's backward): the graph broke there."""
    parts = []
    for width in (before, after):
        shape = list(ops.shape(x))
        shape[axis] = width
        parts.append(ops.zeros(shape, x.dtype) if width else None)
    pieces = [t for t in (parts[0], x, parts[1]) if t is not None]
    return pieces[0] if len(pieces) == 1 else ops.concatenate(pieces, axis=axis)


def block_of(x, query_start, query_size, key_start, key_size):
    """The `(query, key)` block of a tensor broadcastable to `(B, N, T, S)` (a dense
    mask, an attention bias), as rank 4; a broadcast axis of 1 stays as it is."""
    while len(x.shape) < 4:
        x = ops.expand_dims(x, 0)
    if x.shape[2] != 1:
        x = slice_along(x, 2, query_start, query_size)
    if x.shape[3] != 1:
        x = slice_along(x, 3, key_start, key_size)
    return x
