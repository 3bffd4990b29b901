"""Dense attention: attnkit `auto` against PyTorch SDPA and the naive formula.

float32, B=1, H=8, D=64, L from 512 to 8192, forward and forward+backward; prints median time,
GFLOP/s and ratios in one table, measured in one process with interleaved repeats.

    python benchmarks/dense.py            # full run
    python benchmarks/dense.py --quick    # small sizes
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import attnkit
from _common import OUT_HELP, machine, save, table, timeit

NAIVE_LIMIT = 4096 * 4096 * 8  # score elements above which the naive formula is skipped (memory)


def naive(q, k, v, causal):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        L = s.shape[-1]
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [256, 512] if args.quick else [512, 1024, 2048, 4096, 8192]
    repeat = 3 if args.quick else 5
    B, H, D = 1, 8, 64
    rows = []
    for causal in (False, True):
        mask = attnkit.masks.causal() if causal else None
        for L in lengths:
            q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
            flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
            go = torch.randn(B, H, L, D)
            for mode in ("fwd", "fwd+bwd"):

                def wrap(f):
                    if mode == "fwd":

                        def run():
                            with torch.no_grad():
                                f()
                    else:

                        def run():
                            f().backward(go)

                    return run

                fns = {
                    "attnkit": wrap(lambda: attnkit.attention(q, k, v, mask=mask)),
                    "sdpa": wrap(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
                }
                if B * H * L * L <= NAIVE_LIMIT // (1 if mode == "fwd" else 2):
                    fns["naive"] = wrap(lambda: naive(q, k, v, causal))
                t = timeit(fns, repeat=repeat, budget_s=20 if not args.quick else 5)
                mult = 1 if mode == "fwd" else 3.5  # backward ~2.5x the forward's matmul work
                row = {
                    "mask": "causal" if causal else "none",
                    "L": L,
                    "pass": mode,
                    "attnkit ms": f"{t['attnkit'] * 1e3:.1f}",
                    "sdpa ms": f"{t['sdpa'] * 1e3:.1f}",
                    "naive ms": f"{t['naive'] * 1e3:.1f}" if "naive" in t else "skipped (memory)",
                    "attnkit GFLOP/s": f"{flops * mult / t['attnkit'] / 1e9:.1f}",
                    "attnkit/sdpa time": f"{t['attnkit'] / t['sdpa']:.3f}",
                    "naive/attnkit time": f"{t['naive'] / t['attnkit']:.2f}" if "naive" in t else "-",
                }
                rows.append(row)
                print(row, flush=True)
    cols = [
        "mask",
        "L",
        "pass",
        "attnkit ms",
        "sdpa ms",
        "naive ms",
        "attnkit GFLOP/s",
        "attnkit/sdpa time",
        "naive/attnkit time",
    ]
    print()
    print(f"dense attention, float32, B={B}, H={H}, D={D}; {machine()}")
    print(table(rows, cols))
    path = save("dense_quick" if args.quick else "dense", {"rows": rows}, out=args.out)
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
