"""The declared layer-cache protocol: CacheRead / CacheAttention results, LayerCache, caches of one's own."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.cache import (
    CacheAttention,
    CacheRead,
    LayerCache,
    PagedCache,
    QuantizedCache,
    SinkCache,
    SlidingWindowCache,
    StaticCache,
    attend,
)
from attnkit.nn import MultiHeadAttention


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)


def test_cache_read_is_the_tuple_the_contract_returned():
    k, v = _kv(3)
    plain = CacheRead(k, v)
    assert isinstance(plain, tuple) and len(plain) == 2 and plain.k is k and plain.v is v and plain.mask is None
    k_all, v_all = plain
    assert k_all is k and v_all is v
    keep = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    masked = CacheRead(k, v, keep)
    assert len(masked) == 3 and masked.mask is keep and masked[2] is keep
    assert repr(masked) == "CacheRead(k (1, 2, 3, 8), v (1, 2, 3, 8), mask Tensor)"


@pytest.mark.parametrize(
    "make, decode_type",
    [
        (lambda: StaticCache(1, max_len=32), CacheRead),
        (lambda: SlidingWindowCache(1, window=4), CacheRead),
        (lambda: SinkCache(1, n_sink=2, window=32), CacheRead),
        (lambda: QuantizedCache(1, max_len=64, group_size=4), CacheAttention),
    ],
    ids=["static", "sliding", "sink", "quantized"],
)
def test_every_builtin_cache_returns_a_declared_result(make, decode_type):
    layer = make().layers[0]
    k, v = _kv(20)
    prompt = layer.update(k[:, :, :19], v[:, :, :19])
    assert isinstance(prompt, CacheRead)
    step = layer.update(k[:, :, 19:], v[:, :, 19:])
    assert isinstance(step, decode_type) and not isinstance(
        step, CacheRead if decode_type is CacheAttention else CacheAttention
    )


def test_paged_decode_steps_attend_themselves():
    pool = PagedCache(1, num_blocks=8, block_size=4, n_kv_heads=2, d_head=8)
    sid = pool.add_sequence()
    k, v = _kv(6)
    assert isinstance(pool.batch([sid]).layers[0].update(k[:, :, :5], v[:, :, :5]), CacheRead)
    step = pool.batch([sid]).layers[0].update(k[:, :, 5:], v[:, :, 5:])
    assert isinstance(step, CacheAttention)
    q = torch.randn(1, 4, 1, 8)
    torch.testing.assert_close(attend(step, q), attnkit.attention(q, k, v))
    assert isinstance(pool.packed([sid], [2]).layers[0].update(*_kv(2, 1)), CacheAttention)


class _ListCache:
    """A layer cache of one's own that returns plain tuples (the contract before CacheRead)."""

    def __init__(self, with_mask: bool):
        self.k = self.v = None
        self.with_mask = with_mask

    def update(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        if self.with_mask:
            return self.k, self.v, torch.ones(1, 1, 1, self.k.shape[2], dtype=torch.bool)
        return self.k, self.v

    @property
    def seq_len(self):
        return 0 if self.k is None else self.k.shape[2]


class _AttendingCache:
    """A cache of one's own whose update returns an object with attend() (not a CacheAttention subclass)."""

    def __init__(self):
        self.inner = StaticCache(1, max_len=16).layers[0]
        self.calls = 0

    def update(self, k, v):
        read = self.inner.update(k, v)
        cache = self

        class Step:
            def attend(self, q, *, mask=None, bias=None, scale=None, softcap=None):
                cache.calls += 1
                return attend(read, q, mask=mask, bias=bias, scale=scale, softcap=softcap)

        return Step()

    @property
    def seq_len(self):
        return self.inner.seq_len


@pytest.mark.parametrize(
    "make",
    [lambda: _ListCache(False), lambda: _ListCache(True), _AttendingCache],
    ids=["tuple", "tuple-with-mask", "attend-object"],
)
def test_a_cache_of_ones_own_still_works(make):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, n_kv_heads=2, mask=masks.causal()).eval()
    x = torch.randn(1, 6, 16)
    full = mha(x)
    cache = make()
    steps = [mha(x[:, :4], cache=cache)] + [mha(x[:, i : i + 1], cache=cache) for i in (4, 5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-6)
    if isinstance(cache, _AttendingCache):
        empty = torch.zeros(1, 2, 0, 4)
        assert cache.calls == 3 and isinstance(cache.update(empty, empty), CacheAttention)  # by its method


def test_a_cache_returning_something_else_is_told_the_protocol():
    class Bad:
        def update(self, k, v):
            return [k]

    with pytest.raises(TypeError, match="must return a CacheRead.*or a CacheAttention"):
        MultiHeadAttention(16, 4)(torch.randn(1, 3, 16), cache=Bad())
    with pytest.raises(TypeError, match="must return a CacheRead.*or a CacheAttention"):
        attend(object(), torch.randn(1, 2, 1, 8))


def test_layers_share_their_caches_padding():
    cache = StaticCache(2, max_len=8)
    cache.set_left_padding([2, 0])
    k = torch.randn(2, 1, 4, 2)
    masks_ = [layer.update(k, k).mask for layer in cache.layers]
    assert all(m[:, 0, 0].tolist() == [[False, False, True, True], [True] * 4] for m in masks_)
    lazy = StaticCache(1, max_len=8)
    lazy.set_left_padding([1, 0])  # (no storage yet: any number of counts is taken)
    with pytest.raises(ValueError, match="left padding has 2 counts but the update has a batch of 1"):
        lazy.layers[0].update(k[:1], k[:1])


def test_the_protocol_types_annotate_a_cache_of_ones_own():
    def store(cache: LayerCache, k: torch.Tensor) -> CacheRead:
        read = cache.update(k, k)
        assert isinstance(read, CacheRead)
        return read

    assert store(StaticCache(1, max_len=4).layers[0], torch.randn(1, 1, 2, 2)).k.shape == (1, 1, 2, 2)
