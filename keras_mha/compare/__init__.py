"""Parity and speed of `keras_mha.MultiHeadAttention` against `keras.layers.MultiHeadAttention`.

The engine behind `keras-mha compare` (and the notebooks and benchmarks). For one case on
the current backend, `compare_case` builds a functional model around each layer, copies the
built-in's weights into ours, measures the largest absolute difference of the outputs, of
the attention scores (when the case asks for them) and of the gradients with respect to the
inputs, then times `predict_on_batch` and `train_on_batch` for both, alternating ours and
the built-in after a warm-up, and keeps the medians.

Keras picks its backend once per process, so `run_backend` runs a whole set of cases in a
child process with `KERAS_BACKEND` set, and `run` does that for every installed backend:

    from keras_mha import compare
    records = compare.run(backends="all", quick=True)          # list of dicts
    records = compare.run_backend("jax", compare.DEFAULT_CASES, quick=True, repeats=5)
    record = compare.compare_case(compare.DEFAULT_CASES[3], quick=True)  # this process

Each record is a plain dict (see `RECORD_KEYS`); timings are milliseconds, ratios are
ours / built-in (below 1 means ours is faster). Where the built-in fails (on JAX it cannot
run `value_dim != key_dim`) its fields are `None` and `builtin_error` holds its message.

`compare_model` does the same for the user's own model (`keras-mha compare --model`):
it loads a `.keras` file as it is and swapped (`keras_mha.swapping`), compares the
outputs and the gradients of a scalar loss with respect to the trainable weights, on
synthesised inputs without padding and, where the model takes padding (an
`Embedding(mask_zero=True)` or mask inputs), with padding (`user_model.padded`), times
`predict_on_batch` and a train step (SGD on an MSE loss against zeros, for both), and
`run_model_backend` adds the peak memory of each, measured in a fresh process per model
(the GPU's peak allocation where the backend has one, else the process's peak RSS).
`swap_file` is `keras-mha swap`: swap, check the outputs, write the swapped file.

Tolerances (float32): outputs and scores must agree to `ATOL = 1e-4` absolute. Input
gradients are sums over every output element that depends on the input (`T * dim` terms
for a query row), so their rounding error grows with their magnitude: they must agree to
`ATOL * max(1, max|gradient|)`, i.e. 1e-4 absolute for gradients up to 1 and 1e-4
relative beyond.

The package, one concern per module (every public name is importable from here):

- `records`: the backends, tolerances, record keys and the shared measurements;
- `cases`: the case engine (`Case`, `DEFAULT_CASES`, `compare_case`);
- `model`: the user's model (`compare_model`, `swap_file`, `peak_memory`);
- `workers`: the subprocess protocol (`run`, `run_backend`, `run_model_backend`,
  `run_swap`), each job in a child process `python -m keras_mha.compare SPEC`.
"""

from keras_mha.compare.cases import (
    DEFAULT_CASES,
    Case,
    compare_case,
    get_cases,
    run_cases,
)
from keras_mha.compare.model import (
    compare_model,
    peak_memory,
    swap_file,
)
from keras_mha.compare.records import (
    ATOL,
    BACKENDS,
    DEFAULT_REPEATS,
    QUICK_REPEATS,
    RECORD_KEYS,
    WARMUP,
    failed_input_cases,
    installed_backends,
    summary,
    within_tolerance,
)
from keras_mha.compare.workers import (
    run,
    run_backend,
    run_model_backend,
    run_swap,
)

__all__ = [
    "ATOL",
    "BACKENDS",
    "DEFAULT_CASES",
    "DEFAULT_REPEATS",
    "QUICK_REPEATS",
    "RECORD_KEYS",
    "WARMUP",
    "Case",
    "compare_case",
    "compare_model",
    "failed_input_cases",
    "get_cases",
    "installed_backends",
    "peak_memory",
    "run",
    "run_backend",
    "run_cases",
    "run_model_backend",
    "run_swap",
    "summary",
    "swap_file",
    "within_tolerance",
]
