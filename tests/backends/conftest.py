"""Cases run by Triton's interpreter, in one child process per test module.

Triton picks its interpreter or its GPU compiler once, when ``triton`` is first imported (it builds its own
standard library, ``tl.zeros``, ``tl.max``..., for one or the other), so ``TRITON_INTERPRET=1`` must be in the
environment before that import, and it cannot be undone in a running process.  This pytest process may
already hold triton compiled for the GPU (anything may have imported it), and setting the variable here would
leave triton in interpreter mode for every later test.  So a test module that needs the interpreter keeps its
cases in a dict ``CASES`` (name -> function without arguments), parametrizes a test over the names and
requests the ``interpreted`` fixture: the fixture runs this file as a script in ONE child Python started with
``TRITON_INTERPRET=1``, which loads the module, runs each selected case and writes its verdict (None, or the
traceback) to a JSON file; each test then fails with its case's traceback.  The case code is ordinary test
code; only where it runs differs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

CHILD_TIMEOUT_S = 500


@pytest.fixture(scope="module")
def interpreted(request) -> dict:
    """``{case name: None | traceback}`` for the requesting module's selected cases (the ``name`` parameter
    of its tests), run in one child process under ``TRITON_INTERPRET=1``."""
    path = Path(request.module.__file__)
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.path == path and hasattr(item, "callspec") and "name" in item.callspec.params
    ]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "verdicts.json"
        proc = subprocess.run(
            [sys.executable, __file__, str(path), str(out), *selected],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"the interpreter child failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return json.loads(out.read_text())


def _run_cases(module_path: str, out_path: str, names: list[str]) -> None:
    """In the child: load the test module, run the named cases, write {name: null | traceback} as JSON."""
    import torch

    spec = importlib.util.spec_from_file_location(f"_interpreted_{Path(module_path).stem}", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    verdicts = {}
    for name in names:
        torch.manual_seed(0)
        try:
            module.CASES[name]()
            verdicts[name] = None
        except Exception:  # noqa: BLE001 (every failure, assertion or crash, goes back to the parent test
            verdicts[name] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(verdicts))


if __name__ == "__main__":  # the child of the `interpreted` fixture
    _run_cases(sys.argv[1], sys.argv[2], sys.argv[3:])
