"""What a fresh clone and a plain pip install get: `make demo` installs the demo's extra only, `make test` the
dev extra."""

import shutil
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def _dry_run(tmp_path, target: str) -> str:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_the_demo_extra_and_make_test_the_dev_extra(tmp_path):
    demo = _dry_run(tmp_path, "demo")
    assert "-e '.[demo]'" in demo and "[dev]" not in demo and "attnkit demo" in demo
    assert "torch==" in demo
    test = _dry_run(tmp_path, "test")
    assert "-e '.[dev]'" in test and "[demo]" not in test and "pytest" in test
