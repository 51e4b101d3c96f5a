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

import keras_mha
from keras_mha import hub, swapping

models = keras_hub.models

BATCH, LENGTH, VOCAB = 2, 8, 16
ATOL = 1e-5
# Compiled train steps on JAX (eager JAX compiles each op of a step one by one).
RUN_EAGERLY = keras.backend.backend() != "jax"


def _causal_lm_inputs(token_ids, padding_mask):
    return {"token_ids": token_ids, "padding_mask": padding_mask}


@dataclasses.dataclass
class Case:
    """A language model: `build()` returns its task.

    Attributes:
        build: `() -> task` (`preprocessor=None`).
        inputs: `(token_ids, padding_mask) -> the task's inputs` (a causal LM's by
            default): its logits are `(B, LENGTH, VOCAB)`, trained against labels of
            that shape, weighted by `padding_mask`.
        generated: The key of `generate()`'s token ids; `None` for a task with no
            `generate()` (an encoder's masked LM).
        lora: What `enable_lora` gives: "same" (the same trainable weights, names
            and shapes), or "added": keras-hub's targets (layers named `query_dense`
            and `value_dense`) are not in its attention (T5, ESM, RoFormer-v2 name
            theirs otherwise), ours has them, so the swapped model's query and
            value projections get LoRA factors, their biases staying trainable (the
            entry's notes); or "fused": keras-hub's target is a fused projection
            (Qwen3.5's query and gate, `(dim, N, 2H)`), whose factors ours (the query
            alone) cannot have: the same names are checked.
    """

    build: callable
    inputs: callable = _causal_lm_inputs
    generated: str = "token_ids"
    lora: str = "same"


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


def _seq2seq_inputs(token_ids, padding_mask):
    """The same tokens to the encoder and (its prompt) to the decoder."""
    return {
        "encoder_token_ids": token_ids,
        "encoder_padding_mask": padding_mask,
        "decoder_token_ids": token_ids,
        "decoder_padding_mask": padding_mask,
    }


ZOO = {
    "llama": Case(_llama),
    "falcon": Case(_falcon),
    "bloom": Case(_bloom),
    "gpt_neo_x": Case(_gpt_neo_x, lora="added"),
    "qwen3_5": Case(_qwen3_5, lora="fused"),
    "t5": Case(_t5, _seq2seq_inputs, generated="decoder_token_ids", lora="added"),
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


def _inputs(name, seed=0, prompt=None):
    """Model `name`'s inputs from `_tokens`."""
    return ZOO[name].inputs(*_tokens(seed, prompt))


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
    name, model, swapped = pair
    inputs = _inputs(name)
    expected = _logits(model, inputs)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(_logits(swapped, inputs), expected, atol=ATOL, rtol=1e-5)


def test_greedy_generate_gives_the_same_token_ids(pair):
    name, model, swapped = pair
    key = ZOO[name].generated
    if key is None:
        pytest.skip(f"{name}'s task has no generate()")
    inputs = _inputs(name, seed=1, prompt=3)
    results = []
    for lm in (model, swapped):
        lm.compile(sampler="greedy")
        results.append(to_numpy(lm.generate(inputs, stop_token_ids=None)[key]))
    assert (results[0][:, 3:] != 0).any()  # it generated
    np.testing.assert_array_equal(results[1], results[0])


def test_training_gives_the_same_losses_over_several_steps(pair):
    name, model, swapped = pair
    token_ids, padding_mask = _tokens(seed=2)
    inputs = ZOO[name].inputs(token_ids, padding_mask)
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
            [lm.train_on_batch(inputs, labels, sample_weight=padding_mask) for _ in range(3)]
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
    inputs = _inputs(name)
    np.testing.assert_allclose(
        _logits(loaded, inputs), _logits(model, inputs), atol=ATOL, rtol=1e-5
    )


def test_enable_lora_gives_the_same_trainable_weights(pair):
    name, _, _ = pair
    model, swapped = _pair(name)  # LoRA changes the models: a pair of its own
    names = []
    for lm in (model, swapped):
        lm.backbone.enable_lora(2)
        names.append(sorted((w.name, tuple(w.shape)) for w in lm.backbone.trainable_weights))
    if ZOO[name].lora == "added":
        layers = len(swapping.attention_layers(swapped))
        added = collections.Counter(names[1]) - collections.Counter(names[0])
        lora = sorted(n for n, _ in added.elements() if n != "bias")  # biases stay trainable
        assert lora == sorted(["lora_kernel_a", "lora_kernel_b"] * (2 * layers))
        names[1] = sorted((collections.Counter(names[1]) - added).elements())
    else:
        assert any("lora_kernel" in n for n, _ in names[0])
    if ZOO[name].lora == "fused":
        names = [[n for n, _ in each] for each in names]
    assert names[1] == names[0]
    inputs = _inputs(name)
    np.testing.assert_allclose(
        _logits(swapped, inputs), _logits(model, inputs), atol=ATOL, rtol=1e-5
    )


def test_int8_quantized_gives_the_same_logits(pair):
    name, _, _ = pair
    model, swapped = _pair(name)
    inputs = _inputs(name)
    full = _logits(model, inputs)
    for lm in (model, swapped):
        lm.quantize("int8")
    for _, layer in swapping.attention_layers(swapped):
        assert layer.attention.query_dense.quantization_mode == "int8"
    expected = _logits(model, inputs)
    assert np.abs(expected - full).max() > 1e-4  # quantized for real
    np.testing.assert_allclose(_logits(swapped, inputs), expected, atol=ATOL, rtol=1e-5)


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
