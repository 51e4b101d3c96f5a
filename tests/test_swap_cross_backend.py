"""The keras.io-style classifier saved under each of tensorflow, jax and torch, swapped
and compared under each of them: the 3 x 3 matrix, run once (marked `once`), each
backend in its own processes (`tests/swap_models.py save` / `check`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

BACKENDS = ("tensorflow", "jax", "torch")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "swap_models.py"


def _run(backend, *args):
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{SCRIPT.parent}"
    env["PYTHONWARNINGS"] = "ignore"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert done.returncode == 0, f"{backend} {args[0]} failed:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved_per_backend")
    for backend in BACKENDS:
        _run(backend, "save", folder / f"{backend}.keras")
    return {backend: str(folder / f"{backend}.keras") for backend in BACKENDS}


@pytest.mark.parametrize("target", BACKENDS)
def test_files_saved_under_every_backend_swap_and_compare_here(saved, target):
    out = _run(target, "check", *saved.values())
    line = next(line for line in out.splitlines() if line.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS ") :])
    assert sorted(results) == sorted(saved.values())
    for source, path in saved.items():
        result = results[path]
        assert result["backend"] == target, source
        assert result["passed"] is True, (source, result)
        assert result["max_abs_diff"] <= 1e-4, (source, result)
        assert result["swap_passed"] is True, (source, result)
        assert result["loaded"] == ["keras_mha.layer", "keras_mha.layer"], (source, result)
        assert result["same_class"] is True
