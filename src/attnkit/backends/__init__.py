"""Ways of computing attention, registered by name, and the rule ``auto`` uses to pick one.

``math`` is the oracle (materialised scores, any dtype, attention weights); ``sdpa`` is PyTorch's fused
kernel for the calls it takes exactly.  Each backend is three things: ``check(call)`` says why it cannot
take a call (or ``None``), ``cost(call)`` estimates its work, and ``run(call)`` computes.  ``auto`` picks
the cheapest backend whose check passes; :func:`explain` says which and why.

While ``torch.compile`` traces (``torch.compiler.is_compiling()``, also ``torch.export``), ``select`` makes the
eager decision: it is computed once per traced call from the call's shapes, dtypes and flags and the mask's
and modifier's descriptions and tensors (``decide``).  The tiled backends run as custom operators,
one graph node per call: ``flash`` as ``attnkit::flash_forward`` / ``attnkit::flash_backward``, ``triton`` as
``attnkit::triton_forward`` / ``attnkit::triton_backward``.  One exception: a decode-sized CPU call (at most
16 queries and 16384 keys, without gradients) traces ``math``, which Inductor fuses into one loop nest.

Example::

    >>> import torch
    >>> from attnkit import backends, masks
    >>> q = k = v = torch.randn(1, 2, 16, 8)
    >>> "math" in backends.available()
    True
    >>> print(backends.explain(q, k, v, mask=masks.causal()).splitlines()[0])
    auto picks 'sdpa' for q (1, 2, 16, 8) float32, k (1, 2, 16, 8), v (1, 2, 16, 8), mask causal(align='bottom_right')
"""

from __future__ import annotations

import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, cast

import torch

from . import flash as _flash
from . import math as _math
from . import operators
from . import sdpa as _sdpa
from . import splitkv as _splitkv
from . import triton as _triton
from .call import Call, make_call, refuse_foreign, single_query_window
from .operators import constant_result, op_arguments, rebuild, traced_rules

Tensor = torch.Tensor

__all__ = ["available", "explain", "Backend", "Registration", "get", "register"]


@dataclass(frozen=True)
class Backend:
    """A registered way of computing attention."""

    name: str
    run: Callable[[Call], Tensor | tuple[Tensor, Tensor]]  # -> out, or (out, lse) when call.return_lse
    check: Callable[[Call], str | None]  # None when the call is supported, else the reason it is not
    cost: Callable[[Call], float]  # estimated work; auto picks the cheapest supported backend
    available: Callable[[], bool] = lambda: True
    description: str = ""
    unavailable_reason: Callable[[], str] | None = None  # what to change when available() is False


_REGISTRY: dict[str, Backend] = {}

# the custom operators a backend runs as while torch.compile or torch.export traces
_OPERATORS = {"flash": "attnkit::flash_forward/backward", "triton": "attnkit::triton_forward/backward"}


class Registration:
    """The handle :func:`register` returns: :meth:`remove` takes the backend out again and puts back the one
    it replaced, if any (a ``with`` block removes it on exit)."""

    def __init__(self, backend: Backend, replaced: Backend | None) -> None:
        self.backend, self.replaced = backend, replaced

    def remove(self) -> None:
        """Unregister the backend (nothing happens when it was removed already, or replaced since by another
        backend of its name: that one stays)."""
        if _REGISTRY.get(self.backend.name) is not self.backend:
            return
        if self.replaced is None:
            del _REGISTRY[self.backend.name]
        else:
            _REGISTRY[self.backend.name] = self.replaced

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register(backend: Backend) -> Registration:
    """Add a backend, replacing one of the same name; returns the :class:`Registration` that removes it."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register: backend must be an attnkit.backends.Backend, got {type(backend).__name__}")
    replaced = _REGISTRY.get(backend.name)
    _REGISTRY[backend.name] = backend
    return Registration(backend, replaced)


def get(name: str) -> Backend:
    """The backend registered as ``name`` (available on this machine or not): its ``check(call)`` says why it
    refuses a call (``attnkit.backends.call.make_call`` builds one), its ``cost(call)`` what it estimates.

    Example::

        >>> import torch
        >>> from attnkit import backends
        >>> from attnkit.backends.call import make_call
        >>> q = k = v = torch.randn(1, 2, 16, 8)
        >>> backends.get("sdpa").check(make_call(q, k, v, softcap=30.0))
        'SDPA has no softcap'
    """
    b = _REGISTRY.get(name) if isinstance(name, str) else None
    if b is None:
        raise ValueError(f"backends.get: no backend is registered as {name!r}: choose one of {list(_REGISTRY)}")
    return b


register(
    Backend(
        "math",
        _math.run,
        _math.check,
        _math.cost,
        description="textbook formula, materialised scores; the oracle; any dtype",
    )
)
register(
    Backend("sdpa", _sdpa.run, _sdpa.check, _sdpa.cost, description="torch.nn.functional.scaled_dot_product_attention")
)
register(
    Backend(
        "flash",
        _flash.run,
        _flash.check,
        _flash.cost,
        description="tiled block-sparse attention in PyTorch ops; memory-efficient backward",
    )
)
register(
    Backend(
        "triton",
        _triton.run,
        _triton.check,
        _triton.cost,
        _triton.available,
        description="Triton block-sparse flash kernels; CUDA GPUs (or TRITON_INTERPRET=1 on CPU)",
        unavailable_reason=_triton.unavailable_reason,
    )
)
register(
    Backend(
        "splitkv",
        _splitkv.run,
        _splitkv.check,
        _splitkv.cost,
        description="CPU decoding: keys split into chunks merged by log-sum-exp; grouped heads read "
        "each key once; no gradients",
    )
)


def available() -> list[str]:
    """Names of the backends that can run on this machine."""
    return [name for name, b in _REGISTRY.items() if b.available()]


def _get(name: str) -> Backend:
    b = _REGISTRY.get(name)
    if b is None or not b.available():
        why = f" ({b.unavailable_reason()})" if b is not None and b.unavailable_reason is not None else ""
        raise ValueError(f"backend={name!r} is not available here{why}: choose one of {['auto', *available()]}")
    return b


_PICKS: dict[
    tuple[object, ...], tuple[weakref.ref[Any] | None, weakref.ref[Any] | None, Backend]
] = {}  # auto's recent decisions, by call signature
_PICKS_SIZE = 64
_PICKS_LOCK = threading.Lock()


_T = TypeVar("_T")


def _ref(obj: _T | None) -> weakref.ref[_T] | None:
    return None if obj is None else weakref.ref(obj)


def _alive(ref: weakref.ref[_T] | None) -> _T | None:
    return None if ref is None else ref()


def _signature(call: Call) -> tuple[object, ...]:
    """Everything a backend's check and cost may depend on.  The layers of a model call attention with
    the same signature, so auto decides once per forward (and once per decoding step)."""
    bias = call.bias
    t = cast(Tensor, bias)  # (read only where it has a shape: a tensor)
    bias_key = (id(bias), t.requires_grad, tuple(t.shape)) if hasattr(bias, "shape") else id(bias)
    return (
        tuple(call.q.shape),
        tuple(call.k.shape),
        tuple(call.v.shape),
        call.q.dtype,
        call.q.device,
        call.q.stride(),
        call.k.stride(),
        call.v.stride(),
        id(call.mask),
        bias_key,
        call.scale,
        call.softcap,
        call.dropout_p > 0,
        call.return_lse,
        call.needs_grad,
        torch.is_grad_enabled(),
        call.sinks is not None,
        call.sinks is not None and _sdpa.sinks_too_large(call),
    )


# ------------------------------------------------------------------ auto's rules


@dataclass(frozen=True)
class Rule:
    """One step of ``auto``'s policy.  :data:`AUTO_RULES` lists them in order: the first rule whose ``pick``
    returns a backend decides.  ``select`` and :func:`explain` read the same list (``explain`` prints ``why``).

    A ``traced`` rule applies only while ``torch.compile`` traces the call; when none does, the traced call
    takes the eager rules' decision (:func:`decide`).
    """

    name: str
    pick: Callable[[Call], "Backend | None"]  # the backend this rule gives the call, or None when it does not apply
    why: Callable[[Call], str]  # why it decided, as explain says it
    traced: bool = False  # applies only while torch.compile traces
    weighs: bool = False  # decides by the backends' costs (explain prints each one's); else the others are not weighed


def _traced_decode(call: Call) -> Backend | None:
    """``math`` for a decode-sized CPU call (at most 16 queries and 16384 keys, no gradients, no dropout):
    traced, Inductor fuses its scores, softmax and weighted sum into one loop nest, where the fused SDPA kernel
    pays a parallel region per call (a bfloat16 decode step of an 8-layer model: ~7 ms against ~11 ms)."""
    Lq, Lk = call.q.shape[2], call.k.shape[2]
    if (
        call.q.device.type == "cpu"
        and Lq <= _DECODE_QUERIES
        and Lk <= _DECODE_KEYS
        and not call.needs_grad
        and call.dropout_p == 0
    ):
        return _REGISTRY["math"]
    return None


_DECODE_QUERIES, _DECODE_KEYS = 16, 16384


def _traced_any_length(call: Call) -> Backend | None:
    """For a traced call with a dynamic length (mark_dynamic, dynamic=True), the backend that serves any length:
    the backends' checks run traced, on the symbolic sizes (relations between them become guards; no size is
    specialised), so one graph serves every length, but the costs need the sizes' values.  On CPU ``flash`` (one
    operator node; it plans the tiles of each length when the graph runs), elsewhere ``sdpa``; ``math`` where
    these cannot take it."""
    if not _symbolic_sizes(call):
        return None
    for name in DYNAMIC_ORDER.get(call.q.device.type, DYNAMIC_ORDER_OTHER):
        b = _REGISTRY.get(name)
        if b is not None and b.available() and b.check(call) is None:
            return b
    return _checked(call, "math")


DYNAMIC_ORDER = {"cpu": ("flash", "math")}  # auto's pick for a traced call of dynamic length, by device type
DYNAMIC_ORDER_OTHER = ("sdpa", "math")  # ... elsewhere


def _nothing_to_skip(call: Call) -> Backend | None:
    """``sdpa`` for a call without mask or bias when it takes it, or for one query whose mask leaves it one
    window of keys (a decode step under a causal or sliding-window mask, which sdpa reads as a view):
    nothing to skip, so no tiled backend beats the fused kernel, and deciding so costs no planning (a decode
    step meets a new key length each time; planning the tiled backend's cost at every step made the decode
    steps of a model with ``backend="auto"`` several times slower on a busy machine).  Not for a long CPU
    decode call, which ``splitkv`` takes at half the fused kernel's cost."""
    if (
        call.bias is None
        and (call.mask is None or single_query_window(call) is not None)
        and not _splitkv_wins(call)
        and not _sdpa.unfused_on_cpu(call)
    ):
        b = _REGISTRY.get("sdpa")
        if b is not None and b.available() and b.check(call) is None:
            return b
    return None


def _why_nothing_to_skip(call: Call) -> str:
    return (
        "without mask or bias there is nothing to skip"
        if call.mask is None
        else "one query whose mask leaves it one window of keys (read as a view): nothing to skip"
    )


def _splitkv_wins(call: Call) -> bool:
    """A long CPU decode call, which ``splitkv`` takes at half the fused kernel's cost (``splitkv.wins``)."""
    b = _REGISTRY.get("splitkv")
    return b is not None and b.check is _splitkv.check and _splitkv.wins(call)


def _cheapest(call: Call) -> Backend | None:
    best: Backend | None = None
    best_cost = float("inf")
    for b in _REGISTRY.values():
        if b.available() and b.check(call) is None:
            c = b.cost(call)
            if c < best_cost:
                best, best_cost = b, c
    return best  # math takes every call, so there is always one


AUTO_RULES: tuple[Rule, ...] = (
    Rule(
        "decode-sized CPU call",
        _traced_decode,
        lambda call: "a decode-sized CPU call, which Inductor fuses",
        traced=True,
    ),
    Rule(
        "dynamic length",
        _traced_any_length,
        lambda call: "a dynamic length: the backend that serves any length",
        traced=True,
    ),
    Rule("nothing to skip", _nothing_to_skip, _why_nothing_to_skip),
    Rule("cheapest", _cheapest, lambda call: "the cheapest estimate", weighs=True),
)


def _decision(call: Call, traced: bool) -> tuple[Rule, Backend] | None:
    """The first of auto's rules (the traced ones, or the eager ones) that picks a backend for ``call``."""
    for rule in AUTO_RULES:
        if rule.traced == traced:
            b = rule.pick(call)
            if b is not None:
                return rule, b
    return None


def _eager_decision(call: Call) -> tuple[Rule, Backend]:
    """The eager rules' decision (the last rule, the cheapest estimate, always picks: math takes every call)."""
    hit = _decision(call, traced=False)
    if hit is None:
        raise RuntimeError("attnkit.backends: no backend takes this call (math was unregistered?)")
    return hit


def select(call: Call, backend: str) -> Backend:
    """The backend that runs ``call``: the named one (if it takes the call) or auto's pick."""
    if torch.compiler.is_compiling() and not operators.deciding():
        if backend == "auto":
            traced = _decision(call, traced=True)
            if traced is not None:
                return traced[1]
        elif _symbolic_sizes(call):
            return _checked(call, backend)  # (the checks run traced, on the symbolic sizes)
        # the eager decision, computed once while tracing from the call's constants and the mask's tensors
        return _REGISTRY[decide(call, backend)]
    if backend != "auto":
        return _checked(call, backend)
    if operators.deciding():
        return _eager_decision(call)[1]  # (not memoised: the traced rules may differ from eager's)
    key = _signature(call)
    hit = _PICKS.get(key)
    # weak references to the mask and bias tell a reused id from the same object without keeping
    # either alive (a bool tensor mask is a new Mask at every call: its entry just dies)
    if (
        hit is not None
        and _alive(hit[0]) is call.mask
        and _alive(hit[1]) is call.bias
        and _REGISTRY.get(hit[2].name) is hit[2]
    ):
        return hit[2]
    chosen = _eager_decision(call)[1]
    with _PICKS_LOCK:  # (threads share the memo)
        while len(_PICKS) >= _PICKS_SIZE:
            _PICKS.pop(next(iter(_PICKS)))
        _PICKS[key] = (_ref(call.mask), _ref(call.bias), chosen)
    return chosen


def _checked(call: Call, backend: str) -> Backend:
    """The named backend, if it takes ``call``; else a ValueError naming the reason and the backends that can."""
    b = _get(backend)
    reason = b.check(call)
    if reason is not None:
        takers = [n for n in available() if n != backend and _REGISTRY[n].check(call) is None]
        raise ValueError(
            f"backend={backend!r} cannot take this call: {reason}; backends that can: {takers} (or backend='auto')"
        )
    return b


def _symbolic_sizes(call: Call) -> bool:
    """Whether a traced call has a size that ``torch.compile`` keeps symbolic (a dynamic sequence length)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    # (dynamo shows a symbolic size as an int; a size whose parity the compiler cannot tell is symbolic, and
    # asking makes no guard)
    tensors = [call.q, call.k, call.v] + ([call.bias] if isinstance(call.bias, torch.Tensor) else [])
    return any(not (known(n % 2 == 0) or known(n % 2 == 1)) for t in tensors for n in t.shape)


# ------------------------------------------------------------------ auto while tracing

# what _meta reads of a tensor: shape, strides, dtype, device, requires_grad
_Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, bool]


def _meta(t: Tensor | None) -> _Meta | None:
    """What a backend's checks and costs read of a tensor, as constants: shape, strides, dtype, device and
    whether it requires grad (never its values)."""
    if t is None:
        return None
    # operator.index specialises a dynamic size to its value (a guard): tile plans and costs are per shape
    return (
        tuple(operator.index(n) for n in t.shape),
        tuple(operator.index(s) for s in t.stride()),
        t.dtype,
        t.device,
        t.requires_grad,
    )


def _empty(meta: _Meta | None) -> Tensor | None:
    if meta is None:
        return None
    shape, stride, dtype, device, grad = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).requires_grad_(grad)


@constant_result
def _decide(
    backend: str,
    metas: tuple[_Meta | None, ...],
    flags: tuple[bool, float, float | None, float, bool, int],
    mask_key: str,
    mod_key: str,
    *tensors: Tensor,
) -> tuple[str, str]:
    """``("ok", name)`` or ``("error", message)``: eager ``select``'s answer for a call rebuilt from its
    constants, with the mask's and modifier's real tensors.  Runs once per traced call site."""
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
        # (q, k and v always have metas: only bias and sinks may be None)
        q, k, v = cast(Tensor, q), cast(Tensor, k), cast(Tensor, v)
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
    mask_key, mask_tensors, bias_t, mod_key, mod_tensors = op_arguments(call)
    metas = tuple(_meta(t) for t in (call.q, call.k, call.v, bias_t, call.sinks))
    flags = (
        torch.is_grad_enabled(),
        float(call.scale),
        call.softcap,
        float(call.dropout_p),
        call.return_lse,
        len(mask_tensors),
    )
    verdict, value = _decide(backend, metas, flags, mask_key, mod_key, *mask_tensors, *mod_tensors)
    if verdict == "error":
        raise ValueError(value)
    return value


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> str:
    """Which backend ``attention(q, k, v, **kwargs)`` would use, and why each other one would not.

    For ``backend="auto"`` the last line names the backend auto picks while ``torch.compile`` traces the
    call: the same one, except that a decode-sized CPU call traces ``math``.  With ``cu_seqlens_q`` and
    ``cu_seqlens_k`` (packed ``(T, H, D)`` tensors), it says how :func:`attnkit.attention_varlen` computes
    the call: one batched flash call or the per-sequence path, and why.

    Example::

        >>> import torch
        >>> from attnkit import backends
        >>> q = k = v = torch.randn(1, 2, 64, 8)
        >>> print(backends.explain(q, k, v, softcap=30.0).splitlines()[-1])
        under torch.compile auto picks 'math' too
        >>> print(backends.explain(q[:, :, -1:], k, v).splitlines()[-1])   # one query: a decode step
        under torch.compile auto picks 'math' (a decode-sized CPU call, which Inductor fuses)
        >>> cu = torch.tensor([0, 300, 500], dtype=torch.int32)
        >>> packed = torch.randn(500, 2, 8)
        >>> print(backends.explain(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu).splitlines()[0])
        attention_varlen on 2 sequences, q (500, 2, 8) float32: one batched flash call (the cheaper estimate)
    """
    backend = kwargs.pop("backend", "auto")
    if "cu_seqlens_q" in kwargs or "cu_seqlens_k" in kwargs:  # packed sequences: attention_varlen's choice
        from . import packed

        return packed.explain(
            select,
            q,
            k,
            v,
            kwargs.pop("cu_seqlens_q", None),
            kwargs.pop("cu_seqlens_k", None),
            backend=backend,
            **kwargs,
        )
    refuse_foreign(
        "explain",
        {
            n: x
            for n, x in kwargs.items()
            if n not in ("mask", "bias", "scale", "softcap", "sinks", "dropout_p", "return_lse")
        },
    )
    call = make_call(q, k, v, **kwargs)
    chosen = select(call, backend)
    desc = [f"q {tuple(q.shape)} {str(q.dtype).replace('torch.', '')}", f"k {tuple(k.shape)}", f"v {tuple(v.shape)}"]
    if call.mask is not None:
        desc.append(f"mask {call.mask!r}")
    if call.sinks is not None:
        desc.append("sinks")
    if call.bias is not None:
        desc.append(f"bias {call.bias!r}" if not hasattr(call.bias, "shape") else f"bias {tuple(call.bias.shape)}")
    lines = [f"{'auto picks' if backend == 'auto' else 'uses'} {chosen.name!r} for {', '.join(desc)}"]
    decided = _eager_decision(call) if backend == "auto" else None
    # a rule that decides before the costs: the other backends are not weighed
    unweighed = decided[0] if decided is not None and not decided[0].weighs and decided[1] is chosen else None
    for name, b in _REGISTRY.items():
        if not b.available():
            lines.append(f"  {name:7s} not available on this machine")
            continue
        reason = b.check(call)
        if reason is None and unweighed is not None and b is not chosen:
            lines.append(f"  {name:7s} takes it; not weighed: {unweighed.why(call)}")
        elif reason is None:
            lines.append(
                f"  {name:7s} takes it; estimated cost {b.cost(call) / 1e9:.3g} GFLOP-equivalents"
                f"{'  <- chosen' if b is chosen else ''}"
            )
        else:
            lines.append(f"  {name:7s} cannot: {reason}")
    if backend == "auto" and chosen.name == "splitkv" and _splitkv_wins(call):
        lines.append(
            f"splitkv: a CPU decode call ({call.group * call.q_len} query rows per kv head <= "
            f"{_splitkv.DECODE_ROWS}, {call.batch} x {call.kv_len} keys >= {_splitkv.MIN_KEYS}): each key is read "
            f"once for its {call.group} grouped heads, chunks over the threads merged by log-sum-exp"
        )
    traced_rule = _decision(call, traced=True) if backend == "auto" else None
    if traced_rule is not None:
        rule, traced = traced_rule
        lines.append(f"under torch.compile auto picks {traced.name!r} ({rule.why(call)})")
    elif backend == "auto":
        with traced_rules():
            traced, why_not = select(call, backend), chosen.check(call)
        if traced is chosen:
            how = f" (as the custom operators {_OPERATORS[chosen.name]})" if chosen.name in _OPERATORS else ""
            lines.append(f"under torch.compile auto picks {chosen.name!r} too{how}")
        else:
            lines.append(f"under torch.compile auto picks {traced.name!r}: {chosen.name} cannot take it ({why_not})")
    return "\n".join(lines)
