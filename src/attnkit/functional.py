"""``attention()``: validate, pick a backend, run it."""

from __future__ import annotations

import math
import sys
import warnings
import weakref

import torch

from . import backends as _backends
from ._checks import flag, number
from .backends import _math
from .backends._common import Call, accumulation_dtype, per_mask
from .bias import ScoreMod
from .masks import Mask, _FromDense, _nothing_visible, _positions_unchecked, from_dense, from_flex

Tensor = torch.Tensor

__all__ = ["attention", "attention_weights"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Callables ``observe(q, k, v, mask=, bias=, scale=, softcap=, out=)`` told of every attention() call's result;
# attnkit.diagnostics.probe adds one while it runs (so it sees models that call attention() themselves).
_OBSERVERS: list = []


# ------------------------------------------------------------------- input checks


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, L, D), got shape {tuple(t.shape)}: "
                             f"add the missing dims with {name}.view(...) or {name}[None]")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; attention takes float16, bfloat16, float32 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}: cast them with .to()")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}: move them with "
                         f".to(q.device)")
    (B, Hq, Lq, D), (Bk, Hkv, Lk, Dk), (Bv, Hv, Lv, Dv) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv):
        raise ValueError(f"batch sizes differ: q has B={B}, k has B={Bk}, v has B={Bv}: give every tensor the "
                         f"same batch (expand a shared k/v with k.expand({B}, -1, -1, -1))")
    if Hkv != Hv:
        raise ValueError(f"k and v must have the same number of heads, got Hk={Hkv} and Hv={Hv}: project both "
                         f"to the same number of key/value heads")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"got Hq={Hq} and Hkv={Hkv}: Hq must be a multiple of Hkv (grouped-query attention)")
    if D != Dk:
        raise ValueError(f"q and k must have the same head dim, got D={D} for q and D={Dk} for k")
    if Lk != Lv:
        raise ValueError(f"k and v must have the same length, got Lk={Lk} and Lv={Lv}")


def _broadcasts(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _shape_hint(t: Tensor, shape, name: str) -> str:
    """A fix for a mask/bias that does not broadcast: a Hugging Face style (B, Lk) padding mask, mostly."""
    B, _, _, Lk = shape
    if t.dim() == 2 and t.shape == (B, Lk) and B > 1:
        fix = (f"{name}[:, None, None, :]" + ("" if name == "bias" else f", or masks.key_padding({name})"))
        return f": a (B, Lk) padding {name} needs the head and query axes: pass {fix}"
    return (f": give it shape (B, H, Lq, Lk) or one that broadcasts to it (size 1 or missing leading axes), "
            f"e.g. (Lq, Lk) or (B, 1, 1, Lk)")


def _is_block_mask(mask) -> bool:
    """Whether ``mask`` is a FlexAttention ``BlockMask`` (without importing flex_attention)."""
    flex = sys.modules.get("torch.nn.attention.flex_attention")
    return flex is not None and isinstance(mask, flex.BlockMask)


def _check_mask(mask, q: Tensor, shape) -> Mask | None:
    if mask is None:
        return None
    if _is_block_mask(mask):
        mask = from_flex(mask)
    if isinstance(mask, Mask):
        mask.validate(*shape)
        return mask
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}: use "
                            f"mask.bool() for a 0/1 mask, or pass additive float scores as bias=")
        if not _broadcasts(mask.shape, shape):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Lq, Lk)={shape}"
                             f"{_shape_hint(mask, shape, 'mask')}")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}: move it with mask.to(q.device)")
        while mask.dim() < 2:  # (Lk,) or (): broadcast like a bias of that shape
            mask = mask.unsqueeze(0)
        return from_dense(mask)
    if callable(mask):
        raise TypeError("mask must be None, an attnkit.masks.Mask, a bool tensor or a FlexAttention BlockMask; wrap "
                        "a function fn(b, h, q_idx, kv_idx) -> bool tensor with attnkit.masks.from_fn(fn) (q_idx is "
                        "the query row, as in FlexAttention; from_fn(fn, align='bottom_right') gives positions)")
    raise TypeError(f"mask must be None, an attnkit.masks.Mask, a bool tensor or a FlexAttention BlockMask, got "
                    f"{type(mask).__name__}")


def _check_bias(bias, q: Tensor, shape):
    if bias is None:
        return None
    if isinstance(bias, ScoreMod):
        bias.validate(*shape)
        return bias
    if isinstance(bias, torch.Tensor):
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a float tensor of additive scores, got dtype {bias.dtype} "
                            f"(a bool tensor belongs in mask=)")
        if not _broadcasts(bias.shape, shape):
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to (B, H, Lq, Lk)={shape}"
                             f"{_shape_hint(bias, shape, 'bias')}")
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device} but q is on {q.device}: move it with bias.to(q.device)")
        return bias
    if callable(bias):
        raise TypeError("bias must be None, a float tensor or an attnkit.bias modifier; wrap a function "
                        "fn(score, b, h, q_idx, kv_idx) with attnkit.bias.from_fn(fn)")
    raise TypeError(f"bias must be None, a float tensor or an attnkit.bias modifier, got {type(bias).__name__}")


def _check_number(name: str, value, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False, fix: str = "") -> float:
    return number(name, value, low=low, high=high, low_open=low_open, high_open=high_open, fix=fix)


def _check_scale(scale: float, q: Tensor, bias) -> None:
    """Refuse a scale so large that it alone overflows the scores: above ``sqrt(finfo.max)`` of the dtype
    the scores are computed in, a score ``q.k * scale`` is inf for any ``|q.k|`` above that same bound
    and the softmax's rows become NaN (at such a scale the result would be the argmax's hard limit anyway)."""
    factor = bias.scale_factor if isinstance(bias, ScoreMod) and bias.scale_factor is not None else 1.0
    acc = accumulation_dtype(q.dtype)
    limit = math.sqrt(torch.finfo(acc).max)
    if abs(scale * factor) > limit:
        what = f"scale={scale!r}" + (f" with {bias!r}" if factor != 1.0 else "")
        raise ValueError(f"{what} scales the scores by {scale * factor:.3g}, beyond {limit:.3g} (the square root "
                         f"of the largest {str(acc).replace('torch.', '')}, in which the scores are computed): "
                         f"scores would overflow to inf and give NaN rows; use a scale of at most {limit:.3g} in "
                         f"magnitude")


_FOREIGN = {  # keyword arguments of other attention functions: what attnkit takes instead
    "is_causal": ("pass mask=masks.causal() instead (from attnkit import masks). attnkit's causal mask is "
                  "bottom-right aligned (query row i sits at position i + Lk - Lq, as in FlashAttention), while "
                  "SDPA's is_causal is top-left aligned: they differ when Lq != Lk, where "
                  "masks.causal(align='top_left') is SDPA's"),
    "attn_mask": ("pass a bool mask as mask= (True = may attend, as in SDPA) and a float (additive) mask as bias="),
    "enable_gqa": ("drop it: grouped-query attention is automatic when Hq is a multiple of Hkv (k and v are never "
                   "copied)"),
    "causal": ("pass mask=masks.causal() instead (from attnkit import masks); it is bottom-right aligned, as "
               "FlashAttention's causal=True"),
    "window_size": ("pass mask=masks.sliding_window(left, right) instead (from attnkit import masks) for "
                    "FlashAttention's window_size=(left, right); -1 (unbounded) is None there"),
    "softmax_scale": "pass scale= instead",
    "block_mask": ("pass the BlockMask as mask= (it is converted with attnkit.masks.from_flex)"),
    "score_mod": ("pass bias=attnkit.bias.from_fn(score_mod) instead"),
    "alibi_slopes": ("pass bias=attnkit.bias.alibi(slopes) instead"),
    "need_weights": "use attnkit.attention_weights(q, k, ...) for the weights",
    "return_attn_probs": "use attnkit.attention_weights(q, k, ...) for the weights",
}


def _refuse_foreign(fn: str, kwargs: dict) -> None:
    """A TypeError for keyword arguments attnkit does not take, naming attnkit's equivalent where known."""
    if not kwargs:
        return
    name, value = next(iter(kwargs.items()))
    fix = _FOREIGN.get(name)
    if name in ("is_causal", "causal") and value is False:
        fix = "drop it: without mask= no mask applies"
    elif name == "window_size" and isinstance(value, (tuple, list)) and len(value) == 2 \
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        left, right = (None if x < 0 else x for x in value)
        fix = (f"pass mask=masks.sliding_window({left}, {right}) instead (from attnkit import masks): "
               f"FlashAttention's window_size=(left, right), -1 (unbounded) being None")
    if fix is None:
        raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
    shown = f"<tensor {tuple(value.shape)} {value.dtype}>" if isinstance(value, Tensor) else repr(value)
    raise TypeError(f"{fn}() takes no {name}={shown}: {fix}")


def _check_sinks(sinks, q: Tensor) -> Tensor | None:
    """``sinks`` as a ``(B, Hq)`` view (expanded, so its gradient reaches the caller's tensor)."""
    if sinks is None:
        return None
    B, Hq = q.shape[0], q.shape[1]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a float tensor of shape (Hq,)=({Hq},), one logit per query head, "
                        f"got {type(sinks).__name__}: pass torch.tensor([...])")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor, got dtype {sinks.dtype}: use sinks.float()")
    if not _broadcasts(sinks.shape, (B, Hq)):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} does not broadcast to (B, Hq)=({B}, {Hq}): give "
                         f"one logit per query head, shape ({Hq},) (or ({B}, {Hq}))")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}: move it with sinks.to(q.device)")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(sinks.detach()).all()):
        raise ValueError(f"sinks holds a non-finite value ({sinks.detach().tolist()}): give finite logits "
                         f"(for no sink at all, leave sinks=None)")
    return sinks.expand(B, Hq)


def _make_call(q, k, v, *, mask=None, bias=None, scale=None, softcap=None, dropout_p=0.0,
               return_lse=False, sinks=None) -> Call:
    _check_qkv(q, k, v)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    mask = _check_mask(mask, q, shape)
    bias = _check_bias(bias, q, shape)
    if q.shape[-1] == 0 and scale is None:
        raise ValueError(f"q has head dimension D=0 (shape {tuple(q.shape)}): the default scale 1/sqrt(D) is "
                         f"undefined; give heads of size >= 1 (or an explicit scale)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else _check_number("scale", scale)
    _check_scale(scale, q, bias)
    if softcap is not None:
        softcap = _check_number("softcap", softcap, low=0.0, low_open=True, fix=" (or None for no softcap)")
    dropout_p = _check_number("dropout_p", dropout_p, low=0.0, high=1.0, high_open=True)
    sinks = _check_sinks(sinks, q)
    return Call(q, k, v, mask, bias, scale, softcap, dropout_p, flag("return_lse", return_lse), sinks)


def graph_zero(*tensors: Tensor) -> Tensor:
    """A 0 attached to the tensors' graph (their gradients through it are zeros), never NaN: summed over
    an empty slice, so an inf or NaN in them does not leak in (``x.sum() * 0`` would be NaN)."""
    return sum(t.narrow(-1, 0, 0).sum() for t in tensors)


# mask -> {shape: whether it leaves every row empty} (weakly keyed; a few shapes per mask)
_CHECKED_VISIBLE: "weakref.WeakKeyDictionary[Mask, dict]" = weakref.WeakKeyDictionary()
_CHECKED_PER_MASK = 16


def _warn_if_nothing_visible(call: Call) -> None:
    """Warn when the mask leaves every query of a non-empty call with nothing to attend to, for masks whose
    parts may read positions differently (a ``from_fn`` or BlockMask predicate over query rows, or parts
    aligned both ways when ``Lq != Lk``): the mark of a row predicate combined with bottom-right masks.
    Evaluated once per mask and shape; the built-in masks on their own are not checked."""
    m = call.mask
    if m is None or isinstance(m, _FromDense) or call.q.device.type == "meta" or torch.compiler.is_compiling():
        return
    if not _positions_unchecked(m, call.q_len, call.kv_len):
        return
    key = (call.batch, call.heads, call.q_len, call.kv_len)
    memo = per_mask(_CHECKED_VISIBLE, m)
    empty = None if memo is None else memo.get(key)
    if empty is None:
        empty = _nothing_visible(m, call.batch, call.heads, call.q_len, call.kv_len, call.q.device)
        if memo is not None:
            if len(memo) >= _CHECKED_PER_MASK:
                memo.clear()
            memo[key] = empty
    if empty:  # (Python's warning filters show it once per calling line)
        warnings.warn(f"mask {m!r} leaves every query of this (B, H, Lq, Lk)=({call.batch}, {call.heads}, "
                      f"{call.q_len}, {call.kv_len}) call with no key to attend to: the output is all zeros. A "
                      f"from_fn predicate gets query rows (as in FlexAttention) while the built-in masks use "
                      f"positions row + Lk - Lq: give it positions with masks.from_fn(fn, align='bottom_right'), "
                      f"or align the built-ins with align='top_left'", stacklevel=3)


def _is_empty(call: Call) -> bool:
    """Nothing to compute: no batch, no query heads, no queries or no keys."""
    return call.batch == 0 or call.heads == 0 or call.q_len == 0 or call.kv_len == 0


def _empty_result(call: Call):
    """An empty call (or Lq == 0 or Lk == 0): zero output and -inf lse, still attached to the graph (zero
    gradients)."""
    q, k, v = call.q, call.k, call.v
    zero = graph_zero(q, k, v) if call.sinks is None else graph_zero(q, k, v, call.sinks)
    out = torch.zeros(call.batch, call.heads, call.q_len, v.shape[-1], dtype=q.dtype, device=q.device) + zero
    if not call.return_lse:
        return out
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    if call.sinks is not None:  # the denominator is the sink alone
        lse = call.sinks.to(lse_dtype)[..., None].expand(call.batch, call.heads, call.q_len)
        return out, lse + graph_zero(q, k, v)
    return out, torch.full((call.batch, call.heads, call.q_len), float("-inf"), dtype=lse_dtype, device=q.device)


# ---------------------------------------------------------------------- public API


def attention(q: Tensor, k: Tensor, v: Tensor, *, mask=None, bias=None, scale: float | None = None,
              softcap: float | None = None, sinks: Tensor | None = None, dropout_p: float = 0.0,
              return_lse: bool = False, backend: str = "auto", **unknown):
    """Scaled dot-product attention: ``softmax(mask(bias(softcap(q @ k^T * scale)))) @ v``.

    Args:
        q: ``(B, Hq, Lq, D)`` queries.
        k: ``(B, Hkv, Lk, D)`` keys; ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention;
            ``Hkv = 1`` is multi-query).  Query head ``h`` uses key/value head ``h // (Hq // Hkv)``.
        v: ``(B, Hkv, Lk, Dv)`` values; ``Dv`` may differ from ``D``.
        mask: ``None``, an :class:`attnkit.masks.Mask`, a bool tensor broadcastable to
            ``(B, Hq, Lq, Lk)`` (True means "may attend"), or a FlexAttention ``BlockMask`` (converted with
            :func:`attnkit.masks.from_flex`).
        bias: ``None``, a float tensor broadcastable to ``(B, Hq, Lq, Lk)`` added to the scores, or an
            :mod:`attnkit.bias` modifier (ALiBi, T5 buckets, temperature, ``from_fn``).
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.  A magnitude above ``sqrt(finfo.max)`` of the
            dtype the scores are computed in (float32 for half inputs: about ``1.8e19``) is refused: it would
            overflow the scores to inf.
        softcap: ``s`` maps a score ``x`` to ``s * tanh(x / s)`` (Gemma 2); applied before the bias.
        sinks: attention sinks (GPT-OSS): a float tensor ``(Hq,)`` (or broadcastable to ``(B, Hq)``), one
            logit per query head added to every row's softmax denominator with a zero value:
            ``out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))``.  Differentiable.  Not
            touched by ``mask``, ``bias``, ``softcap`` or ``scale``.
        dropout_p: dropout on the attention weights (reproducible under ``torch.manual_seed``).
        return_lse: also return the log-sum-exp of each row's final scores; with ``sinks``, of the whole
            denominator (``logaddexp(lse_without_sink, sink)``): see :func:`attnkit.softmax.add_sink`
            for merging pieces computed with a sink.
        backend: ``"auto"`` or a name from :func:`attnkit.backends.available`.
        **unknown: keyword arguments of other attention functions (SDPA's ``is_causal``, ``attn_mask``,
            ``enable_gqa``; FlashAttention's ``causal``, ``window_size``, ``softmax_scale``; FlexAttention's
            ``block_mask``, ``score_mod``) raise a TypeError naming the attnkit equivalent.

    Returns:
        ``out (B, Hq, Lq, Dv)`` in the input dtype; with ``return_lse``, also ``lse (B, Hq, Lq)``
        (float32, float64 for float64 inputs).

    Query row ``i`` sits at position ``i + Lk - Lq`` (bottom-right), so with a causal mask and
    ``Lq < Lk`` the last query sees every key, and with ``Lq > Lk`` the first rows see none::

        Lq=2, Lk=5 causal      Lq=5, Lk=2 causal
           █ █ █ █ ·              · ·    <- sees nothing: output 0, lse -inf
           █ █ █ █ █              · ·
                                  · ·
                                  █ ·
                                  █ █

    A row that may attend to nothing gives output 0, ``lse = -inf`` and zero gradients, never NaN.  When a
    mask with a ``from_fn`` (or BlockMask) part leaves *every* row of a call with nothing, a warning says so.
    Meta tensors give the output's shape (on ``math`` or ``sdpa``; ``flash`` refuses them).
    With ``sinks`` such a row's denominator is ``exp(sink)`` alone: output 0, ``lse = sink``, zero
    gradients for ``q``, ``k``, ``v`` and the sink (the sink's only gradient from it comes through ``lse``).

    Example::

        >>> import torch, attnkit
        >>> from attnkit import masks
        >>> q = torch.randn(2, 8, 10, 64); k = v = torch.randn(2, 2, 10, 64)
        >>> out = attnkit.attention(q, k, v, mask=masks.causal())
        >>> out.shape
        torch.Size([2, 8, 10, 64])
    """
    _refuse_foreign("attention", unknown)
    call = _make_call(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, dropout_p=dropout_p,
                      return_lse=return_lse, sinks=sinks)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    chosen = _backends.select(call, backend)
    if _is_empty(call):
        result = _empty_result(call)
    else:
        _warn_if_nothing_visible(call)
        result = chosen.run(call)
    if _OBSERVERS:
        out = result[0] if return_lse else result
        for observe in tuple(_OBSERVERS):
            observe(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, out=out)
    return result


def attention_weights(q: Tensor, k: Tensor, v: Tensor | None = None, *, mask=None, bias=None,
                      scale: float | None = None, softcap: float | None = None, sinks: Tensor | None = None,
                      **unknown) -> Tensor:
    """The attention weights ``(B, Hq, Lq, Lk)`` that :func:`attention` would apply (before dropout).

    With ``sinks`` a row's weights sum to ``1 - exp(sink - lse)``, the sink's share left out.

    Computed by the ``math`` backend (the weights are materialised by definition).  ``v`` is accepted
    for symmetry with :func:`attention` and only used for validation.  A fully masked row is all zeros.
    Keyword arguments of other attention functions raise a TypeError naming the attnkit equivalent.

    Example::

        >>> import torch, attnkit
        >>> q = k = torch.randn(1, 1, 3, 4)
        >>> w = attnkit.attention_weights(q, k, mask=attnkit.masks.causal())
        >>> torch.allclose(w.sum(-1), torch.ones(1, 1, 3))
        True
    """
    _refuse_foreign("attention_weights", unknown)
    if v is None:
        v = k
    call = _make_call(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks)
    if _is_empty(call):
        return torch.zeros(call.batch, call.heads, call.q_len, call.kv_len, dtype=q.dtype,
                           device=q.device) + graph_zero(q, k)
    _warn_if_nothing_visible(call)
    return _math.weights(call)
