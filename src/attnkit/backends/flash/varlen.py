"""The ``flash`` backend on packed variable-length sequences: one call over the packed tokens whose tiles
start at each sequence's start (``attnkit.attention_varlen``'s batched path).

The packed ``q (Tq, Hq, D)``, ``k (Tk, Hkv, D)``, ``v (Tk, Hkv, Dv)`` are cut into *segments*, in packed order:

* a sequence with at least ``OWN_TILES_MIN`` queries and keys is a segment of its own.  Its tiles start at
  its first query and key, so no tile straddles two sequences and its last tile is short.  With no mask,
  or a causal mask on ``Lq == Lk``, on CPU, PyTorch's fused flash kernel computes it in one call on
  strided views of the packed tensors (no copy at all: the kernel tiles it, skipping the masked tiles of
  a causal mask, and writes its output and gradients in the packed ``(L, H, D)`` layout; a tensor whose head
  dimension is not contiguous is copied first, by the kernel's entry in ``_flash_ops``).  Otherwise the
  flash plan of its mask (``plan``, on the sequence's own lengths) runs on its rows, laid out head
  first in one buffer shared by all such segments, each padded to its whole tiles with zeros;
* a run of consecutive shorter sequences is one segment under :func:`attnkit.masks.varlen` (a sequence of
  a few tokens is cheaper inside a shared tile than as a call of its own); its block structure still
  visits only the tiles each sequence touches.

Rows, keys and their gradients of different segments never overlap, so each is written once into the
packed result (no accumulation, no per-sequence output buffers or index sorts).  Masks apply with each
sequence's own positions; softcap, scale, grouped-query heads, dropout (a seed per segment) and the
log-sum-exp (with its gradient) are as for ``attention()``.  The backward recomputes each segment from
``(q, k, v, out, lse)`` like the flash backend's.

Attention sinks (one logit per query head, ``sinks (Hq,)``) join each row's denominator as a segment's piece is
written, in place: ``out * exp(lse - lse') = out * sigmoid(lse - sink)`` with ``lse' = logaddexp(lse, sink)``,
exact whichever kernel made the piece (the fused kernel takes no sinks).  Rows of no segment get ``lse' =
sink``.  In the backward the fused kernel reads the saved ``(out, lse')``, whose weights ``exp(s - lse')``
already leave the sink's share out; the explicit tiles renormalise over their keys themselves and get the
sink-free gradients (``autograd._sinkless_grads``).  The sinks' gradient is ``sum over rows of p_sink *
(dlse - rowsum(dout * out))``, ``p_sink = exp(sink - lse')``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from ... import masks as _masks
from ...masks import Mask
from . import backward as bwd
from . import ops
from . import plan as planning
from ..call import Call, accumulation_dtype
from ..fused import FUSED
from .autograd import _backward_plan, _forward_plan, _fusable, _sinkless_grads

if TYPE_CHECKING:
    from ..fused import Fused

Tensor = torch.Tensor

OWN_TILES_MIN = 64  # a sequence with at least this many queries and keys gets tiles of its own (one small tile)
SEED_STEP = 0x9E3779B1  # golden-ratio step between the dropout seeds of consecutive segments


@dataclass
class Segment:
    """Packed query rows ``[qa, qb)`` and keys ``[ka, kb)`` computed together."""

    qa: int
    qb: int
    ka: int
    kb: int
    mask: Mask | None  # the sequence's mask (own segment) or masks.varlen over the run's local lengths
    own: bool  # one sequence (else a run of short ones)
    fused: bool  # on PyTorch's fused CPU kernel (else the explicit path)
    direct: bool  # one fused kernel call on the packed views (no mask, or causal on Lq == Lk)
    seed: int  # dropout seed
    plan: planning.Plan | None = None  # the forward's tiles (None for direct segments)
    plan_b: planning.Plan | None = None  # the backward's tiles (None for direct segments, until needed)

    @property
    def lq(self) -> int:
        return self.qb - self.qa

    @property
    def lk(self) -> int:
        return self.kb - self.ka


@dataclass
class Settings:
    scale: float
    softcap: float | None
    dropout_p: float
    lse_dtype: torch.dtype


def _views(x: Tensor, a: int, b: int) -> Tensor:
    return x[a:b].transpose(0, 1)[None]  # (T, H, E) -> (1, H, b - a, E), a view


def segment_call(seg: Segment, q: Tensor, k: Tensor, v: Tensor, st: Settings) -> Call:
    """The segment as an ``attention()`` call on views (for planning and the fused kernel's conditions)."""
    return Call(
        _views(q, seg.qa, seg.qb),
        _views(k, seg.ka, seg.kb),
        _views(v, seg.ka, seg.kb),
        seg.mask,
        None,
        st.scale,
        st.softcap,
        st.dropout_p,
        False,
    )


def _direct(mask: Mask | None, lq: int, lk: int, scale: float) -> bool:
    """Whether the fused kernel's own masking computes the sequence: no mask, or causal on ``Lq == Lk``
    (where bottom-right and top-left agree; the kernel's ``is_causal`` gives NaN for a negative scale)."""
    return mask is None or (mask.is_causal(None) and lq == lk and scale > 0)


def segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: list[int],
    cu_k: list[int],
    mask: Mask | None,
    st: Settings,
    seed: int,
    backward: bool,
) -> list[Segment]:
    """The segments of a packed batch (module docstring), planned; ``backward``: also the backward's plans."""
    n = len(cu_q) - 1
    segs: list[Segment] = []
    run: list[int] = []

    def add(s0: int, s1: int, own: bool) -> None:  # sequences s0..s1-1
        qa, qb, ka, kb = cu_q[s0], cu_q[s1], cu_k[s0], cu_k[s1]
        if qb == qa or kb == ka:
            return  # no rows, or rows that see nothing (left at 0, lse -inf)
        if own:
            m = mask
        else:
            local_q = torch.tensor(cu_q[s0 : s1 + 1]) - qa
            local_k = torch.tensor(cu_k[s0 : s1 + 1]) - ka
            m = _masks.varlen(local_q, local_k, mask)
        seg = Segment(qa, qb, ka, kb, m, own, False, False, (seed + SEED_STEP * len(segs)) & 0x7FFFFFFF)
        call = segment_call(seg, q, k, v, st)
        seg.fused = _fusable(call, False)
        seg.direct = own and seg.fused and _direct(mask, qb - qa, kb - ka, st.scale)
        if not seg.direct:
            seg.plan = _forward_plan(call)
            seg.plan_b = _backward_plan(call) if backward else None
        segs.append(seg)

    def flush() -> None:
        if run:
            add(run[0], run[-1] + 1, False)
            run.clear()

    for s in range(n):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        if min(lq, lk) >= OWN_TILES_MIN:
            flush()
            add(s, s + 1, True)
        else:
            run.append(s)
    flush()
    return segs


# ------------------------------------------------------------------------ layout


def _padded(x: Tensor | list[Tensor], spans: list[tuple[int, int, int]]) -> tuple[Tensor, list[int]]:
    """``x (T, H, E)``'s rows ``[a, b)`` of each span ``(a, b, rows)`` laid out head first in one buffer
    ``(H, sum(rows), E)``, each span at its own offset and zero-padded to ``rows``; and the offsets.  ``x`` may
    be a list: one tensor of that shape per span, read for that span's rows."""
    offsets, total = [], 0
    for _, _, rows in spans:
        offsets.append(total)
        total += rows
    xs = x if isinstance(x, list) else [x] * len(spans)
    like = x[0] if isinstance(x, list) else x
    buf = like.new_empty(like.shape[1], total, like.shape[2])
    for (a, b, rows), o, src in zip(spans, offsets, xs):
        buf[:, o : o + b - a].copy_(src[a:b].transpose(0, 1))
        buf[:, o + b - a : o + rows].zero_()
    return buf, offsets


def _work(
    seg: Segment, plan: planning.Plan, q3: Tensor, k3: Tensor, v3: Tensor, hq: int, hkv: int, st: Settings, fused: bool
) -> ops.Work:
    """The flash ops' work for one segment on its rows of the padded buffers."""
    q3, k3, v3 = q3[:, : plan.q_pad], k3[:, : plan.kv_pad], v3[:, : plan.kv_pad]
    if any(j.tiles is not None for j in plan.jobs):  # gathered key tiles are read from a contiguous tensor
        k3, v3 = k3.contiguous(), v3.contiguous()
    return ops.Work(plan, 1, hq, hkv, q3, k3, v3, st.scale, st.softcap, seg.mask, None, st.dropout_p, seg.seed, fused)


class _Packed:
    """A packed result ``(total, ...)`` written piece by piece: each piece is copied in as soon as it is made
    and then dropped, so the kernels' temporaries reuse the same memory from call to call (fresh memory is
    page-faulted in on first touch, which costs about as much as the copy); rows no piece wrote get ``fill``."""

    def __init__(self, total: int, like: Tensor, fill: float, dtype: torch.dtype | None = None) -> None:
        self.x = torch.empty(total, *like.shape[1:], dtype=like.dtype if dtype is None else dtype, device=like.device)
        self.fill = fill
        self.spans: list[tuple[int, int]] = []

    def put(self, start: int, piece: Tensor) -> None:
        self.x[start : start + piece.shape[0]].copy_(piece)
        self.spans.append((start, start + piece.shape[0]))

    def result(self) -> Tensor:
        at = 0
        for a, b in sorted(self.spans):
            if a > at:
                self.x[at:a].fill_(self.fill)
            at = max(at, b)
        if self.x.shape[0] > at:
            self.x[at:].fill_(self.fill)
        return self.x


# ----------------------------------------------------------------------- compute


def _with_sink(o: Tensor, l: Tensor, sink: Tensor | None) -> Tensor:  # noqa: E741
    """A piece's output ``o (L, Hq, Dv)`` (the kernel's own, a view) with the sinks ``(Hq,)`` in its rows'
    denominators, ``l (L, Hq)`` being its lse without them: scaled in place (memory already touched, one rounding
    to ``o``'s dtype); ``o`` as it is without sinks."""
    if sink is None:
        return o
    return o.mul_(torch.sigmoid(l - sink)[..., None])  # exp(l - logaddexp(l, sink)); 0 in a row that saw no key


def forward(
    q: Tensor, k: Tensor, v: Tensor, segs: list[Segment], st: Settings, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``out (Tq, Hq, Dv)`` in q's dtype, ``lse (Tq, Hq)`` and, with ``sinks (Hq,)``, the lse without them
    (else None); ``out`` and ``lse`` include the sinks.  Rows of no segment get 0 and -inf (with sinks, the sink)."""
    tq, hq = q.shape[0], q.shape[1]
    hkv = k.shape[1]
    sink = None if sinks is None else sinks.detach().to(st.lse_dtype)  # (Hq,)
    out = _Packed(tq, q.new_empty(0, hq, v.shape[2]), 0.0)
    lse = _Packed(tq, q.new_empty(0, hq), float("-inf"), st.lse_dtype)
    planned = [s for s in segs if not s.direct]  # (each has its plan)
    if planned:
        q3, qo = _padded(q, [(s.qa, s.qb, cast(planning.Plan, s.plan).q_pad) for s in planned])
        k3, ko = _padded(k, [(s.ka, s.kb, cast(planning.Plan, s.plan).kv_pad) for s in planned])
        v3, _ = _padded(v, [(s.ka, s.kb, cast(planning.Plan, s.plan).kv_pad) for s in planned])
        at = {id(s): (a, b) for s, a, b in zip(planned, qo, ko)}
    for s in segs:
        if s.direct:  # (1, Hq, L, Dv) and (1, Hq, L), laid out (L, Hq, .) by the kernel
            o, l = cast("Fused", FUSED)[0](  # noqa: E741  (a direct segment: this build has the kernel)
                _views(q, s.qa, s.qb),
                _views(k, s.ka, s.kb),
                _views(v, s.ka, s.kb),
                0.0,
                s.mask is not None,
                scale=st.scale,
            )
            l = l[0].t()  # noqa: E741  (L, Hq)
            out.put(s.qa, _with_sink(o[0].transpose(0, 1), l, sink))
            lse.put(s.qa, l)
            del o, l
            continue
        a, b = at[id(s)]
        work = _work(s, cast(planning.Plan, s.plan), q3[:, a:], k3[:, b:], v3[:, b:], hq, hkv, st, s.fused)
        o3, l3 = ops.forward(work)  # (Hq, Lq_pad, Dv), (Lq_pad, Hq)
        l = l3[: s.lq].to(st.lse_dtype)  # noqa: E741
        out.put(s.qa, _with_sink(o3[:, : s.lq].transpose(0, 1), l, sink))
        lse.put(s.qa, l)
        del o3, l3, l, work
    bare = lse.result()
    if sink is None:
        return out.result(), bare, None
    return out.result(), torch.logaddexp(bare, sink), bare


def backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    segs: list[Segment],
    st: Settings,
    bare: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the packed layouts and the inputs' dtypes; ``lse (Tq, Hq)``, ``dlse (Tq, Hq)``
    or None; with sinks, ``out`` and ``lse`` include them and ``bare (Tq, Hq)`` is the lse without them.
    Rows and keys of no segment get zero gradients."""
    hq, hkv = q.shape[1], k.shape[1]
    dq, dk, dv = _Packed(q.shape[0], q, 0.0), _Packed(k.shape[0], k, 0.0), _Packed(v.shape[0], v, 0.0)
    fused = [s.fused and dlse is None for s in segs]  # the fused backward takes no gradient of the lse
    tiled = [s for s, f in zip(segs, fused) if not (s.direct and f)]
    for s in tiled:
        if s.plan_b is None:
            s.plan_b = _backward_plan(segment_call(s, q, k, v, st))
    # the explicit tiles renormalise over their keys: they take the gradients of the sink-free result
    explicit = bare is not None and not all(fused)
    if explicit:  # (Tq, Hq, Dv), (Tq, Hq), (Tq, Hq): elementwise, so the packed layout serves
        dout_b, dlse_b, lse_b = _sinkless_grads(out, lse, cast(Tensor, bare), dout, dlse)
    grads_of = {
        id(s): (dout_b, dlse_b, lse_b) if explicit and not f else (dout, dlse, lse) for s, f in zip(segs, fused)
    }
    if tiled:
        spans_q = [(s.qa, s.qb, cast(planning.Plan, s.plan_b).q_pad) for s in tiled]  # (planned above)
        spans_k = [(s.ka, s.kb, cast(planning.Plan, s.plan_b).kv_pad) for s in tiled]
        q3, qo = _padded(q, spans_q)
        k3, ko = _padded(k, spans_k)
        v3, _ = _padded(v, spans_k)
        out3, _ = _padded(out, spans_q)
        dout3, _ = _padded([grads_of[id(s)][0] for s in tiled], spans_q)
        at = {id(s): (a, b) for s, a, b in zip(tiled, qo, ko)}
    for s, f in zip(segs, fused):
        if s.direct and f:
            lse_s = lse[s.qa : s.qb].t()[None]  # (1, Hq, L), the kernel's own layout
            g = cast("Fused", FUSED)[1](
                _views(dout, s.qa, s.qb),
                _views(q, s.qa, s.qb),
                _views(k, s.ka, s.kb),
                _views(v, s.ka, s.kb),
                _views(out, s.qa, s.qb),
                lse_s,
                0.0,
                s.mask is not None,
                scale=st.scale,
            )
            for x, gx, a in ((dq, g[0], s.qa), (dk, g[1], s.ka), (dv, g[2], s.ka)):
                x.put(a, gx[0].transpose(0, 1))  # laid out (L, H, E) by the kernel
            del g
            continue
        plan = cast(planning.Plan, s.plan_b)  # (a tiled segment: planned above)
        a, b = at[id(s)]
        _, dlse_s, lse_s = grads_of[id(s)]
        work = _work(s, plan, q3[:, a:], k3[:, b:], v3[:, b:], hq, hkv, st, f)
        lse3 = torch.full((plan.q_pad, hq), float("inf"), dtype=lse.dtype, device=lse.device)  # padded rows: P = 0
        lse3[: s.lq] = lse_s[s.qa : s.qb]
        dlse3 = None
        if dlse_s is not None:
            dlse3 = torch.zeros(hq, plan.q_pad, dtype=dlse_s.dtype, device=dlse_s.device)  # (Hq, Lq_pad)
            dlse3[:, : s.lq] = dlse_s[s.qa : s.qb].t()
        dq3, dk3, dv3 = bwd.backward(
            work, out3[:, a : a + plan.q_pad], lse3, dout3[:, a : a + plan.q_pad], dlse3, f, None, []
        )
        dq.put(s.qa, dq3[:, : s.lq].transpose(0, 1))
        dk.put(s.ka, dk3[:, : s.lk].transpose(0, 1))
        dv.put(s.ka, dv3[:, : s.lk].transpose(0, 1))
        del dq3, dk3, dv3, work
    return dq.result(), dk.result(), dv.result()


def sinks_grad(out: Tensor, lse: Tensor, dout: Tensor, dlse: Tensor | None, sinks: Tensor) -> Tensor:
    """The gradient of the sinks ``(Hq,)``, summed over every packed row: ``p_sink * (dlse - rowsum(dout *
    out))`` with ``p_sink = exp(sink - lse)`` (1 in a row that saw no key, whose output is 0: only ``dlse``
    reaches the sink from it).  ``out (Tq, Hq, Dv)``, ``lse``/``dlse (Tq, Hq)`` include the sinks."""
    p = torch.exp(sinks.detach().to(lse.dtype) - lse)  # (Tq, Hq)
    g = -torch.einsum("thd,thd->th", dout.to(lse.dtype), out.to(lse.dtype))  # rowsum(dout * out), no product kept
    if dlse is not None:
        g = g + dlse.to(lse.dtype)
    return (p * g).sum(0).to(sinks.dtype)


class _VarlenFunction(torch.autograd.Function):
    """Inputs ``(q, k, v, sinks (Hq,) or None, state)`` packed; outputs ``(out (Tq, Hq, Dv), lse (Hq, Tq))``."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, state: tuple[list[Segment], Settings]
    ) -> tuple[Tensor, Tensor]:
        segs, st = state
        out, lse, bare = forward(q, k, v, segs, st, sinks)
        ctx.save_for_backward(q, k, v, out, lse, bare, sinks)
        ctx.state = state
        ctx.set_materialize_grads(False)
        return out, lse.t().contiguous()

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the flash backend's backward is not differentiable (create_graph=True or a double "
                "backward, e.g. a gradient penalty): use backend='math' or 'sdpa' for such a loss"
            )
        if dout is None and dlse is None:
            return None, None, None, None, None
        q, k, v, out, lse, bare, sinks = ctx.saved_tensors
        segs, st = ctx.state
        dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
        dlse = None if dlse is None else dlse.t().to(lse.dtype)  # (Tq, Hq)
        dsinks = sinks_grad(out, lse, dout, dlse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = backward(q, k, v, out, lse, dout, dlse, segs, st, bare)
        return dq, dk, dv, dsinks, None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: list[int],
    cu_k: list[int],
    mask: Mask | None,
    scale: float,
    softcap: float | None,
    dropout_p: float,
    segs: list[Segment] | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Packed attention as one batched call: ``(out (Tq, Hq, Dv), lse (Hq, Tq))`` (inputs validated by the
    caller; ``segs`` from :func:`segments` when already planned; ``sinks (Hq,)`` or None)."""
    st = settings(q, scale, softcap, dropout_p)
    needs_grad = torch.is_grad_enabled() and (
        any(t.requires_grad for t in (q, k, v)) or (sinks is not None and sinks.requires_grad)
    )
    if segs is None:
        segs = segments(q, k, v, cu_q, cu_k, mask, st, ops.draw_seed() if dropout_p > 0 else 0, needs_grad)
    if not needs_grad:
        out, lse, _ = forward(q, k, v, segs, st, sinks)
        return out, lse.t()
    # (PyTorch leaves Function.apply unannotated)
    return cast("tuple[Tensor, Tensor]", _VarlenFunction.apply(q, k, v, sinks, (segs, st)))  # type: ignore[no-untyped-call]


def settings(q: Tensor, scale: float, softcap: float | None, dropout_p: float) -> Settings:
    return Settings(scale, softcap, dropout_p, torch.promote_types(accumulation_dtype(q.dtype), torch.float32))
