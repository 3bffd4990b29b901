"""``PagedCache``: keys and values in a pool of fixed-size blocks, one block table per sequence.

Layout (shared with the Triton decode kernel), per layer::

    k_pool (num_blocks, Hkv, block_size, D)      v_pool (num_blocks, Hkv, block_size, Dv)
    block_table (B, max_blocks) int32            seq_lens (B,) int32

Position ``p`` of sequence ``b`` lives in block ``block_table[b, p // block_size]`` at offset
``p % block_size``.  Blocks are taken from the pool when a sequence grows into them and given back when it
ends; :meth:`PagedCache.fork` shares every block of a sequence with a new one (reference counts) and copies
the partially filled last block only when one of them writes to it (copy-on-write).  With prefix caching a
new sequence whose prompt starts with a run of full blocks already computed (identified by a hash of their
tokens chained with the hash of everything before them) reuses those blocks instead of recomputing them.
"""

from __future__ import annotations

import functools
from bisect import bisect_left, insort
from collections import OrderedDict
from dataclasses import dataclass, field
from numbers import Integral

import torch

from ..bias import ScoreMod, _ALiBi, _RelativeBuckets, _Temperature
from ..masks import Mask, _BlockLocal, _Causal, _PrefixLM, _SlidingWindow
from .._checks import flag
from ..softmax import stable_softmax
from ..backends._common import check_paged_values
from ..functional import _check_number
from ..backends._common import zero_unseen as _zero_unseen
from ._common import check_dtype, check_int, check_new_kv, model_dims

Tensor = torch.Tensor

__all__ = ["PagedCache", "PagedBatch", "PagedPacked", "PoolExhausted", "paged_attention"]


class PoolExhausted(RuntimeError):
    """The block pool has fewer free blocks than a step needs."""


# ----------------------------------------------------------------------------- the decode


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_paged_args(q, k_pool, v_pool, block_table, seq_lens) -> None:
    for name, t, nd in (("q", q, 4), ("k_pool", k_pool, 4), ("v_pool", v_pool, 4), ("block_table", block_table, 2),
                        ("seq_lens", seq_lens, 1)):
        if not isinstance(t, Tensor):
            raise TypeError(f"paged_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"paged_attention: {name} must have {nd} dims, got shape {tuple(t.shape)}")
    B, Hq, _, D = q.shape
    NB, Hkv, bs, Dk = k_pool.shape
    if v_pool.shape[:3] != k_pool.shape[:3]:
        raise ValueError(f"paged_attention: v_pool {tuple(v_pool.shape)} must match k_pool {tuple(k_pool.shape)} "
                         f"in (num_blocks, Hkv, block_size)")
    if Dk != D:
        raise ValueError(f"paged_attention: q has head dim {D} but k_pool has {Dk}")
    if Hq % Hkv:
        raise ValueError(f"paged_attention: got Hq={Hq} and Hkv={Hkv}: Hq must be a multiple of Hkv")
    if block_table.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(f"paged_attention: block_table {tuple(block_table.shape)} and seq_lens "
                         f"{tuple(seq_lens.shape)} must have one row per sequence (B={B})")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise TypeError(f"paged_attention: {name} must be an integer tensor (int32), got dtype {t.dtype}: "
                            f"{name} holds {'block ids' if name == 'block_table' else 'key counts'}, not a mask")
    if not (q.dtype == k_pool.dtype == v_pool.dtype):
        raise TypeError(f"paged_attention: q, k_pool, v_pool must share one dtype, got {q.dtype}, "
                        f"{k_pool.dtype}, {v_pool.dtype}")
    check_paged_values("paged_attention", block_table, seq_lens, NB, bs)


def _check_modifiers(scale, softcap, bias, mask) -> tuple[float | None, float | None]:
    """``scale`` and ``softcap`` as :func:`attnkit.attention` takes them; ``bias`` and ``mask`` of a kind the
    decode reads."""
    if bias is not None and not isinstance(bias, (ScoreMod, Tensor)):
        raise TypeError(f"paged_attention: bias must be None, an attnkit.bias modifier or a float tensor, got "
                        f"{type(bias).__name__}" + ("; wrap a function with attnkit.bias.from_fn(fn)" if callable(bias)
                                                     else ""))
    if isinstance(bias, Tensor) and not bias.is_floating_point():
        raise TypeError(f"paged_attention: a tensor bias must be a float tensor of additive scores, got dtype "
                        f"{bias.dtype} (a bool tensor belongs in mask=)")
    if mask is not None and not isinstance(mask, (Mask, Tensor)):
        raise TypeError(f"paged_attention: mask must be None, an attnkit.masks.Mask or a bool tensor, got "
                        f"{type(mask).__name__}" + ("; wrap a predicate with attnkit.masks.from_fn(fn)"
                                                     if callable(mask) else ""))
    if isinstance(mask, Tensor) and mask.dtype != torch.bool:
        raise TypeError(f"paged_attention: a tensor mask must be bool (True = may attend), got {mask.dtype}")
    if scale is not None:
        scale = _check_number("scale", scale)
    if softcap is not None:
        softcap = _check_number("softcap", softcap, low=0.0, low_open=True, fix=" (or None for no softcap)")
    return scale, softcap


def _triton_backend():
    try:
        from ..backends import triton as tb  # the GPU kernel, when the Triton backend is installed
    except ImportError:
        return None
    return tb if hasattr(tb, "paged_decode") and hasattr(tb, "check_paged_decode") else None


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor, *,
                    scale: float | None = None, softcap: float | None = None, bias=None, mask=None,
                    sinks: Tensor | None = None) -> Tensor:
    """Attention of each sequence's newest queries over its keys, read through its block table.

    Args:
        q: ``(B, Hq, Lq, D)``; query row ``i`` of sequence ``b`` sits at position ``seq_lens[b] - Lq + i``
            (``Lq = 1`` when decoding).
        k_pool: ``(num_blocks, Hkv, block_size, D)``; ``Hq`` a multiple of ``Hkv`` (grouped-query heads
            share their key/value head: nothing is repeated).
        v_pool: ``(num_blocks, Hkv, block_size, Dv)``.
        block_table: ``(B, max_blocks)`` int32; position ``p`` of sequence ``b`` is in block
            ``block_table[b, p // block_size]``.  Entries past a sequence's blocks are ignored.
        seq_lens: ``(B,)`` int32 keys stored per sequence (the new ones included).
        scale, softcap: as in :func:`attnkit.attention`.
        bias: None, an :mod:`attnkit.bias` modifier (ALiBi, T5 buckets, ...) evaluated per sequence with
            its own length, or a float tensor broadcastable to ``(B, Hq, Lq, Lk)`` indexed by key position.
        mask: None, an :class:`attnkit.masks.Mask` evaluated per sequence (bottom-right: the last query of
            sequence ``b`` at position ``seq_lens[b] - 1``), or a bool tensor like ``bias``.
        sinks: as in :func:`attnkit.attention`, ``(Hq,)`` or broadcastable to ``(B, Hq)``: one logit per
            query head in each row's denominator (such calls are attended per sequence, on every device).

    Returns:
        ``(B, Hq, Lq, Dv)`` in ``q``'s dtype.  A sequence with ``seq_lens[b] = 0`` gets zeros.

    On CUDA tensors, with no mask beyond causal, the Triton kernel ``attnkit.backends.triton.paged_decode``
    runs when it takes the call (its ``check_paged_decode``).  Elsewhere the pool is read where it lies
    (grouped-query heads are not repeated; the softmax runs in float32 for half inputs).  A decode step
    (``Lq = 1``) whose mask and bias read only positions and heads (causal, sliding window, prefix-LM and
    block-local masks; ALiBi, T5 buckets, temperature; softcap) reads the used spans of the pool in one
    pass for the whole batch: each block is scored with the query of the sequence that owns it, in one
    batched product per span however the blocks are scattered, modified at its own positions, and a
    softmax over each sequence's blocks follows.  Otherwise each sequence is attended alone: a contiguous ``(num_blocks, Hkv, block_size, D)``
    pool (:class:`PagedCache`'s storage) takes one matrix product per run of consecutive block ids, and
    a head-major pool (``(Hkv, num_blocks, ...)`` storage) reads a run as one ``(Hkv, L, D)`` view, with
    PyTorch's fused kernel when nothing modifies the scores (a head-major decode step takes whichever
    of the two reads fewer bytes).

    Example::

        >>> import torch
        >>> from attnkit.cache import paged_attention
        >>> k_pool = v_pool = torch.randn(8, 2, 4, 16)             # 8 blocks of 4 positions, 2 kv heads
        >>> table = torch.tensor([[3, 5, 0], [1, 0, 0]], dtype=torch.int32)
        >>> lens = torch.tensor([7, 2], dtype=torch.int32)
        >>> paged_attention(torch.randn(2, 4, 1, 16), k_pool, v_pool, table, lens).shape
        torch.Size([2, 4, 1, 16])
    """
    _check_paged_args(q, k_pool, v_pool, block_table, seq_lens)
    scale, softcap = _check_modifiers(scale, softcap, bias, mask)
    B, Hq, Lq, D = q.shape
    NB, Hkv, bs, _ = k_pool.shape
    Dv = v_pool.shape[3]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    if sinks is not None:
        from ..functional import _check_sinks
        sinks = _check_sinks(sinks, q)
    if isinstance(mask, _Causal) and mask.align == "bottom_right" and Lq == 1:
        mask = None  # the newest query sees every stored key
    if q.is_cuda and Lq == 1 and mask is None and sinks is None:
        tb = _triton_backend()
        kw = dict(scale=scale, softcap=softcap, bias=bias)
        if tb is not None and tb.check_paged_decode(q, k_pool, v_pool, block_table, seq_lens, **kw) is None:
            return tb.paged_decode(q, k_pool, v_pool, block_table, seq_lens, **kw)
    if B == 0:
        return q.new_zeros(B, Hq, Lq, Dv)
    lens = [int(n) for n in seq_lens.tolist()]
    rows = block_table.tolist()
    runs = []
    for b, (row, n) in enumerate(zip(rows, lens)):
        used = row[:-(-n // bs)]
        if any(not 0 <= x < NB for x in used):
            raise ValueError(f"paged_attention: block_table[{b}] holds block ids outside [0, {NB}) among the "
                             f"{len(used)} blocks its seq_lens[{b}]={n} uses")
        runs.append(_runs(used))
    from ..backends import _splitkv  # a long sequence in one run of blocks: split over its blocks, read in place
    if _splitkv.takes_paged(q, k_pool, runs, lens, mask, bias):
        return _splitkv.paged_decode(q, k_pool, v_pool, runs, lens, scale=scale, softcap=softcap, bias=bias,
                                     mask=mask, sinks=sinks)
    layout = None if sinks is not None else _pool_layout(q, k_pool, v_pool, bias, mask, functools.cache(
        lambda whole: _PoolLayout(rows, lens, bs, q.device, NB if whole else None)))
    if layout is not None:
        return _attend_pool(q, k_pool, v_pool, layout, scale=scale, softcap=softcap, mask=mask, bias=bias)
    return _attend_runs(q, k_pool, v_pool, lens, runs, scale=scale, softcap=softcap, bias=bias, mask=mask,
                        sinks=sinks)


def _softmax(sc: Tensor, sinks: Tensor | None, b: int, masked: bool) -> Tensor:
    """Softmax of ``sc (Hkv, G, Lq, L)`` over its keys, with sequence ``b``'s sinks (``(B, Hq)``, or None) as
    one more logit in each row's denominator (a column whose value is zero, dropped after)."""
    if sinks is None:
        # a row may see nothing under a mask: 0, not NaN; else every row sees at least its first key
        return stable_softmax(sc, dim=-1) if masked else torch.softmax(sc, dim=-1)
    Hkv, G, Lq, L = sc.shape
    col = sinks[b].to(sc.dtype).reshape(Hkv, G, 1, 1).expand(Hkv, G, Lq, 1)
    return stable_softmax(torch.cat([sc, col], dim=-1), dim=-1)[..., :L]


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Consecutive block ids as ``(first, count)`` runs: each run is one view of the pool, no copy."""
    out: list[list[int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return [(a, n) for a, n in out]


def _row_bias(bias: Tensor, b: int, Hkv: int, G: int, Lq: int, L: int) -> Tensor:
    """Sequence ``b``'s slice of a tensor broadcastable to (B, Hq, Lq, >=L), as (Hkv, G, Lq, L)."""
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    if bias.shape[-1] < L:
        raise ValueError(f"paged_attention: the bias/mask covers {bias.shape[-1]} keys but sequence {b} has {L}")
    row = bias[b if bias.shape[0] > 1 else 0, :, :, :L]  # (Hq|1, Lq|1, L)
    return row.expand(Hkv * G, Lq, L).reshape(Hkv, G, Lq, L)


def _attend_runs(q: Tensor, k_pool: Tensor, v_pool: Tensor, lens: list[int], runs: list[list[tuple[int, int]]], *,
                 scale: float, softcap, bias, mask, sinks=None) -> Tensor:
    """Attention per sequence over views of its runs of consecutive blocks (nothing is gathered)."""
    if _head_major(k_pool) and _head_major(v_pool):
        return _attend_views(q, k_pool, v_pool, lens, runs, scale=scale, softcap=softcap, bias=bias, mask=mask,
                             sinks=sinks)
    B, Hq, Lq, D = q.shape
    _, Hkv, bs, _ = k_pool.shape
    Dv = v_pool.shape[3]
    G = Hq // Hkv
    acc = _accumulation(q.dtype)
    dev = q.device
    modified = bias is not None or mask is not None
    if modified:
        hi = (torch.arange(Hkv, device=dev).view(Hkv, 1) * G + torch.arange(G, device=dev)).view(Hkv, G, 1, 1)
        qi = torch.arange(Lq, device=dev).view(1, 1, Lq, 1)
    outs = []
    for b in range(B):
        L, rb = lens[b], runs[b]
        if L == 0:
            outs.append(q.new_zeros(Hq, Lq, Dv))
            continue
        qb = q[b].reshape(Hkv, G * Lq, D)  # (Hkv, G*Lq, D): the G query heads of a kv head together
        parts = [torch.matmul(qb, k_pool[a:a + n].transpose(-1, -2)) for a, n in rb]  # (n, Hkv, G*Lq, bs)
        sc = parts[0] if len(parts) == 1 else torch.cat(parts)  # (N, Hkv, G*Lq, bs)
        N = sc.shape[0]
        sc = sc.permute(1, 2, 0, 3).reshape(Hkv, G, Lq, N * bs)[..., :L]  # (Hkv, G, Lq, L), position order
        if sc.dtype != acc:
            sc = sc.to(acc)
        sc = sc * scale
        if softcap is not None:
            sc = softcap * torch.tanh(sc / softcap)
        if modified:
            bi = torch.full((1, 1, 1, 1), b, device=dev)
            ki = torch.arange(L, device=dev).view(1, 1, 1, L)
            if isinstance(bias, ScoreMod):
                sc = bias._mod(sc, bi, hi, qi, ki, Lq, L)
            elif isinstance(bias, Tensor):
                sc = sc + _row_bias(bias, b, Hkv, G, Lq, L).to(sc.dtype)
            elif bias is not None:
                raise TypeError(f"paged_attention: bias must be None, an attnkit.bias modifier or a float tensor, "
                                f"got {type(bias).__name__}")
            if isinstance(mask, Mask):
                sc = sc.masked_fill(~mask._mod(bi, hi, qi, ki, Lq, L), float("-inf"))
            elif isinstance(mask, Tensor):
                if mask.dtype != torch.bool:
                    raise TypeError(f"paged_attention: a tensor mask must be bool (True = may attend), got {mask.dtype}")
                sc = sc.masked_fill(~_row_bias(mask, b, Hkv, G, Lq, L), float("-inf"))
            elif mask is not None:
                raise TypeError(f"paged_attention: mask must be None, an attnkit.masks.Mask or a bool tensor, "
                                f"got {type(mask).__name__}")
        p = _softmax(sc, sinks, b, modified)
        p_seq = p  # (Hkv, G, Lq, L)
        if L < N * bs:
            p = torch.nn.functional.pad(p, (0, N * bs - L))
        p = p.reshape(Hkv, G * Lq, N, bs).permute(2, 0, 1, 3)  # (N, Hkv, G*Lq, bs)
        if p.dtype != v_pool.dtype:
            p = p.to(v_pool.dtype)
        if len(rb) == 1:
            ob = torch.matmul(p, v_pool[rb[0][0]:rb[0][0] + N]).sum(0, dtype=acc)  # (Hkv, G*Lq, Dv)
        else:
            o, ob = 0, None
            for a, n in rb:
                part = torch.matmul(p[o:o + n], v_pool[a:a + n]).sum(0, dtype=acc)
                ob = part if ob is None else ob + part
                o += n
        if not bool(torch.isfinite(ob).all()):  # maybe garbage behind a weight 0 (the unfilled end of the last
            ob = _weigh_seen(p_seq, sc, _seq_view(v_pool, rb, L)).to(acc)  # block, hidden keys): weigh again
        outs.append(ob.reshape(Hq, Lq, Dv))
    return torch.stack(outs).to(q.dtype)


def _weigh_seen(p: Tensor, sc: Tensor, v: Tensor) -> Tensor:
    """``p (Hkv, G, Lq, L) @ v (Hkv, L, Dv)`` as ``(Hkv, G*Lq, Dv)``, with the values of the keys that no
    query may see (their scores ``sc`` all ``-inf``) zeroed: a weight 0 still reads its value, and
    ``0 * NaN`` is NaN, so padding garbage would reach the rows."""
    Hkv, G, Lq, L = p.shape
    seen = (sc != float("-inf")).flatten(1, 2).any(1)  # (Hkv, L); a NaN score (a NaN key it sees) counts
    return torch.matmul(p.reshape(Hkv, G * Lq, L).to(v.dtype), _zero_unseen(v, seen))


def _pool_layout(q: Tensor, k_pool: Tensor, v_pool: Tensor, bias, mask, layouts) -> "_PoolLayout | None":
    """The layout ``_attend_pool`` should read, or None for one attention call per sequence.

    The pool path takes decode steps (one query per sequence) whose mask and bias depend only on the query
    and key positions and the head (``_position_only``).  A block-major pool folds (blocks, kv heads) of a span into one batch; a head-major pool (where
    a run of blocks is one ``(Hkv, L, D)`` view for the fused per-sequence kernel) folds them only over the
    whole pool, and a shorter span takes one product per kv head: there the cheapest of the three is read.
    ``layouts(whole)`` builds the layout (``whole``: one span over the whole pool)."""
    if q.shape[2] != 1 or not _position_only(mask, bias):
        return None
    lay = layouts(False)
    Hkv, NB = k_pool.shape[1], k_pool.shape[0]
    if not lay.rows_read:
        return None
    if not (_head_major(k_pool) and _head_major(v_pool)) or Hkv == 1:
        return lay
    if lay.rows_read == 1 and lay.per_sequence_cost <= lay.cost:
        return None
    spans = lay.cost + len(lay.spans) * 4 * Hkv
    whole = NB + _PoolLayout._SPAN_COST + (lay.cost - sum(hi - lo + _PoolLayout._SPAN_COST for lo, hi in lay.spans))
    best = min(lay.per_sequence_cost, spans, whole)
    if best == lay.per_sequence_cost:
        return None
    return lay if best == spans else layouts(True)


_POSITION_MASKS = (_Causal, _SlidingWindow, _PrefixLM, _BlockLocal)
_POSITION_BIASES = (_ALiBi, _RelativeBuckets, _Temperature)


def _position_only(mask, bias) -> bool:
    """Whether ``mask`` and ``bias`` (None or built-ins, bottom-right aligned) read nothing but the head and
    the query and key positions, so the pool path can evaluate them per block of each sequence."""
    return ((mask is None or (type(mask) in _POSITION_MASKS and mask.align == "bottom_right"))
            and (bias is None or (type(bias) in _POSITION_BIASES and getattr(bias, "align", "bottom_right")
                                  == "bottom_right")))


def _head_major(pool: Tensor) -> bool:
    """Whether consecutive blocks of one head are adjacent in memory (``PagedCache``'s layout), so a run of
    blocks is a ``(Hkv, positions, D)`` view."""
    NB, H, bs, D = pool.shape
    return pool.stride(3) == 1 and pool.stride(2) == D and (pool.stride(0) == bs * D or NB == 1) \
        and (pool.stride(1) == NB * bs * D or H == 1)


def _seq_view(pool: Tensor, runs: list[tuple[int, int]], L: int) -> Tensor:
    """A sequence's first ``L`` positions ``(Hkv, L, D)``: a view of a head-major pool for one run of blocks,
    a copy of its runs otherwise."""
    H, bs, D = pool.shape[1:]
    views = [pool[a:a + n].transpose(0, 1).reshape(H, n * bs, D) for a, n in runs]  # views when head-major
    return (views[0] if len(views) == 1 else torch.cat(views, dim=1))[:, :L]


def _attend_views(q: Tensor, k_pool: Tensor, v_pool: Tensor, lens: list[int], runs, *, scale: float, softcap,
                  bias, mask, sinks=None) -> Tensor:
    """``_attend_runs`` on a head-major pool: one attention per sequence over ``(Hkv, L, D)`` views of its
    blocks (PyTorch's fused kernel when nothing modifies the scores and heads are not grouped)."""
    B, Hq, Lq, D = q.shape
    Hkv = k_pool.shape[1]
    Dv = v_pool.shape[3]
    G = Hq // Hkv
    acc = _accumulation(q.dtype)
    dev = q.device
    modified = bias is not None or mask is not None
    fused = not modified and softcap is None and G == 1 and sinks is None
    if modified:
        hi = (torch.arange(Hkv, device=dev).view(Hkv, 1) * G + torch.arange(G, device=dev)).view(Hkv, G, 1, 1)
        qi = torch.arange(Lq, device=dev).view(1, 1, Lq, 1)
    outs = []
    for b in range(B):
        L = lens[b]
        if L == 0:
            outs.append(q.new_zeros(Hq, Lq, Dv))
            continue
        k, v = _seq_view(k_pool, runs[b], L), _seq_view(v_pool, runs[b], L)  # (Hkv, L, D), (Hkv, L, Dv)
        if fused:
            outs.append(torch.nn.functional.scaled_dot_product_attention(q[b:b + 1], k[None], v[None],
                                                                         scale=scale)[0])
            continue
        sc = torch.matmul(q[b].reshape(Hkv, G * Lq, D), k.transpose(-1, -2)).view(Hkv, G, Lq, L)
        sc = sc.to(acc) * scale
        if softcap is not None:
            sc = softcap * torch.tanh(sc / softcap)
        if modified:
            bi = torch.full((1, 1, 1, 1), b, device=dev)
            ki = torch.arange(L, device=dev).view(1, 1, 1, L)
            if isinstance(bias, ScoreMod):
                sc = bias._mod(sc, bi, hi, qi, ki, Lq, L)
            elif isinstance(bias, Tensor):
                sc = sc + _row_bias(bias, b, Hkv, G, Lq, L).to(sc.dtype)
            elif bias is not None:
                raise TypeError(f"paged_attention: bias must be None, an attnkit.bias modifier or a float tensor, "
                                f"got {type(bias).__name__}")
            if isinstance(mask, Mask):
                sc = sc.masked_fill(~mask._mod(bi, hi, qi, ki, Lq, L), float("-inf"))
            elif isinstance(mask, Tensor):
                if mask.dtype != torch.bool:
                    raise TypeError(f"paged_attention: a tensor mask must be bool (True = may attend), got {mask.dtype}")
                sc = sc.masked_fill(~_row_bias(mask, b, Hkv, G, Lq, L), float("-inf"))
            elif mask is not None:
                raise TypeError(f"paged_attention: mask must be None, an attnkit.masks.Mask or a bool tensor, "
                                f"got {type(mask).__name__}")
        p = _softmax(sc, sinks, b, modified)
        o = torch.matmul(p.view(Hkv, G * Lq, L).to(v.dtype), v)  # (Hkv, G*Lq, Dv)
        if modified and not bool(torch.isfinite(o).all()):  # maybe garbage behind a weight 0 (hidden keys)
            o = _weigh_seen(p, sc, v)
        outs.append(o.reshape(Hq, Lq, Dv))
    return torch.stack(outs).to(q.dtype)


class _PoolLayout:
    """Which sequence owns each block that a decode step reads, for :func:`_attend_pool`.

    The blocks are read as ``spans`` ``(lo, hi)`` of the pool (the used blocks, gaps shorter than ``_GAP``
    blocks left in: a separate span costs more calls than reading them) followed by ``extra`` blocks that
    are gathered (a block several rows read, e.g. a shared prefix, has its first reader in a span).  Over
    that concatenation ``owner[j]`` is the batch row of entry ``j`` (``B`` for a block no row reads) and
    ``unfilled[j]`` marks its unfilled positions."""

    _GAP = 8  # blocks: a gap this long splits the span
    _SPAN_COST = 6  # blocks' worth of reading that one more span costs (its two products)
    _CALL_COST = 4  # the same for one attention call per sequence

    def __init__(self, blocks: list[list[int]], lens: list[int], bs: int, device, whole: int | None = None):
        B = len(blocks)
        used = [row[:-(-n // bs)] for row, n in zip(blocks, lens)]
        first: dict[int, tuple[int, int, int]] = {}  # block -> (row, filled positions, its index in the row)
        extra: list[tuple[int, int, int, int]] = []
        for r, (row, n) in enumerate(zip(used, lens)):
            for j, blk in enumerate(row):
                f = min(bs, n - j * bs)
                if blk in first:
                    extra.append((blk, r, f, j))
                else:
                    first[blk] = (r, f, j)
        ids = sorted(first)
        bounds: list[list[int]] = []
        for blk in ids:
            if bounds and blk - bounds[-1][1] < self._GAP:
                bounds[-1][1] = blk + 1
            else:
                bounds.append([blk, blk + 1])
        if whole is not None and ids:
            bounds = [[0, whole]]
        self.spans = [(lo, hi) for lo, hi in bounds]
        owner, fill, index = [], [], []
        for lo, hi in bounds:
            for blk in range(lo, hi):
                r, f, j = first.get(blk, (B, 0, 0))
                owner.append(r)
                fill.append(f)
                index.append(j)
        self.extra = torch.tensor([e[0] for e in extra], dtype=torch.long, device=device) if extra else None
        owner += [e[1] for e in extra]
        fill += [e[2] for e in extra]
        index += [e[3] for e in extra]
        self.owner = torch.tensor(owner, dtype=torch.long, device=device)
        self._index, self._lens, self._bs = index, lens, bs
        self._positions = None
        # (N, bs): the positions of each entry past its row's length (or in a block no row reads)
        self.unfilled = torch.arange(bs, device=device).view(1, bs) >= torch.tensor(fill, device=device).view(-1, 1)
        ids = [blk for lo, hi in bounds for blk in range(lo, hi)] + [e[0] for e in extra]
        self.block_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (N,): the pool block of each entry
        # what reading the sequences one by one touches, in blocks (a sequence split into several runs of
        # blocks is copied first) plus a cost per call, against the spans read whole
        runs = [_runs(row) for row in used if row]
        self.rows_read = len(runs)
        self.per_sequence_cost = sum(sum(n for _, n in r) * (1 if len(r) == 1 else 3) + self._CALL_COST
                                     for r in runs)
        self.cost = sum(hi - lo + self._SPAN_COST for lo, hi in bounds) + len(extra) * 3

    def positions(self) -> tuple[Tensor, Tensor]:
        """``(query (N, 1, 1, 1), keys (N, 1, 1, bs))`` positions of each entry: its row's newest position
        and the positions its block holds in that row (built once, for masks and biases)."""
        if self._positions is None:
            dev, bs = self.owner.device, self._bs
            lens = torch.tensor(self._lens + [1], dtype=torch.long, device=dev)  # row B: unread blocks
            p = (lens[self.owner] - 1).view(-1, 1, 1, 1)
            k = (torch.tensor(self._index, dtype=torch.long, device=dev).view(-1, 1) * bs
                 + torch.arange(bs, device=dev)).view(-1, 1, 1, bs)
            self._positions = (p, k)
        return self._positions


def _attend_pool(q: Tensor, k_pool: Tensor, v_pool: Tensor, layout: _PoolLayout, *, scale: float, softcap,
                 mask=None, bias=None) -> Tensor:
    """One decode query per sequence against the blocks of some spans of the pool at once.

    Each block's scores come from the query of the row that owns it: one batched matrix product per span
    over its ``(blocks, Hkv)`` pairs (one per kv head on a head-major pool unless the span is all of it),
    reading the keys where they are, however the blocks are scattered; softcap, then a position-only bias
    and mask evaluated at each block's own key positions against its row's newest position; then one
    softmax over each row's blocks (segment max and sums, in float32 for half inputs) and the weighted
    values summed per row.  Unread blocks inside a span cost their bytes but count for nothing (their
    positions are ``-inf``)."""
    B, Hq, _, D = q.shape
    _, Hkv, bs, _ = k_pool.shape
    Dv = v_pool.shape[3]
    G = Hq // Hkv
    acc = _accumulation(q.dtype)
    dev = q.device
    own = layout.owner
    N = own.shape[0]
    parts = [(k_pool[lo:hi], v_pool[lo:hi]) for lo, hi in layout.spans]
    if layout.extra is not None:
        parts.append((k_pool.index_select(0, layout.extra), v_pool.index_select(0, layout.extra)))

    def products(a: Tensor, pool_part: int, y: int, dtype) -> Tensor:
        """``a[j] @ part[j]`` for every entry ``j`` (``(N, Hkv, G, x) @ (n, Hkv, x, y)`` per part), written into
        one ``(N, Hkv, G, y)`` tensor without copying the pool (with autograd recording, the parts' products
        are concatenated instead: ``out=`` products have no derivative)."""
        graph = torch.is_grad_enabled() and (a.requires_grad or any(kv[pool_part].requires_grad for kv in parts))
        out = None if graph else torch.empty(N, Hkv, G, y, dtype=dtype, device=dev)
        pieces, o = [], 0
        for kv in parts:
            n = kv[pool_part].shape[0]
            pieces.append(part_product(a[o:o + n], kv[pool_part], pool_part, None if graph else out[o:o + n]))
            o += n
        return torch.cat(pieces) if graph else out

    def part_product(a: Tensor, b: Tensor, pool_part: int, out: Tensor | None) -> Tensor:
        """One part's ``(n, Hkv, G, y)`` products: into ``out``, or a new tensor when ``out`` is None."""
        b = b.transpose(-1, -2) if pool_part == 0 else b
        n = b.shape[0]
        if b.stride(0) == Hkv * b.stride(1) or Hkv == 1:  # (n, Hkv) folds into one batch dimension
            return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
        if b.stride(1) == n * b.stride(0):  # all of a head-major pool: (Hkv, n) folds
            r = torch.matmul(a.transpose(0, 1), b.transpose(0, 1)).transpose(0, 1)
            return r if out is None else out.copy_(r)
        if out is None:  # a span of a head-major pool: one product per kv head
            return torch.stack([torch.matmul(a[:, h], b[:, h]) for h in range(Hkv)], dim=1)
        for h in range(Hkv):
            out[:, h] = torch.matmul(a[:, h], b[:, h])
        return out

    qb = torch.cat([q.reshape(B, Hkv, G, D), q.new_zeros(1, Hkv, G, D)])  # row B: blocks no row reads
    sc = products(qb[own], 0, bs, q.dtype).to(acc) * scale  # (N, Hkv, G, bs)
    if softcap is not None:
        sc = softcap * torch.tanh(sc / softcap)
    if mask is not None or bias is not None:  # position-only modifiers: each entry's own positions
        p, kpos = layout.positions()
        b = own.view(-1, 1, 1, 1)
        h = (torch.arange(Hkv, device=dev).view(Hkv, 1) * G + torch.arange(G, device=dev)).view(1, Hkv, G, 1)
        if bias is not None:  # lengths of 1 and 1: no alignment offset, p is the query's position already
            sc = bias._mod(sc, b, h, p, kpos, 1, 1).to(acc)
        if mask is not None:
            sc = sc.masked_fill(~mask._mod(b, h, p, kpos, 1, 1), float("-inf"))
    # (masked_fill, not +: a NaN key in an unfilled slot, padding garbage, must give -inf, not NaN)
    sc = sc.masked_fill(layout.unfilled[:, None, None, :], float("-inf"))
    m = torch.full((B + 1, Hkv, G), float("-inf"), dtype=acc, device=dev)
    m.scatter_reduce_(0, own.view(-1, 1, 1).expand(-1, Hkv, G), sc.detach().amax(-1), "amax")  # a shift only
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=acc, device=dev))  # rows reading nothing
    e = torch.exp(sc - m[own].unsqueeze(-1))  # (N, Hkv, G, bs)
    l = torch.zeros(B + 1, Hkv, G, dtype=acc, device=dev).index_add_(0, own, e.sum(-1))[:B]
    ob = products(e.to(v_pool.dtype), 1, Dv, v_pool.dtype)  # (N, Hkv, G, Dv)
    # a weight 0 still reads its value (0 * NaN is NaN): the blocks of a row that hold slots it may not see
    # (the unfilled end of its last block, keys its mask hides) are weighed again with those values zeroed
    # (only when that happened: a non-finite value behind a weight 0 makes its entry's product non-finite)
    if not bool(torch.isfinite(ob).all()):
        seen = (sc != float("-inf")).any(2)  # (N, Hkv, bs); a NaN score (a NaN key it sees) counts as seen
        redo = ((~seen).flatten(1).any(1) & (own < B)).nonzero().view(-1)
        if redo.numel():
            vr = _zero_unseen(v_pool.index_select(0, layout.block_ids[redo]), seen[redo])  # (n, Hkv, bs, Dv)
            ob[redo] = torch.matmul(e[redo].to(v_pool.dtype), vr)
    o = torch.zeros(B + 1, Hkv, G, Dv, dtype=acc, device=dev).index_add_(0, own, ob.to(acc))[:B]
    out = o / torch.where(l > 0, l, torch.ones((), dtype=acc, device=dev)).unsqueeze(-1)
    return out.reshape(B, Hq, 1, Dv).to(q.dtype)


# ----------------------------------------------------------------------------- the block pool


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # positions whose keys/values are stored
    tokens: list[int] = field(default_factory=list)  # known token ids (for prefix hashing)
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block registered so far
    unshared: bool = False  # registers no more blocks (its contents predate clear_prefix_cache)


class _Allocator:
    """Free blocks, reference counts, and the prefix table of full blocks (hash -> block).

    The free blocks are kept sorted so that a sequence can grow into the block right after its last one:
    a sequence whose blocks are consecutive is read as one view of the pool (see ``_attend_runs``).  A new
    run starts at the beginning of the largest free range, or in its middle when used blocks precede it
    (leaving them room to grow).
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks))  # sorted
        self.refs = [0] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached: reusable until evicted (LRU)
        self.table: dict[int, int] = {}  # chained hash -> block
        self.key: dict[int, tuple] = {}  # block -> (hash, parent hash, tokens): verified on lookup

    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def _is_free(self, b: int) -> bool:
        i = bisect_left(self.free, b)
        return i < len(self.free) and self.free[i] == b

    def _place(self, want: int) -> int:
        free = self.free
        best_start, best_len = free[0], 0
        start = prev = free[0]
        for b in free[1:] + [-1]:
            if b != prev + 1:
                if prev - start + 1 > best_len:
                    best_start, best_len = start, prev - start + 1
                start = b
            prev = b
        if best_start == 0 or best_len <= want:
            return best_start
        return best_start + (best_len - want) // 2

    def allocate(self, prefer: int | None = None, want: int = 1) -> int:
        """A block: ``prefer`` when it is free, else the start of a new run with room for ``want`` blocks,
        else the least recently used cached block."""
        if self.free:
            b = prefer if prefer is not None and self._is_free(prefer) else self._place(want)
            del self.free[bisect_left(self.free, b)]
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)  # least recently used cached block
            h = self.key.pop(b)[0]
            if self.table.get(h) == b:
                del self.table[h]
        else:
            raise PoolExhausted("no free block")
        self.refs[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.refs[b] == 0:
            self.evictable.pop(b, None)
        self.refs[b] += 1

    def decref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.key:
                self.evictable[b] = None
            else:
                insort(self.free, b)

    def lookup(self, h: int, parent: int, tokens: tuple) -> int | None:
        b = self.table.get(h)
        if b is None or self.key.get(b) != (h, parent, tokens):
            return None
        self.incref(b)
        return b

    def forget(self) -> None:
        """Drop the prefix table: cached blocks nobody holds become free; blocks in use stay with their
        sequences but are no longer offered to new ones."""
        for b in self.evictable:
            insort(self.free, b)
        self.evictable.clear()
        self.table.clear()
        self.key.clear()

    def unregister(self, b: int) -> None:
        """Block ``b`` is about to be overwritten: it no longer stands for the tokens it was registered with."""
        entry = self.key.pop(b, None)
        if entry is not None and self.table.get(entry[0]) == b:
            del self.table[entry[0]]

    def register(self, b: int, h: int, parent: int, tokens: tuple) -> None:
        if h in self.table or b in self.key:
            return  # the same content is cached in another block already
        self.table[h] = b
        self.key[b] = (h, parent, tokens)


def _items(values) -> list | None:
    """The elements of an iterable that is not a string or a mapping, else None."""
    if isinstance(values, (str, bytes, dict)):
        return None
    try:
        return list(values)
    except TypeError:
        return None


def _token_ids(who: str, tokens) -> list[int]:
    """``tokens`` (a list of ints or a 1-D integer tensor) as a list of ints; anything else raises (a float
    would be truncated to another token, a string read character by character)."""
    if isinstance(tokens, Tensor):
        if tokens.dim() != 1 or tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(f"PagedCache.{who}: tokens must be a list or 1-D integer tensor of token ids, got a "
                            f"{tuple(tokens.shape)} {tokens.dtype} tensor")
        return tokens.tolist()
    items = _items(tokens)
    if items is None or not all(isinstance(t, Integral) and not isinstance(t, bool) for t in items):
        raise TypeError(f"PagedCache.{who}: tokens must be a list of int token ids, got {tokens!r:.80}")
    return [int(t) for t in items]


def _sequence_ids(who: str, seq_ids) -> list[int]:
    """``seq_ids`` (a list of the ids ``add_sequence`` returned) as a list of ints."""
    items = _items(seq_ids.tolist() if isinstance(seq_ids, Tensor) and seq_ids.dim() == 1 else seq_ids)
    if items is None or not all(isinstance(s, Integral) and not isinstance(s, bool) for s in items):
        raise TypeError(f"{who}: seq_ids must be a list of sequence ids (ints from add_sequence()), got "
                        f"{seq_ids!r:.80}" + (f"; for one sequence pass [{seq_ids!r}]"
                                              if isinstance(seq_ids, Integral) else ""))
    return [int(s) for s in items]


def _chain(parent: int, tokens: tuple) -> int:
    return hash((parent, tokens))


_ROOT = hash("attnkit.paged.root")


class PagedCache:
    """A KV cache in a shared pool of fixed-size blocks, for many sequences of different lengths.

    Args:
        n_layers: decoder layers (each has its own ``k_pools[i]``/``v_pools[i]``; a block id is the same
            slot in every layer).
        num_blocks: blocks in the pool; ``block_size``: positions per block.
        n_kv_heads, d_head, d_value, dtype, device: the layout of one layer.
        prefix_caching: reuse full blocks of an identical prompt prefix (see :meth:`add_sequence`).

    Use: :meth:`add_sequence` (optionally with the prompt's token ids) returns a sequence id;
    :meth:`batch` gives the model-level cache for a forward over some sequences (``cache.layers``,
    ``cache.seq_len``, ``cache.positions(n)``); :meth:`free` returns a finished sequence's blocks at once.
    Blocks are reserved on demand (:meth:`reserve`, called by the first layer of a forward if not done
    before); when the pool cannot supply them a :class:`PoolExhausted` error names what was needed.

    Decoding one token per sequence returns an object whose ``attend`` runs :func:`paged_attention`
    through the block table; a multi-token step (a prompt) gathers the sequence's keys in position order.

    Example::

        >>> import torch
        >>> from attnkit.cache import PagedCache
        >>> cache = PagedCache(1, num_blocks=8, block_size=4, n_kv_heads=2, d_head=8)
        >>> a = cache.add_sequence()
        >>> k_all, v_all = cache.batch([a]).layers[0].update(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
        >>> k_all.shape, cache.length(a), cache.num_free_blocks
        (torch.Size([1, 2, 6, 8]), 6, 6)
        >>> b = cache.fork(a)                    # shares both blocks; the partial one is copied on write
        >>> cache.free(a); cache.free(b); cache.num_free_blocks
        8
    """

    def __init__(self, n_layers: int, num_blocks: int, block_size: int = 16, *, n_kv_heads: int, d_head: int,
                 d_value: int | None = None, dtype: torch.dtype = torch.float32, device=None,
                 prefix_caching: bool = True):
        self.n_layers = check_int("n_layers", n_layers, minimum=1)
        self.num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.n_kv_heads = check_int("n_kv_heads", n_kv_heads, minimum=1)
        self.d_head = check_int("d_head", d_head, minimum=1)
        # d_value=0: a latent cache, whose values are part of the keys (attnkit.nn.LatentAttention)
        self.d_value = check_int("d_value", d_value if d_value is not None else d_head, minimum=0)
        self.dtype = check_dtype("dtype", dtype)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.prefix_caching = flag("prefix_caching", prefix_caching)
        # stored block-major and contiguous: a span of block ids is one (blocks * Hkv, block_size, D) batch
        # that the decode's products read in place (see _attend_pool)
        shape_k = (num_blocks, n_kv_heads, block_size, d_head)
        shape_v = (num_blocks, n_kv_heads, block_size, self.d_value)
        with torch.inference_mode(False):  # ordinary tensors: written in and outside inference_mode alike
            self.k_pools = [torch.zeros(shape_k, dtype=dtype, device=self.device) for _ in range(n_layers)]
            self.v_pools = [torch.zeros(shape_v, dtype=dtype, device=self.device) for _ in range(n_layers)]
        self._alloc = _Allocator(num_blocks)
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.prefix_hits = 0  # blocks reused from the prefix cache so far

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = 16, *, dtype: torch.dtype | None = None,
                  device=None, prefix_caching: bool = True) -> "PagedCache":
        """A pool laid out for ``model`` (read from ``model.config`` and its parameters)."""
        d = model_dims(model)
        return cls(d["n_layers"], num_blocks, block_size, n_kv_heads=d["n_kv_heads"], d_head=d["d_head"],
                   d_value=d["d_value"], dtype=dtype or d["dtype"], device=device or d["device"],
                   prefix_caching=prefix_caching)

    # ------------------------------------------------------------------ sequences

    def _seq(self, sid: int) -> _Sequence:
        s = None if isinstance(sid, bool) else self._seqs.get(sid)  # (True == 1 would find sequence 1)
        if s is None:
            raise ValueError(f"PagedCache: no sequence {sid!r} (live ones: {sorted(self._seqs)}); add it with "
                             f"add_sequence() first")
        return s

    def add_sequence(self, tokens=None) -> int:
        """Start a sequence and return its id.  With the prompt's token ids (and prefix caching on), the
        longest run of its full blocks already in the cache is reused: :meth:`length` then tells how many
        positions are stored (at most ``len(tokens) - 1``, so the last prompt token is always computed)."""
        seq = _Sequence(tokens=[] if tokens is None else _token_ids("add_sequence", tokens))
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = seq
        if self.prefix_caching and seq.tokens:
            bs, parent = self.block_size, _ROOT
            for i in range((len(seq.tokens) - 1) // bs):
                chunk = tuple(seq.tokens[i * bs:(i + 1) * bs])
                h = _chain(parent, chunk)
                b = self._alloc.lookup(h, parent, chunk)
                if b is None:
                    break
                seq.blocks.append(b)
                seq.hashes.append(h)
                parent = h
            seq.length = len(seq.blocks) * bs
            self.prefix_hits += len(seq.blocks)
        return sid

    def append_tokens(self, sid: int, tokens) -> None:
        """Record token ids of sequence ``sid`` (prompt continuation or sampled tokens) for prefix hashing."""
        seq = self._seq(sid)
        seq.tokens.extend(_token_ids("append_tokens", tokens))
        self._register(seq)

    def fork(self, sid: int) -> int:
        """A new sequence sharing every block of ``sid`` (reference counts; the partial last block is
        copied when either one writes to it).  Returns the new id."""
        src = self._seq(sid)
        for b in src.blocks:
            self._alloc.incref(b)
        new = self._next_id
        self._next_id += 1
        self._seqs[new] = _Sequence(list(src.blocks), src.length, list(src.tokens), list(src.hashes))
        return new

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after the model's weights changed: cached keys and values were
        computed with the old ones); sequences keep their blocks, new ones no longer reuse any."""
        self._alloc.forget()
        for seq in self._seqs.values():
            seq.unshared = True  # its blocks hold keys/values of the old weights: never offered again

    def free(self, sid: int) -> None:
        """End sequence ``sid``: its blocks go back to the pool (full ones stay findable by their hash
        until the pool needs them)."""
        seq = self._seqs.pop(sid, None)
        if seq is None:
            raise ValueError(f"PagedCache: no sequence {sid!r} to free (live ones: {sorted(self._seqs)})")
        for b in reversed(seq.blocks):  # the deepest blocks are evicted first
            self._alloc.decref(b)

    def truncate(self, sid: int, length: int) -> None:
        """Keep the first ``length`` positions of sequence ``sid`` and their token ids (e.g. after a speculative
        step rejected some tokens): blocks past them go back to the pool, the next write starts at ``length``.
        A kept block that was cached for prefix reuse and is about to be overwritten is no longer offered (a
        shared one is copied on write as usual).  A ValueError if ``length`` is beyond what is stored.

        Example::

            >>> import torch
            >>> from attnkit.cache import PagedCache
            >>> pool = PagedCache(1, num_blocks=4, block_size=2, n_kv_heads=1, d_head=2)
            >>> s = pool.add_sequence()
            >>> _ = pool.batch([s]).layers[0].update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2))
            >>> pool.truncate(s, 2); pool.length(s), pool.num_free_blocks
            (2, 3)
        """
        seq = self._seq(sid)
        check_int("length", length)
        if length > seq.length:
            raise ValueError(f"PagedCache.truncate: length={length} is beyond the {seq.length} positions stored for "
                             f"sequence {sid}: a sequence can only be cut back")
        bs = self.block_size
        keep = -(-length // bs)
        for b in reversed(seq.blocks[keep:]):
            self._alloc.decref(b)
        del seq.blocks[keep:]
        full = length // bs
        if keep > full and self._alloc.refs[seq.blocks[full]] == 1:
            self._alloc.unregister(seq.blocks[full])
        del seq.hashes[full:]
        del seq.tokens[length:]
        seq.length = length

    def length(self, sid: int) -> int:
        """Positions stored for sequence ``sid``."""
        return self._seq(sid).length

    def sequences(self) -> list[int]:
        return sorted(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never used, or cached and unreferenced)."""
        return self._alloc.num_free()

    def blocks_needed(self, sid: int, n_new: int) -> int:
        """Blocks that storing ``n_new`` more positions of ``sid`` takes from the pool (copy-on-write included)."""
        check_int("n_new", n_new)
        seq = self._seq(sid)
        bs = self.block_size
        need = -(-(seq.length + n_new) // bs) - len(seq.blocks)
        if n_new > 0 and seq.length % bs and self._alloc.refs[seq.blocks[seq.length // bs]] > 1:
            need += 1
        return max(0, need)

    def reserve(self, sid: int, n_new: int) -> None:
        """Make room for ``n_new`` more positions of ``sid`` (new blocks, copy-on-write of a shared partial
        block); all or nothing: raises :class:`PoolExhausted` and changes nothing when the pool is short."""
        seq = self._seq(sid)
        need = self.blocks_needed(sid, n_new)
        if need > self._alloc.num_free():
            raise PoolExhausted(
                f"PagedCache pool exhausted: sequence {sid} needs {need} more block(s) of {self.block_size} "
                f"positions for {n_new} new token(s), but only {self._alloc.num_free()} of {self.num_blocks} "
                f"are free; free finished sequences, create the cache with more blocks, or let the Engine "
                f"preempt")
        bs = self.block_size
        if n_new > 0 and seq.length % bs:
            i = seq.length // bs
            old = seq.blocks[i]
            if self._alloc.refs[old] > 1:  # copy-on-write of the shared, partially filled block
                new = self._alloc.allocate(prefer=seq.blocks[i - 1] + 1 if i else None)
                for kp, vp in zip(self.k_pools, self.v_pools):
                    kp[new].copy_(kp[old])
                    vp[new].copy_(vp[old])
                self._alloc.decref(old)
                seq.blocks[i] = new
        missing = -(-(seq.length + n_new) // bs) - len(seq.blocks)
        for j in range(missing):  # grow into the block after the last one when it is free
            prev = seq.blocks[-1] if seq.blocks else None
            seq.blocks.append(self._alloc.allocate(prefer=None if prev is None else prev + 1, want=missing - j))

    def _register(self, seq: _Sequence) -> None:
        if not self.prefix_caching or seq.unshared:
            return
        bs = self.block_size
        full = min(seq.length, len(seq.tokens)) // bs
        for i in range(len(seq.hashes), full):
            parent = seq.hashes[-1] if seq.hashes else _ROOT
            chunk = tuple(seq.tokens[i * bs:(i + 1) * bs])
            h = _chain(parent, chunk)
            self._alloc.register(seq.blocks[i], h, parent, chunk)
            seq.hashes.append(h)

    # ------------------------------------------------------------------ forwards

    def packed(self, seq_ids, n_new) -> "PagedPacked":
        """The model-level cache for one forward whose ``(1, sum(n_new))`` tokens pack ``n_new[i]`` new tokens of
        sequence ``seq_ids[i]`` after each other (decode tokens and prompt chunks mixed); pass
        ``positions=packed.positions()`` to the model.  See :class:`PagedPacked`."""
        ids = [int(s) for s in seq_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"PagedCache.packed: sequence ids repeat in {ids}")
        n_new = [check_int("n_new", n, minimum=1) for n in n_new]
        if len(n_new) != len(ids):
            raise ValueError(f"PagedCache.packed: {len(ids)} sequences but {len(n_new)} counts of new tokens")
        for s in ids:
            self._seq(s)
        return PagedPacked(self, ids, n_new)

    def batch(self, seq_ids) -> "PagedBatch":
        """The model-level cache for one forward over sequences ``seq_ids`` (in this order)."""
        ids = _sequence_ids("PagedCache.batch", seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"PagedCache.batch: sequence ids repeat in {ids}; fork a sequence to decode it twice")
        for s in ids:
            self._seq(s)
        return PagedBatch(self, ids)

    def block_table(self, seq_ids) -> Tensor:
        """``(B, max_blocks)`` int32 block ids of ``seq_ids`` (rows padded with 0)."""
        seqs = [self._seq(s) for s in _sequence_ids("PagedCache.block_table", seq_ids)]
        width = max([len(s.blocks) for s in seqs], default=0)
        rows = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).view(len(seqs), width)

    def seq_lens(self, seq_ids) -> Tensor:
        """``(B,)`` int32 positions stored per sequence."""
        return torch.tensor([self._seq(s).length for s in _sequence_ids("PagedCache.seq_lens", seq_ids)],
                            dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ accounting

    def nbytes(self) -> int:
        """Bytes of the pools (every layer)."""
        return sum(t.nbytes for t in self.k_pools) + sum(t.nbytes for t in self.v_pools)

    def stats(self) -> dict:
        """Blocks in use, positions stored, and the share of the pool allocated but not filled (``waste``)."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for seq in self._seqs.values():
            for i, b in enumerate(seq.blocks):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, seq.length - i * bs)))
        used = len(fill)
        stored = sum(fill.values())
        return {"blocks_used": used, "blocks_free": self.num_free_blocks, "positions_stored": stored,
                "slots_allocated": used * bs, "waste": (used * bs - stored) / (self.num_blocks * bs),
                "prefix_hits": self.prefix_hits}

    def __repr__(self) -> str:
        st = self.stats()
        return (f"PagedCache({self.n_layers} layers, {self.num_blocks} blocks x {self.block_size}, "
                f"{len(self._seqs)} sequences, {st['blocks_used']} blocks used, {self.nbytes() / 2**20:.2f} MiB)")


class _Plan:
    """Where one forward writes and what it reads: computed once, shared by every layer."""

    def __init__(self, cache: PagedCache, ids: list[int], n_new: int):
        seqs = [cache._seqs[s] for s in ids]
        for s in ids:
            cache.reserve(s, n_new)
        bs, dev = cache.block_size, cache.device
        self.cache, self.ids, self.n_new = cache, ids, n_new
        starts = [s.length for s in seqs]
        self.lens = [st + n_new for st in starts]  # after the write
        blk, off = [], []
        for s, st in zip(seqs, starts):
            for p in range(st, st + n_new):
                blk.append(s.blocks[p // bs])
                off.append(p % bs)
        self.write_blocks = torch.tensor(blk, dtype=torch.long, device=dev)  # (B * n_new,)
        self.write_offsets = torch.tensor(off, dtype=torch.long, device=dev)
        self.blocks = [s.blocks[:-(-n // bs)] for s, n in zip(seqs, self.lens)]
        self.runs = [_runs(b) for b in self.blocks]
        self._tables = None
        self._layout = None

    @classmethod
    def reading(cls, cache: PagedCache, ids: list[int], lens: list[int]) -> "_Plan":
        """A plan that only reads: sequences ``ids`` holding ``lens`` positions (written already)."""
        self = cls.__new__(cls)
        bs = cache.block_size
        self.cache, self.ids, self.n_new, self.lens = cache, ids, None, lens
        self.blocks = [cache._seqs[s].blocks[:-(-n // bs)] for s, n in zip(ids, lens)]
        self.runs = [_runs(b) for b in self.blocks]
        self._tables = None
        self._layout = None
        return self

    def layout(self, whole: bool = False) -> _PoolLayout:
        """The pool-wide decode layout (built once per step, shared by every layer)."""
        if self._layout is None:
            self._layout = {}
        if whole not in self._layout:
            self._layout[whole] = _PoolLayout(self.blocks, self.lens, self.cache.block_size, self.cache.device,
                                              self.cache.num_blocks if whole else None)
        return self._layout[whole]

    def tables(self) -> tuple[Tensor, Tensor]:
        """``block_table (B, max_blocks)`` and ``seq_lens (B,)`` int32 tensors (for the GPU kernel)."""
        if self._tables is None:
            self._tables = (self.cache.block_table(self.ids),
                            torch.tensor(self.lens, dtype=torch.int32, device=self.cache.device))
        return self._tables

    def gather(self, pool: Tensor) -> tuple[Tensor, Tensor | None]:
        """Every stored position of each sequence, right-aligned: ``(B, Hkv, max_len, D)`` and the padding mask."""
        _, H, bs, D = pool.shape
        rows = []
        for runs, n in zip(self.runs, self.lens):
            views = [pool[a:a + m].transpose(0, 1).reshape(H, m * bs, D) for a, m in runs]  # (Hkv, m*bs, D)
            if not views:  # a sequence with nothing stored yet
                views = [pool.new_zeros(H, 0, D)]
            rows.append((views[0] if len(views) == 1 else torch.cat(views, dim=1))[:, :n])
        if len(rows) == 1:
            return rows[0][None], None
        L = max(self.lens)
        out = pool.new_zeros(len(rows), H, L, D)
        for b, r in enumerate(rows):
            out[b, :, L - r.shape[1]:] = r  # right-align: every sequence ends at column L - 1 (bottom-right)
        if all(n == L for n in self.lens):
            return out, None
        cols = torch.arange(L, device=pool.device).view(1, -1)
        pad = torch.tensor([L - n for n in self.lens], device=pool.device).view(-1, 1)
        return out, (cols >= pad)[:, None, None, :]  # (B, 1, 1, L)


class _PagedDecode:
    """What a decode step's layer returns: attention through the block table (see ``paged_attention``)."""

    def __init__(self, k_pool: Tensor, v_pool: Tensor, plan: _Plan):
        self.k_pool, self.v_pool, self.plan = k_pool, v_pool, plan

    def attend(self, q: Tensor, *, mask=None, bias=None, scale=None, softcap=None, sinks=None,
               value_dims: int | None = None) -> Tensor:
        """``value_dims``: the values are the first ``value_dims`` channels of the stored keys (a latent cache,
        :class:`attnkit.nn.LatentAttention`, stores no values of its own)."""
        v_pool = self.v_pool if value_dims is None else self.k_pool[..., :value_dims]
        if q.is_cuda or sinks is not None:  # the Triton kernel when it takes the call (sinks: per sequence)
            table, lens = self.plan.tables()
            return paged_attention(q, self.k_pool, v_pool, table, lens, scale=scale, softcap=softcap,
                                   bias=bias, mask=mask, sinks=sinks)
        scale, softcap = _check_modifiers(scale, softcap, bias, mask)
        if isinstance(mask, _Causal) and mask.align == "bottom_right" and q.shape[2] == 1:
            mask = None
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        from ..backends import _splitkv  # a long sequence in one run of blocks: split over its blocks, read in place
        if _splitkv.takes_paged(q, self.k_pool, self.plan.runs, self.plan.lens, mask, bias):
            return _splitkv.paged_decode(q, self.k_pool, v_pool, self.plan.runs, self.plan.lens, scale=scale,
                                         softcap=softcap, bias=bias, mask=mask)
        layout = _pool_layout(q, self.k_pool, v_pool, bias, mask, self.plan.layout)
        if layout is not None:
            return _attend_pool(q, self.k_pool, v_pool, layout, scale=scale, softcap=softcap, mask=mask, bias=bias)
        return _attend_runs(q, self.k_pool, v_pool, self.plan.lens, self.plan.runs, scale=scale,
                            softcap=softcap, bias=bias, mask=mask)


class PagedLayerCache:
    """Layer ``index`` of a :class:`PagedBatch`: writes new keys/values into the pool through the plan."""

    def __init__(self, owner: "PagedBatch", index: int):
        self._owner, self.index = owner, index

    @property
    def length(self) -> int:
        return self._owner.seq_len

    @property
    def seq_len(self) -> int:
        """The batch's stored length when its sequences hold the same (a ragged batch raises: it passes
        explicit positions to the model)."""
        return self._owner.seq_len

    def peek(self, n_new: int) -> tuple[int | None, bool]:
        """``(Lk, attends)`` of an update of ``n_new`` tokens (see ``StaticLayerCache.peek``): one token
        returns the paged decode object; more return the gathered keys, as long as the longest sequence."""
        o = self._owner
        return max((o.cache._seqs[s].length for s in o.ids), default=0) + n_new, n_new == 1

    def update(self, k: Tensor, v: Tensor):
        """Store ``k (B, Hkv, L_new, D)``, ``v`` for the batch's sequences; one new token each returns a
        paged decode object (``attend``), more return the gathered keys/values in position order."""
        o = self._owner
        c = o.cache
        check_new_kv(k, v, batch=len(o.ids), heads=c.n_kv_heads, d_head=c.d_head, d_value=c.d_value,
                     dtype=c.dtype, device=c.device)
        plan = o._plan_for(k.shape[2])
        kp, vp = c.k_pools[self.index], c.v_pools[self.index]
        B, H, n, _ = k.shape
        kp[plan.write_blocks, :, plan.write_offsets] = k.transpose(1, 2).reshape(B * n, H, k.shape[3])  # (B*n, Hkv, D)
        vp[plan.write_blocks, :, plan.write_offsets] = v.transpose(1, 2).reshape(B * n, H, v.shape[3])
        if n == 1:
            out = _PagedDecode(kp, vp, plan)
        else:
            k_all, mask = plan.gather(kp)  # (B, Hkv, L, D), right-aligned
            v_all, _ = plan.gather(vp)
            out = (k_all, v_all) if mask is None else (k_all, v_all, mask)
        if self.index == c.n_layers - 1:
            o._commit()
        return out

    def nbytes(self) -> int:
        c = self._owner.cache
        return c.k_pools[self.index].nbytes + c.v_pools[self.index].nbytes

    def reset(self) -> None:
        raise TypeError("a PagedBatch layer cannot be reset: free the sequences in the PagedCache instead")


class PagedBatch:
    """The model-level view of a :class:`PagedCache` for a forward over some of its sequences.

    ``layers[i]`` writes layer ``i``; the last layer's update commits the new lengths (and registers
    newly filled blocks for prefix caching).  ``seq_len`` is the stored length when every sequence holds the
    same; a batch whose sequences differ in length must pass ``positions=batch.positions(L)`` (``(B, L)``
    long) to the model (its ``seq_len`` raises).

    Example::

        >>> import torch
        >>> from attnkit.cache import PagedCache
        >>> pool = PagedCache(1, num_blocks=4, block_size=4, n_kv_heads=1, d_head=2)
        >>> a, b = pool.add_sequence(), pool.add_sequence()
        >>> _ = pool.batch([a]).layers[0].update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
        >>> view = pool.batch([a, b])
        >>> view.positions(1).tolist(), pool.batch([a]).seq_len
        ([[3], [0]], 3)
    """

    def __init__(self, cache: PagedCache, ids: list[int]):
        self.cache, self.ids = cache, ids
        self.layers = tuple(PagedLayerCache(self, i) for i in range(cache.n_layers))
        self._plan: _Plan | None = None

    @property
    def seq_len(self) -> int:
        """The stored length of the batch's sequences, when they all hold the same (what a model's default
        positions read); sequences of different lengths raise: pass ``positions=batch.positions(L)``."""
        lens = [self.cache._seqs[s].length for s in self.ids]
        if len(set(lens)) > 1:
            raise ValueError(f"PagedBatch: its sequences hold different lengths {lens}, so default positions "
                             f"(seq_len + arange(L)) would be wrong for all but the longest: pass "
                             f"positions=batch.positions(L) to the model")
        return lens[0] if lens else 0

    def positions(self, n_new: int) -> Tensor:
        """``(B, n_new)`` absolute positions of the next ``n_new`` tokens of each sequence."""
        check_int("n_new", n_new)
        lens = torch.tensor([self.cache._seqs[s].length for s in self.ids], dtype=torch.long, device=self.cache.device)
        return lens.view(-1, 1) + torch.arange(n_new, device=self.cache.device).view(1, -1)

    def _plan_for(self, n_new: int) -> _Plan:
        if self._plan is None:
            self._plan = _Plan(self.cache, self.ids, n_new)
        elif self._plan.n_new != n_new:
            raise ValueError(f"PagedBatch: layers of one forward got {self._plan.n_new} and {n_new} new tokens")
        return self._plan

    def _commit(self) -> None:
        plan = self._plan
        for s in self.ids:
            seq = self.cache._seqs[s]
            seq.length += plan.n_new
            self.cache._register(seq)
        self._plan = None

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"PagedBatch(sequences {self.ids}, lengths {[self.cache._seqs[s].length for s in self.ids]})"


# ----------------------------------------------------------------------------- packed forwards (chunked prefill)


class _PackedAttend:
    """What a packed forward's layer returns: each sequence's queries attend to its own keys.

    The one-token segments (decode steps) attend together through the block tables, as a decode step does;
    each longer segment (a chunk of a prompt) attends to its sequence's keys read in position order, with
    the layer's mask and bias bottom-right aligned on that sequence alone."""

    def __init__(self, k_pool: Tensor, v_pool: Tensor, packed: "PagedPacked"):
        self.k_pool, self.v_pool, self.packed = k_pool, v_pool, packed

    def attend(self, q: Tensor, *, mask=None, bias=None, scale=None, softcap=None) -> Tensor:
        from ..functional import attention

        pk = self.packed
        _, Hq, T, D = q.shape
        out = q.new_empty(1, Hq, T, self.v_pool.shape[3])  # (1, Hq, T, Dv)
        dec = pk._decode_rows
        if dec:
            rows = torch.tensor([pk.offsets[i] for i in dec], device=q.device)
            qd = q[0, :, rows].transpose(0, 1).unsqueeze(2)  # (Bd, Hq, 1, D)
            od = _PagedDecode(self.k_pool, self.v_pool, pk._decode_plan()).attend(
                qd, mask=mask, bias=bias, scale=scale, softcap=softcap)  # (Bd, Hq, 1, Dv)
            out[0, :, rows] = od[:, :, 0].transpose(0, 1)
        plan = pk._read_plan()
        for i in pk._chunk_rows:
            a, n = pk.offsets[i], pk.n_new[i]
            L = plan.lens[i]
            k = _seq_view(self.k_pool, plan.runs[i], L)[None]  # (1, Hkv, L, D)
            v = _seq_view(self.v_pool, plan.runs[i], L)[None]
            out[:, :, a:a + n] = attention(q[:, :, a:a + n], k, v, mask=mask, bias=bias, scale=scale,
                                           softcap=softcap)
        return out


class PagedPackedLayerCache:
    """Layer ``index`` of a :class:`PagedPacked`: writes the packed keys/values into the pool."""

    def __init__(self, owner: "PagedPacked", index: int):
        self._owner, self.index = owner, index

    @property
    def length(self) -> int:
        return self._owner.seq_len

    @property
    def seq_len(self) -> int:
        return self._owner.seq_len

    def peek(self, n_new: int) -> tuple[int | None, bool]:
        """``(None, True)``: the keys differ per sequence, and the returned object computes attention."""
        return None, True

    def update(self, k: Tensor, v: Tensor) -> _PackedAttend:
        """Store ``k (1, Hkv, T, D)``, ``v (1, Hkv, T, Dv)`` (the packed tokens) at their sequences' slots."""
        o = self._owner
        c = o.cache
        check_new_kv(k, v, batch=1, heads=c.n_kv_heads, d_head=c.d_head, d_value=c.d_value, dtype=c.dtype,
                     device=c.device)
        if k.shape[2] != o.total:
            raise ValueError(f"PagedPacked: the forward packs {o.total} tokens ({o.n_new} per sequence) but layer "
                             f"{self.index} got {k.shape[2]}")
        o._reserve()
        kp, vp = c.k_pools[self.index], c.v_pools[self.index]
        kp[o.write_blocks, :, o.write_offsets] = k[0].transpose(0, 1)  # (T, Hkv, D)
        vp[o.write_blocks, :, o.write_offsets] = v[0].transpose(0, 1)
        out = _PackedAttend(kp, vp, o)
        if self.index == c.n_layers - 1:
            o._commit()
        return out

    def nbytes(self) -> int:
        c = self._owner.cache
        return c.k_pools[self.index].nbytes + c.v_pools[self.index].nbytes

    def reset(self) -> None:
        raise TypeError("a PagedPacked layer cannot be reset: free the sequences in the PagedCache instead")


class PagedPacked:
    """The model-level view of a :class:`PagedCache` for one forward over packed tokens of several sequences.

    The forward's ``(1, T)`` tokens are ``n_new[0]`` tokens of ``ids[0]``, then ``n_new[1]`` of ``ids[1]``, ...
    (queries of different lengths per sequence: decode tokens and chunks of prompts in one forward, the work
    following the real tokens).  Pass ``positions=packed.positions()`` (``(1, T)``) to the model; each
    sequence's queries attend only to its own keys (its mask bottom-right aligned on it alone).  The last
    layer commits the new lengths.  :meth:`last` gives the index of each sequence's last token in ``T``.

    Example::

        >>> import torch
        >>> from attnkit.cache import PagedCache
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny")).double()
        >>> pool = PagedCache.for_model(model, num_blocks=8, block_size=4)
        >>> a, b = pool.add_sequence(), pool.add_sequence()
        >>> with torch.no_grad():
        ...     view = pool.batch([a])
        ...     _ = model(torch.tensor([[1, 2, 3]]), cache=view, positions=view.positions(3))
        ...     packed = pool.packed([a, b], [1, 5])      # a decodes one token, b prefills five
        ...     logits = model(torch.tensor([[4, 9, 8, 7, 6, 5]]), cache=packed, positions=packed.positions())
        ...     alone = model(torch.tensor([[9, 8, 7, 6, 5]]))
        >>> bool(torch.allclose(logits[0, 1:], alone[0]))
        True
    """

    def __init__(self, cache: PagedCache, ids: list[int], n_new: list[int]):
        self.cache, self.ids, self.n_new = cache, ids, n_new
        self.total = sum(n_new)
        self.offsets = [0]
        for n in n_new[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.starts = [cache._seqs[s].length for s in ids]
        self.layers = tuple(PagedPackedLayerCache(self, i) for i in range(cache.n_layers))
        self._decode_rows = [i for i, n in enumerate(n_new) if n == 1]
        self._chunk_rows = [i for i, n in enumerate(n_new) if n > 1]
        self._reserved = self._committed = False
        self._plans: dict = {}

    @property
    def seq_len(self) -> int:
        raise ValueError("PagedPacked: its sequences hold different lengths: pass positions=packed.positions() "
                         "to the model")

    def positions(self) -> Tensor:
        """``(1, T)`` absolute positions of the packed tokens."""
        pos = [st + j for st, n in zip(self.starts, self.n_new) for j in range(n)]
        return torch.tensor([pos], dtype=torch.long, device=self.cache.device)

    def last(self) -> Tensor:
        """``(len(ids),)`` index of each sequence's last token in the packed ``T``."""
        return torch.tensor([a + n - 1 for a, n in zip(self.offsets, self.n_new)], dtype=torch.long,
                            device=self.cache.device)

    def _reserve(self) -> None:
        if self._committed:
            raise ValueError("PagedPacked: this view served its forward already; make a new one with "
                             "PagedCache.packed(...) for the next")
        if self._reserved:
            return
        c = self.cache
        need = sum(c.blocks_needed(s, n) for s, n in zip(self.ids, self.n_new))
        if need > c.num_free_blocks:
            raise PoolExhausted(f"PagedCache pool exhausted: a packed forward needs {need} more block(s) but only "
                                f"{c.num_free_blocks} of {c.num_blocks} are free")
        for s, n in zip(self.ids, self.n_new):
            c.reserve(s, n)
        bs = c.block_size
        blk, off = [], []
        for s, st, n in zip(self.ids, self.starts, self.n_new):
            seq = c._seqs[s]
            for p in range(st, st + n):
                blk.append(seq.blocks[p // bs])
                off.append(p % bs)
        self.write_blocks = torch.tensor(blk, dtype=torch.long, device=c.device)  # (T,)
        self.write_offsets = torch.tensor(off, dtype=torch.long, device=c.device)
        self._reserved = True

    def _read_plan(self) -> _Plan:
        if "all" not in self._plans:
            lens = [st + n for st, n in zip(self.starts, self.n_new)]
            self._plans["all"] = _Plan.reading(self.cache, self.ids, lens)
        return self._plans["all"]

    def _decode_plan(self) -> _Plan:
        if "decode" not in self._plans:
            rows = self._decode_rows
            self._plans["decode"] = _Plan.reading(self.cache, [self.ids[i] for i in rows],
                                                  [self.starts[i] + 1 for i in rows])
        return self._plans["decode"]

    def _commit(self) -> None:
        self._committed = True
        for s, n in zip(self.ids, self.n_new):
            seq = self.cache._seqs[s]
            seq.length += n
            self.cache._register(seq)

    def nbytes(self) -> int:
        return self.cache.nbytes()

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"PagedPacked(sequences {self.ids}, new tokens {self.n_new}, stored {self.starts})"
