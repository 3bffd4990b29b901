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
import sys
from typing import Sequence

from ._commands import _cmd_bench, _cmd_demo, _cmd_distill, _cmd_doctor, _cmd_serve
from ._commands import _load_model as _load_model
from ._commands import _recall_reach as _recall_reach
from ._commands import _takes_option as _takes_option
from ._common import EXIT_OK, EXIT_USAGE, UsageError, _Parser
from ._explain_masks import _cmd_explain, _cmd_masks_list, _cmd_masks_show, _masks_without_action
from ._explain_masks import _mask_builders as _mask_builders

__all__ = ["main"]


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
    from .. import __version__

    p = _Parser(
        prog="attnkit",
        description="attnkit: attention from the textbook to production.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    e = sub.add_parser(
        "explain",
        help="the four steps of attention worked by hand; check hand computations",
        description="Without options: the first article's worked example (section 3), every step "
        "written out. Exit code 1 when --check finds a wrong claim.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="FILE.json for --input holds X (L x d_model), W_q, W_k (d_model x d_k), W_v "
        "(d_model x d_v), optional scale and mask\n('causal', or an L x L matrix of 0/1 or "
        "true/false, true = may attend).\n"
        "For --check add claims: full matrices under Q, K, V, scores, scaled_scores, "
        'exp_scores, weights, output,\nor one 0-based row as "scores[0]": [...]; each is '
        "compared at the precision it is written in, against the exact\nvalues and against "
        "what follows from the claimed previous steps. 'softmax': [{\"scores\": [...], "
        "\"weights\": [...]}]\nchecks one-row softmax examples (with 'values' and 'output' "
        "for the weighted sum).",
    )
    e.add_argument("--input", metavar="FILE.json", help="explain your own X, W_q, W_k, W_v")
    e.add_argument("--softmax", metavar="S1,S2,...", help="explain one softmax, e.g. 2.0,-1.0,0.5")
    e.add_argument("--check", metavar="FILE.json", help="check hand-computed claims (exit 1 if any is wrong)")
    e.add_argument("--row", type=_nonnegative, default=0, help="0-based query row to write out (default 0)")
    e.add_argument("--digits", type=_positive, default=4, help="decimals shown (default 4)")
    e.set_defaults(func=_cmd_explain)

    m = sub.add_parser(
        "masks",
        help="list and draw the built-in masks",
        description="List the built-in masks or draw one in the terminal with its density.",
    )
    msub = m.add_subparsers(dest="masks_command", metavar="ACTION", parser_class=_Parser)
    ml = msub.add_parser("list", help="the built-in masks and their arguments")
    ml.set_defaults(func=_cmd_masks_list)
    ms = msub.add_parser(
        "show",
        help="draw a mask: attnkit masks show sliding_window 3 --len 12",
        description="Draw a built-in mask (█ may attend, · may not) with its density. ARGS are "
        "the builder's arguments in order, or name=value (none, true/false, comma "
        "lists like 3,5). NAME may also be an expression in quotes, e.g. "
        "'causal() & sliding_window(3)'.",
        epilog="examples: attnkit masks show causal --len 8 | attnkit masks show key_padding "
        "3,5 --len 6 --batch 1 | attnkit masks show strided 4 causal=false --len 16",
    )
    ms.add_argument("name", metavar="NAME", help="a mask name (see attnkit masks list) or an expression")
    ms.add_argument("args", metavar="ARGS", nargs="*", help="the mask's arguments")
    ms.add_argument("--len", type=_positive, default=16, help="query length (default 16)")
    ms.add_argument("--kv-len", type=_positive, default=None, help="key length (default: --len)")
    ms.add_argument("--batch", type=_nonnegative, default=0, help="batch element to draw (default 0)")
    ms.add_argument("--head", type=_nonnegative, default=0, help="head to draw (default 0)")
    ms.add_argument(
        "--width",
        type=_positive,
        default=64,
        help="widest drawing in characters before tiles are drawn instead of elements (default 64)",
    )
    ms.set_defaults(func=_cmd_masks_show)
    m.set_defaults(func=_masks_without_action)

    d = sub.add_parser(
        "doctor",
        help="per-head attention statistics and the article's debugging guide",
        description="Run the attention doctor: per layer and head the normalised entropy, largest "
        "weight, share of saturated rows and gradient norm of the scores, and findings "
        "(uniform, sharp, saturated, vanishing_gradient) with likely causes and fixes. "
        "Without --model it examines the example models that show each symptom.",
    )
    d.add_argument(
        "--example",
        choices=["all", "healthy", "uniform", "sharp", "saturated", "vanishing_gradient"],
        help="one example model (default: all of them, briefly)",
    )
    d.add_argument(
        "--model",
        metavar="FILE.pt",
        help="a DecoderLM.save_pretrained directory, or a whole model "
        "saved with torch.save(model, path) (loading that unpickles "
        "it, so only load files you trust)",
    )
    d.add_argument("--vocab", type=_positive, help="vocabulary size for --model without config.vocab_size")
    d.add_argument(
        "--seq-len",
        type=_at_least_two,
        default=32,
        help="tokens per sequence (default 32; at least 2: the doctor measures rows that may attend "
        "to two or more keys)",
    )
    d.add_argument(
        "--batch-size", type=_positive, default=4, help="sequences (default 4; at least 2 for the example models)"
    )
    d.add_argument("--seed", type=_nonnegative, default=0, help="seed of the example weights and tokens")
    d.add_argument("--plot", metavar="DIR", help="write attention heatmaps (PNG) into DIR (needs matplotlib)")
    d.add_argument("--markdown", metavar="FILE.md", help="write the report as Markdown")
    d.set_defaults(func=_cmd_doctor)

    dm = sub.add_parser(
        "demo",
        help="the library at work: explain, train, heatmaps, doctor, KV-cache generation",
        description="What make demo runs (under 3 minutes on 2 CPU cores): the article's example "
        "traced and its claims checked; a small DecoderLM trained on associative recall "
        "to >= 95% accuracy; attention heatmaps and the doctor's report written to "
        "OUT/attention.png and OUT/doctor.md; generation with the KV cache against "
        "recomputation. Exit code 1 if the model misses 95% or cached tokens differ.",
    )
    dm.add_argument("--quick", action="store_true", help="a small, fast run (used by the tests; no accuracy target)")
    dm.add_argument("--out", metavar="DIR", default="attnkit-demo", help="output folder (default attnkit-demo)")
    dm.add_argument("--seed", type=_nonnegative, default=0, help="seed of the model and data (default 0)")
    dm.add_argument("--threads", type=_positive, default=1, help="torch threads (default 1: the models are tiny)")
    dm.set_defaults(func=_cmd_demo)

    b = sub.add_parser(
        "bench",
        help="run the benchmark scripts in benchmarks/ and print their tables",
        description="Runs every benchmarks/*.py (with --quick: at a small size, a few minutes in "
        "all; scripts without --quick are skipped) and writes their JSON results into "
        "--out. Exit code 1 if a script fails.",
    )
    b.add_argument("--quick", action="store_true", help="small sizes, a few repeats")
    b.add_argument(
        "--out",
        metavar="DIR",
        help="folder for the JSON results (default: benchmarks/results under the current directory)",
    )
    b.add_argument("--only", metavar="NAMES", help="comma-separated script names, e.g. dense,model")
    b.add_argument("--dir", metavar="PATH", help="the benchmarks folder (default: ./benchmarks)")
    b.add_argument("--timeout", type=_positive, default=1800, help="seconds per script (default 1800)")
    b.set_defaults(func=_cmd_bench)

    ds = sub.add_parser(
        "distill",
        help="distil a recall model into a smaller or a sliding-window student",
        description="Distil a teacher (--teacher FILE.pt, a saved DecoderLM, or the demo's "
        "associative-recall model trained here for --teacher-steps) into a student on "
        "associative recall (attnkit.distill.distill: logits and attention transfer), "
        "and report the losses and both models' held-out accuracy. The student has "
        "half the teacher's width (--width, --layers), or with --window W the "
        "teacher's own weights attending under a sliding window of W keys.",
    )
    ds.add_argument(
        "--teacher",
        metavar="FILE.pt",
        help="a DecoderLM.save_pretrained directory, or a whole "
        "DecoderLM saved with torch.save(model, path) (unpickled: "
        "only load files you trust)",
    )
    ds.add_argument(
        "--teacher-steps", type=_positive, default=None, help="training steps of the built-in teacher (default 600)"
    )
    ds.add_argument("--steps", type=_positive, default=None, help="distillation steps (default 300)")
    ds.add_argument("--width", type=_positive, help="the student's d_model (default: half the teacher's)")
    ds.add_argument("--layers", type=_positive, help="the student's layers (default: the teacher's)")
    ds.add_argument("--window", type=_positive, help="a sliding-window student of W keys from the teacher's weights")
    ds.add_argument("--out", metavar="FILE.pt", help="save the student (torch.save of the whole model)")
    ds.add_argument("--seed", type=_nonnegative, default=0, help="seed of the models and data (default 0)")
    ds.add_argument("--threads", type=_positive, default=1, help="torch threads (default 1: the models are tiny)")
    ds.add_argument(
        "--quick",
        action="store_true",
        help="a small, fast run (20 teacher steps, 5 distillation steps unless given; no accuracy to expect)",
    )
    ds.add_argument("--no-progress", action="store_true", help="no progress bar")
    ds.set_defaults(func=_cmd_distill)

    sv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the Engine (needs attnkit[serve])",
        description="Load a Hugging Face model directory from disk (config.json, safetensors weights, "
        "tokenizer files; a family attnkit.integrations.hf.from_hf converts), and serve "
        "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health "
        "and GET /metrics until Ctrl-C (see docs/serving.md).",
    )
    sv.add_argument("model_dir", metavar="MODEL_DIR", help="the model folder (nothing is downloaded)")
    sv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)",
    )
    sv.add_argument("--port", type=_nonnegative, default=8000, help="TCP port (default 8000; 0: a free one)")
    sv.add_argument("--name", help="the model id clients send (default: the folder's name)")
    sv.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "float64"],
        help="weights and KV cache dtype (default float32)",
    )
    sv.add_argument("--device", default="cpu", help="torch device (default cpu)")
    sv.add_argument("--cache-blocks", type=_positive, default=512, help="KV blocks in the pool (default 512)")
    sv.add_argument("--block-size", type=_positive, default=16, help="positions per KV block (default 16)")
    sv.add_argument("--max-batch", type=_positive, default=16, help="most requests decoded together (default 16)")
    sv.add_argument(
        "--max-batched-tokens",
        type=_nonnegative,
        default=None,
        help="the most tokens in one step: a decode token of every running request, then chunks of "
        "the prompts admitted, in one forward (default 512, or --max-batch if larger; 0: each "
        "prompt prefilled alone before the decode step)",
    )
    sv.add_argument(
        "--max-waiting",
        type=_nonnegative,
        default=256,
        help="most requests waiting for a slot; more are answered 503 (default 256)",
    )
    sv.add_argument("--threads", type=_positive, default=None, help="torch threads (default: torch's)")
    sv.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level (default info; debug logs every request)",
    )
    sv.set_defaults(func=_cmd_serve)
    return p


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--softmax -1,2`` -> ``--softmax=-1,2`` (argparse would take ``-1,2`` for an option)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if (
            a == "--softmax"
            and i + 1 < len(argv)
            and argv[i + 1].startswith("-")
            and argv[i + 1][1:2] in set("0123456789.i")
        ):
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
