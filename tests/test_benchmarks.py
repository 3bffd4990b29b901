"""The benchmark scripts keep running as the library changes (nothing here times anything)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generate_benchmark_mixed_section_runs():
    """The mixed-workload section read the Engine's old per-step waste list and crashed after its table."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate.py"), "--quick", "--no-compile",
                           "--threads", "1", "--only", "mixed"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Engine (paged)" in proc.stdout


def test_sinks_benchmark_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sinks.py"), "--length", "256", "--repeat", "1",
                           "--threads", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "forward+backward" in proc.stdout and "ratio" in proc.stdout
