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
# # How `key_dim`, `num_heads` and `value_dim` shape the layer
#
# A common question: *how do `key_dim` and `num_heads` affect MultiHeadAttention?*
# A widely copied answer prints four trainable weights of shape `(512, 512)` for
# every configuration. In Keras 3 that is wrong on both counts: there are **eight**
# weights (four kernels and four biases) and the kernels keep the heads as their
# own axis. This notebook prints the real weights, counts parameters and FLOPs as
# functions of the three sizes, times the configurations, and shows what
# `value_dim` changes.

# %% [markdown]
# Everything below runs on the backend named by `KERAS_BACKEND` (tensorflow, jax or
# torch), printed by the first cell; the outputs stored in this file come from jax on
# a 2-core CPU. Every number and picture is computed here, from a fixed seed.

# %%
import logging
import re
import time

import keras
import matplotlib.pyplot as plt
import numpy as np

import keras_mha

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
keras.utils.set_random_seed(0)

# %% [markdown]
# ## The three configurations of the question
#
# Input `(batch, 128, 512)`, self-attention. Building the layer needs only the
# shapes; we print every trainable weight it creates.

# %%
SEQ, DIM = 128, 512
CONFIGS = {
    "8 heads x 64": dict(num_heads=8, key_dim=64),
    "4 heads x 128": dict(num_heads=4, key_dim=128),
    "8 x 64, value_dim=32": dict(num_heads=8, key_dim=64, value_dim=32),
}


def built(cls=keras_mha.MultiHeadAttention, **kwargs):
    layer = cls(**kwargs)
    layer.build((None, SEQ, DIM), (None, SEQ, DIM))
    return layer


for name, kwargs in CONFIGS.items():
    layer = built(**kwargs)
    weights = layer.trainable_weights
    print(f"{name}: {len(weights)} trainable weights, {layer.count_params():,} parameters")
    for w in weights:
        shape, name = tuple(w.shape), w.path.split("/", 1)[1]
        print(f"    {name:<28} {str(shape):<14} {int(np.prod(shape)):>8,}")

# %% [markdown]
# The built-in `keras.layers.MultiHeadAttention` creates exactly the same weights
# (same order, names and shapes; ours is a drop-in and loads its weights):

# %%
for name, kwargs in CONFIGS.items():
    ours = [tuple(w.shape) for w in built(**kwargs).weights]
    builtin = built(keras.layers.MultiHeadAttention, **kwargs)
    theirs = [tuple(w.shape) for w in builtin.weights]
    print(f"{name:<22} same shapes as the built-in: {ours == theirs}")

# %% [markdown]
# ### Why not four `(512, 512)` matrices?
#
# Each projection is an `EinsumDense` whose kernel keeps heads apart:
# query and key kernels are `(dim, num_heads, key_dim)`, the value kernel
# `(dim, num_heads, value_dim)`, the output kernel `(num_heads, value_dim, dim)`,
# and each has a bias, `(num_heads, key_dim)` ... `(dim,)`: 8 weights. Flattening the
# two head axes gives the textbook fused matrix, which is `(512, 512)` only when
# `num_heads * key_dim == 512`. With `value_dim=32` the value projection is
# `(512, 256)` and the output projection `(256, 512)`:

# %%
for name, kwargs in CONFIGS.items():
    layer = built(**kwargs)
    flat = {
        "query": layer.query_dense.kernel.shape,
        "value": layer.value_dense.kernel.shape,
        "output": layer.output_dense.kernel.shape,
    }
    fused = {
        k: (int(np.prod(s[:-1])), s[-1]) if k == "output" else (s[0], s[1] * s[2])
        for k, s in flat.items()
    }
    print(f"{name:<22}", ", ".join(f"{k} {tuple(flat[k])} -> {fused[k]}" for k in flat))


# %% [markdown]
# ## Parameters and FLOPs as functions of the sizes
#
# With `d = dim`, `N = num_heads`, `H = key_dim`, `Hv = value_dim`, one layer has
#
# `params = 2 (d N H + N H) + (d N Hv + N Hv) + (N Hv d + d)`
#
# and, for a batch of `B` queries of length `T` attending over `S` positions, a
# forward pass costs (a multiply-add counted as 2 FLOPs)
#
# | step | FLOPs |
# |---|---|
# | query projection | `2 B T d N H` |
# | key, value projections | `2 B S d N (H + Hv)` |
# | scores `Q K^T` | `2 B N T S H` |
# | weighted sum of values | `2 B N T S Hv` |
# | output projection | `2 B T N Hv d` |
#
# The parameter formula is checked against `count_params()` of a built layer at
# every point plotted.


# %%
def param_count(dim, num_heads, key_dim, value_dim=None):
    value_dim = value_dim or key_dim
    qk = 2 * (dim * num_heads * key_dim + num_heads * key_dim)
    v = dim * num_heads * value_dim + num_heads * value_dim
    return qk + v + num_heads * value_dim * dim + dim


def flop_terms(batch, query_len, key_len, dim, num_heads, key_dim, value_dim=None):
    value_dim = value_dim or key_dim
    n = num_heads
    return {
        "query projection": 2 * batch * query_len * dim * n * key_dim,
        "key, value projections": 2 * batch * key_len * dim * n * (key_dim + value_dim),
        "scores": 2 * batch * n * query_len * key_len * key_dim,
        "weighted sum": 2 * batch * n * query_len * key_len * value_dim,
        "output projection": 2 * batch * query_len * n * value_dim * dim,
    }


def flops(*args, **kwargs):
    return sum(flop_terms(*args, **kwargs).values())


for name, kwargs in CONFIGS.items():
    assert param_count(DIM, **kwargs) == built(**kwargs).count_params()
    print(
        f"{name:<22} {param_count(DIM, **kwargs):>10,} params "
        f"{flops(32, SEQ, SEQ, DIM, **kwargs) / 1e9:6.2f} GFLOPs for (32, 128, 512)"
    )


# %% [markdown]
# ### Cross-check of the FLOP formula
#
# Two independent counts. First, from the einsums themselves: a contraction
# costs 2 FLOPs per combination of all its indices, `2 * prod(sizes)`; we write
# the five einsums of a forward pass with the layer's real kernel shapes and add
# them up. Second, on the JAX backend only, XLA's own cost analysis of the
# compiled layer, which also counts the biases and the softmax (so a little more).


# %%
def einsum_cost(equation, *shapes):
    """2 * product of the sizes of every index of the einsum."""
    sizes = {}
    for letters, shape in zip(equation.split("->")[0].split(","), shapes):
        sizes.update(zip(letters, shape))
    return 2 * int(np.prod(list(sizes.values())))


def counted_flops(layer, batch, query_len, key_len):
    wq, wk, wv, wo = (
        d.kernel.shape
        for d in (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense)
    )
    dim, n, h = wq
    hv = wv[-1]
    b, t, s = batch, query_len, key_len
    return sum(
        [
            einsum_cost("btd,dnh->btnh", (b, t, dim), wq),
            einsum_cost("bsd,dnh->bsnh", (b, s, dim), wk),
            einsum_cost("bsd,dnv->bsnv", (b, s, dim), wv),
            einsum_cost("btnh,bsnh->bnts", (b, t, n, h), (b, s, n, h)),
            einsum_cost("bnts,bsnv->btnv", (b, n, t, s), (b, s, n, hv)),
            einsum_cost("btnv,nvd->btd", (b, t, n, hv), wo),
        ]
    )


def xla_flops(layer, batch, query_len):
    import jax

    x = np.zeros((batch, query_len, DIM), "float32")
    return jax.jit(lambda x: layer(x, x)).lower(x).compile().cost_analysis()["flops"]


for name, kwargs in CONFIGS.items():
    layer = built(**kwargs)
    by_formula = flops(4, SEQ, SEQ, DIM, **kwargs)
    by_einsums = counted_flops(layer, 4, SEQ, SEQ)
    line = f"{name:<22} formula {by_formula:>13,}  einsums {by_einsums:>13,}"
    if keras.backend.backend() == "jax":
        line += f"  XLA / formula {xla_flops(layer, 4, SEQ) / by_formula:.4f}"
    print(line)
    assert by_formula == by_einsums

# %%
sweeps = {
    "num_heads (key_dim=64)": ("num_heads", [1, 2, 4, 8, 16, 32], dict(key_dim=64)),
    "key_dim (8 heads)": ("key_dim", [8, 16, 32, 64, 128, 256], dict(num_heads=8)),
    "value_dim (8 heads, key_dim=64)": (
        "value_dim",
        [8, 16, 32, 64, 128, 256],
        dict(num_heads=8, key_dim=64),
    ),
}
fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), sharey="row")
for col, (title, (arg, values, fixed)) in enumerate(sweeps.items()):
    params, gflops = [], []
    for v in values:
        kwargs = {**fixed, arg: v}
        params.append(param_count(DIM, **kwargs))
        assert params[-1] == built(**kwargs).count_params()
        terms = flop_terms(32, SEQ, SEQ, DIM, **kwargs)
        gflops.append({k: f / 1e9 for k, f in terms.items()})
    axes[0, col].plot(values, np.array(params) / 1e6, "o-")
    axes[0, col].set(title=title, xscale="log")
    bottom = np.zeros(len(values))
    for term in gflops[0]:
        heights = np.array([g[term] for g in gflops])
        axes[1, col].bar(range(len(values)), heights, bottom=bottom, label=term)
        bottom += heights
    axes[1, col].set_xticks(range(len(values)), values)
    axes[1, col].set_xlabel(arg)
    for ax in axes[:, col]:
        ax.grid(alpha=0.3)
    axes[0, col].set_xticks(values, values)
axes[0, 0].set_ylabel("parameters (millions)")
axes[1, 0].set_ylabel("GFLOPs, batch (32, 128, 512)")
axes[1, 0].legend(fontsize=8)
plt.tight_layout()
plt.show()


# %% [markdown]
# What the plots say:
#
# - Parameters and projection FLOPs grow with `num_heads * key_dim` (and
#   `num_heads * value_dim`), not with either alone: "8 heads of 64" and
#   "4 heads of 128" have the same count. Keeping `num_heads * key_dim = dim`
#   (the paper's `d_k = d_model / h`) keeps the size fixed as heads change.
# - The score matrix costs `2 B N T S H`: it grows with `T * S`, so at long
#   sequences it dominates; more heads of the same total width cost the same.
# - `value_dim` never enters the scores: it sizes the value and output projections
#   and the weighted sum.

# %% [markdown]
# ## Measured time per configuration
#
# A small batch `(4, 128, 512)` so that this stays quick on a CPU: the best of 10
# timed forward passes (`predict_on_batch` of a one-layer model, compiled on JAX
# and TensorFlow; the configurations take turns), next to the formula's FLOPs.
# The best, not the median, because on a shared machine the other runs measure
# the neighbours too. Time follows
# FLOPs only roughly: which attention kernel runs matters as well (JAX's fused
# kernel needs `value_dim == key_dim`; otherwise the layer runs the explicit one).


# %%
def best_ms(fns, repeats=10, warmup=3):
    """Best time of each function, in interleaved rounds, after a warm-up."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: min(t) for name, t in times.items()}


x = np.random.default_rng(0).standard_normal((4, SEQ, DIM)).astype("float32")
forward = {}
for name, kwargs in CONFIGS.items():
    inputs = keras.Input(shape=(SEQ, DIM))
    model = keras.Model(inputs, keras_mha.MultiHeadAttention(**kwargs)(inputs, inputs))
    forward[name] = lambda m=model: m.predict_on_batch(x)
timings = best_ms(forward)
for name, kwargs in CONFIGS.items():
    gflops = flops(4, SEQ, SEQ, DIM, **kwargs) / 1e9
    print(f"{name:<22} {timings[name]:7.2f} ms   {gflops:.3f} GFLOPs")

fig, ax = plt.subplots(figsize=(6, 2.8))
ax.barh(list(timings), list(timings.values()))
ax.set(xlabel="ms per forward pass, batch (4, 128, 512)", title=keras.backend.backend())
ax.invert_yaxis()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## What `value_dim` changes
#
# `value_dim` is the size of each head's *values*, hence of each head's output.
# The scores are computed from queries and keys only, so they do not depend on it;
# the output is projected back to the input width whatever it is.

# %%
q = np.random.default_rng(1).standard_normal((2, 6, 32)).astype("float32")
for value_dim in (4, 16, 64):
    layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=16, value_dim=value_dim)
    out, scores = layer(q, q, return_attention_scores=True)
    value_kernel = tuple(layer.value_dense.kernel.shape)
    output_kernel = tuple(layer.output_dense.kernel.shape)
    print(
        f"value_dim={value_dim:>2}: value kernel {value_kernel}, "
        f"output kernel {output_kernel}, "
        f"scores {tuple(scores.shape)}, output {tuple(out.shape)}"
    )

# %% [markdown]
# Changing only the value weights leaves the attention pattern untouched: below,
# two layers share query and key weights but have different `value_dim`; their
# scores are identical.

# %%
small = keras_mha.MultiHeadAttention(num_heads=2, key_dim=16, value_dim=4)
large = keras_mha.MultiHeadAttention(num_heads=2, key_dim=16, value_dim=64)
_, s_small = small(q, q, return_attention_scores=True)
large.build(q.shape, q.shape)
for name in ("query_dense", "key_dense"):
    for target, source in zip(getattr(large, name).weights, getattr(small, name).weights):
        target.assign(source)
_, s_large = large(q, q, return_attention_scores=True)
to_numpy = keras.ops.convert_to_numpy
diff = np.max(np.abs(to_numpy(s_small) - to_numpy(s_large)))
print("max |score difference|:", float(diff))

# %% [markdown]
# ### `value_dim != key_dim` and the built-in layer on JAX
#
# The question's third example (`value_dim=32`, `key_dim=64`) crashes the built-in
# `keras.layers.MultiHeadAttention` on the JAX backend: its fused attention path
# needs equal head sizes. `keras_mha` checks this and takes the explicit path, on
# every backend. The demonstration of the failure runs only when this notebook
# runs on JAX; on the other backends both layers run and agree.

# %%
kwargs = CONFIGS["8 x 64, value_dim=32"]
x_small = x[:2, :16]
ours = keras_mha.MultiHeadAttention(**kwargs)
builtin = keras.layers.MultiHeadAttention(**kwargs)
builtin.build(x_small.shape, x_small.shape)
ours.build(x_small.shape, x_small.shape)
ours.set_weights(builtin.get_weights())
ours_out = keras.ops.convert_to_numpy(ours(x_small, x_small))
print("keras_mha output:", ours_out.shape)
logging.getLogger("absl").setLevel(logging.CRITICAL)  # Keras logs a traceback first
try:
    builtin_out = keras.ops.convert_to_numpy(builtin(x_small, x_small))
except Exception as error:
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines()
    reason = [ln for ln in lines if ln.strip() and "Exception encountered" not in ln][0]
    backend = keras.backend.backend()
    print(f"built-in on {backend}: {type(error).__name__}: {reason[:200]}")
else:
    if keras.backend.backend() == "jax":
        print("the built-in ran on jax: this Keras version has fixed it")
    print(
        "built-in output:",
        builtin_out.shape,
        "max |difference|:",
        float(np.max(np.abs(ours_out - builtin_out))),
    )
