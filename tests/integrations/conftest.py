"""Tiny models run one op at a time: one intra-op thread avoids thread hand-offs that dominate (and, on a
busy machine, multiply) the time of 64-wide matmuls."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
