"""NSAAttention against a float64 re-implementation written from the NSA paper, decoding, DecoderLM, errors."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit.cache import StaticCache
from attnkit.nn import DecoderConfig, DecoderLM, NSAAttention, RotaryEmbedding
from attnkit.nn.nsa import nsa_selection

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp(seq, x):
    first, _, last = seq
    return torch.nn.functional.linear(
        torch.nn.functional.gelu(torch.nn.functional.linear(x, first.weight, first.bias)), last.weight, last.bias
    )


def _softmax_attend(q, keys, values, scale):
    if keys.shape[0] == 0:
        return torch.zeros(values.shape[-1], dtype=q.dtype)
    return torch.softmax((keys @ q) * scale, dim=0) @ values


def paper_nsa(m, x, q, k, v):
    """NSA (Yuan et al. 2025), one query and head at a time.  Compression (eq. 7): phi(block + intra-block
    position) for blocks of l keys every d positions, visible once complete.  Selection (eqs. 8-11): the
    compressed attention probabilities, summed over a group's heads and over the compressed blocks overlapping
    each selection block; top-n blocks at or before the query, with the own block, the one before it and the
    first block always in (ties to the lower block).  Window: the last w keys.  Gates: sigmoid(W_g x)."""
    l, d, ls, n, w = m.compress_block, m.compress_stride, m.select_block, m.select_count, m.window  # noqa: E741  (the paper's l)
    B, Hq, L, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = 1 / math.sqrt(D)
    n_cmp = (Lk - l) // d + 1 if Lk >= l else 0
    gates = torch.sigmoid(torch.nn.functional.linear(x, m.gate_proj.weight, m.gate_proj.bias)).view(B, L, 3, Hq)
    out = torch.zeros(B, Hq, L, D, dtype=q.dtype)
    for b in range(B):
        for hk in range(Hkv):
            kc = (
                torch.stack(
                    [_mlp(m.compress_k, (k[b, hk, i * d : i * d + l] + m.pos_k).reshape(-1)) for i in range(n_cmp)]
                )
                if n_cmp
                else torch.zeros(0, D, dtype=q.dtype)
            )
            vc = (
                torch.stack(
                    [_mlp(m.compress_v, (v[b, hk, i * d : i * d + l] + m.pos_v).reshape(-1)) for i in range(n_cmp)]
                )
                if n_cmp
                else torch.zeros(0, D, dtype=q.dtype)
            )
            for t in range(L):
                p = t + Lk - L
                vis = [i for i in range(n_cmp) if i * d + l - 1 <= p]
                # the group's importance of each selection block (no gradient)
                imp = {}
                for h in range(hk * g, (hk + 1) * g):
                    if vis:
                        probs = torch.softmax((kc[vis].detach() @ q[b, h, t].detach()) * scale, dim=0)
                    for a, i in enumerate(vis):
                        for j in range(p // ls + 1):
                            if i * d < (j + 1) * ls and i * d + l > j * ls:
                                imp[j] = imp.get(j, 0.0) + float(probs[a])
                own = p // ls
                forced = [own] + ([own - 1] if own >= 1 else []) + ([0] if own > 1 else [])
                rest = sorted((j for j in range(own + 1) if j not in forced), key=lambda j: (-imp.get(j, 0.0), j))
                chosen = set((forced + rest)[:n])
                for h in range(hk * g, (hk + 1) * g):
                    qt = q[b, h, t]
                    o_cmp = _softmax_attend(qt, kc[vis], vc[vis], scale)
                    sel = torch.tensor([s for s in range(p + 1) if s // ls in chosen])
                    o_slc = _softmax_attend(qt, k[b, hk, sel], v[b, hk, sel], scale)
                    win = torch.arange(max(0, p - w + 1), p + 1)
                    o_win = _softmax_attend(qt, k[b, hk, win], v[b, hk, win], scale)
                    gt = gates[b, t, :, h]
                    out[b, h, t] = gt[0] * o_cmp + gt[1] * o_slc + gt[2] * o_win
    return out


def _module(heads=4, kv_heads=2, seed=0, **kw):
    torch.manual_seed(seed)
    opts = dict(compress_block=4, compress_stride=2, select_block=4, select_count=3, window=5)
    opts.update(kw)
    m = NSAAttention(32, heads, kv_heads, positions=RotaryEmbedding(32 // heads), **opts).double()
    with torch.no_grad():  # non-zero position embeddings, so that they are exercised
        m.pos_k.normal_(0, 0.3)
        m.pos_v.normal_(0, 0.3)
    return m


@pytest.mark.parametrize(
    "L, heads, kv_heads, opts",
    [
        (19, 4, 2, {}),
        (17, 2, 1, dict(compress_block=4, compress_stride=4, select_block=8, select_count=2, window=3)),
        (21, 4, 4, dict(compress_block=6, compress_stride=2, select_block=4, select_count=5, window=8)),
        (3, 2, 2, {}),
    ],
)
@pytest.mark.parametrize("routed", [True, False])
def test_forward_and_gradients_equal_the_paper(L, heads, kv_heads, opts, routed):
    m = _module(heads, kv_heads, **opts)
    m.routed = routed
    x = torch.randn(2, L, 32, dtype=torch.float64, requires_grad=True)
    out = m(x)
    q, k, v, _ = m._self_qkv(x, None, None)
    ref = m._output(paper_nsa(m, x, q, k, v))
    assert torch.allclose(out, ref, atol=1e-12)
    go = torch.randn_like(out)
    params = [x, *m.parameters()]
    grads = torch.autograd.grad(out, params, go, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, params, go, allow_unused=True)
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, atol=1e-10)


def test_compression_and_gates_are_trained():
    m = _module(seed=1).float()
    m.backend = "flash"
    x = torch.randn(1, 40, 32)
    m(x).square().mean().backward()
    for p in (m.compress_k[0].weight, m.compress_v[2].weight, m.pos_k, m.pos_v, m.gate_proj.weight):
        assert p.grad is not None and float(p.grad.abs().sum()) > 0


def test_decoding_equals_the_full_forward(check_cached_decoding):
    m = _module()
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    check_cached_decoding(m, x, prefill=5, chunks=((0, 6), (6, 13), (13, 23)))


def test_a_decode_step_reads_the_kept_compression_the_chosen_blocks_and_the_window_only():
    m = _module(select_count=4)
    x = torch.randn(2, 31, 32, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
        cache = StaticCache(1, max_len=32)
        layer = cache.layers[0]
        m(x[:, :30], cache=layer)
        q, k, v, _ = m._self_qkv(x, None, None)
        kc, _ = m.compress(k, v)
        choice = nsa_selection(
            q[:, :, -1:],
            kc,
            31,
            compress_block=4,
            compress_stride=2,
            select_block=4,
            select_count=4,
            scale=m._scale(),
        )  # (B, Hkv, 1, 4): shared by each group of query heads
        keep = torch.zeros(2, 2, 30, dtype=torch.bool)
        keep[..., 31 - 5 :] = True  # the window
        for b, h, j in (choice[:, :, 0] >= 0).nonzero().tolist():
            block = int(choice[b, h, 0, j])
            keep[b, h, block * 4 : (block + 1) * 4] = True
        assert keep.float().mean() < 0.6
        _poison_all_but(layer, keep)
        step = m(x[:, 30:], cache=layer)
    assert torch.allclose(step, full[:, 30:], atol=1e-12)


def test_compressed_keys_are_kept_while_weights_stand_and_recomputed_after_a_step():
    m = _module()
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    cache = StaticCache(1, max_len=24)
    with torch.no_grad():
        steps = [m(x[:, :6], cache=cache.layers[0])] + [m(x[:, i : i + 1], cache=cache.layers[0]) for i in range(6, 20)]
        assert torch.allclose(torch.cat(steps, 1), m(x), atol=1e-12)
        # the prefill compresses blocks 0 and 1 (keys 0..5); later each new block reads its own 4 keys alone
        assert cache.layers[0].summaries["nsa"].reads == 6 + 7 * 4
        m.compress_k[0].weight.add_(0.1)  # as an optimizer step would: the kept compression is stale
        cache.truncate(19)
        last = m(x[:, 19:], cache=cache.layers[0])
    assert torch.allclose(last, m(x)[:, 19:], atol=1e-12)


def _poison_all_but(layer, keep):
    n = keep.shape[-1]
    layer.k[:, :, :n].masked_fill_(~keep[..., None], float("nan"))
    layer.v[:, :, :n].masked_fill_(~keep[..., None], float("nan"))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(compress_block=5, compress_stride=2), "compress_block=5 must be a multiple of compress_stride=2"),
        (dict(select_block=6, compress_stride=4, compress_block=8), "select_block=6 must be a multiple"),
        (dict(window=0), "window"),
        (dict(select_count=0), "select_count"),
    ],
)
def test_bad_options_are_refused(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        NSAAttention(32, 4, **kw)


def test_a_call_mask_and_bias_positions_are_refused():
    m = _module()
    with pytest.raises(ValueError, match="no per-call mask"):
        m(torch.randn(1, 8, 32, dtype=torch.float64), mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="rope"):
        DecoderConfig.preset("tiny", positions="alibi", sparse_attention={"method": "nsa"})


def _lm():
    torch.manual_seed(0)
    cfg = DecoderConfig.preset(
        "tiny",
        n_kv_heads=2,
        sparse_attention={
            "method": "nsa",
            "compress_block": 4,
            "compress_stride": 2,
            "select_block": 4,
            "select_count": 3,
            "window": 4,
        },
    )
    return DecoderLM(cfg)


def test_decoder_lm_uses_nsa_trains_and_generates_as_recomputing(lm_losses):
    model = _lm()
    assert all(isinstance(layer.attn, NSAAttention) for layer in model.layers)
    losses = lm_losses(model)
    assert losses[-1] < losses[0] - 0.3
    model.eval()
    prompt = torch.randint(0, 256, (2, 7))
    cached = attnkit.generate(model, prompt, 12, cache="static")
    recomputed = attnkit.generate(model, prompt, 12, cache=None)
    assert torch.equal(torch.as_tensor(cached), torch.as_tensor(recomputed))
