"""Seconds of four eager calls of one layer whose call lands on the chunked kernel
(JAX's CPU policy: T * S above `explicit_up_to`), the first compiling, in a fresh
process: `KERAS_BACKEND=jax python benchmarks/eager_jax_chunked.py 600`; with
`--uncompiled`, the calls run the kernel op by op as before `kernels/compiled.py`
(`Policy.compile_eager_chunks` off). Results:
benchmarks/results/jax_eager_chunk_loop.md."""

import argparse
import contextlib
import time

import numpy as np
from keras import ops

import keras_mha
from keras_mha.kernels import policy


def main(length, uncompiled):
    layer = keras_mha.MultiHeadAttention(num_heads=4, key_dim=16)
    x = np.random.default_rng(0).random((2, length, 64), dtype="float32")
    seconds = []
    switch = (
        policy.overriding(compile_eager_chunks=False) if uncompiled else contextlib.nullcontext()
    )
    with switch:
        for _ in range(4):
            start = time.perf_counter()
            ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
            seconds.append(round(time.perf_counter() - start, 3))
    print(length, "uncompiled" if uncompiled else "compiled", seconds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("length", type=int)
    parser.add_argument("--uncompiled", action="store_true")
    args = parser.parse_args()
    main(args.length, args.uncompiled)
