"""Attention sinks: one logit per query head in every row's softmax denominator, with a zero value."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.softmax import add_sink, merge
from attnkit.testing import check_against_oracle, reference
from attnkit.testing import random_qkv


def _qkv(B=2, Hq=4, Hkv=2, Lq=21, Lk=29, D=16, Dv=16, dtype=torch.float32, seed=0):
    q, k, v = random_qkv(B, Hq, Hkv, Lq, Lk, D, Dv, dtype=dtype, requires_grad=True, seed=seed)
    sinks = (torch.randn(Hq, generator=torch.Generator().manual_seed(seed + 1)) * 2).requires_grad_(True)
    return q, k, v, sinks


def _backend(name):
    return lambda q, k, v, **kw: attnkit.attention(q, k, v, backend=name, **kw)


def test_reference_is_the_formula_with_a_zero_value_column():
    q, k, v, sinks = _qkv(dtype=torch.float64)
    out, lse = reference(q, k, v, sinks=sinks, mask=masks.causal())
    # the sink as one more key whose score is the sink and whose value is zero
    kk = k.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-1, -2)) / 4.0
    s = s.masked_fill(~masks.causal().to_dense(21, 29), float("-inf"))
    ext = torch.cat([s, sinks.double()[None, :, None, None].expand(2, 4, 21, 1)], -1)
    w = torch.softmax(ext, -1)[..., :-1]
    torch.testing.assert_close(out, w @ v.repeat_interleave(2, 1))
    torch.testing.assert_close(lse, torch.logsumexp(ext, -1))


_MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(),
    "window": lambda: masks.sliding_window(6),
    "document": lambda: masks.document(torch.tensor([[0] * 10 + [1] * 19, [0] * 20 + [1] * 9])),
    "empty-rows": lambda: masks.causal(align="top_left") & masks.key_padding([12, 4]),
}


@pytest.mark.parametrize("backend", ["math", "flash"])
@pytest.mark.parametrize("mask", list(_MASKS))
@pytest.mark.parametrize(
    "dtype,Dv,softcap",
    [(torch.float32, 16, None), (torch.float16, 8, None), (torch.bfloat16, 16, 20.0), (torch.float32, 8, 5.0)],
)
def test_rule_against_the_oracle_forward_and_backward(backend, mask, dtype, Dv, softcap):
    # Dv != D takes flash's explicit path, Dv == D its fused one
    q, k, v, sinks = _qkv(Dv=Dv, dtype=dtype)
    report = check_against_oracle(
        _backend(backend), q, k, v, mask=_MASKS[mask](), softcap=softcap, sinks=sinks, return_lse=True
    )
    assert {"out", "lse", "dq", "dk", "dv", "dsinks"} <= set(report)


@pytest.mark.parametrize("backend", ["math", "flash", "sdpa"])
def test_sinks_broadcast_per_batch_and_head(backend):
    q, k, v, _ = _qkv()
    sinks = torch.randn(2, 4).requires_grad_(True)
    check_against_oracle(_backend(backend), q, k, v, mask=masks.causal(), sinks=sinks)


@pytest.mark.parametrize("backend", ["math", "flash"])
@pytest.mark.parametrize("Dv,bias", [(6, False), (8, False), (8, True)])
def test_gradcheck_float64(backend, Dv, bias):
    q, k, v, sinks = _qkv(B=1, Hq=2, Hkv=1, Lq=5, Lk=7, D=8, Dv=Dv, dtype=torch.float64)
    sinks = sinks.double().detach().requires_grad_(True)
    b = torch.randn(1, 2, 5, 7, dtype=torch.float64, requires_grad=True) if bias else None

    def f(q, k, v, sinks, *b):
        out, lse = attnkit.attention(
            q, k, v, mask=masks.causal(), sinks=sinks, return_lse=True, backend=backend, bias=b[0] if b else None
        )
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, sinks, *([b] if bias else [])))
    assert torch.autograd.gradcheck(lambda *a: f(*a)[0], (q, k, v, sinks, *([b] if bias else [])))


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_a_row_that_sees_nothing_gives_zero_lse_sink_and_zero_gradients(backend):
    q, k, v, sinks = _qkv(B=1, Lq=6, Lk=3)  # causal bottom-right: the first 3 rows see nothing
    out, lse = attnkit.attention(q, k, v, mask=masks.causal(), sinks=sinks, return_lse=True, backend=backend)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    torch.testing.assert_close(lse[:, :, :3], sinks.detach()[None, :, None].expand(1, 4, 3))
    g = torch.zeros_like(out)
    g[:, :, :3] = 1.0  # a gradient only on the empty rows' outputs
    dq, dk, dv, ds = torch.autograd.grad(out, (q, k, v, sinks), g)
    for t in (dq, dk, dv, ds):
        assert torch.equal(t, torch.zeros_like(t))


def test_lse_includes_the_sink_and_merge_then_add_sink_once_is_exact():
    q, k, v, sinks = _qkv(dtype=torch.float64)
    full, full_lse = attnkit.attention(q, k, v, sinks=sinks, return_lse=True, backend="math")
    a = attnkit.attention(q, k[:, :, :10], v[:, :, :10], return_lse=True, backend="math")
    b = attnkit.attention(q, k[:, :, 10:], v[:, :, 10:], return_lse=True, backend="math")
    out, lse = add_sink(*merge(*a, *b), sinks)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)
    twice = merge(
        *attnkit.attention(q, k[:, :, :10], v[:, :, :10], sinks=sinks, return_lse=True),
        *attnkit.attention(q, k[:, :, 10:], v[:, :, 10:], sinks=sinks, return_lse=True),
    )[0]
    assert not torch.allclose(twice, full)  # why the docs say: merge without the sink, add it once


@pytest.mark.parametrize("mask", list(_MASKS))
@pytest.mark.parametrize("dtype,Dv", [(torch.float32, 16), (torch.float16, 8), (torch.bfloat16, 16)])
def test_sdpa_takes_sinks_as_an_extra_key_within_the_rule(mask, dtype, Dv):
    q, k, v, sinks = _qkv(Dv=Dv, dtype=dtype)
    report = check_against_oracle(_backend("sdpa"), q, k, v, mask=_MASKS[mask](), sinks=sinks)
    assert {"out", "dq", "dk", "dv", "dsinks"} <= set(report)


@pytest.mark.parametrize("bias", [False, True])
def test_sdpa_sinks_gradcheck_float64(bias):
    q, k, v, sinks = _qkv(B=1, Hq=2, Hkv=1, Lq=5, Lk=7, D=8, Dv=6, dtype=torch.float64)
    sinks = sinks.double().detach().requires_grad_(True)
    b = torch.randn(1, 2, 5, 7, dtype=torch.float64, requires_grad=True) if bias else None

    def f(q, k, v, sinks, *b):
        return attnkit.attention(q, k, v, mask=masks.causal(), sinks=sinks, backend="sdpa", bias=b[0] if b else None)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks, *([b] if bias else [])))


def test_sdpa_sinks_a_row_that_sees_nothing_gives_zero_and_zero_gradients():
    q, k, v, sinks = _qkv(B=1, Lq=6, Lk=3)  # causal bottom-right: the first 3 rows see nothing
    out = attnkit.attention(q, k, v, mask=masks.causal(), sinks=sinks, backend="sdpa")
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    g = torch.zeros_like(out)
    g[:, :, :3] = 1.0
    for t in torch.autograd.grad(out, (q, k, v, sinks), g):
        assert torch.equal(t, torch.zeros_like(t))


def test_sdpa_refuses_what_it_cannot_add_a_sink_to_and_explain_says_why():
    q, k, v, sinks = _qkv()
    with pytest.raises(ValueError, match="log-sum-exp"):
        attnkit.attention(q, k, v, sinks=sinks, return_lse=True, backend="sdpa")
    with pytest.raises(ValueError, match="scale=0"):
        attnkit.attention(q, k, v, sinks=sinks, scale=0.0, backend="sdpa")
    text = attnkit.backends.explain(q, k, v, sinks=sinks, return_lse=True)
    assert "SDPA does not return the log-sum-exp" in text and "sinks" in text.splitlines()[0]
    check_against_oracle(attnkit.attention, q, k, v, mask=masks.causal(), sinks=sinks)


@pytest.mark.parametrize(
    "sinks,err,match",
    [
        ([0.0] * 4, TypeError, "sinks must be None or a float tensor"),
        (torch.zeros(4, dtype=torch.int64), TypeError, "float tensor"),
        (torch.zeros(3), ValueError, r"does not broadcast to \(B, Hq\)=\(2, 4\)"),
        (torch.tensor([0.0, float("nan"), 0.0, 0.0]), ValueError, "non-finite"),
    ],
)
def test_bad_sinks_are_refused_with_the_fix(sinks, err, match):
    q, k, v, _ = _qkv()
    with pytest.raises(err, match=match):
        attnkit.attention(q, k, v, sinks=sinks)


def test_no_sink_is_the_limit_of_a_very_negative_sink():
    q, k, v, _ = _qkv()
    out = attnkit.attention(q, k, v, sinks=torch.full((4,), -1e4), backend="flash")
    torch.testing.assert_close(out, attnkit.attention(q, k, v, backend="flash"))


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2),
    G=st.integers(1, 3),
    Hkv=st.integers(1, 2),
    Lq=st.integers(1, 40),
    Lk=st.integers(1, 40),
    window=st.one_of(st.none(), st.integers(0, 8)),
    scale=st.floats(-3.0, 3.0),
    backend=st.sampled_from(["math", "flash"]),
    seed=st.integers(0, 2**16),
)
def test_property_any_shape_and_sink(B, G, Hkv, Lq, Lk, window, scale, backend, seed):
    q, k, v, _ = _qkv(B=B, Hq=G * Hkv, Hkv=Hkv, Lq=Lq, Lk=Lk, D=8, Dv=8, seed=seed)
    sinks = (torch.randn(G * Hkv, generator=torch.Generator().manual_seed(seed)) * 10**scale).requires_grad_(True)
    mask = masks.causal() if window is None else masks.sliding_window(window)
    check_against_oracle(_backend(backend), q, k, v, mask=mask, sinks=sinks, return_lse=True)


def test_ring_attention_adds_the_sink_once_forward_and_backward():
    import torch.distributed as dist

    from attnkit.distributed import ring_attention, shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        q, k, v, sinks = _qkv(B=1, Lq=32, Lk=32, dtype=torch.float64)
        out, lse = ring_attention(shard(q), shard(k), shard(v), mask=masks.causal(), sinks=sinks, return_lse=True)
        want, want_lse = attnkit.attention(q, k, v, mask=masks.causal(), sinks=sinks, return_lse=True, backend="math")
        torch.testing.assert_close(out, shard(want))
        torch.testing.assert_close(lse, shard(want_lse))
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v, sinks), g)
        ref = torch.autograd.grad(shard(want), (q, k, v, sinks), g)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------- modules, caches, generate, Engine


def _sink_model(**kw):
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(
        DecoderConfig(
            vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, attention_sinks=True, **kw
        )
    ).eval()
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "sinks", None) is not None:
                m.sinks.copy_(torch.randn(m.sinks.shape) * 2)
    return model


def test_multihead_attention_sinks_parameter_gets_its_gradient():
    from attnkit.nn import MultiHeadAttention

    mha = MultiHeadAttention(32, 4, n_kv_heads=2, mask=masks.causal(), sinks=True)
    assert tuple(mha.sinks.shape) == (4,) and "sinks=True" in repr(mha)
    with torch.no_grad():
        mha.sinks.fill_(1.5)
    x = torch.randn(2, 9, 32)
    out, w = mha(x, need_weights=True)
    assert bool((w.sum(-1) < 1).all())  # the sink took a share of every row
    out.sum().backward()
    assert mha.sinks.grad is not None and bool((mha.sinks.grad != 0).all())
    with pytest.raises(TypeError, match="sinks"):
        MultiHeadAttention(32, 4, sinks="yes")


def test_sink_model_logits_change_with_the_sinks():
    model = _sink_model()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        a = model(ids)
        for m in model.modules():
            if getattr(m, "sinks", None) is not None:
                m.sinks.add_(3.0)
        b = model(ids)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("cache", ["static", "sliding", "paged", "int8", None])
def test_generate_with_sinks_decodes_like_the_full_forward(cache):
    model = _sink_model(mask=masks.sliding_window(7)) if cache == "sliding" else _sink_model()
    prompt = [3, 14, 15, 9, 2, 6, 5]
    out = attnkit.generate(model, [prompt], 12, cache=cache)[0]
    # greedy by hand: the whole sequence through the full forward at every step
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt) :]


def test_cache_decode_logits_equal_the_full_forward_with_sinks():
    from attnkit.cache import StaticCache

    model = _sink_model()
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        full = model(ids)
        cache = StaticCache.for_model(model, 2, 16)
        step = [model(ids[:, :6], cache=cache)]
        for i in range(6, 10):
            step.append(model(ids[:, i : i + 1], cache=cache))
    torch.testing.assert_close(torch.cat(step, 1), full, atol=1e-5, rtol=1e-5)


def test_engine_with_sinks_matches_generate():
    model = _sink_model()
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    a = engine.add([1, 2, 3], max_new_tokens=6)
    b = engine.add([4, 5, 6, 7, 8], max_new_tokens=6)
    done = engine.run()
    assert done[a] == attnkit.generate(model, [[1, 2, 3]], 6)[0]
    assert done[b] == attnkit.generate(model, [[4, 5, 6, 7, 8]], 6)[0]


def test_paged_attention_with_sinks_against_attention():
    from attnkit.cache import paged_attention

    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = torch.randn(8, 2, 4, 16, generator=g), torch.randn(8, 2, 4, 16, generator=g)
    table = torch.tensor([[3, 5, 0], [1, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([7, 2], dtype=torch.int32)
    q = torch.randn(2, 4, 1, 16, generator=g)
    sinks = torch.randn(4, generator=g)
    out = paged_attention(q, k_pool, v_pool, table, lens, sinks=sinks)
    for b, (row, n) in enumerate(zip(table.tolist(), lens.tolist())):
        k = torch.cat([k_pool[i] for i in row], 1)[None, :, :n]
        v = torch.cat([v_pool[i] for i in row], 1)[None, :, :n]
        torch.testing.assert_close(out[b : b + 1], attnkit.attention(q[b : b + 1], k, v, sinks=sinks, backend="math"))
    hm_k, hm_v = (
        k_pool.transpose(0, 1).contiguous().transpose(0, 1),
        v_pool.transpose(0, 1).contiguous().transpose(0, 1),
    )
    torch.testing.assert_close(paged_attention(q, hm_k, hm_v, table, lens, sinks=sinks), out)
