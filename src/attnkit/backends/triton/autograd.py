"""The ``triton`` backend's autograd function: the forward and backward launches (``ops``) as one
differentiable op ``(q, k, v, sinks) -> (out, lse)``, and the eager computation of a call."""

from __future__ import annotations

from typing import Any

import torch

from ...softmax import add_sink_unchecked as add_sink  # (inputs checked by the call)
from ..call import Call
from ..reads import check_unchanged, tensor_versions
from ..scores import sink_grad
from .ops import _backward, _forward, _Mods, _mods, _Plans, _plans

Tensor = torch.Tensor


class _Attention(torch.autograd.Function):
    """Forward and backward kernels as one differentiable op: ``(q, k, v) -> (out, lse)``."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, mods: _Mods, plans: _Plans
    ) -> tuple[Tensor, Tensor]:
        out, lse = _with_sinks(*_forward(q, k, v, mods, plans.forward()), sinks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mods, ctx.plans, ctx.sinks = mods, plans, sinks
        ctx.versions = tensor_versions(plans.mask, mods.source)  # the backward reads them again
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None, None, None]:
        check_unchanged(ctx.versions)
        q, k, v, out, lse = ctx.saved_tensors
        # with sinks the saved (out, lse) include them: the kernels' p = exp(s - lse) is the sink's softmax
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.mods, ctx.plans.backward())
        dsink = sink_grad(out, lse, dout, dlse, ctx.sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """The sinks (when given) added to each row's denominator after the kernel: the output rescaled, the lse
    grown to include them."""
    if sinks is None:
        return out, lse
    return add_sink(out, lse, sinks.detach())


def _run(call: Call) -> Tensor | tuple[Tensor, Tensor]:
    """Compute a validated call eagerly (``out``, or ``(out, lse)`` with ``return_lse``)."""
    mods = _mods(call)
    plans = _plans(call)
    if call.needs_grad:
        # (torch's Function.apply has no annotations)
        out, lse = _Attention.apply(call.q, call.k, call.v, call.sinks, mods, plans)  # type: ignore[no-untyped-call]
    else:
        out, lse = _with_sinks(*_forward(call.q, call.k, call.v, mods, plans.forward()), call.sinks)
    return (out, lse) if call.return_lse else out
