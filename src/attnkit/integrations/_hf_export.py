"""Converting :class:`attnkit.nn.DecoderLM` back to Hugging Face ``transformers`` (``to_hf``, ``hf_config``): the
inverse of ``_hf_models``'s ``from_hf`` (that module's docstring describes the families and how their fields map).
"""

from __future__ import annotations

from .. import _checks
from .. import masks as _masks
from ._hf_models import _GEMMAS, _MLA, _NORMS, _QK_NORMS, _SLIDE_ALL, FAMILIES, _deepseek_scale, _dtype_device
from ._hf_models import _norm_shift, _shifted, _transformers


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
        raise ValueError(
            f"{name}={mask!r}: only a causal sliding window (masks.sliding_window(left)) has a transformers equivalent"
        )
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
            raise ValueError(
                f"the layers' sliding windows differ (left={sorted(slides)}, per layer {lefts}): "
                f"transformers' Qwen2 gives every sliding layer the same window; use one window"
            )
        if biases != (True, False, False):
            raise ValueError(
                f"qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}, ffn_bias={cfg.ffn_bias} with "
                f"full and sliding-window layers mixed: the Llama-family model that mixes them is "
                f"Qwen2, which has biases on q/k/v only (qkv_bias=True, out_bias=ffn_bias=False)"
            )
        return "qwen2"
    if not slides and cfg.qkv_bias == cfg.out_bias:
        return "llama"
    if biases == (False, False, False):
        return "mistral"
    if biases == (True, False, False):
        return "qwen2"
    raise ValueError(
        f"qkv_bias={cfg.qkv_bias}, out_bias={cfg.out_bias}, ffn_bias={cfg.ffn_bias}"
        f"{' with a sliding window' if slides else ''}: no transformers Llama-family "
        f"model has these biases (Llama: q/k/v/o alike; Mistral: none; Qwen2: q/k/v only)"
    )


def _check_fields(cfg, checks: list, family: str) -> None:
    for name, value, want in checks:
        if value != want:
            raise ValueError(f"config.{name}={value!r}: transformers' {family} needs {name}={want!r}")
    if cfg.rotary_dim not in (None, cfg.head_dim):
        raise ValueError(f"config.rotary_dim={cfg.rotary_dim}: partial rotary has no {family} equivalent")


def _hf_rope(cfg) -> tuple[dict, int]:
    """HF ``rope_parameters`` and ``max_position_embeddings`` of a DecoderConfig (see ``_hf_models._rope``)."""
    rope, max_len = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}, cfg.max_seq_len
    if cfg.rope_scaling is None:
        return rope, max_len
    from ..nn.rope_scaling import DynamicNTKScaling, RopeScaling

    s = RopeScaling.from_hf(cfg.rope_scaling)
    if s is None:
        return rope, max_len
    if s.type == "ntk":
        raise ValueError(
            "rope scaling 'ntk' (static NTK) has no transformers equivalent (linear, llama3, yarn, "
            "longrope and dynamic do)"
        )
    rope.update(s.to_hf())
    if isinstance(s, DynamicNTKScaling):  # HF's max_position_embeddings is the length dynamic NTK scales beyond
        return {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}, s.original_max_seq_len
    return rope, max_len


def _gemma_hf_config(cfg, common: dict, lefts: list[int | None], family: str):
    transformers = _transformers()
    gemma3 = family == "gemma3_text"
    name = _NAMES[family]
    checks = [
        ("positions", cfg.positions, "rope"),
        ("rope_interleaved", cfg.rope_interleaved, False),
        ("norm", cfg.norm, "rms"),
        ("norm_first", cfg.norm_first, True),
        ("ffn", cfg.ffn, "geglu"),
        ("post_norms", cfg.post_norms, True),
        ("pre_norms", cfg.pre_norms, True),
        ("qk_norm", cfg.qk_norm, gemma3),
        ("ffn_bias", cfg.ffn_bias, False),
        ("out_bias", cfg.out_bias, cfg.qkv_bias),
        ("rope_layers", cfg.rope_layers, None),
        ("residual_scale", cfg.residual_scale, 1.0),
        ("logit_divisor", cfg.logit_divisor, None),
    ]
    if not gemma3:
        checks.append(("rope_local_theta", cfg.rope_local_theta, None))
    else:  # transformers' Gemma 3 reads attn_logit_softcapping but never caps the scores with it
        checks.append(("softcap", cfg.softcap, None))
    _check_fields(cfg, checks, name)
    if cfg.embed_scale is None or abs(cfg.embed_scale - cfg.d_model**0.5) > 1e-9 * cfg.d_model**0.5:
        raise ValueError(
            f"config.embed_scale={cfg.embed_scale!r}: transformers' {name} scales embeddings by "
            f"sqrt(d_model)={cfg.d_model**0.5!r}"
        )
    slides = sorted({x for x in lefts if x is not None})
    if len(slides) > 1:
        raise ValueError(
            f"the layers' sliding windows differ (left={slides}, per layer {lefts}): transformers' "
            f"{name} gives every sliding layer the same window; use one window"
        )
    if gemma3:
        if slides and cfg.rope_local_theta is None and cfg.rope_scaling is not None:
            raise ValueError(
                "config.rope_local_theta=None with rope_scaling and sliding layers: transformers' Gemma 3 "
                "gives its sliding layers an unscaled rope of their own; set rope_local_theta"
            )
        local = {"rope_type": "default", "rope_theta": float(cfg.rope_local_theta or cfg.rope_theta)}
        common = {
            **common,
            "rope_parameters": {"full_attention": common["rope_parameters"], "sliding_attention": local},
        }
    scalar = cfg.head_dim if cfg.attn_scale is None else cfg.attn_scale**-2.0
    if abs(scalar - round(scalar)) < 1e-6 * scalar:
        scalar = int(round(scalar))
    common = {k: v for k, v in common.items() if k != "hidden_act"}
    return (transformers.Gemma3TextConfig if gemma3 else transformers.Gemma2Config)(
        **common,
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=cfg.qkv_bias,
        query_pre_attn_scalar=scalar,
        # with no sliding layer the window is unused, but Gemma 2 builds its sliding mask anyway: one that hides nothing
        sliding_window=slides[0] + 1 if slides else cfg.max_seq_len,
        attn_logit_softcapping=None if gemma3 else cfg.softcap,
        final_logit_softcapping=cfg.logit_softcap,
        layer_types=["full_attention" if x is None else "sliding_attention" for x in lefts],
    )


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
    if (
        cfg.residual_scale != 1.0
        or cfg.logit_divisor is not None
        or cfg.embed_scale is not None
        or (cfg.attn_scale is not None)
    ):
        return "granite"
    return "qwen3" if cfg.qk_norm else None


_NAMES = {
    "deepseek_v3": "DeepSeek-V3",
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "gemma2": "Gemma 2",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3",
    "phi3": "Phi-3",
    "olmo2": "OLMo 2",
    "smollm3": "SmolLM3",
    "granite": "Granite",
}


def _window_options(cfg, lefts: list[int | None], family: str) -> dict:
    """HF's sliding-window fields for ``family``, or ValueError when it cannot express the layers' windows."""
    slides = sorted({x for x in lefts if x is not None})
    if not slides:
        return {}
    name = _NAMES[family]
    if len(slides) > 1:
        raise ValueError(
            f"the layers' sliding windows differ (left={slides}, per layer {lefts}): transformers' "
            f"{name} gives every sliding layer the same window; use one window"
        )
    if family in _SLIDE_ALL:
        if None in lefts:
            raise ValueError(
                f"some layers slide and some do not (per layer {lefts}): transformers' {name} slides "
                f"in every layer or none"
            )
        return dict(sliding_window=slides[0] + 1)
    if family in ("qwen2", "qwen3", "smollm3"):
        types = ["full_attention" if x is None else "sliding_attention" for x in lefts]
        return dict(use_sliding_window=True, sliding_window=slides[0] + 1, max_window_layers=0, layer_types=types)
    raise ValueError(f"config has sliding-window layers (per layer {lefts}): transformers' {name} has none")


def _new_family_config(cfg, common: dict, lefts: list[int | None], family: str):
    """Qwen3, Phi-3, OLMo 2, SmolLM3 and Granite: the Llama layout with each one's additions."""
    transformers = _transformers()
    name = _NAMES[family]
    checks = [
        ("positions", cfg.positions, "rope"),
        ("rope_interleaved", cfg.rope_interleaved, False),
        ("norm", cfg.norm, "rms"),
        ("norm_first", cfg.norm_first, True),
        ("ffn", cfg.ffn, "swiglu"),
        ("softcap", cfg.softcap, None),
        ("logit_softcap", cfg.logit_softcap, None),
        ("rope_local_theta", cfg.rope_local_theta, None),
        ("qk_norm", cfg.qk_norm, {"qwen3": True, "olmo2": "all"}.get(family, False)),
        ("pre_norms", cfg.pre_norms, family != "olmo2"),
        ("post_norms", cfg.post_norms, family == "olmo2"),
    ]
    if family != "smollm3":
        checks.append(("rope_layers", cfg.rope_layers, None))
    if family != "granite":
        checks += [
            ("attn_scale", cfg.attn_scale, None),
            ("embed_scale", cfg.embed_scale, None),
            ("residual_scale", cfg.residual_scale, 1.0),
            ("logit_divisor", cfg.logit_divisor, None),
        ]
    biases = {
        "phi3": (False, False, False),
        "qwen3": (cfg.qkv_bias, cfg.qkv_bias, False),
        "olmo2": (cfg.qkv_bias, cfg.qkv_bias, False),
    }.get(family, (cfg.qkv_bias, cfg.qkv_bias, cfg.ffn_bias))
    checks += [
        ("qkv_bias", cfg.qkv_bias, biases[0]),
        ("out_bias", cfg.out_bias, biases[1]),
        ("ffn_bias", cfg.ffn_bias, biases[2]),
    ]
    _check_fields(cfg, checks, name)
    opts = _window_options(cfg, lefts, family)
    opts["pad_token_id"] = None  # some defaults (Phi-3's 32000, SmolLM3's 128004) must index the vocabulary
    if family != "phi3":
        opts["attention_bias"] = cfg.qkv_bias
    else:  # Phi-3 reads the original length from its config (default 4096), not from rope_parameters
        opts["original_max_position_embeddings"] = common["rope_parameters"].get(
            "original_max_position_embeddings", common["max_position_embeddings"]
        )
    if family in ("smollm3", "granite"):
        opts["mlp_bias"] = cfg.ffn_bias
    if family == "smollm3":
        opts["no_rope_layers"] = [int(x) for x in cfg.rope_layers or (True,) * cfg.n_layers]
    if family == "granite":
        opts.update(
            embedding_multiplier=cfg.embed_scale or 1.0,
            residual_multiplier=cfg.residual_scale,
            attention_multiplier=cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5,
            logits_scaling=cfg.logit_divisor or 1.0,
        )
    classes = {
        "qwen3": "Qwen3Config",
        "phi3": "Phi3Config",
        "olmo2": "Olmo2Config",
        "smollm3": "SmolLM3Config",
        "granite": "GraniteConfig",
    }
    return getattr(transformers, classes[family])(**common, **opts)


def _deepseek_hf_config(cfg, common: dict, lefts: list[int | None]):
    transformers = _transformers()
    if not cfg.latent:
        raise ValueError("family='deepseek_v3' needs latent attention: set config.kv_lora_rank (and qk_rope_head_dim)")
    checks = [
        ("positions", cfg.positions, "rope"),
        ("norm", cfg.norm, "rms"),
        ("norm_first", cfg.norm_first, True),
        ("ffn", cfg.ffn, "swiglu"),
        ("ffn_bias", cfg.ffn_bias, False),
        ("out_bias", cfg.out_bias, cfg.qkv_bias),
        ("post_norms", cfg.post_norms, False),
        ("embed_scale", cfg.embed_scale, None),
        ("logit_softcap", cfg.logit_softcap, None),
        ("logit_divisor", cfg.logit_divisor, None),
        ("residual_scale", cfg.residual_scale, 1.0),
        ("rope_layers", cfg.rope_layers, None),
    ]
    _check_fields(cfg, checks, "DeepSeek-V3")
    _window_options(cfg, lefts, "deepseek_v3")
    qk = cfg.head_dim + cfg.qk_rope_head_dim
    want = _deepseek_scale(common["rope_parameters"], qk)
    got = cfg.attn_scale if cfg.attn_scale is not None else qk**-0.5
    if abs(got - want) > 1e-12 * want:
        raise ValueError(
            f"config.attn_scale={cfg.attn_scale!r}: transformers' DeepSeek-V3 scales scores by "
            f"{want!r} (1/sqrt(d_head + qk_rope_head_dim), with yarn's mscale_all_dim correction)"
        )
    common = {**common, "head_dim": cfg.qk_rope_head_dim, "num_key_value_heads": cfg.n_heads, "pad_token_id": None}
    return transformers.DeepseekV3Config(
        **common,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.head_dim,
        v_head_dim=cfg.v_head_dim or cfg.head_dim,
        rope_interleave=cfg.rope_interleaved,
        attention_bias=cfg.qkv_bias,
        first_k_dense_replace=cfg.n_layers,
    )  # every layer dense


def hf_config(config, *, attn_implementation: str | None = None, family: str | None = None):
    """The ``transformers`` config of an :class:`attnkit.nn.DecoderConfig`: the family its features ask for
    (see :func:`to_hf`), or ``family`` (a ``model_type`` in ``FAMILIES``) when given."""
    transformers = _transformers()
    cfg = config
    if family is not None:
        _checks.choice("family", family, FAMILIES)
    if getattr(cfg, "indexer", None) is not None or family == "deepseek_v32":
        raise ValueError(
            "to_hf does not convert DeepSeek sparse attention (config.indexer, DeepSeek-V3.2) back to "
            "transformers; keep the attnkit model, or convert a model without an indexer"
        )
    lefts = _layer_lefts(cfg)
    rope, max_len = _hf_rope(cfg)
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ff_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=max_len,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=cfg.attention_dropout,
        initializer_range=cfg.init_std,
    )
    if attn_implementation is not None:
        common["attn_implementation"] = attn_implementation
    family = family or _infer_family(cfg)
    if family == "deepseek_v3":
        return _deepseek_hf_config(cfg, common, lefts)
    if cfg.latent:
        raise ValueError(
            f"family={family!r}: latent attention (config.kv_lora_rank) converts to DeepSeek-V3 (family='deepseek_v3')"
        )
    if family in _GEMMAS:
        return _gemma_hf_config(cfg, common, lefts, family)
    if family is not None and family not in ("llama", "mistral", "qwen2"):
        return _new_family_config(cfg, common, lefts, family)
    checks = [
        ("positions", cfg.positions, "rope"),
        ("rope_interleaved", cfg.rope_interleaved, False),
        ("norm", cfg.norm, "rms"),
        ("norm_first", cfg.norm_first, True),
        ("ffn", cfg.ffn, "swiglu"),
        ("qk_norm", cfg.qk_norm, False),
        ("softcap", cfg.softcap, None),
        ("attn_scale", cfg.attn_scale, None),
    ]
    _check_fields(cfg, checks, "Llama-family models")
    wanted = family
    family = _hf_family(cfg, lefts)
    if wanted == "mistral" and family == "llama" and not (cfg.qkv_bias or cfg.out_bias or cfg.ffn_bias):
        family = "mistral"  # a Mistral without a window: transformers' sliding_window=None
    if wanted is not None and wanted != family:
        raise ValueError(
            f"family={wanted!r}: this config's biases and windows make it {_NAMES[family]} (family={family!r})"
        )
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


def _to_hf_state(
    state: dict, n_layers: int, tied: bool, dims: tuple[int, int, int], family: str, norm_offset: float
) -> dict:
    q, kv, ff = dims
    off = -_norm_shift(family, norm_offset)
    s = {
        "model.embed_tokens.weight": state["embed.weight"],
        "model.norm.weight": _shifted(state["norm.weight"], off),
        "lm_head.weight": state["embed.weight"] if tied else state["lm_head.weight"],
    }
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
                    s[f"{h}mlp.gate_proj.weight"], s[f"{h}mlp.up_proj.weight"] = state[f"{a}ffn.up_proj.weight"].split(
                        ff
                    )
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
    classes = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "olmo2": "Olmo2ForCausalLM",
        "smollm3": "SmolLM3ForCausalLM",
        "granite": "GraniteForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
    }
    dtype, device = _dtype_device(model)
    out = getattr(transformers, classes[config.model_type])(config).to(device=device, dtype=dtype)
    dims = (cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ff_dim)
    state = _to_hf_state(model.state_dict(), cfg.n_layers, cfg.tie_embeddings, dims, config.model_type, cfg.norm_offset)
    out.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True)
    return out.train(model.training)
