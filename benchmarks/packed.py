"""Packed sequences: a causal train step over documents of long-tailed lengths.

Documents with lognormal lengths (median 300 tokens, capped at 4096, about 64k tokens
in all, a fixed seed) go through one attention layer's train step
(`train_on_batch` of a functional model, dim 256, 4 heads, causal), four ways:

- `ours packed`: `keras_mha.MultiHeadAttention` on rows of T=4096 packed by
  `keras_mha.packing.pack`, with `segment_ids` (one row per step);
- `builtin padded`: `keras.layers.MultiHeadAttention`, batches of 8 documents padded
  to their longest, with a padding mask;
- `builtin packed dense`: the built-in on the same packed rows, with a dense
  block-diagonal causal `attention_mask` `(1, T, T)`;
- `ours one by one`: ours on each document alone (B=1, its own length).
- `no attention`: the packed rows' steps with a `Dense` layer where the attention was:
  what the rest of the step (inputs, loss, optimizer, allocator) grows by, which
  every way's growth includes.

Each way runs in a fresh process per backend: a warm-up pass over all its steps (every
shape compiled), then three timed passes (`--passes`), whose median counts (a way's time
varies from pass to pass). Reported: real (non-padding) tokens per second and the
growth of peak RSS over the process's baseline, taken after one step on the first
step's first 64 positions (`ru_maxrss`; on a GPU, the backend's peak device memory
where it reports one). The targets (issue 31): ours packed >= 2x the built-in padded in
tokens/s, peak memory <= 0.1x the built-in packed dense, and ours packed within 1.3x
the time of ours one by one; beside the memory target, the same ratio for no
attention at all. That last ratio comes from one more process per backend
that alternates the passes of ours packed and ours one by one (the ways' own processes
give it too, in brackets: a fresh process can run fast or slow as a whole).

    .venv/bin/python benchmarks/packed.py                  # every backend, writes results
    .venv/bin/python benchmarks/packed.py --dry-run        # toy sizes, checks it runs
    .venv/bin/python benchmarks/packed.py --backends jax
    python benchmarks/packed.py --backends torch jax --out /tmp/gpu   # a GPU session's
"""

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

BACKENDS = ("tensorflow", "jax", "torch")
PACKED, ALONE = "ours packed", "ours one by one"
NONE = "no attention"
WAYS = (PACKED, "builtin padded", "builtin packed dense", ALONE, NONE)
AGAINST_ALONE = "ours packed / one by one"  # the two ways alternated in one process
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FULL = dict(tokens=65_536, median=300, cap=4096, length=4096, dim=256, heads=4, batch=8)
PASSES = 3  # timed passes over the steps per way; the median counts
SMALL = 64  # positions of the step that sets the memory baseline
TOY = dict(tokens=2_048, median=30, cap=256, length=256, dim=32, heads=2, batch=4)


def document_lengths(tokens, median, cap, seed=0):
    """Lognormal lengths (sigma 1) of median `median`, capped, summing to ~`tokens`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(cap, max(2, round(rng.lognormal(np.log(median), 1.0))))))
    return lengths


def _steps(way, sizes):
    """The train steps of one way: a list of `(inputs, weights)` NumPy pairs, and the
    real tokens they hold."""
    import numpy as np

    from keras_mha import packing

    rng = np.random.default_rng(1)
    lengths = document_lengths(sizes["tokens"], sizes["median"], sizes["cap"])
    documents = [rng.standard_normal((n, sizes["dim"])).astype("float32") for n in lengths]
    steps = []
    if way in ("ours packed", "builtin packed dense", NONE):
        rows = packing.pack([np.arange(n) for n in lengths], sizes["length"])
        placed = _place(documents, rows, sizes)
        for x, ids in placed:
            if way in ("ours packed", NONE):
                steps.append(([x, ids], ids > 0))
            else:
                same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
                allowed = same & np.tri(ids.shape[1], dtype=bool)[None]
                steps.append(([x, allowed], ids > 0))
    elif way == "builtin padded":
        for i in range(0, len(documents), sizes["batch"]):
            group = documents[i : i + sizes["batch"]]
            longest = max(len(d) for d in group)
            x = np.zeros((len(group), longest, sizes["dim"]), "float32")
            valid = np.zeros((len(group), longest), bool)
            for j, d in enumerate(group):
                x[j, : len(d)], valid[j, : len(d)] = d, True
            steps.append(([x, valid], valid))
    else:  # one by one
        for d in documents:
            steps.append(([d[None]], np.ones((1, len(d)), bool)))
    return steps, sum(lengths)


def _place(documents, rows, sizes):
    """Rows of embeddings laid out as `pack` laid out the token ids (each document's
    positions 0..n-1 stand for its rows of `documents`)."""
    import numpy as np

    by_length = {}
    for d in documents:
        by_length.setdefault(len(d), []).append(d)
    placed = []
    for ids in rows["segment_ids"]:
        x = np.zeros((sizes["length"], sizes["dim"]), "float32")
        for i in range(1, ids.max() + 1):
            where = np.flatnonzero(ids == i)
            x[where] = by_length[len(where)].pop()
        placed.append((x[None], ids[None]))
    return placed


def _model(way, sizes):
    """A functional model of one attention layer, causal, as the way calls it."""
    import keras

    import keras_mha

    dim, heads = sizes["dim"], sizes["heads"]
    x = keras.Input((None, dim))
    if way == NONE:
        ids = keras.Input((None,), dtype="int32")
        return keras.Model([x, ids], keras.layers.Dense(dim)(x))
    if way in ("ours packed", "ours one by one"):
        layer = keras_mha.MultiHeadAttention(heads, dim // heads)
        if way == "ours packed":
            ids = keras.Input((None,), dtype="int32")
            return keras.Model([x, ids], layer(x, x, segment_ids=ids, use_causal_mask=True))
        return keras.Model(x, layer(x, x, use_causal_mask=True))
    layer = keras.layers.MultiHeadAttention(heads, dim // heads)
    if way == "builtin padded":
        valid = keras.Input((None,), dtype="bool")
        out = layer(x, x, query_mask=valid, value_mask=valid, use_causal_mask=True)
        return keras.Model([x, valid], out)
    mask = keras.Input((None, None), dtype="bool")
    return keras.Model([x, mask], layer(x, x, attention_mask=mask))


def _peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _device_peak_mib():
    """The backend's peak device memory in MiB, where it reports one (GPUs)."""
    import keras

    name = keras.backend.backend()
    try:
        if name == "torch":
            import torch

            if torch.cuda.is_available():
                return torch.cuda.max_memory_allocated() / 2**20
        elif name == "jax":
            import jax

            stats = jax.devices()[0].memory_stats() or {}
            if "peak_bytes_in_use" in stats:
                return stats["peak_bytes_in_use"] / 2**20
        elif name == "tensorflow":
            import tensorflow as tf

            if tf.config.list_physical_devices("GPU"):
                return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    except Exception:  # noqa: BLE001 - a backend without the counter reports none
        return None
    return None


def measure(way, sizes, passes=PASSES):
    """One way's tokens/s (the median of `passes` timed passes over its steps) and peak
    memory growth, in this process."""
    import keras

    steps, tokens, model, run_pass = _prepare(way, sizes)
    # The baseline: the process after one step on the first step's first 64 positions
    # (libraries loaded, the step traced), so the growth is what the full sizes need.
    (first_inputs, first_weights), first_target = steps[0]
    small = [_head(x, SMALL) for x in first_inputs]
    model.train_on_batch(
        small, _head(first_target, SMALL), sample_weight=_head(first_weights, SMALL)
    )
    baseline = _peak_mib()
    warmup = _timed(run_pass)  # every shape, met for the first time
    times = [_timed(run_pass) for _ in range(passes)]
    seconds = statistics.median(times)
    return {
        "way": way,
        "backend": keras.backend.backend(),
        "steps": len(steps),
        "tokens": tokens,
        "seconds": seconds,
        "pass_seconds": times,
        "first_pass_seconds": warmup,
        "tokens_per_s": tokens / seconds,
        "peak_growth_mib": _peak_mib() - baseline,
        "device_peak_mib": _device_peak_mib(),
    }


def measure_against_alone(sizes, passes=PASSES):
    """Ours packed against ours one by one in one process, their passes alternated:
    the time target's ratio, free of the process-to-process differences that the
    ways' separate processes carry (a fresh JAX process runs fast or slow as a whole)."""
    import keras

    runs = [_prepare(way, sizes)[3] for way in (PACKED, ALONE)]
    for run_pass in runs:  # warm-up: every shape
        run_pass()
    times = ([], [])
    for i in range(passes):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for j in order:
            times[j].append(_timed(runs[j]))
    ratios = [a / b for a, b in zip(*times)]
    return {
        "way": AGAINST_ALONE,
        "backend": keras.backend.backend(),
        "packed_seconds": times[0],
        "alone_seconds": times[1],
        "ratio": statistics.median(times[0]) / statistics.median(times[1]),
        "pass_ratios": ratios,
    }


def _prepare(way, sizes):
    """`(steps, tokens, model, run_pass)`: a way's steps, each `((inputs, weights),
    target)`, its compiled model, and a function running one pass over the steps."""
    import numpy as np

    steps, tokens = _steps(way, sizes)
    steps = [(step, np.zeros(step[0][0].shape, "float32")) for step in steps]
    model = _model(way, sizes)
    model.compile(optimizer="sgd", loss="mse")

    def run_pass():
        for (inputs, weights), target in steps:
            model.train_on_batch(inputs, target, sample_weight=weights)

    return steps, tokens, model, run_pass


def _timed(function):
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def _head(x, n):
    """`x` over its first `n` positions (a dense `(B, T, T)` mask: on both axes)."""
    x = x[:, :n]
    return x[:, :, :n] if x.ndim == 3 and x.dtype == bool else x


def _run_child(backend, way, sizes, passes=PASSES):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, __file__, "--child", way, "--sizes", json.dumps(sizes)]
    command += ["--passes", str(passes)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        return {"way": way, "backend": backend, "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(records):
    """The markdown table of every backend, with the issue's three ratios."""
    lines = [
        "| backend | way | steps | tokens/s | peak RSS growth (MiB) | device peak (MiB) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    by = {}
    for r in records:
        by[(r["backend"], r["way"])] = r
        if r["way"] == AGAINST_ALONE and "error" not in r:
            continue  # a ratio, in the second table
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['way']} | failed | | | |")
            continue
        device = "" if r["device_peak_mib"] is None else f"{r['device_peak_mib']:.0f}"
        lines.append(
            f"| {r['backend']} | {r['way']} | {r['steps']} | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_growth_mib']:.0f} | {device} |"
        )
    lines += [
        "",
        "| backend | ours packed / builtin padded, tokens/s (>= 2) "
        "| ours packed / builtin packed dense, memory (<= 0.1) "
        "| no attention / builtin packed dense, memory "
        "| ours packed / one by one, time (<= 1.3): alternated in one process "
        "(the ways' own processes) |",
        "|---|---:|---:|---:|---:|",
    ]
    for backend in sorted({r["backend"] for r in records}):
        ours, padded, dense, alone, none = (by.get((backend, way), {}) for way in WAYS)
        if any("error" in r or not r for r in (ours, padded, dense, alone)):
            lines.append(f"| {backend} | n/a | n/a | n/a | n/a |")
            continue
        memory = "peak_growth_mib" if ours["device_peak_mib"] is None else "device_peak_mib"
        pair = by.get((backend, AGAINST_ALONE), {})
        paired = "n/a" if "ratio" not in pair else f"{pair['ratio']:.2f}x"
        floor = "n/a" if "error" in none or not none else f"{none[memory] / dense[memory]:.3f}x"
        lines.append(
            f"| {backend} | {ours['tokens_per_s'] / padded['tokens_per_s']:.2f}x "
            f"| {ours[memory] / max(dense[memory], 1e-9):.3f}x | {floor} "
            f"| {paired} ({ours['seconds'] / alone['seconds']:.2f}x) |"
        )
    return "\n".join(lines) + "\n"


def _kept_records(rerun, folder=RESULTS):
    """The last results' records (in `folder`) of the backends not measured again, with
    their date."""
    path = os.path.join(folder, "packed.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        last = json.load(f)
    kept = [r for r in last["records"] if r["backend"] not in rerun]
    for record in kept:
        record.setdefault("date", last["meta"]["date"])
    return kept


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes; writes nothing")
    parser.add_argument("--child", choices=WAYS + (AGAINST_ALONE,), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument(
        "--passes", type=int, default=PASSES, help="timed passes per way; the median counts"
    )
    parser.add_argument(
        "--out", default=RESULTS, help="folder of packed.json and packed.md (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.child:
        sizes = json.loads(args.sizes)
        if args.child == AGAINST_ALONE:
            print(json.dumps(measure_against_alone(sizes, args.passes)))
        else:
            print(json.dumps(measure(args.child, sizes, args.passes)))
        return 0
    sizes = TOY if args.dry_run else FULL
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    passes = 1 if args.dry_run else args.passes
    ways = WAYS + (AGAINST_ALONE,)
    records = [_run_child(b, way, sizes, passes) for b in args.backends for way in ways]
    for record in records:
        record["date"] = now
    if not args.dry_run:
        records = _kept_records(args.backends, args.out) + records
    table = report(records)
    print(table)
    failed = [r for r in records if "error" in r]
    for r in failed:
        print(f"{r['backend']} / {r['way']} failed:\n{r['error']}", file=sys.stderr)
    if not args.dry_run:
        meta = {
            "date": now,
            "machine": platform.platform(),
            "sizes": sizes,
            "passes": passes,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "packed.json"), "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
        with open(os.path.join(args.out, "packed.md"), "w") as f:
            dates = ", ".join(sorted({f"{r['backend']} {r['date']}" for r in records}))
            f.write(f"Packed sequences (measured {dates}), {meta['machine']}\n\n{table}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
