"""Mistral and Mixtral: `CachedMistralAttention`, `CachedMixtralAttention`.

Both decoders apply the sliding window in the dense mask they build
(`_compute_self_attention_mask`: key `j` is seen by query `i` when `i < j + window`,
`i` counted from `cache_update_index`), not in the attention class, whose
`sliding_window` only reaches vLLM's paged path. That is our `sliding_window=window`
(`t - s < window` with the causal mask, `t` counted from `cache_update_index` too):
given to our layer as well, the kernels know the band.
"""

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry

# Mixtral's sublayers are public attributes.
_MIXTRAL_PROJECTIONS = {
    "query_dense": "query_dense",
    "key_dense": "key_dense",
    "value_dense": "value_dense",
    "output_dense": "output_dense",
}


def _options(config, dim):
    heads = config["num_query_heads"]
    return dict(
        num_heads=heads,
        key_dim=config.get("head_dim") or dim // heads,
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=False,
        dropout=config["dropout"],
        dropout_on="output",
        sliding_window=config["sliding_window"],
        rope_max_wavelength=config["rope_max_wavelength"],
        rope_scaling_factor=config["rope_scaling_factor"],
        kernel_initializer=common.clone(config["kernel_initializer"]),
        fully_masked_rows="builtin",
    )


_NOTES = (
    "The decoder's mask applies the window (`i < j + sliding_window`); our layer is given "
    "the same window, `|t - s| < sliding_window`.",
)

ADAPTERS = {
    "keras_hub.src.models.mistral.mistral_attention.CachedMistralAttention": Entry(
        options=_options,
        call=common.self_attention,
        decoder_mask=common.causal_decoder_mask,
        weights=common.weights,
        notes=_NOTES,
    ),
    "keras_hub.src.models.mixtral.mixtral_attention.CachedMixtralAttention": Entry(
        options=_options,
        call=common.self_attention,
        decoder_mask=common.causal_decoder_mask,
        weights=lambda layer: common.weights(layer, _MIXTRAL_PROJECTIONS),
        notes=_NOTES,
    ),
}
