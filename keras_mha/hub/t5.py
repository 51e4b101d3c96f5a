"""T5: `T5MultiHeadAttention` (self- and cross-attention, a relative position bias,
logits unscaled)."""

import math

import keras
from keras import ops

from keras_mha.hub import layout
from keras_mha.hub.adapter import Entry

BUCKETS, MAX_DISTANCE = 32, 128  # keras-hub's T5 fixes them


@keras.saving.register_keras_serializable(package="keras_mha")
class RelativePositionBias(keras.layers.Layer):
    """T5's relative position bias: a learned `(buckets, N)` table (weight
    `embeddings`) looked up by the bucket of each key's distance `s - t` from its
    query, as keras-hub's `T5MultiHeadAttention.compute_bias` does (Mesh TensorFlow's
    buckets: exact below `buckets / 4` (or `/ 2` one-way), logarithmic up to
    `max_distance`).

    Args:
        num_heads: Number of attention heads `N`.
        bidirectional: Keys after the query get buckets of their own (an encoder);
            `False`: they share bucket 0 (a decoder).
        stddev: The table's initial normal standard deviation.
        **kwargs: Base `Layer` arguments.

    It holds the table; `bias(query_length, key_length, start)` gives the `(1, N, T,
    S)` bias of queries `start + t` and keys `s` (lengths may be symbolic, so it is
    no Keras call).
    """

    def __init__(self, num_heads, bidirectional, stddev=1.0, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.bidirectional = bidirectional
        self.stddev = stddev

    def build(self, input_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(BUCKETS, self.num_heads),
            initializer=keras.initializers.RandomNormal(mean=0.0, stddev=self.stddev),
        )

    def bias(self, query_length, key_length, start=0):
        queries = ops.arange(query_length)[:, None] + start
        distance = ops.arange(key_length)[None, :] - queries
        values = ops.take(self.embeddings, _bucket(distance, self.bidirectional), axis=0)
        return ops.transpose(values, (2, 0, 1))[None]

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "bidirectional": self.bidirectional,
            "stddev": self.stddev,
        }


def _bucket(distance, bidirectional):
    """The bucket of each relative position `s - t` (int32)."""
    buckets, offset = BUCKETS, 0
    if bidirectional:
        buckets //= 2
        offset = ops.cast(ops.greater(distance, 0), distance.dtype) * buckets
        distance = ops.abs(distance)
    else:
        distance = -ops.minimum(distance, 0)
    exact = buckets // 2
    far = exact + ops.cast(
        ops.log(ops.cast(distance, "float32") / exact)
        / math.log(MAX_DISTANCE / exact)
        * (buckets - exact),
        distance.dtype,
    )
    far = ops.minimum(far, buckets - 1)
    return offset + ops.where(ops.less(distance, exact), distance, far)


def _layers(config):
    if not config["use_relative_attention_bias"]:
        return {}
    inner = config["num_heads"] * config["key_value_dim"]
    return {
        "relative_attention_bias": RelativePositionBias(
            config["num_heads"],
            bidirectional=not config["is_decoder"],
            stddev=inner**-0.5,
            name="relative_attention_bias",
        )
    }


def _options(config, dim):
    inner = config["num_heads"] * config["key_value_dim"]
    return dict(
        num_heads=config["num_heads"],
        key_dim=config["key_value_dim"],
        output_shape=config["hidden_dim"],
        use_bias=False,
        dropout=config["dropout"],
        scale=1.0,
        kernel_initializer=keras.initializers.RandomNormal(mean=0.0, stddev=inner**-0.5),
        fully_masked_rows="builtin",
    )


def _call(
    layer,
    hidden_states,
    mask=None,
    key_value_states=None,
    position_bias=None,
    cache=None,
    cache_update_index=None,
    training=False,
):
    """keras-hub's protocol: returns `(output, position_bias, cache)`. The first layer
    of a stack computes the bias (its table's, or zeros) and folds the mask into it
    (`-1e9` where masked) for the layers after it, which pass it back as
    `position_bias` and no mask; ours takes the bias and the mask apart."""
    attention = layer.attention
    states = hidden_states if key_value_states is None else key_value_states
    bias, attention_mask = position_bias, None
    if position_bias is None:
        length = ops.shape(hidden_states)[1]
        keys = ops.shape(states)[1] if cache is None else ops.shape(cache)[2]
        dtype = attention.compute_dtype
        if layer.config["use_relative_attention_bias"]:
            start = 0 if cache_update_index is None else cache_update_index
            bias = ops.cast(layer.relative_attention_bias.bias(length, keys, start), dtype)
            position_bias = bias
        else:
            position_bias = ops.zeros((1, attention.num_heads, length, keys), dtype)
        if mask is not None:
            attention_mask = mask
            position_bias = position_bias + (1.0 - ops.cast(mask[:, None], dtype)) * -1e9
    output = attention(
        hidden_states,
        states,
        attention_mask=attention_mask,
        attention_bias=bias,
        cache=cache,
        cache_update_index=cache_update_index,
        training=training,
    )
    if cache is not None:
        output, cache = output
    return output, position_bias, cache


def _weights(layer):
    heads = layer.num_heads
    weights = {
        "query_dense": layout.input_heads(layer.query_projector, heads),
        "key_dense": layout.input_heads(layer.key_projector, heads),
        "value_dense": layout.input_heads(layer.value_projector, heads),
        "output_dense": layout.output_heads(layer.output_projector, heads),
    }
    if layer.use_relative_attention_bias:
        weights["relative_attention_bias"] = [layer.relative_attention_bias.value]
    return weights


ADAPTERS = {
    "keras_hub.src.models.t5.t5_multi_head_attention.T5MultiHeadAttention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        layers=_layers,
        with_layer=True,
        notes=(
            "Logits unscaled: `scale=1.0`.",
            "The relative position bias as `attention_bias`, its `(32, N)` table a "
            "trainable weight of the moved layer (`RelativePositionBias`); the mask "
            "passed apart, keras-hub's `position_bias` (mask folded in) still returned.",
            "Initial kernels: keras-hub draws the query's with stddev "
            "`(N * H * H) ** -0.5`, ours all with `(N * H) ** -0.5` (weights are ported).",
            "`enable_lora` targets layers named `query_dense`/`value_dense`: keras-hub's "
            "attention has none, ours does, so the swapped model's query and value "
            "projections get LoRA factors.",
        ),
    ),
}
