"""The package's layout rules, read from the source (imports inside functions included):

- no module under ``attnkit.backends`` imports ``attnkit.functional`` (functional is the public layer above them);
- no import cycles among attnkit's modules (a package importing its own submodules excepted);
- no code outside ``attnkit.masks`` and ``attnkit.bias`` calls a private method of a mask or score modifier, or
  names a private mask or score-modifier class: they ask through the public protocol (``Mask.evaluate``,
  ``Mask.is_causal``, ``ScoreMod.apply``, ...);
- no source file over 1,000 lines.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import attnkit
from attnkit import bias, masks

ROOT = Path(attnkit.__file__).resolve().parent
MAX_LINES = 1000


def _module_name(path: Path) -> str:
    parts = ("attnkit",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


SOURCES = _sources()
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in SOURCES.items()}


def _is_package(name: str) -> bool:
    return SOURCES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, int]]:
    """The attnkit modules ``name`` imports, anywhere in its body, with the line of each import."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "attnkit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "attnkit":
                continue
            for alias in node.names:  # `from pkg import sub` imports the submodule pkg.sub
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in SOURCES else target, node.lineno))
    return [(t, line) for t, line in found if t in SOURCES]


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name in SOURCES:
        own = name + "."
        graph[name] = {t for t, _ in _imports(name) if t != name and not (_is_package(name) and t.startswith(own))}
    return graph


def _where(name: str, line: int | None = None) -> str:
    path = SOURCES[name].relative_to(ROOT.parent)
    return f"{path}:{line}" if line is not None else str(path)


def test_backends_do_not_import_functional():
    bad = [f"{_where(name, line)} imports attnkit.functional"
           for name in SOURCES if name.startswith("attnkit.backends")
           for target, line in _imports(name) if target == "attnkit.functional"]
    assert not bad, "backends must not import the public layer above them:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = _graph()
    cycles = _cycles(graph)
    lines = []
    for component in cycles:
        members = set(component)
        edges = [f"    {a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        lines.append(f"  cycle among {', '.join(component)}:\n" + "\n".join(edges))
    assert not cycles, "import cycles (a package importing its own submodules is fine):\n" + "\n".join(lines)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_protocol() -> tuple[set[str], set[str]]:
    """The private method names of masks and score modifiers, and the private mask and modifier classes."""
    classes = {obj for module in (masks, bias) for obj in vars(module).values()
               if inspect.isclass(obj) and issubclass(obj, (masks.Mask, bias.ScoreMod))}
    for module in list(vars(masks).values()):  # the package's own modules too
        if inspect.ismodule(module) and module.__name__.startswith("attnkit.masks."):
            classes |= {obj for obj in vars(module).values()
                        if inspect.isclass(obj) and issubclass(obj, masks.Mask)}
    methods = {attr for cls in classes for attr in vars(cls)
               if attr.startswith("_") and not attr.startswith("__") and callable(getattr(cls, attr))}
    private_classes = {cls.__name__ for cls in classes if cls.__name__.startswith("_")}
    return methods, private_classes


def _outside_masks(name: str) -> bool:
    return not (name == "attnkit.masks" or name.startswith("attnkit.masks.") or name == "attnkit.bias")


def test_private_mask_protocol_stays_inside_masks_and_bias():
    methods, private_classes = _private_protocol()
    assert {"_tiles", "_size", "_head_count"} <= methods and {"_Causal", "_And", "_ALiBi"} <= private_classes
    bad = []
    for name in filter(_outside_masks, SOURCES):
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
                owner = node.func.value
                own = (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or \
                    (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super")
                if not own:
                    bad.append(f"{_where(name, node.lineno)} calls the private {node.func.attr}() of "
                               f"{ast.unparse(owner)}")
            elif isinstance(node, ast.Attribute) and node.attr in private_classes:
                bad.append(f"{_where(name, node.lineno)} uses the private class {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                hit = [a.name for a in node.names if a.name in private_classes]
                if hit and (node.module or "").split(".")[-1] in ("masks", "bias", "_base", "_builtins", "_convert"):
                    bad.append(f"{_where(name, node.lineno)} imports the private class(es) {', '.join(hit)}")
    assert not bad, ("code outside attnkit.masks and attnkit.bias uses their private protocol; use the public "
                     "methods (Mask.evaluate, Mask.is_causal, Mask.conjuncts, ScoreMod.apply, ...):\n"
                     + "\n".join(bad))


def test_no_source_file_over_1000_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in SOURCES.items()}
    bad = [f"{_where(name)}: {n} lines" for name, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not bad, f"source files over {MAX_LINES} lines (split them along their seams):\n" + "\n".join(bad)


def test_import_reader_sees_imports_inside_functions():
    targets = {t for t, _ in _imports("attnkit.cache._common")}
    assert "attnkit.functional" in targets  # imported inside a function there
    assert "attnkit.masks" in {t for t, _ in _imports("attnkit.backends.call")}
