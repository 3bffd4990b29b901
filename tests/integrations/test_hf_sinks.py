"""Attention-sink architectures of transformers (``s_aux`` / ``sinks``) on attnkit: parity with eager attention,
on tiny random configs (nothing is downloaded)."""

import pytest
import torch

from attnkit.integrations import hf
from _models import hf_sink_model, left_padded

TOL = 1e-4  # float32 parity with eager
CAUSAL = ["gpt_oss", "deepseek_v4", "flint", "granite_swa", "granitemoe_swa", "hy_v4", "mimo_v2_flash"]
ALL = CAUSAL + ["openai_privacy_filter"]


def _model(model_type: str):
    return hf_sink_model(model_type, token_classification=model_type not in CAUSAL)


def _batch(length=9):
    return left_padded([2, 0], length)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()


def _logits(model, ids, am):
    return model(ids, attention_mask=am).logits


@pytest.mark.parametrize("model_type", ALL)
def test_logits_and_gradients_match_eager(model_type):
    model = _model(model_type)
    ids, am = _batch()
    calls = []
    real_attention = hf.attention

    def spy(*a, **kw):
        calls.append(kw.get("sinks") is not None)
        return real_attention(*a, **kw)

    grads = {}
    for impl in ("eager", "attnkit"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        if impl == "attnkit":
            hf.attention = spy
        try:
            logits = _logits(model, ids, am)
        finally:
            hf.attention = real_attention
        (logits[am.bool()] ** 2).mean().backward()
        grads[impl] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert any(calls), "the sinks did not reach attnkit"  # (MiMo-V2-Flash: sinks in some layers only)
    (ref, gref), (out, gout) = grads["eager"], grads["attnkit"]
    err = (out - ref)[am.bool()].abs().max().item()
    assert err <= TOL, f"{model_type}: max |logits - eager| = {err:.2e}"
    sink_grads = [n for n in gref if n.endswith("sinks")]
    assert sink_grads and gref.keys() == gout.keys()
    for n in gref:
        scale = max(1.0, gref[n].abs().max().item())
        assert (gout[n] - gref[n]).abs().max().item() <= TOL * scale, f"{model_type}: grad of {n} differs"


@pytest.mark.parametrize("model_type", CAUSAL)
def test_greedy_generate_matches_eager(model_type):
    model = _model(model_type)
    ids, am = _batch(7)
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        eager = model.generate(ids, **kw)
        model.set_attn_implementation("attnkit")
        ours = model.generate(ids, **kw)
    assert torch.equal(eager, ours), f"{model_type}: greedy tokens differ\n{eager}\n{ours}"


def test_attention_forward_takes_s_aux_and_sinks_like_eager():
    q = torch.randn(1, 4, 5, 8)
    k = v = torch.randn(1, 2, 5, 8)
    s = torch.randn(4)
    a, w = hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True, s_aux=s, output_attentions=True)
    b, _ = hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True, sinks=s)
    torch.testing.assert_close(a, b)
    assert bool((w.sum(-1) < 1).all())  # the weights leave out the sink's share, as eager's do
