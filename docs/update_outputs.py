"""Regenerate the output shown under each `attnkit` command in the docs.

In docs/*.md, a ```bash block holding one `attnkit ...` command followed directly by a ```text block shows
that command's output; this script runs each such command (in-process, from the repository root) and
rewrites the text block.  tests/test_docs.py checks that every shown output is still exact.

    python docs/update_outputs.py            # rewrite docs/*.md in place
    python docs/update_outputs.py --check    # exit 1 if any shown output is stale
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIR = re.compile(r"(```bash\n(attnkit [^\n]*)\n```\n\n?```text\n)(.*?)(```)", re.S)


def run_command(line: str) -> str:
    """Stdout of one `attnkit ...` command line, run in-process from the repository root."""
    from attnkit.cli import main

    argv = shlex.split(line, comments=True)[1:]
    out = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out):
            main(argv)
    finally:
        os.chdir(cwd)
    return out.getvalue()


def refresh(text: str) -> str:
    def sub(m: re.Match) -> str:
        output = run_command(m.group(2)).rstrip() + "\n"
        return m.group(1) + output + m.group(4)

    return PAIR.sub(sub, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale outputs")
    args = ap.parse_args(argv)
    stale = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        old = path.read_text(encoding="utf-8")
        new = refresh(old)
        if new != old:
            stale.append(path.name)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "stale" if args.check else "updated"
    print(f"{verb}: {', '.join(stale)}" if stale else "all outputs are current")
    return 1 if (stale and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
