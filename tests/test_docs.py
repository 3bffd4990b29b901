"""Every code block in README.md, CONTRIBUTING.md and docs/*.md runs.

```python blocks run in order, sharing one namespace per file.  In ```bash blocks, each line that starts with
`attnkit ` runs through the CLI in-process and must exit 0 (or the code named by a trailing
comment holding `exit code N`); other lines (make, pip) are not run.  `attnkit demo`, `attnkit bench` and `attnkit distill` run
with --quick, their documented small size.  A ```bash block holding one `attnkit` command followed directly by a
```text block shows that command's output, which must match exactly (regenerate with
`python docs/update_outputs.py`).  Blocks run in a scratch folder where `docs/` points at the real one.
"""

import re
import shlex
from pathlib import Path

import pytest

from attnkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
EXIT = re.compile(r"#.*\bexit code\s+(\d+)")
QUICK = {"demo", "bench", "distill"}


def blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, code, line number) of every fenced block."""
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def commands(code: str) -> list[tuple[list[str], int]]:
    """The `attnkit` commands of a bash block, as argv (without 'attnkit') and expected exit code."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line.startswith("attnkit "):
            continue
        m = EXIT.search(line)
        argv = shlex.split(line, comments=True)[1:]
        if argv and argv[0] in QUICK and "--quick" not in argv:
            argv.append("--quick")
        out.append((argv, int(m.group(1)) if m else 0))
    return out


def test_the_docs_exist_and_hold_runnable_blocks():
    names = {p.name for p in FILES}
    assert {"README.md", "CONTRIBUTING.md", "tutorial.md", "masks.md"} <= names
    for path in FILES:
        kinds = {lang for lang, _, _ in blocks(path.read_text(encoding="utf-8"))}
        if path.name != "README.md":
            assert kinds & {"python", "bash"}, f"{path.name} has no runnable block"


def test_block_parser():
    text = "x\n```bash\nattnkit explain --check f.json  # exit code 1\nmake demo\n```\n\n```text\nout\n```\n"
    (lang, code, line), (lang2, code2, line2) = blocks(text)
    assert (lang, line, lang2, code2, line2) == ("bash", 2, "text", "out\n", 7)
    assert commands(code) == [(["explain", "--check", "f.json"], 1)]
    assert commands("attnkit demo\n") == [(["demo", "--quick"], 0)]
    assert commands("attnkit explain --check f.json  # finds the slips; exit code 1\n")[0][1] == 1
    assert _adjacent(text, 2, 7, code)
    apart = text.replace("```\n\n```text", "```\nsome words\n```text")
    assert blocks(apart)[1][2] == 7 and not _adjacent(apart, 2, 7, code)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_code_blocks_run(path, tmp_path, monkeypatch, capsys):
    (tmp_path / "docs").symlink_to(ROOT / "docs")
    monkeypatch.chdir(tmp_path)
    text = path.read_text(encoding="utf-8")
    found = blocks(text)
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for i, (lang, code, line) in enumerate(found):
        where = f"{path.name}:{line}"
        if lang == "python":
            capsys.readouterr()
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 (the docs' own examples)
        elif lang == "bash":
            cmds = commands(code)
            for argv, expected in cmds:
                capsys.readouterr()
                code_ = main(argv)
                out, err = capsys.readouterr()
                assert code_ == expected, (
                    f"{where}: attnkit {' '.join(argv)} exited {code_}, expected {expected}\n{err}"
                )
                shown = found[i + 1] if i + 1 < len(found) else None
                if len(cmds) == 1 and shown and shown[0] == "text" and _adjacent(text, line, shown[2], code):
                    assert out.rstrip() == shown[1].rstrip(), (
                        f"{where}: the output shown under `attnkit {' '.join(argv)}` is stale; "
                        f"run python docs/update_outputs.py"
                    )


def _adjacent(text: str, bash_line: int, text_line: int, code: str) -> bool:
    """True when the ```text block starts right after the ```bash block (only blank lines between)."""
    lines = text.splitlines()
    closing = bash_line + code.count("\n")  # 0-based index of the bash block's closing ```
    between = lines[closing + 1 : text_line - 1]
    return all(not ln.strip() for ln in between)
