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
# # A `(None, 6, 8)` input: shapes, masks and attention scores
#
# The question: *what is the correct way to use a Keras MultiHeadAttention layer
# with a tensor of shape `(None, 6, 8)`?* Batch of any size, 6 positions, 8
# features. A popular answer gets three things wrong, which we check here:
#
# 1. `key_dim` does **not** have to match the input's last dimension (8): it is
#    the size of *each head*; the output is projected back to 8 anyway.
# 2. `return_attention_scores` is a **call** argument of Keras 3's built-in layer,
#    whose constructor rejects it. `keras_mha` accepts both (the call wins).
# 3. Scores are `(batch, heads, 6, 6)` only for self-attention; in general they
#    are `(batch, heads, T, S)`, `S` the length of the value.
#
# Then masks (padding from `Embedding(mask_zero=True)`, causal) and attention
# over more than one axis (images, video).

# %% [markdown]
# Everything below runs on the backend named by `KERAS_BACKEND` (tensorflow, jax or
# torch), printed by the first cell; the outputs stored in this file come from jax on
# a 2-core CPU. Every number and picture is computed here, from a fixed seed.

# %%
import keras
import matplotlib.pyplot as plt
import numpy as np

import keras_mha

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
keras.utils.set_random_seed(0)

# %% [markdown]
# ## Self-attention in a functional model
#
# The same tensor is query, key and value. The output has the query's shape.

# %%
inputs = keras.Input(shape=(6, 8))
layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8)
outputs = layer(inputs, inputs)
model = keras.Model(inputs, outputs)
print("symbolic output:", outputs.shape)

batch = np.random.default_rng(0).standard_normal((10, 6, 8)).astype("float32")
print("on a batch of 10:", model(batch).shape)

# %% [markdown]
# ## Attention scores: a call argument (and, here, a constructor argument)

# %%
output, scores = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8)(
    inputs, inputs, return_attention_scores=True
)
print("call argument:        output", output.shape, " scores", scores.shape)

layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8, return_attention_scores=True)
output, scores = layer(inputs, inputs)
print("constructor argument: output", output.shape, " scores", scores.shape)
print("the call overrides it:", layer(inputs, inputs, return_attention_scores=False).shape)

try:
    keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, return_attention_scores=True)
except Exception as error:
    print(f"built-in constructor: {type(error).__name__}: {error}")

# %% [markdown]
# ## `key_dim` is per head, and need not be 8
#
# Any positive `key_dim` works on an 8-wide input: the kernels are
# `(8, num_heads, key_dim)` and the output projection maps back to 8
# (or to `output_shape` when given).

# %%
for key_dim in (2, 8, 32):
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=key_dim)
    out = layer(inputs, inputs)
    print(
        f"key_dim={key_dim:>2}: query kernel {tuple(layer.query_dense.kernel.shape)}, "
        f"output {out.shape}"
    )
wide = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, output_shape=16)
print("output_shape=16:", wide(inputs, inputs).shape)

# %% [markdown]
# ## Cross-attention: the scores are `(B, heads, T, S)`
#
# A 6-step query attending over a 10-step value. The built-in layer computes the
# right scores when it runs, but its *symbolic* shape (what a functional model is
# built from) says `(None, 2, 6, 6)`.

# %%
memory = keras.Input(shape=(10, 8))
for cls in (keras_mha.MultiHeadAttention, keras.layers.MultiHeadAttention):
    _, symbolic = cls(num_heads=2, key_dim=8)(inputs, memory, return_attention_scores=True)
    _, concrete = cls(num_heads=2, key_dim=8)(
        batch, np.zeros((10, 10, 8), "float32"), return_attention_scores=True
    )
    print(
        f"{cls.__module__.split('.')[0]:>9}: symbolic scores {symbolic.shape}, "
        f"computed {tuple(concrete.shape)}"
    )

# %% [markdown]
# ## Separate query, key and value
#
# There is no need for `Dense` layers in front of the attention layer to make
# query, key and value: the layer has its own projection for each. Key and value
# may even have different widths from the query and from each other; they must
# share the sequence length `S`.

# %%
query = keras.Input(shape=(6, 8), name="query")
key = keras.Input(shape=(10, 4), name="key")
value = keras.Input(shape=(10, 12), name="value")
layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=5, name="mha")
output, scores = layer(query, value, key=key, return_attention_scores=True)
print("output", output.shape, " scores", scores.shape)
for w in layer.weights:
    print(f"    {w.path:<28} {tuple(w.shape)}")

# %% [markdown]
# ## Padding masks from `Embedding(mask_zero=True)`
#
# Token id 0 is padding. The embedding attaches a mask to its output and the layer
# picks it up for the query (padded query rows) and the value (padded key
# columns), with no mask argument. A padded query row has no key to attend to in
# the combined mask: `keras_mha` gives it zero weights.

# %%
ids = np.array([[5, 3, 8, 1, 0, 0], [2, 9, 4, 7, 6, 0]], "int32")
embedding = keras.layers.Embedding(20, 8, mask_zero=True)
embedded = embedding(ids)
padding_mask = keras.ops.convert_to_numpy(embedding.compute_mask(ids))
print("padding mask:\n", padding_mask.astype(int))

layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8)
_, padded_scores = layer(embedded, embedded, return_attention_scores=True)
padded_scores = keras.ops.convert_to_numpy(padded_scores)
print("weight on padded keys:", float(padded_scores[0][..., 4:].max()))
print("row sums, sequence 0, head 0:", padded_scores[0, 0].sum(-1).round(3))


# %% [markdown]
# ## Causal masks
#
# `use_causal_mask=True`: position `t` attends only to positions `s <= t`. It
# combines with the padding mask.


# %%
def scores_of(x, **kwargs):
    _, s = layer(x, x, return_attention_scores=True, **kwargs)
    return keras.ops.convert_to_numpy(s)


causal_scores = scores_of(embedded, use_causal_mask=True)
causal_only = scores_of(batch[:1, :, :], use_causal_mask=True)  # no padding
causal = np.tril(np.ones((6, 6), bool))
padding_pairs = padding_mask[0][:, None] & padding_mask[0][None, :]
combined = causal & padding_pairs
print("weight above the diagonal:", float(np.triu(causal_scores[0, 0], 1).max()))

panels = [
    ("padding mask (black: may attend)", padding_pairs),
    ("causal mask", causal),
    ("both", combined),
    ("scores, padding only (head 0)", padded_scores[0, 0]),
    ("scores, causal only (head 0)", causal_only[0, 0]),
    ("scores, both (head 0)", causal_scores[0, 0]),
]
fig, axes = plt.subplots(2, 3, figsize=(10, 6.6))
for ax, (title, image) in zip(axes.flat, panels):
    ax.imshow(image, cmap="Greys" if image.dtype == bool else "viridis", vmin=0, vmax=1)
    ax.set(title=title, xlabel="key position s", ylabel="query position t")
    ax.set_xticks(range(6))
    ax.set_yticks(range(6))
plt.tight_layout()
plt.show()

# %% [markdown]
# Each row of scores sums to 1 over the keys it may see; masked keys get exactly
# 0. With padding, the two padded query rows of sequence 0 are all zeros: padded
# queries attend to nothing (the built-in layer's result for such rows depends on
# its code path).
#
# ## `attention_axes`: images and video
#
# With a `(B, H, W, C)` image, `attention_axes=(1, 2)` lets every pixel attend to
# every pixel: the same as flattening `H * W` into a sequence, with the same
# weights. `attention_axes=2` attends along each row only.

# %%
image = np.random.default_rng(1).standard_normal((2, 4, 5, 8)).astype("float32")
pixels = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8, attention_axes=(1, 2))
out2d, scores2d = pixels(image, image, return_attention_scores=True)
print("attention_axes=(1, 2): output", tuple(out2d.shape), " scores", tuple(scores2d.shape))

flat = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8)
sequence = image.reshape(2, 20, 8)
flat.build(sequence.shape, sequence.shape)
flat.set_weights(pixels.get_weights())
out_flat = keras.ops.convert_to_numpy(flat(sequence, sequence))
diff = np.abs(keras.ops.convert_to_numpy(out2d).reshape(2, 20, 8) - out_flat).max()
print("max |difference| from the flattened sequence:", float(diff))

rows = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8, attention_axes=2)
_, row_scores = rows(image, image, return_attention_scores=True)
print("attention_axes=2:      scores", tuple(row_scores.shape), "(B, H, heads, W, W)")

# %%
scores2d = keras.ops.convert_to_numpy(scores2d)
pixel = (1, 2)
fig, axes = plt.subplots(1, 3, figsize=(11, 3))
for head in range(2):
    ax = axes[head]
    ax.imshow(scores2d[0, head, pixel[0], pixel[1]], cmap="viridis")
    ax.scatter([pixel[1]], [pixel[0]], c="red", marker="x")
    ax.set(title=f"head {head}: where pixel {pixel} looks", xlabel="w", ylabel="h")
axes[2].imshow(scores2d[0, 0].reshape(20, 20), cmap="viridis")
axes[2].set(title="head 0 as a (H*W, H*W) matrix", xlabel="key pixel", ylabel="query pixel")
plt.tight_layout()
plt.show()

# %% [markdown]
# Video `(B, frames, H, W, C)`: attention within each frame over axes `(2, 3)`.
# Across frames at each pixel is one attention axis, `1`; we flatten `H, W` into
# one axis first, `(B, frames, H * W, C)`, because with a single attention axis on
# a 5-D input the scores have 6 dimensions, more than TensorFlow's CPU softmax
# accepts (the built-in layer fails there too). The scores put the non-attended
# axes first, then heads, then the query and key positions.

# %%
video = np.random.default_rng(2).standard_normal((1, 3, 4, 4, 8)).astype("float32")
frames_of_pixels = video.reshape(1, 3, 16, 8)
for x, axes, meaning in [
    (video, (2, 3), "spatial, per frame"),
    (frames_of_pixels, 1, "temporal, per pixel"),
]:
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8, attention_axes=axes)
    out, scores = layer(x, x, return_attention_scores=True)
    print(
        f"input {x.shape}, attention_axes={axes!s:<7} ({meaning}): "
        f"output {tuple(out.shape)}, scores {tuple(scores.shape)}"
    )
