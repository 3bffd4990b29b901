"""DecoderLM, EncoderDecoder and DecoderConfig: caches, ragged positions, presets, errors, conversions."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.nn import DecoderConfig, DecoderLM, EncoderDecoder, to_decode_layout

VARIANTS = {
    "rope": dict(positions="rope"),
    "rope-partial-interleaved": dict(positions="rope", rotary_dim=8, rope_interleaved=True),
    "alibi": dict(positions="alibi"),
    "t5": dict(positions="t5"),
    "sliding-window": dict(positions="rope", mask=masks.sliding_window(3)),
    "gqa": dict(positions="rope", n_kv_heads=2),
    "mqa-alibi": dict(positions="alibi", n_kv_heads=1),
    "sinusoidal": dict(positions="sinusoidal"),
    "post-ln-gelu": dict(norm_first=False, norm="layer", ffn="gelu", qkv_bias=True, out_bias=True, ffn_bias=True),
}


def incremental(model, ids, cache, chunks, **kw):
    out, start = [], 0
    for n in chunks:
        out.append(model(ids[:, start:start + n], cache=cache, **kw))
        start += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_token_by_token_decoding_equals_full_recomputation(concat_cache, name):
    cfg = DecoderConfig.preset("tiny", **VARIANTS[name])
    model = DecoderLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        full = model(ids)
        inc = incremental(model, ids, concat_cache(cfg.n_layers), [4, 1, 1, 1, 2, 1])
    torch.testing.assert_close(inc, full, rtol=0, atol=1e-5)


def test_ragged_batch_with_left_padding_and_explicit_positions(concat_cache):
    """Row 1 is left-padded by 3; its logits equal those of the unpadded sequence run alone."""
    cfg = DecoderConfig.preset("tiny", n_kv_heads=2)
    model = DecoderLM(cfg).eval()
    L, pad = 8, 3
    ids = torch.randint(0, cfg.vocab_size, (2, L))
    real = torch.ones(2, L, dtype=torch.bool)
    real[1, :pad] = False
    positions = (real.long().cumsum(1) - 1).clamp(min=0)  # (B, L): row 1 starts at position 0 after its padding

    def extra(kv_len):
        return real[:, None, None, :kv_len]

    with torch.no_grad():
        alone = model(ids[1:, pad:])
        cache = concat_cache(cfg.n_layers, extra_mask=extra)
        first = model(ids[:, :5], cache=cache, positions=positions[:, :5])
        rest = [model(ids[:, t:t + 1], cache=cache, positions=positions[:, t:t + 1]) for t in range(5, L)]
        logits = torch.cat([first, *rest], dim=1)
        no_cache = model(ids, positions=positions, mask=real[:, None, None, :])
    torch.testing.assert_close(logits[1, pad:], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(no_cache[1, pad:], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[0], model(ids[:1])[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("positions", ["rope", "t5", "alibi", "sinusoidal"])
def test_encoder_decoder_cross_attention_cache(concat_cache, positions):
    cfg = DecoderConfig.preset("tiny", positions=positions, n_kv_heads=2)
    model = EncoderDecoder(cfg, n_encoder_layers=1).eval()
    src = torch.randint(0, cfg.vocab_size, (2, 9))
    tgt = torch.randint(0, cfg.vocab_size, (2, 6))
    src_mask = masks.key_padding([9, 6])
    with torch.no_grad():
        full = model(src, tgt, src_mask=src_mask)
        memory = model.encode(src, src_mask=src_mask)
        cache = concat_cache(cfg.n_layers, cross=True)
        inc = incremental(_Decode(model, memory, src_mask), tgt, cache, [2, 1, 1, 1, 1])
    torch.testing.assert_close(inc, full, rtol=0, atol=1e-5)
    assert all(c.seq_len == 9 and c.calls == 5 for c in cache.cross_layers)  # filled once, then read


class _Decode:
    def __init__(self, model, memory, memory_mask):
        self.model, self.memory, self.memory_mask = model, memory, memory_mask

    def __call__(self, tgt, *, cache):
        return self.model.decode(tgt, self.memory, memory_mask=self.memory_mask, cache=cache)


def test_t5_encoder_is_bidirectional_and_decoder_causal():
    model = EncoderDecoder(DecoderConfig.preset("tiny", positions="t5"))
    assert model.encoder_positions.bidirectional and not model.decoder_positions.bidirectional
    assert model.encoder.layers[0].attn.positions is model.encoder.layers[1].attn.positions  # shared, as in T5


def test_presets_and_config_validation():
    cfg = DecoderConfig.preset("llama-like")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size) == (512, 8, 8, 1408, 32000)
    assert DecoderConfig.preset("small").d_model == 256
    assert DecoderConfig.preset("tiny", n_kv_heads=1).kv_heads == 1
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        DecoderConfig.preset("huge")
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        DecoderConfig(vocab_size=10, d_model=30, n_layers=1, n_heads=4)
    assert DecoderConfig(vocab_size=10, d_model=30, n_layers=1, n_heads=4, d_head=8).head_dim == 8
    with pytest.raises(ValueError, match="n_heads=4 and n_kv_heads=3"):
        DecoderConfig(vocab_size=10, d_model=32, n_layers=1, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="positions='learned' is not one of"):
        DecoderConfig.preset("tiny", positions="learned")
    with pytest.raises(ValueError, match="scaling type 'yarn'"):
        DecoderLM(DecoderConfig.preset("tiny", rope_scaling={"type": "yarn", "factor": 2.0}))
    with pytest.raises(TypeError, match="DecoderConfig"):
        DecoderLM({"vocab_size": 10})


def test_positions_beyond_max_seq_len_raise_unless_the_method_extrapolates(concat_cache):
    for positions in ("rope", "sinusoidal"):
        model = DecoderLM(DecoderConfig.preset("tiny", positions=positions, max_seq_len=8))
        with pytest.raises(ValueError, match="beyond max_seq_len=8"):
            model(torch.zeros(1, 9, dtype=torch.long))
        with pytest.raises(ValueError, match="beyond max_seq_len=8"):
            model(torch.zeros(1, 2, dtype=torch.long), positions=torch.tensor([7, 8]))
        cache = concat_cache(2)
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="beyond max_seq_len=8"):
            model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    for positions in ("alibi", "t5", "none"):
        model = DecoderLM(DecoderConfig.preset("tiny", positions=positions, max_seq_len=8))
        assert model(torch.zeros(1, 12, dtype=torch.long)).shape == (1, 12, 256)


def test_bad_model_inputs_raise_clear_errors(concat_cache):
    model = DecoderLM(DecoderConfig.preset("tiny"))
    with pytest.raises(ValueError, match=r"ids must have shape \(B, L\)"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="cache.layers has 3 per-layer caches for 2 layers"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=concat_cache(3))
    with pytest.raises(TypeError, match="cache must expose 'layers'"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=object())


def test_weights_are_column_major_and_survive_load_state_dict_and_dtype_changes():
    model = DecoderLM(DecoderConfig.preset("tiny", tie_embeddings=True))
    w = model.layers[0].attn.qkv_proj.weight
    assert w.stride() == (1, w.shape[0])
    assert model.embed.weight.stride() == (1, 256)  # tied: the head streams it
    other = DecoderLM(DecoderConfig.preset("tiny"))
    other.load_state_dict(model.state_dict())
    assert other.layers[0].attn.qkv_proj.weight.stride() == (1, w.shape[0])
    assert model.to(torch.bfloat16).layers[0].ffn.up_proj.weight.stride()[0] == 1
    with torch.no_grad():
        other.layers[0].attn.qkv_proj.weight.data = torch.randn(w.shape)
    assert to_decode_layout(other).layers[0].attn.qkv_proj.weight.stride() == (1, w.shape[0])
