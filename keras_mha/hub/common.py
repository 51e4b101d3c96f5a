"""What several entries of the table share: weights by sublayer, keras-hub's decoder
call protocol, initializers cloned as keras-hub clones them."""

PROJECTIONS = {
    "query_dense": "_query_dense",
    "key_dense": "_key_dense",
    "value_dense": "_value_dense",
    "output_dense": "_output_dense",
}


def clone(initializer):
    """A fresh copy of a keras-hub initializer (each layer gets its own)."""
    from keras_hub.src.utils.keras_utils import clone_initializer

    return clone_initializer(initializer)


def weights(layer, names=PROJECTIONS):
    """`{our sublayer: its variables' values}` from `layer`'s sublayers named by
    `names` (`{our sublayer: keras-hub attribute}`), variables in their order."""
    return {
        ours: [v.value for v in getattr(layer, theirs).weights] for ours, theirs in names.items()
    }


def self_attention(
    attention,
    hidden_states,
    attention_mask=None,
    cache=None,
    cache_update_index=None,
    training=None,
):
    """keras-hub's decoder attention protocol: self-attention over `hidden_states`
    with the decoder's dense `(B, T, S)` mask (padding and causality merged), an
    optional `(B, 2, max_length, Nkv, H)` cache and the index of the new positions
    in it; returns the output, or `(output, cache)` when a cache is given."""
    return attention(
        hidden_states,
        hidden_states,
        attention_mask=attention_mask,
        cache=cache,
        cache_update_index=cache_update_index,
        training=training,
    )
