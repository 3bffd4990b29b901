"""``doctor(model, batch)``: per-head statistics of attention and the first article's debugging guide.

The first source article ends with three symptoms and what to do about them (section 5): attention weights
that are too uniform, too sharp, and vanishing gradients.  The doctor runs one forward and backward pass
under :func:`~attnkit.diagnostics.probe`, measures every head, and names the symptoms it sees with the
article's likely causes and fixes:

- ``uniform``: weights close to ``1/L`` (normalised entropy near 1);
- ``sharp``: nearly all of each row's weight on one key (a trained lookup head looks the same: the finding
  says what to check);
- ``saturated``: rows that are numerically one-hot, where softmax passes back almost no gradient (the
  extreme of ``sharp``, reported instead of it);
- ``vanishing_gradient``: the gradient reaching a layer's scores is orders of magnitude below the gradient
  at the model's output (or the largest layer's), while its weights are not saturated.

A layer shows a weight symptom when enough of its heads do: every head for ``uniform``, three quarters for
``sharp``, half for ``saturated`` (see :class:`Thresholds`).  Each layer is given its most severe symptom
only: saturated, then vanishing_gradient, then sharp, then uniform.  The table's per-head ``symptom`` column
comes from the same decision: it marks exactly the heads that a finding names, so the table and the
findings always agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import number
from ._probe import SATURATION, LayerRecord, attention_modules, probe

Tensor = torch.Tensor

__all__ = ["doctor", "Report", "Finding", "HeadStats", "Thresholds", "SYMPTOMS"]


# The article's guide (section 5), in English, with the attnkit switches that act on each cause.
SYMPTOMS: dict[str, dict] = {
    "uniform": {
        "title": "attention weights too uniform",
        "symptom": "every weight is close to 1/L: the layer averages its inputs instead of selecting",
        "causes": [
            "parameter initialisation, especially of W_q and W_k, too small",
            "a wrong scaling factor (d_k taken too large, or the scores scaled twice)",
            "embeddings with too small a norm",
            "or simply an untrained model: with the usual small initialisation (std 0.02) every layer "
            "starts near uniform and sharpens as it trains; check again after some training steps",
        ],
        "fixes": [
            "check the initialisation range (Xavier is the usual choice)",
            "check the scaling factor 1/sqrt(d_k), in particular the value of d_k",
            "add layer normalisation before attention (Pre-LN: norm_first=True)",
        ],
    },
    "sharp": {
        # The doctor cannot tell a trained lookup head (copying, induction, recall: one key on purpose) from
        # scores that are merely too large: both give very sharp rows with large score spreads and some
        # saturated rows.  So the finding says what to check rather than assuming a bug.
        "title": "attention weights very sharp",
        "symptom": "almost all of each row's weight falls on one key: intended in a trained head that looks up "
        "one position (copying, induction, recall), a problem in an untrained or badly scaled model",
        "causes": [
            "scores so large that softmax saturates (in an untrained model usually the 1/sqrt(d_k) scaling missing)",
            "keys with too large a norm",
            "queries and keys nearly parallel (too small an angle between them)",
            "nothing, if the model is trained and does its task: lookup heads are meant to pick one key",
        ],
        "fixes": [
            "make sure the 1/sqrt(d_k) scaling is applied; if it is and the model does its task, look at "
            "where these heads point (report.plot) before changing anything",
            "add a temperature to soften the softmax (MultiHeadAttention(temperature=...) > 1)",
            "normalise the vectors: qk_norm=True (RMSNorm of every query and key head)",
        ],
    },
    "saturated": {
        "title": "softmax saturated",
        "symptom": "rows are numerically one-hot, so softmax passes back almost no gradient to the scores",
        "causes": [
            "scores far too large: the 1/sqrt(d_k) scaling missing, or huge query/key norms",
            "keys with too large a norm",
        ],
        "fixes": [
            "apply the 1/sqrt(d_k) scaling",
            "normalise queries and keys (qk_norm=True) or cap the scores (softcap=...)",
            "add a temperature > 1 or reduce the initialisation of W_q and W_k",
        ],
    },
    "vanishing_gradient": {
        "title": "vanishing gradients",
        "symptom": "the gradient reaching this layer's attention scores is close to zero",
        # the article lists saturation first; a layer with saturated weights is reported as `saturated`
        # instead, so here depth and initialisation come first
        "causes": [
            "a network too deep for its normalisation (e.g. Post-LN without residual paths)",
            "an unreasonable range of scores",
            "softmax in its saturated region",
        ],
        "fixes": [
            "add residual connections (and prefer Pre-LN, norm_first=True, for deep stacks)",
            "adjust the initialisation",
            "use a numerically stable softmax (attnkit always does)",
        ],
    },
}


@dataclass(frozen=True)
class Thresholds:
    """When a head (and a layer) shows each symptom.

    Attributes:
        uniform_entropy: a head is uniform when its mean normalised entropy is at least this.
        sharp_max_weight: a head is sharp when its rows' mean largest weight is at least this.
        saturated_rows: a head is saturated when at least this share of its rows is saturated (largest
            weight within ``SATURATION`` = 1e-4 of 1).
        vanishing_ratio: a layer's score gradient norm is vanishing below this times the gradient norm at the
            model's output (per row of logits) or this times the largest layer's.
        uniform_heads, sharp_heads, saturated_heads: a layer shows the symptom when at least this share of its
            heads do.  A trained layer often keeps a few idle, near-uniform heads next to working ones, and a
            few sharp ones that look up one position; a problem of initialisation or scale hits every head.
            Saturation is flagged early (half the heads): it stops learning wherever it happens.

    Example::

        >>> from attnkit.diagnostics import Thresholds, doctor
        >>> from attnkit.diagnostics.examples import example
        >>> doctor(*example("sharp"), thresholds=Thresholds(sharp_max_weight=0.99)).healthy
        True
    """

    uniform_entropy: float = 0.98
    sharp_max_weight: float = 0.9
    saturated_rows: float = 0.5
    vanishing_ratio: float = 1e-3
    uniform_heads: float = 1.0
    sharp_heads: float = 0.75
    saturated_heads: float = 0.5

    def __post_init__(self):
        for name in (
            "uniform_entropy",
            "sharp_max_weight",
            "saturated_rows",
            "uniform_heads",
            "sharp_heads",
            "saturated_heads",
        ):
            number(name, getattr(self, name), low=0.0, high=1.0, low_open=True, fix=" (a fraction in (0, 1])")
        number("vanishing_ratio", self.vanishing_ratio, low=0.0, high=1.0, low_open=True, high_open=True)


@dataclass
class HeadStats:
    """Statistics of one head over the batch (rows that may attend to at least two keys).

    Attributes:
        layer: module name; head: query head index.
        entropy: mean normalised entropy of its rows (1 = uniform, 0 = one key).
        max_weight: mean of each row's largest weight.
        saturated: share of rows whose largest weight is within 1e-4 of 1 (SATURATION).
        score_std: mean standard deviation of a row's final scores (how far apart softmax's inputs are).
        grad_norm: RMS of the norm of a row's ``dL/d(scores)`` over the rows the loss reaches (0 when it
            reaches none), or None without a backward pass (or without rows).
        rows: rows counted.  When it is 0 (no row may attend to two or more keys: nothing to measure), entropy,
            max_weight, saturated and score_std are NaN, printed ``-``, grad_norm is None and there is no finding.
        symptom: the kind of the report's finding that names this head (``"uniform"``, ``"sharp"``,
            ``"saturated"``, ``"vanishing_gradient"``), or None.  The table and the findings come from one
            rule, so a head of a layer without a finding has None even when its own statistics meet a head
            threshold (a near-uniform head next to working ones: see :class:`Thresholds`).

    Example::

        >>> from attnkit.diagnostics import doctor
        >>> from attnkit.diagnostics.examples import example
        >>> s = doctor(*example("uniform")).heads[0]
        >>> s.layer, s.head, round(s.entropy, 3), s.symptom
        ('layers.0.attn', 0, 1.0, 'uniform')
    """

    layer: str
    head: int
    entropy: float
    max_weight: float
    saturated: float
    score_std: float
    grad_norm: float | None
    rows: int
    symptom: str | None = None


@dataclass
class Finding:
    """One symptom in one layer, with the heads that show it and the article's causes and fixes.

    Example::

        >>> from attnkit.diagnostics import doctor
        >>> from attnkit.diagnostics.examples import example
        >>> f = doctor(*example("saturated")).findings[0]
        >>> f.kind, f.layer, f.heads, f.fixes[0]
        ('saturated', 'layers.0.attn', [0, 1, 2, 3], 'apply the 1/sqrt(d_k) scaling')
    """

    kind: str
    layer: str
    heads: list[int]
    evidence: str
    causes: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        info = SYMPTOMS[self.kind]
        lines = [
            f"[{self.kind}] {info['title']} in {self.layer or '(model)'}, heads {self.heads}: {self.evidence}",
            "  likely causes: " + "; ".join(self.causes),
            "  fixes: " + "; ".join(self.fixes),
        ]
        return "\n".join(lines)


@dataclass
class Report:
    """The doctor's report: per-head statistics, findings, and the recorded weights (batch element 0).

    ``str(report)`` is a table and the findings; :meth:`to_markdown` the same as Markdown; :meth:`plot`
    writes heatmaps.  ``report.kinds`` is the set of symptoms found (empty when healthy).

    Example::

        >>> from attnkit.diagnostics import doctor
        >>> from attnkit.diagnostics.examples import example
        >>> report = doctor(*example("healthy"))
        >>> report.healthy, len(report.heads), sorted(report.weights)
        (True, 8, ['layers.0.attn', 'layers.1.attn'])
    """

    heads: list[HeadStats]
    findings: list[Finding]
    weights: dict[str, Tensor] = field(default_factory=dict, repr=False)
    layer_grad: dict[str, float | None] = field(default_factory=dict)
    output_grad: float | None = None

    @property
    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    @property
    def healthy(self) -> bool:
        return not self.findings

    def _rows(self) -> list[list[str]]:
        out = []
        for s in self.heads:
            grad = "-" if s.grad_norm is None else f"{s.grad_norm:.2e}"
            stats = (
                [f"{s.entropy:.3f}", f"{s.max_weight:.3f}", f"{s.saturated:.0%}", f"{s.score_std:.2f}"]
                if s.rows
                else ["-"] * 4
            )
            out.append([s.layer or "(model)", str(s.head), *stats, grad, s.symptom or ""])
        return out

    _NO_ROWS = "- : no row of the head may attend to two or more keys (one key gets weight 1 whatever its score)"

    _HEADER = ["layer", "head", "entropy", "max weight", "saturated rows", "score std", "grad norm", "symptom"]

    def __str__(self) -> str:
        rows = [self._HEADER] + self._rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEADER))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        if any(not s.rows for s in self.heads):
            lines += [self._NO_ROWS, ""]
        if not self.findings:
            lines.append("No findings: no layer shows uniform, sharp or saturated weights or vanishing gradients.")
        else:
            lines.append(f"{len(self.findings)} finding(s):")
            lines += [str(f) for f in self.findings]
        return "\n".join(lines)

    def to_markdown(self, title: str = "Attention doctor") -> str:
        """The report as Markdown: the per-head table, then each finding with causes and fixes."""
        lines = [
            f"# {title}",
            "",
            "| " + " | ".join(self._HEADER) + " |",
            "|" + "|".join("---" for _ in self._HEADER) + "|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in self._rows()]
        lines += [
            "",
            "Entropy is normalised (1 = uniform over the keys a row may see, 0 = one key); a row is "
            f"saturated when its largest weight is within {SATURATION:g} of 1; grad norm is the RMS over "
            "rows of the norm of the gradient of the loss with respect to a row of scores; all are over "
            "the rows that may attend to at least two keys.",
            "",
        ]
        if any(not s.rows for s in self.heads):
            lines[-1:-1] = ["", self._NO_ROWS.replace("- :", "`-`:")]
        if not self.findings:
            lines.append("**No findings.**")
        for f in self.findings:
            info = SYMPTOMS[f.kind]
            lines += [
                f"## `{f.kind}`: {info['title']} in `{f.layer or '(model)'}`",
                "",
                f"Heads {f.heads}: {f.evidence}. Symptom: {info['symptom']}.",
                "",
                "Likely causes:",
                "",
            ]
            lines += [f"- {c}" for c in f.causes]
            lines += ["", "Fixes:", ""]
            lines += [f"- {x}" for x in f.fixes]
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"

    def plot(self, folder: str | Path, tokens=None) -> list[Path]:
        """Write ``attention.png`` (every recorded layer, one row each) and one PNG per layer into ``folder``.

        A layer's file is its name with dots as underscores (``layers_0_attn.png``; ``model.png`` for the model
        itself); a name already taken, by ``attention.png`` or another layer, gets ``_2``, ``_3``, ... so no
        file overwrites another.

        ``tokens`` labels the keys (and queries) when given.  Needs matplotlib (the ``plot`` extra).  Returns
        the paths written.
        """
        from ..plot import plot_attention

        if not self.weights:
            raise ValueError(
                "no attention weights were kept (the sequences were longer than max_elements): "
                "rerun doctor with a shorter batch or a larger max_elements to plot"
            )
        folder = Path(folder)
        paths = []
        taken = {"attention"}  # the grid's name, also where no grid is written: the names never move
        shapes = {tuple(w.shape[-2:]) for w in self.weights.values()}
        if len(shapes) == 1:
            paths.append(folder / "attention.png")
            plot_attention(self.weights, tokens=tokens, path=paths[-1], title="attention weights (batch element 0)")
        for name, w in self.weights.items():
            paths.append(folder / f"{_file_stem(name, taken)}.png")
            labels = tokens if tokens is not None and len(tokens) == w.shape[-1] else None
            plot_attention(w, tokens=labels, path=paths[-1], title=name or "attention")
        return paths


def _file_stem(name: str, taken: set[str]) -> str:
    """A file name for layer ``name`` that is not in ``taken`` (and is added to it)."""
    base = (name or "model").replace(".", "_")
    stem, n = base, 2
    while stem in taken:
        stem, n = f"{base}_{n}", n + 1
    taken.add(stem)
    return stem


def _head_stats(record: LayerRecord) -> list[HeadStats]:
    if not record.calls:
        return []
    heads = record.calls[0].shape[1]
    out = []
    for h in range(heads):
        ent, mx, sstd, rows, sq, cnt = [], [], [], 0, 0.0, 0
        have_grad = False
        for c in record.calls:
            if c.shape[1] != heads:
                continue
            live = c.allowed[:, h] >= 2  # (B, Lq)
            rows += int(live.sum())
            ent.append(c.entropy[:, h][live])
            mx.append(c.max_weight[:, h][live])
            sstd.append(c.score_std[:, h][live])
            if c.grad_sq is not None:
                have_grad = True
                sq += float(c.grad_sq[:, h].sum())
                cnt += int(c.grad_rows[:, h].sum())  # rows the loss reaches
        e, m, s = torch.cat(ent), torch.cat(mx), torch.cat(sstd)
        if rows == 0:
            e = m = s = torch.tensor([float("nan")])
        grad = (math.sqrt(sq / cnt) if cnt else 0.0) if have_grad and rows else None  # no row reached: 0
        out.append(
            HeadStats(
                record.name,
                h,
                float(e.mean()),
                float(m.mean()),
                float((m >= 1 - SATURATION).float().mean()) if rows else float("nan"),
                float(s.mean()),
                grad,
                rows,
            )
        )
    return out


def _head_symptom(s: HeadStats, t: Thresholds) -> str | None:
    """The weight symptom a head's own statistics meet (the most severe), before its layer is considered."""
    if s.rows == 0:
        return None
    if s.saturated >= t.saturated_rows:
        return "saturated"
    if s.max_weight >= t.sharp_max_weight:
        return "sharp"
    if s.entropy >= t.uniform_entropy:
        return "uniform"
    return None


def _evidence(kind: str, heads: list[HeadStats]) -> str:
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    if kind == "uniform":
        return f"mean normalised entropy {mean([h.entropy for h in heads]):.3f} (1 = exactly uniform)"
    if kind == "sharp":
        return (
            f"mean largest weight {mean([h.max_weight for h in heads]):.3f}, "
            f"score std {mean([h.score_std for h in heads]):.1f}"
        )
    return (
        f"{mean([h.saturated for h in heads]):.0%} of rows saturated, "
        f"score std {mean([h.score_std for h in heads]):.1f}"
    )


def _layer_grads(layers: dict[str, list[HeadStats]]) -> dict[str, float | None]:
    grads: dict[str, float | None] = {}
    for name, heads in layers.items():
        g = [h.grad_norm for h in heads if h.grad_norm is not None and h.rows]
        grads[name] = math.sqrt(sum(x * x for x in g) / len(g)) if g else None
    return grads


def _layer_finding(
    name: str, heads: list[HeadStats], t: Thresholds, grad: float | None, top: float, output_grad: float | None
) -> Finding | None:
    """The layer's finding, if any: its most severe symptom (saturated, vanishing_gradient, sharp, uniform)
    and the heads that show it.  A weight symptom needs its share of the layer's heads (``Thresholds``)."""
    shown: dict[str, Finding] = {}
    heads = [h for h in heads if h.rows]  # a head without a row of two or more keys has nothing to show
    if not heads:
        return None
    own = {h.head: _head_symptom(h, t) for h in heads}
    for kind in ("saturated", "sharp", "uniform"):  # a saturated head that is also sharp counts as sharp
        hit = [
            h
            for h in heads
            if own[h.head] == kind
            or (kind == "sharp" and own[h.head] == "saturated" and h.max_weight >= t.sharp_max_weight)
        ]
        if hit and len(hit) >= getattr(t, f"{kind}_heads") * len(heads):
            shown[kind] = Finding(kind, name, [h.head for h in hit], _evidence(kind, hit))
    if grad is not None:
        vs_top = top > 0 and grad < t.vanishing_ratio * top
        vs_out = output_grad is not None and output_grad > 0 and grad < t.vanishing_ratio * output_grad
        if vs_top or vs_out or (grad == 0 and (top > 0 or (output_grad or 0) > 0)):
            ref = (
                f"{grad / output_grad:.1e} of the gradient at the model's output ({output_grad:.2e})"
                if vs_out
                else f"{grad / top:.1e} of the largest layer's ({top:.2e})"
            )
            shown["vanishing_gradient"] = Finding(
                "vanishing_gradient", name, [h.head for h in heads], f"score gradient norm {grad:.2e}, {ref}"
            )
    for kind in ("saturated", "vanishing_gradient", "sharp", "uniform"):
        if kind in shown:
            f = shown[kind]
            f.causes, f.fixes = list(SYMPTOMS[kind]["causes"]), list(SYMPTOMS[kind]["fixes"])
            return f
    return None


def _diagnose(
    stats: list[HeadStats], t: Thresholds, output_grad: float | None
) -> tuple[list[Finding], dict[str, float | None]]:
    """The one rule behind both the table and the findings: at most one finding per layer (the most
    severe: saturated, vanishing_gradient, sharp, uniform), and every head's ``symptom`` is the kind of the
    finding that names it, else None.

    (Saturation explains a vanishing gradient; a layer whose scores get no gradient cannot be tuned, so its
    weights' shape is secondary.)
    """
    layers: dict[str, list[HeadStats]] = {}
    for s in stats:
        layers.setdefault(s.layer, []).append(s)
    grads = _layer_grads(layers)
    top = max((g for g in grads.values() if g is not None), default=0.0)
    findings = []
    for name, heads in layers.items():
        f = _layer_finding(name, heads, t, grads[name], top, output_grad)
        named = set(f.heads) if f is not None else set()
        for h in heads:
            h.symptom = f.kind if h.head in named else None
        if f is not None:
            findings.append(f)
    return findings, grads


def _run(model: nn.Module, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _main_output(output):
    """The model's main output: the first of a tuple, a Hugging Face output's ``logits``, or the output."""
    if isinstance(output, (tuple, list)):
        return output[0] if output else None
    logits = getattr(output, "logits", None)  # transformers' ModelOutput (a dict with attributes)
    return logits if isinstance(logits, Tensor) else output


def _output_tensor(output) -> Tensor | None:
    out = _main_output(output)
    return out if isinstance(out, Tensor) and out.is_floating_point() else None


def _default_loss(output, batch) -> Tensor:
    out = _main_output(output)
    if not isinstance(out, Tensor):
        raise TypeError(f"the model returned {type(output).__name__}; pass loss_fn(output, batch) -> scalar tensor")
    if (
        isinstance(batch, Tensor)
        and batch.dtype == torch.long
        and out.dim() == 3
        and batch.dim() == 2
        and out.shape[:2] == batch.shape
        and batch.shape[1] >= 2
    ):
        vocab = out.shape[-1]  # a language model: next-token cross-entropy
        return F.cross_entropy(out[:, :-1].reshape(-1, vocab).float(), batch[:, 1:].reshape(-1))
    return 0.5 * out.float().pow(2).mean()


def _nothing_seen(model: nn.Module) -> str:
    """Why the doctor saw no attention in ``model``, and how to make its attention go through attnkit."""
    if attention_modules(model):
        return "the model ran but none of its attention layers was called on this batch"
    text = (
        f"{type(model).__name__} computed no attention through attnkit on this batch: the doctor sees the "
        f"attention modules of attnkit.nn and every call of attnkit.attention made while the model runs"
    )
    if type(model).__module__.startswith("transformers."):
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        text += (
            f"; this Hugging Face model runs attn_implementation={implementation!r}: convert it with "
            f"attnkit.integrations.hf.from_hf(model), or call attnkit.integrations.hf.register() and "
            f"model.set_attn_implementation('attnkit')"
        )
    return text


def doctor(
    model: nn.Module,
    batch,
    loss_fn: Callable | None = None,
    *,
    thresholds: Thresholds | None = None,
    max_elements: int = 1 << 22,
) -> Report:
    """Examine every attnkit attention layer of ``model`` on ``batch`` and name what looks wrong.

    The layers are those :func:`~attnkit.diagnostics.probe` sees: the attention modules of :mod:`attnkit.nn`
    and every module that calls :func:`attnkit.attention` in its forward (a Hugging Face model with
    ``attn_implementation="attnkit"`` included).  A model whose attention does not go through attnkit at all
    is refused (a ``ValueError`` saying how to route it, e.g. ``attnkit.integrations.hf.from_hf``).

    Runs ``model(batch)`` (``model(*batch)`` for a tuple, ``model(**batch)`` for a dict) in eval mode under
    :func:`~attnkit.diagnostics.probe`, then the gradient of the loss with respect to every attention
    output (parameters' ``.grad`` are not touched).  The loss is ``loss_fn(output, batch)``; by default
    next-token cross-entropy when ``batch`` is token ids ``(B, L)`` and the output logits ``(B, L, V)`` (the
    first of a tuple, or ``output.logits`` of a Hugging Face model), else ``0.5 * mean(output**2)``.

    Returns:
        A :class:`Report`: per layer and head the normalised entropy, mean largest weight, share of
        saturated rows, spread of the scores and RMS gradient of the scores; and the findings
        (``uniform``, ``sharp``, ``saturated``, ``vanishing_gradient``), each with the first article's
        likely causes and fixes.

    Example::

        >>> from attnkit.diagnostics import doctor
        >>> from attnkit.diagnostics.examples import example
        >>> model, ids = example("uniform")  # a DecoderLM whose W_q, W_k were initialised far too small
        >>> report = doctor(model, ids)
        >>> sorted(report.kinds), report.findings[0].layer
        (['uniform'], 'layers.0.attn')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, batch) -> scalar, got {loss_fn!r}")
    thresholds = Thresholds() if thresholds is None else thresholds
    if not isinstance(thresholds, Thresholds):
        raise TypeError(f"thresholds must be a Thresholds, got {type(thresholds).__name__}")
    modes = [(m, m.training) for m in model.modules()]  # each module's own mode, given back after
    model.eval()
    try:
        with probe(model, max_elements=max_elements) as p:
            try:
                with torch.enable_grad():
                    output = _run(model, batch)
                    loss = (loss_fn or _default_loss)(output, batch)
                    if not isinstance(loss, Tensor) or loss.numel() != 1:
                        raise TypeError(f"the loss must be a scalar tensor, got {loss!r:.80}")
                    outs = p.outputs()
                    final = _output_tensor(output)
                    targets = outs + ([final] if final is not None and final.requires_grad else [])
                    output_grad = None
                    if outs and loss.requires_grad:
                        grads = torch.autograd.grad(loss, targets, allow_unused=True)
                        if len(targets) > len(outs) and grads[-1] is not None:
                            g = grads[-1].detach().double()
                            output_grad = float(g.pow(2).sum(-1).mean().sqrt())  # RMS of per-row norms
            finally:
                p.release()
    finally:
        for m, mode in modes:
            m.training = mode
    stats = [s for rec in p.layers.values() for s in _head_stats(rec)]
    if not stats:
        raise ValueError(_nothing_seen(model))
    findings, grads = _diagnose(stats, thresholds, output_grad)
    weights = {name: rec.weights[0] for name, rec in p.layers.items() if rec.weights is not None}
    return Report(stats, findings, weights, grads, output_grad)
