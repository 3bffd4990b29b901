# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install everything they need on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnkit demo

test: $(STAMP)
	$(BIN)/python -m pytest src tests

bench: $(STAMP)
	$(BIN)/python benchmarks/dense.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
