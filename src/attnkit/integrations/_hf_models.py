"""Converting Llama-family, Gemma and DeepSeek-V3 causal LMs between Hugging Face ``transformers`` and
:class:`attnkit.nn.DecoderLM`.

The Llama family shares one layout — RMSNorm Pre-LN blocks, grouped-query attention with rotate-half RoPE,
a SwiGLU MLP — and differs in biases and the sliding window:

* ``llama``: biases on q/k/v/o (``attention_bias``) and the MLP (``mlp_bias``) or none; no window;
* ``mistral``: no biases; ``sliding_window`` on every layer, or none;
* ``qwen2``: biases on q/k/v only; ``layer_types`` says which layers slide (all, none, or a mix);
* ``qwen3``: Qwen2's windows, biases on q/k/v/o or none, and an RMSNorm on every query and key head before
  RoPE (``qk_norm=True``);
* ``phi3``: no biases, ``qkv_proj`` and ``gate_up_proj`` already fused as attnkit's, LongRoPE (its original
  length read from the config);
* ``olmo2``: no norm before the sub-layers, one after each (``pre_norms=False, post_norms=True``), and q/k norms
  over all heads of a token at once (``qk_norm="all"``);
* ``smollm3``: ``no_rope_layers`` (0: a layer without positions) as ``rope_layers``;
* ``granite``: ``embedding_multiplier`` (``embed_scale``), ``attention_multiplier`` (``attn_scale``),
  ``residual_multiplier`` (``residual_scale``) and ``logits_scaling`` (``logit_divisor``).

HF's window ``w`` counts the query itself, so it becomes ``masks.sliding_window(w - 1)``: in
``DecoderConfig.mask`` when every layer slides, in ``DecoderConfig.layer_masks`` (``None`` for the
full-attention layers) when only some do.  HF's ``attention_dropout`` is ``DecoderConfig.attention_dropout``.

``gemma2`` adds to that layout: ``embed_scale=sqrt(hidden_size)``, a tanh-GELU gated MLP
(``ffn="geglu"``), a norm after each sub-layer as well as before (``post_norms``; HF's
``post_attention_layernorm`` is the attention's *output* norm there, ``pre_feedforward_layernorm`` the
MLP's input norm), ``attn_scale=query_pre_attn_scalar ** -0.5``, score and logit soft-caps, sliding and
global layers alternating through ``layer_types``, and RMSNorm weights stored as ``w - 1`` (HF multiplies
by ``1 + w`` in float32; attnkit's ``norm_offset=1.0`` does the same, so the weights copy bit for bit).

``gemma3_text`` is Gemma 2 plus q/k norms (stored as ``w - 1`` too) and a rope of its own for the sliding layers
(``rope_parameters["sliding_attention"]``, ``rope_local_theta``) and its final logit soft-cap; transformers' Gemma 3
keeps ``attn_logit_softcapping`` in its config but never caps the scores with it, so ``from_hf`` ignores it and
``to_hf`` refuses a score ``softcap``.

``deepseek_v3`` with every feed-forward dense (``first_k_dense_replace >= num_hidden_layers``) has multi-head
latent attention (:class:`attnkit.nn.LatentAttention`, ``DecoderConfig.kv_lora_rank``); its score scale
``(qk_nope_head_dim + qk_rope_head_dim)^-0.5`` gains YaRN's ``mscale_all_dim`` correction squared as
``attn_scale``.  ``deepseek_v32`` (DeepSeek-V3.2, every feed-forward dense as well) adds DSA's lightning
indexer (:class:`attnkit.nn.DeepSeekSparseAttention`, ``DecoderConfig.indexer``): its ``index_topk``,
``index_n_heads``, ``index_head_dim``, half-split rotary pairs, weights ``self_attn.indexer.*``.
Mixture-of-experts models (DeepSeek with experts, Mixtral, Qwen MoE, ...) are refused.

Weights map one to one except two fusions: attnkit's ``attn.qkv_proj`` stacks ``[q_proj; k_proj; v_proj]`` and
``ffn.up_proj`` stacks ``[gate_proj; up_proj]``.
"""

from __future__ import annotations

import torch

from .. import _checks
from .. import masks as _masks
from ._transformers import _transformers as load_transformers

Tensor = torch.Tensor

FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "qwen3", "gemma3_text", "phi3", "olmo2", "smollm3", "granite",
            "deepseek_v3", "deepseek_v32")
_DEEPSEEKS = ("deepseek_v3", "deepseek_v32")
_GEMMAS = ("gemma2", "gemma3_text")
_SLIDE_ALL = ("mistral", "phi3")  # sliding_window: every layer or none
_SLIDE_TYPED = ("qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text")  # layer_types say which layers slide
# model types whose feed-forward layers are mixtures of experts (configs with experts are caught as well)
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "granitemoehybrid",
        "phimoe", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "jetmoe", "gpt_oss", "llama4", "dots1",
        "ernie4_5_moe", "glm4_moe", "hunyuan_v1_moe", "minimax", "qwen3_next", "flex_olmo", "deepseek_v32",
        "glm_moe_dsa")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def _transformers():
    return load_transformers()[0]


# ---------------------------------------------------------------------------------- HF -> attnkit


def _rope(cfg, params: dict | None = None) -> tuple[float, dict | None, int]:
    """(theta, attnkit rope scaling, max_seq_len) from an HF config (``rope_parameters``, or the older fields).

    ``max_seq_len`` is HF's ``max_position_embeddings``, except for dynamic NTK, whose
    ``max_position_embeddings`` is the original length it scales beyond: there it is ``factor`` times that."""
    if params is None:
        params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    params = dict(params)
    theta = float(params.pop("rope_theta"))
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    max_len = cfg.max_position_embeddings
    if kind not in _ROPE_TYPES:
        raise ValueError(f"rope_type={kind!r} is not supported by attnkit.nn's RotaryEmbedding: convertible "
                         f"rope types are {_ROPE_TYPES}")
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by from_hf")
    if kind == "default":
        return theta, None, max_len
    if kind in ("yarn", "longrope"):
        old = params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
        if old is None:
            raise ValueError(f"rope_type={kind!r} needs original_max_position_embeddings in rope_parameters")
        params["original_max_position_embeddings"] = old
        if params.get("factor") is None:  # transformers' default: the ratio of the two lengths
            params["factor"] = max_len / old
    elif kind == "dynamic":
        params["original_max_position_embeddings"] = max_len
        max_len = int(max_len * float(params["factor"]))
    elif params.get("attention_factor") not in (None, 1.0):
        raise ValueError(f"rope attention_factor={params['attention_factor']} is not used by rope_type={kind!r}")
    return theta, {"type": kind, **{k: v for k, v in params.items() if v is not None}}, max_len


def _windows(cfg, family: str) -> list[int | None]:
    """Each layer's HF sliding window (keys a query sees, itself included), None for full attention."""
    n = cfg.num_hidden_layers
    if family not in _SLIDE_ALL + _SLIDE_TYPED:
        return [None] * n
    window = getattr(cfg, "sliding_window", None)
    if family in _SLIDE_ALL or window is None:
        return [window] * n
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"layer_types={types}: from_hf converts 'full_attention' and 'sliding_attention' layers, "
                         f"one per layer ({n})")
    return [window if t == "sliding_attention" else None for t in types]


def _layer_masks(windows: list[int | None], per_layer: bool = False) -> dict:
    """``mask`` (the same window on every layer) or ``layer_masks`` (windows that differ, or ``per_layer``) of
    DecoderConfig."""
    masks = [None if w is None else _masks.sliding_window(int(w) - 1) for w in windows]
    if len(set(windows)) == 1 and not (per_layer and windows[0] is not None):
        return dict(mask=masks[0], layer_masks=None)
    return dict(mask=None, layer_masks=tuple(masks))


def _family(model) -> str:
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    family = getattr(model.config, "model_type", None)
    _check_dense(model.config)
    if family not in FAMILIES:
        raise ValueError(f"from_hf converts these causal LMs {FAMILIES}, got model_type={family!r}: run "
                         f"other models in transformers with attn_implementation='attnkit' (register())")
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise ValueError(f"from_hf needs a causal LM with an output head ({family.capitalize()}ForCausalLM), got "
                         f"{type(model).__name__}")
    return family


def _check_dense(cfg) -> None:
    """ValueError for a config with mixture-of-experts feed-forward layers (attnkit.nn has none)."""
    family = getattr(cfg, "model_type", None)
    experts = max(int(getattr(cfg, name, 0) or 0) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    if family in _DEEPSEEKS and (experts == 0 or getattr(cfg, "first_k_dense_replace", 0) >= cfg.num_hidden_layers):
        return  # every layer's feed-forward is dense
    if family in _MOE or experts > 0:
        raise ValueError(f"model_type={family!r} has mixture-of-experts feed-forward layers, which attnkit.nn does "
                         f"not build, so from_hf cannot convert it: run it in transformers with "
                         f"attn_implementation=\"attnkit\" (after attnkit.integrations.hf.register()) to use "
                         f"attnkit's attention")


def _family_options(cfg, family: str) -> dict:
    """What a Llama-layout family adds: q/k norms, OLMo 2's output-only norms, NoPE layers, Granite's scales."""
    if family == "qwen3":
        return dict(qk_norm=True)
    if family == "olmo2":
        return dict(qk_norm="all", pre_norms=False, post_norms=True)
    if family == "smollm3":
        flags = tuple(bool(x) for x in cfg.no_rope_layers)  # 1: the layer uses RoPE
        return dict(rope_layers=None if all(flags) else flags)
    if family == "granite":
        d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        scale = float(cfg.attention_multiplier)
        return dict(embed_scale=None if cfg.embedding_multiplier == 1.0 else float(cfg.embedding_multiplier),
                    attn_scale=None if scale == d_head ** -0.5 else scale,
                    residual_scale=float(cfg.residual_multiplier),
                    logit_divisor=None if cfg.logits_scaling == 1.0 else float(cfg.logits_scaling))
    return {}


def decoder_config(hf_config, *, backend: str = "auto"):
    """The :class:`attnkit.nn.DecoderConfig` of a ``transformers`` config of one of ``FAMILIES``."""
    from ..nn import DecoderConfig

    cfg, family = hf_config, hf_config.model_type
    _check_dense(cfg)
    if family in _GEMMAS:
        return _gemma_config(cfg, backend)
    if family in _DEEPSEEKS:
        return _deepseek_config(cfg, backend)
    if family not in FAMILIES:
        raise ValueError(f"decoder_config converts configs of {FAMILIES}, got model_type={family!r}")
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act={cfg.hidden_act!r}: attnkit's SwiGLU uses silu")
    theta, scaling, max_len = _rope(cfg)
    heads = cfg.num_attention_heads
    biased = family not in ("mistral", "qwen2", "phi3") and bool(getattr(cfg, "attention_bias", False))
    return DecoderConfig(**_family_options(cfg, family),
        vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        d_head=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, d_ff=cfg.intermediate_size,
        max_seq_len=max_len, positions="rope", rope_theta=theta, rope_scaling=scaling,
        **_layer_masks(_windows(cfg, family)), norm="rms",
        norm_eps=cfg.rms_norm_eps, norm_first=True, ffn="swiglu", qkv_bias=biased or family == "qwen2",
        out_bias=biased, ffn_bias=bool(getattr(cfg, "mlp_bias", False)),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_std=getattr(cfg, "initializer_range", 0.02), backend=backend)


def _deepseek_scale(rope: dict, qk_head_dim: int) -> float:
    """DeepSeek's score scale: ``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` with a scaled rope."""
    from ..nn.rope_scaling import yarn_mscale

    scale = qk_head_dim ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    return scale


def _deepseek_config(cfg, backend: str):
    """DeepSeek-V3 with dense feed-forward layers only: multi-head latent attention (DecoderConfig.kv_lora_rank);
    DeepSeek-V3.2 adds its indexer (DecoderConfig.indexer)."""
    from ..nn import DecoderConfig, IndexerConfig

    indexer = None
    if cfg.model_type == "deepseek_v32":
        indexer = IndexerConfig(top_k=cfg.index_topk, n_heads=cfg.index_n_heads, head_dim=cfg.index_head_dim,
                                rope_interleaved=False)  # the indexer pairs (i, i + d/2); the attention (2i, 2i + 1)

    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act={cfg.hidden_act!r}: attnkit's SwiGLU uses silu")
    heads = cfg.num_attention_heads
    if (getattr(cfg, "num_key_value_heads", None) or heads) != heads:
        raise ValueError(f"num_key_value_heads={cfg.num_key_value_heads} != num_attention_heads={heads}: latent "
                         f"attention gives every head its own key and value")
    theta, scaling, max_len = _rope(cfg)
    params = dict(cfg.rope_parameters or {})
    if scaling is not None:  # the factor _rope filled in
        params["factor"] = scaling.get("factor", params.get("factor"))
    scale = _deepseek_scale(params, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    biased = bool(getattr(cfg, "attention_bias", False))
    return DecoderConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=heads,
        d_head=cfg.qk_nope_head_dim, d_ff=cfg.intermediate_size, kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        max_seq_len=max_len, positions="rope", rope_theta=theta, rope_scaling=scaling,
        rope_interleaved=bool(getattr(cfg, "rope_interleave", True)),
        attn_scale=None if scale == (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 else scale,
        norm="rms", norm_eps=cfg.rms_norm_eps, norm_first=True, ffn="swiglu", qkv_bias=biased, out_bias=biased,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_std=getattr(cfg, "initializer_range", 0.02), backend=backend, indexer=indexer)


def _gemma_config(cfg, backend: str):
    """Gemma 2, and Gemma 3 (q/k norms, the sliding layers' own rope base ``rope_parameters['sliding_attention']``)."""
    from ..nn import DecoderConfig

    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={act!r}: attnkit's GeGLU (ffn='geglu') uses gelu_pytorch_tanh")
    if getattr(cfg, "use_bidirectional_attention", None):
        raise ValueError("use_bidirectional_attention=True: from_hf converts causal Gemma models only")
    gemma3, extra = cfg.model_type == "gemma3_text", {}
    windows = _windows(cfg, cfg.model_type)
    if gemma3:
        params = cfg.rope_parameters
        if not isinstance(params, dict) or not {"full_attention", "sliding_attention"} <= set(params):
            raise ValueError(f"Gemma 3 rope_parameters={params!r}: from_hf reads one entry per layer type "
                             f"('full_attention' and 'sliding_attention'), as transformers >= 5 stores them")
        theta, scaling, max_len = _rope(cfg, params["full_attention"])
        local_theta, local_scaling, _ = _rope(cfg, params["sliding_attention"])
        if local_scaling is not None:
            raise ValueError(f"rope_parameters['sliding_attention']={params['sliding_attention']}: from_hf converts "
                             f"Gemma 3 sliding layers with the default rope type only")
        sliding = any(w is not None for w in windows)
        extra = dict(qk_norm=True, rope_local_theta=local_theta if sliding else None,
                     **_layer_masks(windows, per_layer=sliding))
    else:
        theta, scaling, max_len = _rope(cfg)
        extra = _layer_masks(windows)
    heads, biased = cfg.num_attention_heads, bool(getattr(cfg, "attention_bias", False))
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    scalar = cfg.query_pre_attn_scalar
    return DecoderConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, d_head=d_head, d_ff=cfg.intermediate_size,
        max_seq_len=max_len, positions="rope", rope_theta=theta, rope_scaling=scaling,
        **extra, norm="rms", norm_eps=cfg.rms_norm_eps, norm_offset=1.0,
        norm_first=True, post_norms=True, ffn="geglu", qkv_bias=biased, out_bias=biased, ffn_bias=False,
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it to the scores
        softcap=None if gemma3 else cfg.attn_logit_softcapping, logit_softcap=cfg.final_logit_softcapping,
        attn_scale=None if scalar == d_head else float(scalar) ** -0.5, embed_scale=cfg.hidden_size ** 0.5,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)), dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_std=getattr(cfg, "initializer_range", 0.02), backend=backend)


# HF norm name -> attnkit norm name, per family (Gemma 2's post_attention_layernorm is the attention's output norm)
_GEMMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "ffn_post_norm"}
_NORMS = {"gemma2": _GEMMA_NORMS, "gemma3_text": _GEMMA_NORMS,
          "olmo2": {"post_attention_layernorm": "attn_post_norm", "post_feedforward_layernorm": "ffn_post_norm"},
          None: {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}}
_QK_NORMS = {"q_norm": "q_norm", "k_norm": "k_norm"}  # self_attn.<name> -> attn.<name>
# DeepSeek's latent attention: self_attn.<HF name> -> attn.<attnkit name> (LatentAttention)
_MLA = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_a_layernorm": "q_norm", "q_b_proj": "q_b_proj",
        "kv_a_proj_with_mqa": "kv_a_proj", "kv_a_layernorm": "kv_norm", "kv_b_proj": "kv_b_proj", "o_proj": "out_proj"}
_INDEXER = ("wq_b", "wk", "k_norm", "weights_proj")  # self_attn.indexer.<name> -> attn.indexer.<name>


def _norm_shift(family: str, norm_offset: float) -> float:
    """attnkit's RMSNorm weight minus HF's: both multiply by ``offset + weight``, HF's offset is 1 for Gemma
    (``1 + weight``) and 0 otherwise.  0 for converted models (``norm_offset`` is HF's): weights copy as is."""
    return (1.0 if family in _GEMMAS else 0.0) - norm_offset


def _shifted(w: Tensor, shift: float) -> Tensor:
    return w if shift == 0 else (w.float() + shift).to(w.dtype)


def _to_attnkit_state(hf_state: dict, n_layers: int, tied: bool, family: str, norm_offset: float) -> dict:
    off = _norm_shift(family, norm_offset)
    s = {"embed.weight": hf_state["model.embed_tokens.weight"], "norm.weight": _shifted(hf_state["model.norm.weight"], off)}
    if not tied:
        s["lm_head.weight"] = hf_state["lm_head.weight"]
    for i in range(n_layers):
        h, a = f"model.layers.{i}.", f"layers.{i}."
        for hf_name, name in _NORMS.get(family, _NORMS[None]).items():
            s[f"{a}{name}.weight"] = _shifted(hf_state[f"{h}{hf_name}.weight"], off)
        for name in _QK_NORMS:
            if f"{h}self_attn.{name}.weight" in hf_state:
                s[f"{a}attn.{name}.weight"] = _shifted(hf_state[f"{h}self_attn.{name}.weight"], off)
        for kind in ("weight", "bias"):
            if family in _DEEPSEEKS:
                for hf_name, name in _MLA.items():
                    if f"{h}self_attn.{hf_name}.{kind}" in hf_state:
                        s[f"{a}attn.{name}.{kind}"] = hf_state[f"{h}self_attn.{hf_name}.{kind}"]
                for name in _INDEXER:  # DeepSeek-V3.2's lightning indexer: the same names
                    if f"{h}self_attn.indexer.{name}.{kind}" in hf_state:
                        s[f"{a}attn.indexer.{name}.{kind}"] = hf_state[f"{h}self_attn.indexer.{name}.{kind}"]
                s[f"{a}ffn.up_proj.weight"] = torch.cat([hf_state[h + "mlp.gate_proj.weight"],
                                                         hf_state[h + "mlp.up_proj.weight"]], 0)  # rows [gate; up]
                s[f"{a}ffn.down_proj.weight"] = hf_state[h + "mlp.down_proj.weight"]
                continue
            qkv = [hf_state.get(f"{h}self_attn.{p}_proj.{kind}") for p in "qkv"]
            if qkv[0] is not None:
                s[f"{a}attn.qkv_proj.{kind}"] = torch.cat(qkv, 0)  # rows [q; k; v]
            if f"{h}self_attn.qkv_proj.{kind}" in hf_state:  # Phi-3: already fused, rows [q; k; v]
                s[f"{a}attn.qkv_proj.{kind}"] = hf_state[f"{h}self_attn.qkv_proj.{kind}"]
            if f"{h}mlp.gate_up_proj.{kind}" in hf_state:  # Phi-3: rows [gate; up]
                s[f"{a}ffn.up_proj.{kind}"] = hf_state[f"{h}mlp.gate_up_proj.{kind}"]
                s[f"{a}ffn.down_proj.{kind}"] = hf_state[f"{h}mlp.down_proj.{kind}"]
            if h + f"self_attn.o_proj.{kind}" in hf_state:
                s[f"{a}attn.out_proj.{kind}"] = hf_state[h + f"self_attn.o_proj.{kind}"]
            if h + f"mlp.gate_proj.{kind}" in hf_state:
                gate_up = [hf_state[h + f"mlp.gate_proj.{kind}"], hf_state[h + f"mlp.up_proj.{kind}"]]
                s[f"{a}ffn.up_proj.{kind}"] = torch.cat(gate_up, 0)  # rows [gate; up]
                s[f"{a}ffn.down_proj.{kind}"] = hf_state[h + f"mlp.down_proj.{kind}"]
    return s


def _dtype_device(model) -> tuple[torch.dtype, torch.device]:
    p = next(model.parameters())
    return p.dtype, p.device


def from_hf(model, *, backend: str = "auto"):
    """Convert a ``transformers`` causal LM of ``FAMILIES`` (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3,
    Phi-3, OLMo 2, SmolLM3, Granite, DeepSeek-V3 and DeepSeek-V3.2 with dense feed-forward layers) into an
    :class:`attnkit.nn.DecoderLM`.

    The result computes the same logits (up to float rounding) on the same device and dtype, and is served
    by attnkit's caches, :func:`attnkit.generate` and the engine.  ``backend`` is the attnkit attention
    backend it uses.  Qwen2 and Gemma 2 models whose ``layer_types`` mix full and sliding-window layers get
    ``config.layer_masks``; HF's ``attention_dropout`` becomes ``config.attention_dropout`` (these models
    have no other dropout).  Rope types: default, linear, llama3, yarn, longrope, dynamic.  Raises
    ``ValueError`` for configurations attnkit cannot express (other rope types, other layer types, ...); for
    models with mixture-of-experts feed-forward layers the error names ``attn_implementation="attnkit"``, the
    way to run them in transformers with attnkit's attention.

    Left-padded batches: give ``positions`` (B, L) and ``mask=masks.key_padding(attention_mask.bool())``
    to the attnkit model, as HF derives ``position_ids`` from the attention mask in ``generate``.

    Example::

        >>> import torch, transformers
        >>> from attnkit.integrations.hf import from_hf
        >>> hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...     num_attention_heads=4, num_key_value_heads=2)).eval()
        >>> model = from_hf(hf_model)
        >>> ids = torch.randint(0, 64, (2, 7))
        >>> torch.allclose(model(ids), hf_model(ids).logits, atol=1e-5)
        True
    """
    from ..nn import DecoderLM

    family = _family(model)
    cfg = decoder_config(model.config, backend=backend)
    dtype, device = _dtype_device(model)
    out = DecoderLM(cfg).to(device=device, dtype=dtype)
    state = _to_attnkit_state(model.state_dict(), cfg.n_layers, cfg.tie_embeddings, family, cfg.norm_offset)
    out.load_state_dict(state, strict=True)
    return out.train(model.training)


# ---------------------------------------------------------------------------------- attnkit -> HF


def _sliding_left(mask, name: str = "config.mask") -> int | None:
    """``left`` of a (causal-compatible) sliding window mask, None for no mask; ValueError otherwise."""
    if mask is None:
        return None
    lefts = []
    for m in mask.conjuncts() if isinstance(mask, _masks.Mask) else (mask,):
        if isinstance(m, _masks.Mask) and m.is_causal("bottom_right"):
            continue
        band = m.form(1, 1) if isinstance(m, _masks.Mask) else None  # (one query at its own position)
        if isinstance(band, _masks.Band) and m.is_positional("bottom_right") and band.hi in (0, None):
            if band.lo is not None:
                lefts.append(-band.lo)
            continue
        raise ValueError(f"{name}={mask!r}: only a causal sliding window (masks.sliding_window(left)) has a "
                         f"transformers equivalent")
    return min(lefts) if lefts else None


def _layer_lefts(cfg) -> list[int | None]:
    """Each layer's sliding window ``left`` (None: full causal attention); ValueError for other masks."""
    names = ["config.mask" if cfg.layer_masks is None else f"config.layer_mask({i})" for i in range(cfg.n_layers)]
    return [_sliding_left(cfg.layer_mask(i), names[i]) for i in range(cfg.n_layers)]


def _hf_family(cfg, lefts: list[int | None]) -> str:
    biases = (cfg.qkv_bias, cfg.out_bias, cfg.ffn_bias)
    slides = {left for left in lefts if left is not None}
    if len(set(lefts)) > 1:  # layers differ: Qwen2's layer_types, with one window for all sliding layers
        if len(slides) > 1:
            raise ValueError(f"the layers' sliding windows differ (left={sorted(slides)}, per layer {lefts}): "
                             f"transformers' Qwen2 gives every sliding layer the same window; use one window")
        if biases != (True, False, False):
            raise ValueError(f"qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}, ffn_bias={cfg.ffn_bias} with "
                             f"full and sliding-window layers mixed: the Llama-family model that mixes them is "
                             f"Qwen2, which has biases on q/k/v only (qkv_bias=True, out_bias=ffn_bias=False)")
        return "qwen2"
    if not slides and cfg.qkv_bias == cfg.out_bias:
        return "llama"
    if biases == (False, False, False):
        return "mistral"
    if biases == (True, False, False):
        return "qwen2"
    raise ValueError(f"qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}, ffn_bias={cfg.ffn_bias}"
                     f"{' with a sliding window' if slides else ''}: no transformers Llama-family "
                     f"model has these biases (Llama: q/k/v/o alike; Mistral: none; Qwen2: q/k/v only)")


def _check_fields(cfg, checks: list, family: str) -> None:
    for name, value, want in checks:
        if value != want:
            raise ValueError(f"config.{name}={value!r}: transformers' {family} needs {name}={want!r}")
    if cfg.rotary_dim not in (None, cfg.head_dim):
        raise ValueError(f"config.rotary_dim={cfg.rotary_dim}: partial rotary has no {family} equivalent")


def _hf_rope(cfg) -> tuple[dict, int]:
    """HF ``rope_parameters`` and ``max_position_embeddings`` of a DecoderConfig (see :func:`_rope`)."""
    rope, max_len = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}, cfg.max_seq_len
    if cfg.rope_scaling is None:
        return rope, max_len
    from ..nn.rope_scaling import DynamicNTKScaling, RopeScaling

    s = RopeScaling.from_hf(cfg.rope_scaling)
    if s is None:
        return rope, max_len
    if s.type == "ntk":
        raise ValueError("rope scaling 'ntk' (static NTK) has no transformers equivalent (linear, llama3, yarn, "
                         "longrope and dynamic do)")
    rope.update(s.to_hf())
    if isinstance(s, DynamicNTKScaling):  # HF's max_position_embeddings is the length dynamic NTK scales beyond
        return {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}, s.original_max_seq_len
    return rope, max_len


def _gemma_hf_config(cfg, common: dict, lefts: list[int | None], family: str):
    transformers = _transformers()
    gemma3 = family == "gemma3_text"
    name = _NAMES[family]
    checks = [("positions", cfg.positions, "rope"), ("rope_interleaved", cfg.rope_interleaved, False),
              ("norm", cfg.norm, "rms"), ("norm_first", cfg.norm_first, True), ("ffn", cfg.ffn, "geglu"),
              ("post_norms", cfg.post_norms, True), ("pre_norms", cfg.pre_norms, True),
              ("qk_norm", cfg.qk_norm, gemma3), ("ffn_bias", cfg.ffn_bias, False), ("out_bias", cfg.out_bias, cfg.qkv_bias),
              ("rope_layers", cfg.rope_layers, None), ("residual_scale", cfg.residual_scale, 1.0),
              ("logit_divisor", cfg.logit_divisor, None)]
    if not gemma3:
        checks.append(("rope_local_theta", cfg.rope_local_theta, None))
    else:  # transformers' Gemma 3 reads attn_logit_softcapping but never caps the scores with it
        checks.append(("softcap", cfg.softcap, None))
    _check_fields(cfg, checks, name)
    if cfg.embed_scale is None or abs(cfg.embed_scale - cfg.d_model ** 0.5) > 1e-9 * cfg.d_model ** 0.5:
        raise ValueError(f"config.embed_scale={cfg.embed_scale!r}: transformers' {name} scales embeddings by "
                         f"sqrt(d_model)={cfg.d_model ** 0.5!r}")
    slides = sorted({x for x in lefts if x is not None})
    if len(slides) > 1:
        raise ValueError(f"the layers' sliding windows differ (left={slides}, per layer {lefts}): transformers' "
                         f"{name} gives every sliding layer the same window; use one window")
    if gemma3:
        if slides and cfg.rope_local_theta is None and cfg.rope_scaling is not None:
            raise ValueError("config.rope_local_theta=None with rope_scaling and sliding layers: transformers' Gemma 3 "
                             "gives its sliding layers an unscaled rope of their own; set rope_local_theta")
        local = {"rope_type": "default", "rope_theta": float(cfg.rope_local_theta or cfg.rope_theta)}
        common = {**common, "rope_parameters": {"full_attention": common["rope_parameters"],
                                                 "sliding_attention": local}}
    scalar = cfg.head_dim if cfg.attn_scale is None else cfg.attn_scale ** -2.0
    if abs(scalar - round(scalar)) < 1e-6 * scalar:
        scalar = int(round(scalar))
    common = {k: v for k, v in common.items() if k != "hidden_act"}
    return (transformers.Gemma3TextConfig if gemma3 else transformers.Gemma2Config)(
        **common, hidden_activation="gelu_pytorch_tanh", attention_bias=cfg.qkv_bias, query_pre_attn_scalar=scalar,
        # with no sliding layer the window is unused, but Gemma 2 builds its sliding mask anyway: one that hides nothing
        sliding_window=slides[0] + 1 if slides else cfg.max_seq_len,
        attn_logit_softcapping=None if gemma3 else cfg.softcap,
        final_logit_softcapping=cfg.logit_softcap,
        layer_types=["full_attention" if x is None else "sliding_attention" for x in lefts])


def _is_gemma_like(cfg) -> bool:
    """Whether ``cfg`` uses a feature only the Gemma models have among the convertible families."""
    return cfg.ffn == "geglu" or (cfg.post_norms and cfg.pre_norms) or cfg.logit_softcap is not None


def _infer_family(cfg) -> str | None:
    """The transformers family a DecoderConfig's features ask for; None: Llama, Mistral or Qwen2 (biases, windows)."""
    if cfg.latent:
        return "deepseek_v3"
    if cfg.qk_norm == "all" or not cfg.pre_norms:
        return "olmo2"
    if _is_gemma_like(cfg):
        return "gemma3_text" if cfg.qk_norm or cfg.rope_local_theta is not None else "gemma2"
    if cfg.rope_layers is not None:
        return "smollm3"
    if cfg.residual_scale != 1.0 or cfg.logit_divisor is not None or cfg.embed_scale is not None or (
            cfg.attn_scale is not None):
        return "granite"
    return "qwen3" if cfg.qk_norm else None


_NAMES = {"deepseek_v3": "DeepSeek-V3", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "gemma2": "Gemma 2", "qwen3": "Qwen3",
          "gemma3_text": "Gemma 3", "phi3": "Phi-3", "olmo2": "OLMo 2", "smollm3": "SmolLM3", "granite": "Granite"}


def _window_options(cfg, lefts: list[int | None], family: str) -> dict:
    """HF's sliding-window fields for ``family``, or ValueError when it cannot express the layers' windows."""
    slides = sorted({x for x in lefts if x is not None})
    if not slides:
        return {}
    name = _NAMES[family]
    if len(slides) > 1:
        raise ValueError(f"the layers' sliding windows differ (left={slides}, per layer {lefts}): transformers' "
                         f"{name} gives every sliding layer the same window; use one window")
    if family in _SLIDE_ALL:
        if None in lefts:
            raise ValueError(f"some layers slide and some do not (per layer {lefts}): transformers' {name} slides "
                             f"in every layer or none")
        return dict(sliding_window=slides[0] + 1)
    if family in ("qwen2", "qwen3", "smollm3"):
        types = ["full_attention" if x is None else "sliding_attention" for x in lefts]
        return dict(use_sliding_window=True, sliding_window=slides[0] + 1, max_window_layers=0, layer_types=types)
    raise ValueError(f"config has sliding-window layers (per layer {lefts}): transformers' {name} has none")


def _new_family_config(cfg, common: dict, lefts: list[int | None], family: str):
    """Qwen3, Phi-3, OLMo 2, SmolLM3 and Granite: the Llama layout with each one's additions."""
    transformers = _transformers()
    name = _NAMES[family]
    checks = [("positions", cfg.positions, "rope"), ("rope_interleaved", cfg.rope_interleaved, False),
              ("norm", cfg.norm, "rms"), ("norm_first", cfg.norm_first, True), ("ffn", cfg.ffn, "swiglu"),
              ("softcap", cfg.softcap, None), ("logit_softcap", cfg.logit_softcap, None),
              ("rope_local_theta", cfg.rope_local_theta, None),
              ("qk_norm", cfg.qk_norm, {"qwen3": True, "olmo2": "all"}.get(family, False)),
              ("pre_norms", cfg.pre_norms, family != "olmo2"), ("post_norms", cfg.post_norms, family == "olmo2")]
    if family != "smollm3":
        checks.append(("rope_layers", cfg.rope_layers, None))
    if family != "granite":
        checks += [("attn_scale", cfg.attn_scale, None), ("embed_scale", cfg.embed_scale, None),
                   ("residual_scale", cfg.residual_scale, 1.0), ("logit_divisor", cfg.logit_divisor, None)]
    biases = {"phi3": (False, False, False), "qwen3": (cfg.qkv_bias, cfg.qkv_bias, False),
              "olmo2": (cfg.qkv_bias, cfg.qkv_bias, False)}.get(family, (cfg.qkv_bias, cfg.qkv_bias, cfg.ffn_bias))
    checks += [("qkv_bias", cfg.qkv_bias, biases[0]), ("out_bias", cfg.out_bias, biases[1]),
               ("ffn_bias", cfg.ffn_bias, biases[2])]
    _check_fields(cfg, checks, name)
    opts = _window_options(cfg, lefts, family)
    opts["pad_token_id"] = None  # some defaults (Phi-3's 32000, SmolLM3's 128004) must index the vocabulary
    if family != "phi3":
        opts["attention_bias"] = cfg.qkv_bias
    else:  # Phi-3 reads the original length from its config (default 4096), not from rope_parameters
        opts["original_max_position_embeddings"] = common["rope_parameters"].get("original_max_position_embeddings",
                                                                                 common["max_position_embeddings"])
    if family in ("smollm3", "granite"):
        opts["mlp_bias"] = cfg.ffn_bias
    if family == "smollm3":
        opts["no_rope_layers"] = [int(x) for x in cfg.rope_layers or (True,) * cfg.n_layers]
    if family == "granite":
        opts.update(embedding_multiplier=cfg.embed_scale or 1.0, residual_multiplier=cfg.residual_scale,
                    attention_multiplier=cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5,
                    logits_scaling=cfg.logit_divisor or 1.0)
    classes = {"qwen3": "Qwen3Config", "phi3": "Phi3Config", "olmo2": "Olmo2Config", "smollm3": "SmolLM3Config",
               "granite": "GraniteConfig"}
    return getattr(transformers, classes[family])(**common, **opts)


def _deepseek_hf_config(cfg, common: dict, lefts: list[int | None]):
    transformers = _transformers()
    if not cfg.latent:
        raise ValueError("family='deepseek_v3' needs latent attention: set config.kv_lora_rank (and "
                         "qk_rope_head_dim)")
    checks = [("positions", cfg.positions, "rope"), ("norm", cfg.norm, "rms"), ("norm_first", cfg.norm_first, True),
              ("ffn", cfg.ffn, "swiglu"), ("ffn_bias", cfg.ffn_bias, False), ("out_bias", cfg.out_bias, cfg.qkv_bias),
              ("post_norms", cfg.post_norms, False), ("embed_scale", cfg.embed_scale, None),
              ("logit_softcap", cfg.logit_softcap, None), ("logit_divisor", cfg.logit_divisor, None),
              ("residual_scale", cfg.residual_scale, 1.0), ("rope_layers", cfg.rope_layers, None)]
    _check_fields(cfg, checks, "DeepSeek-V3")
    _window_options(cfg, lefts, "deepseek_v3")
    qk = cfg.head_dim + cfg.qk_rope_head_dim
    want = _deepseek_scale(common["rope_parameters"], qk)
    got = cfg.attn_scale if cfg.attn_scale is not None else qk ** -0.5
    if abs(got - want) > 1e-12 * want:
        raise ValueError(f"config.attn_scale={cfg.attn_scale!r}: transformers' DeepSeek-V3 scales scores by "
                         f"{want!r} (1/sqrt(d_head + qk_rope_head_dim), with yarn's mscale_all_dim correction)")
    common = {**common, "head_dim": cfg.qk_rope_head_dim, "num_key_value_heads": cfg.n_heads, "pad_token_id": None}
    return transformers.DeepseekV3Config(
        **common, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.head_dim, v_head_dim=cfg.v_head_dim or cfg.head_dim, rope_interleave=cfg.rope_interleaved,
        attention_bias=cfg.qkv_bias, first_k_dense_replace=cfg.n_layers)  # every layer dense


def hf_config(config, *, attn_implementation: str | None = None, family: str | None = None):
    """The ``transformers`` config of an :class:`attnkit.nn.DecoderConfig`: the family its features ask for
    (see :func:`to_hf`), or ``family`` (a ``model_type`` in ``FAMILIES``) when given."""
    transformers = _transformers()
    cfg = config
    if family is not None:
        _checks.choice("family", family, FAMILIES)
    if getattr(cfg, "indexer", None) is not None or family == "deepseek_v32":
        raise ValueError("to_hf does not convert DeepSeek sparse attention (config.indexer, DeepSeek-V3.2) back to "
                         "transformers; keep the attnkit model, or convert a model without an indexer")
    lefts = _layer_lefts(cfg)
    rope, max_len = _hf_rope(cfg)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=max_len, rms_norm_eps=cfg.norm_eps,
                  hidden_act="silu", rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings,
                  attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_std)
    if attn_implementation is not None:
        common["attn_implementation"] = attn_implementation
    family = family or _infer_family(cfg)
    if family == "deepseek_v3":
        return _deepseek_hf_config(cfg, common, lefts)
    if cfg.latent:
        raise ValueError(f"family={family!r}: latent attention (config.kv_lora_rank) converts to DeepSeek-V3 "
                         f"(family='deepseek_v3')")
    if family in _GEMMAS:
        return _gemma_hf_config(cfg, common, lefts, family)
    if family is not None and family not in ("llama", "mistral", "qwen2"):
        return _new_family_config(cfg, common, lefts, family)
    checks = [("positions", cfg.positions, "rope"), ("rope_interleaved", cfg.rope_interleaved, False),
              ("norm", cfg.norm, "rms"), ("norm_first", cfg.norm_first, True), ("ffn", cfg.ffn, "swiglu"),
              ("qk_norm", cfg.qk_norm, False), ("softcap", cfg.softcap, None), ("attn_scale", cfg.attn_scale, None)]
    _check_fields(cfg, checks, "Llama-family models")
    wanted = family
    family = _hf_family(cfg, lefts)
    if wanted == "mistral" and family == "llama" and not (cfg.qkv_bias or cfg.out_bias or cfg.ffn_bias):
        family = "mistral"  # a Mistral without a window: transformers' sliding_window=None
    if wanted is not None and wanted != family:
        raise ValueError(f"family={wanted!r}: this config's biases and windows make it {_NAMES[family]} "
                         f"(family={family!r})")
    left = next((x for x in lefts if x is not None), None)
    if family == "llama":
        return transformers.LlamaConfig(**common, attention_bias=cfg.qkv_bias, mlp_bias=cfg.ffn_bias)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None if left is None else left + 1)
    window = {}
    if left is not None:
        types = ["full_attention" if x is None else "sliding_attention" for x in lefts]
        window = dict(use_sliding_window=True, sliding_window=left + 1, max_window_layers=0, layer_types=types)
    return transformers.Qwen2Config(**common, **window)


def _to_hf_state(state: dict, n_layers: int, tied: bool, dims: tuple[int, int, int], family: str,
                 norm_offset: float) -> dict:
    q, kv, ff = dims
    off = -_norm_shift(family, norm_offset)
    s = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": _shifted(state["norm.weight"], off),
         "lm_head.weight": state["embed.weight"] if tied else state["lm_head.weight"]}
    for i in range(n_layers):
        h, a = f"model.layers.{i}.", f"layers.{i}."
        for hf_name, name in _NORMS.get(family, _NORMS[None]).items():
            s[f"{h}{hf_name}.weight"] = _shifted(state[f"{a}{name}.weight"], off)
        for name in _QK_NORMS if family != "deepseek_v3" else ():  # (LatentAttention's q_norm is q_a_layernorm)
            if f"{a}attn.{name}.weight" in state:
                s[f"{h}self_attn.{name}.weight"] = _shifted(state[f"{a}attn.{name}.weight"], off)
        for kind in ("weight", "bias"):
            if family == "deepseek_v3":
                for hf_name, name in _MLA.items():
                    if f"{a}attn.{name}.{kind}" in state:
                        s[f"{h}self_attn.{hf_name}.{kind}"] = state[f"{a}attn.{name}.{kind}"]
                if kind == "weight":
                    s[f"{h}mlp.gate_proj.weight"], s[f"{h}mlp.up_proj.weight"] = state[f"{a}ffn.up_proj.weight"].split(ff)
                    s[f"{h}mlp.down_proj.weight"] = state[f"{a}ffn.down_proj.weight"]
                continue
            if family == "phi3":  # fused as attnkit's: rows [q; k; v] and [gate; up]
                if f"{a}attn.qkv_proj.{kind}" in state:
                    s[f"{h}self_attn.qkv_proj.{kind}"] = state[f"{a}attn.qkv_proj.{kind}"]
                    s[f"{h}self_attn.o_proj.{kind}"] = state[f"{a}attn.out_proj.{kind}"]
                    s[f"{h}mlp.gate_up_proj.{kind}"] = state[f"{a}ffn.up_proj.{kind}"]
                    s[f"{h}mlp.down_proj.{kind}"] = state[f"{a}ffn.down_proj.{kind}"]
                continue
            if f"{a}attn.qkv_proj.{kind}" in state:
                for name, part in zip("qkv", state[f"{a}attn.qkv_proj.{kind}"].split((q, kv, kv), 0)):
                    s[f"{h}self_attn.{name}_proj.{kind}"] = part
            if f"{a}attn.out_proj.{kind}" in state:
                s[f"{h}self_attn.o_proj.{kind}"] = state[f"{a}attn.out_proj.{kind}"]
            if f"{a}ffn.up_proj.{kind}" in state:
                gate, up = state[f"{a}ffn.up_proj.{kind}"].split(ff, 0)
                s[f"{h}mlp.gate_proj.{kind}"], s[f"{h}mlp.up_proj.{kind}"] = gate, up
                s[f"{h}mlp.down_proj.{kind}"] = state[f"{a}ffn.down_proj.{kind}"]
    return s


def to_hf(model, *, attn_implementation: str | None = None, family: str | None = None):
    """Convert an :class:`attnkit.nn.DecoderLM` into the equivalent ``transformers`` causal LM.

    RoPE, RMSNorm Pre-LN and SwiGLU models become ``LlamaForCausalLM`` (no biases, or q/k/v/o biases),
    ``MistralForCausalLM`` (a causal sliding window, no biases) or ``Qwen2ForCausalLM`` (q/k/v biases; also
    full and sliding-window layers mixed through ``config.layer_masks``, one window size, as ``layer_types``);
    anything else (ALiBi, LayerNorm, GELU, soft-cap, other masks) raises ``ValueError`` naming the field.
    Gemma 2-style models (``ffn="geglu"``, ``post_norms``, ``embed_scale=sqrt(d_model)``, soft-caps, one
    sliding window on some layers) become ``Gemma2ForCausalLM``, with q/k norms (or ``rope_local_theta``)
    ``Gemma3ForCausalLM``.  Of the Llama layout, ``qk_norm=True`` makes ``Qwen3ForCausalLM``, ``qk_norm="all"``
    with output-only norms (``pre_norms=False, post_norms=True``) ``Olmo2ForCausalLM``, ``rope_layers``
    ``SmolLM3ForCausalLM``, and ``embed_scale`` / ``attn_scale`` / ``residual_scale`` / ``logit_divisor``
    ``GraniteForCausalLM``.  ``family`` (a ``model_type`` of ``FAMILIES``, e.g. ``"phi3"`` for
    ``Phi3ForCausalLM``, whose fused projections attnkit's equal) picks the family instead; a config it cannot
    express raises ``ValueError``.
    ``config.attention_dropout`` becomes HF's ``attention_dropout``; ``config.dropout`` (embedding and
    residual dropout, training only) has no equivalent in these models and is not carried over.
    The result has the same dtype, device and training mode, and computes the same logits;
    ``attn_implementation`` is passed to the config (e.g. ``"attnkit"`` after :func:`~attnkit.integrations.hf.register`).

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.nn import DecoderConfig, DecoderLM
        >>> from attnkit.integrations.hf import to_hf
        >>> model = DecoderLM(DecoderConfig.preset("tiny", n_kv_heads=2, mask=masks.sliding_window(3))).eval()
        >>> hf_model = to_hf(model)
        >>> type(hf_model).__name__, hf_model.config.sliding_window
        ('MistralForCausalLM', 4)
        >>> ids = torch.randint(0, 256, (2, 9))
        >>> torch.allclose(hf_model(ids).logits, model(ids), atol=1e-5)
        True
    """
    from ..nn import DecoderLM

    transformers = _transformers()
    if not isinstance(model, DecoderLM):
        raise TypeError(f"to_hf converts an attnkit.nn.DecoderLM, got {type(model).__name__}")
    cfg = model.config
    config = hf_config(cfg, attn_implementation=attn_implementation, family=family)
    classes = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
               "granite": "GraniteForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
    dtype, device = _dtype_device(model)
    out = getattr(transformers, classes[config.model_type])(config).to(device=device, dtype=dtype)
    dims = (cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ff_dim)
    state = _to_hf_state(model.state_dict(), cfg.n_layers, cfg.tie_embeddings, dims, config.model_type,
                         cfg.norm_offset)
    out.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True)
    return out.train(model.training)
