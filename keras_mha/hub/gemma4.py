"""Gemma 4's text attention (`Gemma4TextAttention`); its vision and audio towers stay out
of scope (`gemma.py` names them).

Gemma 4: scale 1.0, QK-norm `x * w` and a value norm without weight (epsilon
`layer_norm_epsilon`), RoPE, on global layers partial ("proportional": the first
`rope_dim / 2` dimensions of each half, at the whole head's frequencies) with their
own base. Its query and key/value kernels are `(N, dim, H)`; ours `(dim, N, H)`:
transposed when ported. Three kinds of layers:

- `attention_k_eq_v` global layers (with `num_global_key_value_heads`): one key
  projection, the values its output normed without RoPE: our
  `key_value_projection="tied"`, with their own number of key/value heads and
  `global_head_dim`. keras-hub's cache is allocated for the widest layer, `(B, 2, S,
  num_key_value_heads, max(head_dim, global_head_dim))`; a layer writes and reads its
  own corner `[..., :Nkv, :H]`, as ours does here.
- KV-shared layers (the last `num_kv_shared_layers`): no key or value projection; the
  model hands each the keys and values of an earlier layer of the same type
  (`shared_kv`) and it returns its own cache slot unchanged: our
  `key_value_projection="none"` and `shared_key_value`.
- the others, as Gemma 3's with the value norm.

The sliding window is not the attention's: the decoder block applies it to its dense
mask through the attention's `_mask_sliding_window`, before OR-ing in a multimodal
model's bidirectional image blocks; the entry gives the layer that method (keras-hub's
band `|t - s| <= size - 1` at the cache's offset, or the bidirectional window).
"""

import functools

import numpy as np
from keras import ops

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry

NOTES = (
    "query/key/value kernels (N, dim, H) ported as (dim, N, H): `enable_lora`'s "
    "lora_kernel_a is (dim, N, r), not (N, dim, r) (the same adapter, transposed)",
    "the cache holds keys with RoPE's halves kept, not Gemma's interleaved layout "
    "(the logits are the same)",
    "`attention_k_eq_v` layers: `key_value_projection='tied'`; KV-shared layers: "
    "`key_value_projection='none'` with `shared_key_value`",
    "the sliding window reaches our layer inside the decoder's dense mask "
    "(`_mask_sliding_window`, kept for the decoder), not described",
)


def _tied(config):
    """keras-hub's rule: K = V only on global (non-sliding) layers."""
    return config["attention_k_eq_v"] and not config["use_sliding_window_attention"]


def _kv_heads(config):
    if _tied(config) and config["num_global_key_value_heads"] is not None:
        return config["num_global_key_value_heads"]
    return config["num_key_value_heads"]


def _rope_dim(config):
    """keras-hub's `rotary_dim`: `int(factor * head_dim)` rounded down to even, at least 2;
    `None` where every dimension rotates."""
    head_dim = config["head_dim"]
    raw = int(config["rope_partial_rotary_factor"] * head_dim)
    rotary = max(2, raw - raw % 2)
    return None if rotary >= head_dim else rotary


def _options(config, dim):
    if config["is_kv_shared_layer"]:
        projection = "none"
    else:
        projection = "tied" if _tied(config) else "separate"
    rope_dim = _rope_dim(config)
    return dict(
        num_heads=config["num_query_heads"],
        key_dim=config["head_dim"],
        num_key_value_heads=_kv_heads(config),
        use_bias=False,
        dropout=config["dropout"],
        scale=1.0,
        logit_soft_cap=config["logit_soft_cap"] or None,
        normalize_qk=True,
        normalize_value=True,
        norm_epsilon=config["layer_norm_epsilon"],
        rope_max_wavelength=config["rope_wavelength"],
        rope_scaling_factor=config["rope_scaling_factor"],
        rope_dim=rope_dim,
        rope_dim_layout="proportional" if rope_dim is not None else "prefix",
        key_value_projection=projection,
        kernel_initializer=common.clone(config["kernel_initializer"]),
    )


def _weights(layer):
    """Query and key/value kernels `(N, dim, H)` -> `(dim, N, H)`; the norms' scales."""

    def heads(dense):
        return [np.transpose(ops.convert_to_numpy(dense.kernel.value), (1, 0, 2))]

    found = {
        "query_dense": heads(layer.query_dense),
        "output_dense": [layer.output_dense.kernel.value],
        "_query_norm": [layer.query_norm.scale.value],
    }
    if layer.key_dense is not None:
        found["key_dense"] = heads(layer.key_dense)
        found["_key_norm"] = [layer.key_norm.scale.value]
    if layer.value_dense is not None:
        found["value_dense"] = heads(layer.value_dense)
    return found


def _mask_sliding_window(config, attention_mask, cache_update_index=0):
    """keras-hub's `Gemma4TextAttention._mask_sliding_window`, which its decoder block
    calls: the dense `(B, T, S)` mask ANDed with the window, a band `|t - s| <= size - 1`
    with the queries at `cache_update_index + t`, or EmbeddingGemma's bidirectional
    window (`size - size // 2 - 1` keys before, `size // 2` after)."""
    size = config["sliding_window_size"]
    shape = ops.shape(attention_mask)
    queries, keys = shape[1], shape[2]
    if config["use_bidirectional_attention"]:
        distance = ops.arange(queries)[:, None] - ops.arange(queries)[None, :]
        right = size // 2
        band = ops.logical_and(distance <= size - right - 1, distance >= -right)
    else:
        rows = ops.arange(queries)[:, None] + cache_update_index
        distance = rows - ops.arange(keys)[None, :]
        band = ops.abs(distance) <= size - 1
    return ops.logical_and(ops.cast(attention_mask, "bool"), band[None])


def _attributes(config):
    """What Gemma 4's decoder block and causal LM read on their attention layer."""
    return {
        "head_dim": config["head_dim"],
        "num_key_value_heads": config["num_key_value_heads"],
        # The drafting model (`Gemma4AssistantCausalLM`) sets it on every layer.
        "is_kv_shared_layer": config["is_kv_shared_layer"],
        "_mask_sliding_window": functools.partial(_mask_sliding_window, config),
    }


def _corner(cache, kv_heads, head_dim):
    """This layer's `[..., :Nkv, :H]` of a cache allocated for the widest layer."""
    if tuple(cache.shape[-2:]) == (kv_heads, head_dim):
        return cache
    return cache[..., :kv_heads, :head_dim]


def _call(
    layer,
    x,
    attention_mask=None,
    cache=None,
    cache_update_index=0,
    cache_update_mask=None,
    shared_kv=None,
    training=False,
    positions=None,
):
    """Returns `(output, cache)`: the updated cache slot, this layer's keys and values
    on the uncached path, or (KV-shared) its own slot unchanged / the shared ones."""
    attention = layer.attention
    kv_heads, head_dim = attention.num_key_value_heads, attention.key_dim
    shared = layer.is_kv_shared_layer and shared_kv is not None
    arguments = dict(attention_mask=attention_mask, positions=positions, training=training)
    if shared:
        held = shared_kv if cache is None else _corner(shared_kv, kv_heads, head_dim)
        index = {} if cache is None else {"cache_update_index": cache_update_index}
        output = attention(x, x, shared_key_value=held, **index, **arguments)
        return output, (shared_kv if cache is None else cache)
    if cache is None:
        return attention(x, x, return_key_value=True, **arguments)
    mine = _corner(cache, kv_heads, head_dim)
    output, mine = attention(
        x,
        x,
        cache=mine,
        cache_update_index=cache_update_index,
        cache_update_mask=cache_update_mask,
        **arguments,
    )
    if mine.shape[-2:] != cache.shape[-2:]:
        mine = ops.slice_update(cache, [0, 0, 0, 0, 0], ops.cast(mine, cache.dtype))
    return output, mine


ADAPTERS = {
    "keras_hub.src.models.gemma4.gemma4_attention.Gemma4TextAttention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        notes=NOTES,
        attributes=_attributes,
        with_layer=True,
    ),
}
