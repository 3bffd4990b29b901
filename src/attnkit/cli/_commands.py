"""``attnkit doctor``, ``demo``, ``bench``, ``distill`` and ``serve``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ._common import EXIT_CLAIMS_WRONG, EXIT_OK, UsageError, _require
from ._explain_masks import _existing_file


# ------------------------------------------------------------------------------------ doctor


def _load_model(path: str):
    import torch

    if (Path(path) / "config.json").is_file() and (Path(path) / "model.safetensors").is_file():
        from ..nn import DecoderLM  # a directory written by DecoderLM.save_pretrained: no unpickling

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
        raise UsageError(
            f"{path}: holds a {type(model).__name__}, not a torch.nn.Module; save the whole model "
            f"with torch.save(model, path)"
        )
    return model


def _print_findings(report) -> None:
    """One line per symptom (the layers that show it, the first one's evidence) and its first cause and fix."""
    if report.healthy:
        print("  no findings")
    kinds: dict[str, list] = {}
    for f in report.findings:
        kinds.setdefault(f.kind, []).append(f)
    for kind, fs in kinds.items():
        layers = (
            ", ".join(f.layer or "(model)" for f in fs)
            if len(fs) <= 3
            else f"{len(fs)} layers, {fs[0].layer} to {fs[-1].layer}"
        )
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
        from ..integrations import hf  # a Hugging Face model saved running attnkit attention: the name must exist

        hf.register()
    embedding = _first_embedding(model)
    config_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    vocab = config_vocab or args.vocab
    if vocab is None:
        if embedding is None:
            raise UsageError(
                f"attnkit doctor: {type(model).__name__} has no config.vocab_size and no embedding; "
                f"the command feeds random token ids: pass --vocab V if it takes token ids, or run a "
                f"model that takes other inputs from Python with attnkit.diagnostics.doctor(model, "
                f"batch, loss_fn=...)"
            )
        raise UsageError(
            f"attnkit doctor: {type(model).__name__} has no config.vocab_size; pass --vocab V "
            f"(random token ids are drawn from [0, V)) (its first embedding, {embedding[0]!r}, has "
            f"{embedding[1]} rows)"
        )
    if config_vocab is None and embedding is not None and args.vocab > embedding[1]:
        raise UsageError(
            f"attnkit doctor: --vocab {args.vocab} is more than the model's vocabulary: its first "
            f"embedding, {embedding[0]!r}, has {embedding[1]} rows; pass --vocab {embedding[1]} "
            f"or less"
        )
    g = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(0, int(vocab), (args.batch_size, args.seq_len), generator=g)
    return args.model, model, batch


def _check_outputs(args) -> None:
    """Refuse, before any work, a --plot that is a file or a --markdown that is a directory, and a --plot
    without matplotlib."""
    if args.plot is not None and Path(args.plot).exists() and not Path(args.plot).is_dir():
        raise UsageError(
            f"attnkit doctor: --plot {args.plot}: is a file, not a directory (heatmaps are written "
            f"into the directory DIR)"
        )
    if args.plot is not None:
        _require(["matplotlib"], extra="plot", needed_by="attnkit doctor --plot")
    if args.markdown is not None and Path(args.markdown).is_dir():
        raise UsageError(
            f"attnkit doctor: --markdown {args.markdown}: is a directory; give a file name such as "
            f"{Path(args.markdown) / 'doctor.md'}"
        )


def _cmd_doctor(args) -> int:
    from ..diagnostics import doctor
    from ..diagnostics.examples import EXAMPLES, example

    if args.model is not None and args.example is not None:
        raise UsageError("attnkit doctor: give --model or --example, not both")
    _check_outputs(args)
    if args.model is not None:
        runs = [_model_run(args)]
    else:
        if args.batch_size < 2:
            raise UsageError(
                f"attnkit doctor: --batch-size {args.batch_size}: the example models take at least 2 "
                f"sequences (--batch-size 1 works with --model)"
            )
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
            raise UsageError(
                f"attnkit doctor {name}: the model failed on random token ids of shape "
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
    from .._demo import run

    _require(["rich", "matplotlib"], extra="demo", needed_by="attnkit demo")
    return run(args.out, quick=args.quick, seed=args.seed, threads=args.threads)


# ------------------------------------------------------------------------------------- bench


_SOURCE_BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"  # source checkout: <repo>/src/attnkit/cli/


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
            raise UsageError(
                f"attnkit bench: --dir {args.dir}: no benchmarks/ folder found there; pass the "
                f"benchmarks/ folder of an attnkit source checkout"
            )
        raise UsageError(
            "attnkit bench: no benchmarks/ folder found: the benchmark scripts are not part of the "
            "installed package; get the attnkit source repository, install its peers with "
            "pip install 'attnkit[bench]', and run attnkit bench from the repository's root (or pass "
            "--dir PATH/benchmarks)"
        )
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {p.stem for p in scripts}
        if unknown:
            raise UsageError(
                f"attnkit bench: no benchmark named {', '.join(sorted(unknown))} in {folder} "
                f"(have {', '.join(p.stem for p in scripts) or 'none'})"
            )
        scripts = [p for p in scripts if p.stem in wanted]
    if not scripts:
        raise UsageError(f"attnkit bench: {folder} holds no benchmark scripts")
    out = Path(args.out or Path("benchmarks") / "results").resolve()  # under the current directory by default
    if out.exists() and not out.is_dir():
        raise UsageError(
            f"attnkit bench: --out {args.out}: is a file, not a directory (results are written into the directory DIR)"
        )
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

    from .._demo import _recall_model
    from ..nn import DecoderLM
    from ..nn.tasks import associative_recall, copy_task, train_lm

    if args.teacher is not None:
        model = _load_model(args.teacher)
        if not isinstance(model, DecoderLM):
            raise UsageError(
                f"attnkit distill: --teacher {args.teacher} holds a {type(model).__name__}; the command "
                f"takes a saved attnkit.nn.DecoderLM (distil other models from Python with "
                f"attnkit.distill.distill)"
            )
        if model.config.vocab_size < 32:
            raise UsageError(
                f"attnkit distill: the teacher's vocab_size={model.config.vocab_size} is below the 32 "
                f"tokens of the recall task (16 keys, 16 values)"
            )
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

    from .. import masks
    from ..distill import DistillConfig, distill, sparse_student
    from ..nn import DecoderLM
    from ..nn.tasks import associative_recall

    if args.out is not None and Path(args.out).is_dir():
        raise UsageError(
            f"attnkit distill: --out {args.out}: is a directory; give a file name such as "
            f"{Path(args.out) / 'student.pt'}"
        )
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
                raise UsageError(
                    f"attnkit distill: --width {width} must be a multiple of the teacher's {cfg.n_heads} heads"
                )
            torch.manual_seed(args.seed + 100)
            student = DecoderLM(
                cfg.replace(d_model=width, d_head=None, d_ff=None, n_layers=args.layers or cfg.n_layers)
            )
            kind = f"student of width {width} and {student.config.n_layers} layers"
        task = dict(n_pairs=6, n_queries=4)
        held = associative_recall(
            64 if args.quick else 512, **task, generator=torch.Generator().manual_seed(args.seed + 2)
        )
        g = torch.Generator().manual_seed(args.seed + 3)
        print(f"teacher: {what}; {kind}", flush=True)
        options = DistillConfig(steps=args.steps, progress=not args.no_progress)
        report = distill(
            teacher, student, lambda step: associative_recall(32, **task, generator=g), options, eval_batch=held
        )
        print(report)
        if args.window is not None:
            print(
                f"  the window reaches the answer of {_recall_reach(held, args.window):.1%} of the held-out queries "
                f"(its pair ends within the last {args.window} tokens): a student attending within it can pass "
                f"that only by guessing, whatever the teacher does"
            )
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

    from ..serve import load_model_dir
    from ..serve.app import run_server

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        served = load_model_dir(args.model_dir, name=args.name, dtype=args.dtype, device=args.device)
        batched = "auto" if args.max_batched_tokens is None else args.max_batched_tokens or None
        run_server(
            served,
            host=args.host,
            port=args.port,
            cache_blocks=args.cache_blocks,
            block_size=args.block_size,
            max_batch=args.max_batch,
            max_batched_tokens=batched,
            max_waiting=args.max_waiting,
            log_level=args.log_level,
            announce=lambda line: print(line, flush=True),
        )
    except ValueError as e:
        raise UsageError(f"attnkit serve: {e}") from None
    return EXIT_OK
