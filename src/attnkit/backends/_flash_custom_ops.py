"""The ``flash`` backend as ``torch.library`` custom operators, so ``torch.compile`` and ``torch.export`` see
one node per attention call (and never trace into the tile loop).

Two operators, ``attnkit::flash_forward`` and ``attnkit::flash_backward``, with fake (shape-only)
implementations and the backward registered as the forward's autograd formula.  A mask or score modifier is
a Python object, which an operator cannot take, so each is passed as two arguments:

* a **description key** (a string): the object's classes and its non-tensor attributes (window sizes,
  alignments, functions), interned once per distinct description while the caller is traced;
* its **tensors** (document ids, key lengths, a dense mask, ALiBi slopes, a T5 table, ...), as a list of
  tensors: graph inputs like any other, so new values reach the kernel without a recompile.

Inside the operator the object is rebuilt from the two (kept per key and tensors, so a loop over one shape
rebuilds nothing) and planned by the eager backend's own plan cache: the tile plan of a mask and a shape is
computed once, on the first call, not per step.  Dropout takes its seed as a tensor drawn in the graph.

While ``torch.compile`` traces, ``auto`` makes the eager choice (:func:`pick`): the decision is computed
once per traced call site from the call's shapes, dtypes, flags and the mask's and modifier's descriptions
and tensors, by the very checks and costs eager ``auto`` uses.

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

import operator
import threading
from collections import OrderedDict
from typing import Optional

import torch

from ..bias import ScoreMod
from ..masks import Mask
from ._common import Call

Tensor = torch.Tensor

__all__: list[str] = []

# ---------------------------------------------------------------- descriptions


def describe(obj) -> tuple[object, list[Tensor]]:
    """``(description, tensors)`` of a mask or score modifier (or None): a nested tuple of classes, attribute
    names and constants in which each tensor is replaced by its index in ``tensors``.  Plain Python that
    ``torch.compile`` traces (attribute reads on the object), so it works also on masks built inside the
    compiled function."""
    tensors: list[Tensor] = []

    def walk(x):
        if isinstance(x, Tensor):
            tensors.append(x)
            return ("tensor", len(tensors) - 1)
        if isinstance(x, (Mask, ScoreMod)):
            fields = x.__dict__
            items = tuple((name, walk(fields[name])) for name in sorted(fields))
            return ("object", type(x), items)
        if isinstance(x, tuple):
            return ("tuple", tuple(walk(e) for e in x))
        if isinstance(x, list):
            return ("list", tuple(walk(e) for e in x))
        if isinstance(x, dict):  # a memo of derived values (random blocks per shape): rebuilt empty
            return ("memo",)
        return ("value", x)  # None, numbers, strings, functions

    return walk(obj), tensors


def _constant_result(fn):
    """``torch._dynamo.assume_constant_result(fn)``: dynamo calls ``fn`` while tracing and makes its result a
    constant of the graph.  Set as that decorator sets it, without importing ``torch._dynamo`` when attnkit is
    imported (about 2 s); ``tests/backends/test_compile.py`` checks that the decorator still does this."""
    fn._dynamo_marked_constant = True
    return fn


_KEYS: dict[object, str] = {}
_DESCRIPTIONS: dict[str, object] = {}
_KEYS_LOCK = threading.Lock()


@_constant_result
def intern(description) -> str:
    """The key of a description (the same key for equal descriptions), registered for :func:`rebuild`.
    Computed while ``torch.compile`` traces (the key is a constant of the graph)."""
    if description is None or description == ("value", None):
        return ""
    try:
        hash(description)
    except TypeError:
        raise TypeError(f"a mask or score modifier holds an attribute of an unhashable type ({description!r}), which "
                        f"the compiled flash operator cannot describe: hold tuples, numbers, strings, functions or "
                        f"tensors, or use backend='math'") from None
    with _KEYS_LOCK:
        key = _KEYS.get(description)
        if key is None:
            key = f"{len(_KEYS)}:{_short(description)}"
            _KEYS[description] = key
            _DESCRIPTIONS[key] = description
    return key


def _short(description) -> str:
    """A readable name for a key: the classes in a description (``_And(_Causal,_SlidingWindow)``)."""
    kind = description[0]
    if kind == "object":
        inner = [_short(v) for _, v in description[2]]
        inner = [s for s in inner if s]
        return description[1].__name__ + (f"({','.join(inner)})" if inner else "")
    if kind in ("tuple", "list"):
        return ",".join(s for s in (_short(e) for e in description[1]) if s)
    return ""


_REBUILT: "OrderedDict[tuple, object]" = OrderedDict()
REBUILT_KEPT = 64  # rebuilt masks/modifiers kept (with the tensors they hold): one per layer mask and shape
REBUILT_KEPT_BYTES = 16 << 20  # ... only when their tensors are at most this big (not a dense mask per step)
_REBUILT_LOCK = threading.Lock()


def rebuild(key: str, tensors: list[Tensor], *, fresh: bool = False):
    """The object a key and its tensors describe (None for the empty key).  The same object is returned for
    the same key and tensors (the same memory, layout and version), so the eager backend's per-mask plan cache
    finds its plan; ``fresh=True`` builds a new one (for modifiers whose tensors get new leaves for gradients)."""
    if not key:
        return None
    description = _DESCRIPTIONS.get(key)
    if description is None:
        raise RuntimeError(f"attnkit flash operator: unknown mask/score modifier key {key!r}: the program was traced "
                           f"in another process; trace it again in this one (the keys live in the process that "
                           f"traced it)")
    if fresh:
        return _build(description, tensors)
    # by storage, layout and version: a compiled graph hands the operator a fresh view of the same tensor (a
    # document mask's ids.view(1, -1)) at every call; the entry holds the tensors, so no other tensor can take
    # their storage's address while it lives
    memo = (key, tuple((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                        t.device, t._version) for t in tensors))
    with _REBUILT_LOCK:
        hit = _REBUILT.get(memo)
        if hit is not None:
            _REBUILT.move_to_end(memo)
            return hit[0]
    obj = _build(description, tensors)
    if sum(t.numel() * t.element_size() for t in tensors) > REBUILT_KEPT_BYTES:
        return obj  # (planned at each call, as eager plans a new mask object)
    with _REBUILT_LOCK:
        _REBUILT[memo] = (obj, tuple(tensors))  # holds the tensors: their ids are not reused while it lives
        while len(_REBUILT) > REBUILT_KEPT:
            _REBUILT.popitem(last=False)
    return obj


def _build(description, tensors: list[Tensor]):
    kind, *rest = description
    if kind == "tensor":
        return tensors[rest[0]]
    if kind == "object":
        cls, items = rest
        obj = cls.__new__(cls)
        obj.__dict__.update({name: _build(value, tensors) for name, value in items})
        return obj
    if kind == "tuple":
        return tuple(_build(e, tensors) for e in rest[0])
    if kind == "list":
        return [_build(e, tensors) for e in rest[0]]
    if kind == "memo":
        return {}
    return rest[0]


# ------------------------------------------------------------------------ operators


def _call(q, k, v, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale, softcap, dropout_p,
          mod=None) -> Call:
    mask = rebuild(mask_key, list(mask_tensors))
    if bias is None:
        bias = mod if mod is not None else rebuild(mod_key, list(mod_tensors))
    return Call(q, k, v, mask, bias, scale, None if softcap == 0 else softcap, dropout_p, True, sinks)


def _seed(seed: Optional[Tensor]) -> int:
    return 0 if seed is None else int(seed.reshape(-1)[0])


@torch.library.custom_op("attnkit::flash_forward", mutates_args=())
def flash_forward(q: Tensor, k: Tensor, v: Tensor, mask_key: str, mask_tensors: list[Tensor], bias: Optional[Tensor],
                  mod_key: str, mod_tensors: list[Tensor], sinks: Optional[Tensor], scale: float, softcap: float,
                  dropout_p: float, seed: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(out (B, Hq, Lq, Dv), lse (B, Hq, Lq), bare)``: the flash backend's forward; ``bare`` is the lse
    without the sinks (an empty tensor without sinks).  ``softcap=0`` means none; ``seed`` (int64, one
    element) is the dropout seed (None without dropout)."""
    from . import _flash_impl as flash

    call = _call(q, k, v, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale, softcap, dropout_p)
    plan = flash._forward_plan(call)
    fused = flash._fusable(call, False)
    with torch.no_grad():
        work = flash._work(call, plan, fused, [], _seed(seed))
        out, lse, bare = flash._finish(*flash.ops.forward(work), call)
    lse = lse.contiguous()
    bare = lse.new_empty(0) if bare is None else bare.contiguous()
    return out.contiguous(), lse, bare


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@flash_forward.register_fake
def _(q, k, v, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale, softcap, dropout_p, seed):
    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty(B, H, L, v.shape[-1])
    lse = q.new_empty(B, H, L, dtype=_lse_dtype(q))
    bare = q.new_empty(B, H, L, dtype=_lse_dtype(q)) if sinks is not None else q.new_empty(0, dtype=_lse_dtype(q))
    return out, lse, bare


@torch.library.custom_op("attnkit::flash_backward", mutates_args=())
def flash_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   bare: Tensor, mask_key: str, mask_tensors: list[Tensor], bias: Optional[Tensor], mod_key: str,
                   mod_tensors: list[Tensor], sinks: Optional[Tensor], scale: float, softcap: float,
                   dropout_p: float, seed: Optional[Tensor], bias_grad: bool, sinks_grad: bool,
                   mod_grads: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """``(dq, dk, dv, dbias, dsinks, dmod)``: the gradients of :func:`flash_forward`'s ``(out, lse)``.
    ``dbias``/``dsinks`` are empty unless ``bias_grad``/``sinks_grad``; ``dmod`` holds one tensor per
    modifier tensor (zeros where ``mod_grads`` is False or the tensor got no gradient)."""
    from types import SimpleNamespace

    from . import _flash_impl as flash

    leaves = [t.detach().requires_grad_(g) for t, g in zip(mod_tensors, mod_grads)]
    mod = rebuild(mod_key, leaves, fresh=True) if any(mod_grads) else None
    params = [t for t in leaves if t.requires_grad]
    call = _call(q, k, v, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale, softcap, dropout_p, mod)
    plan_b = flash._backward_plan(call)
    stripped = Call(None, None, None, call.mask, None if bias is not None else call.bias, call.scale, call.softcap,
                    call.dropout_p, True, None)
    has_sinks = sinks is not None and bare.numel() > 0
    ctx = SimpleNamespace(
        saved_tensors=(q, k, v, out, lse, bias, bare if has_sinks else None),
        state=(stripped, plan_b, _seed(seed), True, params), sinks=sinks, versions=[], reach=(),
        has_bias_t=bias is not None, needs_input_grad=(True, True, True, bias_grad, sinks_grad, False,
                                                        *[True] * len(params)))
    with torch.no_grad(), _autograd_inside(bool(params)):
        grads = flash._FlashFunction.backward(ctx, dout, dlse)
    dq, dk, dv, dbias, dsink = grads[:5]
    dparams = iter(grads[6:])
    dmod = []
    for t, g in zip(mod_tensors, mod_grads):
        d = next(dparams) if g else None
        dmod.append(t.new_zeros(t.shape) if d is None else d.to(t.dtype).reshape(t.shape).contiguous())
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(), q.new_empty(0) if dbias is None else dbias.contiguous(),
            q.new_empty(0) if dsink is None else dsink.contiguous(), dmod)


class _autograd_inside:
    """Autograd back on inside an operator's implementation (which runs below the autograd dispatch keys), for
    the backward of a score modifier with learnable tensors: the recomputing backward differentiates the
    modifier's function with ``torch.autograd.grad``."""

    def __init__(self, on: bool):
        self.guards = [torch._C._SetExcludeDispatchKeyGuard(key, False) for key in (
            torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
            torch._C.DispatchKey.ADInplaceOrView)] if on else []

    def __enter__(self):
        for g in self.guards:
            g.__enter__()

    def __exit__(self, *exc):
        for g in reversed(self.guards):
            g.__exit__(*exc)


@flash_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, bare, mask_key, mask_tensors, bias, mod_key, mod_tensors, sinks, scale,
      softcap, dropout_p, seed, bias_grad, sinks_grad, mod_grads):
    # (contiguous, as the implementation returns them)
    dbias = bias.new_empty(bias.shape) if bias_grad and bias is not None else q.new_empty(0)
    dsink = sinks.new_empty(sinks.shape) if sinks_grad and sinks is not None else q.new_empty(0)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsink,
            [t.new_empty(t.shape) for t in mod_tensors])


def _no_double_backward(ctx, *grads):
    raise RuntimeError("the flash backend's backward is not differentiable (create_graph=True or a double backward, "
                       "e.g. a gradient penalty): use backend='math' or 'sdpa' for such a loss")


flash_backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


_FORWARD_INPUTS = ("q", "k", "v", "mask_key", "mask_tensors", "bias", "mod_key", "mod_tensors", "sinks", "scale",
                   "softcap", "dropout_p", "seed")


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FORWARD_INPUTS, inputs))
    out, lse, bare = output
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse, bare, args["bias"], args["sinks"], args["seed"],
                          *args["mod_tensors"], *args["mask_tensors"])
    ctx.n_mod = len(args["mod_tensors"])
    ctx.consts = (args["mask_key"], args["mod_key"], args["scale"], args["softcap"], args["dropout_p"])
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, dbare):
    q, k, v, out, lse, bare, bias, sinks, seed, *rest = ctx.saved_tensors
    mod_tensors, mask_tensors = rest[:ctx.n_mod], rest[ctx.n_mod:]
    mask_key, mod_key, scale, softcap, dropout_p = ctx.consts
    need = ctx.needs_input_grad
    bias_grad = bias is not None and need[5]
    sinks_grad = sinks is not None and need[8]
    mod_grads = [t.requires_grad for t in mod_tensors] if need[7] else [False] * len(mod_tensors)
    none_mask, none_mod = [None] * len(mask_tensors), [None] * len(mod_tensors)
    if dout is None and dlse is None:
        return (None, None, None, None, none_mask, None, None, none_mod, None, None, None, None, None)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias, dsink, dmod = flash_backward(
        dout, dlse, q, k, v, out, lse, bare, mask_key, list(mask_tensors), bias, mod_key, list(mod_tensors), sinks,
        scale, softcap, dropout_p, seed, bias_grad, sinks_grad, mod_grads)
    dmod = [d if g else None for d, g in zip(dmod, mod_grads)]
    return (dq, dk, dv, None, none_mask, dbias if bias_grad else None, None, dmod,
            dsink if sinks_grad else None, None, None, None, None)


flash_forward.register_autograd(_backward, setup_context=_setup_context)


def run(call: Call):
    """Compute a validated call through the operators (``out``, or ``(out, lse)`` with ``return_lse``)."""
    mask_desc, mask_tensors = describe(call.mask)
    bias_t = call.bias if isinstance(call.bias, Tensor) else None
    mod_desc, mod_tensors = describe(None if bias_t is not None else call.bias)
    seed = None
    if call.dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (1,), device=call.q.device)
    out, lse, _ = flash_forward(call.q, call.k, call.v, intern(mask_desc), mask_tensors, bias_t, intern(mod_desc),
                                mod_tensors, call.sinks, float(call.scale), float(call.softcap or 0.0),
                                float(call.dropout_p), seed)
    return (out, lse) if call.return_lse else out


# ------------------------------------------------------------------ auto while tracing


def _meta(t: Tensor | None):
    """What a backend's checks and costs read of a tensor, as constants: shape, strides, dtype, device and
    whether it requires grad (never its values)."""
    if t is None:
        return None
    # operator.index specialises a dynamic size to its value (a guard): tile plans and costs are per shape
    return (tuple(operator.index(n) for n in t.shape), tuple(operator.index(s) for s in t.stride()), t.dtype,
            t.device, t.requires_grad)


def _empty(meta):
    if meta is None:
        return None
    shape, stride, dtype, device, grad = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)


_DECIDING = threading.local()


def deciding() -> bool:
    """Whether the selection runs for a traced call (:func:`decide`, or ``explain``'s last line): ``select``
    must not divert to :func:`decide` again, and flash refuses what its operators cannot take
    (:func:`traced_reason`)."""
    return getattr(_DECIDING, "on", False)


class traced_rules:
    """Within: ``select`` decides as for a traced call (see :func:`deciding`)."""

    def __enter__(self):
        self.was = deciding()
        _DECIDING.on = True

    def __exit__(self, *exc):
        _DECIDING.on = self.was


def traced_reason(call: Call) -> str | None:
    """Why the flash operators cannot take ``call`` (None when they can): a score modifier whose function reads
    tensors requiring grad that are not its attributes (closure variables of a ``bias.from_fn`` function,
    say) would get no gradient, as the operators take only the modifier's attributes as inputs."""
    if not isinstance(call.bias, ScoreMod):
        return None
    from ._reads import mod_params

    described = {id(t) for t in describe(call.bias)[1]}
    hidden = [t for t in mod_params(call.bias) if id(t) not in described]
    if not hidden:
        return None
    shapes = ", ".join(str(tuple(t.shape)) for t in hidden[:3])
    return (f"under torch.compile the score modifier's function reads {len(hidden)} tensor(s) requiring grad (shapes "
            f"{shapes}) that the flash operator cannot take as inputs (only a built-in modifier's own tensors): "
            f"pass a tensor bias instead, or use backend='math' or 'sdpa' (auto does)")


@_constant_result
def _decide(backend: str, metas: tuple, flags: tuple, mask_key: str, mod_key: str, *tensors: Tensor) -> tuple:
    """``("ok", name)`` or ``("error", message)``: eager ``select``'s answer for a call rebuilt from its
    constants, with the mask's and modifier's real tensors.  Runs once per traced call site."""
    from . import select

    from torch._subclasses.fake_tensor import is_fake

    if any(is_fake(t) for t in tensors):
        # torch.export (non-strict) traces with fake tensors: a mask's or modifier's values (document ids, key
        # lengths) are unknown, so their block structure cannot be weighed; flash takes every mask and reads
        # them when the program runs
        return ("ok", "flash" if backend == "auto" else backend)
    n_mask = flags[-1]
    mask = rebuild(mask_key, list(tensors[:n_mask]))
    mod = rebuild(mod_key, list(tensors[n_mask:]))
    with torch.utils._python_dispatch._disable_current_modes(), torch.set_grad_enabled(flags[0]):
        q, k, v, bias, sinks = (_empty(m) for m in metas)
        scale, softcap, dropout_p, return_lse = flags[1:5]
        call = Call(q, k, v, mask, bias if bias is not None else mod, scale, softcap, dropout_p, return_lse, sinks)
        try:
            with traced_rules():
                return ("ok", select(call, backend).name)
        except ValueError as e:
            return ("error", str(e))


def decide(call: Call, backend: str) -> str:
    """The name of the backend that eager ``select(call, backend)`` picks, computed from the call's constants
    while ``torch.compile`` traces (the answer is a constant of the graph); raises the eager ValueError when
    the named backend cannot take the call."""
    mask_desc, mask_tensors = describe(call.mask)
    bias_t = call.bias if isinstance(call.bias, Tensor) else None
    mod_desc, mod_tensors = describe(None if bias_t is not None else call.bias)
    metas = tuple(_meta(t) for t in (call.q, call.k, call.v, bias_t, call.sinks))
    flags = (torch.is_grad_enabled(), float(call.scale), call.softcap, float(call.dropout_p), call.return_lse,
             len(mask_tensors))
    verdict, value = _decide(backend, metas, flags, intern(mask_desc), intern(mod_desc),
                             *mask_tensors, *mod_tensors)
    if verdict == "error":
        raise ValueError(value)
    return value
