"""SmolLM3: `SmolLM3Attention`.

Its decoder calls it as `self_attn(hidden_states, training, attention_mask,
self_attention_cache=..., self_attention_cache_update_index=...)`. Its query, key and
value projections are `Dense` layers, `(dim, N * H)` kernels, reshaped to our
`(dim, N, H)`; the output projection has no bias (`attention_bias` is on the other
three only). RoPE is off on the layers whose entry of `rope_layer_enabled_list` is
false (NoPE), and `attention_dropout` is not applied by keras-hub's class.
"""

from keras import ops

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads
    enabled = config["rope_layer_enabled_list"]
    index = config["layer_idx"]
    use_rope = enabled[index] if index < len(enabled) else True  # keras-hub's default
    rope_dim = int(head_dim * config["partial_rotary_factor"])
    return dict(
        num_heads=heads,
        key_dim=head_dim,
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=config["attention_bias"],
        use_output_bias=False,
        rope_max_wavelength=config["rope_theta"] if use_rope else None,
        rope_dim=rope_dim if use_rope and rope_dim < head_dim else None,
        fully_masked_rows=common.fused_or_softmax_rows(),
    )


def _call(attention, hidden_states, training=False, attention_mask=None, **kwargs):
    return common.self_attention(
        attention,
        hidden_states,
        attention_mask=attention_mask,
        cache=kwargs.get("self_attention_cache"),
        cache_update_index=kwargs.get("self_attention_cache_update_index"),
        training=training,
    )


def _weights(layer):
    heads, kv_heads = layer.num_attention_heads, layer.num_key_value_heads
    head_dim = layer.head_dim
    result = {}
    for ours, theirs, n in (
        ("query_dense", layer.q_proj, heads),
        ("key_dense", layer.k_proj, kv_heads),
        ("value_dense", layer.v_proj, kv_heads),
    ):
        kernel = ops.reshape(theirs.kernel.value, (-1, n, head_dim))
        result[ours] = [kernel]
        if theirs.use_bias:
            result[ours].append(ops.reshape(theirs.bias.value, (n, head_dim)))
    result["output_dense"] = [v.value for v in layer.o_proj.weights]
    return result


ADAPTERS = {
    "keras_hub.src.models.smollm3.smollm3_layers.SmolLM3Attention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        decoder_mask=common.causal_decoder_mask,
        attributes=lambda config: {
            "head_dim": config["hidden_size"] // config["num_attention_heads"]
        },
        notes=(
            "`partial_rotary_factor` < 1 fails in keras-hub's class (its cos/sin do not "
            "broadcast to the head); ours rotates the first `int(head_dim * factor)` "
            "dimensions of each head (`rope_dim`).",
            "With a cache but no `self_attention_cache_update_index`, keras-hub's class "
            "leaves the queries unrotated (keras-hub's decoding always passes an index); "
            "ours rotates them at position 0 onward.",
        ),
    ),
}
