"""Gemma 3n's text attention (`Gemma3nTextAttention`); its audio tower stays out of scope
(`gemma.py` names it).

Gemma 3n's query, key and value projections are `Dense` layers over all heads, its
QK-norm `x * w` (epsilon `rms_norm_eps`), its value norm without weight, its logits
unscaled (1.0), RoPE on the query and key. Its cache is head-major, `(B, 2, Nkv, S,
H)`; ours is `(B, 2, S, Nkv, H)`: the entry transposes it on the way in and out. The
last `num_kv_shared_layers` layers are KV-shared: keras-hub hands each the cache (on
the uncached path, the stacked keys and values) that the last non-shared layer of the
same type returned, and the layer attends over it without writing it: our layer's
`shared_key_value` call argument. Their own key and value projections, which keras-hub
builds and never uses, are kept (ported, unused), so the model's weights stay the same.
Its decoder block merges padding and causality into a dense mask
(`_compute_attention_mask`); in a swapped model it passes them described
(`common.DecoderMask`), and our layer adds its window and the cache offset itself.
"""

from keras import ops

from keras_mha.hub import common, layout
from keras_mha.hub.adapter import Entry

NOTES = (
    "the head-major `(B, 2, Nkv, S, H)` cache is transposed to ours `(B, 2, S, Nkv, H)` "
    "and back at each call",
    "KV-shared layers attend over the other layer's keys and values as "
    "`shared_key_value`; their own key and value projections are kept, unused, as in "
    "keras-hub",
    "the attention weights (keras-hub's second output, which its decoder discards) are "
    "not computed: `None`",
    "a query whose keys are all masked (a padded query past a short window, or a "
    "left-padded one) gets the mean of all the values in keras-hub (-1e9 logits): kept "
    '(`fully_masked_rows="builtin"`)',
)


def _options(config, dim):
    return dict(
        num_heads=config["num_attention_heads"],
        key_dim=config["head_dim"],
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=config["attention_bias"],
        dropout=config["attention_dropout"],
        scale=1.0,
        normalize_qk=True,
        normalize_value=True,
        norm_epsilon=config["rms_norm_eps"],
        rope_max_wavelength=config["rope_max_wavelength"],
        rope_scaling_factor=config["rope_scaling_factor"] or 1.0,
        sliding_window=config["sliding_window"],
        output_shape=config["hidden_size"] if config["hidden_size"] != dim else None,
        fully_masked_rows="builtin",
    )


def _weights(layer):
    heads, kv_heads = layer.num_attention_heads, layer.num_key_value_heads
    return {
        "query_dense": layout.input_heads(layer.q_proj, heads),
        "key_dense": layout.input_heads(layer.k_proj, kv_heads),
        "value_dense": layout.input_heads(layer.v_proj, kv_heads),
        "output_dense": layout.output_heads(layer.o_proj, heads),
        "_query_norm": [layer.q_norm.scale.value],
        "_key_norm": [layer.k_norm.scale.value],
    }


def _decoder_mask(decoder, x, padding_mask, cache=None, cache_update_index=0):
    """`Gemma3nTextDecoderBlock._compute_attention_mask`, described; with a cache,
    keras-hub's own dense mask: its cached calls pass the padding of the new tokens
    only, which its mask spreads over every key of their rows."""
    if cache is not None:
        own = type(decoder)._compute_attention_mask
        return own(decoder, x, padding_mask, cache, cache_update_index)
    return common.causal_decoder_mask(decoder, x, padding_mask)


_DECODER = common.DescribedDecoder(
    _decoder_mask,
    method="_compute_attention_mask",
    decoders=("keras_hub.src.models.gemma3n.gemma3n_text_decoder.Gemma3nTextDecoderBlock",),
    not_packed="Gemma 3n on packed rows is not checked yet (tests/test_hub_packed.py)",
)


def _ours(cache):
    """Head-major `(B, 2, Nkv, S, H)` <-> ours `(B, 2, S, Nkv, H)` (its own inverse)."""
    return ops.transpose(cache, (0, 1, 3, 2, 4))


def _call(
    layer,
    hidden_states,
    attention_mask,
    cache=None,
    cache_update_index=0,
    cache_update_mask=None,
    training=False,
):
    """Returns `(output, None, cache)`: keras-hub's `(output, weights, cache)`; the cache
    the keys and values (head-major) also on the uncached path, for the KV-shared
    layers after it."""
    attention = layer.attention
    x = hidden_states
    masks = common.mask_arguments(attention_mask)
    if layer.config["is_kv_shared_layer"]:
        output = attention(
            x,
            x,
            **masks,
            shared_key_value=_ours(cache),
            cache_update_index=cache_update_index,
            training=training,
        )
        return output, None, cache
    if cache is None:
        output, held = attention(x, x, **masks, return_key_value=True, training=training)
        return output, None, _ours(held)
    output, held = attention(
        x,
        x,
        **masks,
        cache=_ours(cache),
        cache_update_index=cache_update_index,
        cache_update_mask=cache_update_mask,
        training=training,
    )
    return output, None, _ours(held)


ADAPTERS = {
    "keras_hub.src.models.gemma3n.gemma3n_attention.Gemma3nTextAttention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        decoder_mask=_DECODER,
        notes=NOTES,
        with_layer=True,
    ),
}


def _logits_of_weights(task, inputs):
    """keras-hub 0.32's `Gemma3nCausalLM` builds its functional graph with its output
    embedding read at construction (`token_embedding(..., reverse=True)` on a
    variable's value, a constant of the graph on tensorflow and jax): `task(inputs)`
    keeps the embedding the task was built with, whatever its weights are now (set,
    trained, loaded), and a reloaded task has another. These are the logits of its
    current weights, as its cached decoding (`call_with_cache`) computes them."""
    backbone = task.backbone
    return backbone.language_model.token_embedding(backbone(inputs), reverse=True)


# keras-hub tasks whose call is not the function of their weights: what a check of the
# task runs instead (`keras_mha.hub.task_forward`), and the line that says so.
TASK_FORWARD = {
    "keras_hub.src.models.gemma3n.gemma3n_causal_lm.Gemma3nCausalLM": (
        _logits_of_weights,
        "compared through the logits of its current weights (its backbone, then the "
        "output embedding): keras-hub's task reads its output embedding at "
        "construction, so two loads of one file differ (docs/guide/guarantees.md)",
    ),
}
