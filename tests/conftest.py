"""Shared test settings: hypothesis without deadlines (CI machines are shared and noisy), seeded torch; the
markers each test gets from where it lives (see pyproject.toml for what each means); and a check that every
``dev`` dependency is installed, so a broken install fails the run instead of skipping hundreds of tests."""

import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("attnkit", deadline=None, max_examples=40, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("attnkit")


# the modules of pyproject.toml's `dev` extra that tests import (pytest-xdist runs `make test`; ruff and mypy
# are commands of `make check`)
DEV_MODULES = ("hypothesis", "numpy", "rich", "matplotlib", "transformers", "triton", "setuptools", "sphinx",
               "myst_parser")

ROOT = Path(__file__).resolve().parents[1]

# marker -> the test files (or folders) that carry it; tests elsewhere are marked where they are written
MARKED_PATHS = {
    "distributed": ["tests/distributed/"],
    "hf": ["tests/integrations/", "tests/test_sampling.py"],
    "triton_interpreter": ["tests/backends/test_triton.py", "tests/backends/test_triton_ops.py"],
}

# the slowest tests of the core (measured with --durations on 2 cores), each a few seconds or more;
# `make test` runs them, `make test-fast` leaves them out
SLOW = (
    "tests/test_docs.py::test_code_blocks_run",
)


def pytest_configure(config):
    """Keep pytest's final "N passed in X s" line, which CI reads.  addopts already holds ``-q``, so one more
    ``-q`` on the command line makes ``-qq``, and below ``-q`` pytest prints no summary line at all.

    Fail at once when a ``dev`` dependency is missing: each is a requirement of the suite, not an option."""
    if config.option.verbose < -1:
        config.option.verbose = -1
    missing = [m for m in DEV_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(f"the test suite needs {', '.join(missing)} (attnkit's dev dependencies): "
                                f"install them with pip install -e '.[dev]' (make test does)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        where = Path(item.path).resolve().relative_to(ROOT).as_posix()
        for marker, paths in MARKED_PATHS.items():
            if any(where == p or (p.endswith("/") and where.startswith(p)) for p in paths):
                item.add_marker(marker)
        if "interpreted" in getattr(item, "fixturenames", ()):
            item.add_marker("triton_interpreter")
        if item.nodeid.startswith(SLOW):
            item.add_marker("slow")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """One intra-op thread for tests of tiny tensors and models: a second thread only adds OpenMP
    synchronisation, which costs milliseconds on a loaded machine.  Test modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_dynamo(one_thread):
    """Every test traces from scratch (no compiled code or recompile counts carried over), on one thread.
    Compile tests opt in with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
