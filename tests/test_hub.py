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

import dataclasses
import importlib
import inspect
import pkgutil
import warnings

import keras
import keras_hub
import numpy as np
import pytest
from helpers import to_numpy

import keras_mha
from keras_mha import hub, swapping

models = keras_hub.models

BATCH, LENGTH, VOCAB = 2, 8, 16
ATOL = 1e-5
# Compiled train steps on JAX (eager JAX compiles each op of a step one by one).
RUN_EAGERLY = keras.backend.backend() != "jax"


@dataclasses.dataclass
class Case:
    """A language model: `build()` returns its task (`generate()` is checked, with
    `generate_kwargs` added to its arguments)."""

    build: callable
    generate_kwargs: dict = dataclasses.field(default_factory=dict)


def _llama():
    backbone = models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=8,
    )
    return models.LlamaCausalLM(backbone, preprocessor=None)


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


ZOO = {
    "llama": Case(_llama),
    "gemma": Case(_gemma),
    "gemma2": Case(_gemma2),
    # keras-hub 0.32's Gemma3CausalLM.generate without a preprocessor fails on its own
    # output ("images": None) unless the prompt is stripped.
    "gemma3": Case(_gemma3, generate_kwargs={"strip_prompt": True}),
    "gpt_oss": Case(_gpt_oss),
}


# ------------------------------------------------------------------------- helpers
def _randomize(model, seed):
    """Trainable weights drawn from N(0, 0.5): far from initial values (zeros, ones),
    so a swapped layer that ignored a weight would show."""
    rng = np.random.default_rng(seed)
    for weight in model.trainable_weights:
        weight.assign(rng.normal(0.0, 0.5, weight.shape).astype(weight.dtype))


def _inputs(seed=0, prompt=None):
    """Token ids in `[1, VOCAB)`, the second row padded at its end; with `prompt`,
    every row is a prompt of that many tokens (what `generate()` continues)."""
    rng = np.random.default_rng(seed)
    padding_mask = np.ones((BATCH, LENGTH), "int32")
    padding_mask[1, -2:] = 0
    if prompt is not None:
        padding_mask[:, prompt:] = 0
    token_ids = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype("int32") * padding_mask
    return {"token_ids": token_ids, "padding_mask": padding_mask}


def _logits(model, inputs):
    return to_numpy(model(inputs))


def _pair(name, seed=0):
    keras.utils.set_random_seed(seed)
    model = ZOO[name].build()
    _randomize(model, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(model)
    return model, swapped


@pytest.fixture(scope="module", params=list(ZOO))
def pair(request):
    model, swapped = _pair(request.param)
    return request.param, model, swapped


# --------------------------------------------------------------------------- tests
def test_swap_moves_every_attention_layer(pair):
    _, model, swapped = pair
    rows = swapping.swap_report(model, swapped)
    assert rows and all(row["status"] == swapping.MOVED for row in rows), rows
    for _, layer in swapping.attention_layers(swapped):
        assert isinstance(layer, hub.HubAttention)
        assert isinstance(layer.attention, keras_mha.MultiHeadAttention)


def test_logits_match(pair):
    _, model, swapped = pair
    inputs = _inputs()
    expected = _logits(model, inputs)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(_logits(swapped, inputs), expected, atol=ATOL, rtol=1e-5)


def test_greedy_generate_gives_the_same_token_ids(pair):
    name, model, swapped = pair
    inputs = _inputs(seed=1, prompt=3)
    results = []
    for lm in (model, swapped):
        lm.compile(sampler="greedy")
        outputs = lm.generate(inputs, stop_token_ids=None, **ZOO[name].generate_kwargs)
        results.append(to_numpy(outputs["token_ids"]))
    assert (results[0][:, 3:] != 0).any()  # it generated
    np.testing.assert_array_equal(results[1], results[0])


def test_training_gives_the_same_losses_over_several_steps(pair):
    _, model, swapped = pair
    inputs = _inputs(seed=2)
    rng = np.random.default_rng(3)
    labels = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype("int32")
    losses = []
    for lm in (model, swapped):
        weights = lm.get_weights()
        lm.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=RUN_EAGERLY,
        )
        losses.append(
            [
                lm.train_on_batch(inputs, labels, sample_weight=inputs["padding_mask"])
                for _ in range(3)
            ]
        )
        lm.set_weights(weights)
    assert losses[0][-1] < losses[0][0]  # it trained
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4, atol=1e-5)


def test_saved_swap_loads_with_only_keras_mha_attention(pair, tmp_path):
    name, model, swapped = pair
    path = tmp_path / f"{name}.keras"
    keras_mha.save_swapped(swapped, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = keras.saving.load_model(path)
    layers = swapping.attention_layers(loaded)
    assert layers and all(isinstance(x, hub.HubAttention) for _, x in layers)
    inputs = _inputs()
    np.testing.assert_allclose(
        _logits(loaded, inputs), _logits(model, inputs), atol=ATOL, rtol=1e-5
    )


def test_enable_lora_gives_the_same_trainable_weights(pair):
    name, _, _ = pair
    model, swapped = _pair(name)  # LoRA changes the models: a pair of its own
    names = []
    for lm in (model, swapped):
        lm.backbone.enable_lora(2)
        # Sizes, not shapes: Gemma's (N, dim, H) kernels are ours transposed (dim, N, H),
        # and so is the adapter keras's `enable_lora` gives each (the entry's notes).
        names.append(sorted((w.name, int(np.prod(w.shape))) for w in lm.backbone.trainable_weights))
    assert names[1] == names[0]
    assert any("lora_kernel" in n for n, _ in names[0])
    inputs = _inputs()
    np.testing.assert_allclose(
        _logits(swapped, inputs), _logits(model, inputs), atol=ATOL, rtol=1e-5
    )


def test_int8_quantized_gives_the_same_logits(pair):
    name, _, _ = pair
    model, swapped = _pair(name)
    inputs = _inputs()
    full = _logits(model, inputs)
    for lm in (model, swapped):
        lm.quantize("int8")
    for _, layer in swapping.attention_layers(swapped):
        assert layer.attention.query_dense.quantization_mode == "int8"
    expected = _logits(model, inputs)
    assert np.abs(expected - full).max() > 1e-4  # quantized for real
    np.testing.assert_allclose(_logits(swapped, inputs), expected, atol=ATOL, rtol=1e-5)


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
