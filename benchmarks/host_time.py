"""Host time per eager call: ours against the built-in where the call's own work is tiny.

Torch runs Keras layers eagerly, so every call of the layer pays its Python (Keras's
`Layer.__call__`, ours or the built-in's checks, the sublayers' calls) before and
around its kernels; on a GPU that host time can bound the call (benchmarks/results/
gpu.md). This measures it on sizes where the kernels take almost nothing: B=1, T=8,
dim 64, 4 heads, and a decode-sized B=4, T=1, dim 512, 8 heads; direct calls of the
layer (self-attention, no mask) under `torch.no_grad()`, in float32 and
mixed_bfloat16. Ours and the built-in alternate in `--rounds` rounds of `--calls`
calls each; the best round counts (the least disturbed).

    .venv/bin/python benchmarks/host_time.py            # torch, prints a markdown table
    .venv/bin/python benchmarks/host_time.py --rounds 2 --calls 20   # a quick check
"""

import argparse
import json
import os
import subprocess
import sys
import time

SIZES = {"B=1 T=8 dim 64": (1, 8, 64, 4), "B=4 T=1 dim 512": (4, 1, 512, 8)}
POLICIES = ("float32", "mixed_bfloat16")


def measure(dtype_policy, rounds, calls):
    """`{size: {"ours": us, "builtin": us}}` in this process."""
    import keras
    import numpy as np

    import keras_mha

    keras.config.set_dtype_policy(dtype_policy)
    rng = np.random.default_rng(0)
    result = {}
    for label, (batch, length, dim, heads) in SIZES.items():
        x = keras.ops.convert_to_tensor(rng.standard_normal((batch, length, dim)), "float32")
        layers = {
            "ours": keras_mha.MultiHeadAttention(heads, dim // heads),
            "builtin": keras.layers.MultiHeadAttention(heads, dim // heads),
        }
        for layer in layers.values():
            layer(x, x)
        times = {name: [] for name in layers}
        with _no_grad():
            for i in range(rounds):
                for name in ("ours", "builtin")[:: 1 if i % 2 == 0 else -1]:
                    layer = layers[name]
                    start = time.perf_counter()
                    for _ in range(calls):
                        layer(x, x)
                    times[name].append((time.perf_counter() - start) / calls * 1e6)
        result[label] = {name: min(t) for name, t in times.items()}
    return result


def _no_grad():
    import contextlib

    import keras

    if keras.backend.backend() == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.rounds, args.calls)))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND=args.backend, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    print(f"Host time per call, {args.backend}, best of {args.rounds} rounds of {args.calls} (us)")
    print("\n| dtype policy | size | ours | built-in | ours / built-in |\n|---|---|---|---|---|")
    for dtype_policy in POLICIES:
        command = [sys.executable, __file__, "--child", dtype_policy]
        command += ["--rounds", str(args.rounds), "--calls", str(args.calls)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        for label, pair in json.loads(done.stdout.strip().splitlines()[-1]).items():
            ours, builtin = pair["ours"], pair["builtin"]
            ratio = ours / builtin
            print(f"| {dtype_policy} | {label} | {ours:.0f} | {builtin:.0f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
