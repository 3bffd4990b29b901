"""Tiny models run one op at a time: one intra-op thread avoids thread hand-offs that dominate (and, on a
busy machine, multiply) the time of 64-wide matmuls."""

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
