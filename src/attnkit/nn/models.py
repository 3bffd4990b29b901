"""Language models: :class:`DecoderConfig`, :class:`DecoderLM` (decoder-only) and :class:`EncoderDecoder`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from .. import masks as _masks
from . import _checks
from .blocks import Decoder, Encoder, TransformerBlock, _cache_positions, _layer_caches, default_d_ff
from .layers import Linear, _dropout, linear, make_norm
from .positions import ALiBi, PositionEncoding, RotaryEmbedding, SinusoidalPositions, T5RelativeBias, _parse_scaling

Tensor = torch.Tensor

__all__ = ["DecoderConfig", "DecoderLM", "EncoderDecoder"]

_POSITIONS = ("rope", "alibi", "t5", "sinusoidal", "none")


@dataclass
class DecoderConfig:
    """Configuration of a decoder-only language model (:class:`DecoderLM`); also builds :class:`EncoderDecoder`.

    Expresses Llama (``norm="rms", ffn="swiglu"``, RoPE, no biases), Mistral (plus
    ``mask=masks.sliding_window(W - 1)``), Qwen2 (plus ``qkv_bias=True``), Gemma 2 (``ffn="geglu",
    post_norms=True, embed_scale=sqrt(d_model)``, ``attn_scale``, ``softcap``, ``logit_softcap`` and
    alternating ``layer_masks``) as well as GPT-style models (``norm="layer", ffn="gelu"``, biases,
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
    rope_scaling: dict | None = None  # {"type": "linear" | "ntk" | "llama3", "factor": f, ...} (HF format too)
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
    qk_norm: bool = False  # RMSNorm on every query and key head
    softcap: float | None = None  # attention score softcap
    attention_sinks: bool = False  # a learned sink logit per head in every softmax denominator (GPT-OSS)
    attn_scale: float | None = None  # score scale; None = 1/sqrt(d_head) (Gemma 2: query_pre_attn_scalar^-0.5)
    post_norms: bool = False  # Pre-LN plus a norm on each sub-layer's output before its residual add (Gemma 2)
    embed_scale: float | None = None  # token embeddings times this (Gemma: sqrt(d_model))
    logit_softcap: float | None = None  # s * tanh(logits / s) on the output logits (Gemma 2: 30)
    tie_embeddings: bool = True  # the output head reuses the token embedding
    dropout: float = 0.0  # embedding and residual dropout (training)
    attention_dropout: float = 0.0  # dropout on the attention probabilities (training)
    init_std: float = 0.02
    backend: str = "auto"

    _PRESETS = {
        "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=512),
        "small": dict(vocab_size=32000, d_model=256, n_layers=4, n_heads=4, max_seq_len=1024),
        "llama-like": dict(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, d_ff=1408, max_seq_len=2048,
                           norm_eps=1e-6, tie_embeddings=False),
    }

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "t5_max_distance"):
            _checks.positive_int(name, getattr(self, name))
        for name in ("rope_interleaved", "norm_first", "qkv_bias", "out_bias", "ffn_bias", "qk_norm", "post_norms",
                     "tie_embeddings", "attention_sinks"):
            setattr(self, name, _checks.flag(name, getattr(self, name)))
        self.n_kv_heads_, self.d_head_ = _checks.head_layout(self.d_model, self.n_heads, self.n_kv_heads, self.d_head)
        _checks.choice("positions", self.positions, _POSITIONS)
        _checks.choice("norm", self.norm, ("rms", "layer"))
        _checks.choice("ffn", self.ffn, ("swiglu", "gelu", "geglu"))
        _checks.positive_int("d_ff", self.d_ff, allow_none=True)
        _checks.positive_int("rotary_dim", self.rotary_dim, allow_none=True)
        _checks.positive_float("rope_theta", self.rope_theta)
        _parse_scaling(self.rope_scaling, self.rope_theta)  # errors at configuration time, not when building
        _checks.positive_float("norm_eps", self.norm_eps)
        self.norm_offset = _checks.finite_float("norm_offset", self.norm_offset)
        if self.norm_offset and self.norm != "rms":
            raise ValueError(f"norm_offset={self.norm_offset!r} applies to RMSNorm only: use norm='rms' or "
                             f"norm_offset=0.0")
        for name in ("softcap", "attn_scale", "embed_scale", "logit_softcap"):
            _checks.positive_float(name, getattr(self, name), allow_none=True)
        if self.post_norms and not self.norm_first:
            raise ValueError("post_norms=True needs norm_first=True (Pre-LN): a Post-LN block already normalises "
                             "after every residual add")
        _checks.positive_float("init_std", self.init_std)
        _checks.probability("dropout", self.dropout)
        _checks.probability("attention_dropout", self.attention_dropout)
        if self.positions == "t5":  # the bucket layout's errors at configuration time, not when building
            for bidirectional in (False, True):
                try:
                    T5RelativeBias(self.n_heads, self.t5_num_buckets, self.t5_max_distance,
                                   bidirectional=bidirectional)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"t5_num_buckets={self.t5_num_buckets!r}, t5_max_distance={self.t5_max_distance!r}: "
                                  f"{e}") from None
        _checks.causal_model_mask("mask", self.mask)
        self.layer_masks = _check_layer_masks(self.layer_masks, self.n_layers)
        if self.positions == "rope" and self.rotary_dim is None and self.d_head_ % 2:
            raise ValueError(f"positions='rope' rotates pairs of channels: the head size d_head={self.d_head_} must "
                             f"be even (pick d_model/n_heads or d_head even, or rotary_dim=an even size)")
        if self.rotary_dim is not None and (self.rotary_dim > self.d_head_ or self.rotary_dim % 2):
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= d_head={self.d_head_}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"positions='sinusoidal' needs an even d_model, got {self.d_model}")

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
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers:
            raise ValueError(f"layer index i={i!r} must be an int in [0, n_layers={self.n_layers})")
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


def _check_layer_masks(value, n_layers: int) -> tuple[_masks.Mask | None, ...] | None:
    """``layer_masks`` as a tuple of ``n_layers`` Masks or Nones (bool tensors become Masks)."""
    if value is None:
        return None
    if isinstance(value, (_masks.Mask, torch.Tensor)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"layer_masks must be a tuple with one Mask (or None) per layer, got "
                        f"{type(value).__name__}: for one mask on every layer use mask=... instead")
    if len(value) != n_layers:
        raise ValueError(f"layer_masks has {len(value)} entries but n_layers={n_layers}: give exactly one Mask or "
                         f"None per layer (None: that layer is causal only), e.g. "
                         f"(masks.sliding_window(W - 1), None) * {n_layers // 2 or 1} for alternating layers")
    return tuple(_checks.causal_model_mask(f"layer_masks[{i}]", m) for i, m in enumerate(value))


def _make_positions(cfg: DecoderConfig, *, bidirectional: bool) -> PositionEncoding | None:
    if cfg.positions == "rope":
        return RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, base=cfg.rope_theta, interleaved=cfg.rope_interleaved,
                               scaling=cfg.rope_scaling)
    if cfg.positions == "alibi":
        return ALiBi(cfg.n_heads)
    if cfg.positions == "t5":
        return T5RelativeBias(cfg.n_heads, cfg.t5_num_buckets, cfg.t5_max_distance, bidirectional=bidirectional)
    return None


def _block_options(cfg: DecoderConfig, positions) -> dict:
    return dict(n_kv_heads=cfg.n_kv_heads, d_head=cfg.d_head, d_ff=cfg.ff_dim, dropout=cfg.dropout,
                attention_dropout=cfg.attention_dropout, norm_first=cfg.norm_first, norm=cfg.norm,
                norm_eps=cfg.norm_eps, norm_offset=cfg.norm_offset, ffn=cfg.ffn, positions=positions,
                qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias, ffn_bias=cfg.ffn_bias, qk_norm=cfg.qk_norm,
                softcap=cfg.softcap, backend=cfg.backend, post_norms=cfg.post_norms, sinks=cfg.attention_sinks,
                temperature=1.0 if cfg.attn_scale is None else 1.0 / (cfg.attn_scale * math.sqrt(cfg.head_dim)))


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
            nn.init.normal_(self.embed.weight, std=self.config.d_model ** -0.5)

    def _check_positions(self, pos: Tensor) -> int:
        """The largest position (read from the tensor), checked against ``max_seq_len``."""
        cfg = self.config
        if pos.numel() == 0:
            return 0
        if torch.compiler.is_compiling():  # reading the tensor would split the graph: check inside it instead
            torch._assert_async((pos >= 0).all(), "positions must be >= 0")
            if cfg.positions not in ("alibi", "t5", "none"):
                torch._assert_async((pos < cfg.max_seq_len).all(), f"positions must be < max_seq_len="
                                    f"{cfg.max_seq_len} (positions={cfg.positions!r} does not extrapolate)")
            return cfg.max_seq_len - 1  # a bound, not the maximum: sizes the rotary table without a read
        lo, hi = int(pos.min()), int(pos.max())
        if lo < 0:
            raise ValueError(f"positions must be >= 0, got {lo}")
        self._check_max(hi)
        return hi

    def _check_max(self, hi: int) -> None:
        cfg = self.config
        if hi >= cfg.max_seq_len and cfg.positions not in ("alibi", "t5", "none"):
            raise ValueError(f"position {hi} is beyond max_seq_len={cfg.max_seq_len} and positions="
                             f"{cfg.positions!r} does not extrapolate: raise max_seq_len (with rope_scaling for "
                             f"RoPE) or use positions='alibi'")

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
    a step on CPU; :func:`attnkit.nn.to_decode_layout` lays them out for bigger batches.

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
        opts = _block_options(cfg, self.positions)
        self.layers = nn.ModuleList(
            TransformerBlock(cfg.d_model, cfg.n_heads, mask=_checks.combine(_masks.causal(), cfg.layer_mask(i)), **opts)
            for i in range(cfg.n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_offset) if cfg.norm_first else None
        self._init_weights(cfg.n_layers)

    def forward(self, ids: Tensor, *, cache=None, positions=None, mask=None) -> Tensor:
        _checks.token_ids("ids", ids, self.config.vocab_size)
        caches = _layer_caches(cache, "layers", len(self.layers))
        pos, hi = self._positions(ids, cache, positions)
        rope = self.positions if isinstance(self.positions, RotaryEmbedding) and ids.shape[1] else None
        x = self._embed(ids, pos)
        if rope is not None:
            rope._share(pos, hi)  # one cos/sin gather for every layer
        try:
            for layer, c in zip(self.layers, caches):
                x = layer(x, mask=mask, cache=c, positions=pos)
        finally:
            if rope is not None:
                rope._share(None)
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
            raise ValueError("config.layer_masks is not supported by EncoderDecoder (its decoder applies config.mask "
                             "to every layer): set layer_masks=None, or use DecoderLM for per-layer masks")
        n_enc = cfg.n_layers if n_encoder_layers is None else _checks.positive_int("n_encoder_layers",
                                                                                   n_encoder_layers)
        self._build_io(cfg)
        self.encoder_positions = _make_positions(cfg, bidirectional=True)
        self.decoder_positions = (self.encoder_positions if cfg.positions in ("rope", "alibi")
                                  else _make_positions(cfg, bidirectional=False))
        self.encoder = Encoder(cfg.d_model, n_enc, cfg.n_heads, **_block_options(cfg, self.encoder_positions))
        self.decoder = Decoder(cfg.d_model, cfg.n_layers, cfg.n_heads, cross_attention=True, mask=cfg.mask,
                               **_block_options(cfg, self.decoder_positions))
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
