"""Generated tasks that show a model learns to attend: associative recall and copying.

Both produce token ids and next-token targets (``-100`` where nothing is scored), so any causal language
model trains on them with ``F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)``.

Example::

    >>> import torch
    >>> from attnkit.nn.tasks import associative_recall
    >>> batch = associative_recall(2, n_pairs=3, n_queries=2, generator=torch.Generator().manual_seed(0))
    >>> batch.ids.shape, batch.targets.shape, batch.vocab_size
    (torch.Size([2, 10]), torch.Size([2, 10]), 32)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _checks

Tensor = torch.Tensor

__all__ = ["TaskBatch", "associative_recall", "copy_task", "accuracy", "train_lm"]

IGNORE = -100


@dataclass
class TaskBatch:
    """Token ids ``(B, L)``, next-token targets ``(B, L)`` (``-100`` = not scored), and the vocabulary size.

    Example::

        >>> copy_task(2, length=3).ids.shape
        torch.Size([2, 7])
    """

    ids: Tensor
    targets: Tensor
    vocab_size: int


def associative_recall(
    batch: int,
    *,
    n_pairs: int = 8,
    n_queries: int = 4,
    n_keys: int = 16,
    n_values: int = 16,
    generator: torch.Generator | None = None,
    device=None,
) -> TaskBatch:
    """Multi-query associative recall: ``k1 v1 k2 v2 ... kn vn  q1 a1 ... qm am``.

    Keys (ids ``0 .. n_keys-1``) are distinct within a sequence; values (ids ``n_keys ..``) are drawn at
    random; each query ``q`` is one of the sequence's keys and its answer ``a`` the value that followed
    it.  Only the answers are scored (the target at a query's position), so solving the task means
    attending from the query back to the matching key, then to the token after it (an induction head).

    Returns ``ids`` and ``targets`` ``(batch, 2 (n_pairs + n_queries))``.

    Example::

        >>> import torch
        >>> b = associative_recall(1, n_pairs=2, n_queries=1, n_keys=4, n_values=4,
        ...                        generator=torch.Generator().manual_seed(1))
        >>> ids, t = b.ids[0].tolist(), b.targets[0].tolist()
        >>> t[4] == dict(zip(ids[0:4:2], ids[1:4:2]))[ids[4]]  # the answer to the query at position 4
        True
    """
    for name, v in (
        ("batch", batch),
        ("n_pairs", n_pairs),
        ("n_queries", n_queries),
        ("n_keys", n_keys),
        ("n_values", n_values),
    ):
        _checks.positive_int(name, v)
    if n_pairs > n_keys:
        raise ValueError(f"n_pairs={n_pairs} needs at least as many distinct keys, got n_keys={n_keys}")
    if n_queries > n_pairs:
        raise ValueError(f"n_queries={n_queries} must be <= n_pairs={n_pairs} (each query asks a distinct key)")
    g = generator
    keys = torch.rand(batch, n_keys, generator=g).argsort(-1)[:, :n_pairs]  # (B, n_pairs) distinct keys
    values = torch.randint(n_keys, n_keys + n_values, (batch, n_pairs), generator=g)
    which = torch.rand(batch, n_pairs, generator=g).argsort(-1)[:, :n_queries]  # (B, n_queries)
    q, a = keys.gather(1, which), values.gather(1, which)
    ids = torch.cat([torch.stack([keys, values], -1).flatten(1), torch.stack([q, a], -1).flatten(1)], dim=1)
    targets = torch.full_like(ids, IGNORE)
    first = 2 * n_pairs
    targets[:, first::2] = a  # at each query position, predict its answer
    return TaskBatch(ids.to(device), targets.to(device), n_keys + n_values)


def copy_task(
    batch: int,
    *,
    length: int = 8,
    n_symbols: int = 16,
    distinct: bool = False,
    generator: torch.Generator | None = None,
    device=None,
) -> TaskBatch:
    """Copying: ``x_1 .. x_n  SEP  x_1 .. x_n``; the second half is scored (``SEP`` is id ``n_symbols``).

    A model can copy by attending a fixed distance back (easy with relative positions) or by induction
    (find the current token earlier, take the one after it: the only way with ALiBi).  ``distinct=True``
    draws the symbols of a sequence without repetition, so induction is never ambiguous.

    Example::

        >>> from attnkit.nn.tasks import copy_task
        >>> b = copy_task(1, length=3, n_symbols=4)
        >>> b.ids.shape, b.vocab_size, int(b.ids[0, 3])
        (torch.Size([1, 7]), 5, 4)
    """
    _checks.positive_int("batch", batch)
    _checks.positive_int("length", length)
    _checks.positive_int("n_symbols", n_symbols)
    if _checks.flag("distinct", distinct):
        if length > n_symbols:
            raise ValueError(f"distinct=True needs length <= n_symbols, got length={length}, n_symbols={n_symbols}")
        x = torch.rand(batch, n_symbols, generator=generator).argsort(-1)[:, :length]
    else:
        x = torch.randint(0, n_symbols, (batch, length), generator=generator)
    sep = torch.full((batch, 1), n_symbols, dtype=torch.long)
    ids = torch.cat([x, sep, x], dim=1)
    targets = torch.full_like(ids, IGNORE)
    targets[:, length:-1] = x  # from SEP on, predict the next copied symbol
    return TaskBatch(ids.to(device), targets.to(device), n_symbols + 1)


def accuracy(logits: Tensor, targets: Tensor) -> float:
    """Share of scored positions (``targets != -100``) where the arg-max of ``logits (B, L, V)`` is right.

    Example::

        >>> import torch
        >>> accuracy(torch.tensor([[[0.0, 1.0], [1.0, 0.0]]]), torch.tensor([[1, -100]]))
        1.0
    """
    scored = targets != IGNORE
    if not bool(scored.any()):
        raise ValueError("accuracy: no scored positions (every target is -100)")
    return float((logits.argmax(-1)[scored] == targets[scored]).float().mean())


def train_lm(
    model: torch.nn.Module,
    make_batch,
    *,
    steps: int,
    lr: float = 3e-3,
    weight_decay: float = 0.0,
    warmup: int = 20,
    clip: float = 1.0,
    on_step=None,
) -> list[float]:
    """Train a causal LM (``model(ids) -> logits``) on batches from ``make_batch(step) -> TaskBatch`` with
    AdamW, linear warm-up and cosine decay; returns the losses.  ``on_step(step, loss)`` may return True to
    stop early.

    Example::

        >>> import torch
        >>> from attnkit.nn import DecoderConfig, DecoderLM
        >>> from attnkit.nn.tasks import copy_task, train_lm
        >>> model = DecoderLM(DecoderConfig.preset("tiny", vocab_size=5))
        >>> losses = train_lm(model, lambda step: copy_task(8, length=4, n_symbols=4), steps=3)
        >>> len(losses)
        3
    """
    _checks.positive_int("steps", steps)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / max(1, warmup))
            * 0.5
            * (1 + torch.cos(torch.tensor(torch.pi * min(s, steps) / steps)).item())
        ),
    )
    model.train()
    losses = []
    for step in range(steps):
        b = make_batch(step)
        logits = model(b.ids)
        loss = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None and on_step(step, losses[-1]):
            break
    model.eval()
    return losses
