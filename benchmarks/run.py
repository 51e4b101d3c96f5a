"""Speed and memory of `keras_mha.MultiHeadAttention` against the built-in, per backend.

Writes `benchmarks/results/cpu.md` (a markdown table) and `benchmarks/results/cpu.png`.
Each backend runs in its own child process (Keras picks its backend once per process):

- speed: self-attention, B=8, T=256, dim 512, 8 heads; `predict_on_batch` and
  `train_on_batch` of a functional model, ours and the built-in (identical weights)
  alternated in rounds after a warm-up (see `_median_pairs`), medians kept; plus the
  matmul floor, the layer's FLOPs over the backend's own measured matmul throughput;
- long sequences: B=1, T=S=8192, dim 256, 4 heads, no scores: forward time (alternated
  rounds) and the growth of peak RSS from T=256 to T=8192, each configuration in a fresh
  child process (`ru_maxrss` sees native buffers, which `tracemalloc` does not).

    .venv/bin/python benchmarks/run.py              # every backend, ~9 minutes on 2 cores
    .venv/bin/python benchmarks/run.py --backends jax --pairs 5
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
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SPEED = dict(batch=8, length=256, dim=512, heads=8)
LONG = dict(batch=1, length=8192, short_length=256, dim=256, heads=4)
MATMUL_SIZE = 2048


# ----------------------------------------------------------------- child process side
def _layers(heads, dim):
    import keras

    import keras_mha

    ours = keras_mha.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)
    builtin = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)
    return ours, builtin


def _models(batch, length, dim, heads):
    """Functional self-attention models around ours and the built-in, same weights."""
    import keras

    models = []
    for layer in _layers(heads, dim):
        x = keras.Input(shape=(length, dim), batch_size=batch)
        models.append(keras.Model(x, layer(x, x)))
    models[1].set_weights(models[0].get_weights())
    return models


def _median_pairs(functions, pairs, warmup=2):
    """Median seconds of each function over `pairs` alternated rounds, after warm-up.

    In each round every function runs twice and only its second call is timed, so a
    timed call always follows a call of the same function: what one layer pays for
    the memory the other left behind stays out of its time. With single alternated
    calls the built-in's T=8192 TensorFlow forward took 2.1-2.5 s after itself and
    3.0-4.2 s after ours (2026-11-22), which flipped the ratio between runs. Every
    other round runs the functions in reverse order (A B, B A, ...).
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
    return [statistics.median(t) for t in times], _ratio_quartiles(*times)


def _ratio_quartiles(ours, builtin):
    """First and third quartiles of the per-round ratios ours / built-in: how far the
    machine's drift moves a ratio that the medians summarise."""
    ratios = [a / b for a, b in zip(ours, builtin)]
    quartiles = statistics.quantiles(ratios, n=4)
    return quartiles[0], quartiles[2]


def _matmul_flops_per_second():
    """The backend's own float32 matmul throughput (best of 15, compiled where usual).

    Best, not median: the floor is what the machine can do at its fastest, and on a
    shared machine a slow moment during these few seconds halved the median once.
    """
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


def _layer_flops(batch, length, dim):
    """FLOPs of self-attention `(forward, training step)`.

    Forward: four `dim x dim` projections `P` and the two `T x S` products `A`. A
    training step adds every weight gradient (`P`), the output projection's input
    gradient (`P / 4`) and the attention's backward (`2 A`); the model input needs
    no gradient, so the q/k/v projections' input gradients are not computed.
    """
    projections = 2 * batch * length * dim * dim * 4
    attention = 2 * 2 * batch * length * length * dim
    return projections + attention, 2.25 * projections + 3 * attention


def speed_worker(pairs):
    import numpy as np

    b, t, d, n = SPEED["batch"], SPEED["length"], SPEED["dim"], SPEED["heads"]
    ours, builtin = _models(b, t, d, n)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, t, d)).astype("float32")
    y = rng.standard_normal((b, t, d)).astype("float32")
    predict, predict_spread = _median_pairs(
        [lambda: ours.predict_on_batch(x), lambda: builtin.predict_on_batch(x)], pairs
    )
    for model in (ours, builtin):
        model.compile(optimizer="sgd", loss="mse")
    train, train_spread = _median_pairs(
        [lambda: ours.train_on_batch(x, y), lambda: builtin.train_on_batch(x, y)], pairs
    )
    flops, train_flops = _layer_flops(b, t, d)
    throughput = _matmul_flops_per_second()
    return dict(
        ours_predict_ms=predict[0] * 1e3,
        builtin_predict_ms=predict[1] * 1e3,
        ours_train_ms=train[0] * 1e3,
        builtin_train_ms=train[1] * 1e3,
        predict_ratio_quartiles=predict_spread,
        train_ratio_quartiles=train_spread,
        matmul_gflops=throughput / 1e9,
        floor_predict_ms=flops / throughput * 1e3,
        floor_train_ms=train_flops / throughput * 1e3,
    )


def long_time_worker(pairs):
    import numpy as np

    b, t, d, n = LONG["batch"], LONG["length"], LONG["dim"], LONG["heads"]
    ours, builtin = _models(b, t, d, n)
    x = np.random.default_rng(0).standard_normal((b, t, d)).astype("float32")
    times, spread = _median_pairs(
        [lambda: ours.predict_on_batch(x), lambda: builtin.predict_on_batch(x)], pairs, warmup=0
    )
    return dict(
        ours_long_ms=times[0] * 1e3, builtin_long_ms=times[1] * 1e3, long_ratio_quartiles=spread
    )


def memory_worker(which, length):
    """Peak RSS (MiB) of this process after one forward call of one layer at `length`."""
    import numpy as np

    b, d, n = LONG["batch"], LONG["dim"], LONG["heads"]
    import keras

    layer = _layers(n, d)[0 if which == "ours" else 1]
    x_in = keras.Input(shape=(length, d), batch_size=b)
    model = keras.Model(x_in, layer(x_in, x_in))
    x = np.random.default_rng(0).standard_normal((b, length, d)).astype("float32")
    np.asarray(model.predict_on_batch(x))
    return dict(peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _child(args):
    if args.worker == "speed":
        result = speed_worker(args.pairs)
    elif args.worker == "long_time":
        result = long_time_worker(args.long_pairs)
    else:
        result = memory_worker(args.which, args.length)
    print("RESULT " + json.dumps(result))


# ---------------------------------------------------------------- parent process side
def _spawn(backend, *worker_args):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, os.path.abspath(__file__), *worker_args]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{backend} {worker_args} failed:\n{done.stderr[-3000:]}")


def run_backend(backend, pairs, long_pairs):
    print(f"[{backend}] speed ...", flush=True)
    record = dict(backend=backend)
    record.update(_spawn(backend, "--worker", "speed", "--pairs", str(pairs)))
    print(f"[{backend}] long-sequence time ...", flush=True)
    record.update(_spawn(backend, "--worker", "long_time", "--long-pairs", str(long_pairs)))
    for which in ("ours", "builtin"):
        peaks = {}
        for length in (LONG["short_length"], LONG["length"]):
            print(f"[{backend}] peak memory, {which}, T={length} ...", flush=True)
            args = ("--worker", "memory", "--which", which, "--length", str(length))
            peaks[length] = _spawn(backend, *args)["peak_rss_mib"]
        record[f"{which}_growth_mib"] = peaks[LONG["length"]] - peaks[LONG["short_length"]]
    record["predict_ratio"] = record["ours_predict_ms"] / record["builtin_predict_ms"]
    record["train_ratio"] = record["ours_train_ms"] / record["builtin_train_ms"]
    record["long_ratio"] = record["ours_long_ms"] / record["builtin_long_ms"]
    record["growth_ratio"] = record["ours_growth_mib"] / max(record["builtin_growth_mib"], 1.0)
    print(json.dumps(record), flush=True)
    return record


def _spread(record, step):
    low, high = record[f"{step}_ratio_quartiles"]
    return f"({low:.2f}-{high:.2f})"


def markdown(records, pairs, long_pairs):
    date = datetime.date.today().isoformat()
    lines = [
        f"Measured {date} on {platform.machine()}, {os.cpu_count()} CPU cores, no GPU, with "
        f"`make bench` (`benchmarks/run.py`). Ratios are ours / built-in (below 1: ours is "
        f"faster or leaner); a time ratio is that of the medians, followed by the first and "
        f"third quartiles of the per-round ratios.",
        "",
        f"Self-attention B={SPEED['batch']}, T={SPEED['length']}, dim {SPEED['dim']}, "
        f"{SPEED['heads']} heads: medians of {pairs} alternated rounds (ms; each timed call "
        f"follows an untimed one of the same layer); floor = layer "
        f"FLOPs / the backend's best measured {MATMUL_SIZE}x{MATMUL_SIZE} matmul throughput.",
        "",
        "| backend | predict ours | built-in | ratio | floor | train ours | built-in | ratio "
        "| floor | matmul GFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['backend']} | {r['ours_predict_ms']:.1f} | {r['builtin_predict_ms']:.1f} "
            f"| **{r['predict_ratio']:.2f}x** {_spread(r, 'predict')} "
            f"| {r['floor_predict_ms']:.1f} "
            f"| {r['ours_train_ms']:.1f} | {r['builtin_train_ms']:.1f} "
            f"| **{r['train_ratio']:.2f}x** {_spread(r, 'train')} | {r['floor_train_ms']:.1f} "
            f"| {r['matmul_gflops']:.0f} |"
        )
    lines += [
        "",
        f"Long sequences B={LONG['batch']}, T=S={LONG['length']}, dim {LONG['dim']}, "
        f"{LONG['heads']} heads, no scores: forward medians of {long_pairs} alternated rounds "
        f"(ms); growth of peak RSS from T={LONG['short_length']} to T={LONG['length']} "
        f"(MiB, a fresh process per configuration).",
        "",
        "| backend | forward ours | built-in | ratio | growth ours | built-in | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['backend']} | {r['ours_long_ms']:.0f} | {r['builtin_long_ms']:.0f} "
            f"| **{r['long_ratio']:.2f}x** {_spread(r, 'long')} | {r['ours_growth_mib']:.0f} "
            f"| {r['builtin_growth_mib']:.0f} | **{r['growth_ratio']:.2f}x** |"
        )
    return "\n".join(lines) + "\n"


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["predict\nB=8 T=256", "train\nB=8 T=256", "forward\nT=8192", "memory growth\nT=8192"]
    keys = ["predict_ratio", "train_ratio", "long_ratio", "growth_ratio"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(records), 1)
    for i, r in enumerate(records):
        xs = [k + i * width for k in range(len(keys))]
        ax.bar(xs, [r[k] for k in keys], width, label=r["backend"])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([k + width * (len(records) - 1) / 2 for k in range(len(keys))])
    ax.set_xticklabels(labels)
    ax.set_ylabel("ours / built-in (lower is better)")
    ax.set_title("keras_mha.MultiHeadAttention vs keras.layers.MultiHeadAttention (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--pairs", type=int, default=25)
    parser.add_argument("--long-pairs", type=int, default=15)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--worker", choices=("speed", "long_time", "memory"), help="internal")
    parser.add_argument("--which", choices=("ours", "builtin"), help="internal")
    parser.add_argument("--length", type=int, help="internal")
    args = parser.parse_args(argv)
    if args.worker:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return _child(args)
    records = [run_backend(b, args.pairs, args.long_pairs) for b in args.backends]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu.md"), "w") as f:
        f.write(markdown(records, args.pairs, args.long_pairs))
    with open(os.path.join(args.out, "cpu.json"), "w") as f:
        json.dump(records, f, indent=1)
    plot(records, os.path.join(args.out, "cpu.png"))
    print(open(os.path.join(args.out, "cpu.md")).read())


if __name__ == "__main__":
    main()
