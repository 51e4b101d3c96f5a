"""`keras-mha compare` end to end, on the current backend, in --quick mode."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
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


def _record(**fields):
    record = dict.fromkeys(compare.RECORD_KEYS)
    record.update(backend="torch", case="c", max_abs_diff=2e-7, grad_max_abs_diff=0.0)
    record.update(passed=True, predict_ratio=0.9, train_ratio=1.1)
    record.update(predict_ratio_quartiles=[0.8, 1.0], train_ratio_quartiles=[1.0, 1.3])
    record.update(fields)
    return record


@pytest.mark.once
@pytest.mark.parametrize(
    "fields, verdict, color",
    [
        ({}, "c\nout 2e-07, grad 0\nsame", "#1a7f37"),
        ({"passed": False}, "c\nout 2e-07, grad 0\nDIFFERS", "red"),
        ({"ours_error": "boom", "passed": False}, "c\nours failed", "red"),
        (
            {"classification": ["builtin_torch_fully_masked_rows"]},
            "wrong (masks guide)",
            "darkorange",
        ),
        ({"builtin_error": "x", "max_abs_diff": None}, "built-in failed", "0.35"),
    ],
    ids=["same", "differs", "ours_failed", "known", "builtin_failed"],
)
def test_plot_labels_each_case_with_its_parity(fields, verdict, color):
    text, found = cli._parity_label(_record(**fields))
    assert verdict in text and found == color


@pytest.mark.once
def test_plot_draws_quartile_whiskers_and_keeps_labels_inside(tmp_path, monkeypatch):
    """The whiskers span the quartiles, and the built-in-failed label stays in its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    failed = _record(case="f", builtin_error="x", predict_ratio=None, train_ratio=None)
    failed.update(predict_ratio_quartiles=None, train_ratio_quartiles=None)
    # as on the jax panel that showed the overlap: every bar and whisker below 1.05
    tight = _record(predict_ratio_quartiles=[0.85, 0.95], train_ratio_quartiles=[1.0, 1.02])
    tight.update(train_ratio=1.01)
    cli.plot_ratios([tight, failed], tmp_path / "p.png")
    (figure,) = figures
    (ax,) = figure.axes
    segments = [s for c in ax.collections for s in c.get_segments()]
    whiskers = sorted(
        tuple(round(float(y), 6) for y in s[:, 1])
        for s in segments
        if s.ndim == 2 and np.all(np.isfinite(s)) and s[0, 1] != s[1, 1]
    )
    assert whiskers == [(0.85, 0.95), (1.0, 1.02)]
    figure.canvas.draw()
    frame = ax.get_window_extent()
    (label,) = [t for t in ax.texts if "built-in" in t.get_text()]
    box = label.get_window_extent()
    assert frame.y0 < box.y0 and box.y1 < frame.y1 and frame.x0 < box.x0 and box.x1 < frame.x1
