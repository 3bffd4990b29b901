"""``attention_varlen()``: packed variable-length sequences, without padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import masks as _masks
from .backends import _flash_varlen
from .backends import flash as _flash
from .backends import select as _select
from .backends import sdpa as _sdpa
from .backends._call import _make_call
from .backends._common import Call
from .bias import ScoreMod
from .functional import attention

Tensor = torch.Tensor

__all__ = ["attention_varlen"]

OWN_CALL_MIN = 128  # per-sequence path: sequences with at least this many queries and keys run as their own call
MAX_OWN_CALLS = 64  # ... beyond this many such sequences, all run as one packed call (Python per call would dominate)
COPY_FLOPS = 25.0  # flop-equivalents of the fused kernel per element a copy or zero-fill writes (fresh memory)


# ------------------------------------------------------------------- input checks


def _check_packed(q, k, v) -> None:
    for name, t, layout in (("q", q, "(Tq, Hq, D)"), ("k", k, "(Tk, Hkv, D)"), ("v", v, "(Tk, Hkv, Dv)")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"attention_varlen: {name} must have 3 dims {layout} (the sequences packed along the "
                             f"first), got shape {tuple(t.shape)}; for (B, H, L, D) tensors use attention()")


def _check_cu(name: str, cu, total: int, what: str, device: torch.device) -> Tensor:
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be an int32 tensor of n + 1 prefix sums [0, L0, L0 + L1, ...], got "
                        f"{type(cu).__name__}: pass torch.tensor(..., dtype=torch.int32)")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (as flash_attn_varlen_func takes), got {cu.dtype}: "
                        f"pass {name}.to(torch.int32)")
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(f"{name} must be 1-D with n + 1 entries (0 first), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}: move it with {name}.to(q.device)")
    first, last = int(cu[0]), int(cu[-1])
    if first != 0:
        raise ValueError(f"{name}[0]={first} must be 0: {name} holds prefix sums of the lengths, [0, L0, L0 + L1, "
                         f"...] (torch.nn.functional.pad(lengths.cumsum(0), (1, 0)))")
    steps = cu.diff()
    if bool((steps < 0).any()):
        i = int((steps < 0).nonzero()[0, 0])
        raise ValueError(f"{name} must not decrease (zero-length sequences repeat an entry), got {name}[{i}]="
                         f"{int(cu[i])} > {name}[{i + 1}]={int(cu[i + 1])}")
    if last != total:
        raise ValueError(f"{name}[-1]={last} must equal the number of packed {what}, {total}: the last prefix "
                         f"sum is the total length")
    return cu


def _check_max(name: str, value, cu: Tensor, cu_name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {value!r}")
    longest = int(cu.diff().max()) if cu.numel() > 1 else 0
    if value < longest:
        raise ValueError(f"{name}={value} is smaller than the longest sequence in {cu_name} ({longest}): pass "
                         f"int({cu_name}.diff().max()), or None")


def _check_varlen_bias(bias, hq: int, tq: int, tk: int):
    if bias is None:
        return None
    if isinstance(bias, ScoreMod) or (callable(bias) and not isinstance(bias, Tensor)):
        raise TypeError("attention_varlen: bias modifiers (alibi, relative_buckets, from_fn) read positions of "
                        "one (Lq, Lk) matrix, not of each packed sequence; pass a float tensor broadcastable to "
                        f"(Hq, Tq, Tk)=({hq}, {tq}, {tk}) in packed coordinates, or call attention() per sequence")
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be None or a float tensor broadcastable to (Hq, Tq, Tk), got "
                        f"{type(bias).__name__}")
    if bias.dim() > 3:
        raise ValueError(f"attention_varlen: bias must broadcast to (Hq, Tq, Tk)=({hq}, {tq}, {tk}), got shape "
                         f"{tuple(bias.shape)}")
    return bias[None]  # (1, Hq|1, Tq|1, Tk|1); attention() checks the rest


def _split(result) -> tuple[Tensor, Tensor | None]:
    """(out (1, H, L, Dv), lse (H, L) or None) from attention()'s result."""
    return (result[0], result[1][0]) if isinstance(result, tuple) else (result, None)


def _validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias):
    """The checked ``(cu_q, cu_k, bias (1, Hq|1, Tq|1, Tk|1) or None)`` of an ``attention_varlen`` call."""
    _check_packed(q, k, v)
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], "queries (q.shape[0])", q.device)
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], "keys (k.shape[0])", q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_q.numel()} entries and cu_seqlens_k {cu_k.numel()}: both need "
                         f"n + 1 entries for the same n sequences")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must pack the same keys, got Tk={k.shape[0]} for k and {v.shape[0]} for v")
    _check_max("max_seqlen_q", max_seqlen_q, cu_q, "cu_seqlens_q")
    _check_max("max_seqlen_k", max_seqlen_k, cu_k, "cu_seqlens_k")
    if mask is not None and not isinstance(mask, _masks.Mask):
        raise TypeError(f"attention_varlen: mask must be None or an attnkit.masks.Mask applied within each "
                        f"sequence (e.g. masks.causal()), got {type(mask).__name__}")
    if mask is not None:
        _masks.varlen(cu_q[:1], cu_k[:1], mask)  # (checks that the mask applies per sequence)
    bias = _check_varlen_bias(bias, q.shape[1], q.shape[0], k.shape[0])
    return cu_q, cu_k, bias


# ------------------------------------------------------------------- the two paths


def _alone(lq: list[int], lk: list[int], bias) -> list[int]:
    """The per-sequence path's sequences that run as their own ``attention()`` call."""
    alone = [s for s in range(len(lq)) if min(lq[s], lk[s]) >= OWN_CALL_MIN]
    return [] if bias is not None or len(alone) > MAX_OWN_CALLS else alone


@dataclass
class _Choice:
    batched: bool  # one batched flash call (``_flash_varlen``), else the per-sequence path
    reason: str
    scale: float | None = None
    segments: list | None = None  # the batched call's planned segments
    costs: tuple[float, float] | None = None  # (batched, per-sequence) estimates, when weighed


def _refusal(q: Tensor, bias, backend: str) -> str | None:
    """Why the batched flash call cannot take this call (None when it can)."""
    if backend not in ("auto", "flash"):
        return f"backend={backend!r} was asked for"
    if bias is not None:
        return "a bias tensor in packed coordinates goes with one packed call under masks.varlen"
    if torch.compiler.is_compiling():
        return "while torch.compile traces, the flash custom operators take one packed call"
    if q.device.type == "meta" or torch._C._functorch.is_functorch_wrapped_tensor(q):
        return "meta tensors and torch.func transforms take the per-sequence path (through attention())"
    if q.shape[0] == 0:
        return "there are no queries"
    return None


def _seq_call(q, k, v, a, b, c, d, mask, scale, softcap, dropout_p) -> Call:
    return _make_call(*(t.transpose(0, 1)[None] for t in (q[a:b], k[c:d], v[c:d])), mask=mask, scale=scale,
                      softcap=softcap, dropout_p=dropout_p)


def _costs(q, k, v, cu_q: list[int], cu_k: list[int], segs, mask, scale, softcap, dropout_p,
           needs_grad: bool) -> tuple[float, float]:
    """Estimated cost (flop-equivalents) of the batched call and of the per-sequence path.

    Kernels: a batched segment computed by one fused kernel call costs what ``sdpa`` would (the same kernel),
    a tiled one what the ``flash`` backend estimates; on the per-sequence path a sequence run alone costs what
    ``auto`` picks for it (the same figure when that is the same kernel), and the packed rest the same as its
    batched segments.  Copies (``COPY_FLOPS`` per element written): the batched call writes the output (and
    the gradients) once and lays out its tiled segments' tokens head first; the per-sequence path copies q, k,
    v head first, assembles the output by an index sort and, with gradients, fills a zero gradient of each
    packed tensor for every sequence run alone (the backward of a slice)."""
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    lq, lk = [b - a for a, b in zip(cu_q, cu_q[1:])], [b - a for a, b in zip(cu_k, cu_k[1:])]
    alone = set(_alone(lq, lk, None))
    tokens = q.shape[0] * hq * d + k.shape[0] * hkv * (d + dv)  # elements of q, k, v (and of their gradients)
    outs = q.shape[0] * hq * dv
    st = _flash_varlen.settings(q, scale, softcap, dropout_p)
    passes = 2 if needs_grad else 1  # tiled segments are laid out again in the backward (with out and dout)
    batched_copies = outs + (tokens if needs_grad else 0)
    per_seq_copies = outs + (tokens if needs_grad else 0)
    if alone:
        per_seq_copies = tokens + 3 * outs + (2 * len(alone) * tokens + 3 * outs if needs_grad else 0)
    batched = per_seq = 0.0
    for seg in segs:
        call = _flash_varlen._call(seg, q, k, v, st)
        kernel = _sdpa.cost(call) if seg.direct else _flash.cost(call)
        batched += kernel
        if not seg.direct:
            batched_copies += passes * (seg.lq * hq * (d + (2 * dv if needs_grad else 0)) + seg.lk * hkv * (d + dv))
        s = cu_q.index(seg.qa) if seg.own else -1
        if s in alone and not seg.direct:  # what auto picks for it alone
            call = _seq_call(q, k, v, seg.qa, seg.qb, seg.ka, seg.kb, mask, scale, softcap, dropout_p)
            kernel = _select(call, "auto").cost(call)
        per_seq += kernel  # (a sequence alone on the same kernel, or the packed rest: as batched)
    return batched + COPY_FLOPS * batched_copies, per_seq + COPY_FLOPS * per_seq_copies


def _choose(q, k, v, cu_q: Tensor, cu_k: Tensor, mask, bias, scale, softcap, dropout_p, backend) -> _Choice:
    """Batched flash call or per-sequence path (see :func:`attention_varlen`)."""
    why_not = _refusal(q, bias, backend)
    if why_not is not None:
        return _Choice(False, why_not)
    call = _make_call(*(t.transpose(0, 1)[None] for t in (q, k, v)), scale=scale, softcap=softcap,
                      dropout_p=dropout_p)  # checks the tensors and settings
    needs_grad = call.needs_grad
    cq, ck = cu_q.tolist(), cu_k.tolist()
    st = _flash_varlen.settings(q, call.scale, softcap, dropout_p)
    seed = _flash_varlen.ops.draw_seed() if dropout_p > 0 else 0
    segs = _flash_varlen.segments(q, k, v, cq, ck, mask, st, seed, needs_grad)
    if backend == "flash":
        return _Choice(True, "backend='flash' was asked for", call.scale, segs)
    batched, per_seq = _costs(q, k, v, cq, ck, segs, mask, call.scale, softcap, dropout_p, needs_grad)
    if batched <= per_seq:
        return _Choice(True, "the cheaper estimate", call.scale, segs, (batched, per_seq))
    return _Choice(False, "the cheaper estimate", call.scale, None, (batched, per_seq))


# ---------------------------------------------------------------------- public API


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, mask=None, bias=None,
                     scale: float | None = None, softcap: float | None = None, dropout_p: float = 0.0,
                     return_lse: bool = False, backend: str = "auto"):
    """Attention over packed variable-length sequences: each sequence attends only within itself.

    Args:
        q: ``(Tq, Hq, D)`` the queries of ``n`` sequences packed along the first axis (no padding).
        k: ``(Tk, Hkv, D)`` keys; ``Hq`` a multiple of ``Hkv`` (grouped-query attention).
        v: ``(Tk, Hkv, Dv)`` values.
        cu_seqlens_q: ``(n + 1,)`` int32 prefix sums of the query lengths, ``[0, Lq_0, Lq_0 + Lq_1, ..., Tq]``:
            sequence ``s`` owns rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``.  Zero-length sequences repeat an
            entry.  On q's device.
        cu_seqlens_k: ``(n + 1,)`` int32, the same for the keys (``Lk_s`` may differ from ``Lq_s``).
        max_seqlen_q, max_seqlen_k: the longest sequence (``flash_attn_varlen_func``'s hints); checked when
            given (never smaller than the longest), otherwise unused.
        mask: ``None`` (every query sees all keys of its sequence) or an :class:`attnkit.masks.Mask` applied
            within each sequence with that sequence's positions: ``causal``, ``sliding_window``, ``prefix_lm``,
            ``block_local``, ``strided``, ``dilated``, ``global_tokens``, ``from_fn`` (it gets local rows and
            keys) and their ``&``, ``|``, ``~``.  See :func:`attnkit.masks.varlen`.
        bias: ``None`` or a float tensor broadcastable to ``(Hq, Tq, Tk)`` in packed coordinates.
        scale, softcap, dropout_p, backend: as for :func:`attnkit.attention`.
        return_lse: also return the log-sum-exp ``(Hq, Tq)`` (float32; float64 for float64 inputs), the layout
            of ``flash_attn_varlen_func``'s ``softmax_lse``.

    Returns:
        ``out (Tq, Hq, Dv)``; with ``return_lse``, ``(out, lse (Hq, Tq))``.

    Positions are each sequence's own: with the default bottom-right alignment, local query row ``i`` of
    sequence ``s`` sits at position ``i + Lk_s - Lq_s`` (as ``flash_attn_varlen_func`` aligns causal), and
    ``align="top_left"`` puts it at ``i``, relative to the sequence's start.  Two sequences, causal::

        cu_seqlens_q = [0, 2, 5], cu_seqlens_k = [0, 3, 5]
              k: 0 1 2 | 3 4
        q0       █ █ · | · ·
        q1       █ █ █ | · ·
        q2       · · · | · ·    <- Lq_1 = 3 > Lk_1 = 2: the first row sees nothing (output 0, lse -inf)
        q3       · · · | █ ·
        q4       · · · | █ █

    A row that may attend to nothing (also every row of a sequence with no keys) gives 0, ``lse = -inf``
    and zero gradients.  Nothing is padded to ``(n, max_len)``; the work follows the real tokens, in one of
    two ways:

    * **one batched flash call** (``backend="flash"``, and ``auto``'s usual choice): each sequence with at
      least 64 queries and keys gets tiles of its own, starting at its first query and key (no tile
      straddles two sequences; its last tile is short).  On CPU, with no mask or a causal mask on
      ``Lq_s == Lk_s``, PyTorch's fused flash kernel computes it in one call on strided views of the packed
      tensors, skipping the masked tiles; other masks run the flash backend's tile plan of the sequence's
      own mask.  Consecutive shorter sequences share one call under :func:`attnkit.masks.varlen`.  Outputs
      and gradients are written once into the packed tensors; the backward recomputes each sequence's tiles;
    * **the per-sequence path** (any other ``backend``, a ``bias``, while ``torch.compile`` traces): each
      sequence with at least ``OWN_CALL_MIN`` (128) queries and keys runs as its own
      :func:`attnkit.attention` call on views of the packed tensors (up to ``MAX_OWN_CALLS``), and the
      others share one call under :func:`attnkit.masks.varlen`, whose block structure lets the ``flash``
      and ``triton`` backends visit only each sequence's tiles.

    ``auto`` takes the cheaper of the two by a cost estimate: the kernels' (a sequence on the fused kernel
    costs what ``sdpa`` would, a tiled one what ``flash`` estimates, a sequence run alone what ``auto`` picks
    for it) plus the copies each way writes.  Long sequences with dropout, or off the CPU, usually go to
    the per-sequence path, where ``sdpa`` computes them fused.  ``attnkit.backends.explain(q, k, v,
    cu_seqlens_q=..., cu_seqlens_k=..., ...)`` says which and why.  Gradients flow through both.

    Example::

        >>> import torch, attnkit
        >>> lengths = torch.tensor([3, 0, 5])
        >>> cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # [0, 3, 3, 8]
        >>> q = torch.randn(8, 4, 16); k = v = torch.randn(8, 2, 16)
        >>> out = attnkit.attention_varlen(q, k, v, cu, cu, mask=attnkit.masks.causal())
        >>> out.shape
        torch.Size([8, 4, 16])
        >>> one = attnkit.attention(q[3:].transpose(0, 1)[None], k[3:].transpose(0, 1)[None],
        ...                         v[3:].transpose(0, 1)[None], mask=attnkit.masks.causal())
        >>> torch.allclose(out[3:], one[0].transpose(0, 1), atol=1e-6)
        True
    """
    cu_q, cu_k, bias = _validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias)
    lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
    choice = _choose(q, k, v, cu_q, cu_k, mask, bias, scale, softcap, dropout_p, backend)
    if choice.batched:
        out, lse = _flash_varlen.attention(q, k, v, cu_q.tolist(), cu_k.tolist(), mask, choice.scale, softcap,
                                           dropout_p, choice.segments)
        return (out, lse) if return_lse else out
    kw = dict(mask=mask, scale=scale, softcap=softcap, dropout_p=dropout_p, return_lse=return_lse,
              backend=backend)
    starts_q, starts_k = cu_q[:-1].tolist(), cu_k[:-1].tolist()
    alone = _alone(lq, lk, bias)
    packed = [s for s in range(len(lq)) if s not in set(alone) and lq[s] > 0]
    outs, lses, rows = [], [], []
    if alone:  # heads first, once: a sequence's (1, H, L, D) slice is then a view with contiguous rows
        qh, kh, vh = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # (H, T, D)
    for s in alone:  # a long sequence: its own call, tiles aligned with its start (views, no copies)
        a, b, c, d = starts_q[s], starts_q[s] + lq[s], starts_k[s], starts_k[s] + lk[s]
        o, lse = _split(attention(qh[None, :, a:b], kh[None, :, c:d], vh[None, :, c:d], **kw))  # (1, H, L, D)
        outs.append(o[0].transpose(0, 1))  # (Lq_s, Hq, Dv)
        lses.append(lse)  # (Hq, Lq_s) or None
        rows.append(torch.arange(a, b, device=q.device))
    if packed:  # the others: one call on their packed tokens under masks.varlen
        if len(packed) == len(lq):
            qp, kp, vp, rq = q, k, v, None
            cq, ck = cu_q, cu_k
        else:
            rq = torch.cat([torch.arange(starts_q[s], starts_q[s] + lq[s]) for s in packed]).to(q.device)
            rk = torch.cat([torch.arange(starts_k[s], starts_k[s] + lk[s]) for s in packed]).to(q.device)
            qp, kp, vp = q[rq], k[rk], v[rk]
            cq = torch.tensor([0] + [lq[s] for s in packed], device=q.device).cumsum(0)
            ck = torch.tensor([0] + [lk[s] for s in packed], device=q.device).cumsum(0)
        o, lse = _split(attention(*(t.transpose(0, 1)[None] for t in (qp, kp, vp)), **{
            **kw, "mask": _masks.varlen(cq, ck, mask), "bias": bias}))  # (1, H, T, D) views
        outs.append(o[0].transpose(0, 1))
        lses.append(lse)
        rows.append(torch.arange(q.shape[0], device=q.device) if rq is None else rq)
    if not outs:  # no queries at all
        out, lse = _split(attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), **kw))
        out = out[0].transpose(0, 1)
    elif len(outs) == 1 and rows[0].numel() == q.shape[0] and len(alone) == 0:
        out, lse = outs[0], lses[0]
    else:
        order = torch.cat(rows).argsort()  # the packed order back
        out = torch.cat(outs)[order]
        lse = torch.cat(lses, dim=1)[:, order] if return_lse else None
    out = out.contiguous()  # (Tq, Hq, Dv)
    return (out, lse) if return_lse else out


def explain(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *, max_seqlen_q=None,
            max_seqlen_k=None, mask=None, bias=None, scale=None, softcap=None, dropout_p: float = 0.0,
            return_lse: bool = False, backend: str = "auto") -> str:
    """How :func:`attention_varlen` would compute this call (``backends.explain`` with ``cu_seqlens_q`` and
    ``cu_seqlens_k``): the batched flash call or the per-sequence path, why, and the segments or calls."""
    cu_q, cu_k, bias = _validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias)
    choice = _choose(q, k, v, cu_q, cu_k, mask, bias, scale, softcap, dropout_p, backend)
    n = cu_q.numel() - 1
    head = f"attention_varlen on {n} sequences, q {tuple(q.shape)} {str(q.dtype).replace('torch.', '')}"
    lines = []
    if choice.batched:
        segs = choice.segments
        own = [s for s in segs if s.own]
        direct = sum(s.direct for s in own)
        lines.append(f"{head}: one batched flash call ({choice.reason})")
        lines.append(f"  {len(own)} sequences of >= {_flash_varlen.OWN_TILES_MIN} queries and keys with tiles of "
                     f"their own: {direct} as one fused kernel call each on views of the packed tensors, "
                     f"{len(own) - direct} by their mask's tile plan")
        lines.append(f"  runs of shorter sequences, each one call under masks.varlen: {len(segs) - len(own)}")
    else:
        lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
        alone = _alone(lq, lk, bias)
        lines.append(f"{head}: the per-sequence path ({choice.reason})")
        lines.append(f"  {len(alone)} sequences of >= {OWN_CALL_MIN} queries and keys as their own attention() "
                     f"call (backend={backend!r}), the others as one packed call under masks.varlen")
    if choice.costs is not None:
        lines.append(f"  estimated cost: batched {choice.costs[0] / 1e9:.3g}, per-sequence "
                     f"{choice.costs[1] / 1e9:.3g} GFLOP-equivalents")
    return "\n".join(lines)
