"""No function takes more than 12 parameters: options travel as one config object (``AttentionConfig``,
``BlockConfig``, ``LatentConfig``, ``DistillConfig``, the rope scalings), not as relayed flags.

The exceptions are named below with their reason.  The backends (Triton kernels take their meta-parameters
one by one; registered operators take tensors, not objects) and decoding (``generate``, ``Engine.add``) are
checked where they live, not here."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import attnkit

ROOT = Path(attnkit.__file__).resolve().parent
LIMIT = 12
# the places this test leaves to their own rules (see the module doc)
ELSEWHERE = ("backends/", "decoding/", "generate.py", "engine.py", "_decoding.py", "_sampling.py")
# documented public functions whose signatures follow another library's
EXCEPTIONS = {
    "attention_varlen": "flash_attn_varlen_func's arguments (cu_seqlens, max_seqlen, ...) plus attention()'s",
    "build_mask": "transformers' AttentionMaskInterface calls it with these keywords",
    "attention_forward": "transformers' AttentionInterface calls it with these keywords",
}


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_takes_more_than_twelve_parameters():
    over = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ELSEWHERE) or rel in ELSEWHERE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in EXCEPTIONS:
                n = _parameters(node)
                if n > LIMIT:
                    over.append(f"{rel}:{node.lineno} {node.name} ({n} parameters)")
    assert not over, "pass a config object instead of relaying flags:\n" + "\n".join(over)


def test_the_count_sees_every_kind_of_parameter():
    fn = ast.parse("def f(self, a, /, b, *c, d, **e): pass").body[0]
    assert isinstance(fn, ast.FunctionDef) and _parameters(fn) == 5


def test_the_public_entry_points_are_fully_annotated():
    """mypy checks masks/, backends/ and cache/ strictly; the entry points users call most are held to the same
    rule here: every parameter and the return value annotated (the overloads of `attention` and
    `attention_varlen` say which form `return_lse` gives)."""
    from attnkit.decoding import Engine

    entry = [attnkit.attention, attnkit.attention_varlen, attnkit.generate]
    entry += [getattr(Engine, name) for name in ("__init__", "add", "step", "run", "generate", "abort", "take")]
    bare = []
    for fn in entry:
        sig = inspect.signature(fn)
        bare += [
            f"{fn.__qualname__}({n})" for n, p in sig.parameters.items() if n != "self" and p.annotation is p.empty
        ]
        if sig.return_annotation is sig.empty:
            bare.append(f"{fn.__qualname__} -> ?")
    assert not bare, "unannotated: " + ", ".join(bare)
