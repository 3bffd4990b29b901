"""``attnkit explain`` and ``attnkit masks``."""

from __future__ import annotations

import ast
import inspect
import json
import math
import textwrap
from pathlib import Path
from typing import Sequence

from .. import explain as _explain
from .. import masks as _masks
from ._common import EXIT_CLAIMS_WRONG, EXIT_OK, UsageError


# ----------------------------------------------------------------------------------- explain


def _existing_file(path: str) -> Path:
    """``path`` as a Path when it names a file; a UsageError saying what it is otherwise."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{path}: is a directory, not a file")
    if not p.is_file():
        raise UsageError(f"{path}: no such file")
    return p


def _read_json(path: str, *, keep_written: bool = False) -> dict:
    p = _existing_file(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read it ({e})") from None
    try:
        data = _explain.load_claims(text) if keep_written else json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object with keys X, W_q, W_k, W_v, got {type(data).__name__}")
    return data


def _parse_numbers(text: str, what: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            x = float(part)
        except ValueError:
            raise UsageError(f"{what}: {part!r} is not a number (write e.g. 2.0,-1.0,0.5)") from None
        if math.isnan(x) or x == math.inf:
            raise UsageError(f"{what}: {part!r} is not allowed (scores are finite numbers or -inf for masked)")
        out.append(x)
    return out


def _cmd_explain(args) -> int:
    chosen = [a for a in ("input", "softmax", "check") if getattr(args, a) is not None]
    if len(chosen) > 1:
        raise UsageError(f"attnkit explain: give at most one of --input, --softmax, --check (got {', '.join(chosen)})")
    if args.softmax is not None:
        print(_explain.explain_softmax(_parse_numbers(args.softmax, "--softmax"), digits=args.digits))
        return EXIT_OK
    if args.check is not None:
        spec = _read_json(args.check, keep_written=True)
        try:
            report = _explain.check(spec)
        except (ValueError, TypeError) as e:
            raise UsageError(f"{args.check}: {e}") from None
        print(report)
        return EXIT_OK if report.ok else EXIT_CLAIMS_WRONG
    if args.input is not None:
        spec = _read_json(args.input)
        missing = [k for k in ("X", "W_q", "W_k", "W_v") if k not in spec]
        if missing:
            raise UsageError(f"{args.input}: missing key(s) {', '.join(missing)} (need X, W_q, W_k, W_v)")
        where = f"{args.input}: "
        header = ""
    else:
        spec, where = _explain.ARTICLE, ""
        header = "The worked example of the first article (section 3): three tokens, d_model=4, d_k=2.\n\n"
    try:
        t = _explain.trace(
            spec["X"], spec["W_q"], spec["W_k"], spec["W_v"], mask=spec.get("mask"), scale=spec.get("scale")
        )
        t.digits = args.digits
        text = t.explain(args.row)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{where}{e}") from None
    print(header + text)
    return EXIT_OK


# ------------------------------------------------------------------------------------- masks


def _mask_builders() -> dict:
    """Every public mask builder in attnkit.masks (functions returning a Mask) except from_fn/from_dense/from_flex/
    from_dict and selected_blocks/top_k_blocks (they take Python objects or tensors computed from data, not words)."""
    out = {}
    for name in _masks.__all__:
        obj = getattr(_masks, name)
        if inspect.isfunction(obj) and name not in (
            "from_fn",
            "from_dense",
            "from_flex",
            "from_dict",
            "selected_blocks",
            "top_k_blocks",
        ):
            out[name] = obj
    return out


def _signature_text(name: str, fn) -> str:
    parts = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind == p.KEYWORD_ONLY:
            parts.append(f"[{p.name}={p.default!r}]")
        elif p.default is p.empty:
            parts.append(p.name.upper())
        else:
            parts.append(f"[{p.name.upper()}={p.default!r}]")
    return f"{name} {' '.join(parts)}".strip()


def _word_value(text: str):
    """A command-line word as a mask argument: int, float, None, bool, a comma list, or a string."""
    low = text.strip().lower()
    if low == "none":
        return None
    if low in ("true", "false"):
        return low == "true"
    if "," in text:
        return [_word_value(t) for t in text.split(",") if t.strip()]
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _build_from_words(name: str, words: Sequence[str]):
    builders = _mask_builders()
    if name not in builders:
        raise UsageError(
            f"attnkit masks show: unknown mask {name!r}; choose from {', '.join(builders)} "
            f"(or write an expression such as 'causal() & sliding_window(3)')"
        )
    fn = builders[name]
    args, kwargs = [], {}
    for w in words:
        if "=" in w:
            k, v = w.split("=", 1)
            kwargs[k.strip()] = _word_value(v)
        else:
            args.append(_word_value(w))
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise UsageError(f"attnkit masks show {name}: {e}; usage: {_signature_text(name, fn)}") from None
    return fn(*args, **kwargs)


_AST_OPS = {ast.BitAnd: "__and__", ast.BitOr: "__or__"}


def _build_from_expression(text: str):
    """A mask from a safe expression: builder calls with literal arguments combined by &, | and ~."""
    builders = _mask_builders()
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise UsageError(f"attnkit masks show: cannot parse {text!r} ({e.msg})") from None

    def literal(node):
        try:
            return ast.literal_eval(node)
        except ValueError:
            raise UsageError(
                f"attnkit masks show: arguments must be literal numbers, lists, strings, True/False "
                f"or None, got {ast.unparse(node)!r}"
            ) from None

    def build(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            return getattr(build(node.left), _AST_OPS[type(node.op)])(build(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
            return ~build(node.operand)
        if isinstance(node, ast.Name) and node.id in builders:
            return builders[node.id]()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in builders:
            args = [literal(a) for a in node.args]
            kwargs = {k.arg: literal(k.value) for k in node.keywords if k.arg is not None}
            return builders[node.func.id](*args, **kwargs)
        raise UsageError(
            f"attnkit masks show: {ast.unparse(node)!r} is not a built-in mask; expressions combine "
            f"{', '.join(builders)} with &, | and ~"
        )

    return build(tree.body)


def _masks_without_action(args) -> int:
    raise UsageError("attnkit masks: choose an action, list or show (see attnkit masks --help)")


def _cmd_masks_list(args) -> int:
    print("Built-in masks (attnkit.masks); draw one with: attnkit masks show NAME [ARGS] --len N")
    for name, fn in _mask_builders().items():
        doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
        print(f"  {_signature_text(name, fn)}")
        print(textwrap.fill(doc, width=100, initial_indent="      ", subsequent_indent="      "))
    return EXIT_OK


_MAX_SHOW_LEN = 16384  # show() counts the density element by element: beyond this it takes minutes


def _cmd_masks_show(args) -> int:
    name = args.name
    for flag, value in (("--len", args.len), ("--kv-len", args.kv_len)):
        if value is not None and value > _MAX_SHOW_LEN:
            raise UsageError(
                f"attnkit masks show: {flag} {value} is more than the {_MAX_SHOW_LEN} positions it "
                f"draws (its density is counted element by element); pass a smaller {flag}"
            )
    is_expr = any(c in name for c in "()&|~ ")
    if is_expr and args.args:
        raise UsageError("attnkit masks show: give either NAME with ARGS or one expression in quotes, not both")
    try:
        mask = _build_from_expression(name) if is_expr else _build_from_words(name, args.args)
        kv_len = args.len if args.kv_len is None else args.kv_len
        rows = mask.batch_size()
        if rows > 1 and args.batch >= rows:
            raise UsageError(
                f"attnkit masks show {name}: --batch {args.batch} is out of range: the mask holds "
                f"{rows} sequences (0-based: --batch 0 .. {rows - 1})"
            )
        text = mask.show(args.len, kv_len, batch=args.batch, head=args.head, max_width=args.width)
    except (ValueError, TypeError, IndexError) as e:
        raise UsageError(f"attnkit masks show {name}: {e}") from None
    print(text)
    return EXIT_OK
