"""Runs `MultiHeadAttention` under `keras.distribution` on 8 virtual CPU devices (JAX).

For each case, a single-device model and, with the same starting weights, the same
model under `DataParallel` (8 devices) and under `ModelParallel` on a `(2, 4)`
`("batch", "model")` mesh with `keras_mha.distribution.layout_map`: forward
outputs, one SGD training step (loss and updated weights) and each variable's
sharding. Then ours against `keras.layers.MultiHeadAttention`, both trained with
`model.fit` from the same starting weights on the same batches
(`distribution_parity.py`), under `DataParallel` and under `ModelParallel` with
`layout_map` on a `(4, 2)` mesh (the built-in's weights have the same paths), and ours
once more on one device. Prints one JSON object; `tests/test_distribution.py` runs it
in a subprocess and checks it, whatever that session's backend.

    python tests/distribution_check.py

The backend, the platform (CPU) and the device count are set here, before Keras or JAX
is imported.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_PLATFORMS"] = "cpu"  # the 8 virtual devices, also where a GPU is visible
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from distribution_parity import LAYERS, NUM_HEADS, compare, data, fit, initial_weights  # noqa: E402

import keras_mha  # noqa: E402
from keras_mha import distribution as mha_distribution  # noqa: E402

BATCH, LENGTH, DIM = 8, 6, 16
MESH_SHAPE, MESH_AXES = (2, 4), ("batch", "model")

# name -> (layer arguments, call arguments, distributions to run)
CASES = {
    "mha_causal": (
        dict(num_heads=4, key_dim=8),
        dict(use_causal_mask=True),
        ("data_parallel", "model_parallel"),
    ),
    "gqa_gate_qknorm": (
        dict(
            num_heads=8,
            key_dim=4,
            value_dim=6,
            num_key_value_heads=4,
            use_gate=True,
            normalize_qk=True,
        ),
        {},
        ("data_parallel", "model_parallel"),
    ),
    # Sinks sharded with their heads; soft cap and RoPE run on each device's heads.
    "modern": (
        dict(
            num_heads=8,
            key_dim=4,
            num_key_value_heads=4,
            use_sinks=True,
            logit_soft_cap=5.0,
            rope_max_wavelength=100.0,
        ),
        dict(use_causal_mask=True),
        ("model_parallel",),
    ),
    # 2 key/value heads on a 4-way model axis: key/value weights replicated.
    "gqa_replicated_kv": (
        dict(num_heads=8, key_dim=4, num_key_value_heads=2),
        {},
        ("model_parallel",),
    ),
}


def build_model(layer_kwargs, call_kwargs):
    """`(B, T, DIM)` -> self-attention -> `(B, T, DIM)`, compiled with SGD + MSE."""
    inputs = keras.Input((LENGTH, DIM), batch_size=BATCH)
    layer = keras_mha.MultiHeadAttention(**layer_kwargs, name="mha", seed=0)
    outputs = layer(inputs, inputs, **call_kwargs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.5), loss="mse")
    return model


def sharding_specs(model):
    """`{path: [mesh axis or None per dimension]}` of each variable's current value."""
    specs = {}
    for variable in model.weights:
        value = variable.value
        sharding = value.sharding
        spec = list(getattr(sharding, "spec", ()))
        spec += [None] * (len(value.shape) - len(spec))
        specs[variable.path] = spec
    return specs


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def run_case(layer_kwargs, call_kwargs, distributions, data):
    x, y = data
    reference = build_model(layer_kwargs, call_kwargs)
    weights = reference.get_weights()
    ref_output = np.asarray(reference.predict_on_batch(x))
    ref_loss = float(reference.train_on_batch(x, y))
    ref_trained = reference.get_weights()
    results = {}
    for name, distribution in distributions.items():
        with distribution.scope():
            model = build_model(layer_kwargs, call_kwargs)
            model.set_weights(weights)
            before = sharding_specs(model)
            output = np.asarray(model.predict_on_batch(x))
            loss = float(model.train_on_batch(x, y))
            results[name] = {
                "forward_max_abs_diff": float(np.max(np.abs(output - ref_output))),
                "loss": loss,
                "reference_loss": ref_loss,
                "trained_weights_max_abs_diff": max_diff(model.get_weights(), ref_trained),
                "weights_changed": max_diff(model.get_weights(), weights),
                "sharding": before,
                "sharding_after_training": sharding_specs(model),
            }
    return results


def uneven_heads_error(mesh):
    """What happens when 6 heads meet a 4-way model axis without `num_heads`."""
    distribution = keras.distribution.ModelParallel(
        layout_map=mha_distribution.layout_map(mesh), batch_dim_name="batch"
    )
    try:
        with distribution.scope():
            build_model(dict(num_heads=6, key_dim=4), {})
    except Exception as error:  # noqa: BLE001 - reporting whatever JAX raises
        return f"{type(error).__name__}: {error}"
    return None


def builtin_parity(devices):
    """Ours and the built-in trained with `fit` under each distribution, and ours on
    one device: `{distribution: distribution_parity.compare(...) + "sharding"}`, with
    each distributed model's `{path: spec}` after training."""
    mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"), devices=devices)
    distributions = {
        "data_parallel": keras.distribution.DataParallel(devices=devices),
        "model_parallel": keras.distribution.ModelParallel(
            layout_map=mha_distribution.layout_map(mesh, num_heads=NUM_HEADS),
            batch_dim_name="batch",
        ),
    }
    x, y = data()
    start = initial_weights()
    one_device = fit(LAYERS["ours"], start, x, y)[:2]
    results = {}
    for name, distribution in distributions.items():
        runs, sharding = {"ours_one_device": one_device}, {}
        for layer_name, layer_class in LAYERS.items():
            with distribution.scope():
                *runs[layer_name], model = fit(layer_class, start, x, y)
            sharding[layer_name] = sharding_specs(model)
        results[name] = {**compare(runs, start), "sharding": sharding}
    return results


def main():
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(MESH_SHAPE, MESH_AXES, devices=devices)
    rng = np.random.default_rng(0)
    data = (
        rng.normal(size=(BATCH, LENGTH, DIM)).astype("float32"),
        rng.normal(size=(BATCH, LENGTH, DIM)).astype("float32"),
    )
    report = {
        "backend": keras.backend.backend(),
        "devices": len(devices),
        "jax_devices": len(jax.devices()),
        "cases": {},
    }
    for case, (layer_kwargs, call_kwargs, names) in CASES.items():
        keras.utils.set_random_seed(0)
        candidates = {
            "data_parallel": keras.distribution.DataParallel(devices=devices),
            "model_parallel": keras.distribution.ModelParallel(
                layout_map=mha_distribution.layout_map(
                    mesh,
                    "model",
                    num_heads=layer_kwargs["num_heads"],
                    num_key_value_heads=layer_kwargs.get("num_key_value_heads"),
                ),
                batch_dim_name="batch",
            ),
        }
        distributions = {name: candidates[name] for name in names}
        report["cases"][case] = run_case(layer_kwargs, call_kwargs, distributions, data)
    report["uneven_heads_error"] = uneven_heads_error(mesh)
    report["builtin_parity"] = builtin_parity(devices)
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
