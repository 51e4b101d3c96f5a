"""keras-hub language models fine-tuned on long-tailed documents: padded against packed.

About 64k tokens of documents with lognormal lengths (median 300, capped at 4096, a
fixed seed; random token ids) train a keras-hub `CausalLM` (`preprocessor=None`, 2
layers, hidden 256, 4 heads of 64, vocabulary 1000, random weights; built by
`build`) one epoch of `train_on_batch` steps (SGD), three ways:

- `unswapped padded`: keras-hub's own model, the documents in random order, batches of 8
  padded to their longest (padding mask, padding and each last token weighing 0);
- `swapped padded`: the same batches through `keras_mha.swap(model)`;
- `swapped packed`: `keras_mha.hub.set_packed(keras_mha.swap(model))` on rows of
  T = 4096 packed by `keras_mha.packing.pack` (one row per step, `padding_mask` the
  segment ids, the loss mask as sample weights).

Each (model, way) runs in a fresh process per backend: one step on the first batch's
first 64 positions sets the memory baseline, a warm-up pass over all the steps compiles
every shape, then `--passes` timed passes, whose median counts. Reported: real
(non-padding) tokens per second, and the growth of the process's peak RSS over the
baseline (`ru_maxrss`; on a GPU, the backend's peak device memory where it reports one).
A process that outgrows `--memory-limit-gib` of resident memory (16 GiB: the machine
has 24) or runs past `--time-limit-s` is stopped and reported as such.
The targets (issue 52): packed >= 3x the unswapped padded tokens/s on every backend, and
peak memory no higher than the unswapped padded run. A model that `keras_mha.swap` does
not move (no entry in `keras_mha.hub`) reports an error for its swapped ways.

    .venv/bin/python benchmarks/hub_packed.py                   # writes results/hub_packed.*
    .venv/bin/python benchmarks/hub_packed.py --dry-run         # toy sizes, writes nothing
    .venv/bin/python benchmarks/hub_packed.py --backends jax --models llama
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hub_lm  # noqa: E402
from packed import _device_peak_mib, _peak_mib, document_lengths  # noqa: E402

BACKENDS = ("tensorflow", "jax", "torch")
MODELS = ("llama", "gemma3")
WAYS = ("unswapped padded", "swapped padded", "swapped packed")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FULL = dict(
    tokens=65_536, median=300, cap=4096, length=4096, batch=8, layers=2, hidden=256, heads=4
)
FULL["vocab"] = 1000
TOY = dict(tokens=1_024, median=30, cap=128, length=128, batch=4, layers=1, hidden=32, heads=2)
TOY["vocab"] = 64
PASSES = 3
SMALL = 64  # positions of the step that sets the memory baseline


def documents(sizes, seed=0):
    """The documents: random token ids in `[1, vocab)` of long-tailed lengths."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = document_lengths(sizes["tokens"], sizes["median"], sizes["cap"])
    return [rng.integers(1, sizes["vocab"], n).astype("int32") for n in lengths]


def steps(way, sizes):
    """`(x, y, sample_weight)` NumPy batches of one way, and the real tokens they hold."""
    import numpy as np

    from keras_mha import packing

    docs = documents(sizes)
    tokens = sum(len(d) for d in docs)
    if way == "swapped packed":
        rows = packing.pack(docs, sizes["length"])
        return [
            (
                {"token_ids": rows["token_ids"][r : r + 1], "padding_mask": ids[None]},
                rows["targets"][r : r + 1],
                rows["loss_mask"][r : r + 1].astype("float32"),
            )
            for r, ids in enumerate(rows["segment_ids"])
        ], tokens
    order = np.random.default_rng(1).permutation(len(docs))
    batches = []
    for s in range(0, len(docs), sizes["batch"]):
        group = [docs[i] for i in order[s : s + sizes["batch"]]]
        longest = max(len(d) for d in group)
        token_ids = np.zeros((len(group), longest), "int32")
        mask = np.zeros((len(group), longest), "int32")
        targets = np.zeros_like(token_ids)
        weights = np.zeros((len(group), longest), "float32")
        for j, d in enumerate(group):
            token_ids[j, : len(d)], mask[j, : len(d)] = d, 1
            targets[j, : len(d) - 1], weights[j, : len(d) - 1] = d[1:], 1.0
        batches.append(({"token_ids": token_ids, "padding_mask": mask}, targets, weights))
    return batches, tokens


def build(name, sizes):
    """A keras-hub CausalLM of the given sizes (`hub_lm.build`'s; Gemma 3 text-only)."""
    if name != "gemma3":
        return hub_lm.build(name, sizes)
    import keras_hub

    models = keras_hub.models
    backbone = models.Gemma3Backbone(
        vocabulary_size=sizes["vocab"],
        image_size=None,
        num_layers=sizes["layers"],
        num_query_heads=sizes["heads"],
        num_key_value_heads=sizes["heads"],
        hidden_dim=sizes["hidden"],
        intermediate_dim=2 * sizes["hidden"],
        head_dim=sizes["hidden"] // sizes["heads"],
        use_sliding_window_attention=True,
        sliding_window_size=1024,
    )
    return models.Gemma3CausalLM(preprocessor=None, backbone=backbone)


def _model(name, way, sizes):
    import warnings

    import keras

    import keras_mha
    from keras_mha import hub

    keras.utils.set_random_seed(0)
    model = build(name, sizes)
    if way != "unswapped padded":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = keras_mha.swap(model)
        if way == "swapped packed":
            hub.set_packed(model)  # raises when the model's attention did not move
        elif not hub.describe_masks(model):
            raise ValueError(f"keras_mha.swap does not move {name}'s attention")
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def measure(name, way, sizes, passes):
    """One (model, way)'s tokens/s and peak memory growth, in this process."""
    import keras

    batches, tokens = steps(way, sizes)
    model = _model(name, way, sizes)
    x, y, w = batches[0]
    head = {k: v[:, :SMALL] for k, v in x.items()}
    model.train_on_batch(head, y[:, :SMALL], sample_weight=w[:, :SMALL])
    baseline = _peak_mib()

    def run_pass():
        for x, y, w in batches:
            loss = model.train_on_batch(x, y, sample_weight=w)
        return float(loss)

    _timed(run_pass)  # warm-up: every shape compiled
    times = [_timed(run_pass) for _ in range(passes)]
    seconds = statistics.median(times)
    return {
        "model": name,
        "way": way,
        "backend": keras.backend.backend(),
        "steps": len(batches),
        "tokens": tokens,
        "padded_tokens": int(sum(v["token_ids"].size for v, _, _ in batches)),
        "seconds": seconds,
        "times": times,
        "tokens_per_s": tokens / seconds,
        "peak_growth_mib": _peak_mib() - baseline,
        "device_peak_mib": _device_peak_mib(),
    }


def _timed(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _run_child(backend, name, way, sizes, args):
    worker_args = ["--child", name, way, "--sizes", json.dumps(sizes)]
    worker_args += ["--passes", str(1 if args.dry_run else args.passes)]
    result = hub_lm.spawn(backend, worker_args, args, script=__file__)
    return {"model": name, "way": way, "backend": backend, **result}


def report(records, sizes, command):
    lines = [
        "# keras-hub language models on long-tailed documents: padded against packed",
        "",
        f"Measured {datetime.date.today()} on {platform.node()} ({os.cpu_count()} cores), "
        f"`{command}` (sizes {sizes}).",
        "",
        "| backend | model | way | steps | real tokens / s | padded share | peak growth MiB "
        "| device peak MiB | tokens/s vs unswapped padded | memory vs unswapped padded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {
        (r["backend"], r["model"]): r
        for r in records
        if r["way"] == "unswapped padded" and "error" not in r
    }
    for r in records:
        if "error" in r:
            error = r["error"].replace("|", "/")
            lines.append(f"| {r['backend']} | {r['model']} | {r['way']} | {error} |" + " — |" * 6)
            continue
        b = base.get((r["backend"], r["model"]))
        speed = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "—"
        memory = f"{r['peak_growth_mib'] / max(b['peak_growth_mib'], 1.0):.2f}x" if b else "—"
        device = "—" if r["device_peak_mib"] is None else f"{r['device_peak_mib']:.0f}"
        lines.append(
            f"| {r['backend']} | {r['model']} | {r['way']} | {r['steps']} | "
            f"{r['tokens_per_s']:.0f} | {1 - r['tokens'] / r['padded_tokens']:.0%} | "
            f"{r['peak_growth_mib']:.0f} | {device} | {speed} | {memory} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--passes", type=int, default=PASSES)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes; writes nothing")
    parser.add_argument("--out", default=RESULTS, help="folder for hub_packed.json/.md")
    parser.add_argument("--memory-limit-gib", type=float, default=16.0)
    parser.add_argument("--time-limit-s", type=float, default=1800.0)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "WAY"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, way = args.child
        result = measure(name, way, json.loads(args.sizes), args.passes)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    sizes = TOY if args.dry_run else FULL
    records = []
    for backend in args.backends:
        for name in args.models:
            for way in args.ways:
                record = _run_child(backend, name, way, sizes, args)
                records.append(record)
                shown = record.get("error") or f"{record['tokens_per_s']:.0f} tokens/s"
                print(f"{backend} {name} {way}: {shown}", flush=True)
    command = "python benchmarks/hub_packed.py " + " ".join(argv or sys.argv[1:])
    text = report(records, sizes, command.strip())
    print(text)
    if args.dry_run:
        return 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hub_packed.json"), "w") as f:
        json.dump(
            {"date": str(datetime.date.today()), "sizes": sizes, "records": records}, f, indent=1
        )
    with open(os.path.join(args.out, "hub_packed.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
