# The two set-up commands: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --quiet --constraint constraints.txt

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.demo: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e '.[demo]'
	touch $@

$(VENV)/.test: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) -e '.[test,demo,bench,keras,metrics,checkpoint,lightning,transformers]'
	touch $@

demo: $(VENV)/.demo
	$(BIN)/centralstore demo

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/mypy src/centralstore

test: lint
	$(BIN)/pytest -n 2 src/centralstore tests
	CENTRALSTORE_FAKE_GPUS=2 $(BIN)/pytest -n 2 -q tests/test_cuda.py

bench: $(VENV)/.test
	for script in benchmarks/bench_*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) demo-out .pytest_cache .mypy_cache .ruff_cache
