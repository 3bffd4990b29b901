"""examples/long_context.py runs under torchrun (2 gloo processes, tiny sizes) and checks itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "long_context.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_example_matches_one_process_under_torchrun():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(EXAMPLE),
        "--seq-len",
        "64",
        "--d-model",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--check",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the example did not finish in 150 s:\n{e.stdout}\n{e.stderr}")
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "check passed" in run.stdout, log[-4000:]
    for rank in range(2):
        assert f"rank {rank} of 2" in run.stdout, log[-4000:]
    assert "one process" in run.stdout and "peak memory per rank" in run.stdout, log[-4000:]
