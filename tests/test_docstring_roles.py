"""Every Sphinx cross-reference in attnkit's docstrings names something that exists.

Each ``:func:``/``:class:``/``:meth:``/``:mod:``/``:attr:``/``:data:``/``:exc:`` role in a docstring under
``src/attnkit`` (and in ``docs/*.rst``) is imported and resolved.  A relative target is looked up as Sphinx
does: in the enclosing class, then the docstring's module, then the package that re-exports it (where
``automodule`` documents it).  The one skip, by rule: a target whose first dotted part is a top-level module
other than attnkit that Python can find, or a builtin (``torch.nn.Module``, ``transformers.PreTrainedModel``,
``threading``, ``ValueError``) belongs to another project's documentation and is not checked here.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import attnkit

ROOT = Path(attnkit.__file__).resolve().parent
DOCS = Path(__file__).resolve().parent.parent / "docs"
ROLE = re.compile(r":(func|class|meth|mod|attr|data|exc):`([^`]+)`")


def _module_name(path: Path) -> str:
    parts = ("attnkit",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _docstrings(tree: ast.Module):
    """``(class qualname or None, docstring, line)`` of the module and every class and function in it."""

    def walk(node, cls):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child, clean=False)
                inner = f"{cls}.{child.name}" if cls else child.name
                owner = inner if isinstance(child, ast.ClassDef) else cls
                if doc:
                    yield owner, doc, child.lineno
                yield from walk(child, owner)

    doc = ast.get_docstring(tree, clean=False)
    if doc:
        yield None, doc, 1
    yield from walk(tree, None)


def _roles():
    """``(where, role, target, candidates)``: the absolute names a role may mean, most specific first."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for cls, doc, line in _docstrings(ast.parse(path.read_text(), filename=str(path))):
            for role, text in ROLE.findall(doc):
                target = _target(text)
                scopes = ([f"{module}.{cls}"] if cls else []) + [module, package]
                candidates = [target] if target.startswith("attnkit") else [f"{s}.{target}" for s in scopes]
                found.append((f"{path.relative_to(ROOT.parent)}:{line}", role, target, candidates))
    for path in sorted(DOCS.glob("*.rst")):
        for role, text in ROLE.findall(path.read_text()):
            target = _target(text)
            found.append((str(path.relative_to(DOCS.parent)), role, target, [target]))
    return found


def _target(text: str) -> str:
    """The name a role's text points at: ``title <name>`` gives ``name``; ``~`` and ``!`` prefixes and a
    trailing ``()`` are presentation."""
    m = re.search(r"<([^>]+)>\s*$", text)
    name = m.group(1) if m else text
    return name.strip().lstrip("~!").removesuffix("()")


def _external(target: str) -> bool:
    """Another project's name (the skip rule of the module docstring)."""
    head = target.split(".")[0]
    if head == "attnkit" or not head.isidentifier():
        return False
    return hasattr(builtins, head) or importlib.util.find_spec(head) is not None


def _resolve(name: str, role: str):
    """The object ``name`` denotes, reached as a reader would: attribute by attribute from the top package,
    after importing every module the name passes through (so a function that shadows its module, as
    ``attnkit.generate`` once did, is caught).  An instance attribute a class documents (``__slots__``,
    annotations, ``self.x =``) counts.  AttributeError/ImportError if it denotes nothing."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        try:
            importlib.import_module(".".join(parts[:i]))
        except ImportError:
            break
    obj = importlib.import_module(parts[0])
    for j, attr in enumerate(parts[1:], start=1):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        if j == len(parts) - 1 and inspect.isclass(obj) and role in ("attr", "data") and _instance_attribute(obj, attr):
            return obj
        raise AttributeError(f"{'.'.join(parts[:j])!r} has no attribute {attr!r}")
    if role == "mod" and not inspect.ismodule(obj):
        raise ImportError(f"{name!r} is {type(obj).__name__}, not a module")
    return obj


def _instance_attribute(cls, attr: str) -> bool:
    if attr in getattr(cls, "__slots__", ()) or attr in getattr(cls, "__annotations__", {}):
        return True
    try:
        return re.search(rf"self\.{attr}\s*[:=]", inspect.getsource(cls)) is not None
    except (OSError, TypeError):
        return False


ROLES = _roles()


def test_the_walk_finds_the_roles():
    assert len(ROLES) > 300
    targets = {t for _, _, t, _ in ROLES}
    assert {"attnkit.decoding.SamplingParams", "attnkit.cache"} <= targets


def test_resolver_tells_names_apart():
    assert _resolve("attnkit.decoding.SamplingParams", "class") is attnkit.decoding.SamplingParams
    assert _resolve("attnkit.decoding.sampling", "mod") is attnkit.decoding.sampling
    assert _resolve("attnkit.decoding.Engine.add", "meth") is attnkit.Engine.add
    assert _resolve("attnkit.decoding.Engine.stats", "attr") is attnkit.Engine  # set in __init__
    with pytest.raises(AttributeError):
        _resolve("attnkit.generate.SamplingParams", "class")  # attnkit.generate is the function
    with pytest.raises(ImportError):
        _resolve("attnkit.decoding.generate", "mod")  # a function, not a module
    assert _external("torch.nn.Module") and not _external("attnkit.nn") and not _external("SamplingParams")
    assert _target("~attnkit.decoding.generate()") == "attnkit.decoding.generate"
    assert _target("Engine.add <attnkit.decoding.Engine.add>") == "attnkit.decoding.Engine.add"


def test_every_docstring_role_resolves():
    broken = []
    for where, role, target, candidates in ROLES:
        errors = []
        for name in candidates:
            try:
                _resolve(name, role)
                break
            except (ImportError, AttributeError) as e:
                errors.append(str(e))
        else:
            if not _external(target):
                broken.append(f"{where}: :{role}:`{target}` ({errors[-1]})")
    assert not broken, f"{len(broken)} docstring references name nothing:\n" + "\n".join(broken)
