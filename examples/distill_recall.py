"""Distil the demo's associative-recall model into a student of half its width.

The teacher is the model ``attnkit demo`` trains (DecoderLM, 2 layers x 4 heads, d_model 64, ALiBi), trained
the same way: copying first (it forms the induction circuit), then recall.  The student (d_model 32, the
same 2 layers x 4 heads) is distilled with ``attnkit.distill.distill`` (logits, attention head by head, q/k/v
relations), next to a copy of it trained on the targets alone, on the same batches for as many steps.  Printed:
the distillation report with both models' held-out accuracy, the copy's accuracy, and how far each student
layer's attention is from the teacher's (``attention_kl``, 0 = the same distributions).

    python examples/distill_recall.py            # about a minute on one core
    python examples/distill_recall.py --quick    # a few seconds, no accuracy to reach
"""

from __future__ import annotations

import argparse
import copy

import torch

from attnkit.distill import attention_kl, capture, distill
from attnkit.nn import DecoderConfig, DecoderLM
from attnkit.nn.tasks import accuracy, associative_recall, copy_task, train_lm

TASK = dict(n_pairs=6, n_queries=4)


def recall_model(d_model: int, seed: int) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(
        DecoderConfig(
            vocab_size=33,
            d_model=d_model,
            n_layers=2,
            n_heads=4,
            max_seq_len=64,
            positions="alibi",
            tie_embeddings=False,
        )
    )


def held_out_accuracy(model, batch) -> float:
    with torch.no_grad():
        return accuracy(model.eval()(batch.ids), batch.targets)


def attention_gap(student, teacher, ids) -> list[float]:
    """Per layer, ``attention_kl`` between the student's and the teacher's attention on ``ids``."""
    with torch.no_grad(), capture(teacher) as t, capture(student) as s:
        teacher(ids), student(ids)
        return [float(attention_kl(a, b, heads="map")) for a, b in zip(s.attention, t.attention)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny models
    teacher_steps, steps = (30, 10) if args.quick else (900, 300)
    held = associative_recall(512, **TASK, generator=torch.Generator().manual_seed(2))

    teacher = recall_model(64, 0)
    g = torch.Generator().manual_seed(1)
    train_lm(
        teacher,
        lambda step: (
            copy_task(32, length=10, n_symbols=32, distinct=True, generator=g)
            if step < teacher_steps // 3
            else associative_recall(32, **TASK, generator=g)
        ),
        steps=teacher_steps,
        lr=5e-3,
    )
    print(f"teacher: {held_out_accuracy(teacher, held):.1%} held-out recall accuracy after {teacher_steps} steps")

    batches = [associative_recall(32, **TASK, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]
    student = recall_model(32, 1)
    scratch = copy.deepcopy(student)
    report = distill(
        teacher,
        student,
        lambda step: batches[step],
        steps=steps,
        lr=5e-3,
        eval_batch=held,
        weights={"logits": 1.0, "attention": 10.0, "relations": 10.0},
        heads="map",
    )
    train_lm(scratch, lambda step: batches[step], steps=steps, lr=5e-3)
    print(f"\nhalf-width student\n{report}")
    print(f"   the same student trained on the targets for {steps} steps: {held_out_accuracy(scratch, held):.1%}")
    gap = attention_gap(student, teacher, held.ids[:64])
    print(
        f"   attention KL to the teacher per layer: distilled {', '.join(f'{x:.3f}' for x in gap)}; from scratch "
        f"{', '.join(f'{x:.3f}' for x in attention_gap(scratch, teacher, held.ids[:64]))}"
    )


if __name__ == "__main__":
    main()
