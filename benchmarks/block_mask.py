"""Attention patterns as code: time against density, and the cost of describing one.

Three measurements per backend, each in a fresh process (issue 53's targets):

- per pattern (causal, sliding window, prefix-LM, document, dilated sliding window,
  global+sliding window, NATTEN 2-D, block-diagonal), a train step
  (`train_on_batch` of a functional model: one `keras_mha.MultiHeadAttention`, dim 256,
  4 heads, B=1, T=S=4096) with the pattern as a prebuilt `BlockMask`, against the same
  step unmasked. Target: time <= 1.3 x density x the unmasked time, where density is
  the fraction of (query block, key block) pairs that are not empty;
- causal through `mask_mod` against `use_causal_mask=True` (target: within 10%);
- describing a causal T = S = 32768 pattern (`create_block_mask`, 128-blocks): its
  time and the growth of peak RSS (target: under 1 s and a few MiB).

Each step is warmed up once (compiled), then timed `--repeats` times; the median
counts. Results go to `benchmarks/results/block_mask.{json,md,png}` (the plot: time
over the unmasked time against density, with the target line).

    .venv/bin/python benchmarks/block_mask.py                 # every backend, writes results
    .venv/bin/python benchmarks/block_mask.py --dry-run       # toy sizes, checks it runs
    .venv/bin/python benchmarks/block_mask.py --backends jax
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

BACKENDS = ("tensorflow", "jax", "torch")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FULL = dict(length=4096, dim=256, heads=4, batch=1, block=128, describe=32768, repeats=3)
TOY = dict(length=96, dim=16, heads=2, batch=1, block=16, describe=512, repeats=1)
PATTERNS = (
    "causal",
    "sliding window",
    "prefix-LM",
    "document",
    "dilated",
    "global+sliding",
    "NATTEN 2-D",
    "block-diagonal",
)


def mask_mod(name, length):
    """The pattern `name` as a `mask_mod` over `length` positions."""
    import numpy as np
    from keras import ops

    window = max(4, length // 16)

    def causal(b, h, q, k):
        return ops.greater_equal(q, k)

    if name == "causal":
        return causal
    if name == "sliding window":
        return lambda b, h, q, k: ops.logical_and(causal(b, h, q, k), ops.less(q - k, window))
    if name == "prefix-LM":
        return lambda b, h, q, k: ops.logical_or(causal(b, h, q, k), ops.less(k, length // 4))
    if name == "document":
        rng = np.random.default_rng(0)
        cuts = np.sort(rng.choice(np.arange(1, length), size=7, replace=False))
        ids = ops.convert_to_tensor(np.searchsorted(cuts, np.arange(length), side="right"))

        def document(b, h, q, k):
            same = ops.equal(ops.take(ids, q), ops.take(ids, k))
            return ops.logical_and(same, causal(b, h, q, k))

        return document
    if name == "dilated":

        def dilated(b, h, q, k):
            diff = ops.abs(q - k)
            return ops.logical_and(ops.less(diff, 2 * window), ops.equal(diff % 2, 0))

        return dilated
    if name == "global+sliding":

        def global_sliding(b, h, q, k):
            local = ops.less(ops.abs(q - k), window)
            return ops.logical_or(local, ops.logical_or(ops.less(q, 64), ops.less(k, 64)))

        return global_sliding
    if name == "NATTEN 2-D":
        width = int(length**0.5)

        def natten(b, h, q, k):
            near_x = ops.less_equal(ops.abs(q % width - k % width), 3)
            return ops.logical_and(near_x, ops.less_equal(ops.abs(q // width - k // width), 3))

        return natten
    if name == "block-diagonal":
        return lambda b, h, q, k: ops.equal(q // (length // 8), k // (length // 8))
    raise ValueError(name)


def _median_step(model, x, repeats):
    model.train_on_batch(x, x)  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.train_on_batch(x, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _model(sizes, **call):
    import keras

    import keras_mha

    inputs = keras.Input((sizes["length"], sizes["dim"]), batch_size=sizes["batch"])
    layer = keras_mha.MultiHeadAttention(sizes["heads"], sizes["dim"] // sizes["heads"])
    model = keras.Model(inputs, layer(inputs, inputs, **call))
    model.compile(optimizer="sgd", loss="mse")
    return model


@contextlib.contextmanager
def _no_attention():
    """Inside, the layer's attention gives a zero output: a model's step then costs
    the rest of it (projections, loss, optimizer), which no mask can make cheaper."""
    from keras_mha import layer

    attention = layer.kernels.attention

    def no_attention(query, key, value, **kwargs):
        return query[..., : value.shape[-1]] * 0.0, None

    layer.kernels.attention = no_attention
    try:
        yield
    finally:
        layer.kernels.attention = attention


def measure_steps(sizes):
    """`{pattern: {density, seconds}}`, with "unmasked" and "use_causal_mask"."""
    import numpy as np

    from keras_mha import block_mask

    length, repeats = sizes["length"], sizes["repeats"]
    x = np.random.default_rng(0).standard_normal(
        (sizes["batch"], length, sizes["dim"]), dtype="float32"
    )
    results = {"unmasked": {"density": 1.0, "seconds": _median_step(_model(sizes), x, repeats)}}
    with _no_attention():
        results["floor"] = {"density": None, "seconds": _median_step(_model(sizes), x, repeats)}
    causal = _median_step(_model(sizes, use_causal_mask=True), x, repeats)
    results["use_causal_mask"] = {"density": None, "seconds": causal}
    for name in PATTERNS:
        built = block_mask.create_block_mask(
            mask_mod(name, length), None, None, length, length, block_size=sizes["block"]
        )
        seconds = _median_step(_model(sizes, mask_mod=built), x, repeats)
        results[name] = {"density": built.density, "seconds": seconds}
    return results


def measure_description(sizes):
    """Seconds and peak-RSS growth (MiB) of describing causal `T = S = describe`: the
    named `block_mask.causal()` (classified from the blocks' bounds) first, then the
    same pattern as a function of your own (evaluated by tiles of blocks). Both are
    described once first at a smaller size (an eighth: the ops compiled, the
    backend's thread pools started, which a process pays once)."""
    from keras import ops

    from keras_mha import block_mask

    def causal(b, h, q, k):
        return ops.greater_equal(q, k)

    length = sizes["describe"]
    for warm in (block_mask.causal(), causal):
        block_mask.create_block_mask(warm, None, None, length // 8, length // 8)
    ops.convert_to_numpy(ops.arange(4))
    results = {}
    for name, mask_mod in (("named causal()", block_mask.causal()), ("a function", causal)):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        built = block_mask.create_block_mask(mask_mod, None, None, length, length, 128)
        seconds = time.perf_counter() - start
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        results[name] = {"length": length, "seconds": seconds, "peak_rss_growth_mib": grown,
                         "map_bytes": int(built.kinds.nbytes)}  # fmt: skip
    return results


def child(backend, sizes, out):
    os.environ["KERAS_BACKEND"] = backend
    record = {"backend": backend, "sizes": sizes}
    record["describe"] = measure_description(sizes)  # first: peak RSS before the models
    record["steps"] = measure_steps(sizes)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


def report(records, sizes, command):
    lines = [
        "# Attention patterns: time against density",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.machine()} {_cpu()}, {os.cpu_count()} cores; command: `{command}`.",
        f"Train step, B={sizes['batch']} T=S={sizes['length']} dim={sizes['dim']} "
        f"heads={sizes['heads']}, blocks of {sizes['block']}; median of {sizes['repeats']}.",
        "",
        "`floor`: the unmasked step with the attention replaced by a zero output (the",
        "projections, loss and optimizer, which no mask makes cheaper). `/ unmasked`: the",
        "step against the unmasked step (the issue's target: at most 1.3 x density);",
        "`attention / unmasked`: the step less the floor against the unmasked step less",
        "the floor. `speed needed` and `speed reached`: the attention's speed per",
        "non-empty block, as a share of the unmasked attention's (whose every block is",
        "computed), that the target needs and that the step reached: `density x",
        "(unmasked - floor) / (time - floor)`, the time the target's or the step's.",
        "Above 100% needed, the target is out of reach for any kernel that computes",
        "whole blocks at the dense kernel's speed.",
        "",
        "| backend | pattern | density | ms | / unmasked | attention / unmasked "
        "| target 1.3 x density | speed needed | speed reached |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        steps = record["steps"]
        unmasked = steps["unmasked"]["seconds"]
        floor = steps.get("floor", {}).get("seconds")
        for name, row in steps.items():
            density = row["density"]
            target = "" if density is None else f"{1.3 * density:.2f}"
            shown = "" if density is None else f"{density:.3f}"
            attention = needed = reached = ""
            if floor is not None and name != "floor":
                attention = f"{(row['seconds'] - floor) / (unmasked - floor):.2f}"
            if floor is not None and density is not None and name != "unmasked":
                needed = _speed_share(density, 1.3 * density * unmasked, unmasked, floor)
                reached = _speed_share(density, row["seconds"], unmasked, floor)
            lines.append(
                f"| {record['backend']} | {name} | {shown} | {1000 * row['seconds']:.1f} "
                f"| {row['seconds'] / unmasked:.2f} | {attention} | {target} "
                f"| {needed} | {reached} |"
            )
    lines += [
        "",
        "| backend | causal via mask_mod / use_causal_mask (target <= 1.10) |",
        "|---|---|",
    ]
    for record in records:
        steps = record["steps"]
        ratio = steps["causal"]["seconds"] / steps["use_causal_mask"]["seconds"]
        lines.append(f"| {record['backend']} | {ratio:.2f} |")
    lines += [
        "",
        "| backend | describe causal T=S | as | seconds | peak RSS growth MiB |",
        "|---|---|---|---|---|",
    ]
    for record in records:
        for name, d in record["describe"].items():
            lines.append(
                f"| {record['backend']} | {d['length']} | {name} | {d['seconds']:.4f} "
                f"| {d['peak_rss_growth_mib']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def _speed_share(density, seconds, unmasked, floor):
    """The attention's speed per non-empty block, as a share of the unmasked
    attention's, that a step of `seconds` implies (text; "no time left" where the
    floor alone takes it)."""
    if seconds <= floor:
        return "no time left"
    return f"{100 * density * (unmasked - floor) / (seconds - floor):.0f}%"


def _cpu():
    """The CPU's model name (Linux), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, record in enumerate(records):
        steps = record["steps"]
        unmasked = steps["unmasked"]["seconds"]
        floor = steps.get("floor", {}).get("seconds", 0.0)
        rows = [r for n, r in steps.items() if r["density"] is not None and n != "unmasked"]
        color = f"C{i}"
        ax.scatter([r["density"] for r in rows], [r["seconds"] / unmasked for r in rows],
                   color=color, label=f"{record['backend']}: step")  # fmt: skip
        ax.scatter([r["density"] for r in rows],
                   [(r["seconds"] - floor) / (unmasked - floor) for r in rows],
                   facecolors="none", edgecolors=color,
                   label=f"{record['backend']}: attention (step less floor)")  # fmt: skip
    ax.plot([0, 1], [0, 1.3], "k--", label="target 1.3 x density")
    ax.set_xlabel("density (non-empty blocks)")
    ax.set_ylabel("time / unmasked")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=BACKENDS)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes, nothing written")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], json.loads(args.sizes), args.child[1])
        return
    sizes = TOY if args.dry_run else FULL
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            out = os.path.join(tmp, f"{backend}.json")
            env = dict(os.environ, KERAS_BACKEND=backend)
            subprocess.run(
                [sys.executable, __file__, "--child", backend, out, "--sizes", json.dumps(sizes)],
                check=True,
                env=env,
            )
            with open(out) as f:
                records.append(json.load(f))
    command = "python benchmarks/block_mask.py " + " ".join(sys.argv[1:])
    text = report(records, sizes, command.strip())
    print(text)
    if args.dry_run:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "block_mask.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(args.out, "block_mask.md"), "w") as f:
        f.write(text)
    plot(records, os.path.join(args.out, "block_mask.png"))


if __name__ == "__main__":
    main()
