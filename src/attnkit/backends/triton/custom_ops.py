"""The ``triton`` backend as ``torch.library`` custom operators, so ``torch.compile`` and ``torch.export`` see
one node per attention call and never trace into the kernel launches.

Two operators, ``attnkit::triton_forward`` and ``attnkit::triton_backward``, with fake (shape-only)
implementations and the backward registered as the forward's autograd formula, built as the ``flash``
backend's are (``backends.operators``: a mask or score modifier enters as a description key plus its tensors, the
tile plan of a mask and a shape is kept by the eager backend's plan cache, so a fixed-shape loop plans once).
They launch the very kernels an eager call launches (``ops._forward`` / ``ops._backward``), on the
device of ``q`` and on the current CUDA stream, and return tensors on that device.  Gradients reach ``q``,
``k``, ``v`` and the sinks; the backend refuses biases and modifiers that need gradients (``attnkit.backends.triton.check``),
so the operators compute none for them.

The tests run the operators on CPU tensors under Triton's interpreter (``tests/backends/test_triton_ops.py``:
``torch.library.opcheck``, ``fullgraph`` compiles against eager, no recompiles); GPU runs are covered by the
GPU benchmark script, ``benchmarks/gpu.py``, whose correctness checks call the backend eagerly and compiled.

Example (shapes only: the fake implementation, which runs without triton)::

    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> from attnkit.backends.triton import custom_ops
    >>> with FakeTensorMode():
    ...     q, k, v = torch.empty(1, 4, 40, 16), torch.empty(1, 2, 40, 16), torch.empty(1, 2, 40, 8)
    ...     out, lse = custom_ops.triton_forward(q, k, v, "", [], None, "", [], None, 0.25, 0.0)
    >>> tuple(out.shape), tuple(lse.shape), lse.dtype
    ((1, 4, 40, 8), (1, 4, 40), torch.float32)
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..call import Call
from ..scores import sink_grad
from ..operators import OP_INPUTS, fake_input_grads, fake_out_lse, op_call, op_inputs, refuse_double_backward
from .autograd import _with_sinks
from .ops import _backward as _launch_backward
from .ops import _forward as _launch_forward
from .ops import _mods, _plans

Tensor = torch.Tensor

__all__: list[str] = []


@torch.library.custom_op("attnkit::triton_forward", mutates_args=())
def triton_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_key: str,
    mask_tensors: list[Tensor],
    bias: Optional[Tensor],
    mod_key: str,
    mod_tensors: list[Tensor],
    sinks: Optional[Tensor],
    scale: float,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq) float32)``: the triton backend's forward, the sinks (when
    given) included in each row's denominator and lse.  ``softcap=0`` means none."""
    call = op_call(q, k, v, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale, softcap)
    out, lse = _with_sinks(*_launch_forward(q, k, v, _mods(call), _plans(call).forward()), sinks)
    return out.contiguous(), lse.contiguous()


@triton_forward.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_key: str,
    mask_tensors: list[Tensor],
    bias: Optional[Tensor],
    mod_key: str,
    mod_tensors: list[Tensor],
    sinks: Optional[Tensor],
    scale: float,
    softcap: float,
) -> tuple[Tensor, Tensor]:
    return fake_out_lse(q, v)


@torch.library.custom_op("attnkit::triton_backward", mutates_args=())
def triton_backward(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask_key: str,
    mask_tensors: list[Tensor],
    bias: Optional[Tensor],
    mod_key: str,
    mod_tensors: list[Tensor],
    sinks: Optional[Tensor],
    scale: float,
    softcap: float,
    sinks_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)``: the gradients of :func:`triton_forward`'s ``(out, lse)`` (which include the
    sinks).  ``dsinks`` has the sinks' shape when ``sinks_grad``, else it is empty."""
    call = op_call(q, k, v, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale, softcap)
    dq, dk, dv = _launch_backward(q, k, v, out, lse, dout, dlse, _mods(call), _plans(call).backward())
    dsink = sink_grad(out, lse, dout, dlse, sinks) if sinks_grad and sinks is not None else q.new_empty(0)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsink.contiguous()


@triton_backward.register_fake
def _(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask_key: str,
    mask_tensors: list[Tensor],
    bias: Optional[Tensor],
    mod_key: str,
    mod_tensors: list[Tensor],
    sinks: Optional[Tensor],
    scale: float,
    softcap: float,
    sinks_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dsink = sinks.new_empty(sinks.shape) if sinks_grad and sinks is not None else q.new_empty(0)
    return (*fake_input_grads(q, k, v), dsink)


refuse_double_backward(triton_backward, "triton")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    args = dict(zip(OP_INPUTS, inputs))
    out, lse = output
    # the mask's and modifier's tensors are saved too: autograd then refuses a backward after they were
    # modified in place (the backward reads them again), as the eager backend does
    ctx.save_for_backward(
        args["q"],
        args["k"],
        args["v"],
        out,
        lse,
        args["bias"],
        args["sinks"],
        *args["mod_tensors"],
        *args["mask_tensors"],
    )
    ctx.n_mod = len(args["mod_tensors"])
    ctx.consts = (args["mask_key"], args["mod_key"], args["scale"], args["softcap"])
    ctx.set_materialize_grads(False)


# (one entry per forward input: a gradient, None, or a list of None for a list of tensors)
def _backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | list[None] | None, ...]:
    q, k, v, out, lse, bias, sinks, *rest = ctx.saved_tensors
    mod_tensors, mask_tensors = rest[: ctx.n_mod], rest[ctx.n_mod :]
    mask_key, mod_key, scale, softcap = ctx.consts
    need = ctx.needs_input_grad
    if need[5] or (need[7] and any(t.requires_grad for t in mod_tensors)):  # (need[7]: any of a list)
        raise RuntimeError(
            "the triton operators compute no gradient for a bias tensor or a score modifier's tensors "
            "(attnkit.attention refuses such calls for backend='triton'): use backend='flash'"
        )
    none_mask, none_mod = [None] * len(mask_tensors), [None] * len(mod_tensors)
    sinks_grad = sinks is not None and need[8]
    if dout is None and dlse is None:
        return (None, None, None, None, none_mask, None, None, none_mod, None, None, None)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = triton_backward(
        dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        mask_key,
        list(mask_tensors),
        bias,
        mod_key,
        list(mod_tensors),
        sinks,
        scale,
        softcap,
        sinks_grad,
    )
    return (dq, dk, dv, None, none_mask, None, None, none_mod, dsink if sinks_grad else None, None, None)


triton_forward.register_autograd(_backward, setup_context=_setup_context)


def run(call: Call) -> Tensor | tuple[Tensor, Tensor]:
    """Compute a validated call through the operators (``out``, or ``(out, lse)`` with ``return_lse``)."""
    out, lse = triton_forward(*op_inputs(call))
    return (out, lse) if call.return_lse else out
