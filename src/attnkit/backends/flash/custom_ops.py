"""The ``flash`` backend as ``torch.library`` custom operators, so ``torch.compile`` and ``torch.export`` see
one node per attention call (and never trace into the tile loop).

Two operators, ``attnkit::flash_forward`` and ``attnkit::flash_backward``, with fake (shape-only)
implementations and the backward registered as the forward's autograd formula.  A mask or score modifier
enters as a description key plus its tensors, and ``auto`` decides while traced as it decides eagerly (both
in ``backends.operators``, shared with the ``triton`` backend's operators).  Dropout takes its seed as a tensor drawn
in the graph.

Example::

    >>> import torch, attnkit
    >>> from attnkit import masks
    >>> q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    >>> f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, mask=masks.sliding_window(15),
    ...                                                     backend="flash"), fullgraph=True, backend="eager")
    >>> ref = attnkit.attention(q, k, v, mask=masks.sliding_window(15), backend="math")
    >>> bool(torch.allclose(f(q, k, v), ref, atol=1e-5))
    True
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch

from ...bias import ScoreMod
from ..call import Call
from ..operators import (
    OP_INPUTS,
    describe,
    fake_input_grads,
    fake_out_lse,
    lse_dtype,
    op_call,
    op_inputs,
    rebuild,
    refuse_double_backward,
)

Tensor = torch.Tensor

__all__: list[str] = []

# ------------------------------------------------------------------------ operators


def _seed(seed: Optional[Tensor]) -> int:
    return 0 if seed is None else int(seed.reshape(-1)[0])


@torch.library.custom_op("attnkit::flash_forward", mutates_args=())
def flash_forward(
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
    dropout_p: float,
    seed: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq), bare)``: the flash backend's forward; ``bare`` is the lse
    without the sinks (an empty tensor without sinks).  ``softcap=0`` means none; ``seed`` (int64, one
    element) is the dropout seed (None without dropout)."""
    from . import autograd as flash
    from . import ops

    call = op_call(q, k, v, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale, softcap, dropout_p)
    plan = flash._forward_plan(call)
    fused = flash._fusable(call, False)
    with torch.no_grad():
        work = flash._work(call, plan, fused, [], _seed(seed))
        out, lse, bare = flash._finish(*ops.forward(work), call)
    lse = lse.contiguous()
    bare = lse.new_empty(0) if bare is None else bare.contiguous()
    return out.contiguous(), lse, bare


@flash_forward.register_fake
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
    dropout_p: float,
    seed: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    out, lse = fake_out_lse(q, v)
    bare = lse.new_empty(lse.shape) if sinks is not None else q.new_empty(0, dtype=lse_dtype(q))
    return out, lse, bare


@torch.library.custom_op("attnkit::flash_backward", mutates_args=())
def flash_backward(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    bare: Tensor,
    mask_key: str,
    mask_tensors: list[Tensor],
    bias: Optional[Tensor],
    mod_key: str,
    mod_tensors: list[Tensor],
    sinks: Optional[Tensor],
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: Optional[Tensor],
    bias_grad: bool,
    sinks_grad: bool,
    mod_grads: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """``(dq, dk, dv, dbias, dsinks, dmod)``: the gradients of :func:`flash_forward`'s ``(out, lse)``.
    ``dbias``/``dsinks`` are empty unless ``bias_grad``/``sinks_grad``; ``dmod`` holds one tensor per
    modifier tensor (zeros where ``mod_grads`` is False or the tensor got no gradient)."""
    from types import SimpleNamespace

    from . import autograd as flash

    leaves = [t.detach().requires_grad_(g) for t, g in zip(mod_tensors, mod_grads)]
    mod = rebuild(mod_key, leaves, fresh=True) if any(mod_grads) else None
    params = [t for t in leaves if t.requires_grad]
    call = op_call(q, k, v, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale, softcap, dropout_p, mod)
    plan_b = flash._backward_plan(call)
    dropped = cast(Tensor, None)  # (the call's tensors are left out, as the Function's forward leaves them)
    stripped = Call(
        dropped,
        dropped,
        dropped,
        call.mask,
        None if bias is not None else call.bias,
        call.scale,
        call.softcap,
        call.dropout_p,
        True,
        None,
    )
    has_sinks = sinks is not None and bare.numel() > 0
    ctx = SimpleNamespace(
        saved_tensors=(q, k, v, out, lse, bias, bare if has_sinks else None),
        state=(stripped, plan_b, _seed(seed), True, params),
        sinks=sinks,
        versions=[],
        reach=(),
        has_bias_t=bias is not None,
        needs_input_grad=(True, True, True, bias_grad, sinks_grad, False, *[True] * len(params)),
    )
    # a non-additive modifier (a temperature, a composition holding one) is differentiated with autograd in
    # the recomputing backward even when none of its tensors needs a gradient (the score's gradient flows
    # through it)
    with torch.no_grad(), _autograd_inside(bool(params) or isinstance(call.bias, ScoreMod)):
        grads = flash._FlashFunction.backward(ctx, dout, dlse)
    dq, dk, dv, dbias, dsink = grads[:5]
    dparams = iter(grads[6:])
    dmod: list[Tensor] = []
    for t, g in zip(mod_tensors, mod_grads):
        d = next(dparams) if g else None
        dmod.append(t.new_zeros(t.shape) if d is None else d.to(t.dtype).reshape(t.shape).contiguous())
    # (dout is given: q, k and v get their gradients)
    return (
        cast(Tensor, dq).contiguous(),
        cast(Tensor, dk).contiguous(),
        cast(Tensor, dv).contiguous(),
        q.new_empty(0) if dbias is None else dbias.contiguous(),
        q.new_empty(0) if dsink is None else dsink.contiguous(),
        dmod,
    )


class _autograd_inside:
    """Autograd back on inside an operator's implementation (which runs below the autograd dispatch keys), for
    the backward of a score modifier with learnable tensors: the recomputing backward differentiates the
    modifier's function with ``torch.autograd.grad``."""

    def __init__(self, on: bool) -> None:
        self.guards = (
            [
                torch._C._SetExcludeDispatchKeyGuard(key, False)
                for key in (
                    torch._C.DispatchKey.AutogradFunctionality,
                    torch._C.DispatchKey.AutogradOther,
                    torch._C.DispatchKey.ADInplaceOrView,
                )
            ]
            if on
            else []
        )

    def __enter__(self) -> None:
        for g in self.guards:
            g.__enter__()  # type: ignore[no-untyped-call]  # (PyTorch's stub leaves this __enter__ unannotated)

    def __exit__(self, *exc: object) -> None:
        for g in reversed(self.guards):
            g.__exit__(*exc)


@flash_backward.register_fake
def _(
    dout: Tensor,
    dlse: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    bare: Tensor,
    mask_key: str,
    mask_tensors: list[Tensor],
    bias: Optional[Tensor],
    mod_key: str,
    mod_tensors: list[Tensor],
    sinks: Optional[Tensor],
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: Optional[Tensor],
    bias_grad: bool,
    sinks_grad: bool,
    mod_grads: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    # (contiguous, as the implementation returns them)
    dbias = bias.new_empty(bias.shape) if bias_grad and bias is not None else q.new_empty(0)
    dsink = sinks.new_empty(sinks.shape) if sinks_grad and sinks is not None else q.new_empty(0)
    return (*fake_input_grads(q, k, v), dbias, dsink, [t.new_empty(t.shape) for t in mod_tensors])


refuse_double_backward(flash_backward, "flash")


_FORWARD_INPUTS = (*OP_INPUTS, "dropout_p", "seed")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    args = dict(zip(_FORWARD_INPUTS, inputs))
    out, lse, bare = output
    ctx.save_for_backward(
        args["q"],
        args["k"],
        args["v"],
        out,
        lse,
        bare,
        args["bias"],
        args["sinks"],
        args["seed"],
        *args["mod_tensors"],
        *args["mask_tensors"],
    )
    ctx.n_mod = len(args["mod_tensors"])
    ctx.consts = (args["mask_key"], args["mod_key"], args["scale"], args["softcap"], args["dropout_p"])
    ctx.set_materialize_grads(False)


def _backward(
    ctx: Any, dout: Tensor | None, dlse: Tensor | None, dbare: Tensor | None
) -> tuple[Tensor | list[Tensor | None] | None, ...]:
    q, k, v, out, lse, bare, bias, sinks, seed, *rest = ctx.saved_tensors
    mod_tensors, mask_tensors = rest[: ctx.n_mod], rest[ctx.n_mod :]
    mask_key, mod_key, scale, softcap, dropout_p = ctx.consts
    need = ctx.needs_input_grad
    bias_grad = bias is not None and need[5]
    sinks_grad = sinks is not None and need[8]
    mod_grads = [t.requires_grad for t in mod_tensors] if need[7] else [False] * len(mod_tensors)
    none_mask: list[Tensor | None] = [None] * len(mask_tensors)
    none_mod: list[Tensor | None] = [None] * len(mod_tensors)
    if dout is None and dlse is None:
        return (None, None, None, None, none_mask, None, None, none_mod, None, None, None, None, None)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias, dsink, dmod = flash_backward(
        dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        bare,
        mask_key,
        list(mask_tensors),
        bias,
        mod_key,
        list(mod_tensors),
        sinks,
        scale,
        softcap,
        dropout_p,
        seed,
        bias_grad,
        sinks_grad,
        mod_grads,
    )
    dmod = [d if g else None for d, g in zip(dmod, mod_grads)]
    return (
        dq,
        dk,
        dv,
        None,
        none_mask,
        dbias if bias_grad else None,
        None,
        dmod,
        dsink if sinks_grad else None,
        None,
        None,
        None,
        None,
    )


flash_forward.register_autograd(_backward, setup_context=_setup_context)


def run(call: Call) -> Tensor | tuple[Tensor, Tensor]:
    """Compute a validated call through the operators (``out``, or ``(out, lse)`` with ``return_lse``)."""
    seed = None
    if call.dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (1,), device=call.q.device)
    out, lse, _ = flash_forward(*op_inputs(call), float(call.dropout_p), seed)
    return (out, lse) if call.return_lse else out


# ------------------------------------------------------------------ traced calls


def traced_reason(call: Call) -> str | None:
    """Why the flash operators cannot take ``call`` (None when they can): a score modifier whose function reads
    tensors requiring grad that are not its attributes (closure variables of a ``bias.from_fn`` function,
    say) would get no gradient, as the operators take only the modifier's attributes as inputs."""
    if not isinstance(call.bias, ScoreMod):
        return None
    from ..reads import mod_params

    described = {id(t) for t in describe(call.bias)[1]}
    hidden = [t for t in mod_params(call.bias) if id(t) not in described]
    if not hidden:
        return None
    shapes = ", ".join(str(tuple(t.shape)) for t in hidden[:3])
    return (
        f"under torch.compile the score modifier's function reads {len(hidden)} tensor(s) requiring grad (shapes "
        f"{shapes}) that the flash operator cannot take as inputs (only a built-in modifier's own tensors): "
        f"pass a tensor bias instead, or use backend='math' or 'sdpa' (auto does)"
    )
