"""``attention_varlen()``: packed variable-length sequences, without padding."""

from __future__ import annotations

from typing import Any, Literal, cast, overload

import torch

from . import masks as _masks
from .bias import BiasLike
from .masks import Mask
from .backends import packed as _packed
from .backends.flash import varlen_attention
from .backends import select as _select
from .backends.call import refuse_foreign
from .functional import attention

Tensor = torch.Tensor

__all__ = ["attention_varlen"]

OWN_CALL_MIN = _packed.OWN_CALL_MIN  # per-sequence path: sequences this long run as their own attention() call
MAX_OWN_CALLS = _packed.MAX_OWN_CALLS  # ... up to this many of them


def _split(result) -> tuple[Tensor, Tensor | None]:
    """(out (1, H, L, Dv), lse (H, L) or None) from attention()'s result."""
    return (result[0], result[1][0]) if isinstance(result, tuple) else (result, None)


# ---------------------------------------------------------------------- public API


@overload
def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    mask: Mask | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: Literal[False] = False,
    backend: str = "auto",
    **unknown: object,
) -> Tensor: ...


@overload
def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    mask: Mask | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: Literal[True],
    backend: str = "auto",
    **unknown: object,
) -> tuple[Tensor, Tensor]: ...


@overload
def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    mask: Mask | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    **unknown: object,
) -> Tensor | tuple[Tensor, Tensor]: ...


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    mask: Mask | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    **unknown: object,
) -> Tensor | tuple[Tensor, Tensor]:
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
        sinks: attention sinks (GPT-OSS): a float tensor ``(Hq,)``, one logit per query head shared by every
            sequence, added to each row's softmax denominator with a zero value, as ``sinks=`` of
            :func:`attnkit.attention`.  Differentiable (its gradient sums over the rows of all sequences).
            Sinks that differ between sequences (a ``(n, Hq)`` tensor) are refused: call ``attention()`` per
            sequence for those.
        **unknown: ``flash_attn_varlen_func``'s ``causal``, ``softmax_scale``, ``window_size`` (and the other
            foreign keyword arguments :func:`attnkit.attention` names) raise a TypeError naming the attnkit
            equivalent.
        return_lse: also return the log-sum-exp ``(Hq, Tq)`` (float32; float64 for float64 inputs), the layout
            of ``flash_attn_varlen_func``'s ``softmax_lse``; with ``sinks``, of the whole denominator
            (``logaddexp(lse_without_sink, sink)``).

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
    and zero gradients (with ``sinks``: ``lse = sink``, and the sink's gradient from the row comes only
    through ``lse``).  Nothing is padded to ``(n, max_len)``; the work follows the real tokens, in one of
    two ways:

    * **one batched flash call** (``backend="flash"``, and ``auto``'s usual choice): each sequence with at
      least 64 queries and keys gets tiles of its own, starting at its first query and key (no tile
      straddles two sequences; its last tile is short).  On CPU, with no mask or a causal mask on
      ``Lq_s == Lk_s``, PyTorch's fused flash kernel computes it in one call on strided views of the packed
      tensors, skipping the masked tiles; other masks run the flash backend's tile plan of the sequence's
      own mask.  Consecutive shorter sequences share one call under :func:`attnkit.masks.varlen`.  Outputs
      and gradients are written once into the packed tensors; the backward recomputes each sequence's tiles.
      Sinks join each row's denominator as its output is written, from the kernel's lse (exact; PyTorch's
      fused kernel takes none itself);
    * **the per-sequence path** (any other ``backend``, a ``bias``): each sequence with at least
      ``OWN_CALL_MIN`` (128) queries and keys runs as its own :func:`attnkit.attention` call on views of the
      packed tensors (up to ``MAX_OWN_CALLS``), and the others share one call under
      :func:`attnkit.masks.varlen`, whose block structure lets the ``flash`` and ``triton`` backends visit
      only each sequence's tiles.

    While ``torch.compile`` traces, the call is one :func:`attnkit.attention` call on the packed tensors under
    :func:`attnkit.masks.varlen` (one graph, no graph breaks: the lengths stay tensors), and the checks of
    ``cu_seqlens``' values are assertions in the graph (a RuntimeError when the compiled code meets bad ones).

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
        >>> sinks = torch.zeros(4, requires_grad=True)      # GPT-OSS's learned per-head sink logits
        >>> attnkit.attention_varlen(q, k, v, cu, cu, mask=attnkit.masks.causal(), sinks=sinks).sum().backward()
        >>> sinks.grad.shape
        torch.Size([4])
    """
    refuse_foreign("attention_varlen", unknown)
    cu_q, cu_k, bias, sinks = _packed.validated(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask, bias, sinks
    )  # sinks: (Hq,) or None
    if torch.compiler.is_compiling():  # one packed call: the lengths stay graph values (no .tolist())
        o, lse = _split(
            attention(
                *(t.transpose(0, 1)[None] for t in (q, k, v)),
                mask=_masks.varlen(cu_q, cu_k, mask),
                bias=bias,
                scale=scale,
                softcap=softcap,
                sinks=sinks,
                dropout_p=dropout_p,
                return_lse=return_lse,
                backend=backend,
            )
        )  # (1, H, T, D) views
        out = o[0].transpose(0, 1).contiguous()  # (Tq, Hq, Dv)
        return (out, cast(Tensor, lse)) if return_lse else out  # (lse computed with return_lse)
    lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
    choice = _packed.choose(q, k, v, cu_q, cu_k, mask, bias, scale, softcap, dropout_p, backend, _select, sinks)
    if choice.batched:
        out, lse = varlen_attention(
            q, k, v, cu_q.tolist(), cu_k.tolist(), mask, choice.scale, softcap, dropout_p, choice.segments, sinks
        )
        return (out, lse) if return_lse else out
    kw: dict[str, Any] = dict(
        mask=mask,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
        dropout_p=dropout_p,
        return_lse=return_lse,
        backend=backend,
    )
    starts_q, starts_k = cu_q[:-1].tolist(), cu_k[:-1].tolist()
    alone = _packed.alone(lq, lk, bias)
    # sequences with no queries drop out, except under a bias (packed coordinates: every key keeps its column)
    packed = [s for s in range(len(lq)) if s not in set(alone) and (lq[s] > 0 or bias is not None)]
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
        o, lse = _split(
            attention(
                *(t.transpose(0, 1)[None] for t in (qp, kp, vp)),
                **{**kw, "mask": _masks.varlen(cq, ck, mask), "bias": bias},
            )
        )  # (1, H, T, D) views
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
    return (out, cast(Tensor, lse)) if return_lse else out  # (lse computed with return_lse)
