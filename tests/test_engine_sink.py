"""attnkit.Engine with attention sinks (n_sink, window): every request gets the tokens SinkCache gives it alone,
with batching, chunked prefill, preemption and prefix caching; each sequence holds a bounded number of blocks."""

import random

import pytest
import torch

import attnkit
from attnkit.cache import PagedSinkCache, SinkCache
from _models import tiny_decoder


pytestmark = pytest.mark.usefixtures("one_thread")

N_SINK, WINDOW = 4, 9  # capacity 13: the prompts and generations below run far past it


def _model(positions="rope", dtype=torch.float64, **kw):
    # init_std=0.3: attention that depends on which keys are kept (the default's small weights give near-constant
    # greedy tokens that a wrong window would not change)
    return tiny_decoder(dtype=dtype, positions=positions, init_std=0.3, **kw)


def _alone(model, prompt, n, sampling=None):
    """What SinkCache gives ``prompt`` alone: through generate while the prompt fits n_sink + window (and the
    whole run the model's max_seq_len, which generate checks), else its first n_sink + window tokens at once and
    the rest one per forward (as StreamingLLM streams a long input)."""
    if len(prompt) <= N_SINK + WINDOW and len(prompt) + n - 1 <= model.config.max_seq_len:
        return attnkit.generate(
            model, [prompt], n, cache=lambda m, b, L: SinkCache.for_model(m, N_SINK, WINDOW), **(sampling or {})
        )[0]
    assert not sampling
    cache, C, out = SinkCache.for_model(model, N_SINK, WINDOW), N_SINK + WINDOW, []
    with torch.no_grad():
        logits = model(torch.tensor([prompt[:C]]), cache=cache)[0, -1]
        for t in prompt[C:]:
            logits = model(torch.tensor([[t]]), cache=cache)[0, -1]
        while True:
            out.append(int(logits.argmax()))
            if len(out) == n:
                return out
            logits = model(torch.tensor([[out[-1]]]), cache=cache)[0, -1]


def _engine(model, cache_blocks, **kw):
    """An Engine of 4-token blocks keeping the N_SINK + WINDOW positions of SinkCache."""
    return attnkit.Engine(model, cache_blocks=cache_blocks, block_size=4, n_sink=N_SINK, window=WINDOW, **kw)


def _requests(n, seed, long_prompts=True):
    rng = random.Random(seed)
    top = 30 if long_prompts else N_SINK + WINDOW
    return [([rng.randrange(64) for _ in range(rng.randint(1, top))], rng.randint(20, 45)) for _ in range(n)]


@pytest.mark.parametrize(
    "positions,dtype,kw",
    [
        ("rope", torch.float64, {}),
        ("rope", torch.float32, {"n_kv_heads": 1}),  # multi-query
        ("alibi", torch.float64, {}),
        ("none", torch.float32, {}),
        ("sinusoidal", torch.float64, {}),  # absolute positions: those within the cache, as SinkCache gives them
        ("rope", torch.float64, {"attention_sinks": True}),  # learned sink logits too
    ],
)
@pytest.mark.parametrize("max_batched_tokens", [None, 8])
def test_engine_equals_sink_cache_alone(positions, dtype, kw, max_batched_tokens):
    model = _model(positions, dtype, **kw)
    reqs = _requests(6, seed=1)
    engine = _engine(model, 64, max_batch=4, max_batched_tokens=max_batched_tokens)
    rids = [engine.add(p, n) for p, n in reqs]
    done = engine.run()
    assert any(len(p) > N_SINK + WINDOW for p, _ in reqs)  # prompts past the window are streamed
    assert [done[r] for r in rids] == [_alone(model, p, n) for p, n in reqs]
    assert engine.cache.num_free_blocks == 64


@pytest.mark.parametrize("max_batched_tokens,chunk_sizing", [(None, "tokens"), (6, "tokens"), (6, "cost")])
def test_preemption_and_prefix_caching_give_the_same_tokens(max_batched_tokens, chunk_sizing):
    model = _model()
    shared = [3, 1, 4, 1, 5, 9, 2, 6]  # two full blocks of 4, within n_sink + window
    reqs = _requests(5, seed=2, long_prompts=False) + [(shared + [5], 30), (shared + [8, 8], 25)]
    engine = _engine(model, 12, max_batch=4, max_batched_tokens=max_batched_tokens, chunk_sizing=chunk_sizing)
    rids = [engine.add(p, n) for p, n in reqs]
    done = engine.run()
    assert engine.stats["preemptions"] > 0  # recomputed past the window, one token per step
    assert [done[r] for r in rids] == [_alone(model, p, n) for p, n in reqs]
    assert engine.cache.num_free_blocks == 12


def test_prefix_caching_shares_only_blocks_computed_before_any_eviction():
    model = _model()
    engine = _engine(model, 64, max_batch=1)
    first = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    out = engine.generate([first], 20)[0]
    again = first + out[:10]  # 19 tokens: its first 4 full blocks were all computed by the first request
    assert engine.generate([again], 20) == [_alone(model, again, 20)]
    assert engine.cache.prefix_hits == (N_SINK + WINDOW) // 4  # 3: the 4th block ends past n_sink + window


def test_sampling_controls_are_unchanged():
    model = _model()
    prompt = [7, 3, 9, 1, 1]
    sampling = dict(temperature=0.9, top_k=20, top_p=0.95, seed=5, repetition_penalty=1.2)
    engine = _engine(model, 32, max_batch=2)
    a = engine.add(prompt, 40, **sampling)
    b = engine.add([2, 2], 30, eos_id=63)
    done = engine.run()
    assert done[a] == _alone(model, prompt, 40, sampling)
    assert done[b] == _alone(model, [2, 2], 30, dict(eos_id=63))


def test_blocks_per_sequence_stay_bounded_and_go_back():
    model = _model()
    engine = _engine(model, 40, max_batch=3, preempt=False)  # 3 x 150 tokens at full attention would need 114 blocks
    pool = engine.cache
    bound = pool.max_blocks_per_sequence
    assert bound == 1 + 2 + 1  # the sink block, and the 9 newest positions straddle at most 3 blocks
    for i in range(3):
        engine.add([1 + i] * (3 + 5 * i), 150)
    held = []
    while engine.has_work:
        engine.step()
        held += [sum(b >= 0 for b in pool._seqs[r.sid].blocks) for r in engine.running]
    assert max(held) == bound  # reached, never passed: blocks that left the window went back to the pool
    assert engine.stats["peak_blocks"] <= 3 * bound and pool.num_free_blocks == 40
    # one request needing more blocks than the pool has at full attention runs in a pool of `bound` blocks
    small = _engine(model, bound, preempt=False)
    assert small.generate([[5, 6]], 120) == [_alone(model, [5, 6], 120)]


def test_paged_sink_cache_steps_equal_sink_cache_batched_and_packed():
    model = _model()
    pools = [
        PagedSinkCache.for_model(model, num_blocks=16, block_size=4, n_sink=N_SINK, window=WINDOW) for _ in range(2)
    ]
    ids = [[p.add_sequence(), p.add_sequence()] for p in pools]
    refs = [SinkCache.for_model(model, N_SINK, WINDOW) for _ in range(2)]
    rng = random.Random(0)
    with torch.no_grad():
        for pool, (a, _b) in zip(pools, ids):  # b stays 3 tokens behind a
            view = pool.batch([a])
            model(torch.tensor([[9, 8, 7]]), cache=view, positions=view.positions(3))
        model(torch.tensor([[9, 8, 7]]), cache=refs[0])
        for _ in range(40):
            toks = [rng.randrange(64), rng.randrange(64)]
            view = pools[0].batch(ids[0])
            batched = model(torch.tensor([[t] for t in toks]), cache=view, positions=view.positions(1))[:, -1]
            packed_view = pools[1].packed(ids[1], [1, 1])
            packed = model(torch.tensor([toks]), cache=packed_view, positions=packed_view.positions())[0]
            alone = [model(torch.tensor([[t]]), cache=r)[0, -1] for t, r in zip(toks, refs)]
            torch.testing.assert_close(batched, torch.stack(alone))
            torch.testing.assert_close(packed, torch.stack(alone))
    for pool, (a, b) in zip(pools, ids):
        assert pool.length(a) == 43 and pool.length(b) == 40
        assert pool.batch([a]).seq_len == N_SINK + WINDOW - 1
        assert sum(blk >= 0 for blk in pool.block_table([a])[0].tolist()) <= pool.max_blocks_per_sequence
        pool.free(a)
        pool.free(b)
        assert pool.num_free_blocks == 16


def test_bad_arguments_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="n_sink=4 and window=None"):
        attnkit.Engine(model, cache_blocks=8, n_sink=4)
    with pytest.raises(ValueError, match="window"):
        attnkit.Engine(model, cache_blocks=8, n_sink=4, window=0)
    with pytest.raises(ValueError, match="max_seq_len=64"):
        attnkit.Engine(model, cache_blocks=8, n_sink=4, window=64)
    with pytest.raises(ValueError, match="rope_layers"):
        attnkit.Engine(_model(rope_layers=(True, False)), cache_blocks=8, n_sink=4, window=16)
    pool = PagedSinkCache.for_model(model, num_blocks=16, block_size=4, n_sink=N_SINK, window=WINDOW)
    a = pool.add_sequence()
    with torch.no_grad():
        model(torch.zeros(1, 10, dtype=torch.long), cache=pool.batch([a]))
        with pytest.raises(ValueError, match="one token per forward"):
            model(torch.zeros(1, 4, dtype=torch.long), cache=pool.batch([a]))
    assert pool.length(a) == 10  # a refused forward stores nothing
    with pytest.raises(ValueError, match="truncate"):
        pool.truncate(a, 5)
