"""auto and PyTorch's unfused SDPA path: on CPU, SDPA's fused kernel needs the value head size equal to the
query's; other calls (latent attention: 576 against 512) run its math path, far slower than the tiled backends."""

import pytest
import torch

import attnkit
from attnkit import backends, masks
from attnkit.testing import reference


@pytest.mark.parametrize("shape", [(16, 1, 1, 64, 48), (8, 1, 5, 40, 24), (4, 2, 1, 33, 16)])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_auto_does_not_pick_sdpa_when_value_width_differs_on_cpu(shape, mask):
    Hq, Hkv, Lq, Lk, Dv = shape
    D = 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, Hq, Lq, D, generator=g)
    k = torch.randn(1, Hkv, Lk, D, generator=g)
    v = torch.randn(1, Hkv, Lk, Dv, generator=g)
    m = masks.causal() if mask else None
    text = backends.explain(q, k, v, mask=m)
    assert "auto picks 'sdpa'" not in text.splitlines()[0], text
    # and a same-width call still takes the fused kernel, which has no such fallback
    assert "auto picks 'sdpa'" in backends.explain(q, k, torch.randn(1, Hkv, Lk, D), mask=m).splitlines()[0]
    out = attnkit.attention(q, k, v, mask=m)
    oracle, _ = reference(q.double(), k.double(), v.double(), mask=m)
    assert (out.double() - oracle).abs().max() < 1e-5
