"""The ``triton`` backend's kernel launches: triton imported lazily, tile configurations, the score modifiers
and the mask's tile plans as the kernels take them (kept per mask and shape), and the forward and backward
launches (:func:`_forward`, :func:`_backward`), which both the autograd function (``autograd``) and the custom
operators (``custom_ops``) call."""

from __future__ import annotations

import os
import types
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, cast

import torch

from ...bias import ScoreMod
from ...masks import Mask
from . import plan as _plan
from ..call import Call

Tensor = torch.Tensor

_MAX_BITMAP_BYTES = 1 << 30  # largest per-tile mask bitmap this backend builds
_TRUE = ("1", "true", "on", "yes", "y")  # what triton accepts as TRITON_INTERPRET=1


# -------------------------------------------------------------------------------------- triton, lazily

_state: dict[str, Any] = {}  # "error": why triton does not import (or None); "kernels": the built kernel module


def _interpret_requested() -> bool:
    """Whether TRITON_INTERPRET is set now (read at call time, never at import)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def _import_error() -> str | None:
    if "error" not in _state:
        try:
            import triton  # noqa: F401

            _state["error"] = None
        except Exception as e:  # noqa: BLE001 (a broken install raises more than ImportError
            _state["error"] = f"{type(e).__name__}: {e}"
    return cast("str | None", _state["error"])


def _kernels() -> types.ModuleType:
    """The kernel module, built on first use in the mode triton was imported in (see ``kernels``)."""
    if "kernels" not in _state:
        from . import kernels as _triton_kernels

        _state["kernels"] = _triton_kernels.build()
    return cast(types.ModuleType, _state["kernels"])


def _device_reason(device: torch.device) -> str | None:
    """Why tensors on ``device`` cannot run here (None when they can); imports triton when it must."""
    if device.type == "cpu" and not _interpret_requested():
        return (
            "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is first "
            "imported (or move the tensors to a CUDA GPU)"
        )
    if device.type not in ("cpu", "cuda"):
        return f"tensors on {device.type}: the Triton kernels run on CUDA GPUs (or on the CPU under TRITON_INTERPRET=1)"
    err = _import_error()
    if err is not None:
        return f"triton does not import ({err})"
    if device.type == "cpu" and not _kernels().INTERPRETED:
        return (
            "triton was imported before TRITON_INTERPRET=1 was set, so it compiles for the GPU only: "
            "set TRITON_INTERPRET=1 before anything imports triton"
        )
    return None


# --------------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class _Tiles:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int = 4
    num_stages: int = 2


@lru_cache(maxsize=None)
def _configs(head_dim: int, dtype: torch.dtype, interpreted: bool) -> tuple[_Tiles, _Tiles]:
    """(forward tiles, backward tiles) for a head dim (max of D and Dv) and dtype.

    Under the interpreter 16 x 16 (the smallest tile ``tl.dot`` takes), so tiny test shapes still span
    several tiles.  On the GPU, FlashAttention-2's usual shapes, smaller as the head dim (registers and
    shared memory per tile) grows and for float32 (twice the bytes); not tuned on hardware yet.
    """
    if interpreted:
        return _Tiles(16, 16), _Tiles(16, 16)
    wide = dtype == torch.float32
    if head_dim <= 64:
        fwd, bwd = _Tiles(128, 64, 4, 3), _Tiles(64, 64, 4, 2)
    elif head_dim <= 128:
        fwd, bwd = _Tiles(128, 64, 8, 3), _Tiles(64, 64, 8, 2)
    else:
        fwd, bwd = _Tiles(64, 32, 4, 2), _Tiles(32, 32, 4, 1)
    if wide:
        fwd, bwd = _Tiles(64, 32, 4, 2), _Tiles(32, 32, 4, 1)
    return fwd, bwd


def _pow2(n: int, least: int = 16) -> int:
    """Smallest power of two >= max(n, least): tile widths must be powers of two, and tl.dot needs 16."""
    return max(least, 1 << max(0, (n - 1).bit_length()))


# ---------------------------------------------------------------------------------------- score mods


@dataclass
class _Mods:
    """Everything between ``q @ k^T`` and the mask, in the kernels' terms."""

    scale: float
    softcap: float | None = None
    slopes: Tensor | None = None  # (Hq,) float32 ALiBi slopes
    alibi_off: int = 0  # query row i sits at i + alibi_off for ALiBi
    bias: Tensor | None = None  # (B, Hq, Lq, Lk), broadcast strides 0
    source: object = None  # the call's bias (tensor or modifier): its tensors must not change before backward


def _bias_reason(call: Call) -> str | None:
    b = call.bias
    if b is None:
        return None
    grad = torch.is_grad_enabled()
    if isinstance(b, Tensor):
        if grad and b.requires_grad:
            return "a bias tensor that requires grad: the Triton kernels do not compute the bias gradient"
        return None
    if b.slopes is not None:
        if grad and b.slopes.requires_grad:
            return "learnable ALiBi slopes: the Triton kernels do not compute the slopes' gradient"
        return None
    if b.scale_factor is not None:
        if call.softcap is not None:
            return "a temperature after a softcap: the Triton kernels fold the temperature into the scale"
        return None
    return (
        f"bias {b!r} is not computed by the Triton kernels (they take ALiBi, a scalar temperature or a "
        f"float tensor bias without gradient)"
    )


def _mods(call: Call) -> _Mods:
    m = _Mods(call.scale, call.softcap, source=call.bias)
    b = call.bias
    if isinstance(b, ScoreMod) and b.scale_factor is not None:
        m.scale = call.scale * b.scale_factor  # dividing every score by t is scaling by 1/t (no softcap here)
    elif isinstance(b, ScoreMod) and b.slopes is not None:
        m.slopes = b.slopes.detach().to(device=call.q.device, dtype=torch.float32).contiguous()
        # (a modifier with slopes is ALiBi, which holds its alignment)
        m.alibi_off = call.kv_len - call.q_len if cast(Any, b).align == "bottom_right" else 0
    elif isinstance(b, Tensor):
        t = b.detach()
        while t.dim() < 4:
            t = t.unsqueeze(0)
        m.bias = t.expand(call.batch, call.heads, call.q_len, call.kv_len)
    return m


# ---------------------------------------------------------------------------------------------- plans


@dataclass
class _MaskPlan:
    """How the kernels visit one mask at one tiling."""

    tiles: _Tiles
    lists: _plan.TileLists  # per query tile: the key tiles to visit, partial first
    preds: _plan.Predicates | None = None  # the mask as in-kernel predicates
    bitmap: Tensor | None = None  # (n_partial, block_m, words) int32, for masks that are not built in
    visited: float = 1.0  # share of all tiles visited
    partial: float = 0.0  # share of all tiles that are partial
    reason: str | None = None  # why the backend declines this mask (a bitmap too large)
    num_k_tiles: int = 0
    _transposed: _plan.TileLists | None = field(default=None, repr=False)

    def transposed(self) -> _plan.TileLists:
        """Per key tile, the query tiles to visit (for the dk/dv kernel)."""
        if self._transposed is None:
            self._transposed = _plan.transpose(self.lists, self.num_k_tiles)
        return self._transposed


@lru_cache(maxsize=64)
def _dense_lists(nq: int, nk: int, device: torch.device) -> _plan.TileLists:
    """No mask: every query tile visits every key tile, all full."""
    count = torch.tensor([0, nk], dtype=torch.int32, device=device).repeat(1, 1, nq, 1)  # (1, 1, nq, 2)
    index = torch.arange(nk, dtype=torch.int32, device=device).repeat(1, 1, nq, 1)  # (1, 1, nq, nk)
    return _plan.TileLists(count, index, torch.zeros_like(index))


def _build_plan(
    mask: Mask | None, q_len: int, kv_len: int, batch: int, heads: int, tiles: _Tiles, device: torch.device
) -> _MaskPlan:
    bm, bn = tiles.block_m, tiles.block_n
    nq, nk = -(-q_len // bm), -(-kv_len // bn)
    if mask is None:
        return _MaskPlan(tiles, _dense_lists(nq, nk, device), num_k_tiles=nk)
    structure = mask.block_structure(q_len, kv_len, bm, bn, batch=batch, heads=heads, device=device)
    lists = _plan.tile_lists(structure)
    rows = lists.count.shape[0] * lists.count.shape[1] * nq
    n_partial = lists.num_partial
    plan = _MaskPlan(
        tiles, lists, visited=structure.visited_fraction(), partial=n_partial / max(1, rows * nk), num_k_tiles=nk
    )
    plan.preds = _plan.predicates(mask, q_len, kv_len, device, batch)
    if plan.preds is None and n_partial:
        size = n_partial * bm * -(-bn // 32) * 4
        if size > _MAX_BITMAP_BYTES:
            plan.reason = (
                f"mask {mask!r} is not built in, and its bitmap over {n_partial:,} partial tiles would "
                f"take {size / 2**20:,.0f} MiB (limit {_MAX_BITMAP_BYTES >> 20} MiB)"
            )
        else:
            plan.bitmap = _plan.bitmap(mask, lists, q_len, kv_len, bm, bn)
    return plan


# Plans are reused across calls with the same mask object and shapes (a training loop passes the same mask
# every step; rebuilding costs host syncs).  The key holds every tensor the mask reads with its in-place
# version counter, so a mask whose ids were edited in place is planned again; masks with a Python
# predicate (from_fn, callables) are never reused, since what they read cannot be seen.
_PLAN_CACHE: weakref.WeakKeyDictionary[Mask, OrderedDict[tuple[object, ...], _MaskPlan]] = weakref.WeakKeyDictionary()
_PLANS_PER_MASK = 4


def _mask_state(mask: Mask) -> tuple[tuple[object, ...], ...] | None:
    state: list[tuple[object, ...]] = []
    stack = [mask]
    while stack:
        m = stack.pop()
        if m.wraps_function():
            return None
        for name, value in sorted(vars(m).items()):
            if isinstance(value, Mask):
                stack.append(value)
            elif isinstance(value, Tensor):
                if value.is_inference():  # no version counter: in-place changes could not be noticed
                    return None
                state.append((name, id(value), value._version, value.data_ptr(), tuple(value.shape)))
            elif value is None or isinstance(value, (bool, int, float, str)):
                state.append((name, value))
            elif isinstance(value, dict):  # a derived memo (random_blocks' tables)
                continue
            else:
                return None
    return tuple(state)


def _cached_plan(
    mask: Mask | None, q_len: int, kv_len: int, batch: int, heads: int, tiles: _Tiles, device: torch.device
) -> _MaskPlan:
    state = None if mask is None else _mask_state(mask)
    if state is None:
        return _build_plan(mask, q_len, kv_len, batch, heads, tiles, device)
    try:
        per_mask = _PLAN_CACHE.setdefault(cast(Mask, mask), OrderedDict())  # (a state: a mask)
    except TypeError:  # a mask that cannot be a key (unhashable subclass): planned at each call
        return _build_plan(mask, q_len, kv_len, batch, heads, tiles, device)
    key = (q_len, kv_len, batch, heads, tiles, device, state)
    plan = per_mask.get(key)
    if plan is None:
        plan = _build_plan(mask, q_len, kv_len, batch, heads, tiles, device)
        per_mask[key] = plan
        while len(per_mask) > _PLANS_PER_MASK:
            per_mask.popitem(last=False)
    per_mask.move_to_end(key)
    return plan


class _Plans:
    """The forward and backward plans of one call, built when first needed."""

    def __init__(self, call: Call):
        self.mask = call.mask
        self.shape = (call.q_len, call.kv_len, call.batch, call.heads)
        self.device = call.q.device
        head_dim = max(call.q.shape[-1], call.v.shape[-1])
        self.fwd_tiles, self.bwd_tiles = _configs(head_dim, call.q.dtype, _kernels().INTERPRETED)
        self._fwd: _MaskPlan | None = None
        self._bwd: _MaskPlan | None = None

    def forward(self) -> _MaskPlan:
        if self._fwd is None:
            self._fwd = _cached_plan(self.mask, *self.shape, self.fwd_tiles, self.device)
        return self._fwd

    def backward(self) -> _MaskPlan:
        if self._bwd is None:
            self._bwd = (
                self.forward()
                if self.bwd_tiles == self.fwd_tiles
                else _cached_plan(self.mask, *self.shape, self.bwd_tiles, self.device)
            )
        return self._bwd


def _plans(call: Call) -> _Plans:
    if "triton" not in call.cache:
        call.cache["triton"] = _Plans(call)
    return cast(_Plans, call.cache["triton"])


# ---------------------------------------------------------------------------------------------- launch


def _stride(t: Tensor, dim: int) -> int:
    """The stride of a dim, 0 where it has size 1 (broadcast over batch or heads)."""
    return t.stride(dim) if t.shape[dim] > 1 else 0


def _rows_contiguous(t: Tensor) -> Tensor:
    """The kernels step rows by stride and read each row's elements contiguously."""
    return t if t.stride(-1) == 1 else t.contiguous()


@lru_cache(maxsize=16)
def _placeholders(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """int32, int64 and float32 tensors that stand in for pointers a kernel's flags say it will not read."""
    dtypes = (torch.int32, torch.int64, torch.float32)
    return cast("tuple[Tensor, Tensor, Tensor]", tuple(torch.zeros(1, dtype=dt, device=device) for dt in dtypes))


def _kernel_kwargs(
    q: Tensor, k: Tensor, v: Tensor, mods: _Mods, plan: _MaskPlan, lists: _plan.TileLists
) -> dict[str, Any]:
    """The arguments the three attention kernels share: strides, mask, score modifiers, meta-parameters."""
    K = _kernels()
    i32, i64, f32 = _placeholders(q.device)
    preds = plan.preds or _plan.Predicates()
    q_ids, kv_ids = preds.doc if preds.doc is not None else (i64.view(1, 1), i64.view(1, 1))
    bias = mods.bias
    D, DV = q.shape[-1], v.shape[-1]
    return dict(
        Count=lists.count,
        Index=lists.index,
        TileId=lists.tile_id,
        Bitmap=plan.bitmap if plan.bitmap is not None else i32,
        Slopes=mods.slopes if mods.slopes is not None else f32,
        Bias=bias if bias is not None else f32,
        QDoc=q_ids,
        KDoc=kv_ids,
        KeyLen=preds.key_lengths if preds.key_lengths is not None else i64,
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_qm=q.stride(2),
        stride_kb=k.stride(0),
        stride_kh=k.stride(1),
        stride_kn=k.stride(2),
        stride_vb=v.stride(0),
        stride_vh=v.stride(1),
        stride_vn=v.stride(2),
        stride_cb=_stride(lists.count, 0),
        stride_ch=_stride(lists.count, 1),
        stride_cr=lists.count.stride(2),
        stride_ib=_stride(lists.index, 0),
        stride_ih=_stride(lists.index, 1),
        stride_ir=lists.index.stride(2),
        stride_bb=_stride(bias, 0) if bias is not None else 0,
        stride_bh=_stride(bias, 1) if bias is not None else 0,
        stride_bm=_stride(bias, 2) if bias is not None else 0,
        stride_bn=_stride(bias, 3) if bias is not None else 0,
        stride_qdb=_stride(q_ids, 0),
        stride_kdb=_stride(kv_ids, 0),
        scale=float(mods.scale),
        softcap=float(mods.softcap or 1.0),
        alibi_off=mods.alibi_off,
        lo_off=preds.lo_off or 0,
        hi_off=preds.hi_off or 0,
        prefix_off=preds.prefix[0] if preds.prefix else 0,
        prefix_n=preds.prefix[1] if preds.prefix else 0,
        q_len=q.shape[2],
        kv_len=k.shape[2],
        GROUP=q.shape[1] // k.shape[1],
        D=D,
        DV=DV,
        BLOCK_D=_pow2(D),
        BLOCK_DV=_pow2(DV),
        BLOCK_M=plan.tiles.block_m,
        BLOCK_N=plan.tiles.block_n,
        WORDS=-(-plan.tiles.block_n // 32),
        HAS_SOFTCAP=mods.softcap is not None,
        HAS_ALIBI=mods.slopes is not None,
        HAS_BIAS=bias is not None,
        HAS_LO=preds.lo_off is not None,
        HAS_HI=preds.hi_off is not None,
        HAS_PREFIX=preds.prefix is not None,
        HAS_DOC=preds.doc is not None,
        HAS_KEYLEN=preds.key_lengths is not None,
        HAS_BITMAP=plan.bitmap is not None,
        EMULATE_BF16=K.INTERPRETED and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=plan.tiles.num_warps,
        num_stages=plan.tiles.num_stages,
    )


def _forward(q: Tensor, k: Tensor, v: Tensor, mods: _Mods, plan: _MaskPlan) -> tuple[Tensor, Tensor]:
    """out ``(B, Hq, Lq, Dv)`` in q's dtype and lse ``(B, Hq, Lq)`` float32."""
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    B, Hq, Lq, _ = q.shape
    out = torch.empty(B, Hq, Lq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    kw = _kernel_kwargs(q, k, v, mods, plan, plan.lists)
    grid = (-(-Lq // plan.tiles.block_m), Hq, B)
    _kernels()._attn_fwd[grid](
        Q=q,
        K=k,
        V=v,
        Out=out,
        Lse=lse,
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        stride_om=out.stride(2),
        stride_lb=lse.stride(0),
        stride_lh=lse.stride(1),
        EVEN_N=k.shape[2] % plan.tiles.block_n == 0,
        **kw,
    )
    return out, lse


def _backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    mods: _Mods,
    plan: _MaskPlan,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv for an output gradient (and an lse gradient: d lse / d s is the softmax itself)."""
    q, k, v, do = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v), _rows_contiguous(dout)
    B, Hq, Lq, D = q.shape
    Hkv, Lk, DV = k.shape[1], k.shape[2], v.shape[-1]
    delta = (do.float() * out.float()).sum(-1)  # (B, Hq, Lq): rowsum(dO * O)
    if dlse is not None:
        delta = delta - dlse.float()  # ds = p * (dp - delta + dlse)
    delta = delta.contiguous()
    dq = torch.empty(B, Hq, Lq, D, dtype=torch.float32, device=q.device)
    dk = torch.empty(B, Hkv, Lk, D, dtype=torch.float32, device=q.device)
    dv = torch.empty(B, Hkv, Lk, DV, dtype=torch.float32, device=q.device)
    K = _kernels()
    common = dict(
        Q=q,
        K=k,
        V=v,
        DO=do,
        Lse=lse,
        Delta=delta,
        stride_dob=do.stride(0),
        stride_doh=do.stride(1),
        stride_dom=do.stride(2),
        stride_lb=lse.stride(0),
        stride_lh=lse.stride(1),
    )
    bm, bn = plan.tiles.block_m, plan.tiles.block_n
    K._attn_bwd_dq[(-(-Lq // bm), Hq, B)](
        DQ=dq, EVEN_N=Lk % bn == 0, **common, **_kernel_kwargs(q, k, v, mods, plan, plan.lists)
    )
    K._attn_bwd_dkdv[(-(-Lk // bn), Hkv, B)](
        DK=dk, DV_=dv, **common, **_kernel_kwargs(q, k, v, mods, plan, plan.transposed())
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
