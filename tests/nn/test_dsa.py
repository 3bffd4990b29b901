"""DeepSeek sparse attention: the module against a float64 version written from the DeepSeek-V3.2 paper (forward,
gradients, the indexer's KL loss), decoding that reads only the selected keys (equal to recomputing every
position), training and generating through DecoderConfig, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.cache import StaticCache
from attnkit.nn import (
    DecoderConfig,
    DeepSeekSparseAttention,
    IndexerConfig,
    LatentAttention,
    RotaryEmbedding,
    indexer_loss,
    selected_attention,
    top_k_keys,
)
from _models import LATENT_DIMS, greedy_by_full_forward, latent_decoder, latent_layer

D64 = torch.float64


def _dsa(top_k=4, q_lora_rank=24, interleaved=False, **kw):
    indexer = IndexerConfig(top_k, 8, 16, rope_interleaved=interleaved)
    return latent_layer(DeepSeekSparseAttention, q_lora_rank, indexer=indexer, **kw)


# ------------------------------------------------------------------- the paper, one query at a time, float64


def _rope(x, p, interleaved, base=10000.0):
    """Rotate the pairs of ``x (..., d)`` at position ``p``: (i, i + d/2), or (2i, 2i + 1) when interleaved."""
    d = x.shape[-1]
    theta = p * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        ra, rb = a * theta.cos() - b * theta.sin(), b * theta.cos() + a * theta.sin()
        return torch.stack((ra, rb), -1).flatten(-2)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((a * theta.cos() - b * theta.sin(), b * theta.cos() + a * theta.sin()), -1)


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _paper(m: DeepSeekSparseAttention, x: torch.Tensor, P: dict):
    """Output ``(B, L, d_model)`` and the indexer's loss, from DeepSeek-V3.2 sec. 2.1, weights ``P`` (name ->
    tensor), one query at a time: index scores I[t, s] = sum_j w[t, j] relu(q_I[t, j] . k_I[s]), the top-k keys
    S_t among s <= t, MLA over S_t; the loss KL(p_t || softmax(I[t, S_t])), p_t the heads' summed attention."""
    B, L, _ = x.shape
    H, dn, dr, dv, r = m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    nI, dI, K = m.indexer.config.n_heads, m.indexer.config.head_dim, m.top_k
    il = m.indexer.config.rope_interleaved
    outs, kls = [], []
    for b in range(B):
        xb = x[b]
        ql = _rms(xb @ P["q_a_proj.weight"].T, P["q_norm.weight"])  # (L, q_lora_rank)
        q = (ql @ P["q_b_proj.weight"].T).view(L, H, dn + dr)
        ckv = xb @ P["kv_a_proj.weight"].T
        c = _rms(ckv[:, :r], P["kv_norm.weight"])
        kv = (c @ P["kv_b_proj.weight"].T).view(L, H, dn + dv)
        iq = (ql.detach() @ P["indexer.wq_b.weight"].T).view(L, nI, dI)
        ik = torch.nn.functional.layer_norm(
            xb.detach() @ P["indexer.wk.weight"].T, (dI,), P["indexer.k_norm.weight"], P["indexer.k_norm.bias"], 1e-6
        )
        iw = xb.detach() @ P["indexer.weights_proj.weight"].T / math.sqrt(nI)
        rows = []
        for t in range(L):
            keys = range(t + 1)
            q_t = torch.cat((q[t, :, :dn], _rope(q[t, :, dn:], t, True)), -1)  # (H, dn + dr)
            iq_t = torch.cat((_rope(iq[t, :, :dr], t, il), iq[t, :, dr:]), -1)
            index = torch.stack(
                [
                    (iw[t] * torch.relu(iq_t @ torch.cat((_rope(ik[s, :dr], s, il), ik[s, dr:])) / math.sqrt(dI))).sum()
                    for s in keys
                ]
            )
            chosen = sorted(index.detach().topk(min(K, t + 1)).indices.tolist())
            k_t = torch.stack(
                [torch.cat((kv[s, :, :dn], _rope(ckv[s, r:], s, True).expand(H, dr)), -1) for s in chosen], 1
            )  # (H, |S|, dn + dr)
            v_t = torch.stack([kv[s, :, dn:] for s in chosen], 1)
            a = torch.softmax((k_t @ q_t[:, :, None])[..., 0] / math.sqrt(dn + dr), -1)  # (H, |S|)
            rows.append((a[:, :, None] * v_t).sum(1).reshape(H * dv))
            p = a.detach().sum(0)
            p = p / p.sum()
            logq = torch.log_softmax(index[chosen], -1)
            kls.append((p * (p.log() - logq)).sum())
        outs.append(torch.stack(rows) @ P["out_proj.weight"].T)
    return torch.stack(outs), torch.stack(kls).mean()


def _params(m, dtype):
    return {k: v.detach().to(dtype).requires_grad_() for k, v in m.named_parameters()}


@pytest.mark.parametrize("interleaved", [False, True])
def test_forward_matches_the_paper_in_float64_and_float32_within_the_rule(interleaved):
    m = _dsa(interleaved=interleaved)
    x = torch.randn(2, 9, 32)
    oracle, _ = _paper(m, x.to(D64), _params(m, D64))
    naive, _ = _paper(m, x, _params(m, torch.float32))
    out = m(x)
    assert (out.double() - oracle).abs().max() <= 2 * (naive.double() - oracle).abs().max() + 1e-6
    out64 = m.to(D64)(x.to(D64))
    assert (out64 - oracle).abs().max() <= 1e-6  # (the rotary tables are float32, as in transformers)
    assert m.last_selection.shape == (2, 9, 4)


def test_gradients_and_the_indexer_loss_match_the_paper():
    m = _dsa().to(D64).train()
    x = torch.randn(2, 7, 32, dtype=D64, requires_grad=True)
    P = _params(m, D64)
    ref_out, ref_kl = _paper(m, x, P)
    out = m(x)
    w = torch.randn_like(out)
    g_ref = torch.autograd.grad((ref_out * w).sum(), [x] + list(P.values()), allow_unused=True)
    g = torch.autograd.grad((out * w).sum(), [x] + list(m.parameters()), allow_unused=True)
    for name, a, b in zip(["x"] + list(P), g, g_ref):
        if name.startswith("indexer."):  # the selection is not differentiable: no gradient reaches the indexer
            assert a is None and b is None, name
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-6, msg=name)
    torch.testing.assert_close(m.indexer_loss, ref_kl, rtol=1e-6, atol=1e-9)
    kl_params = [p for n, p in m.named_parameters()]
    g = torch.autograd.grad(m.indexer_loss, [x] + kl_params, allow_unused=True)
    g_ref = torch.autograd.grad(ref_kl, [x] + list(P.values()), allow_unused=True)
    for name, a, b in zip(["x"] + list(P), g, g_ref):
        if name.startswith("indexer."):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=2e-6, msg=name)
        else:  # the indexer's inputs and its target are detached: its loss trains the indexer only
            assert a is None and b is None, name


def test_dense_warmup_attends_densely_and_its_target_is_the_dense_distribution():
    m = _dsa(top_k=2).train()
    mla = LatentAttention(
        32, 4, **LATENT_DIMS, q_lora_rank=24, positions=RotaryEmbedding(8, interleaved=True), mask=masks.causal()
    )
    mla.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("indexer.")})
    x = torch.randn(2, 8, 32)
    m.dense_warmup = True
    torch.testing.assert_close(m(x), mla(x))
    warm = m.indexer_loss
    m.dense_warmup = False
    sparse_out = m(x)
    assert not torch.allclose(sparse_out, mla(x), atol=1e-3)
    assert not torch.allclose(warm, m.indexer_loss)


def test_warmup_training_moves_the_indexer_toward_the_attention():
    m = _dsa(top_k=3).train()
    m.dense_warmup = True
    for n, p in m.named_parameters():
        p.requires_grad_(n.startswith("indexer."))  # the paper's warm-up: everything but the indexer frozen
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=3e-2)
    x = torch.randn(4, 12, 32, generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(25):
        m(x)
        losses.append(float(m.indexer_loss.detach()))
        opt.zero_grad()
        m.indexer_loss.backward()
        opt.step()
    assert losses[-1] < 0.5 * losses[0]


def test_decoding_reads_only_the_selected_keys_and_equals_a_full_forward():
    m = _dsa(top_k=3)
    x = torch.randn(2, 11, 32)
    full = m(x)
    cache = StaticCache(1, max_len=12)
    layer = cache.layers[0]
    outs = [m(x[:, :6], cache=layer)]
    seen = []
    m.register_attention_hook(lambda module, call, compute: seen.append(call.k.shape[2]) or compute(call))
    for i in range(6, 11):
        sel = None
        # poison every cached latent the step will not select: the output must not change
        outs.append(m(x[:, i : i + 1], cache=layer))
        sel = m.last_selection  # (B, 1, 3)
        before = layer.k.clone()
        keep = torch.zeros(2, i + 1, dtype=torch.bool).scatter_(1, sel[:, 0], True)
        layer.k[:, 0, : i + 1, : 16 + 8][~keep] = float("nan")
        layer.length -= 1
        again = m(x[:, i : i + 1], cache=layer)
        assert torch.equal(again, outs[-1])
        layer.k.copy_(before)
    assert seen and all(n == 3 for n in seen)  # each decode step attends to top_k gathered keys
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert layer.k.shape[-1] == 16 + 8 + 16 and layer.v.shape[-1] == 0  # latent, rope key, index key
    chunked = StaticCache(1, max_len=12)  # a chunk of several queries after the prompt gathers per query
    outs = [m(x[:, a:b], cache=chunked.layers[0]) for a, b in ((0, 5), (5, 9), (9, 11))]
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)


def _model():
    return latent_decoder(indexer=IndexerConfig(top_k=4, n_heads=4, head_dim=16))


def test_a_dsa_decoder_trains_and_generates_as_recomputing_every_position():
    model = _model().train()
    assert all(isinstance(layer.attn, DeepSeekSparseAttention) for layer in model.layers)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = last = None
    for _ in range(8):
        logits = model(ids)
        lm = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
        loss = lm + indexer_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = float(lm.detach()) if first is None else first
        last = float(lm.detach())
    assert last < first - 0.5
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 12, 13]]
    want = [greedy_by_full_forward(model, p, 6) for p in prompts]
    assert attnkit.generate(model, prompts, 6) == want
    assert StaticCache.for_model(model, 1, 8).layers[0] is not None
    with pytest.raises(ValueError, match="use a StaticCache"):
        attnkit.generate(model, prompts, 2, cache="paged")


# ------------------------------------------------------------------------------------------------ bad input


def test_selected_attention_equals_masked_attention_and_rejects_bad_selections():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 6)
    idx = torch.randint(0, 7, (2, 5, 3), generator=torch.Generator().manual_seed(0))
    idx[0, 0, 2] = -1  # an unused slot
    sel = torch.zeros(2, 5, 8, dtype=torch.bool).scatter_(-1, torch.where(idx < 0, 7, idx), True)[..., :7]
    want = attnkit.attention(q, k, v, mask=sel[:, None] & masks.causal().to_dense(5, 7))
    torch.testing.assert_close(selected_attention(q, k, v, idx, mask=masks.causal()), want)
    with pytest.raises(ValueError, match=r"selects key 10, outside \[0, Lk=7\)"):
        selected_attention(q, k, v, idx.clamp(min=0) + 4)
    with pytest.raises(ValueError, match=r"shape \(2, 4, 3\), expected \(B=2, Lq=5"):
        selected_attention(q, k, v, idx[:, :4])
    with pytest.raises(TypeError, match="integer tensor"):
        selected_attention(q, k, v, idx.float())
    with pytest.raises(ValueError, match="k=8 is larger than the number of keys Lk=7"):
        top_k_keys(torch.randn(5, 7), 8)
    assert top_k_keys(torch.tensor([[1.0, 0.0, 0.0, 0.0, 1.0]]), 3).tolist() == [[0, 1, 4]]  # ties: earliest


def test_bad_configurations_and_masks_are_refused():
    with pytest.raises(ValueError, match="set kv_lora_rank"):
        DecoderConfig.preset("tiny", indexer=IndexerConfig(top_k=4, n_heads=2, head_dim=16))
    with pytest.raises(TypeError, match="IndexerConfig"):
        DecoderConfig.preset("tiny", kv_lora_rank=16, qk_rope_head_dim=8, indexer={"top_k": 4})
    with pytest.raises(ValueError, match="top_k"):
        IndexerConfig(top_k=0)
    with pytest.raises(ValueError, match="must hold the qk_rope_head_dim=8"):
        DeepSeekSparseAttention(32, 4, **LATENT_DIMS, indexer=IndexerConfig(4, 2, 4))
    m = _dsa()
    per_head = torch.ones(1, 4, 5, 5, dtype=torch.bool)
    per_head[:, 1, :, 0] = False
    with pytest.raises(ValueError, match="differs between heads"):
        m(torch.randn(1, 5, 32), mask=per_head)


def test_the_docs_picture_of_the_selected_keys_is_the_real_output():
    import contextlib
    import io
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "sparse.md").read_text(encoding="utf-8")
    section = text[text.index("## DeepSeek sparse attention") :]
    code, shown = re.search(r"```python\n(.*?)```\n\n```text\n(.*?)```", section, re.S).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/sparse.md", "exec"), {"__name__": "docs_sparse"})  # noqa: S102
    assert out.getvalue() == shown


@given(
    st.integers(1, 2),
    st.sampled_from([(2, 1), (4, 2), (3, 3)]),
    st.integers(1, 6),
    st.integers(1, 9),
    st.integers(1, 5),
    st.integers(0, 10_000),
)
@settings(max_examples=25, deadline=None)
def test_selected_attention_is_attention_under_the_selection_as_a_mask(B, heads, Lq, Lk, K, seed):
    Hq, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, 8, generator=g) for h, n in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    idx = torch.randint(-1, Lk, (B, Lq, K), generator=g)  # repeats and unused slots (-1) included
    sel = torch.zeros(B, Lq, Lk + 1, dtype=torch.bool).scatter_(-1, torch.where(idx < 0, Lk, idx), True)[..., :Lk]
    want = attnkit.attention(q, k, v, mask=sel[:, None] & masks.causal().to_dense(Lq, Lk))
    torch.testing.assert_close(selected_attention(q, k, v, idx, mask=masks.causal()), want, rtol=1e-5, atol=1e-6)


@given(st.integers(1, 12), st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_top_k_keys_is_a_stable_sort_cut_after_k(n, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (3, n), generator=g).float()  # many ties
    k = int(torch.randint(1, n + 1, (1,), generator=g))
    want = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k].sort(-1).values
    assert torch.equal(top_k_keys(scores, k), want)


def test_selected_attention_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=D64, requires_grad=True) for n in (3, 5, 5))
    idx = torch.tensor([[[0, 4], [2, -1], [1, 3]]])
    assert torch.autograd.gradcheck(lambda q, k, v: selected_attention(q, k, v, idx), (q, k, v))


def test_a_cache_that_attends_itself_is_refused_before_anything_is_stored():
    class Attends:
        seq_len, updates = 0, 0

        def peek(self, n_new):
            return n_new, True

        def update(self, k, v):
            self.updates += 1

    cache = Attends()
    with pytest.raises(ValueError, match="use a StaticCache"):
        _dsa()(torch.randn(1, 3, 32), cache=cache)
    assert cache.updates == 0
