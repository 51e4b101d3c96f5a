"""The user's own model for `keras-mha swap` and `keras-mha compare --model`: importing
the modules that register its custom objects, loading the `.keras` file, and its inputs,
synthesised from its input specs or read from a `.npz` file.

Every problem with what the user gave (a file, a module, an input) is a `UsageError`
whose message is one line naming it; the command line prints it and exits with 2.
"""

import importlib
import os
import re
import sys
import zipfile

import numpy as np

BATCH = 2  # an unknown batch dimension
LENGTH = 16  # any other unknown dimension


class UsageError(ValueError):
    """A file, module or input the user gave cannot be used; the message is one line."""


def import_modules(names):
    """Imports each module (they register the model's custom objects), from the
    current directory first, as `python -c "import NAME"` would."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:
            raise UsageError(f"--import {name}: cannot import it: {_one_line(error)}") from None


def load(path, swapped=False):
    """Loads a `.keras` model (Keras's `safe_mode`), under `swapped()` if asked."""
    import keras

    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file")
    if not path.endswith(".keras") or not zipfile.is_zipfile(path):
        raise UsageError(f"{path}: not a .keras model file")
    try:
        if swapped:
            from keras_mha import swapping

            model = swapping.load_swapped(path)
        else:
            model = keras.saving.load_model(path)
    except Exception as error:
        missing = re.search(r"Could not locate (?:class|function) '([^']+)'", _full_text(error))
        if missing:
            raise UsageError(
                f"{path}: cannot load the model: '{missing.group(1)}' is not registered "
                "with Keras (import the module that registers it with --import MODULE)"
            ) from None
        raise UsageError(f"{path}: cannot load the model: {_one_line(error)}") from None
    if not isinstance(model, keras.Model):
        raise UsageError(f"{path}: holds a {type(model).__name__}, not a model")
    return model


def check_output_path(path):
    if not path.endswith(".keras"):
        raise UsageError(f"{path}: the output file must end in .keras")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{path}: no such folder: {folder}")


# -------------------------------------------------------------------------- inputs
def input_specs(model, path, required=True):
    """`[(name, shape, dtype)]` of the model's inputs, in order; `None` for a model
    without input specs (a subclassed model) unless `required`."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        if not required:
            return None
        raise UsageError(
            f"{path}: the model has no input specs (a subclassed model?); "
            "give its inputs with --inputs FILE.npz"
        )
    return [(t.name, tuple(t.shape), str(t.dtype)) for t in inputs]


def synthesize(specs, path, seed=0, bounds=None):
    """Arrays for the specs: floats standard normal, ints in [1, 10) (below
    `bounds[i]` for input `i` where given: `integer_bounds`; 0 where that is 1), mask
    inputs (`is_mask_input`) all ones (nothing padded: `padded` pads them); an unknown
    batch dimension is 2, any other unknown dimension 16."""
    rng = np.random.default_rng(seed)
    arrays = []
    bounds = bounds or {}
    for index, (name, shape, dtype) in enumerate(specs):
        concrete = tuple(
            (BATCH if i == 0 else LENGTH) if d is None else d for i, d in enumerate(shape)
        )
        kind = _kind(dtype)
        if is_mask_input(name, dtype):
            array = np.ones(concrete, dtype)
        elif kind == "f":
            array = rng.standard_normal(concrete).astype("float32")
        elif kind in "iu":
            high = min(10, bounds.get(index, 10))
            array = rng.integers(min(1, high - 1), high, concrete).astype(dtype)
        else:
            raise UsageError(
                f"{path}: cannot synthesize input '{name}' of dtype {dtype}; "
                "give the inputs with --inputs FILE.npz"
            )
        arrays.append(array)
    return arrays


def padded(model, specs, arrays):
    """The arrays with padding, or `None` where the model takes none: each row `b`
    keeps its first `max(1, (b + 1) * L // (B + 1))` positions along axis 1. Integer
    inputs that reach an `Embedding(mask_zero=True)` (found by walking the model's
    graph back from each such embedding) get trailing zeros; mask inputs
    (`is_mask_input`) get trailing `False`/0 at the same positions."""
    if not specs or len(specs) != len(arrays):
        return None
    feeding = _inputs_feeding_masked_embeddings(model)
    result, changed = [], False
    for index, ((name, _, dtype), array) in enumerate(zip(specs, arrays)):
        mask_input = is_mask_input(name, dtype)
        if array.ndim < 2 or array.shape[1] < 2 or not (mask_input or index in feeding):
            result.append(array)
            continue
        batch, length = array.shape[:2]
        kept = np.array([max(1, (b + 1) * length // (batch + 1)) for b in range(batch)])
        valid = np.arange(length)[None, :] < kept[:, None]
        valid = valid.reshape(valid.shape + (1,) * (array.ndim - 2))
        if mask_input:
            array = np.broadcast_to(valid, array.shape).astype(array.dtype)
        else:
            array = np.where(valid, array, 0).astype(array.dtype)
        result.append(array)
        changed = True
    return result if changed else None


def _inputs_feeding_masked_embeddings(model):
    """Indices of the model's inputs from which an `Embedding(mask_zero=True)` (or a
    layer holding one) is reached, through any layers and ops."""
    return {
        index
        for index, layers in embeddings_reached(model).items()
        if any(getattr(layer, "mask_zero", False) for layer in layers)
    }


def integer_bounds(model):
    """`{input index: n}`: the smallest `input_dim` of the embeddings each input
    reaches (`embeddings_reached`), which its synthesized values stay below (a
    keras-hub model's `segment_ids` reach a 2-row segment embedding)."""
    return {
        index: min(layer.input_dim for layer in layers)
        for index, layers in embeddings_reached(model).items()
    }


def embeddings_reached(model):
    """`{input index: [keras.layers.Embedding]}`: the embeddings each of a functional
    model's inputs reaches, found by walking its graph back from each embedding (or
    layer holding one) through any layers and ops, and into nested functional models
    (a keras-hub task's backbone), input by input."""
    import keras

    inputs = list(getattr(model, "inputs", None) or [])
    positions = {id(t): i for i, t in enumerate(inputs)}
    found = {}

    def sources(tensor, seen):
        if id(tensor) in seen:
            return set()
        seen.add(id(tensor))
        if id(tensor) in positions:
            return {positions[id(tensor)]}
        history = getattr(tensor, "_keras_history", None)
        if history is None:
            return set()
        node = history.operation._inbound_nodes[history.node_index]
        reached = set()
        for parent in node.input_tensors:
            reached |= sources(parent, seen)
        return reached

    def add(tensors, layers):
        for index in set().union(*(sources(t, set()) for t in tensors)):
            found.setdefault(index, []).extend(layers)

    for operation in getattr(model, "operations", None) or []:
        nested = getattr(operation, "inputs", None) if isinstance(operation, keras.Model) else None
        if nested and getattr(operation, "operations", None):
            inner = embeddings_reached(operation)
            for node in operation._inbound_nodes:
                outer = node.input_tensors
                if len(outer) != len(nested):
                    add(outer, [layer for layers in inner.values() for layer in layers])
                    continue
                for index, layers in inner.items():
                    add([outer[index]], layers)
            continue
        layers = [operation]
        if isinstance(operation, keras.layers.Layer):
            layers = operation._flatten_layers(include_self=True, recursive=True)
        embeddings = [layer for layer in layers if isinstance(layer, keras.layers.Embedding)]
        if embeddings:
            for node in operation._inbound_nodes:
                add(node.input_tensors, embeddings)
    return found


def read(npz_path, specs):
    """Arrays for the specs from a `.npz` file: by input name, or in order when the
    file's arrays are unnamed (`np.savez(path, a, b)`: `arr_0`, `arr_1`, ...)."""
    try:
        with np.load(npz_path, allow_pickle=False) as data:
            stored = {key: data[key] for key in data.files}
    except Exception as error:
        raise UsageError(f"{npz_path}: not a NumPy .npz file: {_one_line(error)}") from None
    if not isinstance(stored, dict) or not stored:
        raise UsageError(f"{npz_path}: holds no arrays")
    keys = list(stored)
    if specs is None:  # no specs to match: the file's order
        return [stored[key] for key in keys]
    names = [name for name, _, _ in specs]
    if set(keys) == set(names):
        arrays = [stored[name] for name in names]
    elif keys == [f"arr_{i}" for i in range(len(keys))]:
        if len(keys) != len(specs):
            raise UsageError(
                f"{npz_path}: holds {len(keys)} arrays, the model takes {len(specs)} "
                f"inputs ({', '.join(names)})"
            )
        arrays = [stored[key] for key in keys]
    else:
        missing = [name for name in names if name not in stored]
        if missing:
            raise UsageError(
                f"{npz_path}: no array for input '{missing[0]}' "
                f"(arrays: {', '.join(keys)}; inputs: {', '.join(names)})"
            )
        extra = [key for key in keys if key not in names]
        raise UsageError(
            f"{npz_path}: array '{extra[0]}' matches no input (inputs: {', '.join(names)})"
        )
    batch = None
    for (name, shape, dtype), array in zip(specs, arrays):
        fits = len(array.shape) == len(shape) and all(
            d is None or d == a for d, a in zip(shape, array.shape)
        )
        kind, got = _kind(dtype), array.dtype.kind
        fits = fits and (
            got == kind or (kind == "f" and got in "iu") or (kind in "iu" and got in "iu")
        )
        if not fits:
            raise UsageError(
                f"{npz_path}: input '{name}' expects shape {_shape(shape)} of {dtype}, "
                f"got shape {tuple(array.shape)} of {array.dtype}"
            )
        if batch is not None and array.shape[0] != batch:
            raise UsageError(
                f"{npz_path}: input '{name}' has batch size {array.shape[0]}, the others {batch}"
            )
        batch = array.shape[0]
    return [
        array.astype("float32") if _kind(d) == "f" else array
        for (_, _, d), array in zip(specs, arrays)
    ]


def model_inputs(model, arrays):
    """The arrays in the structure the model was built with (one array, a list, a dict)."""
    import keras

    structure = getattr(model, "input", None)
    if structure is None or len(arrays) != len(keras.tree.flatten(structure)):
        return arrays[0] if len(arrays) == 1 else list(arrays)
    return keras.tree.pack_sequence_as(structure, list(arrays))


def is_mask_input(name, dtype):
    """Whether an input is a mask: bool, or an integer named `*mask` (`padding_mask`,
    `decoder_padding_mask`; not a masked LM's `mask_positions`)."""
    kind = _kind(dtype)
    return kind == "b" or (kind in "iu" and name.lower().endswith("mask"))


def _kind(dtype):
    if "float" in dtype:
        return "f"
    if dtype == "bool":
        return "b"
    if dtype.startswith("uint"):
        return "u"
    if dtype.startswith("int"):
        return "i"
    return "?"


def _shape(shape):
    return (
        "("
        + ", ".join("None" if d is None else str(d) for d in shape)
        + ("," if len(shape) == 1 else "")
        + ")"
    )


def _full_text(error):
    texts = []
    while error is not None and len(texts) < 10:
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def _one_line(error):
    """The error's type and first informative line, without Keras's config dumps."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else ""
    line = re.split(r" (Full object config|Make sure custom classes|Config:)", line)[0]
    return f"{type(error).__name__}: {line}"[:300]
