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
# # `keras_mha` against `keras.layers.MultiHeadAttention`
#
# `keras_mha.compare` is the engine behind `keras-mha compare`: for each case it
# builds a model around each layer, copies the built-in's weights into ours,
# compares outputs, attention scores and input gradients, then times inference
# and a training step for both. Here we run its quick settings on the current
# backend only (the command line runs every backend, each in its own process),
# show the results as tables and plots, and then look closer at the cases where
# the built-in layer is wrong or fails.

# %% [markdown]
# Everything below runs on the backend named by `KERAS_BACKEND` (tensorflow, jax or
# torch), printed by the first cell; the outputs stored in this file come from jax on
# a 2-core CPU. Every number and picture is computed here, from a fixed seed.

# %%
import logging
import time

import keras
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

import keras_mha
from keras_mha import compare

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
keras.utils.set_random_seed(0)

# %%
for case in compare.DEFAULT_CASES:
    query_shape, value_shape = case.shapes(quick=True)
    print(
        f"{case.name:<12} query {query_shape}, value {value_shape or 'query'}, "
        f"{case.layer_kwargs} {case.call_kwargs or ''}"
    )

# %%
logging.getLogger("absl").setLevel(logging.CRITICAL)  # the built-in's JAX traceback

start = time.perf_counter()
records = compare.run_cases(compare.DEFAULT_CASES, quick=True, repeats=2)
seconds = time.perf_counter() - start
print(f"{len(records)} cases on {keras.backend.backend()} in {seconds:.0f} s")
print(compare.summary(records))


# %% [markdown]
# ## Parity
#
# Largest absolute differences, ours against the built-in with the same weights
# (float32; tolerance `compare.ATOL`, relative for large gradients). A dash means
# not measured: the case returns no scores, or the built-in failed.


# %%
def fmt(value, spec):
    return "–" if value is None else format(value, spec)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return Markdown("\n".join(lines))


diffs = ("max_abs_diff", "scores_max_abs_diff", "grad_max_abs_diff")
display(
    table(
        ["case", "output", "scores", "gradients", "passed", "built-in error"],
        [
            [
                r["case"],
                *(fmt(r[k], ".1e") for k in diffs),
                "yes" if r["passed"] else "**no**",
                (r["builtin_error"] or "")[:90].replace("|", "/"),
            ]
            for r in records
        ],
    )
)

# %%
names = [r["case"] for r in records]
fig, ax = plt.subplots(figsize=(8, 3.4))
width = 0.27
for i, (key, label) in enumerate(zip(diffs, ["output", "scores", "gradients"])):
    positions = np.arange(len(records)) + (i - 1) * width
    values = [np.nan if r[key] is None else r[key] for r in records]
    ax.bar(positions, values, width, label=label, color=f"C{i}")
    for x, value in zip(positions, values):
        if value == 0:  # exactly equal: no bar on a log axis, so say it
            ax.text(x, 1.3e-9, "0", ha="center", fontsize=8, color=f"C{i}")
ax.axhline(compare.ATOL, color="red", ls="--", lw=1, label=f"tolerance {compare.ATOL:g}")
for i, r in enumerate(records):
    if r["builtin_error"]:
        ax.text(i, 1e-8, "built-in\nfailed", ha="center", fontsize=8, color="red")
ax.set_xticks(range(len(records)), names, rotation=20)
ax.set(
    yscale="log",
    ylim=(1e-9, 1e-2),
    ylabel="max |ours - built-in|",
    title=f"parity on {keras.backend.backend()} (quick shapes)",
)
ax.legend(fontsize=8, ncol=2)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Speed
#
# Median milliseconds per `predict_on_batch` and `train_on_batch`, ours and
# built-in alternating after a warm-up; ratio = ours / built-in (below 1: ours is
# faster). These are the quick, small shapes on a shared CPU, so they are noisy;
# `keras-mha compare` without `--quick` runs the full sizes.

# %%
timing = [
    "ours_predict_ms",
    "builtin_predict_ms",
    "predict_ratio",
    "ours_train_ms",
    "builtin_train_ms",
    "train_ratio",
]
display(
    table(
        [
            "case",
            "ours predict ms",
            "built-in predict ms",
            "ratio",
            "ours train ms",
            "built-in train ms",
            "ratio",
        ],
        [[r["case"], *(fmt(r[k], ".2f") for k in timing)] for r in records],
    )
)

fig, ax = plt.subplots(figsize=(8, 3.2))
for i, (key, label) in enumerate([("predict_ratio", "predict"), ("train_ratio", "train")]):
    values = [np.nan if r[key] is None else r[key] for r in records]
    ax.bar(np.arange(len(records)) + (i - 0.5) * 0.38, values, 0.38, label=label)
ax.axhline(1, color="black", lw=1)
ax.set_xticks(range(len(records)), names, rotation=20)
ax.set(ylabel="time ours / built-in", title=f"speed on {keras.backend.backend()}")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Where the built-in fails
#
# The records whose built-in run raised (on JAX: `value_dim != key_dim`, whose
# fused path needs equal head sizes). `keras_mha` ran those cases:

# %%
failed = [r for r in records if r["builtin_error"]]
for r in failed:
    print(f"{r['case']}: built-in -> {r['builtin_error']}")
    print(
        f"{'':>{len(r['case'])}}  keras_mha -> ran, passed={r['passed']}, "
        f"predict {fmt(r['ours_predict_ms'], '.2f')} ms"
    )
if not failed:
    print(f"the built-in ran every case on {keras.backend.backend()}")

# %% [markdown]
# ## Where the built-in is wrong
#
# ### The symbolic shape of cross-attention scores
#
# A functional model is built from symbolic shapes. For a query of length 6 and
# a value of length 10 the scores are `(B, heads, 6, 10)`; the built-in declares
# `(None, heads, 6, 6)`, so any layer built on them gets the wrong shape, while its
# computed scores (run eagerly) are right.

# %%
query, value = keras.Input(shape=(6, 8)), keras.Input(shape=(10, 8))
q, v = np.zeros((3, 6, 8), "float32"), np.zeros((3, 10, 8), "float32")
for cls in (keras.layers.MultiHeadAttention, keras_mha.MultiHeadAttention):
    _, declared = cls(num_heads=2, key_dim=4)(query, value, return_attention_scores=True)
    _, computed = cls(num_heads=2, key_dim=4)(q, v, return_attention_scores=True)
    name = f"{cls.__module__.split('.')[0]}.MultiHeadAttention"
    ok = declared.shape[1:] == tuple(computed.shape)[1:]
    print(
        f"{name:<30} declared {declared.shape}, computed {tuple(computed.shape)}, consistent: {ok}"
    )

# %% [markdown]
# ### A query that may attend to nothing
#
# When a query row's keys are all masked (a padded query, or a padding mask that
# hides a whole sequence), there is nothing to average. `keras_mha` gives such a
# row zero weights, hence a zero context (the output is the output projection's
# bias, zero here), whichever kernel runs. The built-in's answer depends on its
# code path: asking for the scores takes another path than not asking. Below,
# the same layer, the same weights and inputs, with and without
# `return_attention_scores`:

# %%
rng = np.random.default_rng(0)
x = rng.standard_normal((1, 4, 8)).astype("float32")
mask = np.ones((1, 4, 4), bool)
mask[0, 0] = False  # query 0 may attend to no key
builtin = keras.layers.MultiHeadAttention(num_heads=1, key_dim=4)
ours = keras_mha.MultiHeadAttention(num_heads=1, key_dim=4)
builtin.build(x.shape, x.shape)
ours.build(x.shape, x.shape)
ours.set_weights(builtin.get_weights())
for name, layer in (("built-in", builtin), ("keras_mha", ours)):
    plain = keras.ops.convert_to_numpy(layer(x, x, attention_mask=mask))
    with_scores, scores = layer(x, x, attention_mask=mask, return_attention_scores=True)
    with_scores = keras.ops.convert_to_numpy(with_scores)
    print(
        f"{name:>9}: output row 0 {plain[0, 0, :4].round(3)} ..., with scores "
        f"{with_scores[0, 0, :4].round(3)} ..., "
        f"max |difference| {np.abs(plain[0, 0] - with_scores[0, 0]).max():.3f}"
    )

# %% [markdown]
# The differences that matter to users are the ones above; everywhere else the
# two layers agree to float32 rounding, as the parity table shows, and the same
# weights load in either. `keras-mha compare` reruns all of this on every
# installed backend.
