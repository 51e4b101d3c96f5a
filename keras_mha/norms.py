"""`RMSNorm`: root-mean-square normalisation over the last axis, with a learned scale.

Used for QK-norm (`MultiHeadAttention(normalize_qk=True)`): projected queries and keys
`(B, T, N, H)` are normalised over the head dimension `H` before the dot product.
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_mha")
class RMSNorm(keras.layers.Layer):
    """`x * rsqrt(mean(x ** 2, axis=-1) + epsilon) * scale`, in float32 inside.

    Args:
        epsilon: Added to the mean square before the square root.
        **kwargs: Base `Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        x: `(..., H)`.

    Returns:
        `(..., H)`, in the compute dtype; `scale` has shape `(H,)`, initialised to ones.
    """

    def __init__(self, epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = float(epsilon)

    def build(self, input_shape):
        self.scale = self.add_weight(
            name="scale", shape=(input_shape[-1],), initializer="ones", trainable=True
        )

    def call(self, x):
        dtype = x.dtype
        x = ops.cast(x, "float32")
        mean_square = ops.mean(ops.square(x), axis=-1, keepdims=True)
        x = x * ops.rsqrt(mean_square + self.epsilon)
        return ops.cast(x * ops.cast(self.scale, "float32"), dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}
