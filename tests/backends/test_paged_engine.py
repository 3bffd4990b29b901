"""The paged backend under an Engine: batched decode steps read the pool in one pass over its blocks."""

import random

import pytest
import torch

import attnkit
from attnkit.backends import paged
from attnkit.nn import DecoderConfig, DecoderLM

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_engines_batched_decode_steps_read_the_pool_in_one_pass(monkeypatch):
    """Under preemption (a pool too small for every running sequence), the decode steps of several sequences
    take the pool path, and every request gets the tokens it gets alone."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, n_kv_heads=2, init_std=0.1)).eval()
    pool_steps = []
    real = paged._attend_pool
    monkeypatch.setattr(paged, "_attend_pool", lambda q, *a, **k: pool_steps.append(q.shape[0]) or real(q, *a, **k))
    rng = random.Random(0)
    reqs = [([rng.randrange(64) for _ in range(rng.randint(1, 13))], rng.randint(1, 14)) for _ in range(8)]
    engine = attnkit.Engine(model, cache_blocks=9, block_size=4, max_batch=5)
    rids = [engine.add(p, n) for p, n in reqs]
    done = engine.run()
    assert max(pool_steps) > 1  # batched decode steps read the pool in one pass over its blocks
    assert engine.stats["preemptions"] > 0
    assert [done[r] for r in rids] == [attnkit.generate(model, [p], n)[0] for p, n in reqs]
