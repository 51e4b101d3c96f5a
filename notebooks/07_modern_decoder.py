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
# # A modern decoder block: GQA, QK-norm, RoPE, soft-capping, sinks and a KV cache
#
# Llama, Mistral, Gemma and GPT-OSS each carry their own attention class in keras-hub.
# Here one `keras_mha.MultiHeadAttention` is all of them at once: grouped-query
# attention, QK-norm, rotary embeddings, a sliding window, logit soft-capping and
# attention sinks. We build a small decoder with it, train it to continue a pattern,
# then generate token by token with the KV cache and check that decoding one token at a
# time gives exactly what one causal call over the whole sequence gives.

# %% [markdown]
# Everything below runs on the backend named by `KERAS_BACKEND` (tensorflow, jax or
# torch), printed by the first cell; the outputs stored in this file come from jax on
# a 2-core CPU. Every number and picture is computed here, from a fixed seed.

# %%
import keras
import matplotlib.pyplot as plt
import numpy as np
from keras import ops

import keras_mha

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
keras.utils.set_random_seed(0)

# %% [markdown]
# ## The block
#
# Pre-norm residual attention and a SwiGLU feed-forward, as in Llama. The attention:
#
# - 8 query heads sharing 2 key/value heads (`num_key_value_heads=2`),
# - queries and keys RMS-normalised per head (`normalize_qk=True`, Gemma 3, OLMo 2),
# - rotated by position (`rope_max_wavelength=10_000`, keras-hub's `RotaryEmbedding`),
# - seeing at most the last 16 positions (`sliding_window=16`, Mistral),
# - logits soft-capped at 30 (`logit_soft_cap=30.0`, Gemma 2),
# - and a learned sink per head (`use_sinks=True`, GPT-OSS).


# %%
class DecoderBlock(keras.layers.Layer):
    def __init__(self, dim, heads, **kwargs):
        super().__init__(**kwargs)
        self.attention_norm = keras.layers.RMSNormalization()
        self.attention = keras_mha.MultiHeadAttention(
            num_heads=heads,
            key_dim=dim // heads,
            num_key_value_heads=2,
            normalize_qk=True,
            rope_max_wavelength=10_000,
            sliding_window=16,
            logit_soft_cap=30.0,
            use_sinks=True,
            use_bias=False,
        )
        self.mlp_norm = keras.layers.RMSNormalization()
        self.gate = keras.layers.Dense(4 * dim, use_bias=False)
        self.up = keras.layers.Dense(4 * dim, use_bias=False)
        self.down = keras.layers.Dense(dim, use_bias=False)

    def call(self, x, cache=None, index=None):
        h = self.attention_norm(x)
        if cache is None:
            h = self.attention(h, h, use_causal_mask=True)
        else:
            h, cache = self.attention(
                h, h, cache=cache, cache_update_index=index, use_causal_mask=True
            )
        x = x + h
        h = self.mlp_norm(x)
        x = x + self.down(keras.activations.silu(self.gate(h)) * self.up(h))
        return x if cache is None else (x, cache)


class Decoder(keras.Model):
    def __init__(self, vocab, dim=64, heads=8, depth=2, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(vocab, dim)
        self.blocks = [DecoderBlock(dim, heads) for _ in range(depth)]
        self.norm = keras.layers.RMSNormalization()
        self.head = keras.layers.Dense(vocab)

    def call(self, tokens, caches=None, index=None):
        x = self.embed(tokens)
        new_caches = []
        for i, block in enumerate(self.blocks):
            if caches is None:
                x = block(x)
            else:
                x, cache = block(x, cache=caches[i], index=index)
                new_caches.append(cache)
        logits = self.head(self.norm(x))
        return logits if caches is None else (logits, new_caches)


# %% [markdown]
# ## The task: continue a pattern
#
# Each sequence repeats a random motif of 3 to 6 tokens. Once the motif has appeared,
# every next token is predictable by looking back one period: attention has to find it.

# %%
VOCAB, LENGTH = 16, 32
rng = np.random.default_rng(0)


def sequences(count):
    out = np.empty((count, LENGTH + 1), "int32")
    for row in out:
        motif = rng.integers(1, VOCAB, size=rng.integers(3, 7))
        row[:] = np.resize(motif, LENGTH + 1)
    return out


train, test = sequences(4000), sequences(200)
print(train[0, :24])

# %%
model = Decoder(VOCAB)
model.compile(
    optimizer=keras.optimizers.Adam(3e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
history = model.fit(train[:, :-1], train[:, 1:], batch_size=64, epochs=4, verbose=0)
print("train accuracy per epoch:", np.round(history.history["accuracy"], 3))
_, accuracy = model.evaluate(test[:, :-1], test[:, 1:], verbose=0)
print(f"held-out next-token accuracy: {accuracy:.3f}")

# %% [markdown]
# The first period of each sequence is unpredictable (the motif is random), so the
# ceiling is below 1; past it, the model reads the answer one period back.

# %% [markdown]
# ## Decoding with the KV cache
#
# Each block keeps a cache of its projected keys and values, shaped
# `(batch, 2, max_length, num_key_value_heads, key_dim)` (keras-hub's layout): with 2 key/value
# heads for 8 query heads it is a quarter of the size multi-head attention would need.
# Keys are rotated at their own position before they are written, so a cached key never
# has to be rotated again.

# %%
prompt = test[:4, :12]
caches = [block.attention.init_cache(4, LENGTH) for block in model.blocks]
tokens = prompt
logits, caches = model(ops.convert_to_tensor(prompt), caches=caches, index=0)  # the prompt
generated = [ops.convert_to_numpy(ops.argmax(logits[:, -1], axis=-1))]
for t in range(prompt.shape[1], LENGTH - 1):
    step = ops.convert_to_tensor(generated[-1][:, None].astype("int32"))
    logits, caches = model(step, caches=caches, index=t)  # one token, over the cache
    generated.append(ops.convert_to_numpy(ops.argmax(logits[:, -1], axis=-1)))
generated = np.stack(generated, axis=1)
for row in range(2):
    print("prompt   ", prompt[row])
    print("generated", generated[row, :20])
    print("expected ", test[row, 12:32])
print("generated tokens correct:", (generated == test[:4, 12:LENGTH]).mean())

# %% [markdown]
# One causal call over the whole sequence gives the same logits as the cache, token by
# token (up to float32 rounding):

# %%
sequence = ops.convert_to_tensor(test[:4, :LENGTH])
full = ops.convert_to_numpy(model(sequence))
caches = [block.attention.init_cache(4, LENGTH) for block in model.blocks]
steps = []
for t in range(LENGTH):
    logits, caches = model(sequence[:, t : t + 1], caches=caches, index=t)
    steps.append(ops.convert_to_numpy(logits))
print(
    "largest difference, token by token vs one call:", np.abs(np.concatenate(steps, 1) - full).max()
)

# %% [markdown]
# ## Where the heads look, and what the sinks take
#
# The scores of the first block for one sequence: the window keeps each query within the
# last 16 positions, and the diagonal bands one period back are the motif being read. A
# row sums to less than 1: the rest went to the head's sink.

# %%
block = model.blocks[0]
h = block.attention_norm(model.embed(sequence[:1]))
_, scores = block.attention(h, h, use_causal_mask=True, return_attention_scores=True)
scores = ops.convert_to_numpy(scores)[0]
sinks = ops.convert_to_numpy(block.attention._sinks.sinks)
fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
for head, ax in enumerate(axes):
    ax.imshow(scores[head], cmap="viridis")
    kept = scores[head].sum(-1).mean()
    ax.set_title(f"head {head}: sink logit {sinks[head]:.2f}\nmean row sum {kept:.2f}")
    ax.set_xlabel("key position")
axes[0].set_ylabel("query position")
fig.tight_layout()
plt.show()
print("pattern:", test[0, :16])

# %% [markdown]
# ## An attention bias: ALiBi
#
# `attention_bias` is added to the logits, after the soft cap and before the masks. Here
# ALiBi's per-head linear penalty on distance, broadcast over the batch, on a fresh
# layer: with a steep slope a head looks at its nearest keys.

# %%
heads = 4
layer = keras_mha.MultiHeadAttention(num_heads=heads, key_dim=8)
x = np.random.default_rng(1).normal(size=(1, 12, 32)).astype("float32")
slopes = 2.0 ** -np.arange(0, 2 * heads, 2)  # 1, 1/4, 1/16, 1/64
distance = np.abs(np.arange(12)[None, :] - np.arange(12)[:, None])
alibi = (-slopes[:, None, None] * distance)[None].astype("float32")  # (1, heads, T, S)
_, scores = layer(x, x, attention_bias=alibi, use_causal_mask=True, return_attention_scores=True)
scores = ops.convert_to_numpy(scores)[0]
fig, axes = plt.subplots(1, heads, figsize=(12, 3))
for head, ax in enumerate(axes):
    ax.imshow(scores[head], cmap="magma")
    ax.set_title(f"slope {slopes[head]:g}")
fig.tight_layout()
plt.show()
