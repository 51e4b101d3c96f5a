"""The arithmetic every kernel shares, from logits to weights.

Order, for a query row against its keys:

    logits  = (q * scale) . k                 float32
    logits  = cap * tanh(logits / cap)        with a soft cap
    logits += bias                            with an attention bias
    logits  = score_mod(logits, b, h, q, k)   with a score function (`score_mod.py`)
    logits  = masked where the mask is False
    weights = exp(logits - L)                 L = log(sum(exp(logits)) + exp(sink))
    weights = weights * keep / (1 - rate)     attention dropout

A row with no key to attend to gets zero weights. The dropout mask is a hash of the
seed and each weight's position, so every kernel, chunked or not, forward or backward,
drops the same weights for the same seed.
"""

from keras import backend, ops

MASKED = -1e9  # the logit of a masked entry, zeroed after the exponential
NO_KEYS = 1e30  # the logsumexp of a row with no keys: every weight underflows to 0
# A row of an additive mask (a bias) whose largest entry is below this has no key left
# in practice (`exp(-1000)` is 0 in float32): keras-hub's T5Gemma puts -1e9 there.
NO_KEY_BIAS = -1e3


def logits(query, key_t):
    """`query @ key_t` in float32: `(..., T, H) @ (..., H, S)`; float16 inputs are
    upcast first (their logits can overflow)."""
    if backend.standardize_dtype(query.dtype) == "float16":
        query, key_t = ops.cast(query, "float32"), ops.cast(key_t, "float32")
    return ops.cast(ops.matmul(query, key_t), "float32")


def soft_cap(x, cap):
    """`cap * tanh(x / cap)`; also returns `tanh(x / cap)` for the derivative."""
    squashed = ops.tanh(x / cap)
    return squashed * cap, squashed


def sink_logits(sinks, rank, heads_axis):
    """Sinks `(N,)` as float32, shaped to broadcast along `heads_axis` of a rank-`rank`
    logits tensor."""
    shape = [1] * rank
    shape[heads_axis] = -1
    return ops.reshape(ops.cast(sinks, "float32"), shape)


def softmax(x, mask, axes, sinks=None, empty_rows="zero"):
    """Float32 masked softmax over `axes`, with optional sink logits in the
    denominator; masked entries get weight 0, and key-less rows zero weights
    (`empty_rows="zero"`) or uniform ones (`"mean"`, no sinks: what
    `keras.ops.dot_product_attention` gives them).

    The mask is added to the logits as a bias (`mask_bias`): a masked entry's weight
    underflows to exactly 0 in every row that has a key to attend to. With "mean",
    masked logits are replaced by `MASKED` instead, so a key-less row's are all equal.
    """
    mean = empty_rows == "mean" and mask is not None
    if mean:
        x = ops.where(mask, x, ops.full((), MASKED, "float32"))
    elif mask is not None:
        x = x + mask_bias(mask)
    if _fused_softmax_applies(x, axes, sinks):
        weights = ops.softmax(x, axis=axes[0])
        if mask is not None and not mean:  # every entry of a key-less row
            weights = ops.where(mask, weights, 0.0)
        return weights
    peak = ops.stop_gradient(_peak(x, axes, sinks))
    weights = ops.exp(x - peak)
    if mask is not None and not mean:
        weights = ops.where(mask, weights, 0.0)
    total = ops.sum(weights, axis=axes, keepdims=True)
    if sinks is not None:
        total = total + ops.exp(sinks - peak)
    return weights / ops.where(ops.greater(total, 0.0), total, 1.0)


def softmax_and_logsumexp(x, mask, axes, sinks=None):
    """`(weights, logsumexp)` of float32 logits `x` over `axes`, for the chunked
    kernel's forward: the weights as `softmax`'s, and each row's logsumexp (`NO_KEYS`
    for a row with no key and no sink), which its backward needs.

    A key-less row's weights are left as they come (uniform over logits that all sit
    at `MASKED`): the caller zeroes what they produce by the mask's rows, one value
    per row instead of a pass over every weight. Where the backend's fused softmax
    runs, the logsumexp comes from two reductions, `peak - log(max(weights))` (the
    largest weight is `1 / total`), instead of a second `exp` over every logit.
    """
    if mask is not None:
        x = x + mask_bias(mask)
    peak = _peak(x, axes, sinks)
    if _fused_softmax_applies(x, axes, sinks):
        weights = ops.softmax(x, axis=axes[0])
        logsumexp = peak - ops.log(_peak(weights, axes, None))  # the largest weight
    else:
        weights = ops.exp(x - peak)
        total = ops.sum(weights, axis=axes, keepdims=True)
        if sinks is not None:
            total = total + ops.exp(sinks - peak)
        weights, logsumexp = weights / total, peak + ops.log(total)
    if mask is None:
        return weights, logsumexp
    return weights, ops.where(ops.greater(peak, MASKED / 2), logsumexp, NO_KEYS)


def no_key_offset(bias):
    """Each row's largest bias where it is below `NO_KEY_BIAS`, else 0: float32,
    `bias`'s shape with one key. The chunked kernel subtracts it from such a row's
    logits (all near -1e9): softmax is the same, exactly, since each logit less the
    row's peak is, while the logsumexp it keeps for the backward stays near 0, where
    float32 holds the `log(S)` it would lose near -1e9 (the row's gradients wrong)."""
    peak = ops.max(ops.cast(bias, "float32"), axis=-1, keepdims=True)
    return ops.where(ops.less(peak, NO_KEY_BIAS), peak, 0.0)


def mean_where_empty(output, value, mask):
    """`output` `(B, T, N, Hv)` of a rank-4 call, each row that `mask` (an
    `AttentionMask`) leaves without a key replaced by the mean of `value`
    `(B, S, N, Hv)` over all `S` keys: uniform weights, as
    `keras.ops.dot_product_attention` gives such a row."""
    empty = mask.empty_rows(ops.shape(output)[1], ops.shape(value)[1])
    if empty is None:
        return output
    empty = ops.transpose(empty, (0, 2, 1))[..., None]  # (B, T, N or 1, 1)
    return ops.where(empty, values_mean(value, output.dtype), output)


def values_mean(value, dtype):
    """The mean of `value` `(B, S, N, Hv)` over its `S` keys, `(B, 1, N, Hv)` in
    `dtype`, summed in float32."""
    return ops.cast(ops.mean(ops.cast(value, "float32"), axis=1, keepdims=True), dtype)


def _fused_softmax_applies(x, axes, sinks):
    """Whether the backend's fused softmax computes the weights: one pass, one axis, no
    sinks in the denominator (TensorFlow's CPU kernel takes rank <= 5)."""
    return sinks is None and len(axes) == 1 and len(x.shape) <= 5 and x.shape[axes[0]] != 1


def mask_bias(mask):
    """A boolean mask as float32 logits to add, at the mask's own (broadcast) shape:
    0 where it holds, `MASKED` where it does not."""
    return ops.where(mask, ops.zeros((), "float32"), ops.full((), MASKED, "float32"))


def _peak(x, axes, sinks):
    """Each row's largest logit, and at least `MASKED`."""
    shape = tuple(x.shape)
    if not all(isinstance(size, int) for size in shape):
        # A key range that may be empty (a graph loop's): `initial` keeps it defined.
        peak = ops.max(x, axis=axes, keepdims=True, initial=MASKED)
    elif all(shape):
        # Not `initial`: Keras's torch `max` builds it on the CPU (3.15), and a call on
        # the GPU fails. `amax`: `max` asks whether a tensor's `values` is a tensor,
        # which `torch.compile` cannot trace (the graph broke there).
        peak = ops.maximum(ops.amax(x, axis=axes, keepdims=True), MASKED)
    else:  # nothing to reduce: an empty batch or key range
        reduced = {axis % len(shape) for axis in axes}
        peak = ops.full([1 if i in reduced else n for i, n in enumerate(shape)], MASKED, x.dtype)
    return peak if sinks is None else ops.maximum(peak, sinks)


# ------------------------------------------------------------------------- dropout
_GOLDEN = -1640531527  # 0x9E3779B9 as int32
_MULTIPLIERS = (0x7FEB352D, -2073254261)  # lowbias32's constants (0x846CA68B as int32)


def dropout_keep(seed, rows, cols, rate):
    """Boolean keep mask of attention dropout: `True` with probability `1 - rate`.

    A counter-based hash of `(seed, row, column)`, so the mask of a weight depends on
    its position only, not on how the scores are chunked.

    Args:
        seed: int `(2,)` tensor (from a `keras.random.SeedGenerator`).
        rows: int32 ids of the score rows, broadcastable against `cols`.
        cols: int32 ids of the key positions.
        rate: the drop probability, in (0, 1).
    """
    seed = ops.cast(seed, "int32")
    row_hash = _mix(ops.bitwise_xor(rows, seed[0]))
    col_hash = ops.add(ops.multiply(cols, _GOLDEN), seed[1])
    bits = _mix(_mix(ops.bitwise_xor(row_hash, col_hash)))
    uniform24 = _shift_right(bits, 8)  # 24 random bits, as a non-negative int
    return ops.greater_equal(uniform24, int(round(rate * (1 << 24))))


def _mix(x):
    """lowbias32 (Wellons): an invertible int32 hash with good avalanche."""
    for multiplier, shift in zip(_MULTIPLIERS, (16, 15)):
        x = ops.bitwise_xor(x, _shift_right(x, shift))
        x = ops.multiply(x, multiplier)
    return ops.bitwise_xor(x, _shift_right(x, 16))


def _shift_right(x, bits):
    """Logical right shift of int32 (the backends' `>>` sign-extends)."""
    return ops.bitwise_and(ops.right_shift(x, bits), (1 << (32 - bits)) - 1)


def row_ids(batch, heads, query_length, query_start, query_size):
    """int32 `(B, N, q, 1)` ids of the score rows `(b, n, t)` of queries
    `[query_start, query_start + query_size)`: `(b * N + n) * T + t`."""
    b = ops.arange(batch, dtype="int32")[:, None, None, None]
    n = ops.arange(heads, dtype="int32")[None, :, None, None]
    t = ops.arange(query_size, dtype="int32")[None, None, :, None] + query_start
    return (b * heads + n) * query_length + t
