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

from .. import masks as _masks
from ._transformers import _transformers as load_transformers

Tensor = torch.Tensor

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "gemma2",
    "qwen3",
    "gemma3_text",
    "phi3",
    "olmo2",
    "smollm3",
    "granite",
    "deepseek_v3",
    "deepseek_v32",
)
_DEEPSEEKS = ("deepseek_v3", "deepseek_v32")
_GEMMAS = ("gemma2", "gemma3_text")
_SLIDE_ALL = ("mistral", "phi3")  # sliding_window: every layer or none
_SLIDE_TYPED = ("qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text")  # layer_types say which layers slide
# model types whose feed-forward layers are mixtures of experts (configs with experts are caught as well)
_MOE = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "granitemoe",
    "granitemoeshared",
    "granitemoehybrid",
    "phimoe",
    "deepseek_v2",
    "deepseek_v3",
    "dbrx",
    "jamba",
    "jetmoe",
    "gpt_oss",
    "llama4",
    "dots1",
    "ernie4_5_moe",
    "glm4_moe",
    "hunyuan_v1_moe",
    "minimax",
    "qwen3_next",
    "flex_olmo",
    "deepseek_v32",
    "glm_moe_dsa",
)
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
        raise ValueError(
            f"rope_type={kind!r} is not supported by attnkit.nn's RotaryEmbedding: convertible "
            f"rope types are {_ROPE_TYPES}"
        )
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
        raise ValueError(
            f"layer_types={types}: from_hf converts 'full_attention' and 'sliding_attention' layers, "
            f"one per layer ({n})"
        )
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
        raise ValueError(
            f"from_hf converts these causal LMs {FAMILIES}, got model_type={family!r}: run "
            f"other models in transformers with attn_implementation='attnkit' (register())"
        )
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise ValueError(
            f"from_hf needs a causal LM with an output head ({family.capitalize()}ForCausalLM), got "
            f"{type(model).__name__}"
        )
    return family


def _check_dense(cfg) -> None:
    """ValueError for a config with mixture-of-experts feed-forward layers (attnkit.nn has none)."""
    family = getattr(cfg, "model_type", None)
    experts = max(int(getattr(cfg, name, 0) or 0) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    if family in _DEEPSEEKS and (experts == 0 or getattr(cfg, "first_k_dense_replace", 0) >= cfg.num_hidden_layers):
        return  # every layer's feed-forward is dense
    if family in _MOE or experts > 0:
        raise ValueError(
            f"model_type={family!r} has mixture-of-experts feed-forward layers, which attnkit.nn does "
            f"not build, so from_hf cannot convert it: run it in transformers with "
            f'attn_implementation="attnkit" (after attnkit.integrations.hf.register()) to use '
            f"attnkit's attention"
        )


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
        return dict(
            embed_scale=None if cfg.embedding_multiplier == 1.0 else float(cfg.embedding_multiplier),
            attn_scale=None if scale == d_head**-0.5 else scale,
            residual_scale=float(cfg.residual_multiplier),
            logit_divisor=None if cfg.logits_scaling == 1.0 else float(cfg.logits_scaling),
        )
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
    heads = cfg.num_attention_heads
    biased = family not in ("mistral", "qwen2", "phi3") and bool(getattr(cfg, "attention_bias", False))
    return DecoderConfig(
        **_family_options(cfg, family),
        **_shared_fields(cfg, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, _rope(cfg), backend),
        **_layer_masks(_windows(cfg, family)),
        ffn="swiglu",
        qkv_bias=biased or family == "qwen2",
        out_bias=biased,
        ffn_bias=bool(getattr(cfg, "mlp_bias", False)),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )


def _shared_fields(cfg, d_head: int, rope: tuple, backend: str) -> dict:
    """The :class:`attnkit.nn.DecoderConfig` fields every family reads alike from its ``transformers`` config:
    the sizes (``d_head`` given), the rope (``rope``: what ``_rope`` returns, ``(theta, scaling, max_len)``),
    the RMS norms before each sublayer, dropout (none but the attention's) and the initialisation."""
    theta, scaling, max_len = rope
    heads = cfg.num_attention_heads
    return dict(
        vocab_size=cfg.vocab_size,
        d_model=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        d_head=d_head,
        d_ff=cfg.intermediate_size,
        max_seq_len=max_len,
        positions="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        norm="rms",
        norm_eps=cfg.rms_norm_eps,
        norm_first=True,
        dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_std=getattr(cfg, "initializer_range", 0.02),
        backend=backend,
    )


def _deepseek_scale(rope: dict, qk_head_dim: int) -> float:
    """DeepSeek's score scale: ``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` with a scaled rope."""
    from ..nn.rope_scaling import yarn_mscale

    scale = qk_head_dim**-0.5
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
        indexer = IndexerConfig(
            top_k=cfg.index_topk, n_heads=cfg.index_n_heads, head_dim=cfg.index_head_dim, rope_interleaved=False
        )  # the indexer pairs (i, i + d/2); the attention (2i, 2i + 1)

    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act={cfg.hidden_act!r}: attnkit's SwiGLU uses silu")
    heads = cfg.num_attention_heads
    if (getattr(cfg, "num_key_value_heads", None) or heads) != heads:
        raise ValueError(
            f"num_key_value_heads={cfg.num_key_value_heads} != num_attention_heads={heads}: latent "
            f"attention gives every head its own key and value"
        )
    rope = _rope(cfg)
    scaling = rope[1]
    params = dict(cfg.rope_parameters or {})
    if scaling is not None:  # the factor _rope filled in
        params["factor"] = scaling.get("factor", params.get("factor"))
    scale = _deepseek_scale(params, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    biased = bool(getattr(cfg, "attention_bias", False))
    return DecoderConfig(
        **_shared_fields(cfg, cfg.qk_nope_head_dim, rope, backend),
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleaved=bool(getattr(cfg, "rope_interleave", True)),
        attn_scale=None if scale == (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 else scale,
        ffn="swiglu",
        qkv_bias=biased,
        out_bias=biased,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        indexer=indexer,
    )


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
            raise ValueError(
                f"Gemma 3 rope_parameters={params!r}: from_hf reads one entry per layer type "
                f"('full_attention' and 'sliding_attention'), as transformers >= 5 stores them"
            )
        rope = _rope(cfg, params["full_attention"])
        local_theta, local_scaling, _ = _rope(cfg, params["sliding_attention"])
        if local_scaling is not None:
            raise ValueError(
                f"rope_parameters['sliding_attention']={params['sliding_attention']}: from_hf converts "
                f"Gemma 3 sliding layers with the default rope type only"
            )
        sliding = any(w is not None for w in windows)
        extra = dict(
            qk_norm=True, rope_local_theta=local_theta if sliding else None, **_layer_masks(windows, per_layer=sliding)
        )
    else:
        rope = _rope(cfg)
        extra = _layer_masks(windows)
    heads, biased = cfg.num_attention_heads, bool(getattr(cfg, "attention_bias", False))
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    scalar = cfg.query_pre_attn_scalar
    return DecoderConfig(
        **_shared_fields(cfg, d_head, rope, backend),
        **extra,
        norm_offset=1.0,
        post_norms=True,
        ffn="geglu",
        qkv_bias=biased,
        out_bias=biased,
        ffn_bias=False,
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it to the scores
        softcap=None if gemma3 else cfg.attn_logit_softcapping,
        logit_softcap=cfg.final_logit_softcapping,
        attn_scale=None if scalar == d_head else float(scalar) ** -0.5,
        embed_scale=cfg.hidden_size**0.5,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
    )


# HF norm name -> attnkit norm name, per family (Gemma 2's post_attention_layernorm is the attention's output norm)
_GEMMA_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "attn_post_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "ffn_post_norm",
}
_NORMS = {
    "gemma2": _GEMMA_NORMS,
    "gemma3_text": _GEMMA_NORMS,
    "olmo2": {"post_attention_layernorm": "attn_post_norm", "post_feedforward_layernorm": "ffn_post_norm"},
    None: {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"},
}
_QK_NORMS = {"q_norm": "q_norm", "k_norm": "k_norm"}  # self_attn.<name> -> attn.<name>
# DeepSeek's latent attention: self_attn.<HF name> -> attn.<attnkit name> (LatentAttention)
_MLA = {
    "q_proj": "q_proj",
    "q_a_proj": "q_a_proj",
    "q_a_layernorm": "q_norm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj_with_mqa": "kv_a_proj",
    "kv_a_layernorm": "kv_norm",
    "kv_b_proj": "kv_b_proj",
    "o_proj": "out_proj",
}
_INDEXER = ("wq_b", "wk", "k_norm", "weights_proj")  # self_attn.indexer.<name> -> attn.indexer.<name>


def _norm_shift(family: str, norm_offset: float) -> float:
    """attnkit's RMSNorm weight minus HF's: both multiply by ``offset + weight``, HF's offset is 1 for Gemma
    (``1 + weight``) and 0 otherwise.  0 for converted models (``norm_offset`` is HF's): weights copy as is."""
    return (1.0 if family in _GEMMAS else 0.0) - norm_offset


def _shifted(w: Tensor, shift: float) -> Tensor:
    return w if shift == 0 else (w.float() + shift).to(w.dtype)


def _to_attnkit_state(hf_state: dict, n_layers: int, tied: bool, family: str, norm_offset: float) -> dict:
    off = _norm_shift(family, norm_offset)
    s = {
        "embed.weight": hf_state["model.embed_tokens.weight"],
        "norm.weight": _shifted(hf_state["model.norm.weight"], off),
    }
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
                s[f"{a}ffn.up_proj.weight"] = torch.cat(
                    [hf_state[h + "mlp.gate_proj.weight"], hf_state[h + "mlp.up_proj.weight"]], 0
                )  # rows [gate; up]
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
