"""Distance to the floor: attention against the machine, not only against the built-in.

The floor of a call is its useful floating-point work at the backend's own matrix-multiply
rate: `4 * key_dim` FLOPs per head for each (query, key) pair that the masks leave visible
(a padded query sees none), plus the four projections (`2 * dim * dim` FLOPs per token
each); a train step's floor is 3x its forward. The rate is the best of 15 float32
`2048 x 2048 x 2048` matmuls, measured in the same process as the layer.

Workload (issue 30): B=1, T=S=8192, dim 256, 4 heads, self-attention on the output of
`Embedding(1000, 256)`, through `predict_on_batch` / `train_on_batch` of a functional
model. Padded + causal: `Embedding(mask_zero=True)` with the last quarter of the tokens
padding (id 0), and `use_causal_mask=True`. Each layer runs in child processes of its own
(a warm-up call, then the median of `--calls` timed calls, each after a call of the same
step), ours and the built-in alternating in `--pairs` rounds: neither layer's time carries
what the other left in its process (JAX's train step of ours took 1070-1641 ms right after
the built-in's in one process, 775-794 ms alone).

Also here: the sweep of time against T (1024 ... 32768, padded + causal, forward and
train step, one call after a warm-up, a fresh process per point) with the floor beside
it, and the cached decode step against keras-hub's `CachedMultiHeadAttention` (B=4, a
cache of 1024 positions, dim 512, 8 heads, one new token at the last position; both
compiled the same way: `tf.function`, `jax.jit`, or eager under `torch.no_grad`).

Writes `benchmarks/results/floor.{md,json,png}`:

    .venv/bin/python benchmarks/floor.py                      # every backend
    .venv/bin/python benchmarks/floor.py --backends torch --no-sweep
    .venv/bin/python benchmarks/floor.py --dry-run            # tiny sizes: checks the code
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402  (benchmarks/run.py: process spawning, alternated rounds)

RESULTS = bench.RESULTS
VOCABULARY = 1000
SWEEP_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
# (time / floor) targets of issue 30, per case.
TARGETS = {"unmasked forward": 1.3, "padded+causal forward": 1.5, "padded+causal train": 2.0}


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: int = 1
    length: int = 8192
    dim: int = 256
    heads: int = 4
    masked: bool = True

    @property
    def valid(self):
        """Real tokens per row: the last quarter is padding when masked."""
        return self.length - self.length // 4 if self.masked else self.length

    def visible_pairs(self):
        n = self.valid
        return self.batch * (n * (n + 1) // 2 if self.masked else n * n)

    def floor_flops(self, step):
        projections = 4 * 2 * self.batch * self.length * self.dim * self.dim
        attention = 4 * self.dim * self.visible_pairs()  # 4 * key_dim * heads per pair
        forward = projections + attention
        return forward if step == "predict" else 3 * forward


CASES = {
    "unmasked forward": (dataclasses.replace(Workload(), masked=False), "predict"),
    "padded+causal forward": (Workload(), "predict"),
    "padded+causal train": (Workload(), "train"),
}
DRY = {"length": 256, "sweep": (128, 256)}


# ----------------------------------------------------------------- child process side
def _model(which, work):
    import keras

    import keras_mha

    cls = keras_mha.MultiHeadAttention if which == "ours" else keras.layers.MultiHeadAttention
    tokens = keras.Input(shape=(work.length,), batch_size=work.batch, dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, work.dim, mask_zero=work.masked)(tokens)
    y = cls(num_heads=work.heads, key_dim=work.dim // work.heads)(x, x, use_causal_mask=work.masked)
    model = keras.Model(tokens, y)
    model.compile(optimizer="sgd", loss="mse")
    return model


def _step(model, work, step):
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, (work.batch, work.length)).astype("int32")
    tokens[:, work.valid :] = 0
    if step == "predict":
        return lambda: model.predict_on_batch(tokens)
    target = rng.standard_normal((work.batch, work.length, work.dim)).astype("float32")
    return lambda: model.train_on_batch(tokens, target)


def case_worker(case, length, which, calls):
    """One layer, one case, in a process of its own: a warm-up call, then the median of
    `calls` timed calls, each after a call of the same step; the GEMM rate measured in
    the same process."""
    import statistics

    work, step = CASES[case]
    work = dataclasses.replace(work, length=length)
    run = _step(_model(which, work), work, step)
    run()
    seconds = []
    for _ in range(calls):
        run()
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    rate = bench._matmul_flops_per_second()
    return dict(
        ms=statistics.median(seconds) * 1e3,
        calls_ms=[s * 1e3 for s in seconds],
        gemm_gflops=rate / 1e9,
        floor_ms=work.floor_flops(step) / rate * 1e3,
    )


def sweep_worker(which, step, length):
    """One layer, one padded + causal step at `length`: a warm-up call, then one timed."""
    work = dataclasses.replace(Workload(), length=length)
    run = _step(_model(which, work), work, step)
    run()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    rate = bench._matmul_flops_per_second()
    return dict(ms=seconds * 1e3, floor_ms=work.floor_flops(step) / rate * 1e3)


def decode_worker(pairs, cache_length, dim, heads, batch):
    """The cached decode step: ours against keras-hub's `CachedMultiHeadAttention`."""
    import keras
    import numpy as np
    from keras_hub.layers import CachedMultiHeadAttention

    import keras_mha

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)
    key_dim = dim // heads
    ours = keras_mha.MultiHeadAttention(num_heads=heads, key_dim=key_dim)
    hub = CachedMultiHeadAttention(num_heads=heads, key_dim=key_dim)
    x = rng.standard_normal((batch, 1, dim)).astype("float32")
    ours(x, x)
    hub(x, x)
    hub.set_weights(ours.get_weights())
    cache = rng.standard_normal((batch, 2, cache_length, heads, key_dim)).astype("float32")
    index = cache_length - 1
    # keras-hub's decoders pass the causal mask of the new token over the cache.
    mask = np.ones((batch, 1, cache_length), bool)

    def call_ours(x, cache):
        return ours(x, x, cache=cache, cache_update_index=index, use_causal_mask=True)

    def call_hub(x, cache):
        return hub(x, x, attention_mask=mask, cache=cache, cache_update_index=index)

    calls = [call_ours, call_hub]
    if backend == "tensorflow":
        import tensorflow as tf

        calls = [tf.function(f) for f in calls]
    elif backend == "jax":
        import jax

        # Stateless layers: the weights are traced as constants, for both the same way.
        calls = [jax.jit(f) for f in calls]
    x_t, cache_t = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(cache)

    def timed(f):
        def step():
            if backend == "torch":
                import torch

                with torch.no_grad():
                    out = f(x_t, cache_t)
            else:
                out = f(x_t, cache_t)
            keras.ops.convert_to_numpy(out[0])

        return step

    (o, h), spread = bench._median_pairs([timed(f) for f in calls], pairs, warmup=2)
    out_ours = keras.ops.convert_to_numpy(calls[0](x_t, cache_t)[0])
    out_hub = keras.ops.convert_to_numpy(calls[1](x_t, cache_t)[0])
    return dict(
        ours_ms=o * 1e3,
        hub_ms=h * 1e3,
        ratio=o / h,
        quartiles=spread,
        max_difference=float(np.max(np.abs(out_ours - out_hub))),
    )


def _child(args):
    if args.worker == "case":
        result = case_worker(args.case, args.length, args.which, args.calls)
    elif args.worker == "sweep":
        result = sweep_worker(args.which, args.step, args.length)
    else:
        size = (16, 64, 4, 2) if args.dry_run else (1024, 512, 8, 4)
        result = decode_worker(args.pairs, *size)
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- parent process side
def _spawn(backend, worker_args, args):
    argv = [*worker_args] + (["--dry-run"] if args.dry_run else [])
    return bench._spawn(backend, argv, args.memory_limit, args.time_limit, script=__file__)


def run_case(backend, case, length, args):
    """`case` for ours and the built-in, each layer in processes of its own, in
    `args.pairs` alternated rounds (ours first, then the built-in first, ...): neither
    layer's time carries what the other left in the process. Each ratio is a median
    over rounds of the two processes' times; each distance to the floor, over each
    process's time against its own GEMM rate."""
    import statistics

    runs = {"ours": [], "builtin": []}
    for i in range(args.pairs):
        for which in ("ours", "builtin")[:: -1 if i % 2 else 1]:
            worker = ["--worker", "case", "--case", case, "--length", str(length)]
            point = _spawn(backend, worker + ["--which", which, "--calls", str(args.calls)], args)
            if point.get("failed"):
                return {"case": case, "length": length, "failed": f"{which}: {point['failed']}"}
            runs[which].append(point)
    ratios = [o["ms"] / b["ms"] for o, b in zip(runs["ours"], runs["builtin"])]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3

    def median(which, value):
        return statistics.median(value(p) for p in runs[which])

    every = runs["ours"] + runs["builtin"]
    return dict(
        case=case,
        length=length,
        ours_ms=median("ours", lambda p: p["ms"]),
        builtin_ms=median("builtin", lambda p: p["ms"]),
        ratio=statistics.median(ratios),
        quartiles=(quartiles[0], quartiles[-1]),
        gemm_gflops=statistics.median(p["gemm_gflops"] for p in every),
        floor_ms=statistics.median(p["floor_ms"] for p in every),
        ours_floor=median("ours", lambda p: p["ms"] / p["floor_ms"]),
        builtin_floor=median("builtin", lambda p: p["ms"] / p["floor_ms"]),
        processes=runs,
    )


def run_backend(backend, args):
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"backend": backend, "started": now.strftime("%Y-%m-%d %H:%M UTC"), "cases": {}}
    length = DRY["length"] if args.dry_run else Workload().length
    for case in CASES:
        print(f"[{backend}] {case} ...", flush=True)
        record["cases"][case] = run_case(backend, case, length, args)
    print(f"[{backend}] cached decode step ...", flush=True)
    decode = ["--worker", "decode", "--pairs", str(args.decode_pairs)]
    record["decode"] = _spawn(backend, decode, args)
    if args.sweep:
        lengths = DRY["sweep"] if args.dry_run else args.sweep_lengths
        record["sweep"] = {}
        for step in ("predict", "train"):
            record["sweep"][step] = {}
            for which in ("ours", "builtin"):
                rows, failed = [], None
                for t in lengths:
                    if not failed:
                        print(f"[{backend}] sweep {step} {which} T={t} ...", flush=True)
                        point = _spawn(
                            backend,
                            ["--worker", "sweep", "--which", which, "--step", step]
                            + ["--length", str(t)],
                            args,
                        )
                        failed = point.get("failed")
                    rows.append(dict(length=t, failed=failed, **({} if failed else point)))
                record["sweep"][step][which] = rows
    return record


# --------------------------------------------------------------------------- report
def markdown(records, args):
    lines = [
        f"Measured ({bench._when(records)}) on {platform.machine()}, {os.cpu_count()} CPU "
        f"cores, no GPU, with `benchmarks/floor.py` (`make bench`). B=1, T=S=8192, dim 256, "
        f"4 heads, through `predict_on_batch` / `train_on_batch`; padded + causal: "
        f"`Embedding(mask_zero=True)` with the last quarter of the tokens padding, and "
        f"`use_causal_mask=True`. Floor: 4 x key_dim FLOPs per head per visible (query, key) "
        f"pair plus the four projections (train step: 3x), at the backend's best float32 "
        f"2048^3 matmul rate measured in the same process. Each layer in processes of "
        f"its own, {args.pairs} alternated rounds of one process per layer, "
        f"{args.calls} timed calls each: medians over the rounds.",
        "",
        "| case | target | backend | GEMM GFLOP/s | floor ms | ours ms | ours / floor "
        "| built-in ms | built-in / floor | ours / built-in |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, target in TARGETS.items():
        for r in records:
            e = r["cases"][case]
            if e.get("failed"):
                lines.append(f"| {case} | <= {target}x | {r['backend']} | {e['failed']} |")
                continue
            met = "met" if e["ours_floor"] <= target else "not met"
            lines.append(
                f"| {case} | <= {target}x | {r['backend']} | {e['gemm_gflops']:.0f} "
                f"| {e['floor_ms']:.0f} | {e['ours_ms']:.0f} | **{e['ours_floor']:.2f}x** "
                f"({met}) | {e['builtin_ms']:.0f} | {e['builtin_floor']:.2f}x "
                f"| {e['ratio']:.2f}x |"
            )
    lines += [
        "",
        "Cached decode step, B=4, cache length 1024, dim 512, 8 heads, one new token at "
        "the last position, against keras-hub's `CachedMultiHeadAttention` with the same "
        f"weights (target <= 0.8x), medians of {args.decode_pairs} alternated rounds:",
        "",
        "| backend | ours ms | keras-hub ms | ratio | max abs difference |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        d = r["decode"]
        low, high = d["quartiles"]
        lines.append(
            f"| {r['backend']} | {d['ours_ms']:.2f} | {d['hub_ms']:.2f} "
            f"| **{d['ratio']:.2f}x** ({low:.2f}-{high:.2f}) | {d['max_difference']:.1e} |"
        )
    if all("sweep" in r for r in records):
        lines += ["", "Padded + causal, time against T (ms; floor in brackets):", ""]
        lines += ["| backend | step | layer | " + " | ".join(_sweep_lengths(records)) + " |"]
        lines += ["|---|---|---|" + "---|" * len(_sweep_lengths(records))]
        for r in records:
            for step, by_which in r["sweep"].items():
                for which, rows in by_which.items():
                    cells = [_sweep_cell(row) for row in rows]
                    row_head = f"| {r['backend']} | {step} | {which} | "
                    lines.append(row_head + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _sweep_cell(row):
    return row["failed"] or f"{row['ms']:.0f} ({row['floor_ms']:.0f})"


def _sweep_lengths(records):
    return [f"T={row['length']}" for row in records[0]["sweep"]["predict"]["ours"]]


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 * len(records), figsize=(4.2 * 2 * len(records), 3.8))
    axes = list(getattr(axes, "flat", [axes]))
    for i, r in enumerate(records):
        for j, step in enumerate(("predict", "train")):
            ax = axes[2 * i + j]
            by_which = r["sweep"][step]
            for which, style in (("ours", "o-"), ("builtin", "s--")):
                rows = [row for row in by_which[which] if not row["failed"]]
                ax.plot([x["length"] for x in rows], [x["ms"] for x in rows], style, label=which)
            floors = [row for row in by_which["ours"] if not row["failed"]]
            ax.plot(
                [x["length"] for x in floors],
                [x["floor_ms"] for x in floors],
                "k:",
                label="floor",
            )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T")
            ax.set_ylabel("ms")
            name = "forward" if step == "predict" else "train step"
            ax.set_title(f"{r['backend']} {name}", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle("Padded + causal self-attention against the floor (CPU, log-log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(bench.BACKENDS))
    parser.add_argument(
        "--pairs", type=int, default=5, help="alternated rounds of a process per layer"
    )
    parser.add_argument("--calls", type=int, default=3, help="timed calls per process")
    # A decode step takes milliseconds: many rounds cost little and settle its ratio.
    parser.add_argument("--decode-pairs", type=int, default=50)
    parser.add_argument("--no-sweep", dest="sweep", action="store_false")
    parser.add_argument("--sweep-lengths", nargs="+", type=int, default=list(SWEEP_LENGTHS))
    parser.add_argument("--memory-limit", type=float, default=16.0, help="GiB per process")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, out to --out")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--worker", choices=("case", "sweep", "decode"), help="internal")
    parser.add_argument("--case", help="internal")
    parser.add_argument("--length", type=int, help="internal")
    parser.add_argument("--which", help="internal")
    parser.add_argument("--step", help="internal")
    args = parser.parse_args(argv)
    if args.worker:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return _child(args)
    raw = os.path.join(args.out, "raw")
    os.makedirs(raw, exist_ok=True)
    for backend in args.backends:
        record = run_backend(backend, args)
        previous = os.path.join(raw, f"floor-{backend}.json")
        if not args.sweep and os.path.exists(previous):
            with open(previous) as f:  # --no-sweep keeps the backend's last sweep
                last = json.load(f)
            if "sweep" in last:
                record["sweep"] = last["sweep"]
        with open(previous, "w") as f:
            json.dump(record, f, indent=1)
    records = []
    for backend in bench.BACKENDS:
        path = os.path.join(raw, f"floor-{backend}.json")
        if os.path.exists(path):
            with open(path) as f:
                records.append(json.load(f))
    report = markdown(records, args)
    with open(os.path.join(args.out, "floor.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out, "floor.json"), "w") as f:
        json.dump(records, f, indent=1)
    if records and all("sweep" in r for r in records):
        plot(records, os.path.join(args.out, "floor.png"))
    print(report)


if __name__ == "__main__":
    main()
