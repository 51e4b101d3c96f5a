"""RoFormer-v2: `RoformerAttention` (interleaved RoPE, an encoder's padding mask)."""

import keras

from keras_mha.hub import common, layout
from keras_mha.hub.adapter import Entry

# keras-hub reshapes the `(B, S)` padding mask to `(B, 1, S, 1)` before
# `ops.dot_product_attention`: on tensorflow and jax it masks the padded *queries*
# (their rows fully masked: the mean of all the values) and no key; on torch it
# first turns it into the keys' mask, the correct one.
MASK_NOTE = (
    "Padding: on tensorflow and jax, keras-hub masks the padded queries (their output "
    "the mean of all values) and no key; on torch (and with `corrected=True` on every "
    "backend) the padded keys, which the swap keeps per backend."
)
LORA_NOTE = (
    "`enable_lora` targets layers named `query_dense`/`value_dense`: keras-hub's "
    "attention has none, ours does, so the swapped model's query and value projections "
    "get LoRA factors."
)


def _options(config, dim, rotary=True, interleaved=True):
    heads, size = config["heads"], config["head_size"]
    options = dict(
        num_heads=heads,
        key_dim=size,
        output_shape=config["out_dim"] or heads * size,
        use_bias=config["use_bias"],
        kernel_initializer=common.clone(config["kernel_initializer"]),
        fully_masked_rows="builtin",
    )
    if rotary:
        options.update(rope_max_wavelength=config["max_wavelength"], rope_interleaved=interleaved)
    return options


def encoder_call(layer, x, attention_mask=None):
    """Self-attention with the encoder's `(B, S)` padding mask, applied as keras-hub
    applies it on this backend (`MASK_NOTE`), or to the keys with `corrected`."""
    masks = {}
    if attention_mask is not None:
        keys = layer.corrected or keras.config.backend() == "torch"
        masks = {"value_mask" if keys else "query_mask": attention_mask}
    return layer.attention(x, x, **masks)


def weights(layer):
    return {
        "query_dense": layout.input_heads(layer.q_dense, layer.heads),
        "key_dense": layout.input_heads(layer.k_dense, layer.heads),
        "value_dense": layout.input_heads(layer.v_dense, layer.heads),
        "output_dense": layout.output_heads(layer.o_dense, layer.heads),
    }


ADAPTERS = {
    "keras_hub.src.models.roformer_v2.roformer_v2_attention.RoformerAttention": Entry(
        options=_options,
        call=encoder_call,
        weights=weights,
        with_layer=True,
        notes=(
            "RoPE on interleaved pairs `(x[2i], x[2i + 1])`: `rope_interleaved=True`.",
            MASK_NOTE,
            LORA_NOTE,
        ),
    ),
}
