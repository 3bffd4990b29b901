"""The eager implementation of the ``flash`` backend (see ``flash``): tile plans, the work handed to
``ops``, the ``autograd.Function`` with its recomputing backward, and ``_run``.  The package (``flash``) is
the public layer over it; ``custom_ops`` wraps it as ``torch.library`` operators for traced code."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, cast

import torch
import torch.nn.functional as F

from ..._checks import int_in_range
from ...bias import ScoreMod
from ...masks import Mask
from . import backward as bwd
from . import ops
from . import plan as planning
from ...softmax import add_sink_unchecked as add_sink  # (inputs checked by the call)
from ..call import Call
from ..fused import FUSED
from ..scores import per_mask, sink_grad
from ..reads import (
    check_reach,
    check_unchanged,
    derived_params,
    mod_params,
    probe_params,
    read_tensors,
    reachable_tensors,
    tensor_key,
    tensor_versions,
)

Tensor = torch.Tensor


CALL_OVERHEAD_FLOPS = 2e6  # one batched call costs about this many flop-equivalents of Python and setup
CALL_OVERHEAD_ELEMENTS = 2e5  # ... or score elements, in the tiling estimate
TILE_OVERHEAD_ROWS = 12  # per-element cost of a query tile of R rows grows as 1 + 12 / R (measured)
SMALL_TILE = 64  # the alternative forward tile for narrow bands
FUSED_FACTOR = 1.15  # fused kernel on full tiles vs SDPA on the dense problem
FUSED_MASKED_FACTOR = 1.6  # ... on partial tiles, which read a float mask (as SDPA with a dense mask)
EXPLICIT_FACTOR = 3.5  # explicit matmuls + elementwise softmax passes (measured ~4x the fused path)


# ------------------------------------------------------------------------- helpers


def _check_block(name: str, value: object) -> int | None:
    if value is None:
        return None
    default = planning.BLOCK_Q if name == "block_q" else planning.BLOCK_K
    return int_in_range(name, value, 1, fix=f" (or None for the default {default})")


PLANS_PER_MASK = 8  # plans kept per mask object (one per shape and tiling)
SHARED_PLANS = 32  # plans kept for masks identified by value (no mask, or built-ins without tensors)
_PlanKey = tuple[object, ...]  # (shape, tiling, device, the mask's value or its tensors)
_Entry = tuple[planning.Plan, list[Tensor]]  # a plan, and the tensors of the mask it was built from
_PLANS: "weakref.WeakKeyDictionary[Mask, dict[_PlanKey, _Entry]]" = weakref.WeakKeyDictionary()
_SHARED: dict[_PlanKey, _Entry] = {}
_LOCK = threading.Lock()


def _value_key(mask: Mask | None) -> str | None:
    """A key that identifies a mask by value, for masks made only of built-ins that hold no tensors and no
    user functions (``causal()``, ``sliding_window(w)``, their combinations...), so a mask rebuilt on every
    call still finds its plan; None for others (they are cached per object)."""
    return "none" if mask is None else mask.value_key()


def _plan(call: Call, block_q: int | None = None, block_k: int | None = None) -> planning.Plan:
    """The plan for a call.  Plans (with their evaluated element masks) are kept per mask object, so a
    mask reused across layers and steps is planned once; a mask's tensors modified in place are noticed."""
    bq, bk = planning.choose_tiling(call.q_len, call.kv_len, block_q, block_k)
    key = (call.batch, call.heads, call.kv_heads, call.q_len, call.kv_len, bq, bk, str(call.q.device))
    if key in call.cache:
        return cast(planning.Plan, call.cache[key])
    value = _value_key(call.mask)
    tensors: list[Tensor] = []
    store: dict[_PlanKey, _Entry] | None
    full_key: _PlanKey
    if value is not None:
        store, limit, full_key = _SHARED, SHARED_PLANS, key + (value,)
    else:
        # the tensors the mask reads, by identity and in-place version (an edited or rebound tensor makes a
        # new key); the entry holds them, so their ids cannot be reused by other tensors while it lives
        tensors = reachable_tensors(call.mask)
        with _LOCK:
            store = per_mask(_PLANS, call.mask)
        if store is None:
            store = {}  # (an unhashable mask: planned at each call)
        limit, full_key = PLANS_PER_MASK, key + (tensor_key(tensors),)
    with _LOCK:  # (threads share the stores)
        entry = store.pop(full_key, None)  # re-inserted below: the dict keeps least recently used first
    if entry is None:
        entry = (
            planning.build(
                call.mask, call.batch, call.heads, call.kv_heads, call.q_len, call.kv_len, bq, bk, call.q.device
            ),
            tensors,
        )
    with _LOCK:
        while len(store) >= limit:
            store.pop(next(iter(store)))
        store[full_key] = entry
    call.cache[key] = entry[0]
    return entry[0]


def _estimate(plan: planning.Plan) -> float:
    """Relative forward time of a plan on the fused kernel: score elements computed, dearer per element
    for short query blocks (smaller matrix products; a shared window's rows form one tall block), plus a
    cost per call."""
    bq, bk = plan.block_q, plan.block_k
    work = 0.0
    for j in plan.jobs:
        rows = j.n * bq if j.tiles is None and j.kstep == 0 else bq  # the kernel's query block
        work += j.heads.count * j.n * bq * j.w * bk * (1 + TILE_OVERHEAD_ROWS / rows)
    return work + len(plan.jobs) * CALL_OVERHEAD_ELEMENTS


def _cheap_structure(mask: Mask | None) -> bool:
    """Whether a mask's block structure is cheap to evaluate for a second tiling: built-ins, also those
    holding tensors (documents, key padding), but no user function or dense tensor (evaluated per element)."""
    if mask is None:
        return False  # no mask: every tile is full, the default tiles are best
    return mask.cheap_structure()


def _forward_plan(call: Call, block_q: int | None = None, block_k: int | None = None) -> planning.Plan:
    """The forward's plan: for built-in masks, the cheaper of 128- and 64-row tiles (a narrow window or a
    document's boundaries waste less on 64-row tiles)."""
    if block_q is not None or block_k is not None or not _cheap_structure(call.mask):
        return _plan(call, block_q, block_k)
    plans = [_plan(call), _plan(call, SMALL_TILE, SMALL_TILE)]
    return min(plans, key=_estimate)


def _backward_plan(call: Call, block_q: int | None = None, block_k: int | None = None) -> planning.Plan:
    """The backward's plan: the forward's, unless that has bands of overlapping key windows on small tiles
    (each item's window gradients are computed apart and summed: on 64-row tiles a window is read and
    written 5 times instead of 3), where the default tiles are faster."""
    if block_q is not None or block_k is not None:
        return _plan(call, block_q, block_k)
    plan = _forward_plan(call)
    if plan.block_q != planning.BLOCK_Q and any(j.tiles is None and j.kstep > 0 and j.n > 1 for j in plan.jobs):
        return _plan(call)
    return plan


def _bias_needs_grad(call: Call) -> tuple[bool, list[Tensor]]:
    """Whether the bias needs a gradient, and the modifier's tensors that require one (memoised per call)."""
    if not torch.is_grad_enabled():
        return False, []
    if isinstance(call.bias, Tensor):
        return call.bias.requires_grad, []
    if isinstance(call.bias, ScoreMod):
        if "bias_params" not in call.cache:  # the reachable tensors the modifier's result depends on
            call.cache["bias_params"] = probe_params(call.bias, mod_params(call.bias), call.q.device, call.q.dtype)
        params = call.cache["bias_params"][0]
        return bool(params), params
    return False, []


def _fusable(call: Call, bias_grad: bool) -> bool:
    """Whether the fused CPU kernel computes this call exactly."""
    if FUSED is None or call.q.device.type != "cpu" or call.softcap is not None or call.dropout_p > 0:
        return False
    if call.v.shape[-1] != call.q.shape[-1]:
        return False  # the fused kernel needs one head size for q, k and v
    if bias_grad:
        return False
    b = call.bias
    return b is None or isinstance(b, Tensor) or b.additive or b.scale_factor is not None


def _flat(x: Tensor, length: int) -> Tensor:
    """(B, H, L, E) -> contiguous (B*H, length, E), zero-padded past L."""
    B, H, L, E = x.shape
    x3 = x.reshape(B * H, L, E)
    if length != L:
        x3 = F.pad(x3, (0, 0, 0, length - L))
    return x3.contiguous()


def _bias4(bias: object) -> Tensor | None:
    if not isinstance(bias, Tensor):
        return None
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


def _work(call: Call, plan: planning.Plan, fused: bool, params: list[Tensor], seed: int) -> ops.Work:
    bias, scale = call.bias, call.scale
    if fused and isinstance(bias, ScoreMod) and not bias.additive:
        factor = cast(float, bias.scale_factor)  # (fusable: a scalar temperature)
        bias, scale = None, scale * factor  # a scalar temperature folds into the scale
    neginf = False
    if isinstance(bias, Tensor):
        bias = cast(Tensor, _bias4(bias)).detach()
        neginf = fused and bool(torch.isneginf(bias).any())  # (the fused kernel gives such rows lse 0)
    return ops.Work(
        plan,
        call.batch,
        call.heads,
        call.kv_heads,
        _flat(call.q, plan.q_pad),
        _flat(call.k, plan.kv_pad),
        _flat(call.v, plan.kv_pad),
        scale,
        call.softcap,
        call.mask,
        bias,
        call.dropout_p,
        seed,
        fused,
        params,
        bias_neginf=neginf,
    )


def _unflat(x3: Tensor, call: Call, dtype: torch.dtype) -> Tensor:
    B, H = call.batch, call.heads
    x = x3[:, : call.q_len]
    return x.reshape(B, H, call.q_len, *x3.shape[2:]).to(dtype)


def _finish(out3: Tensor, lse3: Tensor, call: Call) -> tuple[Tensor, Tensor, Tensor | None]:
    """The kernels' ``(out3, lse3)`` as ``out (B, Hq, Lq, Dv)`` in q's dtype and ``lse (B, Hq, Lq)``, with
    the sinks (when the call has them) added to each row's denominator before the output is rounded; and
    the lse without the sinks (None without them)."""
    lse = _unflat(lse3.t(), call, lse3.dtype)
    if call.sinks is None:
        return _unflat(out3, call, call.q.dtype), lse, None
    out, lse_s = add_sink(_unflat(out3, call, out3.dtype), lse, call.sinks.detach())
    return out.to(call.q.dtype), lse_s, lse


def _sinkless_grads(
    out: Tensor, lse: Tensor, bare: Tensor, dout: Tensor, dlse: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of the sink-free result ``(out / c, bare)`` that give those of ``(out, lse)``, the result
    with sinks, for the paths that renormalise each row's weights over its keys themselves.

    ``out = c * out_bare`` with ``c = exp(bare - lse)``, and ``d c / d bare = c * (1 - c)``, so
    ``d out_bare = c * dout`` and ``d bare = (1 - c) * rowsum(dout * out) + c * dlse`` (no division by ``c``).
    (The fused path needs none of this: its weights ``exp(s - lse)`` come from the saved lse, which already
    holds the sink.)  Returns ``(dout, dlse, lse)`` to hand to the sink-free backward."""
    c = torch.exp(bare - lse)  # (B, Hq, Lq); 0 in a row that saw no key
    d = (dout.to(c.dtype) * out.to(c.dtype)).sum(-1)
    dbare = (1 - c) * d + (0 if dlse is None else c * dlse.to(c.dtype))
    return (dout.to(c.dtype) * c[..., None]).to(dout.dtype), dbare, bare


# ---------------------------------------------------------------------- autograd


# (call, forward plan, backward plan, fused, dropout seed, whether the backward may take the fused kernel)
_State = tuple[Call, planning.Plan, planning.Plan, bool, int, bool]


class _FlashFunction(torch.autograd.Function):
    """Inputs ``(q, k, v, bias_tensor, work, *bias_params)``; outputs ``(out, lse)``."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias_t: Tensor | None,
        sinks: Tensor | None,
        state: _State,
        *params: Tensor,
    ) -> tuple[Tensor, Tensor]:
        call, plan, plan_b, fused, seed, allow_fused = state
        work = _work(call, plan, fused, list(params), seed)
        out, lse, bare = _finish(*ops.forward(work), call)
        lse, bare = lse.contiguous(), None if bare is None else bare.contiguous()
        # O((Lq + Lk) * D): the backward recomputes the rest.  Saved, not kept on ctx: saved-tensor hooks
        # (checkpointing, offloading) see them, and autograd checks the bias tensors for in-place edits
        # (the modifier's own tensors stay on ctx: the recomputing backward differentiates the very tensors its
        # function reads, which an unpacking hook would replace by copies)
        ctx.save_for_backward(q, k, v, out, lse, bias_t, bare)
        dropped = cast(Tensor, None)  # (the call's tensors are left out; the backward puts the saved ones back)
        ctx.state = (
            dataclasses.replace(
                call, q=dropped, k=dropped, v=dropped, sinks=None, bias=None if bias_t is not None else call.bias
            ),
            plan_b,
            seed,
            allow_fused,
            params,
        )
        ctx.sinks = sinks
        ctx.versions = tensor_versions(call.mask, call.bias) + [(p, p._version) for p in params]  # read again
        mod = None if bias_t is not None else call.bias
        ctx.reach = read_tensors(call.mask, mod)
        ctx.has_bias_t = bias_t is not None
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: the recomputing backward builds no graph of its own
            raise RuntimeError(
                "the flash backend's backward is not differentiable (create_graph=True or a double "
                "backward, e.g. a gradient penalty): use backend='math' or 'sdpa' for such a loss"
            )
        check_unchanged(ctx.versions)
        stripped, plan, seed, allow_fused, params = ctx.state
        q, k, v, out, lse, bias_t, bare = ctx.saved_tensors
        call = dataclasses.replace(stripped, q=q, k=k, v=v, bias=bias_t if ctx.has_bias_t else stripped.bias)
        check_reach(ctx.reach, call)
        n_params = len(ctx.needs_input_grad) - 6
        if dout is None and dlse is None:
            return (None,) * (6 + n_params)
        bias_grad = ctx.has_bias_t and ctx.needs_input_grad[3]
        fused = allow_fused and _fusable(call, bias_grad or bool(params)) and dlse is None
        work = _work(call, plan, fused, params, seed)  # the backward's own tiling (and padding)
        if dout is None:
            dout = torch.zeros_like(out)
        dsink = None
        if ctx.sinks is not None:
            dsink = sink_grad(out, lse, dout, dlse, ctx.sinks) if ctx.needs_input_grad[4] else None
            if not fused:
                dout, dlse, lse = _sinkless_grads(out, lse, bare, dout, dlse)
        out3 = _flat(out, plan.q_pad)
        pad = plan.q_pad - call.q_len
        lse3 = F.pad(lse.reshape(-1, call.q_len), (0, pad), value=float("inf")).t().contiguous()  # padded rows: P = 0
        dout3 = _flat(dout.to(out.dtype), plan.q_pad)
        dlse3 = None
        if dlse is not None:
            dlse3 = F.pad(dlse.reshape(-1, call.q_len), (0, plan.q_pad - call.q_len))  # (B*Hq, Lq_pad)
        dbias = None
        if bias_grad:
            dbias = torch.zeros(cast(Tensor, work.bias).shape, dtype=work.acc, device=q.device)
        dparams: list[Tensor | None] = [None] * len(params)
        dq3, dk3, dv3 = bwd.backward(work, out3, lse3, dout3, dlse3, fused, dbias, dparams)
        B, Hkv, Lk = call.batch, call.kv_heads, call.kv_len
        dq = _unflat(dq3, call, call.q.dtype)
        dk = dk3[:, :Lk].reshape(B, Hkv, Lk, -1).to(call.k.dtype)
        dv = dv3[:, :Lk].reshape(B, Hkv, Lk, -1).to(call.v.dtype)
        if dbias is not None:
            dbias = dbias.reshape(call.bias.shape).to(call.bias.dtype)
        dparams = [None if g is None else g.to(p.dtype) for g, p in zip(dparams, params)]
        return (dq, dk, dv, dbias, dsink, None, *dparams)


# --------------------------------------------------------------------------- run


def _run(
    call: Call, block_q: int | None = None, block_k: int | None = None, *, fused: bool | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Compute a validated call; ``fused=False`` forces the explicit (public-API) path."""
    plan = _forward_plan(call, block_q, block_k)
    bias_grad, params = _bias_needs_grad(call)
    reason = _unreached_reason(call)
    if reason is not None:
        raise ValueError(f"flash_attention cannot take this call: {reason}")
    use_fused = _fusable(call, bias_grad) if fused is None else (fused and _fusable(call, bias_grad))
    seed = ops.draw_seed() if call.dropout_p > 0 else 0
    needs_grad = call.needs_grad or bias_grad
    if not needs_grad:
        work = _work(call, plan, use_fused, [], seed)
        out, lse, _ = _finish(*ops.forward(work), call)
        return (out, lse) if call.return_lse else out
    bias_t = call.bias if isinstance(call.bias, Tensor) else None
    state = (call, plan, _backward_plan(call, block_q, block_k), use_fused, seed, fused is not False)
    # (PyTorch leaves Function.apply unannotated)
    out, lse = _FlashFunction.apply(call.q, call.k, call.v, bias_t, call.sinks, state, *params)  # type: ignore[no-untyped-call]
    return (out, lse) if call.return_lse else out


def _unreached_reason(call: Call) -> str | None:
    if call.q.device.type == "meta":
        return (
            "meta tensors hold no values to plan the tiles from: use backend='math' or 'sdpa' for the output's "
            "shape (auto does)"
        )
    if not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(call.q):
        return (
            "a torch.func transform (grad, vmap, jacrev, ...) is active, and flash's autograd.Function has "
            "no functorch rule: use backend='math' or 'sdpa' (auto does)"
        )
    _bias_needs_grad(call)
    params, missing = call.cache.get("bias_params", ([], []))
    if "derived" not in call.cache:
        call.cache["derived"] = derived_params(params)
    if call.cache["derived"] is not None:
        a, b = call.cache["derived"]
        if a is b:
            return (
                f"the score modifier's function reads several tensors requiring grad, one of them computed "
                f"through a graph too large to check against the others (shape {tuple(a.shape)}): use "
                f"backend='math'"
            )
        return (
            f"the score modifier's function reaches a tensor {tuple(a.shape)} computed from another it also "
            f"reaches {tuple(b.shape)} (e.g. a parameter and a value derived from it), whose gradients "
            f"flash's backward cannot separate: compute the derived value inside the function, or use "
            f"backend='math'"
        )
    if not missing:
        return None
    shapes = ", ".join(str(tuple(t.shape)) for t in missing[:3])
    return (
        f"the score modifier's function reads {len(missing)} tensor(s) that require grad (shapes {shapes}) "
        f"that flash cannot reach to give them their gradient (not through a closure, a default, a partial, "
        f"a global tensor or module it names, a bound method's object, or a list or dict among those): "
        f"pass them in one of those ways, or use backend='math'"
    )
