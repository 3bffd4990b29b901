"""``python -m attnkit``: a short tour of the core."""

from __future__ import annotations

import torch

from . import attention, backends, masks


def tour() -> None:
    print("attnkit: a few masks (█ may attend, · may not)\n")
    for m in (masks.causal(), masks.sliding_window(3) & masks.causal(), masks.strided(4),
              masks.sliding_window(2, 2) | masks.global_tokens([0])):
        print(m.show(12))
        print()
    print("one attention() call per backend, float32, against a float64 oracle")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 100, 64, generator=g)
    k = torch.randn(2, 2, 120, 64, generator=g)
    v = torch.randn(2, 2, 120, 64, generator=g)
    mask = masks.causal() & masks.sliding_window(31)
    oracle = attention(q.double(), k.double(), v.double(), mask=mask, backend="math")
    naive_w = torch.softmax((q @ k.repeat_interleave(4, 1).transpose(-1, -2) / 8).masked_fill(
        ~mask.to_dense(100, 120), float("-inf")), -1)
    naive = naive_w @ v.repeat_interleave(4, 1)
    print(f"  {'naive formula':14s} max |err| = {(naive.double() - oracle).abs().max():.2e}")
    for name in backends.available():
        out = attention(q, k, v, mask=mask, backend=name)
        print(f"  {name:14s} max |err| = {(out.double() - oracle).abs().max():.2e}")
    print()
    print(backends.explain(q, k, v, mask=mask))


if __name__ == "__main__":
    tour()
