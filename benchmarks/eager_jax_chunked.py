"""Seconds of four eager calls of one layer whose call lands on the chunked kernel
(JAX's CPU policy: T * S above `explicit_up_to`), the first compiling, in a fresh
process: `KERAS_BACKEND=jax python benchmarks/eager_jax_chunked.py 600`. Results:
benchmarks/results/jax_eager_chunk_loop.md."""

import sys
import time

import numpy as np
from keras import ops

import keras_mha


def main(length):
    layer = keras_mha.MultiHeadAttention(num_heads=4, key_dim=16)
    x = np.random.default_rng(0).random((2, length, 64), dtype="float32")
    seconds = []
    for _ in range(4):
        start = time.perf_counter()
        ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
        seconds.append(round(time.perf_counter() - start, 3))
    print(length, seconds)


if __name__ == "__main__":
    main(int(sys.argv[1]))
