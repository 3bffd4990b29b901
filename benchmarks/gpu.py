"""GPU attention: attnkit's Triton kernels against PyTorch SDPA (flash) and compiled FlexAttention.

One prepared run (under 5 minutes on an H100/H200; a time budget skips what would not fit):

1. correctness first: each mask through the ``triton`` backend against the float64 oracle (numerical rule,
   forward and backward), eagerly and compiled (``torch.compile(fullgraph=True)``: one graph whose attention
   is the custom operator ``attnkit::triton_forward``, its backward ``attnkit::triton_backward``), and the
   paged decode kernel against a dense reference, on small shapes;
2. TFLOP/s of forward and forward+backward, bfloat16, D = 64 and 128, L = 1k..16k (B * L = 16k tokens,
   H * D = 2048), causal, sliding window (1024 keys, causal) and document (packed, causal) masks, for attnkit
   ``triton``, SDPA's flash kernel (causal only: it takes no other mask) and ``torch.compile``d
   FlexAttention with its BlockMask; FLOPs count only the pairs the mask allows (backward = 2.5 x forward);
3. the paged decode kernel's bandwidth (bytes of K and V read per second) against the memory bandwidth
   limit (the datasheet peak from the device properties, and a measured device-to-device copy).

Prints a table, the targets (dense causal forward >= 70% of SDPA-flash; sparse masks >= 1.0x
FlexAttention), and writes benchmarks/results/gpu.json.  Without a CUDA GPU it says so and exits (status 2).

    python benchmarks/gpu.py                      # the prepared run
    python benchmarks/gpu.py --lengths 1024 2048 4096 8192 16384 --budget 600
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import OUT_HELP, save, table

TOKENS = 16384  # B * L: every length sees the same number of query tokens
MODEL_DIM = 2048  # H * D
WINDOW = 1024  # sliding window: each query sees itself and the 1023 keys before it
BWD_FACTOR = 2.5  # backward matmul work relative to the forward (FlashAttention's convention)


def need_gpu() -> None:
    """Exit with a clear message (status 2) unless a CUDA GPU and triton are usable."""
    if not torch.cuda.is_available():
        print(
            f"benchmarks/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False here (torch "
            f"{torch.__version__}). Nothing was measured.",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 (a broken install raises more than ImportError)
        print(f"benchmarks/gpu.py needs triton (pip install 'attnkit[gpu]'): {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)


def cuda_time(fn, *, warmup: int = 3, repeat: int = 20, budget_s: float = 2.0) -> float:
    """Median seconds per call, timed with CUDA events (after ``warmup`` calls, which also compile)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ masks


def doc_lengths(L: int, seed: int = 0) -> list[int]:
    """Packed documents of random lengths (64 .. L/2) filling L tokens."""
    g = torch.Generator().manual_seed(seed + L)
    out, left = [], L
    while left > 0:
        n = min(left, int(torch.randint(64, max(65, L // 2), (1,), generator=g)))
        out.append(n)
        left -= n
    return out


def allowed_pairs(kind: str, L: int) -> int:
    """(query, key) pairs the mask allows, for the FLOP count."""
    if kind == "causal":
        return L * (L + 1) // 2
    if kind == "sliding_window":
        w = min(WINDOW, L)
        return w * (w + 1) // 2 + (L - w) * w
    return sum(n * (n + 1) // 2 for n in doc_lengths(L))


def make_masks(kind: str, L: int, device):
    """(attnkit mask, FlexAttention BlockMask) for one kind and length."""
    from torch.nn.attention.flex_attention import create_block_mask

    from attnkit import masks

    if kind == "causal":

        def mod(b, h, q, k):
            return q >= k

        ak = masks.causal()
    elif kind == "sliding_window":

        def mod(b, h, q, k):
            return (q >= k) & (q - k < WINDOW)

        ak = masks.sliding_window(WINDOW - 1)
    else:
        ids = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lengths(L))]).to(device)

        def mod(b, h, q, k):
            return (ids[q] == ids[k]) & (q >= k)

        ak = masks.document(ids) & masks.causal()
    return ak, create_block_mask(mod, None, None, L, L, device=device)


# --------------------------------------------------------------------------------------------- checks


def correctness(device) -> list[str]:
    """The numerical rule with the kernels on the GPU, small shapes: each mask kind forward and backward, and
    paged decode.  The inputs, the float64 oracle and the naive bfloat16 formula live on the CPU; the kernel's
    inputs are moved to the GPU inside the checked function (autograd carries the gradients back)."""
    import attnkit
    from attnkit import bias, masks
    from attnkit.backends.triton import paged_decode
    from attnkit.testing import check_against_oracle

    def triton(q, k, v, **kw):
        return attnkit.attention(q.to(device), k.to(device), v.to(device), backend="triton", **kw).cpu()

    lines = []
    L = 777
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate([200, 77, 500])])
    cases = {
        "causal": dict(mask=masks.causal()),
        "sliding_window": dict(mask=masks.sliding_window(100)),
        "document": dict(mask=masks.document(ids) & masks.causal()),
        "prefix_lm+softcap": dict(mask=masks.prefix_lm(50), softcap=20.0),
        "strided(bitmap)+alibi": dict(mask=masks.strided(16), bias=bias.alibi(bias.alibi_slopes(4))),
    }
    for name, kw in cases.items():
        for D in (64, 128) if name == "causal" else (64,):  # every compile costs seconds: one D per mask
            q = torch.randn(1, 4, L, D, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(1, 2, L, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            rep = check_against_oracle(triton, q, k, v, **kw)
            lines.append(
                f"ok  {name:22s} D={D:3d} bf16 GQA 4/2: out err {rep['out']['err']:.2e} <= "
                f"{rep['out']['bound']:.2e}, dq err {rep['dq']['err']:.2e} <= {rep['dq']['bound']:.2e}"
            )
    lines += compiled_correctness(device, {name: cases[name] for name in ("sliding_window", "document")})
    B, Hq, Hkv, D, page = 4, 32, 8, 128, 16
    lens = torch.tensor([1, 300, 4097, 2048], dtype=torch.int32)
    n_pages = -(-int(lens.max()) // page)
    order = torch.randperm(B * n_pages)
    table_ = order.view(B, n_pages).to(torch.int32)
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, n_pages * page, D, dtype=torch.bfloat16) for _ in range(2))

    def paged(q, k, v, mask):
        pools = []
        for t in (k, v):  # (B, Hkv, n_pages * page, D) -> pages (num_blocks, Hkv, page, D) in table order
            pool = torch.empty(B * n_pages, Hkv, page, D, dtype=t.dtype)
            pool[order] = t.view(B, Hkv, n_pages, page, D).permute(0, 2, 1, 3, 4).flatten(0, 1)
            pools.append(pool.to(device))
        return paged_decode(q.to(device), *pools, table_.to(device), lens.to(device)).cpu()

    rep = check_against_oracle(paged, q, k, v, mask=masks.key_padding(lens.long()), grad=False)
    lines.append(
        f"ok  paged_decode           D=128 bf16 GQA 32/8: out err {rep['out']['err']:.2e} <= {rep['out']['bound']:.2e}"
    )
    return lines


def compiled_correctness(device, cases: dict, L: int = 777, D: int = 64) -> list[str]:
    """``attention(..., backend="triton")`` under ``torch.compile(fullgraph=True)`` (Inductor) on the GPU: one
    graph, no graph break, one ``attnkit::triton_forward`` node; forward and backward (through
    ``attnkit::triton_backward``) against the float64 oracle."""
    import attnkit
    from attnkit.testing import check_against_oracle

    call = functools.partial(attnkit.attention, backend="triton")
    compiled = torch.compile(call, fullgraph=True)

    def triton_compiled(q, k, v, **kw):
        return compiled(q.to(device), k.to(device), v.to(device), **kw).cpu()

    lines = []
    for name, kw in cases.items():
        q = torch.randn(1, 4, L, D, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, 2, L, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        explained = torch._dynamo.explain(call)(*(t.detach().to(device) for t in (q, k, v)), **kw)
        nodes = explained.graphs[0].code.count("attnkit.triton_forward") if explained.graphs else 0
        if explained.graph_break_count or explained.graph_count != 1 or nodes != 1:
            raise AssertionError(
                f"compiled triton with the {name} mask: {explained.graph_count} graph(s), "
                f"{explained.graph_break_count} graph break(s), {nodes} attnkit.triton_forward "
                f"node(s); expected one graph, no break, one node"
            )
        rep = check_against_oracle(triton_compiled, q, k, v, **kw)
        lines.append(
            f"ok  compiled {name:13s} D={D:3d} bf16 GQA 4/2: out err {rep['out']['err']:.2e} <= "
            f"{rep['out']['bound']:.2e}, dq err {rep['dq']['err']:.2e} <= {rep['dq']['bound']:.2e} "
            f"(one attnkit::triton_forward node, no graph break)"
        )
    return lines


# ------------------------------------------------------------------------------------------ attention


def attention_rows(lengths, dims, kinds, budget_s, device):
    import attnkit
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled graph per shape and mask: raise the recompile limit so FlexAttention never falls back to eager
    config = torch._dynamo.config
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", 64)
    flex = torch.compile(flex_attention)
    rows, start = [], time.perf_counter()
    for D in dims:
        H = MODEL_DIM // D
        for kind in kinds:
            for L in lengths:
                if time.perf_counter() - start > budget_s:
                    rows.append({"D": D, "mask": kind, "L": L, "note": f"skipped: over the {budget_s:.0f} s budget"})
                    continue
                B = max(1, TOKENS // L)
                q, k, v = (torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16) for _ in range(3))
                go = torch.randn_like(q)
                ak_mask, block_mask = make_masks(kind, L, device)
                fwd_flops = 4.0 * B * H * D * allowed_pairs(kind, L)
                impls = {
                    "attnkit triton": lambda q, k, v: attnkit.attention(q, k, v, mask=ak_mask, backend="triton"),
                    "flex (compiled)": lambda q, k, v: flex(q, k, v, block_mask=block_mask),
                }
                if kind == "causal":

                    def sdpa(q, k, v):
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                    impls["sdpa flash"] = sdpa
                row = {"D": D, "mask": kind, "L": L, "B": B, "H": H}
                for name, fn in impls.items():

                    def fwd():
                        with torch.no_grad():
                            fn(q, k, v)  # noqa: F821 (runs before the del below)

                    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

                    def fwd_bwd():
                        for t in leaves:
                            t.grad = None
                        fn(*leaves).backward(go)  # noqa: F821 (runs before the del below)

                    try:
                        t_f = cuda_time(fwd)
                        t_fb = cuda_time(fwd_bwd)
                        row[f"{name} fwd"] = fwd_flops / t_f / 1e12
                        row[f"{name} fwd+bwd"] = fwd_flops * (1 + BWD_FACTOR) / t_fb / 1e12
                    except Exception as e:  # noqa: BLE001 (report and go on: one failing peer must not hide the rest
                        row[f"{name} fwd"] = row[f"{name} fwd+bwd"] = float("nan")
                        row["note"] = f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                rows.append(row)
                print({k_: (round(v_, 1) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
                del q, k, v, go
                torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ decode


_DATASHEET_TBPS = {
    "H200": 4.8,
    "H100 SXM": 3.35,
    "H100 PCIe": 2.0,
    "H100 NVL": 3.9,
    "A100-SXM4-80GB": 2.04,
    "A100-SXM4-40GB": 1.56,
    "A100 80GB PCIe": 1.94,
    "L40S": 0.864,
    "RTX 4090": 1.01,
}


def peak_bandwidth(device) -> tuple[float | None, float]:
    """(datasheet peak, measured device-to-device copy) in bytes/s."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    peak = 2.0 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None  # double data rate
    if peak is None:
        peak = next((tb * 1e12 for name, tb in _DATASHEET_TBPS.items() if name in props.name), None)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), repeat=10)  # noqa: F821 (runs before the del below)
    del src, dst
    return peak, 2.0 * (1 << 30) / t  # a copy reads and writes every byte


def decode_rows(device):
    from attnkit.backends.triton import paged_decode

    rows = []
    Hq, Hkv, D, page = 32, 8, 128, 16
    for B, seq in ((1, 32768), (8, 8192), (32, 4096), (128, 2048)):
        n_pages = seq // page
        pool = B * n_pages
        k_pool = torch.randn(pool, Hkv, page, D, device=device, dtype=torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        table_ = torch.randperm(pool, device=device).view(B, n_pages).to(torch.int32)
        lens = torch.full((B,), seq, dtype=torch.int32, device=device)
        q = torch.randn(B, Hq, 1, D, device=device, dtype=torch.bfloat16)
        t = cuda_time(lambda: paged_decode(q, k_pool, v_pool, table_, lens), repeat=50)  # noqa: F821 (runs before the del below)
        read = 2 * B * seq * Hkv * D * k_pool.element_size()  # every key and value once
        rows.append({"B": B, "seq_len": seq, "Hq/Hkv": f"{Hq}/{Hkv}", "D": D, "us": t * 1e6, "GB/s": read / t / 1e9})
        print(rows[-1], flush=True)
        del k_pool, v_pool
    return rows


# -------------------------------------------------------------------------------------------------- main


def summary(rows) -> list[str]:
    out = []

    def gmean(xs):
        xs = [x for x in xs if x and x == x]
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")

    causal = [r for r in rows if r.get("mask") == "causal" and "sdpa flash fwd" in r]
    ratio = gmean([r["attnkit triton fwd"] / r["sdpa flash fwd"] for r in causal])
    out.append(
        f"dense causal forward: attnkit triton at {ratio:.0%} of SDPA-flash TFLOP/s (geometric mean over "
        f"{len(causal)} shapes; target >= 70%) -> {'met' if ratio >= 0.7 else 'NOT met'}"
    )
    for kind in ("sliding_window", "document"):
        rs = [r for r in rows if r.get("mask") == kind and "flex (compiled) fwd" in r]
        for mode in ("fwd", "fwd+bwd"):
            x = gmean([r[f"attnkit triton {mode}"] / r[f"flex (compiled) {mode}"] for r in rs])
            out.append(
                f"{kind} {mode}: attnkit triton {x:.2f}x FlexAttention (geometric mean over {len(rs)} shapes; "
                f"target >= 1.0x) -> {'met' if x >= 1.0 else 'NOT met'}"
            )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument(
        "--masks",
        nargs="+",
        default=["causal", "sliding_window", "document"],
        choices=["causal", "sliding_window", "document"],
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=150.0,
        help="seconds for the attention table; later shapes are skipped (kernel compiles count)",
    )
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    need_gpu()
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    t0 = time.perf_counter()
    print(f"{name}, torch {torch.__version__}; checking correctness first", flush=True)
    checks = correctness(device)
    print("\n".join(checks), flush=True)
    rows = attention_rows(args.lengths, args.dims, args.masks, args.budget, device)
    dec = decode_rows(device)
    peak, copy = peak_bandwidth(device)
    cols = ["D", "mask", "L", "B", "H"]
    for impl in ("attnkit triton", "sdpa flash", "flex (compiled)"):
        cols += [f"{impl} fwd", f"{impl} fwd+bwd"]
    fmt = [
        {c: (f"{r[c]:.1f}" if isinstance(r.get(c), float) else r.get(c, "-")) for c in cols + ["note"]} for r in rows
    ]
    print(f"\nTFLOP/s, bfloat16, B*L = {TOKENS} tokens, H*D = {MODEL_DIM}; {name}; {time.strftime('%Y-%m-%d')}")
    print(table(fmt, cols + ["note"]))
    print(
        f"\npaged decode (bf16, pages of 16): memory bandwidth limit {peak / 1e9 if peak else float('nan'):.0f} GB/s "
        f"(datasheet), {copy / 1e9:.0f} GB/s (measured copy)"
    )
    for r in dec:
        r["% of peak"] = f"{r['GB/s'] * 1e9 / peak:.0%}" if peak else "-"
        r["% of copy"] = f"{r['GB/s'] * 1e9 / copy:.0%}"
    print(
        table(
            [{k: (f"{v:.1f}" if isinstance(v, float) else v) for k, v in r.items()} for r in dec], list(dec[0].keys())
        )
    )
    lines = summary(rows)
    print("\n" + "\n".join(lines))
    path = save(
        "gpu",
        {
            "device": name,
            "torch": torch.__version__,
            "checks": checks,
            "attention": rows,
            "decode": dec,
            "peak_bytes_per_s": peak,
            "copy_bytes_per_s": copy,
            "summary": lines,
            "seconds": time.perf_counter() - t0,
        },
        out=args.out,
    )
    print(f"\nwrote {path} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
