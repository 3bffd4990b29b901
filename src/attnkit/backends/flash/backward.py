"""The flash backend's backward: gradients of a plan recomputed chunk by chunk from ``q``, ``k``, ``v`` and the
saved log-sum-exp (see ``ops`` for the layout and the chunks).  Nothing of size ``Lq x Lk`` is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from ...bias import ScoreMod
from ..fused import FUSED
from .ops import Chunk, Prepared, Work, _add_bias_grad, _keep, _modify, _scores, add_keys, bias_index, lse_rows
from .ops import prepared, put_rows, rows_of
from .plan import Job

if TYPE_CHECKING:
    from ..fused import Fused

Tensor = torch.Tensor


def _weights(x: Tensor, stats: tuple[Tensor, Tensor] | None, shape5: tuple[int, ...], inplace: bool) -> Tensor:
    """Softmax weights of the modified scores ``x (N, kcount, G, R, W)``, recomputed in the backward.

    ``stats``: the rows' ``(max, sum of exp(x - max))`` over all their keys (rows that other chunks cover
    too); None: this chunk holds every key of its rows, so they are taken from ``x`` itself.  Either way
    ``p = exp(x - max) / sum`` comes from the very scores it weighs, never from a saved log-sum-exp: the
    largest weight of a row is ``exp(0) / sum`` and no rounding of an lse of large magnitude enters it
    (with scores of magnitude 30, one float32 ulp of lse is a relative error of 2e-6 in every weight).
    A row that may attend to nothing has ``p = 0``."""
    if stats is None:
        mx = x.amax(-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros((), dtype=x.dtype, device=x.device))
        p = x.sub_(mx) if inplace else x - mx
        p = p.exp_()
        total = p.sum(-1, keepdim=True)
    else:
        mx, total = (t.reshape(shape5).to(x.dtype) for t in stats)
        p = (x.sub_(mx) if inplace else x - mx).exp_()
    return p.div_(torch.where(total > 0, total, torch.ones((), dtype=x.dtype, device=x.device)))


def _recomputed_scores(
    work: Work, item: Prepared, m: Tensor | None, autograd: bool
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor, Tensor, Tensor]:
    """``(x, t, s_leaf, qg, kg, vg)`` of one chunk in the backward: modified scores (a graph from ``s_leaf``
    when a modifier is differentiated with autograd), tanh of the softcap, the grouped queries and
    the key/value windows in the accumulation dtype."""
    ch = item.chunk
    heads = ch.job.heads
    qw, (kw, vw) = rows_of(work.q3, heads, ch), item.kv(work, m)
    s, qg = _scores(work, heads, ch, qw, kw)
    s_leaf = None
    if autograd:
        s_leaf = s.detach().requires_grad_(True)
        with torch.enable_grad():
            x, t = _modify(work, heads, ch, s_leaf, m, inplace=False)
    else:
        x, t = _modify(work, heads, ch, s, m, inplace=True)
    return x, t, s_leaf, qg, kw.to(work.acc), vw.to(work.acc)


def _value_grads(work: Work, ch: Chunk, do: Tensor, vg: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(dog (N, kcount, G*R, Dv), dp (N, kcount, G, R, W), z)``: the output gradient grouped, its product
    with the values (times the dropout multipliers ``z``, which are returned too)."""
    heads = ch.job.heads
    g = heads.count // heads.kcount
    dog = do.reshape(ch.N, heads.kcount, g * ch.R, do.shape[-1]).to(work.acc)  # (N, Hkv, G*R, Dv)
    dp = torch.matmul(dog, vg.transpose(-1, -2)).view(ch.N, heads.kcount, g, ch.R, ch.W)
    z = None
    if work.dropout_p > 0:
        z = _keep(work, heads, ch).to(work.acc).mul_(1.0 / (1.0 - work.dropout_p))
        dp.mul_(z)
    return dog, dp, z


def explicit_row_stats(work: Work, item: Prepared, m: Tensor | None, do: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's share of its rows' softmax statistics, for rows that several chunks cover:
    ``(max, sum of exp(x - max), sum of exp(x - max) * dp)``, each ``(N, count, R)``, where ``dp`` is the
    output gradient times the values (times the dropout multipliers).  Merged over the chunks of a row
    (``_merge_stats``) they give the weights and ``D = rowsum(p * dp)`` of :func:`explicit_backward`."""
    ch = item.chunk
    heads = ch.job.heads
    x, _, _, _, _, vg = _recomputed_scores(work, item, m, False)
    mx = x.amax(-1, keepdim=True)  # -inf for a row that sees no key of this chunk
    e = x.sub_(torch.where(torch.isfinite(mx), mx, torch.zeros((), dtype=x.dtype, device=x.device))).exp_()
    _, dp, _ = _value_grads(work, ch, do, vg)
    shape = (ch.N, heads.count, ch.R)
    return (mx.view(shape), e.sum(-1).view(shape), dp.mul_(e).sum(-1).view(shape))


def explicit_backward(
    work: Work,
    item: Prepared,
    m: Tensor | None,
    do: Tensor,
    stats: tuple[Tensor, Tensor, Tensor] | None,
    dbias: Tensor | None,
    dparams: list[Tensor | None],
    dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one chunk: (dq (N, count, R, D), dk, dv (N, kcount, W, .)); bias grads accumulate.

    ``stats``: the rows' merged ``(max, sum, sum * D)`` (:func:`explicit_row_stats`) when other chunks cover
    them too; None when this chunk holds all their keys.  The weights are recomputed from the chunk's own
    scores (``_weights``) and the row term ``D = rowsum(p * dp)`` from those weights, not from the saved
    output (``rowsum(dO * O)`` is the same sum rounded differently: at a row whose weight is nearly all on
    one key, ``dp - D`` is a small difference of large terms, and an inconsistent D shows up in dq and dk
    multiplied by the keys' and queries' magnitude).  A row with one key gets exactly 0 (or ``dlse``)."""
    ch = item.chunk
    heads = ch.job.heads
    g = heads.count // heads.kcount
    mod = work.bias if isinstance(work.bias, ScoreMod) else None
    autograd = mod is not None and (not mod.additive or bool(work.bias_params))
    shape5 = (ch.N, heads.kcount, g, ch.R, 1)
    x, t, s_leaf, qg, kg, vg = _recomputed_scores(work, item, m, autograd)
    p = _weights(x.detach() if autograd else x, None if stats is None else stats[:2], shape5, not autograd)
    dog, dp, z = _value_grads(work, ch, do, vg)
    pz = p if z is None else p * z
    dv = torch.matmul(pz.view(ch.N, heads.kcount, g * ch.R, ch.W).transpose(-1, -2), dog)  # (N, Hkv, W, Dv)
    if stats is None:  # (N, kcount, G, R, 1): rowsum(p * dp), dp with dropout's z; the product in a workspace
        delta = torch.mul(p, dp, out=work.buffer("p*dp", tuple(p.shape), p.dtype)).sum(-1, keepdim=True)
    else:
        total = stats[1].reshape(shape5).to(work.acc)
        delta = stats[2].reshape(shape5).to(work.acc) / torch.where(total > 0, total, torch.ones_like(total))
    if dlse is not None:
        delta = delta - dlse.reshape(shape5).to(work.acc)  # d lse / d x = p: ds = p * (dp - D + dlse)
    dx = dp.sub_(delta).mul_(p)  # d(modified score), in place on dp
    # a row whose weight is all on one key (p == 1): that key's score gradient is exactly dlse (0 without a
    # gradient of lse); what rounding leaves of dp - D, times a bias's distances summed over rows, would
    # reach the bias parameters
    if dlse is None:
        dx.masked_fill_(p == 1, 0.0)
    else:
        dx = torch.where(p == 1, dlse.reshape(shape5).to(work.acc).expand_as(dx), dx)
    if dbias is not None:
        _add_bias_grad(dbias, bias_index(work, heads, ch), dx)
    if autograd:
        # (autograd: s_leaf is the graph's leaf)
        grads = torch.autograd.grad(x, [cast(Tensor, s_leaf), *work.bias_params], dx, allow_unused=True)
        ds = grads[0]
        for i, gp in enumerate(grads[1:]):
            if gp is not None:
                dparams[i] = gp if dparams[i] is None else cast(Tensor, dparams[i]) + gp
    else:
        ds = dx
        if t is not None:
            ds = ds.mul_(t.mul_(t).neg_().add_(1.0))  # d softcap = 1 - tanh^2
    ds = ds.view(ch.N, heads.kcount, g * ch.R, ch.W)
    dq = torch.matmul(ds, kg).mul_(work.scale).view(ch.N, heads.count, ch.R, -1)
    dk = torch.matmul(ds.transpose(-1, -2), qg).mul_(work.scale)
    return dq, dk, dv


def _shared_rows(work: Work, items: list[tuple[Job, list[Prepared]]]) -> list[list[bool]]:
    """For each chunk, whether some of its query rows are covered by other chunks too (several runs of key
    tiles, a tall window split into its full and partial parts): their softmax statistics are then summed
    over chunks first (``_row_stats``).  Kept on the plan."""
    key = ("shared", id(items))
    cached = work.plan.cache.get(key)
    if cached is not None and cached[0] is items:
        return cast("list[list[bool]]", cached[1])
    nh = work.q3.shape[0]
    cover = torch.zeros(nh, work.plan.q_pad, dtype=torch.int32, device=work.q3.device)
    for job, its in items:
        for item in its:
            ch = item.chunk
            put_rows(
                cover,
                job.heads,
                ch,
                torch.ones((), dtype=torch.int32, device=cover.device).expand(ch.N, job.heads.count, ch.R),
                add=True,
            )
    flags = [[bool((rows_of(cover, job.heads, item.chunk) > 1).any()) for item in its] for job, its in items]
    work.plan.cache[key] = (items, flags)
    return flags


def _row_stats(
    work: Work, items: list[tuple[Job, list[Prepared]]], shared: list[list[bool]], dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(max, sum, sum * D)`` per row ``(B*Hq, Lq_pad)`` over every chunk of the rows that several chunks
    cover (:func:`explicit_row_stats`, merged as online softmax merges); other rows are left at 0."""
    nh, dev = work.q3.shape[0], work.q3.device
    mx = torch.full((nh, work.plan.q_pad), float("-inf"), dtype=work.acc, device=dev)
    total = torch.zeros(nh, work.plan.q_pad, dtype=work.acc, device=dev)
    weighted = torch.zeros(nh, work.plan.q_pad, dtype=work.acc, device=dev)
    zero = torch.zeros((), dtype=work.acc, device=dev)
    for (job, its), flags in zip(items, shared):
        heads = job.heads
        for item, several in zip(its, flags):
            if not several:
                continue
            ch = item.chunk
            m_c, l_c, a_c = explicit_row_stats(work, item, item.element_mask(work), rows_of(dout, heads, ch))
            m_a = rows_of(mx, heads, ch)
            m_new = torch.maximum(m_a, m_c)
            m_safe = torch.where(torch.isfinite(m_new), m_new, zero)
            w_a, w_c = torch.exp(m_a - m_safe), torch.exp(m_c - m_safe)  # (an empty side weighs 0)
            put_rows(total, heads, ch, rows_of(total, heads, ch) * w_a + l_c * w_c, add=False)
            put_rows(weighted, heads, ch, rows_of(weighted, heads, ch) * w_a + a_c * w_c, add=False)
            put_rows(mx, heads, ch, m_new, add=False)
    mx = torch.where(torch.isfinite(mx), mx, zero)
    return mx, total, weighted


def backward(
    work: Work,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    fused: bool,
    dbias: Tensor | None,
    dparams: list[Tensor | None],
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq3, dk3, dv3)`` (``dk3``/``dv3`` in the accumulation dtype, ``dq3`` in it or in the
    input dtype when assembled from the calls' own results); ``out``/``dout`` are ``(B*Hq, Lq_pad, Dv)``
    in the input dtype, ``lse`` ``(Lq_pad, B*Hq)``.  Nothing of size ``Lq x Lk`` is kept: each chunk's
    scores are recomputed from ``q``, ``k`` and ``lse``."""
    dev = work.q3.device
    nh = work.q3.shape[0]
    if fused and work.plan.whole_causal and work.bias is None and work.scale > 0:
        dq, dk, dv = cast("Fused", FUSED)[1](  # (fused: this build has the kernel)
            dout[None],
            work.q3[None],
            work.k3[None],
            work.v3[None],
            out[None],
            lse.t()[None],
            0.0,
            True,
            scale=work.scale,
        )
        return dq[0], dk[0], dv[0]
    items = prepared(work, fused, True)
    # every query row in exactly one call over all heads: concatenate dq instead of zeros + adds
    pieces: list[tuple[int, Tensor]] | None = (
        []
        if work.plan.covered
        and all(i.chunk.first and i.chunk.q_consecutive and j.heads.count == nh for j, its in items for i in its)
        else None
    )
    dq3 = None if pieces is not None else torch.zeros(work.q3.shape, dtype=work.acc, device=dev)
    dk3 = torch.zeros(work.k3.shape, dtype=work.acc, device=dev)
    dv3 = torch.zeros(work.v3.shape, dtype=work.acc, device=dev)
    lse_b = torch.where(lse == float("-inf"), torch.full_like(lse, float("inf")), lse)  # dead rows: P = 0
    shared: list[list[bool]] | None = None
    stats: tuple[Tensor, Tensor, Tensor] | None = None
    if not fused:
        shared = _shared_rows(work, items)
        if any(f for flags in shared for f in flags):
            stats = _row_stats(work, items, shared, dout)
    for (job, its), flags in zip(items, shared or [[False] * len(its) for _, its in items]):
        heads = job.heads
        for item, several in zip(its, flags):
            ch = item.chunk
            m = None if fused and item.kernel_causal(work) else item.element_mask(work)
            if fused:
                qw, (kw, vw) = rows_of(work.q3, heads, ch), item.kv(work, m)
                dq, dk, dv = cast("Fused", FUSED)[1](
                    rows_of(dout, heads, ch),
                    qw,
                    kw,
                    vw,
                    rows_of(out, heads, ch),
                    lse_rows(lse_b, heads, ch),
                    0.0,
                    item.kernel_causal(work),
                    attn_mask=item.float_mask(work, m),
                    scale=work.scale,
                )
            else:
                # (several: the row stats were computed)
                st = cast(
                    "tuple[Tensor, Tensor, Tensor] | None",
                    tuple(rows_of(t, heads, ch) for t in cast("tuple[Tensor, Tensor, Tensor]", stats))
                    if several
                    else None,
                )
                dq, dk, dv = explicit_backward(
                    work,
                    item,
                    m,
                    rows_of(dout, heads, ch),
                    st,
                    dbias,
                    dparams,
                    None if dlse is None else rows_of(dlse.to(work.acc), heads, ch),
                )
            if pieces is not None:
                pieces.append((ch.qstart, dq.transpose(0, 1).reshape(nh, ch.N * ch.R, -1)))
            else:
                put_rows(cast(Tensor, dq3), heads, ch, dq, add=True)  # (no pieces: dq3 is allocated)
            add_keys(dk3, heads, ch, dk)
            add_keys(dv3, heads, ch, dv)
    if pieces is not None:
        pieces.sort(key=lambda p: p[0])
        dq3 = pieces[0][1] if len(pieces) == 1 else torch.cat([p[1] for p in pieces], dim=1)
    return cast(Tensor, dq3), dk3, dv3  # (allocated, or assembled from the pieces)
