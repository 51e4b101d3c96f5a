"""Score functions: the time of a train step's attention (forward and backward) per
score pattern, against the same call without one, on the backend `KERAS_BACKEND` names.

Each pattern of `keras_mha.score_mod` (ALiBi, tanh soft-cap, relative position, a
learned relative-bias table whose gradient is taken) runs through `keras_mha.attention`
on projected heads `(B, T, N, H)`, causal, with the kernel asked for (`--kernels`); the
baseline is the same call with no score function on the same kernel. A call with a score
function never takes the fused kernels (`kernels.policy`), so "auto" compares it with
whatever the unmodified call takes. Compiled as a step is: `jax.jit`, `tf.function`
(XLA), torch eager.

Writes `benchmarks/results/score_mod-<backend>.md` (`--out`), with the command, date and
machine:

    KERAS_BACKEND=jax .venv/bin/python benchmarks/score_mod.py
    KERAS_BACKEND=torch .venv/bin/python benchmarks/score_mod.py --length 2048 --kernels chunked
    KERAS_BACKEND=jax .venv/bin/python benchmarks/score_mod.py --dry-run   # tiny, writes nothing
"""

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

PATTERNS = ("none", "alibi", "soft_cap", "relative_position", "learned_table")
MAX_DISTANCE = 64


def _score_mod(pattern, heads, table):
    from keras_mha import score_mod as sm

    if pattern == "none":
        return None
    if pattern == "alibi":
        return sm.alibi(heads)
    if pattern == "soft_cap":
        return sm.soft_cap(30.0)
    if pattern == "relative_position":
        return sm.relative_position()
    return sm.relative_bias(table, MAX_DISTANCE)


def _step(pattern, kernel, heads, chunk_size):
    """`fn(q, k, v, table) -> (loss, grads)` compiled as the backend compiles a step."""
    import keras
    from keras import ops

    import keras_mha

    implementation = None if kernel == "auto" else kernel

    def loss(q, k, v, table):
        out = keras_mha.attention(
            q,
            k,
            v,
            score_mod=_score_mod(pattern, heads, table),
            use_causal_mask=True,
            implementation=implementation,
            chunk_size=chunk_size,
        )
        return ops.sum(ops.square(out))

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=True)
        def step(q, k, v, table):
            with tf.GradientTape() as tape:
                tape.watch([q, k, v, table])
                value = loss(q, k, v, table)
            return value, tape.gradient(value, [q, k, v, table])

        return step

    def step(q, k, v, table):
        tensors = [x.detach().requires_grad_(True) for x in (q, k, v, table)]
        value = loss(*tensors)
        value.backward()
        return value, [t.grad for t in tensors]

    return step


def _block(result):
    import keras

    value = result[0]
    if keras.backend.backend() == "jax":
        value.block_until_ready()
    else:
        keras.ops.convert_to_numpy(value)


def best_seconds(pattern, kernel, sizes, repeats, chunk_size):
    """The best of `repeats` timed steps, after one warm-up (compilation) step."""
    from keras import ops

    batch, length, heads, key_dim = sizes
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((batch, length, heads, key_dim)).astype("float32") for _ in "qkv"]
    arrays.append(rng.standard_normal((heads, 2 * MAX_DISTANCE + 1)).astype("float32"))
    tensors = [ops.convert_to_tensor(a) for a in arrays]
    step = _step(pattern, kernel, heads, chunk_size)
    _block(step(*tensors))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _block(step(*tensors))
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--key-dim", type=int, default=64)
    parser.add_argument("--kernels", default="auto,chunked,explicit")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, writes nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batch, args.length, args.heads, args.key_dim, args.repeats = 1, 24, 2, 4, 1
        args.chunk_size = args.chunk_size or 8
    import keras

    backend = keras.backend.backend()
    sizes = (args.batch, args.length, args.heads, args.key_dim)
    rows = []
    for kernel in args.kernels.split(","):
        baseline = best_seconds("none", kernel, sizes, args.repeats, args.chunk_size)
        for pattern in PATTERNS:
            if pattern == "none":
                seconds = baseline
            else:
                seconds = best_seconds(pattern, kernel, sizes, args.repeats, args.chunk_size)
            rows.append((kernel, pattern, seconds, seconds / baseline))
            print(
                f"{backend} {kernel:8s} {pattern:18s} {seconds * 1e3:9.2f} ms  x{rows[-1][3]:.2f}"
            )
    if args.dry_run:
        return rows
    command = "KERAS_BACKEND={} python benchmarks/score_mod.py {}".format(
        backend, " ".join(argv if argv is not None else sys.argv[1:])
    )
    lines = [
        f"# Score functions: train-step attention time ({backend})",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs  ",
        f"Sizes: B={args.batch}, T=S={args.length}, N={args.heads}, H={args.key_dim}, causal",
        "",
        f"| kernel | pattern | ms (best of {args.repeats}) | x unmodified |",
        "|---|---|---|---|",
    ]
    lines += [f"| {k} | {p} | {s * 1e3:.2f} | {r:.2f} |" for k, p, s, r in rows]
    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or os.path.join(here, "results", f"score_mod-{backend}.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", out)
    return rows


if __name__ == "__main__":
    main()
