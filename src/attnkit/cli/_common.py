"""What every ``attnkit`` subcommand shares: exit codes, the usage error and its parser, optional dependencies."""

from __future__ import annotations

import argparse
import importlib
from typing import Sequence

EXIT_OK, EXIT_CLAIMS_WRONG, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with the command line or its input files (exit code 2, one line on stderr)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr and exit code 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _require(modules: Sequence[str], *, extra: str, needed_by: str) -> None:
    """Raise a UsageError naming the install command unless every one of ``modules`` imports.

    Checked before any work, so that a missing optional dependency is one line and exit code 2, not a
    traceback after minutes of computing."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(
            f"{needed_by} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed: pip install 'attnkit[{extra}]' (or pip install {' '.join(missing)})"
        )
