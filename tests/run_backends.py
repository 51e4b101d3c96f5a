"""Runs the pytest suite once per Keras backend, each in its own process; the tests
marked `once` (they cover every backend in subprocesses, or need none) in one run; the
inference-only backends' suite (numpy, openvino: tests/test_inference_backends.py); and
the notebooks; JAX's suite in two processes (`SPLIT`). The runs share `--jobs` worker
slots (one per core by default), longest first. Prints one summary line per run and fails
when any run fails, its backend is not installed, or it ran no test: no backend is ever
skipped silently.

    python tests/run_backends.py --backends tensorflow jax torch \
        --inference-backends numpy openvino --notebook-backend jax --jobs 2
"""

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / ".test-logs"


def _backend_importable(backend):
    module = {
        "tensorflow": "tensorflow",
        "jax": "jax",
        "torch": "torch",
        "numpy": "numpy",
        "openvino": "openvino",
    }[backend]
    probe = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True
    )
    return probe.returncode == 0, probe.stderr.strip().splitlines()[-1:]


# Every run compiles XLA's CPU fusions with its older direct emitters instead of its MLIR
# fusion emitters, which take twice as long to compile (alone: JAX's suite without its
# `SPLIT` files 475 -> 337 s; notebooks 06 and 07 51 -> 45 s and 61 -> 51 s).
# A flag of jaxlib 0.10.2 (constraints.txt): XLA aborts on an unknown flag, so a new
# jaxlib may need it changed.
FUSION_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"


# The test runs compile many small XLA programs and run each once or twice, so they
# compile the fast way (`FAST_COMPILE_FLAGS`): LLVM's optimisations off (the shapes are
# tiny: compiling is most of a JAX test's time), one LLVM module per program, not split
# for parallel code generation (the programs are small and the two runs keep both cores
# busy); and JAX's persistent cache in one folder per `make test`, which compiles a
# program that another test (or a subprocess) compiled already only once (programs that
# compile in under 0.1 s, most eager ops, are not worth the writing). It locks its files
# (a size limit turns the locking on): processes share it safely.
# The notebooks get a cache alone, for every program, in a folder of their own with no
# size limit (so no eviction and no locking, which the thousands of eager ops notebook 07
# writes made slow: 07 took 117 s in the shared, limited cache): notebook 06's
# `keras-mha compare` child then reads the eager ops its `keras-mha swap` child compiled
# (notebook 06: 93 -> 60 s). (Every program in the test runs costs more than it saves
# there: test_layer and test_layer_features on JAX 82 -> 91 s.) Whether a notebook
# compiles the fast way is `tests/test_notebooks.py`'s: all but those whose training
# cells run long enough that optimised code pays. Measured: the Benchmarks page,
# "Test-suite times".
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"


def _fast_compile_env(cache_dir):
    return {**_xla_flags_env(FAST_COMPILE_FLAGS), **_cache_env(cache_dir, 0.1)}


def _xla_flags_env(flags=""):
    """`XLA_FLAGS` as the caller's, then `flags`, then `FUSION_EMITTERS_OFF`."""
    parts = [os.environ.get("XLA_FLAGS"), flags, FUSION_EMITTERS_OFF]
    return {"XLA_FLAGS": " ".join(filter(None, parts))}


def _cache_env(cache_dir, min_compile_seconds, max_size=4 << 30):
    return {
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": str(min_compile_seconds),
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(max_size),
    }


# A backend's suite that is much longer than the other runs is split in two processes
# (these files, then every other), so that the two slots finish together: JAX's suite is
# about twice as long as the next run alone. Each file runs in exactly one of the two.
# In this order: quantized layers run several times slower late in a long JAX process
# (test_quantization: 16 s in a fresh one, 127 s at the end of the whole suite).
SPLIT = {
    "jax": [
        "tests/test_quantization.py",
        "tests/test_saving.py",
        "tests/test_upstream.py",
        "tests/test_keras_hub.py",
        "tests/test_hub.py",
        "tests/test_hub_packed.py",
    ],
}


# The runs of the backends' suites, longest first (a whole `make test` on the 2-core VM:
# jax 681 s, tensorflow 629, jax[models] 357, torch 333; then the notebooks about 250
# and `once` about 200): with two slots, JAX's and TensorFlow's suites start together,
# and the shorter runs fill in behind them. Measured: the Benchmarks page, "Test-suite
# times".
LONGEST_FIRST = ("jax", "tensorflow", "jax[models]", "torch")


# torch's runs compute on one thread: the two runs share the two cores, and the tests'
# tensors are tiny, so a second thread per op only adds its hand-off. TensorFlow's one
# thread showed no gain beyond the host's noise, and JAX's XLA threads off made its runs
# slower. Measured: the Benchmarks page, "Test-suite times".
ONE_COMPUTE_THREAD = {"torch": {"OMP_NUM_THREADS": "1"}}


def _run_pytest(label, backend, pytest_args, extra_env=None):
    LOGS.mkdir(exist_ok=True)
    junit = LOGS / f"{label}.xml"
    log = LOGS / f"{label}.log"
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "PYTHONHASHSEED": "0",
        **ONE_COMPUTE_THREAD.get(backend, {}),
        **(extra_env or {}),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}", *pytest_args]
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=out).returncode
    seconds = time.perf_counter() - start
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        counts = {
            "passed": total - failed - skipped,
            "failed": failed,
            "skipped": skipped,
        }
    ok = code == 0 and counts["passed"] > 0
    verdict = "ok" if ok else ("ran no test" if counts["passed"] == 0 else "FAILED")
    print(
        f"{label:>22}: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped in {seconds:.0f}s  [{verdict}]  log: {log}",
        flush=True,
    )
    if not ok:
        tail = log.read_text().splitlines()[-40:]
        print("\n".join("    " + line for line in tail), flush=True)
    return ok, counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="*", default=["tensorflow", "jax", "torch"])
    parser.add_argument("--inference-backends", nargs="*", default=["numpy", "openvino"])
    parser.add_argument("--notebook-backend", default="jax")
    parser.add_argument("--no-notebooks", action="store_true")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args, extra = parser.parse_known_args()

    # Longest first, so that the slots finish together (a run starts when a slot frees):
    # the backends' suites (`LONGEST_FIRST`), then the notebooks, then the `once` tests,
    # then the inference backends.
    runs = []
    for b in args.backends:
        suite = ["-m", "not notebook and not once", *extra]
        if b in SPLIT and not extra:
            ignored = [f"--ignore={path}" for path in SPLIT[b]]
            runs += [(b, b, [*suite, *ignored]), (f"{b}[models]", b, [*suite, *SPLIT[b]])]
        else:
            runs.append((b, b, suite))
    runs.sort(key=lambda run: LONGEST_FIRST.index(run[0]) if run[0] in LONGEST_FIRST else 99)
    if not args.no_notebooks:
        notebooks = ["-m", "notebook", "tests/test_notebooks.py"]
        runs.append((f"notebooks[{args.notebook_backend}]", args.notebook_backend, notebooks))
    if args.backends:  # tests that cover every backend themselves, or need none
        runs.append((f"once[{args.backends[0]}]", args.backends[0], ["-m", "once", *extra]))
    runs += [
        (f"inference[{b}]", b, ["tests/test_inference_backends.py"])
        for b in args.inference_backends
    ]

    def run(label, backend, pytest_args):
        importable, why = _backend_importable(backend)
        if not importable:
            print(f"{label:>22}: NOT INSTALLED ({' '.join(why)})  [FAILED]", flush=True)
            return False, {"passed": 0, "failed": 1, "skipped": 0}
        if label.startswith("notebooks"):
            env = {
                **_xla_flags_env(),
                **_cache_env(os.path.join(cache_dir, "notebooks"), 0, max_size=-1),
            }
        else:
            env = _fast_compile_env(cache_dir)
        return _run_pytest(label, backend, pytest_args, env)

    start = time.perf_counter()
    cache_dir = tempfile.mkdtemp(prefix="keras-mha-jax-cache-")
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = [pool.submit(run, *r) for r in runs]
        results = [r.result() for r in results]
    shutil.rmtree(cache_dir, ignore_errors=True)
    all_ok = all(ok for ok, _ in results)
    totals = {key: sum(counts[key] for _, counts in results) for key in results[0][1]}
    print(
        f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped "
        f"in {time.perf_counter() - start:.0f}s ({args.jobs} jobs)"
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
