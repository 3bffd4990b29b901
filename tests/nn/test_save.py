"""DecoderLM.save_pretrained / from_pretrained (safetensors and a JSON config), masks and score modifiers equal
and serialised by value, DecoderConfig.to_dict / from_dict for every feature."""

import io
import json
import os

import pytest
import torch

from attnkit import bias, masks
from attnkit.nn import DecoderConfig, DecoderLM, IndexerConfig

SW = masks.sliding_window(3)
_LONGROPE = {
    "type": "longrope",
    "original_max_seq_len": 16,
    "factor": 4.0,
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
}
CONFIGS = {
    "llama": dict(),
    "rope-linear": dict(rope_scaling={"type": "linear", "factor": 2.0}),
    "rope-ntk": dict(rope_scaling={"type": "ntk", "factor": 2.0}),
    "rope-llama3": dict(rope_scaling={"type": "llama3", "factor": 8.0, "original_max_seq_len": 64}),
    "rope-yarn": dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 32}),
    "rope-longrope": dict(rope_scaling=_LONGROPE),
    "rope-dynamic": dict(rope_scaling={"type": "dynamic", "factor": 2.0, "original_max_seq_len": 16}),
    "partial-interleaved": dict(rotary_dim=8, rope_interleaved=True, rope_theta=500.0),
    "mistral": dict(mask=SW, n_kv_heads=2),
    "gemma-like": dict(
        n_layers=4,
        layer_masks=(SW, None) * 2,
        ffn="geglu",
        post_norms=True,
        norm_offset=1.0,
        softcap=30.0,
        logit_softcap=20.0,
        embed_scale=8.0,
        attn_scale=0.3,
        qk_norm=True,
        rope_local_theta=100.0,
    ),
    "mixed-masks": dict(layer_masks=(masks.causal() & masks.sliding_window(2), masks.block_local(4))),
    "sinks": dict(attention_sinks=True, mask=SW),
    "mla": dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12),
    "dsa": dict(
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=12,
        indexer=IndexerConfig(top_k=4, n_heads=2, head_dim=8),
    ),
    "moba": dict(sparse_attention={"method": "moba", "block": 4, "top_k": 2}),
    "nsa": dict(
        sparse_attention={
            "method": "nsa",
            "compress_block": 4,
            "compress_stride": 2,
            "select_block": 4,
            "select_count": 2,
            "window": 8,
        }
    ),
    "alibi": dict(positions="alibi", norm="layer", ffn="gelu", qkv_bias=True, out_bias=True, ffn_bias=True),
    "t5": dict(positions="t5", t5_num_buckets=16, t5_max_distance=64, tie_embeddings=False),
    "sinusoidal": dict(positions="sinusoidal", norm_first=False, norm="layer"),
    "olmo2": dict(qk_norm="all", pre_norms=False, post_norms=True),
    "smollm3-granite": dict(rope_layers=(True, False), residual_scale=0.5, logit_divisor=4.0, qkv_bias=True),
}


def _config(name):
    return DecoderConfig.preset("tiny", max_seq_len=64, init_std=0.1, **CONFIGS[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_round_trips_through_json(name):
    cfg = _config(name)
    text = json.dumps(cfg.to_dict())
    back = DecoderConfig.from_dict(json.loads(text))
    assert back == cfg and back.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_and_load_give_the_same_logits(name, tmp_path):
    torch.manual_seed(0)
    model = DecoderLM(_config(name)).eval()
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    state = torch.random.get_rng_state()
    loaded = DecoderLM.from_pretrained(tmp_path)
    assert torch.equal(torch.random.get_rng_state(), state)  # building it drew nothing of the caller's
    assert loaded.config == model.config and not loaded.training
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_keeps_the_dtype_and_refuses_unserialisable_masks(tmp_path):
    model = DecoderLM(DecoderConfig.preset("tiny")).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    loaded = DecoderLM.from_pretrained(tmp_path / "bf16")
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model.eval()(ids))
    fn = DecoderLM(DecoderConfig.preset("tiny", mask=masks.from_fn(lambda b, h, q, k: q - k < 3, align="bottom_right")))
    with pytest.raises(ValueError, match="config.mask: from_fn.*cannot be serialised"):
        fn.save_pretrained(tmp_path / "fn")
    assert not (tmp_path / "fn").exists()
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        DecoderLM.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown fields \\['d_models'\\]"):
        DecoderConfig.from_dict({**DecoderConfig.preset("tiny").to_dict(), "d_models": 3})


def test_state_dict_loads_with_weights_only():
    model = DecoderLM(DecoderConfig.preset("tiny", positions="t5"))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = DecoderLM(DecoderConfig.preset("tiny", positions="t5"))
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


BUILT_INS = [
    masks.causal(),
    masks.causal("top_left"),
    masks.sliding_window(3),
    masks.sliding_window(None, 2),
    masks.prefix_lm(3),
    masks.block_local(4),
    masks.strided(2),
    masks.fixed(4, 1),
    masks.dilated(3, 2),
    masks.random_blocks(4, 2, seed=1),
    ~masks.causal(),
    masks.causal() | masks.sliding_window(2),
    masks.causal() & masks.sliding_window(5) & ~masks.block_local(2),
]


@pytest.mark.parametrize("i", range(len(BUILT_INS)))
def test_masks_compare_hash_and_serialise_by_value(i):
    m = BUILT_INS[i]
    again = masks.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again == m and hash(again) == hash(m) and again is not m
    torch.testing.assert_close(again.to_dense(9, 11), m.to_dense(9, 11))
    assert all((other == m) == (j == i) for j, other in enumerate(BUILT_INS))
    assert len({m, again}) == 1


def test_masks_that_cannot_serialise_say_so():
    assert masks.sliding_window(3) == masks.sliding_window(3) and masks.sliding_window(3) != masks.sliding_window(4)
    lengths = masks.key_padding(torch.tensor([2, 3]))
    assert lengths == lengths and lengths != masks.key_padding(torch.tensor([2, 3]))  # tensors: identity
    for m in (masks.from_fn(lambda b, h, q, k: q >= k), lengths, masks.from_dense(torch.ones(3, 3, dtype=torch.bool))):
        with pytest.raises(ValueError, match="cannot be serialised"):
            m.to_dict()
    for bad in ({"mask": "__import__('os')"}, {"mask": "causal(align=print)"}, {"mask": "causal("}, {"x": 1}):
        with pytest.raises(ValueError, match="from_dict"):
            masks.from_dict(bad)


def test_score_modifiers_compare_and_serialise_by_value():
    mods = [
        bias.alibi(bias.alibi_slopes(4)),
        bias.alibi([0.5, 0.25], align="top_left"),
        bias.temperature(2.0),
        bias.temperature(torch.tensor([1.0, 2.0])),
        bias.relative_buckets(torch.randn(2, 8), bidirectional=False, max_distance=16),
        bias.compose(bias.temperature(0.5), bias.alibi([1.0, 0.5])),
    ]
    for i, m in enumerate(mods):
        again = bias.from_dict(json.loads(json.dumps(m.to_dict())))
        assert again == m and hash(again) == hash(m)
        assert all((o == m) == (j == i) for j, o in enumerate(mods))
        z = torch.zeros(1, dtype=torch.long)
        q, k = torch.arange(5).view(-1, 1), torch.arange(5).view(1, -1)
        heads = torch.arange(2).view(-1, 1, 1)
        torch.testing.assert_close(
            again.apply(torch.zeros(5, 5), z, heads, q, k, 5, 5), m.apply(torch.zeros(5, 5), z, heads, q, k, 5, 5)
        )
    assert bias.alibi([0.5, 0.25]) != bias.alibi([0.5, 0.3])
    fn = bias.from_fn(lambda s, b, h, q, k: s)
    assert fn == fn and fn != bias.from_fn(lambda s, b, h, q, k: s)
    with pytest.raises(ValueError, match="cannot be serialised"):
        bias.compose(bias.temperature(2.0), fn).to_dict()
    with pytest.raises(ValueError, match="type 'nope'"):
        bias.from_dict({"type": "nope"})
