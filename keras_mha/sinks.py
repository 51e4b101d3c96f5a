"""`Sinks`: one learned logit per head that joins every row's softmax denominator.

As in GPT-OSS: `weight(t, s) = exp(l(t, s)) / (sum over s' of exp(l(t, s')) + exp(sink))`,
so a query may put part of its attention nowhere (a row's weights sum to less than 1).
A sublayer of its own, created last, so the attention layer's other weights keep
their order and the sink logits come after them.
"""

import keras


class Sinks(keras.layers.Layer):
    """Holds `sinks`, shape `(num_heads,)`, initialised to zeros."""

    def __init__(self, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads

    def build(self, input_shape=None):
        self.sinks = self.add_weight(
            name="sinks", shape=(self.num_heads,), initializer="zeros", trainable=True
        )

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads}
