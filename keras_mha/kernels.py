"""Attention itself, on projected heads: explicit (with scores), fused, chunked.

All three compute `softmax(q k^T * scale, masked) v` with the same conventions:

- inputs are projected tensors, query `(B, T, N, H)`, key `(B, S, N, H)`,
  value `(B, S, N, Hv)` (the explicit kernel also takes N-d attention layouts);
- `mask` is boolean, `True` = may attend, already broadcastable to the scores;
- a query row with no key to attend to gets zero weights, hence a zero context,
  finite outputs and finite gradients, on every implementation;
- the softmax runs in float32 whatever the compute dtype.

Which one runs is a separate decision, made by `choose_implementation`.
"""

import contextlib
import functools

from keras import backend, ops

from keras_mha import checks
from keras_mha import masks as masks_lib

IMPLEMENTATIONS = ("explicit", "fused", "chunked")

# Chunk size of `chunked_attention` per backend when none is given, by measurement:
# TensorFlow's query chunks of 128 rows took 0.74x the time of 256-row chunks at
# T=S=8192 (B=1, 4 heads: 16 MiB of float32 scores per chunk instead of 32) and the
# same within noise at B=8, T=256; JAX's key chunks of 256 took 0.91x the forward time
# of 128 at T=256 (one chunk) and tied at T=8192 (2 CPU cores, 2026-11-23).
DEFAULT_CHUNK_SIZE = {"tensorflow": 128, "jax": 256, "torch": 256}
# How `chunked_attention` chunks on each backend, by measurement (see its docstring).
CHUNK_OVER = {"tensorflow": "queries", "jax": "keys", "torch": "queries"}
_MASKED_LOGIT = -1e9


def choose_implementation(
    requested,
    *,
    need_weights,
    dropout_active,
    projected_rank,
    same_head_dims,
    query_length,
    key_length,
):
    """Picks the kernel for one call.

    Left to choose, it takes the fastest kernel measured on each backend (see
    `benchmarks/run.py`): torch's own fused kernel (O(T) memory already), JAX's
    fused kernel on a GPU (cuDNN flash attention), and the chunked kernel elsewhere,
    which on CPU beat TensorFlow's and JAX's fused kernels at every length, forward
    and backward, while never holding the whole `(T, S)` scores.

    Args:
        requested: `None`/"auto", or one of `IMPLEMENTATIONS`.
        need_weights: the caller asked for the attention scores.
        dropout_active: attention dropout applies in this call.
        projected_rank: rank of the projected query; only rank 4 (one attention
            axis) can use the fused or chunked kernels.
        same_head_dims: key_dim == value_dim (JAX's fused kernel needs it).
        query_length, key_length: static `T` and `S`, or `None` when unknown.

    Returns:
        One of `IMPLEMENTATIONS`. Scores, dropout and N-d attention always take the
        explicit kernel, whatever was requested.
    """
    del query_length  # an unknown `T` is one query chunk
    if need_weights or dropout_active or projected_rank != 4:
        return "explicit"
    fused_ok = _fused_supported(same_head_dims)
    # Chunking over keys needs a static `S`; over queries it does not.
    chunked_ok = key_length is not None or CHUNK_OVER.get(backend.backend()) == "queries"
    if requested == "chunked":
        return "chunked" if chunked_ok else "explicit"
    if requested == "fused":
        return "fused" if fused_ok else "explicit"
    if requested == "explicit":
        return "explicit"
    name = backend.backend()
    if name == "torch" or (name == "jax" and same_head_dims and _accelerator_visible()):
        return "fused"
    if chunked_ok:
        return "chunked"
    return "fused" if fused_ok else "explicit"


@functools.cache
def _accelerator_visible():
    """Whether JAX's default device is an accelerator (it is on a GPU machine)."""
    import jax

    return jax.default_backend() != "cpu"


def _fused_supported(same_head_dims):
    return backend.backend() != "jax" or same_head_dims


def attention_logits(query, key, equation=None):
    """`einsum(equation, key, query)`, or `matmul(query, key)` without an equation, in
    float32 (computed in float32 where float16 could overflow)."""
    if backend.standardize_dtype(query.dtype) == "float16":
        query, key = ops.cast(query, "float32"), ops.cast(key, "float32")
    logits = ops.matmul(query, key) if equation is None else ops.einsum(equation, key, query)
    return ops.cast(logits, "float32")


def masked_softmax(logits, mask, axes):
    """Float32 softmax over `axes`; masked entries and key-less rows get weight 0."""
    logits = ops.cast(logits, "float32")
    if mask is not None:
        logits = ops.where(mask, logits, _MASKED_LOGIT)
    # TensorFlow's CPU softmax kernel takes at most rank 5; scores of one attention
    # axis on a rank-5 input (video: frames attending over frames) have rank 6.
    if len(axes) == 1 and len(logits.shape) <= 5:
        weights = ops.softmax(logits, axis=axes[0])
    else:
        weights = ops.exp(logits - ops.logsumexp(logits, axis=axes, keepdims=True))
    if mask is not None:
        weights = ops.where(mask, weights, 0.0)
    return weights


def explicit_attention(
    query,
    key,
    value,
    *,
    scale,
    dot_product_equation,
    combine_equation,
    num_attention_axes,
    mask=None,
    dropout=None,
):
    """Attention with the full score tensor; returns `(output, scores)`.

    Args:
        query: `(B, ..., N, H)` projected query (N-d attention layouts allowed).
        key: projected key, same layout as the query along non-attention axes.
        value: projected value, `(..., N, Hv)`.
        scale: multiplies the query before the dot product (`1/sqrt(H)`).
        dot_product_equation, combine_equation: from `equations.attention_equations`.
        num_attention_axes: how many trailing score axes belong to the keys.
        mask: boolean, broadcastable to the scores, or `None`.
        dropout: callable applied to the scores before they weight the values.

    Returns:
        output `(B, ..., N, Hv)` and scores `(<batch dims>, <T dims>, <S dims>)`,
        both in the query's dtype.
    """
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    logits = attention_logits(query, key, dot_product_equation)
    axes = tuple(range(-num_attention_axes, 0))
    scores = ops.cast(masked_softmax(logits, mask, axes), value.dtype)
    weights = scores if dropout is None else dropout(scores)
    output = ops.einsum(combine_equation, weights, value)
    return output, scores


def fused_attention(query, key, value, *, scale, mask=None, is_causal=False, flash=None):
    """The backend's fused kernel (`keras.ops.dot_product_attention`); returns output.

    Rows whose keys are all masked are handed to the kernel unmasked (so it never
    sees an all-masked row, which some kernels turn into NaN) and zeroed after.

    Args:
        query: `(B, T, N, H)`; key: `(B, S, N, H)`; value: `(B, S, N, Hv)`.
        mask: boolean, broadcastable to `(B, N, T, S)`, or `None`.
        is_causal: causal masking inside the kernel (no mask tensor built).
    """
    valid = None
    if mask is not None:
        valid = masks_lib.rows_with_keys(mask, 1)
        mask = ops.logical_or(mask, ops.logical_not(valid))
    dtype = query.dtype
    if backend.standardize_dtype(dtype) == "float16" and not _fused_float16_ok():
        query, key, value = (ops.cast(x, "float32") for x in (query, key, value))
    if backend.backend() == "torch" and not flash:
        output = _torch_attention(query, key, value, mask=mask, scale=scale, is_causal=is_causal)
    else:
        output = ops.dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            scale=scale,
            is_causal=is_causal,
            flash_attention=flash,
        )
    output = ops.cast(output, dtype)
    if valid is not None:
        output = ops.where(ops.transpose(valid, (0, 2, 1, 3)), output, 0.0)
    return output


# From this many keys, torch's kernel gets heads-first copies of the keys and values.
CONTIGUOUS_KEYS_FROM = 4096


def _torch_attention(query, key, value, *, mask, scale, is_causal):
    """torch's `scaled_dot_product_attention` on heads-first views of `(B, T, N, H)`.

    What Keras's torch `dot_product_attention` runs, minus its copies: it makes the
    transposed query, key and value contiguous (and the output projection then copies
    the transposed result back), while torch's kernels take the strided views. At
    B=8, T=256 the copies cost ~30% of the kernel's time. Long keys are the
    exception: every 256-query block rereads all keys and values, which from
    `CONTIGUOUS_KEYS_FROM` keys pay for their copies (kernel plus key and value
    copies against the strided kernel, medians of 9-60 alternated calls: 1.22x at
    B=8, S=256, 1.08x at S=2048, 0.99x at S=4096, 0.98x at S=8192; through
    `predict_on_batch` at T=S=8192, 1.01x of the built-in's time against 1.035x
    with strided keys, 20 rounds, 2026-11-22).
    """
    import torch

    dtype = backend.result_type(query.dtype, key.dtype, value.dtype)
    query, key, value = (ops.cast(x, dtype).transpose(1, 2) for x in (query, key, value))
    # A symbolic length (torch.export) is not compared: that would add a guard.
    if checks.is_known(key.shape[2]) and key.shape[2] >= CONTIGUOUS_KEYS_FROM:
        key, value = key.contiguous(), value.contiguous()
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale
    )
    return output.transpose(1, 2)


def _fused_float16_ok():
    """Whether the fused kernel handles float16 here. TensorFlow's computes float16
    logits, which overflow; JAX's asks for float32 accumulation, which XLA on CPU
    rejects when compiled under `jax.jit`."""
    name = backend.backend()
    if name == "tensorflow":
        return False
    if name == "jax":
        import jax

        return jax.default_backend() != "cpu"
    return True


def chunked_attention(
    query,
    key,
    value,
    *,
    scale,
    mask=None,
    is_causal=False,
    causal_offset=0,
    chunk_size=None,
    over=None,
):
    """Attention in chunks, never materialising the whole `(T, S)` scores.

    Same result as `explicit_attention` within float32 rounding. Two ways, chosen by
    measurement per backend (`CHUNK_OVER`; see `benchmarks/run.py`):

    - "keys": online softmax over key chunks (running max, normaliser and weighted
      sum), normalised once at the end: O(T * chunk) memory. Needs a static `S`.
      XLA compiles it into fewer passes over the scores than a softmax: with one
      chunk it is JAX's fastest attention on CPU even for short sequences.
    - "queries": query chunks, each an exact softmax over all keys in a heads-first
      layout (keys transposed once, not once per chunk): O(chunk * S) memory. On
      TensorFlow it beat both the online softmax and its own one-shot kernel; on
      torch it beat the online softmax (0.75x its time at T=S=8192). The
      chunks are unrolled (a `while` loop with a scatter was ~1.5x slower); at most
      `IN_FLIGHT` of them run at once, or TensorFlow's executor starts them all
      together and the memory saving is gone. An unknown `T` is one chunk.

    Args:
        query: `(B, T, N, H)`; key: `(B, S, N, H)`; value: `(B, S, N, Hv)`.
        mask: boolean, broadcastable to `(B, N, T, S)`, or `None`.
        is_causal: apply a causal mask, generated chunk by chunk.
        causal_offset: position of the first query (KV-cache decoding).
        chunk_size: keys (or queries) per chunk; `None` for this backend's
            `DEFAULT_CHUNK_SIZE`.
        over: "keys", "queries" or `None` (this backend's `CHUNK_OVER`).

    Returns:
        output `(B, T, N, Hv)` in the value's dtype.
    """
    over = over or CHUNK_OVER.get(backend.backend(), "keys")
    chunk_size = chunk_size or DEFAULT_CHUNK_SIZE.get(backend.backend(), 256)
    chunked = _chunked_over_queries if over == "queries" else _chunked_over_keys
    return chunked(
        query,
        key,
        value,
        scale=scale,
        mask=mask,
        is_causal=is_causal,
        causal_offset=causal_offset,
        chunk_size=chunk_size,
    )


# How many query chunks TensorFlow may run at once: two overlap a softmax with the
# next chunk's matmul (T=S=8192: 0.80x the built-in's time, against 0.98x one at a
# time, 2026-11-23); more only cost memory.
IN_FLIGHT = 2


def _chunked_over_queries(query, key, value, *, scale, mask, is_causal, causal_offset, chunk_size):
    query_length = query.shape[1]
    key_length = ops.shape(key)[1]
    query = ops.transpose(ops.multiply(query, ops.cast(scale, query.dtype)), (0, 2, 1, 3))
    key = ops.transpose(key, (0, 2, 3, 1))  # (B, N, H, S)
    value = ops.transpose(value, (0, 2, 1, 3))  # (B, N, S, Hv)
    chunks = [(0, query_length)]
    if query_length is not None:
        starts = range(0, query_length, chunk_size)
        chunks = [(s, min(chunk_size, query_length - s)) for s in starts]

    outputs = []
    for start, size in chunks:
        with _after(outputs[-IN_FLIGHT:][:1] if len(outputs) >= IN_FLIGHT else []):
            whole = len(chunks) == 1
            chunk = query if whole else _slice(query, 2, start, size)
            chunk_mask = mask
            if mask is not None and mask.shape[2] != 1 and not whole:
                chunk_mask = _slice(mask, 2, start, size)
            if is_causal:
                rows = ops.shape(query)[2] if whole else size
                causal = masks_lib.causal_mask(rows, key_length, causal_offset + start)
                chunk_mask = masks_lib.logical_and(chunk_mask, ops.expand_dims(causal, 1))
            logits = attention_logits(chunk, key)
            weights = masked_softmax(logits, chunk_mask, (-1,))
            outputs.append(ops.matmul(ops.cast(weights, value.dtype), value))
    output = outputs[0] if len(outputs) == 1 else ops.concatenate(outputs, axis=2)
    return ops.transpose(output, (0, 2, 1, 3))


def _after(tensors):
    """Context in which new TensorFlow graph ops wait for `tensors` (no-op elsewhere)."""
    if tensors and backend.backend() == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly():
            return tf.control_dependencies(tensors)
    return contextlib.nullcontext()


def _loop_over_chunks(step, start, length, chunk_size, state):
    """`state = step(begin, size, state)` over `[start, length)` in `chunk_size` pieces."""
    whole_chunks, rest = divmod(length - start, chunk_size)
    if whole_chunks == 1:
        state = step(start, chunk_size, state)
    elif whole_chunks > 1:
        state = ops.fori_loop(
            0, whole_chunks, lambda i, s: step(start + i * chunk_size, chunk_size, s), state
        )
    if rest:
        state = step(start + whole_chunks * chunk_size, rest, state)
    return state


def _chunked_over_keys(query, key, value, *, scale, mask, is_causal, causal_offset, chunk_size):
    dtype = value.dtype
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    query = ops.transpose(query, (0, 2, 1, 3))  # (B, N, T, H), once for every chunk
    key_length = key.shape[1]
    chunk_size = min(chunk_size, key_length)
    query_length = ops.shape(query)[2]

    def chunk_scores(start, size):
        """Masked float32 logits of keys `[start, start + size)` and their mask."""
        logits = attention_logits(query, _slice(key, 1, start, size), "bsnh,bnth->bnts")
        chunk_mask = _slice(mask, 3, start, size) if _masks_keys(mask) else mask
        if is_causal:
            causal = masks_lib.causal_mask(query_length, size, causal_offset - start)
            chunk_mask = masks_lib.logical_and(chunk_mask, ops.expand_dims(causal, 1))
        if chunk_mask is not None:
            logits = ops.where(chunk_mask, logits, _MASKED_LOGIT)
        return logits, chunk_mask

    def weighted(start, size, logits, chunk_mask, reference):
        """exp(logits - reference), zero where masked, its sum and its product with v."""
        probs = ops.exp(logits - reference)
        if chunk_mask is not None:
            probs = ops.where(chunk_mask, probs, 0.0)
        values = ops.cast(_slice(value, 1, start, size), "float32")
        return ops.sum(probs, axis=-1, keepdims=True), ops.einsum("bnts,bsnh->bnth", probs, values)

    def chunk_max(logits):
        # `initial` keeps an empty batch (B == 0) legal on TensorFlow and torch.
        return ops.stop_gradient(ops.max(logits, axis=-1, keepdims=True, initial=_MASKED_LOGIT))

    def step(start, size, state):
        # state: running max, normaliser (B, N, T, 1) and weighted sum (B, N, T, Hv).
        running_max, normaliser, accumulator = state
        logits, chunk_mask = chunk_scores(start, size)
        new_max = ops.maximum(running_max, chunk_max(logits))
        total, product = weighted(start, size, logits, chunk_mask, new_max)
        correction = ops.exp(running_max - new_max)
        return new_max, normaliser * correction + total, accumulator * correction + product

    logits, chunk_mask = chunk_scores(0, chunk_size)
    first_max = chunk_max(logits)
    state = (first_max, *weighted(0, chunk_size, logits, chunk_mask, first_max))
    _, normaliser, accumulator = _loop_over_chunks(step, chunk_size, key_length, chunk_size, state)
    has_keys = ops.greater(normaliser, 0.0)
    output = accumulator / ops.where(has_keys, normaliser, 1.0)
    output = ops.where(has_keys, output, 0.0)
    return ops.cast(ops.transpose(output, (0, 2, 1, 3)), dtype)


def _masks_keys(mask):
    return mask is not None and mask.shape[-1] != 1


def _slice(x, axis, start, size):
    """`x[..., start:start + size, ...]` along `axis`; `start` may be a traced integer."""
    starts = [0] * len(x.shape)
    starts[axis] = start
    shape = list(ops.shape(x))
    shape[axis] = size
    return ops.slice(x, starts, shape)
