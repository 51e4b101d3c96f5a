# keras-mha: every target installs what it needs into .venv from constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BACKENDS ?= tensorflow jax torch
NOTEBOOK_BACKEND ?= jax

.PHONY: install demo test test-backends test-notebooks lint format bench bench-gpu gpu clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[all]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/keras-mha compare --quick --json compare.json --plot compare.png

test: $(STAMP)
	$(BIN)/python tests/run_backends.py --backends $(BACKENDS) --notebook-backend $(NOTEBOOK_BACKEND)

test-backends: $(STAMP)
	$(BIN)/python tests/run_backends.py --backends $(BACKENDS) --no-notebooks

test-notebooks: $(STAMP)
	$(BIN)/python tests/run_backends.py --backends --notebook-backend $(NOTEBOOK_BACKEND)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .test-logs *.egg-info
