"""The tracer behind :mod:`attnkit.explain`: the four steps of attention computed in float64 with every
intermediate kept, and printed with the first row's arithmetic written term by term."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .. import _checks
from ..masks import Mask

Tensor = torch.Tensor

# ----------------------------------------------------------------------------- formatting


def _num(x: float, digits: int = 4) -> str:
    """A number as a person writes it: at most ``digits`` decimals, trailing zeros dropped (``1.0``)."""
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if math.isnan(x):
        return "nan"
    if x != 0 and abs(x) < 10**-digits:  # tiny: keep `digits` significant digits, still in fixed notation
        digits = min(18, digits - 1 - math.floor(math.log10(abs(x))))
    s = f"{x:.{digits}f}".rstrip("0")
    s = s + "0" if s.endswith(".") else s
    return "0.0" if s == "-0.0" else s


def _factor(x: float, digits: int = 4) -> str:
    s = _num(x, digits)
    return f"({s})" if s.startswith("-") else s


def _vec(xs: Sequence[float], digits: int = 4) -> str:
    return "[" + ", ".join(_num(float(x), digits) for x in xs) + "]"


def _mat(t: Tensor, digits: int = 4, indent: str = "      ") -> str:
    """A matrix on one line, or one row a line with the rows aligned under the first (``indent`` is what
    precedes the matrix on its first line)."""
    rows = [_vec(r, digits) for r in t.tolist()]
    one = "[" + ", ".join(rows) + "]"
    if len(one) <= 78:
        return one
    return "[" + (",\n" + " " * (len(indent) + 1)).join(rows) + "]"


def _assigned(prefix: str, t: Tensor, digits: int) -> str:
    return prefix + _mat(t, digits, prefix)


def _terms(pairs: Sequence[tuple[float, float]], digits: int = 4, keep: int = 6) -> tuple[str, str]:
    """``a1*b1 + a2*b2 + ...`` and ``p1 + p2 + ...`` (products), eliding the middle of long sums."""
    prods = [a * b for a, b in pairs]
    if len(pairs) > keep:
        head = [f"{_factor(a, digits)}*{_factor(b, digits)}" for a, b in pairs[: keep - 1]]
        tail = f"{_factor(pairs[-1][0], digits)}*{_factor(pairs[-1][1], digits)}"
        more = f"... ({len(pairs) - keep} more) ..."
        written = " + ".join(head + [more, tail])
        psum = " + ".join([_num(p, digits) for p in prods[: keep - 1]] + [more, _num(prods[-1], digits)])
    else:
        written = " + ".join(f"{_factor(a, digits)}*{_factor(b, digits)}" for a, b in pairs)
        psum = _num(prods[0], digits) if prods else "0"
        for p in prods[1:]:
            psum += f" - {_num(-p, digits)}" if p < 0 else f" + {_num(p, digits)}"
    return written, psum


# --------------------------------------------------------------------------- input checks


def as_matrix(name: str, value, *, ndim: tuple[int, ...] = (2,), masked_ok: bool = False) -> Tensor:
    """A float64 tensor from a tensor or nested lists, with a clear error for anything else."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold real numbers, got dtype {t.dtype}")
        t = t.to(torch.float64)
    else:
        try:
            t = torch.tensor(plain(value), dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(
                f"{name} must be a tensor or a nested list of numbers with equal-length rows, got {short(value)} ({e})"
            ) from None
    if t.dim() not in ndim:
        want = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): give at least one number per row")
    if masked_ok and not bool((torch.isnan(t) | (t == float("inf"))).any()):
        return t  # -inf marks a masked score (weight 0), as explain_softmax reads it
    if not bool(torch.isfinite(t).all()):
        raise ValueError(
            f"{name} must hold finite numbers{' or -inf (masked)' if masked_ok else ''}, got {short(t.tolist())}"
        )
    return t


def plain(value):
    """Nested lists of floats from nested lists of numbers or written numbers (strings)."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a number") from None
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{value!r} is not a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{short(value)} is not a number") from None


def short(value) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _check_scale(scale) -> float | None:
    if scale is None:
        return None
    return _checks.number("scale", scale, fix=" (or None for 1/sqrt(d_k))")


def _mask_tensor(mask) -> Tensor:
    """A tensor from a mask given as a tensor, a numpy array, or nested lists of bools (JSON true/false) or
    numbers; the values are checked by the caller."""
    if isinstance(mask, torch.Tensor):
        return mask.detach()
    if hasattr(mask, "__array__") and not isinstance(mask, (list, tuple)):  # a numpy array
        try:
            return torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"mask must be bool or 0/1 (1 = may attend), got {short(mask)} ({e})") from None

    def bools_as_floats(v):
        if isinstance(v, (list, tuple)):
            return [bools_as_floats(x) for x in v]
        return float(v) if isinstance(v, bool) else plain(v)

    try:
        return torch.tensor(bools_as_floats(mask), dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"mask must be an (L, L) matrix of bools or 0/1 with equal-length rows, got {short(mask)} ({e})"
        ) from None


def _dense_mask(mask, length: int) -> Tensor | None:
    """``(L, L)`` bool from None, a Mask, a tensor or numpy array, nested lists of bools or 0/1, or the word
    ``"causal"``."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(
                f"mask={mask!r}: the only mask given by name is 'causal'; pass an attnkit Mask or "
                f"an (L, L) bool matrix for others"
            )
        from ..masks import causal

        mask = causal()
    if isinstance(mask, Mask):
        return mask.to_dense(length, length)[0, 0]
    t = _mask_tensor(mask)
    if t.dtype != torch.bool:
        if t.is_complex() or not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"mask must be bool or 0/1 (1 = may attend), got {short(t.tolist())}")
        t = t.bool()
    while t.dim() > 2 and t.shape[0] == 1:
        t = t[0]
    if tuple(t.shape) != (length, length):
        raise ValueError(f"mask must have shape (L, L)=({length}, {length}), got {tuple(t.shape)}")
    return t.cpu()


# -------------------------------------------------------------------------------- steps


@dataclass
class SoftmaxSteps:
    """Softmax written out: ``weights = exp(s - m) / sum(exp(s - m))`` for each row.

    Attributes:
        scores: ``(R, L)`` float64 input rows (``-inf`` where masked).
        shift: ``(R,)`` the value ``m`` subtracted before ``exp`` (0 when the scores are close enough to 0 to
            show plain ``exp(s)``, as the article does; the row maximum otherwise, against over- and underflow).
        exps: ``(R, L)`` ``exp(s - m)``; sums: ``(R,)``; weights: ``(R, L)``, each row sums to 1
            (a fully masked row is all zeros).

    Example::

        >>> from attnkit.explain import explain_softmax
        >>> steps = explain_softmax([0.0, float("-inf")])
        >>> steps.exps.tolist(), steps.weights.tolist()
        ([[1.0, 0.0]], [[1.0, 0.0]])
    """

    scores: Tensor
    shift: Tensor
    exps: Tensor
    sums: Tensor
    weights: Tensor
    digits: int = 4

    def explain(self, row: int = 0) -> str:
        """The arithmetic of one row (0-based) as text."""
        d = self.digits
        s, m = self.scores[row].tolist(), float(self.shift[row])
        e, total, w = self.exps[row].tolist(), float(self.sums[row]), self.weights[row].tolist()
        lines = []
        if m != 0.0:
            lines.append(
                f"subtract the row maximum m = {_num(m, d)} first (the largest exp is then exp(0) = 1: "
                f"nothing overflows and the sum cannot underflow to 0; the weights do not change)"
            )
        for _j, (sj, ej) in enumerate(zip(s, e)):
            arg = _num(sj, d) if m == 0.0 else f"{_num(sj, d)} - {_factor(m, d)}"
            note = "   (masked)" if math.isinf(sj) else ""
            lines.append(f"exp({arg}) = {_num(ej, d)}{note}")
        lines.append("sum = " + " + ".join(_num(x, d) for x in e) + f" = {_num(total, d)}")
        if total == 0.0:
            lines.append("weights = all 0: nothing may be attended to (never NaN)")
        else:
            lines.append("weights = [" + ", ".join(f"{_num(x, d)}/{_num(total, d)}" for x in e) + "]")
            lines.append(f"        = {_vec(w, d)}   (sum {_num(sum(w), d)})")
        return "\n".join(lines)

    def __str__(self) -> str:
        rows = self.scores.shape[0]
        parts = []
        for r in range(rows):
            head = f"softmax({_vec(self.scores[r].tolist(), self.digits)})" + (f", row {r + 1}" if rows > 1 else "")
            parts.append(head + "\n" + "\n".join("  " + x for x in self.explain(r).splitlines()))
        return "\n".join(parts)


@dataclass
class WeightedSum:
    """The weighted sum ``output_i = sum_j weights[i, j] * values[j]`` written out.

    Attributes:
        weights: ``(R, L)``; values: ``(L, Dv)``; output: ``(R, Dv)``, all float64.

    Example::

        >>> from attnkit.explain import explain_weighted_sum
        >>> explain_weighted_sum([1.0, 0.0], [[1.0, 2.0], [3.0, 4.0]]).output.tolist()
        [[1.0, 2.0]]
    """

    weights: Tensor
    values: Tensor
    output: Tensor
    digits: int = 4

    def explain(self, row: int = 0, name: str = "output") -> str:
        """The arithmetic of one output row (0-based) as text."""
        d = self.digits
        w, v = self.weights[row].tolist(), self.values.tolist()
        keep = [(j, wj) for j, wj in enumerate(w) if wj != 0.0] or [(0, 0.0)]
        lhs = f"{name}{row + 1} = "
        pad = " " * (len(lhs) - 2)
        terms = " + ".join(f"{_num(wj, d)}*{_vec(v[j], d)}" for j, wj in keep)
        parts = " + ".join(_vec([wj * x for x in v[j]], d) for j, wj in keep)
        return f"{lhs}{terms}\n{pad}= {parts}\n{pad}= {_vec(self.output[row].tolist(), d)}"

    def __str__(self) -> str:
        return "\n".join(self.explain(r) for r in range(self.weights.shape[0]))


def softmax_rows(scores: Tensor, digits: int = 4) -> SoftmaxSteps:
    finite = torch.where(torch.isinf(scores), torch.zeros_like(scores), scores)
    big = finite.abs().amax(dim=-1) > 30  # exp(+-30) ~ 1e13 or 1e-13: past that, show the stable form
    rowmax = scores.amax(dim=-1)
    shift = torch.where(big & torch.isfinite(rowmax), rowmax, torch.zeros_like(rowmax))
    exps = torch.exp(scores - shift[:, None])  # (R, L); exp(-inf) = 0 where masked
    sums = exps.sum(-1)  # (R,)
    weights = exps / torch.where(sums == 0, torch.ones_like(sums), sums)[:, None]
    return SoftmaxSteps(scores, shift, exps, sums, weights, digits)


def explain_softmax(scores, *, digits: int = 4) -> SoftmaxSteps:
    """Softmax of one row ``(L,)`` or of each row of ``(R, L)``, every step kept and printable.

    ``-inf`` entries are masked (weight 0).  Printing shows ``exp`` of each score, their sum and the
    division, as the article does; when a score is far from 0 (``|s| > 30``: ``exp`` would overflow for large
    scores, or every ``exp`` underflow towards 0 for very negative ones, e.g. ``[-1000, -999]``) the row maximum
    is subtracted first.

    Example::

        >>> from attnkit.explain import explain_softmax
        >>> s = explain_softmax([2.0, -1.0, 0.5])
        >>> [round(x, 3) for x in s.weights[0].tolist()]
        [0.786, 0.039, 0.175]
        >>> print(s)
        softmax([2.0, -1.0, 0.5])
          exp(2.0) = 7.3891
          exp(-1.0) = 0.3679
          exp(0.5) = 1.6487
          sum = 7.3891 + 0.3679 + 1.6487 = 9.4057
          weights = [7.3891/9.4057, 0.3679/9.4057, 1.6487/9.4057]
                  = [0.7856, 0.0391, 0.1753]   (sum 1.0)
    """
    if isinstance(scores, torch.Tensor):
        t = scores.detach().to(torch.float64)
    else:
        try:
            t = torch.tensor(plain(scores), dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"scores must be a tensor or a list of numbers, got {short(scores)} ({e})") from None
    if t.dim() not in (1, 2) or t.shape[-1] == 0:
        raise ValueError(f"scores must be 1-D (L,) or 2-D (R, L) with L >= 1, got shape {tuple(t.shape)}")
    if bool(torch.isnan(t).any()) or bool((t == float("inf")).any()):
        raise ValueError("scores must be finite numbers or -inf (masked)")
    return softmax_rows(t.view(-1, t.shape[-1]), digits)


def explain_weighted_sum(weights, values, *, digits: int = 4) -> WeightedSum:
    """The weighted sum of value vectors: ``weights (L,)`` or ``(R, L)`` with ``values (L, Dv)``.

    Example::

        >>> from attnkit.explain import explain_weighted_sum
        >>> print(explain_weighted_sum([0.5, 0.25, 0.25], [[0.1, 0.2], [0.3, -0.1], [-0.2, 0.4]]))
        output1 = 0.5*[0.1, 0.2] + 0.25*[0.3, -0.1] + 0.25*[-0.2, 0.4]
                = [0.05, 0.1] + [0.075, -0.025] + [-0.05, 0.1]
                = [0.075, 0.175]
    """
    w = as_matrix("weights", weights, ndim=(1, 2))
    v = as_matrix("values", values)
    w = w.view(-1, w.shape[-1])  # (R, L)
    if w.shape[-1] != v.shape[0]:
        raise ValueError(
            f"weights have {w.shape[-1]} entries per row but there are {v.shape[0]} value vectors: "
            f"give one weight per value"
        )
    return WeightedSum(w, v, w @ v, digits)


@dataclass
class Trace:
    """Every intermediate of single-head attention on one sequence, in float64.

    Attributes:
        x: ``(L, d_model)`` token embeddings (one row per token).
        w_q, w_k: ``(d_model, d_k)``; w_v: ``(d_model, d_v)``.
        q, k: ``(L, d_k)``; v: ``(L, d_v)`` — ``q = x @ w_q`` and so on (the article's ``Q = x·W_q``).
        scores: ``(L, L)`` ``q @ k^T`` (step 1, similarity).
        scale: the factor of step 2 (``1/sqrt(d_k)`` unless given).
        scaled_scores: ``(L, L)`` ``scores * scale``, ``-inf`` where the mask forbids (step 2).
        weights: ``(L, L)`` the softmax of each row (step 3); rows sum to 1 (0 for a fully masked row).
        output: ``(L, d_v)`` ``weights @ v`` (step 4).
        mask: ``(L, L)`` bool (True = may attend) or None.
        default_scale: whether ``scale`` is ``1/sqrt(d_k)``.

    ``print(trace)`` walks the four steps with row 1 written out; :meth:`explain` does any row.

    Example::

        >>> from attnkit.explain import trace
        >>> t = trace([[1.0, 0.0], [0.0, 1.0]], [[1.0], [0.0]], [[1.0], [0.0]], [[1.0], [2.0]], mask="causal")
        >>> t.scaled_scores.tolist(), t.output.tolist()
        ([[1.0, -inf], [0.0, 0.0]], [[1.0], [1.5]])
    """

    x: Tensor
    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    scores: Tensor
    scale: float
    scaled_scores: Tensor
    weights: Tensor
    output: Tensor
    mask: Tensor | None = None
    default_scale: bool = True
    digits: int = field(default=4, repr=False)

    def softmax_steps(self) -> SoftmaxSteps:
        """Step 3 of every row as :class:`SoftmaxSteps`."""
        return softmax_rows(self.scaled_scores, self.digits)

    def explain(self, row: int = 0) -> str:
        """The four steps as text, with the arithmetic of query row ``row`` (0-based) written out."""
        L, dm = self.x.shape
        _checks.int_in_range("row", row, 0, L, fix=f" (rows are 0-based; printed as x1..x{L})")
        d, i, n = self.digits, row, row + 1
        dk, dv = self.q.shape[1], self.v.shape[1]
        out = [
            f"Attention in four steps: L={L} tokens, d_model={dm}, d_k={dk}, d_v={dv} (computed in float64)",
            "",
            "Inputs (one row per token)",
        ]
        for name, t in (("X", self.x), ("W_q", self.w_q), ("W_k", self.w_k), ("W_v", self.w_v)):
            out.append(_assigned(f"  {name} ({t.shape[0]}x{t.shape[1]}) = ", t, d))
        if self.mask is not None:
            out.append("  mask (█ may attend, · may not):")
            out += ["    " + "".join("█" if b else "·" for b in r) for r in self.mask.tolist()]
        out += ["", "Projections: Q = X·W_q, K = X·W_k, V = X·W_v"]
        xi = self.x[i].tolist()
        for name, w, res in (("Q", self.w_q, self.q), ("K", self.w_k, self.k), ("V", self.w_v, self.v)):
            for c in range(w.shape[1]):
                written, psum = _terms(list(zip(xi, w[:, c].tolist())), d)
                out.append(f"  {name}{n}[{c + 1}] = x{n}·W_{name.lower()}[:, {c + 1}] = {written}")
                out.append(f"        = {psum} = {_num(float(res[i, c]), d)}")
            if name == "Q":
                out.append("  (the other rows and K, V the same way)")
                break
        for name, t in (("Q", self.q), ("K", self.k), ("V", self.v)):
            out.append(_assigned(f"  {name} = ", t, d))
        out += ["", f"Step 1, similarity: score(x{n}, xj) = Q{n}·Kj"]
        qi = self.q[i].tolist()
        for j in range(L):
            written, psum = _terms(list(zip(qi, self.k[j].tolist())), d)
            out.append(f"  score(x{n},x{j + 1}) = {written} = {psum} = {_num(float(self.scores[i, j]), d)}")
        out.append(_assigned("  scores = Q·K^T = ", self.scores, d))
        if self.default_scale:
            out += [
                "",
                f"Step 2, scaling: divide by sqrt(d_k) = sqrt({dk}) = {_num(math.sqrt(dk), d)} "
                f"(keeps softmax out of its flat, saturated region)",
            ]
        else:
            out += ["", f"Step 2, scaling: multiply by the given scale {_num(self.scale, d)}"]
        for j in range(L):
            s, ss = float(self.scores[i, j]), float(self.scaled_scores[i, j])
            op = f"{_num(s, d)} / sqrt({dk})" if self.default_scale else f"{_num(s, d)} * {_factor(self.scale, d)}"
            masked = self.mask is not None and not bool(self.mask[i, j])
            out.append(
                f"  scaled(x{n},x{j + 1}) = "
                + (f"-inf   (masked: x{n} may not attend to x{j + 1})" if masked else f"{op} = {_num(ss, d)}")
            )
        out.append(_assigned("  scaled_scores = ", self.scaled_scores, d))
        out += ["", f"Step 3, softmax: weight(x{n}, xj) = exp(scaled(x{n}, xj)) / sum_k exp(scaled(x{n}, xk))"]
        out += ["  " + line for line in self.softmax_steps().explain(i).splitlines()]
        out.append(_assigned("  weights = ", self.weights, d))
        out += ["", f"Step 4, weighted sum: output{n} = sum_j weight(x{n}, xj) * Vj"]
        ws = WeightedSum(self.weights, self.v, self.output, d)
        out += ["  " + line for line in ws.explain(i).splitlines()]
        out.append(_assigned("  output = ", self.output, d))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.explain(0)


def trace(x, w_q, w_k, w_v, *, mask=None, scale: float | None = None) -> Trace:
    """Single-head attention on one sequence with every intermediate kept (float64).

    Args:
        x: ``(L, d_model)`` token embeddings, a tensor or nested lists.
        w_q, w_k: ``(d_model, d_k)`` projections; w_v: ``(d_model, d_v)``.
        mask: None, an :class:`attnkit.masks.Mask`, an ``(L, L)`` bool (or 0/1) matrix, or ``"causal"``;
            True means "may attend".
        scale: the factor of step 2; default ``1/sqrt(d_k)``.

    Returns:
        A :class:`Trace`; ``print`` it to see the four steps written out.  Its ``output`` equals
        ``attnkit.attention(q, k, v, mask=mask, scale=scale)`` for the projected ``q, k, v``.

    Example::

        >>> from attnkit.explain import trace, ARTICLE
        >>> t = trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"])
        >>> [round(x, 4) for x in t.q[0].tolist()], [round(x, 4) for x in t.output[0].tolist()]
        ([0.14, 0.69], [0.2657, -0.0702])
        >>> print([line for line in str(t).splitlines() if line.startswith("  Q1[1]")][0])
          Q1[1] = x1·W_q[:, 1] = 1.0*0.1 + 0.5*(-0.2) + (-0.2)*0.5 + 1.2*0.2
    """
    X = as_matrix("x", x)
    Wq, Wk, Wv = as_matrix("w_q", w_q), as_matrix("w_k", w_k), as_matrix("w_v", w_v)
    L, dm = X.shape
    if L == 0 or dm == 0:
        raise ValueError(f"x must have at least one token and one feature, got shape {tuple(X.shape)}")
    for name, w in (("w_q", Wq), ("w_k", Wk), ("w_v", Wv)):
        if w.shape[0] != dm:
            raise ValueError(
                f"{name} has {w.shape[0]} rows but x has d_model={dm} columns: {name} must be "
                f"(d_model, d_out) so that x @ {name} works"
            )
        if w.shape[1] == 0:
            raise ValueError(f"{name} must have at least one column, got shape {tuple(w.shape)}")
    if Wq.shape[1] != Wk.shape[1]:
        raise ValueError(f"w_q and w_k must give the same d_k, got {Wq.shape[1]} and {Wk.shape[1]} columns")
    given = _check_scale(scale)
    dense = _dense_mask(mask, L)
    q, k, v = X @ Wq, X @ Wk, X @ Wv  # (L, d_k), (L, d_k), (L, d_v)
    factor = 1.0 / math.sqrt(q.shape[1]) if given is None else given
    scores = q @ k.T  # (L, L)
    scaled = scores * factor
    if dense is not None:
        scaled = scaled.masked_fill(~dense, float("-inf"))
    weights = softmax_rows(scaled).weights  # (L, L)
    return Trace(X, Wq, Wk, Wv, q, k, v, scores, factor, scaled, weights, weights @ v, dense, given is None)
