"""Bloom: `BloomAttention` (ALiBi computed inside the attention, as keras-hub's
`AlibiBias` does)."""

from keras import ops

from keras_mha.hub import common, layout
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    heads = config["num_heads"]
    return dict(
        num_heads=heads,
        key_dim=dim // heads,
        use_bias=True,
        dropout=config["dropout"],
        # keras-hub drops the weights, then (the same layer) the projected output.
        dropout_on="weights_and_projected_output",
        kernel_initializer=common.clone(config["kernel_initializer"]),
        bias_initializer=common.clone(config["bias_initializer"]),
        fully_masked_rows="zero",  # keras-hub's masked `keras.layers.Softmax`
    )


def _call(attention, hidden_states, attention_mask=None, cache=None, cache_update_index=None):
    """keras-hub's ALiBi reads the keys' absolute positions: in a packed row, each
    document's keys are shifted by its start, the same for every key a query sees, so
    its softmax is the one it gets alone."""
    length = ops.shape(hidden_states)[1] if cache is None else ops.shape(cache)[2]
    return attention(
        hidden_states,
        hidden_states,
        **common.mask_arguments(attention_mask),
        cache=cache,
        cache_update_index=cache_update_index,
        attention_bias=common.alibi(attention.num_heads, length, attention.compute_dtype),
    )


def _decoder_mask(
    decoder,
    decoder_sequence,
    decoder_padding_mask=None,
    decoder_attention_mask=None,
    use_causal_mask=True,
    cache=None,
    cache_update_index=None,
):
    """`BloomDecoder._compute_attention_mask`, described where it is causal (always, in
    keras-hub's models); without causality, keras-hub's own dense mask."""
    if not use_causal_mask:
        return type(decoder)._compute_attention_mask(
            decoder,
            decoder_sequence,
            decoder_padding_mask,
            decoder_attention_mask,
            use_causal_mask,
            cache,
            cache_update_index,
        )
    return common.causal_decoder_mask(
        decoder, decoder_sequence, decoder_padding_mask, decoder_attention_mask
    )


def _weights(layer):
    return {
        "query_dense": layout.values(layer._query_dense),
        "key_dense": layout.values(layer._key_dense),
        "value_dense": layout.values(layer._value_dense),
        "output_dense": layout.output_heads(layer._output_dense, layer.num_heads),
    }


ADAPTERS = {
    "keras_hub.src.models.bloom.bloom_attention.BloomAttention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        decoder_mask=common.DescribedDecoder(_decoder_mask, method="_compute_attention_mask"),
        notes=(
            "ALiBi (keras-hub's `AlibiBias`: slopes `2 ** (-8 i / N)`, keys' absolute "
            "positions, after the scale) as `attention_bias`.",
            "Dropout as keras-hub's: the attention weights, then the projected output at "
            "the same rate (`dropout_on='weights_and_projected_output'`); ours draws its "
            "masks from our layer's seed (the weights' a hash of their positions), so "
            "training steps with dropout give other losses than keras-hub's, equal "
            "without dropout or in inference.",
        ),
    ),
}
