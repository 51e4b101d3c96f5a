"""DeBERTa-v3: `DisentangledSelfAttention`, out of scope (its reason below)."""

OUT_OF_SCOPE = {
    "keras_hub.src.models.deberta_v3.disentangled_self_attention.DisentangledSelfAttention": (
        "its disentangled content-to-position and position-to-content logits multiply the "
        "projected queries and keys by the relative position embeddings projected with the "
        "same query and key kernels, gathered per bucketed distance: terms of the layer's "
        "own projections, which `attention_bias` (a tensor given to the call) cannot "
        "express; moving it needs a layer hook for logit terms of the projected heads"
    ),
}

ADAPTERS = {}
