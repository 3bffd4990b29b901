"""Language models: :class:`DecoderConfig`, :class:`DecoderLM` (decoder-only) and :class:`EncoderDecoder`."""

from __future__ import annotations

import math
import json
import os
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn

from .. import masks as _masks
from . import _checks
from .attention import AttentionConfig
from .blocks import BlockConfig, Decoder, Encoder, TransformerBlock, _cache_positions, _layer_caches, default_d_ff
from .dsa import DeepSeekSparseAttention, IndexerConfig
from .latent import LatentAttention, LatentConfig
from .moba import MoBAAttention
from .nsa import NSAAttention
from .layers import Linear, _dropout, linear, make_norm
from .positions import ALiBi, PositionEncoding, RotaryEmbedding, SinusoidalPositions, T5RelativeBias, _check_t5_layout
from .rope_scaling import RopeScaling

Tensor = torch.Tensor

__all__ = ["DecoderConfig", "DecoderLM", "EncoderDecoder"]

_POSITIONS = ("rope", "alibi", "t5", "sinusoidal", "none")


# DecoderConfig fields that hold a config dataclass of their own: to_dict writes their fields, from_dict rebuilds them
_NESTED_CONFIGS = {"indexer": IndexerConfig}


@dataclass
class DecoderConfig:
    """Configuration of a decoder-only language model (:class:`DecoderLM`); also builds :class:`EncoderDecoder`.

    Expresses Llama (``norm="rms", ffn="swiglu"``, RoPE, no biases), Mistral (plus
    ``mask=masks.sliding_window(W - 1)``), Qwen2 (plus ``qkv_bias=True``), Gemma 2 (``ffn="geglu",
    post_norms=True, embed_scale=sqrt(d_model)``, ``attn_scale``, ``softcap``, ``logit_softcap`` and
    alternating ``layer_masks``), Gemma 3 (plus ``qk_norm=True``, ``rope_local_theta``), Qwen3 (``qk_norm``),
    OLMo 2 (``qk_norm="all", pre_norms=False, post_norms=True``), SmolLM3 (``rope_layers``), Granite
    (``embed_scale``, ``attn_scale``, ``residual_scale``, ``logit_divisor``), DeepSeek-V3's multi-head latent
    attention (``kv_lora_rank``, ``q_lora_rank``, ``qk_rope_head_dim``, ``v_head_dim``; ``d_head`` is then
    ``qk_nope_head_dim``), DeepSeek-V3.2's sparse attention (plus ``indexer=IndexerConfig(...)``) as well as
    GPT-style models (``norm="layer", ffn="gelu"``, biases,
    ``positions="sinusoidal"`` or ``"alibi"``).  ``attention_sinks=True`` gives every self-attention a learned
    sink logit per head (GPT-OSS; :class:`MultiHeadAttention` ``sinks=True``).

    **Masks.**  Every layer is causal.  ``mask`` is AND-ed into every layer; ``layer_masks`` (one entry per
    layer, ``None`` for none) is AND-ed into its own layer only, on top of ``mask``: layer ``i`` attends
    under ``causal & mask & layer_masks[i]`` (:meth:`layer_mask` gives the part besides causal).  Models
    that mix full-attention and sliding-window layers (Gemma 2, Qwen2 with mixed ``layer_types``) use
    ``layer_masks``, e.g. ``(masks.sliding_window(W - 1), None) * (n_layers // 2)``.

    **Dropout** (training only): ``dropout`` on the embeddings and every residual branch,
    ``attention_dropout`` on the attention probabilities (Hugging Face's ``attention_dropout``).

    Example::

        >>> from attnkit.nn import DecoderConfig
        >>> cfg = DecoderConfig.preset("llama-like")
        >>> cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.vocab_size
        (512, 8, 8, 1408, 32000)
        >>> DecoderConfig.preset("tiny", positions="alibi").positions
        'alibi'
        >>> from attnkit import masks
        >>> cfg = DecoderConfig.preset("tiny", n_layers=4, layer_masks=(masks.sliding_window(3), None) * 2)
        >>> cfg.layer_mask(0), cfg.layer_mask(1)
        (sliding_window(left=3, right=0, align='bottom_right'), None)
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # key/value heads (grouped-query); None = n_heads, 1 = multi-query
    d_head: int | None = None  # None = d_model // n_heads
    d_ff: int | None = None  # feed-forward hidden width (Llama's intermediate_size); None = default_d_ff
    max_seq_len: int = 2048  # positions >= this raise, unless the position method extrapolates (alibi, t5, none)
    positions: str = "rope"  # "rope" | "alibi" | "t5" | "sinusoidal" | "none"
    rope_theta: float = 10000.0
    # a dict {"type": "linear" | "ntk" | "llama3" | "yarn" | "longrope" | "dynamic", ...} (Hugging Face's form too),
    # or a typed attnkit.nn.RopeScaling, kept as its dict (RopeScaling.to_dict: the JSON form)
    rope_scaling: dict | None = None
    rotary_dim: int | None = None  # partial rotary: rotate the first rotary_dim dims of each head
    rope_interleaved: bool = False  # pair dims (2i, 2i+1) instead of (i, i + d/2)
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    mask: _masks.Mask | None = None  # every layer: AND-ed with causal, e.g. masks.sliding_window(4095) (Mistral)
    layer_masks: tuple[_masks.Mask | None, ...] | None = None  # one per layer, AND-ed with causal and mask
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    norm_offset: float = 0.0  # RMSNorm multiplies by norm_offset + weight (Gemma: 1.0, its weights stored as w - 1)
    norm_first: bool = True  # Pre-LN (with a final norm); False = Post-LN
    ffn: str = "swiglu"  # "swiglu" | "gelu" | "geglu" (gated tanh-GELU, Gemma)
    qkv_bias: bool = False  # bias on the q/k/v projections (Qwen2: True)
    out_bias: bool = False  # bias on the attention output projection
    ffn_bias: bool = False  # biases in the feed-forward network
    qk_norm: bool | str = False  # RMSNorm per query/key head (True, "head"), or over all heads at once ("all": OLMo 2)
    softcap: float | None = None  # attention score softcap
    attention_sinks: bool = False  # a learned sink logit per head in every softmax denominator (GPT-OSS)
    attn_scale: float | None = None  # score scale; None = 1/sqrt(d_head) (Gemma 2: query_pre_attn_scalar^-0.5)
    post_norms: bool = False  # Pre-LN plus a norm on each sub-layer's output before its residual add (Gemma 2)
    pre_norms: bool = True  # False (with post_norms): only the sub-layers' outputs are normalised (OLMo 2)
    residual_scale: float = 1.0  # sub-layer outputs times this before the residual add (Granite's residual_multiplier)
    embed_scale: float | None = None  # token embeddings times this (Gemma: sqrt(d_model))
    logit_softcap: float | None = None  # s * tanh(logits / s) on the output logits (Gemma 2: 30)
    logit_divisor: float | None = None  # output logits divided by this (Granite's logits_scaling)
    rope_local_theta: float | None = None  # rope base of the layers with a layer_masks entry (Gemma 3; unscaled)
    rope_layers: tuple[bool, ...] | None = None  # one per layer; False: no positions there (SmolLM3's NoPE layers)
    # multi-head latent attention (DeepSeek-V2/V3, LatentAttention) when kv_lora_rank is set; d_head is then the
    # heads' dims without positions (qk_nope_head_dim), the scale 1/sqrt(d_head + qk_rope_head_dim) unless attn_scale
    kv_lora_rank: int | None = None  # MLA: the latent's width (a cache stores kv_lora_rank + qk_rope_head_dim)
    q_lora_rank: int | None = None  # MLA: rank of the query projection; None = a full projection
    qk_rope_head_dim: int | None = None  # MLA: rotary dims per head, one rotary key shared by every head
    v_head_dim: int | None = None  # MLA: value dims per head; None = d_head
    # DeepSeek sparse attention (DeepSeek-V3.2): an IndexerConfig gives every latent-attention layer a lightning
    # indexer, and each query attends to its top-k keys (DeepSeekSparseAttention); needs kv_lora_rank
    indexer: IndexerConfig | None = None
    tie_embeddings: bool = True  # the output head reuses the token embedding
    dropout: float = 0.0  # embedding and residual dropout (training)
    attention_dropout: float = 0.0  # dropout on the attention probabilities (training)
    init_std: float = 0.02
    backend: str = "auto"
    # content-based sparse attention in every layer: {"method": "moba", "block": 64, "top_k": 8} (MoBAAttention) or
    # {"method": "nsa", ...} (NSAAttention; options compress_block, compress_stride, select_block, select_count, window)
    sparse_attention: dict | None = None

    _PRESETS = {
        "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=512),
        "small": dict(vocab_size=32000, d_model=256, n_layers=4, n_heads=4, max_seq_len=1024),
        "llama-like": dict(
            vocab_size=32000,
            d_model=512,
            n_layers=8,
            n_heads=8,
            d_ff=1408,
            max_seq_len=2048,
            norm_eps=1e-6,
            tie_embeddings=False,
        ),
    }

    def __post_init__(self):
        self._check_values()
        self._check_combinations()
        self._check_masks_and_positions()

    def _check_values(self) -> None:
        """Each field alone (flags become bools)."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "t5_max_distance"):
            _checks.positive_int(name, getattr(self, name))
        for name in (
            "rope_interleaved",
            "norm_first",
            "qkv_bias",
            "out_bias",
            "ffn_bias",
            "post_norms",
            "tie_embeddings",
            "attention_sinks",
        ):
            setattr(self, name, _checks.flag(name, getattr(self, name)))
        if not isinstance(self.qk_norm, str):  # a flag, or one of the named layouts checked below
            self.qk_norm = _checks.flag("qk_norm", self.qk_norm)
        self.n_kv_heads_, self.d_head_ = _checks.head_layout(self.d_model, self.n_heads, self.n_kv_heads, self.d_head)
        _checks.choice("positions", self.positions, _POSITIONS)
        _checks.choice("norm", self.norm, ("rms", "layer"))
        _checks.choice("ffn", self.ffn, ("swiglu", "gelu", "geglu"))
        _checks.positive_int("d_ff", self.d_ff, allow_none=True)
        _checks.positive_int("rotary_dim", self.rotary_dim, allow_none=True)
        _checks.positive_float("rope_theta", self.rope_theta)
        if isinstance(self.rope_scaling, RopeScaling):
            self.rope_scaling = self.rope_scaling.to_dict()
        elif self.rope_scaling is not None:  # errors at configuration time, not when building
            RopeScaling.from_hf(self.rope_scaling, self.rope_theta)
        _checks.positive_float("norm_eps", self.norm_eps)
        self.norm_offset = _checks.finite_float("norm_offset", self.norm_offset)
        for name in ("softcap", "attn_scale", "embed_scale", "logit_softcap", "logit_divisor", "rope_local_theta"):
            _checks.positive_float(name, getattr(self, name), allow_none=True)
        _checks.positive_float("residual_scale", self.residual_scale)
        _checks.positive_float("init_std", self.init_std)
        _checks.probability("dropout", self.dropout)
        _checks.probability("attention_dropout", self.attention_dropout)

    def _check_combinations(self) -> None:
        """Fields that constrain each other."""
        if self.norm_offset and self.norm != "rms":
            raise ValueError(
                f"norm_offset={self.norm_offset!r} applies to RMSNorm only: use norm='rms' or norm_offset=0.0"
            )
        if not self.pre_norms and not self.post_norms:
            raise ValueError("pre_norms=False needs post_norms=True (OLMo 2 normalises only the sub-layers' outputs)")
        if self.qk_norm not in (False, True, "head", "all"):
            raise ValueError(
                f"qk_norm={self.qk_norm!r} must be False, True / 'head' (RMSNorm per head) or 'all' "
                f"(over all heads at once)"
            )
        self.rope_layers = _check_rope_layers(self.rope_layers, self.n_layers, self.positions)
        if self.attention_sinks and self.kv_lora_rank is not None:
            raise ValueError(
                "attention_sinks=True applies to multi-head attention layers; latent attention "
                "(kv_lora_rank) has no sinks: pass attention_sinks=False or kv_lora_rank=None"
            )
        if self.rope_local_theta is not None and (self.positions != "rope" or self.layer_masks is None):
            raise ValueError(
                f"rope_local_theta={self.rope_local_theta!r} is the rope base of the layers with a "
                f"layer_masks entry: it needs positions='rope' and layer_masks (got positions="
                f"{self.positions!r}, layer_masks={self.layer_masks!r})"
            )
        if self.post_norms and not self.norm_first:
            raise ValueError(
                "post_norms=True needs norm_first=True (Pre-LN): a Post-LN block already normalises "
                "after every residual add"
            )

    def _check_masks_and_positions(self) -> None:
        if self.positions == "t5":  # the bucket layout's errors at configuration time, not when building
            for bidirectional in (False, True):
                try:
                    _check_t5_layout(
                        self.n_heads, self.t5_num_buckets, self.t5_max_distance, bidirectional=bidirectional
                    )
                except (TypeError, ValueError) as e:
                    raise type(e)(
                        f"t5_num_buckets={self.t5_num_buckets!r}, t5_max_distance={self.t5_max_distance!r}: {e}"
                    ) from None
        _checks.causal_model_mask("mask", self.mask)
        self.layer_masks = _check_layer_masks(self.layer_masks, self.n_layers)
        self._check_latent()
        self.sparse_attention = _check_sparse_attention(self.sparse_attention, self.latent, self.positions)
        if self.positions == "rope" and self.rotary_dim is None and self.d_head_ % 2 and not self.kv_lora_rank:
            raise ValueError(
                f"positions='rope' rotates pairs of channels: the head size d_head={self.d_head_} must "
                f"be even (pick d_model/n_heads or d_head even, or rotary_dim=an even size)"
            )
        if self.rotary_dim is not None and (self.rotary_dim > self.d_head_ or self.rotary_dim % 2):
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= d_head={self.d_head_}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"positions='sinusoidal' needs an even d_model, got {self.d_model}")

    def _check_latent(self) -> None:
        for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            _checks.positive_int(name, getattr(self, name), allow_none=True)
        if self.indexer is not None and not isinstance(self.indexer, IndexerConfig):
            raise TypeError(
                f"indexer must be an attnkit.nn.IndexerConfig (DeepSeek sparse attention), got "
                f"{type(self.indexer).__name__}"
            )
        if self.indexer is not None and self.kv_lora_rank is None:
            raise ValueError(
                "indexer= (DeepSeek sparse attention) selects keys for latent attention layers: set "
                "kv_lora_rank and qk_rope_head_dim too (or indexer=None)"
            )
        if self.kv_lora_rank is None:
            for name in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} is a field of multi-head latent attention: set "
                        f"kv_lora_rank too (or {name}=None)"
                    )
            return
        if self.qk_rope_head_dim is None or self.qk_rope_head_dim % 2:
            raise ValueError(
                f"kv_lora_rank={self.kv_lora_rank} (latent attention) needs qk_rope_head_dim, an even "
                f"number of rotary dims per head, got {self.qk_rope_head_dim!r}"
            )
        for name, value, want in (
            ("positions", self.positions, ("rope", "none")),
            ("n_kv_heads", self.n_kv_heads, (None, self.n_heads)),
            ("qk_norm", self.qk_norm, (False,)),
            ("softcap", self.softcap, (None,)),
            ("rotary_dim", self.rotary_dim, (None,)),
            ("rope_local_theta", self.rope_local_theta, (None,)),
        ):
            if value not in want:
                raise ValueError(
                    f"{name}={value!r} is not available with latent attention (kv_lora_rank="
                    f"{self.kv_lora_rank}): use {name}={want[0]!r}"
                )

    @property
    def latent(self) -> bool:
        """Whether the layers use multi-head latent attention (``kv_lora_rank`` is set)."""
        return self.kv_lora_rank is not None

    @classmethod
    def preset(cls, name: str, **overrides) -> "DecoderConfig":
        """A named configuration, with fields overridden by keyword.

        ``"tiny"``: vocab 256, d_model 64, 2 layers, 4 heads (tests, demos).  ``"small"``: vocab 32000,
        d_model 256, 4 layers, 4 heads.  ``"llama-like"``: vocab 32000, hidden 512, 8 layers, 8 heads,
        intermediate 1408, RMSNorm eps 1e-6, untied embeddings (Hugging Face ``LlamaConfig`` of that size).
        """
        if name not in cls._PRESETS:
            raise ValueError(f"unknown preset {name!r}: choose one of {sorted(cls._PRESETS)}")
        return cls(**{**cls._PRESETS[name], **overrides})

    def replace(self, **changes) -> "DecoderConfig":
        """A copy with some fields changed (validated)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (masks as :meth:`attnkit.masks.Mask.to_dict` gives them, tuples as
        lists); :meth:`from_dict` rebuilds an equal config.  A mask that cannot be serialised (made from a
        Python function or a tensor) raises ValueError.

        Example::

            >>> from attnkit import masks
            >>> cfg = DecoderConfig.preset("tiny", mask=masks.sliding_window(7))
            >>> cfg.to_dict()["mask"]
            {'mask': "sliding_window(left=7, right=0, align='bottom_right')"}
            >>> DecoderConfig.from_dict(cfg.to_dict()) == cfg
            True
        """
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "mask":
                value = _mask_dict(f.name, value)
            elif f.name == "layer_masks" and value is not None:
                value = [_mask_dict(f"layer_masks[{i}]", m) for i, m in enumerate(value)]
            elif f.name in _NESTED_CONFIGS and value is not None:
                value = asdict(value)
            out[f.name] = _json_ready(value)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "DecoderConfig":
        """The config a :meth:`to_dict` dict describes (validated as any config)."""
        if not isinstance(data, dict):
            raise TypeError(f"DecoderConfig.from_dict takes a dict (DecoderConfig.to_dict), got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"DecoderConfig.from_dict: unknown fields {unknown} (known: {sorted(names)})")
        kw = dict(data)
        if kw.get("mask") is not None:
            kw["mask"] = _masks.from_dict(kw["mask"])
        if kw.get("layer_masks") is not None:
            kw["layer_masks"] = tuple(None if m is None else _masks.from_dict(m) for m in kw["layer_masks"])
        if kw.get("rope_layers") is not None:
            kw["rope_layers"] = tuple(kw["rope_layers"])
        for name, config_cls in _NESTED_CONFIGS.items():
            if isinstance(kw.get(name), dict):
                kw[name] = config_cls(**kw[name])
        return cls(**kw)

    def layer_mask(self, i: int) -> _masks.Mask | None:
        """Layer ``i``'s mask besides causal: ``mask`` AND-ed with ``layer_masks[i]`` (None: causal only).

        Example::

            >>> from attnkit import masks
            >>> cfg = DecoderConfig.preset("tiny", mask=masks.sliding_window(7),
            ...                            layer_masks=(None, masks.sliding_window(3)))
            >>> cfg.layer_mask(0)
            sliding_window(left=7, right=0, align='bottom_right')
            >>> print(cfg.layer_mask(1).to_dense(5, 5).int()[0, 0])  # both windows: the narrower one wins
            tensor([[1, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0],
                    [1, 1, 1, 0, 0],
                    [1, 1, 1, 1, 0],
                    [0, 1, 1, 1, 1]], dtype=torch.int32)
        """
        i = _checks.int_in_range(
            "i", i, 0, self.n_layers, fix=f" (a layer index: the model has {self.n_layers} layers)"
        )
        own = None if self.layer_masks is None else self.layer_masks[i]
        return _checks.combine(_checks.as_mask("mask", self.mask), own)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads_

    @property
    def head_dim(self) -> int:
        return self.d_head_

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else default_d_ff(self.d_model, self.ffn)

    def block_config(self) -> BlockConfig:
        """What every layer is built from (:meth:`TransformerBlock.from_config`), besides its positions and
        mask: the layers' :class:`BlockConfig` with the self-attention's :class:`AttentionConfig`.

        ``attn_scale`` becomes the attention's ``temperature`` (the scale is ``1 / (sqrt(d_head) *
        temperature)``); the q/k norms take ``norm_eps`` and ``norm_offset``.  A latent-attention model
        (``kv_lora_rank``) gives its layers a built :class:`LatentAttention` instead of ``attention``.

        Example::

            >>> cfg = DecoderConfig.preset("tiny", n_kv_heads=2, attn_scale=0.25)
            >>> block = cfg.block_config()
            >>> block.norm, block.ffn, block.d_ff, block.attention.n_kv_heads, block.attention.temperature
            ('rms', 'swiglu', 192, 2, 1.0)
        """
        temperature = 1.0 if self.attn_scale is None else 1.0 / (self.attn_scale * math.sqrt(self.head_dim))
        attention = AttentionConfig(
            self.d_model,
            self.n_heads,
            self.n_kv_heads,
            self.d_head,
            bias=self.qkv_bias,
            out_bias=self.out_bias,
            dropout=self.attention_dropout,
            qk_norm=self.qk_norm,
            qk_norm_eps=self.norm_eps,
            qk_norm_offset=self.norm_offset,
            softcap=self.softcap,
            temperature=temperature,
            sinks=self.attention_sinks,
            backend=self.backend,
        )
        return BlockConfig(
            attention,
            self.ff_dim,
            dropout=self.dropout,
            norm_first=self.norm_first,
            norm=self.norm,
            norm_eps=self.norm_eps,
            norm_offset=self.norm_offset,
            ffn=self.ffn,
            ffn_bias=self.ffn_bias,
            post_norms=self.post_norms,
            pre_norms=self.pre_norms,
            residual_scale=self.residual_scale,
        )


def _mask_dict(name: str, mask) -> dict | None:
    if mask is None:
        return None
    try:
        return mask.to_dict()
    except ValueError as e:
        raise ValueError(f"config.{name}: {e}") from None


def _json_ready(value):
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    return value


_SPARSE_METHODS = {  # method -> its options with their defaults
    "moba": {"block": 64, "top_k": 8},
    "nsa": {"compress_block": 32, "compress_stride": 16, "select_block": 64, "select_count": 16, "window": 512},
}


def _check_sparse_attention(value, latent: bool, positions: str) -> dict | None:
    """``sparse_attention`` with every option of its method filled in (None: full attention)."""
    if value is None:
        return None
    if not isinstance(value, dict) or "method" not in value:
        raise TypeError(
            f"sparse_attention must be None or a dict with a 'method' ({sorted(_SPARSE_METHODS)}) and its "
            f"options, e.g. {{'method': 'moba', 'block': 64, 'top_k': 8}}; got {value!r}"
        )
    method = _checks.choice("sparse_attention['method']", value["method"], tuple(_SPARSE_METHODS))
    defaults = _SPARSE_METHODS[method]
    unknown = sorted(set(value) - set(defaults) - {"method"})
    if unknown:
        raise ValueError(
            f"sparse_attention: {unknown} are not options of {method!r}; its options are {sorted(defaults)}"
        )
    if latent:
        raise ValueError(
            f"sparse_attention={value!r} applies to multi-head attention layers, not to latent "
            f"attention (kv_lora_rank): set one of them only"
        )
    if method == "nsa" and positions in ("alibi", "t5"):
        raise ValueError(
            f"sparse_attention method 'nsa' takes positions='rope', 'sinusoidal' or 'none', got "
            f"positions={positions!r}: its compressed keys have no single position for a score bias"
        )
    return {"method": method, **defaults, **{n: v for n, v in value.items() if n != "method"}}


def _check_layer_masks(value, n_layers: int) -> tuple[_masks.Mask | None, ...] | None:
    """``layer_masks`` as a tuple of ``n_layers`` Masks or Nones (bool tensors become Masks)."""
    if value is None:
        return None
    if isinstance(value, (_masks.Mask, torch.Tensor)) or not isinstance(value, (list, tuple)):
        raise TypeError(
            f"layer_masks must be a tuple with one Mask (or None) per layer, got "
            f"{type(value).__name__}: for one mask on every layer use mask=... instead"
        )
    if len(value) != n_layers:
        raise ValueError(
            f"layer_masks has {len(value)} entries but n_layers={n_layers}: give exactly one Mask or "
            f"None per layer (None: that layer is causal only), e.g. "
            f"(masks.sliding_window(W - 1), None) * {n_layers // 2 or 1} for alternating layers"
        )
    return tuple(_checks.causal_model_mask(f"layer_masks[{i}]", m) for i, m in enumerate(value))


def _check_rope_layers(value, n_layers: int, positions: str) -> tuple[bool, ...] | None:
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != n_layers
        or not all(isinstance(x, (bool, int)) and x in (0, 1) for x in value)
    ):
        raise ValueError(
            f"rope_layers={value!r} must give one bool per layer ({n_layers}): False for a layer without positions"
        )
    if positions != "rope":
        raise ValueError(f"rope_layers is for positions='rope', got positions={positions!r}")
    return tuple(bool(x) for x in value)


def _make_positions(cfg: DecoderConfig, *, bidirectional: bool) -> PositionEncoding | None:
    if cfg.positions == "rope" and cfg.latent:
        return RotaryEmbedding(
            cfg.qk_rope_head_dim, base=cfg.rope_theta, interleaved=cfg.rope_interleaved, scaling=cfg.rope_scaling
        )
    if cfg.positions == "rope":
        return RotaryEmbedding(
            cfg.rotary_dim or cfg.head_dim,
            base=cfg.rope_theta,
            interleaved=cfg.rope_interleaved,
            scaling=cfg.rope_scaling,
        )
    if cfg.positions == "alibi":
        return ALiBi(cfg.n_heads)
    if cfg.positions == "t5":
        return T5RelativeBias(cfg.n_heads, cfg.t5_num_buckets, cfg.t5_max_distance, bidirectional=bidirectional)
    return None


class _LMBase(nn.Module):
    """Token embedding, optional sinusoidal positions, output head; shared by the two models."""

    def _build_io(self, cfg: DecoderConfig):
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.abs_positions = SinusoidalPositions(cfg.d_model) if cfg.positions == "sinusoidal" else None
        self.drop = _dropout(cfg.dropout)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def _init_weights(self, n_layers: int):
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            if name.endswith("table"):  # T5 buckets
                nn.init.normal_(p, std=std)
            elif name.endswith(("out_proj.weight", "down_proj.weight")):  # residual branches, GPT-2 style
                nn.init.normal_(p, std=std / math.sqrt(2 * n_layers))
            else:
                nn.init.normal_(p, std=std)
        if self.abs_positions is not None:  # the original Transformer: embeddings * sqrt(d) join unit-size waves
            nn.init.normal_(self.embed.weight, std=self.config.d_model**-0.5)

    def _check_positions(self, pos: Tensor) -> int:
        """The largest position (read from the tensor), checked against ``max_seq_len``."""
        cfg = self.config
        if pos.numel() == 0:
            return 0
        if torch.compiler.is_compiling():  # reading the tensor would split the graph: check inside it instead
            rope = getattr(self, "positions", None)
            if isinstance(rope, RotaryEmbedding) and rope.length_dependent:
                raise ValueError(
                    f"rope scaling {rope.scaling.type!r} picks its frequencies from the largest "  # type: ignore[union-attr]
                    f"position, which a compiled forward does not read from given positions: call "
                    f"it with positions=None (the cache's offset) or without torch.compile"
                )
            torch._assert_async((pos >= 0).all(), "positions must be >= 0")
            if cfg.positions not in ("alibi", "t5", "none"):
                torch._assert_async(
                    (pos < cfg.max_seq_len).all(),
                    f"positions must be < max_seq_len="
                    f"{cfg.max_seq_len} (positions={cfg.positions!r} does not extrapolate)",
                )
            return cfg.max_seq_len - 1  # a bound, not the maximum: sizes the rotary table without a read
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0:
            raise ValueError(f"positions must be >= 0, got {lo}")
        self._check_max(hi)
        return hi

    def _check_max(self, hi: int) -> None:
        cfg = self.config
        if hi >= cfg.max_seq_len and cfg.positions not in ("alibi", "t5", "none"):
            raise ValueError(
                f"position {hi} is beyond max_seq_len={cfg.max_seq_len} and positions="
                f"{cfg.positions!r} does not extrapolate: raise max_seq_len (with rope_scaling for "
                f"RoPE) or use positions='alibi'"
            )

    def _embed(self, ids: Tensor, pos: Tensor) -> Tensor:
        w = self.embed.weight
        if w.stride(0) == 1 and w.shape[0] > 1:  # column-major (a tied head laid out for batches): gather columns
            x = w.t().index_select(1, ids.reshape(-1)).t().reshape(*ids.shape, w.shape[1])  # (B, L, d_model)
        else:
            x = self.embed(ids)  # (B, L, d_model)
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)  # rounded to the weights' dtype, as HF
        if self.abs_positions is not None:
            x = x * math.sqrt(self.config.d_model) + self.abs_positions.encode(pos).to(x.dtype)
        return self.drop(x)

    def _logits(self, x: Tensor) -> Tensor:
        logits = linear(x, self.embed.weight) if self.lm_head is None else self.lm_head(x)  # (B, L, vocab)
        if self.config.logit_divisor is not None:
            logits = logits / self.config.logit_divisor
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _positions(self, ids: Tensor, cache, positions) -> tuple[Tensor, int]:
        """Absolute positions ``(L,)`` or ``(B, L)`` and the largest one, checked against ``max_seq_len``."""
        B, L = ids.shape
        pos = _cache_positions(cache, B, L, ids.device, positions)
        if positions is None:  # seq_len + arange(L): the bound is known without reading the tensor
            hi = (0 if cache is None else int(cache.seq_len)) + L - 1  # seq_len was validated above
            if L:
                self._check_max(hi)
        else:
            hi = self._check_positions(pos)
        return pos, hi


class DecoderLM(_LMBase):
    """A decoder-only language model: token embedding, ``n_layers`` causal :class:`TransformerBlock` s,
    final norm (Pre-LN), output head (tied to the embedding by default).

    Submodules (for converting checkpoints): ``embed`` (``nn.Embedding``), ``layers[i]`` with
    ``attn_norm``, ``attn.qkv_proj`` (rows ``[q; k; v]``), ``attn.out_proj``, ``ffn_norm``,
    ``ffn.up_proj`` (SwiGLU: rows ``[gate; up]``), ``ffn.down_proj``; ``norm``; ``lm_head`` (``None`` when
    tied).  Weights are row-major like ``nn.Linear``'s, the fastest layout for decoding up to 3 sequences
    a step on CPU; :func:`attnkit.generate` and :class:`attnkit.decoding.Engine` decode bigger batches through
    copies of their own (oneDNN's blocked layout), and :func:`attnkit.nn.to_decode_layout` lays the model out in place.

    ``forward(ids (B, L) long, *, cache=None, positions=None, mask=None) -> logits (B, L, vocab_size)``.

    * ``cache``: a model-level KV cache with ``cache.layers`` (one per-layer cache per layer, see
      :class:`MultiHeadAttention` for the per-layer protocol) and ``cache.seq_len`` (int, tokens stored
      before this call, read once at the start).
    * ``positions``: absolute positions ``(L,)`` or ``(B, L)`` (ragged batches); default
      ``cache.seq_len + arange(L)`` (``arange(L)`` without a cache).  They drive RoPE and sinusoidal
      positions; ALiBi and T5 use relative distances in key order.  Beyond ``max_seq_len`` raises unless
      the method extrapolates (ALiBi, T5, none).
    * ``mask``: extra mask for this call, AND-ed in every layer with the layer's own mask (causal,
      ``config.mask`` and ``config.layer_masks[i]``), e.g. ``masks.key_padding(lengths)`` or a bool
      ``(B, 1, L, Lk)`` tensor.
    * ``logits_at``: a 1-D long tensor of indices along ``L``: only those rows go through the final norm and
      the output head, and the result is ``(B, len(logits_at), vocab_size)`` (a prefill needs the last
      row's logits alone).

    Layer ``i`` is built with the mask ``causal & config.layer_mask(i)``; ``layers[i].attn.mask`` shows it.

    A decoder-only model has no cross attention; for encoder-decoder caching (the cross caches filled once
    from the encoder output) see :class:`EncoderDecoder` and :class:`MultiHeadAttention`.

    Example::

        >>> import torch
        >>> from attnkit.nn import DecoderConfig, DecoderLM
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> model(torch.randint(0, 256, (2, 12))).shape
        torch.Size([2, 12, 256])
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"DecoderLM takes a DecoderConfig, got {type(config).__name__}")
        cfg = config
        self._build_io(cfg)
        self.positions = _make_positions(cfg, bidirectional=False)
        self.local_positions = None  # the sliding layers' own rotary embedding (rope_local_theta)
        if cfg.rope_local_theta is not None:
            self.local_positions = RotaryEmbedding(
                cfg.rotary_dim or cfg.head_dim, base=cfg.rope_local_theta, interleaved=cfg.rope_interleaved
            )
        block = cfg.block_config()
        self.layers = nn.ModuleList(
            TransformerBlock(
                block,
                positions=self._layer_positions(i),
                mask=self._layer_mask(i),
                attn=self._latent_attention(i) or self._sparse_attention(i, block),
            )
            for i in range(cfg.n_layers)
        )
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_offset) if cfg.norm_first else None
        self._init_weights(cfg.n_layers)

    CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write the model to ``directory`` (created if needed): ``config.json`` (:meth:`DecoderConfig.to_dict`)
        and ``model.safetensors`` (the weights in their dtype).  :meth:`from_pretrained` reads it back.  This is
        the way to store a model: a whole-model pickle (``torch.save(model)``) does not load with
        ``torch.load(weights_only=True)``; a ``state_dict()`` does.

        Example::

            >>> import tempfile, torch
            >>> from attnkit.nn import DecoderConfig, DecoderLM
            >>> model = DecoderLM(DecoderConfig.preset("tiny")).eval()
            >>> with tempfile.TemporaryDirectory() as d:
            ...     model.save_pretrained(d)
            ...     loaded = DecoderLM.from_pretrained(d)
            >>> ids = torch.tensor([[1, 2, 3]])
            >>> torch.equal(loaded(ids), model(ids)), loaded.config == model.config
            (True, True)
        """
        from safetensors.torch import save_model

        config = {"architecture": "DecoderLM", "config": self.config.to_dict()}  # before writing: mask errors
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, self.CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
        save_model(self, os.path.join(directory, self.WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, device: str | torch.device = "cpu") -> "DecoderLM":
        """The model :meth:`save_pretrained` wrote to ``directory``, in eval mode, its weights in the dtype
        they were saved in, on ``device``.  Building it leaves the global random generator as it was."""
        from safetensors import safe_open
        from safetensors.torch import load_model

        path = os.path.join(directory, cls.CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"DecoderLM.from_pretrained: no {cls.CONFIG_NAME} in {str(directory)!r}: pass "
                f"a directory written by DecoderLM.save_pretrained"
            )
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or saved.get("architecture") != "DecoderLM" or "config" not in saved:
            raise ValueError(
                f"{path} is not a DecoderLM config (save_pretrained writes "
                f"{{'architecture': 'DecoderLM', 'config': ...}})"
            )
        config = DecoderConfig.from_dict(saved["config"])
        weights = os.path.join(directory, cls.WEIGHTS_NAME)
        with safe_open(weights, framework="pt") as f:
            first = next(iter(f.keys()), None)
            dtype = f.get_slice(first).get_dtype() if first is not None else None
        with torch.random.fork_rng(devices=[]):  # the initial weights are overwritten: draw nothing of the caller's
            model = cls(config)
        if dtype is not None:
            model.to(
                getattr(
                    torch,
                    {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}.get(dtype, "float32"),
                )
            )
        model.to(device)
        load_model(model, weights, strict=True, device=str(device))
        return model.eval()

    def _latent_attention(self, i: int) -> LatentAttention | None:
        cfg = self.config
        if not cfg.latent:
            return None
        kind, extra = (
            (LatentAttention, {}) if cfg.indexer is None else (DeepSeekSparseAttention, {"indexer": cfg.indexer})
        )
        ranks = dict(kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim)  # (set: cfg.latent)
        latent = LatentConfig(
            cfg.d_model,
            cfg.n_heads,
            q_lora_rank=cfg.q_lora_rank,
            qk_nope_head_dim=cfg.head_dim,
            v_head_dim=cfg.v_head_dim or cfg.head_dim,
            scale=cfg.attn_scale,
            bias=cfg.qkv_bias,
            out_bias=cfg.out_bias,
            dropout=cfg.attention_dropout,
            backend=cfg.backend,
            **ranks,
        )  # type: ignore[arg-type]
        return kind(latent, positions=self._layer_positions(i), mask=self._layer_mask(i), **extra)

    def _sparse_attention(self, i: int, block: BlockConfig) -> nn.Module | None:
        """Layer ``i``'s content-based sparse attention (``config.sparse_attention``), or None."""
        sparse = self.config.sparse_attention
        if sparse is None:
            return None
        options = {n: v for n, v in sparse.items() if n != "method"}
        kind = {"moba": MoBAAttention, "nsa": NSAAttention}[sparse["method"]]
        return kind.from_config(
            block.attention, positions=self._layer_positions(i), mask=self._layer_mask(i), **options
        )

    def _layer_mask(self, i: int) -> _masks.Mask:
        return _checks.combine(_masks.causal(), self.config.layer_mask(i))

    def _layer_positions(self, i: int) -> PositionEncoding | None:
        cfg = self.config
        if cfg.rope_layers is not None and not cfg.rope_layers[i]:
            return None
        if self.local_positions is not None and cfg.layer_masks[i] is not None:
            return self.local_positions
        return self.positions

    def forward(self, ids: Tensor, *, cache=None, positions=None, mask=None, logits_at: Tensor | None = None) -> Tensor:
        _checks.token_ids("ids", ids, self.config.vocab_size)
        if logits_at is not None and (
            not isinstance(logits_at, Tensor) or logits_at.dim() != 1 or logits_at.dtype != torch.long
        ):
            raise TypeError(
                f"logits_at must be a 1-D long tensor of indices along L (the positions whose logits to "
                f"compute), got {logits_at!r:.80}"
            )
        caches = _layer_caches(cache, "layers", len(self.layers))
        pos, hi = self._positions(ids, cache, positions)
        ropes = [r for r in (self.positions, self.local_positions) if isinstance(r, RotaryEmbedding)]
        ropes = ropes if ids.shape[1] else []
        x = self._embed(ids, pos)
        for rope in ropes:
            rope._share(pos, hi)  # one cos/sin gather for every layer
        try:
            for layer, c in zip(self.layers, caches):
                x = layer(x, mask=mask, cache=c, positions=pos)
        finally:
            for rope in ropes:
                rope._share(None)
        if logits_at is not None:
            x = x[:, logits_at]  # (B, len(logits_at), d_model): the output head runs on these rows only
        if self.norm is not None:
            x = self.norm(x)
        return self._logits(x)


class EncoderDecoder(_LMBase):
    """An encoder-decoder (sequence-to-sequence) model with one shared vocabulary (as T5).

    The encoder is bidirectional (T5 positions bucket both directions), the decoder causal with cross
    attention to the encoder output ``memory``.  ``config`` gives the decoder (and, unless
    ``n_encoder_layers`` is given, the encoder depth); ``config.mask`` applies to the decoder only
    (``config.layer_masks`` is for :class:`DecoderLM`: here it raises ``ValueError``).

    * ``encode(src (B, Ls), *, src_mask=None) -> memory (B, Ls, d_model)``; ``src_mask`` (e.g.
      ``masks.key_padding(lengths)``) masks the encoder's keys.
    * ``decode(tgt (B, L), memory, *, memory_mask=None, cache=None, positions=None) -> logits``;
      ``memory_mask`` masks the memory's keys in cross attention (give the source's key padding again).
    * ``forward(src, tgt, *, src_mask=None) = decode(tgt, encode(src, src_mask), memory_mask=src_mask)``.

    **Caching** (incremental decoding): ``cache.layers[i]`` is layer ``i``'s self-attention cache,
    ``cache.cross_layers[i]`` its cross-attention cache, ``cache.seq_len`` the target tokens already
    stored.  Compute ``memory`` once and pass it to every ``decode`` call; on the first call each cross
    cache has ``seq_len == 0``, the layer projects ``memory`` to keys/values ``(B, Hkv, Ls, d_head)`` and
    calls ``cross_cache.update(k, v)`` once; on later calls it skips the projection and calls
    ``cross_cache.update`` with zero-length keys/values, using the stored ones.  A plain appending
    per-layer cache with ``seq_len`` works as a cross cache.

    Example::

        >>> import torch
        >>> from attnkit.nn import DecoderConfig, EncoderDecoder
        >>> model = EncoderDecoder(DecoderConfig.preset("tiny", positions="t5"))
        >>> model(torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 5))).shape
        torch.Size([2, 5, 256])
    """

    def __init__(self, config: DecoderConfig, n_encoder_layers: int | None = None):
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"EncoderDecoder takes a DecoderConfig, got {type(config).__name__}")
        cfg = config
        if cfg.layer_masks is not None:
            raise ValueError(
                "config.layer_masks is not supported by EncoderDecoder (its decoder applies config.mask "
                "to every layer): set layer_masks=None, or use DecoderLM for per-layer masks"
            )
        if cfg.latent:
            raise ValueError("latent attention (config.kv_lora_rank) is not supported by EncoderDecoder: use DecoderLM")
        if cfg.rope_layers is not None:
            raise ValueError(
                "config.rope_layers is not supported by EncoderDecoder: use DecoderLM for layers without positions"
            )
        n_enc = cfg.n_layers if n_encoder_layers is None else _checks.positive_int("n_encoder_layers", n_encoder_layers)
        self._build_io(cfg)
        self.encoder_positions = _make_positions(cfg, bidirectional=True)
        self.decoder_positions = (
            self.encoder_positions if cfg.positions in ("rope", "alibi") else _make_positions(cfg, bidirectional=False)
        )
        block = cfg.block_config()
        self.encoder = Encoder(block, n_enc, positions=self.encoder_positions)
        self.decoder = Decoder(
            block.replace(cross_attention=True), cfg.n_layers, positions=self.decoder_positions, mask=cfg.mask
        )
        self._init_weights(cfg.n_layers + n_enc)

    def encode(self, src: Tensor, *, src_mask=None) -> Tensor:
        _checks.token_ids("src", src, self.config.vocab_size)
        pos, hi = self._positions(src, None, None)
        with self.encoder._shared_rotary(pos, hi):  # one cos/sin gather for every layer
            return self.encoder(self._embed(src, pos), mask=src_mask, positions=pos)

    def decode(self, tgt: Tensor, memory: Tensor, *, memory_mask=None, cache=None, positions=None) -> Tensor:
        _checks.token_ids("tgt", tgt, self.config.vocab_size)
        pos, hi = self._positions(tgt, cache, positions)
        with self.decoder._shared_rotary(pos, hi):
            x = self.decoder(self._embed(tgt, pos), memory, context_mask=memory_mask, cache=cache, positions=pos)
        return self._logits(x)

    def forward(self, src: Tensor, tgt: Tensor, *, src_mask=None) -> Tensor:
        return self.decode(tgt, self.encode(src, src_mask=src_mask), memory_mask=src_mask)
