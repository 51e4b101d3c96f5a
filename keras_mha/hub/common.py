"""What several entries of the table share: weights by sublayer, keras-hub's decoder
call protocol and its masks described, initializers cloned as keras-hub clones them."""

import dataclasses
import math

from keras import ops

from keras_mha import masks as masks_lib


@dataclasses.dataclass(frozen=True)
class DecoderMask:
    """A keras-hub decoder's self-attention mask, described instead of merged.

    keras-hub's decoder blocks merge the padding mask, a user's attention mask and the
    causal mask (at the cache's offset) into one dense `(B, T, S)` tensor before their
    attention (`_compute_self_attention_mask`; Gemma's `_compute_attention_mask`). In a
    swapped model (`describe_masks`) the block returns this instead, and our layer gets
    the parts: the keys' padding `(B, S)`, the user's mask, and causality, which it
    places at `cache_update_index` itself. The kernels then skip the blocks causality or
    padding hides.
    """

    padding_mask: object = None
    attention_mask: object = None
    segment_ids: object = None

    def packed(self):
        """The same mask for packed rows: the padding mask read as `(B, T)` document
        ids (0 = padding), so attention stays in each document and RoPE positions
        restart at each (`keras_mha.hub.set_packed`)."""
        return DecoderMask(attention_mask=self.attention_mask, segment_ids=self.padding_mask)


@dataclasses.dataclass(frozen=True)
class DescribedDecoder:
    """How a keras-hub decoder block passes its attention a described mask (an
    `Entry`'s `decoder_mask` where a plain function is not enough).

    Attributes:
        mask: `(decoder, *arguments) -> mask`: the block's mask method, described: a
            `DecoderMask`, or keras-hub's dense mask where the block cannot be
            described (Gemma 3's images).
        method: The name of the block's mask method it replaces.
        decoders: `"module.Class"` of the decoder blocks it replaces that method of;
            empty: any block holding the entry's attention. (PaliGemma's block holds
            Gemma's attention but computes a prefix mask of its own.)
        sublayers: `((attribute, reduce), ...)`: sublayers of the block that read its
            mask too (a router's load-balancing loss), called with `attention_mask`:
            while the block's mask is described, `reduce(mask, inputs)` gives them what
            they read instead of the `DecoderMask`.
        not_packed: `None`, or why the model cannot take packed rows although its
            attention's mask is described (`set_packed`'s model then raises when
            called).
    """

    mask: callable
    method: str = "_compute_self_attention_mask"
    decoders: tuple = ()
    sublayers: tuple = ()
    not_packed: str = None

    def __call__(self, decoder, *args, **kwargs):
        return self.mask(decoder, *args, **kwargs)

    def applies_to(self, decoder):
        """Whether `decoder` is a block whose mask method this replaces."""
        if not hasattr(decoder, self.method):
            return False
        cls = type(decoder)
        return not self.decoders or f"{cls.__module__}.{cls.__qualname__}" in self.decoders


def queries_seeing_a_key(mask, hidden_states):
    """`(B, T, 1)` boolean: whether each of the `T` queries of `hidden_states` sees a
    key under `mask` (a `DecoderMask`, causal, no cache): `ops.any(dense, axis=-1,
    keepdims=True)` of the dense `(B, T, T)` mask keras-hub would have built, without
    building it. Unpacked, a query sees a key when a token precedes it or is it (the
    padding mask's running maximum); packed, when it is in a document (id not 0)."""
    batch, length = ops.shape(hidden_states)[0], ops.shape(hidden_states)[1]
    if mask.attention_mask is not None:  # a user's own mask: keras-hub's reading
        dense = ops.cast(mask.attention_mask, "bool")
        causal = ops.tril(ops.ones((length, length), "int32"))
        dense = ops.logical_and(dense, ops.cast(causal, "bool"))
        if mask.padding_mask is not None:
            dense = ops.logical_and(dense, ops.cast(mask.padding_mask, "bool")[:, None, :])
        if mask.segment_ids is not None:
            ids = masks_lib.as_int(mask.segment_ids)
            dense = ops.logical_and(dense, masks_lib.same_segment(ids, ids))
        return ops.any(dense, axis=-1, keepdims=True)
    if mask.segment_ids is not None:
        return ops.not_equal(masks_lib.as_int(mask.segment_ids), 0)[:, :, None]
    if mask.padding_mask is None:
        return ops.ones((batch, length, 1), "bool")
    seen = ops.cumsum(ops.cast(mask.padding_mask, "int32"), axis=-1)
    return ops.greater(seen, 0)[:, :, None]


def mask_arguments(attention_mask):
    """Our layer's mask arguments for a keras-hub attention's `attention_mask`: the
    dense mask as it is, or a `DecoderMask`'s parts (causal)."""
    if isinstance(attention_mask, DecoderMask):
        return {
            "key_mask": attention_mask.padding_mask,
            "attention_mask": attention_mask.attention_mask,
            "segment_ids": attention_mask.segment_ids,
            "use_causal_mask": True,
        }
    return {"attention_mask": attention_mask}


def causal_decoder_mask(
    decoder,
    decoder_sequence,
    decoder_padding_mask=None,
    decoder_attention_mask=None,
    *unused,
    **unused_by_name,
):
    """`_compute_self_attention_mask` of keras-hub's causal decoder blocks (Llama's
    and those written like it), described: the padding mask given, else the sequence's
    Keras mask (as keras-hub's `merge_padding_and_attention_mask` takes it)."""
    if decoder_padding_mask is None:
        decoder_padding_mask = masks_lib.get_keras_mask(decoder_sequence)
    return DecoderMask(decoder_padding_mask, decoder_attention_mask)


PROJECTIONS = {
    "query_dense": "_query_dense",
    "key_dense": "_key_dense",
    "value_dense": "_value_dense",
    "output_dense": "_output_dense",
}


# Where a keras-hub class names its sublayers as ours, as public attributes.
PUBLIC_PROJECTIONS = {name: name for name in PROJECTIONS}


def decoder_options(config, dim, **options):
    """Our layer's arguments for a Llama-style decoder attention: GQA heads of
    `config["head_dim"]` (else `dim // heads`), projections without bias, dropout on
    the attention output, RoPE, keras-hub's initializer, and keras-hub's outputs on fully
    masked rows; `options` add or replace."""
    heads = config["num_query_heads"]
    return {
        "num_heads": heads,
        "key_dim": config.get("head_dim") or dim // heads,
        "num_key_value_heads": config["num_key_value_heads"],
        "use_bias": False,
        "dropout": config["dropout"],
        "dropout_on": "output",
        "rope_max_wavelength": config["rope_max_wavelength"],
        "kernel_initializer": clone(config["kernel_initializer"]),
        "fully_masked_rows": fused_or_softmax_rows(),
        **options,
    }


def fused_or_softmax_rows(fused=None):
    """`fully_masked_rows` for a keras-hub attention that takes Keras's
    `ops.dot_product_attention` where `fused` (keras-hub's own test, run on the backend
    that builds the layer; by default its `fused_attention_op_available()`: jax and
    torch) and its masked `keras.layers.Softmax` elsewhere: a row with no visible key
    gets the values' mean from the first ("builtin": what that op gives) and zero
    weights from the second, which zeroes the masked weights ("zero"). Read where the
    layer is built, so a file saved on one backend predicts as keras-hub's class does
    on the one that loads it."""
    if fused is None:
        from keras_hub.src.utils.keras_utils import fused_attention_op_available

        fused = fused_attention_op_available()
    return "builtin" if fused else "zero"


def own_fused_test(hub_class, config):
    """A keras-hub class's `_use_fused_attention_op()` (Mixtral's, Qwen-MoE's: its fused op
    on a GPU or TPU without dropout, its masked softmax on every CPU), run on the layer's
    configuration: the test reads only `dropout`."""
    import types

    return hub_class._use_fused_attention_op(types.SimpleNamespace(dropout=config["dropout"]))


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
    in it, or that mask described (`DecoderMask`, causal); returns the output, or
    `(output, cache)` when a cache is given."""
    return attention(
        hidden_states,
        hidden_states,
        cache=cache,
        cache_update_index=cache_update_index,
        training=training,
        **mask_arguments(attention_mask),
    )


# keras-hub's ALiBi (Bloom's `AlibiBias`, Falcon's `_build_alibi_tensor`: the same slopes).
def alibi_slopes(num_heads, max_bias=8):
    """ALiBi's per-head slopes: a geometric sequence from `2 ** (-max_bias / n)` with
    that ratio for the `n` (a power of 2) first heads, the odd ones of `2n` after."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - math.log2(max_bias))))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest, max_bias)[0::2][: num_heads - closest]


def alibi(num_heads, key_length, dtype):
    """`(1, N, 1, S)`: slope times `s - (S - 1)` (keras-hub's `AlibiBias`; Bloom adds it
    after the scale, Falcon on packed rows; with a cache, `S` is its length)."""
    slopes = ops.convert_to_tensor(alibi_slopes(num_heads), dtype=dtype)
    distance = ops.cast(ops.arange(1 - key_length, 1, dtype="int32"), dtype)
    return ops.multiply(slopes[:, None], distance[None, :])[None, :, None, :]
