"""Phi-3: `Phi3Attention`, with plain RoPE (`rope_scaling_type=None`) or LongRoPE
(`"su"`: `Phi3SuScaledRotaryEmbedding`'s short and long factors, the long ones where
the call's last position passes `pretraining_sequence_length`, `cos`/`sin` times
`sqrt(1 + ln(max / pretraining) / ln(pretraining))`): our `rope_scaling` of type
"longrope"."""

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    return common.decoder_options(config, dim, rope_scaling=_longrope(config))


def _longrope(config):
    if config["rope_scaling_type"] is None:
        return None
    if config["rope_scaling_type"] != "su":  # keras-hub raises the same when it builds
        raise ValueError(
            'Received an invalid value for argument `rope_scaling_type`, expected `None` or "su". '
            f"Received: rope_scaling_type={config['rope_scaling_type']}"
        )
    return {
        "type": "longrope",
        "short_factor": list(config["rope_scaling_short_factor"]),
        "long_factor": list(config["rope_scaling_long_factor"]),
        "original_max_position_embeddings": config["pretraining_sequence_length"],
        "max_position_embeddings": config["max_sequence_length"],
    }


ADAPTERS = {
    "keras_hub.src.models.phi3.phi3_attention.Phi3Attention": Entry(
        options=_options,
        call=common.self_attention,
        decoder_mask=common.causal_decoder_mask,
        weights=lambda layer: common.weights(layer, common.PUBLIC_PROJECTIONS),
    ),
}
