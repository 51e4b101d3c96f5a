"""The chunked kernel: attention one chunk of queries at a time, never the whole
`(T, S)` scores, forward or backward.

Forward, for each chunk of `chunk_size` query rows: the logits against the keys the
chunk can see, an exact float32 softmax over them, the product with the values. Only
the output and one logsumexp per row are kept.

Backward (FlashAttention-style, through `keras.ops.custom_gradient`): each chunk's
weights are recomputed from the saved logsumexp, masks and dropout regenerated chunk
by chunk, so the backward holds `O(chunk * S)` too. Gradients flow to the query, key,
value, the attention bias, the sinks and the tensors a score function reads (its
derivative taken per block by the backend's autodiff: `ScoreMod.vjp`).

The chunks are visited one of three ways (`Policy.loop`, `Policy.dynamic`):

- unrolled, over a static `T`: each chunk sees only the keys it can attend to
  (causality and the window bound them: a causal chunk skips the keys after its last
  query, half the work); TensorFlow's graph runs at most `in_flight` chunks at once.
- in a compiled loop (`keras.ops.fori_loop`), static shapes: each chunk visits, in an
  inner loop whose trip count is computed at run time, only the blocks of `key_block`
  keys that hold a key some query of the chunk may see (`_Plan.key_blocks`:
  causality, the window, query and key padding, document ids), with FlashAttention's
  online softmax across them (`_forward_blocks`). XLA runs independent unrolled
  chunks in any order and keeps their buffers alive together; a loop holds one
  chunk's, one key block at a time.
- in a dynamic loop (a TensorFlow graph's while loop): each step's tensors change
  size, so every chunk again sees only its key range; the rows grow by one chunk per
  step (`_Rows`). With a block mask whose chunks have gaps between non-empty key
  blocks, each chunk visits its runs of them in an inner loop as a static loop
  visits its blocks (`_LoopRuns`).

A `T` unknown when tracing is one chunk, unless the loop is dynamic.
"""

import contextlib
import dataclasses
from typing import Any

import numpy as np
from keras import backend, ops

from keras_mha import masks
from keras_mha.kernels import compiled, trim
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
    score_mod=None,
    dropout=0.0,
    seed=None,
    chunk_size=256,
    forward_chunk_size=None,
    key_block=512,
    key_multiple=1,
    in_flight=None,
    loop=False,
    dynamic=False,
    differentiable=True,
    in_place_sums=False,
    skip_zero_gradients=False,
    compile_eager=False,
):
    """Returns the output `(B, T, N, Hv)` in the value's dtype.

    Args:
        query: `(B, T, N, H)`; key: `(B, S, N, H)`; value: `(B, S, N, Hv)`.
        scale: multiplies the query before the dot product.
        mask: an `AttentionMask`, or `None`.
        bias: float, broadcastable to `(B, N, T, S)`, added to the logits.
        soft_cap: `None` or a positive float.
        sinks: `None` or `(N,)` sink logits.
        score_mod: `None` or a `score_mod.ScoreMod`, applied per block after the
            bias; its floating tensors get gradients.
        dropout: attention dropout rate; applies when `seed` is given.
        seed: int `(2,)` tensor seeding the dropout mask.
        chunk_size: query rows per chunk.
        forward_chunk_size: query rows per chunk of the forward pass, when other
            than `chunk_size` (the backward's); every chunking gives the same
            results, dropout included (it is drawn per query and key).
        key_block: keys per block of a static loop's chunk (at most `S`).
        key_multiple: a dynamic loop widens each chunk's key range, found at run
            time, out to multiples of this many keys (the extra keys masked), so
            that the chunks' matmuls take few distinct shapes.
        in_flight: how many chunks of the forward pass may run at once (TensorFlow
            graphs); the backward runs one at a time.
        loop: visit the chunks in a compiled loop rather than unrolled.
        dynamic: the loop's chunks take tensors whose size changes from chunk to
            chunk (TensorFlow graphs): each sees only its key range, and a `T`
            unknown when tracing is chunked too.
        differentiable: use the custom backward (backends that train).
        in_place_sums: unrolled, the backward adds each chunk's key and value
            gradients in place into one buffer (torch: `Policy.in_place_sums`).
        skip_zero_gradients: a loop's backward visits no key for a chunk whose
            output's gradient is all zero (`Policy.skip_zero_gradient_chunks`).
        compile_eager: an eager call without a score function runs one compiled
            program per configuration (`compiled.py`:
            `Policy.compile_eager_chunks`).
    """
    if compile_eager and compiled.applies(query, score_mod):
        options = {name: v for name, v in locals().items() if name not in _NOT_OPTIONS}
        return compiled.attention(_attention, query, key, value, **options)
    if dynamic and backend.backend() == "jax":
        raise ValueError("The chunked kernel's dynamic loop needs dynamic shapes; JAX has none.")

    def plan_of(rows):
        plan = _Plan.make(query, key, mask, rows, in_flight, loop, dynamic, key_block, key_multiple)
        return dataclasses.replace(
            plan, in_place_sums=in_place_sums, skip_zero_gradients=skip_zero_gradients
        )

    plan = plan_of(chunk_size)
    forward_plan = plan
    if forward_chunk_size not in (None, chunk_size):
        forward_plan = plan_of(forward_chunk_size)
    options = _Options(scale, mask, soft_cap, dropout if seed is not None else 0.0, seed)
    tensors = [query, key, value]
    if bias is not None:
        tensors.append(_rank4(bias))
    if sinks is not None:
        tensors.append(_as_tensor(sinks))
    has_bias, has_sinks = bias is not None, sinks is not None
    mod = _ScoreModInputs.make(score_mod)
    tensors += mod.args

    def unpack(args):
        args = list(args)
        b = args.pop(3) if has_bias else None
        s = args.pop(3) if has_sinks else None
        return _Inputs(options, *args[:3], b, s, mod=mod.with_args(args[3:]))

    if not differentiable:
        output, _ = _forward(forward_plan, unpack(tensors))
        return _from_heads(output, value.dtype)

    @ops.custom_gradient
    def run(*args):
        inputs = unpack(args)
        output, logsumexp = _forward(forward_plan, inputs)

        def grad(*upstream_args, upstream=None, variables=None):
            if upstream is None:  # TensorFlow and JAX pass it positionally
                (upstream,) = upstream_args
            grads = _backward(plan, inputs, output, logsumexp, upstream)
            grads = tuple(g for g in grads if g is not None)
            if variables is None:
                return grads
            # TensorFlow names the variables the forward read: those a score function
            # closes over, which get no gradient here (`ScoreMod(fn, tensors)` gives one).
            return grads, [None] * len(variables)

        return _from_heads(output, value.dtype), grad

    return run(*tensors)


# The kernel as defined here, for `compiled.py` to trace (a spy on `attention` counts calls).
_attention = attention
_NOT_OPTIONS = ("query", "key", "value", "compile_eager")


@dataclasses.dataclass(frozen=True)
class _Options:
    scale: float
    mask: Any
    soft_cap: Any
    dropout: float
    seed: Any


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The layout: query chunks and the key range each one sees."""

    chunks: tuple  # unrolled: ((start, size), ...); size `None` for an unknown `T`
    ranges: tuple  # unrolled: ((lo, hi), ...) per chunk; `hi` `None` for an unknown `S`
    key_length: Any  # static `S` or `None`
    query_length: Any  # static `T` or `None`
    chunk_size: int
    in_flight: Any
    loop: bool  # the chunks run in a loop (the rest of a static loop, if any, before it)
    dynamic: bool  # the loop's chunks see only their key range; `T` may be unknown
    mask: Any
    key_block: int = 0  # a static loop's keys per block; 0: every chunk sees every key
    keys: Any = None  # `S`: static, or a scalar tensor in a dynamic loop
    key_multiple: int = 1  # a dynamic loop's key ranges: widened out to multiples
    segments: tuple = ()  # unrolled, with a block mask: per chunk, its non-empty key runs
    runs: Any = None  # a dynamic loop with a block mask: `_LoopRuns`, or `None`
    in_place_sums: bool = False  # unrolled: the key and value gradients summed in place
    skip_zero_gradients: bool = False  # a loop's chunks whose output gradient is all zero

    @classmethod
    def make(
        cls, query, key, mask, chunk_size, in_flight, loop, dynamic, key_block=512, key_multiple=1
    ):
        # Symbolic lengths (torch.export, jax.export) count as unknown: no guards.
        query_length, key_length = (_static(x.shape[1]) for x in (query, key))
        if query_length is None:
            chunks = ((0, None),)
        else:
            starts = range(0, query_length, chunk_size)
            chunks = tuple((s, min(chunk_size, query_length - s)) for s in starts) or ((0, 0),)
        dynamic = loop and dynamic
        loop = dynamic or (loop and len(chunks) > 1)
        if not loop:
            # Unrolled, the last chunk (the most keys) goes first: each chunk's buffers
            # are then no larger than freed ones, which malloc reuses instead of
            # growing the heap by every chunk's new, larger size.
            chunks = chunks[::-1]
        blocks = 0
        if loop and not dynamic and key_length:  # static shapes: blocks of keys
            if mask is not None and mask.block_mask is not None:
                # Whole units of its blocks, to skip empty ones.
                map_block = mask.block_mask.block_size[1]
                key_block = max(1, min(key_block, key_length) // map_block) * map_block
            blocks = min(key_block, key_length)
        # A dynamic loop narrows its chunks' key ranges by the data even where `S` is
        # unknown when tracing (varying lengths under `tf.function`): `S` as a tensor.
        keys = ops.shape(key)[1] if dynamic and key_length is None else key_length
        plan = cls(
            chunks,
            (),
            key_length,
            query_length,
            chunk_size,
            in_flight,
            loop,
            dynamic,
            mask,
            blocks,
            keys,
            key_multiple,
        )
        eager = not loop and trim.holds_data(query)
        ranges = tuple(plan.key_range(start, size, eager) for start, size in chunks)
        segments = ()
        if not loop and mask is not None and mask.block_mask is not None:
            segments = tuple(mask.block_runs(*c, *r) for c, r in zip(chunks, ranges))
        runs = _LoopRuns.make(plan) if dynamic else None
        return dataclasses.replace(plan, ranges=ranges, segments=segments, runs=runs)

    def segments_of(self, i, inputs):
        """The unrolled chunk `i`'s runs of non-empty key blocks, where its block
        mask leaves empty blocks inside its key range (each run is computed on its
        own: the blocks between them are not); `None` to take the range whole."""
        if not self.segments or inputs.sink is not None:  # a sink joins one softmax
            return None
        runs = self.segments[i]
        return runs if runs is not None and len(runs) > 1 else None

    def key_range(self, start, size, eager=False):
        """`(lo, hi)` of the keys queries `[start, start + size)` see; `hi` `None` for
        an unknown `S`. A static loop's chunks see every key (where `S` is known they
        visit their key blocks instead: `key_blocks`).

        Where the tensors hold data (`eager`: unrolled chunks run eagerly) or the
        loop takes ranges that change from chunk to chunk (`dynamic`), the range is
        narrowed at run time by the key padding and the document ids
        (`AttentionMask.visible_keys`): Python ints eagerly, tensors in the loop."""
        if self.mask is None or (self.loop and not self.dynamic):
            return 0, self.key_length
        if not (eager or self.dynamic) or not self.mask.data_dependent:
            return self.mask.key_range(start, size, self.key_length)
        lo, hi = self.mask.visible_keys(start, size, self.keys)
        if eager:
            return int(ops.convert_to_numpy(lo)), int(ops.convert_to_numpy(hi))
        return self._widened(lo, hi)

    def _widened(self, lo, hi):
        """A dynamic loop's `(lo, hi)` out to multiples of `key_multiple` keys (within
        `S`): the matmuls' shapes change with the data, and TensorFlow's CPU kernels
        (oneDNN) keep a compiled primitive per shape they meet; the keys added are
        masked as every key the range left out is."""
        m = self.key_multiple
        if m <= 1:
            return lo, hi
        return lo // m * m, ops.minimum((hi + m - 1) // m * m, self.keys)

    def key_blocks(self, start, size):
        """`(lo, count)`, int32 scalar tensors: a static loop's chunk of queries
        `[start, start + size)` visits key blocks `j < count`, keys
        `[lo + j * key_block, lo + (j + 1) * key_block)`, that cover the keys some
        query of the chunk may see (`AttentionMask.visible_range`, computed at run
        time); `count` is 0 for a chunk that sees no key.

        With a block mask, `lo` is instead the blocks' order: the chunk visits
        blocks `order[j]`, `j < count`, those its block map leaves non-empty within
        that range (`BlockMask.visit_order`), and no other."""
        if self.mask is None:
            lo, hi = ops.zeros((), "int32"), ops.convert_to_tensor(self.key_length, "int32")
        else:
            lo, hi = self.mask.visible_range(start, size, self.key_length)
        if self.mask is not None and self.mask.block_mask is not None:
            first = start + self.mask.offset
            # Map blocks per visited block (one where `S` is below a map block).
            unit = max(1, self.key_block // self.mask.block_mask.block_size[1])
            return self.mask.block_mask.visit_order(
                first, first + size - 1, lo, hi, self.key_length, unit
            )
        return lo, (hi - lo + self.key_block - 1) // self.key_block

    def visits(self, inputs, start, size):
        """`(count, block_of)`: a loop's chunk of queries `[start, start + size)`
        visits the `_Block`s `block_of(j)`, `j < count` (a scalar tensor): a static
        loop's key blocks (`key_blocks`), or a dynamic loop's runs of non-empty map
        blocks (`_LoopRuns`)."""
        if self.runs is not None:
            lo, hi = self.key_range(start, size)
            return self.runs.visits(inputs, start, size, lo, hi)
        lo, count = self.key_blocks(start, size)
        return count, lambda j: self.key_block_of(inputs, start, size, lo, j)

    def key_block_of(self, inputs, start, size, lo, j):
        """The `_Block` of queries `[start, start + size)` and key block `j` from
        `lo` (`key_blocks`; with a block mask, block `lo[j]`). The last block's slice
        is moved back to end at `S` (no padding); its keys before
        `lo + j * key_block`, another block's, are masked off."""
        if self.mask is not None and self.mask.block_mask is not None:
            first = ops.take(lo, j) * self.key_block
        else:
            first = lo + j * self.key_block
        if self.mask is None and self.key_length % self.key_block == 0:
            return _Block(inputs, start, size, first, self.key_block)  # no block moves
        key_start = ops.minimum(first, self.key_length - self.key_block)
        return _Block(inputs, start, size, key_start, self.key_block, since=first)

    def concat(self, parts):
        """The chunks' parts, in the order the chunks were visited, along the queries."""
        order = sorted(range(len(parts)), key=lambda i: self.chunks[i][0])
        return _concat([parts[i] for i in order], 2)

    def looped(self, query_length):
        """`(count, chunk, rest)`: the loop visits chunks `chunk(i)`, `i < count`, as
        `(start, size)`, the last queries (the most keys) first; `rest` are the static
        chunks visited before it. `query_length`: `T`, a tensor if unknown.

        Static: `count` equal chunks and the rest. Dynamic: every chunk, the first
        queries' chunk the smaller one.
        """
        size = self.chunk_size
        if not self.dynamic:
            count = self.query_length // size
            return count, lambda i: ((count - 1 - i) * size, size), self.chunks[count:]
        count = (query_length + size - 1) // size

        def chunk(i):
            end = query_length - i * size
            start = ops.maximum(end - size, 0)
            return start, end - start

        return count, chunk, ()


@dataclasses.dataclass(frozen=True)
class _LoopRuns:
    """A dynamic loop's chunks over a block mask: per chunk, its runs of consecutive
    non-empty key blocks (`AttentionMask.block_runs`), each visited as a block of its
    own (the blocks between them never are), narrowed at run time to the chunk's key
    range (padding, documents).

    `starts`, `ends`: `(chunks, runs)` int32, chunk `i` as `_Plan.looped` numbers it
    (the last queries first), its runs ascending, padded with empty `(S, S)` runs."""

    starts: Any
    ends: Any
    chunk_size: int
    query_length: int

    @classmethod
    def make(cls, plan):
        """The runs of `plan`'s dynamic loop, or `None` where no chunk has a gap
        between its non-empty key blocks (or `T`, `S` or the offset is not static)."""
        mask, length, keys = plan.mask, plan.query_length, plan.key_length
        if mask is None or mask.block_mask is None or length is None or keys is None:
            return None
        size = plan.chunk_size
        runs = []
        for end in range(length, 0, -size):  # `_Plan.looped`'s order
            start = max(end - size, 0)
            found = mask.block_runs(start, end - start, 0, keys)
            if found is None:
                return None
            runs.append(found)
        if max(map(len, runs), default=0) < 2:
            return None
        width = max(map(len, runs))
        table = np.full((len(runs), width, 2), keys, "int32")
        for i, chunk_runs in enumerate(runs):
            table[i, : len(chunk_runs)] = chunk_runs
        return cls(table[..., 0], table[..., 1], size, length)

    def visits(self, inputs, start, size, lo, hi):
        """`(count, block_of)` of the chunk of queries `[start, start + size)` within
        keys `[lo, hi)`: its runs that meet the range, each cut to it."""
        i = (self.query_length - (start + size)) // self.chunk_size
        starts = ops.take(ops.convert_to_tensor(self.starts), i, axis=0)
        ends = ops.take(ops.convert_to_tensor(self.ends), i, axis=0)
        # Runs are ascending and disjoint: those ending by `lo` come first, those
        # starting from `hi` last.
        first = ops.sum(ops.cast(ops.less_equal(ends, lo), "int32"))
        stop = ops.sum(ops.cast(ops.less(starts, hi), "int32"))

        def block_of(j):
            run_lo = ops.maximum(ops.take(starts, first + j), lo)
            run_hi = ops.minimum(ops.take(ends, first + j), hi)
            return _Block(inputs, start, size, run_lo, run_hi - run_lo)

        return ops.maximum(stop - first, 0), block_of


class _Inputs:
    """The kernel's inputs in the heads-first layout the chunks work in."""

    def __init__(self, options, query, key, value, bias, sinks, heads=None, mod=None):
        self.options = options
        self.query, self.key, self.value, self.bias, self.sinks = query, key, value, bias, sinks
        self.mod = mod if mod is not None else _ScoreModInputs.make(None)
        # One query (a decode step): its logits are taken as `keys @ query^T` from the
        # keys in rows, `(B, N, S, H)`, a transpose that moves whole rows; the keys-last
        # `key_t` (a transpose that moves single floats) is then made only by a backward
        # pass (`after`).
        self.key_rows = None
        if _static(query.shape[1]) == 1:
            self.key_rows = ops.transpose(key, (0, 2, 1, 3))
        if heads is None:
            scaled = ops.multiply(query, ops.cast(options.scale, query.dtype))
            heads = (
                ops.transpose(scaled, (0, 2, 1, 3)),  # (B, N, T, H), scaled
                None if self.key_rows is not None else self._keys_last(),
                ops.transpose(value, (0, 2, 1, 3)),  # (B, N, S, Hv)
            )
        self.q, self._key_t, self.v = heads
        self.sink = None if sinks is None else logits_lib.sink_logits(sinks, 4, 1)
        self.query_length = ops.shape(self.q)[2]
        # Rows of the bias with no key left (`logits.no_key_offset`). A sink keeps a
        # row's peak finite; a score function may move the bias's logits anywhere.
        self.row_offset = None
        if bias is not None and sinks is None and self.mod.score_mod is None:
            self.row_offset = logits_lib.no_key_offset(bias)

    @property
    def key_t(self):
        """The keys keys-last, `(B, N, H, S)`."""
        return self._keys_last() if self._key_t is None else self._key_t

    def _keys_last(self):
        return ops.transpose(self.key, (0, 2, 3, 1))

    def after(self, upstream):
        """These inputs as new values that exist only once `upstream` does: the
        backward's recomputation is then no common subexpression of the forward
        pass, which graph compilers would keep alive for it (the whole `(T, S)`)."""
        heads = (self.q, self.key_t, self.v)
        if backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.control_dependencies([upstream]):
                heads = tuple(tf.identity(t) for t in heads)
        elif backend.backend() == "jax":
            import jax

            heads, _ = jax.lax.optimization_barrier((heads, upstream))
        return _Inputs(
            self.options, self.query, self.key, self.value, self.bias, self.sinks, heads, self.mod
        )

    def block(self, start, size, lo, keys):
        return _Block(self, start, size, lo, keys)


class _Block:
    """One chunk of queries `[start, start + size)` against keys `[lo, lo + keys)`;
    with `since`, the keys before it are masked."""

    def __init__(self, inputs, start, size, lo, keys, since=None):
        self.inputs, self.start, self.lo, self.keys, self.since = inputs, start, lo, keys, since
        self.size = inputs.query_length if size is None else size
        self.query = masks.slice_along(inputs.q, 2, start, size)

    def logits(self):
        """Float32 logits `(B, N, q, k)`, the block's mask, `tanh(x / cap)`, and the
        logits before the score function (`None` without one)."""
        inputs, options = self.inputs, self.inputs.options
        keys = ops.shape(inputs.key)[1] if self.keys is None else self.keys
        if inputs.key_rows is None:
            key_t = masks.slice_along(inputs.key_t, 3, self.lo, self.keys)
            x = logits_lib.logits(self.query, key_t)
        else:
            key_rows = masks.slice_along(inputs.key_rows, 2, self.lo, self.keys)
            x = ops.swapaxes(logits_lib.logits(key_rows, ops.swapaxes(self.query, 2, 3)), 2, 3)
        squashed = None
        if options.soft_cap is not None:
            x, squashed = logits_lib.soft_cap(x, options.soft_cap)
        if inputs.bias is not None:
            x = x + ops.cast(
                masks.block_of(inputs.bias, self.start, self.size, self.lo, keys), "float32"
            )
        before_mod = None
        if inputs.mod.score_mod is not None:
            before_mod = x
            x = inputs.mod.score_mod(x, *self.indices(keys), tensors=inputs.mod.tensors)
        if inputs.row_offset is not None:
            x = x - masks.block_of(inputs.row_offset, self.start, self.size, 0, 1)
        mask = None
        if options.mask is not None:
            mask = options.mask.block(self.start, self.size, self.lo, keys)
        if self.since is not None:
            cols = ops.arange(keys, dtype="int32")[None, None, None, :] + self.lo
            mask = masks.logical_and(mask, ops.greater_equal(cols, self.since))
        return x, mask, squashed, before_mod

    def indices(self, keys):
        """The score function's `(b, h, q_idx, kv_idx)` of this block."""
        shape = ops.shape(self.query)
        return self.inputs.mod.score_mod.indices(
            shape[0], shape[1], self.start, shape[2], self.lo, keys
        )

    def values(self):
        return masks.slice_along(self.inputs.v, 2, self.lo, self.keys)

    def dropped(self, weights):
        """`weights` with this block's dropout applied (kept ones scaled up)."""
        options = self.inputs.options
        if not options.dropout:
            return weights
        shape = ops.shape(weights)
        rows = logits_lib.row_ids(
            shape[0], shape[1], self.inputs.query_length, self.start, shape[2]
        )
        cols = ops.arange(shape[3], dtype="int32")[None, None, None, :] + self.lo
        keep = logits_lib.dropout_keep(options.seed, rows, cols, options.dropout)
        return ops.where(keep, weights / (1.0 - options.dropout), 0.0)


# ------------------------------------------------------------------------- forward
def _forward_chunk(block):
    """`(output, logsumexp)` of one chunk: `(B, N, q, Hv)` float32, `(B, N, q, 1)`."""
    x, mask, _, _ = block.logits()
    weights, logsumexp = logits_lib.softmax_and_logsumexp(x, mask, (-1,), block.inputs.sink)
    weights = ops.cast(block.dropped(weights), block.inputs.v.dtype)
    output = ops.cast(ops.matmul(weights, block.values()), "float32")
    if mask is not None:  # a key-less row's weights were left as they came
        output = ops.where(ops.any(mask, axis=-1, keepdims=True), output, 0.0)
    return output, logsumexp


def _forward_blocks(plan, inputs, start, size):
    """`(output, logsumexp)` of one chunk of a static loop, `(B, N, size, Hv)` and
    `(B, N, size, 1)` float32 like `_forward_chunk`'s, over its visible key blocks
    only (`_Plan.visits`: a static loop's key blocks, a dynamic loop's runs of
    non-empty map blocks), in a loop whose trip count is known at run time:
    FlashAttention's online softmax, a running row maximum `peak`, sum of weights
    `total` and weighted sum of values `acc` rescaled as the maximum grows. A sink
    starts the row (`peak` its logit, `total` 1); a chunk with no block gives zero
    output and `logits.NO_KEYS` (no sink), as a row with no key.
    """
    count, block_of = plan.visits(inputs, start, size)
    shape = ops.shape(inputs.q)
    rows = (shape[0], shape[1], size, 1)
    if inputs.sink is None:
        peak, total = ops.full(rows, logits_lib.MASKED, "float32"), ops.zeros(rows, "float32")
    else:
        peak, total = ops.broadcast_to(inputs.sink, rows), ops.ones(rows, "float32")
    acc = ops.zeros(rows[:3] + (ops.shape(inputs.v)[3],), "float32")

    def step(j, state):
        peak, total, acc = state
        block = block_of(j)
        x, mask, _, _ = block.logits()
        if mask is not None:
            x = ops.where(mask, x, logits_lib.MASKED)
        new_peak = ops.maximum(peak, ops.amax(x, axis=-1, keepdims=True))
        weights = ops.exp(x - new_peak)
        if mask is not None:
            weights = ops.where(mask, weights, 0.0)  # masked: exactly 0
        rescale = ops.exp(peak - new_peak)
        total = total * rescale + ops.sum(weights, axis=-1, keepdims=True)
        weights = ops.cast(block.dropped(weights), inputs.v.dtype)
        acc = acc * rescale + _matmul(weights, block.values())
        return new_peak, total, acc

    peak, total, acc = _loop(count, step, (peak, total, acc), 1)
    has_keys = ops.greater(total, 0.0)
    total = ops.where(has_keys, total, 1.0)
    return acc / total, ops.where(has_keys, peak + ops.log(total), logits_lib.NO_KEYS)


def _forward(plan, inputs):
    """`(output, logsumexp)`: `(B, N, T, Hv)` and `(B, N, T, 1)`, float32."""
    if plan.loop:
        return _forward_loop(plan, inputs)
    outputs, logsumexps, done = [], [], []
    for i, ((start, size), (lo, hi)) in enumerate(zip(plan.chunks, plan.ranges)):
        with _after(done, i, plan.in_flight):
            runs = plan.segments_of(i, inputs)
            if runs:
                output, logsumexp = _forward_runs(inputs, start, size, runs)
            else:
                block = inputs.block(start, size, lo, _width(lo, hi))
                output, logsumexp = _forward_chunk(block)
        outputs.append(output)
        logsumexps.append(logsumexp)
        done.append([output, logsumexp])
    return plan.concat(outputs), plan.concat(logsumexps)


def _forward_runs(inputs, start, size, runs):
    """`(output, logsumexp)` of one chunk over several key ranges (a block mask's
    runs of non-empty blocks), each computed as a chunk of its own and merged by
    their logsumexps; a row with no key in any run gives zero output and `NO_KEYS`."""
    parts = [_forward_chunk(inputs.block(start, size, lo, hi - lo)) for lo, hi in runs]
    valid = [ops.less(lse, logits_lib.NO_KEYS / 2) for _, lse in parts]
    lses = [ops.where(v, lse, logits_lib.MASKED) for v, (_, lse) in zip(valid, parts)]
    peak = lses[0]
    for lse in lses[1:]:
        peak = ops.maximum(peak, lse)
    total = sum(ops.where(v, ops.exp(lse - peak), 0.0) for v, lse in zip(valid, lses))
    has_keys = ops.greater(total, 0.0)
    logsumexp = peak + ops.log(ops.where(has_keys, total, 1.0))
    output = sum(
        ops.where(v, ops.exp(lse - logsumexp), 0.0) * out
        for v, lse, (out, _) in zip(valid, lses, parts)
    )
    return output, ops.where(has_keys, logsumexp, logits_lib.NO_KEYS)


def _backward_runs(inputs, start, size, runs, rows):
    """A chunk's gradients over several key ranges (`_forward_runs`): each range's
    parts, the key-axis ones padded out to the ranges' span and summed."""
    lo, hi = runs[0][0], runs[-1][1]
    merged, d_mod = None, ()
    for first, stop in runs:
        block = inputs.block(start, size, first, stop - first)
        d_query, d_key, d_value, d_logits, _, d_run_mod = _backward_chunk(block, rows, sink=False)
        if inputs.bias is None:
            d_logits = None
        parts = [d_query] + [
            None if x is None else _pad_keys(x, first - lo, hi - stop)
            for x in (d_key, d_value, d_logits)
        ]
        if merged is None:
            merged = parts
        else:
            merged = [None if m is None else m + p for m, p in zip(merged, parts)]
        d_mod = d_run_mod if not d_mod else [a + b for a, b in zip(d_mod, d_run_mod)]
    return (*merged, None, d_mod)


def _forward_loop(plan, inputs):
    shape = ops.shape(inputs.q)
    count, chunk, rest = plan.looped(shape[2])
    rows = _Rows(plan)
    output = rows.empty((shape[0], shape[1], shape[2], ops.shape(inputs.v)[3]))
    logsumexp = rows.empty((shape[0], shape[1], shape[2], 1))

    def visit(start, size, state):
        output, logsumexp = state
        if plan.key_block or plan.runs is not None:
            chunk, chunk_logsumexp = _forward_blocks(plan, inputs, start, size)
        else:
            lo, hi = plan.key_range(start, size)
            block = inputs.block(start, size, lo, _width(lo, hi))
            chunk, chunk_logsumexp = _forward_chunk(block)
        return rows.put(output, chunk, start), rows.put(logsumexp, chunk_logsumexp, start)

    state = (output, logsumexp)
    for start, size in rest:
        state = visit(start, size, state)
    shapes = tuple(rows.shape(x) for x in state)
    state = _loop(count, lambda i, s: visit(*chunk(i), s), state, plan.in_flight, shapes)
    return tuple(rows.join(x) for x in state)


class _Rows:
    """A loop's per-chunk rows `(B, N, q, C)` gathered into `(B, N, T, C)` float32.

    A static loop writes them into a zeros buffer (in place under XLA). A dynamic loop
    visits the chunks from the last queries to the first and puts each chunk's rows
    before the rows so far: a buffer that grows, its queries' size left open to the
    loop (`shape`).
    """

    def __init__(self, plan):
        self.growing, self.length = plan.dynamic, None

    def empty(self, shape):
        self.length = shape[2]
        if self.growing:
            shape = (shape[0], shape[1], 0, shape[3])
        return ops.zeros(shape, "float32")

    def put(self, rows, part, start):
        """`rows` with the chunk `part` at query `start`."""
        if self.growing:
            return ops.concatenate([part, rows], axis=2)
        return _add_at(rows, part, [0, 0, start, 0], False)

    def shape(self, rows):
        """The loop's shape for `rows`: a growing buffer's queries vary."""
        if not self.growing:
            return None
        shape = list(rows.shape)
        shape[2] = None
        return shape

    def join(self, rows):
        if not self.growing:
            return rows
        shape = list(ops.shape(rows))
        shape[2] = self.length  # static again where known
        return ops.reshape(rows, shape)


# ------------------------------------------------------------------------ backward
def _backward_chunk(block, rows, sink=True):
    """One chunk's gradients: `(d_query, d_key, d_value, d_logits, d_sink, d_mod)`,
    the key and value parts over the chunk's key range; `d_logits` before the score
    function's and the soft cap's derivatives (what the bias receives); `d_sink`
    `None` unless `sink`; `d_mod` the score function's tensors' parts (a list).

    `rows`: the chunk's rows of the upstream gradient `(B, N, q, Hv)`, the correction
    and the logsumexp `(B, N, q, 1)`, then of the scaled query and the upstream
    gradient transposed, `(B, N, H, q)` and `(B, N, Hv, q)`. The key and value
    gradients are plain products of the transposed rows, `(B, N, C, k)`, keys last:
    XLA's CPU backend runs `weights^T @ d_out` (a transposed left operand) outside
    its fast matmul (the Benchmarks page, "Distance to the floor")."""
    inputs = block.inputs
    d_out, correction, logsumexp, query_t, d_out_t = rows
    x, mask, squashed, before_mod = block.logits()
    weights = ops.exp(x - logsumexp)  # a key-less row's (NO_KEYS) underflow to 0
    if mask is not None:
        # Masked weights are zeroed after the exponential, not pushed down by `MASKED`
        # before it: torch's CPU `exp` takes a slow path, 5-18x, for arguments below
        # -87.3 (benchmarks/results/torch_backward.md).
        weights = ops.where(mask, weights, 0.0)
    values = block.values()
    d_value = _product(d_out_t, block.dropped(weights), inputs.v.dtype)  # (B, N, Hv, k)
    d_weights = block.dropped(_matmul(d_out, ops.transpose(values, (0, 1, 3, 2))))
    d_logits = weights * (d_weights - correction)
    d_mod = []
    if before_mod is not None:  # masked entries' d_logits are 0: they add nothing
        keys = ops.shape(x)[3]
        mod = inputs.mod
        d_logits, *d_mod = mod.score_mod.vjp(before_mod, block.indices(keys), mod.tensors, d_logits)
    d_raw = d_logits if squashed is None else d_logits * (1.0 - ops.square(squashed))
    keys_t = masks.slice_along(inputs.key_t, 3, block.lo, block.keys)
    d_query = ops.einsum("bnqk,bnhk->bnqh", ops.cast(d_raw, inputs.q.dtype), keys_t)
    d_query = ops.cast(d_query, "float32")
    d_key = _product(query_t, d_raw, inputs.q.dtype)  # (B, N, H, k)
    d_sink = _sink_gradient(inputs, correction, logsumexp) if sink else None
    return d_query, d_key, d_value, d_logits, d_sink, d_mod


def _sink_gradient(inputs, correction, logsumexp):
    """`(N,)` gradient of the sinks from a chunk's rows, or `None` without sinks."""
    if inputs.sink is None:
        return None
    return -ops.sum(ops.exp(inputs.sink - logsumexp) * correction, axis=(0, 2, 3))


def _backward(plan, inputs, output, logsumexp, upstream):
    """Gradients of query, key, value, bias and sinks (`None` for the absent ones)."""
    inputs = inputs.after(upstream)
    d_out = ops.cast(ops.transpose(upstream, (0, 2, 1, 3)), "float32")  # (B, N, T, Hv)
    # D = rowsum(dO * O) = rowsum(dP * P), the softmax's correction term.
    correction = ops.sum(d_out * output, axis=-1, keepdims=True)
    query_t = ops.transpose(inputs.q, (0, 1, 3, 2))  # (B, N, H, T)
    d_out_t = ops.transpose(d_out, (0, 1, 3, 2))  # (B, N, Hv, T)
    total = _Gradients(plan, inputs)

    def visit(start, size, lo, hi, state, runs=None, live=None):
        rows = [masks.slice_along(t, 2, start, size) for t in (d_out, correction, logsumexp)]
        rows += [masks.slice_along(t, 3, start, size) for t in (query_t, d_out_t)]
        if plan.key_block or plan.runs is not None:
            return total.add_blocks(state, start, size, rows, live)
        if live is not None:  # a chunk with no gradient visits no key
            hi = ops.where(live, plan.keys if hi is None else hi, lo)
        if runs:
            block = inputs.block(start, size, runs[0][0], runs[-1][1] - runs[0][0])
            return total.add(state, block, _backward_runs(inputs, start, size, runs, rows))
        block = inputs.block(start, size, lo, _width(lo, hi))
        return total.add(state, block, _backward_chunk(block, rows))

    if plan.loop:
        count, chunk, rest = plan.looped(inputs.query_length)
        state = total.zeros()

        def visit_live(start, size, state):
            # A chunk whose output's gradient is all zero (padded queries that a loss
            # ignores) adds zero to every gradient: at run time it visits no key.
            live = None
            if plan.skip_zero_gradients:
                live = ops.any(ops.not_equal(masks.slice_along(d_out, 2, start, size), 0.0))
            return visit(start, size, *plan.key_range(start, size), state, live=live)

        for start, size in rest:
            state = visit_live(start, size, state)

        def step(i, state):
            return visit_live(*chunk(i), state)

        state = _loop(count, step, state, 1, total.shapes(state))
    else:
        state = None
        for i, ((start, size), (lo, hi)) in enumerate(zip(plan.chunks, plan.ranges)):
            # One chunk at a time: two in flight measured no faster and held more.
            with _after(total.done, i, 1):
                state = visit(start, size, lo, hi, state, plan.segments_of(i, inputs))
    d_query, d_key, d_value, d_bias, d_sink, d_mod = total.finish(state)
    d_mod = [ops.cast(d_mod[i], inputs.mod.args[j].dtype) for j, i in enumerate(inputs.mod.wanted)]
    return [
        _from_heads(d_query * inputs.options.scale, inputs.query.dtype),
        _from_keys_last(d_key, inputs.key.dtype),
        _from_keys_last(d_value, inputs.value.dtype),
        None if d_bias is None else ops.cast(d_bias, inputs.bias.dtype),
        None if d_sink is None else ops.cast(d_sink, inputs.sinks.dtype),
    ] + d_mod


class _Gradients:
    """Sums the chunks' gradients.

    In a loop, the state is full-size buffers, each chunk's part added at its rows
    and key range (in place under XLA). Unrolled,
    the query gradients are kept per chunk and the key and value gradients summed
    over growing key prefixes (`_KeySum`).
    """

    def __init__(self, plan, inputs):
        self.plan, self.inputs = plan, inputs
        self.bias_shape = None if inputs.bias is None else tuple(inputs.bias.shape)
        self.d_queries, self.done = [], []
        self.rows = _Rows(plan)  # a loop's query gradients

    def zeros(self):
        """The loop's initial state."""
        inputs = self.inputs
        shape = tuple(ops.shape(inputs.q))
        keys = ops.shape(inputs.key_t)[3]
        state = [
            self.rows.empty(shape),
            ops.zeros(shape[:2] + (shape[3], keys), "float32"),
            ops.zeros(shape[:2] + (ops.shape(inputs.v)[3], keys), "float32"),
            None if inputs.bias is None else ops.zeros(ops.shape(inputs.bias), "float32"),
            None if inputs.sink is None else ops.zeros(ops.shape(inputs.sinks), "float32"),
        ]
        state += inputs.mod.zeros()
        return tuple(x for x in state if x is not None)

    def shapes(self, state):
        """The loop's shapes for `state` (see `_loop`)."""
        return (self.rows.shape(state[0]),) + (None,) * (len(state) - 1)

    def add(self, state, block, parts):
        """`state` with a chunk's gradient `parts` added."""
        d_query, d_key, d_value, d_logits, d_sink, d_mod = parts
        d_bias = None if self.bias_shape is None else self._bias_part(d_logits)
        if self.plan.loop:
            state = self._add_in_place(state, block, d_query, d_key, d_value, d_bias, d_sink)
            return _add_mod(state, d_mod)
        if state is None:
            state = _Unrolled(self.plan, self.inputs, self.bias_shape)
        self.d_queries.append(d_query)
        with _after(self.d_queries, len(self.d_queries), 1):
            state.add(block, d_key, d_value, d_bias, d_sink, d_mod)
        # The next chunks wait for this one's sums, not only its query gradient: the
        # parts of chunks run ahead would otherwise wait, all alive, to be added.
        self.done.append([d_query, state.d_key.sum, state.d_value.sum])
        return state

    def add_blocks(self, state, start, size, rows, live=None):
        """`state` with the gradients of a loop's chunk added, its key blocks (a
        dynamic loop's runs) visited in a loop as the forward pass visits them
        (`_forward_blocks`): the key, value and bias parts added at each block's keys
        (in place in a static loop; a moved last block's masked keys add zeros), the
        query part summed over the blocks. Where `live` is False, no block."""
        inputs, plan = self.inputs, self.plan
        count, block_of = plan.visits(inputs, start, size)
        if live is not None:
            count = ops.where(live, count, 0)
        padded = plan.dynamic
        shape = ops.shape(inputs.q)
        d_query = ops.zeros((shape[0], shape[1], size, shape[3]), "float32")
        has_bias = self.bias_shape is not None

        mods = len(inputs.mod.zeros())
        rest = len(state) - mods  # the score function's sums come last

        def step(j, sums):
            d_query, d_key, d_value, *d_bias = sums[: len(sums) - mods]
            block = block_of(j)
            parts = _backward_chunk(block, rows, sink=False)
            at = [0, 0, 0, block.lo]
            new = [d_query + parts[0], _add_at(d_key, parts[1], at, padded)]
            new.append(_add_at(d_value, parts[2], at, padded))
            if has_bias:
                part = self._bias_part(parts[3])
                new.append(_add_at(d_bias[0], part, self._bias_at(block), padded))
            return _add_mod(tuple(new) + tuple(sums[len(new) :]), parts[5])

        kept = (d_query, state[1], state[2]) + ((state[3],) if has_bias else ())
        sums = _loop(count, step, kept + tuple(state[rest:]), 1)
        state = list(state)
        state[0] = self.rows.put(state[0], sums[0], start)
        state[1 : len(kept)] = sums[1 : len(kept)]
        state[rest:] = sums[len(kept) :]
        if inputs.sink is not None:
            state[rest - 1] = state[rest - 1] + _sink_gradient(inputs, rows[1], rows[2])
        return tuple(state)

    def _add_in_place(self, state, block, d_query, d_key, d_value, d_bias, d_sink):
        state, padded = list(state), self.plan.dynamic
        state[0] = self.rows.put(state[0], d_query, block.start)
        state[1] = _add_at(state[1], d_key, [0, 0, 0, block.lo], padded)
        state[2] = _add_at(state[2], d_value, [0, 0, 0, block.lo], padded)
        i = 3
        if d_bias is not None:
            state[i] = _add_at(state[i], d_bias, self._bias_at(block), padded)
            i += 1
        if d_sink is not None:
            state[i] = state[i] + d_sink
        return tuple(state)

    def _bias_at(self, block):
        """Where `block`'s bias gradient goes in the bias's shape (0 along a
        broadcast axis)."""
        rows = block.start if self.bias_shape[2] != 1 else 0
        keys = block.lo if self.bias_shape[3] != 1 else 0
        return [0, 0, rows, keys]

    def _bias_part(self, d_logits):
        """`d_logits` summed over the axes the bias broadcasts along."""
        axes = tuple(i for i, d in enumerate(self.bias_shape) if d == 1)
        return ops.sum(d_logits, axis=axes, keepdims=True) if axes else d_logits

    def finish(self, state):
        if self.plan.loop:
            state = list(state)
            d_query, d_key, d_value = self.rows.join(state[0]), state[1], state[2]
            rest = state[3:]
            d_bias = rest.pop(0) if self.bias_shape is not None else None
            d_sink = rest.pop(0) if self.inputs.sink is not None else None
            return d_query, d_key, d_value, d_bias, d_sink, rest
        return (self.plan.concat(self.d_queries), *state.finish(self.plan))


class _Unrolled:
    """The unrolled chunks' key, value, bias and sink gradients."""

    def __init__(self, plan, inputs, bias_shape):
        in_place = plan.in_place_sums
        self.d_key = _KeySum(plan.key_length, inputs.key_t, inputs.q, in_place)
        self.d_value = _KeySum(plan.key_length, inputs.key_t, inputs.v, in_place)
        self.bias_shape, self.key_length = bias_shape, plan.key_length
        self.bias_rows, self.bias_sum, self.d_sink = [], None, None
        self.d_mod = inputs.mod.zeros()

    def add(self, block, d_key, d_value, d_bias, d_sink, d_mod=()):
        self.d_mod = _add_mod(self.d_mod, d_mod)
        hi = None if block.keys is None else block.lo + block.keys
        self.d_key.add(d_key, block.lo, hi)
        self.d_value.add(d_value, block.lo, hi)
        if d_bias is not None:
            if self.bias_shape[3] != 1 and hi is not None:
                d_bias = masks.pad_along(d_bias, 3, block.lo, self.key_length - hi)
            if self.bias_shape[2] != 1:
                self.bias_rows.append(d_bias)
            else:
                self.bias_sum = d_bias if self.bias_sum is None else self.bias_sum + d_bias
        if d_sink is not None:
            self.d_sink = d_sink if self.d_sink is None else self.d_sink + d_sink

    def finish(self, plan):
        d_bias = self.bias_sum
        if self.bias_rows:
            d_bias = plan.concat(self.bias_rows)
        return self.d_key.total(), self.d_value.total(), d_bias, self.d_sink, list(self.d_mod)


class _KeySum:
    """A `(B, N, C, S)` float32 gradient summed from per-chunk key ranges `[lo, hi)`.

    The running sum covers keys `[0, largest hi so far)`; a part is padded to it, or
    it to the part. Each add waits for its chunk (see `_Gradients.add`), which keeps
    TensorFlow's graph optimizer from fusing the chain into one `AddN` that would
    hold every chunk's part at once. `in_place` (a known `S`): the sum is one zeroed
    `(B, N, C, S)` buffer from the start, each part added into its keys (in place on
    torch: `_add_into`).
    """

    def __init__(self, length, key_t, channels_of, in_place=False):
        self.length = length
        self.key_t, self.channels_of = key_t, channels_of
        self.sum, self.covered = None, 0
        self.in_place = in_place and isinstance(length, int)

    def add(self, part, lo, hi):
        if hi is None:  # unknown S: every chunk covers all keys
            self.sum = part if self.sum is None else self.sum + part
            return
        if self.in_place:  # each part added into its keys of one whole buffer
            if self.sum is None:
                self.sum, self.covered = self._zeros(), self.length
            self.sum = _add_into(self.sum, part, lo, hi)
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
            return self._zeros()
        if self.length is not None and self.covered < self.length:
            return _pad_keys(self.sum, 0, self.length - self.covered)
        return self.sum

    def _zeros(self):
        lead, channels = ops.shape(self.key_t), ops.shape(self.channels_of)[3]
        return ops.zeros((lead[0], lead[1], channels, lead[3]), "float32")


# ------------------------------------------------------------------- score function
@dataclasses.dataclass(frozen=True, eq=False)
class _ScoreModInputs:
    """A score function (`score_mod`, a `ScoreMod`, or `None`) and the tensors it reads as
    the kernel holds them: `args`, its floating tensors (positions `wanted`), are the
    custom gradient's inputs; `tensors` all of them, those inputs in their places."""

    score_mod: Any
    tensors: tuple
    wanted: tuple
    args: list

    @classmethod
    def make(cls, score_mod):
        if score_mod is None:
            return cls(None, (), (), [])
        wanted = score_mod.differentiable
        args = [_as_tensor(score_mod.tensors[i]) for i in wanted]
        return cls(score_mod, score_mod.tensors, wanted, args).with_args(args)

    def with_args(self, args):
        """These inputs with `args` (the custom gradient's copies) in `tensors`."""
        tensors = list(self.tensors)
        for i, t in zip(self.wanted, args):
            tensors[i] = t
        return dataclasses.replace(self, tensors=tuple(tensors), args=list(args))

    def zeros(self):
        """Float32 zeros like each tensor: the sums of their gradients."""
        return [ops.zeros(ops.shape(t), "float32") for t in self.tensors]


def _add_mod(state, d_mod):
    """`state` with the score function's gradient parts `d_mod` added to its last
    `len(d_mod)` items."""
    if not d_mod:
        return state
    state = list(state)
    first = len(state) - len(d_mod)
    state[first:] = [a + b for a, b in zip(state[first:], d_mod)]
    return tuple(state)


# ------------------------------------------------------------------------- helpers
def _static(dim):
    return dim if isinstance(dim, int) else None


def _width(lo, hi):
    return None if hi is None else hi - lo


def _pad_keys(x, before, after):
    return masks.pad_along(x, 3, before, after)


def _add_at(buffer, part, starts, padded):
    """`buffer` plus `part` placed at `starts` (zeros elsewhere): a loop's running
    sums, and a static loop's rows, each written once into zeros. `padded`: as a sum with `part`
    padded to the buffer's shape (a dynamic loop: TensorFlow's slice update is an XLA
    op, compiled on the CPU for every shape of `part`)."""
    same = tuple(part.shape) == tuple(buffer.shape) and None not in tuple(part.shape)
    if same and all(isinstance(s, int) and s == 0 for s in starts):
        return buffer + part
    if padded:
        sizes, totals = ops.shape(part), ops.shape(buffer)
        return buffer + ops.pad(part, [(s, t - s - n) for s, t, n in zip(starts, totals, sizes)])
    return ops.slice_update(buffer, starts, ops.slice(buffer, starts, ops.shape(part)) + part)


def _add_into(buffer, part, lo, hi):
    """`buffer` with `part` added at keys `[lo, hi)` of its last axis: in place on
    torch (the buffer is the backward's own), a slice update elsewhere."""
    if hasattr(buffer, "add_"):
        buffer[..., lo:hi].add_(part)
        return buffer
    return _add_at(buffer, part, [0, 0, 0, lo], False)


def _loop(count, body, state, in_flight, shapes=None):
    """`state` after `body(i, state)` for `i < count`; TensorFlow graphs run at most
    `in_flight` iterations at once (its while loop would start ten). `shapes`: per
    state item, `None` or the shape it keeps through the loop (`None` where a size
    varies; TensorFlow only)."""
    if backend.backend() == "tensorflow":
        import tensorflow as tf

        invariants = None
        if shapes is not None:
            kept = [tf.TensorShape(s if s is not None else x.shape) for s, x in zip(shapes, state)]
            invariants = (tf.TensorShape([]), tuple(kept))
        return tf.while_loop(
            lambda i, _: i < count,
            lambda i, s: (i + 1, body(i, s)),
            (0, state),
            parallel_iterations=in_flight or 1,
            shape_invariants=invariants,
        )[1]
    return ops.fori_loop(0, count, body, state)


def _from_heads(x, dtype):
    return ops.cast(ops.transpose(x, (0, 2, 1, 3)), dtype)


def _matmul(a, b):
    return ops.cast(ops.matmul(a, b), "float32")


def _product(a, b, dtype):
    """`a @ b` over the last two axes, in `dtype`, as float32."""
    return ops.cast(ops.matmul(ops.cast(a, dtype), ops.cast(b, dtype)), "float32")


def _from_keys_last(x, dtype):
    """A key or value gradient `(B, N, C, S)` as `(B, S, N, C)`, in `dtype`."""
    return ops.cast(ops.transpose(x, (0, 3, 1, 2)), dtype)


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


def _after(outputs, index, in_flight):
    """Context in which the chunk `index` waits for chunk `index - in_flight`
    (TensorFlow graphs; a no-op elsewhere)."""
    if not in_flight or index < in_flight or backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    import tensorflow as tf

    if tf.executing_eagerly():
        return contextlib.nullcontext()
    waited = outputs[index - in_flight]
    return tf.control_dependencies(waited if isinstance(waited, list) else [waited])
