"""Head-parallel sharding (`keras_mha.distribution.layout_map`, issue 10) and training
distributed by each engine, ours against the built-in (issue 29).

Each engine runs in a subprocess of its own, whatever this session's backend, so those
tests run once (`once`) and cover the three backends between them:

- JAX, `keras.distribution` on 8 virtual CPU devices (`tests/distribution_check.py`:
  JAX must see `XLA_FLAGS=--xla_force_host_platform_device_count=8` before it is
  imported): sharded against one device, and ours against the built-in under
  `DataParallel` and `ModelParallel`;
- TensorFlow, `tf.distribute.MirroredStrategy` over 2 logical CPUs
  (`tests/distribution_check_tensorflow.py`: the CPU is split before TensorFlow starts);
- torch, `DistributedDataParallel` over 2 gloo processes on 127.0.0.1
  (`tests/distribution_check_torch.py`).

The last two and the built-in comparison train the one problem of
`tests/distribution_parity.py`. The `LayoutMap` itself is pure Python and is checked in
process on every backend, as is what a distribution scope does on this session's backend.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from distribution_parity import STEPS

from keras_mha import MultiHeadAttention
from keras_mha import distribution as mha_distribution

BACKEND = keras.backend.backend()
CHECKS = Path(__file__).parent
TOLERANCE = 1e-5
# Generous: a check takes well under a minute alone, but `make test` runs others beside it.
CHECK_TIMEOUT = 600

# Expected layouts on the (2, 4) ("batch", "model") mesh, written out per weight.
SHARDED = {
    "query/kernel": [None, "model", None],
    "query/bias": ["model", None],
    "key/kernel": [None, "model", None],
    "key/bias": ["model", None],
    "value/kernel": [None, "model", None],
    "value/bias": ["model", None],
    "gate/kernel": [None, "model", None],
    "gate/bias": ["model", None],
    "attention_output/kernel": ["model", None, None],
    "attention_output/bias": [None],
    "query_norm/scale": [None],
    "key_norm/scale": [None],
    "sinks/sinks": ["model"],
}
REPLICATED_KV = {
    **SHARDED,
    "key/kernel": [None, None, None],
    "key/bias": [None, None],
    "value/kernel": [None, None, None],
    "value/bias": [None, None],
}
# (case, distribution) -> expected layout per weight; None: every weight replicated.
RUNS = {
    ("mha_causal", "data_parallel"): None,
    ("mha_causal", "model_parallel"): SHARDED,
    ("gqa_gate_qknorm", "data_parallel"): None,
    ("gqa_gate_qknorm", "model_parallel"): SHARDED,
    ("gqa_replicated_kv", "model_parallel"): REPLICATED_KV,
    ("modern", "model_parallel"): SHARDED,
}
WEIGHTS_PER_CASE = {"mha_causal": 8, "gqa_gate_qknorm": 12, "gqa_replicated_kv": 8, "modern": 9}


def _mesh(shape=(2, 4), axis_names=("batch", "model")):
    # Device names given explicitly: torch's `list_devices` is not implemented.
    devices = [f"cpu:{i}" for i in range(int(np.prod(shape)))]
    return keras.distribution.DeviceMesh(shape, axis_names, devices=devices)


# ------------------------------------------------------------ engine subprocesses
def run_check(script, backend):
    """Runs `tests/<script>` under `backend`; returns the JSON object it prints last.

    The check runs in a session of its own, so on a timeout every process it started
    (torch's ranks too) is killed with it.
    """
    env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONHASHSEED": "0"}
    process = subprocess.Popen(
        [sys.executable, str(CHECKS / script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{script} ran past {CHECK_TIMEOUT} s")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


def assert_trained_alike(run):
    """`run` (`distribution_parity.compare`): ours, the built-in and ours on one device
    took the same steps, and training really moved the weights."""
    assert set(run["losses"]) == {"ours", "builtin", "ours_one_device"}
    for name, losses in run["losses"].items():
        assert len(losses) == STEPS, name
        np.testing.assert_allclose(losses, run["losses"]["builtin"], rtol=0, atol=TOLERANCE)
    for pair, diff in run["weights_max_abs_diff"].items():
        assert diff <= TOLERANCE, pair
    for name, moved in run["moved"].items():
        assert moved > 1e-2, name


# ----------------------------------------------------- JAX, 8 devices, subprocess
@pytest.fixture(scope="module")
def report():
    # The script adds the 8 devices to `XLA_FLAGS` (keeping `make test`'s own flags).
    return run_check("distribution_check.py", "jax")


@pytest.mark.once
def test_subprocess_sees_eight_jax_devices(report):
    assert report["backend"] == "jax"
    assert report["devices"] == 8
    assert report["jax_devices"] == 8
    assert {(c, d) for c, runs in report["cases"].items() for d in runs} == set(RUNS)


@pytest.mark.once
@pytest.mark.parametrize("case,dist", sorted(RUNS), ids=["-".join(k) for k in sorted(RUNS)])
def test_outputs_match_single_device(report, case, dist):
    assert report["cases"][case][dist]["forward_max_abs_diff"] <= TOLERANCE


@pytest.mark.once
@pytest.mark.parametrize("case,dist", sorted(RUNS), ids=["-".join(k) for k in sorted(RUNS)])
def test_training_step_matches_single_device(report, case, dist):
    run = report["cases"][case][dist]
    assert abs(run["loss"] - run["reference_loss"]) <= TOLERANCE
    assert run["trained_weights_max_abs_diff"] <= TOLERANCE
    # The step really moved the weights, so matching them means something.
    assert run["weights_changed"] > 1e-3


@pytest.mark.once
@pytest.mark.parametrize("case,dist", sorted(RUNS), ids=["-".join(k) for k in sorted(RUNS)])
def test_variables_are_sharded_as_intended(report, case, dist):
    run = report["cases"][case][dist]
    expected = RUNS[(case, dist)]
    for key in ("sharding", "sharding_after_training"):
        specs = run[key]
        assert len(specs) == WEIGHTS_PER_CASE[case]
        for path, spec in specs.items():
            weight = path.split("/", 1)[1]
            want = [None] * len(spec) if expected is None else expected[weight]
            assert spec == want, (key, path)


@pytest.mark.once
def test_uneven_heads_without_num_heads_fail_when_variables_are_created(report):
    # 6 heads over a 4-way model axis: JAX refuses the split, naming the shape.
    error = report["uneven_heads_error"]
    assert error is not None
    assert "divide" in error and "(16, 6, 4)" in error


@pytest.mark.once
@pytest.mark.parametrize("dist", ["data_parallel", "model_parallel"])
def test_keras_distribution_trains_ours_as_the_builtin(report, dist):
    run = report["builtin_parity"][dist]
    assert_trained_alike(run)
    # The built-in's weights have our paths: the map shards both alike.
    assert run["sharding"]["builtin"] == run["sharding"]["ours"]
    for path, spec in run["sharding"]["ours"].items():
        weight = path.split("/", 1)[1]
        want = [None] * len(spec) if dist == "data_parallel" else SHARDED[weight]
        assert spec == want, path


# --------------------------------- TensorFlow, MirroredStrategy on 2 CPUs, subprocess
@pytest.mark.once
def test_mirrored_strategy_trains_ours_as_the_builtin():
    run = run_check("distribution_check_tensorflow.py", "tensorflow")
    assert run["backend"] == "tensorflow"
    assert len(run["devices"]) == 2
    assert run["replicas"] == 2
    # Built in the strategy's scope: each variable is mirrored on both devices.
    assert run["variable_types"] == {"ours": "MirroredVariable", "builtin": "MirroredVariable"}
    assert_trained_alike(run)


# ------------------------------------- torch, DistributedDataParallel, 2 processes
@pytest.mark.once
def test_distributed_data_parallel_trains_ours_as_the_builtin():
    run = run_check("distribution_check_torch.py", "torch")
    assert run["backend"] == "torch"
    assert run["world_size"] == 2
    assert run["ranks"] == [0, 1]
    # Each rank saw half of every batch; the averaged gradients kept them equal, and
    # equal to one process training on the whole batches (`ours_one_device`).
    for name, diff in run["ranks_max_abs_diff"].items():
        assert diff <= TOLERANCE, name
    assert_trained_alike(run)


# ------------------------------------------------- the LayoutMap, every backend
def test_layout_map_is_a_layout_map_with_head_sharding():
    mesh = _mesh()
    layouts = mha_distribution.layout_map(mesh)
    assert isinstance(layouts, keras.distribution.LayoutMap)
    assert layouts.device_mesh is mesh
    for weight, spec in SHARDED.items():
        layout = layouts[f"mha/{weight}"]
        assert layout is not None, weight
        assert layout.device_mesh is mesh
        got = list(layout.axes) + [None] * (len(spec) - len(layout.axes))
        assert got == spec, weight


def test_layout_map_matches_the_layers_variable_paths(rng):
    layer = MultiHeadAttention(
        num_heads=4, key_dim=2, num_key_value_heads=2, use_gate=True, normalize_qk=True
    )
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    inputs = keras.Input((3, 8))
    outer = keras.Model(inputs, layer(inputs, inputs), name="outer")
    outer(x)
    layouts = mha_distribution.layout_map(_mesh(), num_heads=4, num_key_value_heads=2)
    paths = [v.path for v in outer.weights]
    assert len(paths) == 12
    for path in paths:
        layout = layouts[path]  # raises when a path matches two keys
        weight = "/".join(path.split("/")[-2:])
        want = REPLICATED_KV[weight]
        assert list(layout.axes) + [None] * (len(want) - len(layout.axes)) == want, path


def test_layout_map_leaves_other_layers_alone():
    layouts = mha_distribution.layout_map(_mesh())
    for path in ("dense/kernel", "my_query/kernel", "query_proj/kernel", "ffn/bias"):
        assert layouts[path] is None, path
    assert layouts["encoder/block_3/mha/query/kernel"] is not None


def test_layout_map_takes_user_entries():
    layouts = mha_distribution.layout_map(_mesh())
    count = len(layouts)
    layouts[".*ffn_in/kernel"] = (None, "model")
    layouts[".*ffn_out/kernel"] = ("model", None)
    assert len(layouts) == count + 2
    assert layouts["block/ffn_in/kernel"].axes == (None, "model")
    assert layouts["block/query/kernel"].axes == (None, "model", None)


@pytest.mark.parametrize(
    "num_heads,num_key_value_heads,kv_kernel",
    [
        (8, None, [None, "model", None]),
        (8, 8, [None, "model", None]),
        (8, 4, [None, "model", None]),
        (8, 2, [None, None, None]),
        (8, 1, [None, None, None]),
    ],
)
def test_grouped_query_key_value_rule(num_heads, num_key_value_heads, kv_kernel):
    layouts = mha_distribution.layout_map(
        _mesh(), num_heads=num_heads, num_key_value_heads=num_key_value_heads
    )
    assert list(layouts["mha/query/kernel"].axes) == [None, "model", None]
    for name in ("key", "value"):
        assert list(layouts[f"mha/{name}/kernel"].axes) == kv_kernel
        assert list(layouts[f"mha/{name}/bias"].axes) == kv_kernel[1:]


def test_other_model_axis_name_and_size():
    layouts = mha_distribution.layout_map(
        _mesh((1, 8), ("data", "heads")), model_axis="heads", num_heads=16
    )
    assert layouts["mha/query/kernel"].axes == (None, "heads", None)
    assert layouts["mha/attention_output/kernel"].axes == ("heads",)


@pytest.mark.parametrize(
    "kwargs,argument,expected",
    [
        (dict(num_heads=6), "num_heads", "a multiple of the size 4 of mesh axis 'model'"),
        (dict(num_heads=0), "num_heads", "a positive integer"),
        (dict(num_key_value_heads=-1), "num_key_value_heads", "a positive integer"),
        (dict(model_axis="heads"), "model_axis", "one of the mesh's axis names"),
        (dict(device_mesh=(2, 4)), "device_mesh", "a `keras.distribution.DeviceMesh`"),
    ],
)
def test_bad_arguments_are_named(kwargs, argument, expected):
    kwargs = {"device_mesh": _mesh(), **kwargs}
    with pytest.raises(ValueError, match=f"argument `{argument}`") as info:
        mha_distribution.layout_map(**kwargs)
    assert expected in str(info.value)
    assert f"Received: {argument}=" in str(info.value)


# ------------------------------------- what a distribution scope does on this backend
def test_model_parallel_scope_on_this_backend(rng):
    """JAX gives the variables a sharding; tensorflow and torch ignore the scope."""
    mesh = _mesh((1, 1))
    distribution = keras.distribution.ModelParallel(
        layout_map=mha_distribution.layout_map(mesh, num_heads=4), batch_dim_name="batch"
    )
    x = rng.normal(size=(2, 3, 8)).astype("float32")
    plain = MultiHeadAttention(num_heads=4, key_dim=2)
    expected = keras.ops.convert_to_numpy(plain(x, x))
    with distribution.scope():
        layer = MultiHeadAttention(num_heads=4, key_dim=2)
        layer.build(x.shape, x.shape)
        layer.set_weights(plain.get_weights())
        output = keras.ops.convert_to_numpy(layer(x, x))
    np.testing.assert_allclose(output, expected, atol=1e-6)
    kernel = layer.query_dense.kernel.value
    if BACKEND == "jax":
        assert hasattr(kernel, "sharding")
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        assert isinstance(kernel, tf.Variable)
        assert not hasattr(kernel, "sharding")
    else:
        import torch

        assert isinstance(kernel, torch.nn.Parameter)
        assert not hasattr(kernel, "sharding")
