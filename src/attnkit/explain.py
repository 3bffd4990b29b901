"""Attention worked by hand: every intermediate of the four steps, written out, and checks of hand work.

The first source article teaches single-head attention by computing a small example by hand:
project the tokens to ``Q, K, V``; (1) similarity ``scores = Q K^T``; (2) scaling by ``1/sqrt(d_k)``;
(3) softmax; (4) the weighted sum of the values.  :func:`trace` does the same computation in float64,
keeps every intermediate in a :class:`Trace`, and printing it walks the four steps with the first row's
arithmetic written term by term.  :func:`explain_softmax` and :func:`explain_weighted_sum` do one step.

:func:`check` compares hand-computed claims with the exact values.  Each claim is read at the precision it
is written in (``0.240`` claims three decimals) and checked twice: against the exact values from the
inputs, and against what follows from the claimed values of the previous steps.  A slip early on is
reported once, where it happened; later steps that follow correctly from it are shown as inherited.

Rows are numbered from 1 in printed text (``x1``, ``Q1``), as in the article; indices in Python and in
claim names (``"scores[0]"``) start at 0.

Example::

    >>> from attnkit import explain
    >>> t = explain.trace(explain.ARTICLE["X"], explain.ARTICLE["W_q"], explain.ARTICLE["W_k"],
    ...                   explain.ARTICLE["W_v"])
    >>> [round(x, 4) for x in t.weights[0].tolist()]
    [0.4498, 0.248, 0.3023]
    >>> print(str(t).splitlines()[0])
    Attention in four steps: L=3 tokens, d_model=4, d_k=2, d_v=2 (computed in float64)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .masks import Mask

Tensor = torch.Tensor

__all__ = [
    "ARTICLE",
    "ARTICLE_CLAIMS",
    "Trace",
    "SoftmaxSteps",
    "WeightedSum",
    "ClaimResult",
    "CheckReport",
    "trace",
    "explain_softmax",
    "explain_weighted_sum",
    "check",
    "load_claims",
]

# The worked example of the first article, section 3: three tokens ("cat chases mouse") in d_model = 4,
# one head with d_k = d_v = 2.
ARTICLE: dict[str, list] = {
    "X": [[1.0, 0.5, -0.2, 1.2], [0.3, -1.0, 0.8, 0.4], [-0.7, 0.6, 1.1, -0.5]],
    "W_q": [[0.1, 0.4], [-0.2, 0.3], [0.5, -0.1], [0.2, 0.1]],
    "W_k": [[-0.3, 0.2], [0.1, 0.5], [0.4, -0.2], [-0.1, 0.3]],
    "W_v": [[0.2, -0.1], [0.3, 0.4], [-0.2, 0.1], [0.5, -0.3]],
}

# The result of every step the article states, transcribed as written (strings keep the written precision):
# section 3 for the example above (Q, K, V and row 1 of each later step), and the one-row softmax and weighted
# sum of sections 2.3 and 2.4.  The arithmetic inside a step (the products, the sum of the exponentials, the
# terms of the weighted sum) is left out: check() takes step results.
# Nothing here says which claims are right: check() finds that by computing.
ARTICLE_CLAIMS: dict[str, Any] = {
    **ARTICLE,
    "Q": [["0.14", "0.69"], ["-0.38", "0.07"], ["0.25", "-0.43"]],
    "K": [["-0.24", "0.33"], ["0.12", "-0.45"], ["0.29", "0.67"]],
    "V": [["0.21", "0.02"], ["0.16", "0.31"], ["-0.25", "0.38"]],
    "scores[0]": ["0.194", "-0.294", "0.503"],
    "scaled_scores[0]": ["0.137", "-0.208", "0.356"],
    "exp_scores[0]": ["1.147", "0.812", "1.427"],
    "weights[0]": ["0.339", "0.240", "0.421"],
    "output[0]": ["0.004", "0.241"],
    "softmax": [{
        "scores": [2.0, -1.0, 0.5],
        "weights": ["0.70", "0.04", "0.26"],
        "values": [[0.1, 0.2], [0.3, -0.1], [-0.2, 0.4]],
        "output": ["0.03", "0.24"],
    }],
}


# ----------------------------------------------------------------------------- formatting


def _num(x: float, digits: int = 4) -> str:
    """A number as a person writes it: at most ``digits`` decimals, trailing zeros dropped (``1.0``)."""
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if math.isnan(x):
        return "nan"
    if x != 0 and abs(x) < 10 ** -digits:  # tiny: keep `digits` significant digits, still in fixed notation
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


def _as_matrix(name: str, value, *, ndim: tuple[int, ...] = (2,), masked_ok: bool = False) -> Tensor:
    """A float64 tensor from a tensor or nested lists, with a clear error for anything else."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold real numbers, got dtype {t.dtype}")
        t = t.to(torch.float64)
    else:
        try:
            t = torch.tensor(_plain(value), dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{name} must be a tensor or a nested list of numbers with equal-length rows, "
                             f"got {_short(value)} ({e})") from None
    if t.dim() not in ndim:
        want = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): give at least one number per row")
    if masked_ok and not bool((torch.isnan(t) | (t == float("inf"))).any()):
        return t  # -inf marks a masked score (weight 0), as explain_softmax reads it
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must hold finite numbers{' or -inf (masked)' if masked_ok else ''}, got "
                         f"{_short(t.tolist())}")
    return t


def _plain(value):
    """Nested lists of floats from nested lists of numbers or written numbers (strings)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
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
        raise ValueError(f"{_short(value)} is not a number") from None


def _short(value) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _check_scale(scale) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(float(scale)):
        raise ValueError(f"scale={scale!r} must be a finite number (or None for 1/sqrt(d_k))")
    return float(scale)


def _mask_tensor(mask) -> Tensor:
    """A tensor from a mask given as a tensor, a numpy array, or nested lists of bools (JSON true/false) or
    numbers; the values are checked by the caller."""
    if isinstance(mask, torch.Tensor):
        return mask.detach()
    if hasattr(mask, "__array__") and not isinstance(mask, (list, tuple)):  # a numpy array
        try:
            return torch.as_tensor(mask)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"mask must be bool or 0/1 (1 = may attend), got {_short(mask)} ({e})") from None

    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return float(v) if isinstance(v, bool) else _plain(v)

    try:
        return torch.tensor(plain(mask), dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"mask must be an (L, L) matrix of bools or 0/1 with equal-length rows, got "
                         f"{_short(mask)} ({e})") from None


def _dense_mask(mask, length: int) -> Tensor | None:
    """``(L, L)`` bool from None, a Mask, a tensor or numpy array, nested lists of bools or 0/1, or the word
    ``"causal"``."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask={mask!r}: the only mask given by name is 'causal'; pass an attnkit Mask or "
                             f"an (L, L) bool matrix for others")
        from .masks import causal
        mask = causal()
    if isinstance(mask, Mask):
        return mask.to_dense(length, length)[0, 0]
    t = _mask_tensor(mask)
    if t.dtype != torch.bool:
        if t.is_complex() or not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"mask must be bool or 0/1 (1 = may attend), got {_short(t.tolist())}")
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
            lines.append(f"subtract the row maximum m = {_num(m, d)} first (the largest exp is then exp(0) = 1: "
                         f"nothing overflows and the sum cannot underflow to 0; the weights do not change)")
        for j, (sj, ej) in enumerate(zip(s, e)):
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


def _softmax_steps(scores: Tensor, digits: int = 4) -> SoftmaxSteps:
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
            t = torch.tensor(_plain(scores), dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"scores must be a tensor or a list of numbers, got {_short(scores)} ({e})") from None
    if t.dim() not in (1, 2) or t.shape[-1] == 0:
        raise ValueError(f"scores must be 1-D (L,) or 2-D (R, L) with L >= 1, got shape {tuple(t.shape)}")
    if bool(torch.isnan(t).any()) or bool((t == float("inf")).any()):
        raise ValueError("scores must be finite numbers or -inf (masked)")
    return _softmax_steps(t.view(-1, t.shape[-1]), digits)


def explain_weighted_sum(weights, values, *, digits: int = 4) -> WeightedSum:
    """The weighted sum of value vectors: ``weights (L,)`` or ``(R, L)`` with ``values (L, Dv)``.

    Example::

        >>> from attnkit.explain import explain_weighted_sum
        >>> print(explain_weighted_sum([0.5, 0.25, 0.25], [[0.1, 0.2], [0.3, -0.1], [-0.2, 0.4]]))
        output1 = 0.5*[0.1, 0.2] + 0.25*[0.3, -0.1] + 0.25*[-0.2, 0.4]
                = [0.05, 0.1] + [0.075, -0.025] + [-0.05, 0.1]
                = [0.075, 0.175]
    """
    w = _as_matrix("weights", weights, ndim=(1, 2))
    v = _as_matrix("values", values)
    w = w.view(-1, w.shape[-1])  # (R, L)
    if w.shape[-1] != v.shape[0]:
        raise ValueError(f"weights have {w.shape[-1]} entries per row but there are {v.shape[0]} value vectors: "
                         f"give one weight per value")
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
        return _softmax_steps(self.scaled_scores, self.digits)

    def explain(self, row: int = 0) -> str:
        """The four steps as text, with the arithmetic of query row ``row`` (0-based) written out."""
        L, dm = self.x.shape
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < L:
            raise ValueError(f"row={row!r} must be an int in [0, {L}) (rows are 0-based; printed as x1..x{L})")
        d, i, n = self.digits, row, row + 1
        dk, dv = self.q.shape[1], self.v.shape[1]
        out = [f"Attention in four steps: L={L} tokens, d_model={dm}, d_k={dk}, d_v={dv} (computed in float64)",
               "", "Inputs (one row per token)"]
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
                out.append(f"  (the other rows and K, V the same way)")
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
            out += ["", f"Step 2, scaling: divide by sqrt(d_k) = sqrt({dk}) = {_num(math.sqrt(dk), d)} "
                        f"(keeps softmax out of its flat, saturated region)"]
        else:
            out += ["", f"Step 2, scaling: multiply by the given scale {_num(self.scale, d)}"]
        for j in range(L):
            s, ss = float(self.scores[i, j]), float(self.scaled_scores[i, j])
            op = f"{_num(s, d)} / sqrt({dk})" if self.default_scale else f"{_num(s, d)} * {_factor(self.scale, d)}"
            masked = self.mask is not None and not bool(self.mask[i, j])
            out.append(f"  scaled(x{n},x{j + 1}) = " + (f"-inf   (masked: x{n} may not attend to x{j + 1})"
                                                        if masked else f"{op} = {_num(ss, d)}"))
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
    X = _as_matrix("x", x)
    Wq, Wk, Wv = _as_matrix("w_q", w_q), _as_matrix("w_k", w_k), _as_matrix("w_v", w_v)
    L, dm = X.shape
    if L == 0 or dm == 0:
        raise ValueError(f"x must have at least one token and one feature, got shape {tuple(X.shape)}")
    for name, w in (("w_q", Wq), ("w_k", Wk), ("w_v", Wv)):
        if w.shape[0] != dm:
            raise ValueError(f"{name} has {w.shape[0]} rows but x has d_model={dm} columns: {name} must be "
                             f"(d_model, d_out) so that x @ {name} works")
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
    weights = _softmax_steps(scaled).weights  # (L, L)
    return Trace(X, Wq, Wk, Wv, q, k, v, scores, factor, scaled, weights, weights @ v, dense, given is None)


# ------------------------------------------------------------------------- checking claims


class _Written(float):
    """A float that remembers how it was written (for its precision)."""

    text: str

    def __new__(cls, text: str):
        obj = super().__new__(cls, float(text))
        obj.text = text
        return obj


def load_claims(text: str) -> dict:
    """Parse a claims file (JSON) keeping each number as written, so ``0.240`` claims three decimals.

    Example::

        >>> from attnkit.explain import load_claims
        >>> load_claims('{"weights[0]": [0.240, 1]}')["weights[0]"][0].text
        '0.240'
    """
    def bad_constant(name):
        raise ValueError(f"{name} is not allowed in a claims file: write numbers, or null to skip an entry")
    data = json.loads(text, parse_float=_Written, parse_int=_Written, parse_constant=bad_constant)
    if not isinstance(data, dict):
        raise ValueError(f"a claims file must hold a JSON object with keys X, W_q, W_k, W_v and claims, "
                         f"got {type(data).__name__}")
    return data


_FLOAT_RE = re.compile(r"^[+-]?(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?$")


def _decimals(value) -> int:
    """Decimal places a written number claims: ``"0.240"`` -> 3, ``"1.5e-3"`` -> 4, ``2`` -> 0."""
    if isinstance(value, _Written):
        text = value.text
    elif isinstance(value, str):
        text = value.strip()
    elif isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, float):
        text = repr(value)
    else:
        raise ValueError(f"{_short(value)} is not a number")
    m = _FLOAT_RE.match(text)
    if not m or not (m.group(1) or m.group(2)):
        if text.strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
            raise ValueError(f"{text!r} cannot be claimed: write null for a masked entry (-inf in the trace), "
                             f"which skips it")
        raise ValueError(f"{text!r} is not a number")
    return max(0, len(m.group(2) or "") - int(m.group(3) or 0))


@dataclass
class _Iv:
    """An interval ``[lo, hi]`` per element: the values a step can take given rounded claims."""

    lo: Tensor
    hi: Tensor

    @staticmethod
    def point(t: Tensor) -> "_Iv":
        return _Iv(t, t)

    def map(self, fn) -> "_Iv":  # for increasing fn
        return _Iv(fn(self.lo), fn(self.hi))


def _iv_matmul(a: _Iv, b: _Iv) -> _Iv:
    """Tight interval of ``a @ b`` (each variable appears once in each output element)."""
    c = torch.stack([a.lo[:, :, None] * b.lo[None], a.lo[:, :, None] * b.hi[None],
                     a.hi[:, :, None] * b.lo[None], a.hi[:, :, None] * b.hi[None]])  # (4, m, k, n)
    return _Iv(c.amin(0).sum(1), c.amax(0).sum(1))


def _iv_scale(a: _Iv, s: float) -> _Iv:
    return _Iv(a.lo * s, a.hi * s) if s >= 0 else _Iv(a.hi * s, a.lo * s)


def _iv_softmax_scores(s: _Iv) -> _Iv:
    """Tight interval of softmax rows: w_i is increasing in s_i and decreasing in every other s_j."""
    lo, hi = s.lo, s.hi  # (R, L)
    L = lo.shape[-1]
    eye = torch.eye(L, dtype=torch.bool)

    def bound(own: Tensor, other: Tensor) -> Tensor:
        # 1 / sum_j exp(other_j - own_i), with the j = i term exp(0) = 1
        d = other[:, None, :] - own[:, :, None]  # (R, L_i, L_j)
        both_masked = torch.isinf(other[:, None, :]) & torch.isinf(own[:, :, None])
        d = torch.where(eye | both_masked, torch.where(eye, 0.0, float("-inf")), d)
        w = 1.0 / torch.exp(d).sum(-1)
        return torch.where(torch.isinf(own) & (own < 0), torch.zeros_like(w), w)

    return _Iv(bound(lo, hi), bound(hi, lo))


def _iv_softmax_exps(e: _Iv) -> _Iv:
    """Tight interval of ``e_i / sum_j e_j`` from intervals of the exponentials."""
    def bound(own, other):
        den = own + other.sum(-1, keepdim=True) - other
        return torch.where(den > 0, own / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))
    return _Iv(bound(e.lo, e.hi), bound(e.hi, e.lo))


@dataclass
class ClaimResult:
    """One checked claim (a whole matrix, one row, or one entry).

    Attributes:
        name: as written in the claims, e.g. ``"K"`` or ``"scores[0]"``; ``chain`` says where
            (``""`` for the main example, ``"softmax[0]"`` for the first one-row example).
        claimed, exact, chained: nested lists of the claimed values, the exact values, and the values that
            follow from the claimed previous steps (centre of their interval).
        status: ``"ok"`` (matches the exact values), ``"rounding"`` (differs from them only by the rounding
            of earlier claimed values), ``"inherited"`` (follows correctly from an earlier wrong claim) or
            ``"wrong"`` (a slip made in this step).
        decimals: the precision the claim is written in (the fewest decimals among its entries).
        follows_from: for an inherited claim, the earlier wrong claims it follows from.
        follows: False when the claimed values of the previous steps do not lead to this claim.  A claim that
            the exact values round to holds (status ``"ok"``) even then: it was computed right, but the
            earlier claims it should follow from are wrong.

    Example::

        >>> from attnkit.explain import ARTICLE, check
        >>> r = check({**ARTICLE, "K[0]": ["-0.24", "0.33"]}).results[0]
        >>> r.name, r.status, r.claimed, [round(x, 2) for x in r.exact]
        ('K[0]', 'wrong', ['-0.24', '0.33'], [-0.45, 0.85])
    """

    chain: str
    name: str
    step: str
    claimed: Any
    exact: Any
    chained: Any
    status: str
    decimals: int
    follows_from: list[str] = field(default_factory=list)
    follows: bool = True

    @property
    def holds(self) -> bool:
        return self.status in ("ok", "rounding")

    def label(self) -> str:
        return f"{self.chain}.{self.name}" if self.chain else self.name


@dataclass
class CheckReport:
    """The result of :func:`check`: one :class:`ClaimResult` per claim, in step order.

    ``print(report)`` lists every claim with the claimed and the exact values where they differ.

    Example::

        >>> from attnkit.explain import ARTICLE, check
        >>> report = check({**ARTICLE, "K[0]": ["-0.24", "0.33"], "scores[0][0]": "0.194"})
        >>> report.ok, [r.name for r in report.slips], report.inherited[0].follows_from
        (False, ['K[0]'], ['K[0]'])
    """

    results: list[ClaimResult]

    @property
    def ok(self) -> bool:
        """True when every claim matches the exact values (at its precision)."""
        return all(r.holds for r in self.results)

    @property
    def slips(self) -> list[ClaimResult]:
        """Claims wrong in their own step (each error reported once, where it happened)."""
        return [r for r in self.results if r.status == "wrong"]

    @property
    def inherited(self) -> list[ClaimResult]:
        """Claims that follow correctly from an earlier slip but so differ from the exact values."""
        return [r for r in self.results if r.status == "inherited"]

    def __str__(self) -> str:
        lines = []
        marks = {"ok": "ok", "rounding": "ok", "inherited": "follows from an earlier slip", "wrong": "WRONG"}
        chain = None
        for r in self.results:
            if r.chain != chain:
                chain = r.chain
                lines.append("Claims about " + (f"the example {r.chain}" if r.chain else "the main example") + ":")
            d = max(r.decimals, 1)
            claimed = _fmt_nested(r.claimed, d, keep=True)
            if r.status in ("ok", "rounding"):
                extra = " (within the rounding of the earlier claimed values)" if r.status == "rounding" else ""
                if not r.follows:
                    extra = (f" (the exact values; it does not follow from your previous steps, which give "
                             f"{_fmt_nested(r.chained, d)})")
                lines.append(f"  {r.name:18s} {claimed}  ok{extra}")
                continue
            lines.append(f"  {r.name:18s} claimed {claimed}  {marks[r.status]}")
            lines.append(f"  {'':18s} exact   {_fmt_nested(r.exact, d)}")
            if r.status == "wrong":
                if _fmt_nested(r.chained, d) != _fmt_nested(r.exact, d):
                    lines.append(f"  {'':18s} from your previous steps {_fmt_nested(r.chained, d)}")
            else:
                src = ", ".join(r.follows_from) or "an earlier slip"
                lines.append(f"  {'':18s} (correct given {src}: not counted as a new slip)")
        n = len(self.results)
        good = sum(r.holds for r in self.results)
        lines.append("")
        if self.ok:
            lines.append(f"All {n} claims hold.")
        else:
            slips = ", ".join(r.label() for r in self.slips) or "none"
            lines.append(f"{good} of {n} claims hold; slips: {slips}; "
                         f"{len(self.inherited)} more follow from them.")
        return "\n".join(lines)


def _fmt_nested(x, decimals: int, keep: bool = False) -> str:
    if isinstance(x, list):
        return "[" + ", ".join(_fmt_nested(v, decimals, keep) for v in x) + "]"
    if x is None:
        return "-"
    if keep and isinstance(x, (_Written, str)):
        return x.text if isinstance(x, _Written) else x
    if isinstance(x, float) and math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return f"{x:.{decimals}f}"


_CLAIM_RE = re.compile(r"^([A-Za-z_]+)((?:\[\s*\d+\s*\])*)$")


@dataclass
class _Step:
    name: str
    deps: tuple[str, ...]


_MAIN_STEPS = (_Step("Q", ()), _Step("K", ()), _Step("V", ()), _Step("scores", ("Q", "K")),
               _Step("scaled_scores", ("scores",)), _Step("exp_scores", ("scaled_scores",)),
               _Step("weights", ("scaled_scores", "exp_scores")), _Step("output", ("weights", "V")))
_SOFTMAX_STEPS = (_Step("exp_scores", ()), _Step("weights", ("exp_scores",)), _Step("output", ("weights",)))
_MAIN_INPUTS = ("X", "W_q", "W_k", "W_v", "scale", "mask", "softmax")
_SOFTMAX_INPUTS = ("scores", "values")


def _parse_claim_key(key: str, steps: Sequence[_Step], where: str) -> tuple[str, tuple[int, ...]]:
    m = _CLAIM_RE.match(key.strip())
    names = [s.name for s in steps]
    if not m or m.group(1) not in names:
        raise ValueError(f"unknown key {key!r}{where}: claims are {', '.join(names)}, optionally with a 0-based "
                         f"row or entry like 'scores[0]' or 'Q[1][0]'")
    idx = tuple(int(x) for x in re.findall(r"\d+", m.group(2)))
    if len(idx) > 2:
        raise ValueError(f"claim {key!r}{where}: at most two indices (row and column)")
    return m.group(1), idx


def _claim_tensor(key: str, value, shape: tuple[int, ...], where: str) -> tuple[Tensor, Tensor, Tensor]:
    """Claimed values, half-widths of their rounding (0.5 unit in the last written place) and presence."""
    nested = _as_claimed(value)
    try:
        probe = torch.tensor(_nullable(nested), dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"claim {key!r}{where} must be numbers (or null) in equal-length rows: {e}") from None
    if tuple(probe.shape) != shape:
        raise ValueError(f"claim {key!r}{where} has shape {tuple(probe.shape)}, expected {shape}")
    present = ~torch.isnan(probe)
    half = torch.zeros(shape, dtype=torch.float64)
    flat_vals = _flatten(nested)
    decs = [(_decimals(v) if v is not None else 0) for v in flat_vals]
    if flat_vals:
        half = torch.tensor([0.5 * 10.0 ** -d for d in decs], dtype=torch.float64).view(shape)
    return torch.nan_to_num(probe), half, present


def _nullable(x):
    if isinstance(x, list):
        return [_nullable(v) for v in x]
    if x is None:
        return float("nan")
    if isinstance(x, str) or isinstance(x, bool) or not isinstance(x, (int, float)):
        try:
            return float(_plain(x))
        except ValueError:
            raise ValueError(f"{x!r} is not a number") from None
    return float(x)


def _flatten(x) -> list:
    if isinstance(x, list):
        return [y for v in x for y in _flatten(v)]
    return [x]


def _min_decimals(value) -> int:
    vals = [v for v in _flatten(value if isinstance(value, list) else [value]) if v is not None]
    return min((_decimals(v) for v in vals), default=0)


class _Chain:
    """Exact values, intervals that follow from the claims, and provenance, for a chain of steps.

    Provenance is a bool tensor ``(*shape, n_claims)`` per step: which wrong claims each element depends on.
    """

    def __init__(self, label: str, steps: Sequence[_Step], exact: dict[str, Tensor], compute):
        self.label, self.steps, self.exact, self.compute = label, steps, exact, compute
        self.iv: dict[str, _Iv] = {}
        self.prov: dict[str, Tensor] = {}
        self.results: list[ClaimResult] = []
        self.n = 0

    def clean(self, t: Tensor) -> Tensor:
        """No provenance: ``(*t.shape, n_claims)`` all False."""
        return torch.zeros(*t.shape, self.n, dtype=torch.bool)

    def run(self, claims: dict[str, list[tuple[str, tuple[int, ...], Any]]]) -> None:
        where = f" in {self.label}" if self.label else ""
        self.n = max(1, sum(len(v) for v in claims.values()))
        labels: list[str] = []
        for step in self.steps:
            if step.name not in self.exact:
                if claims.get(step.name):
                    raise ValueError(f"claim {claims[step.name][0][0]!r}{where} needs inputs this check lacks")
                continue
            iv, prov = self.compute(step.name, self.iv, self.prov, self)
            exact = self.exact[step.name]
            shape = tuple(exact.shape)
            lo, hi, out_prov = iv.lo.clone(), iv.hi.clone(), prov.clone()
            for key, idx, value in claims.get(step.name, []):
                for a, n in zip(idx, shape):
                    if a >= n:
                        raise ValueError(f"claim {key!r}{where}: index {a} out of range for {step.name} of shape "
                                         f"{shape} (indices start at 0)")
                c, h, present = _claim_tensor(key, value, shape[len(idx):], where)
                e = exact[idx] if idx else exact
                clo, chi = (iv.lo[idx], iv.hi[idx]) if idx else (iv.lo, iv.hi)
                upstream = prov[idx] if idx else prov  # (*sub_shape, n)
                slack = 1e-9 * (1.0 + c.abs())
                # a claim holds when a value it could be rounded from lies in the reference interval
                exact_ok = (((c - e).abs() <= h + slack) & ~torch.isinf(e)) | ~present
                both_inf = torch.isinf(clo) & torch.isinf(chi)
                chain_ok = ((c + h + slack >= clo) & (c - h - slack <= chi) & ~both_inf) | ~present
                differs = ~exact_ok
                slipped = differs & ~chain_ok  # matches neither the exact values nor the claimed steps
                tainted = upstream.any(-1)
                if not bool(differs.any()):
                    status = "ok"  # the exact value rounds to it, whatever the earlier claims say
                elif bool(slipped.any()):
                    status = "wrong"
                elif bool((differs & tainted).any()):
                    status = "inherited"
                else:
                    status = "rounding"
                me = len(labels)
                labels.append(key)
                sources = upstream[differs & present].any(0) if bool((differs & present).any()) else None
                centre = torch.where(clo == chi, clo, (clo + chi) / 2)
                self.results.append(ClaimResult(
                    self.label, key, step.name, _as_claimed(value), e.tolist(), centre.tolist(), status,
                    _min_decimals(value),
                    [labels[j] for j in range(me) if sources is not None and bool(sources[j])],
                    bool(chain_ok.all())))
                # later steps use the claimed values, widened by their rounding; a wrong value carries its
                # own label (and those it came from) downstream, a right one carries nothing
                own = torch.zeros(self.n, dtype=torch.bool)
                own[me] = True
                new_prov = torch.where(slipped[..., None], upstream | own,
                                       torch.where(differs[..., None], upstream, torch.zeros_like(upstream)))
                new_prov = torch.where(present[..., None], new_prov, upstream)
                new_lo, new_hi = torch.where(present, c - h, clo), torch.where(present, c + h, chi)
                if idx:
                    lo[idx], hi[idx], out_prov[idx] = new_lo, new_hi, new_prov
                else:
                    lo, hi, out_prov = new_lo, new_hi, new_prov
            self.iv[step.name] = _Iv(lo, hi)
            self.prov[step.name] = out_prov


def _as_claimed(value):
    if isinstance(value, (list, tuple)):
        return [_as_claimed(v) for v in value]
    return value


def _group_claims(spec: Mapping, steps: Sequence[_Step], inputs: Sequence[str], where: str):
    claims: dict[str, list] = {}
    for key, value in spec.items():
        if key in inputs:
            continue
        name, idx = _parse_claim_key(str(key), steps, where)
        if not idx and _is_matrix(value):  # a whole matrix: check and report it row by row
            for r, row in enumerate(value):
                claims.setdefault(name, []).append((f"{name}[{r}]", (r,), row))
        else:
            claims.setdefault(name, []).append((str(key), idx, value))
    return claims


def _is_matrix(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(r, (list, tuple)) for r in value)


def _prov_matmul(a: Tensor, b: Tensor) -> Tensor:
    """Provenance of ``a @ b``: ``(m, k, n_claims)``, ``(k, p, n_claims)`` -> ``(m, p, n_claims)``."""
    return a.any(1)[:, None, :] | b.any(0)[None, :, :]


def _prov_rows(t: Tensor) -> Tensor:
    """Every entry of a softmax row depends on every entry of the row: ``(R, L, n)``."""
    return t.any(1, keepdim=True).expand_as(t).clone()


def _main_chain(spec: Mapping) -> _Chain:
    missing = [k for k in ("X", "W_q", "W_k", "W_v") if k not in spec]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}: a check needs the inputs X, W_q, W_k, W_v")
    t = trace(spec["X"], spec["W_q"], spec["W_k"], spec["W_v"], mask=spec.get("mask"),
              scale=_plain(spec["scale"]) if spec.get("scale") is not None else None)
    exact = {"Q": t.q, "K": t.k, "V": t.v, "scores": t.scores, "scaled_scores": t.scaled_scores,
             "exp_scores": torch.exp(t.scaled_scores), "weights": t.weights, "output": t.output}
    claims = _group_claims(spec, _MAIN_STEPS, _MAIN_INPUTS, "")
    use_exps = bool(claims.get("exp_scores"))
    projections = {"Q": t.w_q, "K": t.w_k, "V": t.w_v}
    masked = None if t.mask is None else ~t.mask

    def compute(name, iv, prov, chain):
        if name in projections:
            r = t.x @ projections[name]  # the inputs are exact: a point
            return _Iv.point(r), chain.clean(r)
        if name == "scores":
            kt = _Iv(iv["K"].lo.T, iv["K"].hi.T)
            return _iv_matmul(iv["Q"], kt), _prov_matmul(prov["Q"], prov["K"].transpose(0, 1))
        if name == "scaled_scores":
            r = _iv_scale(iv["scores"], t.scale)
            if masked is not None:
                r = _Iv(r.lo.masked_fill(masked, float("-inf")), r.hi.masked_fill(masked, float("-inf")))
            return r, prov["scores"].clone()
        if name == "exp_scores":
            return iv["scaled_scores"].map(torch.exp), prov["scaled_scores"].clone()
        if name == "weights":
            if use_exps:
                return _iv_softmax_exps(iv["exp_scores"]), _prov_rows(prov["exp_scores"])
            return _iv_softmax_scores(iv["scaled_scores"]), _prov_rows(prov["scaled_scores"])
        if name == "output":
            return _iv_matmul(iv["weights"], iv["V"]), _prov_matmul(prov["weights"], prov["V"])
        raise AssertionError(name)

    chain = _Chain("", _MAIN_STEPS, exact, compute)
    chain.run(claims)
    return chain


def _softmax_chain(spec: Mapping, label: str) -> _Chain:
    where = f" in {label}"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{label} must be an object with 'scores' and claims, got {_short(spec)}")
    if "scores" not in spec:
        raise ValueError(f"{label} needs 'scores' (the scaled scores that go into softmax)")
    s = _as_matrix(f"{label}.scores", spec["scores"], ndim=(1, 2), masked_ok=True)
    one_row = s.dim() == 1
    s2 = s.view(-1, s.shape[-1])  # (R, L)
    exact = {"exp_scores": torch.exp(s2), "weights": _softmax_steps(s2).weights}
    values = None
    if spec.get("values") is not None:
        values = _as_matrix(f"{label}.values", spec["values"])
        if values.shape[0] != s2.shape[-1]:
            raise ValueError(f"{label}: {s2.shape[-1]} scores per row but {values.shape[0]} value vectors")
        exact["output"] = exact["weights"] @ values
    claims = _group_claims(spec, _SOFTMAX_STEPS, _SOFTMAX_INPUTS, where)
    if one_row:  # a 1-D example: its claims are about row 0
        claims = {n: [(k, (0, *idx), v) for k, idx, v in cs] for n, cs in claims.items()}
    use_exps = bool(claims.get("exp_scores"))

    def compute(name, iv, prov, chain):
        if name == "exp_scores":
            return _Iv.point(exact["exp_scores"]), chain.clean(s2)
        if name == "weights":
            if use_exps:
                return _iv_softmax_exps(iv["exp_scores"]), _prov_rows(prov["exp_scores"])
            return _Iv.point(exact["weights"]), chain.clean(s2)
        if name == "output":
            return _iv_matmul(iv["weights"], _Iv.point(values)), _prov_matmul(prov["weights"], chain.clean(values))
        raise AssertionError(name)

    chain = _Chain(label, _SOFTMAX_STEPS, exact, compute)
    chain.run(claims)
    return chain


def check(spec: Mapping) -> CheckReport:
    """Check hand-computed claims about single-head attention against the exact values.

    ``spec`` holds the inputs ``X (L, d_model)``, ``W_q``, ``W_k``, ``W_v`` (and optionally ``scale`` and
    ``mask``) and any claims: full matrices under ``Q``, ``K``, ``V``, ``scores``, ``scaled_scores``,
    ``exp_scores`` (the ``exp`` of the scaled scores), ``weights``, ``output``, or parts of them under
    ``"scores[0]"`` (a 0-based row) or ``"Q[1][0]"`` (one entry); ``null`` skips an entry.  Under
    ``"softmax"``, a list of one-row examples: ``{"scores": [...], "weights": [...], "values": [[...]],
    "output": [...]}`` (``exp_scores`` too).

    Numbers are read at the precision they are written in: give them as strings (``"0.240"``) or load
    the file with :func:`load_claims`; a plain float counts the decimals of its shortest form.  A claim
    holds when the exact value rounds to it, even when it does not follow from earlier wrong claims (its
    ``follows`` is then False and the report says so).  Each claim is also recomputed from the *claimed*
    values of the steps before it (interval arithmetic over their rounding), so a slip is reported once, in
    the step where it happened; later claims that follow from it correctly are marked ``"inherited"``.

    Example::

        >>> from attnkit.explain import check, ARTICLE
        >>> report = check({**ARTICLE, "Q[0]": ["0.14", "0.69"], "scores[0]": ["0.52", "-0.32", "-0.04"]})
        >>> report.ok, [r.status for r in report.results]
        (True, ['ok', 'ok'])
        >>> check({**ARTICLE, "K[0]": ["-0.24", "0.33"], "scores[0]": ["0.19", "-0.32", "-0.04"]}).ok
        False
    """
    if not isinstance(spec, Mapping):
        raise TypeError(f"check() takes a mapping of inputs and claims, got {type(spec).__name__}")
    results: list[ClaimResult] = []
    main_keys = [k for k in spec if k != "softmax"]
    if any(k not in ("scale", "mask") for k in main_keys):
        results += _main_chain(spec).results
    examples = spec.get("softmax", [])
    if isinstance(examples, Mapping):
        examples = [examples]
    if not isinstance(examples, (list, tuple)):
        raise ValueError(f"'softmax' must be a list of one-row examples, got {_short(examples)}")
    for i, ex in enumerate(examples):
        results += _softmax_chain(ex, f"softmax[{i}]").results
    if not results:
        raise ValueError("nothing to check: give claims such as 'Q', 'scores[0]' or 'weights' next to the inputs")
    return CheckReport(results)
