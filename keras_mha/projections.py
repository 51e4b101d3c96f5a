"""The projection sublayers: `EinsumDense` with a bias add that is right on every backend.

The layer's query, key, value and output projections (and the gate) are `Projection`s:
same weights, same variable names, same results as Keras's `EinsumDense`.

Self-attention is not fused into one `(dim, 3 * N * H)` product here: with the chunked
attention kernel it measured a wash (0.97x-1.04x of three products, JAX `predict`, four
sizes from B=2, T=16, dim 32 to B=4, T=512, dim 1024) and slower in training steps
(1.21x JAX, 1.02x TensorFlow), so the three projections run as they are written.
"""

from keras import backend, ops
from keras.layers import EinsumDense


def add_bias(x, bias):
    """`x + bias`, the bias broadcast over leading axes; `x` may be overwritten.

    `x` must be a fresh product that nothing else holds (the einsum just above).
    On torch the bias is added into it in place when the dtypes agree: a new
    `(B, T, N, H)` buffer costs its page faults, which at T=8192 made each of the
    four bias adds ~8 ms (a third of the projections' time) against ~1 ms in
    place. Only where no gradient flows through `x` (inference): torch's einsum
    returns a view, and an in-place add on a view costs a `CopySlices` and an
    `AsStridedBackward` in the backward pass, ~3 ms per projection in a training
    step at B=32, T=128, dim 512 against ~0.5 ms for the add's own backward.

    Keras's TensorFlow `ops.add` turns an add whose second operand squeezes to a
    vector into `tf.nn.bias_add`, channels-first when that vector's length is not
    `x`'s last dimension but matches axis 1: a `(N, 1)` bias (key_dim 1) on a
    `(B, T, N, 1)` projection with `T == N` would land on the sequence axis. Such
    biases (last dimension 1) are added there as `subtract(x, -bias)`; every other
    bias squeezes to `x`'s last dimension or not at all, and adds as usual.
    """
    name = backend.backend()
    if name == "tensorflow" and bias.shape[-1] == 1:
        return ops.subtract(x, ops.negative(bias))
    if name == "torch":
        import torch

        bias = ops.convert_to_tensor(bias)
        same = x.dtype == bias.dtype and x.device == bias.device
        # Not while `torch.jit.trace` records (OpenVINO's export): its check re-runs
        # the trace, where `requires_grad` may differ, and the graphs must match.
        if same and not x.requires_grad and not torch.jit.is_tracing():
            return x.add_(bias)
    return ops.add(x, bias)


class Projection(EinsumDense):
    """`EinsumDense` whose bias goes through `add_bias`."""

    def quantize(self, mode=None, type_check=True, config=None):
        # Keras refuses to quantize subclasses of EinsumDense; a quantized layer
        # runs EinsumDense's own quantized call, which this class leaves alone.
        super().quantize(mode, type_check=False, config=config)

    def call(self, inputs, training=None):
        x = ops.einsum(self.equation, inputs, self.kernel)
        if self.bias is not None:
            x = add_bias(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x
