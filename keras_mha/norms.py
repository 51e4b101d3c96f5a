"""`RMSNorm`: root-mean-square normalisation over the last axis, with or without a
learned scale.

The kinds `MultiHeadAttention` uses, all over the head dimension `H` of projected
`(B, T, N, H)` heads, float32 inside:

- QK-norm (`normalize_qk=True`): a learned scale `w`, the output `x_hat * w` with `w`
  initialised to ones (Qwen3, Gemma 4, OLMo 2), or with `unit_offset=True`
  (`norm_unit_offset=True`) `x_hat * (1 + w)` with `w` initialised to zeros (Gemma 3,
  Qwen3.5, T5Gemma 2).
- The value norm (`normalize_value=True`): `x_hat` alone, no weight (Gemma 3n, Gemma 4).

`x_hat = x * rsqrt(mean(x ** 2) + epsilon)`, `epsilon` the layer's `norm_epsilon`.
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_mha")
class RMSNorm(keras.layers.Layer):
    """`x * rsqrt(mean(x ** 2, axis=-1) + epsilon) * scale`, in float32 inside.

    Args:
        epsilon: Added to the mean square before the square root.
        unit_offset: The learned weight `w` is an offset from 1: the output is
            `x_hat * (1 + w)`, `w` initialised to zeros (keras-hub's Gemma 3 and
            Qwen3.5 norms), instead of `x_hat * w`, `w` initialised to ones.
        use_scale: Whether there is a learned weight at all; `False` gives `x_hat`
            and creates no weight (the value norm of Gemma 3n and Gemma 4).
        **kwargs: Base `Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        x: `(..., H)`.

    Returns:
        `(..., H)`, in the compute dtype; the weight `scale` has shape `(H,)`.
    """

    def __init__(self, epsilon=1e-6, unit_offset=False, use_scale=True, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = float(epsilon)
        self.unit_offset = bool(unit_offset)
        self.use_scale = bool(use_scale)

    def build(self, input_shape):
        if self.use_scale:
            self.scale = self.add_weight(
                name="scale",
                shape=(input_shape[-1],),
                initializer="zeros" if self.unit_offset else "ones",
                trainable=True,
            )

    def call(self, x):
        dtype = x.dtype
        x = ops.cast(x, "float32")
        mean_square = ops.mean(ops.square(x), axis=-1, keepdims=True)
        x = x * ops.rsqrt(mean_square + self.epsilon)
        if self.use_scale:
            scale = ops.cast(self.scale, "float32")
            x = x * (1.0 + scale if self.unit_offset else scale)
        return ops.cast(x, dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {
            **super().get_config(),
            "epsilon": self.epsilon,
            "unit_offset": self.unit_offset,
            "use_scale": self.use_scale,
        }
