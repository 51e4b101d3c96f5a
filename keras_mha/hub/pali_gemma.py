"""PaliGemma: its SigLIP vision tower's `PaliGemmaVitAttention`, out of scope (its
reason below); its language model's attention is Gemma's."""

OUT_OF_SCOPE = {
    "keras_hub.src.models.pali_gemma.pali_gemma_vit.PaliGemmaVitAttention": (
        "the attention of PaliGemma's vision tower (image patches in: no cache, no causal "
        "mask): expressible (Dense projections with biases, its additive `attention_mask` "
        "as `attention_bias`) but not moved, since issue 50 moves the language models' "
        "attention and this encoder has no text-only model to check it with"
    ),
}

ADAPTERS = {}
