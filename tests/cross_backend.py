"""The two sides of the cross-backend matrix (`tests/test_cross_backend.py`), run in
one process per backend under `KERAS_BACKEND`:

    KERAS_BACKEND=jax python tests/cross_backend.py save DIR
    KERAS_BACKEND=torch python tests/cross_backend.py check DIR ...
    KERAS_BACKEND=torch python tests/cross_backend.py save-then-check DIR

`save-then-check` saves into DIR, prints `SAVED`, then reads the directories to check
from its standard input (one line, a JSON list), once every backend has saved:
one interpreter per backend instead of two.

`save` writes a model holding our layer (`ours.keras`, with its inputs and outputs in
`ours.npz`) and the keras.io-style classifier on the built-in layer (`builtin.keras`,
from `swap_models.py`). `check` loads every directory's files here: ours must give the
saved outputs; the classifier is swapped and compared with its swapped copy (outputs
and weight gradients, unpadded and padded inputs: `compare.swap_file`), and swapped to
a file that loads with `safe_mode=True`. It prints one line, `RESULTS {json}`.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
import swap_models

import keras_mha


def build_ours():
    """Tokens with a padding mask -> causal self-attention -> cross-attention to a
    context with S != T and value_dim != key_dim, returning output and scores."""
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    context = keras.Input((3, 6), name="context")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = keras_mha.MultiHeadAttention(2, 4, name="self_attention")(x, x, use_causal_mask=True)
    y, scores = keras_mha.MultiHeadAttention(
        2, key_dim=4, value_dim=3, output_shape=(2, 4), name="cross_attention"
    )(x, context, return_attention_scores=True)
    return keras.Model([tokens, context], [y, scores])


def save(directory):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(0)
    model = build_ours()
    tokens = np.array([[4, 9, 2, 0, 0], [7, 1, 3, 8, 5]], "int32")
    context = np.random.default_rng(0).normal(size=(2, 3, 6)).astype("float32")
    y, scores = (keras.ops.convert_to_numpy(o) for o in model([tokens, context]))
    model.save(directory / "ours.keras")
    np.savez(directory / "ours.npz", tokens=tokens, context=context, y=y, scores=scores)
    swap_models.build_classifier().save(directory / "builtin.keras")
    (directory / "backend.txt").write_text(keras.backend.backend())


def _check_ours(directory):
    data = np.load(directory / "ours.npz")
    loaded = keras.saving.load_model(directory / "ours.keras", safe_mode=True)
    classes = {type(loaded.get_layer(n)) for n in ("self_attention", "cross_attention")}
    y, scores = (keras.ops.convert_to_numpy(o) for o in loaded([data["tokens"], data["context"]]))
    return {
        "classes": sorted(f"{c.__module__}.{c.__name__}" for c in classes),
        "shapes": [list(y.shape), list(scores.shape)],
        "max_abs_diff": float(
            max(np.abs(y - data["y"]).max(), np.abs(scores - data["scores"]).max())
        ),
    }


def _check_builtin(directory):
    from keras_mha import compare

    # `swap_file` compares as `compare_model` does (`compare.model._compare_on`: outputs,
    # masks and weight gradients on unpadded and padded inputs) before it writes: one
    # load and comparison, not two (under torch, a file saved under JAX loads with
    # `jit_compile=True`: each model's first call there is a `torch.compile`).
    path = str(directory / "builtin.keras")
    out = str(directory / f"builtin-swapped-{keras.backend.backend()}.keras")
    swap = compare.swap_file(path, out)
    loaded = keras.saving.load_model(out, safe_mode=True)
    return {
        "passed": swap["passed"],
        "max_abs_diff": swap["max_abs_diff"],
        "grad_max_abs_diff": swap["grad_max_abs_diff"],
        "input_cases": sorted(swap["input_cases"]),
        "swapped_classes": [
            type(loaded.get_layer("block").att) is keras_mha.MultiHeadAttention,
            type(loaded.get_layer("causal_attention")) is keras_mha.MultiHeadAttention,
        ],
    }


def check(directories):
    results = {}
    for directory in map(Path, directories):
        results[(directory / "backend.txt").read_text()] = {
            "backend": keras.backend.backend(),
            "ours": _check_ours(directory),
            "builtin": _check_builtin(directory),
        }
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "save-then-check":
        save(sys.argv[2])
        print("SAVED", flush=True)
        check(json.loads(sys.stdin.readline()))
    elif len(sys.argv) >= 3 and sys.argv[1] == "check":
        check(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        sys.exit(
            f"usage: KERAS_BACKEND=... {sys.argv[0]} save DIR | check DIR ... | save-then-check DIR"
        )
