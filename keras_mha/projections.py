"""One fused query/key/value projection for self-attention.

When the query, key and value are the same `(B, T, dim)` tensor, the three
`(dim, N, H)` projections are one `(dim, N*Hq + Nkv*Hk + Nkv*Hv)` matrix product:
`fused_self_projection` concatenates the three existing kernels (and biases) at call
time, multiplies once and splits. The weight variables stay those of the three
sublayers, so weights, checkpoints and results (within float32 rounding) are unchanged.
"""

from keras import activations, backend, ops
from keras.layers import EinsumDense

_EQUATION = "abc,cde->abde"


def fusable(denses, training=None):
    """Whether to fuse: the projections can be fused and fusing pays off here."""
    return pays_off(training) and can_fuse(denses)


def pays_off(training=None):
    """Where one fused product beat three, by measurement (`benchmarks/run.py`).

    Only JAX inference (forward ~16% faster). Not JAX training steps: XLA's backward pass
    through the concatenation and split measured ~8% slower than three projections. Not
    TensorFlow: concatenating the kernels in the graph measured ~8% slower (B=8, T=256,
    dim 512, 8 heads, `predict_on_batch`). Not torch: in eager mode the concatenation,
    casts and splits are a dozen extra op dispatches per call, a wash at that size and
    0.2x of the call's time at `keras-mha compare --quick` sizes.
    """
    return backend.backend() == "jax" and not training


def can_fuse(denses):
    """Whether plain `EinsumDense` projections of a `(B, T, dim)` input can be fused.

    Not: quantized or LoRA-enabled sublayers, activations or activity regularizers
    (their own `__call__` would apply them), different compute dtypes, and subclasses
    that override `call` outside Keras and this package.
    """
    dtypes = {d.compute_dtype for d in denses}
    biases = {d.bias is None for d in denses}
    for d in denses:
        if not isinstance(d, EinsumDense) or not d.built or d.equation != _EQUATION:
            return False
        if type(d).call.__module__.split(".")[0] not in ("keras", "keras_mha"):
            return False
        if getattr(d, "quantization_mode", None) or getattr(d, "lora_enabled", False):
            return False
        if d.activation not in (None, activations.linear) or d.activity_regularizer is not None:
            return False
    return len(dtypes) == 1 and len(biases) == 1


def fused_self_projection(denses, inputs):
    """`tuple(d(inputs) for d in denses)` as one matrix product.

    Args:
        denses: `EinsumDense` layers with equation `"abc,cde->abde"` (see `fusable`),
            kernels `(dim, N_i, H_i)` and biases `(N_i, H_i)` or none.
        inputs: `(B, T, dim)`.

    Returns:
        One `(B, T, N_i, H_i)` tensor per layer, in the layers' compute dtype.
    """
    dtype = denses[0].compute_dtype
    dim = inputs.shape[-1]
    heads = [tuple(d.kernel.shape[1:]) for d in denses]
    widths = [n * h for n, h in heads]
    kernel = ops.concatenate(
        [ops.reshape(ops.cast(d.kernel, dtype), (dim, w)) for d, w in zip(denses, widths)],
        axis=1,
    )
    fused = ops.matmul(ops.cast(inputs, dtype), kernel)
    if denses[0].bias is not None:
        bias = ops.concatenate(
            [ops.reshape(ops.cast(d.bias, dtype), (w,)) for d, w in zip(denses, widths)], axis=0
        )
        # `subtract(x, -b)`, not `add`: see `layer._EinsumDense`.
        fused = ops.subtract(fused, ops.negative(bias))
    leading = list(ops.shape(inputs)[:-1])
    splits = list(_cumulative(widths[:-1]))
    pieces = ops.split(fused, splits, axis=-1) if splits else [fused]
    return tuple(ops.reshape(p, leading + list(nh)) for p, nh in zip(pieces, heads))


def _cumulative(values):
    total = 0
    for v in values:
        total += v
        yield total
