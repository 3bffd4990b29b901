"""Shared test settings: hypothesis without deadlines (CI machines are shared and noisy), seeded torch."""

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("attnkit", deadline=None, max_examples=40, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("attnkit")


def pytest_configure(config):
    """Keep pytest's final "N passed in X s" line, which CI reads.  addopts already holds ``-q``, so one more
    ``-q`` on the command line makes ``-qq``, and below ``-q`` pytest prints no summary line at all."""
    if config.option.verbose < -1:
        config.option.verbose = -1


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
