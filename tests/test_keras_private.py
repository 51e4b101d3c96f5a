"""The private Keras API keras_mha relies on (all of it in `keras_mha/_keras_private.py`)
still exists and still means what we use it for. A Keras upgrade that moves or changes
it fails here, by name, before anything subtler fails elsewhere."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_mha import _keras_private

PACKAGE = Path(_keras_private.__file__).resolve().parent
# Attributes of Keras's own objects that are not public API.
KERAS_PRIVATE_ATTRIBUTES = {
    "_call_signature",
    "_keras_mask",
    "_build_shapes_dict",
    "_tracker",
    "_called",
    "_remat_mode",
}


def test_implicit_mask_helpers_round_trip_on_a_backend_tensor():
    x = keras.ops.ones((2, 3, 4))
    mask = keras.ops.convert_to_tensor(np.array([[True, True, False], [True, False, False]]))
    assert _keras_private.get_keras_mask(x) is None
    _keras_private.set_keras_mask(x, mask)
    assert _keras_private.get_keras_mask(x) is mask
    _keras_private.set_keras_mask(x, None)
    assert _keras_private.get_keras_mask(x) is None


def test_implicit_mask_helpers_read_what_keras_layers_write():
    tokens = np.array([[1, 2, 0], [3, 0, 0]])
    embedded = keras.layers.Embedding(5, 4, mask_zero=True)(tokens)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(_keras_private.get_keras_mask(embedded)), tokens != 0
    )
    # ...and what we write is what Keras's layers read: Masking's output mask is ours.
    x = keras.ops.ones((2, 3, 4))
    mask = keras.ops.convert_to_tensor(np.array([[True, False, True], [False, True, True]]))
    _keras_private.set_keras_mask(x, mask)
    pooled = keras.layers.GlobalAveragePooling1D()(x, mask=_keras_private.get_keras_mask(x))
    assert tuple(pooled.shape) == (2, 4)


def test_keras_still_keeps_what_call_is_all_it_does_reads():
    """`Layer.__call__` marks a layer called, and a layer made under a `RematScope`
    keeps its mode: without these, every projection would go through Keras's
    `__call__` (correct, only slower)."""
    plain = keras.layers.EinsumDense("ab,bc->ac", output_shape=2)
    assert plain._called is False and plain._remat_mode is None
    x = keras.ops.ones((1, 3))
    plain(x)
    assert plain._called is True
    assert _keras_private.call_is_all_it_does(plain, x)
    with keras.RematScope(mode="full"):
        remat = keras.layers.EinsumDense("ab,bc->ac", output_shape=2)
    remat(x)
    assert remat._remat_mode is not None
    assert not _keras_private.call_is_all_it_does(remat, x)


def test_keras_still_refuses_and_then_takes_non_tensor_positional_arguments():
    """The flag `allow_non_tensor_positional_args` sets is the one Keras's
    `Layer.__call__` reads: refused without it, taken with it."""

    class Takes(keras.layers.Layer):
        def call(self, x, extra):
            return x

    x, extra = keras.ops.ones((1, 3)), {"not": "a tensor"}
    with pytest.raises(ValueError, match="Only input tensors may be passed"):
        Takes()(x, extra)
    layer = Takes()
    _keras_private.allow_non_tensor_positional_args(layer)
    assert layer(x, extra) is not None


def test_no_other_module_imports_keras_src():
    """`_keras_private` is the one place private Keras API is imported."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_keras_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("keras.src")]
            if isinstance(node, ast.Attribute) and node.attr in KERAS_PRIVATE_ATTRIBUTES:
                offenders.append(f"{path.name}: .{node.attr}")
    assert offenders == []


def test_our_private_attributes_do_not_shadow_keras_ones():
    """`_built_shapes` (the shapes `build` saw, read by interop.py) is ours, not
    Keras's (whose private record is `_build_shapes_dict`): a Keras that started
    using the name would collide with it."""
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    assert not hasattr(layer, "_built_shapes")
    assert not hasattr(keras.layers.Layer, "_built_shapes")


@pytest.mark.once
def test_tensorflow_says_when_it_traces_for_xla():
    """A TensorFlow process (any backend's run would import it anyway) tells a graph
    XLA compiles from a plain graph and from eager execution."""
    script = (
        "import tensorflow as tf\n"
        "from keras_mha import _keras_private as p\n"
        "seen = []\n"
        "def f(x):\n"
        "    seen.append(p.tensorflow_xla_tracing())\n"
        "    return x\n"
        "tf.function(f, jit_compile=True)(tf.ones(1))\n"
        "tf.function(f)(tf.ones(1))\n"
        "f(tf.ones(1))\n"
        "print(seen)\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "[True, False, False]"
