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
# # Packed sequences: several documents per row, attention kept inside each
#
# Documents come in very different lengths. Padding every batch to its longest
# document spends most of the compute on padding; packing fills each row of `T` tokens
# with several documents instead. The layer's `segment_ids` say which document each
# position belongs to, so a query attends only to its own document, and RoPE positions
# restart at each document. Here we pack documents of long-tailed lengths, look at the
# rows, train a small causal language model on them, and check that a packed document
# gets exactly the loss it gets alone in its own row.

# %% [markdown]
# Everything below runs on the backend named by `KERAS_BACKEND` (tensorflow, jax or
# torch), printed by the first cell; the outputs stored in this file come from jax on
# a 2-core CPU. Every number and picture is computed here, from a fixed seed.

# %%
import keras
import matplotlib.pyplot as plt
import numpy as np
from keras import ops
from matplotlib.patches import Patch

import keras_mha
from keras_mha import packing

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)

# %% [markdown]
# ## Documents of long-tailed lengths
#
# Each document counts up from a random start by a random step (modulo the
# vocabulary), so the next token is predictable from the two before it, within a
# document only. Lengths are lognormal (median 12, capped at 64), as real documents'
# lengths are: many short ones, a few long ones.

# %%
VOCAB, T = 32, 64
lengths = np.minimum(np.round(rng.lognormal(np.log(12), 0.8, 300)).astype(int) + 2, T)


def document(length):
    start, step = rng.integers(1, VOCAB), rng.integers(1, 4)
    return (start + step * np.arange(length)) % (VOCAB - 1) + 1  # tokens 1..VOCAB-1


documents = [document(n) for n in lengths]
print(
    f"{len(documents)} documents, {lengths.sum()} tokens, median length "
    f"{int(np.median(lengths))}, longest {lengths.max()}"
)

# %% [markdown]
# ## Packing them
#
# `packing.pack` places documents longest first, each in the first row with room
# (first-fit decreasing). Each row gets `token_ids`, `segment_ids` (1, 2, ... per
# document, 0 for padding), `positions` (restarting at each document), the next-token
# `targets` and a `loss_mask` that is true only where the next token belongs to the
# same document.

# %%
rows = packing.pack(documents, length=T)
packed_fill = (rows["segment_ids"] > 0).mean()
batch = 16
padded_tokens = sum(
    len(group) * max(len(d) for d in group)
    for group in (documents[i : i + batch] for i in range(0, len(documents), batch))
)
print(f"packed: {len(rows['token_ids'])} rows of {T}, {packed_fill:.0%} real tokens")
print(f"padded per batch of {batch}: {lengths.sum() / padded_tokens:.0%} real tokens")

# %% [markdown]
# Which document sits where: `pack` places documents by their lengths only, so packing
# each document's *index* in place of its tokens gives the layout. Each document has
# its own colour, the same in both panels, a white line between two documents; padding
# is light grey.

# %%
where = packing.pack([np.full(n, i) for i, n in enumerate(lengths)], T, pad_id=-1)
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


padded = np.full((batch, lengths[:batch].max()), -1)
for i, n in enumerate(lengths[:batch]):
    padded[i, :n] = i
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
picture(left, where["token_ids"][:12], "packed: the first 12 rows", "row")
picture(right, padded, f"padded: the first batch of {batch}, to its longest", "document")
fig.legend(
    handles=[Patch(color=PADDING, label="padding (light grey); each colour: one document")],
    loc="lower center",
    frameon=False,
)
plt.tight_layout(rect=(0, 0.07, 1, 1))
plt.show()

# %% [markdown]
# Inside one row (here the one holding the most documents) the attention is block
# diagonal, and causal within each block:

# %%
most = int(np.argmax(rows["segment_ids"].max(axis=1)))
ids = rows["segment_ids"][most]
allowed = (ids[:, None] == ids[None, :]) & (ids[:, None] > 0) & np.tri(T, dtype=bool)
plt.figure(figsize=(3.6, 3.6))
plt.imshow(allowed, cmap="Greys", interpolation="nearest")
plt.title(f"row {most}: who may attend to whom")
plt.xlabel("key")
plt.ylabel("query")
plt.show()

# %% [markdown]
# ## A small causal language model on packed rows
#
# Token embeddings, one attention layer with RoPE (positions derived from the segment
# ids) and a feed-forward layer. The model takes `T` unknown (`None`), so the same
# model also runs one document alone.

# %%
DIM = 32
tokens = keras.Input((None,), dtype="int32", name="token_ids")
segments = keras.Input((None,), dtype="int32", name="segment_ids")
x = keras.layers.Embedding(VOCAB, DIM)(tokens)
attention = keras_mha.MultiHeadAttention(4, 8, rope_max_wavelength=1_000.0)
x = x + attention(x, x, segment_ids=segments, use_causal_mask=True)
x = x + keras.layers.Dense(DIM)(keras.layers.Dense(4 * DIM, activation="gelu")(x))
logits = keras.layers.Dense(VOCAB)(keras.layers.LayerNormalization()(x))
model = keras.Model([tokens, segments], logits)
model.compile(
    optimizer=keras.optimizers.Adam(3e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
history = model.fit(
    [rows["token_ids"], rows["segment_ids"]],
    rows["targets"],
    sample_weight=rows["loss_mask"].astype("float32"),
    batch_size=8,
    epochs=12,
    verbose=0,
)
plt.figure(figsize=(4, 2.6))
plt.plot(history.history["loss"])
plt.xlabel("epoch")
plt.ylabel("loss (masked tokens only)")
plt.show()
print(f"final training loss: {history.history['loss'][-1]:.3f}")

# %% [markdown]
# ## A packed document gets the loss it gets alone
#
# The per-token losses of every document in the row holding the most documents,
# computed in the packed row and with each document alone in its own row (segment ids
# all 1, positions from 0):
# the same numbers, because no attention crosses documents and RoPE restarts.


# %%
def token_losses(token_ids, segment_ids, targets):
    out = model.predict([token_ids, segment_ids], verbose=0)
    return ops.convert_to_numpy(
        keras.losses.sparse_categorical_crossentropy(targets, out, from_logits=True)
    )


row = slice(most, most + 1)
packed_losses = token_losses(
    rows["token_ids"][row], rows["segment_ids"][row], rows["targets"][row]
)[0]
largest = 0.0
for i in range(1, rows["segment_ids"][most].max() + 1):
    where = np.flatnonzero(rows["segment_ids"][most] == i)
    alone_tokens = rows["token_ids"][row][:, where]
    alone = token_losses(alone_tokens, np.ones_like(alone_tokens), rows["targets"][row][:, where])[
        0
    ]
    difference = np.abs(alone[:-1] - packed_losses[where][:-1]).max()
    largest = max(largest, difference)
    print(
        f"document {i}: {len(where):2d} tokens, mean loss packed "
        f"{packed_losses[where][:-1].mean():.4f}, alone {alone[:-1].mean():.4f}"
    )
print(f"largest per-token loss difference: {largest:.1e}")
assert largest < 1e-4

# %% [markdown]
# The last token of each document has no target inside it (`loss_mask` is false
# there), so it is left out above, as in training. The same check, outputs and
# gradients, runs in the tests for every backend and kernel, with random document
# lengths (`tests/test_properties.py`, `tests/test_layer_packed.py`).
