"""A `.keras` file saved under each of tensorflow, jax and torch, used under each of
them: the 3 x 3 matrix, run once (`once`) in 3 saving and 3 checking processes
(`tests/cross_backend.py`).

Each backend saves a model holding our layer and the keras.io-style classifier on the
built-in layer. Each backend then loads every backend's files with `safe_mode=True`
and no `custom_objects`: ours gives the saved outputs (1e-5); the classifier, swapped
to ours, gives its outputs and weight gradients (1e-4) and writes a file that loads
swapped.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

BACKENDS = ("tensorflow", "jax", "torch")
TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "cross_backend.py"


def _start(backend, *args):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS)])
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=TESTS.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process, what):
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, f"{what} failed:\n{err[-3000:]}"
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross_backend")
    processes = {b: _start(b, "save", root / b) for b in BACKENDS}
    for backend, process in processes.items():
        _finish(process, f"saving under {backend}")
    return [root / b for b in BACKENDS]


@pytest.fixture(scope="module")
def results(saved):
    processes = {b: _start(b, "check", *saved) for b in BACKENDS}
    results = {}
    for backend, process in processes.items():
        out = _finish(process, f"checking under {backend}")
        line = next(line for line in out.splitlines() if line.startswith("RESULTS "))
        results[backend] = json.loads(line[len("RESULTS ") :])
    return results


@pytest.mark.parametrize("target", BACKENDS)
@pytest.mark.parametrize("source", BACKENDS)
def test_our_layer_saved_under_source_loads_under_target_with_same_outputs(results, source, target):
    result = results[target][source]
    assert result["backend"] == target
    ours = result["ours"]
    assert ours["classes"] == ["keras_mha.layer.MultiHeadAttention"]
    assert ours["shapes"] == [[2, 5, 2, 4], [2, 2, 5, 3]]
    assert ours["max_abs_diff"] <= 1e-5, ours


@pytest.mark.parametrize("target", BACKENDS)
@pytest.mark.parametrize("source", BACKENDS)
def test_builtin_model_saved_under_source_swaps_and_compares_under_target(results, source, target):
    builtin = results[target][source]["builtin"]
    assert builtin["passed"] is True and builtin["swap_passed"] is True, builtin
    assert builtin["max_abs_diff"] <= 1e-4 and builtin["grad_max_abs_diff"] <= 1e-4, builtin
    assert builtin["swapped_classes"] == [True, True]
