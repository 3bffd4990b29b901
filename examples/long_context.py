"""Long context on several processes: one decoder layer, forward and backward, with ring attention.

One sequence of L tokens is split over the W processes of a torchrun launch (zigzag layout: every rank
holds L/W tokens and the same share of the causal work).  The layer is a ``DecoderLM`` layer (RMSNorm,
RoPE, grouped-query causal attention, SwiGLU); inside :func:`attnkit.distributed.ring_context` its attention
runs as :func:`attnkit.distributed.ring_attention`.  Nothing else changes: RoPE rotates each token at its
global position, and every other part of the layer is per-token.

Each rank prints its time and the peak memory the step added; rank 0 then runs the same layer on the
whole sequence in one fresh process and prints the comparison.  ``--check`` (small sizes) also checks
that the gathered outputs and gradients equal the one-process ones (float64).

    torchrun --nproc-per-node 4 examples/long_context.py                  # L = 16384
    torchrun --nproc-per-node 2 examples/long_context.py --seq-len 64 --check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from attnkit.distributed import ring_context, shard, unshard
from attnkit.nn import DecoderConfig, DecoderLM


def rss_mb() -> float:
    """Resident memory of this process now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    """Peak resident memory of this process so far (MiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_layer(args) -> torch.nn.Module:
    """Layer 0 of a one-layer DecoderLM, with the same weights on every process (seeded)."""
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=256,
        d_model=args.d_model,
        n_layers=1,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        max_seq_len=args.seq_len,
    )
    layer = DecoderLM(cfg).layers[0]
    return layer.double() if args.check else layer


def inputs(args) -> tuple[torch.Tensor, torch.Tensor]:
    """The full hidden states (1, L, d_model) and the output gradient, the same on every process."""
    g = torch.Generator().manual_seed(1)
    dtype = torch.float64 if args.check else torch.float32
    x = torch.randn(1, args.seq_len, args.d_model, generator=g, dtype=dtype)
    return x, torch.randn(x.shape, generator=g, dtype=dtype)


def step(layer, x, grad_out, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of the layer: (output, gradient of the input)."""
    x = x.detach().requires_grad_(True)
    out = layer(x, positions=positions)
    out.backward(grad_out)
    return out.detach(), x.grad


def warm_up(layer, args, world: int = 1, layout: str = "zigzag") -> None:
    """One step on a few tokens, so one-time costs (lazy imports, kernel set-up) are not counted."""
    x = torch.zeros(1, 8 * world, args.d_model, dtype=torch.float64 if args.check else torch.float32)
    if world > 1:
        x = shard(x, dim=1, layout=layout)
    step(
        layer,
        x,
        torch.ones_like(x),
        shard(torch.arange(8 * world), dim=0, layout=layout) if world > 1 else torch.arange(8),
    )
    layer.zero_grad(set_to_none=True)


def single(args) -> None:
    """The whole sequence in this one process; prints one JSON line."""
    torch.set_num_threads(os.cpu_count() or 1)
    layer = build_layer(args)
    warm_up(layer, args)
    base = rss_mb()
    x, grad_out = inputs(args)
    t0 = time.perf_counter()
    step(layer, x, grad_out, torch.arange(args.seq_len))
    print(json.dumps({"s": time.perf_counter() - t0, "peak_mb": peak_mb() - base}))


def distributed(args) -> None:
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))  # torchrun gives RANK, WORLD_SIZE, ...
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    layer = build_layer(args)
    with ring_context(layer, layout=args.layout) as ring:  # the layer's attention runs over all ranks' shards
        warm_up(layer, args, world, args.layout)
        base = rss_mb()
        x, grad_out = inputs(args)
        x_local, g_local = shard(x, dim=1, layout=args.layout), shard(grad_out, dim=1, layout=args.layout)
        positions = ring.positions(x_local.shape[1])  # this rank's tokens' global positions (for RoPE)
        del x, grad_out  # a real run would load only its own tokens
        dist.barrier()
        t0 = time.perf_counter()
        out, dx = step(layer, x_local, g_local, positions)
        dist.barrier()
    mine = {"rank": rank, "tokens": x_local.shape[1], "s": time.perf_counter() - t0, "peak_mb": peak_mb() - base}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if args.check:
        check(args, layer, out, dx, rank)
    if rank == 0:
        report(args, everyone)
    dist.destroy_process_group()


def check(args, layer, out, dx, rank) -> None:
    """Gathered outputs and input gradients, and parameter gradients summed over ranks (what DDP would do),
    against the same layer on the whole sequence in this process (float64)."""
    out_all = unshard(out, dim=1, layout=args.layout)
    dx_all = unshard(dx, dim=1, layout=args.layout)
    grads = [p.grad.clone() for p in layer.parameters()]
    for g in grads:
        dist.all_reduce(g)
    reference = build_layer(args)  # same seed, same weights, plain attention
    x, grad_out = inputs(args)
    ref_out, ref_dx = step(reference, x, grad_out, torch.arange(args.seq_len))
    errors = {
        "out": (out_all - ref_out).abs().max().item(),
        "dx": (dx_all - ref_dx).abs().max().item(),
        "dparams": max((g - p.grad).abs().max().item() for g, p in zip(grads, reference.parameters())),
    }
    bad = {k: e for k, e in errors.items() if not e <= 1e-9}
    if bad:
        raise SystemExit(f"rank {rank}: ring attention differs from one process: {bad}")
    if rank == 0:
        print(
            "check passed: outputs, input and parameter gradients equal one process (float64), max |diff| "
            + ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
        )


def report(args, everyone) -> None:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--single",
        "--seq-len",
        str(args.seq_len),
        "--d-model",
        str(args.d_model),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
    ]
    one = json.loads(
        subprocess.run(cmd + (["--check"] if args.check else []), check=True, capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    world = len(everyone)
    print(
        f"\none DecoderLM layer (d_model={args.d_model}, {args.heads} heads, {args.kv_heads} kv heads, RoPE, "
        f"causal), forward + backward of L={args.seq_len} tokens, layout={args.layout!r}"
    )
    print(f"{'':18s}{'tokens':>8s}{'time s':>9s}{'peak MB':>10s}")
    for e in everyone:
        print(f"{'rank ' + str(e['rank']) + ' of ' + str(world):18s}{e['tokens']:8d}{e['s']:9.2f}{e['peak_mb']:10.1f}")
    print(f"{'one process':18s}{args.seq_len:8d}{one['s']:9.2f}{one['peak_mb']:10.1f}")
    worst = max(e["peak_mb"] for e in everyone)
    print(
        f"peak memory per rank: {worst / max(one['peak_mb'], 1e-9):.2f} of one process's (1/W = {1 / world:.2f}); "
        f"the processes share this machine's cores, so time does not fall here"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    ap.add_argument("--check", action="store_true", help="float64; compare with one process (small sizes)")
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.single:
        single(args)
    elif "RANK" not in os.environ:
        raise SystemExit("run me with torchrun, e.g.: torchrun --nproc-per-node 4 examples/long_context.py")
    else:
        distributed(args)


if __name__ == "__main__":
    main()
