"""Shared timing helpers for the benchmark scripts: medians of interleaved repeats, tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def timeit(
    fns: dict[str, Callable[[], object]], *, repeat: int = 5, warmup: int = 1, budget_s: float = 30.0
) -> dict[str, float]:
    """Median seconds per call of each function, measured interleaved (round-robin) so that a noisy
    neighbour slows every variant alike; stops early when ``budget_s`` is spent (at least 1 run each)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    for i in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s and i >= 0:
            break
    return {name: statistics.median(ts) for name, ts in times.items()}


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table (also valid Markdown)."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


OUT_HELP = "folder for the JSON results (default: benchmarks/results under the current directory)"


def save(name: str, payload: dict, out: str | Path | None = None) -> Path:
    """Write results to ``out``/NAME.json (default: benchmarks/results under the current directory, never the
    script's own folder) with the machine's description."""
    out = Path(out) if out is not None else Path("benchmarks") / "results"
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), **payload}
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def machine(threads: bool = True) -> str:
    """The machine in one line; ``threads=False`` leaves out this process's thread count (a script whose
    timed work runs in other processes says theirs)."""
    return f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}" + (
        f", {torch.get_num_threads()} threads" if threads else ""
    )
