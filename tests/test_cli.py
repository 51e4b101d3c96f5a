"""`keras-mha compare` end to end, on the current backend, in --quick mode."""

import json
import os
import subprocess
import sys

import keras
import pytest

from keras_mha import cli, compare

BACKEND = keras.backend.backend()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_compare_writes_table_json_and_png(tmp_path):
    json_path, png_path = tmp_path / "compare.json", tmp_path / "compare.png"
    command = [sys.executable, "-m", "keras_mha", "compare", "--backend", BACKEND]
    command += ["--quick", "--cases", "seq6_scores", "--repeats", "1"]
    command += ["--json", str(json_path), "--plot", str(png_path)]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{BACKEND}: PASS" in done.stdout
    assert "seq6_scores" in done.stdout

    records = json.loads(json_path.read_text())
    assert [r["case"] for r in records] == ["seq6_scores"]
    for record in records:
        assert set(compare.RECORD_KEYS) <= set(record)
        assert record["backend"] == BACKEND
        assert record["quick"] is True
        assert record["passed"] is True
        assert record["builtin_error"] is None
        assert 0 <= record["max_abs_diff"] <= 1e-4
        assert 0 <= record["scores_max_abs_diff"] <= 1e-4
        assert record["query_shape"] == [10, 6, 8] and record["value_shape"] is None
        for key in ("ours_predict_ms", "builtin_predict_ms", "ours_train_ms", "builtin_train_ms"):
            assert record[key] > 0

    png = png_path.read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 1000


def test_planted_mismatch_exits_non_zero(tmp_path, capsys):
    json_path = tmp_path / "mismatch.json"
    status = cli.main(
        ["compare", "--backend", BACKEND, "--quick", "--cases", "seq6_scores"]
        + ["--repeats", "1", "--perturb", "1e-2", "--json", str(json_path)]
    )
    assert status == 1
    assert f"{BACKEND}: FAIL" in capsys.readouterr().out
    (record,) = json.loads(json_path.read_text())
    assert record["passed"] is False
    assert record["max_abs_diff"] > 1e-4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--cases", "nope"], "argument `cases`"),
        (["compare", "--repeats", "0"], "argument `--repeats`"),
        (["compare", "--backend", "numpy"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_and_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_marks_builtin_failures(tmp_path):
    records = [
        {"backend": BACKEND, "case": "a", "predict_ratio": 0.9, "train_ratio": 1.1},
        {"backend": BACKEND, "case": "b", "predict_ratio": None, "train_ratio": None},
    ]
    path = tmp_path / "ratios.png"
    cli.plot_ratios(records, str(path))
    assert path.read_bytes()[:8] == PNG_SIGNATURE
