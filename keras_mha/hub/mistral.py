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


def _options(config, dim, **options):
    return common.decoder_options(
        config,
        dim,
        sliding_window=config["sliding_window"],
        rope_scaling_factor=config["rope_scaling_factor"],
        **options,
    )


def _mixtral_options(config, dim):
    """Mistral's, with the rows no key reaches as `CachedMixtralAttention` gives them."""
    from keras_hub.src.models.mixtral.mixtral_attention import CachedMixtralAttention

    fused = common.own_fused_test(CachedMixtralAttention, config)
    return _options(config, dim, fully_masked_rows=common.fused_or_softmax_rows(fused))


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
        options=_mixtral_options,
        call=common.self_attention,
        decoder_mask=common.causal_decoder_mask,
        weights=lambda layer: common.weights(layer, common.PUBLIC_PROJECTIONS),
        notes=_NOTES,
    ),
}
