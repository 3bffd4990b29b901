"""TransformerBlock, Encoder, Decoder, FeedForward, RMSNorm, Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit import masks
from attnkit.nn import Decoder, Encoder, FeedForward, Linear, RMSNorm, TransformerBlock

D64 = torch.float64


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_block_composes_its_sublayers_in_the_stated_order(norm_first, norm):
    block = TransformerBlock(
        16, 4, norm_first=norm_first, norm=norm, ffn="swiglu", cross_attention=True, mask=masks.causal()
    ).to(D64)
    for p in block.parameters():  # non-trivial norms
        if p.dim() == 1:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    x, ctx = torch.randn(2, 5, 16, dtype=D64), torch.randn(2, 7, 16, dtype=D64)
    if norm_first:
        h = x + block.attn(block.attn_norm(x))
        h = h + block.cross_attn(block.cross_norm(h), ctx)
        expected = h + block.ffn(block.ffn_norm(h))
    else:
        h = block.attn_norm(x + block.attn(x))
        h = block.cross_norm(h + block.cross_attn(h, ctx))
        expected = block.ffn_norm(h + block.ffn(h))
    torch.testing.assert_close(block(x, ctx), expected, rtol=0, atol=1e-12)
    assert isinstance(block.attn_norm, torch.nn.LayerNorm if norm == "layer" else RMSNorm)


def test_feed_forward_written_out():
    x = torch.randn(2, 3, 8, dtype=D64)
    gelu = FeedForward(8, 12, "gelu").to(D64)
    torch.testing.assert_close(
        gelu(x),
        F.gelu(x @ gelu.up_proj.weight.T + gelu.up_proj.bias) @ gelu.down_proj.weight.T + gelu.down_proj.bias,
        rtol=0,
        atol=1e-12,
    )
    sw = FeedForward(8, 12, "swiglu", bias=False).to(D64)
    gate, up = sw.up_proj.weight[:12], sw.up_proj.weight[12:]
    torch.testing.assert_close(sw(x), (F.silu(x @ gate.T) * (x @ up.T)) @ sw.down_proj.weight.T, rtol=0, atol=1e-12)


def test_rms_norm_and_linear_match_their_definitions():
    x = torch.randn(4, 6, dtype=D64)
    n = RMSNorm(6, eps=1e-5).to(D64)
    torch.nn.init.uniform_(n.weight)
    torch.testing.assert_close(
        n(x), x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * n.weight, rtol=0, atol=1e-12
    )
    lin, ref = Linear(6, 3).to(D64), torch.nn.Linear(6, 3).to(D64)
    ref.load_state_dict(lin.state_dict())
    torch.testing.assert_close(lin(x), ref(x), rtol=0, atol=1e-12)
    assert lin.weight.stride() == (6, 1) and lin.weight.grad is None
    lin(x).sum().backward()
    assert lin.weight.grad.shape == (3, 6)


def test_rms_norm_float32_and_bfloat16_within_the_rule_of_float64():
    """float32 takes one fused call, bfloat16 computes in float32 and casts before the weight (as Llama);
    both within twice the textbook formula's own error in their dtype, gradients too."""
    g = torch.Generator().manual_seed(0)
    x64, w64 = torch.randn(3, 5, 64, generator=g, dtype=D64), torch.rand(64, generator=g, dtype=D64) + 0.5
    ref = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * w64
    for dtype in (torch.float32, torch.bfloat16):
        n = RMSNorm(64).to(dtype)
        with torch.no_grad():
            n.weight.copy_(w64)
        x = x64.to(dtype).requires_grad_()
        naive = x.detach() / torch.sqrt((x.detach() * x.detach()).mean(-1, keepdim=True) + 1e-6) * n.weight.detach()
        out = n(x)
        assert out.dtype is dtype
        assert (out.double() - ref).abs().max() <= 2 * (naive.double() - ref).abs().max() + 1e-6
        out.sum().backward()
        assert x.grad.shape == x.shape and n.weight.grad.shape == (64,)


def test_encoder_is_bidirectional_and_decoder_causal():
    torch.manual_seed(0)
    x = torch.randn(1, 6, 16)
    enc, dec = Encoder(16, 2, 4).eval(), Decoder(16, 2, 4).eval()
    changed = x.clone()
    changed[:, -1] += torch.randn(16)  # not a constant: LayerNorm would remove it
    assert (enc(changed)[:, 0] - enc(x)[:, 0]).abs().max() > 1e-4  # the first token sees the last
    torch.testing.assert_close(dec(changed)[:, :-1], dec(x)[:, :-1])  # the past never sees the future
    assert dec.norm is not None and Decoder(16, 1, 4, norm_first=False).norm is None


def test_decoder_mask_is_and_ed_with_causal():
    dec = Decoder(16, 1, 4, mask=masks.sliding_window(1)).eval()
    x = torch.randn(1, 6, 16)
    changed = x.clone()
    changed[:, 0] += torch.randn(16)
    torch.testing.assert_close(dec(changed)[:, 2:], dec(x)[:, 2:])  # one layer, window of 2: token 0 gone
    assert (dec(changed)[:, 1] - dec(x)[:, 1]).abs().max() > 1e-4


def test_block_errors():
    with pytest.raises(ValueError, match="cross_attention=True: pass context"):
        TransformerBlock(8, 2, cross_attention=True)(torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="no cross attention"):
        TransformerBlock(8, 2)(torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="norm='batch' is not one of"):
        TransformerBlock(8, 2, norm="batch")
    with pytest.raises(ValueError, match="ffn='relu' is not one of"):
        TransformerBlock(8, 2, ffn="relu")
    with pytest.raises(ValueError, match="context has width 3"):
        TransformerBlock(8, 2, cross_attention=True, context_dim=4)(torch.randn(1, 2, 8), torch.randn(1, 2, 3))
    with pytest.raises(ValueError, match="Encoder layers have no cross attention"):
        Encoder(8, 1, 2, cross_attention=True)


def test_a_block_built_from_its_config_is_the_block_the_keywords_build():
    from attnkit.nn import BlockConfig, RotaryEmbedding

    rope = RotaryEmbedding(8)
    kw = dict(
        n_kv_heads=2,
        norm="rms",
        ffn="geglu",
        post_norms=True,
        qkv_bias=False,
        ffn_bias=False,
        attention_dropout=0.1,
        qk_norm=True,
        norm_eps=1e-6,
        norm_offset=1.0,
        cross_attention=True,
        context_dim=12,
        residual_scale=0.5,
        sinks=True,
    )
    torch.manual_seed(0)
    ref = TransformerBlock(32, 4, positions=rope, mask=masks.causal(), **kw).double().eval()
    cfg = ref.config
    assert isinstance(cfg, BlockConfig) and ref.attn.config is cfg.attention
    assert (cfg.attention.dropout, cfg.attention.bias, cfg.attention.qk_norm_eps, cfg.attention.qk_norm_offset) == (
        0.1,
        False,
        1e-6,
        1.0,
    )
    assert ref.cross_attn.config == cfg.cross_attention_config() and ref.cross_attn.sinks is None
    torch.manual_seed(0)
    mine = TransformerBlock.from_config(cfg, positions=rope, mask=masks.causal()).double().eval()
    assert mine.config is cfg and repr(mine) == repr(ref)
    assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), ref.state_dict().values()))
    x, ctx = torch.randn(2, 6, 32, dtype=D64), torch.randn(2, 3, 12, dtype=D64)
    torch.testing.assert_close(mine(x, ctx), ref(x, ctx), rtol=0, atol=0)
    with pytest.raises(TypeError, match="from_config takes an attnkit.nn.BlockConfig"):
        TransformerBlock.from_config(cfg.attention)
    with pytest.raises(ValueError, match="post_norms=True needs norm_first=True"):
        TransformerBlock.from_config(cfg.replace(norm_first=False))
    with pytest.raises(ValueError, match="a TransformerBlock is batch-first"):
        TransformerBlock.from_config(cfg.replace(attention=cfg.attention.replace(batch_first=False)))


def test_the_config_is_the_way_in_and_the_flat_options_build_the_same_config():
    from attnkit.nn import AttentionConfig, BlockConfig, Decoder, MultiHeadAttention

    att = AttentionConfig(16, 4, n_kv_heads=2, qk_norm=True)
    torch.manual_seed(0)
    by_config = MultiHeadAttention(att, mask=masks.causal())
    torch.manual_seed(0)
    by_fields = MultiHeadAttention(16, 4, 2, qk_norm=True, mask=masks.causal())
    assert by_config.config is att and by_fields.config == att and repr(by_config) == repr(by_fields)
    assert all(torch.equal(a, b) for a, b in zip(by_config.state_dict().values(), by_fields.state_dict().values()))
    cfg = BlockConfig(att, norm="rms", ffn="swiglu", cross_attention=True)
    assert TransformerBlock(cfg).config is cfg
    dec = Decoder(cfg, 2)
    assert [layer.config for layer in dec.layers] == [cfg, cfg] and dec.cross_attention
    enc = Encoder(cfg.replace(cross_attention=False), 3)
    assert len(enc.layers) == 3 and enc.layers[0].attn.mask is None
    with pytest.raises(TypeError, match="got an AttentionConfig and the fields n_heads: pass one or the other"):
        MultiHeadAttention(att, n_heads=2)
    with pytest.raises(TypeError, match="got a BlockConfig and the options norm: pass one or the other"):
        TransformerBlock(cfg, norm="layer")
    with pytest.raises(TypeError, match="MultiHeadAttention takes an attnkit.nn.AttentionConfig, or its fields"):
        MultiHeadAttention(cfg)
    with pytest.raises(TypeError, match=r"TransformerBlock: unknown options \['heads'\]"):
        TransformerBlock(16, heads=4)
    with pytest.raises(TypeError, match="MultiHeadAttention: got an unexpected keyword argument 'heads'"):
        MultiHeadAttention(16, heads=4)
    with pytest.raises(TypeError, match="got n_heads by position and by keyword"):
        TransformerBlock(16, 4, n_heads=4)
    with pytest.raises(ValueError, match="Encoder layers have no cross attention"):
        Encoder(cfg, 1)
