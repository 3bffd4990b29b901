"""The decode-product choices are kept per machine between processes: a later process reads the stored choice
and times nothing; another machine's, a corrupt or an unwritable file falls back to measuring; a choice with
signs of a busy core is not stored; ``ATTNKIT_CACHE_DIR=""`` turns storing off; ``decode_products`` says where
each choice came from.  The measurement itself is replaced by a counted stand-in with fixed times, so what is
tested is the bookkeeping, not the machine's speed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnkit.nn import _products, clear_decode_choices, decode_products, linear

OUT, IN = 24, 40
PRODUCT = f"1x{OUT}x{IN}@1"  # the stored key of one row x (24, 40) at one thread
COSTS = {"linear": 2e-6, "columns": 1e-6, "onednn": 3e-6}  # "columns" is the clear winner


@pytest.fixture
def measured(monkeypatch, tmp_path, one_thread):
    """A fresh process's state (no choice in memory, no file read yet), choices stored under tmp_path, and
    ``_measure`` replaced by a stand-in that records its calls and returns ``costs[threads]`` (median and
    fastest alike unless ``fastest[threads]`` says otherwise)."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    calls, costs, fastest = [], {}, {}

    def measure(rows, out_features, in_features, threads, kernels, w):
        calls.append((rows, out_features, in_features, threads))
        seconds = {k: costs.get(threads, COSTS)[k] for k in kernels}
        quick = {k: fastest.get(threads, seconds)[k] for k in kernels}
        return _products.ProductChoice(
            rows, out_features, in_features, threads, _products._pick(seconds), seconds, quick
        )

    def fresh():
        monkeypatch.setattr(_products, "_CHOICES", {})
        monkeypatch.setattr(_products, "_FILES", {})
        monkeypatch.setattr(_products, "_PROBLEM", [])

    fresh()
    monkeypatch.setattr(_products, "_measure", measure)
    return calls, costs, fastest, fresh


def _product(rows=1):
    """One decode product through attnkit.nn.linear, checked against the float64 product."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, IN, generator=g), torch.randn(OUT, IN, generator=g)
    with torch.no_grad():
        got = linear(x, w)
    ref = x.double() @ w.double().T
    naive = (F.linear(x, w).double() - ref).abs().max().item()
    assert (got.double() - ref).abs().max().item() <= 2 * naive + 1e-6 + 1e-5 * ref.abs().max().item()


def _file(tmp_path: Path) -> Path:
    (found,) = tmp_path.glob("decode-choices-*.json")
    return found


def test_a_stored_choice_is_reused_without_timing_and_explained(measured, tmp_path):
    calls, _, _, fresh = measured
    _product()
    assert calls == [(1, OUT, IN, 1)]
    first = str(decode_products())
    assert "(measured now)" in first and str(_file(tmp_path)) in first
    record = json.loads(_file(tmp_path).read_text())["choices"][PRODUCT]
    assert record["kernel"] == "columns" and record["seconds"]["columns"] == COSTS["columns"]
    assert not list(tmp_path.glob(".*tmp"))  # (no temporary file left beside it)

    fresh()  # a new process on the same machine
    _product()
    _product()
    assert calls == [(1, OUT, IN, 1)]  # nothing timed again
    (choice,) = decode_products().choices
    assert choice.origin == "stored" and choice.kernel == "columns" and choice.seconds == record["seconds"]
    text = str(decode_products())
    assert "(stored: measured by an earlier process on this machine)" in text
    assert f"stored choices: {_file(tmp_path)}" in text
    assert f"columns {4 * OUT * IN / COSTS['columns'] / 1e9:.1f} GB/s" in text


def test_a_new_process_reads_the_stored_choice_and_times_nothing(measured, tmp_path):
    calls, _, _, _ = measured
    _product()
    assert len(calls) == 1
    child = f"""
import torch
from attnkit.nn import _products, decode_products, linear
torch.set_num_threads(1)
timed = []
real = _products._measure
_products._measure = lambda *a: timed.append(a[:4]) or real(*a)
with torch.no_grad():
    linear(torch.randn(1, {IN}), torch.randn({OUT}, {IN}))
print(len(timed), [(c.origin, c.kernel) for c in decode_products().choices])
"""
    env = {**os.environ, "ATTNKIT_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(_products.__file__).parents[2]), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(maxsplit=1) == ["0", "[('stored', 'columns')]\n"]


def test_another_machines_file_is_measured_again_and_replaced(measured, tmp_path):
    calls, _, _, fresh = measured
    _product()
    data = json.loads(_file(tmp_path).read_text())
    data["machine"]["cpu"] = "another CPU"  # (the file of this machine's name holds another machine's choices)
    data["choices"][PRODUCT]["kernel"] = "onednn"
    _file(tmp_path).write_text(json.dumps(data))
    fresh()
    _product()
    assert len(calls) == 2 and decode_products().choices[0].origin == "measured"
    data = json.loads(_file(tmp_path).read_text())
    assert data["machine"]["cpu"] != "another CPU" and data["choices"][PRODUCT]["kernel"] == "columns"


@pytest.mark.parametrize(
    "text",
    [
        '{"format": 1, "machine": {"cp',  # cut short
        "[1, 2]",
        "",
        "\x00\xff not json",
        None,  # a valid file whose record of the product is malformed
    ],
)
def test_a_corrupt_file_falls_back_to_measuring(measured, tmp_path, text):
    calls, _, _, fresh = measured
    _product()
    if text is None:
        data = json.loads(_file(tmp_path).read_text())
        data["choices"][PRODUCT] = {"kernel": "columns", "seconds": {"linear": -1.0}, "fastest": "x"}
        text = json.dumps(data)
    _file(tmp_path).write_text(text, errors="surrogateescape")
    fresh()
    _product()
    assert len(calls) == 2 and decode_products().choices[0].origin == "measured"
    assert json.loads(_file(tmp_path).read_text())["choices"][PRODUCT]["kernel"] == "columns"  # (written anew)


def test_an_unwritable_folder_keeps_the_choices_in_the_process(measured, tmp_path, monkeypatch):
    calls, _, _, _ = measured
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "a-file" / "attnkit"))  # (cannot be made)
    _product()
    _product()
    assert len(calls) == 1
    report = decode_products()
    assert report.problem is not None and "could not write" in report.problem
    assert "the choices serve this process only" in str(report)


def test_storing_is_off_with_an_empty_cache_dir(measured, tmp_path, monkeypatch):
    calls, _, _, fresh = measured
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _product()
    fresh()
    _product()
    assert len(calls) == 2  # each process measures
    assert list(tmp_path.iterdir()) == []
    assert decode_products().file is None and "stored choices: off" in str(decode_products())


def test_clear_decode_choices_forgets_and_measures_again(measured, tmp_path):
    calls, _, _, _ = measured
    _product()
    path = _file(tmp_path)
    assert clear_decode_choices() == str(path) and not path.exists()
    assert decode_products().choices == ()
    _product()
    assert len(calls) == 2 and _file(tmp_path) == path
    assert clear_decode_choices() == str(path) and clear_decode_choices() is None


def test_a_choice_measured_on_a_busy_core_is_not_stored(measured, tmp_path):
    """Two signs of another process on a core: the fastest calls pick another kernel than the medians (most
    calls waited), or a candidate ran CONTENDED times slower at more threads than at one.  Such a choice serves
    this process; the next one measures it again, and keeps what was measured cleanly."""
    calls, costs, fastest, fresh = measured
    costs[2] = {"linear": 2e-6, "columns": 10 * _products.CONTENDED * COSTS["columns"], "onednn": 3e-6}
    fastest[1] = {"linear": 0.5e-6, "columns": 1e-6, "onednn": 3e-6}  # (the fastest calls pick linear)
    torch.set_num_threads(2)
    _product()
    assert calls == [(1, OUT, IN, 2), (1, OUT, IN, 1)]
    text = str(decode_products())
    assert "not stored: its fastest calls pick linear" in text
    assert "not stored: columns ran 20.0x slower at 2 threads than at 1" in text
    assert not list(tmp_path.iterdir())  # nothing clean to store

    costs.clear()
    fastest.clear()
    fresh()
    _product()
    assert len(calls) == 4 and "not stored" not in str(decode_products())
    assert sorted(json.loads(_file(tmp_path).read_text())["choices"]) == [PRODUCT, f"1x{OUT}x{IN}@2"]
