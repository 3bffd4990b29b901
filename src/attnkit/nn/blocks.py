"""Transformer blocks and stacks: :class:`BlockConfig`, :class:`TransformerBlock`, :class:`Encoder`, :class:`Decoder`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import masks as _masks
from . import _checks
from .attention import AttentionConfig, MultiHeadAttention
from .layers import FeedForward, _dropout, make_norm

Tensor = torch.Tensor

__all__ = ["TransformerBlock", "BlockConfig", "Encoder", "Decoder", "default_d_ff"]


_FFNS = ("gelu", "swiglu", "geglu")


def default_d_ff(d_model: int, ffn: str) -> int:
    """``4 d_model`` for GELU; for the gated SwiGLU and GeGLU ``8/3 d_model`` rounded up to a multiple of 64
    (the same parameters).

    Example::

        >>> default_d_ff(512, "gelu"), default_d_ff(512, "swiglu")
        (2048, 1408)
    """
    if ffn == "gelu":
        return 4 * d_model
    return -(-(8 * d_model // 3) // 64) * 64


@dataclass(frozen=True)
class BlockConfig:
    """The options of a :class:`TransformerBlock`, as one object: its self-attention's
    :class:`AttentionConfig` and the fields of the block around it.

    Each field means what the :class:`TransformerBlock` keyword of the same name means; the attention's own
    options (heads, biases of the projections, dropout on the probabilities, ``qk_norm`` and its eps and
    offset, ``softcap``, ``temperature``, ``sinks``, ``backend``) live in ``attention``, whose ``d_model`` is
    the block's.  The cross attention (``cross_attention=True``) uses ``attention`` with ``kdim=context_dim``
    and no sinks.  Checked when a block is built, with the keywords' messages.  The parts given built,
    ``positions``, ``mask`` and ``attn``, are passed beside the config: ``TransformerBlock(config,
    positions=..., mask=..., attn=...)``; :class:`Encoder` and :class:`Decoder` take one too.
    :meth:`DecoderConfig.block_config` makes the one its layers share.

    Example::

        >>> from attnkit.nn import AttentionConfig, BlockConfig, TransformerBlock
        >>> cfg = BlockConfig(AttentionConfig(32, 4, n_kv_heads=2), norm="rms", ffn="swiglu")
        >>> block = TransformerBlock(cfg)
        >>> block.config is cfg, block.attn.config is cfg.attention, block.ffn.d_ff
        (True, True, 128)
    """

    attention: AttentionConfig  # the self-attention
    d_ff: int | None = None  # hidden width of the feed-forward network; None = default_d_ff(d_model, ffn)
    dropout: float = 0.0  # on every sub-layer's output before its residual add (training)
    norm_first: bool = True  # Pre-LN; False = Post-LN
    norm: str = "layer"  # "layer" (LayerNorm) or "rms" (RMSNorm)
    norm_eps: float = 1e-5
    norm_offset: float = 0.0  # what an RMSNorm's stored weight lacks (Gemma: 1.0)
    ffn: str = "gelu"  # "gelu", "swiglu" or "geglu"
    ffn_bias: bool = True  # biases in the feed-forward network
    post_norms: bool = False  # a norm on each sub-layer's output before its residual add (Gemma 2)
    pre_norms: bool = True  # False (with post_norms): only the sub-layers' outputs are normalised (OLMo 2)
    residual_scale: float = 1.0  # sub-layer outputs times this before the residual add (Granite)
    cross_attention: bool = False  # a cross-attention sub-layer between self-attention and feed-forward
    context_dim: int | None = None  # width of the cross attention's context; None = d_model

    @property
    def d_model(self) -> int:
        return self.attention.d_model

    def replace(self, **changes) -> "BlockConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def cross_attention_config(self) -> AttentionConfig:
        """The cross attention's options: the self-attention's, over a ``context_dim``-wide context, no sinks."""
        return self.attention.replace(kdim=self.context_dim, vdim=None, sinks=False)


# TransformerBlock(d_model, ...)'s options: the fields it takes by position, and the keywords that set a field of
# the attention's config (the rest are BlockConfig's fields, or the defaults below)
_BLOCK_POSITIONAL = ("d_model", "n_heads", "n_kv_heads", "d_head", "d_ff")
_ATTENTION_OPTIONS = (
    "d_model",
    "n_heads",
    "n_kv_heads",
    "d_head",
    "qk_norm",
    "softcap",
    "temperature",
    "sinks",
    "backend",
)
_BLOCK_OPTIONS = tuple(f.name for f in dataclasses.fields(BlockConfig) if f.name != "attention")
_DEFAULTS = ("bias", "qkv_bias", "out_bias", "attention_dropout")


def block_config(config, fields: tuple, options: dict, *, owner: str) -> BlockConfig:
    """The :class:`BlockConfig` a block (or stack) constructor was given: ``config`` itself, or the one its flat
    options make (see :class:`TransformerBlock`): ``bias`` is the default of ``qkv_bias`` (the attention's
    ``bias``), ``out_bias`` and ``ffn_bias``; ``attention_dropout`` (default ``dropout``) the attention's
    ``dropout``; ``norm_eps`` and ``norm_offset`` are also the q/k norms'."""
    given, fields = _checks.config_or_fields(
        BlockConfig, config, fields, options, owner=owner, positional=_BLOCK_POSITIONAL, what="options"
    )
    if given is not None:
        return given
    for name in _BLOCK_POSITIONAL[: len(fields)]:
        if name in options:
            raise TypeError(f"{owner} got {name} by position and by keyword: pass it once")
    options = {**dict(zip(_BLOCK_POSITIONAL, fields)), **options}
    unknown = [k for k in options if k not in _ATTENTION_OPTIONS + _BLOCK_OPTIONS + _DEFAULTS]
    missing = [k for k in ("d_model", "n_heads") if k not in options]
    if unknown or missing:
        what = f"unknown options {unknown}" if unknown else f"missing {' and '.join(missing)}"
        raise TypeError(
            f"{owner}: {what} (its options are positions, mask, attn, {', '.join(_DEFAULTS)}, "
            f"{', '.join(_ATTENTION_OPTIONS)} and BlockConfig's fields: {', '.join(_BLOCK_OPTIONS)})"
        )
    bias = _checks.flag("bias", options.pop("bias", True))  # the default of the three biases

    def biased(name: str) -> bool:
        value = options.pop(name, None)
        return bias if value is None else _checks.flag(name, value)

    dropout = options.pop("attention_dropout", None)
    dropout = (
        options.get("dropout", BlockConfig.dropout)
        if dropout is None
        else _checks.probability("attention_dropout", dropout)
    )
    attention = AttentionConfig(
        **{k: options.pop(k) for k in _ATTENTION_OPTIONS if k in options},
        bias=biased("qkv_bias"),
        out_bias=biased("out_bias"),
        dropout=dropout,
        qk_norm_eps=options.get("norm_eps", BlockConfig.norm_eps),
        qk_norm_offset=options.get("norm_offset", BlockConfig.norm_offset),
    )
    return BlockConfig(attention, ffn_bias=biased("ffn_bias"), **options)


class TransformerBlock(nn.Module):
    """One transformer layer: self-attention, optional cross attention, feed-forward; each with a residual.

    ``norm_first=True`` (Pre-LN): ``x = x + attn(norm(x))``, then ``x = x + ffn(norm(x))`` (a stack
    needs a final norm).  ``norm_first=False`` (Post-LN, the original Transformer):
    ``x = norm(x + attn(x))``, ``x = norm(x + ffn(x))``.  ``post_norms=True`` (Pre-LN only; Gemma 2's
    "sandwich" norms) also normalises each sub-layer's output before its residual add:
    ``x = x + post_norm(attn(norm(x)))``; with ``pre_norms=False`` as well only the outputs are normalised,
    ``x = x + post_norm(attn(x))`` (OLMo 2).  ``residual_scale`` multiplies each sub-layer's output before its
    residual add (Granite's ``residual_multiplier``).  With ``cross_attention=True`` a cross-attention
    sub-layer over ``context (B, Lc, context_dim)`` sits between the two.

    ``TransformerBlock(config, *, positions=None, mask=None, attn=None)`` builds the block a :class:`BlockConfig`
    describes, with its built parts; ``block.config`` is the config.  As a convenience the options below may
    stand in its place (``d_model`` to ``d_ff`` by position, the others by keyword), flat: they make one
    :class:`BlockConfig`, checked as one (``TransformerBlock(32, 4, norm="rms")`` is
    ``TransformerBlock(BlockConfig(AttentionConfig(32, 4, qk_norm_eps=1e-5), norm="rms"))``).

    Args:
        d_model, n_heads, n_kv_heads, d_head: see :class:`MultiHeadAttention`.
        d_ff: hidden width of the feed-forward network (default :func:`default_d_ff`).
        dropout: residual dropout (and attention dropout unless ``attention_dropout`` is given).
        attention_dropout: dropout on the attention probabilities; None = ``dropout``.
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm); ``norm_eps`` its epsilon; ``norm_offset`` what
            an RMSNorm's stored weight lacks (Gemma's ``1 + weight``: 1.0; see :class:`RMSNorm`); the q/k norms
            (``qk_norm``) use the same two.
        ffn: ``"gelu"``, ``"swiglu"`` or ``"geglu"`` (gated, tanh-approximated GELU: Gemma).
        post_norms: a norm on the output of each sub-layer (``attn_post_norm``, ``ffn_post_norm``).
        cross_attention: add the cross-attention sub-layer; ``context_dim`` its context width.
        positions, mask, qk_norm, softcap, temperature, backend: passed to the self-attention.
        attn: a built self-attention module taking ``(x, *, mask, cache, positions)`` (e.g.
            :class:`LatentAttention`) instead of the :class:`MultiHeadAttention` the options above build.
        sinks: a learned sink logit per head in the self-attention (:class:`MultiHeadAttention`).
        bias: default for ``qkv_bias`` (q/k/v projections), ``out_bias`` (attention output) and ``ffn_bias``.

    Submodules: ``attn_norm``, ``attn``, (``cross_norm``, ``cross_attn``), ``ffn_norm``, ``ffn``; with
    ``post_norms`` also ``attn_post_norm``, (``cross_post_norm``), ``ffn_post_norm``.

    ``forward(x, context=None, *, mask=None, context_mask=None, cache=None, cross_cache=None,
    positions=None)``: ``x (B, L, d_model) -> (B, L, d_model)``; ``mask`` joins the self-attention's
    mask, ``context_mask`` (e.g. the context's key padding) the cross attention's; ``cache`` and
    ``cross_cache`` are per-layer caches (see :class:`MultiHeadAttention`).

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.nn import TransformerBlock
        >>> block = TransformerBlock(32, 4, norm="rms", ffn="swiglu", mask=masks.causal(), cross_attention=True)
        >>> block(torch.randn(2, 6, 32), torch.randn(2, 9, 32)).shape
        torch.Size([2, 6, 32])
        >>> TransformerBlock(block.config, mask=masks.causal()).config == block.config
        True
    """

    def __init__(
        self,
        config: BlockConfig | int | None = None,
        *fields,
        positions=None,
        mask=None,
        attn: nn.Module | None = None,
        **options,
    ):
        super().__init__()
        self._build(block_config(config, fields, options, owner=type(self).__name__), positions, mask, attn)

    @classmethod
    def from_config(
        cls, config: BlockConfig, *, positions=None, mask=None, attn: nn.Module | None = None
    ) -> "TransformerBlock":
        """``TransformerBlock(config, positions=positions, mask=mask, attn=attn)``, refusing anything but a
        :class:`BlockConfig`."""
        _checks.config_object("from_config", config, BlockConfig)
        return cls(config, positions=positions, mask=mask, attn=attn)

    def _build(self, cfg: BlockConfig, positions, mask, attn: nn.Module | None) -> None:
        """Checks ``cfg`` (the keywords' messages), then makes the norms, the attention and the feed-forward."""
        _checks.choice("norm", cfg.norm, ("layer", "rms"))
        _checks.choice("ffn", cfg.ffn, _FFNS)
        norm_first, post_norms = _checks.flag("norm_first", cfg.norm_first), _checks.flag("post_norms", cfg.post_norms)
        cross_attention = _checks.flag("cross_attention", cfg.cross_attention)
        if post_norms and not norm_first:
            raise ValueError(
                "post_norms=True needs norm_first=True (Pre-LN): a Post-LN block already normalises "
                "after every residual add"
            )
        d_model = cfg.d_model
        d_ff = default_d_ff(d_model, cfg.ffn) if cfg.d_ff is None else _checks.positive_int("d_ff", cfg.d_ff)
        if not cfg.pre_norms and not post_norms:
            raise ValueError("pre_norms=False needs post_norms=True (OLMo 2 normalises only the sub-layers' outputs)")
        if not isinstance(cfg.attention.qk_norm, str):  # (a named layout is checked by the attention)
            _checks.flag("qk_norm", cfg.attention.qk_norm)
        if cfg.attention.batch_first is not True:
            raise ValueError("a TransformerBlock is batch-first: build it with attention.batch_first=True")
        self.config, self.norm_first = cfg, norm_first
        self.residual_scale = _checks.positive_float("residual_scale", cfg.residual_scale)

        def norm() -> nn.Module:
            return make_norm(cfg.norm, d_model, cfg.norm_eps, cfg.norm_offset)

        self.attn_norm = norm() if cfg.pre_norms else nn.Identity()
        self.attn = _self_attention(cfg.attention, positions, mask, attn)
        self.cross_attention = cross_attention
        if cross_attention:
            self.cross_norm = norm()
            self.cross_attn = MultiHeadAttention.from_config(cfg.cross_attention_config())
        self.ffn_norm = norm() if cfg.pre_norms else nn.Identity()
        self.ffn = FeedForward(d_model, d_ff, cfg.ffn, bias=_checks.flag("ffn_bias", cfg.ffn_bias))
        self.post_norms = post_norms
        if post_norms:
            self.attn_post_norm = norm()
            if cross_attention:
                self.cross_post_norm = norm()
            self.ffn_post_norm = norm()
        self.dropout = _dropout(cfg.dropout)

    def forward(
        self, x: Tensor, context=None, *, mask=None, context_mask=None, cache=None, cross_cache=None, positions=None
    ) -> Tensor:
        if self.cross_attention and context is None:
            raise ValueError("this TransformerBlock has cross_attention=True: pass context (B, Lc, context_dim)")
        if not self.cross_attention and context is not None:
            raise ValueError(
                "context was given but this TransformerBlock has no cross attention: build it with cross_attention=True"
            )
        drop = self.dropout if self.residual_scale == 1.0 else self._scaled_branch
        if self.post_norms:
            x = x + drop(self.attn_post_norm(self.attn(self.attn_norm(x), mask=mask, cache=cache, positions=positions)))
            if self.cross_attention:
                h = self.cross_attn(self.cross_norm(x), context, mask=context_mask, cache=cross_cache)
                x = x + drop(self.cross_post_norm(h))
            return x + drop(self.ffn_post_norm(self.ffn(self.ffn_norm(x))))
        if self.norm_first:
            x = x + drop(self.attn(self.attn_norm(x), mask=mask, cache=cache, positions=positions))
            if self.cross_attention:
                x = x + drop(self.cross_attn(self.cross_norm(x), context, mask=context_mask, cache=cross_cache))
            return x + drop(self.ffn(self.ffn_norm(x)))
        x = self.attn_norm(x + drop(self.attn(x, mask=mask, cache=cache, positions=positions)))
        if self.cross_attention:
            x = self.cross_norm(x + drop(self.cross_attn(x, context, mask=context_mask, cache=cross_cache)))
        return self.ffn_norm(x + drop(self.ffn(x)))

    def _scaled_branch(self, t: Tensor) -> Tensor:
        """A sub-layer's output, dropped out and scaled by ``residual_scale`` before its residual add (Granite)."""
        return self.dropout(t) * self.residual_scale


def _self_attention(config: AttentionConfig, positions, mask, attn: nn.Module | None) -> nn.Module:
    """``attn`` (a built self-attention module), or the :class:`MultiHeadAttention` ``config`` describes."""
    if attn is not None and not isinstance(attn, nn.Module):
        raise TypeError(
            f"attn must be None or a built self-attention module (e.g. LatentAttention), got {type(attn).__name__}"
        )
    if attn is not None and _checks.flag("sinks", config.sinks):
        raise ValueError(
            "sinks=True configures the MultiHeadAttention this block builds; a built attn module "
            "brings its own options: pass sinks=False (or build attn with sinks)"
        )
    return attn if attn is not None else MultiHeadAttention.from_config(config, positions=positions, mask=mask)


def _layer_caches(cache, name: str, n: int):
    if cache is None:
        return [None] * n
    layers = getattr(cache, name, None)
    if layers is None:
        raise TypeError(f"cache must expose {name!r} (one per-layer cache per layer), got {type(cache).__name__}")
    if len(layers) != n:
        raise ValueError(f"cache.{name} has {len(layers)} per-layer caches for {n} layers")
    return layers


def _cache_positions(cache, batch: int, length: int, device, positions) -> Tensor:
    """Absolute positions ``(L,)`` or ``(B, L)``: given, or ``cache.seq_len + arange(L)``."""
    if positions is not None:
        return _checks.positions_tensor("positions", positions, batch, length, device)
    start = 0
    if cache is not None:
        start = getattr(cache, "seq_len", None)
        if isinstance(start, torch.Tensor) and start.numel() == 1:
            start = int(start)
        if isinstance(start, bool) or not isinstance(start, int):
            raise TypeError(f"cache.seq_len must be an int (tokens already stored), got {start!r}")
    return torch.arange(start, start + length, device=device)


class _Stack(nn.Module):
    """What :class:`Encoder` and :class:`Decoder` share: ``n_layers`` blocks built from one :class:`BlockConfig`
    (``mask`` AND-ed with causal in a decoder), a final norm when Pre-LN, and the rotary positions computed once."""

    _name: str  # the class's name in messages
    _causal: bool

    def __init__(
        self,
        config: BlockConfig | int,
        n_layers: int,
        n_heads: int | None = None,
        *,
        positions=None,
        mask=None,
        attn: nn.Module | None = None,
        **block_options,
    ):
        super().__init__()
        if not self._causal and ("cross_attention" in block_options or getattr(config, "cross_attention", False)):
            raise ValueError("Encoder layers have no cross attention; use Decoder(cross_attention=True)")
        config = block_config(config, () if n_heads is None else (n_heads,), block_options, owner=self._name)
        _checks.positive_int("n_layers", n_layers)
        mask = self._mask(self._causal, mask)
        self.layers = nn.ModuleList(
            TransformerBlock(config, positions=positions, mask=mask, attn=attn) for _ in range(n_layers)
        )
        self.cross_attention = bool(config.cross_attention)
        self.norm = (
            make_norm(config.norm, config.d_model, config.norm_eps, config.norm_offset) if config.norm_first else None
        )
        self.d_model = config.d_model

    @staticmethod
    def _mask(causal: bool, mask) -> _masks.Mask | None:
        user_mask = (_checks.causal_model_mask if causal else _checks.as_mask)("mask", mask)
        if not causal:
            return user_mask
        return _masks.causal() & user_mask if user_mask is not None else _masks.causal()

    def _shared_rotary(self, pos: Tensor, hi: int | None) -> _SharedRotary:
        from .positions import RotaryEmbedding

        rope = getattr(self.layers[0].attn, "positions", None) if len(self.layers) else None
        ok = isinstance(rope, RotaryEmbedding) and hi is not None and pos.numel() > 0
        return _SharedRotary(rope if ok else None, pos, hi)


class _SharedRotary:
    """While a stack runs its layers with default positions (``offset + arange(L)``, largest ``hi``), its
    rotary embedding gathers cos/sin once for all of them without reading the positions tensor (a compiled
    stack stays one graph); given positions are gathered (and checked) per layer as usual."""

    def __init__(self, rope, pos, hi):
        self.rope, self.pos, self.hi = rope, pos, hi

    def __enter__(self):
        if self.rope is not None:
            self.rope._share(self.pos, self.hi)
            self.mine = self.rope._shared

    def __exit__(self, *exc):
        # cleared only if still ours: another thread's forward may have shared its own meanwhile (its layers
        # then gather for themselves, since the shared positions are not theirs; nothing is left behind)
        if self.rope is not None and self.rope._shared is self.mine:
            self.rope._shared = None
        return False


class Encoder(_Stack):
    """A stack of bidirectional :class:`TransformerBlock` s (no causal mask), with a final norm when Pre-LN.

    ``Encoder(config, n_layers, *, positions=None, mask=None, attn=None)``: every layer is
    ``TransformerBlock(config, positions=positions, mask=mask, attn=attn)`` (``positions`` is one instance shared by
    all layers).  As a convenience ``Encoder(d_model, n_layers, n_heads, **block_options)`` takes
    :class:`TransformerBlock`'s options in place of the config (``norm``, ``ffn``, ``dropout``, ...).  ``forward(x (B, L, d_model), *, mask=None, positions=None)``
    returns ``(B, L, d_model)``; ``mask`` is e.g. the inputs' key padding.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.nn import Encoder
        >>> enc = Encoder(32, 2, 4)
        >>> enc(torch.randn(2, 7, 32), mask=masks.key_padding([7, 5])).shape
        torch.Size([2, 7, 32])
    """

    _name, _causal = "Encoder", False

    def forward(self, x: Tensor, *, mask=None, positions=None) -> Tensor:
        _checks.features("x", x, self.d_model, what=f"(B, L, d_model={self.d_model})")
        pos = _cache_positions(None, x.shape[0], x.shape[1], x.device, positions)
        with self._shared_rotary(pos, None if positions is not None else x.shape[1] - 1):
            for layer in self.layers:
                x = layer(x, mask=mask, positions=pos)
        return self.norm(x) if self.norm is not None else x


class Decoder(_Stack):
    """A stack of causal :class:`TransformerBlock` s (``masks.causal()`` AND-ed with ``mask``), optionally
    with cross attention to an encoder's output, and a final norm when Pre-LN.  Built as :class:`Encoder` is:
    ``Decoder(config, n_layers, *, positions=None, mask=None, attn=None)``, or
    ``Decoder(d_model, n_layers, n_heads, **block_options)``.

    ``forward(x (B, L, d_model), context=None, *, mask=None, context_mask=None, cache=None,
    positions=None) -> (B, L, d_model)``.  ``cache`` is a model-level cache: ``cache.layers[i]`` (self
    attention of layer ``i``), ``cache.cross_layers[i]`` (its cross attention; filled from ``context``
    on the first call, see :class:`MultiHeadAttention`) and ``cache.seq_len`` (tokens stored before this
    call; default positions are ``seq_len + arange(L)``).

    Example::

        >>> import torch
        >>> from attnkit.nn import Decoder
        >>> dec = Decoder(32, 2, 4, cross_attention=True)
        >>> dec(torch.randn(2, 5, 32), torch.randn(2, 8, 32)).shape
        torch.Size([2, 5, 32])
    """

    _name, _causal = "Decoder", True

    def forward(self, x: Tensor, context=None, *, mask=None, context_mask=None, cache=None, positions=None) -> Tensor:
        _checks.features("x", x, self.d_model, what=f"(B, L, d_model={self.d_model})")
        n = len(self.layers)
        self_caches = _layer_caches(cache, "layers", n)
        cross_caches = _layer_caches(cache, "cross_layers", n) if self.cross_attention else [None] * n
        pos = _cache_positions(cache, x.shape[0], x.shape[1], x.device, positions)
        hi = None if positions is not None else (0 if cache is None else int(cache.seq_len)) + x.shape[1] - 1
        with self._shared_rotary(pos, hi):
            for layer, c, cc in zip(self.layers, self_caches, cross_caches):
                x = layer(x, context, mask=mask, context_mask=context_mask, cache=c, cross_cache=cc, positions=pos)
        return self.norm(x) if self.norm is not None else x
