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
import ast
import datetime
import functools
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
# Padded + causal, long: token ids through `Embedding(mask_zero=True)`, row b keeping its
# first T * (8 - b) / 8 tokens (rows of different lengths), `use_causal_mask=True`.
LONG = dict(batch=4, lengths=(8192, 16384, 32768), dim=1024, heads=16, warmup=1, repeats=3)
LONG_DRY = dict(batch=2, lengths=(128, 256), dim=64, heads=4, warmup=1, repeats=1)
VOCABULARY = 1000
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
    """Forward and training-step times and rates of `layer` in a one-layer model;
    returns them and the two steps (for `gpu_busy`)."""
    model = _model(layer, sizes["length"], sizes["dim"])
    forward = _forward(backend, model)
    steps = {
        "forward": lambda: forward(x),
        "train_step": lambda: model.train_on_batch(x, y, return_dict=False),
    }
    seconds = {
        step: _time(backend, fn, sizes["warmup"], sizes["repeats"]) for step, fn in steps.items()
    }
    row = {
        "forward_ms": seconds["forward"] * 1e3,
        "train_step_ms": seconds["train_step"] * 1e3,
        "forward_tflops": flops / seconds["forward"] / 1e12,
        "train_tflops": 3 * flops / seconds["train_step"] / 1e12,
    }
    _progress(layer.__class__.__module__, row)
    return row, steps


def gpu_busy(fn, calls=5, top=8):
    """Torch: `fn`'s calls under the profiler: wall ms per call, the ms per call that
    CUDA kernels ran (their self time, summed), and the kernels that took the most."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    per_call = lambda us: us / 1e3 / calls  # noqa: E731
    return {
        "wall_ms": wall * 1e3 / calls,
        "kernels_ms": per_call(sum(e.self_device_time_total for e in kernels)),
        "kernel_launches": sum(e.count for e in kernels) / calls,
        "top": [
            {"name": e.key[:90], "ms": per_call(e.self_device_time_total), "count": e.count / calls}
            for e in kernels[:top]
        ],
    }


def _progress(label, row):
    """One case's result on stderr as soon as it is known (a run cut short keeps it)."""
    print(label, json.dumps(row), file=sys.stderr, flush=True)


def _on_gpu(backend):
    """Whether the backend runs on a GPU (a dry run may not)."""
    return gpu_name(backend) is not None


def _peak_memory_start(backend):
    """Torch: resets the peak and returns the bytes held now (JAX reads its plan)."""
    if backend != "torch":
        return 0
    import torch

    if not torch.cuda.is_available():  # a dry run on CPU
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_memory_mib(backend, start, compiled=None):
    """Peak bytes above `start` (torch, measured), or XLA's buffer plan for the
    compiled step (JAX: its temporaries and outputs), in MiB."""
    if backend == "torch":
        import torch

        if not torch.cuda.is_available():
            return float("nan")  # a dry run on CPU
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    analysis = compiled.memory_analysis()
    return (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**20


def _padded_tokens(batch, length):
    """Token ids `(batch, length)`: row b keeps its first `length * (8 - b) / 8`."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCABULARY, size=(batch, length)).astype("int32")
    kept = [length * (8 - b) // 8 for b in range(batch)]
    for row, n in enumerate(kept):
        tokens[row, n:] = 0
    return tokens, kept


def _long_model(layer, dim):
    import keras

    tokens = keras.Input((None,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, dim, mask_zero=True)(tokens)
    model = keras.Model(tokens, layer(x, x, use_causal_mask=True))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def _long_steps(backend, model, tokens, target):
    """`(forward, train_step, compiled)`: callables of no argument; `compiled` maps
    "forward"/"train" to the compiled JAX executables (for their memory plans)."""
    if backend != "jax":
        import torch

        def forward():
            with torch.no_grad():
                return model(tokens, training=False)

        return forward, lambda: model.train_on_batch(tokens, target, return_dict=False), {}
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def forward_fn(t, n, x):
        return model.stateless_call(t, n, x)[0]

    def train_fn(t, n, x, y):
        def loss(t):
            out = model.stateless_call(t, n, x, training=True)[0]
            return jnp.mean(jnp.square(out.astype("float32") - y))

        grads = jax.grad(loss)(t)
        return [w - 1e-3 * g.astype(w.dtype) for w, g in zip(t, grads)]

    compiled = {
        "forward": jax.jit(forward_fn).lower(trainable, non_trainable, tokens).compile(),
        "train": jax.jit(train_fn).lower(trainable, non_trainable, tokens, target).compile(),
    }
    return (
        lambda: compiled["forward"](trainable, non_trainable, tokens),
        lambda: compiled["train"](trainable, non_trainable, tokens, target),
        compiled,
    )


def long_flops(kept, dim, heads):
    """Useful forward FLOPs: 4 projections over every token, `QK^T` and `AV` over the
    (query, key) pairs causality and padding leave visible."""
    head = dim // heads
    pairs = sum(n * (n + 1) // 2 for n in kept)
    return 4 * 2 * len(kept) * max(kept) * dim * dim + 2 * 2 * heads * head * pairs


def _long_case(backend, make, sizes, length, rate, overrides=None):
    """One layer at one length (under the policy `overrides`): times, peak memory and
    matmul fraction, or the error (out of memory) that stopped it."""
    from keras_mha.kernels import policy

    with policy.overriding(**(overrides or {})):
        return _long_case_timed(backend, make, sizes, length, rate)


def _long_case_timed(backend, make, sizes, length, rate):
    import gc

    import keras

    tokens, kept = _padded_tokens(sizes["batch"], length)
    target = keras.random.normal((sizes["batch"], length, sizes["dim"]), seed=1)
    flops = long_flops(kept, sizes["dim"], sizes["heads"])
    row, model = {}, None
    try:
        model = _long_model(make(), sizes["dim"])
        forward, train, compiled = _long_steps(backend, model, tokens, target)
        for step, fn, factor in (("forward", forward, 1), ("train", train, 3)):
            start = _peak_memory_start(backend)
            seconds = _time(backend, fn, sizes["warmup"], sizes["repeats"])
            row[f"{step}_ms"] = seconds * 1e3
            row[f"{step}_peak_mib"] = _peak_memory_mib(backend, start, compiled.get(step))
            row[f"{step}_fraction_of_matmul"] = factor * flops / seconds / 1e12 / rate
    except Exception as error:  # out of memory, above all: recorded, not fatal
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    finally:
        model = forward = train = compiled = None
        gc.collect()
        if backend == "torch":
            import torch

            torch.cuda.empty_cache()
    _progress(f"T={length}", row)
    return row


def run_long(backend, dry_run, rate, lengths=None, variants=()):
    """Padded + causal calls at every length of `LONG` (or `lengths`), ours and the
    built-in; ours again under each of `variants`: overrides of the backend's policy
    row (`kernels/policy.py`), e.g. `{"chunk_size": 512, "fold_key_padding": ()}`."""
    import keras

    import keras_mha

    sizes = dict(LONG_DRY if dry_run else LONG)
    if lengths:
        sizes["lengths"] = tuple(lengths)
    heads, key_dim = sizes["heads"], sizes["dim"] // sizes["heads"]
    ours = functools.partial(keras_mha.MultiHeadAttention, heads, key_dim)
    layers = {"keras_mha (auto)": (ours, {})}
    for overrides in variants:
        label = ", ".join(f"{k}={v}" for k, v in overrides.items())
        layers[f"keras_mha ({label})"] = (ours, overrides)
    layers["keras.layers.MultiHeadAttention"] = (
        functools.partial(keras.layers.MultiHeadAttention, heads, key_dim),
        {},
    )
    return {
        "sizes": sizes,
        "results": {
            str(length): {
                label: _long_case(backend, make, sizes, length, rate, overrides)
                for label, (make, overrides) in layers.items()
            }
            for length in sizes["lengths"]
        },
    }


def run(dry_run, long=True, full=True, lengths=None, variants=(), profile=False):
    """The whole benchmark of the session's backend as a dict (see `main` for the
    arguments); `full=False` leaves out the B=4 T=4096 case."""
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
    results, steps = {}, {}
    if full:
        for label, make in layers.items():
            results[label], steps[label] = _time_layer(backend, make(), x, y, sizes, flops)
        builtin = results["keras.layers.MultiHeadAttention"]
        for row in results.values():
            row["forward_vs_builtin"] = row["forward_ms"] / builtin["forward_ms"]
            row["train_vs_builtin"] = row["train_step_ms"] / builtin["train_step_ms"]
            row["forward_fraction_of_matmul"] = row["forward_tflops"] / rate
    long_results = None
    if long:
        long_results = run_long(backend, dry_run, rate, lengths, variants)
    # Profiled last: calls timed after a torch profiler session may run slower
    # (benchmarks/results/gpu.md, run 5).
    if profile and backend == "torch" and _on_gpu(backend):
        for label, row in results.items():
            row["profile"] = {step: gpu_busy(fn) for step, fn in steps[label].items()}
    return {
        "backend": backend,
        "dry_run": dry_run,
        "long": long_results,
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


def _full_report(backend, run_):
    """Markdown lines for the B=4 T=4096 case of one backend's run (its heading alone
    where the run left the case out)."""
    s = run_["sizes"]
    lines = [
        f"## {backend}: B={s['batch']}, T=S={s['length']}, dim {s['dim']}, "
        f"{s['heads']} heads, mixed_bfloat16",
        "",
        f"Measured bf16 matmul ({s['matmul']}^3): {run_['bf16_matmul_tflops']:.3g} TFLOP/s. "
        f"Forward: {run_['forward_gflop']:.4g} GFLOP; training step counted as 3x.",
    ]
    if not run_["results"]:
        return lines
    lines += [
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
    profiled = {k: r["profile"] for k, r in run_["results"].items() if r.get("profile")}
    if profiled:
        lines += [
            "",
            "torch.profiler, per call: wall time (profiled) and the CUDA kernels' summed time.",
            "",
            "| layer | step | wall ms | kernels ms | kernel launches | largest kernels (ms) |",
            "|---|---|---|---|---|---|",
        ]
        for label, steps in profiled.items():
            for step, found in steps.items():
                top = "; ".join(f"{k['name'][:40]} {k['ms']:.2f}" for k in found["top"][:3])
                lines.append(
                    f"| {label} | {step} | {found['wall_ms']:.2f} | {found['kernels_ms']:.2f} "
                    f"| {found['kernel_launches']:.0f} | {top} |"
                )
    return lines


def _long_report(long):
    """Markdown lines for `run_long`'s results, or none."""
    if not long:
        return []
    s = long["sizes"]
    lines = [
        "",
        f"Padded + causal, B={s['batch']}, dim {s['dim']}, {s['heads']} heads, mixed_bfloat16: "
        "token ids through `Embedding(mask_zero=True)`, row b keeping its first T(8-b)/8 "
        "tokens. Peak memory: torch's `max_memory_allocated` above the step's start; JAX: "
        "XLA's buffer plan for the compiled step (temporaries + outputs). Useful work: the "
        "visible (query, key) pairs plus the projections; the train step counted as 3x.",
        "",
        "| T | layer | forward ms | forward peak MiB | fwd / matmul rate | train ms "
        "| train peak MiB | train / matmul rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for length, by_layer in long["results"].items():
        for label, row in by_layer.items():
            if "error" in row and "forward_ms" not in row:
                lines.append(f"| {length} | {label} | {row['error'][:60]} | | | | | |")
                continue
            cells = []
            for step in ("forward", "train"):
                if f"{step}_ms" in row:
                    cells += [
                        f"{row[f'{step}_ms']:.1f}",
                        f"{row[f'{step}_peak_mib']:.0f}",
                        f"{row[f'{step}_fraction_of_matmul']:.0%}",
                    ]
                else:
                    cells += [row.get("error", "-")[:60], "", ""]
            lines.append(f"| {length} | {label} | " + " | ".join(cells) + " |")
    return lines


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
        lines += [""] + _full_report(backend, run_)
        lines += _long_report(run_.get("long"))
    missing = [b for b in backends if b not in runs]
    if missing:
        lines += ["", f"Not benchmarked (not installed or no run): {', '.join(missing)}."]
    lines += [
        "",
        f"Command: `make gpu` (date {today}, host {platform.node()}, {os.cpu_count()} CPU cores).",
    ]
    return "\n".join(lines) + "\n"


def _overrides(text):
    """`"k=v,k=v"` -> `{k: v}`: keyword arguments, values read as Python literals (a
    bare word as a string), e.g. `kernel=chunked,fold_key_padding=("bfloat16",)`."""
    call = ast.parse(f"f({text})", mode="eval").body
    found = {}
    for keyword in call.keywords:
        value = keyword.value
        found[keyword.arg] = value.id if isinstance(value, ast.Name) else ast.literal_eval(value)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="time the session's backend")
    run_parser.add_argument("--dry-run", action="store_true", help="tiny sizes, any device")
    run_parser.add_argument("--out", help="JSON file (default: stdout)")
    run_parser.add_argument(
        "--no-long", action="store_true", help="skip the long padded + causal calls"
    )
    run_parser.add_argument(
        "--no-full", action="store_true", help="skip the B=4 T=4096 unmasked case"
    )
    run_parser.add_argument(
        "--lengths", type=int, nargs="+", help="the long calls' T (default: 8192 16384 32768)"
    )
    run_parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=_overrides,
        help="the long calls again with ours under policy overrides, e.g. "
        "chunk_size=512,fold_key_padding=() (repeatable)",
    )
    run_parser.add_argument(
        "--profile",
        action="store_true",
        help="torch: how long the GPU is busy in each call (torch.profiler)",
    )
    report_parser = sub.add_parser("report", help="write the markdown report")
    report_parser.add_argument("--raw", required=True, help="folder of bench-*.json, tests-*.xml")
    report_parser.add_argument("--backends", nargs="+", default=["torch", "jax", "tensorflow"])
    report_parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "run":
        found = run(
            args.dry_run,
            long=not args.no_long,
            full=not args.no_full,
            lengths=args.lengths,
            variants=args.variant,
            profile=args.profile,
        )
        text = json.dumps(found, indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n")
        print(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report(args.raw, args.backends))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
