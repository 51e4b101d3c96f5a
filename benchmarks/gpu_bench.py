"""GPU benchmark (issue 8): ours against `keras.layers.MultiHeadAttention`, same run.

mixed_bfloat16, B=4, T=S=4096, dim 1024, 16 heads of 64: the forward pass and one
training step (SGD on an MSE loss), timed on the session's backend, plus a bf16
matmul measured in the same process as the roofline the attention is compared to.

    KERAS_BACKEND=torch python benchmarks/gpu_bench.py run --out torch.json
    python benchmarks/gpu_bench.py report --raw DIR --out report.md

`run` refuses to time full sizes without a GPU; `--dry-run` times tiny sizes on
whatever device there is, to check the code paths (its numbers mean nothing).
`report` turns the JSON of each backend, and the junit files of `pytest -m gpu`
found in the same folder, into the markdown report `make gpu` writes.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

FULL = dict(batch=4, length=4096, dim=1024, heads=16, matmul=8192, warmup=3, repeats=10)
DRY = dict(batch=2, length=128, dim=64, heads=4, matmul=256, warmup=1, repeats=2)
TARGET_RATIO = 1.0  # ours / built-in time, on torch and jax
TARGET_MATMUL_FRACTION = 0.40  # forward TFLOP/s / measured bf16 matmul TFLOP/s


# --------------------------------------------------------------------- device info
def gpu_name(backend):
    """The accelerator's name as the backend reports it, or `None` without one."""
    if backend == "torch":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if backend == "jax":
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        return gpus[0].device_kind if gpus else None
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    return tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")


def versions(backend):
    import keras

    found = {"python": platform.python_version(), "keras": keras.__version__}
    if backend == "torch":
        import torch

        found.update(
            torch=torch.__version__,
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        )
    elif backend == "jax":
        import jax
        import jaxlib

        found.update(jax=jax.__version__, jaxlib=jaxlib.__version__)
    else:
        import tensorflow as tf

        build = tf.sysconfig.get_build_info()
        found.update(
            tensorflow=tf.__version__,
            cuda=build.get("cuda_version"),
            cudnn=build.get("cudnn_version"),
        )
    return found


def nvidia_smi():
    """Driver and GPU lines from `nvidia-smi`, or `None` where it is missing."""
    try:
        done = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


# -------------------------------------------------------------------------- timing
def _sync(backend, value):
    """Waits for `value` (a backend tensor, or a nest of them) to be computed."""
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif backend == "jax":
        import jax

        jax.block_until_ready(value)
    else:
        import keras

        keras.ops.convert_to_numpy(keras.ops.sum(keras.ops.cast(value, "float32")))


def _time(backend, fn, warmup, repeats):
    """Median seconds of `fn()` over `repeats` calls, after `warmup` calls."""
    for _ in range(warmup):
        _sync(backend, fn())
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        _sync(backend, fn())
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def matmul_rate(backend, n, warmup, repeats):
    """Measured bf16 `(n, n) @ (n, n)` rate in TFLOP/s."""
    import keras

    a = keras.random.normal((n, n), dtype="bfloat16", seed=0)
    b = keras.random.normal((n, n), dtype="bfloat16", seed=1)
    if backend == "jax":
        import jax

        fn = jax.jit(keras.ops.matmul)
        seconds = _time(backend, lambda: fn(a, b), warmup, repeats)
    else:
        seconds = _time(backend, lambda: keras.ops.matmul(a, b), warmup, repeats)
    return 2 * n**3 / seconds / 1e12


def attention_flops(batch, length, dim, heads):
    """Forward FLOPs: 4 projections `(dim -> dim)` plus `QK^T` and `AV` over all heads."""
    head = dim // heads
    projections = 4 * 2 * batch * length * dim * dim
    attention = 2 * 2 * batch * heads * length * length * head
    return projections + attention


def _model(layer, length, dim):
    import keras

    inputs = keras.Input((length, dim))
    model = keras.Model(inputs, layer(inputs, inputs))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def _forward(backend, model):
    """A compiled inference call `x -> model(x)` for the backend."""
    if backend == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        step = jax.jit(lambda t, n, x: model.stateless_call(t, n, x)[0])
        return lambda x: step(trainable, non_trainable, x)
    if backend == "torch":
        import torch

        def forward(x):
            with torch.no_grad():
                return model(x, training=False)

        return forward
    import tensorflow as tf

    return tf.function(lambda x: model(x, training=False), jit_compile=True)


def _time_layer(backend, layer, x, y, sizes, flops):
    """Forward and training-step times and rates of `layer` in a one-layer model."""
    model = _model(layer, sizes["length"], sizes["dim"])
    forward = _forward(backend, model)
    forward_s = _time(backend, lambda: forward(x), sizes["warmup"], sizes["repeats"])
    train_s = _time(
        backend,
        lambda: model.train_on_batch(x, y, return_dict=False),
        sizes["warmup"],
        sizes["repeats"],
    )
    return {
        "forward_ms": forward_s * 1e3,
        "train_step_ms": train_s * 1e3,
        "forward_tflops": flops / forward_s / 1e12,
        "train_tflops": 3 * flops / train_s / 1e12,
    }


def run(dry_run):
    import keras

    import keras_mha

    backend = keras.backend.backend()
    name = gpu_name(backend)
    if name is None and not dry_run:
        sys.exit(f"No GPU visible to the {backend} backend: run with --dry-run to check the code.")
    sizes = DRY if dry_run else FULL
    keras.config.set_dtype_policy("mixed_bfloat16")
    batch, length, dim, heads = (sizes[k] for k in ("batch", "length", "dim", "heads"))
    key_dim = dim // heads
    x = keras.random.normal((batch, length, dim), seed=0)
    y = keras.random.normal((batch, length, dim), seed=1)
    flops = attention_flops(batch, length, dim, heads)
    rate = matmul_rate(backend, sizes["matmul"], sizes["warmup"], sizes["repeats"])
    layers = {
        "keras_mha (auto)": lambda: keras_mha.MultiHeadAttention(heads, key_dim),
        "keras_mha (fused)": lambda: keras_mha.MultiHeadAttention(
            heads, key_dim, implementation="fused"
        ),
        "keras.layers.MultiHeadAttention": lambda: keras.layers.MultiHeadAttention(heads, key_dim),
    }
    results = {
        label: _time_layer(backend, make(), x, y, sizes, flops) for label, make in layers.items()
    }
    builtin = results["keras.layers.MultiHeadAttention"]
    for row in results.values():
        row["forward_vs_builtin"] = row["forward_ms"] / builtin["forward_ms"]
        row["train_vs_builtin"] = row["train_step_ms"] / builtin["train_step_ms"]
        row["forward_fraction_of_matmul"] = row["forward_tflops"] / rate
    return {
        "backend": backend,
        "dry_run": dry_run,
        "gpu": name,
        "nvidia_smi": nvidia_smi(),
        "versions": versions(backend),
        "sizes": sizes,
        "forward_gflop": flops / 1e9,
        "bf16_matmul_tflops": rate,
        "results": results,
    }


# -------------------------------------------------------------------------- report
def _junit_summary(path):
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped"


def report(raw, backends):
    raw = Path(raw)
    today = datetime.date.today().isoformat()
    lines = [f"# GPU report, {today}", ""]
    runs = {}
    for backend in backends:
        bench = raw / f"bench-{backend}.json"
        if bench.exists():
            runs[backend] = json.loads(bench.read_text())
    if any(r["dry_run"] for r in runs.values()):
        lines += ["**DRY RUN: tiny sizes, not a GPU measurement. Quote nothing from it.**", ""]
    names = sorted({r["gpu"] or "no GPU" for r in runs.values()})
    lines += [f"GPU: {', '.join(names) or 'no run'}", ""]
    smi = next((r["nvidia_smi"] for r in runs.values() if r["nvidia_smi"]), None)
    if smi:
        lines += [f"nvidia-smi: `{smi}`", ""]
    lines += ["| backend | `pytest -m gpu tests/test_gpu.py` | versions |", "|---|---|---|"]
    for backend in backends:
        junit = raw / f"tests-{backend}.xml"
        tests = _junit_summary(junit) if junit.exists() else "not run"
        found = runs.get(backend, {}).get("versions")
        shown = ", ".join(f"{k} {v}" for k, v in found.items()) if found else "-"
        lines.append(f"| {backend} | {tests} | {shown} |")
    for backend, run_ in runs.items():
        s = run_["sizes"]
        lines += [
            "",
            f"## {backend}: B={s['batch']}, T=S={s['length']}, dim {s['dim']}, "
            f"{s['heads']} heads, mixed_bfloat16",
            "",
            f"Measured bf16 matmul ({s['matmul']}^3): {run_['bf16_matmul_tflops']:.3g} TFLOP/s. "
            f"Forward: {run_['forward_gflop']:.4g} GFLOP; training step counted as 3x.",
            "",
            "| layer | forward ms | train step ms | forward TFLOP/s | fwd / matmul rate "
            "| fwd vs built-in | train vs built-in |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, row in run_["results"].items():
            lines.append(
                f"| {label} | {row['forward_ms']:.2f} | {row['train_step_ms']:.2f} "
                f"| {row['forward_tflops']:.3g} | {row['forward_fraction_of_matmul']:.0%} "
                f"| {row['forward_vs_builtin']:.2f}x | {row['train_vs_builtin']:.2f}x |"
            )
        ours = run_["results"]["keras_mha (auto)"]
        meets = (
            ours["forward_vs_builtin"] <= TARGET_RATIO
            and ours["train_vs_builtin"] <= TARGET_RATIO
            and ours["forward_fraction_of_matmul"] >= TARGET_MATMUL_FRACTION
        )
        verdict = "not judged (dry run)" if run_["dry_run"] else ("met" if meets else "NOT met")
        lines += [
            "",
            f"Targets (ours, auto: <= {TARGET_RATIO:.1f}x the built-in, forward >= "
            f"{TARGET_MATMUL_FRACTION:.0%} of the matmul rate): {verdict}.",
        ]
    missing = [b for b in backends if b not in runs]
    if missing:
        lines += ["", f"Not benchmarked (not installed or no run): {', '.join(missing)}."]
    lines += [
        "",
        f"Command: `make gpu` (date {today}, host {platform.node()}, {os.cpu_count()} CPU cores).",
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="time the session's backend")
    run_parser.add_argument("--dry-run", action="store_true", help="tiny sizes, any device")
    run_parser.add_argument("--out", help="JSON file (default: stdout)")
    report_parser = sub.add_parser("report", help="write the markdown report")
    report_parser.add_argument("--raw", required=True, help="folder of bench-*.json, tests-*.xml")
    report_parser.add_argument("--backends", nargs="+", default=["torch", "jax", "tensorflow"])
    report_parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "run":
        text = json.dumps(run(args.dry_run), indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n")
        print(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report(args.raw, args.backends))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
