"""Qwen3.5: `Qwen3_5Attention` (gated, QK-norm `x * (1 + w)`, partial rotary, M-RoPE);
its vision encoder's attention is out of scope."""

from keras import ops

from keras_mha.hub import common, layout
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    size = config["head_dim"]
    rotary = int(size * config["partial_rotary_factor"])
    options = dict(
        num_heads=config["num_query_heads"],
        key_dim=size,
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=False,
        use_gate=True,
        normalize_qk=True,
        norm_unit_offset=True,
        norm_epsilon=config["layer_norm_epsilon"],
        rope_max_wavelength=config["rope_max_wavelength"],
        rope_scaling_factor=config["rope_scaling_factor"],
        rope_dim=None if rotary == size else rotary,
        dropout=config["dropout"],
        dropout_on="output",
        kernel_initializer=common.clone(config["kernel_initializer"]),
        sliding_window=_window(config),
        fully_masked_rows=common.fused_or_softmax_rows(),
    )
    if config["mrope_section"] is not None:
        options["rope_scaling"] = {"type": "mrope", "sections": list(config["mrope_section"])}
    return options


def _window(config):
    """keras-hub applies its window (`|t - s| < w`) only where it does not run
    `ops.dot_product_attention` (`fused_attention_op_available()`: false on
    tensorflow and on torch without CUDA; true on jax), the window the swap keeps."""
    from keras_hub.src.utils.keras_utils import fused_attention_op_available

    window = config["sliding_window_size"]
    return None if not window or fused_attention_op_available() else window


def _call(
    attention,
    hidden_states,
    attention_mask=None,
    cache=None,
    cache_update_index=None,
    position_ids=None,
    training=None,
):
    """`position_ids`: M-RoPE's `(B, 4, T)` (text, time, height, width): ours takes
    the last three."""
    positions = {} if position_ids is None else {"positions": position_ids[:, 1:]}
    return attention(
        hidden_states,
        hidden_states,
        **common.mask_arguments(attention_mask),
        cache=cache,
        cache_update_index=cache_update_index,
        training=training,
        **positions,
    )


def _weights(layer):
    query, gate = ops.split(layer._query_dense.kernel, 2, axis=-1)
    return {
        "query_dense": [query],
        "key_dense": layout.values(layer._key_dense),
        "value_dense": layout.values(layer._value_dense),
        "output_dense": layout.values(layer._output_dense),
        "_gate_dense": [gate],
        "_query_norm": layout.values(layer._query_norm),
        "_key_norm": layout.values(layer._key_norm),
    }


# Its full-attention blocks compute their mask as Llama's do; its linear-attention
# (gated delta-rule) blocks carry a recurrent state along the whole row.
_DECODER = common.DescribedDecoder(
    common.causal_decoder_mask,
    not_packed=(
        "its linear-attention layers carry a recurrent state along the whole row, across documents"
    ),
)

ADAPTERS = {
    "keras_hub.src.models.qwen3_5.qwen3_5_attention.Qwen3_5Attention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        decoder_mask=_DECODER,
        notes=(
            "Its query projection `(dim, N, 2H)` (each head's query, then its gate) split "
            "into our query and `use_gate` projections.",
            "QK-norm `x * (1 + w)`: `normalize_qk`, `norm_unit_offset`; partial rotary "
            "`rope_dim` (prefix); M-RoPE `rope_scaling={'type': 'mrope'}` with "
            "`position_ids[:, 1:]`; dropout on the output (`dropout_on='output'`).",
            "Sliding window: keras-hub applies it only off `ops.dot_product_attention` "
            "(tensorflow, torch without CUDA), not on jax: the swap keeps that per backend "
            "(`corrected` does not change it: the window is fixed when the layer builds).",
            "LoRA: keras-hub's `enable_lora` adapts its fused query-and-gate projection "
            "(factors `(dim, N, r) (r, 2H)`); ours adapts the query alone `(r, H)`.",
        ),
    ),
}

OUT_OF_SCOPE = {
    "keras_hub.src.models.qwen3_5.qwen3_5_vision_encoder.Qwen3_5VisionAttention": (
        "the vision encoder's attention takes its 2-D rotary embedding as precomputed "
        "`(cos, sin)` tables per patch (`position_embeddings`), which our RoPE (positions "
        "it rotates by itself) cannot take, and packs images by `cu_seqlens`"
    ),
}
