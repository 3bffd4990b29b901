"""from_hf / to_hf for Qwen3, Gemma 3, Phi-3, OLMo 2, SmolLM3 and Granite: logits, greedy decoding and round trips
against transformers from small random configs; mixture-of-experts models are refused with the way to run them."""

import pytest
import torch

import attnkit
from attnkit import masks

import transformers
from attnkit.integrations.hf import from_hf, to_hf
from attnkit.nn import DecoderLM
from _models import MLA, V, deepseek_yarn, hf_kwargs

TOL = 1e-4
_COMMON = hf_kwargs(intermediate_size=96, num_hidden_layers=3, max_position_embeddings=64)
_PAIRS = 8  # rotated pairs of a 16-wide head
_MLA = {**MLA, "first_k_dense_replace": 3}

FAMILIES = {
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON),
    "qwen3-window-bias": lambda: transformers.Qwen3Config(
        **_COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1, attention_bias=True
    ),
    # sliding / global / sliding with the local layers' own rope base, the global one linearly scaled
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=8.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    # LongRoPE switching at 8 positions, inside the test sequences
    "phi3-longrope": lambda: transformers.Phi3Config(
        **_COMMON,
        original_max_position_embeddings=8,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0 + 0.1 * i for i in range(_PAIRS)],
            "long_factor": [2.0 + 0.5 * i for i in range(_PAIRS)],
        },
    ),
    "olmo2": lambda: transformers.Olmo2Config(**_COMMON),
    "smollm3": lambda: transformers.SmolLM3Config(**_COMMON, no_rope_layers=[1, 0, 1], attention_bias=True),
    # multi-head latent attention, every layer dense
    "deepseek-v3": lambda: transformers.DeepseekV3Config(**{**_COMMON, **_MLA}, q_lora_rank=24),
    "deepseek-v3-yarn-biases": lambda: transformers.DeepseekV3Config(
        **{**_COMMON, **_MLA},
        q_lora_rank=None,
        rope_interleave=False,
        attention_bias=True,
        rope_parameters=deepseek_yarn(),
    ),
    "granite": lambda: transformers.GraniteConfig(
        **_COMMON,
        embedding_multiplier=3.0,
        attention_multiplier=0.3,
        residual_multiplier=0.5,
        logits_scaling=4.0,
        mlp_bias=True,
    ),
}


def _hf(name: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[name](), attn_implementation="eager")
    with torch.no_grad():  # biases are zero and norms the identity at init: make them count
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            if "norm" in n:
                p.normal_(0.0 if name.startswith("gemma") else 1.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_from_hf_logits_match_and_to_hf_round_trips(name):
    hf_model = _hf(name)
    model = from_hf(hf_model)
    ids = torch.randint(3, V, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (model(ids) - hf_model(ids).logits).abs().max().item()
    assert err <= TOL, f"{name}: max |logits - HF| = {err:.2e}"
    g = torch.Generator().manual_seed(1)  # a left-padded batch: positions and key padding as HF's generate
    ids = torch.randint(3, V, (2, 12), generator=g)
    am = torch.ones_like(ids)
    am[0, :4] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, positions=pos, mask=masks.key_padding(am.bool()))
        if model.positions.length_dependent:  # attnkit: each row's own length; HF's batch takes its longest row
            ref = torch.stack(
                [
                    torch.nn.functional.pad(
                        hf_model(ids[b : b + 1, am[b].bool()]).logits[0], (0, 0, int((am[b] == 0).sum()), 0)
                    )
                    for b in range(len(ids))
                ]
            )
        else:
            ref = hf_model(ids, attention_mask=am, position_ids=pos).logits
    assert (out - ref)[am.bool()].abs().max() <= TOL
    back = to_hf(model, family="phi3" if name.startswith("phi3") else None)
    assert type(back) is type(hf_model)
    a, b = hf_model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert (back(ids).logits - model(ids)).abs().max() <= TOL


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_attnkit_generate_and_engine_equal_hf_generate(name):
    hf_model = _hf(name)
    hf_model.generation_config.eos_token_id = None  # run to max_new_tokens
    model = from_hf(hf_model)
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 12, 13]]
    want = [
        hf_model.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False)[0, len(p) :].tolist() for p in prompts
    ]
    for cache in ("static", "paged"):
        assert attnkit.generate(model, prompts, 7, cache=cache) == want, f"{name}, cache={cache}"
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    assert engine.generate(prompts, 7) == want, f"{name}, Engine"


def test_each_family_feature_changes_the_logits():
    """What the conversion carries matters: dropping any one of these changes the logits."""
    ids = torch.randint(3, V, (1, 14), generator=torch.Generator().manual_seed(5))
    changes = {
        "qwen3": [dict(qk_norm=False)],
        "olmo2": [dict(qk_norm=False)],
        "gemma3": [dict(rope_local_theta=None), dict(qk_norm=False)],
        "smollm3": [dict(rope_layers=None)],
        "granite": [dict(residual_scale=1.0), dict(logit_divisor=None), dict(embed_scale=None), dict(attn_scale=None)],
    }
    changes["deepseek-v3-yarn-biases"] = [dict(attn_scale=None), dict(rope_interleaved=True)]
    for name, alts in changes.items():
        model = from_hf(_hf(name))
        with torch.no_grad():
            for p in model.parameters():  # larger weights than the init's 0.02, so that every feature shows
                if p.dim() == 2:
                    p.normal_(0, 0.2)
            ref = model(ids)
            for change in alts:
                alt = DecoderLM(model.config.replace(**change)).eval()
                alt.load_state_dict(model.state_dict(), strict=False)
                assert (alt(ids) - ref).abs().max() > TOL, (name, change)  # beyond the parity tolerance
    cfg = from_hf(_hf("smollm3")).config
    assert cfg.rope_layers == (True, False, True)
    layers = from_hf(_hf("smollm3")).layers
    assert layers[1].attn.positions is None and layers[0].attn.positions is not None


def test_mixture_of_experts_models_are_refused_with_the_way_to_run_them():
    moe = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    )
    with pytest.raises(ValueError, match='mixture-of-experts.*attn_implementation="attnkit"'):
        from_hf(moe)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(**_COMMON, num_local_experts=2))
    with pytest.raises(ValueError, match="model_type='mixtral' has mixture-of-experts"):
        from_hf(mixtral)
    deepseek = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            **{**_COMMON, **_MLA, "first_k_dense_replace": 1},
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=16,
        )
    )
    with pytest.raises(ValueError, match="model_type='deepseek_v3' has mixture-of-experts.*attnkit"):
        from_hf(deepseek)


def test_deepseek_v3_converts_to_latent_attention_with_its_scale():
    from attnkit.nn import LatentAttention

    model = from_hf(_hf("deepseek-v3-yarn-biases"))
    cfg = model.config
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim, cfg.head_dim, cfg.v_head_dim) == (
        16,
        None,
        8,
        12,
        10,
    )
    assert all(isinstance(layer.attn, LatentAttention) for layer in model.layers)
    m = 0.1 * 0.9 * torch.log(torch.tensor(4.0)).item() + 1  # yarn's mscale_all_dim correction, squared
    assert cfg.attn_scale == pytest.approx(20**-0.5 * m * m)
    with pytest.raises(ValueError, match="config.attn_scale=0.5: transformers' DeepSeek-V3 scales scores by"):
        to_hf(DecoderLM(cfg.replace(attn_scale=0.5)))


def test_to_hf_family_errors_name_the_field():
    model = from_hf(_hf("qwen3"))
    with pytest.raises(ValueError, match="config.qk_norm=True: transformers' Phi-3 needs qk_norm=False"):
        to_hf(model, family="phi3")
    with pytest.raises(ValueError, match="family='bert' is not one of"):
        to_hf(model, family="bert")
    olmo = from_hf(_hf("olmo2"))
    with pytest.raises(ValueError, match="config.qk_norm='all': transformers' Qwen3 needs qk_norm=True"):
        to_hf(olmo, family="qwen3")
    windowed = DecoderLM(olmo.config.replace(mask=masks.sliding_window(3)))
    with pytest.raises(ValueError, match="sliding-window layers .* transformers' OLMo 2 has none"):
        to_hf(windowed)
