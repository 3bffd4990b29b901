"""probe(): the recorded weights and score gradients are the model's own, nothing changes, all is restored."""

import math

import pytest
import torch

from attnkit import masks
from attnkit.diagnostics import attention_modules, probe
from attnkit.diagnostics import _probe as probe_module
from attnkit.nn import DecoderConfig, DecoderLM, MultiHeadAttention


def _mha(**kw):
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, n_kv_heads=2, **kw).double()


CASES = {
    "gqa causal window": dict(mask=masks.causal() & masks.sliding_window(3)),
    "alibi softcap": dict(positions="alibi", mask=masks.causal(), softcap=5.0),
    "t5 bias": dict(positions="t5"),
}


def _positions(name):
    from attnkit.nn import ALiBi, T5RelativeBias

    return {"alibi": lambda: ALiBi(4), "t5": lambda: T5RelativeBias(4, bidirectional=True)}[name]()


def _build(case):
    kw = dict(CASES[case])
    if isinstance(kw.get("positions"), str):
        kw["positions"] = _positions(kw["positions"])
    return _mha(**kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_are_the_modules_own_and_the_output_is_unchanged(case):
    mha = _build(case)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    plain, w_ref = mha(x, need_weights=True)
    with probe(mha) as p:
        out = mha(x)
    assert torch.equal(out, plain)
    rec = p.layers[""].calls[0]
    assert rec.shape == (2, 4, 7, 7)
    torch.testing.assert_close(rec.weights, w_ref.float(), rtol=0, atol=1e-6)
    # the statistics are those of these weights
    w = w_ref
    allowed = (w > 0).sum(-1)
    ent = -(torch.where(w > 0, w * w.log(), torch.zeros_like(w))).sum(-1) / allowed.clamp_min(2).double().log()
    live = allowed >= 2
    torch.testing.assert_close(rec.entropy[live], ent[live].float(), rtol=0, atol=1e-5)
    assert torch.isnan(rec.entropy[~live]).all()
    torch.testing.assert_close(rec.max_weight, w.amax(-1).float(), rtol=0, atol=1e-6)
    assert torch.equal(rec.allowed, allowed)


def _reference_attend(module, store):
    """A float64 attention hook that materialises the scores as a leaf of the graph and keeps their gradient."""

    def attend(module, call, compute):
        q, k, v, mask, scale, softcap = call.q, call.k, call.v, call.mask, call.scale, call.softcap
        from attnkit.testing import reference  # the textbook formula, for the mask/bias semantics

        g = q.shape[1] // k.shape[1]
        k2, v2 = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, Hq, L, D)
        s = q @ k2.transpose(-1, -2) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if mask is not None:
            s = s.masked_fill(~mask.to_dense(q.shape[2], k.shape[2], batch=q.shape[0], heads=q.shape[1]), -math.inf)
        s.retain_grad()
        store.append(s)
        out = torch.softmax(s, -1) @ v2
        torch.testing.assert_close(out, reference(q, k, v, mask=mask, scale=scale, softcap=softcap)[0])
        return out

    return attend


@pytest.mark.parametrize("rows_per_block", [None, 2])
def test_score_gradient_matches_autograd(monkeypatch, rows_per_block):
    if rows_per_block:  # recompute in blocks of query rows: offsets of masks and rows must line up
        monkeypatch.setattr(probe_module, "_ROW_BLOCK_ELEMENTS", rows_per_block * 2 * 4 * 9)  # B * Hq * Lk per row
    mha = _mha(mask=masks.causal() & masks.sliding_window(4), softcap=3.0)
    store = []
    mha.register_attention_hook(_reference_attend(mha, store))  # replaces the computation, as ring attention does
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    g = torch.randn(2, 9, 32, dtype=torch.float64)
    with probe(mha) as p:
        (mha(x) * g).sum().backward()
    mha(x)
    assert len(store) == 2 and len(p.layers[""].calls) == 1  # the caller's hook stays; the probe's is gone
    rec = p.layers[""].calls[0]
    expected = (store[0].grad.pow(2).sum(-1) * rec.allowed).sum(-1)  # (B, Hq): rows' squared norms x keys
    torch.testing.assert_close(rec.grad_sq, expected, rtol=1e-9, atol=1e-12)
    # the rows the loss reaches: row 0 sees only itself, has no score gradient, and is not counted
    assert torch.equal(rec.grad_rows, torch.full((2, 4), 8))
    assert torch.equal(rec.grad_rows, (store[0].grad.pow(2).sum(-1) > 0).sum(-1))


def test_long_sequences_keep_statistics_not_weights():
    mha = _build("gqa causal window")
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    with probe(mha) as full:
        mha(x).sum().backward()
    with probe(mha, max_elements=0) as small:
        mha(x).sum().backward()
    a, b = full.layers[""].calls[0], small.layers[""].calls[0]
    assert a.weights is not None and b.weights is None
    for name in ("entropy", "max_weight", "score_std", "allowed", "grad_sq"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), equal_nan=True)


def test_every_attention_layer_of_a_model_is_probed_and_restored_after_an_error():
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", n_layers=3))
    names = [n for n, _ in attention_modules(model)]
    assert names == ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
    ids = torch.randint(0, 256, (2, 6))
    with pytest.raises(RuntimeError, match="boom"):
        with probe(model) as p:
            model(ids)
            raise RuntimeError("boom")
    assert all(len(p.layers[n].calls) == 1 for n in names)
    with probe(model) as outer, probe(model) as inner:  # nested probes both see every call
        model(ids)
    assert all(len(outer.layers[n].calls) == len(inner.layers[n].calls) == 1 for n in names)
    model(ids)  # after exit: nothing records
    assert all(len(r.layers[n].calls) == 1 for r in (p, outer, inner) for n in names)


def test_cross_attention_and_no_grad():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, kdim=8, vdim=8)
    with torch.no_grad(), probe(mha) as p:
        mha(torch.randn(1, 3, 16), torch.randn(1, 5, 8))
    rec = p.layers[""].calls[0]
    assert rec.shape == (1, 2, 3, 5) and rec.grad_sq is None
    torch.testing.assert_close(rec.weights.sum(-1), torch.ones(1, 2, 3))


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: probe("model").__enter__(), TypeError),
        (lambda: probe(MultiHeadAttention(8, 2), max_elements=-1).__enter__(), ValueError),
    ],
)
def test_bad_arguments(call, error):
    with pytest.raises(error):
        call()


def test_additive_and_single_head_attention_are_probed():
    """Bahdanau attention reaches _attend as a bias on zero-width scores: weights and gradients still hold."""
    from attnkit.nn import AdditiveAttention, SingleHeadAttention

    torch.manual_seed(0)
    add = AdditiveAttention(8, 6, 16).double()
    q, k = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)
    v = torch.randn(2, 5, 4, dtype=torch.float64)
    g = torch.randn(2, 3, 4, dtype=torch.float64)
    with probe(add) as p:
        (add(q, k, v) * g).sum().backward()
    rec = p.layers[""].calls[0]
    s = add.scores(q, k).detach().requires_grad_(True)  # (B, Lq, Lk)
    (torch.softmax(s, -1) @ v * g).sum().backward()
    torch.testing.assert_close(rec.weights[:, 0], torch.softmax(s, -1).float().detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        rec.grad_sq[:, 0], s.grad.pow(2).sum(dim=(-1, -2)) * 5, rtol=1e-9, atol=1e-12
    )  # x 5 keys
    head = SingleHeadAttention(4, 2)
    with probe(head) as p:
        head(torch.randn(3, 4))
    assert p.layers[""].calls[0].shape == (1, 1, 3, 3)


def test_a_layer_with_learned_sinks_is_refused_by_name():
    """The probe's recomputed weights leave a sink's share out: it says so instead of recording wrong ones."""
    model = DecoderLM(DecoderConfig.preset("tiny", attention_sinks=True)).eval()
    with pytest.raises(ValueError, match="'layers.0.attn' has learned attention sinks"):
        with probe(model):
            model(torch.randint(0, 256, (1, 4)))
    model(torch.randint(0, 256, (1, 4)))  # the hooks are gone after the error
