"""Trains ours and the built-in under `tf.distribute.MirroredStrategy` on 2 logical CPUs.

The CPU is split into 2 logical devices before TensorFlow initialises anything; each
model is built and compiled in `strategy.scope()` from the same starting weights and
trained with `model.fit` on the same batches (each split over the 2 replicas), then
once more without the strategy. Prints one JSON object (`distribution_parity.compare`
plus what the strategy saw); `tests/test_distribution.py` runs it in a subprocess.

    python tests/distribution_check_tensorflow.py
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import json  # noqa: E402
import sys  # noqa: E402

import tensorflow as tf  # noqa: E402

# Before anything lists or uses a device: afterwards the split is refused.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _CPU, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)

import keras  # noqa: E402
from distribution_parity import (  # noqa: E402
    LAYERS,
    compare,
    data,
    fit,
    initial_weights,
)


def train(layer_class, start, x, y, strategy):
    """`fit` (`distribution_parity.fit`) in `strategy.scope()`: `(losses, final
    weights, the class of the query kernel's variable)`."""
    with strategy.scope():
        losses, weights, model = fit(layer_class, start, x, y)
    kernel = model.get_layer("mha").query_dense.kernel
    return losses, weights, type(kernel.value).__name__


def main():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    x, y = data()
    start = initial_weights()
    runs, variable_types = {}, {}
    for name, layer_class in LAYERS.items():
        *runs[name], variable_types[name] = train(layer_class, start, x, y, strategy)
    *runs["ours_one_device"], _ = fit(LAYERS["ours"], start, x, y)
    report = {
        "backend": keras.backend.backend(),
        "devices": devices,
        "replicas": strategy.num_replicas_in_sync,
        "variable_types": variable_types,
        **compare(runs, start),
    }
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
