"""The claim checker behind :mod:`attnkit.explain`: hand-computed step results read at the precision they
are written in, compared with the exact values and with what follows from the claimed previous steps."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ._trace import as_matrix, plain, short, softmax_rows, trace

Tensor = torch.Tensor

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
        raise ValueError(
            f"a claims file must hold a JSON object with keys X, W_q, W_k, W_v and claims, got {type(data).__name__}"
        )
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
        raise ValueError(f"{short(value)} is not a number")
    m = _FLOAT_RE.match(text)
    if not m or not (m.group(1) or m.group(2)):
        if text.strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
            raise ValueError(
                f"{text!r} cannot be claimed: write null for a masked entry (-inf in the trace), which skips it"
            )
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
    c = torch.stack(
        [
            a.lo[:, :, None] * b.lo[None],
            a.lo[:, :, None] * b.hi[None],
            a.hi[:, :, None] * b.lo[None],
            a.hi[:, :, None] * b.hi[None],
        ]
    )  # (4, m, k, n)
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
                    extra = (
                        f" (the exact values; it does not follow from your previous steps, which give "
                        f"{_fmt_nested(r.chained, d)})"
                    )
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
            lines.append(f"{good} of {n} claims hold; slips: {slips}; {len(self.inherited)} more follow from them.")
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


_MAIN_STEPS = (
    _Step("Q", ()),
    _Step("K", ()),
    _Step("V", ()),
    _Step("scores", ("Q", "K")),
    _Step("scaled_scores", ("scores",)),
    _Step("exp_scores", ("scaled_scores",)),
    _Step("weights", ("scaled_scores", "exp_scores")),
    _Step("output", ("weights", "V")),
)
_SOFTMAX_STEPS = (_Step("exp_scores", ()), _Step("weights", ("exp_scores",)), _Step("output", ("weights",)))
_MAIN_INPUTS = ("X", "W_q", "W_k", "W_v", "scale", "mask", "softmax")
_SOFTMAX_INPUTS = ("scores", "values")


def _parse_claim_key(key: str, steps: Sequence[_Step], where: str) -> tuple[str, tuple[int, ...]]:
    m = _CLAIM_RE.match(key.strip())
    names = [s.name for s in steps]
    if not m or m.group(1) not in names:
        raise ValueError(
            f"unknown key {key!r}{where}: claims are {', '.join(names)}, optionally with a 0-based "
            f"row or entry like 'scores[0]' or 'Q[1][0]'"
        )
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
        half = torch.tensor([0.5 * 10.0**-d for d in decs], dtype=torch.float64).view(shape)
    return torch.nan_to_num(probe), half, present


def _nullable(x):
    if isinstance(x, list):
        return [_nullable(v) for v in x]
    if x is None:
        return float("nan")
    if isinstance(x, str) or isinstance(x, bool) or not isinstance(x, (int, float)):
        try:
            return float(plain(x))
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
                        raise ValueError(
                            f"claim {key!r}{where}: index {a} out of range for {step.name} of shape "
                            f"{shape} (indices start at 0)"
                        )
                c, h, present = _claim_tensor(key, value, shape[len(idx) :], where)
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
                self.results.append(
                    ClaimResult(
                        self.label,
                        key,
                        step.name,
                        _as_claimed(value),
                        e.tolist(),
                        centre.tolist(),
                        status,
                        _min_decimals(value),
                        [labels[j] for j in range(me) if sources is not None and bool(sources[j])],
                        bool(chain_ok.all()),
                    )
                )
                # later steps use the claimed values, widened by their rounding; a wrong value carries its
                # own label (and those it came from) downstream, a right one carries nothing
                own = torch.zeros(self.n, dtype=torch.bool)
                own[me] = True
                new_prov = torch.where(
                    slipped[..., None],
                    upstream | own,
                    torch.where(differs[..., None], upstream, torch.zeros_like(upstream)),
                )
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
    t = trace(
        spec["X"],
        spec["W_q"],
        spec["W_k"],
        spec["W_v"],
        mask=spec.get("mask"),
        scale=plain(spec["scale"]) if spec.get("scale") is not None else None,
    )
    exact = {
        "Q": t.q,
        "K": t.k,
        "V": t.v,
        "scores": t.scores,
        "scaled_scores": t.scaled_scores,
        "exp_scores": torch.exp(t.scaled_scores),
        "weights": t.weights,
        "output": t.output,
    }
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
        raise ValueError(f"{label} must be an object with 'scores' and claims, got {short(spec)}")
    if "scores" not in spec:
        raise ValueError(f"{label} needs 'scores' (the scaled scores that go into softmax)")
    s = as_matrix(f"{label}.scores", spec["scores"], ndim=(1, 2), masked_ok=True)
    one_row = s.dim() == 1
    s2 = s.view(-1, s.shape[-1])  # (R, L)
    exact = {"exp_scores": torch.exp(s2), "weights": softmax_rows(s2).weights}
    values = None
    if spec.get("values") is not None:
        values = as_matrix(f"{label}.values", spec["values"])
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
        raise ValueError(f"'softmax' must be a list of one-row examples, got {short(examples)}")
    for i, ex in enumerate(examples):
        results += _softmax_chain(ex, f"softmax[{i}]").results
    if not results:
        raise ValueError("nothing to check: give claims such as 'Q', 'scores[0]' or 'weights' next to the inputs")
    return CheckReport(results)
