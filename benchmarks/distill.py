"""Distillation on associative recall: a smaller student, and a sliding-window student of a dense teacher.

One process, generated data (attnkit.nn.tasks), every model trained here:

1. **Teacher.** The demo's recall model (DecoderLM, 2 layers x 4 heads, d_model 64, ALiBi), trained as the demo
   trains it (copying warm-up, then recall) to >= 95% held-out accuracy.
2. **Smaller student.** The same architecture at half the width (d_model 32, 4 heads of 8).  Two copies from one
   initialisation see the same recall batches for N steps with the same optimiser (AdamW, warm-up, cosine):
   one distilled (``attnkit.distill.distill``: logits at T=2, attention transfer head by head and MiniLMv2
   q/k/v relations, weights 1/10/10), one trained from scratch on
   the targets (``attnkit.nn.tasks.train_lm``).  Both accuracy curves are printed.
3. **Dense to sparse.** Four recall episodes back to back (80 tokens; a key recurs across episodes with other
   values, so the answer is the latest occurrence's value).  The teacher is fine-tuned densely on them; the
   student is ``sparse_student(teacher, masks.sliding_window(19))``: each query sees 20 keys, 25% of the 80.
   Accuracy before and after distillation, and forward times of both models (interleaved medians) at 80
   tokens and at a long length.

    python benchmarks/distill.py            # N = 400 distillation steps
    python benchmarks/distill.py --quick    # smaller: fewer steps, smaller evaluation sets
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import OUT_HELP, machine, save, table, timeit

from attnkit import masks
from attnkit.distill import distill, sparse_student
from attnkit.nn import DecoderConfig, DecoderLM
from attnkit.nn.tasks import TaskBatch, accuracy, associative_recall, copy_task, train_lm

TASK = dict(n_pairs=6, n_queries=4)  # the demo's recall task: 20 tokens, 16 keys, 16 values
VOCAB = 33  # 32 recall tokens and the copy task's separator
WEIGHTS = {"logits": 1.0, "attention": 10.0, "relations": 10.0}  # the smaller student's loss weights


def recall_model(d_model: int, seed: int) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(
        DecoderConfig(
            vocab_size=VOCAB,
            d_model=d_model,
            n_layers=2,
            n_heads=4,
            max_seq_len=64,
            positions="alibi",
            tie_embeddings=False,
        )
    )


def evaluate(model, batch: TaskBatch) -> float:
    was = model.training
    model.eval()
    with torch.no_grad():
        acc = accuracy(model(batch.ids), batch.targets)
    model.train(was)
    return acc


def train_teacher(seed: int, max_steps: int, held_out: TaskBatch, goal: float = 0.98) -> tuple[DecoderLM, int]:
    """The demo's recipe: copying (10 distinct symbols) until 95% held-out copy accuracy, then recall until
    ``goal`` held-out accuracy (or ``max_steps``)."""
    model = recall_model(64, seed)
    g = torch.Generator().manual_seed(seed + 1)
    copy_check = copy_task(256, length=10, n_symbols=32, distinct=True, generator=torch.Generator().manual_seed(9))
    state = {"phase": "copy"}

    def make_batch(step):
        if state["phase"] == "copy":
            return copy_task(32, length=10, n_symbols=32, distinct=True, generator=g)
        return associative_recall(32, **TASK, generator=g)

    def on_step(step, loss):
        if (step + 1) % 25:
            return False
        if state["phase"] == "copy":
            if evaluate(model, copy_check) >= 0.95 or step + 1 >= 400:
                state["phase"] = "recall"
            return False
        return evaluate(model, held_out) >= goal

    losses = train_lm(model, make_batch, steps=max_steps, lr=5e-3, on_step=on_step)
    return model.eval(), len(losses)


def episodes(batch: int, n: int, generator) -> TaskBatch:
    """``n`` recall sequences back to back: ``(batch, 20 n)``."""
    parts = [associative_recall(batch, **TASK, generator=generator) for _ in range(n)]
    return TaskBatch(torch.cat([p.ids for p in parts], 1), torch.cat([p.targets for p in parts], 1), VOCAB)


def smaller_student(teacher, steps: int, eval_every: int, held_out: TaskBatch, seed: int) -> dict:
    base = recall_model(32, seed + 100)
    distilled, scratch = copy.deepcopy(base), copy.deepcopy(base)
    batches = [
        associative_recall(32, **TASK, generator=torch.Generator().manual_seed(seed + 1000 + s)) for s in range(steps)
    ]
    t0 = time.perf_counter()
    report = distill(
        teacher,
        distilled,
        lambda step: batches[step],
        steps=steps,
        lr=5e-3,
        eval_batch=held_out,
        eval_every=eval_every,
        progress=False,
        heads="map",
        weights=WEIGHTS,
    )
    t_distill = time.perf_counter() - t0
    curve_scratch = []

    def on_step(step, loss):
        if (step + 1) % eval_every == 0:
            curve_scratch.append((step + 1, evaluate(scratch, held_out)))
        return False

    t0 = time.perf_counter()
    train_lm(scratch, lambda step: batches[step], steps=steps, lr=5e-3, on_step=on_step)
    t_scratch = time.perf_counter() - t0
    return dict(
        report=report,
        curve_distilled=report.curve,
        curve_scratch=curve_scratch,
        distilled=evaluate(distilled, held_out),
        scratch=evaluate(scratch, held_out),
        seconds_distill=t_distill,
        seconds_scratch=t_scratch,
        params_teacher=sum(p.numel() for p in teacher.parameters()),
        params_student=sum(p.numel() for p in base.parameters()),
    )


def dense_to_sparse(
    teacher, finetune_steps: int, steps: int, test: TaskBatch, seed: int, long_len: int, budget_s: float
) -> dict:
    dense = copy.deepcopy(teacher).train()
    g = torch.Generator().manual_seed(seed + 2000)
    train_lm(dense, lambda step: episodes(32, 4, g), steps=finetune_steps, lr=2e-3, warmup=10)
    dense.eval()
    window = 19  # each query sees itself and the 19 tokens before it: 20 of the 80 keys
    student = sparse_student(dense, masks.sliding_window(window))
    before = evaluate(student, test)
    g2 = torch.Generator().manual_seed(seed + 3000)
    report = distill(
        dense,
        student,
        lambda step: episodes(32, 4, g2),
        steps=steps,
        lr=2e-3,
        warmup=10,
        eval_batch=test,
        progress=False,
    )
    after = evaluate(student, test)
    times = {}
    for length in (test.ids.shape[1], long_len):
        ids = torch.randint(0, VOCAB, (1 if length > 256 else 32, length), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            t = timeit({"teacher": lambda: dense(ids), "student": lambda: student(ids)}, repeat=7, budget_s=budget_s)
        times[length] = t
    return dict(
        teacher=evaluate(dense, test),
        before=before,
        after=after,
        window=window + 1,
        keys=test.ids.shape[1],
        times=times,
        report=report,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the models are tiny)")
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    q = args.quick
    # --quick: a check that every part runs, in about 20 s; the targets are judged on the full run
    steps, eval_every = (60, 20) if q else (400, 25)
    n_test = 128 if q else 1024
    seed = args.seed
    started = time.perf_counter()
    held_out = associative_recall(n_test, **TASK, generator=torch.Generator().manual_seed(seed + 2))
    teacher, teacher_steps = train_teacher(seed, 600 if q else 3000, held_out, goal=0.9 if q else 0.98)
    t_acc = evaluate(teacher, held_out)
    print(f"teacher: {teacher_steps} training steps, held-out recall accuracy {t_acc:.1%}", flush=True)

    small = smaller_student(teacher, steps, eval_every, held_out, seed)
    goal = 0.95 * t_acc
    rows = []
    scratch_curve = dict(small["curve_scratch"])
    for step, acc in small["curve_distilled"]:
        rows.append(
            {"step": step, "distilled": f"{acc:.1%}", "from scratch": f"{scratch_curve.get(step, float('nan')):.1%}"}
        )
    print(
        f"\n1. half-width student ({small['params_student']:,} parameters; teacher {small['params_teacher']:,}), "
        f"{steps} steps, same batches and optimiser; 95% of the teacher = {goal:.1%}"
    )
    print(table(rows, ["step", "distilled", "from scratch"]))
    ok1 = small["distilled"] >= goal and small["scratch"] < goal
    print(
        f"after {steps} steps: distilled {small['distilled']:.1%} ({small['distilled'] / t_acc:.1%} of the "
        f"teacher), from scratch {small['scratch']:.1%} ({small['scratch'] / t_acc:.1%}); target "
        f"{'met' if ok1 else 'MISSED'}; {small['seconds_distill']:.0f} s distilling, {small['seconds_scratch']:.0f} s "
        f"from scratch",
        flush=True,
    )

    test80 = episodes(n_test // 4, 4, torch.Generator().manual_seed(seed + 5))
    long_len = 512 if q else 4096
    sp = dense_to_sparse(teacher, 30 if q else 200, 30 if q else 200, test80, seed, long_len, 3 if q else 20)
    ok2 = sp["after"] >= 0.95 * sp["teacher"]
    print(
        f"\n2. dense to sparse: 4 recall episodes back to back ({sp['keys']} tokens), sliding window of "
        f"{sp['window']} keys ({sp['window'] / sp['keys']:.0%})"
    )
    print(
        table(
            [
                {"model": "dense teacher", "accuracy": f"{sp['teacher']:.1%}"},
                {"model": "window student, teacher's weights", "accuracy": f"{sp['before']:.1%}"},
                {"model": f"window student, distilled {sp['report'].steps} steps", "accuracy": f"{sp['after']:.1%}"},
            ],
            ["model", "accuracy"],
        )
    )
    trows = []
    for length, t in sp["times"].items():
        trows.append(
            {
                "length": length,
                "batch": 1 if length > 256 else 32,
                "teacher ms": f"{t['teacher'] * 1e3:.2f}",
                "student ms": f"{t['student'] * 1e3:.2f}",
                "student / teacher": f"{t['student'] / t['teacher']:.2f}",
            }
        )
    print(table(trows, ["length", "batch", "teacher ms", "student ms", "student / teacher"]))
    print(f"after distillation: {sp['after'] / sp['teacher']:.1%} of the teacher; target {'met' if ok2 else 'MISSED'}")
    print(f"\n{machine()}; {time.perf_counter() - started:.0f} s in all")
    path = save(
        "distill" + ("_quick" if q else ""),
        out=args.out,
        payload={
            "quick": q,
            "teacher": {"steps": teacher_steps, "accuracy": t_acc},
            "smaller_student": {
                "steps": steps,
                "distilled": small["distilled"],
                "scratch": small["scratch"],
                "curve_distilled": small["curve_distilled"],
                "curve_scratch": small["curve_scratch"],
                "params_student": small["params_student"],
                "params_teacher": small["params_teacher"],
                "target_met": ok1,
            },
            "dense_to_sparse": {
                "keys": sp["keys"],
                "window": sp["window"],
                "teacher": sp["teacher"],
                "before": sp["before"],
                "after": sp["after"],
                "steps": sp["report"].steps,
                "forward_seconds": {str(k): v for k, v in sp["times"].items()},
                "target_met": ok2,
            },
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
