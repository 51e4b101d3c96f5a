"""Packed rows through a swapped keras-hub language model (`keras_mha.hub.set_packed`):
a document's logits in a packed row equal those keras-hub's own (unswapped) model gives it
alone in a row of its own, and the gradients of its loss those the swapped model gives it
alone, for random document lengths (hypothesis)."""

import functools
import warnings

import keras
import keras_hub
import numpy as np
import pytest
from helpers import to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hub import RUN_EAGERLY, TINY, VOCAB, WINDOW, ZOO, _randomize

import keras_mha
from keras_mha import hub, packing

ROW = 16  # tokens per packed row
# Causal language models whose attention our layer runs with RoPE (positions restart
# at each document) and whose decoder blocks describe their masks. GPT-OSS: sinks, a
# window on alternate layers, MoE. Gemma 3: five local layers (window 3, shorter than
# most documents) and a global one, the fewest keras-hub's fixed 5:1 pattern allows;
# Gemma 2: soft-caps and a window on the first of two layers; Qwen-MoE and Qwen3-MoE:
# a window and MoE (routing per token).
PACKED = ["llama", "gpt_oss", "gemma3"]
# The other families whose blocks describe their masks, checked on fewer examples (the
# test's time): Gemma 1, Gemma 2 (soft-caps, a window on the first of two layers),
# SmolLM3, Qwen-MoE and Qwen3-MoE (a window, MoE routing per token), GPT-NeoX (partial
# rotary), Bloom and Falcon (ALiBi).
ALSO_PACKED = [
    "gemma",
    "gemma2",
    "smollm3",
    "qwen_moe",
    "qwen3_moe",
    "gpt_neo_x",
    "bloom",
    "falcon",
]


def _qwen_moe():
    """Qwen-MoE without its router's load-balancing loss: that loss is a statistic of
    the whole batch's routing (how many tokens each expert gets), not of a document,
    so packing other documents beside one changes it by design."""
    backbone = keras_hub.models.QwenMoeBackbone(
        **TINY,
        moe_intermediate_dim=8,
        shared_expert_intermediate_dim=8,
        num_experts=2,
        top_k=1,
        use_sliding_window_attention=True,
        sliding_window_size=WINDOW,
        router_aux_loss_coefficient=0.0,
    )
    return keras_hub.models.QwenMoeCausalLM(backbone, preprocessor=None)


def _qwen3_moe():
    """Qwen3-MoE without its router's load-balancing loss (as `_qwen_moe`)."""
    backbone = keras_hub.models.Qwen3MoeBackbone(
        **TINY,
        head_dim=6,
        moe_intermediate_dim=8,
        num_experts=2,
        top_k=1,
        sliding_window_size=WINDOW,
        router_aux_loss_coefficient=0.0,
    )
    return keras_hub.models.Qwen3MoeCausalLM(backbone, preprocessor=None)


_BUILD = {"qwen_moe": _qwen_moe, "qwen3_moe": _qwen3_moe}


@functools.cache
def _models(name):
    keras.utils.set_random_seed(0)
    model = _BUILD.get(name, ZOO[name].build)()
    _randomize(model, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(model)
    hub.set_packed(swapped)  # (the swap carries Qwen-MoE's coefficient: `hub.CONFIG_GAPS`)
    # Compiled once: every step below takes rows of ROW tokens (one trace per model).
    swapped.compile(optimizer=keras.optimizers.SGD(1.0), loss=_loss(), run_eagerly=RUN_EAGERLY)
    return model, swapped


def _logits(lm, inputs):
    """`lm`'s logits; on JAX through `predict_on_batch` (one compiled program per model:
    eager JAX compiles each op of the call one by one, slower), a call on the others."""
    if keras.backend.backend() == "jax":
        return to_numpy(lm.predict_on_batch(inputs))
    return to_numpy(lm(inputs))


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")


def _step_delta(lm, inputs, targets, weights):
    """The weights' change of one SGD step (rate 1) on the summed, weighted loss:
    minus the gradient of that loss."""
    before = lm.get_weights()
    lm.train_on_batch(inputs, targets, sample_weight=weights)
    after = lm.get_weights()
    lm.set_weights(before)
    return [a - b for a, b in zip(after, before)]


_LENGTHS = st.lists(st.integers(2, 8), min_size=2, max_size=4)


@pytest.mark.parametrize("name", PACKED)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(lengths=_LENGTHS)
def test_a_document_gets_its_own_logits_and_gradients_packed(name, lengths):
    _check_packed(name, lengths)


@pytest.mark.parametrize("name", ALSO_PACKED)
@settings(max_examples=2, deadline=None, derandomize=True)
@given(lengths=_LENGTHS)
def test_the_other_families_pack_too(name, lengths):
    _check_packed(name, lengths)


def _alone(*documents):
    """Each document alone in a row of its own of ROW tokens, padded after it
    (`padding_mask` 0; causal, the padding changes none of its logits, and weighs 0 in
    the losses): every row of the test has one shape."""
    row = np.zeros((len(documents), ROW), documents[0].dtype)
    mask = np.zeros((len(documents), ROW), "int32")
    for i, values in enumerate(documents):
        row[i, : len(values)] = values
        mask[i, : len(values)] = 1
    return {"token_ids": row, "padding_mask": mask}


# A packed row holds at most this many documents (`_LENGTHS`): keras-hub's own model
# takes them all in one call of this many rows (the last repeated), one shape.
MAX_DOCUMENTS = 4


def _check_packed(name, lengths):
    model, swapped = _models(name)
    rng = np.random.default_rng(len(lengths))
    documents = [rng.integers(1, VOCAB, n) for n in lengths]
    rows = packing.pack(documents, ROW)
    row = 0
    packed_inputs = {
        "token_ids": rows["token_ids"][row : row + 1],
        "padding_mask": rows["segment_ids"][row : row + 1],
    }
    packed_logits = _logits(swapped, packed_inputs)[0]
    ids = rows["segment_ids"][row]
    wheres = [np.flatnonzero(ids == document) for document in range(1, ids.max() + 1)]
    assert len(wheres) <= MAX_DOCUMENTS
    batch = wheres + wheres[-1:] * (MAX_DOCUMENTS - len(wheres))
    alone_logits = _logits(model, _alone(*(rows["token_ids"][row, w] for w in batch)))
    for document, where in enumerate(wheres):
        expected = alone_logits[document, : len(where)]
        np.testing.assert_allclose(packed_logits[where], expected, atol=1e-5, rtol=1e-5)
    # Gradients of one document's loss: packed (the others weigh 0) and alone.
    where = np.flatnonzero(ids == 1)
    targets = rows["targets"][row : row + 1]
    weights = (rows["loss_mask"][row : row + 1] & (ids == 1)[None]).astype("float32")
    packed_delta = _step_delta(swapped, packed_inputs, targets, weights)
    # The same swapped model alone (its weights in the same order; the logits above
    # already compared it with keras-hub's own model).
    alone = _alone(rows["token_ids"][row, where])
    alone_delta = _step_delta(
        swapped,
        alone,
        _alone(targets[0, where])["token_ids"],
        _alone(weights[0, where])["token_ids"],
    )
    assert max(np.abs(d).max() for d in alone_delta) > 1e-6
    for ours, theirs in zip(packed_delta, alone_delta):
        # float32 sums in another order: an error relative to the largest entry (Gemma
        # 3's six layers of random weights give gradients up to ~10).
        scale = max(1.0, float(np.abs(theirs).max()))
        np.testing.assert_allclose(ours, theirs, atol=1e-5 * scale, rtol=1e-4)


def test_set_packed_rejects_a_model_it_cannot_pack():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="argument `model`"):
        hub.set_packed(model)


def test_a_packed_gemma3_refuses_a_vision_mask():
    """Gemma 3's images attend to each other both ways, which its block only gives as
    keras-hub's dense mask: a packed model given a vision mask says so, naming
    `padding_mask`, instead of reading document ids as a padding mask."""
    _, swapped = _models("gemma3")
    block = swapped.backbone.transformer_layers[0]
    x = keras.ops.ones((1, ROW, 16))
    ids = np.repeat([[1, 2]], ROW // 2, axis=1)
    mask = block._compute_attention_mask(x, ids, None, None, 0)
    assert isinstance(mask, hub.common.DecoderMask)
    np.testing.assert_array_equal(to_numpy(mask.segment_ids), ids)
    with pytest.raises(ValueError, match="argument `padding_mask`"):
        block._compute_attention_mask(x, ids, np.ones_like(ids), None, 0)


def test_a_packed_gemma3n_refuses_when_called():
    """Gemma 3n describes its masks now, but its packed rows are not checked: a packed
    Gemma 3n says so when called, naming `padding_mask`."""
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(ZOO["gemma3n"].build())
    hub.set_packed(swapped)
    inputs = {"token_ids": np.ones((1, ROW), "int32"), "padding_mask": np.ones((1, ROW), "int32")}
    with pytest.raises(ValueError, match="padding_mask.*not checked yet"):
        swapped(inputs)


def test_a_packed_qwen3_5_refuses_when_called():
    """Qwen3.5's full-attention blocks describe their masks (as Llama's), but its
    linear-attention blocks carry a recurrent state across documents: `set_packed`
    takes the model, and a call says why it cannot pack, naming `padding_mask`."""
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = keras_mha.swap(ZOO["qwen3_5"].build())
    hub.set_packed(swapped)
    ids = np.repeat([[1, 2]], ROW // 2, axis=1).astype("int32")
    inputs = ZOO["qwen3_5"].inputs(np.ones_like(ids), ids)
    with pytest.raises(ValueError, match="argument `padding_mask`.*recurrent state"):
        swapped(inputs)
    hub.set_packed(swapped, False)
    assert np.isfinite(to_numpy(swapped(inputs))).all()


@pytest.mark.parametrize("name", ["qwen_moe", "qwen3_moe"])
def test_the_moe_router_reads_of_a_described_mask_what_it_reads_of_the_dense_one(name):
    """The sparse MoE block of Qwen-MoE and Qwen3-MoE reads its decoder's mask only as
    `ops.any(mask, axis=-1)` (which tokens its load-balancing loss counts): given the
    described mask, it gets the same `(B, T)` truth values as from keras-hub's dense
    `(B, T, T)` mask, for padding anywhere in a row (left, right, holes)."""
    model, swapped = _models(name)
    own = model.backbone.transformer_layers[0]
    block = swapped.backbone.transformer_layers[0]
    padding = np.array([[0, 0, 1, 1, 1, 0], [1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], "int32")
    x = keras.ops.ones((3, 6, 16))
    arguments = dict(
        decoder_sequence=x,
        decoder_padding_mask=padding,
        decoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
    )
    dense = own._compute_self_attention_mask(**arguments)
    hub.set_packed(swapped, False)
    try:
        described = block._compute_self_attention_mask(**arguments)
    finally:
        hub.set_packed(swapped)
    assert isinstance(described, hub.common.DecoderMask)
    reduced = hub.common.queries_seeing_a_key(described, x)
    assert tuple(reduced.shape) == (3, 6, 1)
    np.testing.assert_array_equal(
        to_numpy(reduced)[..., 0], to_numpy(keras.ops.any(dense, axis=-1))
    )
    # Packed, the padding mask holds document ids: a token counts when it is in one.
    packed = block._compute_self_attention_mask(**arguments)
    reduced = hub.common.queries_seeing_a_key(packed, x)
    np.testing.assert_array_equal(to_numpy(reduced)[..., 0], padding != 0)
