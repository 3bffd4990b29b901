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
``attnkit::triton_forward`` / ``attnkit::triton_backward`` (``custom_ops``: fake implementations,
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
from functools import lru_cache
from typing import Any, cast

import torch

from ...bias import BiasLike, ScoreMod
from ..call import Call, check_bias_kind, check_modifiers
from ..scores import check_paged_values
from . import custom_ops
from .autograd import _run
from .ops import (
    _bias_reason,
    _device_reason,
    _import_error,
    _interpret_requested,
    _kernels,
    _MaskPlan,
    _placeholders,
    _plans,
    _pow2,
    _rows_contiguous,
    _stride,
)

Tensor = torch.Tensor

__all__ = ["paged_decode", "check_paged_decode"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535  # CUDA's limit on the 2nd and 3rd grid dimensions (heads, batch)
_INTERPRETED_COST = 1e3  # x flops: the interpreter runs on the CPU in Python; auto must never pick it


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


def run(call: Call) -> Tensor | tuple[Tensor, Tensor]:
    """Backend hook: compute a validated call (``out``, or ``(out, lse)`` with ``return_lse``); while
    ``torch.compile`` or ``torch.export`` traces, through the custom operators (``custom_ops``)."""
    if torch.compiler.is_compiling():
        return custom_ops.run(call)
    return _run(call)


# ----------------------------------------------------------------------------------------- paged decode


def _validate_paged(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor) -> None:
    """Raise TypeError/ValueError for inputs that do not form the paged layout."""
    for name, t in (
        ("q", q),
        ("k_pool", k_pool),
        ("v_pool", v_pool),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
    ):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims, got shape {tuple(t.shape)}: q is (B, Hq, 1, D), the pools "
                f"are (num_blocks, Hkv, block_size, D|Dv)"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got dtype {t.dtype}")
    if not (q.dtype == k_pool.dtype == v_pool.dtype):
        raise TypeError(f"q, k_pool, v_pool must share one dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    B, Hq, Lq, D = q.shape
    if Lq != 1:
        raise ValueError(
            f"q has Lq={Lq}: paged decoding takes one query token per sequence, q (B, Hq, 1, D); "
            f"use attnkit.attention for several"
        )
    if k_pool.shape[:3] != v_pool.shape[:3]:
        raise ValueError(
            f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} must agree on (num_blocks, Hkv, block_size)"
        )
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
        raise ValueError(
            f"q, k_pool, v_pool, block_table, seq_lens must be on one device, got {sorted(map(str, devices))}"
        )


def _validate_paged_bias(q: Tensor, bias: object) -> None:
    """``bias`` checked as every entry point checks one (``check_bias_kind``), and against the decode's
    ``(B, Hq, 1, Lk)``."""
    bias = check_bias_kind(bias, q)
    if isinstance(bias, Tensor):
        shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
        if bias.dim() > 4 or shape[0] not in (1, q.shape[0]) or shape[1] not in (1, q.shape[1]) or shape[2] != 1:
            raise ValueError(
                f"bias of shape {tuple(bias.shape)} does not broadcast to (B, Hq, 1, Lk) with "
                f"B={q.shape[0]}, Hq={q.shape[1]}"
            )
    elif isinstance(bias, ScoreMod):
        bias.validate(q.shape[0], q.shape[1], 1, 1)  # per-head parameters must match Hq


def check_paged_decode(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    bias: BiasLike | None = None,
) -> str | None:
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
    check_modifiers(q, scale, softcap, bias)  # (the checks every entry point makes; the values are kept)
    check_paged_values(
        "paged_decode",
        block_table,
        seq_lens,
        k_pool.shape[0],
        k_pool.shape[2],
        bias.shape[-1] if isinstance(bias, Tensor) else None,
    )
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
    return (
        f"bias {bias!r}: the paged decode kernel takes None, ALiBi, a scalar temperature (without "
        f"softcap) or a float tensor"
    )


@lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _num_splits(programs: int, max_len: int, device: torch.device) -> int:
    """How many pieces to cut each sequence's keys into: enough programs for two waves over the GPU's
    multiprocessors, but at least 256 keys per piece (below that, merging costs more than it saves)."""
    want = -(-2 * _multiprocessors(device) // max(1, programs))
    return max(1, min(want, max_len // 256, 64))


def _paged_decode(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    softcap: float | None,
    slopes: Tensor | None = None,
    alibi_at_end: bool = True,
    bias: Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> Tensor:
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
        Q=q,
        KPool=k_pool,
        VPool=v_pool,
        BlockTable=block_table,
        SeqLens=seq_lens,
        Out=out,
        PartOut=part_out,
        PartLse=part_lse,
        Slopes=slopes if slopes is not None else dummy,
        Bias=bias if bias is not None else dummy,
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_kp=k_pool.stride(0),
        stride_kh=k_pool.stride(1),
        stride_ks=k_pool.stride(2),
        stride_vp=v_pool.stride(0),
        stride_vh=v_pool.stride(1),
        stride_vs=v_pool.stride(2),
        stride_tb=block_table.stride(0),
        stride_ob=out.stride(0),
        stride_oh=out.stride(1),
        stride_bb=_stride(bias, 0) if bias is not None else 0,
        stride_bh=_stride(bias, 1) if bias is not None else 0,
        stride_bn=bias.stride(2) if bias is not None else 0,
        bias_len=bias.shape[2] if bias is not None else 0,
        scale=float(scale),
        softcap=float(softcap or 1.0),
        keys_per_split=per_split,
        page_size=page,
        GROUP=Hq // Hkv,
        NUM_SPLITS=splits,
        D=D,
        DV=Dv,
        BLOCK_D=_pow2(D),
        BLOCK_DV=_pow2(Dv),
        BLOCK_G=_pow2(Hq // Hkv),
        BLOCK_N=block_n,
        HAS_SOFTCAP=softcap is not None,
        HAS_ALIBI=slopes is not None,
        ALIBI_AT_END=alibi_at_end,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        EMULATE_BF16=K.INTERPRETED and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        K._paged_combine[(Hq, B)](
            PartOut=part_out,
            PartLse=part_lse,
            Out=out,
            stride_ob=out.stride(0),
            stride_oh=out.stride(1),
            NUM_SPLITS=splits,
            DV=Dv,
            BLOCK_DV=_pow2(Dv),
            BLOCK_S=_pow2(splits, 2),
            EMULATE_BF16=K.INTERPRETED and q.dtype == torch.bfloat16,
        )
    return out


def paged_decode(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    bias: BiasLike | None = None,
) -> Tensor:
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
        at_end = cast(Any, bias).align == "bottom_right"  # (a modifier with slopes is ALiBi, which holds its alignment)
    elif isinstance(bias, ScoreMod) and bias.scale_factor is not None:
        scale = scale * bias.scale_factor
    return _paged_decode(
        q,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        scale=scale,
        softcap=softcap,
        slopes=slopes,
        alibi_at_end=at_end,
        bias=bias if isinstance(bias, Tensor) else None,
    )
