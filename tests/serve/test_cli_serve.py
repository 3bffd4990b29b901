"""`attnkit serve MODEL_DIR`: starts, answers, and stops cleanly on SIGINT / SIGTERM; refuses what it cannot serve."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from attnkit.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _serve(model_dir, *extra):
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "attnkit",
            "serve",
            str(model_dir),
            "--port",
            "0",
            "--threads",
            "1",
            "--log-level",
            "warning",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 120
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "http://" in line:
            url = line.split("on ", 1)[1].split("/v1")[0]
            return proc, url, lines
    proc.kill()
    proc.wait(10)
    raise AssertionError("the server did not start:\n" + "".join(lines))


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """A context of 4096 positions: a request of 4000 tokens surely still streams when the signal comes."""
    from attnkit.serve import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("long") / "tiny", max_positions=4096)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_starts_answers_and_stops_on_a_signal(long_model_dir, sig):
    proc, url, _ = _serve(long_model_dir)
    try:
        assert url.startswith("http://127.0.0.1:")  # loopback by default
        assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
        body = {"model": "tiny", "prompt": "ba be", "max_tokens": 3, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 3
        # a streaming request still open when the signal comes is ended, not waited for
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json=dict(body, max_tokens=4000, stream=True, logit_bias={"2": -100}),
        ) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(sig)
            rest = list(lines)
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert "attnkit serve: stopped" in out and "Traceback" not in out
        assert any(json.loads(x[6:])["choices"][0]["finish_reason"] == "abort" for x in rest if x.startswith("data: {"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_serve_refuses_an_unsupported_family(tmp_path, capsys):
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    assert main(["serve", str(tmp_path / "gpt")]) == 2
    err = capsys.readouterr().err
    assert "'gpt2'" in err and "llama" in err and "mistral" in err
    assert main(["serve", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_serve_without_the_extra_names_it(model_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as on an install without attnkit[serve]
    assert main(["serve", str(model_dir)]) == 2
    assert "pip install 'attnkit[serve]'" in capsys.readouterr().err
