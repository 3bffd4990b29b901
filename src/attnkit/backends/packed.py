"""``attention_varlen``'s input checks and its choice between one batched flash call (``flash.varlen_attention``) and
the per-sequence path (``attention()`` calls), by a cost estimate; ``backends.explain`` reads it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, cast

import torch

from .. import masks as _masks
from .._checks import holds, integer
from ..bias import ScoreMod
from . import flash as _flash
from . import sdpa as _sdpa
from .call import Call, check_sinks, make_call

Tensor = torch.Tensor

OWN_CALL_MIN = 128  # per-sequence path: sequences with at least this many queries and keys run as their own call
MAX_OWN_CALLS = 64  # ... beyond this many such sequences, all run as one packed call (Python per call would dominate)
COPY_FLOPS = 25.0  # flop-equivalents of the fused kernel per element a copy or zero-fill writes (fresh memory)


class _Costed(Protocol):
    """What ``select`` returns (a registered ``Backend``), as far as the estimate reads it."""

    @property
    def cost(self) -> Callable[[Call], float]: ...


# the backend registry's ``select(call, backend)`` (passed in: this module cannot import the registry)
_Select = Callable[[Call, str], _Costed]


# ------------------------------------------------------------------- input checks


def _check_packed(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t, layout in (("q", q, "(Tq, Hq, D)"), ("k", k, "(Tk, Hkv, D)"), ("v", v, "(Tk, Hkv, Dv)")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"attention_varlen: {name} must have 3 dims {layout} (the sequences packed along the "
                f"first), got shape {tuple(t.shape)}; for (B, H, L, D) tensors use attention()"
            )


def _check_cu(name: str, cu: object, total: int, what: str, device: torch.device) -> Tensor:
    if not isinstance(cu, Tensor):
        raise TypeError(
            f"{name} must be an int32 tensor of n + 1 prefix sums [0, L0, L0 + L1, ...], got "
            f"{type(cu).__name__}: pass torch.tensor(..., dtype=torch.int32)"
        )
    if cu.dtype != torch.int32:
        raise TypeError(
            f"{name} must have dtype torch.int32 (as flash_attn_varlen_func takes), got {cu.dtype}: "
            f"pass {name}.to(torch.int32)"
        )
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(f"{name} must be 1-D with n + 1 entries (0 first), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}: move it with {name}.to(q.device)")
    # (while traced, each check is an assertion in the graph: holds)
    if not holds(cu[0] == 0, f"{name}[0] must be 0: {name} holds prefix sums of the lengths"):
        raise ValueError(
            f"{name}[0]={int(cu[0])} must be 0: {name} holds prefix sums of the lengths, [0, L0, L0 + "
            f"L1, ...] (torch.nn.functional.pad(lengths.cumsum(0), (1, 0)))"
        )
    steps = cu.diff()
    if not holds((steps >= 0).all(), f"{name} must not decrease (zero-length sequences repeat an entry)"):
        i = int((steps < 0).nonzero()[0, 0])
        raise ValueError(
            f"{name} must not decrease (zero-length sequences repeat an entry), got {name}[{i}]="
            f"{int(cu[i])} > {name}[{i + 1}]={int(cu[i + 1])}"
        )
    if not holds(cu[-1] == total, f"{name}[-1] must equal the number of packed {what}, {total}"):
        raise ValueError(
            f"{name}[-1]={int(cu[-1])} must equal the number of packed {what}, {total}: the last "
            f"prefix sum is the total length"
        )
    return cu


def _check_max(name: str, value: int | None, cu: Tensor, cu_name: str) -> None:
    if value is None:
        return
    integer(name, value, allow_none=True)
    if cu.numel() > 1 and not holds(
        (cu.diff() <= value).all(), f"{name}={value} is smaller than the longest sequence in {cu_name}"
    ):
        longest = int(cu.diff().max())
        raise ValueError(
            f"{name}={value} is smaller than the longest sequence in {cu_name} ({longest}): pass "
            f"int({cu_name}.diff().max()), or None"
        )


def _check_varlen_bias(bias: object, hq: int, tq: int, tk: int) -> Tensor | None:
    if bias is None:
        return None
    if isinstance(bias, ScoreMod) or (callable(bias) and not isinstance(bias, Tensor)):
        raise TypeError(
            "attention_varlen: bias modifiers (alibi, relative_buckets, from_fn) read positions of "
            "one (Lq, Lk) matrix, not of each packed sequence; pass a float tensor broadcastable to "
            f"(Hq, Tq, Tk)=({hq}, {tq}, {tk}) in packed coordinates, or call attention() per sequence"
        )
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be None or a float tensor broadcastable to (Hq, Tq, Tk), got {type(bias).__name__}")
    if bias.dim() > 3:
        raise ValueError(
            f"attention_varlen: bias must broadcast to (Hq, Tq, Tk)=({hq}, {tq}, {tk}), got shape {tuple(bias.shape)}"
        )
    return bias[None]  # (1, Hq|1, Tq|1, Tk|1); attention() checks the rest


def _check_varlen_sinks(sinks: object, q: Tensor, n: int) -> Tensor | None:
    """``sinks`` as an ``(Hq,)`` view (expanded, so its gradient reaches the caller's tensor), or None."""
    if sinks is None:
        return None
    hq = q.shape[1]
    if isinstance(sinks, Tensor) and sinks.dim() > 1:
        raise ValueError(
            f"attention_varlen: sinks must be one logit per query head shared by every packed "
            f"sequence, shape (Hq,)=({hq},), got shape {tuple(sinks.shape)}; for sinks that differ "
            f"between the {n} sequences, call attnkit.attention() on each sequence"
        )
    if isinstance(sinks, Tensor) and sinks.dim() == 1 and sinks.shape[0] not in (1, hq):
        raise ValueError(
            f"attention_varlen: sinks of shape {tuple(sinks.shape)} does not match the {hq} query "
            f"heads of q {tuple(q.shape)}: give one logit per query head, shape ({hq},)"
        )
    # (not None: check_sinks returns None only for None)
    return cast(Tensor, check_sinks(sinks, q[None].transpose(1, 2)))[
        0
    ]  # (1, Hq, Tq, D) view: the (1, Hq) check -> (Hq,)


def validated(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    mask: _masks.Mask | None,
    bias: object,
    sinks: object = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The checked ``(cu_q, cu_k, bias (1, Hq|1, Tq|1, Tk|1) or None, sinks (Hq,) or None)`` of an
    ``attention_varlen`` call."""
    _check_packed(q, k, v)
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], "queries (q.shape[0])", q.device)
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], "keys (k.shape[0])", q.device)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel()} entries and cu_seqlens_k {cu_k.numel()}: both need "
            f"n + 1 entries for the same n sequences"
        )
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must pack the same keys, got Tk={k.shape[0]} for k and {v.shape[0]} for v")
    _check_max("max_seqlen_q", max_seqlen_q, cu_q, "cu_seqlens_q")
    _check_max("max_seqlen_k", max_seqlen_k, cu_k, "cu_seqlens_k")
    if mask is not None and not isinstance(mask, _masks.Mask):
        raise TypeError(
            f"attention_varlen: mask must be None or an attnkit.masks.Mask applied within each "
            f"sequence (e.g. masks.causal()), got {type(mask).__name__}"
        )
    if mask is not None:
        _masks._check_per_sequence(mask, "attention_varlen")
    bias = _check_varlen_bias(bias, q.shape[1], q.shape[0], k.shape[0])
    sinks = _check_varlen_sinks(sinks, q, cu_q.numel() - 1)
    return cu_q, cu_k, bias, sinks


# ------------------------------------------------------------------- the two paths


def alone(lq: list[int], lk: list[int], bias: object) -> list[int]:
    """The per-sequence path's sequences that run as their own ``attention()`` call."""
    seqs = [s for s in range(len(lq)) if min(lq[s], lk[s]) >= OWN_CALL_MIN]
    return [] if bias is not None or len(seqs) > MAX_OWN_CALLS else seqs


@dataclass
class _Choice:
    batched: bool  # one batched flash call (``flash.varlen_attention``), else the per-sequence path
    reason: str
    scale: float | None = None
    # the batched call's planned segments (flash's varlen ``Segment``s, a type flash does not export)
    segments: list[Any] | None = None
    costs: tuple[float, float] | None = None  # (batched, per-sequence) estimates, when weighed


def _refusal(q: Tensor, bias: object, backend: str) -> str | None:
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


def _seq_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: int,
    b: int,
    c: int,
    d: int,
    mask: _masks.Mask | None,
    scale: float | None,
    softcap: float | None,
    dropout_p: float,
    sinks: Tensor | None = None,
) -> Call:
    return make_call(
        *(t.transpose(0, 1)[None] for t in (q[a:b], k[c:d], v[c:d])),
        mask=mask,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        sinks=sinks,
    )


def _costs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: list[int],
    cu_k: list[int],
    segs: list[Any],
    mask: _masks.Mask | None,
    scale: float,
    softcap: float | None,
    dropout_p: float,
    needs_grad: bool,
    select: _Select,
    sinks: Tensor | None = None,
) -> tuple[float, float]:
    """Estimated cost (flop-equivalents) of the batched call and of the per-sequence path.

    Kernels: a batched segment computed by one fused kernel call costs what ``sdpa`` would (the same kernel),
    a tiled one what the ``flash`` backend estimates; on the per-sequence path a sequence run alone costs what
    ``auto`` picks for it (the same figure when that is the same kernel), and the packed rest the same as its
    batched segments.  Copies (``COPY_FLOPS`` per element written): the batched call writes the output (and
    the gradients) once and lays out its tiled segments' tokens head first; the per-sequence path copies q, k,
    v head first, assembles the output by an index sort and, with gradients, fills a zero gradient of each
    packed tensor for every sequence run alone (the backward of a slice).  Sinks: the batched call scales each
    piece in place (no fresh memory), ``attention()`` writes its output once more; with gradients, segments off
    the fused kernel make both ways write the output gradient of the sink-free result once; a sequence run
    alone costs what ``auto`` picks with the sinks."""
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    lq, lk = [b - a for a, b in zip(cu_q, cu_q[1:])], [b - a for a, b in zip(cu_k, cu_k[1:])]
    solo = set(alone(lq, lk, None))
    tokens = q.shape[0] * hq * d + k.shape[0] * hkv * (d + dv)  # elements of q, k, v (and of their gradients)
    outs = q.shape[0] * hq * dv
    st = _flash.varlen_settings(q, scale, softcap, dropout_p)
    passes = 2 if needs_grad else 1  # tiled segments are laid out again in the backward (with out and dout)
    batched_copies = outs + (tokens if needs_grad else 0)
    per_seq_copies = outs + (tokens if needs_grad else 0)
    if solo:
        per_seq_copies = tokens + 3 * outs + (2 * len(solo) * tokens + 3 * outs if needs_grad else 0)
    if sinks is not None:
        sink_grads = outs if needs_grad and not all(seg.fused for seg in segs) else 0
        batched_copies += sink_grads
        per_seq_copies += outs + sink_grads
    batched = per_seq = 0.0
    for seg in segs:
        call = _flash.segment_call(seg, q, k, v, st)
        kernel = _sdpa.cost(call) if seg.direct else _flash.cost(call)
        batched += kernel
        if not seg.direct:
            batched_copies += passes * (seg.lq * hq * (d + (2 * dv if needs_grad else 0)) + seg.lk * hkv * (d + dv))
        s = cu_q.index(seg.qa) if seg.own else -1
        if s in solo and not seg.direct:  # what auto picks for it alone
            call = _seq_call(q, k, v, seg.qa, seg.qb, seg.ka, seg.kb, mask, scale, softcap, dropout_p, sinks)
            kernel = select(call, "auto").cost(call)
        per_seq += kernel  # (a sequence alone on the same kernel, or the packed rest: as batched)
    return batched + COPY_FLOPS * batched_copies, per_seq + COPY_FLOPS * per_seq_copies


def choose(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    mask: _masks.Mask | None,
    bias: Tensor | None,
    scale: float | None,
    softcap: float | None,
    dropout_p: float,
    backend: str,
    select: _Select,
    sinks: Tensor | None = None,
) -> _Choice:
    """Batched flash call or per-sequence path (see :func:`attnkit.attention_varlen`); ``select`` is the
    backend registry's ``select`` (what ``auto`` picks for a sequence run alone); ``sinks (Hq,)`` or None."""
    why_not = _refusal(q, bias, backend)
    if why_not is not None:
        return _Choice(False, why_not)
    call = make_call(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), scale=scale, softcap=softcap, dropout_p=dropout_p, sinks=sinks
    )  # checks the tensors and settings
    needs_grad = call.needs_grad
    cq, ck = cu_q.tolist(), cu_k.tolist()
    st = _flash.varlen_settings(q, call.scale, softcap, dropout_p)
    seed = _flash.draw_seed() if dropout_p > 0 else 0
    segs = _flash.varlen_segments(q, k, v, cq, ck, mask, st, seed, needs_grad)
    if backend == "flash":
        return _Choice(True, "backend='flash' was asked for", call.scale, segs)
    batched, per_seq = _costs(q, k, v, cq, ck, segs, mask, call.scale, softcap, dropout_p, needs_grad, select, sinks)
    if batched <= per_seq:
        return _Choice(True, "the cheaper estimate", call.scale, segs, (batched, per_seq))
    return _Choice(False, "the cheaper estimate", call.scale, None, (batched, per_seq))


def explain(
    select: _Select,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    mask: _masks.Mask | None = None,
    bias: object = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: object = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
) -> str:
    """How :func:`attnkit.attention_varlen` would compute this call (``backends.explain`` with ``cu_seqlens_q`` and
    ``cu_seqlens_k``): the batched flash call or the per-sequence path, why, the segments or calls, and where
    the sinks (if any) enter."""
    cu_q, cu_k, bias, sinks = validated(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias, sinks
    )
    choice = choose(q, k, v, cu_q, cu_k, mask, bias, scale, softcap, dropout_p, backend, select, sinks)
    n = cu_q.numel() - 1
    head = f"attention_varlen on {n} sequences, q {tuple(q.shape)} {str(q.dtype).replace('torch.', '')}"
    lines = []
    if choice.batched:
        segs = cast("list[Any]", choice.segments)  # (planned for a batched call)
        own = [s for s in segs if s.own]
        direct = sum(s.direct for s in own)
        lines.append(f"{head}: one batched flash call ({choice.reason})")
        lines.append(
            f"  {len(own)} sequences of >= {_flash.OWN_TILES_MIN} queries and keys with tiles of "
            f"their own: {direct} as one fused kernel call each on views of the packed tensors, "
            f"{len(own) - direct} by their mask's tile plan"
        )
        lines.append(f"  runs of shorter sequences, each one call under masks.varlen: {len(segs) - len(own)}")
        if sinks is not None:
            lines.append(
                "  sinks: added to each row's denominator as each piece is written, out * sigmoid(lse - "
                "sink) from the kernel's lse (the fused kernel takes none); its backward reads the lse with "
                "the sink, the explicit tiles take the sink-free gradients"
            )
    else:
        lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
        seqs = alone(lq, lk, bias)
        lines.append(f"{head}: the per-sequence path ({choice.reason})")
        lines.append(
            f"  {len(seqs)} sequences of >= {OWN_CALL_MIN} queries and keys as their own attention() "
            f"call (backend={backend!r}), the others as one packed call under masks.varlen"
        )
        if sinks is not None:
            lines.append("  sinks: passed to every attention() call")
    if choice.costs is not None:
        lines.append(
            f"  estimated cost: batched {choice.costs[0] / 1e9:.3g}, per-sequence "
            f"{choice.costs[1] / 1e9:.3g} GFLOP-equivalents"
        )
    return "\n".join(lines)
