"""Multi-head attention (:class:`AttentionConfig`): self, grouped-query, cross and cached; attention hooks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .. import masks as _masks
from ..bias import BiasLike
from ..cache import CacheAttention
from ..cache import attend as cache_attend
from ..functional import attention, attention_weights
from . import _checks, _hooks
from ._hooks import AttentionCall, AttentionHook
from .layers import Linear, RMSNorm, linear
from .positions import PositionEncoding, RotaryEmbedding

Tensor = torch.Tensor

__all__ = ["MultiHeadAttention", "AttentionConfig"]


class _Attends(nn.Module):
    """The one place where attention is computed inside :mod:`attnkit.nn` (see ``_attend``), and its hooks."""

    backend: str = "auto"
    _attention_hooks: Mapping[int, AttentionHook] = _hooks._NO_HOOKS  # an instance's own once it registers one

    def register_attention_hook(self, hook: AttentionHook) -> RemovableHandle:
        """Observe or replace the attention this module computes; ``handle.remove()`` takes the hook off.

        ``hook(module, call, compute) -> out`` runs in place of every attention computation of the module:
        ``call`` is an :class:`AttentionCall` (``q (B, Hq, Lq, D)``, ``k``, ``v``, mask, bias, scale, softcap,
        dropout_p, sinks) and ``compute(call)`` the computation it stands for (the hooks registered before,
        then :func:`attnkit.attention` with the module's ``backend``), returning ``out (B, Hq, Lq, Dv)``.  A
        hook observes (``out = compute(call)``, look, return ``out``), changes the inputs (``compute(
        call.replace(mask=...))``) or replaces the computation (return its own ``(B, Hq, Lq, Dv)`` without
        calling ``compute``).  The hook registered last runs outermost.  The handle is also a context manager
        that removes the hook on exit.  A paged or quantized cache's decode step computes attention itself
        (its ``update`` returns a :class:`attnkit.cache.CacheAttention`): with hooks, it reads its keys and
        values in position order and the hooks see that attention (one call per piece it attends separately:
        the decode rows of a step together, each prompt chunk alone), at the cost of its fused kernel.

        Example::

            >>> import torch
            >>> from attnkit import masks
            >>> from attnkit.nn import MultiHeadAttention
            >>> mha = MultiHeadAttention(16, 2, mask=masks.causal())
            >>> seen = []
            >>> def hook(module, call, compute):
            ...     seen.append(tuple(call.q.shape))
            ...     return compute(call)
            >>> with mha.register_attention_hook(hook):
            ...     _ = mha(torch.randn(1, 5, 16))
            >>> _ = mha(torch.randn(1, 5, 16))  # removed: not seen
            >>> seen
            [(1, 2, 5, 8)]
        """
        hooks = self.__dict__.get("_attention_hooks")
        hooks, handle = _hooks.register(hooks, hook)
        self._attention_hooks = hooks
        return handle

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask,
        bias,
        scale: float | None,
        softcap: float | None,
        dropout_p: float,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)`` -> ``(B, Hq, Lq, Dv)``.

        Every attention computed in :mod:`attnkit.nn` calls this method, which calls
        :func:`attnkit.attention` with the module's ``backend``, through the hooks of
        :meth:`register_attention_hook` when there are any; ``sinks`` is passed only by a module that has them.
        """
        if self._attention_hooks:
            call = AttentionCall(
                q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, dropout_p=dropout_p, sinks=sinks
            )
            return _hooks.run(self, self._attention_hooks, call, self._compute)
        return attention(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            scale=scale,
            softcap=softcap,
            dropout_p=dropout_p,
            backend=self.backend,
            sinks=sinks,
        )

    def _hooked_compute(self):
        """None without hooks; with them, the attention a cache that computes attention itself (paged,
        quantized) calls on its keys and values in place of its own kernel, so that the hooks see it."""
        if not self._attention_hooks:
            return None

        def compute(q, k, v, *, mask=None, bias=None, scale=None, softcap=None, sinks=None):
            # (no dropout: the caches' own kernels apply none either)
            return self._attend(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, dropout_p=0.0, sinks=sinks)

        return compute

    def _compute(self, c: AttentionCall) -> Tensor:
        """The module's own attention of one call (under its hooks)."""
        return attention(c.q, c.k, c.v, dropout_p=c.dropout_p, backend=self.backend, **c.weight_kwargs())

    def _check_dtype(self, x: Tensor) -> None:
        """``x`` has the dtype of the module's weights (read off ``out_proj``), unless autocast converts it."""
        w = self.out_proj.weight if type(self.out_proj) in (Linear, nn.Linear) else None  # (a subclass may cast)
        if w is not None and x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"x has dtype {x.dtype} but this module's weights are {w.dtype}: convert one to the "
                f"other (module.to({x.dtype}) or x.to({w.dtype})), or run under torch.autocast"
            )


def _torch_key_padding(key_padding_mask) -> _masks.Mask:
    """PyTorch's ``key_padding_mask`` (bool ``(B, Lk)``, True = ignore the key) as an attnkit Mask."""
    if not isinstance(key_padding_mask, Tensor):
        raise TypeError(
            f"key_padding_mask must be a bool tensor (B, Lk) with True for the keys to ignore "
            f"(PyTorch's convention), got {type(key_padding_mask).__name__}"
        )
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(
            f"key_padding_mask must be a bool tensor (True = ignore the key, PyTorch's convention), got "
            f"dtype {key_padding_mask.dtype}: a float additive mask has no place here; pass "
            f"key_padding_mask.isneginf() for a 0/-inf one"
        )
    if key_padding_mask.dim() != 2:
        raise ValueError(f"key_padding_mask must have shape (B, Lk), got {tuple(key_padding_mask.shape)}")
    return _masks.key_padding(~key_padding_mask)


def _is_bottom_right_causal(m) -> bool:
    return isinstance(m, _masks.Mask) and m.is_causal("bottom_right")


def _check_layer_cache(name: str, cache) -> None:
    """``cache`` is None or one layer's KV cache (an object with ``update(k, v)``)."""
    if cache is None or callable(getattr(cache, "update", None)):
        return
    if hasattr(cache, "layers"):
        raise TypeError(
            f"{name} is a model-level {type(cache).__name__}: an attention module takes one layer's "
            f"cache, {name}.layers[i] (a model such as DecoderLM takes the whole cache)"
        )
    raise TypeError(
        f"{name} must be None or one layer's KV cache with update(k, v) (e.g. "
        f"attnkit.cache.StaticCache(n_layers, max_len).layers[0]), got {type(cache).__name__} "
        f"{cache!r:.60}"
    )


def _rows(proj: nn.Module, x: Tensor, start: int, stop: int) -> Tensor:
    """Output features ``start:stop`` of the projection ``proj`` on ``x`` (a part of a fused projection):
    its weight rows sliced, or its own ``forward_rows`` (quantized layers, see :func:`attnkit.quantize`)."""
    part = getattr(proj, "forward_rows", None)
    if part is not None:
        return part(x, start, stop)
    b = proj.bias
    return linear(x, proj.weight[start:stop], None if b is None else b[start:stop])


# the fields MultiHeadAttention(d_model, ...) takes by position, in the order of the keywords it always took
_POSITIONAL = ("d_model", "n_heads", "n_kv_heads", "d_head", "kdim", "vdim", "bias")


@dataclass(frozen=True)
class AttentionConfig:
    """The options of a :class:`MultiHeadAttention`, as one object that blocks and models pass along.

    Each field means what the :class:`MultiHeadAttention` keyword of the same name means (``None`` takes the
    default described there); the fields are checked when a module is built from the config, with the same
    messages.  The parts a module is given built, ``positions`` (one position encoding shared by every layer)
    and ``mask`` (often one per layer), are passed beside it: ``MultiHeadAttention(config, positions=...,
    mask=...)``.  :class:`TransformerBlock` keeps its self-attention's config in
    :class:`BlockConfig` ``.attention``, and :class:`DecoderConfig` builds both once for all its layers.

    Example::

        >>> from attnkit import masks
        >>> from attnkit.nn import AttentionConfig, MultiHeadAttention
        >>> cfg = AttentionConfig(64, 8, n_kv_heads=2, bias=False, qk_norm=True)
        >>> mha = MultiHeadAttention(cfg, mask=masks.causal())
        >>> mha.config is cfg, mha.n_kv_heads, mha.d_head, mha.qkv_proj.bias
        (True, 2, 8, None)
        >>> cross = MultiHeadAttention(cfg.replace(kdim=32))  # 64-wide queries, a 32-wide context
        >>> cross.kv_proj.weight.shape
        torch.Size([32, 32])
    """

    d_model: int  # width of x and of the output
    n_heads: int  # query heads
    n_kv_heads: int | None = None  # key/value heads (grouped-query); None = n_heads, 1 = multi-query
    d_head: int | None = None  # dims per head; None = d_model // n_heads
    kdim: int | None = None  # width of the cross-attention key input; None = d_model
    vdim: int | None = None  # width of the cross-attention value input; None = kdim
    bias: bool = True  # biases of the q/k/v projections
    out_bias: bool | None = None  # bias of out_proj; None = bias
    dropout: float = 0.0  # on the attention probabilities, while training
    qk_norm: bool | str = False  # RMSNorm per query/key head (True, "head") or over all heads ("all")
    qk_norm_eps: float = 1e-6  # the q/k norms' eps
    qk_norm_offset: float = 0.0  # the q/k norms' offset (see RMSNorm)
    softcap: float | None = None  # s * tanh(score / s) on the scores
    temperature: float = 1.0  # divides the scores
    sinks: bool = False  # a learned sink logit per query head
    backend: str = "auto"  # "auto" or a name from attnkit.backends.available()
    batch_first: bool = True  # False: (L, B, E) in and out, as torch.nn.MultiheadAttention(batch_first=False)

    def replace(self, **changes) -> "AttentionConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _update_cache(cache, k: Tensor, v: Tensor, *, call_mask, heads: int, q_len: int, need_weights: bool = False):
    """``cache.update(k, v)``, after the cache's ``peek`` (where it has one) let the call's mask and
    ``need_weights`` be checked first, so that a rejected call leaves the cache unchanged."""
    peek = getattr(cache, "peek", None)
    if callable(peek):
        lk_next, attends = peek(k.shape[2])
        if attends and need_weights:
            raise ValueError(
                "need_weights=True is not available with a cache that computes attention "
                "itself (its update() returns an object with attend())"
            )
        if lk_next is not None:
            _checks.check_mask_shape("mask", call_mask, k.shape[0], heads, q_len, lk_next)
    kv = cache.update(k, v)
    if need_weights and isinstance(kv, CacheAttention):
        raise ValueError(
            "need_weights=True is not available with a cache that computes attention "
            "itself (its update() returned a CacheAttention, an object with attend())"
        )
    return kv


class MultiHeadAttention(_Attends):
    """Multi-head attention, batch-first: ``(B, L, d_model) -> (B, L, d_model)``.

    ``n_heads`` query heads share ``n_kv_heads`` key/value heads (grouped-query attention; 1 is
    multi-query); each head has ``d_head`` dims (default ``d_model // n_heads``).

    **Projections.**  Self-attention uses one fused projection ``qkv_proj: d_model -> (Hq + 2 Hkv) d_head``
    whose weight stacks rows ``[q (Hq d_head); k (Hkv d_head); v (Hkv d_head)]`` (the articles' "widen
    W_q, W_k, W_v to d_model x (h d_k)").  Cross attention ``forward(x, context)`` applies the q rows to
    ``x`` and the k/v rows to ``context``.  When the context has another width (``kdim``/``vdim``, e.g.
    image patches attending to text) the module has ``q_proj`` and a fused ``kv_proj: kdim -> 2 Hkv d_head``
    (rows ``[k; v]``), or ``k_proj``/``v_proj`` when ``kdim != vdim`` (then ``context`` is a pair
    ``(key_input, value_input)``).  ``out_proj`` maps ``Hq d_head -> d_model``.  Projections are
    :class:`~attnkit.nn.Linear` layers (the fastest CPU kernel for the weights' layout when decoding).

    **Scores.**  ``q.k * scale`` with ``scale = 1 / (sqrt(d_head) * temperature)``, then ``softcap``, then
    the position bias (ALiBi/T5), then the masks; optional ``qk_norm`` (RMSNorm of every query and key
    head) before rotary positions.  Every score is computed by one call of :func:`attnkit.attention` with
    ``backend``, which :meth:`register_attention_hook` lets a hook observe or replace (the doctor's probe,
    distillation's capture and ring attention do).

    **Masks.**  ``mask`` (constructor, e.g. ``masks.causal()``) and ``mask`` (call) are AND-ed; either is
    an :class:`attnkit.masks.Mask` or a bool tensor broadcastable to ``(B, n_heads, Lq, Lk)``.  Query row
    ``i`` sits at position ``i + Lk - Lq`` (bottom-right), which is what a KV cache needs.

    **Positions** (``positions=``, self-attention only): :class:`~attnkit.nn.RotaryEmbedding` rotates
    queries and keys at absolute positions (``forward(positions=...)``: ``(L,)`` or ``(B, L)``; default
    ``offset + arange(L)`` with ``offset = cache.seq_len`` when the cache has one, else 0);
    :class:`~attnkit.nn.ALiBi` / :class:`~attnkit.nn.T5RelativeBias` add a bias from relative distances
    (key order, bottom-right); :class:`~attnkit.nn.SinusoidalPositions` is added to the query and key
    inputs.

    **KV cache** (``cache=`` a per-layer cache).  Self-attention: the new keys/values ``(B, Hkv, L, d_head)``
    (keys already rotated at their absolute positions) go to ``kv = cache.update(k, v)``, which returns
    ``(k_all, v_all)``, ``(k_all, v_all, extra_mask)`` (``extra_mask``: None, a Mask or a bool tensor
    broadcastable to ``(B, Hq, L, Lk)``, AND-ed with the masks) or an object with
    ``attend(q, *, mask, bias, scale, softcap, compute) -> (B, Hq, L, d_head)`` that computes attention itself
    (paged/quantized caches; with attention hooks the module passes ``compute``, its attention through the
    hooks, which the cache calls on its keys and values; it cannot return weights).  A cache with
    ``peek(n_new) -> (Lk or None, attends)`` (the built-in ones) lets the module check the call mask and
    ``need_weights`` before the update, so a rejected call leaves the cache unchanged.

    **Cross-attention cache.**  The context's keys and values are computed once: with ``cache=``, the
    module reads ``cache.seq_len``; while it is 0 it projects ``context`` and calls
    ``cache.update(k, v)`` with all ``Lc`` context positions; afterwards it does not project the context
    and calls ``cache.update(k0, v0)`` with zero-length ``(B, Hkv, 0, d_head)`` tensors, using what the
    cache returns.  So any per-layer cache that appends and exposes ``seq_len`` serves as a cross cache;
    ``context`` must still be passed on every call (its width and batch are checked; it is not read
    once cached).  Cross attention has no causal mask and no positions.

    ``MultiHeadAttention(config, *, positions=None, mask=None)`` builds the module an :class:`AttentionConfig`
    describes, with its built parts ``positions`` and ``mask``; ``module.config`` is the config.  As a convenience
    the config's fields may stand in its place: ``MultiHeadAttention(64, 8, n_kv_heads=2)`` is
    ``MultiHeadAttention(AttentionConfig(64, 8, n_kv_heads=2))`` (``d_model`` to ``bias`` may be given by
    position, the others by keyword); the config is then checked as one.

    Args:
        d_model: width of ``x`` and of the output.
        n_heads, n_kv_heads, d_head: head layout (see above).
        kdim, vdim: widths of the cross-attention key and value inputs (``kdim`` defaults to ``d_model``,
            ``vdim`` to ``kdim``: keys and values usually come from one context).
        bias: bias on the q/k/v projections; ``out_bias`` (default: ``bias``) on ``out_proj``.
        dropout: dropout on the attention weights while training.
        qk_norm: RMSNorm on each query and key head (``True`` or ``"head"``: Qwen3, Gemma 3), or ``"all"``: one
            RMSNorm over all query heads together and one over all key heads (OLMo 2); ``qk_norm_eps`` and
            ``qk_norm_offset`` are those norms' ``eps`` and ``offset`` (see :class:`RMSNorm`).
        positions: a :class:`~attnkit.nn.PositionEncoding` or None.
        mask: a mask applied to every call (e.g. ``masks.causal()``).
        softcap: ``s * tanh(score / s)`` on the scores (Gemma 2).
        temperature: divides the scores (> 1 flattens the attention).
        sinks: a learnable per-head sink logit (GPT-OSS), the parameter ``sinks (n_heads,)`` (initialised
            to 0), added to every row's softmax denominator with a zero value (see :func:`attnkit.attention`);
            caches decode with it like a full forward.
        backend: ``"auto"`` or a name from :func:`attnkit.backends.available`.
        batch_first: False takes ``x (L, B, d_model)`` and ``context (Lc, B, kdim)`` and returns
            ``(L, B, d_model)``, as ``torch.nn.MultiheadAttention(batch_first=False)`` does (masks, positions
            and weights keep their batch-first shapes).

    ``forward(x, context=None, *, mask=None, cache=None, positions=None, need_weights=False,
    key_padding_mask=None)`` returns ``out (B, L, d_model)``, or ``(out, weights (B, n_heads, L, Lk))`` with
    ``need_weights=True`` (weights before dropout, differentiable, computed by
    :func:`attnkit.attention_weights`).  ``key_padding_mask`` is PyTorch's: a bool ``(B, Lk)`` tensor with
    True for the keys to *ignore* (the opposite of ``mask``, where True means "may attend"); it is AND-ed with
    the masks as ``masks.key_padding(~key_padding_mask)``.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.nn import AttentionConfig, MultiHeadAttention
        >>> mha = MultiHeadAttention(64, 8, n_kv_heads=2, mask=masks.causal())
        >>> mha.qkv_proj.weight.shape  # rows [q (8*8); k (2*8); v (2*8)]
        torch.Size([96, 64])
        >>> out, w = mha(torch.randn(2, 10, 64), need_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 8, 10, 10]))
        >>> cross = MultiHeadAttention(64, 8, kdim=32)  # 64-wide queries attend to a 32-wide context
        >>> cross(torch.randn(2, 10, 64), torch.randn(2, 7, 32)).shape
        torch.Size([2, 10, 64])
        >>> MultiHeadAttention(AttentionConfig(64, 8, kdim=32)).config == cross.config
        True
    """

    def __init__(
        self,
        config: AttentionConfig | int | None = None,
        *fields,
        positions: PositionEncoding | None = None,
        mask=None,
        **options,
    ):
        super().__init__()
        cfg = _checks.config_of(
            AttentionConfig,
            config,
            fields,
            options,
            owner=type(self).__name__,
            positional=_POSITIONAL,
            beside="positions, mask",
        )
        self._build(cfg, positions, mask)

    @classmethod
    def from_config(
        cls, config: AttentionConfig, *, positions: PositionEncoding | None = None, mask=None
    ) -> "MultiHeadAttention":
        """``MultiHeadAttention(config, positions=positions, mask=mask)``, refusing anything but an
        :class:`AttentionConfig` (so a stray options dict is not read as ``d_model``)."""
        _checks.config_object("from_config", config, AttentionConfig)
        return cls(config, positions=positions, mask=mask)

    def _build(self, cfg: AttentionConfig, positions: PositionEncoding | None, mask) -> None:
        """Checks ``cfg`` and the built parts, then makes the projections, norms and sinks."""
        self.config, self.batch_first = cfg, _checks.flag("batch_first", cfg.batch_first)
        d_model, n_heads = cfg.d_model, cfg.n_heads
        n_kv_heads, d_head = _checks.head_layout(d_model, n_heads, cfg.n_kv_heads, cfg.d_head)
        bias = _checks.flag("bias", cfg.bias)
        qk_norm = cfg.qk_norm if isinstance(cfg.qk_norm, str) else _checks.flag("qk_norm", cfg.qk_norm)  # or a layout
        kdim = d_model if cfg.kdim is None else _checks.positive_int("kdim", cfg.kdim)
        vdim = kdim if cfg.vdim is None else _checks.positive_int("vdim", cfg.vdim)
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = d_model, n_heads, n_kv_heads, d_head
        self.kdim, self.vdim = kdim, vdim
        self.dropout = _checks.probability("dropout", cfg.dropout)
        self.softcap = _checks.positive_float("softcap", cfg.softcap, allow_none=True)
        self.temperature = _checks.positive_float("temperature", cfg.temperature)
        self.backend = _checks.backend(cfg.backend)
        if positions is not None and not isinstance(positions, PositionEncoding):
            raise TypeError(
                f"positions must be None or an attnkit.nn PositionEncoding (RotaryEmbedding, ALiBi, "
                f"T5RelativeBias, SinusoidalPositions), got {type(positions).__name__}"
            )
        if positions is not None:
            positions.check_heads(n_heads, d_head, d_model)
        self.positions = positions
        self.mask = _checks.as_mask("mask", mask)
        out_bias = bias if cfg.out_bias is None else _checks.flag("out_bias", cfg.out_bias)
        self._build_projections(bias, out_bias)
        self._build_qk_norms(qk_norm, cfg.qk_norm_eps, cfg.qk_norm_offset)
        self._plain_causal = _is_bottom_right_causal(self.mask)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if _checks.flag("sinks", cfg.sinks) else None

    def _build_projections(self, bias: bool, out_bias: bool) -> None:
        """``qkv_proj`` (rows ``[q; k; v]``) when keys and values come from ``d_model``-wide inputs, else
        ``q_proj`` and ``kv_proj`` (or ``k_proj``, ``v_proj``); ``out_proj``."""
        d_model, kdim, vdim = self.d_model, self.kdim, self.vdim
        q_out, kv_out = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        self._split = (q_out, kv_out, kv_out)
        self.self_capable = kdim == d_model and vdim == d_model
        if self.self_capable:
            self.qkv_proj = Linear(d_model, q_out + 2 * kv_out, bias=bias)
        else:
            self.q_proj = Linear(d_model, q_out, bias=bias)
            if kdim == vdim:
                self.kv_proj = Linear(kdim, 2 * kv_out, bias=bias)
            else:
                self.k_proj = Linear(kdim, kv_out, bias=bias)
                self.v_proj = Linear(vdim, kv_out, bias=bias)
        self.out_proj = Linear(q_out, d_model, bias=out_bias)

    def _build_qk_norms(self, qk_norm, eps: float, offset: float) -> None:
        if qk_norm not in (False, True, "head", "all"):
            raise ValueError(
                f"qk_norm={qk_norm!r} must be False, True / 'head' (RMSNorm per head) or 'all' (over all heads at once)"
            )
        self.qk_norm_all = qk_norm == "all"
        q_out, kv_out, _ = self._split
        q_dim, k_dim = (q_out, kv_out) if self.qk_norm_all else (self.d_head, self.d_head)
        self.q_norm = RMSNorm(q_dim, eps, offset) if qk_norm else None
        self.k_norm = RMSNorm(k_dim, eps, offset) if qk_norm else None

    # ------------------------------------------------------------------------ projections

    def _heads(self, t: Tensor, n: int) -> Tensor:
        B, L, _ = t.shape
        return t.view(B, L, n, self.d_head).transpose(1, 2)  # (B, n, L, d_head)

    def _project_self(self, x: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        q_out, kv_out, _ = self._split
        pe = self.positions.encode(positions) if self.positions is not None else None
        if pe is None:
            qkv = self.qkv_proj(x)  # (B, L, (Hq + 2 Hkv) d_head)
            q, k, v = qkv.split(self._split, dim=-1)
        else:  # absolute encodings join the query and key inputs only
            qk = _rows(self.qkv_proj, x + pe.to(x.dtype), 0, q_out + kv_out)
            v = _rows(self.qkv_proj, x, q_out + kv_out, q_out + 2 * kv_out)
            q, k = qk.split((q_out, kv_out), dim=-1)
        return self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    def _project_rotated(self, x: Tensor, pos: Tensor, hi: int | None) -> tuple[Tensor, Tensor, Tensor]:
        """``_project_self`` with rotary positions: the query and key heads are adjacent columns of the fused
        projection, so one rotation serves both (half the elementwise calls of a decode step's RoPE)."""
        B, L, _ = x.shape
        q_out, kv_out, _ = self._split
        qkv = self.qkv_proj(x)  # (B, L, (Hq + 2 Hkv) d_head)
        qk = qkv[..., : q_out + kv_out].view(B, L, self.n_heads + self.n_kv_heads, self.d_head).transpose(1, 2)
        qk = self.positions.rotate(qk, pos, max_position=hi)  # (B, Hq + Hkv, L, d_head)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)
        return q, k, self._heads(qkv[..., q_out + kv_out :], self.n_kv_heads)

    def _project_query(self, x: Tensor) -> Tensor:
        if self.self_capable:
            q = _rows(self.qkv_proj, x, 0, self._split[0])
        else:
            q = self.q_proj(x)
        return self._heads(q, self.n_heads)  # (B, Hq, L, d_head)

    def _context_inputs(self, context, batch: int) -> tuple[Tensor, Tensor]:
        if isinstance(context, (tuple, list)):
            if len(context) != 2:
                raise ValueError(
                    f"context must be a tensor or a pair (key_input, value_input), got {len(context)} items"
                )
            key_in, value_in = context
        else:
            if self.kdim != self.vdim:
                raise ValueError(
                    f"this MultiHeadAttention has kdim={self.kdim} != vdim={self.vdim}: pass "
                    f"context=(key_input, value_input)"
                )
            key_in = value_in = context
        _checks.features("context", key_in, self.kdim, what=f"(B, Lc, kdim={self.kdim})")
        _checks.features("context values", value_in, self.vdim, what=f"(B, Lc, vdim={self.vdim})")
        if key_in.shape[0] != batch or value_in.shape[:2] != key_in.shape[:2]:
            raise ValueError(
                f"context of shape {tuple(key_in.shape)} (values {tuple(value_in.shape)}) does not "
                f"match the batch of x (B={batch}) or its keys' length"
            )
        return key_in, value_in

    def _project_context(self, key_in: Tensor, value_in: Tensor) -> tuple[Tensor, Tensor]:
        q_out, kv_out, _ = self._split
        if self.self_capable:
            if key_in is value_in:
                k, v = _rows(self.qkv_proj, key_in, q_out, q_out + 2 * kv_out).split(kv_out, dim=-1)
            else:
                k = _rows(self.qkv_proj, key_in, q_out, q_out + kv_out)
                v = _rows(self.qkv_proj, value_in, q_out + kv_out, q_out + 2 * kv_out)
        elif hasattr(self, "kv_proj"):
            if key_in is value_in:
                k, v = self.kv_proj(key_in).split(kv_out, dim=-1)
            else:
                k = _rows(self.kv_proj, key_in, 0, kv_out)
                v = _rows(self.kv_proj, value_in, kv_out, 2 * kv_out)
        else:
            k, v = self.k_proj(key_in), self.v_proj(value_in)
        return self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    # ---------------------------------------------------------------------------- forward

    def forward(
        self,
        x: Tensor,
        context=None,
        *,
        mask=None,
        cache=None,
        positions=None,
        need_weights: bool = False,
        key_padding_mask: Tensor | None = None,
    ):
        """Attention of ``x (B, L, d_model)`` to itself or to ``context (B, Lc, kdim)``; see the class doc."""
        if key_padding_mask is not None:
            mask = _checks.combine(_checks.as_mask("mask", mask), _torch_key_padding(key_padding_mask))
        call = dict(mask=mask, cache=cache, positions=positions, need_weights=need_weights)
        if not self.batch_first:
            return self._forward_sequence_first(x, context, **call)
        return self._forward_batch_first(x, context, **call)

    def _forward_sequence_first(self, x: Tensor, context, **call):
        """``batch_first=False``: ``x (L, B, d_model)`` and ``context (Lc, B, kdim)`` in, ``(L, B, d_model)`` out."""
        _checks.features("x", x, self.d_model, what=f"(L, B, d_model={self.d_model}) (batch_first=False)")
        if isinstance(context, (tuple, list)):
            context = type(context)(c.transpose(0, 1) if isinstance(c, Tensor) else c for c in context)
        elif isinstance(context, Tensor):
            context = context.transpose(0, 1)
        result = self._forward_batch_first(x.transpose(0, 1), context, **call)
        if call["need_weights"]:
            return result[0].transpose(0, 1), result[1]
        return result.transpose(0, 1)

    def _forward_batch_first(self, x: Tensor, context, *, mask, cache, positions, need_weights: bool):
        _checks.features("x", x, self.d_model, what=f"(B, L, d_model={self.d_model})")
        need_weights = _checks.flag("need_weights", need_weights)
        _check_layer_cache("cache", cache)
        self._check_dtype(x)
        call_mask = _checks.as_mask("mask", mask)
        if context is None:
            q, k, v, bias = self._self_qkv(x, cache, positions)
        else:
            (q, k, v), bias = self._cross_qkv(x, context, cache), None
        extra = None
        if cache is not None:
            kv = _update_cache(
                cache, k, v, call_mask=call_mask, heads=self.n_heads, q_len=x.shape[1], need_weights=need_weights
            )
            if isinstance(kv, CacheAttention):  # the cache computes attention itself (paged, quantized)
                out = cache_attend(
                    kv,
                    q,
                    mask=_checks.combine(self.mask, call_mask),
                    bias=bias,
                    scale=self._scale(),
                    softcap=self.softcap,
                    sinks=self.sinks,
                    compute=self._hooked_compute(),
                )
                return self._output(out)
            k, v, extra = _checks.cache_kv(kv)  # everything stored, in position order
        return self._attention(q, k, v, bias=bias, call_mask=call_mask, extra=extra, need_weights=need_weights)

    def _scale(self) -> float:
        return 1.0 / (math.sqrt(self.d_head) * self.temperature)

    def _self_qkv(self, x: Tensor, cache, positions) -> tuple[Tensor, Tensor, Tensor, BiasLike | None]:
        """Self-attention's ``q (B, Hq, L, d_head)``, new ``k``, ``v (B, Hkv, L, d_head)`` (normed, rotated at
        their absolute positions) and the position bias (a score modifier or None)."""
        if not self.self_capable:
            raise ValueError(
                f"this MultiHeadAttention has kdim={self.kdim}, vdim={self.vdim} != "
                f"d_model={self.d_model}, so it only does cross attention: pass context"
            )
        pos, hi = self._absolute_positions(cache, positions, x)
        if pos is not None and self.q_norm is None and isinstance(self.positions, RotaryEmbedding):
            q, k, v = self._project_rotated(x, pos, hi)
        else:
            q, k, v = self._project_self(x, pos)
            if self.q_norm is not None:
                q, k = self._qk_normed(self.q_norm, q), self._qk_normed(self.k_norm, k)
            if pos is not None:
                q, k = self.positions.rotate(q, pos, max_position=hi), self.positions.rotate(k, pos, max_position=hi)
        bias = self.positions.score_mod() if self.positions is not None else None
        return q, k, v, bias

    def _absolute_positions(self, cache, positions, x: Tensor) -> tuple[Tensor | None, int | None]:
        """The positions ``(L,)`` or ``(B, L)`` an absolute encoding reads, and the largest where it is known
        without reading the tensor; ``(None, None)`` for relative encodings or none (given positions are still
        checked)."""
        B, L, _ = x.shape
        absolute = self.positions is not None and self.positions.absolute
        if positions is not None:
            pos = _checks.positions_tensor("positions", positions, B, L, x.device)
            return (pos, None) if absolute else (None, None)
        if not absolute:
            return None, None
        offset = 0  # default: offset + arange(L), with the offset the tokens the cache holds
        if cache is not None:
            offset = getattr(cache, "seq_len", None)
            if not isinstance(offset, int):
                raise ValueError(
                    f"{type(self.positions).__name__} needs absolute positions with a cache: pass "
                    f"positions=..., or give the cache an int attribute seq_len"
                )
        return torch.arange(offset, offset + L, device=x.device), offset + L - 1

    def _cross_qkv(self, x: Tensor, context, cache) -> tuple[Tensor, Tensor, Tensor]:
        """Cross attention's ``q (B, Hq, L, d_head)`` and the context's ``k``, ``v (B, Hkv, Lc, d_head)``;
        zero-length ``k``, ``v`` once ``cache`` holds the context (``cache.seq_len > 0``)."""
        if self.positions is not None:
            raise ValueError(
                "positions= applies to self-attention; this module was built with "
                f"{type(self.positions).__name__}: build the cross-attention module without it"
            )
        B = x.shape[0]
        key_in, value_in = self._context_inputs(context, B)
        q = self._project_query(x)
        filled = 0
        if cache is not None:
            filled = getattr(cache, "seq_len", None)
            if not isinstance(filled, int):
                raise TypeError(
                    f"a cross-attention cache needs an int attribute seq_len (0 until filled), "
                    f"got {type(cache).__name__} without one"
                )
        if filled == 0:
            k, v = self._project_context(key_in, value_in)
        else:  # the cache holds the context's keys and values: nothing new to store
            k = q.new_empty(B, self.n_kv_heads, 0, self.d_head)
            v = q.new_empty(B, self.n_kv_heads, 0, self.d_head)
        if self.q_norm is not None:
            q = self._qk_normed(self.q_norm, q)
            if k.shape[2]:
                k = self._qk_normed(self.k_norm, k)
        return q, k, v

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, *, bias, call_mask, extra, need_weights: bool):
        """``q (B, Hq, L, d_head)`` over every key ``k, v (B, Hkv, Lk, d_head)`` under the layer's, the call's
        and the cache's masks, through ``_attend``: ``out (B, L, d_model)``, and the weights
        ``(B, Hq, L, Lk)`` with ``need_weights``."""
        B, _, L, _ = q.shape
        layer_mask = self.mask
        if self._plain_causal and L == 1 and call_mask is None and extra is None:
            layer_mask = None  # one query at the last position sees every key: no mask to evaluate
        _checks.check_mask_shape("mask", call_mask, B, self.n_heads, L, k.shape[2])
        m = _checks.combine(layer_mask, call_mask, extra)
        sk = {} if self.sinks is None else {"sinks": self.sinks}
        scale, dropout_p = self._scale(), self.dropout if self.training else 0.0
        out = self._attend(q, k, v, mask=m, bias=bias, scale=scale, softcap=self.softcap, dropout_p=dropout_p, **sk)
        out = self._output(out)
        if need_weights:
            return out, attention_weights(q, k, v, mask=m, bias=bias, scale=scale, softcap=self.softcap, **sk)
        return out

    def _qk_normed(self, norm: nn.Module, t: Tensor) -> Tensor:
        """``t (B, H, L, D)`` through a q/k norm: per head, or over all ``H D`` features of a token."""
        if not self.qk_norm_all:
            return norm(t)
        B, H, L, D = t.shape
        flat = norm(t.transpose(1, 2).reshape(B, L, H * D))  # (B, L, H D)
        return flat.view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)

    def _output(self, out: Tensor) -> Tensor:
        B, H, L, D = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, L, H * D))  # (B, L, d_model)

    # --------------------------------------------------------------------------- convert

    @classmethod
    def from_torch(
        cls, m: nn.MultiheadAttention, *, backend: str = "auto", batch_first: bool | None = None
    ) -> "MultiHeadAttention":
        """An equivalent module from a ``torch.nn.MultiheadAttention`` (weights copied; dtype, device and training mode kept).

        The layout of the inputs is the source module's (``batch_first`` defaults to ``m.batch_first``): a
        module built with torch's default ``batch_first=False`` gives one that takes and returns ``(L, B, E)``;
        pass ``batch_first=True`` for a batch-first module (then transpose such inputs yourself).

        Masks use the opposite convention from torch's (True = may attend).  torch's ``key_padding_mask (B, S)``
        (True = ignore) is taken as it is by ``forward(..., key_padding_mask=...)``, or converted once with
        ``masks.key_padding(~key_padding_mask)``; never pass it as ``mask=``, which would attend to exactly the
        padding.  A bool ``attn_mask (L, S)`` or ``(B*H, L, S)`` (True = not allowed) becomes ``~attn_mask``
        (reshaped to ``(B, H, L, S)``).  torch's averaged weights are ``weights.mean(1)``.  ``add_bias_kv``
        and ``add_zero_attn`` are not supported.

        Example::

            >>> import torch
            >>> from attnkit.nn import MultiHeadAttention
            >>> tm = torch.nn.MultiheadAttention(16, 4)  # batch_first=False: (L, B, E)
            >>> x = torch.randn(5, 2, 16)
            >>> pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # (B, S), True = ignore
            >>> mine = MultiHeadAttention.from_torch(tm)
            >>> torch.allclose(mine(x, key_padding_mask=pad), tm(x, x, x, key_padding_mask=pad)[0], atol=1e-6)
            True
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention, got {type(m).__name__}")
        if batch_first is None:
            batch_first = bool(m.batch_first)
        if not isinstance(batch_first, bool):
            raise TypeError(
                f"from_torch: batch_first must be None (the source module's), True or False, got {batch_first!r}"
            )
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch: add_bias_kv=True and add_zero_attn=True have no equivalent here")
        E, H = m.embed_dim, m.num_heads
        has_bias = m.in_proj_bias is not None
        ref = m.out_proj.weight
        out = cls(
            E,
            H,
            kdim=m.kdim,
            vdim=m.vdim,
            bias=has_bias,
            dropout=m.dropout,
            backend=backend,
            out_bias=m.out_proj.bias is not None,
            batch_first=batch_first,
        ).to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                wq, wk, wv = m.in_proj_weight.split(E)
            else:
                wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            b = m.in_proj_bias
            bq, bk, bv = b.split(E) if has_bias else (None, None, None)
            if out.self_capable:
                pairs = [(out.qkv_proj, torch.cat([wq, wk, wv]), b)]
            elif hasattr(out, "kv_proj"):
                pairs = [(out.q_proj, wq, bq), (out.kv_proj, torch.cat([wk, wv]), None if b is None else b[E:])]
            else:
                pairs = [(out.q_proj, wq, bq), (out.k_proj, wk, bk), (out.v_proj, wv, bv)]
            for lin, w, bb in pairs:
                lin.weight.copy_(w)
                if bb is not None:
                    lin.bias.copy_(bb)
            out.out_proj.weight.copy_(m.out_proj.weight)
            if m.out_proj.bias is not None:
                out.out_proj.bias.copy_(m.out_proj.bias)
        return out.train(m.training)

    def extra_repr(self) -> str:
        s = f"d_model={self.d_model}, n_heads={self.n_heads}"
        if self.n_kv_heads != self.n_heads:
            s += f", n_kv_heads={self.n_kv_heads}"
        s += f", d_head={self.d_head}"
        if not self.self_capable:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.mask is not None:
            s += f", mask={self.mask!r}"
        for name in ("softcap",):
            if getattr(self, name) is not None:
                s += f", {name}={getattr(self, name)}"
        if self.temperature != 1.0:
            s += f", temperature={self.temperature}"
        if self.sinks is not None:
            s += ", sinks=True"
        if self.backend != "auto":
            s += f", backend={self.backend!r}"
        if not self.batch_first:
            s += ", batch_first=False"
        return s
