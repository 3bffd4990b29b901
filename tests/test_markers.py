"""The lists in ``conftest.py`` that mark tests slow, distributed, hf or triton_interpreter name files and tests that
exist: a renamed or moved test would otherwise fall silently back into the fast lane (``make test-fast``)."""

import ast

import pytest
from conftest import MARKED_PATHS, ROOT, SLOW


@pytest.mark.parametrize("marker", sorted(MARKED_PATHS))
def test_marked_paths_exist(marker):
    for path in MARKED_PATHS[marker]:
        assert (ROOT / path).exists(), f"conftest.MARKED_PATHS[{marker!r}] names {path}, which does not exist"


def _defined_names(path):
    tree = ast.parse((ROOT / path).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


def test_every_slow_entry_names_a_test_that_exists():
    missing = []
    for entry in SLOW:
        path, name = entry.split("::", 1)
        if not (ROOT / path).is_file():
            missing.append(entry)
        elif path.startswith("tests/") and name not in _defined_names(path):
            missing.append(entry)
        elif path.startswith("src/") and name.rsplit(".", 1)[-1] not in _defined_names(path):
            missing.append(entry)
    assert not missing, f"conftest.SLOW names tests that do not exist (renamed or moved?): {missing}"


def test_slow_has_no_duplicates():
    assert len(SLOW) == len(set(SLOW))
