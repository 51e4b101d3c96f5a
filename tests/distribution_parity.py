"""The one small training problem every engine check runs, ours against the built-in.

`distribution_check.py` (JAX, `keras.distribution`), `distribution_check_tensorflow.py`
(`tf.distribute.MirroredStrategy`) and `distribution_check_torch.py` (torch
`DistributedDataParallel`) each train `model(keras_mha.MultiHeadAttention)` and
`model(keras.layers.MultiHeadAttention)` from the same starting weights on the same
batches, distributed, and report what this module measures. The engine scripts set
`KERAS_BACKEND` before they import it.
"""

import keras
import numpy as np

import keras_mha

# Tiny on purpose: 2 heads of size 4 over dim 8, STEPS batches of BATCH sequences.
DIM, NUM_HEADS, KEY_DIM, LENGTH = 8, 2, 4, 5
BATCH, STEPS = 8, 4
LEARNING_RATE = 0.5
LAYERS = {"ours": keras_mha.MultiHeadAttention, "builtin": keras.layers.MultiHeadAttention}


def data():
    """`(x, y)`, both `(STEPS * BATCH, LENGTH, DIM)` float32: the batches in order."""
    rng = np.random.default_rng(0)
    shape = (STEPS * BATCH, LENGTH, DIM)
    return rng.normal(size=shape).astype("float32"), rng.normal(size=shape).astype("float32")


def build_model(layer_class):
    """`(B, LENGTH, DIM)` -> causal self-attention (`layer_class`) -> `(B, LENGTH, DIM)`.

    Not compiled: each engine trains it its own way.
    """
    inputs = keras.Input((LENGTH, DIM))
    layer = layer_class(num_heads=NUM_HEADS, key_dim=KEY_DIM, name="mha")
    outputs = layer(inputs, inputs, use_causal_mask=True)
    return keras.Model(inputs, outputs)


def initial_weights():
    """The starting weights of both models (ours has the built-in's weights, in the same
    order), drawn by NumPy: the same on every engine and in every process, and without
    `keras.utils.set_random_seed`, which imports TensorFlow where it is installed."""
    rng = np.random.default_rng(1)
    shapes = [w.shape for w in build_model(keras.layers.MultiHeadAttention).weights]
    return [rng.normal(scale=0.3, size=shape).astype("float32") for shape in shapes]


class _Losses(keras.callbacks.Callback):
    """The loss `fit` logs after each step (its running mean over the epoch)."""

    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def fit(layer_class, start, x, y):
    """Builds `build_model(layer_class)` with the weights `start`, compiles it (SGD,
    MSE) and trains it one `fit` epoch on `x`, `y` in batches of BATCH, in order.
    Call it inside a distribution's scope to build, compile and train under it.

    Returns:
        `(losses, final weights, model)`: the losses as `fit` logs them after each step.
    """
    model = build_model(layer_class)
    model.set_weights(start)
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse")
    losses = _Losses()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[losses])
    return losses.losses, model.get_weights(), model


def max_diff(a, b):
    """Largest absolute difference between two lists of arrays."""
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def compare(runs, start):
    """What the engine checks report: per run its losses, and how its final weights
    differ from the start (that training moved them) and from the other runs'.

    Args:
        runs: `{name: (losses, final weights)}`, e.g. "ours", "builtin", and
            "ours_one_device" (the same training on one device, no engine).
        start: the starting weights.

    Returns:
        A JSON-able dict: `losses` (`{name: [float per step]}`), `moved`
        (`{name: max |final - start|}`) and `weights_max_abs_diff`
        (`{"a-b": max |final_a - final_b|}` for each pair, names sorted).
    """
    names = sorted(runs)
    return {
        "losses": {name: [float(v) for v in runs[name][0]] for name in names},
        "moved": {name: max_diff(runs[name][1], start) for name in names},
        "weights_max_abs_diff": {
            f"{a}-{b}": max_diff(runs[a][1], runs[b][1])
            for i, a in enumerate(names)
            for b in names[i + 1 :]
        },
    }
