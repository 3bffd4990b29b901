"""The generated tasks: layout, targets, determinism, errors."""

from __future__ import annotations

import pytest
import torch

from attnkit.nn.tasks import accuracy, associative_recall, copy_task


def test_associative_recall_answers_are_the_values_after_the_queried_keys():
    b = associative_recall(64, n_pairs=5, n_queries=3, n_keys=7, n_values=9, generator=torch.Generator().manual_seed(0))
    assert b.ids.shape == (64, 16) and b.vocab_size == 16
    for ids, targets in zip(b.ids.tolist(), b.targets.tolist()):
        keys, values = ids[0:10:2], ids[1:10:2]
        assert len(set(keys)) == 5 and all(k < 7 for k in keys) and all(7 <= v < 16 for v in values)
        pairs = dict(zip(keys, values))
        for pos in range(10, 16, 2):
            assert targets[pos] == pairs[ids[pos]] == ids[pos + 1]
        assert [t for i, t in enumerate(targets) if i not in (10, 12, 14)] == [-100] * 13
    queried = b.ids[:, 10::2]
    assert all(len(set(row)) == 3 for row in queried.tolist())  # distinct queries


def test_copy_task_layout_and_distinct_symbols():
    b = copy_task(32, length=6, n_symbols=8, distinct=True, generator=torch.Generator().manual_seed(0))
    assert b.ids.shape == (32, 13) and b.vocab_size == 9
    assert torch.equal(b.ids[:, :6], b.ids[:, 7:]) and bool((b.ids[:, 6] == 8).all())
    assert torch.equal(b.targets[:, 6:12], b.ids[:, :6]) and bool((b.targets[:, :6] == -100).all())
    assert all(len(set(row)) == 6 for row in b.ids[:, :6].tolist())
    again = copy_task(32, length=6, n_symbols=8, distinct=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.ids, b.ids)  # seeded


def test_accuracy_counts_only_scored_positions():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = logits[0, 1, 1] = logits[0, 2, 3] = 1.0
    assert accuracy(logits, torch.tensor([[2, -100, 0]])) == 0.5
    with pytest.raises(ValueError, match="no scored positions"):
        accuracy(logits, torch.full((1, 3), -100))


def test_task_errors():
    with pytest.raises(ValueError, match="n_pairs=9 needs at least as many distinct keys"):
        associative_recall(2, n_pairs=9, n_keys=8)
    with pytest.raises(ValueError, match="n_queries=5 must be <= n_pairs=4"):
        associative_recall(2, n_pairs=4, n_queries=5)
    with pytest.raises(ValueError, match="distinct=True needs length <= n_symbols"):
        copy_task(2, length=9, n_symbols=8, distinct=True)
