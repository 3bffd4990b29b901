"""Attention over a paged KV cache: queries read their keys and values through a block table.

Layout (that of :class:`attnkit.cache.PagedCache` and of the Triton decode kernel), per layer::

    k_pool (num_blocks, Hkv, block_size, D)      v_pool (num_blocks, Hkv, block_size, Dv)
    block_table (B, max_blocks) int32            seq_lens (B,) int32

Position ``p`` of sequence ``b`` lives in block ``block_table[b, p // block_size]`` at offset
``p % block_size``.  The public entry is :func:`attnkit.cache.paged_attention`, which validates a call and
comes here; the cache's decode objects come here with block lists they hold already
(:func:`attend_blocks`).  Scores go through the pipeline every backend shares (``scores.score_pipeline``:
softcap, then bias, then mask; sinks as one more column), evaluated per sequence at its own positions.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, cast

import torch

from ..bias import ScoreMod
from ..masks import Mask
from ..softmax import stable_softmax
from . import splitkv as _splitkv
from .call import accumulation_dtype
from .scores import check_paged_values, grouped_heads, score_pipeline, with_sinks, zero_unseen

Tensor = torch.Tensor

if TYPE_CHECKING:
    from types import ModuleType

    from .fused import FusedForward


def check_paged_args(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, seq_lens: Tensor) -> None:
    """Raise TypeError/ValueError unless ``q``, ``k_pool``, ``v_pool``, ``block_table`` and ``seq_lens`` have the
    shapes, dtypes and values :func:`attend_table` reads (block ids inside the pool, lengths inside the table)."""
    for name, t, nd in (
        ("q", q, 4),
        ("k_pool", k_pool, 4),
        ("v_pool", v_pool, 4),
        ("block_table", block_table, 2),
        ("seq_lens", seq_lens, 1),
    ):
        if not isinstance(t, Tensor):
            raise TypeError(f"paged_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"paged_attention: {name} must have {nd} dims, got shape {tuple(t.shape)}")
    B, Hq, _, D = q.shape
    NB, Hkv, bs, Dk = k_pool.shape
    if v_pool.shape[:3] != k_pool.shape[:3]:
        raise ValueError(
            f"paged_attention: v_pool {tuple(v_pool.shape)} must match k_pool {tuple(k_pool.shape)} "
            f"in (num_blocks, Hkv, block_size)"
        )
    if Dk != D:
        raise ValueError(f"paged_attention: q has head dim {D} but k_pool has {Dk}")
    if Hq % Hkv:
        raise ValueError(f"paged_attention: got Hq={Hq} and Hkv={Hkv}: Hq must be a multiple of Hkv")
    if block_table.shape[0] != B or seq_lens.shape[0] != B:
        raise ValueError(
            f"paged_attention: block_table {tuple(block_table.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)} must have one row per sequence (B={B})"
        )
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise TypeError(
                f"paged_attention: {name} must be an integer tensor (int32), got dtype {t.dtype}: "
                f"{name} holds {'block ids' if name == 'block_table' else 'key counts'}, not a mask"
            )
    if not (q.dtype == k_pool.dtype == v_pool.dtype):
        raise TypeError(
            f"paged_attention: q, k_pool, v_pool must share one dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}"
        )
    check_paged_values("paged_attention", block_table, seq_lens, NB, bs)


def _triton_backend() -> ModuleType | None:
    """``attnkit.backends.triton`` when it offers the paged decode kernel, else None."""
    try:
        from . import triton as tb  # the GPU kernel, when the Triton backend is installed
    except ImportError:
        return None
    return tb if hasattr(tb, "paged_decode") and hasattr(tb, "check_paged_decode") else None


def attend_table(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    bias: Tensor | ScoreMod | None = None,
    mask: Mask | Tensor | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """:func:`attnkit.cache.paged_attention` once its arguments are checked: ``scale`` a float, ``softcap`` a
    positive float or None, ``bias``/``mask`` of the kinds it takes (a bottom-right causal mask of a decode
    step already dropped), ``sinks`` ``(B, Hq)`` or None.  The Triton kernel takes a CUDA decode step with no
    mask and no sinks when its ``check_paged_decode`` passes; otherwise :func:`attend_blocks` reads the pool."""
    kw = dict(scale=scale, softcap=softcap, bias=bias)
    tb = _triton_taker(q, k_pool, v_pool, block_table, seq_lens, mask=mask, sinks=sinks, **kw)
    if tb is not None:
        return cast(Tensor, tb.paged_decode(q, k_pool, v_pool, block_table, seq_lens, **kw))
    B, Hq, Lq, _ = q.shape
    if B == 0:
        return q.new_zeros(B, Hq, Lq, v_pool.shape[3])
    lens, runs, layouts = _table_runs(q, k_pool, block_table, seq_lens)
    return attend_blocks(
        q, k_pool, v_pool, lens, runs, layouts, scale=scale, softcap=softcap, bias=bias, mask=mask, sinks=sinks
    )


def explain_table(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    bias: Tensor | ScoreMod | None = None,
    mask: Mask | Tensor | None = None,
    sinks: Tensor | None = None,
) -> str:
    """How :func:`attend_table` computes a call (arguments as it takes them), as one line: the path it takes
    (the same decision, made by the same functions) and why."""
    kw = dict(scale=scale, softcap=softcap, bias=bias)
    if _triton_taker(q, k_pool, v_pool, block_table, seq_lens, mask=mask, sinks=sinks, **kw) is not None:
        return "triton: the Triton paged decode kernel (a CUDA decode step without mask or sinks)"
    if q.shape[0] == 0:
        return "empty: no sequences"
    lens, runs, layouts = _table_runs(q, k_pool, block_table, seq_lens)
    path, layout = _route(q, k_pool, v_pool, lens, runs, layouts, bias, mask, sinks)
    if path == "splitkv":
        return "splitkv: one long sequence in one run of blocks, its keys split in chunks merged by log-sum-exp"
    if layout is not None:
        return (
            f"pool: one pass over {len(layout.spans)} span(s) of the pool for the whole batch (a decode step whose "
            f"mask and bias read only positions and heads)"
        )
    if q.shape[2] != 1:
        why = f"{q.shape[2]} queries per sequence; the pool path takes decode steps"
    elif sinks is not None:
        why = "sinks"
    elif not _position_only(mask, bias):
        why = "the mask or bias reads more than positions and heads"
    else:
        why = "cheaper than reading spans of the pool"
    return f"per sequence: one attention per sequence over its runs of blocks ({why})"


def _triton_taker(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    mask: Mask | Tensor | None,
    sinks: Tensor | None,
    **kw: object,
) -> ModuleType | None:
    """``attnkit.backends.triton`` when its paged decode kernel takes the call (a CUDA decode step without mask
    or sinks; ``kw``: its scale, softcap and bias), else None."""
    if not (q.is_cuda and q.shape[2] == 1 and mask is None and sinks is None):
        return None
    tb = _triton_backend()
    if tb is not None and tb.check_paged_decode(q, k_pool, v_pool, block_table, seq_lens, **kw) is None:
        return tb
    return None


def _table_runs(
    q: Tensor, k_pool: Tensor, block_table: Tensor, seq_lens: Tensor
) -> tuple[list[int], list[list[tuple[int, int]]], Callable[[bool], PoolLayout]]:
    """``(lens, runs, layouts)`` of a block table, as :func:`attend_blocks` takes them."""
    NB, _, bs, _ = k_pool.shape
    lens = [int(n) for n in seq_lens.tolist()]
    rows = block_table.tolist()
    runs: list[list[tuple[int, int]]] = []
    for b, (row, n) in enumerate(zip(rows, lens)):
        used = row[: -(-n // bs)]
        if any(not 0 <= x < NB for x in used):
            raise ValueError(
                f"paged_attention: block_table[{b}] holds block ids outside [0, {NB}) among the "
                f"{len(used)} blocks its seq_lens[{b}]={n} uses"
            )
        runs.append(block_runs(used))
    layouts = functools.cache(lambda whole: PoolLayout(rows, lens, bs, q.device, NB if whole else None))
    return lens, runs, layouts


def attend_blocks(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    lens: list[int],
    runs: list[list[tuple[int, int]]],
    layouts: Callable[[bool], PoolLayout],
    *,
    scale: float,
    softcap: float | None = None,
    bias: Tensor | ScoreMod | None = None,
    mask: Mask | Tensor | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of ``q (B, Hq, Lq, D)`` over sequences holding ``lens[b]`` positions in the blocks ``runs[b]``
    (``(first block, count)`` runs, :func:`block_runs`), arguments checked as for :func:`attend_table`.

    A decode step whose mask and bias read only positions and heads reads the used spans of the pool in
    one pass for the whole batch (``layouts(whole)`` builds its :class:`PoolLayout`, ``whole``: one span
    over the whole pool); otherwise each sequence is attended alone over views of its runs.  Returns
    ``(B, Hq, Lq, Dv)`` in ``q``'s dtype."""
    path, layout = _route(q, k_pool, v_pool, lens, runs, layouts, bias, mask, sinks)
    if path == "splitkv":  # a long sequence in one run: split-KV, in place
        return _splitkv.paged_decode(
            q,
            k_pool,
            v_pool,
            runs,
            lens,
            scale=scale,
            softcap=softcap,
            bias=cast("ScoreMod | None", bias),  # (takes_paged checked both)
            mask=cast("Mask | None", mask),
            sinks=sinks,
        )
    if layout is not None:
        return _attend_pool(  # (_pool_layout takes only masks and modifiers that read positions)
            q, k_pool, v_pool, layout, scale=scale, softcap=softcap, mask=cast("Mask | None", mask), bias=bias
        )
    return _attend_runs(q, k_pool, v_pool, lens, runs, scale=scale, softcap=softcap, bias=bias, mask=mask, sinks=sinks)


def _route(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    lens: list[int],
    runs: list[list[tuple[int, int]]],
    layouts: Callable[[bool], PoolLayout],
    bias: Tensor | ScoreMod | None,
    mask: Mask | Tensor | None,
    sinks: Tensor | None,
) -> tuple[str, PoolLayout | None]:
    """The path :func:`attend_blocks` takes: ``("splitkv", None)``, ``("pool", layout)`` or
    ``("per sequence", None)``."""
    if _splitkv.takes_paged(q, k_pool, runs, lens, mask, bias):
        return "splitkv", None
    layout = None if sinks is not None else _pool_layout(q, k_pool, v_pool, bias, mask, layouts)
    return ("per sequence", None) if layout is None else ("pool", layout)


def _softmax(sc: Tensor, sinks: Tensor | None, b: int, masked: bool) -> Tensor:
    """Softmax of ``sc (Hkv, G, Lq, L)`` over its keys, with sequence ``b``'s sinks (``(B, Hq)``, or None) as
    one more logit in each row's denominator (a column whose value is zero, dropped after)."""
    if sinks is None:
        # a row may see nothing under a mask: 0, not NaN; else every row sees at least its first key
        return stable_softmax(sc, dim=-1) if masked else torch.softmax(sc, dim=-1)
    Hkv, G, _, L = sc.shape
    return stable_softmax(with_sinks(sc, sinks[b].reshape(Hkv, G, 1, 1)), dim=-1)[..., :L]


def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
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


def _sizes(q: Tensor, k_pool: Tensor, v_pool: Tensor) -> tuple[int, int, int, int, int, int, int, int]:
    """``(B, Hq, Lq, D, Hkv, block_size, Dv, G)`` of a call; ``G = Hq // Hkv`` query heads share a kv head."""
    B, Hq, Lq, D = q.shape
    _, Hkv, bs, _ = k_pool.shape
    return B, Hq, Lq, D, Hkv, bs, v_pool.shape[3], Hq // Hkv


def _row_index(Hkv: int, G: int, Lq: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The query heads ``(Hkv, G, 1, 1)`` and query rows ``(1, 1, Lq, 1)`` of a sequence's scores."""
    return grouped_heads(Hkv, G, device).view(Hkv, G, 1, 1), torch.arange(Lq, device=device).view(1, 1, Lq, 1)


def _sequence_scores(
    sc: Tensor,
    b: int,
    rows: tuple[Tensor, Tensor] | None,
    *,
    softcap: float | None,
    bias: Tensor | ScoreMod | None,
    mask: Mask | Tensor | None,
) -> Tensor:
    """Sequence ``b``'s scaled scores ``(Hkv, G, Lq, L)`` through softcap, bias and mask (the shared score
    pipeline), evaluated at its own length: its query ``i`` at position ``L - Lq + i``.  ``rows``: its
    ``_row_index`` (None when there is no bias or mask)."""
    Hkv, G, Lq, L = sc.shape
    if rows is None:
        return score_pipeline(sc, None, None, None, None, Lq, L, softcap=softcap, bias=None, mask=None)
    dev = sc.device
    hi, qi = rows
    bi = torch.full((1, 1, 1, 1), b, device=dev)
    ki = torch.arange(L, device=dev).view(1, 1, 1, L)
    return score_pipeline(
        sc,
        bi,
        hi,
        qi,
        ki,
        Lq,
        L,
        softcap=softcap,
        bias=bias,
        mask=mask if isinstance(mask, Mask) else None,
        bias_block=_row_bias(bias, b, Hkv, G, Lq, L) if isinstance(bias, Tensor) else None,
        mask_block=_row_bias(mask, b, Hkv, G, Lq, L) if isinstance(mask, Tensor) else None,
    )


def _attend_runs(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    lens: list[int],
    runs: list[list[tuple[int, int]]],
    *,
    scale: float,
    softcap: float | None,
    bias: Tensor | ScoreMod | None,
    mask: Mask | Tensor | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention per sequence over views of its runs of consecutive blocks (nothing is gathered)."""
    if _head_major(k_pool) and _head_major(v_pool):
        return _attend_views(
            q, k_pool, v_pool, lens, runs, scale=scale, softcap=softcap, bias=bias, mask=mask, sinks=sinks
        )
    B, Hq, Lq, D, Hkv, bs, Dv, G = _sizes(q, k_pool, v_pool)
    acc = accumulation_dtype(q.dtype)
    dev = q.device
    modified = bias is not None or mask is not None
    rows = _row_index(Hkv, G, Lq, dev) if modified else None
    outs = []
    for b in range(B):
        L, rb = lens[b], runs[b]
        if L == 0:
            outs.append(q.new_zeros(Hq, Lq, Dv))
            continue
        qb = q[b].reshape(Hkv, G * Lq, D)  # (Hkv, G*Lq, D): the G query heads of a kv head together
        parts = [torch.matmul(qb, k_pool[a : a + n].transpose(-1, -2)) for a, n in rb]  # (n, Hkv, G*Lq, bs)
        sc = parts[0] if len(parts) == 1 else torch.cat(parts)  # (N, Hkv, G*Lq, bs)
        N = sc.shape[0]
        sc = sc.permute(1, 2, 0, 3).reshape(Hkv, G, Lq, N * bs)[..., :L]  # (Hkv, G, Lq, L), position order
        if sc.dtype != acc:
            sc = sc.to(acc)
        sc = _sequence_scores(sc * scale, b, rows, softcap=softcap, bias=bias, mask=mask)
        p = _softmax(sc, sinks, b, modified)
        p_seq = p  # (Hkv, G, Lq, L)
        if L < N * bs:
            p = torch.nn.functional.pad(p, (0, N * bs - L))
        p = p.reshape(Hkv, G * Lq, N, bs).permute(2, 0, 1, 3)  # (N, Hkv, G*Lq, bs)
        if p.dtype != v_pool.dtype:
            p = p.to(v_pool.dtype)
        if len(rb) == 1:
            ob = torch.matmul(p, v_pool[rb[0][0] : rb[0][0] + N]).sum(0, dtype=acc)  # (Hkv, G*Lq, Dv)
        else:
            o, total = 0, None
            for a, n in rb:
                part = torch.matmul(p[o : o + n], v_pool[a : a + n]).sum(0, dtype=acc)
                total = part if total is None else total + part
                o += n
            ob = cast(Tensor, total)  # (rb holds at least one run: L > 0)
        if not bool(torch.isfinite(ob).all()):  # maybe garbage behind a weight 0 (the unfilled end of the last
            ob = _weigh_seen(p_seq, sc, seq_view(v_pool, rb, L)).to(acc)  # block, hidden keys): weigh again
        outs.append(ob.reshape(Hq, Lq, Dv))
    return torch.stack(outs).to(q.dtype)


def _weigh_seen(p: Tensor, sc: Tensor, v: Tensor) -> Tensor:
    """``p (Hkv, G, Lq, L) @ v (Hkv, L, Dv)`` as ``(Hkv, G*Lq, Dv)``, with the values of the keys that no
    query may see (their scores ``sc`` all ``-inf``) zeroed: a weight 0 still reads its value, and
    ``0 * NaN`` is NaN, so padding garbage would reach the rows."""
    Hkv, G, Lq, L = p.shape
    seen = (sc != float("-inf")).flatten(1, 2).any(1)  # (Hkv, L); a NaN score (a NaN key it sees) counts
    return torch.matmul(p.reshape(Hkv, G * Lq, L).to(v.dtype), zero_unseen(v, seen))


def _pool_layout(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    bias: Tensor | ScoreMod | None,
    mask: Mask | Tensor | None,
    layouts: Callable[[bool], PoolLayout],
) -> PoolLayout | None:
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
    whole = NB + PoolLayout._SPAN_COST + (lay.cost - sum(hi - lo + PoolLayout._SPAN_COST for lo, hi in lay.spans))
    best = min(lay.per_sequence_cost, spans, whole)
    if best == lay.per_sequence_cost:
        return None
    return lay if best == spans else layouts(True)


def _position_only(mask: object, bias: object) -> bool:
    """Whether ``mask`` and ``bias`` (None or built-ins, bottom-right aligned) read nothing but the head and
    the query and key positions, so the pool path can evaluate them per block of each sequence."""
    return (mask is None or (isinstance(mask, Mask) and mask.is_positional("bottom_right"))) and (
        bias is None or (isinstance(bias, ScoreMod) and bias.is_positional("bottom_right"))
    )


def _head_major(pool: Tensor) -> bool:
    """Whether consecutive blocks of one head are adjacent in memory (``PagedCache``'s layout), so a run of
    blocks is a ``(Hkv, positions, D)`` view."""
    NB, H, bs, D = pool.shape
    return (
        pool.stride(3) == 1
        and pool.stride(2) == D
        and (pool.stride(0) == bs * D or NB == 1)
        and (pool.stride(1) == NB * bs * D or H == 1)
    )


def seq_view(pool: Tensor, runs: list[tuple[int, int]], L: int) -> Tensor:
    """A sequence's first ``L`` positions ``(Hkv, L, D)``: a view of a head-major pool for one run of blocks,
    a copy of its runs otherwise."""
    H, bs, D = pool.shape[1:]
    views = [pool[a : a + n].transpose(0, 1).reshape(H, n * bs, D) for a, n in runs]  # views when head-major
    return (views[0] if len(views) == 1 else torch.cat(views, dim=1))[:, :L]


def _attend_views(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    lens: list[int],
    runs: list[list[tuple[int, int]]],
    *,
    scale: float,
    softcap: float | None,
    bias: Tensor | ScoreMod | None,
    mask: Mask | Tensor | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """``_attend_runs`` on a head-major pool: one attention per sequence over ``(Hkv, L, D)`` views of its
    blocks (PyTorch's fused kernel when nothing modifies the scores and heads are not grouped)."""
    B, Hq, Lq, D, Hkv, _, Dv, G = _sizes(q, k_pool, v_pool)
    acc = accumulation_dtype(q.dtype)
    dev = q.device
    modified = bias is not None or mask is not None
    fused = not modified and softcap is None and G == 1 and sinks is None
    rows = _row_index(Hkv, G, Lq, dev) if modified else None
    outs = []
    for b in range(B):
        L = lens[b]
        if L == 0:
            outs.append(q.new_zeros(Hq, Lq, Dv))
            continue
        k, v = seq_view(k_pool, runs[b], L), seq_view(v_pool, runs[b], L)  # (Hkv, L, D), (Hkv, L, Dv)
        if fused:
            outs.append(
                torch.nn.functional.scaled_dot_product_attention(q[b : b + 1], k[None], v[None], scale=scale)[0]
            )
            continue
        sc = torch.matmul(q[b].reshape(Hkv, G * Lq, D), k.transpose(-1, -2)).view(Hkv, G, Lq, L)
        sc = _sequence_scores(sc.to(acc) * scale, b, rows, softcap=softcap, bias=bias, mask=mask)
        p = _softmax(sc, sinks, b, modified)
        o = torch.matmul(p.view(Hkv, G * Lq, L).to(v.dtype), v)  # (Hkv, G*Lq, Dv)
        if modified and not bool(torch.isfinite(o).all()):  # maybe garbage behind a weight 0 (hidden keys)
            o = _weigh_seen(p, sc, v)
        outs.append(o.reshape(Hq, Lq, Dv))
    return torch.stack(outs).to(q.dtype)


class PoolLayout:
    """Which sequence owns each block that a decode step reads, for :func:`_attend_pool`.

    The blocks are read as ``spans`` ``(lo, hi)`` of the pool (the used blocks, gaps shorter than ``_GAP``
    blocks left in: a separate span costs more calls than reading them) followed by ``extra`` blocks that
    are gathered (a block several rows read, e.g. a shared prefix, has its first reader in a span).  Over
    that concatenation ``owner[j]`` is the batch row of entry ``j`` (``B`` for a block no row reads) and
    ``unfilled[j]`` marks its unfilled positions."""

    _GAP = 8  # blocks: a gap this long splits the span
    _SPAN_COST = 6  # blocks' worth of reading that one more span costs (its two products)
    _CALL_COST = 4  # the same for one attention call per sequence

    def __init__(
        self, blocks: list[list[int]], lens: list[int], bs: int, device: torch.device, whole: int | None = None
    ) -> None:
        B = len(blocks)
        used = [row[: -(-n // bs)] for row, n in zip(blocks, lens)]
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
        self._positions: tuple[Tensor, Tensor] | None = None
        # (N, bs): the positions of each entry past its row's length (or in a block no row reads)
        self.unfilled = torch.arange(bs, device=device).view(1, bs) >= torch.tensor(fill, device=device).view(-1, 1)
        ids = [blk for lo, hi in bounds for blk in range(lo, hi)] + [e[0] for e in extra]
        self.block_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (N,): the pool block of each entry
        # what reading the sequences one by one touches, in blocks (a sequence split into several runs of
        # blocks is copied first) plus a cost per call, against the spans read whole
        runs = [block_runs(row) for row in used if row]
        self.rows_read = len(runs)
        self.per_sequence_cost = sum(sum(n for _, n in r) * (1 if len(r) == 1 else 3) + self._CALL_COST for r in runs)
        self.cost = sum(hi - lo + self._SPAN_COST for lo, hi in bounds) + len(extra) * 3

    def positions(self) -> tuple[Tensor, Tensor]:
        """``(query (N, 1, 1, 1), keys (N, 1, 1, bs))`` positions of each entry: its row's newest position
        and the positions its block holds in that row (built once, for masks and biases)."""
        if self._positions is None:
            dev, bs = self.owner.device, self._bs
            lens = torch.tensor(self._lens + [1], dtype=torch.long, device=dev)  # row B: unread blocks
            p = (lens[self.owner] - 1).view(-1, 1, 1, 1)
            k = (
                torch.tensor(self._index, dtype=torch.long, device=dev).view(-1, 1) * bs + torch.arange(bs, device=dev)
            ).view(-1, 1, 1, bs)
            self._positions = (p, k)
        return self._positions


def _attend_pool(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    layout: PoolLayout,
    *,
    scale: float,
    softcap: float | None,
    mask: Mask | None = None,
    bias: Tensor | ScoreMod | None = None,
) -> Tensor:
    """One decode query per sequence against the blocks of some spans of the pool at once.

    Each block's scores come from the query of the row that owns it: one batched matrix product per span
    over its ``(blocks, Hkv)`` pairs (one per kv head on a head-major pool unless the span is all of it),
    reading the keys where they are, however the blocks are scattered; softcap, then a position-only bias
    and mask evaluated at each block's own key positions against its row's newest position; then one
    softmax over each row's blocks (segment max and sums, in float32 for half inputs) and the weighted
    values summed per row.  Unread blocks inside a span cost their bytes but count for nothing (their
    positions are ``-inf``)."""
    B, Hq, _, D, Hkv, bs, Dv, G = _sizes(q, k_pool, v_pool)
    acc = accumulation_dtype(q.dtype)
    dev = q.device
    own = layout.owner
    N = own.shape[0]
    parts = [(k_pool[lo:hi], v_pool[lo:hi]) for lo, hi in layout.spans]
    if layout.extra is not None:
        parts.append((k_pool.index_select(0, layout.extra), v_pool.index_select(0, layout.extra)))

    def products(a: Tensor, pool_part: int, y: int, dtype: torch.dtype) -> Tensor:
        """``a[j] @ part[j]`` for every entry ``j`` (``(N, Hkv, G, x) @ (n, Hkv, x, y)`` per part), written into
        one ``(N, Hkv, G, y)`` tensor without copying the pool (with autograd recording, the parts' products
        are concatenated instead: ``out=`` products have no derivative)."""
        graph = torch.is_grad_enabled() and (a.requires_grad or any(kv[pool_part].requires_grad for kv in parts))
        out = None if graph else torch.empty(N, Hkv, G, y, dtype=dtype, device=dev)
        pieces: list[Tensor] = []
        o = 0
        for kv in parts:
            n = kv[pool_part].shape[0]
            pieces.append(
                part_product(a[o : o + n], kv[pool_part], pool_part, None if graph else cast(Tensor, out)[o : o + n])
            )
            o += n
        return torch.cat(pieces) if graph else cast(Tensor, out)  # (out is None only when graph)

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
    b = h = p = kpos = None
    if mask is not None or bias is not None:  # position-only modifiers: each entry's own positions
        p, kpos = layout.positions()
        b = own.view(-1, 1, 1, 1)
        h = grouped_heads(Hkv, G, dev).view(1, Hkv, G, 1)
    # lengths of 1 and 1: no alignment offset, p is the query's position already
    sc = score_pipeline(sc, b, h, p, kpos, 1, 1, softcap=softcap, bias=bias, mask=mask).to(acc)
    # (masked_fill, not +: a NaN key in an unfilled slot, padding garbage, must give -inf, not NaN)
    sc = sc.masked_fill(layout.unfilled[:, None, None, :], float("-inf"))
    m = torch.full((B + 1, Hkv, G), float("-inf"), dtype=acc, device=dev)
    m.scatter_reduce_(0, own.view(-1, 1, 1).expand(-1, Hkv, G), sc.detach().amax(-1), "amax")  # a shift only
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=acc, device=dev))  # rows reading nothing
    e = torch.exp(sc - m[own].unsqueeze(-1))  # (N, Hkv, G, bs)
    l = torch.zeros(B + 1, Hkv, G, dtype=acc, device=dev).index_add_(0, own, e.sum(-1))[:B]  # noqa: E741 (l: the softmax denominator, as in the papers)
    ob = products(e.to(v_pool.dtype), 1, Dv, v_pool.dtype)  # (N, Hkv, G, Dv)
    # a weight 0 still reads its value (0 * NaN is NaN): the blocks of a row that hold slots it may not see
    # (the unfilled end of its last block, keys its mask hides) are weighed again with those values zeroed
    # (only when that happened: a non-finite value behind a weight 0 makes its entry's product non-finite)
    if not bool(torch.isfinite(ob).all()):
        seen = (sc != float("-inf")).any(2)  # (N, Hkv, bs); a NaN score (a NaN key it sees) counts as seen
        redo = ((~seen).flatten(1).any(1) & (own < B)).nonzero().view(-1)
        if redo.numel():
            vr = zero_unseen(v_pool.index_select(0, layout.block_ids[redo]), seen[redo])  # (n, Hkv, bs, Dv)
            ob[redo] = torch.matmul(e[redo].to(v_pool.dtype), vr)
    o = torch.zeros(B + 1, Hkv, G, Dv, dtype=acc, device=dev).index_add_(0, own, ob.to(acc))[:B]
    out = o / torch.where(l > 0, l, torch.ones((), dtype=acc, device=dev)).unsqueeze(-1)
    return out.reshape(B, Hq, 1, Dv).to(q.dtype)


# ----------------------------------------------------------------------------- prompt chunks (chunked prefill)


def gather_positions(pool: Tensor, runs: list[tuple[int, int]], L: int, out: Tensor) -> Tensor:
    """Copy a sequence's first ``L`` positions ``(Hkv, L, D)`` from the runs of blocks ``runs`` of ``pool``
    (``(num_blocks, Hkv, block_size, D)``) into ``out``, a contiguous ``(Hkv, L, D)`` tensor: one strided
    copy per run (nothing allocated), whatever the pool's layout.  Returns ``out``."""
    H, bs, D = pool.shape[1:]
    o = 0
    for a, n in runs:
        take = min(n * bs, L - o)
        if take <= 0:
            break
        full, rest = divmod(take, bs)
        if full:  # (Hkv, full, bs, D) <- the run's blocks, heads first
            out[:, o : o + full * bs].view(H, full, bs, D).copy_(pool[a : a + full].transpose(0, 1))
        if rest:  # the filled start of the sequence's last block
            out[:, o + full * bs : o + take].copy_(pool[a + full, :, :rest])
        o += take
    return out


def _fused_cpu() -> FusedForward | None:
    """PyTorch's fused CPU flash forward (``(out, lse)``), or None when this build lacks it."""
    from .fused import FUSED

    return None if FUSED is None else FUSED[0]


def takes_chunk(q: Tensor, k: Tensor, v: Tensor, *, mask: object, bias: object, softcap: float | None) -> bool:
    """Whether :func:`attend_chunk` computes a prompt chunk's attention: CPU tensors that autograd does not
    track, values as wide as the keys (the kernel's requirement), no bias or softcap, and no mask or a
    bottom-right causal one."""
    return (
        q.device.type == "cpu"
        and _fused_cpu() is not None
        and bias is None
        and softcap is None
        and v.shape[-1] == k.shape[-1]
        and (mask is None or (isinstance(mask, Mask) and mask.is_causal("bottom_right")))
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
    )


def attend_chunk(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, sinks: Tensor | None = None) -> Tensor:
    """A prompt chunk's ``n`` queries ``q (1, Hq, n, D)`` over its sequence's ``L`` keys ``k (1, Hkv, L, D)``,
    ``v (1, Hkv, L, Dv)`` (the chunk's own keys last), with PyTorch's fused CPU flash kernel (grouped-query
    heads read their shared key head; nothing is repeated).  The tensors may be laid out any way (the kernel's
    entry copies those whose rows are not dense).

    ``causal``: query ``i`` sits at position ``L - n + i`` and sees the keys up to it (bottom-right).  The
    ``L - n`` keys before the chunk are seen by every query: one call with no mask; the chunk's own
    ``n x n`` keys take the kernel's causal mask in a second call; the two are merged by their
    log-sum-exps (no ``n x L`` mask is built or applied).  ``causal=False``: every query sees every key.
    ``sinks``: None or ``(1, Hq)`` logits, one more term in each row's softmax denominator (the output is
    scaled by ``sigmoid(lse - sink)``).  Returns ``(1, Hq, n, Dv)`` in ``q``'s dtype."""
    fwd = cast("FusedForward", _fused_cpu())  # (takes_chunk checked that this build has it)
    n, L = q.shape[2], k.shape[2]
    s = L - n
    acc = accumulation_dtype(q.dtype)
    if not causal or s == 0:
        o, lse = fwd(q, k, v, 0.0, causal, scale=scale)
        if sinks is None:
            return o
        return (o.to(acc) * _sink_weight(lse, sinks).to(acc)).to(q.dtype)
    o1, l1 = fwd(q, k[:, :, :s], v[:, :, :s], 0.0, False, scale=scale)  # the keys before the chunk: all seen
    o2, l2 = fwd(q, k[:, :, s:], v[:, :, s:], 0.0, True, scale=scale)  # the chunk's own keys: causal
    lse = torch.logaddexp(l1, l2)  # (1, Hq, n); every row sees its own key: finite
    w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)  # (1, Hq, n, 1)
    if sinks is not None:
        sunk = _sink_weight(lse, sinks)
        w1, w2 = w1 * sunk, w2 * sunk
    return (o1.to(acc) * w1.to(acc) + o2.to(acc) * w2.to(acc)).to(q.dtype)


def _sink_weight(lse: Tensor, sinks: Tensor) -> Tensor:
    """``(1, Hq, n, 1)``: the share of each row's softmax its keys keep once the sink logit ``sinks (1, Hq)``
    joins the denominator, ``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``."""
    return torch.sigmoid(lse - sinks.to(lse.dtype)[..., None]).unsqueeze(-1)
