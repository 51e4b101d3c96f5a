# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Move your model to keras-mha
#
# You have a model on `keras.layers.MultiHeadAttention`, built the keras.io way: a
# `TransformerBlock` that creates the attention layer in its `__init__`, plus one
# attention layer at the top level of a functional model. This notebook saves it,
# swaps every attention layer for `keras_mha.MultiHeadAttention` (same configuration,
# same weights), checks that the outputs agree, and shows the two commands that do the
# same from a shell, on every installed backend.

# %%
import os
import subprocess
import sys
import tempfile

import keras
import numpy as np
from keras import layers

import keras_mha
from keras_mha import swapping

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
workdir = tempfile.mkdtemp(prefix="move-your-model-")

# %% [markdown]
# ## A model written for the built-in layer
#
# The block is registered with Keras, so that a `.keras` file can rebuild it. Its
# attention layer is created in `__init__`: it never appears in the model's config.

# %%
MODULE = """
import keras
from keras import layers


@keras.saving.register_keras_serializable(package="my_project")
class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.embed_dim, self.num_heads, self.ff_dim = embed_dim, num_heads, ff_dim
        self.rate = rate
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)

    def get_config(self):
        return {**super().get_config(), "embed_dim": self.embed_dim,
                "num_heads": self.num_heads, "ff_dim": self.ff_dim, "rate": self.rate}
"""
with open(os.path.join(workdir, "my_project_layers.py"), "w") as f:
    f.write(MODULE)
sys.path.insert(0, workdir)
import my_project_layers  # noqa: E402

keras.utils.set_random_seed(0)
vocab, maxlen, embed = 200, 32, 32
tokens = keras.Input((maxlen,), dtype="int32", name="tokens")
x = layers.Embedding(vocab, embed, mask_zero=True)(tokens)
x = my_project_layers.TransformerBlock(embed, 2, 64, name="block")(x)
x = layers.MultiHeadAttention(2, 16, name="causal_attention")(x, x, use_causal_mask=True)
x = layers.GlobalAveragePooling1D()(x)
outputs = layers.Dense(2, activation="softmax", name="classes")(x)
model = keras.Model(tokens, outputs, name="classifier")
model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")

path = os.path.join(workdir, "classifier.keras")
model.save(path)
print(path)

# %% [markdown]
# ## Swap it in Python
#
# `keras_mha.swap(model)` returns a new model; the original is not changed. The report
# lists each attention layer by its path: layer names inside models, attribute names
# inside your layers (`block/att` is the block's `self.att`).

# %%
swapped = keras_mha.swap(model)
for row in swapping.swap_report(model, swapped):
    print(f"{row['path']:18} {row['before']} -> {row['after']}   ({row['config']})")
print("weights:", len(model.weights), "before,", len(swapped.weights), "after")

# %% [markdown]
# Same inputs, same outputs: a padded batch (token 0 is padding), whose mask reaches the
# pooling, so padded positions do not count.

# %%
rng = np.random.default_rng(0)
batch = rng.integers(1, vocab, (4, maxlen)).astype("int32")
batch[0, 20:] = 0
batch[1, 5:] = 0
difference = np.abs(swapped.predict_on_batch(batch) - model.predict_on_batch(batch)).max()
print(f"largest output difference: {difference:.1e}")
assert difference <= 1e-4

# %% [markdown]
# `keras_mha.save_swapped` writes a file that loads with our layers in place after
# `import keras_mha`, also with `safe_mode=True`. (A plain `model.save` would rebuild
# the block's attention on the built-in when loaded: its config does not describe it.)

# %%
out = os.path.join(workdir, "classifier-swapped.keras")
keras_mha.save_swapped(swapped, out)
loaded = keras.saving.load_model(out, safe_mode=True)
print(type(loaded.get_layer("block").att))
print(type(loaded.get_layer("causal_attention")))

# %% [markdown]
# Code that builds its own layers can run under `keras_mha.swapped()`: while it is
# active, `layers.MultiHeadAttention(...)` constructs ours.

# %%
with keras_mha.swapped():
    block = my_project_layers.TransformerBlock(embed, 2, 64)
print(type(block.att))

# %% [markdown]
# ## The same from a shell
#
# `keras-mha swap` loads, swaps, checks the outputs on inputs synthesized from the
# model's input specs (unpadded, and padded: trailing zeros in the token ids that reach
# `Embedding(mask_zero=True)`) and writes the swapped file; `--import` names the module that
# registers the custom layers. `keras-mha compare --model` compares outputs and weight
# gradients on both kinds of inputs and times predict and train steps on each installed
# backend, each in its own process, with the peak memory of each model. Exit status: 0
# within tolerance, 1 above, 2 on a usage error. (`python -m keras_mha` is the same command.)


# %%
def keras_mha_cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([workdir, *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "keras_mha", *args],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
    )
    print(done.stdout[-4000:], done.stderr[-2000:])
    return done.returncode


status = keras_mha_cli(
    "swap",
    path,
    "cli-swapped.keras",
    "--import",
    "my_project_layers",
    "--backend",
    keras.backend.backend(),
)
print("exit status:", status)
assert status == 0

# %%
status = keras_mha_cli(
    "compare",
    "--model",
    path,
    "--import",
    "my_project_layers",
    "--backend",
    keras.backend.backend(),
    "--repeats",
    "3",
    "--plot",
    "compare-model.png",
)
print("exit status:", status)
assert status == 0

# %% [markdown]
# `--plot` draws the time and memory ratios (ours / built-in) of the model:

# %%
from IPython.display import Image  # noqa: E402

Image(filename=os.path.join(workdir, "compare-model.png"))

# %% [markdown]
# A usage error is one line naming what is wrong, with exit status 2; nothing is
# written. Here the module that registers `TransformerBlock` is not imported:

# %%
status = keras_mha_cli("swap", path, "never-written.keras")
print("exit status:", status)
assert status == 2 and not os.path.exists(os.path.join(workdir, "never-written.keras"))
