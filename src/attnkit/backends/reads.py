"""What a mask or score modifier reads: the tensors it reaches without being run, their identities and
in-place versions (memo keys), the checks that a backward which calls it again finds them unchanged, and
which of a modifier's tensors that require grad its result depends on directly."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Iterator

import torch

from ..bias import ScoreMod
from ..masks import Mask

if TYPE_CHECKING:
    from torch.autograd.graph import Node

    from .call import Call

Tensor = torch.Tensor

_REACH_DEPTH = 5  # steps followed from a mask or modifier (closures, attributes, containers) before giving up


# globals a function names that are not searched for tensor attributes (containers could be huge)
_NOT_FOLLOWED = (types.ModuleType, type, dict, list, tuple, set, frozenset, str, bytes, int, float, bool, complex)


def reachable_tensors(obj: object, *, modules: bool = True) -> list[Tensor]:
    """The tensors a mask or score modifier reads, as far as they can be seen without running it: its own
    attributes, combined masks/modifiers, and what a ``from_fn`` function holds — closure cells, default
    arguments, ``functools.partial`` arguments, a bound method's object (its attributes, ``__slots__`` too),
    a callable object's attributes, lists, tuples, sets and dicts among those, and the module globals the
    function's code names when they are tensors, ``nn.Module`` objects, or other objects' own tensor
    attributes (containers and functions reached through globals are not searched: a global list of
    tensors is not).  An ``nn.Module``'s parameters, buffers and plain
    tensor attributes count, unless ``modules=False``.  Modules, classes and anything further than
    ``_REACH_DEPTH`` steps are not followed.  In first-reached order, each tensor once."""
    import functools

    out: list[Tensor] = []
    seen: set[int] = set()

    def names(code: types.CodeType) -> Iterator[str]:
        yield from code.co_names
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                yield from names(c)

    def attributes(x: object) -> list[object]:
        if isinstance(x, Mask):  # a mask's private attributes are derived memos (random_blocks' tables)
            return [v for k, v in vars(x).items() if not k.startswith("_")]
        items = list(vars(x).values()) if hasattr(x, "__dict__") else []
        for cls in type(x).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and not slot.startswith("__"):
                    try:
                        items.append(getattr(x, slot))
                    except AttributeError:
                        pass
        return items

    def walk(x: object, depth: int) -> None:
        if depth > _REACH_DEPTH or x is None or isinstance(x, (str, bytes, int, float, bool, complex)) or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, Tensor):
            out.append(x)
            return
        if isinstance(x, (types.ModuleType, type)):
            return
        if isinstance(x, torch.nn.Module):
            if modules:
                for t in (*x.parameters(), *x.buffers()):
                    walk(t, depth + 1)
                for t in vars(x).values():
                    if isinstance(t, Tensor):
                        walk(t, depth + 1)
            return
        if isinstance(x, dict):
            items = list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            items = list(x)
        elif isinstance(x, functools.partial):
            items = [x.func, *x.args, *(x.keywords or {}).values()]
        elif isinstance(x, types.MethodType):
            items = [x.__self__, x.__func__]
        elif isinstance(x, types.FunctionType):
            items = [c.cell_contents for c in (x.__closure__ or ()) if _has_contents(c)]
            items += list(x.__defaults__ or ()) + list((x.__kwdefaults__ or {}).values())
            g = x.__globals__
            for n in dict.fromkeys(names(x.__code__)):  # globals: tensors, modules, objects' own tensors
                value = g.get(n)
                if isinstance(value, (Tensor, torch.nn.Module)):
                    walk(value, depth + 1)
                elif not isinstance(value, _NOT_FOLLOWED) and not callable(value) and id(value) not in seen:
                    seen.add(id(value))
                    for attr in attributes(value):
                        if isinstance(attr, Tensor):
                            walk(attr, depth + 2)
        else:
            items = attributes(x)
        for item in items:
            walk(item, depth + 1)

    walk(obj, 0)
    return out


def mod_params(obj: object) -> list[Tensor]:
    """Tensors that require grad that a score modifier reads: its own (ALiBi slopes, T5 table, per-head
    temperatures), those of composed modifiers, and whatever a ``from_fn`` function reaches (closures,
    globals it names, a bound method's object, ``nn.Module`` parameters; see ``reachable_tensors``)."""
    return [t for t in reachable_tensors(obj) if t.requires_grad]


def probe_params(
    mod: ScoreMod, params: list[Tensor], device: torch.device | str, dtype: torch.dtype = torch.float32
) -> tuple[list[Tensor], list[Tensor]]:
    """``(used, missing)``: the ``params`` that ``mod``'s result depends on directly (not only through another
    of them), and the leaf tensors requiring grad it depends on that are not (and are not behind)
    ``params``; found by applying the modifier to one score and walking its autograd graph.  The flash
    backward gives gradients to ``used`` (autograd carries them on to what those were computed from);
    anything in ``missing`` would silently get none."""
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    with torch.enable_grad():
        out = mod.apply(torch.zeros((1, 1, 1, 1), dtype=dtype, device=device), zero, zero, zero, zero, 1, 1)
    if not isinstance(out, Tensor) or out.grad_fn is None:
        return [], []
    leaves = {id(p): p for p in params if p.grad_fn is None}
    inner: dict[int, list[Tensor]] = {}
    for p in params:
        if p.grad_fn is not None:
            inner.setdefault(id(p.grad_fn), []).append(p)
    used: dict[int, Tensor] = {}
    missing: list[Tensor] = []
    seen: set[int] = set()
    todo: list[Node | None] = [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in inner:  # a parameter computed by this node: its own gradient carries on from there
            used.update((id(p), p) for p in inner[id(node)])
            continue
        var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if var is not None:
            if id(var) in leaves:
                used[id(var)] = var
            else:
                missing.append(var)
        todo += [n for n, _ in node.next_functions]
    return [p for p in params if id(p) in used], missing


def derived_params(params: list[Tensor], limit: int = 200_000) -> tuple[Tensor, Tensor] | None:
    """A pair ``(a, b)`` of ``params`` where ``a`` was computed from ``b`` (its autograd graph reaches ``b``),
    or None.  The backward's gradient for ``b`` already includes the path through ``a``; giving ``a`` its
    own gradient too would count that path twice.  A graph of more than ``limit`` nodes is not walked to
    its end: the pair ``(a, a)`` says it could not be checked (the call is refused, to be safe)."""
    if len(params) < 2:
        return None
    targets = {id(p.grad_fn) if p.grad_fn is not None else id(p): p for p in params}
    for a in params:
        if a.grad_fn is None:
            continue
        seen: set[int] = set()
        todo = [n for n, _ in a.grad_fn.next_functions]
        while todo:
            if len(seen) >= limit:
                return a, a
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
            hit = targets.get(id(var) if var is not None else id(node))
            if hit is not None and hit is not a:
                return a, hit
            todo += [n for n, _ in node.next_functions]
    return None


def tensor_key(tensors: list[Tensor]) -> tuple[tuple[int, object], ...]:
    """A memo key part for these tensors' identities and in-place versions.  Hold the tensors with the
    memoised entry: while they live their ids cannot be reused by other tensors.  An inference tensor has
    no version counter: its key matches nothing, so what depends on it is recomputed."""
    return tuple((id(t), object() if t.is_inference() else t._version) for t in tensors)


def _has_contents(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (reading an empty cell raises ValueError)
    except ValueError:
        return False
    return True


def tensor_versions(*objs: object) -> list[tuple[Tensor, int]]:
    """The tensors the masks and biases ``objs`` read that no gradient flows into (index tables, lengths,
    constant biases), with their in-place versions now: what a backward that reads them again must find
    unchanged.  Left out: inference tensors (no version counter), tensors that require grad (parameters an
    optimizer or a layer, e.g. an embedding's max_norm, may legitimately rewrite), and everything inside
    ``nn.Module`` objects."""
    return [
        (t, t._version)
        for o in objs
        for t in reachable_tensors(o, modules=False)
        if not (t.is_inference() or t.requires_grad)
    ]


def check_unchanged(versions: list[tuple[Tensor, int]]) -> None:
    """Raise, as autograd does for its saved tensors, when one of ``versions``' tensors was modified in place
    between the forward and this backward (the backward would compute the gradients of another function)."""
    for t, v in versions:
        if t._version != v:
            raise RuntimeError(
                f"a tensor the attention's mask or bias reads (shape {tuple(t.shape)}, {t.dtype}) was "
                f"modified in place between the forward and the backward (version {v} -> "
                f"{t._version}), so the backward cannot recompute what the forward did: modify a "
                f"clone, or change it only after backward()"
            )


def read_tensors(*objs: object) -> tuple[Tensor, ...]:
    """The tensors the masks/modifiers ``objs`` read, for the rebinding check: what ``reachable_tensors``
    finds outside modules, plus the tensor attributes of a module whose bound method is the function that
    its code names (``self.scale`` in ``def fn(self, ...)``: a module's other attributes may change freely)."""
    out = [t for o in objs for t in reachable_tensors(o, modules=False)]
    stack: list[object] = list(objs)
    seen: set[int] = set()
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen or isinstance(x, Tensor):
            continue
        seen.add(id(x))
        if isinstance(x, types.MethodType) and isinstance(x.__self__, torch.nn.Module):
            names: set[str] = set()
            codes = [x.__func__.__code__]
            while codes:
                code = codes.pop()
                names.update(code.co_names)
                codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            for name in names:
                t = getattr(x.__self__, name, None)
                if isinstance(t, Tensor):
                    out.append(t)
        elif isinstance(x, (Mask, ScoreMod)):
            stack += [v for v in vars(x).values() if not isinstance(v, Tensor)]
        elif isinstance(x, (list, tuple)):
            stack += list(x)
    return tuple(out)


def check_reach(before: tuple[Tensor, ...], call: Call) -> None:
    """The backward recomputes the scores by calling the mask and bias again: every tensor they reached in
    the forward must still be what they reach (a closure variable rebound between the forward and the
    backward would give the gradients of another function)."""
    mod = None if isinstance(call.bias, Tensor) else call.bias
    now = {id(t) for t in read_tensors(call.mask, mod)}
    gone = [t for t in before if id(t) not in now]
    if gone:
        t = gone[0]
        raise RuntimeError(
            f"a tensor the attention's mask or bias read in the forward (shape {tuple(t.shape)}, "
            f"{t.dtype}) is no longer what it reads at the backward (a variable or attribute it "
            f"names was rebound, e.g. by a second forward), so the flash backward cannot "
            f"recompute what the forward did: compute such tensors inside the bias function, call "
            f"backward() before rebinding them, or use backend='math' or 'sdpa'"
        )
