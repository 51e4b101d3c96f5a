"""Qwen 2/2.5, Qwen-MoE, Qwen3 and Qwen3-MoE: `QwenAttention`, `QwenMoeAttention`,
`Qwen3Attention`, `Qwen3MoeAttention`.

Their sliding window is applied by the attention class itself, and only on its
explicit path: `_mask_sliding_window` keeps keys `j` with `|i - j| <= window - 1`
(`i` counted from `cache_update_index`), our `sliding_window=window` (`|t - s| <
window`). The fused path (`ops.dot_product_attention`, taken where keras-hub's
`fused_attention_op_available()` holds: JAX and torch; Qwen-MoE: only on a GPU or
TPU, and without dropout) ignores the window. keras-hub's decision, on the machine
the layer is built on, is ours: the window is given to our layer exactly where
keras-hub's class applies it, so the swap keeps the model's outputs.
"""

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry

# Qwen-MoE's query, key and value sublayers are public attributes, not its output's.
_MOE_PROJECTIONS = {
    "query_dense": "query_dense",
    "key_dense": "key_dense",
    "value_dense": "value_dense",
    "output_dense": "_output_dense",
}
_QK_NORMS = {
    **common.PROJECTIONS,
    "_query_norm": "_query_dense_layer_norm",
    "_key_norm": "_key_dense_layer_norm",
}


# keras-hub 0.32's `QwenMoeBackbone.get_config` drops `router_aux_loss_coefficient`, and the
# backbone passes it to each decoder block and its sparse MoE block when constructed.
_MOE = "keras_hub.src.models.qwen_moe"
CONFIG_GAPS = {
    f"{_MOE}.qwen_moe_backbone.QwenMoeBackbone": ("router_aux_loss_coefficient",),
    f"{_MOE}.qwen_moe_decoder.QwenMoeTransformerDecoder": ("router_aux_loss_coefficient",),
    f"{_MOE}.qwen_moe_decoder.QwenSparseMoeBlock": ("router_aux_loss_coefficient",),
}


def _fused_everywhere_but_tensorflow(config):
    """`QwenAttention`, `Qwen3Attention` and `Qwen3MoeAttention`'s test for their
    fused path (which ignores the window)."""
    from keras_hub.src.utils.keras_utils import fused_attention_op_available

    return fused_attention_op_available()


def _fused_on_accelerators(config):
    """`QwenMoeAttention._use_fused_attention_op`: keras-hub's own test, run on the
    layer's configuration (it reads only `dropout`)."""
    from keras_hub.src.models.qwen_moe.qwen_moe_attention import QwenMoeAttention

    return common.own_fused_test(QwenMoeAttention, config)


def _base(config, dim, key_dim, window, fused):
    heads = config["num_query_heads"]
    return dict(
        num_heads=heads,
        key_dim=key_dim or dim // heads,
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=False,
        dropout=config["dropout"],
        dropout_on="output",
        sliding_window=None if not window or fused(config) else window,
        rope_max_wavelength=config["rope_max_wavelength"],
        rope_scaling_factor=config["rope_scaling_factor"],
        kernel_initializer=common.clone(config["kernel_initializer"]),
        fully_masked_rows=common.fused_or_softmax_rows(fused(config)),
    )


def _qwen_options(fused):
    """Qwen 2 and Qwen-MoE: biases on the query, key and value projections only."""

    def options(config, dim):
        window = config["sliding_window_size"] if config["use_sliding_window_attention"] else None
        return dict(
            _base(config, dim, None, window, fused),
            use_bias=True,
            use_output_bias=False,
            bias_initializer=common.clone(config["bias_initializer"]),
        )

    return options


def _qwen3_options(config, dim):
    """Qwen3 and Qwen3-MoE: RMS QK-norm over each head (its own epsilon; keras-hub's
    decoders leave the attention's default, 1e-5 for Qwen3, 1e-6 for Qwen3-MoE)."""
    return dict(
        _base(
            config,
            dim,
            config["head_dim"],
            config["sliding_window_size"],
            _fused_everywhere_but_tensorflow,
        ),
        normalize_qk=True,
        norm_epsilon=config["layer_norm_epsilon"],
    )


def _window_note(where):
    return (
        f"keras-hub applies the sliding window only on its explicit path ({where}); the "
        "fused path ignores it. Ours applies it where keras-hub's does."
    )


# Qwen-MoE's and Qwen3-MoE's decoders hand their sparse MoE block the dense mask too:
# routing ignores it, and only the load-balancing loss (training) reads it, as
# `ops.any(mask, axis=-1)`, which tokens count. The block gets that, `(B, T, 1)`.
_MOE_DECODER = common.DescribedDecoder(
    common.causal_decoder_mask,
    sublayers=(("mlp", common.queries_seeing_a_key),),
)

_NOTE = _window_note("TensorFlow, or no fused op")
ADAPTERS = {
    "keras_hub.src.models.qwen.qwen_attention.QwenAttention": Entry(
        options=_qwen_options(_fused_everywhere_but_tensorflow),
        call=common.self_attention,
        decoder_mask=common.causal_decoder_mask,
        weights=common.weights,
        notes=(_NOTE,),
    ),
    "keras_hub.src.models.qwen_moe.qwen_moe_attention.QwenMoeAttention": Entry(
        options=_qwen_options(_fused_on_accelerators),
        call=common.self_attention,
        decoder_mask=_MOE_DECODER,
        weights=lambda layer: common.weights(layer, _MOE_PROJECTIONS),
        notes=(_window_note("every CPU; on a GPU or TPU only with dropout"),),
    ),
    "keras_hub.src.models.qwen3.qwen3_attention.Qwen3Attention": Entry(
        options=_qwen3_options,
        call=common.self_attention,
        decoder_mask=common.causal_decoder_mask,
        weights=lambda layer: common.weights(layer, _QK_NORMS),
        notes=(_NOTE,),
    ),
    "keras_hub.src.models.qwen3_moe.qwen3_moe_attention.Qwen3MoeAttention": Entry(
        options=_qwen3_options,
        call=common.self_attention,
        decoder_mask=_MOE_DECODER,
        weights=lambda layer: common.weights(layer, _QK_NORMS),
        notes=(_NOTE,),
    ),
}
