"""Llama (2 and 3.x): `LlamaAttention`."""

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    heads = config["num_query_heads"]
    return dict(
        num_heads=heads,
        key_dim=dim // heads,
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=False,
        dropout=config["dropout"],
        rope_max_wavelength=config["rope_max_wavelength"],
        rope_scaling_factor=config["rope_position_scaling_factor"],
        kernel_initializer=common.clone(config["kernel_initializer"]),
        fully_masked_rows="builtin",
    )


ADAPTERS = {
    "keras_hub.src.models.llama.llama_attention.LlamaAttention": Entry(
        options=_options,
        call=common.self_attention,
        weights=common.weights,
        decoder_mask=common.causal_decoder_mask,
    ),
}
