"""The splitkv backend: CPU decode attention split over chunks of keys, merged by log-sum-exp."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import backends, bias, masks
from attnkit.backends import splitkv as _splitkv
from attnkit.cache import SlidingWindowCache, StaticCache, attend
from attnkit.testing import check_against_oracle


def splitkv(q, k, v, **kw):
    return attnkit.attention(q, k, v, backend="splitkv", **kw)


MASKS = {
    "none": lambda lk, b: None,
    "causal": lambda lk, b: masks.causal(),
    "sliding": lambda lk, b: masks.sliding_window(max(1, lk // 3)),
    "key padding": lambda lk, b: masks.key_padding([lk // 2, lk][:b]),
    "padding and sliding": lambda lk, b: masks.key_padding([0, lk][:b]) & masks.sliding_window(5),
}
MODS = {
    "none": {},
    "softcap": {"softcap": 2.0},
    "alibi": {"bias": "alibi"},
    "sinks": {"sinks": "sinks"},
    "tensor bias": {"bias": "tensor"},
}


@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    g=st.sampled_from([1, 2, 4]),
    lq=st.integers(1, 3),
    lk=st.integers(0, 300),
    mask=st.sampled_from(sorted(MASKS)),
    mod=st.sampled_from(sorted(MODS)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    lse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_exact_within_the_rule_against_the_float64_oracle(b, hkv, g, lq, lk, mask, mod, dtype, lse, seed):
    """Every mask that applies to decoding, score modifiers, sinks, grouped heads, empty rows and empty caches;
    small chunks (and few pieces) so that the split, the shorter last chunk and the merge all run."""
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * g
    q = torch.randn(b, hq, lq, 16, generator=gen, dtype=dtype) * 2
    k = torch.randn(b, hkv, lk, 16, generator=gen, dtype=dtype) * 2
    v = torch.randn(b, hkv, lk, 8, generator=gen, dtype=dtype)
    kw = dict(MODS[mod])
    if kw.get("bias") == "alibi":
        kw["bias"] = bias.alibi(bias.alibi_slopes(hq))
    elif kw.get("bias") == "tensor":
        kw["bias"] = torch.randn(b, hq, 1, lk, generator=gen, dtype=dtype)
    if "sinks" in kw:
        kw["sinks"] = torch.randn(hq, generator=gen, dtype=dtype)
    m = MASKS[mask](lk, b)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_splitkv, "MIN_CHUNK", 7)
        mp.setattr(_splitkv, "CHUNKS", 5)
        mp.setattr(_splitkv, "SPLIT_BELOW", 3)
        with torch.no_grad():
            check_against_oracle(splitkv, q, k, v, mask=m, return_lse=lse, grad=False, **kw)


def test_rows_that_see_nothing_give_zeros_and_minus_inf():
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 3000, 8), torch.randn(2, 2, 3000, 8)
    out, lse = splitkv(q, k, v, mask=masks.key_padding([0, 3000]), return_lse=True)
    assert bool((out[0] == 0).all()) and bool((lse[0] == float("-inf")).all())
    assert bool(torch.isfinite(out[1]).all()) and bool(torch.isfinite(lse[1]).all())


def test_garbage_in_hidden_slots_reaches_no_row():
    """NaN and inf in keys and values that the mask hides (an unfilled cache's tail) leave the rows finite."""
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5000, 8), torch.randn(1, 2, 5000, 8)
    k[:, :, 4000:] = float("nan")
    v[:, :, 4000:] = float("inf")
    out = splitkv(q, k, v, mask=masks.key_padding([4000]))
    ref = splitkv(q, k[:, :, :4000], v[:, :, :4000])
    torch.testing.assert_close(out, ref)


def test_keys_are_read_in_place_and_grouped_heads_are_not_repeated():
    """No copy of the cache: the products read views of the keys (a cache buffer's prefix, strided)."""
    buf_k, buf_v = torch.randn(1, 2, 9000, 64), torch.randn(1, 2, 9000, 64)
    k, v = buf_k[:, :, :8200], buf_v[:, :, :8200]
    q = torch.randn(1, 8, 1, 64)
    seen = []
    real = torch.matmul

    def spy(a, b, *args, **kw):
        seen.append(b.untyped_storage().data_ptr())  # the keys (transposed) or the values
        return real(a, b, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "matmul", spy)
        out = splitkv(q, k, v)
    assert seen and set(seen) <= {buf_k.untyped_storage().data_ptr(), buf_v.untyped_storage().data_ptr()}
    check_against_oracle(splitkv, q, k, v, grad=False)
    assert out.shape == (1, 8, 1, 64)


def test_auto_picks_it_for_a_long_cpu_decode_call_and_explain_says_why():
    q, k, v = torch.randn(1, 8, 1, 128), torch.randn(1, 2, 32768, 128), torch.randn(1, 2, 32768, 128)
    text = backends.explain(q, k, v)
    assert text.startswith("auto picks 'splitkv'")
    assert "splitkv: a CPU decode call (4 query rows per kv head" in text and "1 x 32768 keys" in text
    assert "auto picks 'splitkv'" in backends.explain(q, k, v, mask=masks.causal())
    short = backends.explain(q, k[:, :, :8192], v[:, :, :8192])
    assert short.startswith("auto picks 'sdpa'")
    prefill = torch.randn(1, 8, 512, 128)
    assert not backends.explain(prefill, k, v, mask=masks.causal()).startswith("auto picks 'splitkv'")
    with_grad = q.clone().requires_grad_()
    assert not backends.explain(with_grad, k, v).startswith("auto picks 'splitkv'")
    assert "computes no gradients" in backends.explain(with_grad, k, v)


@pytest.mark.parametrize(
    "make",
    [
        lambda: StaticCache(1, max_len=6000, batch_size=1, n_kv_heads=2, d_head=32),
        lambda: SlidingWindowCache(1, window=5000, batch_size=1, n_kv_heads=2, d_head=32),
    ],
)
def test_static_and_sliding_caches_reach_it_through_their_attention(make, monkeypatch):
    monkeypatch.setattr(_splitkv, "MIN_KEYS", 4096)
    calls = []
    real = _splitkv.run
    entry = backends._REGISTRY["splitkv"]
    monkeypatch.setitem(
        backends._REGISTRY,
        "splitkv",
        backends.Backend(
            entry.name,
            lambda call: calls.append(call.kv_len) or real(call),
            entry.check,
            entry.cost,
            description=entry.description,
        ),
    )
    backends._PICKS.clear()
    cache = make()
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 4500, 32, generator=g), torch.randn(1, 2, 4500, 32, generator=g))
    kv = layer.update(torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g))
    q = torch.randn(1, 8, 1, 32, generator=g)
    with torch.no_grad():
        out = attend(kv, q, mask=masks.causal())
    assert calls == [4501]
    k, v = kv[0], kv[1]
    ref = attnkit.attention(q, k, v, mask=masks.causal(), backend="math")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_within_the_rule():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, s, 1 if s == 4 else 5000, 32, generator=g).bfloat16() for s in (4, 2, 2))
    with torch.no_grad():
        check_against_oracle(splitkv, q, k, v, mask=masks.sliding_window(3000), grad=False)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"mask": masks.sliding_window(3000)},
        {"softcap": 3.0},
        {"bias": bias.alibi(bias.alibi_slopes(8))},
        {"sinks": "sinks"},
    ],
)
def test_the_paged_decode_path_takes_a_long_sequence_split_over_its_blocks(kw, monkeypatch):
    """A sequence whose blocks are consecutive, long enough: paged_attention reads its blocks in place, each
    one a chunk merged by log-sum-exp; the result is the oracle's on the gathered keys within the rule."""
    monkeypatch.setattr(_splitkv, "MIN_KEYS", 4096)
    from attnkit.cache import paged_attention

    calls = []
    real = _splitkv.paged_decode
    monkeypatch.setattr(_splitkv, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    bs, lens = 16, [4100, 0, 4097]
    nb = [-(-n // bs) for n in lens]
    k_pool = torch.randn(sum(nb) + 2, 2, bs, 32, generator=g)
    v_pool = torch.randn(sum(nb) + 2, 2, bs, 32, generator=g)
    k_pool[0], v_pool[0] = float("nan"), float("nan")  # blocks no sequence uses
    starts = [1, 1, 1 + nb[0]]
    table = torch.zeros(3, max(nb), dtype=torch.int32)
    for b, (s, n) in enumerate(zip(starts, nb)):
        table[b, :n] = torch.arange(s, s + n)
    q = torch.randn(3, 8, 1, 32, generator=g)
    kw = dict(kw)
    if "sinks" in kw:
        kw["sinks"] = torch.randn(8, generator=g)
    with torch.no_grad():
        out = paged_attention(q, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32), **kw)
    assert calls == [1]
    assert bool((out[1] == 0).all())
    for b in (0, 2):
        ks = k_pool[table[b, : nb[b]].long()].transpose(0, 1).reshape(1, 2, -1, 32)[:, :, : lens[b]]
        vs = v_pool[table[b, : nb[b]].long()].transpose(0, 1).reshape(1, 2, -1, 32)[:, :, : lens[b]]
        check_against_oracle(lambda *a, **k2: out[b : b + 1], q[b : b + 1], ks, vs, grad=False, **kw)


def test_a_paged_cache_decode_step_of_a_long_sequence_takes_it(monkeypatch):
    monkeypatch.setattr(_splitkv, "MIN_KEYS", 4096)
    from attnkit.cache import PagedCache

    calls = []
    real = _splitkv.paged_decode
    monkeypatch.setattr(_splitkv, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(4)
    pool = PagedCache(1, num_blocks=300, block_size=16, n_kv_heads=2, d_head=32)
    sid = pool.add_sequence()
    k, v = torch.randn(1, 2, 4200, 32, generator=g), torch.randn(1, 2, 4200, 32, generator=g)
    view = pool.batch([sid])
    view.layers[0].update(k[:, :, :4199], v[:, :, :4199])
    view = pool.batch([sid])
    kv = view.layers[0].update(k[:, :, 4199:], v[:, :, 4199:])
    q = torch.randn(1, 8, 1, 32, generator=g)
    with torch.no_grad():
        out = attend(kv, q, mask=masks.causal())
    assert calls == [1]
    check_against_oracle(lambda *a, **kw: out, q, k, v, grad=False)
