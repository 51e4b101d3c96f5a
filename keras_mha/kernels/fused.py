"""The backend's fused kernel (`keras.ops.dot_product_attention`; torch's
`scaled_dot_product_attention` directly).

The kernel takes one mask or bias tensor. A mask it can take as it is, it gets whole:
none, causality alone (`is_causal`), key padding, the user's dense mask, a bias. A mask
that would have to be built over the whole `(T, S)` (causality or a window together
with padding, a decoding offset given as a tensor, packed rows' document ids) is built
one chunk of queries at a time instead, and the kernel runs on each chunk against the
keys it can see: no `(T, S)` tensor, and a causal call skips the keys after each
chunk's last query.

Padded queries, and rows left with no key, are zeroed after the kernel, which never
sees an all-masked row (some kernels turn one into NaN).
"""

import dataclasses

import numpy as np
from keras import backend, ops

from keras_mha import masks as masks_lib
from keras_mha.kernels import logits as logits_lib
from keras_mha.kernels import policy, trim


def attention(
    query,
    key,
    value,
    *,
    scale,
    mask=None,
    bias=None,
    flash=None,
    chunk_size=256,
    empty_rows="zero",
):
    """Returns the output `(B, T, N, Hv)`.

    Args:
        query: `(B, T, N, H)`; key: `(B, S, N, H)`; value: `(B, S, N, Hv)`.
        mask: an `AttentionMask`, or `None`.
        bias: float, broadcastable to `(B, N, T, S)`, or `None`.
        flash: the layer's `flash_attention` (`None` lets the backend decide).
        chunk_size: query rows per chunk, when the mask is built chunk by chunk.
        empty_rows: what a row with no visible key gets: "zero" weights, or the
            mean of the values ("mean").
    """
    dtype = query.dtype
    if backend.standardize_dtype(dtype) == "float16" and not policy.current().fused_float16:
        query, key, value = (ops.cast(x, "float32") for x in (query, key, value))
    run = _Kernel(scale, flash)
    mean = empty_rows == "mean" and mask is not None
    # Where the kernel runs whole or by chunks, the rows it would zero get the mean:
    # one `where`, not `mean_where_empty` after it.
    filled = _Kernel(scale, flash, mean_of=value) if mean else None
    if mean and bias is None and _takes_whole(mask, bias):
        return ops.cast(filled(query, key, value, *_whole_mask(mask), None), dtype)
    if _has_tail(query, key, mask, bias):
        output = _causal_with_tail(run, query, key, value)
    elif _takes_whole(mask, bias):
        output = run(query, key, value, *_whole_mask(mask), bias)
    elif _folds_key_padding(mask, bias, query):
        output = _folded(run, query, key, value, mask, scale)
    elif (runs := _document_runs(query, key, mask, bias, chunk_size)) is not None:
        output = _by_documents(run, query, key, value, mask, runs)
    elif (rows := _causal_from(query, key, mask, bias)) is not None:
        output = _with_causal_rows(run, query, key, value, mask, rows, chunk_size)
    elif mean:
        return ops.cast(_by_chunks(filled, query, key, value, mask, bias, chunk_size), dtype)
    else:
        output = _by_chunks(run, query, key, value, mask, bias, chunk_size)
    output = ops.cast(output, dtype)
    return logits_lib.mean_where_empty(output, value, mask) if mean else output


def _takes_whole(mask, bias):
    """Whether the kernel takes the mask as it is, with no `(T, S)` tensor built."""
    if mask is None:
        return True
    if mask.query_segments is not None or mask.block_mask is not None:  # built per chunk
        return False
    if mask.window is not None or (mask.causal and mask.static_offset != 0):
        return False
    if mask.causal:  # `is_causal` takes no other mask or bias
        return mask.key_valid is None and mask.dense is None and bias is None
    return mask.key_valid is None or policy.current().fused_key_padding


def _has_tail(query, key, mask, bias):
    """Whether an eager causal call has queries past its last key (`T > S`, offset 0:
    what a cut leaves of right-padded rows when, as in keras-hub's models, the padded
    queries attend to the keys), which see every key, and the policy has them skip
    their backward where their gradient is zero (`Policy.skip_zero_gradient_tail`)."""
    if mask is None or bias is not None or not policy.current().skip_zero_gradient_tail:
        return False
    if not mask.causal or mask.static_offset != 0 or not _takes_whole(mask, bias):
        return False
    if mask.key_valid is not None or mask.dense is not None or mask.query_valid is not None:
        return False
    query_length, key_length = query.shape[1], key.shape[1]
    if not (isinstance(query_length, int) and isinstance(key_length, int)):
        return False
    return 0 < key_length < query_length and trim.holds_data(query) and _records(query)


def _records(*tensors):
    """Whether torch's autograd records an op on `tensors`; not under `torch.func`'s
    transforms (`grad`, `vmap`: tensors they wrap), which differentiate on their own;
    never on another backend, whatever a policy override says."""
    if backend.backend() != "torch":
        return False
    import torch

    if not torch.is_grad_enabled() or not all(isinstance(x, torch.Tensor) for x in tensors):
        return False
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    if wrapped is None or any(wrapped(x) for x in tensors):
        return False
    return any(x.requires_grad for x in tensors)


def _causal_with_tail(run, query, key, value):
    """A causal call whose queries from `S` on see every key: the first `S` queries
    as a causal square, the tail as plain attention whose backward is skipped when its
    output's gradient is zero (a loss that ignores padded positions)."""
    head, tail = ops.split(query, [key.shape[1]], axis=1)
    head = run(head, key, value, None, None, True, None)
    tail = _zero_gradient_skipped()(lambda q, k, v: run(q, k, v, None, None, False, None))(
        tail, key, value
    )
    return ops.concatenate([head, tail], axis=1)


_SKIPPED = []


def _zero_gradient_skipped():
    """`wrap(fn)`: `fn(*tensors)` under torch's autograd, whose backward gives no
    gradient where the output's is all zero (no kernel runs) and otherwise recomputes
    `fn` and differentiates it. Defined on first use: torch is imported then only."""
    if not _SKIPPED:
        import torch

        class ZeroGradientSkipped(torch.autograd.Function):
            @staticmethod
            def forward(ctx, fn, *tensors):
                ctx.fn = fn
                ctx.save_for_backward(*tensors)
                return fn(*tensors)

            @staticmethod
            def backward(ctx, grad):
                tensors = ctx.saved_tensors
                if not bool(grad.any()):
                    return (None,) * (len(tensors) + 1)
                wanted = ctx.needs_input_grad[1:]
                with torch.enable_grad():
                    inputs = [x.detach().requires_grad_(w) for x, w in zip(tensors, wanted)]
                    output = ctx.fn(*inputs)
                    asked = [x for x in inputs if x.requires_grad]
                    grads = iter(torch.autograd.grad(output, asked, grad))
                return (None, *(next(grads) if w else None for w in wanted))

        _SKIPPED.append(lambda fn: lambda *tensors: ZeroGradientSkipped.apply(fn, *tensors))
    return _SKIPPED[0]


def _folds_key_padding(mask, bias, query):
    """Whether the kernel takes the key padding as one more head channel (`_folded`):
    the policy says so for the query's dtype, and padding is all the mask holds
    besides causality."""
    dtype = backend.standardize_dtype(query.dtype)
    if dtype not in policy.current().fold_key_padding or bias is not None:
        return False
    if mask.key_valid is None or len(mask.key_valid.shape) != 2:
        return False
    if mask.dense is not None or mask.query_segments is not None or mask.window is not None:
        return False
    if mask.block_mask is not None:
        return False
    return not mask.causal or mask.static_offset == 0


# How far a key that padding hides falls below every other key's logit, in logits: its
# weight, exp(-FOLD_SHIFT) next to the row's largest, is zero in float32.
FOLD_SHIFT = 1e4


def _folded(run, query, key, value, mask, scale):
    """The kernel once, whole (with `is_causal` where the mask is causal), the key
    padding folded into the head channels: no mask tensor at all.

    The query gets a channel of ones and the key a channel holding `-FOLD_SHIFT / scale`
    where its padding hides it and 0 elsewhere, both padded with zeros to a multiple of
    8 channels (what the kernels take). A visible key's logit gains exactly 0; a hidden
    key's falls by `FOLD_SHIFT`, so its weight is 0. Rows left with no key are zeroed
    after the kernel, as everywhere (`AttentionMask.empty_rows`, `O(B * (T + S))`).
    """
    channels = query.shape[-1]
    extra = -(-(channels + 1) // 8) * 8 - channels  # channels added: 1 to 8
    dtype = query.dtype
    hidden = -FOLD_SHIFT / scale
    if backend.standardize_dtype(dtype) == "float16":
        hidden = ops.maximum(hidden, -6e4)  # float16 holds up to 65504
    one_hot = ops.one_hot(0, extra, dtype=dtype)  # (extra,): 1, 0, ..., 0
    query = ops.concatenate(
        [query, ops.broadcast_to(one_hot, (*ops.shape(query)[:-1], extra))], axis=-1
    )
    hides = ops.cast(ops.logical_not(mask.key_valid), dtype) * hidden  # (B, S)
    key_channels = hides[:, :, None, None] * one_hot  # (B, S, 1, extra)
    key = ops.concatenate(
        [key, ops.broadcast_to(key_channels, (*ops.shape(key)[:-1], extra))], axis=-1
    )
    value_channels = value.shape[-1]
    if value_channels == channels:  # the kernels want equal head sizes
        value = masks_lib.pad_along(value, 3, 0, extra)
    empty = mask.empty_rows(ops.shape(query)[1], ops.shape(key)[1])  # (B, 1, T)
    valid = ops.logical_not(empty)[..., None]  # (B, 1, T, 1), as a kernel mask's rows
    output = run(query, key, value, None, valid, mask.causal, None)
    return output[..., :value_channels]


def _document_runs(query, key, mask, bias, chunk_size):
    """Per batch row, the `(start, end)` of each document, where a packed
    self-attention call goes by documents (`_by_documents`); else `None`.

    Where the ids hold data (eager calls), each document id is one contiguous run of
    positions, the queries' ids are the keys', and nothing else masks the call but
    causality from position 0: each document then runs whole, alone, as FlashAttention's
    variable-length kernels run packed rows. Only where that makes no more kernel
    calls than the chunks of queries would (`chunk_size`): rows of many short documents
    go by chunks."""
    segments = mask.query_segments
    if segments is None or bias is not None or not trim.holds_data(query):
        return None
    if query.shape[1] != key.shape[1]:
        return None
    if mask.dense is not None or mask.window is not None or mask.key_valid is not None:
        return None
    if mask.block_mask is not None:
        return None
    if mask.query_valid is not None or (mask.causal and mask.static_offset != 0):
        return None
    if chunk_size is None:
        return None
    ids = ops.convert_to_numpy(segments)
    keys = mask.key_segments  # the queries' own tensor unless key ids were given
    if keys is not segments and not np.array_equal(ids, ops.convert_to_numpy(keys)):
        return None
    runs = []
    for row in ids:
        starts = [0, *(np.flatnonzero(row[1:] != row[:-1]) + 1).tolist()]
        spans = [(a, b) for a, b in zip(starts, starts[1:] + [len(row)]) if row[a] != 0]
        if len({int(row[a]) for a, _ in spans}) != len(spans):  # an id in two runs
            return None
        runs.append(spans)
    if sum(len(spans) for spans in runs) > -(-ids.shape[1] // chunk_size):
        return None
    return runs


def _by_documents(run, query, key, value, mask, runs):
    """The kernel on each document of each batch row alone (`_document_runs`), with
    `is_causal` where the mask is causal; padding (id 0) gets zero rows."""
    shape = ops.shape(query)
    spans = [(b, start, end) for b, row in enumerate(runs) for start, end in row]
    taken = [iter(_spans_of(x, spans)) for x in (query, key, value)]
    rows = []
    for row in runs:
        parts, at = [], 0
        for start, end in row:
            if start > at:
                parts.append(_zero_rows(query, value, start - at, batch=1))
            q, k, v = (next(x) for x in taken)
            parts.append(run(q, k, v, None, None, mask.causal, None))
            at = end
        if at < shape[1]:
            parts.append(_zero_rows(query, value, shape[1] - at, batch=1))
        rows.append(parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1))
    return rows[0] if len(rows) == 1 else ops.concatenate(rows, axis=0)


def _zero_rows(query, value, length, batch=None):
    """Zero output rows `(B or batch, length, N, Hv)` for queries that see no key."""
    shape = ops.shape(query)
    batch = shape[0] if batch is None else batch
    return ops.zeros((batch, length, shape[2], ops.shape(value)[3]), query.dtype)


def _whole_mask(mask):
    """`(kernel_mask, valid_rows, is_causal)` for a mask the kernel takes whole."""
    if mask is None:
        return None, None, False
    keys = None if mask.key_valid is None else mask.key_valid[:, None, None, :]
    kernel_mask, valid = _unmask_empty_rows(masks_lib.logical_and(keys, mask.dense))
    if mask.query_valid is not None:
        valid = masks_lib.logical_and(valid, mask.query_valid[:, None, :, None])
    return kernel_mask, valid, mask.causal


def _unmask_empty_rows(kernel_mask):
    """`(kernel_mask, valid_rows)`: rows with no key unmasked (zeroed later)."""
    if kernel_mask is None:
        return None, None
    valid = ops.any(kernel_mask, axis=-1, keepdims=True)
    return ops.logical_or(kernel_mask, ops.logical_not(valid)), valid


def _by_chunks(run, query, key, value, mask, bias, chunk_size):
    """The kernel on each chunk of queries, against the keys the chunk can see."""
    query_length, key_length = query.shape[1], key.shape[1]
    if not isinstance(query_length, int):  # unknown or symbolic: one chunk
        query_length, chunk_size = ops.shape(query)[1], None
    if not isinstance(key_length, int):
        key_length = ops.shape(key)[1]
    # The last chunk (the most keys) first: later chunks' buffers fit in freed ones.
    starts = [0] if chunk_size is None else range(0, query_length, chunk_size)[::-1]
    # Where the masks hold data, each chunk takes only the keys its queries may see by
    # their documents and padding, as well as by causality and the window.
    narrowed = chunk_size is not None and mask.data_dependent and trim.holds_data(query)
    chunks = []  # (start, size, key runs), or no runs where the chunk sees no key
    for start in starts:
        size = query_length if chunk_size is None else min(chunk_size, query_length - start)
        lo, hi = mask.key_range(start, size, key_length)
        if chunk_size is None:
            lo, hi = 0, key_length
        elif narrowed:
            lo, hi = (int(x) for x in mask.visible_range(start, size, key_length))
        if isinstance(lo, int) and isinstance(hi, int) and hi <= lo:  # no key to see
            chunks.append((start, size, None))
            continue
        runs = mask.block_runs(start, size, lo, hi) if bias is None else None
        if not runs or len(runs) == 1:  # one range: sliced, not gathered
            runs = ((lo, hi),)
        chunks.append((start, size, runs))
    queries = iter(_spans_of(query, [(None, start, start + size) for start, size, _ in chunks]))
    spans = [(None, lo, hi) for _, _, runs in chunks for lo, hi in runs or ()]
    keys, values = (iter(_spans_of(x, spans)) for x in (key, value))
    outputs = []
    for start, size, runs in chunks:
        chunk_queries = next(queries)
        if runs is None:
            outputs.append(run.empty(query, value, size))
            continue
        block = _joined([mask.block(start, size, a, b - a) for a, b in runs], runs, size)
        kernel_mask, valid = _unmask_empty_rows(block)
        chunk_bias = None
        if bias is not None:
            lo, hi = runs[0]  # a bias: one range
            chunk_bias = masks_lib.block_of(bias, start, size, lo, hi - lo)
        output = run(
            chunk_queries,
            _concat([next(keys) for _ in runs]),
            _concat([next(values) for _ in runs]),
            kernel_mask,
            valid,
            False,
            chunk_bias,
        )
        outputs.append(output)
    return outputs[0] if len(outputs) == 1 else ops.concatenate(outputs[::-1], axis=1)


def _causal_from(query, key, mask, bias):
    """The query position `R` from which a block mask's rows are exactly causal
    (`BlockMask.causal_from`: a prefix-LM's queries past its prefix), where the call
    is `T = S` self-attention under the block mask alone, and `R` at most a quarter
    of `T` (a larger `R` measured slower: benchmarks/results, "Attention patterns as
    code"); else `None`."""
    block_mask = mask.block_mask
    if block_mask is None or bias is not None or mask.static_offset != 0:
        return None
    if not dataclasses.replace(mask, block_mask=None).is_empty:
        return None  # padding, a dense mask, a window, documents or causality too
    length, rows = query.shape[1], block_mask.causal_from
    if not (isinstance(length, int) and length == key.shape[1] == block_mask.query_length):
        return None
    return rows if 0 < rows and 4 * rows <= length else None


def _with_causal_rows(run, query, key, value, mask, rows, chunk_size):
    """Queries before `rows` by chunks under the block mask (`_by_chunks`); those
    from `rows` on, whose rows are causal, as the rows of one call of the backend's
    causal kernel (`is_causal`, its own block skipping) over all the queries. The
    rows before `rows` are computed there too and dropped: at most a fifteenth of
    the work of the rows kept, at `4 * rows <= T`."""
    queries = masks_lib.slice_along(query, 1, 0, rows)
    head = _by_chunks(run, queries, key, value, mask, None, chunk_size)
    causal = run(query, key, value, None, None, True, None)
    tail = masks_lib.slice_along(causal, 1, rows, query.shape[1] - rows)
    return ops.concatenate([head, tail], axis=1)


def _spans_of(x, spans):
    """`x[b:b + 1, lo:hi]` (`b` `None`: every batch row) for each `(b, lo, hi)` of
    `spans`, views of `x`.

    Under torch's autograd a slice's gradient is a zero tensor of the whole `x`
    holding the slice's gradient, one per slice: the chunks of a call filled
    `chunks x L` rows of zeros, as much work as the attention itself in a sparse
    pattern (benchmarks/results/README.md, "Attention patterns as code"). There the
    views come from one `autograd.Function` whose gradient is one zero tensor of `x`'s
    size, each view's gradient added in place at its rows."""
    if len(spans) > 1 and _static(spans) and _records(x):
        return _one_gradient_views()(x, [(b, int(lo), int(hi)) for b, lo, hi in spans])
    return [_span(x, *span) for span in spans]


def _span(x, b, lo, hi):
    if b is not None:
        x = masks_lib.slice_along(x, 0, b, 1)
    return masks_lib.slice_along(x, 1, lo, hi - lo)


def _static(spans):
    return all(isinstance(v, (int, np.integer)) for _, lo, hi in spans for v in (lo, hi))


_VIEWS = []


def _one_gradient_views():
    """`views(x, spans)`: `_spans_of`'s views under torch's autograd, with one zero
    gradient of `x`'s size. Defined on first use: torch is imported then only."""
    if not _VIEWS:
        import torch

        class OneGradientViews(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, spans):
                ctx.spans, ctx.shape = spans, x.shape
                views = []
                for b, lo, hi in spans:
                    view = x if b is None else x.narrow(0, b, 1)
                    views.append(view.narrow(1, lo, hi - lo))
                return tuple(views)

            @staticmethod
            def backward(ctx, *grads):
                total = None
                for (b, lo, hi), grad in zip(ctx.spans, grads):
                    if grad is None:
                        continue
                    if total is None:
                        total = grad.new_zeros(ctx.shape)
                    rows = total if b is None else total.narrow(0, b, 1)
                    rows.narrow(1, lo, hi - lo).add_(grad)
                return total, None

        _VIEWS.append(lambda x, spans: OneGradientViews.apply(x, spans))
    return _VIEWS[0]


def _joined(parts, runs, size):
    """The masks of a chunk's key runs side by side (`None` where every part is);
    a part that is `None` (all visible) becomes true."""
    if len(parts) == 1 or all(p is None for p in parts):
        return parts[0] if len(parts) == 1 else None
    lead = [1, 1]
    for p in parts:
        if p is not None:
            lead = [max(a, b) for a, b in zip(lead, p.shape[:2])]
    full = [
        ops.ones((*lead, size, b - a), "bool") if p is None else p for p, (a, b) in zip(parts, runs)
    ]
    full = [ops.broadcast_to(p, (*lead, size, b - a)) for p, (a, b) in zip(full, runs)]
    return ops.concatenate(full, axis=-1)


def _concat(parts):
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)


class _Kernel:
    """One call of the backend's kernel; the rows `valid` marks False get zeros, or with
    `mean_of` (the call's values `(B, S, N, Hv)`: `empty_rows="mean"`) the mean of those
    values, computed where first needed, once."""

    def __init__(self, scale, flash, mean_of=None):
        self.scale, self.flash, self._mean_of, self._mean = scale, flash, mean_of, None

    def _fill(self, dtype):
        if self._mean_of is None:
            return 0.0
        if self._mean is None:
            self._mean = logits_lib.values_mean(self._mean_of, dtype)
        return self._mean

    def empty(self, query, value, length):
        """The output rows `(B, length, N, Hv)` of queries that see no key."""
        if self._mean_of is None:
            return _zero_rows(query, value, length)
        shape = ops.shape(query)
        rows = (shape[0], length, shape[2], ops.shape(value)[3])
        return ops.broadcast_to(self._fill(query.dtype), rows)

    def __call__(self, query, key, value, mask, valid, is_causal, bias):
        if bias is not None and mask is not None:  # the kernels take one of them
            bias = ops.cast(bias, "float32") + logits_lib.mask_bias(mask)
            mask = None
        if backend.backend() == "torch" and not self.flash:
            output = _torch_attention(
                query, key, value, mask=mask, bias=bias, scale=self.scale, is_causal=is_causal
            )
        else:
            output = ops.dot_product_attention(
                query,
                key,
                value,
                bias=bias,
                mask=mask,
                scale=self.scale,
                is_causal=is_causal,
                flash_attention=self.flash,
            )
        if valid is not None:
            valid = ops.transpose(valid, (0, 2, 1, 3))  # (B, T or 1, N or 1, 1)
            output = ops.where(valid, output, self._fill(output.dtype))
        return output


def _torch_attention(query, key, value, *, mask, bias, scale, is_causal):
    """torch's `scaled_dot_product_attention` on heads-first views of `(B, T, N, H)`.

    What Keras's torch `dot_product_attention` runs, minus its copies: it makes the
    transposed query, key and value contiguous (and the output projection then
    copies the transposed result back), while torch's kernels take strided views.
    """
    import torch

    dtype = backend.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (ops.cast(x, dtype).transpose(1, 2) for x in (query, key, value))
    attn_mask = mask if bias is None else ops.cast(bias, dtype)
    with _exact_backward(attn_mask, query, key, value):
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale
        )
    return output.transpose(1, 2)


def _exact_backward(attn_mask, *tensors):
    """torch's math kernel where gradients are taken through a float mask with a row
    left with no key (every entry below `logits.NO_KEY_BIAS`); else torch's choice.

    torch's CPU flash kernel keeps each row's log-sum-exp in float32 for its backward.
    Where a row's logits are all near -1e9 (T5Gemma's `(1 - mask) * -1e9` on a padded
    query), the sum's `log(S)` is lost in it, and that row's gradients come out wrong
    (by 838 in a tiny T5Gemma's weight gradients) while its output is right. The math
    kernel differentiates the softmax as written, as the other backends do
    (tests/test_kernels.py::test_bias_row_with_no_key_has_the_explicit_kernels_gradients).
    """
    import contextlib

    import torch

    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if attn_mask is None or attn_mask.dtype == torch.bool or not needs_grad:
        return contextlib.nullcontext()
    if not bool((torch.amax(attn_mask, dim=-1) < logits_lib.NO_KEY_BIAS).any()):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)
