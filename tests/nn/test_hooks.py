"""register_attention_hook: observe, change or replace the attention of an attnkit.nn module; removable."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.functional import observe_attention
from attnkit.nn import (
    AttentionCall,
    DecoderConfig,
    DecoderLM,
    LatentAttention,
    MoBAAttention,
    MultiHeadAttention,
    NSAAttention,
    SingleHeadAttention,
)


def _mha(**kw):
    torch.manual_seed(0)
    return MultiHeadAttention(16, 4, n_kv_heads=2, mask=masks.causal(), **kw).eval()


def test_an_observing_hook_sees_the_call_and_changes_nothing():
    mha = _mha()
    x = torch.randn(2, 5, 16)
    plain = mha(x)
    seen = []

    def hook(module, call, compute):
        out = compute(call)
        seen.append((module, call, out))
        return out

    handle = mha.register_attention_hook(hook)
    torch.testing.assert_close(mha(x), plain, rtol=0, atol=0)
    ((module, call, out),) = seen
    assert module is mha and isinstance(call, AttentionCall)
    assert call.q.shape == (2, 4, 5, 4) and call.k.shape == (2, 2, 5, 4) and call.v.shape == (2, 2, 5, 4)
    assert call.mask is not None and call.bias is None and call.dropout_p == 0.0 and call.sinks is None
    torch.testing.assert_close(out, attnkit.attention(call.q, call.k, call.v, mask=call.mask, scale=call.scale))
    handle.remove()
    torch.testing.assert_close(mha(x), plain, rtol=0, atol=0)
    assert len(seen) == 1  # removed: not called any more
    handle.remove()  # removing twice is harmless


def test_removal_restores_exactly_the_output_and_its_gradient():
    mha = _mha()
    x = torch.randn(1, 6, 16, requires_grad=True)
    mha(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    with mha.register_attention_hook(lambda module, call, compute: torch.zeros_like(compute(call))):
        assert mha(x).abs().sum() == mha.out_proj.bias.abs().sum() * 6  # only the output bias is left
    out = mha(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def test_hooks_nest_the_last_registered_outermost():
    mha = _mha()
    x = torch.randn(1, 4, 16)
    order = []

    def named(name):
        def hook(module, call, compute):
            order.append(f"{name} in")
            out = compute(call)
            order.append(f"{name} out")
            return out

        return hook

    a = mha.register_attention_hook(named("a"))
    b = mha.register_attention_hook(named("b"))
    mha(x)
    assert order == ["b in", "a in", "a out", "b out"]
    order.clear()
    a.remove()
    mha(x)
    assert order == ["b in", "b out"]
    b.remove()


def test_a_hook_may_change_the_call_or_replace_the_computation():
    mha = _mha()
    x = torch.randn(1, 5, 16)
    full = MultiHeadAttention(16, 4, n_kv_heads=2).eval()
    full.load_state_dict(mha.state_dict())
    with mha.register_attention_hook(lambda module, call, compute: compute(call.replace(mask=None))):
        torch.testing.assert_close(mha(x), full(x), rtol=0, atol=0)  # the causal mask taken off
    seen = []
    inner = mha.register_attention_hook(lambda module, call, compute: seen.append("inner") or compute(call))
    with mha.register_attention_hook(lambda module, call, compute: torch.zeros_like(call.q)):
        mha(x)
    assert seen == []  # a replacing hook runs instead of the ones registered before it
    inner.remove()


def test_a_hook_that_passes_something_else_on_is_told_so():
    mha = _mha()
    with mha.register_attention_hook(lambda module, call, compute: compute(call.q)):
        with pytest.raises(TypeError, match="compute\\(\\) with Tensor.*AttentionCall"):
            mha(torch.randn(1, 3, 16))
    with pytest.raises(TypeError, match="hook must be callable"):
        mha.register_attention_hook("not a hook")


@pytest.mark.parametrize(
    "make",
    [
        lambda: SingleHeadAttention(16, 8),
        lambda: LatentAttention(
            32,
            4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            mask=masks.causal(),
        ),
        lambda: MoBAAttention(16, 2, block=4, top_k=2, mask=masks.causal()),
        lambda: NSAAttention(
            16, 2, compress_block=4, compress_stride=2, select_block=4, select_count=2, window=4, mask=masks.causal()
        ),
    ],
    ids=["single", "latent", "moba", "nsa"],
)
def test_every_attention_module_runs_its_hooks(make):
    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(1, 8, 32 if isinstance(module, LatentAttention) else 16)
    args = (x,)
    plain = module(*args)
    calls = []
    with module.register_attention_hook(lambda m, call, compute: calls.append(call) or compute(call)):
        hooked = module(*args)
    # (MoBA's prefill under a hook is one call under its block mask, not routed: equal up to rounding)
    torch.testing.assert_close(hooked, plain, **({} if isinstance(module, MoBAAttention) else {"rtol": 0, "atol": 0}))
    assert calls and all(isinstance(c, AttentionCall) for c in calls)
    torch.testing.assert_close(module(*args), plain, rtol=0, atol=0)  # removed: as before, exactly


def test_a_models_hooks_and_attention_observers_are_removable():
    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    ids = torch.randint(0, 256, (1, 6))
    seen = []
    handles = [
        layer.attn.register_attention_hook(lambda m, call, compute: seen.append(m) or compute(call))
        for layer in model.layers
    ]
    with observe_attention(lambda q, k, v, *, out, **kw: seen.append(out.shape)):
        model(ids)
    assert seen[0] is model.layers[0].attn and seen[1] == (1, 4, 6, 16) and len(seen) == 4
    for h in handles:
        h.remove()
    model(ids)
    assert len(seen) == 4
    with pytest.raises(TypeError, match="observer must be callable"):
        observe_attention(None)
