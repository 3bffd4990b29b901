"""``distill(teacher, student, batches, steps=...)``: the training loop, and :class:`DistillReport`."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from itertools import count

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _checks
from ..nn.tasks import IGNORE
from ._capture import attention_layers, capture
from ._losses import HiddenProjection, attention_kl, hidden_mse, logit_kl, relation_kl

Tensor = torch.Tensor

__all__ = ["distill", "DistillConfig", "DistillReport", "uniform_layer_map", "TERMS"]

TERMS = ("logits", "targets", "hidden", "attention", "relations")
# an attention row's KL is small next to the logits' T^2-scaled KL: without the factor 10 the attention
# barely steers a student (benchmarks/distill.py measures both)
_LM_WEIGHTS = {"logits": 1.0, "attention": 10.0}
_STACK_WEIGHTS = {"hidden": 1.0, "attention": 10.0}


def uniform_layer_map(n_student: int, n_teacher: int) -> dict[int, int]:
    """Student layer ``i`` learns from teacher layer ``floor((i + 1) n_teacher / n_student) - 1``: layers spread
    evenly, the last student layer on the last teacher layer (one-to-one when the depths are equal).

    Example::

        >>> from attnkit.distill import uniform_layer_map
        >>> uniform_layer_map(2, 4), uniform_layer_map(3, 3)
        ({0: 1, 1: 3}, {0: 0, 1: 1, 2: 2})
    """
    if n_student > n_teacher:
        return {i: min(n_teacher - 1, i * n_teacher // n_student) for i in range(n_student)}
    return {i: (i + 1) * n_teacher // n_student - 1 for i in range(n_student)}


@dataclass
class DistillReport:
    """What :func:`distill` did.

    Attributes:
        steps: optimisation steps taken.
        losses: per step, the weighted total (``"total"``) and every active term's unweighted value.
        weights: the loss weights used; ``layer_map`` the ``{student layer: teacher layer}`` pairs.
        teacher_accuracy, student_accuracy: on the evaluation batch after training (None without targets
            or logits); ``student_accuracy_before`` the student's before training.
        curve: ``(step, student accuracy)`` every ``eval_every`` steps.
        seconds: wall time of the loop.

    Example::

        >>> r = DistillReport(steps=2, losses=[{"total": 2.0}, {"total": 1.0}], weights={"logits": 1.0},
        ...                   layer_map={0: 0}, teacher_accuracy=1.0, student_accuracy=0.5)
        >>> r.total_losses, r.relative_accuracy
        ([2.0, 1.0], 0.5)
    """

    steps: int
    losses: list[dict[str, float]]
    weights: dict[str, float]
    layer_map: dict[int, int]
    teacher_accuracy: float | None = None
    student_accuracy: float | None = None
    student_accuracy_before: float | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total_losses(self) -> list[float]:
        """The weighted total loss of every step."""
        return [s["total"] for s in self.losses]

    @property
    def relative_accuracy(self) -> float | None:
        """Student accuracy over teacher accuracy (None when either is unknown or the teacher's is 0)."""
        if self.teacher_accuracy is None or self.student_accuracy is None or not self.teacher_accuracy:
            return None
        return self.student_accuracy / self.teacher_accuracy

    def __str__(self) -> str:
        def mean(key, part):
            vals = [s[key] for s in part if key in s]
            return f"{sum(vals) / len(vals):.4f}" if vals else "-"

        n = max(1, min(10, self.steps // 5 or 1))
        first, last = self.losses[:n], self.losses[-n:]
        keys = ["total"] + [k for k in TERMS if self.weights.get(k)]
        lines = [
            f"distilled {self.steps} steps in {self.seconds:.1f} s; layer map (student: teacher) "
            f"{self.layer_map}; weights {self.weights}",
            f"  {'loss':10s} {'first ' + str(n):>10s} {'last ' + str(n):>10s}",
        ]
        lines += [f"  {k:10s} {mean(k, first):>10s} {mean(k, last):>10s}" for k in keys]
        if self.teacher_accuracy is not None:
            before = "" if self.student_accuracy_before is None else f" (before: {self.student_accuracy_before:.1%})"
            lines.append(
                f"  accuracy: teacher {self.teacher_accuracy:.1%}, student {self.student_accuracy:.1%}"
                f"{before}, {self.relative_accuracy:.1%} of the teacher's"
                if self.relative_accuracy is not None
                else f"  accuracy: teacher {self.teacher_accuracy:.1%}, student {self.student_accuracy:.1%}{before}"
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------- the models


def _is_hf(model) -> bool:
    tr = sys.modules.get("transformers")
    return tr is not None and isinstance(model, tr.PreTrainedModel)


class _Side:
    """One model (teacher or student) run on a batch: ``(logits or None, hidden states, attention)``."""

    def __init__(self, name: str, model):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{name} must be a torch.nn.Module (an attnkit model or a Hugging Face model), got "
                f"{type(model).__name__}"
            )
        from ..nn.blocks import Decoder, Encoder

        self.name, self.model, self.hf = name, model, _is_hf(model)
        if self.hf:
            cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            self.n_layers, self.width = cfg.num_hidden_layers, cfg.hidden_size
            self.vocab = getattr(cfg, "vocab_size", None)
            self.stack = False
        else:
            attn, blocks = attention_layers(model)
            if not attn:
                raise TypeError(
                    f"{name} ({type(model).__name__}) has no attnkit attention layers: pass an attnkit.nn "
                    f"model, a Hugging Face model, or a Hugging Face model converted with "
                    f"attnkit.integrations.hf.from_hf"
                )
            self.n_layers = len(attn)
            self.width = blocks[0].attn.d_model if blocks else None
            self.vocab = getattr(getattr(model, "config", None), "vocab_size", None)
            self.stack = isinstance(model, (Encoder, Decoder))  # returns hidden states, not logits

    def run(self, inputs, *, attention: bool, hidden: bool):
        m = self.model
        if self.hf:
            kw = dict(inputs) if isinstance(inputs, dict) else {"input_ids": inputs}
            out = m(**kw, output_attentions=attention, output_hidden_states=hidden)
            attn = list(out.attentions) if attention else []
            if attention and (len(attn) != self.n_layers or any(a is None for a in attn)):
                raise ValueError(
                    f"the {self.name} (a Hugging Face {type(m).__name__}) returned no attention weights: "
                    f"build it with attn_implementation='eager' (or 'attnkit' after "
                    f"attnkit.integrations.hf.register()), or convert it with from_hf"
                )
            hs = list(out.hidden_states[1:]) if hidden else []
            return out.logits, hs, attn
        with capture(m) as cap:
            out = m(**inputs) if isinstance(inputs, dict) else m(inputs)
        logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
        if logits is None:
            raise TypeError(
                f"the {self.name} returned {type(out).__name__}: expected a tensor (logits or, for an "
                f"Encoder/Decoder stack, hidden states) or an object with .logits"
            )
        missing = [i for i, a in enumerate(cap.attention) if a is None] if attention else []
        if missing:
            raise ValueError(
                f"the {self.name}'s attention layers {missing} computed no attention in its forward "
                f"pass (a layer served by a cache that attends itself, or not called): run it without "
                f"a cache"
            )
        return (None if self.stack else logits), cap.hidden, cap.attention


def _layer_map(layer_map, student: _Side, teacher: _Side) -> dict[int, int]:
    if layer_map is None:
        return uniform_layer_map(student.n_layers, teacher.n_layers)
    if isinstance(layer_map, dict):
        pairs = list(layer_map.items())
    elif isinstance(layer_map, (list, tuple)):
        if len(layer_map) != student.n_layers:
            raise ValueError(
                f"layer_map has {len(layer_map)} entries but the student has {student.n_layers} layers: "
                f"give one teacher layer (or None) per student layer, or a dict {{student: teacher}}"
            )
        pairs = [(i, t) for i, t in enumerate(layer_map) if t is not None]
    else:
        raise TypeError(
            f"layer_map must be None (uniform), a dict {{student layer: teacher layer}} or a list of "
            f"teacher layers, got {type(layer_map).__name__}"
        )
    out = {}
    for s, t in pairs:
        for who, name, i, n in (
            ("student", "layer_map key", s, student.n_layers),
            ("teacher", f"layer_map[{s!r}]", t, teacher.n_layers),
        ):
            _checks.int_in_range(name, i, 0, n, fix=f" (a {who} layer: the {who} has {n} layers)")
        out[s] = t
    if not out:
        raise ValueError("layer_map pairs no layers: give at least one {student layer: teacher layer}")
    return out


def _weights(weights, student: _Side, teacher: _Side) -> dict[str, float]:
    stack = student.stack or teacher.stack
    if weights is None:
        weights = dict(_STACK_WEIGHTS if stack else _LM_WEIGHTS)
    if not isinstance(weights, dict):
        raise TypeError(
            f"weights must be a dict such as {{'logits': 1.0, 'attention': 1.0}}, got {type(weights).__name__}"
        )
    out = {}
    for k, w in weights.items():
        if k not in TERMS:
            raise ValueError(f"unknown loss term {k!r} in weights: choose from {', '.join(TERMS)}")
        _checks.number(f"weights[{k!r}]", w, low=0.0)
        if w:
            out[k] = float(w)
    if not out:
        raise ValueError("every loss weight is 0: give at least one term a weight > 0")
    if stack and (out.get("logits") or out.get("targets")):
        which = "student" if student.stack else "teacher"
        raise ValueError(
            f"the {which} is an Encoder/Decoder stack, which returns hidden states, not logits: use "
            f"weights={{'hidden': 1.0, 'attention': 1.0}} (or wrap the stack with an output head)"
        )
    if out.get("relations") and (student.hf or teacher.hf):
        raise ValueError(
            "relation transfer needs each layer's queries, keys and values, which a Hugging Face "
            "model does not return: convert it with attnkit.integrations.hf.from_hf, or set "
            "weights['relations'] to 0"
        )
    if out.get("logits") and student.vocab is not None and teacher.vocab is not None and student.vocab != teacher.vocab:
        raise ValueError(
            f"the vocabularies differ: the student has vocab_size={student.vocab}, the teacher "
            f"{teacher.vocab}; logit distillation needs one vocabulary (the same tokenizer): build the "
            f"student with vocab_size={teacher.vocab}, or set weights['logits'] to 0"
        )
    return out


def _split(batch):
    """``(model inputs, targets or None)`` of a batch."""
    if hasattr(batch, "ids") and hasattr(batch, "targets"):  # attnkit.nn.tasks.TaskBatch
        return batch.ids, batch.targets
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, dict):
        d = dict(batch)
        return d, d.pop("targets", None)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"a batch must be a TaskBatch, a tensor of inputs, a pair (inputs, targets) or a dict of model "
        f"keyword arguments (with optional 'targets'), got {type(batch).__name__}"
    )


def _batch_source(batches):
    """A function ``step -> batch or None`` (None: the batches ran out)."""
    if callable(batches) and not hasattr(batches, "__iter__"):
        return batches
    if not hasattr(batches, "__iter__") or isinstance(batches, (Tensor, dict)):
        raise TypeError(
            f"batches must be a function step -> batch or an iterable of batches, got {type(batches).__name__}"
        )
    state = {"it": iter(batches)}
    reiterable = state["it"] is not batches

    def get(step):
        try:
            return next(state["it"])
        except StopIteration:
            if not reiterable:
                return None
            state["it"] = iter(batches)
            return next(state["it"], None)

    return get


def _modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    return [(m, m.training) for m in model.modules()]


def _restore(modes) -> None:
    for m, training in modes:
        m.training = training


# ------------------------------------------------------------------------------------------- the loop


def _accuracy(side: _Side, inputs, targets) -> float | None:
    if targets is None:
        return None
    from ..nn.tasks import accuracy

    modes = _modes(side.model)
    side.model.eval()
    try:
        with torch.no_grad():
            logits = side.run(inputs, attention=False, hidden=False)[0]
    finally:
        _restore(modes)
    return None if logits is None else accuracy(logits, targets)


def _progress(enabled: bool, steps: int):
    """A rich progress bar, or None (disabled, or rich not installed)."""
    if not enabled:
        return None
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return Progress(
        TextColumn("distil"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[acc]}"),
        TimeElapsedColumn(),
    )


@dataclass(frozen=True)
class DistillConfig:
    """How :func:`distill` trains, as one object (see :func:`distill` for what each option does); checked when
    built.  The parts of one run, ``eval_batch`` and ``on_step``, are passed to :func:`distill` beside it.

    Example::

        >>> from attnkit.distill import DistillConfig
        >>> cfg = DistillConfig(steps=100, weights={"logits": 1.0, "relations": 1.0}, lr=1e-3, progress=False)
        >>> cfg.replace(steps=10).steps, cfg.temperature
        (10, 2.0)
    """

    steps: int  # optimisation steps (>= 1)
    layer_map: dict | list | None = None  # {student layer: teacher layer}, a teacher layer or None per student layer
    weights: dict[str, float] | None = None  # loss term -> weight (terms: TERMS); None: the defaults
    temperature: float = 2.0  # of the logits' KL
    heads: str = "auto"  # attention terms: "mean", "map" or "auto"
    relation_heads: int | None = None  # relation heads of the "relations" term (MiniLMv2)
    chunk_rows: int | None = None  # query rows per block of the attention and relation terms
    scored_only: bool = True  # with targets, the logits' KL at the scored positions only
    lr: float = 3e-3  # AdamW's peak learning rate
    weight_decay: float = 0.0
    warmup: int = 20  # linear warm-up steps before the cosine decay
    clip: float = 1.0  # gradient-norm clip (0: none)
    eval_every: int | None = None  # student accuracy on eval_batch every this many steps (report.curve)
    progress: bool = True  # a rich progress bar, when rich is installed

    def __post_init__(self):
        _checks.int_in_range("steps", self.steps, 1)
        _checks.positive_float("temperature", self.temperature)
        _checks.choice("heads", self.heads, ("auto", "mean", "map"))
        _checks.integer("eval_every", self.eval_every, minimum=1, allow_none=True)

    def replace(self, **changes) -> "DistillConfig":
        """A copy with some fields changed (checked)."""
        return dataclasses.replace(self, **changes)


def _distill_config(config, options: dict) -> DistillConfig:
    """``config``, or the :class:`DistillConfig` the keyword options make (checked in one place)."""
    if config is not None:
        if not isinstance(config, DistillConfig):
            raise TypeError(f"distill's config must be an attnkit.distill.DistillConfig, got {type(config).__name__}")
        if options:
            raise TypeError(
                f"distill got a DistillConfig and the options {', '.join(options)}: pass one or the other "
                f"(config.replace(...) makes a config with some fields changed)"
            )
        return config
    try:
        return DistillConfig(**options)
    except TypeError as e:  # a missing or unknown option
        names = ", ".join(f.name for f in dataclasses.fields(DistillConfig))
        raise TypeError(
            f"distill: {str(e).split('() ', 1)[-1]} (its options are eval_batch, on_step and "
            f"DistillConfig's fields: {names})"
        ) from None


def distill(
    teacher: nn.Module,
    student: nn.Module,
    batches,
    config: DistillConfig | None = None,
    *,
    eval_batch=None,
    on_step=None,
    **options,
) -> DistillReport:
    """Train ``student`` to imitate ``teacher`` on ``batches`` for ``steps`` steps; returns a :class:`DistillReport`.

    The options are a :class:`DistillConfig`: ``distill(teacher, student, batches, DistillConfig(steps=100,
    lr=1e-3))``, or, as a convenience, its fields as keywords, ``distill(teacher, student, batches, steps=100,
    lr=1e-3)``, which build one.

    Each step runs the teacher (eval mode, no gradients) and the student (train mode) on one batch and minimises
    ``sum_term weights[term] * loss_term`` over the active terms:

    * ``"logits"``: :func:`logit_kl` at ``temperature`` (with targets and ``scored_only``, at the scored
      positions only: where ``targets != -100``);
    * ``"targets"``: cross entropy with the batch's targets (the ordinary task loss);
    * ``"hidden"``: :func:`hidden_mse` of each mapped layer's output, through a learned
      :class:`HiddenProjection` when the widths differ (trained with the student);
    * ``"attention"``: :func:`attention_kl` of each mapped layer (``heads="mean"`` or ``"map"``; ``"auto"``:
      ``"map"`` where the teacher layer's head count is a multiple of the student layer's, else ``"mean"``);
    * ``"relations"``: :func:`relation_kl` of the q-q, k-k and v-v relations of each mapped layer
      (MiniLMv2; ``relation_heads``), under the teacher layer's mask.

    Layer terms are averaged over the pairs of ``layer_map`` (``{student layer: teacher layer}``, a list of one
    teacher layer or None per student layer, or None: :func:`uniform_layer_map`).  Attention and relation terms
    are computed in blocks of ``chunk_rows`` query rows, recomputed in the backward pass, so no layer's full
    ``Lq x Lk`` weights are kept.  Default weights: ``{"logits": 1, "attention": 10}``, or ``{"hidden": 1,
    "attention": 10}`` when a model is a bare :class:`~attnkit.nn.Encoder` / :class:`~attnkit.nn.Decoder` stack
    (which returns hidden states).

    Models: attnkit models (:class:`~attnkit.nn.DecoderLM`, :class:`~attnkit.nn.Encoder`, anything built from
    :class:`~attnkit.nn.TransformerBlock` s), read through :func:`capture`; or Hugging Face models, run with
    ``output_attentions`` / ``output_hidden_states`` (build them with ``attn_implementation="eager"`` or
    ``"attnkit"``; they hold full weights, and give no q/k/v for relations: convert with
    :func:`attnkit.integrations.hf.from_hf` for those).  A layer's hidden state is its block's output; for a
    Hugging Face model, its ``hidden_states[i + 1]`` (the last one after the final norm, as transformers
    returns it).

    Batches: ``batches`` is a function ``step -> batch`` or an iterable (a list is cycled; an iterator that
    runs out ends the loop early).  A batch is an :class:`attnkit.nn.tasks.TaskBatch`, a tensor of inputs, a
    pair ``(inputs, targets)`` or a dict of keyword arguments for the models (``targets`` popped).  Accuracy
    (arg-max over scored targets) is measured on ``eval_batch`` (default: the last training batch), for the
    teacher and for the student before and after, and every ``eval_every`` steps for ``report.curve``.

    Optimiser: AdamW (``lr``, ``weight_decay``, betas 0.9/0.98) with ``warmup`` linear steps and cosine
    decay, gradients clipped to ``clip``: the same as :func:`attnkit.nn.tasks.train_lm`, so a student trained
    from scratch with it compares like with like.  ``progress`` shows a rich progress bar when rich is
    installed.  ``on_step(step, losses)`` may return True to stop.

    What the caller owns: the teacher's weights, gradients and train/eval modes are unchanged (it runs under
    ``torch.no_grad``; a student sharing a parameter with it is refused); the student's weights are trained
    (the purpose of the call) and its modes restored at the end.  Bad layer maps, weights, mismatched
    vocabularies and models without attention layers raise before any step.

    Example::

        >>> import torch
        >>> from attnkit.nn import DecoderConfig, DecoderLM
        >>> from attnkit.nn.tasks import associative_recall
        >>> from attnkit.distill import distill
        >>> teacher = DecoderLM(DecoderConfig.preset("tiny", vocab_size=32))
        >>> student = DecoderLM(DecoderConfig.preset("tiny", vocab_size=32, d_model=32, n_layers=1))
        >>> report = distill(teacher, student, lambda step: associative_recall(8, n_pairs=4, n_queries=2),
        ...                  steps=3, progress=False)
        >>> report.steps, report.layer_map, sorted(report.losses[0])
        (3, {0: 1}, ['attention', 'logits', 'total'])
        >>> report.weights
        {'logits': 1.0, 'attention': 10.0}
    """
    cfg = _distill_config(config, options)
    steps = cfg.steps
    t_side, s_side = _Side("teacher", teacher), _Side("student", student)
    if teacher is student:
        raise ValueError(
            "teacher and student are the same model: distil into a separate student (e.g. "
            "copy.deepcopy(teacher), or attnkit.distill.sparse_student(teacher, mask))"
        )
    shared = {id(p) for p in teacher.parameters()} & {id(p) for p in student.parameters()}
    if shared:
        raise ValueError(
            f"the student shares {len(shared)} parameter tensor(s) with the teacher: training it would "
            f"change the teacher; give the student its own copy (copy.deepcopy)"
        )
    lmap = _layer_map(cfg.layer_map, s_side, t_side)
    w = _weights(cfg.weights, s_side, t_side)
    projections = nn.ModuleDict()
    if "hidden" in w:
        for s in lmap:
            if s_side.width is None or t_side.width is None:
                raise ValueError("hidden-state matching needs models built from TransformerBlocks (or HF models)")
            projections[str(s)] = HiddenProjection(s_side.width, t_side.width)
        ref = next(student.parameters(), None)
        if ref is not None:
            projections.to(device=ref.device, dtype=ref.dtype)
    params = list(student.parameters()) + list(projections.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    warmup = cfg.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda st: min(1.0, (st + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(st, steps) / steps))
    )
    get = _batch_source(batches)
    need_attn = "attention" in w or "relations" in w
    need_hidden = "hidden" in w

    t_modes, s_modes = _modes(teacher), _modes(student)
    report = DistillReport(steps=0, losses=[], weights=w, layer_map=lmap)
    start = time.perf_counter()
    bar = _progress(cfg.progress, steps)
    last = None
    ev = _split(eval_batch) if eval_batch is not None else None
    try:
        teacher.eval()
        if ev is not None:
            report.teacher_accuracy = _accuracy(t_side, *ev)
            report.student_accuracy_before = _accuracy(s_side, *ev)
        if bar is not None:
            bar.start()
            job = bar.add_task("distil", total=steps, loss="-", acc="")
        for step in count():
            if step >= steps:
                break
            batch = get(step)
            if batch is None:
                break
            inputs, targets = _split(batch)
            last = (inputs, targets)
            if step == 0 and ev is None and targets is not None:
                report.student_accuracy_before = _accuracy(s_side, inputs, targets)
            student.train()
            projections.train()
            with torch.no_grad():
                t_logits, t_hidden, t_attn = t_side.run(inputs, attention=need_attn, hidden=need_hidden)
            s_logits, s_hidden, s_attn = s_side.run(inputs, attention=need_attn, hidden=need_hidden)
            terms = _terms(
                cfg, w, lmap, (s_logits, s_hidden, s_attn), (t_logits, t_hidden, t_attn), targets, projections
            )
            total = sum(w[k] * v for k, v in terms.items())
            opt.zero_grad(set_to_none=True)
            total.backward()
            if cfg.clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            sched.step()
            record = {"total": float(total.detach()), **{k: float(v.detach()) for k, v in terms.items()}}
            report.losses.append(record)
            report.steps = step + 1
            acc_text = ""
            if cfg.eval_every and ev is not None and (step + 1) % cfg.eval_every == 0:
                acc = _accuracy(s_side, *ev)
                if acc is not None:
                    report.curve.append((step + 1, acc))
                    acc_text = f"accuracy {acc:.1%}"
            if bar is not None:
                bar.update(job, advance=1, loss=f"{record['total']:.4f}", **({"acc": acc_text} if acc_text else {}))
            if on_step is not None and on_step(step, record):
                break
        final = ev if ev is not None else last
        if final is not None:
            if report.teacher_accuracy is None:
                report.teacher_accuracy = _accuracy(t_side, *final)
            report.student_accuracy = _accuracy(s_side, *final)
    finally:
        if bar is not None:
            bar.stop()
        _restore(t_modes)
        _restore(s_modes)
        report.seconds = time.perf_counter() - start
    if report.steps == 0:
        raise ValueError("batches gave no batch: nothing was distilled")
    return report


def _heads(heads: str, student, teacher) -> str:
    if heads != "auto":
        return heads
    hs, ht = (x.shape[1] for x in (student, teacher))
    return "map" if ht % hs == 0 else "mean"


def _terms(cfg: DistillConfig, w, lmap, student: tuple, teacher: tuple, targets, projections) -> dict[str, Tensor]:
    """Each active loss term (unweighted) of one step; ``student`` and ``teacher`` are (logits, hidden, attention)."""
    (s_logits, s_hidden, s_attn), (t_logits, t_hidden, t_attn) = student, teacher
    heads, relation_heads, chunk_rows = cfg.heads, cfg.relation_heads, cfg.chunk_rows
    out = {}
    scored = None
    if targets is not None and cfg.scored_only and s_logits is not None and targets.shape == s_logits.shape[:-1]:
        scored = targets != IGNORE
        if not bool(scored.any()):
            scored = None
    if "logits" in w:
        out["logits"] = logit_kl(s_logits, t_logits, temperature=float(cfg.temperature), mask=scored)
    if "targets" in w:
        if targets is None:
            raise ValueError("weights['targets'] > 0 needs batches with targets (a TaskBatch or (inputs, targets))")
        out["targets"] = F.cross_entropy(s_logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE)
    pairs = sorted(lmap.items())
    if "hidden" in w:
        out["hidden"] = sum(
            hidden_mse(s_hidden[s], t_hidden[t], projection=projections[str(s)].proj) for s, t in pairs
        ) / len(pairs)
    if "attention" in w:
        out["attention"] = sum(
            attention_kl(s_attn[s], t_attn[t], heads=_heads(heads, s_attn[s], t_attn[t]), chunk_rows=chunk_rows)
            for s, t in pairs
        ) / len(pairs)
    if "relations" in w:
        total = 0.0
        for s, t in pairs:
            rs, rt = s_attn[s], t_attn[t]
            for name in ("q", "k", "v"):
                total = total + relation_kl(
                    getattr(rs, name),
                    getattr(rt, name),
                    relation_heads=relation_heads,
                    mask=rt.mask,
                    chunk_rows=chunk_rows,
                )
        out["relations"] = total / (3 * len(pairs))
    return out
