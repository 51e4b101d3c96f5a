"""Attention over projected heads: one entry point, three kernels.

    attention(query, key, value, scale=..., mask=..., ...) -> (output, scores or None)

- "explicit" (`explicit.py`): the whole scores; the only one that returns them, and
  the only one for N-d attention.
- "fused" (`fused.py`): the backend's own kernel, where it takes the call as it is
  (never with a score function: `policy.fusable`).
- "chunked" (`chunked.py`): query chunks, never the whole `(T, S)`, forward or
  backward, with every mask kind, bias, soft cap, sinks, score functions
  (`score_mod.py`) and dropout.

All three share the arithmetic of `logits.py` (float32 softmax, a row with no keys
gets zero weights, the same dropout mask for the same seed). Which one runs, and with
what chunk size, is decided in one place: `policy.py`. `empty_rows="mean"` gives a row
with no keys the mean of the values instead (what `keras.ops.dot_product_attention` gives
it, except on torch's CUDA kernels: `fused_gives_mean`), whichever kernel runs: the
explicit kernel and the fused one taking a mask whole in their softmax, the others by
`mean_where_empty` after the kernel. Where the
masks hold data (eager calls), padded tails are cut off before any kernel runs
(`trim.py`). Where the policy says so (JAX), an eager call of the chunked kernel runs
one compiled program per configuration (`compiled.py`).
"""

from keras import backend

from keras_mha.kernels import chunked, explicit, fused, policy, trim
from keras_mha.kernels import logits as logits_lib
from keras_mha.kernels.logits import mean_where_empty
from keras_mha.kernels.policy import IMPLEMENTATIONS


def attention(
    query,
    key,
    value,
    *,
    scale,
    equations,
    mask=None,
    bias=None,
    soft_cap=None,
    sinks=None,
    score_mod=None,
    dropout=0.0,
    seed=None,
    return_scores=False,
    implementation=None,
    chunk_size=None,
    flash=None,
    empty_rows="zero",
    cut_already=False,
):
    """`softmax(q k^T * scale + ..., masked) v` on projected heads.

    Args:
        query: `(B, T, N, H)` (or an N-d layout `(B, ..., N, H)`).
        key: `(B, S, N, H)`; value: `(B, S, N, Hv)`.
        scale: multiplies the query before the dot product.
        equations: `(dot_product, combine, num_attention_axes)` of the layout
            (`equations.attention_equations`), for the explicit kernel.
        mask: a `masks.AttentionMask`, or `None`.
        bias: float, broadcastable to the scores `(B, N, T, S)`, added to the logits.
        soft_cap: `None` or `c > 0`: logits become `c * tanh(logits / c)`.
        sinks: `None` or `(N,)` sink logits joining each row's softmax denominator.
        score_mod: `None` or a `score_mod.ScoreMod`, applied to the logits after
            the bias, before the mask (rank-4 calls).
        dropout: attention dropout rate; applies when `seed` is given.
        seed: int `(2,)` tensor seeding the dropout mask, or `None` (no dropout).
        return_scores: also return the weights (explicit kernel).
        implementation: `None`/"auto" or one of `IMPLEMENTATIONS`.
        chunk_size: query rows per chunk; `None` for the policy's.
        flash: the layer's `flash_attention`, for the fused kernel.
        empty_rows: what a row with no visible key gets: "zero" weights, or
            uniform ones, the mean of the values ("mean": rank-4 calls without
            sinks or scores, as `keras.ops.dot_product_attention` gives it).
        cut_already: the call is a cut's (`trim.py`): no look for another.

    Returns:
        `(output, scores)`: output like the query with `Hv` channels in the value's
        dtype, scores `(B, N, T, S)` or `None` when not requested.
    """
    dropping = seed is not None and dropout > 0.0
    rules = policy.current()
    cut = None
    if not (return_scores or cut_already) and policy.looks_for_cut(
        _score_entries(query, key), mask, rules
    ):
        cut = trim.cut(query, key, mask, dropout=dropping)
    if cut is not None:
        kept_query, kept_key, kept_value, kept_bias = cut.inputs(query, key, value, bias)
        # The cut's own rows take the mean of the values it keeps: all of them only
        # where it keeps every query and key.
        whole = (cut.queries, cut.keys) == (query.shape[1], key.shape[1])
        output, _ = attention(
            kept_query,
            kept_key,
            kept_value,
            scale=scale,
            equations=equations,
            mask=None if cut.mask.is_empty else cut.mask,
            bias=kept_bias,
            soft_cap=soft_cap,
            sinks=sinks,
            score_mod=score_mod,
            implementation=implementation,
            chunk_size=chunk_size,
            flash=flash,
            empty_rows=empty_rows if whole else "zero",
            cut_already=True,
        )
        output = cut.output(output, query.shape[1])
        if empty_rows == "mean" and not whole:
            output = logits_lib.mean_where_empty(output, value, mask)
        return output, None
    call = policy.Call(
        scores=return_scores,
        rank4=len(query.shape) == 4 and equations[2] == 1,
        dropout=dropping,
        mask=mask,
        bias=bias is not None,
        soft_cap=soft_cap is not None,
        sinks=sinks is not None,
        score_mod=score_mod is not None,
        same_head_dims=key.shape[-1] == value.shape[-1],
        score_entries=_score_entries(query, key),
        one_chunk=_one_chunk(query, chunk_size or rules.chunk_size),
    )
    kernel = policy.choose(implementation, call, rules)
    if kernel == "explicit":
        return explicit.attention(
            query,
            key,
            value,
            scale=scale,
            equations=equations,
            mask=mask,
            bias=bias,
            soft_cap=soft_cap,
            sinks=sinks,
            score_mod=score_mod,
            dropout=dropout,
            seed=seed if dropping else None,
            empty_rows=empty_rows,
            one_op_einsum=policy.one_op_einsum(call, rules),
            unit_axis=rules.unit_axis_products,
        )
    if kernel == "fused":
        output = fused.attention(
            query,
            key,
            value,
            scale=scale,
            mask=mask,
            bias=bias,
            flash=flash,
            chunk_size=chunk_size or rules.chunk_size,
            empty_rows=empty_rows,
        )
        return output, None
    dynamic = policy.dynamic_loop(rules)
    forward_chunk_size = chunk_size
    if chunk_size is None:
        chunk_size = rules.chunk_size
        forward_chunk_size = policy.forward_chunk_rows(
            rules, query.shape, key.shape[1], mask, dynamic
        )
    output = chunked.attention(
        query,
        key,
        value,
        scale=scale,
        mask=mask,
        bias=bias,
        soft_cap=soft_cap,
        sinks=sinks,
        score_mod=score_mod,
        dropout=dropout,
        seed=seed if dropping else None,
        chunk_size=chunk_size,
        forward_chunk_size=forward_chunk_size,
        key_block=rules.key_block,
        key_multiple=rules.key_multiple,
        in_flight=rules.in_flight,
        loop=rules.loop,
        dynamic=dynamic,
        differentiable=rules.trains,
        in_place_sums=rules.in_place_sums,
        skip_zero_gradients=rules.skip_zero_gradient_chunks and dynamic,
        compile_eager=rules.compile_eager_chunks,
    )
    if empty_rows == "mean" and mask is not None:
        output = logits_lib.mean_where_empty(output, value, mask)
    return output, None


def fused_gives_mean(x):
    """Whether `keras.ops.dot_product_attention` gives a row with no visible key
    uniform weights (the values' mean) where the tensor `x` lives: on CPUs and on
    JAX's GPU. Torch's CUDA kernels give such a row zero weights, float32 and bfloat16
    alike (benchmarks/results/gpu.md)."""
    device = getattr(x, "device", None)  # a NumPy array (a direct call) lives on the host
    return backend.backend() != "torch" or getattr(device, "type", "cpu") != "cuda"


def _one_chunk(query, chunk_size):
    """Whether the query's `T` is known and at most `chunk_size`."""
    length = query.shape[1]
    return isinstance(length, int) and length <= chunk_size


def _score_entries(query, key):
    """`B x N x T x S` of `(B, T, N, H)` query and `(B, S, N, H)` key, or `None` when a
    size is unknown while tracing (symbolic sizes included)."""
    if len(query.shape) != 4:
        return None
    sizes = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    if not all(isinstance(d, int) for d in sizes):
        return None
    return sizes[0] * sizes[1] * sizes[2] * sizes[3]


__all__ = [
    "IMPLEMENTATIONS",
    "attention",
    "chunked",
    "explicit",
    "fused",
    "fused_gives_mean",
    "mean_where_empty",
    "policy",
]
