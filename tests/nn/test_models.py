"""DecoderLM, EncoderDecoder and DecoderConfig: caches, ragged positions, presets, errors, conversions."""

from __future__ import annotations

import copy

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
        out.append(model(ids[:, start : start + n], cache=cache, **kw))
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
        rest = [model(ids[:, t : t + 1], cache=cache, positions=positions[:, t : t + 1]) for t in range(5, L)]
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
    with pytest.raises(ValueError, match="scaling type 'proportional'"):
        DecoderLM(DecoderConfig.preset("tiny", rope_scaling={"type": "proportional", "factor": 2.0}))
    with pytest.raises(ValueError, match="yarn scaling needs scaling\\['original_max_seq_len'\\]"):
        DecoderLM(DecoderConfig.preset("tiny", rope_scaling={"type": "yarn", "factor": 2.0}))
    for kw, match in [
        (dict(pre_norms=False), "pre_norms=False needs post_norms=True"),
        (dict(qk_norm="proj"), "qk_norm='proj' must be"),
        (dict(rope_layers=(True,)), "one bool per layer \\(2\\)"),
        (dict(rope_layers=(True, False), positions="alibi"), "rope_layers is for positions='rope'"),
        (dict(rope_local_theta=1e4), "it needs positions='rope' and layer_masks"),
        (dict(residual_scale=0.0), "residual_scale=0.0 must be"),
        (dict(logit_divisor=-1.0), "logit_divisor=-1.0 must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            DecoderConfig.preset("tiny", **kw)
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


def test_decode_layout_follows_the_batch_and_survives_load_state_dict_and_dtype_changes():
    model = DecoderLM(DecoderConfig.preset("tiny", tie_embeddings=True))
    w = model.layers[0].attn.qkv_proj.weight
    assert w.stride() == (w.shape[1], 1) and model.embed.weight.stride() == (64, 1)  # nn.Linear's layout
    ids = torch.randint(0, 256, (2, 7))
    ref = model(ids)
    assert to_decode_layout(model, batch_size=8) is model
    assert w.stride() == (1, w.shape[0]) and model.embed.weight is not None
    assert model.embed.weight.stride() == (1, 256)  # tied: the head streams the embedding
    assert model.layers[0].attn.qkv_proj.weight is w  # parameters keep their identity
    torch.testing.assert_close(model(ids), ref, rtol=1e-5, atol=1e-5)  # the same model, laid out otherwise
    other = DecoderLM(DecoderConfig.preset("tiny"))
    other.load_state_dict(model.state_dict())
    assert other.layers[0].attn.qkv_proj.weight.stride() == (w.shape[1], 1)  # load_state_dict keeps the layout
    untied = DecoderLM(DecoderConfig.preset("tiny", tie_embeddings=False))
    assert to_decode_layout(untied, 4).embed.weight.stride() == (64, 1)  # untied: lookups want rows
    assert untied.lm_head.weight.stride() == (1, 256)
    b16 = copy.deepcopy(model).to(torch.bfloat16)
    assert b16.layers[0].ffn.up_proj.weight.stride()[0] == 1  # .to keeps the layout
    assert to_decode_layout(b16, 1).layers[0].ffn.up_proj.weight.stride()[0] == 1  # bfloat16: column-major
    to_decode_layout(model, batch_size=3)
    assert w.stride() == (w.shape[1], 1) and model.embed.weight.stride() == (64, 1)
    with pytest.raises(ValueError, match="batch_size"):
        to_decode_layout(model, batch_size=0)


# ------------------------------------------------------------------ per-layer masks and attention dropout

MIXED = (masks.sliding_window(2), None, masks.sliding_window(4))  # sliding, full, sliding (Gemma 2-like)


def _mixed(**kw) -> DecoderLM:
    torch.manual_seed(0)
    cfg = DecoderConfig.preset("tiny", n_layers=3, n_kv_heads=2, layer_masks=MIXED, **kw)
    return DecoderLM(cfg).eval()


def test_layer_masks_config_validation():
    base = DecoderConfig.preset("tiny")  # 2 layers
    with pytest.raises(ValueError, match=r"layer_masks has 3 entries but n_layers=2: give exactly one"):
        base.replace(layer_masks=MIXED)
    with pytest.raises(ValueError, match=r"layer_masks has 2 entries but n_layers=3"):
        DecoderConfig.preset("tiny", n_layers=2, layer_masks=MIXED[:2]).replace(n_layers=3)
    with pytest.raises(TypeError, match=r"layer_masks must be a tuple .* got _SlidingWindow: .* use mask="):
        base.replace(layer_masks=masks.sliding_window(3))
    with pytest.raises(TypeError, match=r"layer_masks\[1\] must be None, an attnkit.masks.Mask"):
        base.replace(layer_masks=[None, "sliding"])
    with pytest.raises(ValueError, match=r"attention_dropout=1.5 must be a number in \[0, 1\)"):
        base.replace(attention_dropout=1.5)
    with pytest.raises(ValueError, match=r"i=2 must be an int in \[0, 2\) \(a layer index: the model has 2 layers\)"):
        base.layer_mask(2)
    with pytest.raises(ValueError, match="layer_masks is not supported by EncoderDecoder"):
        EncoderDecoder(base.replace(layer_masks=(None, None)))
    cfg = base.replace(layer_masks=[masks.sliding_window(3), torch.ones(4, 4, dtype=torch.bool)])
    assert isinstance(cfg.layer_masks, tuple) and all(isinstance(m, masks.Mask) for m in cfg.layer_masks)
    assert "layer_masks=(sliding_window(left=3" in repr(cfg) and "attention_dropout=0.0" in repr(cfg)
    both = base.replace(mask=masks.sliding_window(5), layer_masks=(masks.sliding_window(1), None))
    assert torch.equal(both.layer_mask(0).to_dense(8, 8), masks.sliding_window(1).to_dense(8, 8))
    assert both.layer_mask(1) is both.mask and base.layer_mask(0) is None


def test_decoder_lm_with_layer_masks_equals_a_hand_built_stack():
    from attnkit.nn import TransformerBlock

    model = _mixed().double()
    cfg = model.config
    blocks = [
        TransformerBlock.from_config(
            cfg.block_config(), positions=model.positions, mask=masks.causal() & m if m is not None else masks.causal()
        ).double()
        for m in MIXED
    ]
    for block, layer in zip(blocks, model.layers):
        block.load_state_dict(layer.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        x = model.embed(ids)  # (B, L, d_model)
        for block in blocks:
            x = block(x, positions=torch.arange(ids.shape[1]))
        want = model.norm(x) @ model.embed.weight.t()  # tied head
        got = model(ids)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        # not vacuous: each layer's own mask matters (all-causal, or the masks moved to other layers, differ)
        for other in [(None, None, None), (None, MIXED[0], MIXED[2]), (MIXED[2], None, MIXED[0])]:
            alt = DecoderLM(cfg.replace(layer_masks=other)).double().eval()
            alt.load_state_dict(model.state_dict())
            assert (alt(ids) - got).abs().max() > 1e-4, other


def test_layer_masks_decode_with_caches_like_full_recomputation():
    import attnkit
    from attnkit.cache import StaticCache

    model = _mixed(init_std=0.2)  # larger weights than the default: greedy tokens vary, so they test something
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids)
        cache = StaticCache.for_model(model, 2, 16)
        inc = torch.cat([model(ids[:, a:b], cache=cache) for a, b in [(0, 5), (5, 6), (6, 7), (7, 10), (10, 12)]], 1)
        exact = copy.deepcopy(model).double()(ids)  # the float64 oracle
    # DESIGN.md's rule: the cached steps (whose 1-3 row products use the kernel timed fastest on this machine)
    # are as close to float64 as the full pass is, within twice its error
    assert (inc.double() - exact).abs().max() <= 2 * (full.double() - exact).abs().max() + 1e-6
    prompts = [[5, 9, 14, 3, 22, 7, 40], [11, 12, 13]]  # ragged: left padding in the batch
    want = attnkit.generate(model, prompts, 9, cache=None)  # recomputes every position at every step
    causal_only = DecoderLM(model.config.replace(layer_masks=None)).eval()
    causal_only.load_state_dict(model.state_dict())
    assert attnkit.generate(causal_only, prompts, 9, cache=None) != want  # the windows matter in these 16 tokens
    for cache in ("static", "paged", "int8"):
        got = attnkit.generate(model, prompts, 9, cache=cache)
        if cache == "int8":  # quantized keys/values: most tokens agree, not all need to
            assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) >= 14
        else:
            assert got == want, cache


def test_sliding_window_cache_with_layer_masks():
    """The ring cache keeps the widest layer window: exact when every layer slides (config.mask and/or its own
    layer mask), refused with the full layers named when some layers attend to everything."""
    import attnkit
    from attnkit.cache import SlidingWindowCache

    model = _mixed(mask=masks.sliding_window(5), init_std=0.2)
    prompts = [[5, 9, 14, 3, 22, 7, 40, 8], [11, 12, 13]]
    assert SlidingWindowCache.for_model(model, 2).window == 6
    assert attnkit.generate(model, prompts, 8, cache="sliding") == attnkit.generate(model, prompts, 8, cache=None)
    with pytest.raises(ValueError, match=r"window is required: layers \[1\] of the model attend without"):
        SlidingWindowCache.for_model(_mixed(), 2)
    # every layer slides, with different windows: the ring keeps the widest, each layer applies its own
    torch.manual_seed(0)
    cfg = DecoderConfig.preset(
        "tiny",
        n_layers=3,
        n_kv_heads=2,
        init_std=0.2,
        layer_masks=(masks.sliding_window(2), masks.sliding_window(6), masks.sliding_window(4)),
    )
    windowed = DecoderLM(cfg).eval()
    assert SlidingWindowCache.for_model(windowed, 2).window == 7
    assert attnkit.generate(windowed, prompts, 8, cache="sliding") == attnkit.generate(windowed, prompts, 8, cache=None)


def test_attention_dropout_is_separate_from_residual_dropout():
    ids = torch.randint(0, 256, (2, 9))
    only_attn = DecoderLM(DecoderConfig.preset("tiny", attention_dropout=0.5))
    only_resid = DecoderLM(DecoderConfig.preset("tiny", dropout=0.5))
    for layer in only_attn.layers:
        assert layer.attn.dropout == 0.5 and isinstance(layer.dropout, torch.nn.Identity)
    for layer in only_resid.layers:
        assert layer.attn.dropout == 0.0 and isinstance(layer.dropout, torch.nn.Dropout)
    assert isinstance(only_attn.drop, torch.nn.Identity) and isinstance(only_resid.drop, torch.nn.Dropout)
    for model in (only_attn, only_resid):
        with torch.no_grad():
            assert (model.train()(ids) - model(ids)).abs().max() > 1e-3  # random in training
            assert torch.equal(model.eval()(ids), model(ids))  # off in eval


def test_gemma_style_fields_do_what_they_say():
    """attn_scale, embed_scale, logit_softcap, ffn='geglu' and post_norms, in float64 against their formulas."""
    import math

    from attnkit.nn import RMSNorm

    with pytest.raises(ValueError, match="post_norms=True needs norm_first=True"):
        DecoderConfig.preset("tiny", post_norms=True, norm_first=False)
    for name in ("attn_scale", "embed_scale", "logit_softcap"):
        with pytest.raises(ValueError, match=f"{name}=0 must be a finite number > 0"):
            DecoderConfig.preset("tiny", **{name: 0})
    with pytest.raises(ValueError, match="ffn='reglu' is not one of"):
        DecoderConfig.preset("tiny", ffn="reglu")
    ids = torch.randint(0, 256, (2, 7))
    torch.manual_seed(0)
    plain = DecoderLM(DecoderConfig.preset("tiny")).double().eval()

    def variant(**kw):
        m = DecoderLM(plain.config.replace(**kw)).double().eval()
        m.load_state_dict(plain.state_dict())
        return m

    with torch.no_grad():
        raw = plain(ids)
        torch.testing.assert_close(variant(logit_softcap=0.05)(ids), 0.05 * torch.tanh(raw / 0.05), rtol=0, atol=1e-12)
        torch.testing.assert_close(variant(attn_scale=16**-0.5)(ids), raw, rtol=0, atol=1e-12)  # d_head = 16
        assert (variant(attn_scale=0.5)(ids) - raw).abs().max() > 1e-6
        # embed_scale multiplies the token embeddings: equal to scaling the (untied) embedding table
        scaled = variant(embed_scale=3.0)
        x = scaled.embed(ids) * 3.0
        for layer in scaled.layers:
            x = layer(x, positions=torch.arange(7))
        torch.testing.assert_close(scaled(ids), scaled.norm(x) @ scaled.embed.weight.t(), rtol=0, atol=1e-12)
        # GeGLU and the sandwich norms of one block
        torch.manual_seed(1)
        gem = DecoderLM(DecoderConfig.preset("tiny", ffn="geglu", post_norms=True)).double().eval()
        block = gem.layers[0]
        assert isinstance(block.attn_post_norm, RMSNorm) and isinstance(block.ffn_post_norm, RMSNorm)
        for norm in (block.attn_post_norm, block.ffn_post_norm):
            norm.weight.normal_(1.0, 0.3)
        h = torch.randn(2, 7, 64, dtype=torch.float64)
        ffn = block.ffn
        gate, up = ffn.up_proj(h).split(ffn.d_ff, -1)
        gelu_tanh = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
        torch.testing.assert_close(ffn(h), ffn.down_proj(gelu_tanh * up), rtol=0, atol=1e-12)
        a = h + block.attn_post_norm(block.attn(block.attn_norm(h), positions=torch.arange(7)))
        want = a + block.ffn_post_norm(ffn(block.ffn_norm(a)))
        torch.testing.assert_close(block(h, positions=torch.arange(7)), want, rtol=0, atol=1e-12)


def test_token_ids_outside_the_vocabulary_are_clear_errors():
    model = DecoderLM(DecoderConfig.preset("tiny"))
    for bad in (300, -1):
        with pytest.raises(ValueError, match=f"ids holds token id {bad}, outside the vocabulary \\[0, 256\\)"):
            model(torch.tensor([[1, bad, 3]]))


def test_rms_norm_offset_is_gemmas_one_plus_weight():
    from attnkit.nn import RMSNorm

    x = torch.randn(3, 16, dtype=torch.bfloat16)
    norm = RMSNorm(16, offset=1.0)
    assert torch.equal(norm.weight, torch.zeros(16))  # the identity
    with torch.no_grad():
        norm.weight.normal_()
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(norm.to(torch.bfloat16)(x), (h * (1.0 + norm.weight.float())).to(torch.bfloat16))
    with pytest.raises(ValueError, match="norm_offset=1.0 applies to RMSNorm only"):
        DecoderConfig.preset("tiny", norm="layer", norm_offset=1.0)


def test_decoder_logits_at_runs_the_head_on_chosen_rows():
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny")).double().eval()
    ids = torch.randint(0, 256, (2, 7))
    rows = torch.tensor([1, 6])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, logits_at=rows), model(ids)[:, rows])
    with pytest.raises(TypeError, match="logits_at"):
        model(ids, logits_at=[1, 6])


def test_every_layer_is_built_from_the_one_block_config():
    cfg = DecoderConfig.preset(
        "tiny",
        n_layers=3,
        n_kv_heads=2,
        qkv_bias=True,
        attention_dropout=0.1,
        attn_scale=0.125,
        softcap=30.0,
        norm_offset=1.0,
        attention_sinks=True,
        qk_norm=True,
    )
    model = DecoderLM(cfg)
    block = model.layers[0].config
    assert all(layer.config is block and layer.attn.config is block.attention for layer in model.layers)
    assert block == cfg.block_config()
    attn = model.layers[2].attn
    assert (attn.n_kv_heads, attn.dropout, attn.softcap, attn.qkv_proj.bias is not None, attn.sinks.shape) == (
        2,
        0.1,
        30.0,
        True,
        (4,),
    )
    assert attn._scale() == pytest.approx(0.125)  # attn_scale as the attention's temperature
    assert attn.q_norm.offset == 1.0 and model.layers[0].attn_norm.offset == 1.0
    enc_dec = EncoderDecoder(cfg.replace(positions="t5", attention_sinks=False))
    assert enc_dec.decoder.layers[1].config.cross_attention and not enc_dec.encoder.layers[1].config.cross_attention
    assert enc_dec.decoder.layers[0].config.attention == enc_dec.encoder.layers[0].config.attention
