"""The `attnkit` command: explain, masks, bench; --help everywhere; bad input -> one line on stderr, exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnkit import cli, masks
from attnkit.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(capsys, *argv, match=""):
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert match in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------- explain


def test_explain_without_arguments_is_the_article_example(capsys):
    code, out, _ = run(capsys, "explain")
    assert code == 0
    assert "Q1[1] = x1·W_q[:, 1] = 1.0*0.1 + 0.5*(-0.2) + (-0.2)*0.5 + 1.2*0.2" in out
    assert "output = [[0.2657, -0.0702], [-0.0551, 0.041], [0.0141, -0.0198]]" in out


def test_explain_input_file_and_row(capsys, tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(
        json.dumps(
            {"X": [[1, 0], [0, 1]], "W_q": [[1, 0], [0, 1]], "W_k": [[2, 0], [0, 2]], "W_v": [[1], [3]], "scale": 1.0}
        )
    )
    code, out, _ = run(capsys, "explain", "--input", str(f), "--row", "1")
    assert code == 0
    assert "score(x2,x2) = 0.0*0.0 + 1.0*2.0 = 0.0 + 2.0 = 2.0" in out
    assert "multiply by the given scale 1.0" in out
    w = torch.softmax(torch.tensor([0.0, 2.0], dtype=torch.float64), -1)
    assert f"output2 = {float(w[0]):.4f}*[1.0] + {float(w[1]):.4f}*[3.0]" in out


def test_explain_softmax(capsys):
    code, out, _ = run(capsys, "explain", "--softmax", "2.0,-1.0,0.5")
    assert code == 0
    assert "= [0.7856, 0.0391, 0.1753]" in out
    code, out, _ = run(capsys, "explain", "--softmax", "-1,-inf")  # a leading minus is a value, not an option
    assert code == 0 and "= [1.0, 0.0]" in out


def test_explain_check_article_exits_1_with_claimed_and_exact(capsys):
    code, out, _ = run(capsys, "explain", "--check", str(ROOT / "docs" / "examples" / "article.json"))
    assert code == 1
    assert "K[0]               claimed [-0.24, 0.33]  WRONG" in out
    assert "exact   [-0.45, 0.85]" in out
    assert "weights[0]         claimed [0.339, 0.240, 0.421]" in out  # written precision kept
    assert "slips: Q[1], Q[2], K[0], K[1], K[2], V[0], V[1], V[2], softmax[0].weights" in out


def test_explain_check_exits_0_when_all_claims_hold(capsys, tmp_path):
    f = tmp_path / "good.json"
    f.write_text(
        '{"X": [[1.0, 0.5, -0.2, 1.2], [0.3, -1.0, 0.8, 0.4], [-0.7, 0.6, 1.1, -0.5]],'
        ' "W_q": [[0.1, 0.4], [-0.2, 0.3], [0.5, -0.1], [0.2, 0.1]],'
        ' "W_k": [[-0.3, 0.2], [0.1, 0.5], [0.4, -0.2], [-0.1, 0.3]],'
        ' "W_v": [[0.2, -0.1], [0.3, 0.4], [-0.2, 0.1], [0.5, -0.3]],'
        ' "K[0]": [-0.45, 0.85], "scores[0]": [0.524, -0.319, -0.039], "weights[0]": [0.450, 0.248, 0.302],'
        ' "softmax": [{"scores": [2.0, -1.0, 0.5], "weights": [0.79, 0.04, 0.18]}]}'
    )
    code, out, _ = run(capsys, "explain", "--check", str(f))
    assert code == 0, out
    assert "All 4 claims hold." in out


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"X": [[1, 2]], "W_q": [[1], [2]], "W_k": [[1], [2]]}', "missing key(s) W_v"),
        ('{"X": [[1, 2]], "W_q": [[1]], "W_k": [[1], [2]], "W_v": [[1], [2]]}', "w_q has 1 rows but x has d_model=2"),
        ('{"X": [[1, 2], [3]], "W_q": [[1], [2]], "W_k": [[1], [2]], "W_v": [[1], [2]]}', "equal-length rows"),
        ('{"X": [[1, 2]], "W_q": [[1], [2]], "W_k": [[1], [2]], "W_v": [[1], [2]], "mask": [[1, 1]]}', "(L, L)"),
    ],
)
def test_explain_input_errors(capsys, tmp_path, content, match):
    f = tmp_path / "in.json"
    if content is not None:
        f.write_text(content)
    assert_usage_error(capsys, "explain", "--input", str(f), match=match)


@pytest.mark.parametrize(
    "content, match",
    [
        ("{bad", "not valid JSON"),
        ('{"X": [[1.0]], "W_q": [[1.0]], "W_k": [[1.0]], "W_v": [[1.0]], "scores[5]": [1]}', "index 5 out of range"),
        ('{"X": [[1.0]], "W_q": [[1.0]], "W_k": [[1.0]], "W_v": [[1.0]], "weight": [1]}', "unknown key 'weight'"),
        ('{"X": [[1.0]], "W_q": [[1.0]], "W_k": [[1.0]], "W_v": [[1.0]], "scores": [[NaN]]}', "NaN is not allowed"),
        ('{"X": [[1.0]], "W_q": [[1.0]], "W_k": [[1.0]], "W_v": [[1.0]]}', "nothing to check"),
        ('{"softmax": [{"scores": [], "weights": []}]}', "scores is empty"),
    ],
)
def test_explain_check_errors(capsys, tmp_path, content, match):
    f = tmp_path / "claims.json"
    f.write_text(content)
    assert_usage_error(capsys, "explain", "--check", str(f), match=match)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["explain", "--softmax", "1,x"], "'x' is not a number"),
        (["explain", "--softmax", "1,inf"], "not allowed"),
        (["explain", "--softmax", "1", "--check", "f.json"], "at most one of"),
        (["explain", "--row", "7"], "row=7"),
        (["explain", "--row", "-1"], "must be >= 0"),
        (["explain", "--digits", "two"], "not an integer"),
        (["explain", "--frobnicate"], "unrecognized arguments"),
        (["frobnicate"], "invalid choice"),
        (["masks", "show", "global_tokens", "none"], "indices must be integers"),
        (["masks", "show", "strided", "4", "causal=maybe"], "causal must be True or False"),
    ],
)
def test_bad_arguments(capsys, argv, match):
    assert_usage_error(capsys, *argv, match=match)


# ------------------------------------------------------------------------------------------ masks


def _drawn(out: str) -> torch.Tensor:
    rows = [ln[1:] for ln in out.splitlines()[1:] if ln.startswith(" ")]
    return torch.tensor([[c == "█" for c in r] for r in rows])


EXAMPLES = {  # every built-in, with command-line arguments and the same mask built in Python
    "causal": ([], masks.causal()),
    "sliding_window": (["2", "1"], masks.sliding_window(2, 1)),
    "key_padding": (["3,5"], masks.key_padding([3, 5])),
    "document": (["0,0,0,1,1,2,2,2,2,2"], masks.document([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])),
    "varlen": (["0,4,10"], masks.varlen([0, 4, 10])),
    "prefix_lm": (["3"], masks.prefix_lm(3)),
    "block_local": (["4"], masks.block_local(4)),
    "strided": (["3", "causal=false"], masks.strided(3, causal=False)),
    "fixed": (["4", "1"], masks.fixed(4, 1)),
    "dilated": (["2", "2", "causal=true"], masks.dilated(2, 2, causal=True)),
    "global_tokens": (["0,5"], masks.global_tokens([0, 5])),
    "random_blocks": (["2", "2", "7"], masks.random_blocks(2, 2, 7)),
}


def test_every_builtin_mask_is_covered():
    from attnkit.cli import _mask_builders

    assert set(_mask_builders()) == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_masks_show_draws_every_builtin(capsys, name):
    words, mask = EXAMPLES[name]
    batch = ["--batch", "1"] if name == "key_padding" else []
    code, out, _ = run(capsys, "masks", "show", name, *words, "--len", "10", *batch)
    assert code == 0
    b = 1 if batch else 0
    expected = mask.to_dense(10, 10, batch=b + 1)[b if mask.to_dense(10, 10, batch=b + 1).shape[0] > 1 else 0, 0]
    assert torch.equal(_drawn(out), expected)
    assert f"density {expected.float().mean().item():.1%}" in out.splitlines()[0]  # of the element drawn


def test_masks_show_expression_and_tiles(capsys):
    code, out, _ = run(capsys, "masks", "show", "causal() & ~sliding_window(2)", "--len", "8")
    assert code == 0
    expected = (masks.causal() & ~masks.sliding_window(2)).to_dense(8, 8)[0, 0]
    assert torch.equal(_drawn(out), expected)
    code, out, _ = run(capsys, "masks", "show", "sliding_window", "64", "--len", "4096", "--width", "32")
    assert code == 0 and "one character per 128x128 tile" in out
    code, out, _ = run(capsys, "masks", "list")
    assert code == 0 and all(name in out for name in EXAMPLES)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["masks", "show", "nope"], "unknown mask 'nope'"),
        (["masks", "show", "sliding_window"], "missing a required argument"),
        (["masks", "show", "sliding_window", "1", "2", "3", "4"], "too many positional arguments"),
        (["masks", "show", "sliding_window", "-3x"], "unrecognized arguments"),
        (["masks", "show", "strided", "0"], "stride=0 must be >= 1"),
        (["masks", "show", "causal", "align=middle"], "align='middle'"),
        (["masks", "show", "causal", "--len", "0"], "must be >= 1"),
        (["masks", "show", "causal", "--len", "1000000"], "pass a smaller --len"),
        (["masks", "show", "causal() & os.system('x')"], "is not a built-in mask"),
        (["masks", "show", "causal(__import__('os'))"], "literal"),
        (["masks", "show", "causal(("], "cannot parse"),
        (["masks"], "choose an action"),
    ],
)
def test_masks_errors(capsys, argv, match):
    assert_usage_error(capsys, *argv, match=match)


# ------------------------------------------------------------------------------------------ bench


def test_bench_runs_scripts_that_take_quick(capfd, tmp_path):
    (tmp_path / "fast.py").write_text("import sys\nassert sys.argv[1:] == ['--quick']\nprint('| fast | 1.0x |')\n")
    (tmp_path / "slowonly.py").write_text("print('only the full size')  # mentions --quick in a comment only\n")
    (tmp_path / "_common.py").write_text("raise SystemExit(3)\n")  # helpers are not benchmarks
    code = main(["bench", "--quick", "--dir", str(tmp_path)])
    out = capfd.readouterr().out
    assert code == 0
    assert "== fast.py: fast.py --quick" in out.replace(str(tmp_path) + "/", "")
    assert "| fast | 1.0x |" in out and "only the full size" not in out
    assert "slowonly.py: skipped (it has no --quick option)" in out
    (tmp_path / "broken.py").write_text("QUICK = '--quick'\nraise SystemExit(4)\n")
    assert main(["bench", "--quick", "--dir", str(tmp_path), "--only", "broken"]) == 1
    assert "exit code 4" in capfd.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["bench", "--dir", "/nonexistent/benchmarks"], "no benchmarks/ folder"),
        (["bench", "--only", "nope", "--dir", "."], "no benchmark named nope"),
    ],
)
def test_bench_errors(capsys, tmp_path, argv, match):
    argv = [str(tmp_path) if a == "." else a for a in argv]
    assert_usage_error(capsys, *argv, match=match)


# ------------------------------------------------------------------------------------- everywhere


def _subcommands(parser, prefix=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from _subcommands(sub, prefix + (name,))


def test_help_on_every_command(capsys):
    commands = [()] + list(_subcommands(build_parser()))
    assert ("explain",) in commands and ("masks", "show") in commands and ("bench",) in commands
    for cmd in commands:
        code, out, err = run(capsys, *cmd, "--help")
        assert code == 0 and out.startswith("usage: attnkit"), cmd
        assert err == ""


def test_console_script_entry_point():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'attnkit = "attnkit.cli:main"' in text
    r = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "explain", "--input", "missing.json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip() == "error: missing.json: no such file"


# ------------------------------------------------------------------------------------------- doctor


def test_doctor_one_example_in_full(capsys, tmp_path):
    # `attnkit doctor` over every example, in brief, is run and its output checked by tests/test_docs.py
    code, out, _ = run(
        capsys, "doctor", "--example", "uniform", "--plot", str(tmp_path / "p"), "--markdown", str(tmp_path / "r.md")
    )
    assert code == 0
    assert out.splitlines()[1].split()[:3] == ["layer", "head", "entropy"]
    assert "[uniform] attention weights too uniform in layers.0.attn, heads [0, 1, 2, 3]" in out
    marked, named = _doctor_table_and_findings(out)
    assert marked == named and set(named.values()) == {"uniform"}
    assert (tmp_path / "p" / "attention.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "r.md").read_text().startswith("# Attention doctor: uniform")


def test_doctor_on_a_saved_model(capsys, tmp_path):
    from attnkit.diagnostics.examples import example

    model, _ = example("saturated")
    torch.save(model, tmp_path / "m.pt")
    code, out, _ = run(capsys, "doctor", "--model", str(tmp_path / "m.pt"), "--seq-len", "32")
    assert code == 0 and "[saturated] softmax saturated in layers.0.attn" in out
    torch.save({"not": "a model"}, tmp_path / "d.pt")
    assert_usage_error(capsys, "doctor", "--model", str(tmp_path / "d.pt"), match="not a torch.nn.Module")
    (tmp_path / "bad.pt").write_text("garbage")
    assert_usage_error(capsys, "doctor", "--model", str(tmp_path / "bad.pt"), match="cannot load a model")
    assert_usage_error(capsys, "doctor", "--model", str(tmp_path / "none.pt"), match="no such file")
    assert_usage_error(capsys, "doctor", "--model", str(tmp_path / "m.pt"), "--example", "sharp", match="not both")
    assert_usage_error(capsys, "doctor", "--example", "nope", match="invalid choice")


# --------------------------------------------------------------------------------------------- demo


def test_demo_quick_runs_every_step(capsys, tmp_path):
    code, out, _ = run(capsys, "demo", "--quick", "--out", str(tmp_path / "demo"))
    assert code == 0, out
    headings = [
        "1. Attention in four steps",
        "2. A small DecoderLM learns associative recall",
        "3. Where the model looks",
        "4. Generation with a KV cache",
    ]
    assert all(h in out for h in headings)
    assert "Q1[1] = x1·W_q[:, 1] = 1.0*0.1 + 0.5*(-0.2) + (-0.2)*0.5 + 1.2*0.2" in out
    assert "slips: Q[1], Q[2], K[0], K[1], K[2], V[0], V[1], V[2], softmax[0].weights" in out
    assert "No induction circuit has formed in 10 training steps" in out  # --quick trains too little to claim one
    assert "the tokens are identical" in out
    assert (tmp_path / "demo" / "attention.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "demo" / "doctor.md").read_text().startswith("# Attention doctor")
    marked, named = _doctor_table_and_findings(out)
    assert marked == named, out  # the doctor's per-head symptom column and its findings tell the same story


def _doctor_table_and_findings(out: str) -> tuple[dict, dict]:
    """From printed doctor output: {(layer, head): symptom} of the table's marked rows, and the same map
    built from the findings' lines ("[kind] <title> in <layer>, heads [0, 1]: ...")."""
    import re

    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["layer", "head", "entropy"])
    marked = {}
    for ln in lines[start + 2 :]:
        if not ln.strip():
            break
        cells = ln.split()
        assert len(cells) in (7, 8), ln
        if len(cells) == 8:
            marked[(cells[0], int(cells[1]))] = cells[7]
    named = {}
    for m in re.finditer(r"^\[(\w+)\] .* in (\S+), heads \[([\d, ]*)\]:", out, re.M):
        for h in m.group(3).split(","):
            named[(m.group(2), int(h))] = m.group(1)
    assert bool(named) != ("No findings" in out), out
    return marked, named


def test_python_dash_m_attnkit_is_the_demo():
    text = (ROOT / "src" / "attnkit" / "__main__.py").read_text()
    assert 'main(sys.argv[1:] or ["demo"])' in text
    assert "attnkit demo" in (ROOT / "Makefile").read_text().split("demo: $(DEMO_STAMP)")[1].splitlines()[1]


# ------------------------------------------------------------- doctor: bad arguments and paths


class _EmbeddingModel(torch.nn.Module):
    """A language model without config.vocab_size whose token embedding has 50 rows."""

    def __init__(self):
        super().__init__()
        from attnkit.nn import MultiHeadAttention

        self.emb = torch.nn.Embedding(50, 16)
        self.attention = MultiHeadAttention(16, 2, mask=masks.causal())
        self.out = torch.nn.Linear(16, 50)

    def forward(self, ids):
        return self.out(self.attention(self.emb(ids)))  # (B, L, 50)


class _TableModel(torch.nn.Module):
    """Looks tokens up in a plain tensor: no nn.Embedding tells its vocabulary."""

    def __init__(self):
        super().__init__()
        from attnkit.nn import MultiHeadAttention

        self.table = torch.nn.Parameter(torch.randn(50, 16))
        self.attention = MultiHeadAttention(16, 2, mask=masks.causal())

    def forward(self, ids):
        return self.attention(self.table[ids])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["doctor", "--seq-len", "1"], "--seq-len: 1 must be >= 2"),
        (["doctor", "--batch-size", "1", "--example", "healthy"], "--batch-size 1: the example models take at least 2"),
        (["doctor", "--example", "healthy", "--plot", "{file}"], "is a file, not a directory"),
        (["doctor", "--example", "healthy", "--markdown", "{dir}"], "is a directory; give a file name"),
        (["doctor", "--markdown", "{dir}"], "is a directory; give a file name"),
        (["doctor", "--model", "{dir}"], "is a directory, not a file"),
        (["explain", "--check", "{dir}"], "is a directory, not a file"),
        (["explain", "--input", "{dir}"], "is a directory, not a file"),
        (
            ["doctor", "--model", "{emb}", "--vocab", "5000"],
            "--vocab 5000 is more than the model's vocabulary: its first "
            "embedding, 'emb', has 50 rows; pass --vocab 50",
        ),
        (
            ["doctor", "--model", "{emb}"],
            "pass --vocab V (random token ids are drawn from [0, V)) (its first embedding, 'emb', has 50 rows)",
        ),
        (
            ["doctor", "--model", "{table}", "--vocab", "5000"],
            "the model failed on random token ids of shape (4, 32) (IndexError",
        ),
        (
            ["doctor", "--model", "{table}"],
            "pass --vocab V if it takes token ids, or run a model that takes other inputs from Python",
        ),
        (["doctor", "--seq-len", "1"], "1 must be >= 2"),
        (
            ["masks", "show", "key_padding", "3,5", "--len", "6", "--batch", "2"],
            "--batch 2 is out of range: the mask holds 2 sequences",
        ),
        (["doctor", "--seq-len", "0"], "0 must be >= 2"),
    ],
)
def test_doctor_bad_arguments_and_paths_are_one_line(capsys, tmp_path, argv, match):
    (tmp_path / "afile").write_text("")
    torch.save(_EmbeddingModel(), tmp_path / "emb.pt")
    torch.save(_TableModel(), tmp_path / "table.pt")
    names = {"file": tmp_path / "afile", "dir": tmp_path, "emb": tmp_path / "emb.pt", "table": tmp_path / "table.pt"}
    argv = [a.format(**names) for a in argv]
    assert_usage_error(capsys, *argv, match=match)


def test_doctor_on_a_model_without_config_within_its_vocabulary(capsys, tmp_path):
    torch.manual_seed(0)
    torch.save(_EmbeddingModel(), tmp_path / "emb.pt")
    code, out, err = run(
        capsys,
        "doctor",
        "--model",
        str(tmp_path / "emb.pt"),
        "--vocab",
        "50",
        "--batch-size",
        "1",
        "--plot",
        str(tmp_path / "p"),
    )
    assert code == 0, err
    # the layer is named `attention`: its heatmap must not overwrite the grid attention.png
    assert "heatmaps: " + ", ".join(str(tmp_path / "p" / n) for n in ("attention.png", "attention_2.png")) in out


def test_explain_input_takes_a_mask_of_json_booleans(capsys, tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(
        '{"X": [[1, 0], [0, 1]], "W_q": [[1, 0], [0, 1]], "W_k": [[2, 0], [0, 2]], "W_v": [[1], [3]],'
        ' "mask": [[true, false], [true, true]]}'
    )
    code, out, _ = run(capsys, "explain", "--input", str(f))
    assert code == 0
    assert "scaled(x1,x2) = -inf   (masked: x1 may not attend to x2)" in out


def _hide(monkeypatch, *modules):
    """Make ``import NAME`` fail as it does where NAME is not installed."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("hidden", [("rich",), ("matplotlib",), ("rich", "matplotlib")])
def test_demo_without_its_optional_dependencies_is_one_line_before_any_work(capsys, monkeypatch, tmp_path, hidden):
    _hide(monkeypatch, *hidden)
    line = assert_usage_error(
        capsys, "demo", "--quick", "--out", str(tmp_path / "demo"), match="pip install 'attnkit[demo]'"
    )
    assert all(name in line for name in hidden)
    assert not (tmp_path / "demo").exists()  # nothing was started


def test_doctor_plot_without_matplotlib_is_one_line_before_any_work(capsys, monkeypatch, tmp_path):
    import attnkit.diagnostics

    def no_work(*args, **kwargs):
        raise AssertionError("the doctor ran before the missing dependency was reported")

    monkeypatch.setattr(attnkit.diagnostics, "doctor", no_work)
    _hide(monkeypatch, "matplotlib")
    assert_usage_error(
        capsys,
        "doctor",
        "--example",
        "uniform",
        "--plot",
        str(tmp_path / "p"),
        match="attnkit doctor --plot needs matplotlib, which is not installed: pip install 'attnkit[plot]'",
    )
    assert not (tmp_path / "p").exists()


def test_version(capsys):
    import attnkit

    code, out, err = run(capsys, "--version")
    assert code == 0 and out.strip() == f"attnkit {attnkit.__version__}" and err == ""


def test_bench_writes_results_under_the_current_directory_or_out(capfd, tmp_path, monkeypatch):
    bench = tmp_path / "checkout" / "benchmarks"
    bench.mkdir(parents=True)
    (bench / "writes.py").write_text(
        "import argparse, pathlib\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('--quick', action='store_true'); ap.add_argument('--out')\n"
        "a = ap.parse_args(); p = pathlib.Path(a.out); p.mkdir(parents=True, exist_ok=True)\n"
        "(p / 'writes.json').write_text('{}')\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["bench", "--quick", "--dir", str(bench)]) == 0
    assert (elsewhere / "benchmarks" / "results" / "writes.json").is_file()
    assert main(["bench", "--dir", str(bench), "--out", "mine"]) == 0
    assert (elsewhere / "mine" / "writes.json").is_file()
    assert [p.name for p in bench.iterdir()] == ["writes.py"]  # nothing written next to the scripts
    capfd.readouterr()


# -------------------------------------------------------------------------------------- packaging


def test_import_attnkit_stays_light():
    """Reading torch._dynamo's config at import cost ~2 s over `import torch`: nothing heavy at import."""
    code = (
        "import sys, attnkit\n"
        "heavy = ['torch._dynamo', 'torch._inductor', 'sympy', 'triton', 'transformers', 'matplotlib', 'rich']\n"
        "print([m for m in heavy if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_the_wheel_ships_types_and_builds_without_warnings(tmp_path):
    """py.typed (so type checkers read the annotations), no numpy requirement (nothing imports it), an SPDX
    license string (the table form is deprecated in setuptools), the version from attnkit.__version__."""
    import zipfile

    import attnkit

    import shutil

    source = tmp_path / "source"  # a copy: building leaves build/ and an egg-info behind
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(source),
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "Warning" not in log and "deprecated" not in log, log[-3000:]
    (wheel,) = tmp_path.glob("attnkit-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "attnkit/py.typed" in z.namelist()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist()), z.namelist()
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Version: {attnkit.__version__}" in meta and "License-Expression: MIT" in meta
    requires = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert requires == ["Requires-Dist: torch>=2.13", "Requires-Dist: safetensors>=0.4"], requires  # (save_pretrained)
    assert "Provides-Extra: demo" in meta


@pytest.mark.hf
def test_doctor_on_a_saved_hugging_face_model_running_attnkit_attention(capsys, tmp_path, attnkit_llama):
    model = attnkit_llama
    torch.save(model, tmp_path / "hf.pt")
    code, out, err = run(capsys, "doctor", "--model", str(tmp_path / "hf.pt"), "--seq-len", "8")
    assert code == 0, err
    assert "model.layers.0.self_attn" in out and "model.layers.1.self_attn" in out
    model.set_attn_implementation("eager")
    torch.save(model, tmp_path / "eager.pt")
    assert_usage_error(
        capsys,
        "doctor",
        "--model",
        str(tmp_path / "eager.pt"),
        "--seq-len",
        "8",
        match="attnkit.integrations.hf.from_hf(model)",
    )


def test_the_command_line_loads_a_saved_directory(tmp_path, capsys):
    from attnkit.cli import _load_model
    from attnkit.nn import DecoderConfig, DecoderLM

    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    model.save_pretrained(tmp_path)
    loaded = _load_model(str(tmp_path))
    assert isinstance(loaded, DecoderLM) and loaded.config == model.config


def test_bench_without_a_source_checkout_says_what_to_do(tmp_path, monkeypatch, capsys):
    """After `pip install attnkit` the package has no benchmarks/ beside it and the current directory has none."""
    monkeypatch.setattr(cli._commands, "_SOURCE_BENCHMARKS", tmp_path / "site-packages" / "benchmarks")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "not part of the installed package" in err and "attnkit[bench]" in err and "--dir" in err
    assert cli.main(["bench", "--dir", str(tmp_path / "nowhere")]) == 2
    assert "--dir" in capsys.readouterr().err
