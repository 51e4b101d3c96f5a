"""What every comparison records: the backends, the float32 tolerances, the record's
keys, and the measurements both engines share (largest differences, alternated timing,
an error in one line).

The tolerances are those the package's docstring states (`keras_mha.compare`).
"""

import re
import statistics
import time

import numpy as np

BACKENDS = ("tensorflow", "jax", "torch")
ATOL = 1e-4
DEFAULT_REPEATS = 7
QUICK_REPEATS = 21
WARMUP = 2

RECORD_KEYS = (
    "backend",
    "case",
    "description",
    "query_shape",
    "value_shape",
    "quick",
    "max_abs_diff",
    "scores_max_abs_diff",
    "grad_max_abs_diff",
    "grad_scale",
    "ours_predict_ms",
    "builtin_predict_ms",
    "predict_ratio",
    "ours_train_ms",
    "builtin_train_ms",
    "train_ratio",
    "ours_predict_quartiles",
    "builtin_predict_quartiles",
    "predict_ratio_quartiles",
    "ours_train_quartiles",
    "builtin_train_quartiles",
    "train_ratio_quartiles",
    "ours_peak_mib",
    "builtin_peak_mib",
    "peak_ratio",
    "builtin_error",
    "ours_error",
    "tolerance",
    "passed",
    "classification",
)


def installed_backends():
    """The backends of `BACKENDS` whose framework can be imported here."""
    import importlib.util

    return tuple(name for name in BACKENDS if importlib.util.find_spec(name) is not None)


def within_tolerance(record):
    """Whether a record's measured differences are within the float32 tolerances.

    Unmeasured differences (`None`, e.g. when the built-in failed) do not fail it.
    """
    atol = record.get("tolerance") or ATOL
    checks = [
        (record.get("max_abs_diff"), atol),
        (record.get("scores_max_abs_diff"), atol),
        (record.get("grad_max_abs_diff"), atol * max(1.0, record.get("grad_scale") or 0.0)),
    ]
    return all(diff is None or diff <= bound for diff, bound in checks)


def summary(records):
    """Per backend: `{"cases", "passed", "failed", "builtin_failed", "passed_all"}`."""
    result = {}
    for record in records:
        entry = result.setdefault(
            record["backend"], {"cases": 0, "passed": 0, "failed": 0, "builtin_failed": 0}
        )
        entry["cases"] += 1
        entry["passed" if record["passed"] else "failed"] += 1
        entry["builtin_failed"] += record.get("builtin_error") is not None
    for entry in result.values():
        entry["passed_all"] = entry["failed"] == 0
    return result


def failed_input_cases(record):
    """Names of the input cases ("unpadded", "padded", "given") whose results differ."""
    cases = record.get("input_cases") or {}
    return [name for name, case in cases.items() if not case.get("passed")]


def _time_steps(record, models, steps, repeats):
    """For each step, the median ms of `step(model)` for each of `models` ("ours" and
    maybe "builtin"), in alternated rounds after a warm-up; sets the record's times and
    ratios, and their spread: `{side}_{step}_quartiles`, the first and third quartiles
    of each side's times, and `{step}_ratio_quartiles`, those of the rounds' ratios
    (ours / built-in within one round). A built-in that fails is recorded and dropped;
    ours failing raises."""
    models = dict(models)
    for step_name, step in steps.items():
        times = {name: [] for name in models}
        for name, built in list(models.items()):
            try:
                for _ in range(WARMUP):
                    step(built)
            except Exception as error:
                if name == "ours":
                    raise
                record["builtin_error"] = record["builtin_error"] or _error_text(error)
                del models[name]
        for i in range(repeats):
            # Every other round in reverse order: the second call of a pair can be
            # the slower one, and a fixed order would always charge the same side.
            order = list(models.items())
            for name, built in order[::-1] if i % 2 else order:
                start = time.perf_counter()
                step(built)
                times[name].append((time.perf_counter() - start) * 1e3)
        for name in ("ours", "builtin"):
            if times.get(name):
                record[f"{name}_{step_name}_ms"] = statistics.median(times[name])
                record[f"{name}_{step_name}_quartiles"] = _quartiles(times[name])
        if times.get("ours") and times.get("builtin"):
            rounds = [a / b for a, b in zip(times["ours"], times["builtin"])]
            record[f"{step_name}_ratio_quartiles"] = _quartiles(rounds)
        if record[f"ours_{step_name}_ms"] and record[f"builtin_{step_name}_ms"]:
            record[f"{step_name}_ratio"] = (
                record[f"ours_{step_name}_ms"] / record[f"builtin_{step_name}_ms"]
            )


def _quartiles(values):
    """`[first, third]` quartile (NumPy's linear interpolation)."""
    return [float(q) for q in np.percentile(values, [25, 75])]


def _max_abs_diff(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _error_text(error):
    """The error's type and first informative line (Keras wraps call errors)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception encountered")]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()[:300]
