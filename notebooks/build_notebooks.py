"""Writes the notebooks of this folder from the cells below, formats them, runs them.

The notebooks are committed with their outputs (so the plots render on a code host);
this script is their source. Edit a cell here, then rebuild:

    .venv/bin/python notebooks/build_notebooks.py                 # all, on KERAS_BACKEND
    .venv/bin/python notebooks/build_notebooks.py 01 03           # some of them
    .venv/bin/python notebooks/build_notebooks.py --no-execute    # write without outputs

Outputs are committed from the jax backend (`KERAS_BACKEND=jax`, the default here).
"""

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
CELL_TIMEOUT = 600

SETUP = """\
import keras
import matplotlib.pyplot as plt
import numpy as np

import keras_mha

print("Keras backend:", keras.backend.backend(), "| keras", keras.__version__)
keras.utils.set_random_seed(0)
"""

BACKEND_NOTE = (
    "Everything below runs on the backend named by `KERAS_BACKEND` (tensorflow, jax or "
    "torch), printed by the first cell; the outputs stored in this file come from jax on "
    "a 2-core CPU. Every number and picture is computed here, from a fixed seed."
)


def _cells(spec):
    cells = []
    for kind, text in spec:
        text = textwrap.dedent(text).strip("\n")
        if kind == "md":
            cells.append(nbformat.v4.new_markdown_cell(text))
        else:
            cells.append(nbformat.v4.new_code_cell(text))
    return cells


# ----------------------------------------------------------------------- 01 quickstart
QUICKSTART = [
    (
        "md",
        """
        # Quickstart: `keras_mha.MultiHeadAttention` in a model that has to attend

        We build a small functional Keras model around the layer, train it on a task it
        cannot solve without attention (reversing a sequence of digits), save it to a
        `.keras` file, load it back, and look at what each head learned to look at.
        """,
    ),
    ("md", BACKEND_NOTE),
    ("code", SETUP),
    (
        "md",
        """
        ## The task: reverse eight digits

        Input `3 1 4 1 5 9 2 6`, target `6 2 9 5 1 4 1 3`. Output position `t` must copy
        the digit at position `7 - t`: which position to read depends on where you
        are, so a model that looks at each position on its own can only guess (10 %).
        """,
    ),
    (
        "code",
        """
        LENGTH, VOCAB = 8, 10
        rng = np.random.default_rng(0)
        digits = rng.integers(0, VOCAB, size=(12_000, LENGTH)).astype("int32")
        reversed_digits = digits[:, ::-1].copy()
        x_train, y_train = digits[:10_000], reversed_digits[:10_000]
        x_test, y_test = digits[10_000:], reversed_digits[10_000:]
        print("train", x_train.shape, "test", x_test.shape)
        print("example:", x_test[0], "->", y_test[0])
        """,
    ),
    (
        "md",
        """
        ## The model

        Attention is blind to order, so each token carries its position: a learned token
        embedding and a learned position embedding, concatenated. Then one
        `keras_mha.MultiHeadAttention` (self-attention, 2 heads of size 16) and a small
        per-position classifier. The custom embedding layer is registered so that the
        saved model can be loaded again.
        """,
    ),
    (
        "code",
        """
        @keras.saving.register_keras_serializable(package="quickstart")
        class TokenAndPosition(keras.layers.Layer):
            \"\"\"`(B, T)` token ids -> `(B, T, 2 * dim)`: token and position embeddings.\"\"\"

            def __init__(self, vocab, length, dim, **kwargs):
                super().__init__(**kwargs)
                self.vocab, self.length, self.dim = vocab, length, dim
                self.tokens = keras.layers.Embedding(vocab, dim, name="tokens")
                self.positions = keras.layers.Embedding(length, dim, name="positions")

            def build(self, ids_shape):
                self.tokens.build(ids_shape)
                self.positions.build((self.length,))

            def call(self, ids):
                tokens = self.tokens(ids)
                positions = self.positions(keras.ops.arange(self.length))
                positions = keras.ops.broadcast_to(positions, keras.ops.shape(tokens))
                return keras.ops.concatenate([tokens, positions], axis=-1)

            def compute_output_shape(self, ids_shape):
                return (*ids_shape, 2 * self.dim)

            def get_config(self):
                config = {"vocab": self.vocab, "length": self.length, "dim": self.dim}
                return {**super().get_config(), **config}


        def reverser(use_attention=True):
            ids = keras.Input(shape=(LENGTH,), dtype="int32", name="digits")
            x = TokenAndPosition(VOCAB, LENGTH, 16, name="embed")(ids)
            if use_attention:
                x = keras_mha.MultiHeadAttention(num_heads=2, key_dim=16, name="mha")(x, x)
            x = keras.layers.Dense(64, activation="relu", name="hidden")(x)
            logits = keras.layers.Dense(VOCAB, name="logits")(x)
            model = keras.Model(ids, logits)
            model.compile(
                optimizer=keras.optimizers.Adam(3e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
            return model


        model = reverser()
        for layer in model.layers:
            shape = str(layer.output.shape)
            print(f"{layer.name:>8}  {shape:<14} {layer.count_params():>6} params")
        """,
    ),
    (
        "md",
        """
        ## Training

        Two passes over the 10 000 examples, in rounds of 1 000, measuring the held-out
        token accuracy (on 500 test sequences) after each round to see it learn. For
        contrast, the same model without the attention layer (every position on its
        own) gets the same training.
        """,
    ),
    (
        "code",
        """
        import time

        ROUNDS, PER_ROUND = 20, 1_000  # 2 passes over the training set


        def accuracies(m, n=None):
            \"\"\"(token accuracy, whole-sequence accuracy) on the first `n` test sequences.\"\"\"
            predicted = np.argmax(np.asarray(m.predict(x_test[:n], verbose=0)), axis=-1)
            right = predicted == y_test[:n]
            return float(right.mean()), float(right.all(axis=1).mean())


        def train(m):
            \"\"\"Trains in rounds; returns the held-out token accuracy after each.\"\"\"
            curve = []
            for r in range(ROUNDS):
                start = (r * PER_ROUND) % len(x_train)
                part = slice(start, start + PER_ROUND)
                m.fit(x_train[part], y_train[part], batch_size=50, epochs=1, verbose=0)
                curve.append(accuracies(m, n=500)[0])
            return curve


        start = time.perf_counter()
        curve = train(model)
        print(f"trained on {ROUNDS * PER_ROUND:,} examples in {time.perf_counter() - start:.1f} s")
        baseline = reverser(use_attention=False)
        baseline_curve = train(baseline)

        for label, m in [("with attention", model), ("without attention", baseline)]:
            tokens_ok, sequences_ok = accuracies(m)  # all 2 000 test sequences
            print(f"{label:>17}: token accuracy {tokens_ok:.2%}, sequences {sequences_ok:.2%}")
        """,
    ),
    (
        "code",
        """
        seen = PER_ROUND * np.arange(1, ROUNDS + 1)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(seen, curve, "o-", ms=3, label="with attention")
        ax.plot(seen, baseline_curve, "s--", ms=3, label="without attention")
        ax.axhline(1 / VOCAB, color="gray", lw=0.8, ls=":", label="chance")
        ax.set(xlabel="training examples seen", ylabel="held-out token accuracy", ylim=(0, 1.05))
        ax.legend(loc="center right")
        ax.set_title("Reversing 8 digits")
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## Save, load, same predictions

        The layer is registered with Keras's serialisation, so a `.keras` file holds it
        like any built-in layer (here in a temporary folder).
        """,
    ),
    (
        "code",
        """
        import os
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "reverser.keras")
            model.save(path)
            print(f"saved {os.path.getsize(path) / 1024:.0f} KiB")
            reloaded = keras.saving.load_model(path)

        before = np.asarray(model.predict(x_test, verbose=0))
        after = np.asarray(reloaded.predict(x_test, verbose=0))
        print("reloaded layer:", type(reloaded.get_layer("mha")).__module__)
        print("max |difference| of the logits:", float(np.max(np.abs(before - after))))
        """,
    ),
    (
        "md",
        """
        ## What the heads look at

        We ask the reloaded attention layer for its scores (`return_attention_scores=True`
        at call time): `(B, heads, T, S)`, one row per output position, summing to 1
        over the input positions. Reversal needs output `t` to read input `7 - t`: an
        anti-diagonal. Top row: one test sequence; bottom row: the mean over the test set.
        """,
    ),
    (
        "code",
        """
        embedded = reloaded.get_layer("embed")(x_test)
        _, scores = reloaded.get_layer("mha")(embedded, embedded, return_attention_scores=True)
        scores = keras.ops.convert_to_numpy(scores)
        print("scores:", scores.shape)

        anti_diagonal = np.eye(LENGTH)[::-1].astype(bool)
        on_mirror = scores[:, :, anti_diagonal].mean(axis=(0, 2))
        print("mean weight on input 7 - t, per head:", np.round(on_mirror, 3))

        num_heads = scores.shape[1]
        fig, axes = plt.subplots(2, num_heads, figsize=(3.6 * num_heads, 6.8))
        for head in range(num_heads):
            for row, (image, title) in enumerate(
                [(scores[0, head], "test sequence 0"), (scores[:, head].mean(0), "test mean")]
            ):
                ax = axes[row, head]
                ax.imshow(image, cmap="viridis", vmin=0, vmax=1)
                ax.set_title(f"head {head}, {title}")
                ax.set_xticks(range(LENGTH), x_test[0] if row == 0 else range(LENGTH))
                ax.set_yticks(range(LENGTH), range(LENGTH))
                ax.set_xlabel("input position (digit)" if row == 0 else "input position")
                ax.set_ylabel("output position")
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "md",
        """
        Each head takes part of the anti-diagonal; together they route every digit to its
        mirrored position, which is why the model reaches the accuracy above and the
        attention-free baseline stays near chance.
        """,
    ),
]

# ------------------------------------------------------------ 02 key_dim and num_heads
KEY_DIM = [
    (
        "md",
        """
        # How `key_dim`, `num_heads` and `value_dim` shape the layer

        A common question: *how do `key_dim` and `num_heads` affect MultiHeadAttention?*
        A widely copied answer prints four trainable weights of shape `(512, 512)` for
        every configuration. In Keras 3 that is wrong on both counts: there are **eight**
        weights (four kernels and four biases) and the kernels keep the heads as their
        own axis. This notebook prints the real weights, counts parameters and FLOPs as
        functions of the three sizes, times the configurations, and shows what
        `value_dim` changes.
        """,
    ),
    ("md", BACKEND_NOTE),
    ("code", SETUP),
    (
        "md",
        """
        ## The three configurations of the question

        Input `(batch, 128, 512)`, self-attention. Building the layer needs only the
        shapes; we print every trainable weight it creates.
        """,
    ),
    (
        "code",
        """
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
        """,
    ),
    (
        "md",
        """
        The built-in `keras.layers.MultiHeadAttention` creates exactly the same weights
        (same order, names and shapes; ours is a drop-in and loads its weights):
        """,
    ),
    (
        "code",
        """
        for name, kwargs in CONFIGS.items():
            ours = [tuple(w.shape) for w in built(**kwargs).weights]
            builtin = built(keras.layers.MultiHeadAttention, **kwargs)
            theirs = [tuple(w.shape) for w in builtin.weights]
            print(f"{name:<22} same shapes as the built-in: {ours == theirs}")
        """,
    ),
    (
        "md",
        """
        ### Why not four `(512, 512)` matrices?

        Each projection is an `EinsumDense` whose kernel keeps heads apart:
        query and key kernels are `(dim, num_heads, key_dim)`, the value kernel
        `(dim, num_heads, value_dim)`, the output kernel `(num_heads, value_dim, dim)`,
        and each has a bias, `(num_heads, key_dim)` ... `(dim,)`: 8 weights. Flattening the
        two head axes gives the textbook fused matrix, which is `(512, 512)` only when
        `num_heads * key_dim == 512`. With `value_dim=32` the value projection is
        `(512, 256)` and the output projection `(256, 512)`:
        """,
    ),
    (
        "code",
        """
        for name, kwargs in CONFIGS.items():
            layer = built(**kwargs)
            flat = {
                "query": layer.query_dense.kernel.shape,
                "value": layer.value_dense.kernel.shape,
                "output": layer.output_dense.kernel.shape,
            }
            fused = {k: (int(np.prod(s[:-1])), s[-1]) if k == "output" else (s[0], s[1] * s[2])
                     for k, s in flat.items()}
            print(f"{name:<22}", ", ".join(f"{k} {tuple(flat[k])} -> {fused[k]}" for k in flat))
        """,
    ),
    (
        "md",
        """
        ## Parameters and FLOPs as functions of the sizes

        With `d = dim`, `N = num_heads`, `H = key_dim`, `Hv = value_dim`, one layer has

        `params = 2 (d N H + N H) + (d N Hv + N Hv) + (N Hv d + d)`

        and, for a batch of `B` queries of length `T` attending over `S` positions, a
        forward pass costs (a multiply-add counted as 2 FLOPs)

        | step | FLOPs |
        |---|---|
        | query projection | `2 B T d N H` |
        | key, value projections | `2 B S d N (H + Hv)` |
        | scores `Q K^T` | `2 B N T S H` |
        | weighted sum of values | `2 B N T S Hv` |
        | output projection | `2 B T N Hv d` |

        The parameter formula is checked against `count_params()` of a built layer at
        every point plotted.
        """,
    ),
    (
        "code",
        """
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
            print(f"{name:<22} {param_count(DIM, **kwargs):>10,} params "
                  f"{flops(32, SEQ, SEQ, DIM, **kwargs) / 1e9:6.2f} GFLOPs for (32, 128, 512)")
        """,
    ),
    (
        "md",
        """
        ### Cross-check of the FLOP formula

        Two independent counts. First, from the einsums themselves: a contraction
        costs 2 FLOPs per combination of all its indices, `2 * prod(sizes)`; we write
        the five einsums of a forward pass with the layer's real kernel shapes and add
        them up. Second, on the JAX backend only, XLA's own cost analysis of the
        compiled layer, which also counts the biases and the softmax (so a little more).
        """,
    ),
    (
        "code",
        """
        def einsum_cost(equation, *shapes):
            \"\"\"2 * product of the sizes of every index of the einsum.\"\"\"
            sizes = {}
            for letters, shape in zip(equation.split("->")[0].split(","), shapes):
                sizes.update(zip(letters, shape))
            return 2 * int(np.prod(list(sizes.values())))


        def counted_flops(layer, batch, query_len, key_len):
            wq, wk, wv, wo = (d.kernel.shape for d in (
                layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense))
            dim, n, h = wq
            hv = wv[-1]
            b, t, s = batch, query_len, key_len
            return sum([
                einsum_cost("btd,dnh->btnh", (b, t, dim), wq),
                einsum_cost("bsd,dnh->bsnh", (b, s, dim), wk),
                einsum_cost("bsd,dnv->bsnv", (b, s, dim), wv),
                einsum_cost("btnh,bsnh->bnts", (b, t, n, h), (b, s, n, h)),
                einsum_cost("bnts,bsnv->btnv", (b, n, t, s), (b, s, n, hv)),
                einsum_cost("btnv,nvd->btd", (b, t, n, hv), wo),
            ])


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
        """,
    ),
    (
        "code",
        """
        sweeps = {
            "num_heads (key_dim=64)": ("num_heads", [1, 2, 4, 8, 16, 32], dict(key_dim=64)),
            "key_dim (8 heads)": ("key_dim", [8, 16, 32, 64, 128, 256], dict(num_heads=8)),
            "value_dim (8 heads, key_dim=64)": (
                "value_dim", [8, 16, 32, 64, 128, 256], dict(num_heads=8, key_dim=64)
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
        """,
    ),
    (
        "md",
        """
        What the plots say:

        - Parameters and projection FLOPs grow with `num_heads * key_dim` (and
          `num_heads * value_dim`), not with either alone: "8 heads of 64" and
          "4 heads of 128" have the same count. Keeping `num_heads * key_dim = dim`
          (the paper's `d_k = d_model / h`) keeps the size fixed as heads change.
        - The score matrix costs `2 B N T S H`: it grows with `T * S`, so at long
          sequences it dominates; more heads of the same total width cost the same.
        - `value_dim` never enters the scores: it sizes the value and output projections
          and the weighted sum.
        """,
    ),
    (
        "md",
        """
        ## Measured time per configuration

        A small batch `(4, 128, 512)` so that this stays quick on a CPU: the best of 10
        timed forward passes (`predict_on_batch` of a one-layer model, compiled on JAX
        and TensorFlow; the configurations take turns), next to the formula's FLOPs.
        The best, not the median, because on a shared machine the other runs measure
        the neighbours too. Time follows
        FLOPs only roughly: which attention kernel runs matters as well (JAX's fused
        kernel needs `value_dim == key_dim`; otherwise the layer runs the explicit one).
        """,
    ),
    (
        "code",
        """
        import time


        def best_ms(fns, repeats=10, warmup=3):
            \"\"\"Best time of each function, in interleaved rounds, after a warm-up.\"\"\"
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
        """,
    ),
    (
        "md",
        """
        ## What `value_dim` changes

        `value_dim` is the size of each head's *values*, hence of each head's output.
        The scores are computed from queries and keys only, so they do not depend on it;
        the output is projected back to the input width whatever it is.
        """,
    ),
    (
        "code",
        """
        q = np.random.default_rng(1).standard_normal((2, 6, 32)).astype("float32")
        for value_dim in (4, 16, 64):
            layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=16, value_dim=value_dim)
            out, scores = layer(q, q, return_attention_scores=True)
            value_kernel = tuple(layer.value_dense.kernel.shape)
            output_kernel = tuple(layer.output_dense.kernel.shape)
            print(f"value_dim={value_dim:>2}: value kernel {value_kernel}, "
                  f"output kernel {output_kernel}, "
                  f"scores {tuple(scores.shape)}, output {tuple(out.shape)}")
        """,
    ),
    (
        "md",
        """
        Changing only the value weights leaves the attention pattern untouched: below,
        two layers share query and key weights but have different `value_dim`; their
        scores are identical.
        """,
    ),
    (
        "code",
        """
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
        """,
    ),
    (
        "md",
        """
        ### `value_dim != key_dim` and the built-in layer on JAX

        The question's third example (`value_dim=32`, `key_dim=64`) crashes the built-in
        `keras.layers.MultiHeadAttention` on the JAX backend: its fused attention path
        needs equal head sizes. `keras_mha` checks this and takes the explicit path, on
        every backend. The demonstration of the failure runs only when this notebook
        runs on JAX; on the other backends both layers run and agree.
        """,
    ),
    (
        "code",
        """
        import logging
        import re

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
            lines = re.sub(r"\\x1b\\[[0-9;]*m", "", str(error)).strip().splitlines()
            reason = [ln for ln in lines if ln.strip() and "Exception encountered" not in ln][0]
            backend = keras.backend.backend()
            print(f"built-in on {backend}: {type(error).__name__}: {reason[:200]}")
        else:
            if keras.backend.backend() == "jax":
                print("the built-in ran on jax: this Keras version has fixed it")
            print("built-in output:", builtin_out.shape,
                  "max |difference|:", float(np.max(np.abs(ours_out - builtin_out))))
        """,
    ),
]
# ------------------------------------------------------- 03 shapes, masks and scores
SHAPES = [
    (
        "md",
        """
        # A `(None, 6, 8)` input: shapes, masks and attention scores

        The question: *what is the correct way to use a Keras MultiHeadAttention layer
        with a tensor of shape `(None, 6, 8)`?* Batch of any size, 6 positions, 8
        features. A popular answer gets three things wrong, which we check here:

        1. `key_dim` does **not** have to match the input's last dimension (8): it is
           the size of *each head*; the output is projected back to 8 anyway.
        2. `return_attention_scores` is a **call** argument of Keras 3's built-in layer,
           whose constructor rejects it. `keras_mha` accepts both (the call wins).
        3. Scores are `(batch, heads, 6, 6)` only for self-attention; in general they
           are `(batch, heads, T, S)`, `S` the length of the value.

        Then masks (padding from `Embedding(mask_zero=True)`, causal) and attention
        over more than one axis (images, video).
        """,
    ),
    ("md", BACKEND_NOTE),
    ("code", SETUP),
    (
        "md",
        """
        ## Self-attention in a functional model

        The same tensor is query, key and value. The output has the query's shape.
        """,
    ),
    (
        "code",
        """
        inputs = keras.Input(shape=(6, 8))
        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8)
        outputs = layer(inputs, inputs)
        model = keras.Model(inputs, outputs)
        print("symbolic output:", outputs.shape)

        batch = np.random.default_rng(0).standard_normal((10, 6, 8)).astype("float32")
        print("on a batch of 10:", model(batch).shape)
        """,
    ),
    (
        "md",
        """
        ## Attention scores: a call argument (and, here, a constructor argument)
        """,
    ),
    (
        "code",
        """
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
        """,
    ),
    (
        "md",
        """
        ## `key_dim` is per head, and need not be 8

        Any positive `key_dim` works on an 8-wide input: the kernels are
        `(8, num_heads, key_dim)` and the output projection maps back to 8
        (or to `output_shape` when given).
        """,
    ),
    (
        "code",
        """
        for key_dim in (2, 8, 32):
            layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=key_dim)
            out = layer(inputs, inputs)
            print(f"key_dim={key_dim:>2}: query kernel {tuple(layer.query_dense.kernel.shape)}, "
                  f"output {out.shape}")
        wide = keras_mha.MultiHeadAttention(num_heads=2, key_dim=4, output_shape=16)
        print("output_shape=16:", wide(inputs, inputs).shape)
        """,
    ),
    (
        "md",
        """
        ## Cross-attention: the scores are `(B, heads, T, S)`

        A 6-step query attending over a 10-step value. The built-in layer computes the
        right scores when it runs, but its *symbolic* shape (what a functional model is
        built from) says `(None, 2, 6, 6)`.
        """,
    ),
    (
        "code",
        """
        memory = keras.Input(shape=(10, 8))
        for cls in (keras_mha.MultiHeadAttention, keras.layers.MultiHeadAttention):
            _, symbolic = cls(num_heads=2, key_dim=8)(inputs, memory, return_attention_scores=True)
            _, concrete = cls(num_heads=2, key_dim=8)(
                batch, np.zeros((10, 10, 8), "float32"), return_attention_scores=True
            )
            print(f"{cls.__module__.split('.')[0]:>9}: symbolic scores {symbolic.shape}, "
                  f"computed {tuple(concrete.shape)}")
        """,
    ),
    (
        "md",
        """
        ## Separate query, key and value

        There is no need for `Dense` layers in front of the attention layer to make
        query, key and value: the layer has its own projection for each. Key and value
        may even have different widths from the query and from each other; they must
        share the sequence length `S`.
        """,
    ),
    (
        "code",
        """
        query = keras.Input(shape=(6, 8), name="query")
        key = keras.Input(shape=(10, 4), name="key")
        value = keras.Input(shape=(10, 12), name="value")
        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=5, name="mha")
        output, scores = layer(query, value, key=key, return_attention_scores=True)
        print("output", output.shape, " scores", scores.shape)
        for w in layer.weights:
            print(f"    {w.path:<28} {tuple(w.shape)}")
        """,
    ),
    (
        "md",
        """
        ## Padding masks from `Embedding(mask_zero=True)`

        Token id 0 is padding. The embedding attaches a mask to its output and the layer
        picks it up for the query (padded query rows) and the value (padded key
        columns), with no mask argument. A padded query row has no key to attend to in
        the combined mask: `keras_mha` gives it zero weights.
        """,
    ),
    (
        "code",
        """
        ids = np.array([[5, 3, 8, 1, 0, 0], [2, 9, 4, 7, 6, 0]], "int32")
        embedding = keras.layers.Embedding(20, 8, mask_zero=True)
        embedded = embedding(ids)
        padding_mask = keras.ops.convert_to_numpy(embedding.compute_mask(ids))
        print("padding mask:\\n", padding_mask.astype(int))

        layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8)
        _, padded_scores = layer(embedded, embedded, return_attention_scores=True)
        padded_scores = keras.ops.convert_to_numpy(padded_scores)
        print("weight on padded keys:", float(padded_scores[0][..., 4:].max()))
        print("row sums, sequence 0, head 0:", padded_scores[0, 0].sum(-1).round(3))
        """,
    ),
    (
        "md",
        """
        ## Causal masks

        `use_causal_mask=True`: position `t` attends only to positions `s <= t`. It
        combines with the padding mask.
        """,
    ),
    (
        "code",
        """
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
        """,
    ),
    (
        "md",
        """
        Each row of scores sums to 1 over the keys it may see; masked keys get exactly
        0. With padding, the two padded query rows of sequence 0 are all zeros: padded
        queries attend to nothing (the built-in layer's result for such rows depends on
        its code path).

        ## `attention_axes`: images and video

        With a `(B, H, W, C)` image, `attention_axes=(1, 2)` lets every pixel attend to
        every pixel: the same as flattening `H * W` into a sequence, with the same
        weights. `attention_axes=2` attends along each row only.
        """,
    ),
    (
        "code",
        """
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
        """,
    ),
    (
        "code",
        """
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
        """,
    ),
    (
        "md",
        """
        Video `(B, frames, H, W, C)`: attention within each frame over axes `(2, 3)`.
        Across frames at each pixel is one attention axis, `1`; we flatten `H, W` into
        one axis first, `(B, frames, H * W, C)`, because with a single attention axis on
        a 5-D input the scores have 6 dimensions, more than TensorFlow's CPU softmax
        accepts (the built-in layer fails there too). The scores put the non-attended
        axes first, then heads, then the query and key positions.
        """,
    ),
    (
        "code",
        """
        video = np.random.default_rng(2).standard_normal((1, 3, 4, 4, 8)).astype("float32")
        frames_of_pixels = video.reshape(1, 3, 16, 8)
        for x, axes, meaning in [
            (video, (2, 3), "spatial, per frame"),
            (frames_of_pixels, 1, "temporal, per pixel"),
        ]:
            layer = keras_mha.MultiHeadAttention(num_heads=2, key_dim=8, attention_axes=axes)
            out, scores = layer(x, x, return_attention_scores=True)
            print(f"input {x.shape}, attention_axes={axes!s:<7} ({meaning}): "
                  f"output {tuple(out.shape)}, scores {tuple(scores.shape)}")
        """,
    ),
]

# ------------------------------------------------- 04 fused vs per-head projections
FUSED = [
    (
        "md",
        """
        # `h` per-head projections or one fused projection?

        The paper writes head `i` as `softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V`
        with its own `(d_model, d_k)` matrices, yet implementations use one
        `(d_model, h * d_k)` projection each for queries, keys and values. Why? Because
        the two are the *same function*: stacking the `h` matrices side by side gives
        the big one, and one matrix product computes all heads at once. We check it
        numerically, map it onto this layer's `(dim, num_heads, key_dim)` kernels and
        onto PyTorch's packed `in_proj_weight`, and measure the speed difference.
        """,
    ),
    ("md", BACKEND_NOTE),
    ("code", SETUP),
    (
        "md",
        """
        ## Stacking the weights

        `x W = [x W_0, x W_1, ..., x W_{h-1}]` for `W = [W_0 W_1 ... W_{h-1}]`: column
        block `i` of the product only sees column block `i` of `W`.
        """,
    ),
    (
        "code",
        """
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
        """,
    ),
    (
        "code",
        """
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
        """,
    ),
    (
        "md",
        """
        ## This layer's kernels: `(dim, num_heads, key_dim)`

        `keras_mha` (like Keras's built-in) never flattens the heads: its query kernel
        is `(512, 8, 64)`, so `kernel[:, i, :]` *is* head `i`'s `W_i` and
        `kernel.reshape(512, 512)` is the stacked matrix above. Below, a paper-style
        implementation written with one matrix per head and a Python loop, fed with
        slices of the layer's weights, reproduces the layer's output.
        """,
    ),
    (
        "code",
        """
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
            \"\"\"Concat(head_1 ... head_h) W^O + b^O, with separate matrices per head.\"\"\"
            heads = []
            for (wq_i, bq_i), (wk_i, bk_i), (wv_i, bv_i) in head_weights:
                q, k, v = x @ wq_i + bq_i, x @ wk_i + bk_i, x @ wv_i + bv_i
                weights = softmax(q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]))
                heads.append(weights @ v)
            return np.concatenate(heads, axis=-1) @ wo + bo


        head_weights = [
            ((wq[:, i], bq[i]), (wk[:, i], bk[i]), (wv[:, i], bv[i])) for i in range(HEADS)
        ]
        reference = paper_attention(x, head_weights, wo.reshape(HEADS * D_K, D_MODEL), bo)
        print("max |layer - per-head loop|:", float(np.abs(output - reference).max()))
        """,
    ),
    (
        "md",
        """
        ## PyTorch's packed `in_proj_weight (3E, E)`

        `torch.nn.MultiheadAttention` stores the three stacked projections in one
        `(3E, E)` matrix, rows `[W_q; W_k; W_v]`, and applies weights as `x @ W.T`.
        So its `W_q` is our query kernel reshaped to `(E, E)` and transposed, and
        `out_proj.weight` is our output kernel reshaped to `(E, E)` and transposed. In
        NumPy:
        """,
    ),
    (
        "code",
        """
        E = D_MODEL
        in_proj_weight = np.concatenate([w.reshape(E, E).T for w in (wq, wk, wv)], axis=0)
        in_proj_bias = np.concatenate([b.reshape(E) for b in (bq, bk, bv)])
        out_proj_weight = wo.reshape(E, E).T
        print("in_proj_weight", in_proj_weight.shape, " in_proj_bias", in_proj_bias.shape,
              " out_proj.weight", out_proj_weight.shape)

        # PyTorch's projection: one matmul for q, k and v together, then split in three.
        q, k, v = np.split(x @ in_proj_weight.T + in_proj_bias, 3, axis=-1)
        ours_q = keras.ops.convert_to_numpy(layer.query_dense(x)).reshape(2, 10, E)
        print("max |torch-style q - our projected query|:", float(np.abs(q - ours_q).max()))
        """,
    ),
    (
        "md",
        """
        `keras_mha.interop` does this conversion both ways. When PyTorch is installed
        (whatever the Keras backend), we convert the layer and run PyTorch's module:
        """,
    ),
    (
        "code",
        """
        import importlib.util

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
        """,
    ),
    (
        "md",
        """
        ## Speed: `h` small products or one big one

        Same arithmetic, different cost. We time the query projection of a
        `(8, 128, 512)` batch written as a loop of `h` matmuls (one per head, then
        stacked) and as the layer's single einsum `btd,dnh->btnh`, with `h * d_k = 512`
        fixed, using `keras.ops` on this backend (eagerly, as a per-head `ModuleList` in
        PyTorch would run). Best of 20 runs each, the two taking turns.
        """,
    ),
    (
        "code",
        """
        import time

        from keras import ops


        def best_ms(calls, repeats=20, warmup=2):
            \"\"\"Best time of each `(fn, args)`, taking turns, after a warm-up.\"\"\"
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
            print(f"h={h:>2}, d_k={D_MODEL // h:>3}: loop {loop_ms[-1]:6.2f} ms, "
                  f"one einsum {fused_ms[-1]:6.2f} ms, max |difference| {diff:.1e}")
        """,
    ),
    (
        "code",
        """
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(head_counts, loop_ms, "o-", label="loop over heads (h matmuls)")
        ax.plot(head_counts, fused_ms, "s-", label="one einsum (stacked kernel)")
        ax.set(xscale="log", ylim=(0, None), xlabel="num_heads h (d_k = 512 / h)",
               ylabel="ms, query projection of (8, 128, 512)", title=keras.backend.backend())
        ax.set_xticks(head_counts, head_counts)
        ax.grid(alpha=0.3)
        ax.legend()
        plt.tight_layout()
        plt.show()
        print("loop / einsum time at h = 8:", round(loop_ms[3] / fused_ms[3], 2),
              "  at h = 64:", round(loop_ms[-1] / fused_ms[-1], 2))
        """,
    ),
    (
        "md",
        """
        Both compute the same numbers with the same FLOPs. The loop pays a dispatch (a
        kernel launch on a GPU) per head and multiplies `h` thin `(512, 512 / h)`
        matrices; the fused version is one well-shaped product, whatever `h`. That is
        the whole reason for "3 linear layers instead of 3 h": an optimisation, not a
        different model; the parameter count is the same either way. (Timings of small
        products on a shared CPU are noisy; the ratios printed above are this run's.)
        """,
    ),
]
# ----------------------------------------------------------- 05 compare with built-in
COMPARE = [
    (
        "md",
        """
        # `keras_mha` against `keras.layers.MultiHeadAttention`

        `keras_mha.compare` is the engine behind `keras-mha compare`: for each case it
        builds a model around each layer, copies the built-in's weights into ours,
        compares outputs, attention scores and input gradients, then times inference
        and a training step for both. Here we run its quick settings on the current
        backend only (the command line runs every backend, each in its own process),
        show the results as tables and plots, and then look closer at the cases where
        the built-in layer is wrong or fails.
        """,
    ),
    ("md", BACKEND_NOTE),
    ("code", SETUP),
    (
        "code",
        """
        import time

        from IPython.display import Markdown, display

        from keras_mha import compare

        for case in compare.DEFAULT_CASES:
            query_shape, value_shape = case.shapes(quick=True)
            print(f"{case.name:<12} query {query_shape}, value {value_shape or 'query'}, "
                  f"{case.layer_kwargs} {case.call_kwargs or ''}")
        """,
    ),
    (
        "code",
        """
        import logging

        logging.getLogger("absl").setLevel(logging.CRITICAL)  # the built-in's JAX traceback

        start = time.perf_counter()
        records = compare.run_cases(compare.DEFAULT_CASES, quick=True, repeats=2)
        seconds = time.perf_counter() - start
        print(f"{len(records)} cases on {keras.backend.backend()} in {seconds:.0f} s")
        print(compare.summary(records))
        """,
    ),
    (
        "md",
        """
        ## Parity

        Largest absolute differences, ours against the built-in with the same weights
        (float32; tolerance `compare.ATOL`, relative for large gradients). A dash means
        not measured: the case returns no scores, or the built-in failed.
        """,
    ),
    (
        "code",
        """
        def fmt(value, spec):
            return "–" if value is None else format(value, spec)


        def table(header, rows):
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
            return Markdown("\\n".join(lines))


        diffs = ("max_abs_diff", "scores_max_abs_diff", "grad_max_abs_diff")
        display(table(
            ["case", "output", "scores", "gradients", "passed", "built-in error"],
            [
                [r["case"], *(fmt(r[k], ".1e") for k in diffs), "yes" if r["passed"] else "**no**",
                 (r["builtin_error"] or "")[:90].replace("|", "/")]
                for r in records
            ],
        ))
        """,
    ),
    (
        "code",
        """
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
                ax.text(i, 1e-8, "built-in\\nfailed", ha="center", fontsize=8, color="red")
        ax.set_xticks(range(len(records)), names, rotation=20)
        ax.set(yscale="log", ylim=(1e-9, 1e-2), ylabel="max |ours - built-in|",
               title=f"parity on {keras.backend.backend()} (quick shapes)")
        ax.legend(fontsize=8, ncol=2)
        plt.tight_layout()
        plt.show()
        """,
    ),
    (
        "md",
        """
        ## Speed

        Median milliseconds per `predict_on_batch` and `train_on_batch`, ours and
        built-in alternating after a warm-up; ratio = ours / built-in (below 1: ours is
        faster). These are the quick, small shapes on a shared CPU, so they are noisy;
        `keras-mha compare` without `--quick` runs the full sizes.
        """,
    ),
    (
        "code",
        """
        timing = ["ours_predict_ms", "builtin_predict_ms", "predict_ratio",
                  "ours_train_ms", "builtin_train_ms", "train_ratio"]
        display(table(
            ["case", "ours predict ms", "built-in predict ms", "ratio",
             "ours train ms", "built-in train ms", "ratio"],
            [[r["case"], *(fmt(r[k], ".2f") for k in timing)] for r in records],
        ))

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
        """,
    ),
    (
        "md",
        """
        ## Where the built-in fails

        The records whose built-in run raised (on JAX: `value_dim != key_dim`, whose
        fused path needs equal head sizes). `keras_mha` ran those cases:
        """,
    ),
    (
        "code",
        """
        failed = [r for r in records if r["builtin_error"]]
        for r in failed:
            print(f"{r['case']}: built-in -> {r['builtin_error']}")
            print(f"{'':>{len(r['case'])}}  keras_mha -> ran, passed={r['passed']}, "
                  f"predict {fmt(r['ours_predict_ms'], '.2f')} ms")
        if not failed:
            print(f"the built-in ran every case on {keras.backend.backend()}")
        """,
    ),
    (
        "md",
        """
        ## Where the built-in is wrong

        ### The symbolic shape of cross-attention scores

        A functional model is built from symbolic shapes. For a query of length 6 and
        a value of length 10 the scores are `(B, heads, 6, 10)`; the built-in declares
        `(None, heads, 6, 6)`, so any layer built on them gets the wrong shape, while its
        computed scores (run eagerly) are right.
        """,
    ),
    (
        "code",
        """
        query, value = keras.Input(shape=(6, 8)), keras.Input(shape=(10, 8))
        q, v = np.zeros((3, 6, 8), "float32"), np.zeros((3, 10, 8), "float32")
        for cls in (keras.layers.MultiHeadAttention, keras_mha.MultiHeadAttention):
            _, declared = cls(num_heads=2, key_dim=4)(query, value, return_attention_scores=True)
            _, computed = cls(num_heads=2, key_dim=4)(q, v, return_attention_scores=True)
            name = f"{cls.__module__.split('.')[0]}.MultiHeadAttention"
            ok = declared.shape[1:] == tuple(computed.shape)[1:]
            print(f"{name:<30} declared {declared.shape}, computed {tuple(computed.shape)}, "
                  f"consistent: {ok}")
        """,
    ),
    (
        "md",
        """
        ### A query that may attend to nothing

        When a query row's keys are all masked (a padded query, or a padding mask that
        hides a whole sequence), there is nothing to average. `keras_mha` gives such a
        row zero weights, hence a zero context (the output is the output projection's
        bias, zero here), whichever kernel runs. The built-in's answer depends on its
        code path: asking for the scores takes another path than not asking. Below,
        the same layer, the same weights and inputs, with and without
        `return_attention_scores`:
        """,
    ),
    (
        "code",
        """
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
            print(f"{name:>9}: output row 0 {plain[0, 0, :4].round(3)} ..., with scores "
                  f"{with_scores[0, 0, :4].round(3)} ..., "
                  f"max |difference| {np.abs(plain[0, 0] - with_scores[0, 0]).max():.3f}")
        """,
    ),
    (
        "md",
        """
        The differences that matter to users are the ones above; everywhere else the
        two layers agree to float32 rounding, as the parity table shows, and the same
        weights load in either. `keras-mha compare` reruns all of this on every
        installed backend.
        """,
    ),
]

NOTEBOOKS = {
    "01_quickstart": QUICKSTART,
    "02_key_dim_and_num_heads": KEY_DIM,
    "03_shapes_masks_and_scores": SHAPES,
    "04_fused_vs_per_head_projections": FUSED,
    "05_compare_with_builtin": COMPARE,
}


def write(name, spec, folder=HERE):
    """Writes `folder/name.ipynb` (no outputs) from a list of (kind, text) cells."""
    nb = nbformat.v4.new_notebook()
    nb.cells = _cells(spec)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    path = Path(folder) / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def format_and_lint(paths):
    """`ruff format` then `ruff check --fix` the notebooks, with the project's settings."""
    ruff = Path(sys.executable).parent / "ruff"
    paths = [str(p) for p in paths]
    config = ["--config", str(HERE.parent / "pyproject.toml")]
    subprocess.run([str(ruff), "format", "-q", *config, *paths], check=True)
    subprocess.run([str(ruff), "check", "-q", "--fix", *config, *paths], check=True)


def execute(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        record_timing=False,  # no timestamps: a rebuild changes only what changed
        kernel_name="python3",
        resources={"metadata": {"path": str(HERE)}},
    )
    client.execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not _is_native_log(o)]
    nbformat.write(nb, path)


def _is_native_log(output):
    """TensorFlow's C++ start-up lines (printed on import whatever the backend)."""
    if output.get("output_type") != "stream" or output.get("name") != "stderr":
        return False
    lines = [line for line in output["text"].splitlines() if line.strip()]
    return all(line.startswith(_NATIVE_LOG_PREFIXES) for line in lines)


_NATIVE_LOG_PREFIXES = (
    "WARNING: All log messages before absl",
    "To enable the following instructions",
    "I0000 ",
    "W0000 ",
    "E0000 ",
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="name prefixes, e.g. 01 03")
    parser.add_argument("--no-execute", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    names = [n for n in NOTEBOOKS if not args.only or any(n.startswith(p) for p in args.only)]
    paths = [write(name, NOTEBOOKS[name]) for name in names]
    format_and_lint(paths)
    if args.no_execute:
        return
    for path in paths:
        print(f"executing {path.name} on {os.environ['KERAS_BACKEND']} ...", flush=True)
        execute(path)


if __name__ == "__main__":
    main()
