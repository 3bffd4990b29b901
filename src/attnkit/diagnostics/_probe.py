"""``probe(model)``: record what every attnkit attention layer does, without changing what it computes.

Every attention module of :mod:`attnkit.nn` takes attention hooks (``module.register_attention_hook``, see
:class:`attnkit.nn.AttentionCall`).  While the probe is active it hooks each attention module: the module
still computes the output, and on the side the probe recomputes the attention weights from the same
``q, k, v`` and score modifiers, one block of query rows at a time, and keeps them (or, for long sequences,
only their per-row statistics).  Models that call :func:`attnkit.attention` themselves (their own modules,
or a Hugging Face model running with ``attn_implementation="attnkit"``) are seen the same way: the probe
observes each such call made while the model runs (through :func:`attnkit.functional.observe_attention`) and
files it under the innermost module that made it.  A hook on the output records the gradient of the scores
when a backward pass runs: with ``g = dL/d(out)``, ``dL/d(scores) = w * (g v^T - rowsum(w * g v^T))`` (the
softmax backward; dropout is not modelled, so probe a model in ``eval()`` mode).  On exit every hook is
removed, also after an error.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .._checks import int_in_range
from ..backends.call import Call, accumulation_dtype, make_call
from ..backends.scores import grouped_bias, grouped_index, modify_scores
from ..functional import observe_attention
from ..nn import AttentionCall
from ..softmax import stable_softmax

Tensor = torch.Tensor

__all__ = ["probe", "Probe", "LayerRecord", "CallRecord", "attention_modules", "SATURATION"]

SATURATION = 1e-4  # a row is saturated when its largest weight is within this of 1: softmax's gradient ~ 0
_ROW_BLOCK_ELEMENTS = 1 << 22  # score elements per block of query rows while recomputing weights


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every attnkit attention module inside ``model`` (those taking ``register_attention_hook``).

    Example::

        >>> from attnkit.nn import MultiHeadAttention
        >>> [name for name, _ in attention_modules(MultiHeadAttention(16, 2))]
        ['']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [
        (name, m) for name, m in model.named_modules() if callable(getattr(type(m), "register_attention_hook", None))
    ]


@dataclass
class CallRecord:
    """One attention computation of a layer.

    Attributes:
        shape: ``(B, Hq, Lq, Lk)``.
        weights: ``(B, Hq, Lq, Lk)`` float32 on the CPU, or None when larger than the probe's
            ``max_elements`` (then only the statistics are kept).
        entropy: ``(B, Hq, Lq)`` normalised entropy of each row, ``H / log(n)`` with ``n`` the keys the row
            may attend to (1 = uniform, 0 = one key); NaN for rows with fewer than two keys.
        max_weight: ``(B, Hq, Lq)`` the largest weight of each row.
        allowed: ``(B, Hq, Lq)`` int, how many keys each row may attend to.
        score_std: ``(B, Hq, Lq)`` standard deviation of each row's final (allowed) scores.
        grad_sq: ``(B, Hq)`` sum over rows of a row's squared ``dL/d(scores)`` norm times the keys ``n`` it may
            attend to, once a backward pass ran (diffuse weights split a row's gradient over its keys, so its
            norm falls as ``1/sqrt(n)`` with the length alone; the factor puts rows of any length on one scale).
        grad_rows: ``(B, Hq)`` int, the rows whose score gradient is not zero (the rows the loss reaches: a
            classifier reading one position reaches one row of its last layer), summed over backward passes
            (None before one), so ``sqrt(grad_sq / grad_rows)`` is the RMS of a row's gradient norm over those
            rows.  A row with one key (or none) gets no gradient: its weight is 1 (or 0) whatever its score.

    Example::

        >>> import torch
        >>> from attnkit.diagnostics import probe
        >>> from attnkit.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 2)
        >>> with probe(mha) as p:
        ...     _ = mha(torch.randn(1, 4, 8))
        >>> rec = p.layers[""].calls[0]
        >>> rec.shape, rec.allowed.tolist()[0][0], rec.grad_sq is None
        ((1, 2, 4, 4), [4, 4, 4, 4], True)
    """

    shape: tuple[int, int, int, int]
    weights: Tensor | None
    entropy: Tensor
    max_weight: Tensor
    allowed: Tensor
    score_std: Tensor
    grad_sq: Tensor | None = None
    grad_rows: Tensor | None = None
    _inputs: tuple | None = field(default=None, repr=False)  # (call, keep) until the backward pass ran


@dataclass
class LayerRecord:
    """What the probe saw in one attention module: one :class:`CallRecord` per attention computation.

    Example::

        >>> import torch
        >>> from attnkit.diagnostics import probe
        >>> from attnkit.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(8, 2)
        >>> with probe(mha) as p:
        ...     _ = mha(torch.randn(1, 3, 8)); _ = mha(torch.randn(1, 5, 8))
        >>> [c.shape for c in p.layers[""].calls], p.layers[""].weights.shape
        ([(1, 2, 3, 3), (1, 2, 5, 5)], torch.Size([1, 2, 5, 5]))
    """

    name: str
    module: nn.Module
    calls: list[CallRecord] = field(default_factory=list)

    @property
    def weights(self) -> Tensor | None:
        """The weights ``(B, Hq, Lq, Lk)`` of the last call, if they were kept."""
        return self.calls[-1].weights if self.calls else None


def _row_blocks(call: Call):
    """Yield ``(r0, r1, scores, weights)`` for blocks of query rows; scores/weights ``(B, Hkv, G, r, Lk)``."""
    q, k = call.q, call.k
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    acc = torch.promote_types(accumulation_dtype(q.dtype), torch.float32)
    kg = k.unsqueeze(2).to(acc)  # (B, Hkv, 1, Lk, D)
    bias = grouped_bias(call.bias, call) if isinstance(call.bias, Tensor) else None
    step = max(1, _ROW_BLOCK_ELEMENTS // max(1, B * Hq * Lk))
    for r0 in range(0, Lq, step):
        r1 = min(Lq, r0 + step)
        qg = q[:, :, r0:r1].reshape(B, Hkv, call.group, r1 - r0, D).to(acc)  # (B, Hkv, G, r, D)
        s = torch.matmul(qg, kg.transpose(-1, -2)) * call.scale  # (B, Hkv, G, r, Lk)
        b, h, qi, ki = grouped_index(call, torch.arange(r0, r1, device=q.device), torch.arange(Lk, device=q.device))
        block_bias = None
        if bias is not None:
            block_bias = bias[..., r0:r1, :] if bias.shape[-2] > 1 else bias
        s = modify_scores(s, call, b, h, qi, ki, bias_block=block_bias)
        yield r0, r1, s, stable_softmax(s, dim=-1)


def _flat(t: Tensor, call: Call) -> Tensor:
    """``(B, Hkv, G, r, ...)`` -> ``(B, Hq, r, ...)``."""
    return t.reshape(call.batch, call.heads, *t.shape[3:])


def _statistics(call: Call, keep: bool) -> CallRecord:
    B, Hq, Lq, Lk = call.batch, call.heads, call.q_len, call.kv_len
    weights = torch.empty(B, Hq, Lq, Lk, dtype=torch.float32) if keep else None
    ent, mx, allowed, sstd = (torch.empty(B, Hq, Lq) for _ in range(4))
    for r0, r1, s, w in _row_blocks(call):
        ok = torch.isfinite(s)
        n = ok.sum(-1)  # (B, Hkv, G, r)
        plogp = torch.where(w > 0, w * torch.log(w.clamp_min(1e-45)), torch.zeros_like(w))
        h = -plogp.sum(-1) / torch.log(n.clamp_min(2).to(w.dtype))
        h = torch.where(n >= 2, h, torch.full_like(h, float("nan")))
        sz = torch.where(ok, s, torch.zeros_like(s))
        mean = sz.sum(-1) / n.clamp_min(1)
        var = torch.where(ok, (sz - mean[..., None]) ** 2, torch.zeros_like(s)).sum(-1) / n.clamp_min(1)
        ent[:, :, r0:r1] = _flat(h, call).float().cpu()
        mx[:, :, r0:r1] = _flat(w.amax(-1), call).float().cpu()
        allowed[:, :, r0:r1] = _flat(n, call).float().cpu()
        sstd[:, :, r0:r1] = _flat(var.sqrt(), call).float().cpu()
        if keep:
            weights[:, :, r0:r1] = _flat(w, call).float().cpu()
    return CallRecord((B, Hq, Lq, Lk), weights, ent, mx, allowed.long(), sstd)


def _score_gradient(record: CallRecord, call: Call, grad_out: Tensor) -> None:
    """Accumulate ``|dL/d(scores)|^2`` per batch element and head from ``grad_out (B, Hq, Lq, Dv)``."""
    B, Hq = grad_out.shape[:2]
    acc = torch.promote_types(accumulation_dtype(grad_out.dtype), torch.float32)
    vg = call.v.detach().unsqueeze(2).to(acc)  # (B, Hkv, 1, Lk, Dv)
    sq = torch.zeros(B, Hq, dtype=torch.float64)
    live = torch.zeros(B, Hq, dtype=torch.long)
    for r0, r1, _, w in _row_blocks(call):
        g = grad_out[:, :, r0:r1].reshape(B, call.kv_heads, call.group, r1 - r0, -1).to(acc)  # (B, Hkv, G, r, Dv)
        dw = torch.matmul(g, vg.transpose(-1, -2))  # (B, Hkv, G, r, Lk)
        ds = w * (dw - (dw * w).sum(-1, keepdim=True))
        row_sq = _flat(ds.pow(2).sum(-1), call).double().cpu()  # (B, Hq, r)
        # diffuse weights split a row's gradient over its n keys (|dL/ds| ~ spread / sqrt(n)): scaled by n,
        # the squared norm is on one key's scale, so a long sequence alone does not look like a vanishing one
        sq += (row_sq * record.allowed[:, :, r0:r1].double()).sum(-1)
        live += (row_sq > 0).sum(-1)  # rows the loss reaches
    record.grad_sq = sq if record.grad_sq is None else record.grad_sq + sq
    record.grad_rows = live if record.grad_rows is None else record.grad_rows + live


class Probe:
    """The records of an active (or finished) :func:`probe`: ``layers`` maps module names to records.

    Example::

        >>> import torch
        >>> from attnkit.diagnostics import probe
        >>> from attnkit.nn import DecoderConfig, DecoderLM
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> with probe(model) as p:
        ...     _ = model(torch.randint(0, 256, (1, 6)))
        >>> sorted(p.layers), len(p.outputs())
        (['layers.0.attn', 'layers.1.attn'], 2)
    """

    def __init__(self, model: nn.Module, max_elements: int):
        self.model = model
        self.max_elements = max_elements
        self.layers: dict[str, LayerRecord] = {}
        self._outputs: list[Tensor] = []
        self._thread = threading.get_ident()  # attention() calls of other threads are not this model's
        self._running: list[tuple[str, nn.Module]] = []  # the modules whose forward is running, outermost first
        self._in_hook = 0  # > 0 inside the probe's attention hook: its attention() call is recorded there already

    def outputs(self) -> list[Tensor]:
        """The outputs of every recorded attention call that are part of an autograd graph."""
        return [o for o in self._outputs if o.requires_grad]

    def release(self) -> None:
        """Drop the references to the recorded calls' inputs and outputs (frees the autograd graph)."""
        self._outputs.clear()
        for layer in self.layers.values():
            for c in layer.calls:
                c._inputs = None

    def _record(self, name: str, module: nn.Module, seen: AttentionCall, out: Tensor) -> None:
        """Keep the statistics of one attention call (and its score gradient once a backward pass runs)."""
        with torch.no_grad():
            q, k, v = seen.q.detach(), seen.k.detach(), seen.v.detach()
            call = make_call(q, k, v, mask=seen.mask, bias=seen.bias, scale=seen.scale, softcap=seen.softcap)
            if call.q_len == 0 or call.kv_len == 0:
                return
            keep = call.batch * call.heads * call.q_len * call.kv_len <= self.max_elements
            rec = _statistics(call, keep)
        rec._inputs = (call,)
        self.layers.setdefault(name, LayerRecord(name, module)).calls.append(rec)
        if out.requires_grad:

            def hook(grad, rec=rec):
                if rec._inputs is not None:
                    with torch.no_grad():
                        _score_gradient(rec, rec._inputs[0], grad.detach())
                return None

            out.register_hook(hook)
            self._outputs.append(out)

    def _hook(self, name: str):
        """The attention hook recording the calls of the module ``name``."""

        def hook(module: nn.Module, call: AttentionCall, compute) -> Tensor:
            if call.sinks is not None:  # (the recomputed weights would leave the sinks' share out)
                raise ValueError(
                    f"probe: layer {name or '(model)'!r} has learned attention sinks, which the probe's "
                    f"statistics do not model: probe a model without sinks"
                )
            self._in_hook += 1
            try:
                out = compute(call)
            finally:
                self._in_hook -= 1
            self._record(name, module, call, out)
            return out

        return hook

    def _observe(self, q, k, v, *, mask, bias, scale, softcap, out) -> None:
        """An :func:`attnkit.attention` call made outside an attention hook while the model runs."""
        if self._in_hook or not self._running or threading.get_ident() != self._thread:
            return
        name, module = self._running[-1]
        self._record(name, module, AttentionCall(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap), out)

    def _track(self, model: nn.Module) -> list:
        """Forward hooks on every module of ``model`` that keep :attr:`_running` (the handles, to remove)."""
        handles = []
        for name, module in model.named_modules():

            def enter(mod, args, name=name):
                if threading.get_ident() == self._thread:
                    self._running.append((name, mod))

            def leave(mod, args, output):
                if threading.get_ident() == self._thread and self._running and self._running[-1][1] is mod:
                    self._running.pop()

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave, always_call=True))
        return handles


@contextmanager
def probe(model: nn.Module, *, max_elements: int = 1 << 22):
    """Record every attnkit attention layer of ``model`` while the context is active.

    The layers are the attention modules of :mod:`attnkit.nn` (through their attention hooks) and any other
    module of ``model`` that calls :func:`attnkit.attention` in its forward (a Hugging Face attention layer
    with ``attn_implementation="attnkit"``, or your own), named after the innermost module making the call.
    For each call the probe keeps a :class:`CallRecord`: the weights ``(B, Hq, Lq, Lk)`` when
    they have at most ``max_elements`` entries (else only per-row statistics: normalised entropy, largest
    weight, allowed keys, spread of the scores), and, once a backward pass runs through the output, the
    squared norm of the gradient of the scores per batch element and head.  The model computes exactly
    what it computes without the probe.  The hooks are removed on exit, also after an error.

    Yields:
        A :class:`Probe`; ``probe.layers`` maps module names (as in ``model.named_modules()``) to
        :class:`LayerRecord`.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.diagnostics import probe
        >>> from attnkit.nn import MultiHeadAttention
        >>> mha = MultiHeadAttention(16, 2, mask=masks.causal())
        >>> with probe(mha) as p:
        ...     mha(torch.randn(1, 5, 16)).sum().backward()
        >>> rec = p.layers[""].calls[0]
        >>> rec.weights.shape, rec.grad_sq.shape
        (torch.Size([1, 2, 5, 5]), torch.Size([1, 2]))
        >>> with probe(mha):  # probes nest: each records every call
        ...     with probe(mha) as inner:
        ...         _ = mha(torch.randn(1, 5, 16))
        >>> len(inner.layers[""].calls)
        1

    A module of your own that calls :func:`attnkit.attention` is recorded under its name::

        >>> import attnkit
        >>> class SelfAttention(torch.nn.Module):
        ...     def forward(self, x):  # x (B, H, L, D)
        ...         return attnkit.attention(x, x, x, mask=masks.causal())
        >>> model = torch.nn.Sequential(SelfAttention())
        >>> with probe(model) as p:
        ...     _ = model(torch.randn(1, 2, 4, 8))
        >>> sorted(p.layers), p.layers["0"].calls[0].shape
        (['0'], (1, 2, 4, 4))
    """
    max_elements = int_in_range(
        "max_elements", max_elements, 0, fix=" (weights larger than this are summarised, not kept)"
    )
    modules = attention_modules(model)
    p = Probe(model, max_elements)
    handles: list = []
    try:
        for name, module in modules:
            handles.append(module.register_attention_hook(p._hook(name)))
        handles += p._track(model)
        handles.append(observe_attention(p._observe))
        yield p
    finally:
        for h in reversed(handles):
            h.remove()
        p._running.clear()
