"""Position encodings: RoPE (pairings, partial, offsets, scaling), ALiBi, T5 buckets, sinusoidal."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import bias as kbias
from attnkit import masks
from attnkit.nn import ALiBi, MultiHeadAttention, RotaryEmbedding, SinusoidalPositions, T5RelativeBias
from attnkit.testing import reference

D64 = torch.float64


def rope_complex(x, positions, dim, base, interleaved, pos_scale=1.0):
    """RoPE written as complex multiplication (float64), the definition in the RoFormer paper."""
    xr, rest = x[..., :dim].double(), x[..., dim:]
    theta = base ** (-torch.arange(0, dim, 2, dtype=D64) / dim)
    angle = positions.double()[..., None] / pos_scale * theta  # (..., L, dim/2)
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        z = torch.complex(xr[..., : dim // 2], xr[..., dim // 2 :])
    z = z * torch.polar(torch.ones_like(angle), angle)
    if interleaved:
        out = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        out = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([out, rest.double()], dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim", [8, 4])
def test_rope_is_a_rotation_of_pairs(interleaved, dim):
    rope = RotaryEmbedding(dim, base=100.0, interleaved=interleaved)
    x = torch.randn(2, 3, 7, 8, dtype=D64)
    pos = torch.arange(7) + 5
    expected = rope_complex(x, pos, dim, 100.0, interleaved)
    torch.testing.assert_close(rope.rotate(x, pos), expected, rtol=0, atol=1e-6)  # angles in float32
    if dim < 8:
        assert torch.equal(rope.rotate(x, pos)[..., dim:], x[..., dim:])  # partial rotary passes the rest


@given(st.integers(0, 50), st.integers(0, 50))
def test_rope_scores_depend_only_on_distance(shift, length_extra):
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 1, 1, 8, dtype=D64), torch.randn(1, 1, 1, 8, dtype=D64)
    d = length_extra % 7
    a = rope.rotate(q, torch.tensor([d])) @ rope.rotate(k, torch.tensor([0])).transpose(-1, -2)
    b = rope.rotate(q, torch.tensor([d + shift])) @ rope.rotate(k, torch.tensor([shift])).transpose(-1, -2)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_rope_batched_positions_and_offsets():
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 2, 4, 8)
    pos = torch.tensor([[0, 1, 2, 3], [7, 8, 9, 10]])
    out = rope.rotate(x, pos)
    torch.testing.assert_close(out[0], rope.rotate(x[:1], torch.arange(4))[0])
    torch.testing.assert_close(out[1], rope.rotate(x[1:], torch.arange(7, 11))[0])


def test_rope_linear_and_ntk_scaling():
    x = torch.randn(1, 1, 6, 8, dtype=D64)
    pos = torch.arange(6) * 3
    linear = RotaryEmbedding(8, scaling={"type": "linear", "factor": 4.0})
    torch.testing.assert_close(
        linear.rotate(x, pos), rope_complex(x, pos, 8, 10000.0, False, pos_scale=4.0), rtol=0, atol=1e-6
    )
    ntk = RotaryEmbedding(8, scaling={"rope_type": "ntk", "factor": 4.0})
    base = 10000.0 * 4.0 ** (8 / 6)
    torch.testing.assert_close(ntk.rotate(x, pos), rope_complex(x, pos, 8, base, False), rtol=0, atol=1e-6)
    llama3 = RotaryEmbedding(8, scaling={"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16})
    inv = RotaryEmbedding(8).inv_freq
    wavelen = 2 * math.pi / inv
    assert torch.equal(llama3.inv_freq[wavelen < 16 / 4], inv[wavelen < 16 / 4])  # high frequencies kept
    torch.testing.assert_close(llama3.inv_freq[wavelen > 16], inv[wavelen > 16] / 8)  # low ones scaled


def test_rope_errors():
    with pytest.raises(ValueError, match="must be even"):
        RotaryEmbedding(5)
    with pytest.raises(ValueError, match="beyond max_seq_len=4"):
        RotaryEmbedding(4, max_seq_len=4).rotate(torch.randn(1, 1, 5, 4), torch.arange(5))
    with pytest.raises(ValueError, match="scaling\\['factor'\\]"):
        RotaryEmbedding(4, scaling={"type": "linear"})
    with pytest.raises(ValueError, match="does not use"):
        RotaryEmbedding(4, scaling={"type": "linear", "factor": 2.0, "beta": 1})


def test_rope_inside_attention_rotates_queries_and_keys_at_positions():
    rope = RotaryEmbedding(4)
    m = MultiHeadAttention(8, 2, positions=rope, mask=masks.causal()).to(D64)
    x = torch.randn(2, 5, 8, dtype=D64)
    pos = torch.arange(5) + 11
    qkv = m.qkv_proj(x)
    q, k, v = (t.view(2, 5, 2, 4).transpose(1, 2) for t in qkv.split(8, -1))
    q, k = rope_complex(q, pos, 4, 10000.0, False), rope_complex(k, pos, 4, 10000.0, False)
    out, _ = reference(q, k, v, mask=masks.causal())
    expected = m.out_proj(out.transpose(1, 2).reshape(2, 5, 8))
    torch.testing.assert_close(m(x, positions=pos), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(m(x, positions=pos[None].expand(2, 5)), expected, rtol=0, atol=1e-6)


def _scores_bias(m, x, expected_bias):
    qkv = m.qkv_proj(x)
    B, L, _ = x.shape
    H, D = m.n_heads, m.d_head
    q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in qkv.split(H * D, -1))
    out, _ = reference(q, k, v, bias=expected_bias, mask=m.mask)
    return m.out_proj(out.transpose(1, 2).reshape(B, L, H * D))


def test_alibi_adds_minus_slope_times_distance():
    m = MultiHeadAttention(8, 4, positions=ALiBi(4), mask=masks.causal()).to(D64)
    x = torch.randn(2, 6, 8, dtype=D64)
    i = torch.arange(6)
    slopes = kbias.alibi_slopes(4).double()
    expected_bias = -slopes.view(1, 4, 1, 1) * (i.view(-1, 1) - i.view(1, -1)).abs().double()
    torch.testing.assert_close(m(x), _scores_bias(m, x, expected_bias), rtol=0, atol=1e-12)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_reads_the_learned_table_at_the_bucket(bidirectional, t5_bucket):
    t5 = T5RelativeBias(2, num_buckets=8, max_distance=20, bidirectional=bidirectional)
    mask = None if bidirectional else masks.causal()
    m = MultiHeadAttention(8, 2, positions=t5, mask=mask).to(D64)
    L = 30
    x = torch.randn(1, L, 8, dtype=D64)
    table = t5.table.detach()
    bucket = torch.tensor([[t5_bucket(j - p, bidirectional, 8, 20) for j in range(L)] for p in range(L)])
    expected_bias = table[:, bucket][None]  # (1, H, L, L)
    torch.testing.assert_close(m(x), _scores_bias(m, x, expected_bias), rtol=0, atol=1e-12)
    m(x).sum().backward()
    assert t5.table.grad is not None and bool((t5.table.grad != 0).any())  # the table learns


def test_sinusoidal_values_and_use_inside_attention():
    pe = SinusoidalPositions(6, base=100.0)
    pos = torch.arange(5)
    table = pe.encode(pos)
    for p in range(5):
        for i in range(3):
            angle = p / 100.0 ** (2 * i / 6)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    m = MultiHeadAttention(6, 2, positions=SinusoidalPositions(6)).to(D64)
    x = torch.randn(2, 5, 6, dtype=D64)
    w, b = m.qkv_proj.weight, m.qkv_proj.bias
    xp = x + SinusoidalPositions(6).encode(pos).double()
    q, k = (xp @ w[:6].T + b[:6]), (xp @ w[6:12].T + b[6:12])
    v = x @ w[12:].T + b[12:]  # values do not see the positions
    q, k, v = (t.view(2, 5, 2, 3).transpose(1, 2) for t in (q, k, v))
    out, _ = reference(q, k, v)
    torch.testing.assert_close(m(x), m.out_proj(out.transpose(1, 2).reshape(2, 5, 6)), rtol=0, atol=1e-6)


def test_position_errors():
    with pytest.raises(ValueError, match="SinusoidalPositions\\(dim=8\\) is added to inputs of width d_model=6"):
        MultiHeadAttention(6, 2, positions=SinusoidalPositions(8))
    with pytest.raises(ValueError, match="T5RelativeBias was built for n_heads=2"):
        MultiHeadAttention(8, 4, positions=T5RelativeBias(2))
    with pytest.raises(ValueError, match="slopes must have shape"):
        ALiBi(4, slopes=[1.0, 2.0])
    with pytest.raises(ValueError, match="beyond max_seq_len=3"):
        SinusoidalPositions(4, max_seq_len=3).encode(torch.arange(4))


def test_rope_scaling_in_hugging_face_form():
    """transformers stores type and rope_type side by side, with rope_theta: accepted; a rope_theta that
    differs from the base, or two different types, are clear errors."""
    hf = {"type": "linear", "factor": 2.0, "rope_theta": 10000.0, "rope_type": "linear"}
    a, b = RotaryEmbedding(8, scaling=hf), RotaryEmbedding(8, scaling={"type": "linear", "factor": 2.0})
    assert torch.equal(a.inv_freq, b.inv_freq) and a.scaling == b.scaling
    with pytest.raises(ValueError, match=r"rope_theta'\]=500000.0 differs from the rotary base 10000.0"):
        RotaryEmbedding(8, scaling={**hf, "rope_theta": 500000.0})
    with pytest.raises(ValueError, match="type='linear' and rope_type='llama3'"):
        RotaryEmbedding(8, scaling={**hf, "rope_type": "llama3"})
    from attnkit.nn import DecoderConfig

    with pytest.raises(ValueError, match="differs from the rotary base"):  # at configuration time
        DecoderConfig.preset("tiny", rope_scaling={**hf, "rope_theta": 1.0})


# ------------------------------------------------------------------ rope scaling against transformers

_HF_ROPES = {
    "linear": dict(factor=2.5),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
    "yarn": dict(factor=4.0, original_max_position_embeddings=32),
    "yarn-deepseek": dict(
        factor=4.0, original_max_position_embeddings=32, mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2
    ),
    "yarn-untruncated-attention-factor": dict(
        factor=8.0, original_max_position_embeddings=16, truncate=False, attention_factor=1.5
    ),
    "longrope": dict(
        factor=4.0,
        original_max_position_embeddings=16,
        short_factor=[1.0 + 0.1 * i for i in range(8)],
        long_factor=[2.0 + 0.3 * i for i in range(8)],
    ),
    "dynamic": dict(factor=2.0),
}


def _hf_rope(name, max_pos=64):
    import transformers

    params = {"rope_type": name.split("-")[0], "rope_theta": 500.0, **_HF_ROPES[name]}
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=max_pos, rope_parameters=params
    )
    scaling = dict(params)
    if params["rope_type"] == "dynamic":  # HF's max_position_embeddings is the length it scales beyond
        scaling["original_max_position_embeddings"] = max_pos
    return cfg, RotaryEmbedding(16, base=500.0, scaling=scaling)


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(_HF_ROPES))
def test_rope_scaling_frequencies_and_attention_factor_equal_transformers(name):
    """inv_freq and attention factor equal transformers' rope init functions at every length (for longrope and
    dynamic NTK both sides of the original length)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg, rope = _hf_rope(name)
    init = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]]
    for n in (5, 16, 17, 64, 65, 130):
        inv, factor = init(cfg, "cpu", seq_len=n)
        torch.testing.assert_close(rope.inv_freq_for(n), inv, rtol=0, atol=0)
        assert rope.attention_factor == pytest.approx(factor, rel=1e-12), (n, factor)


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(_HF_ROPES))
def test_rope_scaling_rotations_equal_transformers_rotary_embedding(name):
    """cos/sin at positions (attention factor included) equal transformers' LlamaRotaryEmbedding, and the rotated
    queries equal its apply_rotary_pos_emb, for calls below and past the original length."""
    from transformers.models.llama import modeling_llama as ml

    cfg, rope = _hf_rope(name)
    hf = ml.LlamaRotaryEmbedding(cfg)
    x = torch.randn(2, 3, 1, 16)
    for length in (12, 40, 100):
        pos = torch.arange(length)[None]
        cos, sin = hf(x, pos)
        mine_cos, mine_sin = rope.cos_sin(pos[0])
        torch.testing.assert_close(mine_cos, cos[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine_sin, sin[0], rtol=1e-6, atol=1e-6)
        q = torch.randn(2, 3, length, 16)
        want, _ = ml.apply_rotary_pos_emb(q, q, cos, sin)
        torch.testing.assert_close(rope.rotate(q, pos[0]), want, rtol=1e-6, atol=1e-6)


def test_rope_scaling_errors_name_the_field():
    for scaling, match in [
        ({"type": "yarn", "factor": 2.0}, "needs scaling\\['original_max_seq_len'\\]"),
        (
            {"type": "longrope", "original_max_seq_len": 8, "short_factor": [1.0] * 4},
            "needs scaling\\['long_factor'\\]",
        ),
        (
            {"type": "longrope", "original_max_seq_len": 8, "short_factor": [1.0] * 4, "long_factor": [1.0] * 3},
            "short_factor has 4 entries and long_factor 3",
        ),
        (
            {
                "type": "longrope",
                "original_max_seq_len": 8,
                "short_factor": [1.0, -1.0, 1, 1],
                "long_factor": [1.0] * 4,
            },
            "short_factor'\\]\\[1\\]=-1.0",
        ),
        ({"type": "linear", "factor": 2.0, "attention_factor": 2.0}, "not used by 'linear' scaling"),
        ({"type": "dynamic", "factor": 2.0}, "original_max_seq_len"),
        ({"type": "yarn", "factor": 2.0, "original_max_seq_len": 8, "beta": 3}, "keys \\['beta'\\]"),
    ]:
        with pytest.raises((TypeError, ValueError), match=match):
            RotaryEmbedding(8, scaling=scaling)
    with pytest.raises(ValueError, match="longrope scaling has 2 short/long factors but RotaryEmbedding\\(dim=8\\)"):
        RotaryEmbedding(
            8,
            scaling={
                "type": "longrope",
                "original_max_seq_len": 8,
                "short_factor": [1.0, 1.0],
                "long_factor": [1.0, 2.0],
            },
        )


def test_longrope_switches_frequencies_per_call_at_the_original_length():
    rope = RotaryEmbedding(
        4,
        scaling={
            "type": "longrope",
            "original_max_seq_len": 8,
            "factor": 4.0,
            "short_factor": [1.0, 1.0],
            "long_factor": [3.0, 5.0],
        },
    )
    q = torch.randn(1, 1, 9, 4)
    short = rope.rotate(q[:, :, :8], torch.arange(8))
    long = rope.rotate(q, torch.arange(9))  # position 8: the call reaches 9 > 8 positions
    assert not torch.allclose(short, long[:, :, :8])
    plain = RotaryEmbedding(4).rotate(q[:, :, :8], torch.arange(8)) * rope.attention_factor
    torch.testing.assert_close(short, plain)  # short factors of 1: plain RoPE times the attention factor


def test_length_dependent_rope_refuses_a_position_bound_under_compile(monkeypatch):
    """A compiled forward with given positions sizes rope tables by max_seq_len, not the largest position: for
    LongRoPE and dynamic NTK that would pick the wrong frequencies, so it raises instead."""
    from attnkit.nn import DecoderConfig, DecoderLM

    scaling = {"type": "dynamic", "factor": 2.0, "original_max_seq_len": 16}
    model = DecoderLM(DecoderConfig.preset("tiny", max_seq_len=32, rope_scaling=scaling)).eval()
    assert model.positions.length_dependent and not RotaryEmbedding(8).length_dependent
    ids = torch.randint(0, 256, (1, 4))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="rope scaling 'dynamic' picks its frequencies from the largest position"):
        model(ids, positions=torch.arange(4))


_TYPED = {
    "linear": ("LinearScaling", dict(factor=2.5)),
    "ntk": ("NTKScaling", dict(factor=3.0)),
    "llama3": ("Llama3Scaling", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=16)),
    "yarn": ("YaRNScaling", dict(factor=4.0, original_max_seq_len=32, mscale=0.707, mscale_all_dim=1.0)),
    "longrope": (
        "LongRoPEScaling",
        dict(short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[2.0, 2.5, 3.0, 3.5], original_max_seq_len=16, factor=4.0),
    ),
    "dynamic": ("DynamicNTKScaling", dict(factor=2.0, original_max_seq_len=16)),
}


@pytest.mark.parametrize("kind", sorted(_TYPED))
def test_typed_rope_scaling_is_the_dict_form(kind):
    """Each typed scaling gives the frequencies and attention factor of its dict form, reads that form back
    (from_hf, Hugging Face's spelling included) and writes it (to_dict, to_hf)."""
    import attnkit.nn as nn_
    from attnkit.nn import DecoderConfig, RopeScaling

    name, fields = _TYPED[kind]
    typed = getattr(nn_, name)(**fields)
    a, b = (
        RotaryEmbedding(8, base=500.0, scaling=typed),
        RotaryEmbedding(8, base=500.0, scaling={"type": kind, **fields}),
    )
    assert a.scaling == b.scaling == typed and a.attention_factor == b.attention_factor == typed.attention_factor
    for n in (5, 16, 17, 40):
        assert torch.equal(a.inv_freq_for(n), b.inv_freq_for(n))
    assert RopeScaling.from_hf(typed.to_dict()) == typed == type(typed).from_hf(typed.to_hf())
    assert typed.to_hf()["rope_type"] == kind and a.length_dependent == (kind in ("longrope", "dynamic"))
    cfg = DecoderConfig.preset("tiny", rope_scaling=typed)
    assert cfg.rope_scaling == typed.to_dict() and DecoderConfig.from_dict(cfg.to_dict()) == cfg


def test_typed_rope_scaling_errors():
    from attnkit.nn import LinearScaling, Llama3Scaling, RopeScaling, YaRNScaling

    with pytest.raises(ValueError, match=r"scaling\['factor'\]=-1.0 must be a finite number > 0"):
        LinearScaling(-1.0)
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor, got 1.0 and 2.0"):
        Llama3Scaling(8.0, low_freq_factor=2.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="YaRNScaling.from_hf got a 'linear' scaling"):
        YaRNScaling.from_hf({"type": "linear", "factor": 2.0})
    with pytest.raises(TypeError, match="scaling must be None, a RopeScaling"):
        RotaryEmbedding(8, scaling=[("type", "linear")])
    assert RopeScaling.from_hf({"rope_type": "default", "rope_theta": 1.0}) is None
