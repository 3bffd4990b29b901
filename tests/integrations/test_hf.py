"""attnkit inside Hugging Face models: parity with attn_implementation="eager" on tiny random-weight models."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.testing import check_against_oracle

import transformers
from transformers import masking_utils as mu

from attnkit.integrations import hf
from _models import V, hf_kwargs, hf_llama_family, left_padded

TOL = 1e-4  # float32 parity with eager
_COMMON = hf_kwargs(intermediate_size=128, attention_dropout=0.0)


def _config(name: str):
    if name in ("llama", "mistral", "qwen2"):
        return hf_llama_family(name, **_COMMON)
    if name == "gemma2":
        return transformers.Gemma2Config(
            **_COMMON,
            head_dim=16,
            sliding_window=4,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=20.0,
            query_pre_attn_scalar=16,
        )
    if name == "gpt2":
        return transformers.GPT2Config(
            vocab_size=V,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    raise KeyError(name)


def _model(name: str, impl: str = "eager"):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation=impl)
    if name == "gemma2":  # large q/k so that the soft-cap (3.0) changes the scores a lot
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(25.0)
                layer.self_attn.k_proj.weight.mul_(25.0)
    return model.eval()


def _batch(length: int = 9):
    """Three sequences, the first two left-padded (pad id 0)."""
    return left_padded([3, 1, 0], length)


CAUSAL_LMS = ["llama", "mistral", "qwen2", "gemma2", "gpt2"]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert hf.register() == "attnkit"


def _matches_eager(model, run, name: str = "attnkit") -> None:
    """``run(model)`` (a tensor) under the attention implementation ``name`` is what it is under the model's own
    (eager) attention, to TOL; the model is left on ``name``."""
    with torch.no_grad():
        ref = run(model)
        model.set_attn_implementation(name)
        out = run(model)
    assert (out - ref).abs().max().item() <= TOL


class _Spy:
    """Counts attnkit.attention calls made by the HF attention function and records the k/v head counts."""

    def __init__(self, monkeypatch):
        self.calls, self.kv_heads, self.q_heads = 0, set(), set()
        real = hf.attention

        def spy(q, k, v, **kw):
            self.calls += 1
            self.q_heads.add(q.shape[1])
            self.kv_heads.add(k.shape[1])
            return real(q, k, v, **kw)

        monkeypatch.setattr(hf, "attention", spy)


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_logits_match_eager_with_left_padding(name, monkeypatch):
    model = _model(name)
    ids, am = _batch()
    with torch.no_grad():
        ref = model(ids, attention_mask=am).logits
        model.set_attn_implementation("attnkit")
        assert model.config._attn_implementation == "attnkit"
        spy = _Spy(monkeypatch)
        out = model(ids, attention_mask=am).logits
    assert spy.calls == model.config.num_hidden_layers
    real = am.bool()
    err = (out - ref)[real].abs().max().item()
    assert err <= TOL, f"{name}: max |logits - eager| = {err:.2e} at real tokens"
    if name != "gpt2":  # grouped-query layers get k/v with their own 2 heads, never repeated to 4
        assert spy.kv_heads == {2} and spy.q_heads == {4}


def test_from_config_with_attn_implementation():
    model = _model("llama", impl="attnkit")
    ref = _model("llama")
    ids, am = _batch()
    with torch.no_grad():
        err = (model(ids, attention_mask=am).logits - ref(ids, attention_mask=am).logits)[am.bool()].abs().max()
    assert model.config._attn_implementation == "attnkit" and err <= TOL


def test_gemma2_softcap_and_window_are_honoured():
    """The Gemma 2 parity above is not vacuous: dropping the soft-cap or the window changes the logits."""
    model = _model("gemma2")
    ids, am = _batch()
    with torch.no_grad():
        ref = model(ids, attention_mask=am).logits
        model.set_attn_implementation("attnkit")
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        no_cap = model(ids, attention_mask=am).logits
    assert (no_cap - ref)[am.bool()].abs().max() > 1e-2


def test_mistral_window_changes_logits():
    model = _model("mistral")
    ids, am = _batch()
    with torch.no_grad():
        model.set_attn_implementation("attnkit")
        windowed = model(ids, attention_mask=am).logits
        model.config.sliding_window = None
        full = model(ids, attention_mask=am).logits
    assert (windowed - full)[am.bool()].abs().max() > 1e-3


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_greedy_generate_matches_eager(name):
    model = _model(name)
    ids, am = _batch(7)
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **kw)  # 13 tokens: past Mistral's and Gemma 2's window of 4
    model.set_attn_implementation("attnkit")
    ours = model.generate(ids, **kw)
    assert torch.equal(eager, ours), f"{name}: greedy tokens differ\n{eager}\n{ours}"


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_greedy_generate_with_static_cache_matches_eager(name):
    """Static caches: generate builds the masks ahead of the forward (a structured one for Mistral's prefill)."""
    model = _model(name)
    ids, am = _batch(7)
    kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    eager = model.generate(ids, **kw)
    model.set_attn_implementation("attnkit")
    assert torch.equal(eager, model.generate(ids, **kw))


def _grads(model, ids, am):
    model.zero_grad()
    # no loss on padding, nor on the first real token of a left-padded row (it would be predicted from a pad)
    labels = ids.masked_fill(am == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(am[:, :-1] == 0, -100)
    model(ids, attention_mask=am, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_training_step_gradients_match_eager(name):
    model = _model(name).train()
    ids, am = _batch()
    ref = _grads(model, ids, am)
    model.set_attn_implementation("attnkit")
    ours = _grads(model, ids, am)
    assert ref.keys() == ours.keys() and len(ref) > 5
    for n in ref:
        scale = max(1.0, ref[n].abs().max().item())
        err = (ours[n] - ref[n]).abs().max().item()
        assert err <= TOL * scale, f"{name}: grad of {n} differs by {err:.2e}"


# ------------------------------------------------------------------------------------------- encoder


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    return transformers.AutoModelForMaskedLM.from_config(cfg, attn_implementation="eager").eval()


def test_bert_logits_and_gradients_match_eager():
    model = _bert()
    ids, am = _batch()
    am[2, -2:] = 0  # right padding as well
    # bidirectional: every query row sees the real keys, so padded rows agree too
    _matches_eager(model, lambda m: m(ids, attention_mask=am).logits)
    model.train()
    ours = _grads(model, ids, am)
    model.set_attn_implementation("eager")
    ref_g = _grads(model, ids, am)
    for n in ref_g:
        assert (ours[n] - ref_g[n]).abs().max() <= TOL * max(1.0, ref_g[n].abs().max().item()), n


# ------------------------------------------------------------------------------------------- masks


def _recorded_masks(monkeypatch):
    seen = []
    real = hf.build_mask

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(
        mu.AttentionMaskInterface, "_global_mapping", {**mu.AttentionMaskInterface._global_mapping, "attnkit": spy}
    )
    return seen


@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama", "(causal(align='bottom_right') & key_padding(bool (3, 9)))"),
        ("mistral", "(sliding_window(left=3, right=0, align='bottom_right') & key_padding(bool (3, 9)))"),
    ],
)
def test_models_get_structured_masks(name, expected, monkeypatch):
    seen = _recorded_masks(monkeypatch)
    model = _model(name, impl="attnkit")
    ids, am = _batch()
    with torch.no_grad():
        model(ids, attention_mask=am)
        model(ids)  # no padding: the pattern alone
    assert [repr(m.mask) for m in seen] == [expected, expected.split(" & ")[0][1:]]


def test_bert_gets_key_padding_only(monkeypatch):
    seen = _recorded_masks(monkeypatch)
    model = _bert()
    model.set_attn_implementation("attnkit")
    ids, am = _batch()
    with torch.no_grad():
        model(ids, attention_mask=am)
        model(ids)
    assert repr(seen[0].mask) == "key_padding(bool (3, 9))" and seen[1].mask is None


def test_packed_sequences_get_the_varlen_mask(monkeypatch):
    """position_ids that restart mark packed documents: each sequence's tiles only (masks.varlen), exact."""
    model = _model("llama")
    ids = torch.randint(3, V, (1, 9))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    with torch.no_grad():
        ref = model(ids, position_ids=pos, use_cache=False).logits
        model.set_attn_implementation("attnkit")
        seen = _recorded_masks(monkeypatch)
        out = model(ids, position_ids=pos, use_cache=False).logits
    assert repr(seen[0].mask) == "varlen(3 sequences, mask=causal(align='bottom_right'))"
    assert (out - ref).abs().max() <= TOL


_PATTERNS = {
    "causal": lambda w: mu.causal_mask_function,
    "sliding": lambda w: mu.sliding_window_causal_mask_function(w),
    "bidirectional": lambda w: mu.bidirectional_mask_function,
    "bidirectional_sliding": lambda w: mu.sliding_window_bidirectional_mask_function(w),
}


@given(
    kind=st.sampled_from(sorted(_PATTERNS)),
    window=st.integers(1, 6),
    q_len=st.integers(1, 7),
    past=st.integers(0, 6),
    dropped=st.integers(0, 4),
    batch=st.integers(1, 3),
    pads=st.data(),
)
def test_build_mask_equals_transformers_sdpa_mask(kind, window, q_len, past, dropped, batch, pads):
    """For any shape, cache offset and padding, attnkit's mask allows exactly what transformers' does."""
    fn = _PATTERNS[kind](window)
    if kind.startswith("bidirectional"):
        past = dropped = 0  # encoders have no cache
    dropped = min(dropped, past)  # a sliding cache that dropped its oldest keys: kv_offset > 0
    kv_len, q_off, kv_off = past + q_len - dropped, past, dropped
    n_pad = pads.draw(st.lists(st.integers(0, past + q_len), min_size=batch, max_size=batch))
    am = torch.ones(batch, past + q_len, dtype=torch.bool)
    for b, n in enumerate(n_pad):
        am[b, :n] = False
    for padding in (None, am):
        want = mu.sdpa_mask(
            batch_size=batch,
            q_length=q_len,
            kv_length=kv_len,
            q_offset=q_off,
            kv_offset=kv_off,
            mask_function=fn,
            attention_mask=padding,
            allow_is_causal_skip=False,
            allow_is_bidirectional_skip=False,
        )
        got = hf.build_mask(
            batch,
            q_len,
            kv_len,
            q_off,
            kv_off,
            mask_function=fn,
            attention_mask=padding,
            allow_is_bidirectional_skip=True,
        )
        assert isinstance(got, hf._StructuredMask)  # every one of these has the bottom-right alignment
        assert torch.equal(got.to_dense(), want)


def test_build_mask_falls_back_where_alignment_differs():
    """A static cache (keys = the whole buffer, q_offset a tensor) gets transformers' dense mask."""
    am = torch.ones(2, 10, dtype=torch.bool)
    am[0, :2] = False
    got = hf.build_mask(2, 1, 10, torch.tensor(4), 0, mask_function=mu.causal_mask_function, attention_mask=am)
    want = mu.sdpa_mask(
        batch_size=2,
        q_length=1,
        kv_length=10,
        q_offset=torch.tensor(4),
        kv_offset=0,
        mask_function=mu.causal_mask_function,
        attention_mask=am,
        allow_is_causal_skip=False,
    )
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    # callers that will add to the mask ask for a tensor
    got = hf.build_mask(2, 3, 3, mask_function=mu.causal_mask_function, allow_is_causal_skip=False)
    assert isinstance(got, torch.Tensor) and got.shape == (2, 1, 3, 3)


def test_prepared_structured_mask_passes_through():
    m = hf.build_mask(1, 4, 4, mask_function=mu.causal_mask_function)
    assert hf.build_mask(1, 4, 4, attention_mask=m) is m
    assert m.ndim == 4 and m.shape == (1, 1, 4, 4) and "causal" in repr(m)


# --------------------------------------------------------------------------------- attention function


def test_output_attentions_match_eager():
    for name in ("llama", "gpt2"):  # GPT-2 keeps output_attentions out of the kwargs: the recorder is read
        model = _model(name)
        ids, am = _batch()
        with torch.no_grad():
            ref = model(ids, attention_mask=am, output_attentions=True).attentions
            model.set_attn_implementation("attnkit")
            ours = model(ids, attention_mask=am, output_attentions=True).attentions
            assert model(ids, attention_mask=am).attentions is None
        assert len(ours) == len(ref) == 2
        real_rows = am.bool()[:, None, :, None]  # (B, 1, Lq, 1): query rows of real tokens
        for a, b in zip(ours, ref):
            assert a is not None and a.shape == b.shape
            assert (a - b).masked_fill(~real_rows, 0).abs().max() <= 1e-5


def test_attention_forward_passes_dropout_scale_softcap_and_bias():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    bias = torch.randn(1, 4, 5, 5, generator=g)
    keep = torch.tensor([[False, True, True, True, True], [True] * 5])
    m = hf._StructuredMask(masks.causal() & masks.key_padding(keep), (2, 1, 5, 5), torch.device("cpu"))
    kw = dict(scale=0.3, softcap=2.0, bias=bias, mask=m.mask)
    torch.manual_seed(7)
    out, w = hf.attention_forward(
        torch.nn.Module(), q, k, v, m, dropout=0.5, scaling=0.3, softcap=2.0, position_bias=bias
    )
    torch.manual_seed(7)
    want = attnkit.attention(q, k, v, dropout_p=0.5, **kw).transpose(1, 2)
    assert w is None and torch.equal(out, want)
    out0, _ = hf.attention_forward(torch.nn.Module(), q, k, v, m, scaling=0.3, softcap=2.0, position_bias=bias)
    assert not torch.allclose(out0, out)  # dropout did something
    check_against_oracle(
        lambda q, k, v, **kw: hf.attention_forward(
            torch.nn.Module(), q, k, v, m, scaling=0.3, softcap=2.0, position_bias=bias
        )[0].transpose(1, 2),
        q.requires_grad_(),
        k.requires_grad_(),
        v.requires_grad_(),
        mask=m.mask,
        bias=bias,
        scale=0.3,
        softcap=2.0,
    )


def test_attention_forward_without_mask_uses_module_causality():
    q = k = v = torch.randn(1, 2, 6, 8)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = hf.attention_forward(module, q, k, v, None)
    assert torch.allclose(out, attnkit.attention(q, k, v, mask=masks.causal()).transpose(1, 2))
    out, _ = hf.attention_forward(module, q, k, v, None, is_causal=False)
    assert torch.allclose(out, attnkit.attention(q, k, v).transpose(1, 2))
    out, _ = hf.attention_forward(module, q, k, v, None, sliding_window=3)
    assert torch.allclose(out, attnkit.attention(q, k, v, mask=masks.sliding_window(2)).transpose(1, 2))


def test_attention_forward_takes_dense_bool_and_float_masks():
    q = k = v = torch.randn(2, 2, 4, 8)
    allowed = torch.rand(2, 1, 4, 4) > 0.3
    allowed[..., 0] = True
    out, _ = hf.attention_forward(torch.nn.Module(), q, k, v, allowed)
    assert torch.allclose(out, attnkit.attention(q, k, v, mask=allowed).transpose(1, 2))
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out2, _ = hf.attention_forward(torch.nn.Module(), q, k, v, additive)
    assert torch.allclose(out, out2, atol=1e-6)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        hf.attention_forward(torch.nn.Module(), q, k, v, allowed.long())


def test_attention_forward_rejects_block_selections_and_mismatched_masks():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="block_indices"):
        hf.attention_forward(torch.nn.Module(), q, k, v, None, block_indices=torch.zeros(2))
    m = hf.build_mask(1, 3, 3, mask_function=mu.causal_mask_function)
    with pytest.raises(ValueError, match=r"\(Lq, Lk\)=\(3, 3\)"):
        hf.attention_forward(torch.nn.Module(), q, k, v, m)


# ------------------------------------------------------------------------------------- registration


def test_register_with_a_backend_and_bad_arguments():
    assert hf.register("attnkit-math", backend="math") == "attnkit-math"
    model = _model("qwen2")
    ids, am = _batch()
    with torch.no_grad():
        ref = model(ids, attention_mask=am).logits
        model.set_attn_implementation("attnkit-math")
        assert (model(ids, attention_mask=am).logits - ref)[am.bool()].abs().max() <= TOL
    with pytest.raises(ValueError, match="name='sdpa'"):
        hf.register("sdpa")
    with pytest.raises(ValueError, match="backend='nope'"):
        hf.register("x", backend="nope")
    with pytest.raises(TypeError, match="name"):
        hf.register("")


@pytest.mark.parametrize(
    "version, ok",
    [
        ("5.4.0", True),
        ("5.24.0", True),
        ("5.99.1.dev0", True),
        ("5.3.0", False),
        ("4.57.6", False),
        ("6.0.0", False),
        ("6.0.0rc1", False),
    ],
)
def test_version_gate(version, ok):
    if ok:
        hf._check_version(version)
    else:
        with pytest.raises(RuntimeError, match=f"found {version}"):
            hf._check_version(version)


def test_models_that_do_their_own_attention_get_the_eager_mask():
    """Bloom has no attention interface (``_supports_attention_backend = False``) but builds its mask
    through create_causal_mask: with attn_implementation="attnkit" it gets the mask "eager" gets (an
    attnkit structured mask crashed its own attention code), so its logits are eager's."""
    name = hf.register()
    cfg = dict(vocab_size=100, hidden_size=64, n_head=4, n_layer=2)
    torch.manual_seed(0)
    eager = transformers.BloomForCausalLM(transformers.BloomConfig(**cfg, attn_implementation="eager")).eval()
    ours = transformers.BloomForCausalLM(transformers.BloomConfig(**cfg, attn_implementation=name)).eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(2, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    with torch.no_grad():
        assert torch.equal(ours(ids, attention_mask=am).logits, eager(ids, attention_mask=am).logits)


def test_sparse_indexer_models_keep_their_top_k_selection():
    """DeepSeek-V3.2-style models pass their indexer's top-k keys as ``indices=`` to every implementation but
    eager/sdpa (which turn them into a mask): attnkit applies them (it attended densely before)."""
    name = hf.register()
    cfg = transformers.DeepseekV32Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        index_topk=3,
        index_head_dim=16,
        index_n_heads=2,
        head_dim=16,
        first_k_dense_replace=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    _matches_eager(model, lambda m: m(ids).logits, name)
    q = k = v = torch.randn(1, 2, 4, 8)
    picked = torch.tensor([[[0, -1], [1, 0], [2, 2], [3, 1]]])  # -1 selects nothing
    allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    out, _ = hf.attention_forward(torch.nn.Module(), q, k, v, None, indices=picked)
    assert torch.allclose(out.transpose(1, 2), attnkit.attention(q, k, v, mask=allowed[None, None]), atol=1e-6)
    with pytest.raises(ValueError, match="beyond the Lk=4 keys"):
        hf.attention_forward(torch.nn.Module(), q, k, v, None, indices=picked + 4)
    with pytest.raises(ValueError, match="block_indices"):
        hf.attention_forward(torch.nn.Module(), q, k, v, None, block_indices=torch.zeros(1, 1, 4, 1, dtype=torch.long))


@pytest.mark.parametrize("bad", ["attnkit_flash", "my_sdpa", "flex_attention_x", "org/kernel"])
def test_register_refuses_names_transformers_routes_by_substring(bad):
    with pytest.raises(ValueError, match="routes by substring"):
        hf.register(bad)


# one encoder and one decoder layer, 32 wide, four heads
_ENCODER_DECODER = dict(
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
)


def test_seq2seq_models_that_call_the_interface_get_structured_masks(monkeypatch):
    """BART sets _supports_attention_backend = False yet calls the attention interface: its masks reach
    attnkit structured (key padding, causal), not as dense float biases, and its logits stay eager's."""
    name = hf.register()
    cfg = dict(
        **_ENCODER_DECODER,
        vocab_size=64,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    torch.manual_seed(0)
    eager = transformers.BartForConditionalGeneration(transformers.BartConfig(**cfg, attn_implementation="eager"))
    ours = transformers.BartForConditionalGeneration(transformers.BartConfig(**cfg, attn_implementation=name))
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    seen = []
    real = hf.attention

    def spy(q, k, v, **kw):
        seen.append((kw.get("mask"), kw.get("bias")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(hf, "attention", spy)
    with torch.no_grad():
        got = ours.eval()(input_ids=ids, attention_mask=am, decoder_input_ids=ids[:, :5]).logits
        want = eager.eval()(input_ids=ids, attention_mask=am, decoder_input_ids=ids[:, :5]).logits
    assert (got - want).abs().max() <= TOL
    assert seen and all(isinstance(m, masks.Mask) and b is None for m, b in seen)


# ------------------------------------------------------- model code that computes with the mask itself


def test_siglip2_pooling_head_gets_a_plain_tensor_mask():
    vcfg = transformers.Siglip2VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_channels=3,
        patch_size=4,
        num_patches=16,
    )
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(vcfg).eval()
    pv = torch.randn(2, 16, 3 * 4 * 4)
    pam = torch.ones(2, 16, dtype=torch.long)
    pam[0, 10:] = 0
    kw = dict(pixel_values=pv, pixel_attention_mask=pam, spatial_shapes=torch.tensor([[4, 4], [4, 4]]))
    _matches_eager(
        model, lambda m: m(**kw).pooler_output
    )  # (the head's mask.repeat(...) failed on the structured mask)


def test_bigbird_pegasus_encoder_adding_the_mask_to_its_scores_matches_eager():
    cfg = transformers.BigBirdPegasusConfig(
        **_ENCODER_DECODER,
        vocab_size=V,
        max_position_embeddings=64,
        attention_type="original_full",
    )
    torch.manual_seed(0)
    model = transformers.BigBirdPegasusForConditionalGeneration(cfg).eval()
    ids, am = _batch()
    _matches_eager(model, lambda m: m(input_ids=ids, attention_mask=am, decoder_input_ids=ids).logits)


def test_a_padding_mask_built_for_one_query_row_serves_every_row():
    # BridgeTower builds its key padding mask for one query row and reuses it for all of them
    keep = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    m = hf.build_mask(
        2, 1, 5, mask_function=mu.bidirectional_mask_function, attention_mask=keep, allow_is_bidirectional_skip=True
    )
    q = torch.randn(2, 4, 3, 8)
    k = v = torch.randn(2, 2, 5, 8)
    out, _ = hf.attention_forward(torch.nn.Module(), q, k, v, m)
    want = attnkit.attention(q, k, v, mask=keep.bool()[:, None, None, :])
    torch.testing.assert_close(out, want.transpose(1, 2))
    causal = hf.build_mask(2, 1, 5, q_offset=4, mask_function=mu.causal_mask_function, attention_mask=keep)
    with pytest.raises(ValueError, match=r"\(Lq, Lk\)=\(1, 5\)"):  # a causal one depends on the row: refused
        hf.attention_forward(torch.nn.Module(), q, k, v, causal)
