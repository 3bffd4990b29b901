"""from_hf / to_hf: Llama-family causal LMs between transformers and attnkit.nn.DecoderLM, identical logits."""

import math

import pytest
import torch

import attnkit
from attnkit import masks

import transformers
from attnkit.integrations.hf import from_hf, to_hf
from attnkit.cache import SlidingWindowCache, StaticCache
from attnkit.nn import DecoderConfig, DecoderLM
from _models import V, hf_kwargs, left_padded

TOL = 1e-4
_COMMON = hf_kwargs(intermediate_size=96, max_position_embeddings=64)

HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "llama-biases-untied-llama3": lambda: transformers.LlamaConfig(
        **_COMMON,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        head_dim=32,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "mistral-window": lambda: transformers.MistralConfig(**_COMMON, sliding_window=4),
    # long-context rope types, with sequences on both sides of the original length (8)
    "llama-yarn": lambda: transformers.LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
    "llama-longrope": lambda: transformers.LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 8,
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.5 + 0.5 * i for i in range(8)],
        },
    ),
    "qwen2-dynamic": lambda: transformers.Qwen2Config(
        **{**_COMMON, "max_position_embeddings": 8},
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    ),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "qwen2-window-linear-rope": lambda: transformers.Qwen2Config(
        **_COMMON,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=0,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "qwen2-mixed-layers": lambda: transformers.Qwen2Config(  # sliding, full, sliding; attention dropout
        **{**_COMMON, "num_hidden_layers": 3},
        use_sliding_window=True,
        sliding_window=4,
        attention_dropout=0.25,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # Gemma 2: sliding / global / sliding, score and logit soft-caps, query_pre_attn_scalar != head_dim; weights
    # large enough (initializer_range) that every one of these changes the logits
    "gemma2": lambda: transformers.Gemma2Config(
        **{**_COMMON, "num_hidden_layers": 3},
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        initializer_range=0.1,
    ),
    "gemma2-biases-untied": lambda: transformers.Gemma2Config(
        **_COMMON,
        head_dim=16,
        sliding_window=5,
        query_pre_attn_scalar=16,
        attention_bias=True,
        tie_word_embeddings=False,
        final_logit_softcapping=None,
        initializer_range=0.1,
    ),
}


def _hf(name: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[name](), attn_implementation="eager")
    with torch.no_grad():  # biases are zero at init: make them count
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            if name.startswith("gemma2") and "norm" in n:  # stored as w - 1, zero at init: make the fold count
                p.normal_(0, 0.2)
    return model.eval()


def _left_padded(length: int = 12):
    ids, am = left_padded([4, 1, 0], length)
    pos = (am.cumsum(-1) - 1).clamp(min=0)  # HF's generate positions: count real tokens only
    return ids, am, pos


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_from_hf_logits_match(name):
    hf_model = _hf(name)
    model = from_hf(hf_model)
    assert isinstance(model, DecoderLM) and not model.training
    ids = torch.randint(3, V, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (model(ids) - hf_model(ids).logits).abs().max().item()
    assert err <= TOL, f"{name}: max |logits - HF| = {err:.2e}"
    # left-padded batch: HF with position_ids from the mask, attnkit with positions and key padding
    ids, am, pos = _left_padded()
    with torch.no_grad():
        out = model(ids, positions=pos, mask=masks.key_padding(am.bool()))
        if model.positions.length_dependent:  # attnkit: each row's own length; HF's batch takes its longest row
            ref = torch.zeros_like(out)
            for b in range(len(ids)):
                real = am[b].bool()
                ref[b, real] = _hf(name)(ids[b : b + 1, real]).logits[0]  # afresh: HF's dynamic NTK keeps state
        else:
            ref = hf_model(ids, attention_mask=am, position_ids=pos).logits
    err = (out - ref)[am.bool()].abs().max().item()
    assert err <= TOL, f"{name}: left-padded max |logits - HF| = {err:.2e}"


def test_from_hf_config_and_sensitivity():
    """The conversion carries what matters: the window, the biases, the rope scaling (each changes logits)."""
    cfg = from_hf(_hf("mistral-window")).config
    assert repr(cfg.mask) == "sliding_window(left=3, right=0, align='bottom_right')"
    cfg = from_hf(_hf("llama-biases-untied-llama3")).config
    assert (cfg.qkv_bias, cfg.out_bias, cfg.ffn_bias, cfg.tie_embeddings) == (True, True, True, False)
    assert cfg.rope_scaling["type"] == "llama3" and cfg.rope_theta == 500000.0 and cfg.head_dim == 32
    cfg = from_hf(_hf("qwen2")).config
    assert (cfg.qkv_bias, cfg.out_bias, cfg.ffn_bias, cfg.tie_embeddings) == (True, False, False, True)
    assert cfg.layer_masks is None and cfg.mask is None and cfg.attention_dropout == 0.0
    cfg = from_hf(_hf("qwen2-window-linear-rope")).config  # every layer slides: one mask for all
    assert repr(cfg.mask) == "sliding_window(left=4, right=0, align='bottom_right')" and cfg.layer_masks is None
    mixed = from_hf(_hf("qwen2-mixed-layers"))
    cfg = mixed.config
    assert cfg.mask is None and cfg.attention_dropout == 0.25
    assert [repr(m) for m in cfg.layer_masks] == [
        "sliding_window(left=3, right=0, align='bottom_right')",
        "None",
        "sliding_window(left=3, right=0, align='bottom_right')",
    ]
    assert [layer.attn.dropout for layer in mixed.layers] == [0.25] * 3
    ids = torch.randint(3, V, (1, 12))
    with torch.no_grad():  # the per-layer windows change the logits
        windowed = mixed(ids)
        for other in [(None, None, None), (None, cfg.layer_masks[0], None)]:
            alt = DecoderLM(cfg.replace(layer_masks=other))
            alt.load_state_dict(mixed.state_dict())
            assert (alt.eval()(ids) - windowed).abs().max() > 1e-3
    model = from_hf(_hf("mistral-window"))
    ids = torch.randint(3, V, (1, 12))
    with torch.no_grad():
        windowed = model(ids)
        model.config.mask = None
        full = DecoderLM(model.config)
        full.load_state_dict(model.state_dict())
        assert (full.eval()(ids) - windowed).abs().max() > 1e-3


def test_from_hf_long_context_rope_config_and_sensitivity():
    """yarn / longrope / dynamic NTK carry their fields; dynamic NTK may run past HF's max_position_embeddings
    (the length it scales beyond) up to factor times it; each scaling changes the logits."""
    model = from_hf(_hf("qwen2-dynamic"))
    assert model.config.rope_scaling == {"type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8}
    assert model.config.max_seq_len == 32
    yarn = from_hf(_hf("llama-yarn"))
    assert yarn.layers[0].attn.positions.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    ids = torch.randint(3, V, (1, 30))
    for m in (model, yarn, from_hf(_hf("llama-longrope"))):
        plain = DecoderLM(m.config.replace(rope_scaling=None, max_seq_len=64)).eval()
        plain.load_state_dict(m.state_dict())
        with torch.no_grad():
            assert (plain(ids) - m(ids)).abs().max() > 10 * TOL, m.config.rope_scaling["type"]


def test_from_hf_gemma2_config_and_sensitivity():
    """Gemma 2 converts with everything that makes it Gemma 2, and each piece changes the logits."""
    model = from_hf(_hf("gemma2"))
    cfg = model.config
    assert (cfg.ffn, cfg.post_norms, cfg.embed_scale, cfg.softcap, cfg.logit_softcap) == ("geglu", True, 8.0, 3.0, 5.0)
    assert cfg.attn_scale == pytest.approx(24**-0.5) and cfg.tie_embeddings and cfg.mask is None
    assert [m is None for m in cfg.layer_masks] == [False, True, False]  # sliding, global, sliding
    assert repr(cfg.layer_masks[0]) == "sliding_window(left=3, right=0, align='bottom_right')"
    other = from_hf(_hf("gemma2-biases-untied")).config
    assert (other.qkv_bias, other.out_bias, other.tie_embeddings, other.attn_scale, other.logit_softcap) == (
        True,
        True,
        False,
        None,
        None,
    )
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(ids)
        for change in [
            dict(softcap=None),
            dict(logit_softcap=None),
            dict(attn_scale=None),
            dict(layer_masks=None),
            dict(embed_scale=None),
        ]:
            alt = DecoderLM(cfg.replace(**change)).eval()
            alt.load_state_dict(model.state_dict())
            assert (alt(ids) - ref).abs().max() > 1e-2, change


def _greedy(model, ids, am, new: int, cache):
    """Greedy decoding of a left-padded batch through an attnkit KV cache, one token per step."""
    cache.set_left_padding((am == 0).sum(-1))
    pos = (am.cumsum(-1) - 1).clamp(min=0)  # (B, L) per-row positions
    with torch.no_grad():
        nxt = model(ids, cache=cache, positions=pos)[:, -1].argmax(-1)  # prefill
        out, last = [nxt], pos[:, -1:]
        for _ in range(new - 1):
            last = last + 1
            nxt = model(nxt[:, None], cache=cache, positions=last)[:, -1].argmax(-1)  # (B,)
            out.append(nxt)
    return torch.stack(out, 1)


@pytest.mark.parametrize("name", ["llama", "mistral-window", "qwen2"])
def test_from_hf_decodes_with_attnkit_caches_like_hf_generate(name):
    hf_model = _hf(name)
    hf_model.generation_config.eos_token_id = None  # run to max_new_tokens
    model = from_hf(hf_model)
    ids, am, _ = _left_padded(7)
    want = hf_model.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, 7:]
    caches = [StaticCache(2, max_len=15)]
    if name == "mistral-window":  # 15 positions through a window of 4
        caches.append(SlidingWindowCache(2, window=4))
    for cache in caches:
        got = _greedy(model, ids, am, 8, cache)
        assert torch.equal(got, want), f"{name}, {type(cache).__name__}:\n{got}\n{want}"


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "mistral-window",
        "qwen2",
        "qwen2-mixed-layers",
        "gemma2",
        "llama-yarn",
        "llama-longrope",
        "qwen2-dynamic",
    ],
)
def test_from_hf_serves_attnkit_generate_and_engine_like_hf(name):
    hf_model = _hf(name)
    hf_model.generation_config.eos_token_id = None  # run to max_new_tokens
    model = from_hf(hf_model)
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 12, 13], [30, 31, 32, 33, 34]]
    want = [
        hf_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist() for p in prompts
    ]
    caches = ["static", "paged"] + (["sliding"] if name == "mistral-window" else [])
    for cache in caches:
        assert attnkit.generate(model, prompts, 8, cache=cache) == want, f"{name}, cache={cache}"
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    assert engine.generate(prompts, 8) == want, f"{name}, Engine"


@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
def test_from_hf_gradients_match(name):
    hf_model = _hf(name).train()
    model = from_hf(hf_model)
    assert model.training
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(3))
    hf_model(ids, labels=ids).loss.backward()
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
    g_ours = model.layers[1].attn.qkv_proj.weight.grad
    a = hf_model.model.layers[1].self_attn
    g_hf = torch.cat([a.q_proj.weight.grad, a.k_proj.weight.grad, a.v_proj.weight.grad], 0)
    assert (g_ours - g_hf).abs().max() <= TOL * max(1.0, g_hf.abs().max().item())


def test_gemma2_bfloat16_round_trip_is_bit_exact_and_logits_match():
    """Gemma's norms multiply by 1 + w: attnkit keeps w as stored (norm_offset=1.0) and computes 1 + w in
    float32 as HF does, so bfloat16 weights survive the round trip and the logits are HF's own."""
    hf_model = _hf("gemma2").to(torch.bfloat16)
    model = from_hf(hf_model)
    assert model.config.norm_offset == 1.0
    back = to_hf(model).state_dict()
    assert all(torch.equal(v, back[k]) for k, v in hf_model.state_dict().items())
    ids = torch.randint(3, V, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_bf16, ours = hf_model(ids).logits.float(), model(ids).float()
        truth = hf_model.float()(ids).logits  # the same (bfloat16-valued) weights computed in float32
    # the numerical rule: within twice HF's own bfloat16 error (it was ~50x off in float32 when the
    # conversion stored 1 + w in bfloat16)
    assert (ours - truth).abs().max() <= 2 * (hf_bf16 - truth).abs().max()
    assert (model.float()(ids) - truth).abs().max() <= 1e-3


def test_from_hf_keeps_dtype():
    hf_model = _hf("llama").to(torch.float64)
    model = from_hf(hf_model)
    assert model.embed.weight.dtype == torch.float64
    ids = torch.randint(3, V, (1, 9))
    with torch.no_grad():  # both compute RoPE angles and RMSNorm statistics in float32
        assert (model(ids) - hf_model(ids).logits).abs().max() <= 1e-6


_ATTNKIT = {
    "llama-like": dict(),
    "llama-biases": dict(
        qkv_bias=True,
        out_bias=True,
        ffn_bias=True,
        tie_embeddings=False,
        rope_scaling={"type": "linear", "factor": 2.0},
    ),
    "mistral-like": dict(mask=masks.sliding_window(3)),
    "qwen2-like": dict(qkv_bias=True, rope_theta=1e6),
    "llama-yarn": dict(
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 8, "mscale": 0.8, "mscale_all_dim": 0.5}
    ),
    "llama-longrope": dict(
        rope_scaling={
            "type": "longrope",
            "factor": 4.0,
            "original_max_seq_len": 8,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
            "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5],
        }
    ),
    "llama-dynamic": dict(rope_scaling={"type": "dynamic", "factor": 8.0, "original_max_seq_len": 8}),
    "qwen2-window": dict(qkv_bias=True, mask=masks.causal() & masks.sliding_window(5)),
    "qwen2-mixed": dict(
        qkv_bias=True,
        n_layers=3,
        attention_dropout=0.125,
        layer_masks=(None, masks.sliding_window(3), masks.sliding_window(3)),
    ),
    "qwen2-mixed-with-mask": dict(
        qkv_bias=True,
        n_layers=3,
        mask=masks.causal(),
        layer_masks=(masks.sliding_window(2), masks.causal(), masks.sliding_window(6) & masks.sliding_window(2)),
    ),
    "gemma2-like": dict(
        ffn="geglu",
        post_norms=True,
        embed_scale=8.0,
        softcap=2.0,
        logit_softcap=4.0,
        attn_scale=0.2,
        n_layers=3,
        layer_masks=(masks.sliding_window(3), None, masks.sliding_window(3)),
        attention_dropout=0.1,
        norm_offset=1.0,
    ),
    "gemma2-biases-global": dict(
        ffn="geglu",
        post_norms=True,
        embed_scale=8.0,
        qkv_bias=True,
        out_bias=True,
        tie_embeddings=False,
        norm_offset=1.0,
    ),
    "qwen3-like": dict(qk_norm=True, qkv_bias=True, out_bias=True, layer_masks=(masks.sliding_window(3), None)),
    "olmo2-like": dict(qk_norm="all", pre_norms=False, post_norms=True),
    "smollm3-like": dict(rope_layers=(False, True), ffn_bias=True),
    "granite-like": dict(embed_scale=2.0, attn_scale=0.3, residual_scale=0.5, logit_divisor=3.0),
    "gemma3-like": dict(
        ffn="geglu",
        post_norms=True,
        embed_scale=8.0,
        qk_norm=True,
        norm_offset=1.0,
        layer_masks=(masks.sliding_window(3), None),
        rope_local_theta=100.0,
    ),
    # norms without Gemma's offset: converted through w - 1 (logits match; the round trip has offset 1.0)
    "gemma2-no-offset": dict(ffn="geglu", post_norms=True, embed_scale=8.0, softcap=2.0),
}
_FAMILY = {
    "llama-like": "Llama",
    "llama-biases": "Llama",
    "llama-yarn": "Llama",
    "llama-longrope": "Llama",
    "llama-dynamic": "Llama",
    "mistral-like": "Mistral",
    "qwen2-like": "Qwen2",
    "qwen2-window": "Qwen2",
    "qwen2-mixed": "Qwen2",
    "qwen2-mixed-with-mask": "Qwen2",
    "qwen3-like": "Qwen3",
    "olmo2-like": "Olmo2",
    "smollm3-like": "SmolLM3",
    "granite-like": "Granite",
    "gemma3-like": "Gemma3",
    "gemma2-like": "Gemma2",
    "gemma2-biases-global": "Gemma2",
    "gemma2-no-offset": "Gemma2",
}


@pytest.mark.parametrize("name", sorted(_ATTNKIT))
def test_to_hf_logits_match_and_round_trip(name):
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", n_kv_heads=2, d_ff=96, max_seq_len=64, **_ATTNKIT[name])).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            if n.endswith("norm.weight"):  # (Gemma 2 stores them as w - 1: norm_offset=1.0)
                p.normal_(1.0 - model.config.norm_offset, 0.1)
    hf_model = to_hf(model)
    assert type(hf_model).__name__ == f"{_FAMILY[name]}ForCausalLM" and not hf_model.training
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = (hf_model(ids).logits - model(ids)).abs().max().item()
    assert err <= TOL, f"{name}: max |HF logits - attnkit| = {err:.2e}"
    back = from_hf(hf_model)
    a, b = model.state_dict(), back.state_dict()
    if back.config.norm_offset == model.config.norm_offset:
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    else:  # the norms' weights moved by the offset; the function is the same
        assert back.config.norm_offset == 1.0 and a.keys() == b.keys()
        with torch.no_grad():
            assert (back(ids) - model(ids)).abs().max().item() <= TOL
    cfg = model.config
    assert hf_model.config.attention_dropout == back.config.attention_dropout == cfg.attention_dropout
    for i in range(cfg.n_layers):  # each layer keeps what it may see (the same keys for every query)
        want, got = [masks.causal() & (c.layer_mask(i) or masks.causal()) for c in (cfg, back.config)]
        assert torch.equal(want.to_dense(13, 13), got.to_dense(13, 13)), i


def test_to_hf_with_attnkit_attention():
    from attnkit.integrations import hf

    name = hf.register()
    model = DecoderLM(DecoderConfig.preset("tiny", n_kv_heads=1, mask=masks.sliding_window(2))).eval()
    hf_model = to_hf(model, attn_implementation=name)
    assert hf_model.config._attn_implementation == name
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert (hf_model(ids).logits - model(ids)).abs().max() <= TOL


def test_conversion_errors_name_the_problem():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        from_hf(gpt2)
    with pytest.raises(ValueError, match="ForCausalLM"):
        from_hf(transformers.LlamaModel(HF_CONFIGS["llama"]()))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        from_hf(torch.nn.Linear(2, 2))
    proportional = transformers.LlamaConfig(**_COMMON)
    proportional.rope_parameters = {"rope_type": "proportional", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type='proportional'"):
        from_hf(transformers.LlamaForCausalLM(proportional))
    chunked = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=4)
    )
    chunked.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer_types=\['full_attention', 'chunked_attention'\]: from_hf converts"):
        from_hf(chunked)
    two_windows = (masks.sliding_window(3), masks.sliding_window(5))
    for kw, match in [
        (dict(qkv_bias=True, layer_masks=two_windows), r"sliding windows differ \(left=\[3, 5\]"),
        (dict(layer_masks=(None, masks.sliding_window(3))), "mixed: the Llama-family model that mixes them is Qwen2"),
        (dict(layer_masks=(None, masks.prefix_lm(2))), r"config.layer_mask\(1\)=prefix_lm"),
    ]:
        with pytest.raises(ValueError, match=match):
            to_hf(DecoderLM(DecoderConfig.preset("tiny", **kw)))
    for field, value, match in [
        ("positions", "alibi", "config.positions='alibi'"),
        ("norm", "layer", "config.norm='layer'"),
        ("softcap", 5.0, "config.softcap=5.0"),
        ("mask", masks.prefix_lm(3), "only a causal sliding window"),
        ("out_bias", True, "no transformers Llama-family model"),
    ]:
        model = DecoderLM(DecoderConfig.preset("tiny", **{field: value}))
        with pytest.raises(ValueError, match=match):
            to_hf(model)
    gemma = dict(ffn="geglu", post_norms=True, embed_scale=8.0)
    for kw, match in [
        (dict(gemma, post_norms=False), "config.post_norms=False: transformers' Gemma 2 needs"),
        (dict(gemma, embed_scale=2.0), r"config.embed_scale=2.0: .* sqrt\(d_model\)=8.0"),
        (dict(gemma, ffn="swiglu"), "config.ffn='swiglu': transformers' Gemma 2 needs ffn='geglu'"),
        (dict(gemma, qkv_bias=True), "config.out_bias=False: transformers' Gemma 2 needs out_bias=True"),
        (
            dict(gemma, layer_masks=(masks.sliding_window(2), masks.sliding_window(4))),
            r"sliding windows differ \(left=\[2, 4\]",
        ),
        (dict(attn_scale=0.5, mask=masks.sliding_window(3)), "transformers' Granite has none"),
    ]:
        with pytest.raises(ValueError, match=match):
            to_hf(DecoderLM(DecoderConfig.preset("tiny", **kw)))
    gelu = transformers.Gemma2Config(**_COMMON, head_dim=16, hidden_activation="gelu")
    with pytest.raises(ValueError, match="hidden_activation='gelu': attnkit's GeGLU"):
        from_hf(transformers.Gemma2ForCausalLM(gelu))
    with pytest.raises(TypeError, match="DecoderLM"):
        to_hf(torch.nn.Linear(2, 2))
