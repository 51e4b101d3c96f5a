# keras-mha: every target installs what it needs into .venv from constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BACKENDS ?= tensorflow jax torch
NOTEBOOK_BACKEND ?= jax

# Bytecode: pip installs without compiling every module of every package (tensorflow,
# torch, jax: a minute of the install), and Python writes each module's bytecode when a
# process first imports it, for the processes after it (the test runs start dozens:
# command-line workers, notebook kernels, a fresh virtual environment's). A
# PYTHONDONTWRITEBYTECODE in the caller's environment would make every one of them
# compile its imports again from source. Measured: the Benchmarks page, "Test-suite times".
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-backends test-notebooks notebooks docs lint format bench gpu clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-compile -c constraints.txt -e ".[all]"
	# keras-hub (tests/test_keras_hub.py) without tensorflow-text: see the `hub` extra.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-compile -c constraints.txt --no-deps keras-hub
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/keras-mha compare --quick --json compare.json --plot compare.png

test: $(STAMP)
	$(BIN)/python tests/run_backends.py --backends $(BACKENDS) --notebook-backend $(NOTEBOOK_BACKEND)

test-backends: $(STAMP)
	$(BIN)/python tests/run_backends.py --backends $(BACKENDS) --no-notebooks

test-notebooks: $(STAMP)
	$(BIN)/python tests/run_backends.py --backends --inference-backends --notebook-backend $(NOTEBOOK_BACKEND)

# The notebooks' sources are notebooks/*.py (jupytext percent format). This writes each
# paired .ipynb from its source (keeping the outputs of unchanged cells), then runs them all
# top to bottom on $(NOTEBOOK_BACKEND), outputs stored in place.
NOTEBOOK_SOURCES = $(wildcard notebooks/*.py)
notebooks: $(STAMP)
	$(BIN)/jupytext --to ipynb --update $(NOTEBOOK_SOURCES)
	KERAS_BACKEND=$(NOTEBOOK_BACKEND) TF_CPP_MIN_LOG_LEVEL=3 PYTHONPATH=$(CURDIR) $(BIN)/jupyter nbconvert \
	  --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 \
	  --ExecutePreprocessor.record_timing=False $(NOTEBOOK_SOURCES:.py=.ipynb)

# The documentation site, from mkdocs.yml into site/; --strict fails on any broken reference.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/floor.py
	$(BIN)/python benchmarks/packed.py
	$(BIN)/python benchmarks/hub_lm.py
	$(BIN)/python benchmarks/hub_packed.py
	$(BIN)/python benchmarks/block_shapes.py
	$(BIN)/python benchmarks/block_mask.py
	$(BIN)/python benchmarks/score_mod.py
	$(BIN)/python benchmarks/reference_backend.py

# GPU tests + GPU benchmark per installed backend, against the existing .venv (no
# install, no network), then a markdown report in $(GPU_OUT). On a machine without a
# GPU: make gpu GPU_BENCH_ARGS=--dry-run GPU_OUT=/tmp/gpu-dry (checks the code only).
GPU_BACKENDS ?= torch jax tensorflow
GPU_OUT ?= benchmarks/results
GPU_BENCH_ARGS ?=
gpu:
	@test -x $(BIN)/python || { echo "no $(BIN)/python: run make install first"; exit 1; }
	@mkdir -p $(GPU_OUT)/raw
	@for b in $(GPU_BACKENDS); do \
	  rm -f $(GPU_OUT)/raw/tests-$$b.xml $(GPU_OUT)/raw/bench-$$b.json; \
	  if ! $(BIN)/python -c "import $$b" >/dev/null 2>&1; then \
	    echo "== $$b: not installed, left out of the report"; continue; fi; \
	  echo "== $$b: pytest -m gpu"; \
	  KERAS_BACKEND=$$b $(BIN)/python -m pytest -q -m gpu tests/test_gpu.py \
	    --junitxml=$(GPU_OUT)/raw/tests-$$b.xml || true; \
	  echo "== $$b: benchmarks/gpu_bench.py $(GPU_BENCH_ARGS)"; \
	  KERAS_BACKEND=$$b $(BIN)/python benchmarks/gpu_bench.py run $(GPU_BENCH_ARGS) \
	    --out $(GPU_OUT)/raw/bench-$$b.json > /dev/null || true; \
	done
	$(BIN)/python benchmarks/gpu_bench.py report --raw $(GPU_OUT)/raw \
	  --backends $(GPU_BACKENDS) --out $(GPU_OUT)/gpu-$$(date +%F).md
	@cat $(GPU_OUT)/gpu-$$(date +%F).md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .test-logs *.egg-info site .cache
