"""Attention masks: causal, sliding-window and Keras implicit masks, merged and broadcast.

Every mask here is boolean with `True` meaning "may attend". Merged masks have shape
`(B or 1, T, S)` for sequence inputs, or `(B or 1, <query attention dims>,
<key attention dims>)` for N-d attention, and are broadcast to the scores' shape by
inserting axes just before the query attention dims.
"""

from keras import ops

from keras_mha._keras_private import get_keras_mask, set_keras_mask  # noqa: F401


def causal_mask(query_length, key_length, offset=0):
    """`(1, T, S)` lower-triangular mask: query `t` sees keys `s <= t + offset`.

    `offset` shifts query positions, as in KV-cache decoding where the `T` new queries
    sit at positions `offset ... offset + T - 1` of the cache.
    """
    rows = ops.expand_dims(ops.arange(query_length, dtype="int32") + offset, -1)
    cols = ops.expand_dims(ops.arange(key_length, dtype="int32"), 0)
    return ops.expand_dims(ops.greater_equal(rows, cols), 0)


def sliding_window_mask(query_length, key_length, window, offset=0):
    """`(1, T, S)` band: query `t` sees keys with `|t + offset - s| < window`."""
    rows = ops.expand_dims(ops.arange(query_length, dtype="int32") + offset, -1)
    cols = ops.expand_dims(ops.arange(key_length, dtype="int32"), 0)
    return ops.expand_dims(ops.less(ops.abs(rows - cols), window), 0)


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
    """Boolean view of a mask given as bool, integers or floats: non-zero is kept, as
    the built-in's `ops.cast(mask, "bool")` reads it."""
    if mask is None or _is_bool(mask):
        return mask
    return ops.not_equal(mask, 0)


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
):
    """The built-in layer's mask merge, as one `(B or 1, T, S)` boolean mask or `None`.

    Args:
        query_length, key_length: `T` and `S` (ints or scalar tensors).
        query_mask: `(B, T)` padding mask of the query; masks whole query rows.
        value_mask, key_mask: `(B, S)` padding masks of value / key; mask columns.
        attention_mask: user mask broadcastable to `(B, T, S)`.
        use_causal_mask: AND a causal mask (see `causal_mask`).
        sliding_window: AND a `sliding_window_mask` of this width.
        offset: position of the first query, for causal and window masks.
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


def rows_with_keys(mask, num_attention_axes):
    """`True` where a query position has at least one key it may attend to.

    Reduces over the key attention axes of a scores-shaped mask, keeping them as 1s.
    """
    key_axes = tuple(range(-num_attention_axes, 0))
    return ops.any(mask, axis=key_axes, keepdims=True)


def _is_bool(x):
    return "bool" in str(x.dtype)
