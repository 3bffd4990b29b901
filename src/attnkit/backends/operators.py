"""What the backends' ``torch.library`` custom operators share (``flash.custom_ops``: ``attnkit::flash_forward``
/ ``flash_backward``; ``triton.custom_ops``: ``attnkit::triton_forward`` / ``triton_backward``): how a mask or
score modifier enters an operator, the call an operator rebuilds from its arguments, the fake outputs' shapes,
and ``auto``'s decision while ``torch.compile`` traces.

A mask or score modifier is a Python object, which an operator cannot take, so each is passed as two
arguments:

* a **description key** (a string): the object's classes and its non-tensor attributes (window sizes,
  alignments, functions), interned once per distinct description while the caller is traced;
* its **tensors** (document ids, key lengths, a dense mask, ALiBi slopes, a T5 table, ...), as a list of
  tensors: graph inputs like any other, so new values reach the kernel without a recompile.

Inside an operator the object is rebuilt from the two (kept per key and tensors, so a loop over one shape
rebuilds nothing) and planned by the eager backend's own plan cache: the tile plan of a mask and a shape is
computed once, on the first call, not per step.

While ``torch.compile`` traces, ``auto`` makes the eager choice (``backends.decide``): the decision is computed
once per traced call site from the call's shapes, dtypes, flags and the mask's and modifier's descriptions
and tensors, by the very checks and costs eager ``auto`` uses.

Example::

    >>> import torch
    >>> from attnkit import masks
    >>> from attnkit.backends import operators
    >>> ids = torch.tensor([0, 0, 1, 1])
    >>> description, tensors = operators.describe(masks.document(ids) & masks.causal())
    >>> key = operators.intern(description)
    >>> key.split(":")[1], len(tensors)
    ('_And(_Document,_Causal)', 1)
    >>> rebuilt = operators.rebuild(key, tensors)
    >>> bool(torch.equal(rebuilt.to_dense(4, 4), (masks.document(ids) & masks.causal()).to_dense(4, 4)))
    True
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence, TypeVar, cast

import torch

from ..bias import ScoreMod
from ..masks import Mask
from .call import Call

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

Tensor = torch.Tensor

__all__: list[str] = []

# a description: a nested tuple of classes, attribute names and constants (see describe)
Description = tuple[Any, ...]

_F = TypeVar("_F", bound=Callable[..., Any])

# ---------------------------------------------------------------- descriptions


def describe(obj: object) -> tuple[Description, list[Tensor]]:
    """``(description, tensors)`` of a mask or score modifier (or None): a nested tuple of classes, attribute
    names and constants in which each tensor is replaced by its index in ``tensors``.  Plain Python that
    ``torch.compile`` traces (attribute reads on the object), so it works also on masks built inside the
    compiled function."""
    tensors: list[Tensor] = []

    def walk(x: object) -> Description:
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
        if isinstance(x, int) and not isinstance(x, bool):
            # (a constant of the key: under dynamic=True dynamo makes an input object's ints symbolic, and
            # operator.index specialises such an int to its value)
            return ("value", operator.index(x))
        return ("value", x)  # None, numbers, strings, functions

    return walk(obj), tensors


def constant_result(fn: _F) -> _F:
    """``torch._dynamo.assumeconstant_result(fn)``: dynamo calls ``fn`` while tracing and makes its result a
    constant of the graph.  Set as that decorator sets it, without importing ``torch._dynamo`` when attnkit is
    imported (about 2 s); ``tests/backends/test_compile.py`` checks that the decorator still does this."""
    cast(Any, fn)._dynamo_marked_constant = True
    return fn


_KEYS: dict[Description, str] = {}
_DESCRIPTIONS: dict[str, Description] = {}
_KEYS_LOCK = threading.Lock()


@constant_result
def intern(description: Description | None) -> str:
    """The key of a description (the same key for equal descriptions), registered for :func:`rebuild`.
    Computed while ``torch.compile`` traces (the key is a constant of the graph)."""
    if description is None or description == ("value", None):
        return ""
    try:
        hash(description)
    except TypeError:
        raise TypeError(
            f"a mask or score modifier holds an attribute of an unhashable type ({description!r}), which "
            f"attnkit's compiled operators cannot describe: hold tuples, numbers, strings, functions or "
            f"tensors, or use backend='math'"
        ) from None
    with _KEYS_LOCK:
        key = _KEYS.get(description)
        if key is None:
            key = f"{len(_KEYS)}:{_short(description)}"
            _KEYS[description] = key
            _DESCRIPTIONS[key] = description
    return key


def _short(description: Description) -> str:
    """A readable name for a key: the classes in a description (``_And(_Causal,_SlidingWindow)``)."""
    kind = description[0]
    if kind == "object":
        inner = [_short(v) for _, v in description[2]]
        inner = [s for s in inner if s]
        return cast(type, description[1]).__name__ + (f"({','.join(inner)})" if inner else "")
    if kind in ("tuple", "list"):
        return ",".join(s for s in (_short(e) for e in description[1]) if s)
    return ""


_REBUILT: OrderedDict[tuple[object, ...], tuple[Any, tuple[Tensor, ...]]] = OrderedDict()
REBUILT_KEPT = 64  # rebuilt masks/modifiers kept (with the tensors they hold): one per layer mask and shape
REBUILT_KEPT_BYTES = 16 << 20  # ... only when their tensors are at most this big (not a dense mask per step)
_REBUILT_LOCK = threading.Lock()


def rebuild(key: str, tensors: list[Tensor], *, fresh: bool = False) -> Any:  # a Mask, a ScoreMod or None
    """The object a key and its tensors describe (None for the empty key).  The same object is returned for
    the same key and tensors (the same memory, layout and version), so the eager backend's per-mask plan cache
    finds its plan; ``fresh=True`` builds a new one (for modifiers whose tensors get new leaves for gradients)."""
    if not key:
        return None
    description = _DESCRIPTIONS.get(key)
    if description is None:
        raise RuntimeError(
            f"attnkit operator: unknown mask/score modifier key {key!r}: the program was traced "
            f"in another process; trace it again in this one (the keys live in the process that "
            f"traced it)"
        )
    if fresh:
        return _build(description, tensors)
    # by storage, layout and version: a compiled graph hands the operator a fresh view of the same tensor (a
    # document mask's ids.view(1, -1)) at every call; the entry holds the tensors, so no other tensor can take
    # their storage's address while it lives
    memo = (
        key,
        tuple(
            (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                t.stride(),
                t.dtype,
                t.device,
                t._version,
            )
            for t in tensors
        ),
    )
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


def _build(description: Description, tensors: list[Tensor]) -> Any:
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


# ---------------------------------------------------------------- operator arguments


def op_arguments(call: Call) -> tuple[str, list[Tensor], Tensor | None, str, list[Tensor]]:
    """``(mask_key, mask_tensors, bias_tensor, mod_key, mod_tensors)``: a call's mask and bias as operator
    arguments (a tensor bias is passed as itself; a score modifier as its key and tensors)."""
    mask_desc, mask_tensors = describe(call.mask)
    bias_t = call.bias if isinstance(call.bias, Tensor) else None
    mod_desc, mod_tensors = describe(None if bias_t is not None else call.bias)
    return intern(mask_desc), mask_tensors, bias_t, intern(mod_desc), mod_tensors


# the inputs every attention operator takes first, in order (what op_inputs gives and op_call reads back)
OP_INPUTS = ("q", "k", "v", "mask_key", "mask_tensors", "bias", "mod_key", "mod_tensors", "sinks", "scale", "softcap")


def op_inputs(
    call: Call,
) -> tuple[Tensor, Tensor, Tensor, str, list[Tensor], Tensor | None, str, list[Tensor], Tensor | None, float, float]:
    """A validated call as the inputs ``OP_INPUTS`` names: ``q``, ``k``, ``v``, the mask's and bias's arguments
    (:func:`op_arguments`), the sinks, the scale and the softcap (0 for none)."""
    mask_key, mask_tensors, bias_t, mod_key, mod_tensors = op_arguments(call)
    scale, softcap = float(call.scale), float(call.softcap or 0.0)
    return call.q, call.k, call.v, mask_key, mask_tensors, bias_t, mod_key, mod_tensors, call.sinks, scale, softcap


def op_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_key: str,
    mask_tensors: Sequence[Tensor],
    bias: Tensor | None,
    mod_key: str,
    mod_tensors: Sequence[Tensor],
    sinks: Tensor | None,
    scale: float,
    softcap: float | None,
    dropout_p: float = 0.0,
    mod: ScoreMod | None = None,
) -> Call:
    """The call an operator's arguments describe (``softcap=0`` means none; ``mod`` replaces the rebuilt
    score modifier)."""
    mask = rebuild(mask_key, list(mask_tensors))
    score: Tensor | ScoreMod | None = bias
    if bias is None:
        score = mod if mod is not None else rebuild(mod_key, list(mod_tensors))
    return Call(q, k, v, mask, score, scale, None if softcap == 0 else softcap, dropout_p, True, sinks)


def lse_dtype(q: Tensor) -> torch.dtype:
    """The lse's dtype for inputs of q's dtype: float64 for float64, else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def fake_out_lse(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Fake ``out (B, Hq, Lq, Dv)`` and ``lse (B, Hq, Lq)`` for a forward operator's fake implementation."""
    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    return q.new_empty(B, H, L, v.shape[-1]), q.new_empty(B, H, L, dtype=lse_dtype(q))


def fake_input_grads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Fake ``dq, dk, dv`` (contiguous, as the backward operators return them)."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def refuse_double_backward(op: CustomOpDef, backend: str) -> None:
    """Register, as the autograd formula of a backward operator, an error that names what to use instead."""

    def backward(ctx: object, *grads: Tensor) -> NoReturn:
        raise RuntimeError(
            f"the {backend} backend's backward is not differentiable (create_graph=True or a double "
            f"backward, e.g. a gradient penalty): use backend='math' or 'sdpa' for such a loss"
        )

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)


# ------------------------------------------------------------------ auto while tracing


_DECIDING = threading.local()


def deciding() -> bool:
    """Whether the selection runs for a traced call (``backends.decide``, or ``explain``'s last line): ``select``
    must not divert to ``decide`` again, and flash refuses what its operators cannot take
    (``flash.custom_ops.traced_reason``)."""
    return getattr(_DECIDING, "on", False)


class traced_rules:
    """Within: ``select`` decides as for a traced call (see :func:`deciding`)."""

    def __enter__(self) -> None:
        self.was = deciding()
        _DECIDING.on = True

    def __exit__(self, *exc: object) -> None:
        _DECIDING.on = self.was
