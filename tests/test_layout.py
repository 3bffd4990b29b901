"""The package's layout rules, read from the source (imports inside functions included):

- ``docs/architecture.md``'s layer table is the contract: every module belongs to a row, and a module imports only
  its own layer, the layers its row names, and (transitively) what those may import;
- no module imports another package's private submodule or private name (``attnkit.x._y`` or
  ``from attnkit.x import _y`` from outside ``attnkit.x``), and nothing outside ``backends/<name>/`` imports that
  folder's submodules;
- no test imports a private name of another package than the one it tests;
- no module under ``attnkit.backends`` imports ``attnkit.functional`` (functional is the public layer above them);
- no import cycles among attnkit's modules, a submodule importing its own package's ``__init__`` included;
- no code outside ``attnkit.masks`` and ``attnkit.bias`` calls a private method of a mask or score modifier, or
  names a private mask or score-modifier class: they ask through the public protocol (``Mask.evaluate``,
  ``Mask.is_causal``, ``ScoreMod.apply``, ...);
- no source file over 1,000 lines.
"""

from __future__ import annotations

import ast
import inspect
import re
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


def _imported(tree: ast.AST, package: str) -> list[tuple[str, int, list[str]]]:
    """Every attnkit import in ``tree``, anywhere in its body: the module it names, its line, and the names taken
    from it (empty for ``import x``); ``package`` is where relative imports start."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, []) for a in node.names if a.name.split(".")[0] == "attnkit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "attnkit":
                found.append((target, node.lineno, [a.name for a in node.names]))
    return found


def _package_of(name: str) -> str:
    return name if _is_package(name) else name.rpartition(".")[0]


def _imports(name: str) -> list[tuple[str, int]]:
    """The attnkit modules ``name`` imports, anywhere in its body, with the line of each import."""
    found = []
    for target, line, names in _imported(TREES[name], _package_of(name)):
        if not names:
            found.append((target, line))
        for alias in names:  # `from pkg import sub` imports the submodule pkg.sub
            sub = f"{target}.{alias}"
            found.append((sub if sub in SOURCES else target, line))
    return [(t, line) for t, line in found if t in SOURCES]


def _graph() -> dict[str, set[str]]:
    """Every import edge between two modules; a package importing its own submodules is an edge too, so a
    submodule that imports its package's ``__init__`` closes a cycle."""
    return {name: {t for t, _ in _imports(name) if t != name} for name in SOURCES}


def _where(name: str, line: int | None = None) -> str:
    path = SOURCES[name].relative_to(ROOT.parent)
    return f"{path}:{line}" if line is not None else str(path)


def test_backends_do_not_import_functional():
    bad = [
        f"{_where(name, line)} imports attnkit.functional"
        for name in SOURCES
        if name.startswith("attnkit.backends")
        for target, line in _imports(name)
        if target == "attnkit.functional"
    ]
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
    assert not cycles, (
        "import cycles (a submodule that imports its own package's __init__ counts: import from "
        "the defining submodule instead):\n" + "\n".join(lines)
    )


def test_the_import_graph_holds_package_to_submodule_edges():
    graph = _graph()
    assert "attnkit.backends.flash" in graph["attnkit.backends"]  # so a submodule importing it back is a cycle


def test_waiting_imports_are_still_there():
    for name, dotted in WAITING:
        assert dotted in {d for d, _ in _private_imports(name, TREES[name], _package_of(name))}, (
            f"{name} -> {dotted} is gone"
        )


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_protocol() -> tuple[set[str], set[str]]:
    """The private method names of masks and score modifiers, and the private mask and modifier classes."""
    classes = {
        obj
        for module in (masks, bias)
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, (masks.Mask, bias.ScoreMod))
    }
    for module in list(vars(masks).values()):  # the package's own modules too
        if inspect.ismodule(module) and module.__name__.startswith("attnkit.masks."):
            classes |= {obj for obj in vars(module).values() if inspect.isclass(obj) and issubclass(obj, masks.Mask)}
    methods = {
        attr
        for cls in classes
        for attr in vars(cls)
        if attr.startswith("_") and not attr.startswith("__") and callable(getattr(cls, attr))
    }
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
                own = (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
                    isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
                )
                if not own:
                    bad.append(
                        f"{_where(name, node.lineno)} calls the private {node.func.attr}() of {ast.unparse(owner)}"
                    )
            elif isinstance(node, ast.Attribute) and node.attr in private_classes:
                bad.append(f"{_where(name, node.lineno)} uses the private class {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                hit = [a.name for a in node.names if a.name in private_classes]
                if hit and (node.module or "").split(".")[-1] in ("masks", "bias", "_base", "_builtins", "_convert"):
                    bad.append(f"{_where(name, node.lineno)} imports the private class(es) {', '.join(hit)}")
    assert not bad, (
        "code outside attnkit.masks and attnkit.bias uses their private protocol; use the public "
        "methods (Mask.evaluate, Mask.is_causal, Mask.conjuncts, ScoreMod.apply, ...):\n" + "\n".join(bad)
    )


def test_no_source_file_over_1000_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in SOURCES.items()}
    bad = [f"{_where(name)}: {n} lines" for name, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not bad, f"source files over {MAX_LINES} lines (split them along their seams):\n" + "\n".join(bad)


def test_import_reader_sees_imports_inside_functions():
    targets = {t for t, _ in _imports("attnkit.cache._common")}
    assert "attnkit.functional" in targets  # imported inside a function there
    assert "attnkit.masks" in {t for t, _ in _imports("attnkit.backends.call")}


# --- the layer table of docs/architecture.md ------------------------------------------------------------------

ARCHITECTURE = ROOT.parent.parent / "docs" / "architecture.md"
TESTS = Path(__file__).resolve().parent


def _layer(name: str) -> str:
    """The layer a module belongs to: the package or module directly under attnkit (``attnkit.cache._common`` ->
    ``cache``, ``attnkit.bias`` -> ``bias``); attnkit's own ``__init__`` is the layer ``__init__``."""
    parts = name.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _table(text: str) -> list[tuple[list[str], set[str] | None]]:
    """The rows of the layer table, in order: the layers each row names (its first column: backticked ``x/``
    packages or ``x.py`` modules) and the layers it may import (its last column: backticked or bare layer names;
    ``torch`` and other words ignored), or None for "everything above"."""
    lines = text.split("## Layers", 1)[1].splitlines()
    rows = [line for line in lines if line.startswith("|") and not line.startswith("|---")][1:]  # after the header
    out: list[tuple[list[str], set[str] | None]] = []
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        places = [p.removesuffix("/").removesuffix(".py") for p in re.findall(r"`([\w.]+(?:/|\.py))`", cells[0])]
        assert places, f"a row of the layer table names no `package/` or `module.py`: {row}"
        if "everything above" in cells[-1]:
            out.append((places, None))
            continue
        words = {w.strip("`") for w in re.split(r"[,\s]+", cells[-1]) if w}
        out.append((places, words))
    known = {p for places, _ in out for p in places}
    return [(places, None if allowed is None else allowed & known) for places, allowed in out]


def _allowed(table: list[tuple[list[str], set[str] | None]]) -> dict[str, set[str]]:
    """What each layer may import: its own layer, the layers its row names and, transitively, what those may
    import; "everything above" is every layer of the rows above."""
    direct: dict[str, set[str]] = {}
    for i, (places, allowed) in enumerate(table):
        above = {p for earlier, _ in table[:i] for p in earlier}
        for place in places:
            direct[place] = set(above) if allowed is None else set(allowed)
    closed = {}
    for place in direct:
        seen, todo = {place}, [place]
        while todo:
            for other in direct.get(todo.pop(), set()):
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        closed[place] = seen
    return closed


TABLE = _table(ARCHITECTURE.read_text())
ALLOWED = _allowed(TABLE)


def test_the_table_reader_reads_rows_and_everything_above():
    text = (
        "## Layers\n\n| place | holds | may import |\n|---|---|---|\n| `a/` | x | torch |\n"
        "| `b.py`, `c/` | y | a, `numpy` |\n| `d.py` | z | everything above |\n"
    )
    table = _table(text)
    assert table == [(["a"], set()), (["b", "c"], {"a"}), (["d"], None)]
    assert _allowed(table) == {"a": {"a"}, "b": {"a", "b"}, "c": {"a", "c"}, "d": {"a", "b", "c", "d"}}
    assert _allowed([(["a"], set()), (["b"], {"a"}), (["c"], {"b"})])["c"] == {"a", "b", "c"}  # transitive


def test_every_module_belongs_to_a_row_of_the_layer_table():
    missing = sorted({_layer(name) for name in SOURCES} - set(ALLOWED))
    assert not missing, (
        f"{ARCHITECTURE.name} has no row for the layer(s) {', '.join(missing)}: add a row that says "
        "what each holds and may import"
    )
    stale = sorted(set(ALLOWED) - {_layer(name) for name in SOURCES})
    assert not stale, f"{ARCHITECTURE.name} has rows for layers that do not exist: {', '.join(stale)}"


def test_modules_import_only_the_layers_their_row_allows():
    bad = [
        f"{_where(name, line)}: {_layer(name)} imports {target} ({_layer(target)}), which its row of "
        f"{ARCHITECTURE.name} does not allow"
        for name in SOURCES
        for target, line in _imports(name)
        if _layer(target) not in ALLOWED.get(_layer(name), {_layer(name)})
    ]
    assert not bad, "imports against the layer table (move the code, or change the table and say why):\n" + "\n".join(
        bad
    )


def _private_owner(dotted: str) -> str | None:
    """The package (or module directly under attnkit) whose private part ``dotted`` names, or None when every part
    after ``attnkit`` is public: ``attnkit.cache._common.x`` -> ``attnkit.cache``, ``attnkit.nn.attention._Attends``
    -> ``attnkit.nn`` (a private name of a module is its package's), ``attnkit.softmax._check_float`` ->
    ``attnkit.softmax``, and a private module directly under attnkit (``attnkit._checks``) is attnkit's own."""
    parts = dotted.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:i])
            if i > 2 and owner in SOURCES and not _is_package(owner):
                owner = owner.rpartition(".")[0]
            return owner
    return None


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _private_imports(name: str, tree: ast.AST, package: str) -> list[tuple[str, int]]:
    """The private attnkit modules and names ``tree`` imports, as dotted paths with their lines; ``package`` is
    the package relative imports start from."""
    found = [
        (dotted, line)
        for target, line, names in _imported(tree, package)
        for dotted in ([f"{target}.{a}" for a in names] if names else [target])
    ]
    return [(dotted, line) for dotted, line in found if _private_owner(dotted) is not None]


# bias and masks share the mask protocol's private helpers (offsets, index grids, alignment checks)
FRIENDS = {("attnkit.bias", "attnkit.masks")}
# imports still waiting for a public home, each with its reason
WAITING = {
    ("attnkit.distill._sparse", "attnkit.nn._checks"): "the student's mask is checked as DecoderConfig checks "
    "layer_masks (causal_model_mask); its public home comes with the config objects of issue 31",
}


def test_no_module_imports_another_packages_private_parts():
    bad = []
    for name in SOURCES:
        for dotted, line in _private_imports(name, TREES[name], _package_of(name)):
            owner = _private_owner(dotted)
            if (name, owner) in FRIENDS or (name, dotted) in WAITING:
                continue
            if not _inside(name, owner):
                bad.append(f"{_where(name, line)} imports {dotted}, private to {owner}")
    assert not bad, (
        "modules import private parts of another package (give the name a public home in that "
        "package):\n" + "\n".join(bad)
    )


def test_only_a_backend_folder_imports_its_own_submodules():
    folders = {name for name in SOURCES if name.startswith("attnkit.backends.") and _is_package(name)}
    assert {"attnkit.backends.flash", "attnkit.backends.triton"} <= folders
    bad = [
        f"{_where(name, line)} imports {target}: outside {folder} import the names {folder} exports"
        for name in SOURCES
        for target, line in _imports(name)
        for folder in folders
        if target.startswith(folder + ".") and not _inside(name, folder)
    ]
    assert not bad, "\n".join(bad)


def _test_module(path: Path) -> str:
    """The attnkit package or module a test file tests: a test under ``tests/<pkg>/`` tests ``attnkit.<pkg>``; a
    top-level ``tests/test_<x>.py`` tests the module named by the longest ``_``-separated prefix of ``x`` that is
    a module, public or private (``test_cli_distill.py`` -> ``attnkit.cli``, ``test_checks.py`` ->
    ``attnkit._checks``), else attnkit's public API (``attnkit``: no private name is its own)."""
    rel = path.relative_to(TESTS)
    if len(rel.parts) > 1:
        return "attnkit." + rel.parts[0]
    words = rel.stem.removeprefix("test_").split("_")
    for n in range(len(words), 0, -1):
        stem = "_".join(words[:n])
        for candidate in (f"attnkit.{stem}", f"attnkit._{stem}"):
            if candidate in SOURCES:
                return candidate
    return "attnkit"


def _private_uses(tree: ast.AST) -> list[tuple[str, int]]:
    """The private attnkit names a test imports or reaches through an imported module (``backends._REGISTRY``)."""
    modules: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "attnkit":
                    modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else "attnkit"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "attnkit" and not node.level:
            for a in node.names:
                modules[a.asname or a.name] = f"{node.module}.{a.name}"
                found.append((f"{node.module}.{a.name}", node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in modules:
                found.append((".".join([modules[cur.id], *reversed(chain)]), node.lineno))
    for node in ast.walk(tree):  # a dotted import names its modules too
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "attnkit"]
    return [(dotted, line) for dotted, line in found if _private_owner(dotted) is not None]


def _foreign_private_uses(path: Path, tree: ast.AST) -> list[str]:
    own = _test_module(path)
    out = []
    for dotted, line in sorted(set(_private_uses(tree))):
        owner = _private_owner(dotted)
        if own == "attnkit" or not _inside(dotted, own):
            out.append(
                f"{path.relative_to(TESTS.parent)}:{line} uses {dotted}, private to {owner} (the test tests {own})"
            )
    return out


def test_tests_use_only_their_own_packages_private_names():
    bad = [
        use for path in sorted(TESTS.rglob("*.py")) for use in _foreign_private_uses(path, ast.parse(path.read_text()))
    ]
    assert not bad, (
        "tests use private names of a package they do not test (use the public seam, or move the "
        "test into the folder of the package it tests):\n" + "\n".join(bad)
    )


def test_the_private_use_reader_tells_own_from_foreign():
    source = "import attnkit\nfrom attnkit import backends\nfrom attnkit.cache._common import x\nbackends._REGISTRY\n"
    tree = ast.parse(source)
    assert sorted(_private_uses(tree)) == [("attnkit.backends._REGISTRY", 4), ("attnkit.cache._common.x", 3)]
    assert len(_foreign_private_uses(TESTS / "cache" / "test_x.py", tree)) == 1  # backends' private name
    assert len(_foreign_private_uses(TESTS / "backends" / "test_x.py", tree)) == 1  # cache's private module
    assert len(_foreign_private_uses(TESTS / "test_unknown_topic.py", tree)) == 2
    assert _test_module(TESTS / "test_cli_distill.py") == "attnkit.cli"
    assert _test_module(TESTS / "test_checks.py") == "attnkit._checks"
    assert _test_module(TESTS / "decoding" / "test_sampling.py") == "attnkit.decoding"


def test_the_strictly_typed_layers_have_no_known_type_errors():
    """pyproject.toml checks masks/, backends/ and cache/ with mypy's strict flags; `make check` tolerates only
    the errors listed in mypy-baseline.txt, so none of those layers may be listed there."""
    baseline = (ROOT.parents[1] / "mypy-baseline.txt").read_text().splitlines()
    strict = ("src/attnkit/masks/", "src/attnkit/backends/", "src/attnkit/cache/")
    listed = [line for line in baseline if line.startswith(strict)]
    assert not listed, "known type errors in strictly typed layers (fix them):\n" + "\n".join(listed)
