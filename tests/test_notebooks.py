"""The notebooks of notebooks/: jupytext sources paired with their executed .ipynb.

Each notebook's source is `notebooks/NAME.py` (jupytext percent format); `make notebooks`
writes `NAME.ipynb` from it and executes it, outputs committed. These tests check that
every pair is in sync (same cells, same sources), that the committed notebooks were run
top to bottom without error, and execute every source. `make test` runs this file once,
on the backend in `KERAS_BACKEND` (jax by default):

    KERAS_BACKEND=jax .venv/bin/pytest -m notebook tests/test_notebooks.py

Each source runs from a temporary folder (the committed notebooks stay as they are) in a
kernel started from this interpreter, importing `keras_mha` from this checkout, with a
last cell appended that checks the kernel's interpreter, Keras backend and `keras_mha`.
"""

import json
import os
import sys
from pathlib import Path

import jupytext
import keras
import nbformat
import pytest
from nbclient import NotebookClient
from run_backends import FAST_COMPILE_FLAGS

pytestmark = pytest.mark.notebook

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS_DIR.glob("*.py"))
NAMES = [source.stem for source in SOURCES]
CELL_TIMEOUT_S = 600  # generous: the machine may be shared
KERNEL_NAME = "keras-mha-test-python"
# What a notebook must print, beyond running: text -> how many times.
EXPECTED_TEXT = {
    "06_move_your_model": {
        # the notebook's own line, then `keras-mha swap`'s: unpadded and padded inputs
        "largest output difference": 3,
        "exit status: 0": 2,
        "exit status: 2": 1,
    },
}


def _cells(notebook):
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def pair_difference(source, notebook_path):
    """Why `notebook_path` (.ipynb) is out of sync with `source` (.py); `None` if it is not."""
    if not notebook_path.exists():
        return f"{notebook_path.name} is missing for {source.name}: run `make notebooks`"
    expected = _cells(jupytext.read(source))
    committed = _cells(nbformat.read(notebook_path, as_version=4))
    if expected == committed:
        return None
    shorter = min(len(expected), len(committed))
    index = next((i for i, (a, b) in enumerate(zip(expected, committed)) if a != b), shorter)
    return (
        f"{notebook_path.name} differs from its source {source.name} from cell {index} on "
        f"({len(committed)} cells against {len(expected)}): run `make notebooks`"
    )


def test_there_are_notebook_sources():
    assert len(SOURCES) >= 5, f"expected the notebooks' .py sources in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_in_sync_with_its_source(name):
    difference = pair_difference(NOTEBOOKS_DIR / f"{name}.py", NOTEBOOKS_DIR / f"{name}.ipynb")
    assert difference is None, difference


def test_every_notebook_has_a_source():
    orphans = [p.name for p in NOTEBOOKS_DIR.glob("*.ipynb") if p.stem not in NAMES]
    assert not orphans, f"notebooks without a .py source in {NOTEBOOKS_DIR}: {orphans}"


def test_pair_difference_catches_drift(tmp_path):
    source = tmp_path / "example.py"
    notebook = tmp_path / "example.ipynb"
    source.write_text(SOURCES[0].read_text())
    assert "run `make notebooks`" in pair_difference(source, notebook)  # no .ipynb yet
    jupytext.write(jupytext.read(source), notebook)
    assert pair_difference(source, notebook) is None
    source.write_text(source.read_text() + "\nprint('edited')\n")  # the last cell changes
    difference = pair_difference(source, notebook)
    assert difference is not None and "example.ipynb differs" in difference, difference
    jupytext.write(jupytext.read(source), notebook)
    source.write_text(source.read_text().replace("\n# %%\n", "\n# %% [markdown]\n", 1))
    assert pair_difference(source, notebook) is not None  # a cell's type changed


@pytest.fixture
def kernel_from_this_python(tmp_path, monkeypatch):
    """A kernelspec whose interpreter is `sys.executable`, found through JUPYTER_PATH,
    importing `keras_mha` from this checkout."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "keras-mha tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT)] + ([path] if path else [])))
    return KERNEL_NAME


# Notebooks whose training cells run long enough that XLA's optimised code saves more
# than its compiling costs. The others' kernels (and their command-line children) compile
# the fast way, as the test runs do (`run_backends.FAST_COMPILE_FLAGS`). Measured: the
# Benchmarks page, "Test-suite times".
OPTIMIZED = ("07_modern_decoder",)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_source_runs_without_error(name, tmp_path, kernel_from_this_python, monkeypatch):
    if name not in OPTIMIZED:
        flags = os.environ.get("XLA_FLAGS")
        monkeypatch.setenv("XLA_FLAGS", " ".join(filter(None, [flags, FAST_COMPILE_FLAGS])))
    nb = jupytext.read(NOTEBOOKS_DIR / f"{name}.py")
    backend = keras.backend.backend()
    assert os.environ.get("KERAS_BACKEND", backend) == backend
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import os, sys, keras, keras_mha\n"
            f"assert os.path.realpath(sys.executable) == {os.path.realpath(sys.executable)!r}, "
            "sys.executable\n"
            f"assert keras.backend.backend() == {backend!r}, keras.backend.backend()\n"
            f"assert keras_mha.__file__.startswith({str(ROOT)!r}), keras_mha.__file__\n"
            f"fast = {FAST_COMPILE_FLAGS!r} in os.environ.get('XLA_FLAGS', '')\n"
            f"assert fast == {name not in OPTIMIZED!r}, os.environ.get('XLA_FLAGS')\n"
            "print('checked')"
        )
    )
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=kernel_from_this_python,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    assert nb.cells[-1].outputs[0]["text"].strip() == "checked"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for expected, count in EXPECTED_TEXT.get(name, {}).items():
        assert text.count(expected) == count, f"{name} printed {expected!r} {text.count(expected)}x"
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "data" in o]
    assert any("image/png" in o["data"] for o in images), f"{name} drew no picture"


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_has_outputs(name):
    path = NOTEBOOKS_DIR / f"{name}.ipynb"
    assert path.exists(), f"{path.name} is missing: run `make notebooks`"
    nb = nbformat.read(path, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, f"{name} has no code"
    unexecuted = [i for i, cell in enumerate(code) if cell.execution_count is None]
    assert not unexecuted, f"{name}: code cells {unexecuted} were not executed"
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), f"{name} was not run top to bottom"
    errors = [o for cell in code for o in cell.outputs if o["output_type"] == "error"]
    assert not errors, f"{name} was committed with an error: {errors[0]['ename']}"
    first = "".join(o.get("text", "") for o in code[0].outputs)
    assert "Keras backend:" in first, f"{name} does not state its backend first"
    pngs = [o for cell in code for o in cell.outputs if "image/png" in o.get("data", {})]
    assert pngs, f"{name} was committed without its pictures"
