"""Cache tests use tiny tensors: one intra-op thread is faster than two, and far faster on a loaded machine."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
