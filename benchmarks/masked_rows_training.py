"""Training through query rows with no key to attend to: ours on torch against the
built-in on tensorflow and on torch.

Five small models on padded token inputs, each with built-in attention whose padded
query rows reach the loss (`x + attention(x, x)` drops the Keras mask):

- `pooling`: Embedding(mask_zero=True) -> x + attention -> average pooling -> Dense;
- `gru`: the same with a GRU head instead of the pooling;
- `sequence loss`: a causal x + attention, a per-token next-token loss;
- `cross-attention`: a causal decoder over its own padded tokens, then cross-attention
  to a padded source, a per-token loss;
- `transformer block`: keras.io's classifier (a registered block holding the
  built-in, layer norms, a feed-forward net), then x + causal attention, pooling.

Each model is built and saved once under tensorflow (seed 0; no dropout), with its data
(256 rows of 12 tokens, lengths 2-12, targets derived from the tokens). Then, each in a
fresh process, the same file trains two epochs (SGD 0.1, batch 32, no shuffling) four
ways: the built-in on tensorflow, ours (`keras_mha.swapping.load_swapped`) on
tensorflow, the built-in on torch, ours on torch. Reported: each epoch's mean loss, and
each way's final loss minus the built-in's on tensorflow. The built-in's torch gradients
through those rows are wrong (docs/guide/masks.md, "Rows with no key to attend to"), so
the built-in on torch drifts; ours on torch should end where tensorflow's built-in ends.
Plain SGD: Adam rescales each weight's gradient by its own running size, which can turn
rounding-level differences between backends into full-size steps, and the comparison
is about the gradients.

    .venv/bin/python benchmarks/masked_rows_training.py          # writes results/
    .venv/bin/python benchmarks/masked_rows_training.py --out /tmp/x
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = ("pooling", "gru", "sequence loss", "cross-attention", "transformer block")
WAYS = (("tensorflow", "builtin"), ("tensorflow", "ours"), ("torch", "builtin"), ("torch", "ours"))
ROWS, LENGTH, VOCAB, DIM, HEADS, CLASSES = 256, 12, 40, 32, 4, 4
EPOCHS, BATCH, LEARNING_RATE = 2, 32, 0.1


def _register():
    import keras

    @keras.saving.register_keras_serializable(package="masked_rows_training")
    class TransformerBlock(keras.layers.Layer):
        """keras.io's block (text classification with a Transformer), no dropout."""

        def __init__(self, embed_dim, num_heads, ff_dim, **kwargs):
            super().__init__(**kwargs)
            self.supports_masking = True
            self.embed_dim, self.num_heads, self.ff_dim = embed_dim, num_heads, ff_dim
            self.att = keras.layers.MultiHeadAttention(num_heads, embed_dim // num_heads)
            self.ffn = keras.Sequential(
                [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
            )
            self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
            self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)

        def call(self, inputs):
            out1 = self.norm1(inputs + self.att(inputs, inputs))
            return self.norm2(out1 + self.ffn(out1))

        def get_config(self):
            return {
                **super().get_config(),
                "embed_dim": self.embed_dim,
                "num_heads": self.num_heads,
                "ff_dim": self.ff_dim,
            }

    return TransformerBlock


def _data():
    """Padded tokens (trailing zeros), a padded source, and each model's targets."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, LENGTH + 1, ROWS)
    valid = np.arange(LENGTH)[None, :] < lengths[:, None]
    tokens = np.where(valid, rng.integers(1, VOCAB, (ROWS, LENGTH)), 0).astype("int32")
    source = np.where(
        np.arange(LENGTH)[None, :] < rng.integers(2, LENGTH + 1, ROWS)[:, None],
        rng.integers(1, VOCAB, (ROWS, LENGTH)),
        0,
    ).astype("int32")
    classes = (tokens[:, 0] % CLASSES).astype("int32")
    next_tokens = np.concatenate([tokens[:, 1:], np.zeros((ROWS, 1), "int32")], axis=1)
    return {"tokens": tokens, "source": source, "classes": classes, "next": next_tokens}


def _build(name, block_class):
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, DIM, mask_zero=True)(tokens)
    attention = layers.MultiHeadAttention(HEADS, DIM // HEADS)
    inputs = tokens
    if name == "pooling":
        x = x + attention(x, x)
        out = layers.Dense(CLASSES)(layers.GlobalAveragePooling1D()(x))
    elif name == "gru":
        x = x + attention(x, x)
        out = layers.Dense(CLASSES)(layers.GRU(16)(x))
    elif name == "sequence loss":
        x = x + attention(x, x, use_causal_mask=True)
        out = layers.Dense(VOCAB)(x)
    elif name == "cross-attention":
        source = keras.Input((LENGTH,), dtype="int32", name="source")
        memory = layers.Embedding(VOCAB, DIM, mask_zero=True)(source)
        x = x + attention(x, x, use_causal_mask=True)
        x = x + layers.MultiHeadAttention(HEADS, DIM // HEADS)(x, memory)
        out = layers.Dense(VOCAB)(x)
        inputs = [tokens, source]
    else:
        x = block_class(DIM, HEADS, 2 * DIM)(x)
        x = x + attention(x, x, use_causal_mask=True)
        out = layers.Dense(CLASSES)(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, out, name=name.replace(" ", "_").replace("-", "_"))


def _feed(name, data):
    x = [data["tokens"], data["source"]] if name == "cross-attention" else data["tokens"]
    y = data["next"] if name in ("sequence loss", "cross-attention") else data["classes"]
    return x, y


def build(folder):
    """Child under tensorflow: saves each model and the data into `folder`."""
    block_class = _register()
    data = _data()
    np.savez(os.path.join(folder, "data.npz"), **data)
    for name in MODELS:
        _build(name, block_class).save(os.path.join(folder, f"{name}.keras"))


def train(folder, layer):
    """Child: trains each saved model two epochs; returns `{model: [epoch losses]}`."""
    import keras

    from keras_mha import swapping

    _register()
    with np.load(os.path.join(folder, "data.npz")) as stored:
        data = {key: stored[key] for key in stored.files}
    losses = {}
    for name in MODELS:
        path = os.path.join(folder, f"{name}.keras")
        model = swapping.load_swapped(path) if layer == "ours" else keras.saving.load_model(path)
        model.compile(
            optimizer=keras.optimizers.SGD(LEARNING_RATE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        x, y = _feed(name, data)
        history = model.fit(x, y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, verbose=0)
        losses[name] = [float(v) for v in history.history["loss"]]
    return losses


def _child(backend, *args):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    command = [sys.executable, os.path.abspath(__file__), "--child", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{backend} {args}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else None


def report(results):
    """A markdown table: final loss per model and way, and its distance from the
    built-in's on tensorflow."""
    head = [f"{backend} {layer}" for backend, layer in WAYS]
    lines = [
        "| model | "
        + " | ".join(head)
        + " | ours torch - builtin tf | builtin torch - builtin tf |",
        "|---|" + "---:|" * (len(head) + 2),
    ]
    for name in MODELS:
        final = {way: results[f"{way[0]} {way[1]}"][name][-1] for way in WAYS}
        truth = final[("tensorflow", "builtin")]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{final[way]:.5f}" for way in WAYS)
            + f" | {final[('torch', 'ours')] - truth:+.1e}"
            + f" | {final[('torch', 'builtin')] - truth:+.1e} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=RESULTS, help="folder of the results (%(default)s)")
    args = parser.parse_args(argv)
    if args.child:
        job, folder, *rest = args.child
        if job == "build":
            build(folder)
        else:
            print(json.dumps(train(folder, rest[0])))
        return 0
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="masked-rows-") as folder:
        _child("tensorflow", "build", folder)
        results = {
            f"{backend} {layer}": _child(backend, "train", folder, layer) for backend, layer in WAYS
        }
    table = report(results)
    print(table)
    meta = {
        "date": now,
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
        "versions": _versions(),
        "command": "python benchmarks/masked_rows_training.py",
        "settings": dict(
            rows=ROWS,
            length=LENGTH,
            vocab=VOCAB,
            dim=DIM,
            heads=HEADS,
            epochs=EPOCHS,
            batch=BATCH,
            optimizer=f"SGD({LEARNING_RATE})",
        ),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "masked_rows_training.json"), "w") as f:
        json.dump({"meta": meta, "losses": results}, f, indent=1)
    with open(os.path.join(args.out, "masked_rows_training.md"), "w") as f:
        f.write(
            "# Training through rows with no key: final loss after two epochs\n\n"
            f"`{meta['command']}`, {now}, {meta['machine']}; "
            + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
            + ".\n\nEach model saved once under tensorflow, then trained from those weights "
            "in a fresh process per way (SGD 0.1, batch 32, 256 rows of 12 tokens, "
            "padded; no dropout). Columns: the mean loss of the second epoch.\n\n" + table + "\n"
        )
    return 0


def _versions():
    from importlib import metadata

    found = {}
    for name, packages in (
        ("keras", ("keras",)),
        ("tensorflow", ("tensorflow", "tensorflow-cpu")),
        ("torch", ("torch",)),
    ):
        for package in packages:
            try:
                found[name] = metadata.version(package)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


if __name__ == "__main__":
    sys.exit(main())
