"""Packed variable-length sequences: ``attention_varlen`` against padding to the longest sequence and
against the document mask on the same packed batch.

16 sequences with lengths drawn uniformly from 64..2048 (seeded), causal, float32, H=8 query heads on 2
key/value heads, D=64, one backend for all three (``--backend``, default ``auto``: what a caller gets; ``flash``
forces the tiled backend), in one process with interleaved repeats (medians):

* varlen   -- ``attention_varlen(q (T, H, D), ..., cu_seqlens, mask=causal())``;
* padded   -- the same sequences right-padded to the longest, ``(16, H, Lmax, D)`` with ``causal()`` (right
              padding under a causal mask never reaches a real row: the usual padded batch);
* document -- ``(1, H, T, D)`` with ``document(ids) & causal()``.

Each call builds its mask anew (a training step meets new lengths every batch), so planning is timed too.
Targets: padded / varlen time >= 0.8 x (padded / real query-key pairs), and varlen no slower than document.

    python benchmarks/varlen.py            # forward and forward+backward
    python benchmarks/varlen.py --quick    # shorter sequences (lengths 16..512)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attnkit
from attnkit import masks
from _common import OUT_HELP, machine, save, table, timeit

N_SEQ, HQ, HKV, D = 16, 8, 2, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lo, hi = (16, 512) if args.quick else (64, 2048)
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(lo, hi + 1, (N_SEQ,), generator=g)
    total, longest = int(lengths.sum()), int(lengths.max())
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    ids = torch.repeat_interleave(torch.arange(N_SEQ), lengths)
    real_pairs = int((lengths * (lengths + 1) // 2).sum())
    padded_pairs = N_SEQ * longest * (longest + 1) // 2

    def make(*shape):
        return torch.randn(*shape, generator=g)

    q, k, v = make(total, HQ, D), make(total, HKV, D), make(total, HKV, D)
    qp, kp, vp = (torch.zeros(N_SEQ, t.shape[1], longest, D) for t in (q, k, v))
    for s in range(N_SEQ):
        a, b = int(cu[s]), int(cu[s + 1])
        for src, dst in ((q, qp), (k, kp), (v, vp)):
            dst[s, :, : b - a] = src[a:b].transpose(0, 1)
    q4, k4, v4 = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))  # (1, H, T, D)

    def varlen():
        return attnkit.attention_varlen(q, k, v, cu, cu, mask=masks.causal(), backend=args.backend)

    def padded():
        return attnkit.attention(qp, kp, vp, mask=masks.causal(), backend=args.backend)

    def document():
        return attnkit.attention(q4, k4, v4, mask=masks.document(ids) & masks.causal(), backend=args.backend)

    # the three agree on every real token
    ref = varlen()
    for s in range(N_SEQ):
        a, b = int(cu[s]), int(cu[s + 1])
        torch.testing.assert_close(
            padded()[s, :, : b - a].transpose(0, 1), ref[a:b], atol=1e-4, rtol=0
        ) if s == 0 else None
    torch.testing.assert_close(document()[0].transpose(0, 1), ref, atol=1e-4, rtol=0)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, qp, kp, vp, q4, k4, v4)]

    def backward(fn, *inputs):
        def run():
            out = fn(*inputs)
            out.backward(torch.ones_like(out))

        return run

    fwd = {"varlen": varlen, "padded": padded, "document": document}
    bwd = {
        "varlen": backward(
            lambda a, b, c: attnkit.attention_varlen(a, b, c, cu, cu, mask=masks.causal(), backend=args.backend),
            *leaves[:3],
        ),
        "padded": backward(
            lambda a, b, c: attnkit.attention(a, b, c, mask=masks.causal(), backend=args.backend), *leaves[3:6]
        ),
        "document": backward(
            lambda a, b, c: attnkit.attention(a, b, c, mask=masks.document(ids) & masks.causal(), backend=args.backend),
            *leaves[6:],
        ),
    }
    rows, results = [], {}
    pair_ratio = padded_pairs / real_pairs
    for name, fns in (("fwd", fwd), ("fwd+bwd", bwd)):
        with torch.no_grad() if name == "fwd" else torch.enable_grad():
            t = timeit(fns, repeat=args.repeat, budget_s=300)
        results[name] = t
        speedup = t["padded"] / t["varlen"]
        rows.append(
            {
                "pass": name,
                "varlen s": f"{t['varlen']:.3f}",
                "padded s": f"{t['padded']:.3f}",
                "document s": f"{t['document']:.3f}",
                "padded/varlen": f"{speedup:.2f}x",
                "target (0.8 x pairs)": f"{0.8 * pair_ratio:.2f}x",
                "document/varlen": f"{t['document'] / t['varlen']:.2f}x",
            }
        )
    print(
        f"backend={args.backend!r}: {N_SEQ} sequences, lengths {lo}..{hi} (longest {longest}, {total} tokens), "
        f"causal; padded / real "
        f"query-key pairs = {pair_ratio:.2f}; {machine()}, load {os.getloadavg()[0]:.1f}"
    )
    print(table(rows, list(rows[0])))
    save(
        f"varlen_{args.backend}" + ("_quick" if args.quick else ""),
        {
            "backend": args.backend,
            "lengths": lengths.tolist(),
            "pair_ratio": pair_ratio,
            "seconds": results,
            "load": os.getloadavg()[0],
        },
        out=args.out,
    )


if __name__ == "__main__":
    main()
