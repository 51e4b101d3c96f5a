"""ESM (ESM-2): `EsmSelfAttention`, RoFormer-v2's attention with keras-hub's
rotate-half RoPE (ESM-1's absolute positions: no RoPE)."""

from keras_mha.hub import roformer
from keras_mha.hub.adapter import Entry


def _options(config, dim):
    return roformer._options(config, dim, rotary=config["use_rotary"], interleaved=False)


ADAPTERS = {
    "keras_hub.src.models.esm.esm_attention.EsmSelfAttention": Entry(
        options=_options,
        call=roformer.encoder_call,
        weights=roformer.weights,
        with_layer=True,
        notes=(
            "RoPE on the halves `(x[i], x[i + H/2])` (keras-hub's `RotaryEmbedding`).",
            roformer.MASK_NOTE,
            roformer.LORA_NOTE,
        ),
    ),
}
