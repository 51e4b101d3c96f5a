"""The command line starts without Keras or any backend, `import keras_mha` registers
our classes with Keras whichever is imported first, and a fresh virtual environment with
one backend runs the command line from the built wheel (KERAS_BACKEND unset).

All marked `once`: each test starts its own interpreters, whatever backend runs pytest.
"""

import json
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parent.parent
BACKEND_MODULES = ("keras", "tensorflow", "jax", "torch")


def _python(code, backend=None, executable=sys.executable, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERAS_BACKEND", None)
    if backend:
        env["KERAS_BACKEND"] = backend
    done = subprocess.run(
        [executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=cwd
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_command_line_imports_neither_keras_nor_a_backend():
    out = _python(
        """
        import contextlib, io, json, sys
        from keras_mha import cli
        for argv in (["--help"], ["swap", "--help"], ["compare", "--help"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                cli.main(argv)
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in
                                ("keras", "tensorflow", "jax", "torch"))))
        """
    )
    assert json.loads(out) == []


def test_python_dash_m_prints_help_without_a_backend():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KERAS_BACKEND", None)
    code = (
        "import runpy, sys; sys.argv = ['keras_mha', '--help']\n"
        "try: runpy.run_module('keras_mha', run_name='__main__', alter_sys=True)\n"
        "except SystemExit: pass\n"
        "print('loaded:', [m for m in sys.modules if m.split('.')[0] in "
        f"{BACKEND_MODULES!r}])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "{compare,swap}" in done.stdout
    assert done.stdout.strip().endswith("loaded: []")


@pytest.mark.parametrize(
    "first",
    [
        "import keras_mha; import keras",
        "import keras; import keras_mha",
        "from keras_mha import kernels; import keras",
    ],
    ids=["keras_mha_first", "keras_first", "a_submodule_first"],
)
def test_importing_keras_mha_registers_our_classes_in_either_order(first, tmp_path):
    backend = next(b for b in ("jax", "torch", "tensorflow") if _importable(b))
    out = _python(
        f"""
        {first}
        import keras_mha
        print(keras.saving.get_registered_object("keras_mha>MultiHeadAttention")
              is keras_mha.MultiHeadAttention)
        print(keras.saving.get_registered_object("keras_mha>SwapOnLoad") is not None)
        print(callable(keras_mha.swap) and callable(keras_mha.swapped))
        """,
        backend=backend,
    )
    assert out.split() == ["True", "True", "True"]


def _importable(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory):
    """The built wheel installed with `[jax]` only, into a new virtual environment."""
    root = tmp_path_factory.mktemp("fresh_venv")
    wheels = root / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("keras_mha-*.whl")
    venv.create(root / "venv", with_pip=True)
    bin_dir = root / "venv" / "bin"
    _pip(bin_dir, f"keras-mha[jax] @ {wheel.as_uri()}")
    return {"bin": bin_dir, "wheel": wheel, "root": root}


def _pip(bin_dir, requirement):
    """`pip install` into the new environment, without compiling every installed module
    to bytecode (a module compiles when first imported: 18 -> 8 s for `[jax]`)."""
    done = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        + ["--no-compile", "-c", str(ROOT / "constraints.txt"), requirement],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _cli(fresh_venv, *args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "PYTHONPATH")}
    env["PATH"] = f"{fresh_venv['bin']}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        ["keras-mha", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd
    )


def test_fresh_venv_with_one_backend_runs_the_command_line(fresh_venv, tmp_path):
    python = str(fresh_venv["bin"] / "python")
    absent = _python(
        "import importlib.util as u; print([m for m in ('tensorflow', 'torch', 'matplotlib') "
        "if u.find_spec(m)])",
        executable=python,
        cwd=tmp_path,
    )
    assert absent.strip() == "[]"

    done = _cli(fresh_venv, "--help", cwd=tmp_path)
    assert done.returncode == 0 and "swap" in done.stdout, done.stderr
    quick = ("compare", "--quick", "--cases", "seq6_scores", "--repeats", "1")
    done = _cli(fresh_venv, *quick, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "jax: PASS" in done.stdout
    assert "tensorflow: not installed, skipped" in done.stdout

    _python(
        """
        import keras
        x = keras.Input((6, 8))
        y = keras.layers.MultiHeadAttention(2, 4, name="attention")(x, x)
        keras.Model(x, y).save("in.keras")
        """,
        backend="jax",
        executable=python,
        cwd=tmp_path,
    )
    done = _cli(fresh_venv, "swap", "in.keras", "out.keras", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout and "(jax)" in done.stdout
    out = _python(
        """
        import keras, keras_mha
        model = keras.saving.load_model("out.keras", safe_mode=True)
        print(type(model.get_layer("attention")).__module__)
        """,
        backend="jax",
        executable=python,
        cwd=tmp_path,
    )
    assert out.strip() == "keras_mha.layer"

    # --plot needs matplotlib: one line naming the extra, nothing written; [cli] adds it.
    done = _cli(fresh_venv, *quick, "--plot", "p.png", cwd=tmp_path)
    assert done.returncode == 2 and not (tmp_path / "p.png").exists()
    assert done.stderr.strip() == (
        "keras-mha compare: error: needs matplotlib, not installed: pip install 'keras-mha[cli]'"
    )
    _pip(fresh_venv["bin"], f"keras-mha[jax,cli] @ {fresh_venv['wheel'].as_uri()}")
    done = _cli(fresh_venv, *quick, "--plot", "p.png", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
