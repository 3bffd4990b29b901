"""MoBAAttention against a float64 re-implementation written from the MoBA paper, decoding, DecoderLM, errors."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.cache import PagedCache, StaticCache
from attnkit.nn import DecoderConfig, DecoderLM, MoBAAttention, RotaryEmbedding
from attnkit.nn.moba import moba_selection

pytestmark = pytest.mark.usefixtures("one_thread")


def paper_moba(q, k, v, block, top_k, scale):
    """MoBA (Lu et al. 2025), one query at a time: the gate s_i = <q, mean_pool(K[I_i])> over the blocks before
    the query's own block, top-k of them, plus the own block under the causal mask; then softmax attention over
    the union.  Plain float64 loops; the gate is a constant (no gradient), the attention differentiable."""
    B, Hq, L, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    rows = []
    for b in range(B):
        heads = []
        for h in range(Hq):
            kh, vh = k[b, h // g], v[b, h // g]
            outs = []
            for i in range(L):
                p = i + Lk - L
                own = p // block
                gates = []
                for j in range(own):  # blocks that end before the own block
                    gates.append((float(q[b, h, i].detach() @ kh[j * block : (j + 1) * block].detach().mean(0)), j))
                chosen = {j for _, j in sorted(gates, key=lambda t: -t[0])[:top_k]}
                keys = [t for t in range(p + 1) if t // block in chosen or t // block == own]
                idx = torch.tensor(keys)
                w = torch.softmax((kh[idx] @ q[b, h, i]) * scale, dim=0)
                outs.append(w @ vh[idx])
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def _module(d_model=32, heads=4, kv_heads=2, block=4, top_k=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = MoBAAttention(
        d_model, heads, kv_heads, block=block, top_k=top_k, positions=RotaryEmbedding(d_model // heads), **kw
    )
    return m.double()


@pytest.mark.parametrize("routed", [True, False])
@pytest.mark.parametrize(
    "L, block, top_k, heads, kv_heads", [(23, 4, 2, 4, 2), (16, 8, 1, 2, 1), (9, 2, 3, 2, 2), (20, 5, 0, 4, 4)]
)
def test_forward_and_gradients_equal_the_paper(L, block, top_k, heads, kv_heads, routed):
    """Both ways of computing it: routed (attention_varlen per chosen block) and one call under the mask."""
    m = _module(heads=heads, kv_heads=kv_heads, block=block, top_k=top_k)
    m.routed = routed
    x = torch.randn(2, L, 32, dtype=torch.float64, requires_grad=True)
    out = m(x)
    q, k, v, _ = m._self_qkv(x, None, None)
    ref = m._output(paper_moba(q, k, v, block, top_k, 1 / math.sqrt(m.d_head)))
    assert torch.allclose(out, ref, atol=1e-12)
    go = torch.randn_like(out)
    params = [x, *m.parameters()]
    grads = torch.autograd.grad(out, params, go)
    ref_grads = torch.autograd.grad(ref, params, go)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-10)


def test_selection_is_top_k_of_earlier_blocks_plus_own():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 1, 10, 4, generator=g)
    choice = moba_selection(q, k, block=3, top_k=2)
    assert choice.shape == (1, 2, 10, 3)
    assert choice[0, 0, :, 2].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]  # own block
    assert choice[0, 0, 0, :2].tolist() == [-1, -1] and (choice[0, 0, 3, 1] == -1)  # one earlier block at row 3
    means = k[0, 0, :9].view(3, 3, 4).mean(1)
    scores = q[0, 1, 9] @ means.T
    assert set(choice[0, 1, 9, :2].tolist()) == set(scores.topk(2).indices.tolist())


@pytest.mark.parametrize("routed", [True, False])
def test_training_step_flows_through_the_flash_backend(routed):
    m = _module(block=8, top_k=1).float()
    m.backend, m.routed = "flash", routed
    x = torch.randn(1, 64, 32, requires_grad=True)
    m(x).square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_decoding_equals_the_full_forward_and_reads_only_chosen_blocks(check_cached_decoding):
    m = _module(block=4, top_k=2)
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    full = check_cached_decoding(m, x, prefill=6, chunks=((0, 6), (6, 13), (13, 21)))
    # the gathered step reads only the chosen blocks: garbage elsewhere changes nothing
    q, k, v, _ = m._self_qkv(x, None, None)
    choice = moba_selection(q[:, :, -1:], k, 4, 2)
    keep = torch.zeros(2, 2, 21, dtype=torch.bool)
    for b in range(2):
        for h in range(4):
            for j in choice[b, h, 0].tolist():
                if j >= 0:
                    keep[b, h // 2, j * 4 : (j + 1) * 4] = True
    poisoned_k = torch.where(keep[..., None], k, float("nan"))
    poisoned_v = torch.where(keep[..., None], v, float("nan"))
    out = m._gathered(q[:, :, -1:], poisoned_k, poisoned_v, choice)
    assert torch.allclose(m._output(out), full[:, -1:], atol=1e-12)


def _poison_all_but(layer, keep):
    """NaN in every stored key and value outside ``keep (B, Hkv, Lk)``: a read of them would show."""
    n = keep.shape[-1]
    layer.k[:, :, :n].masked_fill_(~keep[..., None], float("nan"))
    layer.v[:, :, :n].masked_fill_(~keep[..., None], float("nan"))


def test_a_decode_step_reads_the_kept_block_means_and_the_chosen_blocks_only():
    m = _module(block=4, top_k=2)
    x = torch.randn(2, 39, 32, dtype=torch.float64)
    full = m(x)
    cache = StaticCache(1, max_len=40)
    layer = cache.layers[0]
    with torch.no_grad():
        m(x[:, :38], cache=layer)
        q, k, v, _ = m._self_qkv(x, None, None)
        choice = moba_selection(q[:, :, -1:], k, 4, 2)  # (B, Hq, 1, 3): the last query's blocks, own block last
        keep = torch.zeros(2, 2, 38, dtype=torch.bool)
        for b, h, j in (choice[:, :, 0] >= 0).nonzero().tolist():
            block = int(choice[b, h, 0, j])
            keep[b, h // 2, block * 4 : (block + 1) * 4] = True
        assert keep.float().mean() < 0.6
        _poison_all_but(layer, keep)
        step = m(x[:, 38:], cache=layer)
    assert torch.allclose(step, full[:, 38:], atol=1e-12)


def test_block_means_are_computed_once_and_survive_a_truncation():
    m = _module(block=4, top_k=2)
    x = torch.randn(1, 23, 32, dtype=torch.float64)
    cache = StaticCache(1, max_len=24)
    with torch.no_grad():
        steps = [m(x[:, :5], cache=cache.layers[0])] + [m(x[:, i : i + 1], cache=cache.layers[0]) for i in range(5, 23)]
        assert cache.layers[0].summaries["moba"].reads == 20  # each key of the 5 complete blocks read once
        assert torch.allclose(torch.cat(steps, 1), m(x), atol=1e-12)
        cache.truncate(10)  # blocks 0 and 1 stay; the new tokens complete blocks 2.. again
        y = torch.cat([x[:, :10], torch.randn(1, 13, 32, dtype=torch.float64)], 1)
        again = [m(y[:, i : i + 1], cache=cache.layers[0]) for i in range(10, 23)]
        assert torch.allclose(torch.cat(again, 1), m(y)[:, 10:], atol=1e-12)
        assert cache.layers[0].summaries["moba"].reads == 20 + 12


def test_paged_caches_are_refused():
    m = _module().float()
    cache = PagedCache(1, num_blocks=8, block_size=4, n_kv_heads=2, d_head=8)
    sid = cache.add_sequence()
    with pytest.raises(ValueError, match="MoBAAttention needs the cached keys"):
        for n in (5, 1):  # a prefill, then a decode step (which the pool computes itself)
            m(torch.randn(1, n, 32), cache=cache.batch([sid]).layers[0])


@pytest.mark.parametrize("kw, match", [(dict(block=0), "block"), (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k")])
def test_bad_options_are_refused(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MoBAAttention(32, 4, **kw)


def test_the_module_is_causal_even_without_a_mask():
    m = _module(block=4, top_k=1)
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    y = x.clone()
    y[:, 7:] += 1.0
    assert torch.allclose(m(x)[:, :7], m(y)[:, :7], atol=1e-12)
    assert m.mask.is_causal()
    w = _module(block=4, top_k=1, mask=masks.sliding_window(5))
    assert len(w.mask.conjuncts()) == 2


# ----------------------------------------------------------------------------- DecoderLM


def _lm(**sparse):
    torch.manual_seed(0)
    cfg = DecoderConfig.preset(
        "tiny", n_kv_heads=2, sparse_attention={"method": "moba", "block": 4, "top_k": 1, **sparse}
    )
    return DecoderLM(cfg)


def test_decoder_lm_uses_moba_and_generates_as_recomputing():
    model = _lm().eval()
    assert all(isinstance(layer.attn, MoBAAttention) for layer in model.layers)
    assert model.config.sparse_attention == {"method": "moba", "block": 4, "top_k": 1}
    prompt = torch.randint(0, 256, (2, 7))
    cached = attnkit.generate(model, prompt, 12, cache="static")
    recomputed = attnkit.generate(model, prompt, 12, cache=None)
    assert torch.equal(torch.as_tensor(cached), torch.as_tensor(recomputed))


def test_decoder_lm_trains(lm_losses):
    model = _lm()
    losses = lm_losses(model)
    assert losses[-1] < losses[0] - 0.3


@pytest.mark.parametrize(
    "sparse, match",
    [
        ({"block": 4}, "must be None or a dict with a 'method'"),
        ({"method": "nope"}, "is not one of"),
        ({"method": "moba", "blok": 4}, "not options of 'moba'"),
    ],
)
def test_bad_sparse_attention_configs_are_refused(sparse, match):
    with pytest.raises((ValueError, TypeError), match=match):
        DecoderConfig.preset("tiny", sparse_attention=sparse)


def test_sparse_attention_and_latent_attention_exclude_each_other():
    with pytest.raises(ValueError, match="not to latent"):
        DecoderConfig.preset("tiny", sparse_attention={"method": "moba"}, kv_lora_rank=16, qk_rope_head_dim=8)


def test_moba_attention_refuses_a_choice_of_later_blocks():
    from attnkit.nn.moba import moba_attention

    q = k = v = torch.randn(1, 1, 16, 4)
    choice = torch.tensor([0, 1, 1, 1]).view(1, 1, 1, 4).repeat(1, 1, 16, 1)[..., :2]  # block 0, then own
    choice[0, 0, 3, 0] = 1  # row 3 sits in block 0: block 1 is later
    with pytest.raises(ValueError, match="does not end before the query's own block"):
        moba_attention(q, k, v, block=4, top_k=1, choice=choice)
