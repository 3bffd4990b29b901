"""attnkit.Engine: continuous batching gives every request exactly the tokens it gets alone, also when the
pool runs out and sequences are preempted and recomputed; blocks are freed at once; clear errors."""

import random

import pytest
import torch

import attnkit
from attnkit.cache import PoolExhausted
from attnkit.nn import DecoderConfig, DecoderLM


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, n_kv_heads=2, init_std=0.1)).eval()


def _requests(n=10, seed=0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 13))]
        sampling = {} if i % 3 else dict(temperature=0.8, top_p=0.9, seed=i)
        reqs.append((prompt, rng.randint(1, 14), sampling))
    return reqs


def _alone(model, reqs):
    return [attnkit.generate(model, [p], n, **s)[0] for p, n, s in reqs]


def test_engine_equals_one_by_one_under_preemption(model):
    # (that its batched decode steps read the pool in one pass: tests/backends/test_paged_engine.py)
    reqs = _requests()
    engine = attnkit.Engine(model, cache_blocks=9, block_size=4, max_batch=5)
    rids = [engine.add(p, n, **s) for p, n, s in reqs]
    done = engine.run()
    assert engine.stats["preemptions"] > 0  # the pool was too small for every running sequence
    assert [done[r] for r in rids] == _alone(model, reqs)
    assert engine.cache.num_free_blocks == 9 and not engine.has_work  # every block came back


def test_requests_join_while_others_run_and_finished_ones_free_at_once(model):
    reqs = _requests(6, seed=1)
    engine = attnkit.Engine(model, cache_blocks=40, block_size=4, max_batch=3)
    rids = [engine.add(p, n, **s) for p, n, s in reqs[:4]]
    produced = {}
    for _ in range(3):
        for rid, tok in engine.step():
            produced.setdefault(rid, []).append(tok)
        assert len(engine.running) <= 3
    rids += [engine.add(p, n, **s) for p, n, s in reqs[4:]]  # added at any time
    while engine.has_work:
        before = {r.rid for r in engine.running}
        for rid, tok in engine.step():
            produced.setdefault(rid, []).append(tok)
        ended = before - {r.rid for r in engine.running}
        assert all(rid in engine.results for rid in ended)
        held = {b for s in engine.cache._seqs.values() for b in s.blocks}  # only live sequences hold blocks
        assert len(engine.cache._seqs) == len(engine.running)
        assert engine.cache.num_free_blocks == 40 - len(held)
    want = _alone(model, reqs)
    assert [produced[r] for r in rids] == want == [engine.results[r] for r in rids]


def test_prefix_caching_reuses_a_shared_prompt(model):
    shared = list(range(1, 30))
    reqs = [(shared + [40], 6, {}), (shared + [41, 42], 6, {})]
    engine = attnkit.Engine(model, cache_blocks=30, block_size=4, max_batch=1)
    out = engine.generate([p for p, _, _ in reqs], 6)
    assert engine.cache.stats()["prefix_hits"] == 7  # 28 of the second prompt's 31 tokens came from the cache
    assert engine.stats["prefill_tokens"] == 30 + 3
    assert out == _alone(model, reqs)


def test_eos_ends_a_request(model):
    ((prompt, _, _),) = _requests(1, seed=4)
    full = attnkit.generate(model, [prompt], 10)[0]
    eos = full[3]
    engine = attnkit.Engine(model, cache_blocks=10, block_size=4)
    rid = engine.add(prompt, 10, eos_id=eos)
    assert engine.run()[rid] == full[: full.index(eos) + 1]


def test_exhausted_pool_without_preemption_raises(model):
    engine = attnkit.Engine(model, cache_blocks=4, block_size=4, max_batch=4, preempt=False)
    for p in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        engine.add(p, 12)
    with pytest.raises(PoolExhausted, match="preemption is off.*more cache_blocks"):
        engine.run()


def test_bad_requests(model):
    engine = attnkit.Engine(model, cache_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="needs 5 blocks.*cache_blocks=4"):
        engine.add(list(range(10)), 11)
    with pytest.raises(ValueError, match="non-empty list of int token ids"):
        engine.add([], 3)
    with pytest.raises(ValueError, match="top_k=0"):
        engine.add([1], 3, top_k=0)
    with pytest.raises(ValueError, match="max_batch=0"):
        attnkit.Engine(model, cache_blocks=4, max_batch=0)
    assert engine.run() == {} and engine.add([1], 0) == 0 and engine.results[0] == []


def test_engine_decodes_through_copies_of_its_own(model):
    """Decode steps of 4 or more sequences read column-major copies held by the Engine; the model's weights
    stay row-major; relayout=False reads them as they are."""
    import copy

    m = copy.deepcopy(model)
    w = m.layers[0].attn.qkv_proj.weight
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    small = attnkit.Engine(m, cache_blocks=16, block_size=4, max_batch=2)
    assert small.generate(prompts, 4) == [attnkit.generate(model, [p], 4)[0] for p in prompts]
    assert small._copies.nbytes() == 0  # up to 3 sequences a step: the row-major weights themselves
    engine = attnkit.Engine(m, cache_blocks=16, block_size=4, max_batch=8)
    assert engine.generate(prompts, 4) == [attnkit.generate(model, [p], 4)[0] for p in prompts]
    assert engine._copies.nbytes() >= w.nbytes  # every Linear weight and the tied head, column-major
    assert w.stride() == (w.shape[1], 1)
    off = attnkit.Engine(m, cache_blocks=16, block_size=4, max_batch=8, relayout=False)
    assert off._copies is None and off.generate(prompts[:1], 4) == [attnkit.generate(model, prompts[:1], 4)[0]]
    with pytest.raises(TypeError, match="relayout must be True or False, got 'no'"):
        attnkit.Engine(m, cache_blocks=8, relayout="no")


@pytest.mark.parametrize(
    "variant", [dict(positions="alibi", mask=attnkit.masks.sliding_window(6)), dict(positions="t5", n_kv_heads=1)]
)
def test_engine_with_windows_and_relative_biases(variant):
    """The paged decode evaluates the model's window and its ALiBi/T5 bias per sequence."""
    torch.manual_seed(1)
    model = DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, init_std=0.1, **variant)).eval()
    reqs = _requests(6, seed=2)
    want = [attnkit.generate(model, [p], 10)[0] for p, _, _ in reqs]
    engine = attnkit.Engine(model, cache_blocks=12, block_size=4, max_batch=4)
    assert engine.generate([p for p, _, _ in reqs], 10) == want
    chunked = attnkit.Engine(model, cache_blocks=12, block_size=4, max_batch=4, max_batched_tokens=6)
    assert chunked.generate([p for p, _, _ in reqs], 10) == want  # prompt chunks under the window and bias


def test_engine_made_under_inference_mode_runs_outside_it(model):
    with torch.inference_mode():
        engine = attnkit.Engine(model, cache_blocks=8, block_size=4, max_batch=2)
    rid = engine.add([1, 2, 3], 4)
    assert engine.run()[rid] == attnkit.generate(model, [[1, 2, 3]], 4)[0]


def test_prefix_hits_count_admitted_sequences_only(model):
    """A request that waits for room is not counted as reusing its cached prefix at every failed try."""
    shared = list(range(1, 9))  # two full blocks of 4
    engine = attnkit.Engine(model, cache_blocks=6, block_size=4, max_batch=4)
    first = engine.add(shared + [20], 12)  # grows to 5 blocks
    for _ in range(6):
        engine.step()  # first now holds 4 blocks
    second = engine.add(shared + list(range(30, 39)), 3)  # shares 2 blocks, needs 3 more: waits
    waited = 0
    while second not in engine.results:
        waited += bool(engine.waiting)
        engine.step()
    assert waited >= 2
    assert engine.cache.stats()["prefix_hits"] == 2
    assert engine.results[first] == attnkit.generate(model, [shared + [20]], 12)[0]
    assert engine.results[second] == attnkit.generate(model, [shared + list(range(30, 39))], 3)[0]


def test_engine_request_errors_name_the_argument(model):
    engine = attnkit.Engine(model, cache_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"^prompt has token ids \[999\]"):
        engine.add([1, 999], 2)
    with pytest.raises(ValueError, match="eos_id=5000 is outside the vocabulary"):
        engine.add([1], 2, eos_id=5000)


def test_a_long_running_engine_keeps_no_per_request_state(model):
    """Finished results leave with take(), the waste statistic is a running sum: nothing grows per request."""
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    for i in range(30):
        rid = engine.add([1 + i % 7, 2], 3)
        while rid not in engine.results:
            engine.step()
        assert engine.take(rid) == attnkit.generate(model, [[1 + i % 7, 2]], 3)[0]
    assert engine.results == {} and 0.0 <= engine.mean_waste < 1.0 and engine.stats["waste_steps"] > 0
    with pytest.raises(KeyError, match="not finished"):
        engine.take(rid)
    assert engine.generate([[3, 4], [5]], 2) == [attnkit.generate(model, [p], 2)[0] for p in ([3, 4], [5])]
    assert engine.results == {}  # generate takes its own results


def test_an_engine_keeps_the_precision_it_was_built_under():
    m = DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, qkv_bias=True)).eval()
    outside = attnkit.Engine(m, cache_blocks=32, block_size=4, relayout=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = attnkit.Engine(m, cache_blocks=32, block_size=4, relayout=False)
        assert inside.cache.dtype == torch.bfloat16
        assert outside.generate([[1, 2, 3]], 3) == attnkit.Engine(m, 32, 4, relayout=False).generate([[1, 2, 3]], 3)
    assert len(inside.generate([[1, 2, 3]], 3)[0]) == 3  # run outside autocast: still bfloat16 steps


def test_peak_blocks_counts_blocks_held_during_prefill(model):
    """Requests that finish at their first token never reach a decode step; their prompts' blocks count."""
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4)
    for i in range(3):
        engine.add(list(range(i, i + 16)), 1)
    engine.run()
    assert engine.stats["peak_blocks"] >= 4 and engine.cache.stats()["blocks_used"] == 0


def test_a_model_that_is_not_a_module_is_a_clear_error():
    """Engine(None) and generate(<a function>) raised AttributeError ('eval', 'training')."""
    for model in (None, lambda ids, **kw: ids, "tiny"):
        with pytest.raises(TypeError, match="Engine takes a decoder language model, a torch.nn.Module"):
            attnkit.Engine(model, cache_blocks=4)
        with pytest.raises(TypeError, match="generate takes a decoder language model, a torch.nn.Module"):
            attnkit.generate(model, [[1, 2]], 3)


def test_string_flags_are_refused(model):
    """preempt="no" and prefix_caching="no" turned the feature on."""
    for name in ("preempt", "prefix_caching", "relayout"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got 'no'"):
            attnkit.Engine(model, cache_blocks=8, block_size=4, **{name: "no"})
    engine = attnkit.Engine(model, cache_blocks=8, block_size=4, max_batch=2, preempt=False, prefix_caching=False)
    assert engine.preempt is False and engine.cache.prefix_caching is False


def test_an_encoder_decoder_is_a_clear_error():
    from attnkit.nn import EncoderDecoder

    ed = EncoderDecoder(DecoderConfig.preset("tiny"))
    with pytest.raises(TypeError, match="decoder-only.*EncoderDecoderCache"):
        attnkit.Engine(ed, cache_blocks=4)
    with pytest.raises(TypeError, match="decoder-only.*EncoderDecoderCache"):
        attnkit.generate(ed, [[1, 2]], 3)


def test_new_weights_drop_the_cached_prefixes():
    """After load_state_dict the Engine reused prefix blocks computed with the old weights (other tokens
    than a fresh generate); a change of the weights now clears the prefix cache."""
    torch.manual_seed(0)
    m1 = DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, init_std=0.3)).eval()
    m2 = DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, init_std=0.3)).eval()
    prompt = list(range(3, 40))
    engine = attnkit.Engine(m1, cache_blocks=32, block_size=4)
    engine.generate([prompt], 6)
    m1.load_state_dict(m2.state_dict())
    hits = engine.cache.prefix_hits
    assert engine.generate([prompt], 6) == attnkit.generate(m2, [prompt], 6)
    assert engine.cache.prefix_hits == hits
    assert engine.generate([prompt], 6) == attnkit.generate(m2, [prompt], 6)  # cached again, new weights
    assert engine.cache.prefix_hits > hits


def test_a_model_converted_after_the_engine_was_built_is_a_clear_error(model):
    import copy

    m = copy.deepcopy(model)
    engine = attnkit.Engine(m, cache_blocks=8, block_size=4)
    m.double()
    with pytest.raises(ValueError, match="make a new Engine"):
        engine.generate([[1, 2, 3]], 2)


# ----------------------------------------------------------------------------- chunked prefill


class _Recorder(torch.nn.Module):
    """The model, recording the token count of every forward."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.sizes = model, model.config, []

    def forward(self, ids, **kw):
        self.sizes.append(ids.numel())
        return self.inner(ids, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("blocks, budget, prefix", [(64, 8, True), (64, 5, False), (8, 6, True), (20, 16, True)])
def test_chunked_prefill_gives_the_tokens_of_each_request_alone(model, dtype, blocks, budget, prefix):
    m = model.to(dtype)
    try:
        rng = random.Random(3)
        shared = [rng.randrange(64) for _ in range(9)]
        reqs = _requests(8, seed=4) + [
            (shared + [5, 6], 6, {}),
            (shared + [7], 5, dict(temperature=1.0, seed=9, repetition_penalty=1.3)),
        ]
        want = _alone(m, reqs)
        rec = _Recorder(m)
        engine = attnkit.Engine(
            rec,
            cache_blocks=blocks,
            block_size=4,
            max_batch=4,
            max_batched_tokens=max(budget, 4),
            prefix_caching=prefix,
        )
        rids = [engine.add(p, n, **s) for p, n, s in reqs]
        engine.run()
        assert [engine.take(r) for r in rids] == want
        assert max(rec.sizes) <= max(budget, 4)
        if blocks == 8:
            assert engine.stats["preemptions"] > 0
        if prefix and blocks == 64:
            assert engine.cache.prefix_hits > 0
    finally:
        model.float()


def test_chunked_step_mixes_decode_tokens_and_a_prompt_chunk(model):
    """A long prompt arriving while others decode: each step is one forward holding a decode token of every
    running request and a chunk of the prompt."""
    rec = _Recorder(model)
    engine = attnkit.Engine(rec, cache_blocks=64, block_size=4, max_batch=4, max_batched_tokens=8)
    short = [engine.add([i + 1, 2, 3], 12) for i in range(3)]
    engine.step()
    long_prompt = [random.Random(0).randrange(64) for _ in range(40)]
    late = engine.add(long_prompt, 4)
    mixed = 0
    while engine.has_work:
        prefilling = [r for r in engine.running if r.rid == late and r.fed < len(r.feed)]
        decoding = {r.rid for r in engine.running if r.rid in short}
        n = len(rec.sizes)
        events = engine.step()
        if prefilling and decoding:
            mixed += 1
            assert len(rec.sizes) == n + 1 and rec.sizes[-1] <= 8
            assert decoding <= {rid for rid, _ in events}
    assert mixed >= 5
    want = [attnkit.generate(model, [[i + 1, 2, 3]], 12)[0] for i in range(3)]
    assert [engine.results[r] for r in short] == want
    assert engine.results[late] == attnkit.generate(model, [long_prompt], 4)[0]


def test_chunked_prefill_arguments(model):
    with pytest.raises(ValueError, match="max_batched_tokens=2 is below max_batch=4"):
        attnkit.Engine(model, cache_blocks=8, max_batch=4, max_batched_tokens=2)
    with pytest.raises(ValueError, match="max_batched_tokens"):
        attnkit.Engine(model, cache_blocks=8, max_batch=1, max_batched_tokens=0)
    with pytest.raises(TypeError, match="max_batched_tokens"):
        attnkit.Engine(model, cache_blocks=8, max_batched_tokens=8.0)
    with pytest.raises(ValueError, match="chunk_sizing='flops' must be 'tokens'"):
        attnkit.Engine(model, cache_blocks=8, max_batch=1, max_batched_tokens=8, chunk_sizing="flops")


def test_cost_sizing_gives_late_chunks_fewer_tokens_and_the_same_tokens(model):
    """chunk_sizing='cost': a chunk's tokens shrink as the keys it attends to grow, every step stays within the
    budget, and every request still gets its tokens alone."""
    rec = _Recorder(model)
    engine = attnkit.Engine(rec, cache_blocks=64, block_size=4, max_batch=3, max_batched_tokens=24, chunk_sizing="cost")
    engine._key_cost = 0.05  # (the tiny model's own is far smaller: make the keys weigh within 90 tokens)
    short = [engine.add([i + 1, 2, 3], 30) for i in range(2)]
    engine.step()
    long_prompt = [random.Random(0).randrange(64) for _ in range(90)]
    late = engine.add(long_prompt, 3)
    sizes = []
    while engine.has_work:
        req = next((r for r in engine.running if r.rid == late), None)
        fed = 0 if req is None else req.fed
        engine.step()
        if late not in engine.results or not sizes or sum(sizes) < len(long_prompt):
            now = next((r.fed for r in engine.running if r.rid == late), len(long_prompt))
            if now > fed:
                sizes.append(now - fed)
    assert max(rec.sizes) <= 24
    assert sum(sizes) == len(long_prompt) and len(sizes) >= 4
    assert sizes[0] > sizes[-2] and sizes[:-1] == sorted(sizes[:-1], reverse=True)  # (the last: what was left)
    assert [engine.results[r] for r in short] == [attnkit.generate(model, [[i + 1, 2, 3]], 30)[0] for i in range(2)]
    assert engine.results[late] == attnkit.generate(model, [long_prompt], 3)[0]


def test_chunk_len_follows_the_cost_model(model):
    engine = attnkit.Engine(model, cache_blocks=8, max_batch=1, max_batched_tokens=100, chunk_sizing="cost")
    engine._key_cost = 0.01
    for start in (0, 50, 400):
        n, cost = engine._chunk_len(start, 1000, 100.0)
        assert cost <= 100.0 < (n + 1) + 0.01 * ((n + 1) * start + (n + 1) * (n + 2) / 2)
    assert engine._chunk_len(10**6, 1000, 100.0)[0] == 1  # a prompt always advances
    assert engine._chunk_len(0, 7, 100.0) == (7, 7 + 0.01 * 28)
    tokens = attnkit.Engine(model, cache_blocks=8, max_batch=1, max_batched_tokens=100)
    assert tokens._chunk_len(400, 1000, 60.0) == (60, 60.0)


def test_chunked_engine_decodes_plain_steps_through_the_batched_path(model, monkeypatch):
    """A step with no prompt tokens is the Engine's ordinary decode step (weight copies, thread policy), not a
    packed forward."""
    from attnkit.cache import PagedCache

    packed = []
    real = PagedCache.packed
    monkeypatch.setattr(PagedCache, "packed", lambda self, *a: packed.append(a) or real(self, *a))
    engine = attnkit.Engine(model, cache_blocks=32, block_size=4, max_batch=2, max_batched_tokens=4)
    rids = [engine.add([1, 2, 3, 4, 5, 6], 6), engine.add([7, 8], 6)]
    engine.run()
    assert len(packed) == 2 and engine.stats["steps"] == 7  # two prefill steps (4 + 2 and 2 tokens), then decode
    assert [engine.results[r] for r in rids] == [
        attnkit.generate(model, [p], 6)[0] for p in ([1, 2, 3, 4, 5, 6], [7, 8])
    ]
