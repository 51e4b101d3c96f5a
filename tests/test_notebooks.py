"""The notebooks of notebooks/: executed top to bottom, committed with their outputs.

`make test` runs this file once, on the backend in `KERAS_BACKEND` (jax by default):

    KERAS_BACKEND=jax .venv/bin/pytest -m notebook tests/test_notebooks.py

Each notebook runs from a copy in a temporary folder (the committed outputs stay as they
are) in a kernel started from this interpreter, with a last cell appended that checks
the kernel's interpreter and Keras backend.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import keras
import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.notebook

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = (
    "01_quickstart",
    "02_key_dim_and_num_heads",
    "03_shapes_masks_and_scores",
    "04_fused_vs_per_head_projections",
    "05_compare_with_builtin",
)
CELL_TIMEOUT_S = 600  # generous: the machine may be shared
KERNEL_NAME = "keras-mha-test-python"


def _load_builder():
    spec = importlib.util.spec_from_file_location(
        "build_notebooks", NOTEBOOKS_DIR / "build_notebooks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def kernel_from_this_python(tmp_path, monkeypatch):
    """A kernelspec whose interpreter is `sys.executable`, found through JUPYTER_PATH."""
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
    return KERNEL_NAME


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_without_error(name, tmp_path, kernel_from_this_python):
    nb = nbformat.read(NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4)
    backend = keras.backend.backend()
    assert os.environ.get("KERAS_BACKEND", backend) == backend
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import os, sys, keras\n"
            f"assert os.path.realpath(sys.executable) == {os.path.realpath(sys.executable)!r}, "
            "sys.executable\n"
            f"assert keras.backend.backend() == {backend!r}, keras.backend.backend()\n"
            "print('checked')"
        )
    )
    copy = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, copy)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=kernel_from_this_python,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    assert nb.cells[-1].outputs[0]["text"].strip() == "checked"
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "data" in o]
    assert any("image/png" in o["data"] for o in images), f"{name} drew no picture"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_outputs(name):
    nb = nbformat.read(NOTEBOOKS_DIR / f"{name}.ipynb", as_version=4)
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


def test_committed_notebooks_match_their_source(tmp_path):
    builder = _load_builder()
    assert sorted(builder.NOTEBOOKS) == sorted(NOTEBOOKS)
    paths = [builder.write(name, spec, folder=tmp_path) for name, spec in builder.NOTEBOOKS.items()]
    builder.format_and_lint(paths)
    for path in paths:
        fresh = nbformat.read(path, as_version=4)
        committed = nbformat.read(NOTEBOOKS_DIR / path.name, as_version=4)
        assert [c.source for c in committed.cells] == [c.source for c in fresh.cells], (
            f"{path.name} differs from notebooks/build_notebooks.py: rebuild it"
        )
