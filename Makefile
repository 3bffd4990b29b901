# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install what they need on a fresh clone: the demo only attnkit[demo] (rich,
# matplotlib), the tests attnkit[dev] (transformers, triton, hypothesis, ...).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
TORCH_STAMP := $(VENV)/.installed-torch
DEMO_STAMP := $(VENV)/.installed-demo
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(TORCH_STAMP): $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	touch $(TORCH_STAMP)

$(DEMO_STAMP): $(TORCH_STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[demo]'
	touch $(DEMO_STAMP)

$(DEV_STAMP): $(TORCH_STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	touch $(DEV_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/attnkit demo

test: $(DEV_STAMP)
	$(BIN)/python -m pytest src tests

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/dense.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
