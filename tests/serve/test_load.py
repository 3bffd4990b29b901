"""The load test at a small size: concurrent streaming clients with mixed prompt and output lengths against one
server, a quarter of them disconnecting mid-stream (benchmarks/serve.py runs it with 64)."""

import asyncio
import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

import attnkit

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("_bench_serve", ROOT / "benchmarks" / "serve.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_concurrent_clients_some_leaving(start, served, server_log):
    bench = _bench()
    server = start(max_batch=6, cache_blocks=160, block_size=8, max_waiting=64)
    words = sorted(w for w in served.tokenizer.get_vocab() if w.isalpha())
    eos = list(served.eos_ids)
    jobs = bench.jobs_for(
        words, 20, seed=3, prompt_words=(1, 40), max_tokens=(1, 24), disconnect_share=0.25, eos_id=eos[0]
    )
    records, _ = asyncio.run(bench.run_clients(server.url, "tiny", jobs, len(jobs), timeout=120))

    def expected(job):
        ids = served.tokenizer(job["prompt"]).input_ids
        return served.tokenizer.decode(
            attnkit.generate(served.model, [ids], job["max_tokens"], eos_id=eos)[0], skip_special_tokens=True
        )

    assert server.engine.wait_idle(30)
    problems = bench.check_load(records, expected, httpx.get(server.url + "/metrics").text)
    assert not problems, "\n".join(problems)
    assert sum(r["left"] for r in records) == 5  # every fourth client went away mid-stream
    cache = server.engine.engine.cache
    assert cache.stats()["blocks_used"] == 0 and cache.num_free_blocks == cache.num_blocks  # the pool is empty
    assert server.engine.submitted == len(jobs) and sum(server.engine.finished.values()) == len(jobs)
    assert not server_log  # no error and no traceback in the server's log


def test_check_load_sees_a_wrong_text_and_a_lost_request():
    bench = _bench()
    job = {"prompt": "ba", "max_tokens": 2, "disconnect_after": None}
    good = {
        "job": job,
        "text": "ka ke",
        "times": [0.1, 0.2],
        "done": 1,
        "finish_reason": "length",
        "ids": {"a"},
        "error": None,
        "left": False,
    }
    metrics = (
        "attnkit_kv_blocks_used 0\nattnkit_requests_running 0\nattnkit_requests_waiting 0\n"
        'attnkit_requests_finished_total{finish_reason="length"} 1\n'
    )
    assert bench.check_load([good], lambda j: "ka ke", metrics) == []
    assert "differs" in bench.check_load([good], lambda j: "ka ko", metrics)[0]
    lost = dict(good, done=0, finish_reason=None)
    assert "[DONE]" in bench.check_load([lost], lambda j: "ka ke", metrics)[0]
    assert "finished 1 requests, the clients sent 2" in " ".join(
        bench.check_load([good, dict(good, ids={"b"})], lambda j: "ka ke", metrics)
    )
    assert "kv_blocks_used is 3" in " ".join(
        bench.check_load([good], lambda j: "ka ke", metrics.replace("used 0", "used 3"))
    )
