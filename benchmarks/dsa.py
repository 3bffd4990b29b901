"""DeepSeek sparse attention: one decode step at a long cache, DSA (top-k keys) against full attention.

One attention layer with DeepSeek-V3.2's attention shapes (128 heads, latent 512 + rope 64, nope 128, value 128,
query latent 1536; indexer 64 heads of 128, top-k 2048) and a narrower model width (``--d-model``, which only
sizes the input and output projections), random weights, float32.  Both layers decode one token against the
same ``--cached`` tokens (random latents written into a :class:`attnkit.cache.StaticCache`; each timed step is
rolled back so every step sees the same length):

* full attention: :class:`attnkit.nn.LatentAttention` (absorbed multi-head latent attention over every cached
  latent);
* DSA: :class:`attnkit.nn.DeepSeekSparseAttention` with the same weights: the indexer scores every cached token,
  then the step gathers and attends to its top-k latents only.

Medians of interleaved runs in one process; the ratio is what counts on a shared machine.

    python benchmarks/dsa.py                 # 128k cached tokens, top-k 2048
    python benchmarks/dsa.py --quick         # 8k cached tokens, top-k 256
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import OUT_HELP, machine, save, table, timeit

from attnkit import masks
from attnkit.cache import StaticCache
from attnkit.nn import DeepSeekSparseAttention, IndexerConfig, LatentAttention, RotaryEmbedding


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8k cached tokens, top-k 256")
    ap.add_argument("--cached", type=int, default=131072, help="tokens in the cache (default 131072)")
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--backend",
        default="flash",
        help="attention backend of both layers (default flash: 'auto' "
        "picks sdpa for 128 query heads over one latent key head, many times slower here)",
    )
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cached, top_k = (8192, 256) if args.quick else (args.cached, args.top_k)
    dims = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536)
    heads, d = 128, args.d_model
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, interleaved=True)
    dsa = DeepSeekSparseAttention(
        d,
        heads,
        **dims,
        positions=rope,
        mask=masks.causal(),
        backend=args.backend,
        indexer=IndexerConfig(top_k=top_k, n_heads=64, head_dim=128),
    ).eval()
    full = LatentAttention(d, heads, **dims, positions=rope, mask=masks.causal(), backend=args.backend).eval()
    full.load_state_dict({k: v for k, v in dsa.state_dict().items() if not k.startswith("indexer.")})

    g = torch.Generator().manual_seed(1)
    stored = torch.randn(1, 1, cached, dsa.latent_dim, generator=g)  # [latent; rope key; index key] per token
    dsa_cache = StaticCache(1, max_len=cached + 1)
    full_cache = StaticCache(1, max_len=cached + 1)
    with torch.no_grad():
        dsa_cache.layers[0].update(stored, stored.new_empty(1, 1, cached, 0))
        lat = stored[..., : full.latent_dim].contiguous()
        full_cache.layers[0].update(lat, lat.new_empty(1, 1, cached, 0))
    del stored, lat
    x = torch.randn(1, 1, d, generator=g)

    def step(module, cache):
        def run():
            with torch.no_grad():
                module(x, cache=cache.layers[0])
            cache.layers[0].length -= 1  # roll back: every step decodes at the same length

        return run

    t = timeit({"full": step(full, full_cache), "dsa": step(dsa, dsa_cache)}, repeat=args.repeat, budget_s=300)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = [
        {
            "attention": "full (LatentAttention)",
            "keys read": cached,
            "ms/step": f"{t['full'] * 1e3:.1f}",
            "vs full": "1.00x",
        },
        {
            "attention": f"DSA (top-k {top_k})",
            "keys read": top_k,
            "ms/step": f"{t['dsa'] * 1e3:.1f}",
            "vs full": f"{t['full'] / t['dsa']:.2f}x faster",
        },
    ]
    print(
        f"one decode step at {cached} cached tokens: 128 heads, latent 512 + rope 64, nope 128, v 128, q latent "
        f"1536, indexer 64 x 128, d_model {d}, float32, backend {args.backend!r}, {machine()}, load average "
        f"{load:.1f} at the end"
    )
    print(table(rows, list(rows[0])))
    print(
        "saved",
        save(
            "dsa_quick" if args.quick else "dsa",
            {
                "cached": cached,
                "top_k": top_k,
                "d_model": d,
                "backend": args.backend,
                "rows": rows,
                "load": load,
                "ratio": t["full"] / t["dsa"],
            },
            out=args.out,
        ),
    )


if __name__ == "__main__":
    main()
