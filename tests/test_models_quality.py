"""Model-level fixes: Gemma 3's unused score softcap, T5 configs leaving the global generator alone, a Mistral
without a window converting, sliding-window caches for latent attention."""

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.nn import DecoderConfig, DecoderLM

V = 96


def test_t5_config_and_positions_leave_the_global_generator_alone():
    """Building the config validates the bucket layout without drawing random numbers; other position methods
    never drew either."""
    for positions in ("t5", "rope", "alibi"):
        torch.manual_seed(123)
        before = torch.random.get_rng_state()
        cfg = DecoderConfig.preset("tiny", positions=positions)
        cfg.replace(n_layers=3)
        assert torch.equal(torch.random.get_rng_state(), before), positions
    with pytest.raises(ValueError, match="t5_num_buckets=2"):  # the layout is still checked
        DecoderConfig.preset("tiny", positions="t5", t5_num_buckets=2)


def test_mla_model_decodes_with_a_sliding_cache():
    """cache='sliding' on a latent-attention model with a window: the latent ring gives the static cache's tokens."""
    cfg = DecoderConfig.preset("tiny", kv_lora_rank=16, qk_rope_head_dim=8, mask=masks.sliding_window(3), init_std=0.2)
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    prompts = [[5, 60, 7, 80, 9, 10], [3, 4, 200]]
    assert attnkit.generate(model, prompts, 12, cache="sliding") == attnkit.generate(model, prompts, 12)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = attnkit.cache.SlidingWindowCache.for_model(model, 2)
    with torch.no_grad():
        full = model(ids)
        steps = torch.cat(
            [model(ids[:, :5], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(5, 12)], dim=1
        )
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=0)


import transformers  # noqa: E402  (the transformers half of this file starts here)
from attnkit.integrations.hf import from_hf, to_hf  # noqa: E402
from _models import hf_kwargs  # noqa: E402

_COMMON = hf_kwargs(intermediate_size=96, num_hidden_layers=3, max_position_embeddings=64)


def _random(model):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.hf
def test_gemma3_attn_logit_softcapping_is_not_applied_either_way():
    """transformers' Gemma 3 keeps attn_logit_softcapping in its config but never caps the scores: from_hf
    matches its logits with the field set (small cap, so a cap would show), to_hf round-trips, and a score
    softcap of attnkit's own has no Gemma 3 equivalent."""
    torch.manual_seed(0)
    hf_cfg = transformers.Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=16,
        initializer_range=0.3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=0.5,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    )
    hf = _random(transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager"))
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(1))
    model = from_hf(hf)
    assert model.config.softcap is None
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(model(ids), ref, atol=1e-4, rtol=0)
        back = to_hf(model)
        assert back.config.attn_logit_softcapping is None
        torch.testing.assert_close(back(ids).logits, ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="softcap"):
        to_hf(DecoderLM(model.config.replace(softcap=20.0)), family="gemma3_text")


@pytest.mark.hf
def test_to_hf_mistral_without_a_window():
    """family='mistral' with no window: transformers' MistralConfig(sliding_window=None), logits equal."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, init_std=0.1)).eval()
    hf = to_hf(model, family="mistral", attn_implementation="eager")
    assert type(hf).__name__ == "MistralForCausalLM" and hf.config.sliding_window is None
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)
    biased = DecoderLM(model.config.replace(qkv_bias=True, out_bias=True))
    with pytest.raises(ValueError, match="family='mistral'"):  # Mistral has no biases: still refused
        to_hf(biased, family="mistral")
