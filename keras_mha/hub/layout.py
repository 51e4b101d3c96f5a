"""keras-hub's projection layouts reshaped to ours: `Dense` kernels over all heads,
`(dim, N * H)` and `(N * H, dim)`, to our per-head `(dim, N, H)` and `(N, H, dim)`, and
fused query/key/value projections split (the head index before the three in the
fused axis, as GPT-NeoX lays it out)."""

from keras import ops


def values(layer):
    """The values of `layer`'s variables, in their order."""
    return [v.value for v in layer.weights]


def input_heads(dense, num_heads):
    """A `Dense` `(dim, N * H)` projection (and its `(N * H,)` bias) as our
    `(dim, N, H)` kernel (and `(N, H)` bias)."""
    kernel, *bias = values(dense)
    dim = kernel.shape[0]
    shaped = [ops.reshape(kernel, (dim, num_heads, -1))]
    return shaped + [ops.reshape(b, (num_heads, -1)) for b in bias]


def output_heads(dense, num_heads):
    """A `Dense` `(N * H, dim)` output projection as our `(N, H, dim)` kernel (its
    `(dim,)` bias as it is)."""
    kernel, *bias = values(dense)
    return [ops.reshape(kernel, (num_heads, -1, kernel.shape[-1]))] + bias


def split_fused(dense, parts=3):
    """A fused `(dim, N, parts * H)` projection (bias `(N, parts * H)`), each head's
    query, key and value adjacent, as `parts` lists `[kernel (dim, N, H), bias (N, H)]`."""
    kernel, *bias = values(dense)
    pieces = [ops.split(kernel, parts, axis=-1)] + [ops.split(b, parts, axis=-1) for b in bias]
    return [list(each) for each in zip(*pieces)]
