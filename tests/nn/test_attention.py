"""MultiHeadAttention: projections, grouped-query and cross attention, scores, caches, from_torch, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import masks
from attnkit.nn import ALiBi, MultiHeadAttention, RotaryEmbedding, SinusoidalPositions, T5RelativeBias
from attnkit.testing import reference

D64 = torch.float64


def split_heads(t, n, d):
    B, L, _ = t.shape
    return t.view(B, L, n, d).transpose(1, 2)


def manual_self(m: MultiHeadAttention, x, *, mask=None, bias=None):
    """The module's forward written out from its weights, with the textbook formula (float64)."""
    Hq, Hkv, D = m.n_heads, m.n_kv_heads, m.d_head
    w, b = m.qkv_proj.weight, m.qkv_proj.bias
    wq, wk, wv = w[: Hq * D], w[Hq * D : (Hq + Hkv) * D], w[(Hq + Hkv) * D :]
    bq, bk, bv = (None, None, None) if b is None else (b[: Hq * D], b[Hq * D : (Hq + Hkv) * D], b[(Hq + Hkv) * D :])
    q = split_heads(x @ wq.T + (0 if bq is None else bq), Hq, D)
    k = split_heads(x @ wk.T + (0 if bk is None else bk), Hkv, D)
    v = split_heads(x @ wv.T + (0 if bv is None else bv), Hkv, D)
    out, _ = reference(q, k, v, mask=mask, bias=bias, scale=1 / (math.sqrt(D) * m.temperature), softcap=m.softcap)
    out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], Hq * D)
    return m.out_proj(out)


@given(st.integers(1, 4), st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(1, 9), st.booleans())
def test_self_attention_matches_the_written_out_formula(hkv, group, d_head, length, causal):
    torch.manual_seed(length)
    hq = hkv * group
    m = MultiHeadAttention(12, hq, n_kv_heads=hkv, d_head=2 * d_head, mask=masks.causal() if causal else None)
    m = m.to(D64)
    x = torch.randn(2, length, 12, dtype=D64)
    expected = manual_self(m, x, mask=masks.causal() if causal else None)
    torch.testing.assert_close(m(x), expected, rtol=0, atol=1e-12)


def test_fused_projection_stacks_q_k_v_rows():
    m = MultiHeadAttention(16, 4, n_kv_heads=2)
    assert m.qkv_proj.weight.shape == ((4 + 2 * 2) * 4, 16)
    assert m.out_proj.weight.shape == (16, 16)
    assert m.qkv_proj.weight.stride() == (16, 1)  # nn.Linear's row-major storage


def test_d_head_may_differ_from_d_model_over_heads():
    m = MultiHeadAttention(10, 3, d_head=4).to(D64)
    x = torch.randn(2, 5, 10, dtype=D64)
    assert m.qkv_proj.weight.shape == (36, 10)
    torch.testing.assert_close(m(x), manual_self(m, x), rtol=0, atol=1e-12)


def test_temperature_softcap_and_biases_follow_the_contract_order():
    m = MultiHeadAttention(16, 2, softcap=3.0, temperature=0.5, bias=False).to(D64)
    assert m.qkv_proj.bias is None and m.out_proj.bias is None
    with torch.no_grad():
        m.qkv_proj.weight.mul_(4.0)  # large scores so the softcap matters
    x = torch.randn(2, 6, 16, dtype=D64)
    torch.testing.assert_close(m(x), manual_self(m, x), rtol=0, atol=1e-12)
    plain = MultiHeadAttention(16, 2, bias=False).to(D64)
    plain.load_state_dict(m.state_dict())
    assert (plain(x) - m(x)).abs().max() > 1e-3


def test_qk_norm_normalises_every_head_before_attention():
    m = MultiHeadAttention(16, 4, qk_norm=True).to(D64)
    with torch.no_grad():
        m.q_norm.weight.uniform_(0.5, 1.5)
        m.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 16, dtype=D64)
    H, D = 4, 4
    w, b = m.qkv_proj.weight, m.qkv_proj.bias
    qkv = x @ w.T + b
    q, k, v = (split_heads(t, H, D) for t in qkv.split(16, dim=-1))

    def rms(t, g):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    out, _ = reference(rms(q, m.q_norm.weight), rms(k, m.k_norm.weight), v)
    expected = m.out_proj(out.transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(m(x), expected, rtol=0, atol=1e-12)


def test_need_weights_returns_per_head_weights_that_explain_the_output():
    m = MultiHeadAttention(8, 2, n_kv_heads=1, mask=masks.causal(), bias=False).to(D64)
    x = torch.randn(3, 7, 8, dtype=D64)
    out, w = m(x, need_weights=True)
    assert w.shape == (3, 2, 7, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 7, dtype=D64))
    assert bool((w.triu(1) == 0).all())
    v = split_heads(x @ m.qkv_proj.weight[12:].T, 1, 4)  # (B, 1, L, 4)
    expected = m.out_proj((w @ v).transpose(1, 2).reshape(3, 7, 8))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_call_mask_and_module_mask_are_and_ed():
    m = MultiHeadAttention(8, 2, mask=masks.causal()).to(D64)
    x = torch.randn(2, 6, 8, dtype=D64)
    pad = masks.key_padding([6, 4])
    expected = manual_self(m, x, mask=masks.causal() & pad)
    torch.testing.assert_close(m(x, mask=pad), expected, rtol=0, atol=1e-12)
    dense = pad.to_dense(6, 6, batch=2)  # (2, 1, 6, 6) bool tensor works as well
    torch.testing.assert_close(m(x, mask=dense), expected, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------ cross attention


def test_cross_attention_with_another_context_width_uses_q_and_fused_kv():
    m = MultiHeadAttention(16, 4, n_kv_heads=2, kdim=6).to(D64)
    assert m.q_proj.weight.shape == (16, 16) and m.kv_proj.weight.shape == (16, 6)
    x, ctx = torch.randn(2, 5, 16, dtype=D64), torch.randn(2, 9, 6, dtype=D64)
    q = split_heads(m.q_proj(x), 4, 4)
    k, v = (split_heads(t, 2, 4) for t in m.kv_proj(ctx).split(8, dim=-1))
    out, _ = reference(q, k, v)
    torch.testing.assert_close(m(x, ctx), m.out_proj(out.transpose(1, 2).reshape(2, 5, 16)), rtol=0, atol=1e-12)


def test_cross_attention_with_different_key_and_value_widths_takes_a_pair():
    m = MultiHeadAttention(8, 2, kdim=3, vdim=5).to(D64)
    x, kin, vin = torch.randn(2, 4, 8, dtype=D64), torch.randn(2, 6, 3, dtype=D64), torch.randn(2, 6, 5, dtype=D64)
    q, k, v = split_heads(m.q_proj(x), 2, 4), split_heads(m.k_proj(kin), 2, 4), split_heads(m.v_proj(vin), 2, 4)
    out, _ = reference(q, k, v)
    torch.testing.assert_close(m(x, (kin, vin)), m.out_proj(out.transpose(1, 2).reshape(2, 4, 8)), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="kdim=3 != vdim=5"):
        m(x, kin)


def test_a_self_attention_module_can_attend_to_a_context_of_the_same_width():
    m = MultiHeadAttention(8, 2).to(D64)
    x, ctx = torch.randn(2, 3, 8, dtype=D64), torch.randn(2, 5, 8, dtype=D64)
    q = split_heads(x @ m.qkv_proj.weight[:8].T + m.qkv_proj.bias[:8], 2, 4)
    kv = ctx @ m.qkv_proj.weight[8:].T + m.qkv_proj.bias[8:]
    k, v = (split_heads(t, 2, 4) for t in kv.split(8, dim=-1))
    out, _ = reference(q, k, v)
    torch.testing.assert_close(m(x, ctx), m.out_proj(out.transpose(1, 2).reshape(2, 3, 8)), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------ attention hooks


def test_every_forward_path_runs_the_attention_hooks(concat_layer_cache):
    calls = []
    m = MultiHeadAttention(8, 2, mask=masks.causal(), positions=RotaryEmbedding(4))
    cross = MultiHeadAttention(8, 2, kdim=5)
    for mod in (m, cross):

        def hook(module, call, compute):
            calls.append((tuple(call.q.shape), tuple(call.k.shape), call.dropout_p, call.sinks))
            return compute(call)

        mod.register_attention_hook(hook)
    x = torch.randn(1, 4, 8)
    m(x)
    c = concat_layer_cache()
    m(x, cache=c)
    m(x[:, :1], cache=c)
    cross(x, torch.randn(1, 6, 5))
    assert [c[:2] for c in calls] == [
        ((1, 2, 4, 4), (1, 2, 4, 4)),
        ((1, 2, 4, 4), (1, 2, 4, 4)),
        ((1, 2, 1, 4), (1, 2, 5, 4)),
        ((1, 2, 4, 4), (1, 2, 6, 4)),
    ]
    assert all(c[2:] == (0.0, None) for c in calls)


def test_backend_is_passed_to_attention():
    x = torch.randn(2, 5, 8, dtype=D64)
    m = MultiHeadAttention(8, 2, mask=masks.causal(), backend="math").to(D64)
    s = MultiHeadAttention(8, 2, mask=masks.causal(), backend="sdpa").to(D64)
    s.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x), s(x), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="backend='sdpa' cannot take this call"):
        MultiHeadAttention(8, 2, softcap=2.0, backend="sdpa")(x.float())


# -------------------------------------------------------------------------------------- caches


@pytest.mark.parametrize("positions", [None, "rope", "alibi", "t5", "sinusoidal"])
@pytest.mark.parametrize("layout", [(4, 4), (4, 1)])
def test_cached_self_attention_equals_full_recomputation(concat_layer_cache, positions, layout):
    hq, hkv = layout
    pe = {
        None: None,
        "rope": RotaryEmbedding(4),
        "alibi": ALiBi(hq),
        "t5": T5RelativeBias(hq, bidirectional=False),
        "sinusoidal": SinusoidalPositions(16),
    }[positions]
    m = MultiHeadAttention(16, hq, n_kv_heads=hkv, positions=pe, mask=masks.causal() & masks.sliding_window(4))
    x = torch.randn(2, 9, 16)
    full = m(x)
    c = concat_layer_cache()
    parts = [m(x[:, :3], cache=c)] + [m(x[:, t : t + 1], cache=c) for t in range(3, 7)] + [m(x[:, 7:], cache=c)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


def test_cache_extra_mask_is_and_ed_with_the_layer_mask(concat_layer_cache):
    m = MultiHeadAttention(8, 2, mask=masks.causal())
    x = torch.randn(2, 5, 8)
    hide = torch.tensor([[True, False, True, True, True], [True, True, True, True, True]])  # key 1 of row 0 hidden

    def extra(kv_len):
        return hide[:, None, None, :kv_len]  # bool (B, 1, 1, Lk)

    c = concat_layer_cache(extra)
    parts = [m(x[:, :2], cache=c)] + [m(x[:, t : t + 1], cache=c) for t in range(2, 5)]
    full = m(x, mask=hide[:, None, None, :])
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-6)
    c = concat_layer_cache(lambda kv_len: masks.key_padding(torch.tensor([kv_len, kv_len])))  # a Mask works too
    torch.testing.assert_close(m(x, cache=c), m(x), rtol=0, atol=1e-6)


def test_a_cache_that_computes_attention_itself_gets_q_and_the_masks():
    seen = {}

    class AttendingCache:
        def __init__(self):
            self.k = self.v = None

        def update(self, k, v):
            self.k, self.v = k, v
            return self

        def attend(self, q, *, mask, bias, scale, softcap):
            seen.update(mask=mask, bias=bias, scale=scale, softcap=softcap)
            import attnkit

            return attnkit.attention(q, self.k, self.v, mask=mask, bias=bias, scale=scale, softcap=softcap)

    m = MultiHeadAttention(8, 2, mask=masks.causal(), positions=ALiBi(2), softcap=5.0, temperature=2.0)
    x = torch.randn(1, 4, 8)
    torch.testing.assert_close(m(x, cache=AttendingCache()), m(x), rtol=0, atol=1e-6)
    assert seen["scale"] == pytest.approx(1 / (2 * 2.0)) and seen["softcap"] == 5.0
    assert seen["bias"] is not None and seen["mask"] is not None
    with pytest.raises(ValueError, match="need_weights"):
        m(x, cache=AttendingCache(), need_weights=True)


def test_cross_attention_cache_projects_the_context_once(concat_layer_cache):
    m = MultiHeadAttention(8, 2, kdim=6)
    projected = []
    m.kv_proj.register_forward_hook(lambda mod, inp, out: projected.append(out.shape))
    ctx = torch.randn(2, 7, 6)
    x = torch.randn(2, 5, 8)
    full = m(x, ctx)
    projected.clear()
    c = concat_layer_cache()
    parts = [m(x[:, t : t + 1], ctx, cache=c) for t in range(5)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-6)
    assert projected == [torch.Size([2, 7, 16])]  # once, on the first call
    assert c.calls == 5 and c.seq_len == 7


def test_bad_cache_results_are_explained():
    class Bad:
        seq_len = 0

        def update(self, k, v):
            return k

    class NoLength:
        def update(self, k, v):
            return k, v

    with pytest.raises(TypeError, match="must return"):
        MultiHeadAttention(8, 2)(torch.randn(1, 2, 8), cache=Bad())
    with pytest.raises(TypeError, match="seq_len"):
        MultiHeadAttention(8, 2, kdim=4)(torch.randn(1, 2, 8), torch.randn(1, 3, 4), cache=NoLength())
    with pytest.raises(ValueError, match="positions"):
        MultiHeadAttention(8, 2, positions=RotaryEmbedding(4))(torch.randn(1, 2, 8), cache=NoLength())


def test_a_cache_without_update_is_a_clear_error():
    """cache=[] (or a model-level cache given to one layer) raised AttributeError deep in the forward."""
    from attnkit.cache import StaticCache

    mha = MultiHeadAttention(8, 2, positions=RotaryEmbedding(4))
    for cache, match in (
        ([], "cache must be None or one layer's KV cache with update"),
        (object(), "got object"),
        (StaticCache(2, max_len=8), r"model-level StaticCache: .* cache.layers\[i\]"),
    ):
        with pytest.raises(TypeError, match=match):
            mha(torch.randn(1, 2, 8), cache=cache)
    cache = StaticCache(1, max_len=8)
    assert mha(torch.randn(1, 2, 8), cache=cache.layers[0]).shape == (1, 2, 8) and cache.seq_len == 2


# ----------------------------------------------------------------------------------- from_torch


def torch_masks_to_ours(key_padding_mask, attn_mask, batch, heads):
    allowed = None
    if key_padding_mask is not None:
        allowed = ~key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        am = ~attn_mask if attn_mask.dim() == 2 else ~attn_mask.view(batch, heads, *attn_mask.shape[1:])
        allowed = am if allowed is None else allowed & am
    return allowed


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", ["self", "cross", "kdim", "kdim_vdim"])
@pytest.mark.parametrize("masking", [None, "padding", "attn", "both", "per_head"])
def test_from_torch_is_identical(batch_first, kind, masking):
    torch.manual_seed(1)
    E, H, B, L, S = 12, 3, 2, 5, 7
    kdim, vdim = {"kdim": (4, 4), "kdim_vdim": (4, 6)}.get(kind, (None, None))
    tm = torch.nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=vdim, dtype=D64).eval()
    with torch.no_grad():
        for p in tm.parameters():
            p.normal_()
    ours = MultiHeadAttention.from_torch(tm)
    assert ours.qkv_proj.weight.dtype == D64 if kind in ("self", "cross") else ours.q_proj.weight.dtype == D64
    S = L if kind == "self" else S
    x = torch.randn(B, L, E, dtype=D64)
    key = x if kind == "self" else torch.randn(B, S, kdim or E, dtype=D64)
    value = key if kind in ("self", "cross", "kdim") else torch.randn(B, S, vdim, dtype=D64)
    kpm = torch.rand(B, S) < 0.3 if masking in ("padding", "both") else None
    if kpm is not None:
        kpm[:, 0] = False  # every row keeps one key (torch returns NaN for fully masked rows)
    if masking in ("attn", "both"):
        am = torch.rand(L, S) < 0.3
        am[:, 0] = False
    elif masking == "per_head":
        am = torch.rand(B * H, L, S) < 0.3
        am[..., 0] = False
    else:
        am = None
    t_in = (x, key, value) if batch_first else (x.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))
    expected, t_w = tm(*t_in, key_padding_mask=kpm, attn_mask=am, need_weights=True)
    # the converted module takes the source module's layout, and torch's padding mask as it is
    context = None if kind == "self" else ((t_in[1], t_in[2]) if kind == "kdim_vdim" else t_in[1])
    out, w = ours(t_in[0], context, mask=torch_masks_to_ours(None, am, B, H), key_padding_mask=kpm, need_weights=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(w.mean(1), t_w, rtol=0, atol=1e-10)
    # a batch-first module, and the padding mask converted once to an attnkit mask
    bf = MultiHeadAttention.from_torch(tm, batch_first=True)
    context = None if kind == "self" else ((key, value) if kind == "kdim_vdim" else key)
    out = bf(x, context, mask=torch_masks_to_ours(kpm, am, B, H))
    torch.testing.assert_close(out, expected if batch_first else expected.transpose(0, 1), rtol=0, atol=1e-10)


def test_from_torch_of_a_sequence_first_module_takes_its_inputs():
    """torch's default layout is (L, B, E): the converted module must not read it as (B, L, E)."""
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(16, 4).eval()  # batch_first=False
    x = torch.randn(7, 3, 16)  # (L, B, E)
    ours = MultiHeadAttention.from_torch(tm)
    assert not ours.batch_first and "batch_first=False" in repr(ours)
    torch.testing.assert_close(ours(x), tm(x, x, x)[0], rtol=0, atol=1e-6)
    ctx = torch.randn(4, 3, 16)  # (S, B, E)
    out, w = ours(x, ctx, need_weights=True)
    expected, t_w = tm(x, ctx, ctx)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.mean(1), t_w, rtol=0, atol=1e-6)  # weights stay (B, H, L, S)
    with pytest.raises(ValueError, match=r"\(L, B, d_model=16\) \(batch_first=False\)"):
        ours(torch.randn(7, 3, 8))


def test_torch_key_padding_mask_is_taken_in_torchs_convention():
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(tm)
    x = torch.randn(2, 6, 16)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])  # True = ignore (torch)
    expected = tm(x, x, x, key_padding_mask=pad)[0]
    torch.testing.assert_close(ours(x, key_padding_mask=pad), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours(x, mask=masks.key_padding(~pad)), expected, rtol=0, atol=1e-6)
    causal = ours(x, mask=masks.causal(), key_padding_mask=pad)  # AND-ed with the other masks
    am = torch.ones(6, 6, dtype=torch.bool).triu(1)
    torch.testing.assert_close(causal, tm(x, x, x, key_padding_mask=pad, attn_mask=am)[0], rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        ours(x, key_padding_mask=pad.float())
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, Lk\)"):
        ours(x, key_padding_mask=pad[:, None, None, :])
    with pytest.raises(TypeError, match="batch_first must be"):
        MultiHeadAttention.from_torch(tm, batch_first="no")
    with pytest.raises(TypeError, match="batch_first must be True or False"):
        MultiHeadAttention(16, 4, batch_first=0)


def test_from_torch_rejects_what_it_cannot_express():
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="torch.nn.MultiheadAttention"):
        MultiHeadAttention.from_torch(torch.nn.Linear(2, 2))


# -------------------------------------------------------------------------------------- errors


def test_bad_configurations_raise_clear_errors():
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_heads=4.*d_head"):
        MultiHeadAttention(10, 4)
    MultiHeadAttention(10, 4, d_head=3)  # fine with d_head
    with pytest.raises(ValueError, match="n_heads=6 and n_kv_heads=4: n_heads must be a multiple"):
        MultiHeadAttention(12, 6, n_kv_heads=4)
    with pytest.raises(ValueError, match="ALiBi was built for n_heads=4"):
        MultiHeadAttention(16, 2, positions=ALiBi(4))
    with pytest.raises(ValueError, match="wider than the heads"):
        MultiHeadAttention(16, 4, positions=RotaryEmbedding(8))
    with pytest.raises(TypeError, match="PositionEncoding"):
        MultiHeadAttention(16, 4, positions="rope")
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(16, 4, dropout=1.5)
    with pytest.raises(ValueError, match="temperature"):
        MultiHeadAttention(16, 4, temperature=0)


def test_bad_inputs_raise_clear_errors():
    m = MultiHeadAttention(8, 2, kdim=8)
    with pytest.raises(ValueError, match="x has width 6.*d_model=8"):
        m(torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, d_model=8\)"):
        m(torch.randn(3, 8))
    with pytest.raises(ValueError, match="context has width 5.*kdim=8"):
        m(torch.randn(1, 3, 8), torch.randn(1, 4, 5))
    with pytest.raises(ValueError, match="batch"):
        m(torch.randn(1, 3, 8), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="only does cross attention"):
        MultiHeadAttention(8, 2, kdim=4)(torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match=r"mask does not fit.*\(1, 2, 3, 3\)"):
        MultiHeadAttention(8, 2)(torch.randn(1, 3, 8), mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool tensor"):
        MultiHeadAttention(8, 2)(torch.randn(1, 3, 8), mask=torch.ones(3, 3))
    with pytest.raises(ValueError, match="positions= applies to self-attention"):
        MultiHeadAttention(8, 2, positions=RotaryEmbedding(4))(torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match=r"positions must have shape \(L,\)"):
        MultiHeadAttention(8, 2, positions=RotaryEmbedding(4))(torch.randn(1, 3, 8), positions=torch.arange(4))


def test_returned_weights_are_differentiable():
    m = MultiHeadAttention(8, 2).to(D64)
    x = torch.randn(1, 4, 8, dtype=D64, requires_grad=True)
    _, w = m(x, need_weights=True)
    (w[..., 0] ** 2).sum().backward()  # e.g. an attention-supervision loss
    assert x.grad is not None and m.qkv_proj.weight.grad.abs().sum() > 0


def test_from_torch_keeps_the_training_mode():
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True).eval()
    am = MultiHeadAttention.from_torch(tm)
    assert not am.training
    x = torch.randn(2, 5, 16)
    assert torch.allclose(am(x), tm(x, x, x)[0], atol=1e-6)
    assert MultiHeadAttention.from_torch(tm.train()).training


@pytest.mark.parametrize(
    "options",
    [
        dict(n_kv_heads=2, qk_norm=True, softcap=20.0, sinks=True, bias=False),
        dict(kdim=12, vdim=10, out_bias=False, temperature=2.0, qk_norm="all"),
    ],
)
def test_from_config_builds_the_module_the_keywords_build(options):
    from attnkit.nn import AttentionConfig

    rope = RotaryEmbedding(4) if "kdim" not in options else None
    torch.manual_seed(0)
    mine = MultiHeadAttention.from_config(
        AttentionConfig(16, 4, **options), positions=rope, mask=None if rope is None else masks.causal()
    ).double()
    torch.manual_seed(0)
    ref = MultiHeadAttention(16, 4, positions=rope, mask=None if rope is None else masks.causal(), **options).double()
    assert mine.config == ref.config == AttentionConfig(16, 4, **options)
    assert [(k, v.shape) for k, v in mine.state_dict().items()] == [(k, v.shape) for k, v in ref.state_dict().items()]
    assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), ref.state_dict().values()))
    x = torch.randn(2, 5, 16, dtype=D64)
    ctx = () if rope is not None else ((torch.randn(2, 3, 12, dtype=D64), torch.randn(2, 3, 10, dtype=D64)),)
    torch.testing.assert_close(mine(x, *ctx), ref(x, *ctx), rtol=0, atol=0)
    assert repr(mine) == repr(ref)


def test_from_config_checks_the_config_like_the_keywords():
    from attnkit.nn import AttentionConfig

    with pytest.raises(TypeError, match="from_config takes an attnkit.nn.AttentionConfig, got dict"):
        MultiHeadAttention.from_config(dict(d_model=16, n_heads=4))
    with pytest.raises(ValueError, match="n_heads must be a multiple of n_kv_heads"):
        MultiHeadAttention.from_config(AttentionConfig(16, 4, n_kv_heads=3))
    with pytest.raises(ValueError, match=r"dropout=1.0 must be a number in \[0, 1\)"):
        MultiHeadAttention.from_config(AttentionConfig(16, 4).replace(dropout=1.0))
