"""Rebuilding masks from :meth:`Mask.to_dict` descriptions (the built-ins' own constructor calls)."""

from __future__ import annotations

import ast

from . import _builtins
from ._base import Mask

_CONSTRUCTORS = ("causal", "sliding_window", "prefix_lm", "block_local", "strided", "fixed", "dilated", "random_blocks")


def from_dict(data: dict[str, object]) -> Mask:
    """The mask a :meth:`Mask.to_dict` description stands for.

    The description is read as an expression of the built-in constructors with literal arguments and the
    operators ``&``, ``|``, ``~``; nothing else is evaluated.

    Example::

        >>> from attnkit import masks
        >>> masks.from_dict({"mask": "sliding_window(left=3, right=0, align='bottom_right')"})
        sliding_window(left=3, right=0, align='bottom_right')
    """
    if not isinstance(data, dict) or set(data) != {"mask"} or not isinstance(data["mask"], str):
        raise ValueError(f"masks.from_dict takes a dict {{'mask': str}} as Mask.to_dict gives, got {data!r:.120}")
    text = data["mask"]
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ValueError(f"masks.from_dict: {text!r} is not a mask description (Mask.to_dict)") from None
    return _build(tree, text)


def _build(node: ast.expr, text: str) -> Mask:
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
        a, b = _build(node.left, text), _build(node.right, text)
        return a & b if isinstance(node.op, ast.BitAnd) else a | b
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        return ~_build(node.operand, text)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CONSTRUCTORS:
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except ValueError:
            raise ValueError(
                f"masks.from_dict: {ast.unparse(node)!r} in {text!r} has an argument that is not a literal"
            ) from None
        built: Mask = getattr(_builtins, node.func.id)(*args, **kwargs)
        return built
    raise ValueError(
        f"masks.from_dict: {ast.unparse(node)!r} in {text!r} is not a built-in mask constructor "
        f"({', '.join(_CONSTRUCTORS)}) or &, |, ~ of them"
    )
