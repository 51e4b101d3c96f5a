"""Speed and memory of `keras_mha.MultiHeadAttention` against the built-in, per backend,
on the paths users take: padded batches, causal masks, training steps, long sequences.

Writes `benchmarks/results/cpu.{md,json,png}` and `benchmarks/results/scaling.{md,png}`.
Every measurement runs in a child process per backend (Keras picks its backend once
per process), through `predict_on_batch` / `train_on_batch` of a functional model:

- pairs: ours and the built-in (identical weights) alternated in rounds after a warm-up
  (see `_median_pairs`), medians kept, on
  - B=8, T=256, dim 512, 8 heads: unmasked, and padded + causal (predict, train),
    with the matmul floor (the layer's FLOPs over the backend's measured matmul rate);
  - B=1, T=S=8192, dim 256, 4 heads: unmasked forward; a quarter of the keys padding
    + causal, forward and train step.
- memory: growth of peak RSS from T=256 to T=8192 of one call, a fresh process per
  configuration (`ru_maxrss` sees native buffers, which `tracemalloc` does not).
- scaling: time and peak memory of one forward and one train step, padded + causal,
  T = 512 ... 32768, ours and the built-in, a fresh process per point; a point whose
  process passes `--memory-limit` GiB (or `--time-limit` s) is killed and reported so.
- small models (`--only small` runs this section alone, into `small.md`): keras.io-sized
  models, dim 32, 2 heads, where a call's fixed cost shows: keras.io's text classifier
  (B=4, T=12; a `TransformerBlock`, then a causal attention), and one attention layer
  at B=4, T=12 and B=16, T=32, padded, padded + causal and unmasked (`Small`). Ours is
  built where the built-in would be (`keras_mha.swapped()`, as `keras-mha swap` builds
  it), with the built-in's weights. Two controls time the built-in against a second
  built-in with the same weights (the classifier, and B=16 T=32 padded): the spread a
  ratio of 1.00x has on the machine of the run.

Peak RSS is what the process holds, allocator included: glibc keeps freed buffers of
up to 32 MiB for reuse (faster than mapping fresh pages), so a kernel that works in
chunks shows more than it holds live at once. Both layers run with the defaults.

    .venv/bin/python benchmarks/run.py                 # every backend, ~40 minutes on 2 cores
    .venv/bin/python benchmarks/run.py --backends jax --pairs 5 --no-scaling
    .venv/bin/python benchmarks/run.py --only small      # the small models, ~10 minutes
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time

BACKENDS = ("tensorflow", "jax", "torch")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MATMUL_SIZE = 2048
SHORT_LENGTH = 256  # the memory baseline
SCALING_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark shape. `masked`: a quarter of the keys padding (and one more
    sequence half padded when B > 1) with a causal mask; else plain self-attention."""

    name: str
    batch: int
    length: int
    dim: int
    heads: int
    masked: bool

    def at(self, length):
        return dataclasses.replace(self, length=length)


SHORT = Config("B=8 T=256", 8, 256, 512, 8, masked=False)
SHORT_MASKED = dataclasses.replace(SHORT, name="B=8 T=256 padded+causal", masked=True)
LONG = Config("T=8192", 1, 8192, 256, 4, masked=False)
LONG_MASKED = dataclasses.replace(LONG, name="T=8192 padded+causal", masked=True)
CONFIGS = {c.name: c for c in (SHORT, SHORT_MASKED, LONG, LONG_MASKED)}


@dataclasses.dataclass(frozen=True)
class Small:
    """A keras.io-sized model, where a call's fixed cost shows: token ids ->
    `Embedding(mask_zero=True)` (unmasked: `mask_zero=False`) -> attention -> pooling ->
    a dense head. `kind`: "padded" (the Embedding's Keras mask), "padded+causal"
    (also `use_causal_mask=True`), "unmasked", or "classifier": keras.io's text
    classifier, a `TransformerBlock` holding the attention, then
    `x + attention(x, x, use_causal_mask=True)`, padded. `control`: the built-in in
    place of ours too, so the ratio is the built-in against itself."""

    name: str
    batch: int
    length: int
    kind: str
    control: bool = False


SMALL_DIM, SMALL_HEADS, SMALL_VOCAB = 32, 2, 1000
SMALL = {
    c.name: c
    for c in [Small("classifier B=4 T=12", 4, 12, "classifier")]
    + [
        Small(f"B={b} T={t} {kind}", b, t, kind)
        for b, t in ((4, 12), (16, 32))
        for kind in ("padded", "padded+causal", "unmasked")
    ]
}
# The section's rows: the models, then two controls (the built-in against itself),
# which only `small_worker` times (`small_ops.py` and `jax_train_step.py` read `SMALL`).
SMALL_ROWS = {
    **SMALL,
    **{
        c.name: c
        for c in (
            dataclasses.replace(
                SMALL[name], name=f"control: {name}, built-in / built-in", control=True
            )
            for name in ("classifier B=4 T=12", "B=16 T=32 padded")
        )
    },
}


# ----------------------------------------------------------------- child process side
def _model(which, config):
    import keras

    import keras_mha

    cls = keras_mha.MultiHeadAttention if which == "ours" else keras.layers.MultiHeadAttention
    b, t, d = config.batch, config.length, config.dim
    x_in = keras.Input(shape=(t, d), batch_size=b)
    mask_in = keras.Input(shape=(t,), batch_size=b, dtype="bool")
    layer = cls(num_heads=config.heads, key_dim=d // config.heads)
    if config.masked:
        y = layer(x_in, x_in, value_mask=mask_in, use_causal_mask=True)
    else:
        y = layer(x_in, x_in)
    model = keras.Model([x_in, mask_in], y)
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data(config):
    import numpy as np

    rng = np.random.default_rng(0)
    b, t = config.batch, config.length
    x = rng.standard_normal((b, t, config.dim)).astype("float32")
    valid = np.ones((b, t), bool)
    valid[:, t - t // 4 :] = False
    if b > 1:
        valid[1, t // 2 :] = False
    return x, valid


def _step(model, config, step):
    x, valid = _data(config)
    if step == "predict":
        return lambda: model.predict_on_batch([x, valid])
    return lambda: model.train_on_batch([x, valid], x)


def _median_pairs(functions, pairs, warmup=2):
    """Median seconds of each function over `pairs` alternated rounds, after warm-up.

    In each round every function runs twice and only its second call is timed, so a
    timed call always follows a call of the same function: what one layer pays for
    the memory the other left behind stays out of its time. Every other round runs
    the functions in reverse order (A B, B A, ...).
    """
    for _ in range(warmup):
        for f in functions:
            f()
    times = [[] for _ in functions]
    for i in range(pairs):
        order = list(zip(functions, times))
        for f, bucket in order[::-1] if i % 2 else order:
            f()
            start = time.perf_counter()
            f()
            bucket.append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(*times)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return [statistics.median(t) for t in times], (quartiles[0], quartiles[-1])


def _matmul_flops_per_second():
    """The backend's own float32 matmul throughput (best of 15, compiled where usual)."""
    import keras
    import numpy as np

    n = MATMUL_SIZE
    a = np.random.default_rng(0).standard_normal((n, n)).astype("float32")
    name = keras.backend.backend()
    if name == "jax":
        import jax

        x = jax.numpy.asarray(a)
        f = jax.jit(lambda u: u @ u)

        def step():
            f(x).block_until_ready()

    elif name == "tensorflow":
        import tensorflow as tf

        x = tf.constant(a)
        f = tf.function(lambda u: tf.matmul(u, u))

        def step():
            f(x).numpy()

    else:
        import torch

        x = torch.from_numpy(a)

        def step():
            torch.matmul(x, x)

    for _ in range(2):
        step()
    seconds = []
    for _ in range(15):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return 2.0 * n**3 / min(seconds)


def _layer_flops(config):
    """FLOPs of unmasked self-attention `(forward, training step)`: four `dim x dim`
    projections `P` and the two `T x S` products `A`; a training step adds every
    weight gradient (`P`), the output projection's input gradient (`P / 4`) and the
    attention's backward (`2 A`)."""
    b, t, d = config.batch, config.length, config.dim
    projections = 2 * b * t * d * d * 4
    attention = 2 * 2 * b * t * t * d
    return projections + attention, 2.25 * projections + 3 * attention


def pairs_worker(name, pairs, steps):
    config = CONFIGS[name]
    ours, builtin = _model("ours", config), _model("builtin", config)
    builtin.set_weights(ours.get_weights())
    result = {"config": name}
    warmup = 2 if config.length <= 1024 else 1
    for step in steps:
        functions = [_step(ours, config, step), _step(builtin, config, step)]
        (o, b), spread = _median_pairs(functions, pairs, warmup)
        result[step] = dict(ours_ms=o * 1e3, builtin_ms=b * 1e3, ratio=o / b, quartiles=spread)
    if config.length <= 1024 and not config.masked:
        throughput = _matmul_flops_per_second()
        flops = _layer_flops(config)
        result["matmul_gflops"] = throughput / 1e9
        result["predict"]["floor_ms"] = flops[0] / throughput * 1e3
        result["train"]["floor_ms"] = flops[1] / throughput * 1e3
    return result


def _small_model(config, ours):
    """`config`'s model (a `Small`) with the built-in, or with ours where the built-in
    would be (`keras_mha.swapped()`, as `keras-mha swap` builds it)."""
    import contextlib

    import keras
    from keras import layers

    import keras_mha

    class TransformerBlock(layers.Layer):
        """keras.io's block: attention, then a feed-forward net, each with a residual
        and a layer norm."""

        def __init__(self, dim, heads, **kwargs):
            super().__init__(**kwargs)
            self.supports_masking = True
            self.att = layers.MultiHeadAttention(num_heads=heads, key_dim=dim)
            self.ffn = keras.Sequential([layers.Dense(dim, activation="relu"), layers.Dense(dim)])
            self.norm1 = layers.LayerNormalization(epsilon=1e-6)
            self.norm2 = layers.LayerNormalization(epsilon=1e-6)

        def call(self, x):
            x = self.norm1(x + self.att(x, x))
            return self.norm2(x + self.ffn(x))

    keras.utils.set_random_seed(0)
    b, t, d, heads = config.batch, config.length, SMALL_DIM, SMALL_HEADS
    with keras_mha.swapped() if ours else contextlib.nullcontext():
        tokens = keras.Input((t,), batch_size=b, dtype="int32")
        x = layers.Embedding(SMALL_VOCAB, d, mask_zero=config.kind != "unmasked")(tokens)
        if config.kind == "classifier":
            x = TransformerBlock(d, heads)(x)
            x = x + layers.MultiHeadAttention(heads, d)(x, x, use_causal_mask=True)
        else:
            causal = config.kind == "padded+causal"
            x = layers.MultiHeadAttention(heads, d)(x, x, use_causal_mask=causal)
        x = layers.GlobalAveragePooling1D()(x)
        outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(tokens, outputs)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def _small_data(config):
    """Token ids with zero padding at the tails (lengths from T/2 to T, one row
    whole) and labels."""
    import numpy as np

    rng = np.random.default_rng(0)
    b, t = config.batch, config.length
    tokens = rng.integers(1, SMALL_VOCAB, (b, t)).astype("int32")
    if config.kind != "unmasked":
        lengths = rng.integers(t // 2, t + 1, b)
        lengths[0] = t
        tokens[np.arange(t)[None, :] >= lengths[:, None]] = 0
    return tokens, rng.integers(0, 2, (b,)).astype("int32")


def small_worker(name, pairs):
    """Ours against the built-in (identical weights) on one small model: medians of
    `pairs` alternated rounds of `predict_on_batch` and `train_on_batch`."""
    import keras_mha

    config = SMALL_ROWS[name]
    ours = _small_model(config, ours=not config.control)
    builtin = _small_model(config, ours=False)
    swapped = [x for x in ours._flatten_layers() if isinstance(x, keras_mha.MultiHeadAttention)]
    if len(swapped) != (0 if config.control else 2 if config.kind == "classifier" else 1):
        raise RuntimeError(f"{name}: ours is not where the built-in would be")
    builtin.set_weights(ours.get_weights())
    tokens, labels = _small_data(config)
    result = {"config": name}
    for step in ("predict", "train"):
        if step == "predict":
            functions = [lambda m=m: m.predict_on_batch(tokens) for m in (ours, builtin)]
        else:
            functions = [lambda m=m: m.train_on_batch(tokens, labels) for m in (ours, builtin)]
        (o, b), spread = _median_pairs(functions, pairs, warmup=5)
        result[step] = dict(ours_ms=o * 1e3, builtin_ms=b * 1e3, ratio=o / b, quartiles=spread)
    return result


def point_worker(which, name, length, step, repeats):
    """One layer, one step at `length`: warm-up call, then the median of `repeats`
    timed calls, and the process's peak RSS."""
    config = CONFIGS[name].at(length)
    run = _step(_model(which, config), config, step)
    run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(ms=statistics.median(seconds) * 1e3, peak_mib=peak)


def _child(args):
    if args.worker == "pairs":
        result = pairs_worker(args.config, args.pairs, args.steps.split(","))
    elif args.worker == "small":
        result = small_worker(args.config, args.pairs)
    else:
        result = point_worker(args.which, args.config, args.length, args.step, args.repeats)
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- parent process side
def _spawn(backend, worker_args, memory_limit_gib=None, time_limit_s=None, script=__file__):
    """Runs a worker of `script` in a child process; returns its result, or
    `{"failed": why}` when it passed the memory or time limit."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, os.path.abspath(script), *worker_args]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    killed = {}

    def watch():
        start = time.monotonic()
        while process.poll() is None:
            rss = _rss_gib(process.pid)
            if memory_limit_gib and rss > memory_limit_gib:
                killed["why"] = f"out of memory (passed {memory_limit_gib:g} GiB)"
                process.kill()
            elif time_limit_s and time.monotonic() - start > time_limit_s:
                killed["why"] = f"took over {time_limit_s:g} s"
                process.kill()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stdout, stderr = process.communicate()
    watcher.join()
    if killed:
        return {"failed": killed["why"]}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    # A backend that refuses an allocation up front (XLA asks for the whole buffer at
    # once) fails the point the same way as one that outgrows the limit.
    refused = [line for line in stderr.splitlines() if _OUT_OF_MEMORY.search(line)]
    if memory_limit_gib and refused:
        size = re.search(r"allocat\w* (\d+) bytes", refused[-1])
        asked = f" of {int(size.group(1)) / 2**30:.0f} GiB" if size else ""
        return {"failed": f"out of memory (an allocation{asked} refused)"}
    raise RuntimeError(f"{backend} {worker_args} failed:\n{stderr[-3000:]}")


_OUT_OF_MEMORY = re.compile(
    r"RESOURCE_EXHAUSTED|Out of memory|MemoryError|OutOfMemoryError|can.t allocate memory|bad_alloc"
)


def _rss_gib(pid):
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _point(backend, which, name, length, step, args, repeats=1):
    worker = ["--worker", "point", "--which", which, "--config", name]
    worker += ["--length", str(length), "--step", step, "--repeats", str(repeats)]
    return _spawn(backend, worker, args.memory_limit, args.time_limit)


def run_backend(backend, args):
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"backend": backend, "started": now.strftime("%Y-%m-%d %H:%M UTC")}
    for name, pairs, steps in (
        (SHORT.name, args.pairs, "predict,train"),
        (SHORT_MASKED.name, args.pairs, "predict,train"),
        (LONG.name, args.long_pairs, "predict"),
        (LONG_MASKED.name, args.long_pairs, "predict,train"),
    ):
        print(f"[{backend}] {name}: {steps} ...", flush=True)
        worker = ["--worker", "pairs", "--config", name, "--pairs", str(pairs), "--steps", steps]
        record[name] = _spawn(backend, worker)
    for name, steps in ((LONG.name, ("predict",)), (LONG_MASKED.name, ("predict", "train"))):
        for step in steps:
            growth = {}
            for which in ("ours", "builtin"):
                print(f"[{backend}] memory {name} {step} {which} ...", flush=True)
                short = _point(backend, which, name, SHORT_LENGTH, step, args)
                long = _point(backend, which, name, CONFIGS[name].length, step, args)
                growth[which] = long["peak_mib"] - short["peak_mib"]
            record[name][step]["ours_growth_mib"] = growth["ours"]
            record[name][step]["builtin_growth_mib"] = growth["builtin"]
            record[name][step]["growth_ratio"] = growth["ours"] / max(growth["builtin"], 1.0)
    if args.scaling:
        record["scaling"] = scaling(backend, args)
        record["scaling_started"] = record["started"]
    print(json.dumps(record), flush=True)
    return record


def run_small(backend, args):
    """The small models' section: `{"backend", "started", "load", name: result}`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"backend": backend, "started": now.strftime("%Y-%m-%d %H:%M UTC")}
    record["load"] = os.getloadavg()[0]  # the machine is shared: how busy it was
    record["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    for name in SMALL_ROWS:
        print(f"[{backend}] small {name} ...", flush=True)
        worker = ["--worker", "small", "--config", name, "--pairs", str(args.small_pairs)]
        record[name] = _spawn(backend, worker)
    return record


def small_markdown(records, args):
    lines = [
        f"Measured ({_when(records)}) on {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"no GPU, with `benchmarks/run.py --only small` (a section of `make bench`), "
        f"through `predict_on_batch`/`train_on_batch`; load average (1 min) when each "
        f"backend started: "
        + ", ".join(
            f"{r['backend']} {r['load']:.1f}"
            + (f" (OMP_NUM_THREADS={r['omp_num_threads']})" if r.get("omp_num_threads") else "")
            for r in records
        )
        + f". Ratios are ours / built-in (below 1: ours is faster), the medians of "
        f"{args.small_pairs} alternated rounds, then the first and third quartiles of "
        f"the per-round ratios. Dim {SMALL_DIM}, {SMALL_HEADS} heads, token ids padded "
        f"at the tails (lengths T/2 to T, one row whole) under `Embedding(mask_zero=True)`; "
        f'ours built by `keras_mha.swapped()` (`fully_masked_rows="builtin"`). In the '
        f"control rows both models are the built-in, with the same weights: their ratios "
        f"are the timing's own spread on this machine.",
        "",
        "| backend | model | predict ours ms | built-in | ratio | train ours ms | built-in "
        "| ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        for name in SMALL_ROWS:
            p, t = r[name]["predict"], r[name]["train"]
            lines.append(
                f"| {r['backend']} | {name} | {p['ours_ms']:.2f} | {p['builtin_ms']:.2f} "
                f"| {_ratio(p)} | {t['ours_ms']:.2f} | {t['builtin_ms']:.2f} | {_ratio(t)} |"
            )
    return "\n".join(lines) + "\n"


def scaling(backend, args):
    """`{step: {which: [(length, ms or None, peak growth MiB or None, failure)]}}`."""
    results = {}
    for step in ("predict", "train"):
        results[step] = {}
        for which in ("ours", "builtin"):
            base = _point(backend, which, LONG_MASKED.name, SHORT_LENGTH, step, args)["peak_mib"]
            rows, failed = [], None
            for length in args.scaling_lengths:
                if failed:  # a longer sequence would fail the same way
                    rows.append((length, None, None, failed))
                    continue
                print(f"[{backend}] scaling {step} {which} T={length} ...", flush=True)
                point = _point(backend, which, LONG_MASKED.name, length, step, args)
                failed = point.get("failed")
                if failed:
                    rows.append((length, None, None, failed))
                else:
                    rows.append((length, point["ms"], point["peak_mib"] - base, None))
            results[step][which] = rows
    return results


# --------------------------------------------------------------------------- report
def _ratio(entry):
    low, high = entry["quartiles"]
    return f"**{entry['ratio']:.2f}x** ({low:.2f}-{high:.2f})"


def _when(records, key="started"):
    """When each backend's run started: "tensorflow 2026-11-23 17:56 UTC, ..."."""
    return ", ".join(f"{r['backend']} {r.get(key, r.get('started', '(no date)'))}" for r in records)


def markdown(records, args):
    lines = [
        f"Measured ({_when(records)}) on {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"no GPU, with "
        f"`make bench` (`benchmarks/run.py`), through `predict_on_batch`/`train_on_batch`. "
        f"Ratios are ours / built-in (below 1: ours is faster or leaner); a time ratio is "
        f"that of the medians of alternated rounds, followed by the first and third "
        f"quartiles of the per-round ratios. Padded + causal: a quarter of the keys "
        f"padding (B=8: one more sequence half padded) and `use_causal_mask=True`.",
        "",
        f"Short sequences, {args.pairs} rounds (ms); floor = the unmasked layer's FLOPs / "
        f"the backend's best measured {MATMUL_SIZE}x{MATMUL_SIZE} float32 matmul rate.",
        "",
        "| backend | case | predict ours | built-in | ratio | train ours | built-in | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        for name in (SHORT.name, SHORT_MASKED.name):
            p, t = r[name]["predict"], r[name]["train"]
            lines.append(
                f"| {r['backend']} | {name} | {p['ours_ms']:.1f} | {p['builtin_ms']:.1f} "
                f"| {_ratio(p)} | {t['ours_ms']:.1f} | {t['builtin_ms']:.1f} | {_ratio(t)} |"
            )
    lines += ["", "| backend | matmul GFLOP/s | predict floor ms | train floor ms |"]
    lines += ["|---|---|---|---|"]
    for r in records:
        s = r[SHORT.name]
        lines.append(
            f"| {r['backend']} | {s['matmul_gflops']:.0f} | {s['predict']['floor_ms']:.1f} "
            f"| {s['train']['floor_ms']:.1f} |"
        )
    lines += [
        "",
        f"Long sequences B=1, T=S=8192, dim 256, 4 heads: medians of {args.long_pairs} "
        f"alternated rounds (ms); peak-RSS growth from T={SHORT_LENGTH} to T=8192 of one "
        f"call (MiB, a fresh process per configuration).",
        "",
        "| backend | case | step | time ours | built-in | ratio | growth ours | built-in | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        for name, steps in ((LONG.name, ("predict",)), (LONG_MASKED.name, ("predict", "train"))):
            for step in steps:
                e = r[name][step]
                lines.append(
                    f"| {r['backend']} | {name} | {step} | {e['ours_ms']:.0f} "
                    f"| {e['builtin_ms']:.0f} | {_ratio(e)} | {e['ours_growth_mib']:.0f} "
                    f"| {e['builtin_growth_mib']:.0f} | **{e['growth_ratio']:.2f}x** |"
                )
    return "\n".join(lines) + "\n"


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [
        ("predict\nB=8 T=256", SHORT.name, "predict", "ratio"),
        ("train\nB=8 T=256", SHORT.name, "train", "ratio"),
        ("predict\npadded+causal", SHORT_MASKED.name, "predict", "ratio"),
        ("train\npadded+causal", SHORT_MASKED.name, "train", "ratio"),
        ("forward\nT=8192", LONG.name, "predict", "ratio"),
        ("forward\nT=8192 p+c", LONG_MASKED.name, "predict", "ratio"),
        ("train\nT=8192 p+c", LONG_MASKED.name, "train", "ratio"),
        ("memory train\nT=8192 p+c", LONG_MASKED.name, "train", "growth_ratio"),
    ]
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / max(len(records), 1)
    for i, r in enumerate(records):
        xs = [k + i * width for k in range(len(cells))]
        ax.bar(xs, [r[name][step][key] for _, name, step, key in cells], width, label=r["backend"])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([k + width * (len(records) - 1) / 2 for k in range(len(cells))])
    ax.set_xticklabels([c[0] for c in cells], fontsize=8)
    ax.set_ylabel("ours / built-in (lower is better)")
    ax.set_title("keras_mha.MultiHeadAttention vs keras.layers.MultiHeadAttention (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _slope(rows, column):
    """Least-squares slope of log(value) against log(T) over the measured points."""
    points = [(math.log(r[0]), math.log(r[column])) for r in rows if r[column] and r[column] > 0]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    num = sum((x - mx) * (y - my) for x, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return num / den


def scaling_markdown(records, args):
    lines = [
        f"Measured ({_when(records, 'scaling_started')}) on {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, no GPU, with "
        f"`make bench` (`benchmarks/run.py`). B=1, dim 256, 4 heads, a quarter of the keys "
        f"padding, causal. Time of one call after a warm-up call (ms) and peak-RSS growth "
        f"from T={SHORT_LENGTH} (MiB), a fresh process per point; a process that passed "
        f"{args.memory_limit:g} GiB or {args.time_limit:g} s was stopped. Slope: "
        f"least-squares fit of log(value) against log(T) (2 = quadratic, 1 = linear).",
        "",
    ]
    for r in records:
        for step, by_which in r["scaling"].items():
            lines += [
                f"**{r['backend']}, {'forward' if step == 'predict' else 'train step'}**",
                "",
                "| T | ours ms | built-in ms | ours MiB | built-in MiB |",
                "|---|---|---|---|---|",
            ]
            for ours_row, builtin_row in zip(by_which["ours"], by_which["builtin"]):
                cells = []
                for column in (1, 2):
                    for row in (ours_row, builtin_row):
                        value = row[column]
                        cells.append(row[3] if value is None else f"{value:.0f}")
                lines.append(
                    f"| {ours_row[0]} | " + " | ".join(cells[i] for i in (0, 1, 2, 3)) + " |"
                )
            slopes = []
            for label, column in (("time", 1), ("memory", 2)):
                for which in ("ours", "builtin"):
                    s = _slope(by_which[which], column)
                    slopes.append(f"{label} {which} {'—' if s is None else f'{s:.2f}'}")
            lines += ["", "Slopes: " + ", ".join(slopes), ""]
    return "\n".join(lines) + "\n"


def scaling_plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        2, 2 * len(records), figsize=(4.2 * len(records) * 2, 7), squeeze=False
    )
    for i, r in enumerate(records):
        for j, step in enumerate(("predict", "train")):
            for row, (column, label) in enumerate(((1, "time (ms)"), (2, "peak growth (MiB)"))):
                ax = axes[row, 2 * i + j]
                for which, style in (("ours", "o-"), ("builtin", "s--")):
                    rows = [x for x in r["scaling"][step][which] if x[column]]
                    slope = _slope(r["scaling"][step][which], column)
                    name = f"{which} (slope {slope:.2f})" if slope is not None else which
                    ax.plot([x[0] for x in rows], [x[column] for x in rows], style, label=name)
                    failed = [x for x in r["scaling"][step][which] if x[3]]
                    if failed:
                        ax.annotate(
                            f"built-in: {failed[0][3]} from T={failed[0][0]}"
                            if which == "builtin"
                            else f"ours: {failed[0][3]}",
                            (0.02, 0.02 if which == "builtin" else 0.1),
                            xycoords="axes fraction",
                            fontsize=7,
                        )
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("T")
                ax.set_ylabel(label)
                ax.set_title(
                    f"{r['backend']} {'forward' if step == 'predict' else 'train step'}", fontsize=9
                )
                ax.legend(fontsize=7)
    fig.suptitle("Padded + causal self-attention, B=1, dim 256, 4 heads (CPU, log-log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--pairs", type=int, default=25)
    parser.add_argument("--long-pairs", type=int, default=7)
    parser.add_argument("--no-scaling", dest="scaling", action="store_false")
    parser.add_argument("--scaling-lengths", nargs="+", type=int, default=list(SCALING_LENGTHS))
    parser.add_argument("--memory-limit", type=float, default=16.0, help="GiB per process")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--small-pairs", type=int, default=101)
    parser.add_argument(
        "--only", choices=("small",), help="run one section: the small models (small.md)"
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the reports from OUT/raw/BACKEND.json (one file per backend's last run)",
    )
    parser.add_argument("--worker", choices=("pairs", "point", "small"), help="internal")
    parser.add_argument("--config", help="internal")
    parser.add_argument("--steps", help="internal")
    parser.add_argument("--which", choices=("ours", "builtin"), help="internal")
    parser.add_argument("--length", type=int, help="internal")
    parser.add_argument("--step", help="internal")
    parser.add_argument("--repeats", type=int, default=1, help="internal")
    args = parser.parse_args(argv)
    if args.worker:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return _child(args)
    raw = os.path.join(args.out, "raw")
    os.makedirs(raw, exist_ok=True)
    if not args.report_only:
        for backend in args.backends:
            small = run_small(backend, args)
            with open(os.path.join(raw, f"small-{backend}.json"), "w") as f:
                json.dump(small, f, indent=1)
            if args.only == "small":
                continue
            record = run_backend(backend, args)
            previous = os.path.join(raw, f"{backend}.json")
            if not args.scaling and os.path.exists(previous):
                # --no-scaling keeps the backend's last sweep, with its own date.
                with open(previous) as f:
                    last = json.load(f)
                if "scaling" in last:
                    record["scaling"] = last["scaling"]
                    record["scaling_started"] = last.get("scaling_started", last["started"])
            with open(os.path.join(raw, f"{backend}.json"), "w") as f:
                json.dump(record, f, indent=1)
    small = []
    for backend in BACKENDS:
        path = os.path.join(raw, f"small-{backend}.json")
        if os.path.exists(path):
            with open(path) as f:
                small.append(json.load(f))
    if small:
        with open(os.path.join(args.out, "small.md"), "w") as f:
            f.write(small_markdown(small, args))
        print(open(os.path.join(args.out, "small.md")).read())
    if args.only == "small":
        return
    records = []
    for backend in BACKENDS:  # every backend measured so far, in one report
        path = os.path.join(raw, f"{backend}.json")
        if os.path.exists(path):
            with open(path) as f:
                records.append(json.load(f))
    with open(os.path.join(args.out, "cpu.md"), "w") as f:
        f.write(markdown(records, args))
    with open(os.path.join(args.out, "cpu.json"), "w") as f:
        json.dump(records, f, indent=1)
    plot(records, os.path.join(args.out, "cpu.png"))
    print(open(os.path.join(args.out, "cpu.md")).read())
    if records and all("scaling" in r for r in records):
        with open(os.path.join(args.out, "scaling.md"), "w") as f:
            f.write(scaling_markdown(records, args))
        scaling_plot(records, os.path.join(args.out, "scaling.png"))
        print(open(os.path.join(args.out, "scaling.md")).read())


if __name__ == "__main__":
    main()
