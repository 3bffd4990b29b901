"""Ring attention: one causal sequence on 1, 2 and 4 gloo processes; time, per-rank peak memory, balance.

float32, B=1, H=8, D=64, L=32768, causal: a forward then its backward.  Every configuration starts its
own processes (on 127.0.0.1), each rank holding L/W tokens; the 2 and 4 process runs compare the zigzag
and contiguous layouts.  Reported per configuration: wall time of the slowest rank (one run at full size,
median of 3 with --quick); the peak resident memory a rank added over its start, inputs included
(largest rank, smallest in parentheses); and the balance of the causal work, max / min across ranks of
the compute CPU time in the forward and the backward, and of the score elements computed.
"attnkit.attention, 1 process" is one process calling attnkit.attention on the whole sequence.

glibc keeps freed memory for reuse, so the resident peak over-counts live tensors by what it cached;
--live-memory makes it hand every freed block back at once (slower: every large tensor page-faults).

The processes share this machine's cores (one torch thread each by default, --threads), so time cannot
fall with W here: wall time and the CPU seconds of all ranks show the overhead, while the memory per
rank shows how it falls with W (not quite as 1/W: the travelling blocks are double-buffered).

    python benchmarks/ring.py            # L=32768, H=8, D=64 (tens of minutes on 2 cores)
    python benchmarks/ring.py --quick    # L=4096, H=4, D=32, 1 and 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import OUT_HELP, machine, save, table


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _worker(args) -> None:
    import torch.distributed as dist

    import attnkit
    from attnkit.distributed import ring

    W, rank = args.world, args.rank
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=W, timeout=timedelta(seconds=1800)
    )
    L, H, D = args.seq_len, args.heads, args.head_dim
    mask = attnkit.masks.causal()
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # load the kernels at a tiny size first
        tiny = torch.randn(1, H, 16, D)
        attnkit.attention(tiny, tiny, tiny, mask=mask)
        if args.mode == "ring":
            ring.ring_attention(tiny, tiny, tiny, mask=mask, layout=args.layout)  # 16 tokens per rank
    n = L if args.mode == "attention" else L // W
    base = _rss_mb()  # before the inputs: they are part of what each rank holds
    q, k, v = (torch.randn(1, H, n, D, generator=g).requires_grad_(True) for _ in range(3))

    def forward():
        if args.mode == "attention":
            return attnkit.attention(q, k, v, mask=mask)
        return ring.ring_attention(q, k, v, mask=mask, layout=args.layout)

    result = {"rank": rank, "fwd_s": [], "bwd_s": [], "cpu_s": [], "fwd_peak_mb": 0.0, "peak_mb": 0.0}
    for _ in range(args.repeat):
        ring._profile = {}
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        out = forward()
        dist.barrier()
        t1 = time.perf_counter()
        result["fwd_peak_mb"] = max(result["fwd_peak_mb"], _peak_mb() - base)
        out.sum().backward()
        dist.barrier()
        result["fwd_s"].append(t1 - t0)
        result["bwd_s"].append(time.perf_counter() - t1)
        result["cpu_s"].append(time.process_time() - c0)
        result["peak_mb"] = max(result["peak_mb"], _peak_mb() - base)
        del out
        q.grad = k.grad = v.grad = None
        for name, value in ring._profile.items():
            result.setdefault(name, []).append(value)
    result = {name: statistics.median(x) if isinstance(x, list) else x for name, x in result.items()}
    ring._profile = None
    dist.destroy_process_group()
    Path(args.worker_out).write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, world: int, layout: str, args, tmp: Path) -> list[dict]:
    port = _free_port()
    common = [
        "--seq-len",
        str(args.seq_len),
        "--heads",
        str(args.heads),
        "--head-dim",
        str(args.head_dim),
        "--repeat",
        str(args.repeat),
        "--threads",
        str(args.threads),
        "--mode",
        mode,
        "--layout",
        layout,
        "--world",
        str(world),
        "--port",
        str(port),
    ]
    env = dict(os.environ)
    if args.live_memory:  # glibc then returns every freed tensor to the OS at once: peak RSS ~ live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--rank",
                str(r),
                "--worker-out",
                str(tmp / f"{mode}_{layout}_{world}_{r}.json"),
                *common,
            ],
            env=env,
        )
        for r in range(world)
    ]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a worker of {mode} W={world} {layout} failed with exit code {p.returncode}")
    return [json.loads((tmp / f"{mode}_{layout}_{world}_{r}.json").read_text()) for r in range(world)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="L=4096, H=4, D=32, median of 3, up to 2 ranks")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default 1: on a shared, "
        "oversubscribed machine multi-threaded regions stall whenever one thread is descheduled)",
    )
    ap.add_argument(
        "--live-memory",
        action="store_true",
        help="fix glibc's mmap threshold so that the peak "
        "resident memory counts live tensors, not allocator caching (costs page faults: slower)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ring", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="zigzag", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    quick = args.quick
    args.seq_len = args.seq_len or (4096 if quick else 32768)
    args.heads = args.heads or (4 if quick else 8)
    args.head_dim = args.head_dim or (32 if quick else 64)
    args.repeat = args.repeat or (3 if quick else 1)
    if args.worker:
        _worker(args)
        return

    configs = [("attention", 1, "-"), ("ring", 1, "zigzag"), ("ring", 2, "zigzag"), ("ring", 2, "contiguous")]
    if not quick:  # four ranks oversubscribe a small machine: the full run only
        configs += [("ring", 4, "zigzag"), ("ring", 4, "contiguous")]
    rows, raw = [], []
    base_time = base_peak = None
    with tempfile.TemporaryDirectory() as tmp:
        for mode, world, layout in configs:
            ranks = _launch(mode, world, layout if layout != "-" else "zigzag", args, Path(tmp))
            raw.append({"mode": mode, "world": world, "layout": layout, "ranks": ranks})
            fwd = max(r["fwd_s"] for r in ranks)
            fb = fwd + max(r["bwd_s"] for r in ranks)
            peaks = [r["peak_mb"] for r in ranks]
            fwd_peaks = [r["fwd_peak_mb"] for r in ranks]
            cpu = [r.get("forward_cpu_s", 0.0) for r in ranks]
            bcpu = [r.get("backward_cpu_s", 0.0) for r in ranks]
            elems = [r.get("forward_elements", 0) for r in ranks]
            if mode == "ring" and world == 1:
                base_time, base_peak = fb, max(peaks)
            row = {
                "run": "attnkit.attention, 1 process" if mode == "attention" else f"ring, {world} x {layout}",
                "fwd s": f"{fwd:.2f}",
                "fwd+bwd s": f"{fb:.2f}",
                "CPU s, all ranks": f"{sum(r['cpu_s'] for r in ranks):.2f}",
                "fwd peak MB/rank": f"{max(fwd_peaks):.0f}",
                "fwd+bwd peak MB/rank": f"{max(peaks):.0f}" + (f" ({min(peaks):.0f})" if world > 1 else ""),
            }
            if mode == "ring":
                row["time vs ring 1"] = f"{fb / base_time:.2f}x"
                row["memory vs ring 1"] = f"{max(peaks) / base_peak:.2f}"
                row["fwd CPU s per rank"] = " ".join(f"{c:.2f}" for c in cpu)
                if world > 1:
                    row["fwd balance"] = f"{max(cpu) / max(min(cpu), 1e-9):.2f}"
                    row["bwd balance"] = f"{max(bcpu) / max(min(bcpu), 1e-9):.2f}"
                    row["work balance"] = f"{max(elems) / max(min(elems), 1):.2f}"
            rows.append(row)
            print(f"done: {row['run']}", flush=True)
    columns = [
        "run",
        "fwd s",
        "fwd+bwd s",
        "CPU s, all ranks",
        "time vs ring 1",
        "fwd peak MB/rank",
        "fwd+bwd peak MB/rank",
        "memory vs ring 1",
        "fwd CPU s per rank",
        "fwd balance",
        "bwd balance",
        "work balance",
    ]
    print(
        f"\nring attention, causal, float32, B=1 H={args.heads} L={args.seq_len} D={args.head_dim}; "
        f"{machine(threads=False)}; {args.threads} torch thread(s) per process; "
        f"{'glibc mmap threshold 64 KiB (--live-memory); ' if args.live_memory else ''}"
        f"{'median of ' + str(args.repeat) if args.repeat > 1 else 'one run'} per cell"
    )
    print(table(rows, columns))
    name = ("ring_quick" if quick else "ring") + ("_live_memory" if args.live_memory else "")
    path = save(
        name,
        {"seq_len": args.seq_len, "heads": args.heads, "head_dim": args.head_dim, "rows": rows, "raw": raw},
        out=args.out,
    )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
