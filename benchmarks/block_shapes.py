"""XLA's CPU products at the chunked kernel's block shapes: the measurement behind JAX's
`chunk_size` and `key_block` (`keras_mha.kernels.policy.POLICIES[("jax", "cpu")]`).

Each chunk of `q` queries of the compiled loop multiplies, per key block of `k` keys,
`(heads, q, key_dim) x (heads, key_dim, k)` for its logits and `(heads, q, k) x
(heads, k, key_dim)` for its output. Both run here alone, in a `fori_loop` over the
blocks of an `S`-key tensor (the kernel's loop without its softmax), and are reported in
GFLOP/s beside the backend's float32 GEMM rate measured in the same process, as
`floor.py` measures it (`run.py`'s `_matmul_flops_per_second`). Shapes with the same
logits per block (`q * k`) differ by up to 2x, and some fall off a cliff: the policy's
shape is re-measured here whenever jaxlib changes.

Writes `benchmarks/results/block_shapes.md` (`--out`):

    .venv/bin/python benchmarks/block_shapes.py
    .venv/bin/python benchmarks/block_shapes.py --heads 8 --key-dim 128 --out /tmp/shapes
    .venv/bin/python benchmarks/block_shapes.py --dry-run     # tiny sizes, writes nothing
"""

import argparse
import datetime
import os
import platform
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"  # the policy row measured here is JAX's
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402  (benchmarks/run.py: the GEMM rate)

SHAPES = ((256, 512), (512, 256), (256, 256), (512, 128), (512, 512), (1024, 256))


def _best_seconds(function, *args, repeats=5):
    function(*args).block_until_ready()  # compiled and warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def block_rates(queries, keys, heads, key_dim, length, sweeps):
    """`(logits, output)` FLOP/s of one chunk's block products, looped over the
    `length // keys` blocks `sweeps` times."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    blocks = length // keys
    steps = blocks * sweeps
    rng = jax.random.split(jax.random.key(0), 3)
    query = jax.random.normal(rng[0], (heads, queries, key_dim), jnp.float32)
    keys_last = jax.random.normal(rng[1], (heads, key_dim, length), jnp.float32)
    values = jax.random.normal(rng[2], (heads, length, key_dim), jnp.float32)

    def logits(query, keys_last):
        def step(j, acc):
            block = lax.dynamic_slice_in_dim(keys_last, (j % blocks) * keys, keys, 2)
            return acc + (query @ block)[..., :1]  # a use of every logit's row

        return lax.fori_loop(0, steps, step, jnp.zeros((heads, queries, 1), jnp.float32))

    def output(query, values):
        weights = jnp.ones((heads, queries, keys), jnp.float32) * query[..., :1]

        def step(j, acc):
            block = lax.dynamic_slice_in_dim(values, (j % blocks) * keys, keys, 1)
            return acc + weights @ block

        return lax.fori_loop(0, steps, step, jnp.zeros((heads, queries, key_dim), jnp.float32))

    flops = 2 * heads * queries * keys * key_dim * steps
    return (
        flops / _best_seconds(jax.jit(logits), query, keys_last),
        flops / _best_seconds(jax.jit(output), query, values),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--key-dim", type=int, default=64)
    parser.add_argument("--length", type=int, default=8192, help="keys the blocks sweep")
    parser.add_argument("--sweeps", type=int, default=8, help="passes over the keys per call")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, writes nothing")
    parser.add_argument("--out", default=bench.RESULTS, help="folder of block_shapes.md")
    args = parser.parse_args(argv)
    import jax

    shapes, length, sweeps = SHAPES, args.length, args.sweeps
    if args.dry_run:
        shapes, length, sweeps = ((8, 16), (16, 8)), 64, 1
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"Measured {now} by `benchmarks/block_shapes.py` on {platform.platform()},",
        f"{os.cpu_count()} CPU cores, jax {jax.__version__} ({jax.devices()[0].device_kind}).",
        "",
        f"Float32 {bench.MATMUL_SIZE}^3 GEMM: {bench._matmul_flops_per_second() / 1e9:.0f} "
        f"GFLOP/s. Heads {args.heads}, key_dim {args.key_dim}, {length} keys, {sweeps} sweeps;",
        "best of 5 calls per product.",
        "",
        "| queries x keys per block | logits GFLOP/s | output GFLOP/s |",
        "|---|---:|---:|",
    ]
    for queries, keys in shapes:
        rates = block_rates(queries, keys, args.heads, args.key_dim, length, sweeps)
        lines.append(f"| {queries} x {keys} | {rates[0] / 1e9:.0f} | {rates[1] / 1e9:.0f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.dry_run:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "block_shapes.md"), "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
