"""Falcon: `FalconAttention` (ALiBi, given by its decoder block)."""

import math

from keras import ops

from keras_mha.hub import common, layout
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    heads = config["num_heads"]
    return dict(
        num_heads=heads,
        key_dim=dim // heads,
        use_bias=True,
        dropout=config["attention_dropout_rate"],
        fully_masked_rows="zero",  # keras-hub's masked `keras.layers.Softmax`
    )


def _call(attention, inputs, alibi, attention_mask=None, cache=None, cache_update_index=None):
    """Falcon's decoder passes ALiBi, `(B, N, 1, S)`: each head's slope (`2 ** (-8 i / N)`)
    times the key's position among the unpadded keys (the cache's positions when
    decoding); keras-hub adds it before the `1 / sqrt(H)` scale, so ours adds it scaled.
    In a packed row the decoder reads the document ids as that padding mask, which
    gives no positions: the slopes times the keys' positions in the row then (each
    document's shifted by its start, the same for every key a query sees: its softmax
    is the one it gets alone)."""
    if isinstance(attention_mask, common.DecoderMask) and attention_mask.segment_ids is not None:
        length = ops.shape(inputs)[1] if cache is None else ops.shape(cache)[2]
        alibi = common.alibi(attention.num_heads, length, attention.compute_dtype)
    scale = ops.cast(1.0 / math.sqrt(attention.key_dim), attention.compute_dtype)
    return attention(
        inputs,
        inputs,
        **common.mask_arguments(attention_mask),
        cache=cache,
        cache_update_index=cache_update_index,
        attention_bias=ops.multiply(ops.cast(alibi, attention.compute_dtype), scale),
    )


def _weights(layer):
    return {
        "query_dense": layout.values(layer.query_dense),
        "key_dense": layout.values(layer.key_dense),
        "value_dense": layout.values(layer.value_dense),
        "output_dense": layout.output_heads(layer.output_dense, layer.num_heads),
    }


ADAPTERS = {
    "keras_hub.src.models.falcon.falcon_attention.FalconAttention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        decoder_mask=common.DescribedDecoder(
            common.causal_decoder_mask, method="_compute_attention_mask"
        ),
        notes=(
            "ALiBi (the `alibi` its decoder passes) as `attention_bias`, times `1 / sqrt(H)`: "
            "keras-hub adds it before the scale.",
        ),
    ),
}
