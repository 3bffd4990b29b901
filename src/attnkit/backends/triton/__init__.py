"""The ``triton`` backend: block-sparse flash attention in Triton, and a paged decode kernel.

Forward (output and log-sum-exp) and backward (dq, dk, dv) kernels in the FlashAttention-2 style: one
program per query tile (per key tile for dk/dv), an online softmax in float32 over the key tiles the
mask's :class:`~attnkit.masks.BlockStructure` lists for that tile, and nothing else.  Full tiles are
computed without any element mask; partial tiles evaluate the built-in masks' predicates in the kernel
(causal, sliding window, prefix LM, document, key padding by lengths, and ``&`` of them) or read a bitmap
computed once on the host for every other mask.  Grouped-query heads read their shared key/value head (no
copies); dk/dv of a key/value head sum its query heads in one program (no atomics).  float16 and bfloat16
accumulate in float32; float32 uses IEEE float32 products (no TF32).  ``scale``, ``softcap``, ALiBi, a
scalar temperature and a float tensor bias (without gradient) are applied in the kernels.  The tile
sizes and warp counts follow FlashAttention-2's usual choices; they have not been tuned on a GPU yet.

:func:`paged_decode` attends one new token per sequence over a paged KV cache (the layout of
``attnkit.cache.PagedCache``), splitting long sequences across programs when the batch is small;
:func:`check_paged_decode` says whether it can run a call here.

When it runs: ``triton`` must import, and the tensors must be on a CUDA GPU, or on the CPU with
``TRITON_INTERPRET=1`` set in the environment (Triton's interpreter: exact but slow, for tests).  Triton
picks the interpreter or the compiler once, when it is first imported, so ``TRITON_INTERPRET=1`` must be
set before anything imports triton; this module imports it only when a call needs it, and nothing here
changes global state at import.  ``auto`` never picks the interpreter (it is far slower than ``math``).

Under ``torch.compile`` and ``torch.export`` the backend runs as the custom operators
``attnkit::triton_forward`` / ``attnkit::triton_backward`` (``_triton_custom_ops``: fake implementations,
registered autograd), one graph node per call, launching the same kernels.

Whether it takes a call, and why not (here: no GPU and no interpreter, or float64, which the kernels do not
take), is what :func:`attnkit.backends.explain` prints on its ``triton`` line.

Example::

    >>> import torch
    >>> from attnkit import backends
    >>> q = k = v = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    >>> print(backends.explain(q, k, v, backend="math").splitlines()[4])
      triton  ...
"""

from __future__ import annotations

import math
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..bias import ScoreMod
from ..masks import Mask
from . import _triton_plan as _plan
from ..softmax import _add_sink as add_sink  # (inputs checked by the call)
from ._common import Call, check_paged_values, sink_grad
from ._reads import check_unchanged, tensor_versions

Tensor = torch.Tensor

__all__ = ["paged_decode", "check_paged_decode"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535  # CUDA's limit on the 2nd and 3rd grid dimensions (heads, batch)
_MAX_BITMAP_BYTES = 1 << 30  # largest per-tile mask bitmap this backend builds
_INTERPRETED_COST = 1e3  # x flops: the interpreter runs on the CPU in Python; auto must never pick it
_TRUE = ("1", "true", "on", "yes", "y")  # what triton accepts as TRITON_INTERPRET=1


# -------------------------------------------------------------------------------------- triton, lazily

_state: dict = {}  # "error": why triton does not import (or None); "kernels": the built kernel module


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
    return _state["error"]


def _kernels():
    """The kernel module, built on first use in the mode triton was imported in (see _triton_kernels)."""
    if "kernels" not in _state:
        from . import _triton_kernels

        _state["kernels"] = _triton_kernels.build()
    return _state["kernels"]


def available() -> bool:
    """Triton imports, and there is a CUDA GPU, or Triton runs in its interpreter (TRITON_INTERPRET=1 set
    before triton was first imported; checked at call time)."""
    if torch.cuda.is_available():
        return _import_error() is None
    return _interpret_requested() and _device_reason(torch.device("cpu")) is None


def unavailable_reason() -> str:
    """Why :func:`available` is False here (what to change), for the error of an explicit ``backend="triton"``."""
    if torch.cuda.is_available():
        return f"triton does not import ({_import_error()})"
    return _device_reason(torch.device("cpu")) or "no CUDA GPU"


def _device_reason(device: torch.device) -> str | None:
    """Why tensors on ``device`` cannot run here (None when they can); imports triton when it must."""
    if device.type == "cpu" and not _interpret_requested():
        return ("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is first "
                "imported (or move the tensors to a CUDA GPU)")
    if device.type not in ("cpu", "cuda"):
        return f"tensors on {device.type}: the Triton kernels run on CUDA GPUs (or on the CPU under TRITON_INTERPRET=1)"
    err = _import_error()
    if err is not None:
        return f"triton does not import ({err})"
    if device.type == "cpu" and not _kernels().INTERPRETED:
        return ("triton was imported before TRITON_INTERPRET=1 was set, so it compiles for the GPU only: "
                "set TRITON_INTERPRET=1 before anything imports triton")
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
    return (f"bias {b!r} is not computed by the Triton kernels (they take ALiBi, a scalar temperature or a "
            f"float tensor bias without gradient)")


def _mods(call: Call) -> _Mods:
    m = _Mods(call.scale, call.softcap, source=call.bias)
    b = call.bias
    if isinstance(b, ScoreMod) and b.scale_factor is not None:
        m.scale = call.scale * b.scale_factor  # dividing every score by t is scaling by 1/t (no softcap here)
    elif isinstance(b, ScoreMod) and b.slopes is not None:
        m.slopes = b.slopes.detach().to(device=call.q.device, dtype=torch.float32).contiguous()
        m.alibi_off = call.kv_len - call.q_len if b.align == "bottom_right" else 0
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


def _build_plan(mask: Mask | None, q_len: int, kv_len: int, batch: int, heads: int, tiles: _Tiles,
                device: torch.device) -> _MaskPlan:
    bm, bn = tiles.block_m, tiles.block_n
    nq, nk = -(-q_len // bm), -(-kv_len // bn)
    if mask is None:
        return _MaskPlan(tiles, _dense_lists(nq, nk, device), num_k_tiles=nk)
    structure = mask.block_structure(q_len, kv_len, bm, bn, batch=batch, heads=heads, device=device)
    lists = _plan.tile_lists(structure)
    rows = lists.count.shape[0] * lists.count.shape[1] * nq
    n_partial = lists.num_partial
    plan = _MaskPlan(tiles, lists, visited=structure.visited_fraction(), partial=n_partial / max(1, rows * nk),
                     num_k_tiles=nk)
    plan.preds = _plan.predicates(mask, q_len, kv_len, device, batch)
    if plan.preds is None and n_partial:
        size = n_partial * bm * -(-bn // 32) * 4
        if size > _MAX_BITMAP_BYTES:
            plan.reason = (f"mask {mask!r} is not built in, and its bitmap over {n_partial:,} partial tiles would "
                           f"take {size / 2**20:,.0f} MiB (limit {_MAX_BITMAP_BYTES >> 20} MiB)")
        else:
            plan.bitmap = _plan.bitmap(mask, lists, q_len, kv_len, bm, bn)
    return plan


# Plans are reused across calls with the same mask object and shapes (a training loop passes the same mask
# every step; rebuilding costs host syncs).  The key holds every tensor the mask reads with its in-place
# version counter, so a mask whose ids were edited in place is planned again; masks with a Python
# predicate (from_fn, callables) are never reused, since what they read cannot be seen.
_PLAN_CACHE: "weakref.WeakKeyDictionary[Mask, OrderedDict]" = weakref.WeakKeyDictionary()
_PLANS_PER_MASK = 4


def _mask_state(mask: Mask) -> tuple | None:
    state, stack = [], [mask]
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


def _cached_plan(mask: Mask | None, q_len: int, kv_len: int, batch: int, heads: int, tiles: _Tiles,
                 device: torch.device) -> _MaskPlan:
    state = None if mask is None else _mask_state(mask)
    if state is None:
        return _build_plan(mask, q_len, kv_len, batch, heads, tiles, device)
    try:
        per_mask = _PLAN_CACHE.setdefault(mask, OrderedDict())
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
        self._fwd = self._bwd = None

    def forward(self) -> _MaskPlan:
        if self._fwd is None:
            self._fwd = _cached_plan(self.mask, *self.shape, self.fwd_tiles, self.device)
        return self._fwd

    def backward(self) -> _MaskPlan:
        if self._bwd is None:
            self._bwd = (self.forward() if self.bwd_tiles == self.fwd_tiles
                         else _cached_plan(self.mask, *self.shape, self.bwd_tiles, self.device))
        return self._bwd


def _plans(call: Call) -> _Plans:
    if "triton" not in call.cache:
        call.cache["triton"] = _Plans(call)
    return call.cache["triton"]


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
    return tuple(torch.zeros(1, dtype=dt, device=device) for dt in (torch.int32, torch.int64, torch.float32))


def _kernel_kwargs(q: Tensor, k: Tensor, v: Tensor, mods: _Mods, plan: _MaskPlan,
                   lists: _plan.TileLists) -> dict:
    """The arguments the three attention kernels share: strides, mask, score modifiers, meta-parameters."""
    K = _kernels()
    i32, i64, f32 = _placeholders(q.device)
    preds = plan.preds or _plan.Predicates()
    q_ids, kv_ids = preds.doc if preds.doc is not None else (i64.view(1, 1), i64.view(1, 1))
    bias = mods.bias
    D, DV = q.shape[-1], v.shape[-1]
    return dict(
        Count=lists.count, Index=lists.index, TileId=lists.tile_id,
        Bitmap=plan.bitmap if plan.bitmap is not None else i32,
        Slopes=mods.slopes if mods.slopes is not None else f32,
        Bias=bias if bias is not None else f32,
        QDoc=q_ids, KDoc=kv_ids,
        KeyLen=preds.key_lengths if preds.key_lengths is not None else i64,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qm=q.stride(2),
        stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2),
        stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vn=v.stride(2),
        stride_cb=_stride(lists.count, 0), stride_ch=_stride(lists.count, 1), stride_cr=lists.count.stride(2),
        stride_ib=_stride(lists.index, 0), stride_ih=_stride(lists.index, 1), stride_ir=lists.index.stride(2),
        stride_bb=_stride(bias, 0) if bias is not None else 0, stride_bh=_stride(bias, 1) if bias is not None else 0,
        stride_bm=_stride(bias, 2) if bias is not None else 0, stride_bn=_stride(bias, 3) if bias is not None else 0,
        stride_qdb=_stride(q_ids, 0), stride_kdb=_stride(kv_ids, 0),
        scale=float(mods.scale), softcap=float(mods.softcap or 1.0), alibi_off=mods.alibi_off,
        lo_off=preds.lo_off or 0, hi_off=preds.hi_off or 0,
        prefix_off=preds.prefix[0] if preds.prefix else 0, prefix_n=preds.prefix[1] if preds.prefix else 0,
        q_len=q.shape[2], kv_len=k.shape[2], GROUP=q.shape[1] // k.shape[1],
        D=D, DV=DV, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV),
        BLOCK_M=plan.tiles.block_m, BLOCK_N=plan.tiles.block_n, WORDS=-(-plan.tiles.block_n // 32),
        HAS_SOFTCAP=mods.softcap is not None, HAS_ALIBI=mods.slopes is not None, HAS_BIAS=bias is not None,
        HAS_LO=preds.lo_off is not None, HAS_HI=preds.hi_off is not None, HAS_PREFIX=preds.prefix is not None,
        HAS_DOC=preds.doc is not None, HAS_KEYLEN=preds.key_lengths is not None, HAS_BITMAP=plan.bitmap is not None,
        EMULATE_BF16=K.INTERPRETED and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=plan.tiles.num_warps, num_stages=plan.tiles.num_stages,
    )


def _forward(q: Tensor, k: Tensor, v: Tensor, mods: _Mods, plan: _MaskPlan) -> tuple[Tensor, Tensor]:
    """out ``(B, Hq, Lq, Dv)`` in q's dtype and lse ``(B, Hq, Lq)`` float32."""
    q, k, v = _rows_contiguous(q), _rows_contiguous(k), _rows_contiguous(v)
    B, Hq, Lq, _ = q.shape
    out = torch.empty(B, Hq, Lq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=q.device)
    kw = _kernel_kwargs(q, k, v, mods, plan, plan.lists)
    grid = (-(-Lq // plan.tiles.block_m), Hq, B)
    _kernels()._attn_fwd[grid](Q=q, K=k, V=v, Out=out, Lse=lse, stride_ob=out.stride(0), stride_oh=out.stride(1),
                               stride_om=out.stride(2), stride_lb=lse.stride(0), stride_lh=lse.stride(1),
                               EVEN_N=k.shape[2] % plan.tiles.block_n == 0, **kw)
    return out, lse


def _backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None,
              mods: _Mods, plan: _MaskPlan) -> tuple[Tensor, Tensor, Tensor]:
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
    common = dict(Q=q, K=k, V=v, DO=do, Lse=lse, Delta=delta, stride_dob=do.stride(0), stride_doh=do.stride(1),
                  stride_dom=do.stride(2), stride_lb=lse.stride(0), stride_lh=lse.stride(1))
    bm, bn = plan.tiles.block_m, plan.tiles.block_n
    K._attn_bwd_dq[(-(-Lq // bm), Hq, B)](DQ=dq, EVEN_N=Lk % bn == 0, **common,
                                          **_kernel_kwargs(q, k, v, mods, plan, plan.lists))
    K._attn_bwd_dkdv[(-(-Lk // bn), Hkv, B)](DK=dk, DV_=dv, **common,
                                             **_kernel_kwargs(q, k, v, mods, plan, plan.transposed()))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Attention(torch.autograd.Function):
    """Forward and backward kernels as one differentiable op: ``(q, k, v) -> (out, lse)``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mods, plans):
        out, lse = _with_sinks(*_forward(q, k, v, mods, plans.forward()), sinks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mods, ctx.plans, ctx.sinks = mods, plans, sinks
        ctx.versions = tensor_versions(plans.mask, mods.source)  # the backward reads them again
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        check_unchanged(ctx.versions)
        q, k, v, out, lse = ctx.saved_tensors
        # with sinks the saved (out, lse) include them: the kernels' p = exp(s - lse) is the sink's softmax
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.mods, ctx.plans.backward())
        dsink = sink_grad(out, lse, dout, dlse, ctx.sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """The sinks (when given) added to each row's denominator after the kernel: the output rescaled, the lse
    grown to include them."""
    if sinks is None:
        return out, lse
    return add_sink(out, lse, sinks.detach())


# ------------------------------------------------------------------------------------ backend protocol


def check(call: Call) -> str | None:
    """Why the Triton kernels cannot take ``call`` here (None when they can)."""
    if call.q.dtype not in _DTYPES:
        return f"dtype {call.q.dtype} is not supported by the Triton kernels (float16, bfloat16, float32): use math"
    reason = _device_reason(call.q.device)
    if reason is not None:
        return reason
    if call.dropout_p > 0:
        return f"dropout_p={call.dropout_p}: the Triton kernels have no dropout"
    D, Dv = call.q.shape[-1], call.v.shape[-1]
    if max(D, Dv) > _MAX_HEAD_DIM:
        return f"head dims D={D}, Dv={Dv}: the Triton kernels take at most {_MAX_HEAD_DIM}"
    if call.heads > _MAX_GRID_YZ or call.batch > _MAX_GRID_YZ:
        return f"B={call.batch}, Hq={call.heads}: the Triton kernels take at most {_MAX_GRID_YZ} of each"
    reason = _bias_reason(call)
    if reason is not None:
        return reason
    if call.q_len == 0 or call.kv_len == 0:
        return None
    return _plans(call).forward().reason


def _tile_cost(flops: float, plan: _MaskPlan) -> float:
    """Dense-equivalent FLOPs on a GPU: 1.25 per visited tile (a Triton flash kernel runs at ~80% of the
    fastest dense one, SDPA's, whose cost is 1.0), 0.25 more per partial tile (the element mask)."""
    return flops * (1.25 * plan.visited + 0.25 * plan.partial)


def cost(call: Call) -> float:
    """:func:`_tile_cost` on a GPU; under the interpreter, never worth picking."""
    if call.q_len == 0 or call.kv_len == 0:
        return 0.0
    if call.q.device.type != "cuda" or _kernels().INTERPRETED:
        return _INTERPRETED_COST * call.flops()
    return _tile_cost(call.flops(), _plans(call).forward())


def run(call: Call):
    """Compute a validated call eagerly (``out``, or ``(out, lse)`` with ``return_lse``).  The registered
    backend hook is ``_triton_custom_ops.run``, which calls this one, or the custom operators while
    ``torch.compile`` or ``torch.export`` traces."""
    mods = _mods(call)
    plans = _plans(call)
    if call.needs_grad:
        out, lse = _Attention.apply(call.q, call.k, call.v, call.sinks, mods, plans)
    else:
        out, lse = _with_sinks(*_forward(call.q, call.k, call.v, mods, plans.forward()), call.sinks)
    return (out, lse) if call.return_lse else out


# ----------------------------------------------------------------------------------------- paged decode


def _validate_paged(q, k_pool, v_pool, block_table, seq_lens) -> None:
    """Raise TypeError/ValueError for inputs that do not form the paged layout."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("block_table", block_table),
                    ("seq_lens", seq_lens)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims, got shape {tuple(t.shape)}: q is (B, Hq, 1, D), the pools "
                             f"are (num_blocks, Hkv, block_size, D|Dv)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got dtype {t.dtype}")
    if not (q.dtype == k_pool.dtype == v_pool.dtype):
        raise TypeError(f"q, k_pool, v_pool must share one dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    B, Hq, Lq, D = q.shape
    if Lq != 1:
        raise ValueError(f"q has Lq={Lq}: paged decoding takes one query token per sequence, q (B, Hq, 1, D); "
                         f"use attnkit.attention for several")
    if k_pool.shape[:3] != v_pool.shape[:3]:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} must agree on "
                         f"(num_blocks, Hkv, block_size)")
    Hkv = k_pool.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"got Hq={Hq} and Hkv={Hkv}: Hq must be a multiple of Hkv (grouped-query attention)")
    if k_pool.shape[-1] != D:
        raise ValueError(f"q has D={D} but k_pool has D={k_pool.shape[-1]}: they must match")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be (B, max_blocks) with B={B}, got shape {tuple(block_table.shape)}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be (B,) with B={B}, got shape {tuple(seq_lens.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 (or int64), got dtype {t.dtype}")
    devices = {t.device for t in (q, k_pool, v_pool, block_table, seq_lens)}
    if len(devices) > 1:
        raise ValueError(f"q, k_pool, v_pool, block_table, seq_lens must be on one device, "
                         f"got {sorted(map(str, devices))}")


def _validate_paged_bias(q: Tensor, bias) -> None:
    if bias is None:
        return
    if isinstance(bias, Tensor):
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a float tensor of additive scores, got dtype {bias.dtype}")
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device} but q is on {q.device}: move it with bias.to(q.device)")
        shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
        if bias.dim() > 4 or shape[0] not in (1, q.shape[0]) or shape[1] not in (1, q.shape[1]) or shape[2] != 1:
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to (B, Hq, 1, Lk) with "
                             f"B={q.shape[0]}, Hq={q.shape[1]}")
    elif isinstance(bias, ScoreMod):
        bias.validate(q.shape[0], q.shape[1], 1, 1)  # per-head parameters must match Hq
    else:
        raise TypeError(f"bias must be None, a float tensor or an attnkit.bias modifier, got {type(bias).__name__}")


def check_paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor, *,
                       scale: float | None = None, softcap: float | None = None, bias=None) -> str | None:
    """Why :func:`paged_decode` cannot run these inputs here, or None when it can.

    Malformed inputs raise (as :func:`paged_decode` would); inputs that are valid but out of the kernel's
    reach (CPU tensors without ``TRITON_INTERPRET=1``, float64, a head dim over 256, a bias other than
    ALiBi, a scalar temperature or a float tensor, inputs that require grad: the kernel has no backward)
    give the reason, so a caller can fall back to ``attnkit.cache.paged_attention``.

    Example::

        >>> import torch
        >>> q = torch.randn(1, 2, 1, 16, dtype=torch.float64); pool = torch.randn(4, 2, 8, 16, dtype=torch.float64)
        >>> table = torch.zeros(1, 4, dtype=torch.int32); lens = torch.tensor([5], dtype=torch.int32)
        >>> check_paged_decode(q, pool, pool, table, lens)
        'dtype torch.float64 is not supported by the paged decode kernel (float16, bfloat16, float32)'
    """
    _validate_paged(q, k_pool, v_pool, block_table, seq_lens)
    _validate_paged_bias(q, bias)
    for name, x, positive in (("scale", scale, False), ("softcap", softcap, True)):
        if x is not None and (isinstance(x, (bool, Tensor)) or not isinstance(x, (int, float))
                              or not math.isfinite(x) or (positive and x <= 0)):
            raise ValueError(f"{name}={x!r} must be a finite number{' > 0' if positive else ''} (or None)")
    check_paged_values("paged_decode", block_table, seq_lens, k_pool.shape[0], k_pool.shape[2],
                       bias.shape[-1] if isinstance(bias, Tensor) else None)
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} is not supported by the paged decode kernel (float16, bfloat16, float32)"
    reason = _device_reason(q.device)
    if reason is not None:
        return reason
    D, Dv = q.shape[-1], v_pool.shape[-1]
    if max(D, Dv) > _MAX_HEAD_DIM:
        return f"head dims D={D}, Dv={Dv}: the paged decode kernel takes at most {_MAX_HEAD_DIM}"
    if q.shape[0] > _MAX_GRID_YZ or k_pool.shape[1] > _MAX_GRID_YZ:
        return f"B={q.shape[0]}, Hkv={k_pool.shape[1]}: the paged decode kernel takes at most {_MAX_GRID_YZ} of each"
    grad = torch.is_grad_enabled()
    if grad and any(t.requires_grad for t in (q, k_pool, v_pool)):
        return "inputs that require grad: the paged decode kernel has no backward"
    if bias is None:
        return None
    if isinstance(bias, Tensor):
        if grad and bias.requires_grad:
            return "a bias tensor that requires grad: the paged decode kernel has no backward"
        return None
    if bias.slopes is not None:
        if grad and bias.slopes.requires_grad:
            return "learnable ALiBi slopes: the paged decode kernel does not compute their gradient"
        return None
    if bias.scale_factor is not None and softcap is None:
        return None
    return (f"bias {bias!r}: the paged decode kernel takes None, ALiBi, a scalar temperature (without "
            f"softcap) or a float tensor")


@lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _num_splits(programs: int, max_len: int, device: torch.device) -> int:
    """How many pieces to cut each sequence's keys into: enough programs for two waves over the GPU's
    multiprocessors, but at least 256 keys per piece (below that, merging costs more than it saves)."""
    want = -(-2 * _multiprocessors(device) // max(1, programs))
    return max(1, min(want, max_len // 256, 64))


def _paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor, *,
                  scale: float, softcap: float | None, slopes: Tensor | None = None, alibi_at_end: bool = True,
                  bias: Tensor | None = None, num_splits: int | None = None, block_n: int | None = None) -> Tensor:
    """The kernel launch behind :func:`paged_decode` (``num_splits``/``block_n`` fixed only by tests)."""
    K = _kernels()
    q, k_pool, v_pool = _rows_contiguous(q), _rows_contiguous(k_pool), _rows_contiguous(v_pool)
    B, Hq, _, D = q.shape
    Hkv, page = k_pool.shape[1], k_pool.shape[2]
    Dv = v_pool.shape[-1]
    block_n = block_n or (16 if K.INTERPRETED else 64)
    max_len = block_table.shape[1] * page  # an upper bound on every seq_len, known without a host sync
    splits = num_splits or _num_splits(B * Hkv, max_len, q.device)
    per_split = -(-max(1, -(-max_len // splits)) // block_n) * block_n  # keys per split, whole BLOCK_Ns
    splits = max(1, -(-max_len // per_split))
    out = torch.empty(B, Hq, 1, Dv, dtype=q.dtype, device=q.device)
    dummy = _placeholders(q.device)[2]
    part_out = torch.empty(B, Hq, splits, Dv, dtype=torch.float32, device=q.device) if splits > 1 else dummy
    part_lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device) if splits > 1 else dummy
    if bias is not None:
        bias = bias.detach()
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
        bias = bias[:, :, 0, :]  # (B' | 1, Hq' | 1, Lb)
    K._paged_decode[(splits, Hkv, B)](
        Q=q, KPool=k_pool, VPool=v_pool, BlockTable=block_table, SeqLens=seq_lens, Out=out, PartOut=part_out,
        PartLse=part_lse, Slopes=slopes if slopes is not None else dummy, Bias=bias if bias is not None else dummy,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kp=k_pool.stride(0), stride_kh=k_pool.stride(1),
        stride_ks=k_pool.stride(2), stride_vp=v_pool.stride(0), stride_vh=v_pool.stride(1),
        stride_vs=v_pool.stride(2), stride_tb=block_table.stride(0), stride_ob=out.stride(0),
        stride_oh=out.stride(1), stride_bb=_stride(bias, 0) if bias is not None else 0,
        stride_bh=_stride(bias, 1) if bias is not None else 0, stride_bn=bias.stride(2) if bias is not None else 0,
        bias_len=bias.shape[2] if bias is not None else 0, scale=float(scale), softcap=float(softcap or 1.0),
        keys_per_split=per_split,
        page_size=page, GROUP=Hq // Hkv, NUM_SPLITS=splits, D=D, DV=Dv, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
        BLOCK_G=_pow2(Hq // Hkv), BLOCK_N=block_n, HAS_SOFTCAP=softcap is not None,
        HAS_ALIBI=slopes is not None, ALIBI_AT_END=alibi_at_end, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        EMULATE_BF16=K.INTERPRETED and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2)
    if splits > 1:
        K._paged_combine[(Hq, B)](PartOut=part_out, PartLse=part_lse, Out=out, stride_ob=out.stride(0),
                                  stride_oh=out.stride(1), NUM_SPLITS=splits, DV=Dv, BLOCK_DV=_pow2(Dv),
                                  BLOCK_S=_pow2(splits, 2), EMULATE_BF16=K.INTERPRETED and q.dtype == torch.bfloat16)
    return out


def paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor, *,
                 scale: float | None = None, softcap: float | None = None, bias=None) -> Tensor:
    """Attention of one new token per sequence over a paged KV cache, in one Triton kernel.

    Args:
        q: ``(B, Hq, 1, D)`` the new token's queries.
        k_pool: ``(num_blocks, Hkv, block_size, D)`` the key pages of one layer; ``Hq % Hkv == 0``.
        v_pool: ``(num_blocks, Hkv, block_size, Dv)`` the value pages.
        block_table: ``(B, max_blocks)`` int32: key ``j`` of sequence ``b`` is slot ``j % block_size`` of
            page ``block_table[b, j // block_size]``; entries past a sequence's length are not read.
        seq_lens: ``(B,)`` int32 keys per sequence, the new token's own included (at most
            ``max_blocks * block_size``); a sequence of length 0 gives 0.
        scale: default ``1/sqrt(D)``.  softcap: ``s * tanh(x / s)``.
        bias: None, ``attnkit.bias.alibi`` (the query sits at position ``seq_len - 1``, or 0 with
            ``align="top_left"``), a scalar ``attnkit.bias.temperature``, or a float tensor broadcastable
            to ``(B, Hq, 1, Lb)`` added to the score of key ``j < Lb`` (``Lb`` must cover every seq_len).

    Returns:
        ``(B, Hq, 1, Dv)`` in q's dtype: the same as ``attnkit.cache.paged_attention``.

    The keys of a sequence are cut into pieces processed in parallel when the batch alone would leave
    the GPU idle (split-K / flash-decoding), and merged by their log-sum-exp.  Each program serves all
    query heads of a key/value head, so grouped-query attention reads every page once.  Runs on CUDA
    tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; :func:`check_paged_decode` says whether it
    can run here, and anything else raises ``ValueError`` with the reason.

    Example::

        >>> import torch
        >>> from attnkit.backends.triton import check_paged_decode, paged_decode
        >>> dev = "cuda" if torch.cuda.is_available() else "cpu"
        >>> k_pool = torch.randn(6, 2, 16, 64, device=dev); v_pool = torch.randn(6, 2, 16, 64, device=dev)
        >>> table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32, device=dev)  # pages of 16 keys
        >>> seq_lens = torch.tensor([40, 17], dtype=torch.int32, device=dev)
        >>> q = torch.randn(2, 8, 1, 64, device=dev)  # Hq=8 query heads share Hkv=2
        >>> if check_paged_decode(q, k_pool, v_pool, table, seq_lens) is None:  # a GPU, or TRITON_INTERPRET=1
        ...     assert paged_decode(q, k_pool, v_pool, table, seq_lens).shape == (2, 8, 1, 64)
    """
    reason = check_paged_decode(q, k_pool, v_pool, block_table, seq_lens, scale=scale, softcap=softcap, bias=bias)
    if reason is not None:
        raise ValueError(f"paged_decode cannot run this call: {reason}; attnkit.cache.paged_attention takes it")
    block_table, seq_lens = block_table.contiguous(), seq_lens.contiguous()  # the kernel reads them with stride 1
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    slopes, at_end = None, True
    if isinstance(bias, ScoreMod) and bias.slopes is not None:
        slopes = bias.slopes.detach().to(device=q.device, dtype=torch.float32).contiguous()
        at_end = bias.align == "bottom_right"
    elif isinstance(bias, ScoreMod) and bias.scale_factor is not None:
        scale = scale * bias.scale_factor
    return _paged_decode(q, k_pool, v_pool, block_table, seq_lens, scale=scale, softcap=softcap, slopes=slopes,
                         alibi_at_end=at_end, bias=bias if isinstance(bias, Tensor) else None)
