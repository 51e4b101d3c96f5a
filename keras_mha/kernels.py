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

import functools

from keras import backend, ops

from keras_mha import masks as masks_lib

IMPLEMENTATIONS = ("explicit", "fused", "chunked")

# Below this many query-key pairs per (batch, head) the full score matrix is cheap.
CHUNK_THRESHOLD = 2048 * 2048
DEFAULT_CHUNK_SIZE = 256
# How `chunked_attention` chunks on each backend, by measurement (see its docstring).
CHUNK_OVER = {"tensorflow": "queries", "jax": "keys", "torch": "keys"}
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
    if need_weights or dropout_active or projected_rank != 4:
        return "explicit"
    lengths_known = query_length is not None and key_length is not None
    if requested == "chunked":
        return "chunked" if key_length is not None else "explicit"
    if requested == "fused":
        return "fused" if _fused_supported(same_head_dims) else "explicit"
    if requested == "explicit":
        return "explicit"
    name = backend.backend()
    if name == "torch":
        return "fused"
    long = lengths_known and query_length * key_length >= CHUNK_THRESHOLD
    if long and not (name == "jax" and same_head_dims and _accelerator_visible()):
        # On a GPU, JAX's fused kernel (cuDNN flash attention) is itself lean.
        return "chunked"
    # On TensorFlow the fused kernel (the built-in's path) beat our explicit einsums.
    if name == "tensorflow" or (name == "jax" and same_head_dims):
        return "fused"
    return "explicit"


@functools.cache
def _accelerator_visible():
    """Whether JAX's default device is an accelerator (it is on a GPU machine)."""
    import jax

    return jax.default_backend() != "cpu"


def _fused_supported(same_head_dims):
    return backend.backend() != "jax" or same_head_dims


def attention_logits(query, key, equation):
    """`einsum(equation, key, query)` in float32 where float16 could overflow."""
    if backend.standardize_dtype(query.dtype) == "float16":
        query, key = ops.cast(query, "float32"), ops.cast(key, "float32")
    return ops.cast(ops.einsum(equation, key, query), "float32")


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
    chunk_size=DEFAULT_CHUNK_SIZE,
    over=None,
):
    """Attention in chunks, never materialising the `(T, S)` scores: O(chunk) memory.

    Same result as `explicit_attention` within float32 rounding. Needs a static `S`
    (and `T` when chunking over queries). Two ways, chosen by measurement per backend
    (`CHUNK_OVER`; see `benchmarks/run.py`):

    - "keys": online softmax over key chunks (running max, normaliser and weighted
      sum): O(T * chunk) memory. JAX's XLA compiles the loop well: 0.26x the time of
      its fused kernel at T=S=8192 on CPU.
    - "queries": query chunks, each an exact softmax over all keys by the backend's
      fused kernel (`fused_attention`, or the explicit math where that kernel does not
      apply): O(chunk * S) memory. On TensorFlow the online softmax's extra
      elementwise passes made it ~3x slower than this.

    Whole chunks run in `ops.fori_loop` (a compiled loop on TensorFlow and JAX, so one
    chunk's temporaries are alive at a time); a shorter last chunk runs after it.

    Args:
        query: `(B, T, N, H)`; key: `(B, S, N, H)`; value: `(B, S, N, Hv)`.
        mask: boolean, broadcastable to `(B, N, T, S)`, or `None`.
        is_causal: apply a causal mask, generated chunk by chunk.
        causal_offset: position of the first query (KV-cache decoding).
        chunk_size: keys (or queries) per chunk.
        over: "keys", "queries" or `None` (this backend's `CHUNK_OVER`).

    Returns:
        output `(B, T, N, Hv)` in the value's dtype.
    """
    over = over or CHUNK_OVER.get(backend.backend(), "keys")
    # An empty batch goes over keys: TensorFlow's scatter rejects an empty output.
    if over == "queries" and query.shape[1] is not None and query.shape[0] != 0:
        chunked = _chunked_over_queries
    else:
        chunked = _chunked_over_keys
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


def _chunked_over_queries(query, key, value, *, scale, mask, is_causal, causal_offset, chunk_size):
    query_length, key_length = query.shape[1], key.shape[1]
    chunk_size = min(chunk_size, query_length)
    fused = _fused_supported(key.shape[-1] == value.shape[-1])

    def step(start, size, output):
        chunk_mask = mask
        if mask is not None and mask.shape[2] != 1:
            chunk_mask = _slice(mask, 2, start, size)
        if is_causal:
            causal = masks_lib.causal_mask(size, key_length, causal_offset + start)
            chunk_mask = masks_lib.logical_and(chunk_mask, ops.expand_dims(causal, 1))
        chunk = _slice(query, 1, start, size)
        if fused:
            result = fused_attention(chunk, key, value, scale=scale, mask=chunk_mask)
        else:
            result, _ = explicit_attention(
                chunk,
                key,
                value,
                scale=scale,
                dot_product_equation="bsnh,btnh->bnts",
                combine_equation="bnts,bsnh->btnh",
                num_attention_axes=1,
                mask=chunk_mask,
            )
        # A scatter (differentiable on every backend, unlike TF's dynamic update
        # slice) into the (T, B, N, Hv) output.
        rows = ops.expand_dims(ops.arange(size, dtype="int32") + start, -1)
        result = ops.transpose(ops.cast(result, output.dtype), (1, 0, 2, 3))
        return ops.scatter_update(output, rows, result)

    output = ops.zeros(
        (query_length, ops.shape(query)[0], value.shape[2], value.shape[3]), value.dtype
    )
    output = _loop_over_chunks(step, query_length, chunk_size, output)
    return ops.transpose(output, (1, 0, 2, 3))


def _loop_over_chunks(step, length, chunk_size, state):
    """`state = step(start, size, state)` over `[0, length)` in `chunk_size` pieces."""
    whole_chunks, rest = divmod(length, chunk_size)
    if whole_chunks == 1:
        state = step(0, chunk_size, state)
    else:
        state = ops.fori_loop(
            0, whole_chunks, lambda i, s: step(i * chunk_size, chunk_size, s), state
        )
    if rest:
        state = step(whole_chunks * chunk_size, rest, state)
    return state


def _chunked_over_keys(query, key, value, *, scale, mask, is_causal, causal_offset, chunk_size):
    dtype = value.dtype
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    query = ops.transpose(query, (0, 2, 1, 3))  # (B, N, T, H), once for every chunk
    key_length = key.shape[1]
    chunk_size = min(chunk_size, key_length)
    batch, query_length, heads = ops.shape(value)[0], ops.shape(query)[2], value.shape[2]

    def step(start, size, state):
        # state: running max, normaliser (B, N, T, 1) and weighted sum (B, N, T, Hv).
        running_max, normaliser, accumulator = state
        logits = attention_logits(query, _slice(key, 1, start, size), "bsnh,bnth->bnts")
        chunk_mask = _slice(mask, 3, start, size) if _masks_keys(mask) else mask
        if is_causal:
            causal = masks_lib.causal_mask(query_length, size, causal_offset - start)
            chunk_mask = masks_lib.logical_and(chunk_mask, ops.expand_dims(causal, 1))
        if chunk_mask is not None:
            logits = ops.where(chunk_mask, logits, _MASKED_LOGIT)
        # `initial` keeps an empty batch (B == 0) legal on TensorFlow and torch.
        chunk_max = ops.stop_gradient(
            ops.max(logits, axis=-1, keepdims=True, initial=_MASKED_LOGIT)
        )
        new_max = ops.maximum(running_max, chunk_max)
        probs = ops.exp(logits - new_max)
        if chunk_mask is not None:
            probs = ops.where(chunk_mask, probs, 0.0)
        values = ops.cast(_slice(value, 1, start, size), "float32")
        correction = ops.exp(running_max - new_max)
        normaliser = normaliser * correction + ops.sum(probs, axis=-1, keepdims=True)
        accumulator = accumulator * correction + ops.einsum("bnts,bsnh->bnth", probs, values)
        return new_max, normaliser, accumulator

    # Finite, far below any (masked) logit: the first correction is exactly 0.
    state = (
        ops.full((batch, heads, query_length, 1), -1e30, "float32"),
        ops.zeros((batch, heads, query_length, 1), "float32"),
        ops.zeros((batch, heads, query_length, value.shape[-1]), "float32"),
    )
    _, normaliser, accumulator = _loop_over_chunks(step, key_length, chunk_size, state)
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
