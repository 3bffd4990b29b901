"""The tiny models and configs that many test files build: small transformers decoders (nothing is downloaded)
and small attnkit decoders, their weights drawn after a fixed ``torch.manual_seed`` so that each test sees the
same model every run.  Test files import them as ``from _models import ...`` (pyproject puts tests/ on the path)."""

import torch

from attnkit import masks
from attnkit.nn import DecoderConfig, DecoderLM, RotaryEmbedding

V = 96  # the vocabulary of the transformers configs of hf_kwargs


def hf_kwargs(**overrides) -> dict:
    """The keyword arguments of a tiny transformers decoder config: a 96-token vocabulary, 64 wide, two layers,
    four query heads over two key/value heads, tokens 0, 1 and 2 for padding, start and end; ``overrides``
    replace or add to them."""
    base = dict(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {**base, **overrides}


def left_padded(pads: list[int], length: int):
    """A batch of ``len(pads)`` random sequences of ``length`` ids from 3..V-1 (a generator seeded with 1), row b
    left-padded with ``pads[b]`` padding ids 0; and its attention mask (1 at real tokens)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (len(pads), length), generator=g)
    am = torch.ones_like(ids)
    for b, n in enumerate(pads):
        am[b, :n] = 0
    return ids.masked_fill(am == 0, 0), am


# the widths of the tiny latent-attention layers and DeepSeek configs: 16-wide latent keys and values, query/key
# heads of 8 rotated and 12 plain dims, 10-wide values (MLA: as transformers' config keywords, four KV heads)
LATENT_DIMS = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)
MLA = dict(num_key_value_heads=4, **LATENT_DIMS)


def deepseek_yarn() -> dict:
    """DeepSeek's YaRN rope parameters (with its attention-scale terms), switching at 8 positions: inside the test
    sequences.  A new dict each call: a config keeps the one it is given."""
    return {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "mscale": 0.7,
        "mscale_all_dim": 0.9,
    }


def hf_llama_family(name: str, **kwargs):
    """The transformers config of ``"llama"``, ``"mistral"`` (a 4-token sliding window) or ``"qwen2"`` over
    ``kwargs`` (the keyword arguments of :func:`hf_kwargs`, say)."""
    import transformers

    if name == "llama":
        return transformers.LlamaConfig(**kwargs)
    if name == "mistral":
        return transformers.MistralConfig(**kwargs, sliding_window=4)
    if name == "qwen2":
        return transformers.Qwen2Config(**kwargs)
    raise KeyError(name)


def hf_sink_model(model_type: str, attn_implementation: str = "eager", token_classification: bool = False):
    """A tiny transformers model with learned attention sinks (``s_aux`` / ``sinks``) in eval mode: ``model_type``
    as transformers names it, a causal LM or a token classifier, with two small experts where it has experts and
    a 4-token window where it has one; its weights drawn after ``torch.manual_seed(0)``, then its sink logits
    (which start at zero or small) redrawn with std 2, so that they matter.  Skips the test where this transformers
    has no such model."""
    import pytest
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    cfg = transformers.AutoConfig.for_model(
        model_type,
        **hf_kwargs(
            intermediate_size=64,
            head_dim=16,
            attention_dropout=0.0,
            num_local_experts=2,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            sliding_window=4,
            max_position_embeddings=128,
        ),
    )
    auto = transformers.AutoModelForTokenClassification if token_classification else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(cfg, attn_implementation=attn_implementation).eval()
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-1] == "sinks":
                p.copy_(torch.randn_like(p) * 2)
                n += 1
    assert n >= 1, f"{model_type}: no sink parameter found"
    return model


def tiny_llama(attn_implementation: str | None = "eager", seed: int = 0, **overrides):
    """A transformers Llama causal LM in eval mode: the layers and heads of :func:`hf_kwargs` at half the width,
    a 64-token vocabulary and no padding token (``overrides`` replace or add config fields), its weights drawn
    after ``torch.manual_seed(seed)``.  ``attn_implementation=None`` leaves transformers' default."""
    import transformers

    half = dict(vocab_size=64, hidden_size=32, intermediate_size=64, pad_token_id=None)  # Llama's bos 1, eos 2
    config = transformers.LlamaConfig(**hf_kwargs(**{**half, **overrides}))
    torch.manual_seed(seed)
    if attn_implementation is None:
        return transformers.LlamaForCausalLM(config).eval()
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def tiny_decoder(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> DecoderLM:
    """An attnkit DecoderLM in eval mode: a 64-token vocabulary, 32 wide, two layers, four query heads over two
    key/value heads, 64 positions (``overrides`` replace or add DecoderConfig fields), its weights drawn after
    ``torch.manual_seed(seed)`` and cast to ``dtype``."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    return DecoderLM(DecoderConfig(**{**cfg, **overrides})).to(dtype).eval()


def latent_layer(cls, q_lora_rank: int | None = 24, **kw):
    """A layer of latent attention ``cls`` (LatentAttention, DeepSeekSparseAttention; ``kw``: more of its
    arguments) in eval mode: 32 wide, four heads of the LATENT_DIMS widths, interleaved rope, causal; its weight
    matrices drawn with std 0.3 after ``torch.manual_seed(0)`` (large enough that the attention matters)."""
    torch.manual_seed(0)
    m = cls(
        32,
        4,
        **LATENT_DIMS,
        q_lora_rank=q_lora_rank,
        positions=RotaryEmbedding(8, interleaved=True),
        mask=masks.causal(),
        **kw,
    )
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return m.eval()


def latent_decoder(q_lora_rank: int | None = 24, v_head_dim: int = 10, **kw) -> DecoderLM:
    """A two-layer DecoderLM of the ``"tiny"`` preset with latent attention (16-wide latent, 12 + 8 rotated
    query/key dims a head, 64 positions; ``kw``: more config fields), its weights drawn after
    ``torch.manual_seed(0)``, in training mode."""
    torch.manual_seed(0)
    cfg = DecoderConfig.preset(
        "tiny",
        n_layers=2,
        d_head=12,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=v_head_dim,
        max_seq_len=64,
        **kw,
    )
    return DecoderLM(cfg)


def greedy_by_full_forward(model, prompt: list[int], n: int) -> list[int]:
    """The ``n`` greedy tokens after ``prompt``, every step a full forward over the whole sequence (no cache):
    the reference for cached decoding."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]
