"""Test helpers for attnkit.nn: a tiny contiguous KV cache (test-only; the real caches live in attnkit.cache)."""

from __future__ import annotations

import pytest
import torch


class ConcatLayerCache:
    """Appends new keys/values along the length dim and returns everything stored, in position order."""

    def __init__(self, extra_mask=None):
        self.k = self.v = None
        self.extra_mask = extra_mask  # a callable(kv_len) -> mask, to exercise the 3-tuple form
        self.calls = 0

    @property
    def seq_len(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k, v):
        self.calls += 1
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)  # (B, Hkv, Lk, D)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        if self.extra_mask is not None:
            return self.k, self.v, self.extra_mask(self.k.shape[2])
        return self.k, self.v


class ConcatCache:
    """Model-level cache: ``layers``, ``cross_layers`` and ``seq_len`` (tokens stored in layer 0)."""

    def __init__(self, n_layers: int, *, cross: bool = False, extra_mask=None):
        self.layers = [ConcatLayerCache(extra_mask) for _ in range(n_layers)]
        self.cross_layers = [ConcatLayerCache() for _ in range(n_layers)] if cross else None

    @property
    def seq_len(self) -> int:
        return self.layers[0].seq_len


@pytest.fixture
def concat_cache():
    return ConcatCache


@pytest.fixture
def concat_layer_cache():
    return ConcatLayerCache


@pytest.fixture
def lm_losses():
    """The losses of eight AdamW steps (lr 3e-3) of a 256-token language model on one fixed random batch."""

    def losses(model) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(8):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(float(loss.detach()))
        return out

    return losses


@pytest.fixture
def check_cached_decoding():
    """``check(layer, x, prefill, chunks)``: a self-attention layer decoding through a StaticCache gives its full
    forward over ``x`` (B, L, D) in float64 (to 1e-12), fed ``prefill`` tokens and then one token a step, and fed
    the chunks ``[(start, end), ...]`` of a prefill in pieces (queries behind a longer key range).  Returns the
    full forward."""
    from attnkit.cache import StaticCache

    def check(m, x, prefill: int, chunks) -> torch.Tensor:
        L = x.shape[1]
        full = m(x)
        cache = StaticCache(1, max_len=24)
        steps = [m(x[:, :prefill], cache=cache.layers[0])]
        steps += [m(x[:, i : i + 1], cache=cache.layers[0]) for i in range(prefill, L)]
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-12)
        chunked = StaticCache(1, max_len=24)
        parts = [m(x[:, a:b], cache=chunked.layers[0]) for a, b in chunks]
        assert torch.allclose(torch.cat(parts, 1), full, atol=1e-12)
        return full

    return check
