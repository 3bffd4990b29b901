# `make demo` runs the main job, `make test` runs the tests, `make check` the lint, type and docs checks.
# Each creates .venv and installs what it needs on a fresh clone: the demo only attnkit[demo] (rich,
# matplotlib), the tests and checks attnkit[dev] (transformers, triton, hypothesis, the checkers, ...).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
TORCH_STAMP := $(VENV)/.installed-torch
DEMO_STAMP := $(VENV)/.installed-demo
DEV_STAMP := $(VENV)/.installed-dev
# the markers a contributor leaves out while working (registered in pyproject.toml)
FAST := not slow and not distributed and not triton_interpreter and not hf

.PHONY: demo test test-fast check lint format-check typecheck mypy-baseline docs bench clean

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

# pytest keeps its rewritten test modules, and Python the bytecode of attnkit's modules, between runs and for the
# child processes of a run, even where the environment turns bytecode writing off (~6 s of each worker's start)
KEEP_BYTECODE := PYTHONDONTWRITEBYTECODE=

# the whole suite on two workers (tests handed out one by one, an idle worker takes over queued ones), with
# the reason of every skip
test: $(DEV_STAMP)
	$(KEEP_BYTECODE) $(BIN)/python -m pytest -n 2 --dist worksteal -rs src tests

# the core, while working: no slow, distributed, Triton-interpreter or transformers tests
test-fast: $(DEV_STAMP)
	$(KEEP_BYTECODE) $(BIN)/python -m pytest -n 2 --dist loadfile -rs -m "$(FAST)" --hypothesis-profile attnkit-fast src tests

check: lint format-check typecheck docs

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

format-check: $(DEV_STAMP)
	$(BIN)/ruff format --check .

# mypy's errors minus the known ones in mypy-baseline.txt: a new error fails
typecheck: $(DEV_STAMP)
	$(BIN)/mypy | $(BIN)/mypy-baseline filter --sort-baseline --ignore-categories note --no-colors

# after fixing type errors: rewrite mypy-baseline.txt without them
mypy-baseline: $(DEV_STAMP)
	$(BIN)/mypy | $(BIN)/mypy-baseline sync --sort-baseline --ignore-categories note --no-colors

# the API reference and the guides as HTML in docs/_build/html (index.html); any warning (a cross-reference
# to a name that does not exist, a docstring Sphinx cannot parse) fails the build
docs: $(DEV_STAMP)
	$(BIN)/sphinx-build -b html -W --keep-going -n -q docs docs/_build/html

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/dense.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache docs/_build
