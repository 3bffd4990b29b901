"""The benchmark scripts keep running as the library changes (nothing here times anything)."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    """Run benchmarks/SCRIPT with ``args`` from the repository root; it must succeed.  Its standard output."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_generate_benchmark_mixed_section_runs():
    """The mixed-workload section read the Engine's old per-step waste list and crashed after its table."""
    out = _run("generate.py", "--quick", "--no-compile", "--threads", "1", "--only", "mixed")
    assert "Engine (paged)" in out


def _load(name: str):
    """benchmarks/NAME.py as a module (its folder on sys.path for _common, as when it runs as a script)."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def _run_without(script: str, hidden: list[str], *args: str) -> subprocess.CompletedProcess:
    """Run benchmarks/SCRIPT as a script where the modules ``hidden`` cannot be imported."""
    code = (
        f"import runpy, sys\nfor m in {hidden!r}: sys.modules[m] = None\n"
        f"sys.argv = [{str(ROOT / 'benchmarks' / script)!r}, *{list(args)!r}]\n"
        f"runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_sparse_window_section_without_local_attention_is_a_skipped_column(monkeypatch):
    """A missing optional peer crashed the table with a KeyError after the first length."""
    import torch
    import torch.nn.functional as F

    sparse = _load("sparse")
    monkeypatch.setattr(sparse, "local_attention_peer", lambda window: None)  # as without the bench extra

    class NoCompileFlex:  # the table's FlexAttention column without minutes of torch.compile
        compile_s = 0.0

        def __init__(self, mask_mod, L):
            self.allowed = sparse.masks.sliding_window(256).to_dense(L, L)

        def __call__(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed)

    monkeypatch.setattr(sparse, "Flex", NoCompileFlex)
    notes = set()
    torch.manual_seed(0)
    rows = sparse.window_section([64, 96], 1, notes)
    assert [r["mode"] for r in rows] == ["fwd", "fwd+bwd"] * 2
    assert all(r["local-attention"] == "skipped" and r["local/flash"] == "-" for r in rows)
    assert any("local-attention is not installed" in n for n in notes)


def test_benchmarks_that_need_transformers_skip_without_it():
    for script in ("hf_models.py", "generate.py"):
        proc = _run_without(script, ["transformers"], "--quick", "--out", "/nonexistent/never-written")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "skipped" in proc.stdout and "attnkit[bench]" in proc.stdout, proc.stdout


def test_generate_quick_compiles_nothing_unless_asked():
    """--quick compiled two models (minutes each): quick means no compiled rows unless --compile is given."""
    generate = _load("generate")
    assert generate.parse_args(["--quick"]).compile is False
    assert generate.parse_args(["--quick", "--compile"]).compile is True
    assert generate.parse_args([]).compile is True
    assert generate.parse_args(["--no-compile"]).compile is False


def test_results_go_under_the_current_directory_or_out(tmp_path, monkeypatch):
    common = _load("_common")
    monkeypatch.chdir(tmp_path)
    path = common.save("probe", {"x": 1})
    assert path.resolve() == (tmp_path / "benchmarks" / "results" / "probe.json").resolve()
    assert common.save("probe", {}, out=tmp_path / "mine").parent == tmp_path / "mine"
    for script in sorted((ROOT / "benchmarks").glob("[!_]*.py")):  # each takes --out for `attnkit bench --out`
        assert re.search(r"""["']--out["']""", script.read_text()), script.name


def test_sinks_benchmark_runs():
    out = _run("sinks.py", "--length", "256", "--repeat", "1", "--threads", "1")
    assert "forward+backward" in out and "ratio" in out


def test_generate_contended_starts_its_busy_loop_and_always_stops_it():
    """--contended runs the sections beside a process of its own spinning on one core, stopped at the end,
    also when the run fails or is interrupted."""
    import os

    generate = _load("generate")
    with generate.busy_core() as proc:
        assert proc.poll() is None  # spinning
        if hasattr(os, "sched_getaffinity"):
            assert os.sched_getaffinity(proc.pid) == {max(os.sched_getaffinity(0))}
    assert proc.poll() is not None
    for error in (RuntimeError("a section failed"), KeyboardInterrupt()):
        try:
            with generate.busy_core() as proc:
                raise error
        except (RuntimeError, KeyboardInterrupt):
            pass
        assert proc.poll() is not None
    import contextlib

    procs = []
    real = generate.busy_core

    @contextlib.contextmanager
    def spy():
        with real() as p:
            procs.append(p)
            yield p

    generate.busy_core = spy
    generate.run = lambda args: (_ for _ in ()).throw(KeyboardInterrupt())  # interrupted inside the sections
    try:
        generate.main(["--contended", "--only", "decode"])
    except KeyboardInterrupt:
        pass
    assert len(procs) == 1 and procs[0].poll() is not None


def test_generate_long_context_section_runs(tmp_path):
    out = _run("generate.py", "--quick", "--no-compile", "--only", "longctx", "--out", str(tmp_path))
    assert "32k keys, auto: splitkv" in out and "x SDPA" in out


def test_generate_read_bandwidth_covers_every_decode_thread_count_with_its_spread():
    """The bandwidth limit is read at the thread count the decode steps ran at, from a median with its
    spread; an "auto" policy's decision is what the decode rows are compared at."""
    import torch

    import attnkit
    from attnkit.nn import DecoderConfig, DecoderLM

    generate = _load("generate")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bw = generate.read_bandwidth(passes=3, rounds=3)
        assert sorted(bw) == [1, 2] and torch.get_num_threads() == 2
        for b in bw.values():
            assert len(b["rates"]) == 3 and 0 < b["p10"] <= b["median"] <= b["p90"]
        both = generate.pooled(bw, bw)
        assert len(both[1]["rates"]) == 6 and both[1]["median"] == bw[1]["median"]
        assert generate.bandwidth_text(bw).startswith("1 thread ") and " GB/s (" in generate.bandwidth_text(bw)
        model = DecoderLM(DecoderConfig.preset("tiny")).eval()
        assert generate.decode_thread_count(model, 1) == 2  # not decided yet: torch's count
        attnkit.generate(model, [[1, 2, 3]], 6)
        assert generate.decode_thread_count(model, 1) in (1, 2)
    finally:
        torch.set_num_threads(before)


def test_cpu_engines_without_llama_cpp_or_ctranslate2_says_how_to_install_and_runs_the_rest(
    tmp_path, monkeypatch, capsys
):
    """The engine processes are replaced by canned answers (nothing is built or timed): a missing engine is
    an install hint, the others fill the table, with agreement against HF float32's tokens."""
    bench = _load("cpu_engines")
    monkeypatch.setattr(bench, "build_model", lambda folder, size: None)
    monkeypatch.setattr(bench, "has", lambda python, module: False)
    seen = []

    def spawn(python, spec, timeout):
        seen.append((spec["engine"], spec["mode"], [b["reference"] is not None for b in spec["batches"]]))
        tokens = [[5, 6, 7] if spec["mode"] != "int4" else [5, 6, 9] for _ in range(2)]
        return {
            "results": [
                {"prefill_s": 0.5, "total_s": 1.5, "tokens": tokens[: len(b["prompts"])]} for b in spec["batches"]
            ]
        }

    monkeypatch.setattr(bench, "spawn", spawn)
    out = tmp_path / "r.json"
    assert (
        bench.main(["--batches", "1", "2", "--prompt", "4", "--new", "3", "--work", str(tmp_path), "--out", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "pip install ctranslate2" in text and "llama-cpp-python is not installed" in text
    assert [e[:2] for e in seen] == [
        ("hf", "float32"),
        ("attnkit", "float32"),
        ("attnkit", "int8"),
        ("attnkit", "int8 act"),
        ("attnkit", "int4"),
    ]
    assert seen[0][2] == [False, False] and seen[1][2] == [True, True]  # HF's tokens are the reference
    rows = json.loads(out.read_text())["rows"]
    int4 = [r for r in rows if r["mode"] == "int4"]
    assert [r["agree"] for r in int4] == [2 / 3, 2 / 3] and rows[0]["decode_tok_s"] == 2.0  # 1 x 2 tokens / 1 s
    assert "batch 2" in text and "1.00x" in text


def test_cpu_engines_agreement_and_safetensors_reader(tmp_path):
    bench = _load("cpu_engines")
    assert bench.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 0], [4, 0, 6]]) == 4 / 6
    import torch
    from safetensors.torch import save_file

    t = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.float32)}
    save_file(t, tmp_path / "m.safetensors")
    got = bench._safetensors(tmp_path / "m.safetensors")
    assert set(got) == {"a", "b"} and all(torch.equal(torch.from_numpy(got[k].copy()), t[k]) for k in t)
