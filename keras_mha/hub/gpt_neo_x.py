"""GPT-NeoX: `GPTNeoXAttention` (a fused query/key/value projection, partial rotary)."""

from keras import ops

from keras_mha.hub import common, layout
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    heads = config["num_heads"]
    size = config["hidden_dim"] // heads
    rotary = int(size * config["rotary_percentage"])
    return dict(
        num_heads=heads,
        key_dim=size,
        use_bias=True,
        dropout=config["dropout"],
        kernel_initializer=common.clone(config["kernel_initializer"]),
        bias_initializer=common.clone(config["bias_initializer"]),
        rope_max_wavelength=config["rotary_max_wavelength"],
        rope_dim=None if rotary == size else rotary,
        fully_masked_rows=common.fused_or_softmax_rows(),
    )


def _call(
    layer, hidden_states, attention_mask=None, cache=None, cache_update_index=None, training=None
):
    """keras-hub returns `(output, cache)`, `cache` `None` without one. Its cache holds
    the keys unrotated and rotates them all at their positions each call, while the
    queries are rotated at `0..T-1` whatever `cache_update_index`: a decoding step's
    query sits at 0. By default ours does the same (`positions` of the queries at
    `t`, `key_positions` of the new keys at `cache_update_index + t`, which the cache
    keeps rotated); with `corrected`, queries sit at `cache_update_index + t`."""
    positions = {}
    if cache is not None and cache_update_index is not None and not layer.corrected:
        batch, length = ops.shape(hidden_states)[0], ops.shape(hidden_states)[1]
        steps = ops.broadcast_to(ops.arange(length, dtype="int32")[None], (batch, length))
        index = ops.cast(cache_update_index, "int32")
        positions = {"positions": steps, "key_positions": steps + index}
    output = layer.attention(
        hidden_states,
        hidden_states,
        **common.mask_arguments(attention_mask),
        cache=cache,
        cache_update_index=cache_update_index,
        training=training,
        **positions,
    )
    if cache is None:
        return output, None
    return output


def _weights(layer):
    query, key, value = layout.split_fused(layer._qkv_dense)
    return {
        "query_dense": query,
        "key_dense": key,
        "value_dense": value,
        "output_dense": layout.output_heads(layer._output_dense, layer.num_heads),
    }


ADAPTERS = {
    "keras_hub.src.models.gpt_neo_x.gpt_neo_x_attention.GPTNeoXAttention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        with_layer=True,
        decoder_mask=common.causal_decoder_mask,
        notes=(
            "Its fused `query_key_value` `(dim, N, 3H)` (each head's query, key and value "
            "adjacent) split into our three projections.",
            "Partial rotary: the first `int(H * rotary_percentage)` dimensions of each head "
            "(`rope_dim`, prefix layout).",
            "Cached decoding: keras-hub rotates each step's query at position 0 (its cache "
            "keeps the keys unrotated, rotated at their positions each call): the swap keeps "
            "that (`positions`, `key_positions`); `corrected=True` puts the query at "
            "`cache_update_index + t`, so decoding gives a full call's logits.",
            "`enable_lora` targets layers named `query_dense`/`value_dense`: keras-hub's "
            "attention has none (`query_key_value`), ours does, so the swapped model's "
            "query and value projections get LoRA factors.",
        ),
    ),
}
