# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fine-tuning a keras-hub Llama on packed documents
#
# keras-hub fine-tunes a `CausalLM` on rows padded to the batch's longest text, so with
# long-tailed lengths most of each step goes to padding. Here a tiny keras-hub Llama
# moves onto our layer (`keras_mha.swap`) and reads its `padding_mask` as document ids
# (`keras_mha.hub.set_packed`); `keras_mha.packing_text` turns text into packed rows
# with the model's own tokenizer. We look at the rows, fine-tune, check that a packed
# document gets the loss keras-hub's own model gives it alone, and time packed against
# padded steps.

# %% [markdown]
# Everything below runs on the backend named by `KERAS_BACKEND` (tensorflow, jax or
# torch), printed by the first cell; the outputs stored in this file come from jax on
# a 2-core CPU. Every number and picture is computed here, from a fixed seed.

# %%
import io
import time
import warnings

import keras
import keras_hub
import matplotlib.pyplot as plt
import numpy as np
import sentencepiece
from matplotlib.patches import Patch

import keras_mha
from keras_mha import hub, packing, packing_text

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)

# %% [markdown]
# ## Documents and the model's tokenizer
#
# Each document recites a cycle of words from a random start (so the next word is
# predictable within a document, never across two); lengths are lognormal (median 12
# words, capped), as real fine-tuning data's are. A real run would load the tokenizer
# of a preset (`LlamaCausalLMPreprocessor.from_preset(...)`); here we train a tiny
# SentencePiece vocabulary on the spot, so the notebook needs no download.

# %%
WORDS = "red orange yellow green blue indigo violet black white grey brown pink".split()
lengths = np.minimum(np.round(rng.lognormal(np.log(12), 0.9, 160)).astype(int) + 1, 120)
texts = [
    " ".join(WORDS[(s + i) % len(WORDS)] for i in range(n))
    for s, n in zip(rng.integers(0, len(WORDS), len(lengths)), lengths)
]

proto = io.BytesIO()
sentencepiece.SentencePieceTrainer.train(
    sentence_iterator=iter(texts),
    model_writer=proto,
    vocab_size=len(WORDS) + 4,
    model_type="word",
    pad_id=0,
    unk_id=1,
    bos_id=2,
    eos_id=3,
    pad_piece="<pad>",
    unk_piece="<unk>",
    bos_piece="<s>",
    eos_piece="</s>",
    minloglevel=2,
)
tokenizer = keras_hub.models.LlamaTokenizer(proto=proto.getvalue())
preprocessor = keras_hub.models.LlamaCausalLMPreprocessor(tokenizer)
print(texts[0])
print("tokens:", packing_text.tokenize(texts[:1], preprocessor)[0][0])

# %% [markdown]
# ## Text to packed rows
#
# `packing_text.pack_text` tokenizes each text as the preprocessor does (start token,
# the text, end token) and packs the documents into rows of `T` tokens, longest first,
# each in the first row with room. `segment_ids` number the documents of a row (0 is
# padding); `loss_mask` is true where the next token belongs to the same document.

# %%
T, BATCH = 128, 8
rows = packing_text.pack_text(texts, preprocessor, length=T)
documents = [d for d, _ in packing_text.tokenize(texts, preprocessor)]
real = sum(len(d) for d in documents)
print(f"{len(texts)} documents, {real} tokens, longest {max(map(len, documents))}")
print(f"packed: {len(rows['token_ids'])} rows of {T}, {real / rows['token_ids'].size:.0%} real")
padded_size = sum(
    len(g) * max(map(len, g))
    for g in (documents[i : i + BATCH] for i in range(0, len(documents), BATCH))
)
print(f"padded per batch of {BATCH}: {real / padded_size:.0%} real")

# %% [markdown]
# ## The row layout
#
# Packing places documents by their lengths only, so packing each document's *index*
# in place of its tokens tells which document sits where. Each document has its own
# colour, in both panels; padding is light grey.

# %%
where = packing.pack([np.full(len(d), i) for i, d in enumerate(documents)], T, pad_id=-1)
palette = np.concatenate([plt.get_cmap(c)(np.arange(20))[:, :3] for c in ("tab20", "tab20b")])
colour_of = palette[(np.arange(len(documents)) * 7) % len(palette)]  # neighbours differ
PADDING = np.array([0.88, 0.88, 0.88])


def picture(axes, index, title, ylabel):
    """Draws a grid of document indices (-1: padding), a white line between documents."""
    rgb = np.where(index[..., None] >= 0, colour_of[np.maximum(index, 0)], PADDING)
    axes.imshow(rgb, interpolation="nearest", aspect="auto")
    for r, row in enumerate(index):
        starts = np.flatnonzero(np.diff(row) != 0) + 0.5
        axes.vlines(starts, r - 0.5, r + 0.5, color="white", linewidth=0.8)
    axes.set(title=title, xlabel="position", ylabel=ylabel)


shown = 12
padded = np.full((shown, max(map(len, documents[:shown]))), -1)
for i, d in enumerate(documents[:shown]):
    padded[i, : len(d)] = i
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
picture(left, where["token_ids"], f"packed: all {len(texts)} documents", "row")
picture(right, padded, f"padded: the first {shown} documents", "document")
fig.legend(
    handles=[Patch(color=PADDING, label="padding (light grey); each colour: one document")],
    loc="lower center",
    frameon=False,
)
plt.tight_layout(rect=(0, 0.07, 1, 1))
plt.show()

# %% [markdown]
# ## A tiny keras-hub Llama, swapped and packed
#
# keras-hub's own `LlamaCausalLM` (2 layers, hidden 32); `keras_mha.swap` moves its
# attention onto our layer, `hub.set_packed` makes its blocks read `padding_mask` as the
# segment ids: attention stays inside each document and RoPE positions restart at 0 at
# each. `packing_text.fit_arrays` gives `fit` the inputs, the targets and the loss mask
# as sample weights. The same works for Mistral, Mixtral, Qwen 2/3 and their MoE, Phi-3,
# GPT-OSS, Gemma 1 to 3 (text) and SmolLM3; the keras-hub guide's table names the
# families that do not take packed rows, and why.

# %%
backbone = keras_hub.models.LlamaBackbone(
    vocabulary_size=tokenizer.vocabulary_size(),
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
)
model = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    lm = hub.set_packed(keras_mha.swap(model))
lm.compile(
    optimizer=keras.optimizers.Adam(1e-2),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
x, y, weights = packing_text.fit_arrays(rows)
history = lm.fit(x, y, sample_weight=weights, batch_size=4, epochs=8, verbose=0)
plt.figure(figsize=(4, 2.6))
plt.plot(history.history["loss"])
plt.xlabel("epoch")
plt.ylabel("loss (learned tokens)")
plt.show()
print(f"final training loss: {history.history['loss'][-1]:.3f}")

# %% [markdown]
# ## A packed document gets the loss it gets alone
#
# keras-hub's own model, given the fine-tuned weights, runs each document of the row
# holding the most documents alone (`padding_mask` all ones), as keras-hub would; the
# swapped model runs the packed row. The per-token losses agree.

# %%
model.set_weights(lm.get_weights())
most = int(np.argmax(rows["segment_ids"].max(axis=1)))
ids = rows["segment_ids"][most]
row = {k: v[most : most + 1] for k, v in x.items()}
per_token = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
packed_losses = keras.ops.convert_to_numpy(
    per_token(y[most : most + 1], lm.predict(row, verbose=0))
)[0]
largest = 0.0
for i in range(1, ids.max() + 1):
    at = np.flatnonzero(ids == i)
    tokens = rows["token_ids"][most, at][None]
    alone_logits = model.predict(
        {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}, verbose=0
    )
    alone = keras.ops.convert_to_numpy(per_token(y[most : most + 1, at], alone_logits))[0]
    largest = max(largest, np.abs(alone[:-1] - packed_losses[at][:-1]).max())
    print(
        f"document {i}: {len(at):3d} tokens, mean loss packed "
        f"{packed_losses[at][:-1].mean():.4f}, alone {alone[:-1].mean():.4f}"
    )
print(f"largest per-token loss difference: {largest:.1e}")
assert largest < 1e-4

# %% [markdown]
# (The last token of a document has no target inside it; `loss_mask` leaves it out, as
# here.) `tests/test_hub_packed.py` checks the same, logits and gradients, on every
# backend for random lengths; `tests/test_packing_text.py` checks the whole text
# pipeline against keras-hub's preprocessor.
#
# ## Tokens per second, packed against padded
#
# One pass of `train_on_batch` over all the documents: keras-hub's own model on batches
# of 8 documents padded to their longest (rounded up to a power of two, so that a few
# shapes compile), against the swapped model on the packed rows, 4 rows a step. A
# warm-up pass compiles every shape first. A tiny model on a CPU: the ratio, not the
# numbers, is the point; `benchmarks/hub_packed.py` measures a larger one.

# %%
order = rng.permutation(len(documents))
padded_batches = []
for s in range(0, len(documents), BATCH):
    group = [documents[i] for i in order[s : s + BATCH]]
    width = int(2 ** np.ceil(np.log2(max(map(len, group)))))
    tok = np.zeros((len(group), width), "int32")
    mask, sw = np.zeros_like(tok), np.zeros((len(group), width), "float32")
    tgt = np.zeros_like(tok)
    for j, d in enumerate(group):
        tok[j, : len(d)], mask[j, : len(d)] = d, 1
        tgt[j, : len(d) - 1], sw[j, : len(d) - 1] = d[1:], 1.0
    padded_batches.append(({"token_ids": tok, "padding_mask": mask}, tgt, sw))
packed_batches = [
    ({k: v[s : s + 4] for k, v in x.items()}, y[s : s + 4], weights[s : s + 4])
    for s in range(0, len(y), 4)
]
model.compile(
    optimizer=keras.optimizers.SGD(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)


def tokens_per_second(m, batches):
    for xb, yb, wb in batches:  # warm-up: every shape compiled
        m.train_on_batch(xb, yb, sample_weight=wb)
    start = time.perf_counter()
    for xb, yb, wb in batches:
        m.train_on_batch(xb, yb, sample_weight=wb)
    return real / (time.perf_counter() - start)


speeds = {
    "keras-hub, padded": tokens_per_second(model, padded_batches),
    "swapped, packed": tokens_per_second(lm, packed_batches),
}
for name, speed in speeds.items():
    print(f"{name}: {speed:,.0f} real tokens/s")
plt.figure(figsize=(4.5, 2.4))
plt.barh(list(speeds), list(speeds.values()), color=["#999999", "#1f77b4"])
plt.xlabel("real tokens / s (one CPU pass)")
plt.tight_layout()
plt.show()
