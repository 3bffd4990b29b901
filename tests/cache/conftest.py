"""Cache tests use tiny tensors: one intra-op thread is faster than two, and far faster on a loaded machine."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
