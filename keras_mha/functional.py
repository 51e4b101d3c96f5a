"""`keras_mha.attention`: attention over projected heads, as a function.

The layer's attention without its projections: the same kernels (`kernels.attention`),
the same masks and the same arithmetic, for code that projects its own heads (a
keras-hub model's attention, a custom block). One entry point on every backend, like
`keras.ops.dot_product_attention`, with what that lacks: score functions
(`score_mod`), causal and window masks described rather than materialised, grouped
key/value heads, a KV cache's query offset, soft cap and sinks.
"""

import math

from keras import ops

from keras_mha import block_mask as block_mask_lib
from keras_mha import checks, equations, kernels
from keras_mha import masks as masks_lib
from keras_mha import score_mod as score_mod_lib

_EQUATIONS = equations.attention_equations(4, (1,))[:2] + (1,)


def attention(
    query,
    key,
    value,
    *,
    score_mod=None,
    mask=None,
    mask_mod=None,
    use_causal_mask=False,
    sliding_window=None,
    query_offset=None,
    bias=None,
    scale=None,
    soft_cap=None,
    sinks=None,
    return_scores=False,
    implementation=None,
    chunk_size=None,
):
    """`softmax(score_mod(q k^T * scale + bias), masked) v` over projected heads.

    The logits are computed in float32 in this order (`kernels/logits.py`): scaled,
    soft-capped, `bias` added, `score_mod` applied, masked, then a softmax with
    sinks. A row with no visible key gets zero weights.

    Args:
        query: `(B, T, N, H)` projected queries.
        key: `(B, S, Nkv, H)` projected keys; `Nkv` a divisor of `N` (grouped-query
            attention: each key head serves `N / Nkv` adjacent query heads).
        value: `(B, S, Nkv, Hv)` projected values.
        score_mod: `None`, a `keras_mha.score_mod.ScoreMod`, or a function
            `fn(score, b, h, q_idx, kv_idx)` of `keras.ops` code (see
            `keras_mha.score_mod`); calls with one run the chunked or explicit kernel.
        mask: `None` or a boolean mask broadcastable to `(B, T, S)` or, per head,
            `(B, N, T, S)`; `True` means "may attend".
        mask_mod: `None`, a function `fn(b, h, q_idx, kv_idx) -> bool` of `keras.ops`
            code, or a `keras_mha.block_mask.BlockMask` (see `keras_mha.block_mask`),
            ANDed with the other masks; the chunked kernel skips its empty key blocks.
        use_causal_mask: query `t` sees keys `s <= t + query_offset`.
        sliding_window: `None`, a positive int `w` (`|t - s| < w`) or a pair
            `(left, right)` of non-negative ints (the layer's `sliding_window`).
        query_offset: `None` (0) or the position of query 0 among the keys (an
            int or a scalar int tensor): KV-cache decoding. The causal and window
            masks and the score function's `q_idx` follow it.
        bias: float, broadcastable to `(B, N, T, S)`, added to the logits.
        scale: the logits' scale; `None` means `1 / sqrt(H)`.
        soft_cap: `None` or `c > 0`: logits become `c * tanh(logits / c)`.
        sinks: `None` or `(N,)` sink logits in each row's softmax denominator.
        return_scores: also return the weights `(B, N, T, S)` (the explicit kernel).
        implementation: `None`/"auto", "explicit", "fused" or "chunked" (see
            `MultiHeadAttention`'s argument of the same name).
        chunk_size: query rows per chunk of the chunked kernel; `None` for the
            policy's.

    Returns:
        `(B, T, N, Hv)` in the value's dtype, or `(output, scores)` with
        `return_scores`.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != 4:
            raise checks.invalid(name, "a rank-4 tensor (B, L, heads, channels)", x.shape)
    heads, key_heads = query.shape[2], key.shape[2]
    if checks.is_known(heads) and checks.is_known(key_heads) and heads % key_heads:
        raise checks.invalid("key", f"a number of heads dividing the query's {heads}", key.shape)
    if checks.dims_differ(key.shape[2], value.shape[2]):
        raise checks.invalid("value", f"{key.shape[2]} heads, as the key", value.shape)
    if implementation == "auto":
        implementation = None
    checks.one_of("implementation", implementation, (None,) + kernels.IMPLEMENTATIONS)
    scale = checks.positive_number("scale", scale, allow_none=True)
    soft_cap = checks.positive_number("soft_cap", soft_cap, allow_none=True)
    sliding_window = checks.sliding_window(sliding_window)
    chunk_size = checks.positive_int("chunk_size", chunk_size, allow_none=True)
    score_mod = score_mod_lib.get(score_mod)
    if score_mod is not None:
        score_mod = score_mod.at(query_offset)
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    if checks.is_known(heads) and checks.is_known(key_heads) and heads != key_heads:
        repeats = heads // key_heads
        key, value = ops.repeat(key, repeats, axis=2), ops.repeat(value, repeats, axis=2)
    described = masks_lib.describe(
        attention_mask=mask,
        use_causal_mask=use_causal_mask,
        sliding_window=sliding_window,
        offset=query_offset,
    )
    if mask_mod is not None:
        built = block_mask_lib.for_call(
            mask_mod,
            query.shape[0],
            query.shape[2],
            query.shape[1],
            key.shape[1],
            query_offset,
            cached=query_offset is not None,
        )
        described = masks_lib.with_block_mask(described, built, query_offset)
    output, scores = kernels.attention(
        query,
        key,
        value,
        scale=scale,
        equations=_EQUATIONS,
        mask=described,
        bias=bias,
        soft_cap=soft_cap,
        sinks=sinks,
        score_mod=score_mod,
        return_scores=return_scores,
        implementation=implementation,
        chunk_size=chunk_size,
    )
    return (output, scores) if return_scores else output
