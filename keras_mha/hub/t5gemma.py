"""T5Gemma 1 (`T5GemmaAttention`: the encoder's self-attention, the decoder's self- and
cross-attention) and T5Gemma 2 (`T5Gemma2Attention`, the encoder's;
`T5Gemma2MergedAttention`, the decoder's self- and cross-attention in one softmax).

The classes subclass Gemma's (`CachedGemmaAttention`, `CachedGemma3Attention`) but lay
their kernels out as ours (`(dim, N, H)`, `"btd,dnh->btnh"`) and rotate with keras-hub's
`RotaryEmbedding` (halves, as ours). Their blocks build additive masks (`(1 - mask) *
-1e9`, `(B, 1, T, S)`: padding, causality and the decoder's window, or T5Gemma 2's
bidirectional encoder window), which keras-hub adds to the soft-capped logits: ours gets
them as `attention_bias`, added at the same place. Calls return `(output, cache)`, the
cache `(B, 2, S, Nkv, H)` (keys after RoPE), or `None` where keras-hub's models do not
read it (self-attention called without one).
"""

from keras import ops

from keras_mha.hub import common
from keras_mha.hub.adapter import Entry


def _initializer(config):
    """keras-hub's (T5Gemma's and T5Gemma 2's alike): normal, stddev `initializer_range`."""
    from keras_hub.src.models.t5gemma.t5gemma_layers import t5gemma_kernel_initializer

    return t5gemma_kernel_initializer(config["initializer_range"])


def _cross(config):
    return config.get("attention_type", "self") == "cross"


def _options(config, dim):
    return dict(
        num_heads=config["num_attention_heads"],
        key_dim=config["head_dim"],
        num_key_value_heads=config["num_key_value_heads"],
        use_bias=config["attention_bias"],
        dropout=config["attention_dropout"],
        scale=float(config["query_pre_attn_scalar"] ** -0.5),
        logit_soft_cap=config["attn_logit_softcapping"] or None,
        # RoPE on self-attention only.
        rope_max_wavelength=None if _cross(config) else config["rope_max_wavelength"],
        kernel_initializer=_initializer(config),
    )


def _value_shape(config, shapes):
    """Cross-attention is built from `[hidden_states, encoder_hidden_states]`."""
    if _cross(config):
        return shapes[1]
    return shapes[0] if isinstance(shapes[0], (list, tuple)) else shapes


def _self_attention(attention, x, attention_mask, cache, cache_update_index, training):
    """Self-attention; without a cache (the encoder, training), the output and `None`
    for the keys and values, which keras-hub returns there and none of its models
    reads (writing them would take the cache's update, which has no gradient on
    TensorFlow)."""
    if cache is None:
        return attention(x, x, attention_bias=attention_mask, training=training), None
    return attention(
        x,
        x,
        attention_bias=attention_mask,
        cache=cache,
        cache_update_index=cache_update_index,
        training=training,
    )


def _cross_attention(attention, inputs, attention_mask, cache, training):
    """Cross-attention over the encoder's states; with a cache (written once, by the
    call without one), over the cache as it is."""
    hidden_states, encoder_states = inputs
    if cache is not None:
        return attention(
            hidden_states,
            encoder_states,
            attention_bias=attention_mask,
            cache=cache,
            training=training,
        )
    output = attention(
        hidden_states, encoder_states, attention_bias=attention_mask, training=training
    )
    keys, values = attention.key_dense(encoder_states), attention.value_dense(encoder_states)
    return output, ops.stack((keys, values), axis=1)


def _call(layer, inputs, attention_mask=None, cache=None, cache_update_index=None, training=None):
    """keras-hub's protocol: `inputs` the hidden states, or `[hidden_states,
    encoder_hidden_states]` for cross-attention; the mask additive; returns
    `(output, cache)`."""
    if _cross(layer.config):
        return _cross_attention(layer.attention, inputs, attention_mask, cache, training)
    return _self_attention(
        layer.attention, inputs, attention_mask, cache, cache_update_index, training
    )


def _weights(layer):
    return common.weights(
        layer,
        {
            "query_dense": "query_dense",
            "key_dense": "key_dense",
            "value_dense": "value_dense",
            "output_dense": "output_dense",
        },
    )


def _attributes(config):
    """What keras-hub's `compute_output_shape` (which the blocks call) reads."""
    return {
        "attention_type": config.get("attention_type", "self"),
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
    }


# ---------------------------------------------------------------- T5Gemma 2
def _t5gemma2_options(config, dim):
    options = _options(config, dim)  # self-attention (no `attention_type`)
    options.update(rope_scaling_factor=config["rope_scaling_factor"])
    if config["use_query_key_norm"]:
        options.update(
            normalize_qk=True, norm_unit_offset=True, norm_epsilon=config["rms_norm_eps"]
        )
    return options


def _t5gemma2_call(
    attention, inputs, attention_mask=None, cache=None, cache_update_index=None, training=None
):
    return _self_attention(attention, inputs, attention_mask, cache, cache_update_index, training)


def _t5gemma2_weights(layer):
    found = _weights(layer)
    if layer.use_query_key_norm:
        found["_query_norm"] = [layer.query_norm.scale.value]
        found["_key_norm"] = [layer.key_norm.scale.value]
    return found


# ------------------------------------------------- T5Gemma 2's decoder (merged)
def _positions(batch, start, length):
    """`(B, length)` positions `start, start + 1, ...`."""
    steps = ops.arange(length, dtype="int32")[None] + ops.cast(start, "int32")
    return ops.broadcast_to(steps, (batch, length))


def _merged_call(
    attention,
    inputs,
    encoder_hidden_states,
    attention_mask=None,
    cache=None,
    cache_update_index=None,
    training=None,
):
    """`T5Gemma2MergedAttention`'s protocol, one softmax over the decoder's keys and
    the encoder's: ours gets the encoder's keys first, then the decoder's, as one key
    sequence (a cache `(B, 2, S + L, Nkv, H)` when decoding), the encoder's at RoPE
    position 0 (the identity: they are not rotated), and keras-hub's merged mask
    (self part, then cross part) reordered to match. Returns `(output, (self cache,
    cross cache))`; `(None, None)` without caches (training: no keras-hub model reads
    them)."""
    x, encoder = inputs, encoder_hidden_states
    self_cache, cross_cache = (None, None) if cache is None else cache
    batch, length = ops.shape(x)[0], ops.shape(x)[1]
    enc_length = ops.shape(encoder)[1] if cross_cache is None else ops.shape(cross_cache)[2]
    self_length = length if self_cache is None else ops.shape(self_cache)[2]
    bias = attention_mask
    if bias is not None:  # keras-hub: [self, cross]; ours: [cross, self]
        if bias.shape[-1] is not None and bias.shape[-1] == self_length:  # no cross mask
            bias = ops.pad(bias, [[0, 0]] * 3 + [[0, enc_length]])
        bias = ops.concatenate([bias[..., self_length:], bias[..., :self_length]], axis=-1)
    start = 0 if cache_update_index is None else cache_update_index
    options = dict(
        attention_bias=bias, training=training, positions=_positions(batch, start, length)
    )
    if self_cache is None:  # training: no cache
        keys = ops.concatenate([encoder, x], axis=1)
        key_positions = ops.concatenate(
            [_positions(batch, 0, enc_length) * 0, _positions(batch, 0, length)], axis=1
        )
        options.pop("positions")  # the queries' are `t` (ours takes no others here)
        return attention(x, keys, key_positions=key_positions, **options), (None, None)
    if cross_cache is None:
        # The prefill: the encoder's keys and values are written too, before the
        # decoder's. keras-hub's models pass index 0: one run of new keys.
        shape = (batch, 2, enc_length, attention.num_key_value_heads, attention.key_dim)
        empty = ops.zeros(shape, self_cache.dtype)
        combined = ops.concatenate([empty, self_cache], axis=2)
        if isinstance(cache_update_index, int) and cache_update_index == 0:
            keys = ops.concatenate([encoder, x], axis=1)
            key_positions = ops.concatenate(
                [_positions(batch, 0, enc_length) * 0, _positions(batch, 0, length)], axis=1
            )
            output, combined = attention(
                x,
                keys,
                cache=combined,
                cache_update_index=0,
                key_positions=key_positions,
                **options,
            )
            return output, (combined[:, :, enc_length:], combined[:, :, :enc_length])
        # Elsewhere, a first call writes the encoder's (its attention unused).
        _, combined = attention(
            encoder,
            encoder,
            cache=combined,
            cache_update_index=0,
            positions=_positions(batch, 0, enc_length) * 0,
        )
    else:
        combined = ops.concatenate([cross_cache, self_cache], axis=2)
    output, combined = attention(
        x, x, cache=combined, cache_update_index=enc_length + start, **options
    )
    return output, (combined[:, :, enc_length:], combined[:, :, :enc_length])


NOTES = (
    "Logits scaled by `query_pre_attn_scalar ** -0.5` (`scale`).",
    "keras-hub's additive masks (`-1e9` where masked: padding, causality, windows) as "
    "`attention_bias`, after the soft cap as keras-hub adds them.",
    "Self-attention called without a cache (the encoder, training) returns `None` "
    "for the keys and values keras-hub returns there, which none of its models reads.",
)

_MODELS = "keras_hub.src.models."
ADAPTERS = {
    _MODELS + "t5gemma.t5gemma_attention.T5GemmaAttention": Entry(
        options=_options,
        call=_call,
        weights=_weights,
        with_layer=True,
        value_shape=_value_shape,
        attributes=_attributes,
        notes=NOTES
        + (
            "Cross-attention (`attention_type='cross'`): no RoPE; its cache is written by "
            "the call without one and read as it is after (`cache_update_index=None`); on "
            "each cached step our layer also projects the encoder's states it is given "
            "(unused), which keras-hub does not.",
        ),
    ),
    _MODELS + "t5gemma2.t5gemma2_attention.T5Gemma2Attention": Entry(
        options=_t5gemma2_options,
        call=_t5gemma2_call,
        weights=_t5gemma2_weights,
        attributes=_attributes,
        notes=NOTES + ("QK-norm `x * (1 + w)` (`norm_unit_offset`), Gemma 3's.",),
    ),
    _MODELS + "t5gemma2.t5gemma2_attention.T5Gemma2MergedAttention": Entry(
        options=_t5gemma2_options,
        call=_merged_call,
        weights=_t5gemma2_weights,
        attributes=_attributes,
        notes=(
            "Logits scaled by `query_pre_attn_scalar ** -0.5` (`scale`); QK-norm `x * (1 + w)`.",
            "One key sequence: the encoder's keys first (RoPE position 0, the identity), "
            "then the decoder's; keras-hub's merged additive mask reordered to match, as "
            "`attention_bias`; its two caches joined for each call and split back.",
            "A prefill at a `cache_update_index` other than 0 (keras-hub's models pass 0) "
            "writes the encoder's keys by a first call whose attention is unused.",
            "Called without caches (training) it returns `(None, None)` for the caches "
            "keras-hub returns there, which none of its models reads.",
        ),
    ),
}

OUT_OF_SCOPE = {}
