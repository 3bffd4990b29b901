"""Serving: `attnkit serve` against `transformers serve` on one model, one machine, loopback only.

Two parts:

* **load check** (``--load-clients N``, default 64): N concurrent streaming clients with mixed prompt and output
  lengths against `attnkit serve`, a quarter of them disconnecting mid-stream; every completed request's text must
  equal ``attnkit.generate`` of that request alone (greedy, float32), the block pool must be empty at the end, no
  request lost or duplicated (each completed stream ends with one ``[DONE]``; the server counts every request as
  finished), and no traceback in the server's log.  Exit code 1 if any of it fails.
* **throughput** at concurrency 1, 8 and 32 (``--concurrency``): requests/s, output tokens/s, time to first token
  and inter-token latency (p50/p99) of streamed chat completions, for each server in ``--peers`` (``attnkit``,
  ``transformers``: `transformers serve` with continuous batching).

The model is a random-weight Llama written by :func:`attnkit.serve.make_demo_model` (``--model-dir`` to use another
HF folder); output tokens are counted by re-tokenizing each reply with the model's tokenizer (both servers alike).
Every server is a subprocess of this script, always stopped at the end; every request loop is bounded in count and
time (``--timeout`` per request).

    python benchmarks/serve.py --quick      # a small load check and concurrency 1, 8 (attnkit only)
    python benchmarks/serve.py              # the load check with 64 clients, then both servers at 1, 8, 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _common import OUT_HELP, save, table

# ----------------------------------------------------------------------------------------- clients


def jobs_for(
    words: list[str],
    n: int,
    *,
    seed: int,
    prompt_words=(2, 60),
    max_tokens=(4, 48),
    disconnect_share: float = 0.0,
    eos_id: int | None = None,
) -> list[dict]:
    """``n`` requests with random prompts of made-up words and random output lengths; a ``disconnect_share`` of
    them (every 1/share-th) leave after a few chunks (``disconnect_after``) and ask for many tokens with ``eos_id``
    banned, so they are surely still running when they go."""
    rng = random.Random(seed)
    every = round(1 / disconnect_share) if disconnect_share else 0
    jobs = []
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(*prompt_words)))
        leaves = bool(every) and i % every == every - 1
        jobs.append(
            {
                "prompt": prompt,
                "max_tokens": 200 if leaves else rng.randint(*max_tokens),
                "disconnect_after": rng.randint(1, 4) if leaves else None,
                "no_eos": {str(eos_id): -100} if leaves and eos_id is not None else None,
            }
        )
    return jobs


async def _one(client: httpx.AsyncClient, url: str, model: str, job: dict, chat: bool, timeout: float) -> dict:
    body = {"model": model, "max_tokens": job["max_tokens"], "temperature": 0, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": job["prompt"]}]
    else:
        body["prompt"] = job["prompt"]
    if job.get("no_eos"):
        body["logit_bias"] = job["no_eos"]
    rec = {
        "job": job,
        "text": "",
        "times": [],
        "done": 0,
        "finish_reason": None,
        "ids": set(),
        "error": None,
        "left": False,
    }
    start = time.perf_counter()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + path, json=body) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                    return rec
                chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        rec["done"] += 1
                        continue
                    chunk = json.loads(data)
                    rec["ids"].add(chunk.get("id"))
                    for c in chunk.get("choices", []):
                        piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                        if piece:
                            rec["text"] += piece
                            rec["times"].append(time.perf_counter() - start)
                            chunks += 1
                        if c.get("finish_reason"):
                            rec["finish_reason"] = c["finish_reason"]
                    if job.get("disconnect_after") and chunks >= job["disconnect_after"]:
                        rec["left"] = True
                        break  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, TimeoutError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["wall"] = time.perf_counter() - start
    return rec


async def run_clients(
    url: str, model: str, jobs: list[dict], concurrency: int, *, chat: bool = False, timeout: float = 120.0
) -> tuple[list[dict], float]:
    """Run ``jobs`` with at most ``concurrency`` in flight; returns their records (in job order) and the wall
    time."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def run(job):
            async with sem:
                return await _one(client, url, model, job, chat, timeout)

        start = time.perf_counter()
        records = await asyncio.gather(*(run(j) for j in jobs))
        return list(records), time.perf_counter() - start


def check_load(records: list[dict], expected_text, metrics_text: str) -> list[str]:
    """What is wrong with a load run: a completed request whose text differs from ``expected_text(job)``, a lost
    or duplicated stream, a non-empty pool or queue, a server count that differs from the clients'."""
    problems = []
    for i, rec in enumerate(records):
        job = rec["job"]
        if rec["error"]:
            problems.append(f"request {i}: {rec['error']}")
        elif rec["left"]:
            continue
        elif rec["done"] != 1 or rec["finish_reason"] is None or len(rec["ids"]) != 1:
            problems.append(
                f"request {i}: {rec['done']} [DONE], finish_reason {rec['finish_reason']}, ids {rec['ids']}"
            )
        elif rec["text"] != expected_text(job):
            problems.append(
                f"request {i}: text {rec['text'][:60]!r} differs from generate's {expected_text(job)[:60]!r}"
            )
    ids = [next(iter(r["ids"])) for r in records if len(r["ids"]) == 1]
    if len(set(ids)) != len(ids):
        problems.append("two streams share an id")
    values = {}
    for line in metrics_text.splitlines():
        m = re.match(r"^(attnkit_\w+)(\{[^}]*\})? (\S+)$", line)
        if m:
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    for name in ("attnkit_kv_blocks_used", "attnkit_requests_running", "attnkit_requests_waiting"):
        if values.get(name) != 0:
            problems.append(f"{name} is {values.get(name)} after the run, not 0")
    finished = sum(v for k, v in values.items() if k.startswith("attnkit_requests_finished_total"))
    if finished != len(records):
        problems.append(f"the server finished {finished:g} requests, the clients sent {len(records)}")
    left = sum(r["left"] for r in records)
    aborted = values.get('attnkit_requests_finished_total{finish_reason="abort"}', 0)
    if aborted != left:
        problems.append(f"{left} clients left mid-stream but the server aborted {aborted:g} requests")
    return problems


def wait_idle(url: str, timeout: float = 30.0) -> str:
    """The server's /metrics once nothing runs or waits (at most ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        busy = re.search(r"^attnkit_requests_(running|waiting) [1-9]", text, re.M)
        if not busy or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def latency_summary(records: list[dict], wall: float, count_tokens) -> dict:
    """requests/s, output tokens/s, TTFT and ITL p50/p99 (milliseconds) of completed records."""
    done = [r for r in records if not r["error"]]
    ttft = [r["times"][0] for r in done if r["times"]]
    itl = [b - a for r in done for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(count_tokens(r["text"]) for r in done)

    def pct(xs, q):
        return (
            round(1000 * statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 1)
            if len(xs) > 1
            else (round(1000 * xs[0], 1) if xs else None)
        )

    return {
        "requests": len(done),
        "failed": len(records) - len(done),
        "req_per_s": round(len(done) / wall, 2),
        "out_tok_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
    }


# ----------------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (its output in ``log``), ready once GET /v1/models answers; always stopped."""

    def __init__(self, cmd: list[str], port: int, log: Path, *, ready_s: float = 300.0, env=None):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._file = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + ready_s
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}: {log.read_text()[-1500:]}")
            try:
                r = httpx.get(self.url + "/v1/models", timeout=5)
                if r.status_code == 200:
                    self.models = [m["id"] for m in r.json()["data"]]
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{cmd[0]} did not answer within {ready_s:.0f} s: {log.read_text()[-1500:]}")
            time.sleep(0.5)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._file.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def attnkit_server(model_dir: Path, log: Path, args) -> Server:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "attnkit",
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-batch",
        str(args.max_batch),
        "--cache-blocks",
        str(args.cache_blocks),
        "--block-size",
        "16",
        "--max-waiting",
        "1024",
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.max_batched_tokens is not None:
        cmd += ["--max-batched-tokens", str(args.max_batched_tokens)]
    env = dict(os.environ)
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return Server(cmd, port, log, env=env)


def transformers_server(model_dir: Path, log: Path, args) -> Server:
    exe = shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))
    port = free_port()
    cmd = [exe, "serve", str(model_dir), "--port", str(port), "--continuous-batching"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return Server(cmd, port, log, env=env)


PEERS = {"attnkit": attnkit_server, "transformers": transformers_server}


# ----------------------------------------------------------------------------------------- main


def load_check(model_dir: Path, workdir: Path, args) -> tuple[dict, list[str]]:
    import attnkit
    from attnkit.serve import load_model_dir

    served = load_model_dir(model_dir)
    words = [w for w in served.tokenizer.get_vocab() if w.isalpha()]
    eos = list(served.eos_ids)
    jobs = jobs_for(sorted(words), args.load_clients, seed=1, disconnect_share=0.25, eos_id=eos[0] if eos else None)

    def expected(job):
        ids = served.tokenizer(job["prompt"]).input_ids
        tokens = attnkit.generate(served.model, [ids], job["max_tokens"], eos_id=eos)[0]
        return served.tokenizer.decode(tokens, skip_special_tokens=True)

    log = workdir / "attnkit-load.log"
    with attnkit_server(model_dir, log, args) as server:
        records, wall = asyncio.run(run_clients(server.url, server.models[0], jobs, len(jobs), timeout=args.timeout))
        metrics = wait_idle(server.url)
        problems = check_load(records, expected, metrics)
        code = server.stop()
    text = log.read_text()
    if "Traceback" in text:
        problems.append("a traceback in the server log:\n" + text[text.index("Traceback") :][:2000])
    if code != 0:
        problems.append(f"the server exited with {code} after SIGINT")
    left = sum(r["left"] for r in records)
    return {
        "clients": len(jobs),
        "left_mid_stream": left,
        "completed": len(jobs) - left,
        "wall_s": round(wall, 2),
        "problems": problems,
    }, problems


def throughput(model_dir: Path, workdir: Path, args) -> list[dict]:
    from attnkit.serve import load_model_dir

    tokenizer = load_model_dir(model_dir).tokenizer
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha())

    def count(text):
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    rows = []
    for peer in args.peers.split(","):
        try:
            server = PEERS[peer](model_dir, workdir / f"{peer}.log", args)
        except (RuntimeError, OSError) as e:
            print(f"{peer}: could not start ({str(e)[:400]})")
            rows.append({"server": peer, "note": f"could not start: {str(e)[:200]}"})
            continue
        with server:
            model = server.models[0]
            asyncio.run(
                run_clients(server.url, model, jobs_for(words, 2, seed=9), 2, chat=True, timeout=args.timeout)
            )  # warm-up
            for conc in [int(c) for c in args.concurrency.split(",")]:
                n = max(args.min_requests, args.requests_per_client * conc)
                jobs = jobs_for(words, n, seed=conc, prompt_words=(8, 64), max_tokens=(args.max_tokens,) * 2)
                records, wall = asyncio.run(run_clients(server.url, model, jobs, conc, chat=True, timeout=args.timeout))
                row = {"server": peer, "concurrency": conc, **latency_summary(records, wall, count)}
                errors = [r["error"] for r in records if r["error"]]
                if errors:
                    row["note"] = errors[0][:120]
                rows.append(row)
                print(table([row], list(row)), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 load clients; attnkit at concurrency 1 and 8")
    ap.add_argument("--model-dir", help="an HF model folder (default: a random Llama written here)")
    ap.add_argument(
        "--size",
        default="small",
        choices=["tiny", "small"],
        help="the written model: tiny (64 wide, 2 layers) or small (256 wide, 4 layers; default)",
    )
    ap.add_argument("--load-clients", type=int, default=64, help="clients of the load check (0: skip it)")
    ap.add_argument("--peers", default=None, help="servers to time (default attnkit,transformers; --quick: attnkit)")
    ap.add_argument("--concurrency", default=None, help="client counts (default 1,8,32; --quick: 1,8)")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per throughput request")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--cache-blocks", type=int, default=1024)
    ap.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="attnkit's tokens per step (default: the server's, 512; 0: each prompt prefilled alone)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads of each server (default: torch's)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request at most")
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args(argv)
    if args.quick:
        args.load_clients = min(args.load_clients, 16)
        args.peers, args.concurrency = args.peers or "attnkit", args.concurrency or "1,8"
        args.size, args.requests_per_client, args.max_tokens = "tiny", 1, 16
    args.peers, args.concurrency = args.peers or "attnkit,transformers", args.concurrency or "1,8,32"
    from attnkit.serve import make_demo_model

    with tempfile.TemporaryDirectory(prefix="attnkit-serve-bench-") as tmp:
        work = Path(tmp)
        if args.model_dir:
            model_dir = Path(args.model_dir)
        elif args.size == "tiny":
            model_dir = make_demo_model(work / "tiny", max_positions=1024)
        else:
            model_dir = make_demo_model(
                work / "small", vocab_words=2000, hidden_size=256, layers=4, heads=8, kv_heads=4, max_positions=1024
            )
        print(
            f"model: {model_dir.name}; load: {os.getloadavg()[0]:.2f} (1-minute load average at the start), "
            f"{os.cpu_count()} cores",
            flush=True,
        )
        payload: dict = {"model": model_dir.name, "load_avg_start": os.getloadavg()[0]}
        failed = False
        if args.load_clients:
            summary, problems = load_check(model_dir, work, args)
            payload["load_check"] = summary
            print(
                f"load check: {summary['clients']} clients, {summary['left_mid_stream']} left mid-stream, "
                f"{summary['wall_s']} s: " + ("OK" if not problems else "FAILED\n  " + "\n  ".join(problems)),
                flush=True,
            )
            failed = bool(problems)
        rows = throughput(model_dir, work, args) if args.concurrency else []
        payload["throughput"] = rows
        payload["load_avg_end"] = os.getloadavg()[0]
        if rows:
            cols = [
                "server",
                "concurrency",
                "requests",
                "failed",
                "req_per_s",
                "out_tok_per_s",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "itl_p50_ms",
                "itl_p99_ms",
            ]
            print(table(rows, cols))
        if not args.quick:
            print(f"saved {save('serve', payload, args.out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
