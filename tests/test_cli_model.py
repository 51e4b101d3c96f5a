"""`keras-mha swap` and `keras-mha compare --model` end to end: the command line in a
subprocess, its worker in another, on the current backend. Exit-status plumbing that
is the same on every backend is marked `once` (make test runs it in one backend's run).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest
import swap_models

import keras_mha
from keras_mha import cli

BACKEND = keras.backend.backend()
ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(*args, cwd=ROOT):
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    env.pop("KERAS_BACKEND", None)  # the command line picks and sets it per child
    command = [sys.executable, "-m", "keras_mha", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_models")
    paths = {"classifier": folder / "classifier.keras", "plain": folder / "plain.keras"}
    swap_models.build_classifier().save(paths["classifier"])
    swap_models.build_plain().save(paths["plain"])
    return paths


@pytest.mark.once
def test_worker_usage_errors_exit_2_with_one_line_and_nothing_written(saved, tmp_path):
    out, json_path = tmp_path / "out.keras", tmp_path / "r.json"
    done = _run("swap", saved["plain"], out, "--backend", BACKEND)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"keras-mha swap: error: {saved['plain']}: no keras.layers.MultiHeadAttention to "
        "swap (no attention layer)"
    ]
    assert not out.exists()

    done = _run(
        "compare", "--model", saved["classifier"], "--backend", BACKEND, "--json", json_path
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"keras-mha compare: error: {saved['classifier']}: cannot load")
    assert "'TransformerBlock' is not registered" in line and "--import" in line
    assert not json_path.exists()


@pytest.mark.once
def test_planted_mismatch_exits_1(saved, tmp_path):
    out = tmp_path / "out.keras"
    args = ("--import", "swap_models", "--backend", BACKEND, "--perturb", "0.05")
    done = _run("swap", saved["classifier"], out, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL" in done.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["swap", "nope.keras", "out.keras"], "keras-mha swap: error: nope.keras: no such file"),
        (
            ["compare", "--model", "nope.keras"],
            "keras-mha compare: error: nope.keras: no such file",
        ),
        (
            ["compare", "--model", __file__, "--inputs", "none.npz"],
            "keras-mha compare: error: none.npz: no such file",
        ),
        (
            ["compare", "--model", __file__, "--json", "/no/such/dir/r.json"],
            "keras-mha compare: error: /no/such/dir/r.json: no such folder",
        ),
    ],
    ids=["swap_missing", "model_missing", "inputs_missing", "json_folder"],
)
def test_usage_errors_found_before_any_worker(argv, message, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--model", "m.keras", "--cases", "causal"], "--cases and --quick go with"),
        (["compare", "--import", "x"], "--import, --inputs and --no-memory go with --model"),
        (["swap", "in.keras"], "the following arguments are required: OUT.keras"),
    ],
)
def test_argument_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def residual(tmp_path_factory):
    """keras.io's classifier with `x + attention(x, x, use_causal_mask=True)`, saved
    under tensorflow where it is installed (as the issue's user did): a registered
    `TransformerBlock` holding the built-in, a top-level built-in, and padded query rows
    that reach the pooling (on torch the built-in's gradients through them are wrong)."""
    path = tmp_path_factory.mktemp("residual") / "user.keras"
    code = f"import swap_models; swap_models.build_residual_classifier().save({str(path)!r})"
    backend = "tensorflow" if importlib.util.find_spec("tensorflow") else BACKEND
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
    return path


# One run of each command on this backend, read by the tests below.
@pytest.fixture(scope="module")
def swapped(residual, tmp_path_factory):
    out = tmp_path_factory.mktemp("swapped") / "out.keras"
    done = _run("swap", residual, out, "--import", "swap_models", "--backend", BACKEND)
    return done, out


@pytest.fixture(scope="module")
def compared(residual, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compared")
    json_path, png_path = folder / "model.json", folder / "model.png"
    args = ("--import", "swap_models", "--backend", BACKEND, "--repeats", "1")
    done = _run("compare", "--model", residual, *args, "--json", json_path, "--plot", png_path)
    return done, json_path, png_path


def test_swap_command_writes_a_file_that_loads_swapped(swapped):
    done, out = swapped
    assert done.returncode == 0, done.stdout + done.stderr
    for text in ("block/att", "causal_attention", "keras_mha.MultiHeadAttention", "PASS"):
        assert text in done.stdout
    assert "num_heads=2, key_dim=16" in done.stdout
    assert f"on tokens (2, 8) ({BACKEND})" in done.stdout

    loaded = keras.saving.load_model(out, safe_mode=True)
    assert type(loaded.get_layer("block").att) is keras_mha.MultiHeadAttention
    assert type(loaded.get_layer("causal_attention")) is keras_mha.MultiHeadAttention


def test_swap_passes_the_builtins_known_torch_difference_in_one_line(swapped):
    done, out = swapped
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout and out.exists()
    lines = [line for line in done.stdout.splitlines() if "KNOWN" in line]
    if BACKEND != "torch":
        assert lines == [] and "PASS: padded inputs" in done.stdout
        return
    (line,) = lines
    assert line.startswith("KNOWN: padded inputs: the weight gradients differ only where")
    assert "docs/guide/masks.md#rows-with-no-key-to-attend-to" in line
    assert "ours matches the model as it is on" in line
    assert "PASS: unpadded inputs" in done.stdout and "PASS: padded" not in done.stdout


def test_compare_model_writes_table_json_and_png(compared):
    done, json_path, png_path = compared
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{BACKEND}: PASS" in done.stdout and "block/att" in done.stdout
    (record,) = json.loads(json_path.read_text())
    assert record["backend"] == BACKEND and record["case"] == "residual_classifier"
    assert record["passed"] is True and record["max_abs_diff"] <= 1e-4
    for key in ("ours_predict_ms", "builtin_predict_ms", "ours_train_ms", "builtin_train_ms"):
        assert record[key] > 0
    assert record["ours_peak_mib"] > 10 and record["builtin_peak_mib"] > 10
    assert record["peak_ratio"] == pytest.approx(
        record["ours_peak_mib"] / record["builtin_peak_mib"]
    )
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE


def test_compare_model_passes_padded_inputs_reaching_the_output(compared):
    """Padded query rows reach the output: the swap gives them what the built-in gives
    them (`fully_masked_rows`); on torch the built-in's backward differs there (masks
    guide), a known difference that passes, named in one line."""
    done, json_path, _ = compared
    assert done.returncode == 0, done.stdout + done.stderr
    assert "padded" in done.stdout and "FAIL" not in done.stdout
    assert ("docs/guide/masks.md#rows-with-no-key-to-attend-to" in done.stdout) is (
        BACKEND == "torch"
    )
    (record,) = json.loads(json_path.read_text())
    expected = ["builtin_torch_fully_masked_rows"] if BACKEND == "torch" else None
    assert record["classification"] == expected


@pytest.mark.skipif(BACKEND != "torch", reason="the known difference is torch's")
def test_perturbed_swap_beside_the_known_difference_still_exits_1(residual, tmp_path):
    args = ("--import", "swap_models", "--backend", BACKEND, "--perturb", "0.05")
    done = _run("swap", residual, tmp_path / "out.keras", *args)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL: padded inputs" in done.stdout and "KNOWN" not in done.stdout


@pytest.mark.once
@pytest.mark.parametrize(
    ("backend", "preset", "shared"),
    [("jax", None, True), ("jax", "/tmp/yours", False), ("torch", None, False)],
)
def test_model_comparison_processes_share_a_jax_compilation_cache(
    monkeypatch, backend, preset, shared
):
    """`compare --model` runs three processes per backend (the comparison, then each
    model's memory): on JAX they share a compilation cache of the run's own, which
    exists while they run and is gone after; a cache the caller set is left alone."""
    from keras_mha import compare

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    if preset:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", preset)
    seen = []

    def spawn(backend, spec, on_record=None, env=None):
        env = env or {}
        cache = env.get("JAX_COMPILATION_CACHE_DIR")
        seen.append((spec["job"], cache, cache is not None and os.path.isdir(cache)))
        if spec["job"] == "memory":
            return [{"peak_mib": 100.0}], 0, []
        record = dict.fromkeys(compare.RECORD_KEYS)
        record.update(backend=backend, ours_error=None, passed=True)
        return [record], 0, []

    monkeypatch.setattr(compare.workers, "_spawn", spawn)
    (record,) = compare.run_model_backend(backend, "model.keras")
    assert record["peak_ratio"] == 1.0
    assert [job for job, _, _ in seen] == ["model", "memory", "memory"]
    caches = {cache for _, cache, _ in seen}
    assert len(caches) == 1
    (cache,) = caches
    if shared:
        assert all(exists for _, _, exists in seen)
        assert not os.path.exists(cache)  # removed with the run
    else:
        assert cache is None  # the children inherit the caller's environment as it is
