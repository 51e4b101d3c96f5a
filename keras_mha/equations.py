"""Einsum equations for multi-head projections and N-d attention (pure Python).

Projected tensors have the layout `(B, <non-attention dims>, <attention dims>, N, H)`:
batch, any free axes, the axes attention runs over, heads, channels. The attention
scores have the layout `(<batch dims>, <query attention dims>, <key attention dims>)`
where `<batch dims>` are every projected axis that is neither an attention axis nor
the channel axis (so they include the heads axis). This is the layout of
`keras.layers.MultiHeadAttention`, which our weights and scores must match.
"""

import string

_LETTERS = string.ascii_lowercase


def projection_equation(free_dims, bound_dims, output_dims):
    """Equation of an EinsumDense that contracts `bound_dims` trailing input axes.

    Args:
        free_dims: number of leading input axes carried through (batch and sequence).
        bound_dims: number of trailing input axes contracted with the kernel.
        output_dims: number of kernel axes that become trailing output axes.

    Returns:
        `(equation, bias_axes, output_rank)`, e.g. `("abc,cde->abde", "de", 4)` for
        a `(B, T, dim)` input projected to `(B, T, N, H)`.
    """
    free = _LETTERS[:free_dims]
    bound = _LETTERS[free_dims : free_dims + bound_dims]
    out = _LETTERS[free_dims + bound_dims : free_dims + bound_dims + output_dims]
    return f"{free}{bound},{bound}{out}->{free}{out}", out, free_dims + output_dims


def projection_output_shape(output_rank, known_last_dims):
    """EinsumDense `output_shape`: unknown leading axes, then the known trailing ones."""
    return [None] * (output_rank - 1 - len(known_last_dims)) + list(known_last_dims)


def normalize_attention_axes(attention_axes, projected_rank):
    """Attention axes as non-negative indices into the projected `(B, ..., N, H)` rank.

    `None` means every axis between batch and heads. Negative axes count from the end
    of the *input* (whose last axis is features), as in the built-in layer.
    """
    if attention_axes is None:
        return tuple(range(1, projected_rank - 2))
    return tuple(a if a >= 0 else (projected_rank - 1) + a for a in attention_axes)


def score_batch_axes(projected_rank, attention_axes):
    """Projected axes that index the scores' leading "batch" dims (heads included)."""
    return tuple(i for i in range(projected_rank - 1) if i not in attention_axes)


def attention_equations(projected_rank, attention_axes):
    """Einsum equations for the query-key product and the weighted sum of values.

    Args:
        projected_rank: rank of the projected query/key/value, `(B, ..., N, H)`.
        attention_axes: normalized attention axes (see `normalize_attention_axes`).

    Returns:
        `(dot_product_equation, combine_equation, scores_rank)`, with the dot product
        taking `(key, query)` and the combination taking `(scores, value)`, in that
        order, as the built-in layer does.
    """
    target = _LETTERS[:projected_rank]
    batch_axes = score_batch_axes(projected_rank, attention_axes)
    source = list(target)
    next_letter = projected_rank
    for axis in attention_axes:
        source[axis] = _LETTERS[next_letter]
        next_letter += 1
    source = "".join(source)
    product = (
        "".join(target[i] for i in batch_axes)
        + "".join(target[i] for i in attention_axes)
        + "".join(source[i] for i in attention_axes)
    )
    dot_product = f"{source},{target}->{product}"
    combine = f"{product},{source}->{target}"
    return dot_product, combine, len(product)


def scores_shape(projected_query_shape, projected_key_shape, attention_axes):
    """Static shape of the attention scores for the given projected shapes."""
    rank = len(projected_query_shape)
    batch_axes = score_batch_axes(rank, attention_axes)
    return (
        tuple(projected_query_shape[i] for i in batch_axes)
        + tuple(projected_query_shape[i] for i in attention_axes)
        + tuple(projected_key_shape[i] for i in attention_axes)
    )
