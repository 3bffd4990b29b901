"""Converting Llama-family and Gemma 2 causal LMs between Hugging Face ``transformers`` and
:class:`attnkit.nn.DecoderLM`.

The Llama family shares one layout — RMSNorm Pre-LN blocks, grouped-query attention with rotate-half RoPE,
a SwiGLU MLP — and differs in biases and the sliding window:

* ``llama``: biases on q/k/v/o (``attention_bias``) and the MLP (``mlp_bias``) or none; no window;
* ``mistral``: no biases; ``sliding_window`` on every layer, or none;
* ``qwen2``: biases on q/k/v only; ``layer_types`` says which layers slide (all, none, or a mix).

HF's window ``w`` counts the query itself, so it becomes ``masks.sliding_window(w - 1)``: in
``DecoderConfig.mask`` when every layer slides, in ``DecoderConfig.layer_masks`` (``None`` for the
full-attention layers) when only some do.  HF's ``attention_dropout`` is ``DecoderConfig.attention_dropout``.

``gemma2`` adds to that layout: ``embed_scale=sqrt(hidden_size)``, a tanh-GELU gated MLP
(``ffn="geglu"``), a norm after each sub-layer as well as before (``post_norms``; HF's
``post_attention_layernorm`` is the attention's *output* norm there, ``pre_feedforward_layernorm`` the
MLP's input norm), ``attn_scale=query_pre_attn_scalar ** -0.5``, score and logit soft-caps, sliding and
global layers alternating through ``layer_types``, and RMSNorm weights stored as ``w - 1`` (HF multiplies
by ``1 + w`` in float32; attnkit's ``norm_offset=1.0`` does the same, so the weights copy bit for bit).

Weights map one to one except two fusions: attnkit's ``attn.qkv_proj`` stacks ``[q_proj; k_proj; v_proj]`` and
``ffn.up_proj`` stacks ``[gate_proj; up_proj]``.
"""

from __future__ import annotations

import torch

from .. import masks as _masks

Tensor = torch.Tensor

FAMILIES = ("llama", "mistral", "qwen2", "gemma2")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def _transformers():
    from .hf import _transformers as load

    return load()[0]


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
    if family == "llama":
        return [None] * n
    window = getattr(cfg, "sliding_window", None)
    if family == "mistral" or window is None:
        return [window] * n
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"layer_types={types}: from_hf converts 'full_attention' and 'sliding_attention' layers, "
                         f"one per layer ({n})")
    return [window if t == "sliding_attention" else None for t in types]


def _layer_masks(windows: list[int | None]) -> dict:
    """``mask`` (the same window on every layer) or ``layer_masks`` (windows that differ) of DecoderConfig."""
    masks = [None if w is None else _masks.sliding_window(int(w) - 1) for w in windows]
    if len(set(windows)) == 1:
        return dict(mask=masks[0], layer_masks=None)
    return dict(mask=None, layer_masks=tuple(masks))


def _family(model) -> str:
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    family = getattr(model.config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(f"from_hf converts these causal LMs {FAMILIES}, got model_type={family!r}: run "
                         f"other models in transformers with attn_implementation='attnkit' (register())")
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise ValueError(f"from_hf needs a causal LM with an output head ({family.capitalize()}ForCausalLM), got "
                         f"{type(model).__name__}")
    return family


def decoder_config(hf_config, *, backend: str = "auto"):
    """The :class:`attnkit.nn.DecoderConfig` of a Llama / Mistral / Qwen2 / Gemma 2 ``transformers`` config."""
    from ..nn import DecoderConfig

    cfg, family = hf_config, hf_config.model_type
    if family == "gemma2":
        return _gemma2_config(cfg, backend)
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act={cfg.hidden_act!r}: attnkit's SwiGLU uses silu")
    theta, scaling, max_len = _rope(cfg)
    heads = cfg.num_attention_heads
    biased = family == "llama" and bool(getattr(cfg, "attention_bias", False))
    return DecoderConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        d_head=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, d_ff=cfg.intermediate_size,
        max_seq_len=max_len, positions="rope", rope_theta=theta, rope_scaling=scaling,
        **_layer_masks(_windows(cfg, family)), norm="rms",
        norm_eps=cfg.rms_norm_eps, norm_first=True, ffn="swiglu", qkv_bias=biased or family == "qwen2",
        out_bias=biased, ffn_bias=family == "llama" and bool(getattr(cfg, "mlp_bias", False)),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_std=getattr(cfg, "initializer_range", 0.02), backend=backend)


def _gemma2_config(cfg, backend: str):
    from ..nn import DecoderConfig

    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={act!r}: attnkit's GeGLU (ffn='geglu') uses gelu_pytorch_tanh")
    if getattr(cfg, "use_bidirectional_attention", None):
        raise ValueError("use_bidirectional_attention=True: from_hf converts causal Gemma 2 models only")
    theta, scaling, max_len = _rope(cfg)
    heads, biased = cfg.num_attention_heads, bool(getattr(cfg, "attention_bias", False))
    d_head = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    scalar = cfg.query_pre_attn_scalar
    return DecoderConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, d_head=d_head, d_ff=cfg.intermediate_size,
        max_seq_len=max_len, positions="rope", rope_theta=theta, rope_scaling=scaling,
        **_layer_masks(_windows(cfg, "gemma2")), norm="rms", norm_eps=cfg.rms_norm_eps, norm_offset=1.0,
        norm_first=True, post_norms=True, ffn="geglu", qkv_bias=biased, out_bias=biased, ffn_bias=False,
        softcap=cfg.attn_logit_softcapping, logit_softcap=cfg.final_logit_softcapping,
        attn_scale=None if scalar == d_head else float(scalar) ** -0.5, embed_scale=cfg.hidden_size ** 0.5,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)), dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_std=getattr(cfg, "initializer_range", 0.02), backend=backend)


# HF norm name -> attnkit norm name, per family (Gemma 2's post_attention_layernorm is the attention's output norm)
_NORMS = {"gemma2": {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "ffn_post_norm"},
          None: {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}}


def _norm_shift(family: str, norm_offset: float) -> float:
    """attnkit's RMSNorm weight minus HF's: both multiply by ``offset + weight``, HF's offset is 1 for Gemma
    (``1 + weight``) and 0 otherwise.  0 for converted models (``norm_offset`` is HF's): weights copy as is."""
    return (1.0 if family == "gemma2" else 0.0) - norm_offset


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
        for kind in ("weight", "bias"):
            qkv = [hf_state.get(f"{h}self_attn.{p}_proj.{kind}") for p in "qkv"]
            if qkv[0] is not None:
                s[f"{a}attn.qkv_proj.{kind}"] = torch.cat(qkv, 0)  # rows [q; k; v]
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
    """Convert a ``transformers`` Llama / Mistral / Qwen2 / Gemma 2 causal LM into an :class:`attnkit.nn.DecoderLM`.

    The result computes the same logits (up to float rounding) on the same device and dtype, and is served
    by attnkit's caches, :func:`attnkit.generate` and the engine.  ``backend`` is the attnkit attention
    backend it uses.  Qwen2 and Gemma 2 models whose ``layer_types`` mix full and sliding-window layers get
    ``config.layer_masks``; HF's ``attention_dropout`` becomes ``config.attention_dropout`` (these models
    have no other dropout).  Raises ``ValueError`` for configurations attnkit cannot express (other rope
    types, other layer types, ...).

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
    parts, todo = [], [mask]
    while todo:
        m = todo.pop()
        if isinstance(m, _masks._And):
            todo += [m.a, m.b]
        else:
            parts.append(m)
    lefts = []
    for m in parts:
        if isinstance(m, _masks._Causal) and m.align == "bottom_right":
            continue
        if isinstance(m, _masks._SlidingWindow) and m.align == "bottom_right" and m.right in (0, None):
            if m.left is not None:
                lefts.append(m.left)
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


def _is_gemma(cfg) -> bool:
    """Whether ``cfg`` uses a feature only Gemma 2 has among the convertible families."""
    return cfg.ffn == "geglu" or cfg.post_norms or cfg.embed_scale is not None or cfg.logit_softcap is not None


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
    from ..nn.positions import _parse_scaling

    s = _parse_scaling(cfg.rope_scaling)
    if s is None:
        return rope, max_len
    if s["type"] == "ntk":
        raise ValueError("rope scaling 'ntk' (static NTK) has no transformers equivalent (linear, llama3, yarn, "
                         "longrope and dynamic do)")
    rope.update(rope_type=s["type"])
    if s["factor"] is not None:
        rope["factor"] = s["factor"]
    if s["type"] == "dynamic":
        return rope, s["original_max_seq_len"]
    if "original_max_seq_len" in s:
        rope["original_max_position_embeddings"] = s["original_max_seq_len"]
    names = {"llama3": ("low_freq_factor", "high_freq_factor"),
             "yarn": ("beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim", "attention_factor"),
             "longrope": ("short_factor", "long_factor", "attention_factor")}.get(s["type"], ())
    rope.update({k: list(s[k]) if isinstance(s[k], tuple) else s[k] for k in names if k in s})
    return rope, max_len


def _gemma2_hf_config(cfg, common: dict, lefts: list[int | None]):
    transformers = _transformers()
    checks = [("positions", cfg.positions, "rope"), ("rope_interleaved", cfg.rope_interleaved, False),
              ("norm", cfg.norm, "rms"), ("norm_first", cfg.norm_first, True), ("ffn", cfg.ffn, "geglu"),
              ("post_norms", cfg.post_norms, True), ("qk_norm", cfg.qk_norm, False), ("ffn_bias", cfg.ffn_bias, False),
              ("out_bias", cfg.out_bias, cfg.qkv_bias)]
    _check_fields(cfg, checks, "Gemma 2")
    if cfg.embed_scale is None or abs(cfg.embed_scale - cfg.d_model ** 0.5) > 1e-9 * cfg.d_model ** 0.5:
        raise ValueError(f"config.embed_scale={cfg.embed_scale!r}: transformers' Gemma 2 scales embeddings by "
                         f"sqrt(d_model)={cfg.d_model ** 0.5!r}")
    slides = sorted({x for x in lefts if x is not None})
    if len(slides) > 1:
        raise ValueError(f"the layers' sliding windows differ (left={slides}, per layer {lefts}): transformers' "
                         f"Gemma 2 gives every sliding layer the same window; use one window")
    scalar = cfg.head_dim if cfg.attn_scale is None else cfg.attn_scale ** -2.0
    if abs(scalar - round(scalar)) < 1e-6 * scalar:
        scalar = int(round(scalar))
    common = {k: v for k, v in common.items() if k != "hidden_act"}
    return transformers.Gemma2Config(
        **common, hidden_activation="gelu_pytorch_tanh", attention_bias=cfg.qkv_bias, query_pre_attn_scalar=scalar,
        # with no sliding layer the window is unused, but Gemma 2 builds its sliding mask anyway: one that hides nothing
        sliding_window=slides[0] + 1 if slides else cfg.max_seq_len, attn_logit_softcapping=cfg.softcap,
        final_logit_softcapping=cfg.logit_softcap,
        layer_types=["full_attention" if x is None else "sliding_attention" for x in lefts])


def hf_config(config, *, attn_implementation: str | None = None):
    """The ``transformers`` config (Llama, Mistral, Qwen2 or Gemma 2) of an :class:`attnkit.nn.DecoderConfig`."""
    transformers = _transformers()
    cfg = config
    lefts = _layer_lefts(cfg)
    rope, max_len = _hf_rope(cfg)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ff_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=max_len, rms_norm_eps=cfg.norm_eps,
                  hidden_act="silu", rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings,
                  attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_std)
    if attn_implementation is not None:
        common["attn_implementation"] = attn_implementation
    if _is_gemma(cfg):
        return _gemma2_hf_config(cfg, common, lefts)
    checks = [("positions", cfg.positions, "rope"), ("rope_interleaved", cfg.rope_interleaved, False),
              ("norm", cfg.norm, "rms"), ("norm_first", cfg.norm_first, True), ("ffn", cfg.ffn, "swiglu"),
              ("qk_norm", cfg.qk_norm, False), ("softcap", cfg.softcap, None), ("attn_scale", cfg.attn_scale, None)]
    _check_fields(cfg, checks, "Llama-family models")
    family = _hf_family(cfg, lefts)
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
        for kind in ("weight", "bias"):
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


def to_hf(model, *, attn_implementation: str | None = None):
    """Convert an :class:`attnkit.nn.DecoderLM` into the equivalent ``transformers`` causal LM.

    RoPE, RMSNorm Pre-LN and SwiGLU models become ``LlamaForCausalLM`` (no biases, or q/k/v/o biases),
    ``MistralForCausalLM`` (a causal sliding window, no biases) or ``Qwen2ForCausalLM`` (q/k/v biases; also
    full and sliding-window layers mixed through ``config.layer_masks``, one window size, as ``layer_types``);
    anything else (ALiBi, LayerNorm, GELU, soft-cap, other masks) raises ``ValueError`` naming the field.
    Gemma 2-style models (``ffn="geglu"``, ``post_norms``, ``embed_scale=sqrt(d_model)``, soft-caps, one
    sliding window on some layers) become ``Gemma2ForCausalLM``.
    ``config.attention_dropout`` becomes HF's ``attention_dropout``; ``config.dropout`` (embedding and
    residual dropout, training only) has no equivalent in these models and is not carried over.
    The result has the same dtype, device and training mode, and computes the same logits;
    ``attn_implementation`` is passed to the config (e.g. ``"attnkit"`` after :func:`register`).

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
    config = hf_config(cfg, attn_implementation=attn_implementation)
    classes = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
               "qwen2": transformers.Qwen2ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM}
    dtype, device = _dtype_device(model)
    out = classes[config.model_type](config).to(device=device, dtype=dtype)
    dims = (cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ff_dim)
    state = _to_hf_state(model.state_dict(), cfg.n_layers, cfg.tie_embeddings, dims, config.model_type,
                         cfg.norm_offset)
    out.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True)
    return out.train(model.training)
