"""BLIP-2: `QFormerAttention`, out of scope (its reason below)."""

OUT_OF_SCOPE = {
    "keras_hub.src.models.blip2.blip2_qformer.QFormerAttention": (
        "not an attention of its own: it wraps a keras.layers.MultiHeadAttention (its "
        "`attention`, with a LayerNorm and a Dropout around it), which swap moves as the "
        "built-in"
    ),
}

ADAPTERS = {}
