"""Attention sinks: the ``flash`` backend with and without a per-head sink logit.

float32, B=1, H=8, D=64, causal, L = 4096 (default), 2 threads; forward and forward+backward, with
interleaved repeats (medians) in one process.  The ratio ``sinks / no sinks`` is the cost of the sinks:
a rescaling of each row's output and log-sum-exp after the kernel, and a row sum in the backward.

    python benchmarks/sinks.py             # L = 4096
    python benchmarks/sinks.py --quick     # L = 1024, fewer repeats (not saved)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attnkit
from attnkit import masks
from _common import OUT_HELP, machine, save, table, timeit

B, H, D = 1, 8, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    L = args.length or (1024 if args.quick else 4096)
    repeat = args.repeat or (3 if args.quick else 7)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_(True) for _ in range(3))
    sinks = torch.randn(H, generator=g).requires_grad_(True)
    dout = torch.randn(B, H, L, D, generator=g)
    causal = masks.causal()

    def fwd(s):
        def run():
            with torch.no_grad():
                attnkit.attention(q, k, v, mask=causal, sinks=s, backend="flash")

        return run

    def fwd_bwd(s):
        def run():
            out = attnkit.attention(q, k, v, mask=causal, sinks=s, backend="flash")
            grads = torch.autograd.grad(out, (q, k, v) if s is None else (q, k, v, s), dout)
            return grads

        return run

    rows = []
    for name, make in (("forward", fwd), ("forward+backward", fwd_bwd)):
        t = timeit({"no sinks": make(None), "sinks": make(sinks)}, repeat=repeat, budget_s=120.0)
        rows.append(
            {
                "pass": name,
                "L": L,
                "no sinks (ms)": f"{t['no sinks'] * 1e3:.1f}",
                "sinks (ms)": f"{t['sinks'] * 1e3:.1f}",
                "ratio": f"{t['sinks'] / t['no sinks']:.3f}",
            }
        )
    print(f"flash, causal, B={B} H={H} D={D} float32; {machine()}")
    print(table(rows, ["pass", "L", "no sinks (ms)", "sinks (ms)", "ratio"]))
    if args.length is None and not args.quick:  # (a smoke run leaves the recorded result alone)
        save("sinks", {"rows": rows}, out=args.out)


if __name__ == "__main__":
    main()
