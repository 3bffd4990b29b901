"""Multi-head latent attention: the module against a float64 textbook version, decoding from the latent cache
equal to a full forward (static, paged, generate, the Engine), what the caches store, and bad configurations."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.cache import PagedCache, StaticCache
from attnkit.nn import DecoderConfig, DecoderLM, LatentAttention, RotaryEmbedding
from _models import LATENT_DIMS, greedy_by_full_forward, latent_decoder, latent_layer

D64 = torch.float64


def _mla(q_lora_rank=24, **kw):
    return latent_layer(LatentAttention, q_lora_rank, **kw)


def _textbook(m: LatentAttention, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's definition step by step: per-head keys [k_nope; k_rope] and values, causal softmax."""
    B, L, _ = x.shape
    H, dn, dr, dv, r = m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    q = m.q_proj(x) if m.q_lora_rank is None else m.q_b_proj(m.q_norm(m.q_a_proj(x)))
    q = q.view(B, L, H, dn + dr).transpose(1, 2)
    ckv = m.kv_a_proj(x)
    c, k_rope = m.kv_norm(ckv[..., :r]), ckv[..., r:]
    pos = torch.arange(L)
    q_rope = m.positions.rotate(q[..., dn:], pos)
    k_rope = m.positions.rotate(k_rope[:, None], pos).expand(B, H, L, dr)
    kv = m.kv_b_proj(c).view(B, L, H, dn + dv).transpose(1, 2)
    k = torch.cat([kv[..., :dn], k_rope], -1)
    qq = torch.cat([q[..., :dn], q_rope], -1)
    s = qq @ k.transpose(-1, -2) / math.sqrt(dn + dr)
    s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    out = s.softmax(-1) @ kv[..., dn:]
    return m.out_proj(out.transpose(1, 2).reshape(B, L, H * dv))


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_latent_attention_matches_the_textbook_definition(q_lora_rank):
    m = _mla(q_lora_rank)
    x = torch.randn(2, 9, 32)
    oracle = _textbook(m.to(D64), x.to(D64))
    naive = _textbook(m.float(), x)
    out = m(x)
    assert (out.double() - oracle).abs().max() <= 2 * (naive.double() - oracle).abs().max() + 1e-6


def test_decoding_from_the_latent_cache_equals_a_full_forward_and_builds_no_per_head_keys():
    m = _mla()
    x = torch.randn(2, 10, 32)
    full = m(x)
    calls = []
    m.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
    cache = StaticCache(1, max_len=12)
    outs = [m(x[:, :6], cache=cache.layers[0])]  # prompt: ordinary attention from its own latents
    assert len(calls) == 1
    for i in range(6, 10):  # decode: absorbed projections, kv_b_proj's weight read, its forward never run
        outs.append(m(x[:, i : i + 1], cache=cache.layers[0]))
    assert len(calls) == 1
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-5, atol=1e-5)
    # a chunk after the prompt attends absorbed too
    cache2 = StaticCache(1, max_len=12)
    chunked = torch.cat([m(x[:, :4], cache=cache2.layers[0]), m(x[:, 4:], cache=cache2.layers[0])], 1)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    # what is stored: the latent and the rotated rope key, nothing per head
    assert cache.layers[0].k.shape == (2, 1, 12, 16 + 8) and cache.layers[0].v.shape[-1] == 0
    assert cache.nbytes() == 2 * 12 * (16 + 8) * 4


def _mla_model(q_lora_rank=24, v_head_dim=10, **kw):
    model = latent_decoder(q_lora_rank, v_head_dim, rope_interleaved=True, **kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


def test_an_mla_decoder_generates_through_static_paged_caches_and_the_engine_as_a_full_forward():
    model = _mla_model()
    assert all(isinstance(layer.attn, LatentAttention) for layer in model.layers)
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 12, 13]]
    want = [greedy_by_full_forward(model, p, 8) for p in prompts]
    for cache in ("static", "paged"):
        assert attnkit.generate(model, prompts, 8, cache=cache) == want, cache
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    assert engine.generate(prompts, 8) == want


def test_a_quantized_mla_model_decodes_from_its_latent_cache_as_its_full_forward():
    model = attnkit.quantize(_mla_model(), "bfloat16")
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 12, 13]]
    assert attnkit.generate(model, prompts, 6, cache="paged") == [greedy_by_full_forward(model, p, 6) for p in prompts]
    # (widths that are multiples of 16: torch's int8 product crashes on 24 or 40 input features)
    model = attnkit.quantize(_mla_model(q_lora_rank=32, v_head_dim=16), "int8")
    x = torch.randint(0, 256, (1, 9))
    cache = StaticCache.for_model(model, 1, 9)
    with torch.no_grad():
        steps = torch.cat(
            [model(x[:, :5], cache=cache)] + [model(x[:, i : i + 1], cache=cache) for i in range(5, 9)], 1
        )
        full = model(x)
    # against the same (dequantized) weights in float64: decoding from latents is as close as the full forward
    oracle = DecoderLM(model.config).to(D64).eval()
    layers = dict(model.named_modules())
    with torch.no_grad():
        for name, lin in oracle.named_modules():
            if isinstance(lin, torch.nn.Linear):
                q = layers[name]
                lin.weight.copy_(q.dequantized() if hasattr(q, "dequantized") else q.weight)
        for name, p in oracle.named_parameters():
            if not name.endswith("proj.weight") and not name.startswith("lm_head"):
                p.copy_(dict(model.named_parameters())[name])
        truth = oracle(x)
    assert (full.double() - truth).abs().max() <= 0.05 * truth.abs().max()  # the oracle has the model's weights
    assert (steps.double() - truth).abs().max() <= 2 * (full.double() - truth).abs().max()


def test_mla_caches_store_the_latent_only():
    model = _mla_model()
    per_token = 2 * (16 + 8) * 4  # layers x (kv_lora_rank + qk_rope_head_dim) x float32 bytes
    assert StaticCache.for_model(model, 1, 10).nbytes() == 10 * per_token
    assert PagedCache.for_model(model, num_blocks=4, block_size=4).nbytes() == 16 * per_token
    plain = DecoderLM(DecoderConfig.preset("tiny", n_layers=2, d_head=12 + 8, max_seq_len=64))
    assert StaticCache.for_model(plain, 1, 10).nbytes() == 10 * 2 * 2 * 4 * 20 * 4  # k and v, 4 heads


def test_latent_attention_errors_name_the_field():
    for kw, match in [
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7 must be even"),
        (dict(positions=RotaryEmbedding(4)), r"must rotate qk_rope_head_dim=8 dims"),
        (dict(kv_lora_rank=0), "kv_lora_rank=0"),
    ]:
        args = {**LATENT_DIMS, **kw}
        with pytest.raises(ValueError, match=match):
            LatentAttention(32, 4, **args)
    with pytest.raises(TypeError, match="takes a RotaryEmbedding"):
        LatentAttention(32, 4, **LATENT_DIMS, positions=attnkit.nn.ALiBi(4))
    for kw, match in [
        (dict(kv_lora_rank=16), "needs qk_rope_head_dim"),
        (dict(q_lora_rank=8), "q_lora_rank=8 is a field of multi-head latent attention"),
        (dict(kv_lora_rank=16, qk_rope_head_dim=8, n_kv_heads=2), "n_kv_heads=2 is not available"),
        (dict(kv_lora_rank=16, qk_rope_head_dim=8, positions="alibi"), "positions='alibi' is not"),
    ]:
        with pytest.raises(ValueError, match=match):
            DecoderConfig.preset("tiny", **kw)
    with pytest.raises(ValueError, match="QuantizedCache does not store latent attention's caches"):
        attnkit.generate(_mla_model(), [[1, 2, 3]], 2, cache="int8")
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        _mla()(torch.randn(1, 3, 32, dtype=D64))


def test_latent_attention_takes_its_config_or_the_fields_that_make_one():
    from attnkit.nn import LatentConfig

    cfg = LatentConfig(32, 2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=16)
    torch.manual_seed(0)
    by_config = LatentAttention(cfg, mask=masks.causal())
    torch.manual_seed(0)
    by_fields = LatentAttention(
        32, 2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=16, mask=masks.causal()
    )
    assert by_config.config is cfg and by_fields.config == cfg and repr(by_config) == repr(by_fields)
    assert all(torch.equal(a, b) for a, b in zip(by_config.state_dict().values(), by_fields.state_dict().values()))
    with pytest.raises(TypeError, match="got a LatentConfig and the fields dropout: pass one or the other"):
        LatentAttention(cfg, dropout=0.1)
    with pytest.raises(TypeError, match="LatentAttention: missing 1 required positional argument: 'v_head_dim'"):
        LatentAttention(32, 2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8)
    with pytest.raises(ValueError, match="kv_lora_rank=0 must be >= 1"):
        LatentAttention(cfg.replace(kv_lora_rank=0))
