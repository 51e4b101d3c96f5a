"""A `.keras` file saved under each of tensorflow, jax and torch, used under each of
them: the 3 x 3 matrix, run once (`once`) in one process per backend
(`tests/cross_backend.py save-then-check`): each saves, then checks every backend's
files once all three have saved.

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


def _start(backend, folder):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS)])
    env["PYTHONWARNINGS"] = "ignore"
    log = open(folder.with_suffix(".log"), "w+")  # not a pipe: it could fill unread
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "save-then-check", str(folder)],
        cwd=TESTS.parent,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    return process, log


def _finish(started, what, stdin=None):
    process, log = started
    out, _ = process.communicate(stdin, timeout=900)
    log.seek(0)
    assert process.returncode == 0, f"{what} failed:\n{log.read()[-3000:]}"
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each backend's process saves into its folder and prints `SAVED`; once all three
    have, each is given the three folders to check."""
    root = tmp_path_factory.mktemp("cross_backend")
    folders = [root / b for b in BACKENDS]
    started = {b: _start(b, folder) for b, folder in zip(BACKENDS, folders)}
    for backend, (process, _) in started.items():
        if process.stdout.readline().strip() != "SAVED":
            _finish(started[backend], f"saving under {backend}")
            pytest.fail(f"saving under {backend} ended without SAVED")
    results = {}
    for backend, begun in started.items():
        out = _finish(begun, f"checking under {backend}", json.dumps(list(map(str, folders))))
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
    assert builtin["passed"] is True, builtin
    assert builtin["max_abs_diff"] <= 1e-4 and builtin["grad_max_abs_diff"] <= 1e-4, builtin
    assert builtin["input_cases"] == ["padded", "unpadded"]
    assert builtin["swapped_classes"] == [True, True]
