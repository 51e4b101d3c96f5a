"""Llama (2 and 3.x): `LlamaAttention` (`LlamaBackbone`, `Llama3Backbone`)."""

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    return common.decoder_options(
        config,
        dim,
        rope_scaling_factor=config["rope_position_scaling_factor"],
        rope_scaling=_llama3_scaling(config),
    )


def _llama3_scaling(config):
    """Llama 3.1+'s frequency smoothing (keras-hub's `LlamaRotaryEmbedding`), set
    when its four arguments are (keras-hub requires all four or none)."""
    if config["rope_low_freq_factor"] is None:
        return None
    return {
        "type": "llama3",
        "factor": config["rope_frequency_adjustment_factor"],
        "low_freq_factor": config["rope_low_freq_factor"],
        "high_freq_factor": config["rope_high_freq_factor"],
        "original_max_position_embeddings": config["rope_pretraining_sequence_length"],
    }


ADAPTERS = {
    "keras_hub.src.models.llama.llama_attention.LlamaAttention": Entry(
        options=_options,
        call=common.self_attention,
        weights=common.weights,
        decoder_mask=common.causal_decoder_mask,
        notes=(
            'Dropout on the attention output (`dropout_on="output"`), as keras-hub\'s; '
            "its masks are drawn from our layer's seed, not keras-hub's.",
        ),
    ),
}
