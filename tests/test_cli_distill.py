"""The distillation command's documented runs: a half-width student learns the teacher's recall; a
sliding-window student is bounded by what its window can see, which the command prints."""

import re
from types import SimpleNamespace

import torch

from attnkit.cli import _recall_reach, main


def test_recall_reach_counts_the_answers_within_the_window():
    # keys 1, 2, values 11, 12; the query at position 4 asks key 1, whose value sits at position 1
    batch = SimpleNamespace(
        ids=torch.tensor([[1, 11, 2, 12, 1, 11]]), targets=torch.tensor([[-100, -100, -100, -100, 11, -100]])
    )
    assert [_recall_reach(batch, w) for w in (2, 3, 4, 6)] == [0.0, 0.0, 1.0, 1.0]
    wrong = SimpleNamespace(ids=batch.ids, targets=torch.tensor([[-100, -100, -100, -100, 12, -100]]))
    assert _recall_reach(wrong, 6) == 0.0  # 12 follows key 2, not the query's key


def _accuracies(out: str) -> tuple[float, float, float]:
    m = re.search(r"accuracy: teacher ([\d.]+)%, student ([\d.]+)% \(before: ([\d.]+)%\)", out)
    assert m, out
    return tuple(float(x) / 100 for x in m.groups())


def test_window_student_prints_its_reach(capsys):
    assert main(["distill", "--window", "10", "--quick", "--no-progress"]) == 0
    out = capsys.readouterr().out
    reach = re.search(r"the window reaches the answer of ([\d.]+)% of the held-out queries", out)
    assert reach and 0.0 < float(reach.group(1)) < 100.0, out


def test_half_width_student_learns_the_teachers_recall(capsys):
    """The documented default run (about 20 s of one core): the student goes from chance to most of the teacher's
    accuracy (measured: teacher 100%, student 1.6% before, 95.4% after)."""
    assert main(["distill", "--no-progress"]) == 0
    teacher, after, before = _accuracies(capsys.readouterr().out)
    assert teacher > 0.95 and before < 0.2
    assert after > 0.8 * teacher, (teacher, before, after)
