"""The projection sublayers: `EinsumDense` with a bias add that is right on every backend.

The layer's query, key, value and output projections (and the gate) are `Projection`s:
same weights, same variable names, same results as Keras's `EinsumDense`.

A quantized projection (`model.quantize(...)`) has its own quantized dtype policy;
`policy_for_config` records those policies in the layer's config, so a layer rebuilt
from it builds its projections quantized and their saved variables load.

Self-attention is not fused into one `(dim, 3 * N * H)` product here: it measured no
gain (benchmarks/results/README.md, "Decisions"), so the three projections run as they
are written.
"""

from keras import dtype_policies, ops
from keras.layers import EinsumDense

from keras_mha import _keras_private
from keras_mha.kernels import policy


def add_bias(x, bias):
    """`x + bias`, the bias broadcast over leading axes; `x` may be overwritten.

    `x` must be a fresh product that nothing else holds (the einsum just above).
    Where the policy says so (torch), the bias is added into it in place when the
    dtypes agree and no gradient flows through `x`: a new `(B, T, N, H)` buffer
    costs its page faults, and an in-place add on the view torch's einsum returns
    would cost a `CopySlices` and an `AsStridedBackward` in a backward pass.

    Keras's TensorFlow `ops.add` turns an add whose second operand squeezes to a
    vector into `tf.nn.bias_add`, channels-first when that vector's length is not
    `x`'s last dimension but matches axis 1: a `(N, 1)` bias (key_dim 1) on a
    `(B, T, N, 1)` projection with `T == N` would land on the sequence axis. Such
    biases (last dimension 1) are added as `subtract(x, -bias)`; every other bias
    squeezes to `x`'s last dimension or not at all, and adds as usual.
    """
    if bias.shape[-1] == 1:
        return ops.subtract(x, ops.negative(bias))
    if policy.current().in_place_bias:
        import torch

        bias = ops.convert_to_tensor(bias)
        same = x.dtype == bias.dtype and x.device == bias.device
        # Not while `torch.jit.trace` records (OpenVINO's export): its check re-runs
        # the trace, where `requires_grad` may differ, and the graphs must match.
        if same and not x.requires_grad and not torch.jit.is_tracing():
            return x.add_(bias)
    return ops.add(x, bias)


def policy_for_config(layer):
    """The dtype policy `layer.get_config()` records: its own, plus its quantized sublayers'.

    `quantize` gives each projection a quantized policy (`"int8_from_float32"`, ...)
    while the layer keeps its own. Rebuilt from a config holding only the layer's
    policy, the projections would be built in floating point and could not take the
    quantized variables saved with them. So, as Keras's `DTypePolicyMap` docstring
    does for the built-in layer and keras-hub's `Backbone` for whole models, the
    policy becomes a `DTypePolicyMap`: the layer's own policy as default, and each
    quantized sublayer's path (`"mha/query"`) to its policy. The sublayers are
    given that map as their dtype and look their own path up when built, so they
    are built quantized; this needs the layer to sit at the same path when it is
    rebuilt (as it does when a saved model loads).

    Args:
        layer: A built or unbuilt `keras.layers.Layer`.

    Returns:
        The layer's `dtype_policy` when it is already a `DTypePolicyMap` (the
        sublayers' quantized policies are in it: they were set through it) or when
        no sublayer is quantized; otherwise a new `DTypePolicyMap`.
    """
    policy = layer.dtype_policy
    if isinstance(policy, dtype_policies.DTypePolicyMap):
        return policy
    quantized = {
        sublayer.path: sublayer.dtype_policy
        for sublayer in layer._flatten_layers(include_self=False)
        if sublayer.quantization_mode is not None
    }
    if not quantized:
        return policy
    return dtype_policies.DTypePolicyMap(default_policy=policy, policy_map=quantized)


class Projection(EinsumDense):
    """`EinsumDense` whose bias goes through `add_bias`."""

    def quantize(self, mode=None, type_check=True, config=None):
        # Keras refuses to quantize subclasses of EinsumDense; a quantized layer
        # runs EinsumDense's own quantized call, which this class leaves alone.
        super().quantize(mode, type_check=False, config=config)

    def __call__(self, *args, **kwargs):
        # Keras's `Layer.__call__` costs more Python than the einsum of a small call;
        # where the policy says so (eager torch), it is skipped when it would only
        # call `call` (`_keras_private.call_is_all_it_does`).
        if (
            len(args) == 1
            and not kwargs
            and policy.current().direct_projections
            and _keras_private.call_is_all_it_does(self, args[0])
        ):
            return self.call(args[0])
        return super().__call__(*args, **kwargs)

    def call(self, inputs, training=None):
        x = ops.einsum(self.equation, inputs, self.kernel)
        if self.bias is not None:
            x = add_bias(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        return x
