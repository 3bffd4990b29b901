"""register_attention_hook: observe, change or replace the attention of an attnkit.nn module; removable."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.functional import observe_attention
from _models import latent_decoder, tiny_decoder
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


# ----------------------------------------------------------- caches that compute attention themselves


def _flip_hook(seen):
    """A hook that changes the attention (its output's channels reversed, scaled by -3) and records the query
    lengths."""

    def hook(module, call, compute):
        seen.append(call.q.shape[2])
        return -3.0 * compute(call).flip(-1)

    return hook


def _hooked(model, seen):
    return [
        m.register_attention_hook(_flip_hook(seen)) for m in model.modules() if hasattr(m, "register_attention_hook")
    ]


def _decoder(variant):
    if variant == "latent":
        return latent_decoder().eval()
    if variant == "sinks":
        model = tiny_decoder(attention_sinks=True)
        with torch.no_grad():
            for m in model.modules():
                if getattr(m, "sinks", None) is not None:
                    m.sinks.normal_(0.0, 2.0)  # (learned sinks that matter)
        return model
    return tiny_decoder(positions=variant)


def _logprobs(model, prompts, cache):
    """The chosen tokens' log-probabilities of a 6-token greedy generation (they move with any change)."""
    out = attnkit.generate(model, prompts, 6, cache=cache, logprobs=0)
    return torch.tensor([[t.logprob for t in row] for row in out.logprobs])


# (the quantized cache stores no latent keys: LatentAttention refuses it)
@pytest.mark.parametrize(
    "variant, cache",
    [
        ("rope", "paged"),
        ("alibi", "paged"),
        ("latent", "paged"),
        ("sinks", "paged"),
        ("rope", "int8"),
        ("alibi", "int8"),
        ("sinks", "int8"),
    ],
)
def test_decode_steps_of_caches_that_attend_themselves_run_the_hooks(variant, cache):
    """The paged and quantized caches' decode steps compute attention themselves; with hooks they hand it to
    the hooks: the log-probabilities equal those of the static cache under the same (output-changing) hook,
    which differ from the unhooked ones, and the hooks see one-token decode queries."""
    model = _decoder(variant)
    prompts = [[5, 3, 9, 1, 7], [2, 8]]  # ragged: the paged cache's decode rows differ in length
    plain = _logprobs(model, prompts, cache)
    seen: list[int] = []
    handles = _hooked(model, seen)
    try:
        hooked = _logprobs(model, prompts, cache)
        reference = _logprobs(model, prompts, "static")
    finally:
        for h in handles:
            h.remove()
    # int8: as far apart as the quantization alone moves the unhooked model (paged: rounding)
    quantization = (plain - _logprobs(model, prompts, "static")).abs().max().item()
    tol = 1e-5 if cache == "paged" else 3 * quantization + 1e-5
    torch.testing.assert_close(hooked, reference, rtol=0, atol=tol)
    assert (hooked - plain).abs().max() > 10 * tol
    assert seen.count(1) >= 5 * model.config.n_layers  # every decode step of every layer
    # removed: the caches' own kernels again (up to the rounding of another decode thread count)
    torch.testing.assert_close(_logprobs(model, prompts, cache), plain, rtol=0, atol=1e-5)


def _engine_logprobs(model, prompts):
    engine = attnkit.Engine(model, cache_blocks=32, block_size=4, max_batch=3, max_batched_tokens=6)
    rids = [engine.add(p, 5, logprobs=0) for p in prompts]
    engine.run()
    return [torch.tensor([t.logprob for t in engine.token_logprobs(r)]) for r in rids]


ENGINE_PROMPTS = [[5, 3, 9, 1, 7, 4, 4, 2, 6], [2, 8], [1, 2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("variant", ["rope", "alibi", "sinks"])
def test_the_engines_packed_steps_run_the_hooks(variant):
    """The Engine packs prompt chunks and decode tokens of several requests into one forward (a paged cache
    that computes attention itself, per piece): with hooks, each piece goes through them, and every request's
    log-probabilities equal those of generating it alone through a static cache under the same hook."""
    model = _decoder(variant)
    seen: list[int] = []
    handles = _hooked(model, seen)
    try:
        got = _engine_logprobs(model, ENGINE_PROMPTS)
        want = [_logprobs(model, [p], "static")[0, :5] for p in ENGINE_PROMPTS]
    finally:
        for h in handles:
            h.remove()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert 1 in seen and max(seen) > 1  # decode rows and prompt chunks
    plain = [_logprobs(model, [p], "static")[0, :5] for p in ENGINE_PROMPTS]
    assert max((g - p).abs().max().item() for g, p in zip(got, plain)) > 1e-3  # the hook mattered


def test_the_engines_packed_steps_show_latent_attention_to_observing_hooks():
    """Latent attention in the Engine attends in the latent space (the up-projections absorbed), so that is
    what its hooks see: an observing hook sees decode rows and prompt chunks and changes nothing."""
    model = _decoder("latent")
    plain = _engine_logprobs(model, ENGINE_PROMPTS)
    seen = []

    def hook(module, call, compute):
        seen.append((call.q.shape[2], call.v.shape[-1]))
        return compute(call)

    handles = [m.register_attention_hook(hook) for m in model.modules() if hasattr(m, "register_attention_hook")]
    try:
        got = _engine_logprobs(model, ENGINE_PROMPTS)
    finally:
        for h in handles:
            h.remove()
    for g, w in zip(got, plain):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    lengths = {n for n, _ in seen}
    assert 1 in lengths and max(lengths) > 1
    assert {d for _, d in seen} == {model.config.kv_lora_rank}  # the latent values


def test_a_cache_whose_attend_takes_no_compute_is_refused_when_hooks_are_on():
    """A user's cache that computes attention itself, written without ``compute=``: unhooked it works; with a
    hook the layer says what to add instead of silently skipping the hook."""
    from attnkit.cache import CacheAttention, CacheRead, attend

    class OldAttend(CacheAttention):
        def __init__(self, k, v):
            self.k, self.v = k, v

        def attend(self, q, *, mask=None, bias=None, scale=None, softcap=None, sinks=None):
            return attend(CacheRead(self.k, self.v), q, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks)

    class OldCache:
        def __init__(self):
            self.k = self.v = None

        def update(self, k, v):
            self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
            self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
            return OldAttend(self.k, self.v)

    mha = _mha()
    x = torch.randn(1, 4, 16)
    want = mha(x)
    torch.testing.assert_close(mha(x, cache=OldCache()), want)
    with mha.register_attention_hook(lambda module, call, compute: compute(call)):
        with pytest.raises(TypeError, match="OldAttend.attend takes no compute= argument"):
            mha(x, cache=OldCache())
