"""Distillation losses: logits at a temperature, hidden states, attention distributions, q/k/v relations."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .._checks import choice, int_in_range, positive_float
from ..backends.call import Call, accumulation_dtype, make_call
from ..backends.scores import grouped_bias, grouped_index, modify_scores
from ..masks import Mask

Tensor = torch.Tensor

__all__ = ["AttentionRecord", "logit_kl", "hidden_mse", "HiddenProjection", "attention_kl", "relation_kl"]

_BLOCK_ELEMENTS = 1 << 21  # score elements per block of query rows when chunk_rows is not given


# ------------------------------------------------------------------------------------------ records


@dataclass
class AttentionRecord:
    """What one attention layer computed with: the arguments of its :func:`attnkit.attention` call.

    ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)`` as the layer passed them (after its
    projections, q/k norms and rotary positions), the layer's ``mask`` (an :class:`attnkit.masks.Mask` or
    None), ``bias`` (a tensor, a score modifier such as ALiBi, or None), ``scale``, ``softcap`` and ``sinks``
    (learned sink logits ``(Hq,)``, or None: :meth:`weights` leaves each row the share its keys keep beside
    the sink; the attention losses compare distributions over keys, each row renormalised over its keys, as
    for weights given as tensors).  The tensors stay in the autograd graph of the forward that made them, so
    a loss on them trains the model.
    :func:`attnkit.distill.capture` records one per layer; the attention losses recompute the weights from
    it a block of query rows at a time instead of keeping every layer's ``(B, Hq, Lq, Lk)`` weights.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.distill import AttentionRecord
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> rec = AttentionRecord(q, k, v, mask=masks.causal())
        >>> rec.weights().shape, rec.weights()[0, 0, 0].tolist()
        (torch.Size([1, 2, 4, 4]), [1.0, 0.0, 0.0, 0.0])
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Mask | None = None
    bias: object = None
    scale: float | None = None
    softcap: float | None = None
    sinks: Tensor | None = None

    def __post_init__(self):
        call = make_call(
            self.q,
            self.k,
            self.v,
            mask=self.mask,
            bias=self.bias,
            scale=self.scale,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        self.mask, self.bias, self.scale = call.mask, call.bias, call.scale
        self._call = call

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, Hq, Lq, Lk)`` of the attention weights."""
        c = self._call
        return c.batch, c.heads, c.q_len, c.kv_len

    def weights(self) -> Tensor:
        """The full weights ``(B, Hq, Lq, Lk)`` (materialised: meant for small cases and tests)."""
        B, H, Lq, Lk = self.shape
        s = _scores(self._call, 0, Lq, None)
        if self.sinks is None:
            return torch.softmax(s, -1).nan_to_num(0.0)
        sink = self.sinks.to(s.dtype).expand(B, H)[:, :, None, None].expand(B, H, Lq, 1)  # one more column
        return torch.softmax(torch.cat((s, sink), -1), -1)[..., :Lk]


def _scores(call: Call, r0: int, r1: int, other: Call | None) -> Tensor:
    """Scores ``(B, Hq, r1 - r0, Lk)`` of query rows ``r0:r1`` in float32 (or float64), ``-inf`` where the
    call's mask (AND the other call's mask, when given) forbids a key."""
    q, k = call.q, call.k
    B, Hq, _, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    acc = torch.promote_types(accumulation_dtype(q.dtype), torch.float32)
    qg = q[:, :, r0:r1].reshape(B, Hkv, call.group, r1 - r0, D).to(acc)  # (B, Hkv, G, r, D)
    s = torch.matmul(qg, k.unsqueeze(2).to(acc).transpose(-1, -2)) * call.scale  # (B, Hkv, G, r, Lk)
    rows, cols = torch.arange(r0, r1, device=q.device), torch.arange(Lk, device=q.device)
    b, h, qi, ki = grouped_index(call, rows, cols)
    block_bias = None
    if isinstance(call.bias, Tensor):
        bias = grouped_bias(call.bias, call)
        block_bias = bias[..., r0:r1, :] if bias.shape[-2] > 1 else bias
    s = modify_scores(s, call, b, h, qi, ki, bias_block=block_bias)
    s = s.reshape(B, Hq, r1 - r0, Lk)  # (B, Hq, r, Lk)
    if other is not None and other.mask is not None:
        s = s.masked_fill(~_allowed(other, r0, r1), float("-inf"))
    return s


def _allowed(call: Call, r0: int, r1: int) -> Tensor:
    """``(B or 1, 1, r, Lk)``: keys that any head of ``call`` may attend to from rows ``r0:r1``."""
    dev = call.q.device
    b, h, qi, ki = grouped_index(call, torch.arange(r0, r1, device=dev), torch.arange(call.kv_len, device=dev))
    ok = call.mask.evaluate(b, h, qi, ki, call.q_len, call.kv_len)  # broadcastable to (B, Hkv, G, r, Lk)
    ok = ok.expand(-1, call.kv_heads, call.group, -1, -1) if ok.dim() == 5 else ok
    return ok.flatten(1, 2).any(1, keepdim=True)  # (B', 1, r, Lk)


def _logsumexp(x: Tensor, dim: int) -> Tensor:
    """``log(sum(exp(x)))`` along ``dim`` (kept); an all ``-inf`` slice gives ``-inf`` with zero gradients (not the
    NaN gradient of ``torch.logsumexp`` there)."""
    m = x.detach().amax(dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.exp(x - m).sum(dim, keepdim=True)
    return torch.where(
        total > 0, m + total.clamp_min(torch.finfo(total.dtype).tiny).log(), torch.full_like(total, float("-inf"))
    )


def _log_softmax(s: Tensor) -> Tensor:
    """log-softmax along the last dim; a row that may attend to nothing stays ``-inf`` (never NaN)."""
    lse = _logsumexp(s, -1)
    return s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _kl_rows(log_p: Tensor, log_q: Tensor) -> tuple[Tensor, Tensor]:
    """Sum over rows of ``KL(p || q) = sum_j p_j (log p_j - log q_j)`` and the number of rows where ``p`` has
    mass; keys with ``p_j = 0`` add nothing (``q`` may be 0 there too)."""
    p = log_p.exp()
    live = p > 0
    term = torch.where(live, p * (log_p.where(live, 0.0) - log_q.where(live, 0.0)), torch.zeros_like(p))
    rows = live.any(-1)
    return term.sum(), rows.sum()


def _row_step(n_rows: int, per_row: int, chunk_rows: int | None) -> int:
    if chunk_rows is None:
        return max(1, _BLOCK_ELEMENTS // max(1, per_row))
    return int_in_range(
        "chunk_rows", chunk_rows, 1, fix=f" (query rows per block) or None (blocks of about {_BLOCK_ELEMENTS:,} scores)"
    )


def _chunked(fn, n_rows: int, step: int, tensors: tuple[Tensor, ...]) -> Tensor:
    """``sum(fn(r0, r1))`` over blocks of rows ``/ sum(rows)``; with several blocks and gradients, each block is
    recomputed in the backward pass (``torch.utils.checkpoint``) so only one block's scores live at a time."""
    total, count = None, 0
    recompute = n_rows > step and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        if recompute:
            kl, rows = checkpoint(fn, r0, r1, use_reentrant=False)
        else:
            kl, rows = fn(r0, r1)
        total = kl if total is None else total + kl
        count += int(rows)
    if total is None:
        raise ValueError("the attention has no query rows (Lq = 0): nothing to distil")
    return total / max(count, 1)


# ------------------------------------------------------------------------------------------ logits


def logit_kl(student: Tensor, teacher: Tensor, *, temperature: float = 1.0, mask: Tensor | None = None) -> Tensor:
    """Logit distillation: ``T^2 * mean_positions KL(softmax(teacher / T) || softmax(student / T))``.

    ``student`` and ``teacher`` are logits ``(..., V)`` of one shape (e.g. ``(B, L, V)``); ``mask`` (bool,
    the shape without ``V``) picks the positions that count (default: all).  The factor ``T^2`` keeps the
    gradient's size independent of the temperature (Hinton et al.).  Zero when the two agree.

    Example::

        >>> import math, torch
        >>> from attnkit.distill import logit_kl
        >>> s, t = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])  # q = (1/2, 1/2), p = (3/4, 1/4)
        >>> round(float(logit_kl(s, t)), 6) == round(0.75 * math.log(1.5) + 0.25 * math.log(0.5), 6)
        True
    """
    _same_logits(student, teacher)
    t = positive_float("temperature", temperature)
    log_q = F.log_softmax(student.float() / t, -1)
    log_p = F.log_softmax(teacher.detach().float() / t, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # (...)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != kl.shape:
            raise ValueError(
                f"mask must be a bool tensor of shape {tuple(kl.shape)} (the logits' shape without "
                f"the vocabulary), got {getattr(mask, 'shape', type(mask).__name__)}"
            )
        if not bool(mask.any()):
            raise ValueError("mask selects no position: nothing to distil")
        kl = kl[mask]
    return kl.mean() * t * t


def _same_logits(student: Tensor, teacher: Tensor) -> None:
    for name, x in (("student", student), ("teacher", teacher)):
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} logits must be a float tensor (..., V), got {type(x).__name__}")
    if student.shape[-1] != teacher.shape[-1]:
        raise ValueError(
            f"the vocabularies differ: student logits have V={student.shape[-1]}, teacher logits "
            f"V={teacher.shape[-1]}; logit distillation needs one vocabulary (same tokenizer): give "
            f"both models the same vocab_size, or set the 'logits' weight to 0"
        )
    if student.shape != teacher.shape:
        raise ValueError(
            f"student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ "
            f"in shape: feed both models the same batch"
        )


# ---------------------------------------------------------------------------------------- hidden states


class HiddenProjection(nn.Module):
    """Hidden-state matching: ``mean((h_s W - h_t)^2)`` with a learned ``W: d_student -> d_teacher``.

    ``forward(student (B, L, d_student), teacher (B, L, d_teacher), mask=None)`` returns the mean squared
    error over the selected positions (``mask`` bool ``(B, L)``) and features.  When the widths are equal the
    projection is the identity and has no parameters (unless ``learned=True``); otherwise ``proj`` is a
    ``Linear(d_student, d_teacher, bias=False)`` trained with the student (TinyBERT's ``W_h``).

    Example::

        >>> import torch
        >>> from attnkit.distill import HiddenProjection
        >>> match = HiddenProjection(16, 32)
        >>> match(torch.randn(2, 5, 16), torch.randn(2, 5, 32)).shape, match.proj.weight.shape
        (torch.Size([]), torch.Size([32, 16]))
        >>> h = torch.randn(2, 5, 8)
        >>> float(HiddenProjection(8, 8)(h, h))
        0.0
    """

    def __init__(self, d_student: int, d_teacher: int, *, learned: bool = False):
        super().__init__()
        for name, d in (("d_student", d_student), ("d_teacher", d_teacher)):
            int_in_range(name, d, 1, fix=" (a hidden width)")
        self.d_student, self.d_teacher = d_student, d_teacher
        self.proj = nn.Linear(d_student, d_teacher, bias=False) if learned or d_student != d_teacher else None

    def forward(self, student: Tensor, teacher: Tensor, mask: Tensor | None = None) -> Tensor:
        return hidden_mse(student, teacher, projection=self.proj, mask=mask)


def hidden_mse(
    student: Tensor, teacher: Tensor, *, projection: nn.Module | None = None, mask: Tensor | None = None
) -> Tensor:
    """``mean((projection(student) - teacher)^2)`` over positions (``mask`` bool ``(B, L)``) and features.

    ``student (B, L, d_s)``, ``teacher (B, L, d_t)``; ``projection`` maps ``d_s -> d_t`` (required when the
    widths differ; see :class:`HiddenProjection`).

    Example::

        >>> import torch
        >>> from attnkit.distill import hidden_mse
        >>> float(hidden_mse(torch.ones(1, 2, 3), torch.zeros(1, 2, 3)))
        1.0
    """
    if student.dim() != 3 or teacher.dim() != 3 or student.shape[:2] != teacher.shape[:2]:
        raise ValueError(
            f"hidden states must be (B, L, d) with the same B and L, got student "
            f"{tuple(student.shape)} and teacher {tuple(teacher.shape)}"
        )
    h = student if projection is None else projection(student)
    if h.shape[-1] != teacher.shape[-1]:
        raise ValueError(
            f"student width {student.shape[-1]} != teacher width {teacher.shape[-1]}: pass a "
            f"projection (HiddenProjection({student.shape[-1]}, {teacher.shape[-1]}))"
        )
    err = (h.float() - teacher.detach().float()).pow(2).mean(-1)  # (B, L)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != err.shape:
            raise ValueError(
                f"mask must be a bool tensor of shape {tuple(err.shape)}, got "
                f"{getattr(mask, 'shape', type(mask).__name__)}"
            )
        err = err[mask]
    return err.mean()


# ------------------------------------------------------------------------------------- attention maps


def attention_kl(student, teacher, *, heads: str = "mean", chunk_rows: int | None = None) -> Tensor:
    """Attention transfer: ``mean_rows KL(A_t || A_s)`` between teacher and student attention distributions.

    ``student`` and ``teacher`` are each an :class:`AttentionRecord` (weights recomputed from ``q, k`` a block
    of ``chunk_rows`` query rows at a time: the full ``(B, H, Lq, Lk)`` weights are never held) or the weights
    themselves, a tensor ``(B, H, Lq, Lk)`` (e.g. a Hugging Face model's ``output_attentions``).  Both cover
    the same ``B, Lq, Lk``; the head counts may differ:

    * ``heads="mean"``: ``A = mean_h A_h`` on each side (any head counts);
    * ``heads="map"``: student head ``i`` against the mean of teacher heads ``i m .. i m + m - 1``
      (``m = Ht / Hs``, an integer; ``m = 1`` is one-to-one).

    Where the student may attend to fewer keys than the teacher (a sparse student of a dense teacher), the
    teacher's row is renormalised over the keys the student may see: the closest distribution the student can
    express.  A row counts when the teacher puts weight on a key the student can see.  With gradients and more
    than one block, each block is recomputed in the backward pass.  Zero when the two attend alike.

    Example::

        >>> import math, torch
        >>> from attnkit.distill import attention_kl
        >>> t = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])  # (B=1, H=1, Lq=2, Lk=2)
        >>> s = torch.tensor([[[[1.0, 0.0], [0.75, 0.25]]]])
        >>> expected = (0 + 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)) / 2
        >>> abs(float(attention_kl(s, t)) - expected) < 1e-6
        True
    """
    choice(
        "heads",
        heads,
        ("mean", "map"),
        fix=": 'mean' averages each side's heads, 'map' sets student head i against a group of Ht/Hs teacher heads",
    )
    s_call, s_w = _as_attention("student", student)
    t_call, t_w = _as_attention("teacher", teacher)
    s_shape = s_w.shape if s_w is not None else (s_call.batch, s_call.heads, s_call.q_len, s_call.kv_len)
    t_shape = t_w.shape if t_w is not None else (t_call.batch, t_call.heads, t_call.q_len, t_call.kv_len)
    if (s_shape[0], *s_shape[2:]) != (t_shape[0], *t_shape[2:]):
        raise ValueError(
            f"student attention (B, H, Lq, Lk)={tuple(s_shape)} and teacher {tuple(t_shape)} differ in "
            f"B, Lq or Lk: feed both models the same batch"
        )
    Hs, Ht = s_shape[1], t_shape[1]
    if heads == "map" and Ht % Hs:
        raise ValueError(
            f"heads='map' needs the teacher's heads to be a multiple of the student's, got Ht={Ht}, "
            f"Hs={Hs}: use heads='mean'"
        )
    B, _, Lq, Lk = s_shape

    def block(r0: int, r1: int):
        with torch.no_grad():
            if t_call is not None:
                log_t = _log_softmax(_scores(t_call, r0, r1, s_call))  # (B, Ht, r, Lk)
            else:
                w = t_w[:, :, r0:r1].detach().float()
                if s_call is not None and s_call.mask is not None:
                    w = w * _allowed(s_call, r0, r1)
                w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
                log_t = torch.where(w > 0, w.clamp_min(1e-30).log(), torch.full_like(w, float("-inf")))
            log_t = _merge_heads(log_t, 1 if heads == "mean" else Hs)
        if s_call is not None:
            log_s = _log_softmax(_scores(s_call, r0, r1, None))  # (B, Hs, r, Lk)
        else:
            w = s_w[:, :, r0:r1].float()
            log_s = torch.where(w > 0, w.clamp_min(1e-30).log(), torch.full_like(w, float("-inf")))
        if heads == "mean":
            log_s = _merge_heads(log_s, 1)
        return _kl_rows(log_t, log_s)

    step = _row_step(Lq, B * max(Hs, Ht) * Lk, chunk_rows)
    tensors = (s_call.q, s_call.k) if s_call is not None else (s_w,)
    return _chunked(block, Lq, step, tensors)


def _merge_heads(log_w: Tensor, groups: int) -> Tensor:
    """``log(mean over each of `groups` consecutive groups of heads of w)``: ``(B, H, r, Lk) -> (B, groups, r, Lk)``."""
    B, H, r, Lk = log_w.shape
    if H == groups:
        return log_w
    g = log_w.view(B, groups, H // groups, r, Lk)  # (B, groups, m, r, Lk)
    return _logsumexp(g, 2).squeeze(2) - math.log(H // groups)


def _as_attention(name: str, x) -> tuple[Call | None, Tensor | None]:
    if isinstance(x, AttentionRecord):
        return x._call, None
    if isinstance(x, Tensor) and x.is_floating_point() and x.dim() == 4:
        return None, x
    raise TypeError(
        f"{name} must be an AttentionRecord (see attnkit.distill.capture) or attention weights "
        f"(B, H, Lq, Lk), got {type(x).__name__}{tuple(x.shape) if isinstance(x, Tensor) else ''}"
    )


# ------------------------------------------------------------------------------------------ relations


def relation_kl(
    student: Tensor, teacher: Tensor, *, relation_heads: int | None = None, mask=None, chunk_rows: int | None = None
) -> Tensor:
    """MiniLMv2 relation transfer: ``mean_rows KL(R_t || R_s)`` of self-relations of queries, keys or values.

    ``student (B, Hs, L, ds)`` and ``teacher (B, Ht, L, dt)`` are one layer's queries (or keys, or values) of
    each model.  Each side's heads are concatenated to ``(B, L, H d)`` and split again into ``R =
    relation_heads`` relation heads ``X_r (B, L, H d / R)``; the relation of positions ``i, j`` is
    ``R[r, i] = softmax_j(X_r[i] . X_r[j] / sqrt(H d / R))``.  So the two models may have different head
    counts and widths: only ``R`` must divide both ``Hs ds`` and ``Ht dt`` (default ``gcd(Hs, Ht)``).
    ``mask`` (an :class:`attnkit.masks.Mask`, a bool tensor broadcastable to ``(B, 1, L, L)``, or None)
    restricts which ``j`` each ``i`` relates to, on both sides (e.g. causal, key padding).  Computed in blocks
    of ``chunk_rows`` rows (recomputed in the backward pass), never holding ``(B, R, L, L)``.  Use it three
    times for MiniLMv2's q-q, k-k and v-v relations.

    Example::

        >>> import torch
        >>> from attnkit.distill import relation_kl
        >>> q_t = torch.randn(2, 4, 6, 16)  # teacher: 4 heads of 16
        >>> float(relation_kl(q_t, q_t))
        0.0
        >>> q_s = torch.randn(2, 2, 6, 8, requires_grad=True)  # student: 2 heads of 8
        >>> relation_kl(q_s, q_t, relation_heads=2).backward(); q_s.grad.shape
        torch.Size([2, 2, 6, 8])
    """
    for name, x in (("student", student), ("teacher", teacher)):
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != 4:
            raise TypeError(
                f"{name} must be a float tensor (B, H, L, d) of queries, keys or values, got "
                f"{type(x).__name__}{tuple(x.shape) if isinstance(x, Tensor) else ''}"
            )
    if student.shape[0] != teacher.shape[0] or student.shape[2] != teacher.shape[2]:
        raise ValueError(
            f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)} differ in B or L: "
            f"feed both models the same batch"
        )
    B, Hs, L, ds = student.shape
    Ht, dt = teacher.shape[1], teacher.shape[3]
    R = math.gcd(Hs, Ht) if relation_heads is None else relation_heads
    if isinstance(R, bool) or not isinstance(R, int) or R < 1 or (Hs * ds) % R or (Ht * dt) % R:
        raise ValueError(
            f"relation_heads={R!r} must be a positive int dividing both widths, the student's "
            f"Hs*ds={Hs * ds} and the teacher's Ht*dt={Ht * dt} (e.g. {math.gcd(Hs, Ht)})"
        )
    xs, xt = _relation_heads(student, R), _relation_heads(teacher.detach(), R)  # (B, R, L, width / R)
    allowed = _relation_mask(mask, B, L, student.device)

    def scores(x: Tensor, r0: int, r1: int) -> Tensor:
        s = torch.matmul(x[:, :, r0:r1], x.transpose(-1, -2)) / math.sqrt(x.shape[-1])  # (B, R, r, L)
        if allowed is not None:
            s = s.masked_fill(~allowed(r0, r1), float("-inf"))
        return s

    def block(r0: int, r1: int):
        with torch.no_grad():
            log_t = _log_softmax(scores(xt, r0, r1))
        return _kl_rows(log_t, _log_softmax(scores(xs, r0, r1)))

    step = _row_step(L, B * R * L, chunk_rows)
    return _chunked(block, L, step, (student,))


def _relation_heads(x: Tensor, R: int) -> Tensor:
    B, H, L, d = x.shape
    acc = torch.promote_types(accumulation_dtype(x.dtype), torch.float32)
    cat = x.transpose(1, 2).reshape(B, L, H * d)  # (B, L, H d): every head side by side
    return cat.view(B, L, R, H * d // R).transpose(1, 2).to(acc)  # (B, R, L, H d / R)


def _relation_mask(mask, B: int, L: int, device):
    """A function ``(r0, r1) -> bool (B|1, 1, r, L)``, or None for no mask."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        mod = mask.mask_mod(L, L)
        b = torch.arange(B, device=device).view(-1, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
        cols = torch.arange(L, device=device).view(1, 1, 1, -1)
        return lambda r0, r1: mod(b, h, torch.arange(r0, r1, device=device).view(1, 1, -1, 1), cols).expand(
            -1, 1, r1 - r0, L
        )
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:
        try:
            full = mask.expand(B, 1, L, L) if mask.dim() <= 4 else None
        except RuntimeError:
            full = None
        if full is None:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (B, 1, L, L)=({B}, 1, {L}, {L})")
        return lambda r0, r1: full[:, :, r0:r1]
    raise TypeError(f"mask must be None, an attnkit.masks.Mask or a bool tensor, got {type(mask).__name__}")
