"""The call every backend takes: :class:`Call`, and :func:`make_call`, which turns ``attention()``'s arguments
into a checked one.

Every entry point that computes attention (``attnkit.attention``, each backend's public function, the caches,
ring attention) builds its call here, so a bad argument gets the same message wherever it is passed.
"""

from __future__ import annotations

import math
import operator
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch

from .._checks import flag, holds, number
from ..bias import ScoreMod
from ..masks import Mask, MaskLike, from_dense, from_flex

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

Tensor = torch.Tensor

HALF = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs, the input's own dtype otherwise (float64 stays float64)."""
    return torch.float32 if dtype in HALF else dtype


@dataclass
class Call:
    """One validated ``attention()`` call.  ``mask`` is a Mask (bool tensors were wrapped), ``scale`` a float."""

    q: Tensor  # (B, Hq, Lq, D)
    k: Tensor  # (B, Hkv, Lk, D)
    v: Tensor  # (B, Hkv, Lk, Dv)
    mask: Mask | None
    bias: Tensor | ScoreMod | None
    scale: float
    softcap: float | None
    dropout_p: float
    return_lse: bool
    sinks: Tensor | None = None  # (B, Hq): one logit per query head in every row's denominator
    cache: dict[object, Any] = field(default_factory=dict)  # per-call memo shared by support checks and the run

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def q_len(self) -> int:
        return self.q.shape[2]

    @property
    def kv_len(self) -> int:
        return self.k.shape[2]

    @property
    def needs_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        tensors = (self.q, self.k, self.v, self.bias) if isinstance(self.bias, Tensor) else (self.q, self.k, self.v)
        return any(t.requires_grad for t in tensors) or (self.sinks is not None and self.sinks.requires_grad)

    def flops(self) -> float:
        """Forward multiply-adds x 2 of the dense computation."""
        f = self.cache.get("flops")
        if f is None:
            (b, h, lq, d), lk, dv = self.q.shape, self.k.shape[2], self.v.shape[3]
            f = self.cache["flops"] = 2.0 * b * h * lq * lk * (d + dv)
        return f


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims (B, H, L, D), got shape {tuple(t.shape)}: "
                f"add the missing dims with {name}.view(...) or {name}[None]"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; attention takes float16, bfloat16, float32 or float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}: cast them with .to()")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}: move them with .to(q.device)"
        )
    (B, Hq, _Lq, D), (Bk, Hkv, Lk, Dk), (Bv, Hv, Lv, _Dv) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv):
        raise ValueError(
            f"batch sizes differ: q has B={B}, k has B={Bk}, v has B={Bv}: give every tensor the "
            f"same batch (expand a shared k/v with k.expand({B}, -1, -1, -1))"
        )
    if Hkv != Hv:
        raise ValueError(
            f"k and v must have the same number of heads, got Hk={Hkv} and Hv={Hv}: project both "
            f"to the same number of key/value heads{_layout_hint(q, k, v)}"
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"got Hq={Hq} and Hkv={Hkv}: Hq must be a multiple of Hkv (grouped-query attention){_layout_hint(q, k, v)}"
        )
    if D != Dk:
        raise ValueError(f"q and k must have the same head dim, got D={D} for q and D={Dk} for k")
    if Lk != Lv:
        raise ValueError(f"k and v must have the same length, got Lk={Lk} and Lv={Lv}{_layout_hint(q, k, v)}")


def _layout_hint(q: Tensor, k: Tensor, v: Tensor) -> str:
    """The layout attnkit reads, and FlashAttention's fix when the tensors read as ``(B, L, H, D)`` fit."""
    hint = "; attnkit reads q, k, v as (B, H, L, D), heads before length"
    (_, lq, hq, _), (_, lk, hkv, _), (_, lv, hv, _) = q.shape, k.shape, v.shape
    if hkv == hv and hkv > 0 and hq % hkv == 0 and lk == lv:
        hint += (
            f": these shapes fit FlashAttention's (B, L, H, D) layout (Hq={hq}, Hkv={hkv}, Lq={lq}, Lk={lk}); "
            f"pass q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)"
        )
    return hint


def layout_swap_suspected(call: Call) -> bool:
    """Whether the call's shapes look like FlashAttention's ``(B, L, H, D)`` tensors read as ``(B, H, L, D)``:
    a bottom-right causal mask with ``Lq >= 2 * Lk`` (at least half its rows see nothing), ``Lk`` dividing
    ``Lq``, ``Lq <= 256`` (a head count) and ``Hq == Hkv >= 16`` (self-attention in that layout has equal
    lengths, read as equal head counts, and grouped-query heads, read as lengths, divide)."""
    m = call.mask
    if m is None or not isinstance(m, Mask) or not m.is_causal("bottom_right"):
        return False
    hq, hkv, lq, lk = call.q.shape[1], call.k.shape[1], call.q_len, call.kv_len
    return 0 < 2 * lk <= lq <= 256 and lq % lk == 0 and hq == hkv >= 16


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _shape_hint(t: Tensor, shape: tuple[int, int, int, int], name: str) -> str:
    """A fix for a mask/bias that does not broadcast: a Hugging Face style (B, Lk) padding mask, mostly."""
    B, _, _, Lk = shape
    if t.dim() == 2 and t.shape == (B, Lk) and B > 1:
        fix = f"{name}[:, None, None, :]" + ("" if name == "bias" else f", or masks.key_padding({name})")
        return f": a (B, Lk) padding {name} needs the head and query axes: pass {fix}"
    return (
        ": give it shape (B, H, Lq, Lk) or one that broadcasts to it (size 1 or missing leading axes), "
        "e.g. (Lq, Lk) or (B, 1, 1, Lk)"
    )


def _is_block_mask(mask: object) -> TypeGuard[BlockMask]:
    """Whether ``mask`` is a FlexAttention ``BlockMask`` (without importing flex_attention)."""
    flex = sys.modules.get("torch.nn.attention.flex_attention")
    return flex is not None and isinstance(mask, flex.BlockMask)


def check_mask_kind(mask: object, q: Tensor) -> Mask | Tensor | None:
    """``mask`` checked for what it is, not for its shape: None, a Mask (a FlexAttention ``BlockMask`` becomes
    one) or a bool tensor on ``q``'s device (returned as it is); else the TypeError/ValueError every entry
    point gives."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if _is_block_mask(mask):
        return from_flex(mask)
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(
                f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}: use "
                f"mask.bool() for a 0/1 mask, or pass additive float scores as bias="
            )
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}: move it with mask.to(q.device)")
        return mask
    if callable(mask):
        raise TypeError(
            "mask must be None, an attnkit.masks.Mask, a bool tensor or a FlexAttention BlockMask; wrap "
            "a function fn(b, h, q_idx, kv_idx) -> bool tensor with attnkit.masks.from_fn(fn) (q_idx is "
            "the query row, as in FlexAttention; from_fn(fn, align='bottom_right') gives positions)"
        )
    raise TypeError(
        f"mask must be None, an attnkit.masks.Mask, a bool tensor or a FlexAttention BlockMask, got "
        f"{type(mask).__name__}"
    )


def check_mask(mask: object, q: Tensor, shape: tuple[int, int, int, int]) -> Mask | None:
    """``mask`` (:func:`check_mask_kind`) checked against the call's ``(B, H, Lq, Lk)``, as a Mask."""
    mask = check_mask_kind(mask, q)
    if mask is None or isinstance(mask, Mask):
        if mask is not None:
            mask.validate(*shape)
        return mask
    if not _broadcasts(mask.shape, shape):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Lq, Lk)={shape}"
            f"{_shape_hint(mask, shape, 'mask')}"
        )
    while mask.dim() < 2:  # (Lk,) or (): broadcast like a bias of that shape
        mask = mask.unsqueeze(0)
    return from_dense(mask)


def check_bias_kind(bias: object, q: Tensor) -> Tensor | ScoreMod | None:
    """``bias`` checked for what it is, not for its shape: None, an attnkit.bias modifier or a float tensor on
    ``q``'s device; else the TypeError/ValueError every entry point gives."""
    if bias is None or isinstance(bias, ScoreMod):
        return bias
    if isinstance(bias, torch.Tensor):
        if not bias.is_floating_point():
            raise TypeError(
                f"bias must be a float tensor of additive scores, got dtype {bias.dtype} "
                f"(a bool tensor belongs in mask=)"
            )
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device} but q is on {q.device}: move it with bias.to(q.device)")
        return bias
    if callable(bias):
        raise TypeError(
            "bias must be None, a float tensor or an attnkit.bias modifier; wrap a function "
            "fn(score, b, h, q_idx, kv_idx) with attnkit.bias.from_fn(fn)"
        )
    raise TypeError(f"bias must be None, a float tensor or an attnkit.bias modifier, got {type(bias).__name__}")


def check_bias(bias: object, q: Tensor, shape: tuple[int, int, int, int]) -> Tensor | ScoreMod | None:
    """``bias`` (:func:`check_bias_kind`) checked against the call's ``(B, H, Lq, Lk)``."""
    bias = check_bias_kind(bias, q)
    if isinstance(bias, ScoreMod):
        bias.validate(*shape)
    elif bias is not None and not _broadcasts(bias.shape, shape):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)} does not broadcast to (B, H, Lq, Lk)={shape}"
            f"{_shape_hint(bias, shape, 'bias')}"
        )
    return bias


def check_modifiers(
    q: Tensor, scale: float | None, softcap: float | None, bias: ScoreMod | Tensor | None
) -> tuple[float, float | None]:
    """``(scale, softcap)`` checked as :func:`make_call` checks them: ``scale`` a number (``1/sqrt(D)`` when
    None) that does not overflow the scores (:func:`check_scale`, with ``bias``, already checked), ``softcap``
    None or a positive number."""
    if scale is None:
        D = q.shape[-1]
        if D == 0:
            raise ValueError(
                f"q has head dimension D=0 (shape {tuple(q.shape)}): the default scale 1/sqrt(D) is "
                f"undefined; give heads of size >= 1 (or an explicit scale)"
            )
        # (operator.index: the head size is fixed in a compiled graph even under dynamic=True, so the default
        # scale is a number, not a symbolic float)
        scale = 1.0 / math.sqrt(operator.index(D))
    else:
        scale = check_number("scale", scale)
    check_scale(scale, q, bias)
    if softcap is not None:
        softcap = check_number("softcap", softcap, low=0.0, low_open=True, fix=" (or None for no softcap)")
    return scale, softcap


# the scalar check of ``scale``, ``softcap`` and ``dropout_p``, for the layers above that check them as a call does
check_number = number


# by q's dtype: the square root of its accumulation dtype's largest.  Filled here once for every floating dtype:
# a dict that filled up on first use made a function compiled before an eager call recompile after it (torch.compile
# guards on the dict's keys)
_SCALE_LIMITS: dict[torch.dtype, float] = {
    dt: math.sqrt(torch.finfo(accumulation_dtype(dt)).max)
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def check_scale(scale: float, q: Tensor, bias: Tensor | ScoreMod | None) -> None:
    """Refuse a scale so large that it alone overflows the scores: above ``sqrt(finfo.max)`` of the dtype
    the scores are computed in, a score ``q.k * scale`` is inf for any ``|q.k|`` above that same bound
    and the softmax's rows become NaN (at such a scale the result would be the argmax's hard limit anyway)."""
    factor = bias.scale_factor if isinstance(bias, ScoreMod) and bias.scale_factor is not None else 1.0
    limit = _SCALE_LIMITS.get(q.dtype)
    if limit is None:
        limit = _SCALE_LIMITS[q.dtype] = math.sqrt(torch.finfo(accumulation_dtype(q.dtype)).max)
    if abs(scale * factor) > limit:
        acc = accumulation_dtype(q.dtype)
        what = f"scale={scale!r}" + (f" with {bias!r}" if factor != 1.0 else "")
        raise ValueError(
            f"{what} scales the scores by {scale * factor:.3g}, beyond {limit:.3g} (the square root "
            f"of the largest {str(acc).replace('torch.', '')}, in which the scores are computed): "
            f"scores would overflow to inf and give NaN rows; use a scale of at most {limit:.3g} in "
            f"magnitude"
        )


_FOREIGN = {  # keyword arguments of other attention functions: what attnkit takes instead
    "is_causal": (
        "pass mask=masks.causal() instead (from attnkit import masks). attnkit's causal mask is "
        "bottom-right aligned (query row i sits at position i + Lk - Lq, as in FlashAttention), while "
        "SDPA's is_causal is top-left aligned: they differ when Lq != Lk, where "
        "masks.causal(align='top_left') is SDPA's"
    ),
    "attn_mask": ("pass a bool mask as mask= (True = may attend, as in SDPA) and a float (additive) mask as bias="),
    "enable_gqa": (
        "drop it: grouped-query attention is automatic when Hq is a multiple of Hkv (k and v are never copied)"
    ),
    "causal": (
        "pass mask=masks.causal() instead (from attnkit import masks); it is bottom-right aligned, as "
        "FlashAttention's causal=True"
    ),
    "window_size": (
        "pass mask=masks.sliding_window(left, right) instead (from attnkit import masks) for "
        "FlashAttention's window_size=(left, right); -1 (unbounded) is None there"
    ),
    "softmax_scale": "pass scale= instead",
    "block_mask": ("pass the BlockMask as mask= (it is converted with attnkit.masks.from_flex)"),
    "score_mod": ("pass bias=attnkit.bias.from_fn(score_mod) instead"),
    "alibi_slopes": ("pass bias=attnkit.bias.alibi(slopes) instead"),
    "need_weights": "use attnkit.attention_weights(q, k, ...) for the weights",
    "return_attn_probs": "use attnkit.attention_weights(q, k, ...) for the weights",
}


def refuse_foreign(fn: str, kwargs: dict[str, Any]) -> None:
    """A TypeError for keyword arguments attnkit does not take, naming attnkit's equivalent where known."""
    if not kwargs:
        return
    name, value = next(iter(kwargs.items()))
    fix = _FOREIGN.get(name)
    if name in ("is_causal", "causal") and value is False:
        fix = "drop it: without mask= no mask applies"
    elif (
        name == "window_size"
        and isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    ):
        left, right = (None if x < 0 else x for x in value)
        fix = (
            f"pass mask=masks.sliding_window({left}, {right}) instead (from attnkit import masks): "
            f"FlashAttention's window_size=(left, right), -1 (unbounded) being None"
        )
    if fix is None:
        raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}")
    shown = f"<tensor {tuple(value.shape)} {value.dtype}>" if isinstance(value, Tensor) else repr(value)
    raise TypeError(f"{fn}() takes no {name}={shown}: {fix}")


def check_sinks(sinks: object, q: Tensor) -> Tensor | None:
    """``sinks`` as a ``(B, Hq)`` view (expanded, so its gradient reaches the caller's tensor)."""
    if sinks is None:
        return None
    B, Hq = q.shape[0], q.shape[1]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"sinks must be None or a float tensor of shape (Hq,)=({Hq},), one logit per query head, "
            f"got {type(sinks).__name__}: pass torch.tensor([...])"
        )
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor, got dtype {sinks.dtype}: use sinks.float()")
    if not _broadcasts(sinks.shape, (B, Hq)):
        raise ValueError(
            f"sinks of shape {tuple(sinks.shape)} does not broadcast to (B, Hq)=({B}, {Hq}): give "
            f"one logit per query head, shape ({Hq},) (or ({B}, {Hq}))"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}: move it with sinks.to(q.device)")
    if not holds(
        torch.isfinite(sinks.detach()).all(),
        "sinks holds a non-finite value: give finite logits (for no sink at all, leave sinks=None)",
    ):
        raise ValueError(
            f"sinks holds a non-finite value ({sinks.detach().tolist()}): give finite logits "
            f"(for no sink at all, leave sinks=None)"
        )
    return sinks.expand(B, Hq)


def make_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: MaskLike | None = None,
    bias: object = None,  # checked here: an attnkit.bias modifier, a float tensor or None
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Call:
    check_qkv(q, k, v)
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    mask = check_mask(mask, q, shape)
    bias = check_bias(bias, q, shape)
    scale, softcap = check_modifiers(q, scale, softcap, bias)
    dropout_p = check_number("dropout_p", dropout_p, low=0.0, high=1.0, high_open=True)
    sinks = check_sinks(sinks, q)
    return Call(q, k, v, mask, bias, scale, softcap, dropout_p, flag("return_lse", return_lse), sinks)


def graph_zero(*tensors: Tensor) -> Tensor:
    """A 0 attached to the tensors' graph (their gradients through it are zeros), never NaN: summed over
    an empty slice, so an inf or NaN in them does not leak in (``x.sum() * 0`` would be NaN)."""
    # (sum() starts from the int 0, so its type is Tensor | int; with one tensor or more it is a Tensor)
    return cast(Tensor, sum(t.narrow(-1, 0, 0).sum() for t in tensors))


def single_query_window(call: Call) -> tuple[int, int] | None:
    """For one query row under a batch-independent interval mask (causal, sliding window, ...) and no
    bias, the visible keys are one contiguous range [lo, hi]: decoding then needs no mask at all."""
    if "window" in call.cache:
        return cast("tuple[int, int] | None", call.cache["window"])
    m, window = call.mask, None
    keys = None if call.q_len != 1 or call.bias is not None or m is None else m.key_range(0, 1, call.kv_len)
    if keys is not None:
        lo, hi = keys
        window = int(max(lo, 0)), int(min(hi, call.kv_len - 1))
    call.cache["window"] = window
    return window


def is_empty(call: Call) -> bool:
    """Nothing to compute: no batch, no query heads, no queries or no keys."""
    return call.batch == 0 or call.heads == 0 or call.q_len == 0 or call.kv_len == 0


def empty_result(call: Call) -> Tensor | tuple[Tensor, Tensor]:
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
