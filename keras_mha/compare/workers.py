"""The subprocess protocol: Keras picks its backend once per process, so every job (a
set of cases, a user model, its memory, a swap) runs in a child process,
`python -m keras_mha.compare SPEC` with `KERAS_BACKEND` set. The parent writes the job
as a JSON spec file; the child prints one line per record (`_RECORD_PREFIX` + JSON), or
one line with a usage error and exits with 2.
"""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import traceback

from keras_mha.compare.cases import DEFAULT_CASES, Case, compare_case
from keras_mha.compare.model import builtin_reference, compare_model, peak_memory, swap_file
from keras_mha.compare.records import (
    ATOL,
    BACKENDS,
    RECORD_KEYS,
    _error_text,
    installed_backends,
)


def run_backend(
    backend, cases=DEFAULT_CASES, quick=False, repeats=None, perturb=0.0, on_record=None
):
    """Runs `cases` on one backend in a child process and returns its records.

    Args:
        backend: One of `BACKENDS`.
        cases: `Case`s (any, not only the defaults: they travel as JSON).
        quick: Use the small shapes.
        repeats: Timed calls per model and step (`None`: the default for the mode).
        perturb: Noise on our copied weights (testing aid).
        on_record: Called with each record as soon as the child reports it.

    Returns:
        A list of records (see `RECORD_KEYS`). A child that dies is reported as one
        record per missing case with `ours_error` set and `passed=False`.
    """
    _check_backend(backend)
    cases = tuple(cases)
    spec = {
        "job": "cases",
        "cases": [case.to_dict() for case in cases],
        "quick": quick,
        "repeats": repeats,
        "perturb": perturb,
    }
    records, code, tail = _spawn(backend, spec, on_record)
    done = {record["case"] for record in records}
    for case in cases:
        if case.name in done:
            continue
        record = dict.fromkeys(RECORD_KEYS)
        why = tail[0] if tail else f"exit status {code}"
        record.update(
            backend=backend,
            case=case.name,
            description=case.description,
            quick=bool(quick),
            tolerance=ATOL,
            ours_error=f"worker process failed: {why}"[:300],
            passed=False,
        )
        records.append(record)
        if on_record is not None:
            on_record(record)
    return records


def run(backends="all", cases=DEFAULT_CASES, quick=False, repeats=None, on_record=None, **kw):
    """Runs `cases` on each backend (each in its own process); returns all records.

    Args:
        backends: "all" (every installed backend), one name, or a list of names.

    The other arguments (`cases`, `quick`, `repeats`, `on_record`, `**kw`) are those of
    `run_backend`.
    """
    if backends == "all":
        backends = installed_backends()
    elif isinstance(backends, str):
        backends = (backends,)
    records = []
    for backend in backends:
        records.extend(
            run_backend(backend, cases, quick=quick, repeats=repeats, on_record=on_record, **kw)
        )
    return records


def run_model_backend(
    backend, path, imports=(), inputs=None, repeats=None, memory=True, perturb=0.0, on_record=None
):
    """`compare_model` in a child process on `backend`, then (with `memory`) the peak
    memory of each model, each in a fresh child process; returns `[record]`.

    Raises:
        user_model.UsageError: The child found the file, a module or the inputs unusable.
    """
    _check_backend(backend)
    with _shared_compile_cache(backend) as env:
        record = _model_and_memory(backend, path, imports, inputs, repeats, memory, perturb, env)
    if on_record is not None:
        on_record(record)
    return [record]


@contextlib.contextmanager
def _shared_compile_cache(backend):
    """Environment for the child processes of one model's comparison: on JAX, a
    persistent compilation cache of their own (unless the caller set one), so the
    memory runs load the programs that the comparison compiled instead of compiling
    them again, and their peaks leave the compiler out (the Benchmarks page,
    "`keras-mha compare`")."""
    if backend != "jax" or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="keras-mha-jax-cache-") as cache:
        yield {
            "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }


def _model_and_memory(backend, path, imports, inputs, repeats, memory, perturb, env):
    job = {"path": os.path.abspath(path), "imports": list(imports), "seed": 0}
    job["inputs"] = None if inputs is None else os.path.abspath(inputs)
    records, code, tail = _spawn(
        backend, {"job": "model", **job, "repeats": repeats, "perturb": perturb}, env=env
    )
    if not records:
        record = dict.fromkeys(RECORD_KEYS)
        why = tail[0] if tail else f"exit status {code}"
        record.update(
            backend=backend,
            case=os.path.basename(path),
            tolerance=ATOL,
            ours_error=f"worker process failed: {why}"[:300],
            passed=False,
        )
        records = [record]
    record = records[0]
    if memory and record["ours_error"] is None:
        for which in ("builtin", "ours"):
            found, _, tail = _spawn(backend, {"job": "memory", "which": which, **job}, env=env)
            if found:
                record[f"{which}_peak_mib"] = found[0]["peak_mib"]
            elif which == "ours":
                record["ours_error"] = f"memory run failed: {tail[0] if tail else ''}"[:300]
                record["passed"] = False
            else:
                record["builtin_error"] = f"memory run failed: {tail[0] if tail else ''}"[:300]
        if record["ours_peak_mib"] and record["builtin_peak_mib"]:
            record["peak_ratio"] = record["ours_peak_mib"] / record["builtin_peak_mib"]
    return record


def run_swap(backend, in_path, out_path, imports=(), inputs=None, perturb=0.0):
    """`swap_file` in a child process on `backend`; returns its result dict.

    Raises:
        user_model.UsageError: The files, a module or the inputs cannot be used.
        RuntimeError: The child failed otherwise (its last line of stderr).
    """
    _check_backend(backend)
    spec = {
        "job": "swap",
        "in_path": os.path.abspath(in_path),
        "out_path": os.path.abspath(out_path),
        "imports": list(imports),
        "inputs": None if inputs is None else os.path.abspath(inputs),
        "perturb": perturb,
    }
    results, code, tail = _spawn(backend, spec)
    if not results:
        raise RuntimeError(f"the {backend} worker failed: {tail[0] if tail else code}")
    return results[0]


def run_reference(backend, path, imports, arrays, cotangents):
    """The model of a `.keras` file as it is (the built-in), on `backend` in a child
    process: its outputs and the gradients of `sum_i sum(output_i * cotangent_i)` with
    respect to its trainable weights, on `arrays` (`model.builtin_reference`). Once per
    process for the same backend, file (as it is on disk), imports, arrays and
    cotangents: `compare --model`'s and `swap`'s checks of one file share it.

    Returns:
        `{"backend", "outputs", "grads"}` (lists of NumPy arrays), or `None` where the
        child failed.
    """
    _check_backend(backend)
    key = _reference_key(backend, path, imports, arrays, cotangents)
    if _REFERENCES.get(key) is None:  # a failed child is tried again
        _REFERENCES[key] = _run_reference(backend, path, imports, arrays, cotangents)
    return _REFERENCES[key]


_REFERENCES = {}


def _reference_key(backend, path, imports, arrays, cotangents):
    import hashlib

    import numpy as np

    stat = os.stat(path)
    digest = hashlib.sha256()
    for a in [*arrays, *cotangents]:
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(a.tobytes())
    where = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    return backend, where, tuple(imports), digest.hexdigest()


def _run_reference(backend, path, imports, arrays, cotangents):
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="keras-mha-reference-") as tmp:
        given, found = os.path.join(tmp, "given.npz"), os.path.join(tmp, "found.npz")
        np.savez(
            given,
            **{f"array_{i}": np.asarray(a) for i, a in enumerate(arrays)},
            **{f"cotangent_{i}": np.asarray(c) for i, c in enumerate(cotangents)},
        )
        spec = {
            "job": "reference",
            "path": os.path.abspath(path),
            "imports": list(imports),
            "given": given,
            "found": found,
        }
        try:
            results, _, _ = _spawn(backend, spec)
        except Exception:
            return None
        if not results or not os.path.isfile(found):
            return None
        with np.load(found) as data:
            count = results[0]
            outputs = [data[f"output_{i}"] for i in range(count["outputs"])]
            grads = [data[f"grad_{i}"] for i in range(count["grads"])]
    return {"backend": backend, "outputs": outputs, "grads": grads}


def _reference_job(spec):
    """The child's side of `run_reference`: writes the arrays, returns their counts."""
    import numpy as np

    with np.load(spec["given"]) as data:
        arrays, cotangents = (
            [data[f"{kind}_{i}"] for i in range(_count(data, kind))]
            for kind in ("array", "cotangent")
        )
    found = builtin_reference(spec["path"], spec["imports"], arrays, cotangents)
    np.savez(
        spec["found"],
        **{f"output_{i}": a for i, a in enumerate(found["outputs"])},
        **{f"grad_{i}": g for i, g in enumerate(found["grads"])},
    )
    return {"outputs": len(found["outputs"]), "grads": len(found["grads"])}


def _count(data, kind):
    return sum(name.startswith(f"{kind}_") for name in data.files)


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(
            "Received an invalid value for argument `backend`, expected one of "
            f"{BACKENDS}. Received: backend={backend}"
        )


def _spawn(backend, spec, on_record=None, env=None):
    """Runs `python -m keras_mha.compare SPEC` with `KERAS_BACKEND=backend` (and `env`).

    Returns `(records, exit status, [last line of stderr])`. A usage error reported by
    the child is raised here as `user_model.UsageError`.
    """
    from keras_mha.user_model import UsageError

    with tempfile.TemporaryDirectory(prefix="keras-mha-compare-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = {
            **os.environ,
            "KERAS_BACKEND": backend,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "PYTHONWARNINGS": "ignore",
            **(env or {}),
        }
        log_path = os.path.join(tmp, "stderr.log")
        records, usage_error = [], None
        with open(log_path, "w") as log:
            child = subprocess.Popen(
                [sys.executable, "-m", "keras_mha.compare", spec_path],
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
            )
            for line in child.stdout:
                if line.startswith(_RECORD_PREFIX):
                    record = json.loads(line[len(_RECORD_PREFIX) :])
                    records.append(record)
                    if on_record is not None:
                        on_record(record)
                elif line.startswith(_USAGE_PREFIX):
                    usage_error = line[len(_USAGE_PREFIX) :].strip()
            code = child.wait()
        with open(log_path) as log:
            tail = log.read().strip().splitlines()[-1:]
    if usage_error is not None:
        raise UsageError(usage_error)
    return records, code, tail


_RECORD_PREFIX = "@@keras-mha-record "
_USAGE_PREFIX = "@@keras-mha-usage-error "


def _worker(spec_path):
    """Child process entry: runs the job of a spec file, one record per stdout line
    (a usage error: one line with its message, exit status 2)."""
    with open(spec_path) as f:
        spec = json.load(f)
    job = spec.get("job", "cases")
    if job == "cases":
        return _cases_worker(spec)
    from keras_mha.user_model import UsageError

    try:
        if job == "model":
            result = compare_model(
                spec["path"], spec["imports"], spec["inputs"], spec["repeats"], spec["perturb"]
            )
        elif job == "swap":
            result = swap_file(
                spec["in_path"],
                spec["out_path"],
                spec["imports"],
                spec["inputs"],
                perturb=spec["perturb"],
            )
        elif job == "reference":
            result = _reference_job(spec)
        else:
            peak = peak_memory(spec["path"], spec["which"], spec["imports"], spec["inputs"])
            result = {"peak_mib": peak}
    except UsageError as error:
        print(_USAGE_PREFIX + str(error).replace("\n", " "), flush=True)
        sys.exit(2)
    print(_RECORD_PREFIX + json.dumps(result), flush=True)


def _cases_worker(spec):
    cases = [Case.from_dict(data) for data in spec["cases"]]
    for case in cases:
        try:
            record = compare_case(
                case, quick=spec["quick"], repeats=spec["repeats"], perturb=spec["perturb"]
            )
        except Exception as error:
            traceback.print_exc()
            record = dict.fromkeys(RECORD_KEYS)
            record.update(case=case.name, ours_error=_error_text(error), passed=False)
            import keras

            record["backend"] = keras.backend.backend()
        print(_RECORD_PREFIX + json.dumps(record), flush=True)
