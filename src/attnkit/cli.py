"""The ``attnkit`` command.

Subcommands (each takes ``--help``)::

    attnkit explain                         # the first article's worked example, the four steps written out
    attnkit explain --input FILE.json       # your own X, W_q, W_k, W_v
    attnkit explain --softmax 2.0,-1.0,0.5  # one softmax, step by step
    attnkit explain --check FILE.json       # check hand-computed claims; exit 1 if any is wrong
    attnkit masks list                      # the built-in masks and their arguments
    attnkit masks show NAME [ARGS] --len N  # draw a mask with its density
    attnkit doctor [--example NAME] [--plot DIR]  # the attention doctor on models that show each symptom
    attnkit doctor --model FILE.pt          # ... or on your own model
    attnkit demo [--quick]                  # the library at work (what make demo runs)
    attnkit bench [--quick] [--out DIR]     # run the benchmark scripts in benchmarks/
    attnkit distill [--window W] [--out FILE.pt]  # distil a recall model into a smaller or sliding-window student
    attnkit serve MODEL_DIR [--port N]      # an OpenAI-compatible server over the Engine (docs/serving.md)
    attnkit --version

Bad arguments, missing or malformed files and inputs of the wrong shape print one line on stderr and exit
with code 2.

Example::

    >>> from attnkit.cli import main
    >>> main(["explain", "--softmax", "1,1"])
    softmax([1.0, 1.0])
      exp(1.0) = 2.7183
      exp(1.0) = 2.7183
      sum = 2.7183 + 2.7183 = 5.4366
      weights = [2.7183/5.4366, 2.7183/5.4366]
              = [0.5, 0.5]   (sum 1.0)
    0
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Sequence

from . import explain as _explain
from . import masks as _masks

__all__ = ["main"]

EXIT_OK, EXIT_CLAIMS_WRONG, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with the command line or its input files (exit code 2, one line on stderr)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr and exit code 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _require(modules: Sequence[str], *, extra: str, needed_by: str) -> None:
    """Raise a UsageError naming the install command unless every one of ``modules`` imports.

    Checked before any work, so that a missing optional dependency is one line and exit code 2, not a
    traceback after minutes of computing."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UsageError(f"{needed_by} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                         f"not installed: pip install 'attnkit[{extra}]' (or pip install {' '.join(missing)})")


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
        t = _explain.trace(spec["X"], spec["W_q"], spec["W_k"], spec["W_v"], mask=spec.get("mask"),
                           scale=spec.get("scale"))
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
        if inspect.isfunction(obj) and name not in ("from_fn", "from_dense", "from_flex", "from_dict", "selected_blocks",
                                                    "top_k_blocks"):
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
        raise UsageError(f"attnkit masks show: unknown mask {name!r}; choose from {', '.join(builders)} "
                         f"(or write an expression such as 'causal() & sliding_window(3)')")
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
            raise UsageError(f"attnkit masks show: arguments must be literal numbers, lists, strings, True/False "
                             f"or None, got {ast.unparse(node)!r}") from None

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
        raise UsageError(f"attnkit masks show: {ast.unparse(node)!r} is not a built-in mask; expressions combine "
                         f"{', '.join(builders)} with &, | and ~")

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
            raise UsageError(f"attnkit masks show: {flag} {value} is more than the {_MAX_SHOW_LEN} positions it "
                             f"draws (its density is counted element by element); pass a smaller {flag}")
    is_expr = any(c in name for c in "()&|~ ")
    if is_expr and args.args:
        raise UsageError("attnkit masks show: give either NAME with ARGS or one expression in quotes, not both")
    try:
        mask = _build_from_expression(name) if is_expr else _build_from_words(name, args.args)
        kv_len = args.len if args.kv_len is None else args.kv_len
        rows = mask.batch_size()
        if rows > 1 and args.batch >= rows:
            raise UsageError(f"attnkit masks show {name}: --batch {args.batch} is out of range: the mask holds "
                             f"{rows} sequences (0-based: --batch 0 .. {rows - 1})")
        text = mask.show(args.len, kv_len, batch=args.batch, head=args.head, max_width=args.width)
    except (ValueError, TypeError, IndexError) as e:
        raise UsageError(f"attnkit masks show {name}: {e}") from None
    print(text)
    return EXIT_OK


# ------------------------------------------------------------------------------------ doctor


def _load_model(path: str):
    import torch
    if (Path(path) / "config.json").is_file() and (Path(path) / "model.safetensors").is_file():
        from .nn import DecoderLM  # a directory written by DecoderLM.save_pretrained: no unpickling

        try:
            return DecoderLM.from_pretrained(path)
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"{path}: cannot load a DecoderLM from it ({type(e).__name__}: {e})") from None
    p = _existing_file(path)
    try:
        model = torch.load(p, map_location="cpu", weights_only=False)  # a whole module: unpickling runs code
    except Exception as e:  # noqa: BLE001 (any unpickling failure is a bad file for the user)
        raise UsageError(f"{path}: cannot load a model from it ({type(e).__name__}: {e})") from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{path}: holds a {type(model).__name__}, not a torch.nn.Module; save the whole model "
                         f"with torch.save(model, path)")
    return model


def _print_findings(report) -> None:
    """One line per symptom (the layers that show it, the first one's evidence) and its first cause and fix."""
    if report.healthy:
        print("  no findings")
    kinds: dict[str, list] = {}
    for f in report.findings:
        kinds.setdefault(f.kind, []).append(f)
    for kind, fs in kinds.items():
        layers = ", ".join(f.layer or "(model)" for f in fs) if len(fs) <= 3 else \
            f"{len(fs)} layers, {fs[0].layer} to {fs[-1].layer}"
        print(f"  [{kind}] in {layers}; {fs[0].layer or '(model)'}: {fs[0].evidence}")
        print(f"      likely cause: {fs[0].causes[0]}; fix: {fs[0].fixes[0]}")


def _first_embedding(model):
    """``(name, rows)`` of the model's first ``nn.Embedding`` (its token embedding, usually), or None."""
    import torch.nn as nn

    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            return name, m.num_embeddings
    return None


def _model_run(args):
    """``(name, model, token ids (B, L))`` for ``--model``, the ids drawn from the model's vocabulary."""
    import torch

    model = _load_model(args.model)
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "attnkit":
        from .integrations import hf  # a Hugging Face model saved running attnkit attention: the name must exist

        hf.register()
    embedding = _first_embedding(model)
    config_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    vocab = config_vocab or args.vocab
    if vocab is None:
        if embedding is None:
            raise UsageError(f"attnkit doctor: {type(model).__name__} has no config.vocab_size and no embedding; "
                             f"the command feeds random token ids: pass --vocab V if it takes token ids, or run a "
                             f"model that takes other inputs from Python with attnkit.diagnostics.doctor(model, "
                             f"batch, loss_fn=...)")
        raise UsageError(f"attnkit doctor: {type(model).__name__} has no config.vocab_size; pass --vocab V "
                         f"(random token ids are drawn from [0, V)) (its first embedding, {embedding[0]!r}, has "
                         f"{embedding[1]} rows)")
    if config_vocab is None and embedding is not None and args.vocab > embedding[1]:
        raise UsageError(f"attnkit doctor: --vocab {args.vocab} is more than the model's vocabulary: its first "
                         f"embedding, {embedding[0]!r}, has {embedding[1]} rows; pass --vocab {embedding[1]} "
                         f"or less")
    g = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(0, int(vocab), (args.batch_size, args.seq_len), generator=g)
    return args.model, model, batch


def _check_outputs(args) -> None:
    """Refuse, before any work, a --plot that is a file or a --markdown that is a directory, and a --plot
    without matplotlib."""
    if args.plot is not None and Path(args.plot).exists() and not Path(args.plot).is_dir():
        raise UsageError(f"attnkit doctor: --plot {args.plot}: is a file, not a directory (heatmaps are written "
                         f"into the directory DIR)")
    if args.plot is not None:
        _require(["matplotlib"], extra="plot", needed_by="attnkit doctor --plot")
    if args.markdown is not None and Path(args.markdown).is_dir():
        raise UsageError(f"attnkit doctor: --markdown {args.markdown}: is a directory; give a file name such as "
                         f"{Path(args.markdown) / 'doctor.md'}")


def _cmd_doctor(args) -> int:
    from .diagnostics import doctor
    from .diagnostics.examples import EXAMPLES, example

    if args.model is not None and args.example is not None:
        raise UsageError("attnkit doctor: give --model or --example, not both")
    _check_outputs(args)
    if args.model is not None:
        runs = [_model_run(args)]
    else:
        if args.batch_size < 2:
            raise UsageError(f"attnkit doctor: --batch-size {args.batch_size}: the example models take at least 2 "
                             f"sequences (--batch-size 1 works with --model)")
        names = EXAMPLES if args.example in (None, "all") else [args.example]
        runs = [(n, *example(n, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len)) for n in names]
    for name, model, batch in runs:
        try:
            report = doctor(model, batch)
        except (ValueError, TypeError) as e:
            raise UsageError(f"attnkit doctor {name}: {e}") from None
        except (IndexError, RuntimeError) as e:
            if args.model is None:  # a built-in example failing is a bug, not a bad argument
                raise
            first = (str(e).splitlines() or [""])[0]  # the user's model failed on the random batch
            raise UsageError(f"attnkit doctor {name}: the model failed on random token ids of shape "
                             f"{tuple(batch.shape)} ({type(e).__name__}: {first}); check --vocab and --seq-len"
                             ) from None
        if len(runs) > 1:
            print(f"== example {name!r}")
            _print_findings(report)
        else:
            print(f"== {'model ' + name if args.model else 'example ' + repr(name)}")
            print(report)
        try:
            if args.plot:
                folder = Path(args.plot) / name if len(runs) > 1 else Path(args.plot)
                paths = report.plot(folder)
                print(f"  heatmaps: {', '.join(str(p) for p in paths)}")
            if args.markdown:
                target = Path(args.markdown)
                if len(runs) > 1:
                    target = target.with_name(f"{target.stem}-{name}{target.suffix or '.md'}")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(report.to_markdown(f"Attention doctor: {name}"), encoding="utf-8")
                print(f"  report: {target}")
        except OSError as e:
            raise UsageError(f"attnkit doctor: cannot write {e.filename or 'the output'}: {e.strerror or e}") from None
        if len(runs) > 1:
            print()
    return EXIT_OK


# -------------------------------------------------------------------------------------- demo


def _cmd_demo(args) -> int:
    from ._demo import run

    _require(["rich", "matplotlib"], extra="demo", needed_by="attnkit demo")
    return run(args.out, quick=args.quick, seed=args.seed, threads=args.threads)


# ------------------------------------------------------------------------------------- bench


_SOURCE_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"  # a source checkout: <repo>/src/attnkit/cli.py


def _default_bench_dir() -> Path | None:
    for candidate in (Path.cwd() / "benchmarks", _SOURCE_BENCHMARKS):
        if candidate.is_dir():
            return candidate
    return None


def _takes_option(script_text: str, option: str) -> bool:
    """Whether a benchmark script's source names ``option`` as a quoted string (its argparse option)."""
    return re.search(rf"""["']{re.escape(option)}["']""", script_text) is not None


def _cmd_bench(args) -> int:
    folder = Path(args.dir) if args.dir else _default_bench_dir()
    if folder is None or not folder.is_dir():
        if args.dir:
            raise UsageError(f"attnkit bench: --dir {args.dir}: no benchmarks/ folder found there; pass the "
                             f"benchmarks/ folder of an attnkit source checkout")
        raise UsageError("attnkit bench: no benchmarks/ folder found: the benchmark scripts are not part of the "
                         "installed package; get the attnkit source repository, install its peers with "
                         "pip install 'attnkit[bench]', and run attnkit bench from the repository's root (or pass "
                         "--dir PATH/benchmarks)")
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {p.stem for p in scripts}
        if unknown:
            raise UsageError(f"attnkit bench: no benchmark named {', '.join(sorted(unknown))} in {folder} "
                             f"(have {', '.join(p.stem for p in scripts) or 'none'})")
        scripts = [p for p in scripts if p.stem in wanted]
    if not scripts:
        raise UsageError(f"attnkit bench: {folder} holds no benchmark scripts")
    out = Path(args.out or Path("benchmarks") / "results").resolve()  # under the current directory by default
    if out.exists() and not out.is_dir():
        raise UsageError(f"attnkit bench: --out {args.out}: is a file, not a directory (results are written into "
                         f"the directory DIR)")
    failures = 0
    for script in scripts:
        text = script.read_text(encoding="utf-8", errors="replace")
        if args.quick and not _takes_option(text, "--quick"):
            print(f"== {script.name}: skipped (it has no --quick option)\n", flush=True)
            continue
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        if _takes_option(text, "--out"):
            cmd += ["--out", str(out)]
        print(f"== {script.name}: {' '.join(cmd[1:])}", flush=True)
        try:
            rc = subprocess.run(cmd, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"== {script.name}: stopped after {args.timeout} s", flush=True)
            rc = 1
        if rc != 0:
            failures += 1
            print(f"== {script.name}: exit code {rc}", flush=True)
        print(flush=True)
    return EXIT_OK if failures == 0 else EXIT_CLAIMS_WRONG


# ----------------------------------------------------------------------------------- distill


def _distill_teacher(args):
    """``(teacher, what)``: the model in ``--teacher``, or the demo's recall model trained here."""
    import torch

    from ._demo import _recall_model
    from .nn import DecoderLM
    from .nn.tasks import associative_recall, copy_task, train_lm

    if args.teacher is not None:
        model = _load_model(args.teacher)
        if not isinstance(model, DecoderLM):
            raise UsageError(f"attnkit distill: --teacher {args.teacher} holds a {type(model).__name__}; the command "
                             f"takes a saved attnkit.nn.DecoderLM (distil other models from Python with "
                             f"attnkit.distill.distill)")
        if model.config.vocab_size < 32:
            raise UsageError(f"attnkit distill: the teacher's vocab_size={model.config.vocab_size} is below the 32 "
                             f"tokens of the recall task (16 keys, 16 values)")
        return model.eval(), f"{args.teacher}"
    model = _recall_model(args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    warm = min(args.teacher_steps // 3, 400)  # copying forms the induction circuit recall reuses (see the demo)

    def batch(step):
        if step < warm:
            return copy_task(32, length=10, n_symbols=32, distinct=True, generator=g)
        return associative_recall(32, n_pairs=6, n_queries=4, generator=g)

    train_lm(model, batch, steps=args.teacher_steps, lr=5e-3)
    return model.eval(), f"the demo's recall model, trained {args.teacher_steps} steps"


def _recall_reach(batch, window: int) -> float:
    """The share of an associative-recall batch's answers that lie within a sliding window of ``window`` keys:
    a value token at most ``window - 1`` positions before the query, right after a copy of the query's key (the
    key itself may sit just outside: the value's own window holds it).  A model attending within the window
    answers the rest by guessing at best."""
    hit = total = 0
    for row, want in zip(batch.ids.tolist(), batch.targets.tolist()):
        for q, target in enumerate(want):
            if target < 0:
                continue
            total += 1
            hit += any(row[p - 1] == row[q] and row[p] == target for p in range(max(1, q - window + 1), q))
    return hit / max(total, 1)


def _cmd_distill(args) -> int:
    import torch

    from . import masks
    from .distill import DistillConfig, distill, sparse_student
    from .nn import DecoderLM
    from .nn.tasks import associative_recall

    if args.out is not None and Path(args.out).is_dir():
        raise UsageError(f"attnkit distill: --out {args.out}: is a directory; give a file name such as "
                         f"{Path(args.out) / 'student.pt'}")
    args.teacher_steps = args.teacher_steps or (20 if args.quick else 600)
    args.steps = args.steps or (5 if args.quick else 300)
    old = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        teacher, what = _distill_teacher(args)
        cfg = teacher.config
        if args.window is not None:
            student = sparse_student(teacher, masks.sliding_window(args.window - 1))
            kind = f"sliding-window student ({args.window} keys), initialised from the teacher's weights"
        else:
            width = args.width or max(cfg.n_heads, cfg.d_model // 2)
            if width % cfg.n_heads:
                raise UsageError(f"attnkit distill: --width {width} must be a multiple of the teacher's "
                                 f"{cfg.n_heads} heads")
            torch.manual_seed(args.seed + 100)
            student = DecoderLM(cfg.replace(d_model=width, d_head=None, d_ff=None, n_layers=args.layers or cfg.n_layers))
            kind = f"student of width {width} and {student.config.n_layers} layers"
        task = dict(n_pairs=6, n_queries=4)
        held = associative_recall(64 if args.quick else 512, **task, generator=torch.Generator().manual_seed(args.seed + 2))
        g = torch.Generator().manual_seed(args.seed + 3)
        print(f"teacher: {what}; {kind}", flush=True)
        options = DistillConfig(steps=args.steps, progress=not args.no_progress)
        report = distill(teacher, student, lambda step: associative_recall(32, **task, generator=g), options,
                         eval_batch=held)
        print(report)
        if args.window is not None:
            print(f"  the window reaches the answer of {_recall_reach(held, args.window):.1%} of the held-out queries "
                  f"(its pair ends within the last {args.window} tokens): a student attending within it can pass "
                  f"that only by guessing, whatever the teacher does")
        if args.out is not None:
            try:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                torch.save(student, args.out)
            except OSError as e:
                raise UsageError(f"attnkit distill: cannot write {args.out}: {e.strerror or e}") from None
            print(f"wrote the student to {args.out}")
    finally:
        torch.set_num_threads(old)
    return EXIT_OK


# ---------------------------------------------------------------------------------- the parser


def _cmd_serve(args) -> int:
    _require(["starlette", "uvicorn", "transformers"], extra="serve", needed_by="attnkit serve")
    import torch

    from .serve import load_model_dir
    from .serve.app import run_server

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        served = load_model_dir(args.model_dir, name=args.name, dtype=args.dtype, device=args.device)
        batched = "auto" if args.max_batched_tokens is None else args.max_batched_tokens or None
        run_server(served, host=args.host, port=args.port, cache_blocks=args.cache_blocks,
                   block_size=args.block_size, max_batch=args.max_batch, max_batched_tokens=batched,
                   max_waiting=args.max_waiting, log_level=args.log_level,
                   announce=lambda line: print(line, flush=True))
    except ValueError as e:
        raise UsageError(f"attnkit serve: {e}") from None
    return EXIT_OK


def _int_at_least(minimum: int, why: str = ""):
    """An argparse type: an integer of at least ``minimum`` (``why`` says why, after the bound)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"{n} must be >= {minimum}{why}")
        return n

    return parse


_positive = _int_at_least(1)
_at_least_two = _int_at_least(2, " (a row needs two keys to show a weight pattern)")
_nonnegative = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``attnkit`` command (every subcommand has ``--help``)."""
    from . import __version__

    p = _Parser(prog="attnkit", description="attnkit: attention from the textbook to production.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    e = sub.add_parser("explain", help="the four steps of attention worked by hand; check hand computations",
                       description="Without options: the first article's worked example (section 3), every step "
                                   "written out. Exit code 1 when --check finds a wrong claim.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="FILE.json for --input holds X (L x d_model), W_q, W_k (d_model x d_k), W_v "
                              "(d_model x d_v), optional scale and mask\n('causal', or an L x L matrix of 0/1 or "
                              "true/false, true = may attend).\n"
                              "For --check add claims: full matrices under Q, K, V, scores, scaled_scores, "
                              "exp_scores, weights, output,\nor one 0-based row as \"scores[0]\": [...]; each is "
                              "compared at the precision it is written in, against the exact\nvalues and against "
                              "what follows from the claimed previous steps. 'softmax': [{\"scores\": [...], "
                              "\"weights\": [...]}]\nchecks one-row softmax examples (with 'values' and 'output' "
                              "for the weighted sum).")
    e.add_argument("--input", metavar="FILE.json", help="explain your own X, W_q, W_k, W_v")
    e.add_argument("--softmax", metavar="S1,S2,...", help="explain one softmax, e.g. 2.0,-1.0,0.5")
    e.add_argument("--check", metavar="FILE.json", help="check hand-computed claims (exit 1 if any is wrong)")
    e.add_argument("--row", type=_nonnegative, default=0, help="0-based query row to write out (default 0)")
    e.add_argument("--digits", type=_positive, default=4, help="decimals shown (default 4)")
    e.set_defaults(func=_cmd_explain)

    m = sub.add_parser("masks", help="list and draw the built-in masks",
                       description="List the built-in masks or draw one in the terminal with its density.")
    msub = m.add_subparsers(dest="masks_command", metavar="ACTION", parser_class=_Parser)
    ml = msub.add_parser("list", help="the built-in masks and their arguments")
    ml.set_defaults(func=_cmd_masks_list)
    ms = msub.add_parser("show", help="draw a mask: attnkit masks show sliding_window 3 --len 12",
                         description="Draw a built-in mask (█ may attend, · may not) with its density. ARGS are "
                                     "the builder's arguments in order, or name=value (none, true/false, comma "
                                     "lists like 3,5). NAME may also be an expression in quotes, e.g. "
                                     "'causal() & sliding_window(3)'.",
                         epilog="examples: attnkit masks show causal --len 8 | attnkit masks show key_padding "
                                "3,5 --len 6 --batch 1 | attnkit masks show strided 4 causal=false --len 16")
    ms.add_argument("name", metavar="NAME", help="a mask name (see attnkit masks list) or an expression")
    ms.add_argument("args", metavar="ARGS", nargs="*", help="the mask's arguments")
    ms.add_argument("--len", type=_positive, default=16, help="query length (default 16)")
    ms.add_argument("--kv-len", type=_positive, default=None, help="key length (default: --len)")
    ms.add_argument("--batch", type=_nonnegative, default=0, help="batch element to draw (default 0)")
    ms.add_argument("--head", type=_nonnegative, default=0, help="head to draw (default 0)")
    ms.add_argument("--width", type=_positive, default=64, help="widest drawing in characters before tiles "
                                                                "are drawn instead of elements (default 64)")
    ms.set_defaults(func=_cmd_masks_show)
    m.set_defaults(func=_masks_without_action)

    d = sub.add_parser("doctor", help="per-head attention statistics and the article's debugging guide",
                       description="Run the attention doctor: per layer and head the normalised entropy, largest "
                                   "weight, share of saturated rows and gradient norm of the scores, and findings "
                                   "(uniform, sharp, saturated, vanishing_gradient) with likely causes and fixes. "
                                   "Without --model it examines the example models that show each symptom.")
    d.add_argument("--example", choices=["all", "healthy", "uniform", "sharp", "saturated", "vanishing_gradient"],
                   help="one example model (default: all of them, briefly)")
    d.add_argument("--model", metavar="FILE.pt", help="a DecoderLM.save_pretrained directory, or a whole model "
                                                      "saved with torch.save(model, path) (loading that unpickles "
                                                      "it, so only load files you trust)")
    d.add_argument("--vocab", type=_positive, help="vocabulary size for --model without config.vocab_size")
    d.add_argument("--seq-len", type=_at_least_two, default=32,
                   help="tokens per sequence (default 32; at least 2: the doctor measures rows that may attend "
                        "to two or more keys)")
    d.add_argument("--batch-size", type=_positive, default=4,
                   help="sequences (default 4; at least 2 for the example models)")
    d.add_argument("--seed", type=_nonnegative, default=0, help="seed of the example weights and tokens")
    d.add_argument("--plot", metavar="DIR", help="write attention heatmaps (PNG) into DIR (needs matplotlib)")
    d.add_argument("--markdown", metavar="FILE.md", help="write the report as Markdown")
    d.set_defaults(func=_cmd_doctor)

    dm = sub.add_parser("demo", help="the library at work: explain, train, heatmaps, doctor, KV-cache generation",
                        description="What make demo runs (under 3 minutes on 2 CPU cores): the article's example "
                                    "traced and its claims checked; a small DecoderLM trained on associative recall "
                                    "to >= 95% accuracy; attention heatmaps and the doctor's report written to "
                                    "OUT/attention.png and OUT/doctor.md; generation with the KV cache against "
                                    "recomputation. Exit code 1 if the model misses 95% or cached tokens differ.")
    dm.add_argument("--quick", action="store_true", help="a small, fast run (used by the tests; no accuracy target)")
    dm.add_argument("--out", metavar="DIR", default="attnkit-demo", help="output folder (default attnkit-demo)")
    dm.add_argument("--seed", type=_nonnegative, default=0, help="seed of the model and data (default 0)")
    dm.add_argument("--threads", type=_positive, default=1, help="torch threads (default 1: the models are tiny)")
    dm.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="run the benchmark scripts in benchmarks/ and print their tables",
                       description="Runs every benchmarks/*.py (with --quick: at a small size, a few minutes in "
                                   "all; scripts without --quick are skipped) and writes their JSON results into "
                                   "--out. Exit code 1 if a script fails.")
    b.add_argument("--quick", action="store_true", help="small sizes, a few repeats")
    b.add_argument("--out", metavar="DIR", help="folder for the JSON results (default: benchmarks/results under the "
                                                "current directory)")
    b.add_argument("--only", metavar="NAMES", help="comma-separated script names, e.g. dense,model")
    b.add_argument("--dir", metavar="PATH", help="the benchmarks folder (default: ./benchmarks)")
    b.add_argument("--timeout", type=_positive, default=1800, help="seconds per script (default 1800)")
    b.set_defaults(func=_cmd_bench)

    ds = sub.add_parser("distill", help="distil a recall model into a smaller or a sliding-window student",
                        description="Distil a teacher (--teacher FILE.pt, a saved DecoderLM, or the demo's "
                                    "associative-recall model trained here for --teacher-steps) into a student on "
                                    "associative recall (attnkit.distill.distill: logits and attention transfer), "
                                    "and report the losses and both models' held-out accuracy. The student has "
                                    "half the teacher's width (--width, --layers), or with --window W the "
                                    "teacher's own weights attending under a sliding window of W keys.")
    ds.add_argument("--teacher", metavar="FILE.pt", help="a DecoderLM.save_pretrained directory, or a whole "
                                                         "DecoderLM saved with torch.save(model, path) (unpickled: "
                                                         "only load files you trust)")
    ds.add_argument("--teacher-steps", type=_positive, default=None,
                    help="training steps of the built-in teacher (default 600)")
    ds.add_argument("--steps", type=_positive, default=None, help="distillation steps (default 300)")
    ds.add_argument("--width", type=_positive, help="the student's d_model (default: half the teacher's)")
    ds.add_argument("--layers", type=_positive, help="the student's layers (default: the teacher's)")
    ds.add_argument("--window", type=_positive, help="a sliding-window student of W keys from the teacher's weights")
    ds.add_argument("--out", metavar="FILE.pt", help="save the student (torch.save of the whole model)")
    ds.add_argument("--seed", type=_nonnegative, default=0, help="seed of the models and data (default 0)")
    ds.add_argument("--threads", type=_positive, default=1, help="torch threads (default 1: the models are tiny)")
    ds.add_argument("--quick", action="store_true", help="a small, fast run (20 teacher steps, 5 distillation "
                                                         "steps unless given; no accuracy to expect)")
    ds.add_argument("--no-progress", action="store_true", help="no progress bar")
    ds.set_defaults(func=_cmd_distill)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the Engine (needs attnkit[serve])",
                        description="Load a Hugging Face model directory from disk (config.json, safetensors weights, "
                                    "tokenizer files; a family attnkit.integrations.hf.from_hf converts), and serve "
                                    "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health "
                                    "and GET /metrics until Ctrl-C (see docs/serving.md).")
    sv.add_argument("model_dir", metavar="MODEL_DIR", help="the model folder (nothing is downloaded)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                        "only; 0.0.0.0 opens it to the network)")
    sv.add_argument("--port", type=_nonnegative, default=8000, help="TCP port (default 8000; 0: a free one)")
    sv.add_argument("--name", help="the model id clients send (default: the folder's name)")
    sv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
                    help="weights and KV cache dtype (default float32)")
    sv.add_argument("--device", default="cpu", help="torch device (default cpu)")
    sv.add_argument("--cache-blocks", type=_positive, default=512, help="KV blocks in the pool (default 512)")
    sv.add_argument("--block-size", type=_positive, default=16, help="positions per KV block (default 16)")
    sv.add_argument("--max-batch", type=_positive, default=16, help="most requests decoded together (default 16)")
    sv.add_argument("--max-batched-tokens", type=_nonnegative, default=None,
                    help="the most tokens in one step: a decode token of every running request, then chunks of "
                         "the prompts admitted, in one forward (default 512, or --max-batch if larger; 0: each "
                         "prompt prefilled alone before the decode step)")
    sv.add_argument("--max-waiting", type=_nonnegative, default=256,
                    help="most requests waiting for a slot; more are answered 503 (default 256)")
    sv.add_argument("--threads", type=_positive, default=None, help="torch threads (default: torch's)")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="server log level (default info; debug logs every request)")
    sv.set_defaults(func=_cmd_serve)
    return p


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--softmax -1,2`` -> ``--softmax=-1,2`` (argparse would take ``-1,2`` for an option)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--softmax" and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1][1:2] in \
                set("0123456789.i"):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnkit`` command with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(_join_negative_values(argv))
        if getattr(args, "func", None) is None:
            parser.print_help()
            return EXIT_OK
        return args.func(args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else EXIT_OK
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly, as other commands do
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the interpreter's final flush)
        return EXIT_OK
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
