"""Gemma 1 and 2 (`CachedGemmaAttention`), Gemma 3 (`CachedGemma3Attention`); the vision
and audio towers of the multimodal Gemmas out of scope (Gemma 3n's and Gemma 4's text
attention: `gemma3n.py`, `gemma4.py`).

Gemma's query, key and value kernels are `(N, dim, H)` (`"btd,ndh->btnh"`); ours are
`(dim, N, H)`: they are transposed when ported. Gemma's RoPE interleaves the rotated
halves of each head (`stack(split(x, 2), -1)`), the same permutation of the query's
and the key's dimensions, which leaves every logit as it is: ours keeps the halves.
A query whose keys are all masked gets a zero attention output in keras-hub (it wipes
it) and with ours (`fully_masked_rows="zero"`).

Their decoder blocks merge padding and causality into a dense mask
(`_compute_attention_mask`) and the attention class adds the window; in a swapped
model the blocks pass the padding mask described (`common.DecoderMask`), and our layer
adds causality and the window itself. Gemma 3's block falls back to keras-hub's dense
mask where it is given a vision mask (images attend to each other both ways) or its
attention is bidirectional (EmbeddingGemma); such a model takes no packed rows.
PaliGemma's block holds Gemma's attention with a prefix mask of its own: it keeps it.
"""

import numpy as np
from keras import ops

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry

NOTES = (
    "query/key/value kernels (N, dim, H) ported as (dim, N, H): `enable_lora`'s "
    "lora_kernel_a is (dim, N, r), not (N, dim, r) (the same adapter, transposed)",
    "the cache holds keys with RoPE's halves kept, not Gemma's interleaved layout "
    "(the logits are the same)",
)


def _scale(config, dim):
    """`query_head_dim_normalize`: `1 / sqrt(head_dim)`, else `1 / sqrt(dim // N)`."""
    if config["query_head_dim_normalize"]:
        return float(1.0 / np.sqrt(config["head_dim"]))
    return float(1.0 / np.sqrt(dim // config["num_query_heads"]))


def _window(config):
    """keras-hub masks `|t - s| <= size - 1`, on the cached path too (at the query's
    position `cache_update_index + t`): our integer window `size`. EmbeddingGemma's
    bidirectional window (Gemma 3) keeps `size - size // 2 - 1` keys before the query
    and `size // 2` after."""
    if not config["use_sliding_window_attention"]:
        return None
    size = config["sliding_window_size"]
    if config.get("use_bidirectional_attention"):
        return (size - size // 2 - 1, size // 2)
    return size


def _options(config, dim):
    return dict(
        num_heads=config["num_query_heads"],
        key_dim=config["head_dim"],
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=False,
        dropout=config["dropout"],
        scale=_scale(config, dim),
        logit_soft_cap=config["logit_soft_cap"] or None,
        sliding_window=_window(config),
        rope_max_wavelength=10_000.0,
        kernel_initializer=common.clone(config["kernel_initializer"]),
    )


def _weights(layer):
    """Query, key and value kernels `(N, dim, H)` -> `(dim, N, H)`."""
    found = common.weights(
        layer,
        {
            "query_dense": "query_dense",
            "key_dense": "key_dense",
            "value_dense": "value_dense",
            "output_dense": "output_dense",
        },
    )
    for name in ("query_dense", "key_dense", "value_dense"):
        found[name] = [np.transpose(ops.convert_to_numpy(v), (1, 0, 2)) for v in found[name]]
    return found


def _gemma_decoder_mask(decoder, x, padding_mask, cache=None, cache_update_index=0):
    """`GemmaDecoderBlock._compute_attention_mask`, described."""
    return common.causal_decoder_mask(decoder, x, padding_mask)


_GEMMA_DECODER = common.DescribedDecoder(
    _gemma_decoder_mask,
    method="_compute_attention_mask",
    decoders=("keras_hub.src.models.gemma.gemma_decoder_block.GemmaDecoderBlock",),
)


# ------------------------------------------------------------------------ Gemma 3
def _gemma3_decoder_mask(
    decoder, x, padding_mask, vision_mask=None, cache=None, cache_update_index=0
):
    """`Gemma3DecoderBlock._compute_attention_mask`, described; keras-hub's own dense
    mask where images attend both ways (`vision_mask`) or the attention is
    bidirectional (EmbeddingGemma)."""
    if vision_mask is not None or decoder.use_bidirectional_attention:
        own = type(decoder)._compute_attention_mask
        return own(decoder, x, padding_mask, vision_mask, cache, cache_update_index)
    return common.causal_decoder_mask(decoder, x, padding_mask)


_GEMMA3_DECODER = common.DescribedDecoder(
    _gemma3_decoder_mask,
    method="_compute_attention_mask",
    decoders=("keras_hub.src.models.gemma3.gemma3_decoder_block.Gemma3DecoderBlock",),
)


def _gemma3_options(config, dim):
    options = _options(config, dim)
    options.update(
        rope_max_wavelength=config["rope_wavelength"],
        rope_scaling_factor=config["rope_scaling_factor"],
    )
    if config["use_query_key_norm"]:
        options.update(
            normalize_qk=True,
            norm_unit_offset=True,
            norm_epsilon=config["layer_norm_epsilon"],
        )
    return options


def _gemma3_weights(layer):
    found = _weights(layer)
    if layer.use_query_key_norm:
        found["_query_norm"] = [layer.query_norm.scale.value]
        found["_key_norm"] = [layer.key_norm.scale.value]
    return found


def _gemma3_call(
    attention,
    x,
    attention_mask=None,
    cache=None,
    cache_update_index=0,
    cache_update_mask=None,
    training=False,
):
    """Gemma 3's protocol: the cache is a `(keys, values)` pair, each `(B, S, Nkv, H)`,
    and decoding steps pass a `(B, T)` `cache_update_mask`: where it is false (a
    prompt's own position), the cache keeps what it holds."""
    if cache is None:
        return common.self_attention(attention, x, attention_mask, training=training)
    output, cache = attention(
        x,
        x,
        **common.mask_arguments(attention_mask),
        cache=ops.stack(cache, axis=1),
        cache_update_index=cache_update_index,
        cache_update_mask=cache_update_mask,
        training=training,
    )
    return output, (cache[:, 0, ...], cache[:, 1, ...])


ADAPTERS = {
    "keras_hub.src.models.gemma.gemma_attention.CachedGemmaAttention": Entry(
        options=_options,
        call=common.self_attention,
        weights=_weights,
        decoder_mask=_GEMMA_DECODER,
        notes=NOTES,
    ),
    "keras_hub.src.models.gemma3.gemma3_attention.CachedGemma3Attention": Entry(
        options=_gemma3_options,
        call=_gemma3_call,
        weights=_gemma3_weights,
        decoder_mask=_GEMMA3_DECODER,
        notes=NOTES + ("the `(keys, values)` cache pair is stacked into ours for each call",),
    ),
}


_MODELS = "keras_hub.src.models."
OUT_OF_SCOPE = {
    # Towers of multimodal models: not language-model attention.
    _MODELS + "gemma3.gemma3_vision_encoder.Gemma3VisionAttention": (
        "the SigLIP vision tower of a multimodal Gemma 3 (CLIP-style attention over image "
        "patches, Dense (dim, dim) projections with biases, no cache): not a language "
        "model's attention; keras-hub's own images-in path is left as it is"
    ),
    _MODELS + "gemma3n.gemma3n_attention.Gemma3nAudioAttention": (
        "the audio tower of Gemma 3n: chunked local attention (query blocks against a "
        "left/right context of keys), relative-position logits and a learned softplus "
        "per-dimension query scale, none of which our layer has"
    ),
    _MODELS + "gemma3n.gemma3n_audio_layers.Gemma3nAudioConformerAttention": (
        "the audio tower of Gemma 3n: a Conformer block's pre/post-norm, projection and "
        "residual around Gemma3nAudioAttention (out of scope), not an attention of its own"
    ),
    _MODELS + "gemma4.gemma4_attention.Gemma4VisionAttention": (
        "the vision tower of Gemma 4: 2-D RoPE over (x, y) patch ids (each half of a head "
        "rotated by one axis), which our `positions` (one stream, or M-RoPE's interleaved "
        "sections) does not express, and padded patch queries kept un-zeroed on purpose"
    ),
    _MODELS + "gemma4.gemma4_audio_encoder.Gemma4AudioAttention": (
        "the audio tower of Gemma 4: chunk-based local attention (query blocks against "
        "past/future horizons) with relative-position sinusoidal biases"
    ),
    _MODELS + "gemma4.gemma4_audio_encoder.Gemma4AudioConformerAttention": (
        "the audio tower of Gemma 4: a Conformer block's norms, projection and residual "
        "around Gemma4AudioAttention (out of scope), not an attention of its own"
    ),
}
