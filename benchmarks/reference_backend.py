"""How long the known-difference reference takes on each backend it may run on.

`keras-mha swap` / `compare --model` on torch judge a padded case whose weight gradients
differ from the built-in's against the built-in on another backend, in a child process
(`keras_mha.compare.workers.run_reference`). `keras_mha.compare.known.REFERENCE_BACKENDS`
orders the candidates; this measures the wall time of one reference (start the child,
import, load the file, one predict and one gradient) per candidate, alternating, on a
keras.io-style classifier (`Embedding(mask_zero=True)`, a built-in attention with a causal
residual, pooling, a dense head) saved under the first candidate.

Writes `benchmarks/results/reference_backend.md`:

    .venv/bin/python benchmarks/reference_backend.py --rounds 3
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CANDIDATES = ("tensorflow", "jax")

SAVE = """
import keras, sys
keras.utils.set_random_seed(0)
tokens = keras.Input((8,), dtype="int32", name="tokens")
x = keras.layers.Embedding(50, 32, mask_zero=True)(tokens)
x = x + keras.layers.MultiHeadAttention(2, 16)(x, x, use_causal_mask=True)
x = keras.layers.GlobalAveragePooling1D()(x)
keras.Model(tokens, keras.layers.Dense(3)(x)).save(sys.argv[1])
"""


def _save(backend, path):
    env = {**os.environ, "KERAS_BACKEND": backend}
    subprocess.run([sys.executable, "-c", SAVE, path], check=True, env=env, capture_output=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(RESULTS, "reference_backend.md"))
    args = parser.parse_args(argv)

    from keras_mha.compare import workers

    started = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()[0]
    seconds = {backend: [] for backend in CANDIDATES}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "classifier.keras")
        _save(CANDIDATES[0], path)
        tokens = np.array([[4, 9, 2, 7, 0, 0, 0, 0], [7, 1, 3, 8, 5, 6, 2, 1]], "int32")
        cotangents = [np.ones((2, 3), "float32")]
        for _ in range(args.rounds):
            for backend in CANDIDATES:
                start = time.perf_counter()
                found = workers.run_reference(backend, path, [], [tokens], cotangents)
                seconds[backend].append(time.perf_counter() - start)
                if found is None:
                    sys.exit(f"the reference on {backend} failed")
                print(f"{backend}: {seconds[backend][-1]:.1f} s", flush=True)

    rows = [
        f"| {b} | {statistics.median(s):.1f} | {', '.join(f'{x:.1f}' for x in s)} |"
        for b, s in seconds.items()
    ]
    text = "\n".join(
        [
            "# The known-difference reference, per backend",
            "",
            f"Measured {started:%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
            f"{os.cpu_count()} CPU cores, no GPU (load average {load:.1f} at the start), "
            f"with `benchmarks/reference_backend.py --rounds {args.rounds}`: the wall time "
            "of `keras_mha.compare.workers.run_reference` (a child process: import, load a "
            "keras.io-style classifier on the built-in, one predict, one weight gradient), "
            "the candidates alternating.",
            "",
            "| backend | median s | each round, s |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
