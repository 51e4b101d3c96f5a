"""The only place keras_mha uses API that is not public, of Keras and of TensorFlow.

Keras 3 keeps a tensor's implicit mask (from `Embedding(mask_zero=True)`, `Masking`,
...) as an attribute of the tensor, read and written with these two helpers; no
public API exposes them. TensorFlow says whether a graph is being traced for XLA
(`tf.function(jit_compile=True)`, Keras's default on TensorFlow with a GPU) only
through its control-flow utilities. What Keras's `Layer.__call__` does around a
layer's `call` (autocast scopes, quantized and rematerialized calls, output layouts,
input conversion and checks) is read from the layer's private state in
`call_is_all_it_does`. A layer that takes a structure other than tensors as a
positional call argument (a keras-hub block's described mask) says so through
`allow_non_tensor_positional_args`. `tests/test_keras_private.py` fails loudly if a new
Keras or TensorFlow moves or changes them.
"""

from keras import InputSpec, backend, distribution, ops
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.backend.common.variables import get_autocast_scope


def tensorflow_xla_tracing():
    """Whether TensorFlow is tracing a graph that XLA compiles (static shapes only).
    Call only on the TensorFlow backend."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def call_is_all_it_does(layer, inputs):
    """Whether Keras's `Layer.__call__` would do nothing for `layer(inputs)` (one
    tensor, no other argument) but return `layer.call(inputs)`.

    True only for a layer already called once (built, its call context known), not
    quantized (`quantized_call`), not rematerialized, with no activity regularizer, no
    `keras.distribution` in force (outputs relaid out), and an input that is a backend
    tensor (not symbolic) with no Keras mask, of the layer's input dtype (no
    conversion), of the rank its input spec asks for, under the autocast scope the
    layer would keep (none where its compute and variable dtypes agree; the caller's,
    when it is the layer's compute dtype)."""
    # A Keras without these attributes gets its own `__call__` (and the test fails).
    if not getattr(layer, "_called", False) or layer.quantization_mode is not None:
        return False
    if getattr(layer, "_remat_mode", "?") is not None or layer.activity_regularizer is not None:
        return False
    if not ops.is_tensor(inputs) or get_keras_mask(inputs) is not None:
        return False
    if backend.standardize_dtype(inputs.dtype) != layer.input_dtype:
        return False
    if layer.input_spec is not None and _spec_asks_more(layer.input_spec, inputs):
        return False
    if distribution.distribution() is not None:
        return False
    scope = get_autocast_scope()
    if scope is None:
        return layer.compute_dtype == layer.variable_dtype
    return bool(layer.autocast) and scope.dtype == layer.compute_dtype


def allow_non_tensor_positional_args(layer):
    """Lets `layer`'s `Layer.__call__` take positional arguments that are not tensors
    (Keras's own flag, off by default: its check refuses them)."""
    layer._allow_non_tensor_positional_args = True


def _spec_asks_more(spec, inputs):
    """Whether `spec` asks anything of `inputs` but the rank they have (`EinsumDense`'s
    asks the rank alone): a list of specs, a shape, bounds, a dtype or axes."""
    if not isinstance(spec, InputSpec):
        return True
    asks = (spec.shape, spec.max_ndim, spec.min_ndim, spec.dtype, spec.axes)
    return (spec.ndim is not None and spec.ndim != len(inputs.shape)) or any(
        a is not None and a != {} for a in asks
    )


__all__ = [
    "allow_non_tensor_positional_args",
    "call_is_all_it_does",
    "get_keras_mask",
    "set_keras_mask",
    "tensorflow_xla_tracing",
]
