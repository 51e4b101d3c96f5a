"""T5Gemma 1 and 2: encoder-decoder Gemmas, not moved yet (`OUT_OF_SCOPE`).

Their attention classes subclass Gemma's (`CachedGemmaAttention`,
`CachedGemma3Attention`); `keras_mha.hub.patch` leaves a subclass of a moved class as
it is, so a T5Gemma model swaps nothing and runs as before.
"""

ADAPTERS = {}

_MODELS = "keras_hub.src.models."
OUT_OF_SCOPE = {
    _MODELS + "t5gemma.t5gemma_attention.T5GemmaAttention": (
        "not moved yet: one class for self- and cross-attention (`attention_type`), called "
        "with `[hidden_states, encoder_hidden_states]` for cross-attention and an "
        "encoder-keys cache written once; our layer expresses each (RoPE only on "
        "self-attention, `query_pre_attn_scalar ** -0.5` as `scale`), but the entry and a "
        "Seq2SeqLM case in tests/test_hub.py (encoder inputs, generate()) wait for the seq2seq "
        "handling the T5 entry adds to that harness"
    ),
    _MODELS + "t5gemma2.t5gemma2_attention.T5Gemma2Attention": (
        "not moved yet: T5Gemma 2's encoder attention (Gemma 3's with QK-norm x*(1+w)); "
        "expressible with our options, but moved with the Seq2SeqLM harness of T5Gemma "
        "above, which is not written"
    ),
    _MODELS + "t5gemma2.t5gemma2_attention.T5Gemma2MergedAttention": (
        "the decoder's self- and cross-attention merged into one softmax: the decoder's "
        "RoPE'd keys and values concatenated with the encoder's (projected by the same "
        "kernels, without RoPE) along the key axis; our layer attends over one key "
        "sequence from one input, with no second key source in the same softmax"
    ),
}
