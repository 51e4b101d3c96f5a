"""keras-hub's language models, whose attention classes are their own, move to keras_mha
with `keras_mha.swap` (`keras_mha.hub`): each built from its constructor with a tiny random
config, every attention layer moves, and the swapped model gives the same logits on padded
inputs, the same greedy `generate()` token ids through keras-hub's cached decoding, the
same losses over several training steps, a `.keras` round trip holding only our
attention, the same trainable weights under `enable_lora`, and the same outputs once
quantized.

`test_every_keras_hub_attention_class_is_moved_or_out_of_scope` fails when a keras-hub
upgrade adds an attention class to a language model's package that is neither in
`keras_mha.hub.ADAPTERS` nor in `keras_mha.hub.OUT_OF_SCOPE`.
"""

import collections
import contextlib
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import warnings

import keras
import keras_hub
import numpy as np
import pytest
from helpers import to_numpy
from test_packing_text import proto  # noqa: F401, F811 (a fixture)

import keras_mha
from keras_mha import hub, swapping
from keras_mha.hub import adapter

models = keras_hub.models

BATCH, LENGTH, VOCAB = 2, 8, 16
ATOL = 1e-5
# Compiled train steps on JAX (eager JAX compiles each op of a step one by one).
RUN_EAGERLY = keras.backend.backend() != "jax"


def _causal_lm_inputs(token_ids, padding_mask):
    return {"token_ids": token_ids, "padding_mask": padding_mask}


@dataclasses.dataclass
class Case:
    """A language model: `build()` returns its task (`generate()` is checked).

    Where keras-hub's own model cannot take a check, the case says so, and why:
    - `lora_layer_names`: `enable_lora`'s targets where keras-hub's defaults name none
      of the model's layers.
    - `lora_shapes_differ`: why LoRA's weights have other shapes once swapped (only
      their names are compared).
    - `generate_fails_on`: `{backend: its error's message (a regex)}` where
      keras-hub's cached `generate()` fails, and `generate_fails_because`, why: the
      test checks that it still does, and compares the swapped model's ids with
      greedy decoding by whole forward passes of the original.
    - `generate_kwargs`: added to `generate()`'s arguments.
    - `inputs`: `(token_ids, padding_mask) -> the task's inputs` (a causal LM's by
      default): its logits are `(B, LENGTH, VOCAB)`, trained against labels of that
      shape, weighted by `padding_mask`.
    - `generated`: the key of `generate()`'s token ids; `None` for a task with no
      `generate()` (an encoder's masked LM).
    - `lora`: what `enable_lora` gives: "same" (the same trainable weights), or
      "added": keras-hub's targets (layers named `query_dense` and `value_dense`)
      are not in its attention (T5, ESM, RoFormer-v2 name theirs otherwise), ours
      has them, so the swapped model's query and value projections get LoRA
      factors (the entry's notes); or "fused": keras-hub's target is a fused
      projection (Qwen3.5's query and gate), whose factors ours (the query alone)
      cannot have: the same names are checked.
    """

    build: callable
    inputs: callable = _causal_lm_inputs
    generated: str = "token_ids"
    lora: str = "same"
    lora_layer_names: tuple = None
    lora_shapes_differ: str = None
    generate_fails_on: dict = dataclasses.field(default_factory=dict)
    generate_fails_because: str = None
    generate_kwargs: dict = dataclasses.field(default_factory=dict)


# Shared by the decoders below: 1 layer, hidden 16, 4 query heads over 2 key/value heads.
TINY = dict(
    vocabulary_size=VOCAB,
    num_layers=1,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=8,
)
# A window shorter than the inputs, so that applying it or not shows.
WINDOW = 3


def _llama():
    backbone = models.LlamaBackbone(**TINY)
    return models.LlamaCausalLM(backbone, preprocessor=None)


def _llama3():
    # Llama 3.1's smoothing on every frequency of a 4-wide head: the pretraining
    # length sets wavelengths 4 (high) and 16 (low), between the head's 2*pi and 628.
    backbone = models.Llama3Backbone(
        **TINY,
        rope_frequency_adjustment_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_pretraining_sequence_length=16,
    )
    return models.Llama3CausalLM(backbone, preprocessor=None)


def _mistral():
    backbone = models.MistralBackbone(**TINY, sliding_window=WINDOW, head_dim=6)
    return models.MistralCausalLM(backbone, preprocessor=None)


def _mixtral():
    backbone = models.MixtralBackbone(**TINY, num_experts=2, top_k=1, sliding_window=WINDOW)
    return models.MixtralCausalLM(backbone, preprocessor=None)


def _qwen():
    backbone = models.QwenBackbone(
        **TINY, use_sliding_window_attention=True, sliding_window_size=WINDOW
    )
    return models.QwenCausalLM(backbone, preprocessor=None)


def _qwen_moe():
    backbone = models.QwenMoeBackbone(
        **TINY,
        moe_intermediate_dim=8,
        shared_expert_intermediate_dim=8,
        num_experts=2,
        top_k=1,
        use_sliding_window_attention=True,
        sliding_window_size=WINDOW,
    )
    return models.QwenMoeCausalLM(backbone, preprocessor=None)


def _qwen3():
    backbone = models.Qwen3Backbone(**TINY, head_dim=6, sliding_window_size=WINDOW)
    return models.Qwen3CausalLM(backbone, preprocessor=None)


def _qwen3_moe():
    backbone = models.Qwen3MoeBackbone(
        **TINY,
        head_dim=6,
        moe_intermediate_dim=8,
        num_experts=2,
        top_k=1,
        sliding_window_size=WINDOW,
    )
    return models.Qwen3MoeCausalLM(backbone, preprocessor=None)


def _smollm3_backbone(rope_layers, attention_bias):
    """SmolLM3, one layer per entry of `rope_layers` (RoPE or NoPE)."""
    return models.SmolLM3Backbone(
        vocabulary_size=VOCAB,
        hidden_dim=16,
        intermediate_dim=8,
        num_layers=len(rope_layers),
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=attention_bias,
        attention_dropout=0.0,
        rope_layer_enabled_list=list(rope_layers),
        layer_types=["attention"] * len(rope_layers),
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        max_position_embeddings=32,
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
    )


# One layer each: keras-hub's SmolLM3 with two or more layers does not train the same
# on torch (`test_smollm3_keras_hub_output_projections_share_one_path`).
def _smollm3():
    backbone = _smollm3_backbone([True], attention_bias=True)
    return models.SmolLM3CausalLM(backbone, preprocessor=None)


def _smollm3_nope():
    backbone = _smollm3_backbone([False], attention_bias=False)
    # keras-hub's SmolLM3 cannot `quantize()` with a NoPE layer: that layer's rotary
    # embedding, never called, is never built. Built here (its swap has none).
    backbone.transformer_layers[0].self_attn.rotary_embedding.build(None)
    return models.SmolLM3CausalLM(backbone, preprocessor=None)


def _phi3():
    backbone = models.Phi3Backbone(**TINY)
    return models.Phi3CausalLM(backbone, preprocessor=None)


def _phi3_longrope():
    # LongRoPE: the long factors apply from position 6 (the pretraining length) on,
    # so a whole input and the last steps of `generate()` use them, the first
    # steps the short ones; head 4 wide, so two factors each.
    backbone = models.Phi3Backbone(
        **TINY,
        max_sequence_length=16,
        pretraining_sequence_length=6,
        rope_scaling_type="su",
        rope_scaling_short_factor=[1.5, 3.0],
        rope_scaling_long_factor=[2.0, 40.0],
    )
    return models.Phi3CausalLM(backbone, preprocessor=None)


# keras-hub's Qwen and Qwen-MoE classes test `if cache_update_index` where they apply
# their window (their explicit path): a traced index has no Python truth value.
_WINDOW_INDEX = "keras-hub's window on a traced `cache_update_index` (`if cache_update_index`)"
_GRAPH_BOOL = "symbolic `tf.Tensor` as a Python `bool`"
_TRACER_BOOL = "_error_repr|boolean conversion"

_SMOLLM3_LORA = dict(
    # keras-hub's LoRA defaults name `query`/`value`; SmolLM3's are `q_proj`/`v_proj`.
    lora_layer_names=("q_proj", "v_proj", "query", "value"),
    lora_shapes_differ="SmolLM3's query and value projections are `Dense` layers, "
    "whose LoRA factors are `(dim, r) x (r, N * H)`; ours are `EinsumDense` layers, "
    "`(dim, N, r) x (r, H)`.",
)


def _gemma():
    backbone = models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=8,
        head_dim=4,
    )
    return models.GemmaCausalLM(backbone, preprocessor=None)


def _gemma2():
    """Gemma 2: post-norms, soft-capped logits, a window of 3 on the first of two
    layers. (keras-hub 0.32's decoder block gives its attention
    `query_head_dim_normalize=True` whatever the backbone's value:
    `test_gemma_attention_scale_from_the_model_width` checks the other scale.)"""
    backbone = models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=8,
        head_dim=8,
        query_head_dim_normalize=False,
        use_post_ffw_norm=True,
        use_post_attention_norm=True,
        attention_logit_soft_cap=1.5,
        final_logit_soft_cap=30.0,
        use_sliding_window_attention=True,
        sliding_window_size=3,
    )
    return models.GemmaCausalLM(backbone, preprocessor=None)


def _gemma3():
    """Gemma 3: QK-norm `x * (1 + w)`, five local layers (window 3, RoPE base 1e4)
    then a global one (base 1e6, linear RoPE scaling 8)."""
    backbone = models.Gemma3Backbone(
        vocabulary_size=VOCAB,
        image_size=16,
        num_layers=6,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=8,
        head_dim=4,
        use_post_ffw_norm=True,
        use_post_attention_norm=True,
        use_sliding_window_attention=True,
        sliding_window_size=3,
        global_rope_scaling_factor=8.0,
        vision_encoder=None,
    )
    return models.Gemma3CausalLM(backbone=backbone, preprocessor=None)


def _gpt_oss():
    """GPT-OSS: biases, sinks, YaRN RoPE (factor 4), a window of 2 keys before the
    query on the second of two layers."""
    backbone = models.GptOssBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=8,
        num_experts=2,
        top_k=1,
        rope_scaling_factor=4.0,
        sliding_window=2,
    )
    return models.GptOssCausalLM(backbone=backbone, preprocessor=None)


def _falcon():
    backbone = models.FalconBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_attention_heads=4,
        hidden_dim=16,
        intermediate_dim=8,
    )
    return models.FalconCausalLM(backbone, preprocessor=None)


def _bloom():
    backbone = models.BloomBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=8
    )
    return models.BloomCausalLM(backbone, preprocessor=None)


def _gpt_neo_x():
    backbone = models.GPTNeoXBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=8,
        rotary_percentage=0.5,
        max_sequence_length=LENGTH,
    )
    return models.GPTNeoXCausalLM(backbone, preprocessor=None)


def _qwen3_5():
    backbone = models.Qwen3_5Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_dim=16,
        intermediate_dim=8,
        layer_types=["full_attention"],
        partial_rotary_factor=0.5,
    )
    return models.Qwen3_5CausalLM(backbone, preprocessor=None)


def _gemma3n():
    """Gemma 3n, text only: a local layer (window 3), then two global ones, the last
    KV-shared (it attends over the second layer's keys and values); AltUp, LAuReL and
    per-layer inputs as small as they go."""
    backbone = models.Gemma3nBackbone(
        text_vocab_size=VOCAB,
        text_hidden_size=8,
        num_hidden_layers=3,
        pad_token_id=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=[8, 8, 8],
        hidden_activation="gelu_approximate",
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        sliding_window=3,
        rope_theta=1e6,
        max_position_embeddings=32,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=2,
        altup_num_inputs=2,
        laurel_rank=2,
        num_kv_shared_layers=1,
    )
    return models.Gemma3nCausalLM(backbone=backbone, preprocessor=None)


def _gemma4():
    """Gemma 4, text only: a local layer (window 3), then two global ones with their
    own head size (8), one key/value head whose values are the key projection's
    (`attention_k_eq_v`) and partial RoPE (half the head); the last KV-shared."""
    backbone = models.Gemma4Backbone(
        vocabulary_size=VOCAB,
        image_size=16,
        num_layers=3,
        num_query_heads=2,
        num_key_value_heads=2,
        hidden_dim=8,
        intermediate_dim=8,
        head_dim=4,
        sliding_window_size=3,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        global_head_dim=8,
        num_global_key_value_heads=1,
        global_rope_partial_rotary_factor=0.5,
        num_kv_shared_layers=1,
        vision_encoder=None,
    )
    return models.Gemma4CausalLM(backbone=backbone, preprocessor=None)


def _gemma4_inputs(token_ids, padding_mask):
    """Gemma 4's backbone also takes `position_ids` (its forward pass, not `generate()`)."""
    positions = np.tile(np.arange(token_ids.shape[1], dtype="int32"), (token_ids.shape[0], 1))
    return {"token_ids": token_ids, "padding_mask": padding_mask, "position_ids": positions}


def _masked_lm_inputs(token_ids, padding_mask, segments=False):
    """A masked LM's inputs, every position predicted (its logits `(B, LENGTH,
    VOCAB)`); id 0 is padding."""
    batch, length = token_ids.shape
    positions = np.tile(np.arange(length, dtype="int32"), (batch, 1))
    inputs = {"token_ids": token_ids, "mask_positions": positions}
    if segments:
        inputs["segment_ids"] = np.zeros_like(token_ids)
    return inputs


def _esm():
    backbone = models.ESMBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=4,
        hidden_dim=16,
        intermediate_dim=8,
        dropout=0.0,
    )
    return models.ESMMaskedPLM(backbone, preprocessor=None)


def _roformer():
    backbone = models.RoformerV2Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=4,
        hidden_dim=16,
        intermediate_dim=8,
        head_size=4,
        dropout=0.0,
    )
    return models.RoformerV2MaskedLM(backbone, preprocessor=None)


def _t5():
    backbone = models.T5Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=8,
        key_value_dim=4,
        dropout=0.0,
    )
    return models.T5Seq2SeqLM(backbone, preprocessor=None)


def _t5gemma_config(decoder_layer):
    """Encoder and decoder of other widths (cross-attention's keys and values from the
    encoder's 16 into the decoder's 8), GQA, biases, soft-capped logits, a scale of
    `4 ** -0.5`, and a decoder layer of type `decoder_layer` (window 3)."""
    return dict(
        vocabulary_size=VOCAB,
        encoder_hidden_dim=16,
        encoder_intermediate_dim=8,
        encoder_num_layers=1,
        encoder_num_attention_heads=4,
        encoder_num_key_value_heads=2,
        encoder_head_dim=4,
        encoder_layer_types=["sliding_attention"],
        decoder_hidden_dim=8,
        decoder_intermediate_dim=8,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_num_key_value_heads=1,
        decoder_head_dim=4,
        decoder_layer_types=[decoder_layer],
        sliding_window=WINDOW,
        query_pre_attn_scalar=4.0,
        attention_bias=True,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=30.0,
    )


def _t5gemma():
    backbone = models.T5GemmaBackbone(**_t5gemma_config("sliding_attention"))
    return models.T5GemmaSeq2SeqLM(backbone, preprocessor=None)


def _t5gemma2():
    """Text only; QK-norm `x * (1 + w)`; the encoder's window bidirectional; the
    decoder's self- and cross-attention in one softmax. Encoder and decoder of one
    width: T5Gemma 2's decoder projects the encoder's states with its own kernels."""
    config = dict(
        _t5gemma_config("full_attention"), decoder_hidden_dim=16, global_rope_scaling_factor=2.0
    )
    backbone = models.T5Gemma2Backbone(**config)
    return models.T5Gemma2Seq2SeqLM(backbone, preprocessor=None)


def _seq2seq_inputs(token_ids, padding_mask):
    """The same tokens to the encoder and (its prompt) to the decoder."""
    return {
        "encoder_token_ids": token_ids,
        "encoder_padding_mask": padding_mask,
        "decoder_token_ids": token_ids,
        "decoder_padding_mask": padding_mask,
    }


_GEMMA_LORA = (
    "Gemma's `(N, dim, H)` query and value kernels are ours transposed, `(dim, N, H)`, "
    "and so are the LoRA factors keras gives each."
)

ZOO = {
    "llama": Case(_llama),
    "llama3": Case(_llama3),
    "mistral": Case(_mistral),
    "mixtral": Case(_mixtral),
    "qwen": Case(
        _qwen,
        generate_fails_on={"tensorflow": _GRAPH_BOOL},
        generate_fails_because=_WINDOW_INDEX,
    ),
    "qwen_moe": Case(
        _qwen_moe,
        generate_fails_on={"tensorflow": _GRAPH_BOOL, "jax": _TRACER_BOOL},
        generate_fails_because=_WINDOW_INDEX,
    ),
    "qwen3": Case(_qwen3),
    "qwen3_moe": Case(_qwen3_moe),
    "smollm3": Case(_smollm3, **_SMOLLM3_LORA),
    "smollm3_nope": Case(_smollm3_nope, **_SMOLLM3_LORA),
    "phi3": Case(_phi3),
    "phi3_longrope": Case(_phi3_longrope),
    "gemma": Case(_gemma, lora_shapes_differ=_GEMMA_LORA),
    "gemma2": Case(_gemma2, lora_shapes_differ=_GEMMA_LORA),
    # keras-hub 0.32's Gemma3CausalLM.generate without a preprocessor fails on its own
    # output ("images": None) unless the prompt is stripped.
    "gemma3": Case(_gemma3, lora_shapes_differ=_GEMMA_LORA, generate_kwargs={"strip_prompt": True}),
    "gemma3n": Case(
        _gemma3n,
        lora_layer_names=("q_proj", "v_proj", "query", "value"),
        lora_shapes_differ="Gemma 3n's query and value projections are `Dense` layers, "
        "whose LoRA factors are `(dim, r) x (r, N * H)`; ours are `EinsumDense` layers, "
        "`(dim, N, r) x (r, H)`.",
    ),
    "gemma4": Case(_gemma4, _gemma4_inputs, lora_shapes_differ=_GEMMA_LORA),
    "gpt_oss": Case(_gpt_oss),
    "falcon": Case(_falcon),
    "bloom": Case(_bloom),
    "gpt_neo_x": Case(_gpt_neo_x, lora="added"),
    "qwen3_5": Case(_qwen3_5, lora="fused"),
    "t5": Case(_t5, _seq2seq_inputs, generated="decoder_token_ids", lora="added"),
    "t5gemma": Case(_t5gemma, _seq2seq_inputs, generated="decoder_token_ids"),
    "t5gemma2": Case(_t5gemma2, _seq2seq_inputs, generated="decoder_token_ids"),
    "esm": Case(_esm, _masked_lm_inputs, generated=None, lora="added"),
    "roformer": Case(
        _roformer,
        functools.partial(_masked_lm_inputs, segments=True),
        generated=None,
        lora="added",
    ),
}


# ------------------------------------------------------------------------- helpers
def _randomize(model, seed):
    """Trainable weights drawn from N(0, 0.5): far from initial values (zeros, ones),
    so a swapped layer that ignored a weight would show."""
    rng = np.random.default_rng(seed)
    for weight in model.trainable_weights:
        weight.assign(rng.normal(0.0, 0.5, weight.shape).astype(weight.dtype))


def _tokens(seed=0, prompt=None):
    """`(token_ids, padding_mask)`: ids in `[1, VOCAB)`, the second row padded at its
    end; with `prompt`, every row is a prompt of that many tokens (what `generate()`
    continues)."""
    rng = np.random.default_rng(seed)
    padding_mask = np.ones((BATCH, LENGTH), "int32")
    padding_mask[1, -2:] = 0
    if prompt is not None:
        padding_mask[:, prompt:] = 0
    token_ids = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype("int32") * padding_mask
    return token_ids, padding_mask


def _inputs(name="llama", seed=0, prompt=None):
    """Model `name`'s inputs from `_tokens`."""
    return ZOO[name].inputs(*_tokens(seed, prompt))


class _Forward(keras.Model):
    """A task trained through its `hub.task_forward` function."""

    def __init__(self, task, logits_of):
        super().__init__()
        self.task, self.logits_of = task, logits_of  # not `forward`: torch's Module method

    def call(self, inputs):
        return self.logits_of(self.task, inputs)


def _trainer(task):
    """The task, or where its call is not the function of its weights (keras-hub's
    Gemma 3n: `keras_mha.hub.task_forward`), a model trained through what is."""
    forward = hub.task_forward(task)
    return task if forward is None else _Forward(task, forward[0])


def _logits(model, inputs):
    """`model`'s logits, from an eager call (on JAX, its ops compile one by one, and
    the zoo's tiny models share most of them: a compiled `predict_on_batch` per model
    made this file slower in `make test`)."""
    forward = hub.task_forward(model)
    if forward is not None:
        return to_numpy(forward[0](model, inputs))
    return to_numpy(model(inputs))


def _pair(name, seed=0):
    keras.utils.set_random_seed(seed)
    model = ZOO[name].build()
    _randomize(model, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(model)
    return model, swapped


class _Pair:
    """Model `name` of the zoo and its swap (`_pair`), built on first use, and the
    unswapped model's logits on `_inputs(name)`, computed once (the tests that train it
    set its weights back). A test that changes the models for good (LoRA, quantizing)
    `take()`s them: the next test that asks gets a new pair."""

    def __init__(self, name):
        self.name = name
        self._models = self._logits = None

    @property
    def models(self):
        if self._models is None:
            self._models, self._logits = _pair(self.name), None
        return self._models

    def logits(self):
        if self._logits is None:
            self._logits = _logits(self.models[0], _inputs(self.name))
        return self._logits

    def take(self):
        models = self.models
        self._models = self._logits = None
        return models


@pytest.fixture(scope="module", params=list(ZOO))
def pair(request):
    return _Pair(request.param)


# --------------------------------------------------------------------------- tests
def test_swap_moves_every_attention_layer(pair):
    model, swapped = pair.models
    rows = swapping.swap_report(model, swapped)
    assert rows and all(row["status"] == swapping.MOVED for row in rows), rows
    for row, (_, layer) in zip(rows, swapping.attention_layers(swapped)):
        assert isinstance(layer, hub.HubAttention)
        assert isinstance(layer.attention, keras_mha.MultiHeadAttention)
        assert row["notes"] == list(layer.entry.notes)  # what `keras-mha swap` prints


def test_logits_match(pair):
    _, swapped = pair.models
    inputs = _inputs(pair.name)
    expected = pair.logits()
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(_logits(swapped, inputs), expected, atol=ATOL, rtol=1e-5)


def _greedy_without_cache(model, inputs, prompt):
    """Greedy decoding by whole forward passes, no cache: the ids keras-hub's
    `generate()` gives where its cached decoding runs."""
    token_ids, padding_mask = inputs["token_ids"].copy(), inputs["padding_mask"].copy()
    for position in range(prompt, LENGTH):
        logits = _logits(model, {"token_ids": token_ids, "padding_mask": padding_mask})
        token_ids[:, position] = logits[:, position - 1].argmax(axis=-1)
        padding_mask[:, position] = 1
    return token_ids


def test_greedy_generate_gives_the_same_token_ids(pair):
    name, (model, swapped) = pair.name, pair.models
    key = ZOO[name].generated
    if key is None:
        pytest.skip(f"{name}'s task has no generate()")
    inputs = _inputs(name, seed=1, prompt=3)
    results = []
    for lm in (model, swapped):
        lm.compile(sampler="greedy")
        fails = ZOO[name].generate_fails_on.get(keras.backend.backend())
        if lm is model and fails:
            assert ZOO[name].generate_fails_because
            with pytest.raises(Exception, match=fails):  # keras-hub's own failure
                lm.generate(inputs, stop_token_ids=None)
            results.append(_greedy_without_cache(lm, inputs, prompt=3))
            continue
        outputs = lm.generate(inputs, stop_token_ids=None, **ZOO[name].generate_kwargs)
        results.append(to_numpy(outputs[key]))
    assert (results[0][:, 3:] != 0).any()  # it generated
    np.testing.assert_array_equal(results[1], results[0])


def test_training_gives_the_same_losses_over_several_steps(pair):
    name, (model, swapped) = pair.name, pair.models
    token_ids, padding_mask = _tokens(seed=2)
    inputs = ZOO[name].inputs(token_ids, padding_mask)
    rng = np.random.default_rng(3)
    labels = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype("int32")
    losses = []
    for lm in (model, swapped):
        weights = lm.get_weights()
        trainer = _trainer(lm)
        trainer.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=RUN_EAGERLY,
        )
        losses.append(
            [trainer.train_on_batch(inputs, labels, sample_weight=padding_mask) for _ in range(3)]
        )
        lm.set_weights(weights)
    assert losses[0][-1] < losses[0][0]  # it trained
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4, atol=1e-5)


def test_saved_swap_loads_with_only_keras_mha_attention(pair, tmp_path):
    name, (_, swapped) = pair.name, pair.models
    path = tmp_path / f"{name}.keras"
    keras_mha.save_swapped(swapped, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = keras.saving.load_model(path)
    layers = swapping.attention_layers(loaded)
    assert layers and all(isinstance(x, hub.HubAttention) for _, x in layers)
    np.testing.assert_allclose(_logits(loaded, _inputs(name)), pair.logits(), atol=ATOL, rtol=1e-5)


def test_decoder_blocks_pass_their_masks_described(pair):
    """In a swapped model, a decoder block whose entry describes its mask hands our
    layer the padding mask and causality, not keras-hub's dense `(B, T, S)` mask."""
    _, swapped = pair.models
    blocks = [(layer, _mask_spec(layer)) for layer in swapped._flatten_layers()]
    blocks = [(block, spec) for block, spec in blocks if spec is not None]
    if not blocks:
        pytest.skip("this model's entry passes keras-hub's dense mask")
    inputs = _inputs()
    sequence = keras.ops.ones((BATCH, LENGTH, 16))
    for block, spec in blocks:
        mask = _block_mask(block, spec.method, sequence, inputs["padding_mask"])
        assert isinstance(mask, hub.common.DecoderMask)
        np.testing.assert_array_equal(to_numpy(mask.padding_mask), inputs["padding_mask"])


def test_int8_quantized_gives_the_same_logits(pair):
    name, full = pair.name, pair.logits()
    model, swapped = pair.take()  # quantized for good: a pair of its own
    inputs = _inputs(name)
    for lm in (model, swapped):
        lm.quantize("int8")
    for _, layer in swapping.attention_layers(swapped):
        assert layer.attention.query_dense.quantization_mode == "int8"
    expected = _logits(model, inputs)
    assert np.abs(expected - full).max() > 1e-4  # quantized for real
    np.testing.assert_allclose(_logits(swapped, inputs), expected, atol=ATOL, rtol=1e-5)


def test_enable_lora_gives_the_same_trainable_weights(pair):
    name = pair.name
    model, swapped = pair.take()  # LoRA changes the models: a pair of its own
    names = []
    for lm in (model, swapped):
        lm.backbone.enable_lora(2, target_layer_names=ZOO[name].lora_layer_names)
        weights = lm.backbone.trainable_weights
        names.append(sorted((w.name, tuple(w.shape)) for w in weights))
    if ZOO[name].lora == "added":
        layers = len(swapping.attention_layers(swapped))
        added = collections.Counter(names[1]) - collections.Counter(names[0])
        lora = sorted(n for n, _ in added.elements() if n != "bias")  # biases stay trainable
        assert lora == sorted(["lora_kernel_a", "lora_kernel_b"] * (2 * layers))
        names[1] = sorted((collections.Counter(names[1]) - added).elements())
    else:
        assert any("lora_kernel" in n for n, _ in names[0])
    if ZOO[name].lora == "fused" or ZOO[name].lora_shapes_differ:
        names = [[n for n, _ in each] for each in names]
    assert names[1] == names[0]
    inputs = _inputs(name)
    np.testing.assert_allclose(
        _logits(swapped, inputs), _logits(model, inputs), atol=ATOL, rtol=1e-5
    )


# ----------------------------------------------------------- entries' options
def _options(hub_class, dim=16, **kwargs):
    """Our layer's arguments from the entry of `hub_class` (`"package.module.Class"`
    under `keras_hub.src.models`) for those keras-hub constructor arguments."""
    key = f"keras_hub.src.models.{hub_class}"
    cls = {k: c for c, k in hub.hub_classes().items()}[key]
    config, _ = adapter.constructor_arguments(cls, (), kwargs)
    return hub.ADAPTERS[key].options(config, dim)


_HEADS = dict(num_query_heads=4, num_key_value_heads=2)
_QWEN_WINDOW = dict(_HEADS, use_sliding_window_attention=True, sliding_window_size=WINDOW)
_FUSED_ON_JAX_AND_TORCH = keras.backend.backend() != "tensorflow"


# Where keras-hub's class applies its window, on a CPU: the decoder's mask (Mistral,
# Mixtral) on every path; Qwen's own explicit path, not the fused one (`ops.
# dot_product_attention`, keras-hub's choice on JAX and torch; Qwen-MoE's only on a
# GPU or TPU).
@pytest.mark.parametrize(
    "hub_class, kwargs, applied",
    [
        (
            "mistral.mistral_attention.CachedMistralAttention",
            dict(_HEADS, sliding_window=WINDOW),
            True,
        ),
        (
            "mixtral.mixtral_attention.CachedMixtralAttention",
            dict(_HEADS, sliding_window=WINDOW),
            True,
        ),
        ("qwen.qwen_attention.QwenAttention", _QWEN_WINDOW, not _FUSED_ON_JAX_AND_TORCH),
        ("qwen_moe.qwen_moe_attention.QwenMoeAttention", _QWEN_WINDOW, True),
        (
            "qwen3.qwen3_attention.Qwen3Attention",
            dict(_HEADS, head_dim=4, sliding_window_size=WINDOW),
            not _FUSED_ON_JAX_AND_TORCH,
        ),
        (
            "qwen3_moe.qwen3_moe_attention.Qwen3MoeAttention",
            dict(_HEADS, sliding_window_size=WINDOW),
            not _FUSED_ON_JAX_AND_TORCH,
        ),
    ],
    ids=lambda x: x.rpartition(".")[2] if isinstance(x, str) else None,
)
def test_sliding_window_is_given_where_keras_hub_applies_it(hub_class, kwargs, applied):
    assert _options(hub_class, **kwargs)["sliding_window"] == (WINDOW if applied else None)


def test_qwen_window_off_gives_no_window():
    options = _options("qwen.qwen_attention.QwenAttention", **_HEADS, sliding_window_size=WINDOW)
    assert options["sliding_window"] is None


def test_smollm3_rope_per_layer_and_partial_rotary():
    config = dict(
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_bias=False,
        attention_dropout=0.0,
        rope_layer_enabled_list=[True, False],
        layer_types=["attention"] * 3,
        partial_rotary_factor=0.5,
    )
    smollm3 = "smollm3.smollm3_layers.SmolLM3Attention"
    first = _options(smollm3, **config, layer_idx=0)
    assert (first["rope_max_wavelength"], first["rope_dim"]) == (10000.0, 4)  # head of 8
    assert _options(smollm3, **config, layer_idx=1)["rope_max_wavelength"] is None  # NoPE
    # Past the list: keras-hub's default, RoPE.
    assert _options(smollm3, **config, layer_idx=2)["rope_max_wavelength"] == 10000.0
    whole = _options(smollm3, **dict(config, partial_rotary_factor=1.0), layer_idx=0)
    assert whole["rope_dim"] is None


def test_llama3_and_phi3_longrope_scaling():
    llama3 = _options(
        "llama.llama_attention.LlamaAttention",
        **_HEADS,
        rope_frequency_adjustment_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_pretraining_sequence_length=16,
    )
    assert llama3["rope_scaling"] == {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    assert _options("llama.llama_attention.LlamaAttention", **_HEADS)["rope_scaling"] is None
    phi3 = _options(
        "phi3.phi3_attention.Phi3Attention",
        **_HEADS,
        max_sequence_length=16,
        pretraining_sequence_length=6,
        rope_scaling_type="su",
        rope_scaling_short_factor=[1.5, 3.0],
        rope_scaling_long_factor=[2.0, 40.0],
    )
    assert phi3["rope_scaling"] == {
        "type": "longrope",
        "short_factor": [1.5, 3.0],
        "long_factor": [2.0, 40.0],
        "original_max_position_embeddings": 6,
        "max_position_embeddings": 16,
    }
    assert _options("phi3.phi3_attention.Phi3Attention", **_HEADS)["rope_scaling"] is None


def test_smollm3_keras_hub_output_projections_share_one_path():
    """keras-hub's `SmolLM3Attention` builds its `o_proj` in `__init__`, outside its
    layer's name scope: every layer's output kernel has the path `o_proj/kernel`. On
    torch, where Keras keys a layer's parameters by path (`TorchLayer.
    _track_variables`), a two-layer SmolLM3 trains otherwise than on JAX and
    TensorFlow: the first layer's `o_proj` takes another second update, and the
    losses part from the third step on. Swapped, each weight has its own path, and
    the torch losses are JAX's and TensorFlow's: keras-hub's wrong gradient is not
    reproduced."""
    keras.utils.set_random_seed(0)
    model = models.SmolLM3CausalLM(_smollm3_backbone([True, False], False), preprocessor=None)
    paths = [w.path for w in model.weights]
    assert paths.count("o_proj/kernel") == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(model)
    paths = [w.path for w in swapped.weights]
    assert len(set(paths)) == len(paths)


# ------------------------------------------------------------------- single layers
def test_gemma_attention_scale_from_the_model_width():
    """`CachedGemmaAttention(query_head_dim_normalize=False)` scales the logits by
    `1 / sqrt(dim // heads)` (Gemma 2's `query_pre_attn_scalar`), not by the head's
    size: the moved layer gives the same outputs, with a cache too."""
    from keras_hub.src.models.gemma.gemma_attention import CachedGemmaAttention

    config = dict(
        head_dim=8,
        num_query_heads=4,
        num_key_value_heads=2,
        query_head_dim_normalize=False,
        logit_soft_cap=2.0,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, LENGTH, 16)).astype("float32")
    mask = np.tril(np.ones((LENGTH, LENGTH), "int32"))[None].repeat(BATCH, axis=0)
    theirs = CachedGemmaAttention(**config)
    theirs.build(x.shape)
    for weight in theirs.weights:
        weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
    with keras_mha.swapped():
        ours = CachedGemmaAttention(**config)
    assert isinstance(ours, hub.HubAttention)
    ours.build(x.shape)
    ours.port(theirs)
    assert ours.attention._inverse_sqrt_key_dim == pytest.approx(0.5)  # 1 / sqrt(16 // 4)
    expected = to_numpy(theirs(x, attention_mask=mask))
    np.testing.assert_allclose(to_numpy(ours(x, attention_mask=mask)), expected, atol=ATOL)
    cache = np.zeros((BATCH, 2, LENGTH, 2, 8), "float32")
    outputs = [to_numpy(layer(x, mask, cache, cache_update_index=0)[0]) for layer in (ours, theirs)]
    np.testing.assert_allclose(outputs[0], outputs[1], atol=ATOL)


@pytest.mark.parametrize("size", [4, 5])
def test_gemma3_bidirectional_window(size):
    """EmbeddingGemma's `CachedGemma3Attention(use_bidirectional_attention=True)`: a
    window of `size - size // 2 - 1` keys before the query and `size // 2` after, our
    `(left, right)` pair; the moved layer gives the same outputs on padded rows."""
    from keras_hub.src.models.gemma3.gemma3_attention import CachedGemma3Attention

    config = dict(
        head_dim=4,
        num_query_heads=4,
        num_key_value_heads=2,
        use_query_key_norm=True,
        use_sliding_window_attention=True,
        sliding_window_size=size,
        use_bidirectional_attention=True,
    )
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, LENGTH, 16)).astype("float32")
    padding = _inputs()["padding_mask"]
    mask = padding[:, :, None] * padding[:, None, :]
    theirs = CachedGemma3Attention(**config)
    theirs.build(x.shape)
    for weight in theirs.weights:
        weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
    with keras_mha.swapped():
        ours = CachedGemma3Attention(**config)
    ours.build(x.shape)
    ours.port(theirs)
    assert ours.attention._sliding_window == (size - size // 2 - 1, size // 2)
    expected = to_numpy(theirs(x, attention_mask=mask))
    np.testing.assert_allclose(to_numpy(ours(x, attention_mask=mask)), expected, atol=ATOL)


# ----------------------------------------------------------------------- dropout
def test_bloom_with_dropout_trains_swapped():
    """keras-hub's Bloom drops the attention weights and then the projected output
    (`dropout_on="weights_and_projected_output"`). With dropout the masks differ from
    keras-hub's (the entry's notes), so the losses do: a swapped Bloom trains, its
    losses finite and falling; in inference it gives keras-hub's logits."""
    keras.utils.set_random_seed(0)
    backbone = models.BloomBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=4,
        hidden_dim=16,
        intermediate_dim=8,
        dropout=0.3,
    )
    model = models.BloomCausalLM(backbone, preprocessor=None)
    _randomize(model, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(model)
    (_, layer), *_ = swapping.attention_layers(swapped)
    assert layer.attention.dropout == 0.3
    assert layer.attention.get_config()["dropout_on"] == "weights_and_projected_output"
    inputs = _inputs("bloom")
    np.testing.assert_allclose(
        _logits(swapped, inputs), _logits(model, inputs), atol=ATOL, rtol=1e-5
    )
    training = to_numpy(swapped(inputs, training=True))
    assert np.abs(training - _logits(swapped, inputs)).max() > 1e-3  # dropout acted
    token_ids, padding_mask = _tokens(seed=2)
    labels = np.random.default_rng(3).integers(1, VOCAB, (BATCH, LENGTH)).astype("int32")
    swapped.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=RUN_EAGERLY,
    )
    losses = [swapped.train_on_batch(inputs, labels, sample_weight=padding_mask) for _ in range(5)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_t5gemma_cross_attention_builds_for_the_encoders_width_and_keeps_the_dtype():
    """`T5GemmaAttention` names `dtype` (a base `Layer` argument) and calls its Gemma
    parent with arguments of its own; its cross-attention's key and value projections
    take the encoder's width (`Entry.value_shape`), its queries the decoder's."""
    from keras_hub.src.models.t5gemma.t5gemma_attention import T5GemmaAttention

    config = dict(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        query_pre_attn_scalar=4.0,
        attention_bias=False,
        head_dim=4,
        attention_type="cross",
        cross_attention_hidden_size=16,
        dtype="float16",
    )
    with keras_mha.swapped():
        ours = T5GemmaAttention(**config)
    assert isinstance(ours, hub.HubAttention) and ours.dtype_policy.name == "float16"
    ours.build([(BATCH, 3, 8), (BATCH, LENGTH, 16)])
    assert tuple(ours.attention.query_dense.kernel.shape) == (8, 2, 4)
    assert tuple(ours.attention.key_dense.kernel.shape) == (16, 1, 4)
    assert ours.attention.compute_dtype == "float16"


@contextlib.contextmanager
def _dtype_policy(name):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_bfloat16_model_is_as_accurate_swapped(name):
    """keras-hub's presets load in bfloat16 (`dtype="bfloat16"`). Swapped, such a
    model computes in bfloat16 too, its logits are as close to the float32 model's
    (the same weights) as keras-hub's own attention gives them (mean error within
    1.5x of theirs: measured 0.8-1.25x over the zoo on the three backends), and
    Gemma 3 trains (a step's compiling is the cost on JAX)."""
    keras.utils.set_random_seed(0)
    reference = ZOO[name].build()
    _randomize(reference, 0)
    with _dtype_policy("bfloat16"):
        keras.utils.set_random_seed(0)
        model = ZOO[name].build()
        model.set_weights(reference.get_weights())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            swapped = keras_mha.swap(model)
    layers = swapping.attention_layers(swapped)
    assert layers and all(x.attention.compute_dtype == "bfloat16" for _, x in layers)
    inputs = _inputs(name)
    expected = _logits(reference, inputs).astype("float64")
    errors = []
    for lm in (model, swapped):
        logits = _logits(lm, inputs)
        assert logits.dtype.name == "bfloat16"
        errors.append(np.abs(logits.astype("float64") - expected).mean())
    assert 0 < errors[1] <= 1.5 * errors[0], errors
    if name != "gemma3":
        return
    token_ids, padding_mask = _tokens(seed=2)
    labels = np.random.default_rng(3).integers(1, VOCAB, (BATCH, LENGTH)).astype("int32")
    before = [to_numpy(w).astype("float32") for w in swapped.trainable_weights]
    swapped.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=RUN_EAGERLY,
    )
    loss = swapped.train_on_batch(inputs, labels, sample_weight=padding_mask, return_dict=True)
    assert np.isfinite(loss["loss"])
    weights = swapped.trainable_weights
    changed = [(to_numpy(w).astype("float32") != b).any() for w, b in zip(weights, before)]
    queries = [changed[i] for i, w in enumerate(weights) if "query" in w.path]
    assert queries and all(queries)  # our query projections and norms trained


@pytest.mark.parametrize("index", [0, 2])
def test_t5gemma2_merged_attention_prefill_and_decoding(index):
    """`T5Gemma2MergedAttention` (one softmax over the decoder's keys and the
    encoder's): a prefill (its self cache given, no cross cache) at `index` (0, as
    keras-hub's models pass it; 2, the moved layer's first call writing the encoder's
    keys), then a decoding step over both caches: the same outputs and caches."""
    from keras_hub.src.models.t5gemma2.t5gemma2_attention import T5Gemma2MergedAttention

    config = dict(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        query_pre_attn_scalar=4.0,
        attention_bias=True,
        head_dim=4,
        attn_logit_softcapping=2.0,
        rope_scaling_factor=2.0,
    )
    t, s, length = 3, 5, LENGTH
    rng = np.random.default_rng(4)
    x = rng.normal(size=(BATCH, t, 16)).astype("float32")
    encoder = rng.normal(size=(BATCH, s, 16)).astype("float32")
    self_cache = rng.normal(size=(BATCH, 2, length, 2, 4)).astype("float32")
    theirs = T5Gemma2MergedAttention(**config)
    theirs.build([x.shape, encoder.shape])
    for weight in theirs.weights:
        weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
    with keras_mha.swapped():
        ours = T5Gemma2MergedAttention(**config)
    assert isinstance(ours, hub.HubAttention)
    ours.build([x.shape, encoder.shape])
    ours.port(theirs)

    def mask(queries, start):  # causal over the self keys, the encoder's last key padded
        causal = np.arange(length)[None] <= np.arange(queries)[:, None] + start
        cross = np.ones((queries, s), bool)
        cross[:, -1] = False
        visible = np.concatenate([causal, cross], axis=-1)[None, None]
        return ((1.0 - visible.astype("float32")) * -1e9).repeat(BATCH, axis=0)

    results = []
    for layer in (theirs, ours):
        out, (own, cross) = layer(
            x, encoder, attention_mask=mask(t, index), cache=(self_cache, None),
            cache_update_index=index,
        )  # fmt: skip
        step = index + t
        token = x[:, :1]
        out_step, (own_step, _) = layer(
            token, encoder, attention_mask=mask(1, step), cache=(own, cross),
            cache_update_index=step,
        )  # fmt: skip
        results.append([to_numpy(a) for a in (out, own, cross, out_step, own_step)])
    for ours_value, theirs_value in zip(results[1], results[0]):
        np.testing.assert_allclose(ours_value, theirs_value, atol=ATOL, rtol=1e-5)


# ------------------------------------------------- where keras-hub's class is wrong
def _corrected(swapped):
    for _, layer in swapping.attention_layers(swapped):
        layer.corrected = True
    return swapped


@pytest.mark.parametrize("name", ["esm", "roformer"])
def test_encoder_padding_is_keras_hubs_unless_corrected(name):
    """RoFormer-v2's and ESM's attention mask the padded queries, not the keys, on
    tensorflow and jax (the entries' notes): the swap keeps that; `corrected=True`
    masks the keys, so a padded row's tokens get the logits of the row unpadded."""
    model, swapped = _pair(name)
    token_ids, padding_mask = _tokens()  # row 1: its last 2 tokens padding
    inputs = ZOO[name].inputs(token_ids, padding_mask)
    short = ZOO[name].inputs(token_ids[1:, :-2], padding_mask[1:, :-2])
    unpadded = _logits(model, short)[0]
    keras_hub_padded = _logits(model, inputs)[1, :-2]
    np.testing.assert_allclose(_logits(swapped, inputs)[1, :-2], keras_hub_padded, atol=ATOL)
    if keras.backend.backend() == "torch":  # keras-hub masks the keys there
        np.testing.assert_allclose(keras_hub_padded, unpadded, atol=ATOL)
    else:
        assert np.abs(keras_hub_padded - unpadded).max() > 1e-3
    corrected = _logits(_corrected(swapped), inputs)[1, :-2]
    np.testing.assert_allclose(corrected, unpadded, atol=ATOL, rtol=1e-5)


def test_gpt_neo_x_decoding_is_keras_hubs_unless_corrected():
    """keras-hub's GPT-NeoX rotates a decoding step's query at position 0 (the entry's
    notes): the swap keeps that; `corrected=True` gives the step a full call's logits."""
    model, swapped = _pair("gpt_neo_x")
    token_ids, _ = _tokens()
    full = _logits(model, {"token_ids": token_ids, "padding_mask": np.ones_like(token_ids)})
    t = LENGTH - 2

    def step(lm):  # prefill every position, as `generate()` does, then decode `t`
        _, cache = lm._build_cache(token_ids)
        logits, _, _ = lm.call_with_cache(token_ids[:, t : t + 1], cache, t)
        return to_numpy(logits)[:, 0]

    keras_hub_step = step(model)
    assert np.abs(keras_hub_step - full[:, t]).max() > 1e-3
    np.testing.assert_allclose(step(swapped), keras_hub_step, atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(step(_corrected(swapped)), full[:, t], atol=ATOL, rtol=1e-5)


# ------------------------------------------------------------------ out of scope
def test_swap_names_an_out_of_scope_class_and_its_reason():
    backbone = models.DebertaV3Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=8
    )
    model = models.DebertaV3TextClassifier(backbone, num_classes=2, preprocessor=None)
    layers = swapping.attention_layers(model)
    assert layers and all(hub.out_of_scope(x) for _, x in layers)
    key = "keras_hub.src.models.deberta_v3.disentangled_self_attention.DisentangledSelfAttention"
    with pytest.raises(ValueError) as info:
        keras_mha.swap(model)
    message = str(info.value)
    assert "\n" not in message
    assert f"DisentangledSelfAttention: {hub.OUT_OF_SCOPE[key]}" in message


# ------------------------------------------------------------ with a preprocessor
def test_a_task_with_its_preprocessor_generates_the_same_text(proto):  # noqa: F811
    """A task built with keras-hub's preprocessor (a tokenizer whose vocabulary is an
    asset, as `from_preset` gives it) generates from strings once swapped."""
    tokenizer = models.LlamaTokenizer(proto=proto)
    preprocessor = models.LlamaCausalLMPreprocessor(tokenizer, sequence_length=LENGTH + 4)
    keras.utils.set_random_seed(0)
    backbone = models.LlamaBackbone(**{**TINY, "vocabulary_size": tokenizer.vocabulary_size()})
    model = models.LlamaCausalLM(backbone, preprocessor=preprocessor)
    _randomize(model, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(model)
    texts = []
    for lm in (model, swapped):
        lm.compile(sampler="greedy")
        texts.append(lm.generate(["the quick", "a lazy dog"]))
    assert texts[0][0].startswith("the quick") and len(texts[0][0]) > len("the quick")
    assert texts[1] == texts[0]


# --------------------------------------------------------------------------- guard
def _language_model_packages():
    """keras-hub's model packages that define a language-model task."""
    tasks = (models.CausalLM, models.Seq2SeqLM, models.MaskedLM, models.TextClassifier)

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    prefix = "keras_hub.src.models."
    return {
        c.__module__[len(prefix) :].split(".")[0]
        for task in tasks
        for c in subclasses(task)
        if c.__module__.startswith(prefix)
    }


def _attention_classes(packages):
    """`module.ClassName` of every layer class named `...Attention` defined in
    `packages` that is not the built-in or a subclass of it (`test_keras_hub.py`)."""
    found = set()
    root = importlib.import_module("keras_hub.src.models")
    for info in pkgutil.walk_packages(root.__path__, root.__name__ + "."):
        if info.name.split(".")[3] not in packages:
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and value.__module__ == module.__name__
                and issubclass(value, keras.layers.Layer)
                and name.lower().endswith("attention")
                and not issubclass(value, keras.layers.MultiHeadAttention)
            ):
                found.add(f"{value.__module__}.{name}")
    return found


def test_every_keras_hub_attention_class_is_moved_or_out_of_scope():
    found = _attention_classes(_language_model_packages())
    assert "keras_hub.src.models.llama.llama_attention.LlamaAttention" in found
    accounted = set(hub.ADAPTERS) | set(hub.OUT_OF_SCOPE)
    missing = sorted(found - accounted)
    assert not missing, f"keras-hub attention classes neither moved nor out of scope: {missing}"
    assert accounted <= found  # no stale entry
    assert all(reason for reason in hub.OUT_OF_SCOPE.values())


def _mask_spec(block):
    """The described-mask spec of the entry of `block`'s attention, when it applies."""
    for child in block._flatten_layers(include_self=False, recursive=False):
        if isinstance(child, hub.HubAttention) and child.entry.decoder_mask is not None:
            spec = child.entry.decoder_mask
            if not isinstance(spec, hub.common.DescribedDecoder):
                spec = hub.common.DescribedDecoder(spec)
            return spec if spec.applies_to(block) else None
    return None


def _block_mask(block, method, sequence, padding_mask, **overrides):
    """`block`'s mask method called with keras-hub's arguments for it, by name (Llama's
    `decoder_sequence, ...`, Gemma's `x, padding_mask, ...`), no cache."""
    arguments = {
        **dict(
            decoder_sequence=sequence,
            decoder_padding_mask=padding_mask,
            decoder_attention_mask=None,
            self_attention_cache=None,
            self_attention_cache_update_index=None,
            x=sequence,
            padding_mask=padding_mask,
            vision_mask=None,
            cache=None,
            cache_update_index=0,
        ),
        **overrides,
    }
    names = inspect.signature(getattr(type(block), method)).parameters
    return getattr(block, method)(**{k: v for k, v in arguments.items() if k in names})


def test_gemma4_options_per_layer_kind():
    """Local layers: separate projections, full RoPE; `attention_k_eq_v` global layers:
    tied key/value with their own key/value heads and proportional partial RoPE (keras-
    hub's `rotary_dim`: `int(factor * head_dim)`, even, at least 2); KV-shared layers: no
    key/value projection."""
    gemma4 = "gemma4.gemma4_attention.Gemma4TextAttention"
    common = dict(head_dim=8, num_query_heads=2, num_key_value_heads=2)
    local = _options(gemma4, **common, use_sliding_window_attention=True, attention_k_eq_v=True)
    assert local["key_value_projection"] == "separate"  # K = V only on global layers
    assert (local["rope_dim"], local["num_key_value_heads"], local["scale"]) == (None, 2, 1.0)
    tied = dict(common, attention_k_eq_v=True, num_global_key_value_heads=1)
    glob = _options(gemma4, **tied, rope_partial_rotary_factor=0.3)
    assert glob["key_value_projection"] == "tied" and glob["num_key_value_heads"] == 1
    assert (glob["rope_dim"], glob["rope_dim_layout"]) == (2, "proportional")  # int(2.4) = 2
    shared = _options(gemma4, **tied, is_kv_shared_layer=True)
    assert shared["key_value_projection"] == "none"


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gemma4_mask_sliding_window_is_keras_hubs(bidirectional):
    """Gemma 4's decoder block windows its dense mask through its attention's
    `_mask_sliding_window`: the swapped layer's gives keras-hub's, at a cache offset."""
    from keras_hub.src.models.gemma4.gemma4_attention import Gemma4TextAttention

    kwargs = dict(
        head_dim=4,
        num_query_heads=2,
        num_key_value_heads=1,
        use_sliding_window_attention=True,
        sliding_window_size=3,
        use_bidirectional_attention=bidirectional,
    )
    theirs = Gemma4TextAttention(**kwargs)
    hub.patch()
    try:
        ours = Gemma4TextAttention(**kwargs)
    finally:
        hub.unpatch()
    assert isinstance(ours, hub.HubAttention)
    rng = np.random.default_rng(0)
    cases = [(6, 6, 0)] if bidirectional else [(6, 6, 0), (2, 8, 3), (1, 8, 7)]
    for queries, keys, index in cases:
        mask = rng.random((2, queries, keys)) < 0.8
        expected = to_numpy(theirs._mask_sliding_window(mask, cache_update_index=index))
        got = to_numpy(ours._mask_sliding_window(mask, cache_update_index=index))
        np.testing.assert_array_equal(got, expected)
        assert not got.all()


def _attention_masks(swapped):
    """Records the `attention_mask` each `HubAttention` of `swapped` is called with
    (its type), in a list returned."""
    seen = []
    for _, layer in swapping.attention_layers(swapped):
        call = layer.entry.call

        def spy(attention, *args, _call=call, **kwargs):
            seen.append(type(kwargs.get("attention_mask")))
            return _call(attention, *args, **kwargs)

        layer.entry = dataclasses.replace(layer.entry, call=spy)
    return seen


def test_gemma3_blocks_pass_their_masks_described():
    """The swapped Gemma 3's decoder blocks (local and global) give our layer a
    `DecoderMask` in a forward pass and in cached `generate()`, and its logits stay
    keras-hub's; with a vision mask (images attend both ways) keras-hub's dense mask."""
    model, swapped = _pair("gemma3")
    assert hub.describe_masks(swapped) == 6
    seen = _attention_masks(swapped)
    inputs = _inputs("gemma3")
    np.testing.assert_allclose(
        _logits(swapped, inputs), _logits(model, inputs), atol=ATOL, rtol=1e-5
    )
    assert seen and set(seen) == {hub.common.DecoderMask}, seen
    seen.clear()
    token_ids, padding_mask = _tokens(prompt=3)
    swapped.generate(
        {"token_ids": token_ids, "padding_mask": padding_mask},
        stop_token_ids=None,
        strip_prompt=True,
    )
    assert seen and set(seen) == {hub.common.DecoderMask}, seen
    block = swapped.backbone.transformer_layers[0]
    sequence = keras.ops.ones((BATCH, LENGTH, 16))
    vision = np.zeros((BATCH, LENGTH), "int32")
    vision[:, 2:5] = 1
    dense = _block_mask(
        block, "_compute_attention_mask", sequence, inputs["padding_mask"], vision_mask=vision
    )
    assert not isinstance(dense, hub.common.DecoderMask)
    expected = type(block)._compute_attention_mask(
        block, sequence, inputs["padding_mask"], vision, None, 0
    )
    np.testing.assert_array_equal(to_numpy(dense), to_numpy(expected))


def test_swap_carries_what_keras_hubs_config_drops(monkeypatch):
    """keras-hub 0.32's `QwenMoeBackbone.get_config` drops `router_aux_loss_coefficient`:
    the swap (a rebuild from the config) carries it from the original, so the swapped
    model's load-balancing losses are the original's (`hub.CONFIG_GAPS`)."""
    keras.utils.set_random_seed(0)
    backbone = models.QwenMoeBackbone(
        **TINY,
        moe_intermediate_dim=8,
        shared_expert_intermediate_dim=8,
        num_experts=2,
        top_k=1,
        router_aux_loss_coefficient=0.25,
    )
    inputs = ZOO["qwen_moe"].inputs(*_tokens())

    def aux_losses(model):
        model(inputs, training=True)
        return np.array([to_numpy(loss) for loss in model.losses])

    expected = aux_losses(backbone)
    assert len(expected) == TINY["num_layers"] and (expected > 0).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(backbone)
    assert swapped.router_aux_loss_coefficient == 0.25
    np.testing.assert_allclose(aux_losses(swapped), expected, rtol=1e-5)
    monkeypatch.setattr(hub, "carry_config_gaps", lambda original, result: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rebuilt = keras_mha.swap(backbone)  # what keras-hub's config alone gives
    assert not np.allclose(aux_losses(rebuilt), expected, rtol=1e-3)


def test_rows_no_key_reaches_get_keras_hubs_outputs(pair):
    """A left-padded row: its first queries see no key (a causal model's), or none that
    is not padding. keras-hub gives them the values' mean where its class runs Keras's
    fused `ops.dot_product_attention` and a zero output where it runs its masked
    `keras.layers.Softmax` (tensorflow, or a CPU, by class: the guarantees page); the
    swap keeps what keras-hub's class gives on this backend."""
    model, swapped = pair.models
    token_ids, padding_mask = _tokens()
    padding_mask[0, :3] = 0
    inputs = ZOO[pair.name].inputs(token_ids * padding_mask, padding_mask)
    expected = _logits(model, inputs)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(_logits(swapped, inputs), expected, atol=ATOL, rtol=1e-5)


# One model per way an entry lays keras-hub's weights out as ours: Gemma's kernels
# transposed, GPT-NeoX's fused projection split, T5's `Dense` kernels reshaped (a
# relative-position table beside them; a seq2seq model's two padding masks), Qwen3.5's
# query kernel split into query and gate, T5Gemma's additive masks (padded decoder
# queries see no key), RoFormer's segment ids (a 2-row embedding) and Gemma 3n, whose
# task is checked through `hub.task_forward` (two loads of its file differ).
CLI_MODELS = ["gemma", "gpt_neo_x", "t5", "qwen3_5", "t5gemma", "roformer", "gemma3n"]


@pytest.mark.parametrize("name", CLI_MODELS)
def test_swap_file_pairs_the_gradients_of_weights_laid_out_anew(name, tmp_path):
    """`keras-mha swap` (`compare.swap_file`, what its worker runs) on a saved keras-hub
    model: the weight gradients are compared in our layout (`compare.model
    .in_our_layout`) and each input case passes; a perturbed copy of one fails."""
    from keras_mha import compare

    keras.utils.set_random_seed(0)
    model = ZOO[name].build()
    _randomize(model, 0)
    path = str(tmp_path / f"{name}.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = compare.swap_file(path, str(tmp_path / "out.keras"))
        perturbed = None
        if name == "gpt_neo_x":
            perturbed = compare.swap_file(path, str(tmp_path / "p.keras"), perturb=0.05)
    assert result["passed"] is True, result["input_cases"]
    assert result["classification"] is None
    assert perturbed is None or perturbed["passed"] is False
    # One line says where the check ran the task other than by its call.
    assert [n.split(":")[0] for n in result["model_notes"]] == (
        ["Gemma3nCausalLM"] if name == "gemma3n" else []
    )
