"""What a fresh clone and a plain pip install get: `make demo` installs the demo's extra only, `make test` the
dev extra; `attnkit bench` outside a source checkout says where the scripts are."""

import shutil
import subprocess
from pathlib import Path

import pytest

from attnkit import cli

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


def test_bench_without_a_source_checkout_says_what_to_do(tmp_path, monkeypatch, capsys):
    """After `pip install attnkit` the package has no benchmarks/ beside it and the current directory has none."""
    monkeypatch.setattr(cli._commands, "_SOURCE_BENCHMARKS", tmp_path / "site-packages" / "benchmarks")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "not part of the installed package" in err and "attnkit[bench]" in err and "--dir" in err
    assert cli.main(["bench", "--dir", str(tmp_path / "nowhere")]) == 2
    assert "--dir" in capsys.readouterr().err
