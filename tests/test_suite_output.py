"""The test run ends with pytest's "N passed in X s" line (CI reads it), however many ``-q`` it is given."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("quiet", [[], ["-q"], ["-qq"]])
def test_the_run_ends_with_the_summary_line(quiet):
    # addopts already holds -q: one more -q (a common habit) used to make -qq, where pytest drops the line
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *quiet, "-p", "no:cacheprovider", "tests/test_softmax.py::test_logsumexp"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.fullmatch(r"1 passed in [\d.]+s( \(\d+:\d\d:\d\d\))?", r.stdout.strip().splitlines()[-1]), r.stdout
