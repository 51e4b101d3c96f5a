"""The chunked kernel: attention one block of queries at a time, never the whole
`(T, S)` scores, forward or backward.

Forward, for each chunk of `chunk_size` query rows: the logits against the keys the
chunk can see at all (causality and the sliding window bound them: a causal chunk
skips the keys after its last query), an exact float32 softmax over them, normalised
after the product with the values. Only the output and one logsumexp per row are kept.

Backward (FlashAttention-style, through `keras.ops.custom_gradient`): each chunk's
weights are recomputed from the saved logsumexp, masks and dropout regenerated chunk
by chunk, so the backward holds `O(chunk * S)` too. Gradients flow to the query, key,
value, the attention bias and the sinks.

Chunks are unrolled over a static `T` (a `T` unknown when tracing is one chunk).
"""

import contextlib
import dataclasses
from typing import Any

from keras import backend, ops

from keras_mha.kernels import logits as logits_lib


def attention(
    query,
    key,
    value,
    *,
    scale,
    mask=None,
    bias=None,
    soft_cap=None,
    sinks=None,
    dropout=0.0,
    seed=None,
    chunk_size=256,
    in_flight=None,
    differentiable=True,
):
    """Returns the output `(B, T, N, Hv)` in the value's dtype.

    Args:
        query: `(B, T, N, H)`; key: `(B, S, N, H)`; value: `(B, S, N, Hv)`.
        scale: multiplies the query before the dot product.
        mask: an `AttentionMask`, or `None`.
        bias: float, broadcastable to `(B, N, T, S)`, added to the logits.
        soft_cap: `None` or a positive float.
        sinks: `None` or `(N,)` sink logits.
        dropout: attention dropout rate; applies when `seed` is given.
        seed: int `(2,)` tensor seeding the dropout mask.
        chunk_size: query rows per chunk.
        in_flight: how many chunks may run at once (TensorFlow graphs), or `None`.
        differentiable: use the custom backward (backends that train).
    """
    plan = _Plan.make(query, key, mask, bias, chunk_size, in_flight)
    options = _Options(scale, mask, soft_cap, dropout if seed is not None else 0.0, seed)
    tensors = [query, key, value]
    if bias is not None:
        tensors.append(_rank4(bias))
    if sinks is not None:
        tensors.append(_as_tensor(sinks))
    has_bias, has_sinks = bias is not None, sinks is not None

    def unpack(args):
        args = list(args)
        b = args.pop(3) if has_bias else None
        s = args.pop(3) if has_sinks else None
        return (*args, b, s)

    if not differentiable:
        output, _ = _forward(plan, options, *unpack(tensors))
        return _from_heads(output, value.dtype)

    @ops.custom_gradient
    def run(*args):
        q, k, v, b, s = unpack(args)
        output, logsumexp = _forward(plan, options, q, k, v, b, s)

        def grad(*upstream_args, upstream=None):
            if upstream is None:  # TensorFlow and JAX pass it positionally
                (upstream,) = upstream_args
            grads = _backward(plan, options, q, k, v, b, s, output, logsumexp, upstream)
            return tuple(g for g in grads if g is not None)

        return _from_heads(output, value.dtype), grad

    return run(*tensors)


@dataclasses.dataclass(frozen=True)
class _Options:
    scale: float
    mask: Any
    soft_cap: Any
    dropout: float
    seed: Any


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static layout: query chunks and the key range each one sees."""

    chunks: tuple  # ((start, size), ...); size `None` for an unknown `T`
    ranges: tuple  # ((lo, hi), ...) per chunk; `hi` `None` for an unknown `S`
    key_length: Any  # static `S` or `None`
    query_length: Any  # static `T` or `None`
    in_flight: Any

    @classmethod
    def make(cls, query, key, mask, bias, chunk_size, in_flight):
        query_length, key_length = query.shape[1], key.shape[1]
        if query_length is None:
            chunks = ((0, None),)
        else:
            starts = range(0, query_length, chunk_size)
            chunks = tuple((s, min(chunk_size, query_length - s)) for s in starts) or ((0, 0),)
        ranges = tuple(
            (0, key_length) if mask is None else mask.key_range(start, size, key_length)
            for start, size in chunks
        )
        return cls(chunks, ranges, key_length, query_length, in_flight)


# ------------------------------------------------------------------------- forward
def _forward(plan, options, query, key, value, bias, sinks):
    """`(output, logsumexp)`: `(B, N, T, Hv)` float32 and a list of `(B, N, q, 1)`."""
    q, key_t, _, v = _heads(query, key, value, options.scale)
    sink = None if sinks is None else logits_lib.sink_logits(sinks, 4, 1)
    outputs, logsumexps = [], []
    for i, ((start, size), (lo, hi)) in enumerate(zip(plan.chunks, plan.ranges)):
        with _after(outputs, i, plan.in_flight):
            block = _Block(plan, options, q, start, size, lo, hi, _waiting_on(outputs, i, plan))
            x, mask, _ = block.logits(key_t, bias)
            weights, logsumexp = logits_lib.softmax(x, mask, (-1,), sink)
            weights = block.dropped(weights)
            values = _slice(v, 2, lo, block.keys)
            outputs.append(ops.cast(ops.matmul(ops.cast(weights, v.dtype), values), "float32"))
            logsumexps.append(logsumexp)
    return _concat(outputs, 2), logsumexps


# ------------------------------------------------------------------------ backward
def _backward(plan, options, query, key, value, bias, sinks, output, logsumexps, upstream):
    """Gradients of query, key, value, bias and sinks (`None` for the absent ones)."""
    query, key, value = _after_upstream((query, key, value), upstream)
    q, key_t, k, v = _heads(query, key, value, options.scale)
    d_out = ops.cast(ops.transpose(upstream, (0, 2, 1, 3)), "float32")  # (B, N, T, Hv)
    # D = rowsum(dO * O) = rowsum(dP * P), the softmax's correction term.
    correction = ops.sum(d_out * output, axis=-1, keepdims=True)
    sink = None if sinks is None else logits_lib.sink_logits(sinks, 4, 1)
    d_key = _KeyGradient(plan, k)
    d_value = _KeyGradient(plan, v)
    d_bias = None if bias is None else _BiasGrad(plan, bias)
    d_queries, d_sink = [], None
    for i, ((start, size), (lo, hi)) in enumerate(zip(plan.chunks, plan.ranges)):
        with _after(d_queries, i, plan.in_flight):
            block = _Block(plan, options, q, start, size, lo, hi, _waiting_on(d_queries, i, plan))
            x, mask, squashed = block.logits(key_t, bias)
            weights = ops.exp(x - logsumexps[i])
            if mask is not None:
                weights = ops.where(mask, weights, 0.0)
            d_out_chunk = _slice(d_out, 2, start, size)
            values = _slice(v, 2, lo, block.keys)
            dropped = block.dropped(weights)
            d_value_part = _matmul_t(dropped, d_out_chunk, v.dtype)
            d_weights = block.dropped(_matmul(d_out_chunk, ops.transpose(values, (0, 1, 3, 2))))
            row_correction = _slice(correction, 2, start, size)
            d_logits = weights * (d_weights - row_correction)
            if d_bias is not None:
                d_bias.add(d_logits, start, size, lo, hi)
            if squashed is not None:
                d_logits = d_logits * (1.0 - ops.square(squashed))
            keys = _slice(k, 2, lo, block.keys)
            d_queries.append(_matmul(ops.cast(d_logits, k.dtype), keys))
            d_key_part = _matmul_t(d_logits, block.query, q.dtype)
        with _after(d_queries, i + 1, 1):
            d_value.add(d_value_part, lo, hi)
            d_key.add(d_key_part, lo, hi)
            if sink is not None:
                part = ops.exp(sink - logsumexps[i]) * row_correction
                part = -ops.sum(part, axis=(0, 2, 3))
                d_sink = part if d_sink is None else d_sink + part
    d_query = _concat(d_queries, 2) * options.scale
    grads = [
        _from_heads(d_query, query.dtype),
        _from_heads(d_key.total(), key.dtype),
        _from_heads(d_value.total(), value.dtype),
        None if d_bias is None else ops.cast(d_bias.total(), bias.dtype),
        None if sinks is None else ops.cast(d_sink, sinks.dtype),
    ]
    return grads


class _Block:
    """One chunk of queries against its range of keys."""

    def __init__(self, plan, options, q, start, size, lo, hi, previous=None):
        self.options = options
        self.start, self.lo = start, lo
        self.size = ops.shape(q)[2] if size is None else size
        self.keys = None if hi is None else hi - lo
        self.query = _sequenced(_slice(q, 2, start, size), previous)
        self.query_length = ops.shape(q)[2] if plan.query_length is None else plan.query_length

    def logits(self, key_t, bias):
        """Float32 logits `(B, N, q, k)`, the block's mask, and `tanh(x / cap)`."""
        options = self.options
        keys = ops.shape(key_t)[3] if self.keys is None else self.keys
        x = logits_lib.logits(self.query, _slice(key_t, 3, self.lo, self.keys))
        squashed = None
        if options.soft_cap is not None:
            x, squashed = logits_lib.soft_cap(x, options.soft_cap)
        if bias is not None:
            x = x + ops.cast(_bias_block(bias, self.start, self.size, self.lo, keys), "float32")
        mask = None
        if options.mask is not None:
            mask = options.mask.block(self.start, self.size, self.lo, keys)
        return x, mask, squashed

    def dropped(self, weights):
        """`weights` with this block's dropout applied (kept ones scaled up)."""
        options = self.options
        if not options.dropout:
            return weights
        shape = ops.shape(weights)
        rows = logits_lib.row_ids(shape[0], shape[1], self.query_length, self.start, shape[2])
        cols = ops.arange(shape[3], dtype="int32")[None, None, None, :] + self.lo
        keep = logits_lib.dropout_keep(options.seed, rows, cols, options.dropout)
        return ops.where(keep, weights / (1.0 - options.dropout), 0.0)


class _KeyGradient:
    """A `(B, N, S, C)` float32 gradient summed from per-chunk key ranges `[lo, hi)`.

    The running sum covers keys `[0, largest hi so far)`: a causal chunk's range
    grows, and the sum is padded as it does, so no chunk pads to the whole `S`.
    A pad between successive adds also keeps TensorFlow's graph optimizer from
    fusing the chain into one `AddN`, which would hold every chunk's part at once.
    """

    def __init__(self, plan, like):
        self.length = plan.key_length
        self.like = like  # a (B, N, S, C) tensor: the leading and channel sizes
        self.sum, self.covered = None, 0

    def add(self, part, lo, hi):
        if hi is None:  # unknown S: every chunk covers all keys
            self.sum = part if self.sum is None else self.sum + part
            return
        if lo:
            part = _pad_keys(part, lo, 0)
        if self.sum is None:
            self.sum, self.covered = part, hi
            return
        if hi > self.covered:
            self.sum, self.covered = _pad_keys(self.sum, 0, hi - self.covered), hi
        elif hi < self.covered:
            part = _pad_keys(part, 0, self.covered - hi)
        self.sum = self.sum + part

    def total(self):
        if self.sum is None:  # no query sees any key
            shape = ops.shape(self.like)
            return ops.zeros((shape[0], shape[1], shape[2], shape[3]), "float32")
        if self.length is not None and self.covered < self.length:
            return _pad_keys(self.sum, 0, self.length - self.covered)
        return self.sum


def _pad_keys(x, before, after):
    return ops.pad(x, [(0, 0), (0, 0), (before, after), (0, 0)])


class _BiasGrad:
    """The gradient of a rank-4 bias: each chunk's `d_logits` summed over the axes
    the bias broadcasts along, placed at its queries and keys."""

    def __init__(self, plan, bias):
        self.plan = plan
        self.shape = tuple(bias.shape)
        self.broadcast = tuple(i for i, d in enumerate(self.shape) if d == 1)
        self.rows = []  # per chunk, when the bias has a query axis
        self.total_ = None

    def add(self, d_logits, start, size, lo, hi):
        part = d_logits
        if self.broadcast:
            part = ops.sum(part, axis=self.broadcast, keepdims=True)
        if self.shape[3] != 1 and hi is not None:
            length = self.plan.key_length
            part = ops.pad(part, [(0, 0), (0, 0), (0, 0), (lo, length - hi)])
        if self.shape[2] != 1:
            self.rows.append(part)
        else:
            self.total_ = part if self.total_ is None else self.total_ + part

    def total(self):
        return _concat(self.rows, 2) if self.shape[2] != 1 else self.total_


# ------------------------------------------------------------------------- helpers
def _heads(query, key, value, scale):
    """Heads-first `(B, N, T, H)` scaled query, `(B, N, H, S)` and `(B, N, S, H)` keys,
    `(B, N, S, Hv)` values."""
    q = ops.transpose(ops.multiply(query, ops.cast(scale, query.dtype)), (0, 2, 1, 3))
    key_t = ops.transpose(key, (0, 2, 3, 1))
    k = ops.transpose(key, (0, 2, 1, 3))
    v = ops.transpose(value, (0, 2, 1, 3))
    return q, key_t, k, v


def _from_heads(x, dtype):
    return ops.cast(ops.transpose(x, (0, 2, 1, 3)), dtype)


def _matmul(a, b):
    return ops.cast(ops.matmul(a, b), "float32")


def _matmul_t(a, b, dtype):
    """`a^T @ b` over the last two axes, in `dtype`, as float32."""
    a = ops.cast(ops.transpose(a, (0, 1, 3, 2)), dtype)
    return _matmul(a, ops.cast(b, dtype))


def _bias_block(bias, start, size, lo, keys):
    if bias.shape[2] != 1:
        bias = _slice(bias, 2, start, size)
    if bias.shape[3] != 1:
        bias = _slice(bias, 3, lo, keys)
    return bias


def _as_tensor(x):
    """`x` as a tensor, not a variable: TensorFlow's custom gradients reject functions
    that read variables (the gradient still reaches the variable through the read)."""
    x = ops.convert_to_tensor(x)
    return ops.cast(x, x.dtype)


def _rank4(bias):
    """A bias broadcastable to `(B, N, T, S)`, as a rank-4 tensor."""
    bias = _as_tensor(bias)
    while len(bias.shape) < 4:
        bias = ops.expand_dims(bias, 0)
    return bias


def _concat(parts, axis):
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=axis)


def _slice(x, axis, start, size):
    """`x[..., start:start + size, ...]` along `axis`; `size=None` keeps the rest."""
    if size is None:
        return x if start == 0 else x[(slice(None),) * axis + (slice(start, None),)]
    if start == 0 and x.shape[axis] == size:
        return x
    starts = [0] * len(x.shape)
    starts[axis] = start
    shape = list(ops.shape(x))
    shape[axis] = size
    return ops.slice(x, starts, shape)


def _after_upstream(tensors, upstream):
    """`tensors`, as new values that exist only once the upstream gradient does: the
    backward's recomputation is then no common subexpression of the forward pass,
    which graph compilers would otherwise keep alive for it (the whole `(T, S)`)."""
    if backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.control_dependencies([upstream]):
            return tuple(tf.identity(t) for t in tensors)
    if backend.backend() == "jax":
        import jax

        tensors, _ = jax.lax.optimization_barrier((tuple(tensors), upstream))
    return tensors


def _waiting_on(outputs, index, plan):
    """The output chunk `index` waits for under `plan.in_flight`, or `None`."""
    if not plan.in_flight or index < plan.in_flight:
        return None
    return outputs[index - plan.in_flight]


def _sequenced(x, previous):
    """`x`, available only once `previous` is computed (JAX: an optimization barrier,
    so XLA frees one chunk's buffers before the next chunk allocates its own)."""
    if previous is None or backend.backend() != "jax":
        return x
    import jax

    x, _ = jax.lax.optimization_barrier((x, previous))
    return x


def _after(outputs, index, in_flight):
    """Context in which the chunk `index` waits for chunk `index - in_flight`
    (TensorFlow graphs; a no-op elsewhere)."""
    if not in_flight or index < in_flight or backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    import tensorflow as tf

    if tf.executing_eagerly():
        return contextlib.nullcontext()
    return tf.control_dependencies([outputs[index - in_flight]])
