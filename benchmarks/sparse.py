"""Sparse attention: attnkit's ``flash`` backend against SDPA with a dense mask, FlexAttention,
``local-attention`` and the naive formula.

float32, B=1, H=8, D=64, 2 threads (default), measured in one process with interleaved repeats, the
order reversed every other round (medians).  Sections:

* window   -- causal sliding window of 256 (keys ``p-256 .. p``: local-attention's ``window_size=256``)
              at L = 2048 / 8192 / 16384, forward and forward+backward;
* density  -- random block-sparse masks (128 x 128 blocks) at 5 / 10 / 25 / 50 % density vs dense;
* document -- 16 packed sequences of random lengths (document mask), 16384 tokens;
* causal   -- dense causal, flash vs SDPA ``is_causal`` (auto would pick SDPA here);
* memory   -- forward+backward at L = 65536, one head, causal sliding window 512: peak RSS.

FlexAttention is ``torch.compile``d ``flex_attention`` with ``create_block_mask``; its compile time is
reported separately, and a backward that fails on CPU is reported as such.  Peers that would exceed
memory (the naive formula's L x L scores) are skipped and the table says so.

    python benchmarks/sparse.py            # full run (tens of minutes on 2 cores)
    python benchmarks/sparse.py --quick    # small sizes, one FlexAttention compile (about a minute)
    python benchmarks/sparse.py --only window
    python benchmarks/sparse.py --only window --lengths 2048    # one size
    python benchmarks/sparse.py --only density --densities 0.05 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import attnkit
from attnkit import masks
from _common import OUT_HELP, machine, save, table

B, H, D = 1, 8, 64
NAIVE_LIMIT = 1 << 28  # score elements (B*H*L*L) above which the naive formula is skipped (1 GiB per tensor)
SECTIONS = ("window", "density", "document", "causal", "memory")


# ------------------------------------------------------------------------------ peers


def naive(q, k, v, allowed):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


class Flex:
    """``torch.compile``d flex_attention with a block mask; compile time measured on the first call."""

    def __init__(self, mask_mod, L):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.reset()  # compile each size from scratch, with static shapes
        t0 = time.perf_counter()
        self.block_mask = create_block_mask(mask_mod, None, None, L, L, device="cpu")
        self.fn = torch.compile(flex_attention, dynamic=False)
        self.block_mask_s = time.perf_counter() - t0
        self.compile_s = None
        self.backward_error = None

    def __call__(self, q, k, v):
        if self.compile_s is None:
            t0 = time.perf_counter()
            out = self.fn(q, k, v, block_mask=self.block_mask)
            self.compile_s = time.perf_counter() - t0
            return out
        return self.fn(q, k, v, block_mask=self.block_mask)


def local_attention_peer(window: int):
    """The ``local-attention`` package's causal window, or None when it is not installed (the bench extra)."""
    try:
        from local_attention import LocalAttention
    except ImportError:
        return None

    la = LocalAttention(
        window_size=window,
        causal=True,
        look_backward=1,
        look_forward=0,
        exact_windowsize=True,
        dropout=0.0,
        autopad=True,
        scale=D**-0.5,
        use_rotary_pos_emb=False,
    )
    return lambda q, k, v: la(q, k, v)


# ---------------------------------------------------------------------------- helpers


def timeit(fns: dict, *, repeat: int = 5, warmup: int = 1, budget_s: float = 60.0) -> dict[str, float]:
    """Median seconds per call of each function, run round-robin with the order reversed every other round
    (so that no peer always runs right after the same one, e.g. after the naive formula's large
    allocations); stops early once ``budget_s`` is spent (every peer runs at least once)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for i in range(repeat):
        for n in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return {n: statistics.median(ts) for n, ts in times.items()}


def inputs(L, heads=H, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, L, D, generator=g).requires_grad_(grad) for _ in range(3)]


def fwd(fn, q, k, v):
    def run():
        with torch.no_grad():
            fn(q, k, v)

    return run


def fwd_bwd(fn, q, k, v, go):
    def run():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(go)

    return run


def try_backward(fn, q, k, v, go) -> str | None:
    """None when ``fn`` has a backward here, else the error's first line."""
    try:
        fn(q, k, v).backward(go)
        return None
    except Exception as e:  # noqa: BLE001  (report whatever the peer raises)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"


def fmt(t):
    return "-" if t is None else f"{t:.3f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.1f}x"


def check_same(name, a, b, atol=2e-4):
    err = (a - b).abs().max().item()
    if err > atol:
        raise AssertionError(f"{name} differs from flash by {err:.2e}")


# ---------------------------------------------------------------------------- sections


def window_section(lengths, repeat, notes):
    rows = []
    W = 256
    mask = masks.sliding_window(W)

    def mod(b, h, qi, ki):
        return (qi >= ki) & (qi - ki <= W)

    for L in lengths:
        q, k, v = inputs(L)
        allowed = mask.to_dense(L, L)
        peers = {
            "flash": lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend="flash"),
            "sdpa+mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
            "local-attention": local_attention_peer(W),
        }
        if peers["local-attention"] is None:
            del peers["local-attention"]
            notes.add("local-attention is not installed: .venv/bin/pip install -e '.[bench]'")
        flex = Flex(mod, L)
        peers["flex"] = flex
        if B * H * L * L <= NAIVE_LIMIT:
            peers["naive"] = lambda q, k, v: naive(q, k, v, allowed)
        else:
            notes.add(f"naive formula skipped at L >= {L}: its {B * H * L * L * 4 / 2**30:.0f} GiB score matrix")
        with torch.no_grad():
            ref = peers["flash"](q, k, v)
            for name, fn in peers.items():
                check_same(f"{name} at L={L}", fn(q, k, v), ref)
        t = timeit({n: fwd(f, q, k, v) for n, f in peers.items()}, repeat=repeat, warmup=1)
        qg, kg, vg = inputs(L, grad=True)
        go = torch.randn(B, H, L, D)
        flex_bwd = try_backward(flex, qg, kg, vg, go)
        if flex_bwd:
            notes.add(f"FlexAttention has no backward on CPU here ({flex_bwd})")
        bw = {n: f for n, f in peers.items() if not (n == "flex" and flex_bwd)}
        tb = timeit({n: fwd_bwd(f, qg, kg, vg, go) for n, f in bw.items()}, repeat=max(1, repeat - 2), warmup=1)
        skipped = {n: "skipped" for n in ("local-attention", "naive") if n not in peers}  # see the notes
        rows.append(
            {
                "L": L,
                "mode": "fwd",
                **skipped,
                **{n: fmt(x) for n, x in t.items()},
                "sdpa/flash": ratio(t["sdpa+mask"], t["flash"]),
                "flex/flash": ratio(t["flex"], t["flash"]),
                "local/flash": ratio(t.get("local-attention"), t["flash"]),
                "flex compile s": f"{flex.compile_s:.1f}",
            }
        )
        rows.append(
            {
                "L": L,
                "mode": "fwd+bwd",
                **skipped,
                **{n: fmt(x) for n, x in tb.items()},
                "flex": "no CPU bwd" if flex_bwd else fmt(tb.get("flex")),
                "sdpa/flash": ratio(tb["sdpa+mask"], tb["flash"]),
                "local/flash": ratio(tb.get("local-attention"), tb["flash"]),
            }
        )
        print(table(rows[-2:], list(rows[-2].keys())), flush=True)
    return rows


def density_section(L, densities, repeat, notes):
    """Random 128 x 128 block masks; each density is timed interleaved with dense SDPA (no mask), so the
    ratio flash / (density x dense) compares runs taken under the same machine load."""
    rows = []
    q, k, v = inputs(L)
    nb = L // 128
    dense = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    for dens in densities:
        n = max(1, round(dens * nb))
        mask = masks.random_blocks(128, n, seed=1)
        allowed = mask.to_dense(L, L)
        peers = {
            "flash": lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend="flash"),
            "sdpa+mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
            "sdpa dense": dense,
        }
        with torch.no_grad():
            check_same(f"sdpa at density {dens}", peers["sdpa+mask"](q, k, v), peers["flash"](q, k, v))
        t = timeit({n_: fwd(f, q, k, v) for n_, f in peers.items()}, repeat=repeat, warmup=1)
        real = n / nb
        rows.append(
            {
                "density": f"{real:.1%}",
                "flash s": fmt(t["flash"]),
                "sdpa+mask s": fmt(t["sdpa+mask"]),
                "sdpa dense s": fmt(t["sdpa dense"]),
                "flash / (density x dense)": f"{t['flash'] / (real * t['sdpa dense']):.2f}",
                "sdpa+mask/flash": ratio(t["sdpa+mask"], t["flash"]),
            }
        )
        print(f"  density {real:.1%} done", flush=True)
    print(table(rows, list(rows[-1].keys())), flush=True)
    return rows


def document_section(L, repeat, notes):
    g = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(L - 1, generator=g)[:15].add(1).tolist())
    ids = torch.zeros(L, dtype=torch.long)
    for c in cuts:
        ids[c:] += 1
    lengths = torch.bincount(ids).tolist()
    rows = []
    for causal in (False, True):
        mask = masks.document(ids) & masks.causal() if causal else masks.document(ids)
        q, k, v = inputs(L)
        allowed = mask.to_dense(L, L)
        peers = {
            "flash": lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend="flash"),
            "sdpa+mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
        }
        with torch.no_grad():
            check_same("sdpa document", peers["sdpa+mask"](q, k, v), peers["flash"](q, k, v))
        t = timeit({n: fwd(f, q, k, v) for n, f in peers.items()}, repeat=repeat, warmup=1)
        qg, kg, vg = inputs(L, grad=True)
        go = torch.randn(B, H, L, D)
        tb = timeit({n: fwd_bwd(f, qg, kg, vg, go) for n, f in peers.items()}, repeat=max(1, repeat - 2), warmup=1)
        for mode, tt in (("fwd", t), ("fwd+bwd", tb)):
            rows.append(
                {
                    "mask": "document & causal" if causal else "document",
                    "mode": mode,
                    "flash": fmt(tt["flash"]),
                    "sdpa+mask": fmt(tt["sdpa+mask"]),
                    "sdpa/flash": ratio(tt["sdpa+mask"], tt["flash"]),
                }
            )
        print(table(rows[-2:], list(rows[-2].keys())), flush=True)
    notes.add(f"document lengths: {lengths}")
    return rows


def causal_section(lengths, repeat, notes):
    rows = []
    for L in lengths:
        q, k, v = inputs(L)
        peers = {
            "flash": lambda q, k, v: attnkit.attention(q, k, v, mask=masks.causal(), backend="flash"),
            "sdpa causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        t = timeit({n: fwd(f, q, k, v) for n, f in peers.items()}, repeat=repeat, warmup=1)
        qg, kg, vg = inputs(L, grad=True)
        go = torch.randn(B, H, L, D)
        tb = timeit({n: fwd_bwd(f, qg, kg, vg, go) for n, f in peers.items()}, repeat=max(1, repeat - 2), warmup=1)
        for mode, tt in (("fwd", t), ("fwd+bwd", tb)):
            rows.append(
                {
                    "L": L,
                    "mode": mode,
                    "flash": fmt(tt["flash"]),
                    "sdpa causal": fmt(tt["sdpa causal"]),
                    "flash/sdpa": f"{tt['flash'] / tt['sdpa causal']:.2f}",
                }
            )
        print(table(rows[-2:], list(rows[-2].keys())), flush=True)
    return rows


_MEMORY_SCRIPT = """
import json, sys, time, torch
from attnkit import masks
from attnkit.backends.flash import flash_attention
torch.set_num_threads(int(sys.argv[2]))
L = int(sys.argv[1])
q, k, v = (torch.randn(1, 1, L, 64, requires_grad=True) for _ in range(3))
t0 = time.perf_counter()
flash_attention(q, k, v, mask=masks.sliding_window(511)).backward(torch.randn(1, 1, L, 64))
dt = time.perf_counter() - t0
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]  # this process's own peak
print(json.dumps({"peak_rss": int(hwm.split()[1]) * 1024, "seconds": dt}))
"""


def memory_section(L, threads, notes):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed blocks return to the OS: RSS ~ live memory
    res = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(L), str(threads)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    r = json.loads(res.stdout.strip().splitlines()[-1])
    row = {
        "L": L,
        "heads": 1,
        "mask": "causal sliding window 512",
        "fwd+bwd s": f"{r['seconds']:.2f}",
        "peak RSS GiB (whole process)": f"{r['peak_rss'] / 2**30:.2f}",
        "dense score matrix GiB": f"{L * L * 4 / 2**30:.0f}",
    }
    print(table([row], list(row.keys())), flush=True)
    return [row]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=SECTIONS, action="append", help="run only these sections")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        help="sequence lengths of the window section (default 2048 8192 16384; --quick: 1024)",
    )
    ap.add_argument(
        "--densities",
        type=float,
        nargs="+",
        default=None,
        help="densities of the density section (default 0.05 0.10 0.25 0.50; --quick: 0.10 0.50)",
    )
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    quick = args.quick
    repeat = args.repeat or (3 if quick else 5)
    sections = args.only or SECTIONS
    notes: set[str] = set()
    results = {}
    print(
        f"# sparse attention, float32, B={B} H={H} D={D}; {machine()}; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    load_start = os.getloadavg()
    if "window" in sections:
        lengths = args.lengths or ([1024] if quick else [2048, 8192, 16384])  # FlexAttention compiles per length
        results["window"] = window_section(lengths, repeat, notes)
    if "density" in sections:
        densities = args.densities or ([0.10, 0.50] if quick else [0.05, 0.10, 0.25, 0.50])
        results["density"] = density_section(2048 if quick else 8192, densities, repeat, notes)
    if "document" in sections:
        results["document"] = document_section(2048 if quick else 16384, repeat, notes)
    if "causal" in sections:
        results["causal"] = causal_section([1024] if quick else [2048, 8192], repeat, notes)
    if "memory" in sections:
        results["memory"] = memory_section(8192 if quick else 65536, args.threads, notes)
    notes.add(f"load average (1/5/15 min) {load_start} at the start, {os.getloadavg()} at the end")
    for n in sorted(notes):
        print("note:", n)
    path = save("sparse_quick" if quick else "sparse", {"results": results, "notes": sorted(notes)}, out=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
