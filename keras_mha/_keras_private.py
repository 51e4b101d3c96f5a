"""The only place keras_mha uses API that is not public, of Keras and of TensorFlow.

Keras 3 keeps a tensor's implicit mask (from `Embedding(mask_zero=True)`, `Masking`,
...) as an attribute of the tensor, read and written with these two helpers; no
public API exposes them. TensorFlow says whether a graph is being traced for XLA
(`tf.function(jit_compile=True)`, Keras's default on TensorFlow with a GPU) only
through its control-flow utilities. `tests/test_keras_private.py` fails loudly if a
new Keras or TensorFlow moves or changes them.
"""

from keras.src.backend.common.masking import get_keras_mask, set_keras_mask


def tensorflow_xla_tracing():
    """Whether TensorFlow is tracing a graph that XLA compiles (static shapes only).
    Call only on the TensorFlow backend."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


__all__ = ["get_keras_mask", "set_keras_mask", "tensorflow_xla_tracing"]
