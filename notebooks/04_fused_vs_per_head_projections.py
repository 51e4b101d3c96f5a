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
# # `h` per-head projections or one fused projection?
#
# The paper writes head `i` as `softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V`
# with its own `(d_model, d_k)` matrices, yet implementations use one
# `(d_model, h * d_k)` projection each for queries, keys and values. Why? Because
# the two are the *same function*: stacking the `h` matrices side by side gives
# the big one, and one matrix product computes all heads at once. We check it
# numerically, map it onto this layer's `(dim, num_heads, key_dim)` kernels and
# onto PyTorch's packed `in_proj_weight`, and measure the speed difference.

# %% [markdown]
# Everything below runs on the backend named by `KERAS_BACKEND` (tensorflow, jax or
# torch), printed by the first cell; the outputs stored in this file come from jax on
# a 2-core CPU. Every number and picture is computed here, from a fixed seed.

# %%
import importlib.util
import time

import keras
import matplotlib.pyplot as plt
import numpy as np
from keras import ops

import keras_mha

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
keras.utils.set_random_seed(0)

# %% [markdown]
# ## Stacking the weights
#
# `x W = [x W_0, x W_1, ..., x W_{h-1}]` for `W = [W_0 W_1 ... W_{h-1}]`: column
# block `i` of the product only sees column block `i` of `W`.

# %%
D_MODEL, HEADS = 512, 8
D_K = D_MODEL // HEADS
rng = np.random.default_rng(0)
x = rng.standard_normal((2, 10, D_MODEL)).astype("float32")
per_head_w = [rng.normal(0, 0.05, (D_MODEL, D_K)).astype("float32") for _ in range(HEADS)]
per_head_b = [rng.normal(0, 1, D_K).astype("float32") for _ in range(HEADS)]

heads_loop = np.stack([x @ w + b for w, b in zip(per_head_w, per_head_b)], axis=2)
w_stacked = np.concatenate(per_head_w, axis=1)  # (512, 8 * 64)
b_stacked = np.concatenate(per_head_b)
heads_fused = (x @ w_stacked + b_stacked).reshape(2, 10, HEADS, D_K)
print("per-head loop", heads_loop.shape, " fused", heads_fused.shape)
print("max |difference|:", float(np.abs(heads_loop - heads_fused).max()))

# %%
panels = [
    ("loop: x W_i + b_i, head by head", heads_loop[0, 0]),
    ("fused: (x W + b).reshape(h, d_k)", heads_fused[0, 0]),
    ("difference", heads_loop[0, 0] - heads_fused[0, 0]),
]
fig, axes = plt.subplots(1, 3, figsize=(13, 2.4))
for ax, (title, image) in zip(axes, panels):
    shown = ax.imshow(image, cmap="RdBu", aspect="auto", vmin=-3, vmax=3)
    ax.set(title=title, xlabel="j (of d_k = 64)", ylabel="head i")
fig.colorbar(shown, ax=axes, fraction=0.02)
fig.suptitle("query projection of one token, shaped (heads, d_k)", y=1.08)
plt.show()

# %% [markdown]
# ## This layer's kernels: `(dim, num_heads, key_dim)`
#
# `keras_mha` (like Keras's built-in) never flattens the heads: its query kernel
# is `(512, 8, 64)`, so `kernel[:, i, :]` *is* head `i`'s `W_i` and
# `kernel.reshape(512, 512)` is the stacked matrix above. Below, a paper-style
# implementation written with one matrix per head and a Python loop, fed with
# slices of the layer's weights, reproduces the layer's output.

# %%
layer = keras_mha.MultiHeadAttention(num_heads=HEADS, key_dim=D_K)
output = keras.ops.convert_to_numpy(layer(x, x))
wq, bq, wk, bk, wv, bv, wo, bo = layer.get_weights()
print("kernels:", wq.shape, wk.shape, wv.shape, wo.shape)

stacked = np.concatenate([wq[:, i, :] for i in range(HEADS)], axis=1)
same = np.array_equal(wq.reshape(512, 512), stacked)
print("kernel.reshape(512, 512) == [W_0 ... W_7]:", same)


def softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def paper_attention(x, head_weights, wo, bo):
    """Concat(head_1 ... head_h) W^O + b^O, with separate matrices per head."""
    heads = []
    for (wq_i, bq_i), (wk_i, bk_i), (wv_i, bv_i) in head_weights:
        q, k, v = x @ wq_i + bq_i, x @ wk_i + bk_i, x @ wv_i + bv_i
        weights = softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]))
        heads.append(weights @ v)
    return np.concatenate(heads, axis=-1) @ wo + bo


head_weights = [((wq[:, i], bq[i]), (wk[:, i], bk[i]), (wv[:, i], bv[i])) for i in range(HEADS)]
reference = paper_attention(x, head_weights, wo.reshape(HEADS * D_K, D_MODEL), bo)
print("max |layer - per-head loop|:", float(np.abs(output - reference).max()))

# %% [markdown]
# ## PyTorch's packed `in_proj_weight (3E, E)`
#
# `torch.nn.MultiheadAttention` stores the three stacked projections in one
# `(3E, E)` matrix, rows `[W_q; W_k; W_v]`, and applies weights as `x @ W.T`.
# So its `W_q` is our query kernel reshaped to `(E, E)` and transposed, and
# `out_proj.weight` is our output kernel reshaped to `(E, E)` and transposed. In
# NumPy:

# %%
E = D_MODEL
in_proj_weight = np.concatenate([w.reshape(E, E).T for w in (wq, wk, wv)], axis=0)
in_proj_bias = np.concatenate([b.reshape(E) for b in (bq, bk, bv)])
out_proj_weight = wo.reshape(E, E).T
print(
    "in_proj_weight",
    in_proj_weight.shape,
    " in_proj_bias",
    in_proj_bias.shape,
    " out_proj.weight",
    out_proj_weight.shape,
)

# PyTorch's projection: one matmul for q, k and v together, then split in three.
q, k, v = np.split(x @ in_proj_weight.T + in_proj_bias, 3, axis=-1)
ours_q = keras.ops.convert_to_numpy(layer.query_dense(x)).reshape(2, 10, E)
print("max |torch-style q - our projected query|:", float(np.abs(q - ours_q).max()))

# %% [markdown]
# `keras_mha.interop` does this conversion both ways. When PyTorch is installed
# (whatever the Keras backend), we convert the layer and run PyTorch's module:

# %%
if importlib.util.find_spec("torch") is None:
    print("PyTorch is not installed: the NumPy mapping above is the whole story")
else:
    import torch

    from keras_mha import interop

    module = interop.to_torch(layer)
    same = np.array_equal(module.in_proj_weight.detach().numpy(), in_proj_weight)
    print("interop.to_torch(layer).in_proj_weight == NumPy mapping:", same)
    with torch.no_grad():
        t = torch.from_numpy(x)
        torch_out = module(t, t, t, need_weights=False)[0].numpy()
    diff = float(np.abs(torch_out - output).max())
    print("max |torch.nn.MultiheadAttention - keras_mha|:", diff)
    back = interop.from_torch(module)
    pairs = zip(back.get_weights(), layer.get_weights())
    print("round trip, weights equal:", all(np.array_equal(a, b) for a, b in pairs))


# %% [markdown]
# ## Speed: `h` small products or one big one
#
# Same arithmetic, different cost. We time the query projection of a
# `(8, 128, 512)` batch written as a loop of `h` matmuls (one per head, then
# stacked) and as the layer's single einsum `btd,dnh->btnh`, with `h * d_k = 512`
# fixed, using `keras.ops` on this backend (eagerly, as a per-head `ModuleList` in
# PyTorch would run). Best of 20 runs each, the two taking turns.


# %%
def best_ms(calls, repeats=20, warmup=2):
    """Best time of each `(fn, args)`, taking turns, after a warm-up."""
    for fn, args in calls.values():
        for _ in range(warmup):
            ops.convert_to_numpy(fn(*args))
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            start = time.perf_counter()
            ops.convert_to_numpy(fn(*args))  # waits for asynchronous backends
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: min(t) for name, t in times.items()}


def loop(x, per_head):
    return ops.stack([ops.matmul(x, w) for w in per_head], axis=2)


def fused(x, kernel):
    return ops.einsum("btd,dnh->btnh", x, kernel)


xb = ops.convert_to_tensor(rng.standard_normal((8, 128, D_MODEL)).astype("float32"))
head_counts = [1, 2, 4, 8, 16, 32, 64]
loop_ms, fused_ms = [], []
for h in head_counts:
    kernel = rng.standard_normal((D_MODEL, h, D_MODEL // h)) / np.sqrt(D_MODEL)
    kernel = ops.convert_to_tensor(kernel.astype("float32"))
    per_head = [kernel[:, i, :] for i in range(h)]
    diff = np.abs(ops.convert_to_numpy(loop(xb, per_head) - fused(xb, kernel))).max()
    best = best_ms({"loop": (loop, (xb, per_head)), "fused": (fused, (xb, kernel))})
    loop_ms.append(best["loop"])
    fused_ms.append(best["fused"])
    print(
        f"h={h:>2}, d_k={D_MODEL // h:>3}: loop {loop_ms[-1]:6.2f} ms, "
        f"one einsum {fused_ms[-1]:6.2f} ms, max |difference| {diff:.1e}"
    )

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(head_counts, loop_ms, "o-", label="loop over heads (h matmuls)")
ax.plot(head_counts, fused_ms, "s-", label="one einsum (stacked kernel)")
ax.set(
    xscale="log",
    ylim=(0, None),
    xlabel="num_heads h (d_k = 512 / h)",
    ylabel="ms, query projection of (8, 128, 512)",
    title=keras.backend.backend(),
)
ax.set_xticks(head_counts, head_counts)
ax.grid(alpha=0.3)
ax.legend()
plt.tight_layout()
plt.show()
print(
    "loop / einsum time at h = 8:",
    round(loop_ms[3] / fused_ms[3], 2),
    "  at h = 64:",
    round(loop_ms[-1] / fused_ms[-1], 2),
)

# %% [markdown]
# Both compute the same numbers with the same FLOPs. The loop pays a dispatch (a
# kernel launch on a GPU) per head and multiplies `h` thin `(512, 512 / h)`
# matrices; the fused version is one well-shaped product, whatever `h`. That is
# the whole reason for "3 linear layers instead of 3 h": an optimisation, not a
# different model; the parameter count is the same either way. (Timings of small
# products on a shared CPU are noisy; the ratios printed above are this run's.)
