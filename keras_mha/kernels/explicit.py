"""The explicit kernel: the whole score tensor, as the built-in layer computes it.

The only kernel that returns the scores, and the only one for N-d attention (several
attention axes, or free axes beside them). Gradients come from autodiff.
"""

import math

from keras import backend, ops

from keras_mha import equations as equations_lib
from keras_mha.kernels import logits as logits_lib


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
    empty_rows="zero",
    one_op_einsum=False,
    unit_axis=False,
):
    """Attention with the full scores; returns `(output, scores)`.

    Args:
        query: `(B, ..., N, H)` projected query (N-d layouts allowed).
        key: projected key, same layout as the query along non-attention axes.
        value: projected value, `(..., N, Hv)`.
        scale: multiplies the query before the dot product.
        equations: `(dot_product, combine, num_attention_axes)` from
            `equations.attention_equations`.
        mask: an `AttentionMask` (for N-d attention: its `dense` part, already in
            the scores' layout), or `None`.
        bias: float, broadcastable to the scores, added to the logits.
        soft_cap: `None` or a positive float.
        sinks: `None` or `(N,)` sink logits.
        score_mod: `None` or a `score_mod.ScoreMod` (one attention axis, `(B, N,
            T, S)` scores), applied after the bias; autodiff differentiates it.
        dropout: rate of attention dropout; applies when `seed` is given.
        seed: int `(2,)` tensor seeding the dropout mask.
        empty_rows: what a row with no visible key gets: "zero" weights, or
            uniform ones ("mean", without sinks).
        one_op_einsum: the two products run as one backend einsum op each
            (`policy.one_op_einsum`), not as Keras's `ops.einsum` writes them.
        unit_axis: the rank-4 layer's two products carry a unit axis beside the
            heads (`Policy.unit_axis_products`).

    Returns:
        output `(B, ..., N, Hv)` and scores `(<batch dims>, <T dims>, <S dims>)` (the
        weights before dropout), both in the value's dtype.
    """
    dot_product, combine, num_axes = equations
    einsum = _one_op_einsum if one_op_einsum else ops.einsum
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    if backend.standardize_dtype(query.dtype) == "float16":  # logits could overflow
        query, key = ops.cast(query, "float32"), ops.cast(key, "float32")
    unit_axis = unit_axis and tuple(equations[:2]) == RANK4_EQUATIONS  # not a subclass's
    if unit_axis:
        x = ops.squeeze(ops.einsum(_UNIT_AXIS_SCORES, ops.expand_dims(query, 3), key), 3)
    else:
        x = einsum(*_query_first(dot_product, key, query))
    x = ops.cast(x, "float32")
    if soft_cap is not None:
        x, _ = logits_lib.soft_cap(x, soft_cap)
    if bias is not None:
        x = x + ops.cast(bias, "float32")
    if score_mod is not None:
        if len(x.shape) != 4:
            raise ValueError("A score function needs one attention axis, `(B, N, T, S)` scores.")
        shape = ops.shape(x)
        x = score_mod(x, *score_mod.indices(shape[0], shape[1], 0, shape[2], 0, shape[3]))
    rank = len(x.shape)
    axes = tuple(range(rank - num_axes, rank))
    if sinks is not None:
        sinks = logits_lib.sink_logits(sinks, rank, rank - 2 * num_axes - 1)
    weights = logits_lib.softmax(x, _dense(mask, query, key), axes, sinks, empty_rows)
    scores = ops.cast(weights, value.dtype)
    if seed is not None and dropout > 0.0:
        shape = ops.shape(scores)
        rows = ops.reshape(
            ops.arange(math.prod(shape[:-1]), dtype="int32"), tuple(shape[:-1]) + (1,)
        )
        cols = ops.arange(shape[-1], dtype="int32")
        keep = logits_lib.dropout_keep(seed, rows, cols, dropout)
        weights = ops.where(keep, weights / (1.0 - dropout), 0.0)
    weights = ops.cast(weights, value.dtype)
    if unit_axis:
        output = ops.squeeze(ops.einsum(_UNIT_AXIS_COMBINE, weights, ops.expand_dims(value, 3)), 3)
    else:
        output = einsum(combine, weights, value)
    return output, scores


# The rank-4 layer's products, and the same
# products with a unit axis `g` beside the query's and the value's heads: `(B, T, N, 1,
# H)` queries give `(B, N, T, 1, S)` logits (the product's own order: no transpose of the
# scores), `(B, S, N, 1, Hv)` values `(B, T, N, 1, Hv)` outputs, each squeezed back. As
# `jax.nn.dot_product_attention`'s grouped products (its heads per key-value head) do,
# this leads XLA:CPU to run both products of each product's backward in YNNPACK; without
# the axis, the key's or the value's gradient (a contraction over the queries, not the
# last axis of the logits) falls to its Eigen dot, which costs more per call
# (benchmarks/results/jax_unit_axis.md).
RANK4_EQUATIONS = equations_lib.attention_equations(4, (1,))[:2]
_UNIT_AXIS_SCORES = "abcgd,aecd->acbge"
_UNIT_AXIS_COMBINE = "acbe,aecgd->abcgd"


def _query_first(equation, key, query):
    """`(equation, operands)` for the built-in's `key, query -> scores` product, with
    the operands swapped where the equation names its output: `query, key -> scores`,
    the same product. Keras's TensorFlow einsum runs the built-in's order as keys
    times queries and transposes the whole `(B, N, S, T)` result; in this order its
    product comes out as `(B, N, T, S)`. JAX and torch run the same ops either way.
    An equation without `->` (a subclass's) keeps its order: its output's layout
    follows its letters, not its operands."""
    if "->" not in equation:
        return equation, key, query
    operands, product = equation.split("->")
    key_letters, query_letters = operands.split(",")
    return f"{query_letters},{key_letters}->{product}", query, key


def _one_op_einsum(equation, *operands):
    """The backend's own einsum, one op: TensorFlow's `tf.einsum`, where Keras's
    `ops.einsum` rewrites the attention products as transposes around a matmul."""
    if backend.backend() == "tensorflow":
        import tensorflow as tf

        dtype = backend.result_type(*(x.dtype for x in operands))  # as Keras's einsum
        return tf.einsum(equation, *(ops.cast(x, dtype) for x in operands))
    return ops.einsum(equation, *operands)


def _dense(mask, query, key):
    """The mask over the whole scores: boolean, or `None`."""
    if mask is None:
        return None
    if len(query.shape) != 4:  # N-d attention: merged by the layer, scores layout
        return mask.dense
    return mask.block(0, ops.shape(query)[1], 0, ops.shape(key)[1])
