"""Models on `keras.layers.MultiHeadAttention`, as users write them (keras.io's text
classification with a Transformer), for the swap tests and the CLI's `--import`.
"""

import keras
import numpy as np
from keras import layers

PACKAGE = "swap_models"
VOCAB, MAXLEN, EMBED, HEADS, FF = 20, 8, 16, 2, 16


@keras.saving.register_keras_serializable(package=PACKAGE)
class TransformerBlock(layers.Layer):
    """keras.io's block: the built-in attention is created in `__init__`."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True  # padding stays masked down to the pooling
        self.embed_dim, self.num_heads, self.ff_dim, self.rate = embed_dim, num_heads, ff_dim, rate
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)

    def get_config(self):
        config = super().get_config()
        config.update(
            embed_dim=self.embed_dim, num_heads=self.num_heads, ff_dim=self.ff_dim, rate=self.rate
        )
        return config


@keras.saving.register_keras_serializable(package=PACKAGE)
class Encoder(layers.Layer):
    """Two levels down: a layer holding a list of blocks."""

    def __init__(self, depth=2, **kwargs):
        super().__init__(**kwargs)
        self.depth = depth
        self.blocks = [TransformerBlock(EMBED, HEADS, FF) for _ in range(depth)]

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def get_config(self):
        return {**super().get_config(), "depth": self.depth}


@keras.saving.register_keras_serializable(package=PACKAGE)
class CachedAttention(layers.MultiHeadAttention):
    """keras-hub's `CachedMultiHeadAttention` pattern: its own `call` over the
    documented protected surface (projections and `_compute_attention`)."""

    def call(self, query, value, key=None, attention_mask=None, training=None):
        key = value if key is None else key
        query = self._query_dense(query)
        key, value = self._key_dense(key), self._value_dense(value)
        output, _ = self._compute_attention(
            query=query, key=key, value=value, attention_mask=attention_mask, training=training
        )
        return self._output_dense(output)

    def get_config(self):
        return super().get_config()  # zero-argument super(): rebound when rebuilt


@keras.saving.register_keras_serializable(package=PACKAGE)
class SoftmaxHookAttention(layers.MultiHeadAttention):
    """Overrides a build hook of the built-in and reads what it sets (`_softmax`)."""

    def _build_attention(self, rank):
        super()._build_attention(rank)
        self.softmax_axes = self._softmax.axis


def build_subclassed(seed=0):
    """Two subclasses of the built-in: one over its projections and `_compute_attention`,
    one overriding its `_build_attention` hook."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((MAXLEN, EMBED), name="features")
    causal = np.tril(np.ones((1, MAXLEN, MAXLEN), bool))
    y = CachedAttention(2, 8, name="cached")(x, x, attention_mask=causal)
    y = SoftmaxHookAttention(2, 8, name="hooked")(y, y)
    return keras.Model(x, y, name="subclassed")


def build_classifier(seed=0):
    """Embedding(mask_zero=True) -> TransformerBlock (built-in inside) -> a top-level
    built-in attention with a causal mask -> pooling -> Dense."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((MAXLEN,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, EMBED, mask_zero=True)(tokens)
    x = TransformerBlock(EMBED, HEADS, FF, name="block")(x)
    x = layers.MultiHeadAttention(2, 8, name="causal_attention")(x, x, use_causal_mask=True)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(3, activation="softmax", name="classes")(x)
    model = keras.Model(tokens, outputs, name="classifier")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def build_residual_classifier(seed=0):
    """keras.io's text classifier with a causal residual on top: Embedding(mask_zero=True)
    -> TransformerBlock (built-in inside) -> `x + MultiHeadAttention(x, x,
    use_causal_mask=True)` (the sum drops the Keras mask) -> pooling over every row,
    padded ones included -> Dense. Padded query rows have no key to attend to and reach
    the loss: on torch the built-in's gradients through them are wrong (masks guide)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((MAXLEN,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, EMBED, mask_zero=True)(tokens)
    x = TransformerBlock(EMBED, HEADS, FF, name="block")(x)
    x = x + layers.MultiHeadAttention(2, 8, name="causal_attention")(x, x, use_causal_mask=True)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(3, activation="softmax", name="classes")(x)
    model = keras.Model(tokens, outputs, name="residual_classifier")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def build_deep(seed=0):
    """Attention two user layers down, in a list: Encoder -> blocks[i] -> att."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((MAXLEN, EMBED), name="features")
    return keras.Model(x, layers.Dense(2)(Encoder(name="encoder")(x)), name="deep")


def build_plain(seed=0):
    """No attention at all."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((4,), name="x")
    return keras.Model(x, layers.Dense(2)(x), name="plain")
