"""The decode-step thread policy: measured on the live steps, and the caller's thread count given back."""

import pytest
import torch

import attnkit
from attnkit import _threads
from attnkit._threads import DecodeThreads
from attnkit.nn import DecoderConfig, DecoderLM


class FakeClock:
    """Steps take ``cost[threads]`` seconds of this clock."""

    def __init__(self, cost):
        self.cost, self.now = cost, 0.0

    def __call__(self):
        self.now += self.cost[torch.get_num_threads()] / 2  # read twice a step
        return self.now


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def run_steps(policy, n):
    counts = []
    for _ in range(n):
        with policy.step():
            counts.append(torch.get_num_threads())
        assert torch.get_num_threads() == 2  # the caller's count between steps
    return counts


def test_a_clear_difference_decides_after_one_round(two_threads):
    policy = DecodeThreads("auto", clock=FakeClock({1: 1.0, 2: 3.0}))  # a busy core: one thread is faster
    counts = run_steps(policy, 3)
    assert counts == [2, 2, 1]  # an untimed first step at the caller's count, then one step at each count
    assert policy.chosen == 1
    assert run_steps(policy, _threads.RECHECK) == [1] * _threads.RECHECK


def test_the_first_step_is_not_timed(two_threads):
    clock = FakeClock({1: 1.0, 2: 0.5})
    first = {2: 50.0, 1: 1.0}  # the first step pays one-time costs (weight copies, kernel setup)
    policy = DecodeThreads("auto", clock=clock)
    clock.cost, quiet = first, clock.cost
    run_steps(policy, 1)
    clock.cost = quiet
    run_steps(policy, 2)
    assert policy.chosen == 2


def test_close_counts_are_probed_for_more_rounds_and_the_medians_decide(two_threads):
    clock = FakeClock({1: 1.0, 2: 0.9})  # within MARGIN of each other
    policy = DecodeThreads("auto", clock=clock)
    counts = run_steps(policy, 1 + 2 * _threads.PROBE)
    assert sorted(counts[1:]) == [1] * _threads.PROBE + [2] * _threads.PROBE
    assert policy.chosen == 2
    assert run_steps(policy, 5) == [2] * 5


def test_rechecks_grow_further_apart_while_the_choice_holds(two_threads):
    policy = DecodeThreads("auto", clock=FakeClock({1: 1.0, 2: 3.0}))
    run_steps(policy, 3)
    counts = run_steps(policy, 2000)
    rechecks = [i for i, c in enumerate(counts) if c == 2]
    gaps = [b - a - 1 for a, b in zip([-1] + rechecks, rechecks)]
    assert gaps[:4] == [32, 64, 128, 256] and set(gaps[4:]) == {_threads.RECHECK_MAX}
    assert policy.chosen == 1


def test_a_machine_that_becomes_busy_is_followed_within_a_few_steps(two_threads):
    clock = FakeClock({1: 1.5, 2: 1.0})  # quiet: two threads are faster
    policy = DecodeThreads("auto", clock=clock)
    run_steps(policy, 3 + 600)  # the re-checks are far apart by now
    assert policy.chosen == 2
    clock.cost = {1: 1.5, 2: 4.0}  # another process takes a core
    counts = run_steps(policy, 4)
    assert counts == [2, 2, 1, 1] and policy.chosen == 1  # two slow steps, a re-check, then one thread


def test_steps_that_slow_down_at_every_count_cost_one_recheck(two_threads):
    clock = FakeClock({1: 1.5, 2: 1.0})
    policy = DecodeThreads("auto", clock=clock)
    run_steps(policy, 3 + 10)
    clock.cost = {1: 3.0, 2: 2.0}  # e.g. a longer cache: every count slower, two threads still faster
    counts = run_steps(policy, _threads.RECHECK)
    assert counts.count(1) == 1 and policy.chosen == 2


def test_a_single_slow_step_does_not_trigger_a_recheck(two_threads):
    clock = FakeClock({1: 1.5, 2: 1.0})
    policy = DecodeThreads("auto", clock=clock)
    run_steps(policy, 3 + 10)
    for _ in range(5):
        clock.cost = {1: 1.5, 2: 5.0}
        run_steps(policy, 1)
        clock.cost = {1: 1.5, 2: 1.0}
        assert run_steps(policy, 3) == [2, 2, 2]


def test_a_machine_that_becomes_quiet_is_followed_at_the_next_recheck(two_threads):
    clock = FakeClock({1: 1.0, 2: 3.0})
    policy = DecodeThreads("auto", clock=clock)
    run_steps(policy, 3 + 40)
    assert policy.chosen == 1
    clock.cost = {1: 1.0, 2: 0.5}  # the busy process ended: two threads win again
    counts = run_steps(policy, 2 * _threads.RECHECK + 2)
    assert policy.chosen == 2 and counts[-5:] == [2] * 5


def test_the_caller_count_is_given_back_on_error_and_fixed_counts(two_threads):
    policy = DecodeThreads(1)
    with pytest.raises(RuntimeError, match="boom"):
        with policy.step():
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    with DecodeThreads(None).step():
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", ["fast", 0, -1, True, 1.5])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="decode_threads=.* must be 'auto'"):
        DecodeThreads(bad)
    model = DecoderLM(DecoderConfig.preset("tiny"))
    with pytest.raises(ValueError, match="decode_threads"):
        attnkit.generate(model, [[1, 2]], 2, decode_threads=bad)


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_generate_and_engine_decode_at_the_policy_count_and_restore_the_callers(two_threads, cache):
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
    try:
        ref = attnkit.generate(model, [[1, 2, 3]], 12, cache=cache, decode_threads=None)
        seen.clear()
        out = attnkit.generate(model, [[1, 2, 3]], 12, cache=cache, decode_threads=1)
        assert out == ref and seen[0] == 2 and set(seen[1:]) == {1}  # prefill at the caller's count
        assert torch.get_num_threads() == 2
        assert attnkit.generate(model, [[1, 2, 3]], 12, cache=cache) == ref  # "auto"
        assert torch.get_num_threads() == 2
        seen.clear()
        engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2, decode_threads=1)
        rid = engine.add([1, 2, 3], 12)
        assert engine.run()[rid] == ref[0] and 1 in seen and torch.get_num_threads() == 2
    finally:
        hook.remove()


def test_generate_keeps_what_it_measured_for_the_next_generation_of_that_batch_size(two_threads):
    import importlib

    gen = importlib.import_module("attnkit.decoding.generation")

    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    attnkit.generate(model, [[1, 2, 3]], 10)
    policy = gen._THREADS[model][1]
    steps = policy._steps
    assert steps == 9 and policy.chosen in (1, 2)
    attnkit.generate(model, [[4, 5, 6]], 10)
    assert gen._THREADS[model][1] is policy and policy._steps == steps + 9  # no new probing
    attnkit.generate(model, [[1], [2]], 4)
    assert gen._THREADS[model][2] is not policy  # another batch size measures for itself
    assert torch.get_num_threads() == 2


def test_follow_runs_at_the_chosen_count_untimed_and_gives_the_callers_back(two_threads):
    policy = DecodeThreads("auto", clock=FakeClock({1: 1.0, 2: 3.0}))
    with policy.follow():  # nothing chosen yet: the caller's count
        assert torch.get_num_threads() == 2
    run_steps(policy, 3)  # untimed first step, then one round: 1 thread is clearly faster
    steps = policy._steps
    with policy.follow():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2 and policy._steps == steps  # not a step of the policy
    with pytest.raises(RuntimeError, match="boom"):
        with DecodeThreads(1).follow():
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    with DecodeThreads(None).follow():
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("chunked", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_engine_prefills_at_the_decode_steps_count(two_threads, chunked):
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    ref = attnkit.generate(model, [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], 6, decode_threads=None)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append((a[0].shape, torch.get_num_threads())))
    try:
        engine = attnkit.Engine(
            model, cache_blocks=16, block_size=4, max_batch=2, decode_threads=1, max_batched_tokens=chunked
        )
        rids = [engine.add([1, 2, 3], 6), engine.add([4, 5, 6, 7, 8, 9, 10, 11, 12, 13], 6)]
        done = engine.run()
        assert [done[r] for r in rids] == ref
        assert any(shape[-1] > 1 for shape, _ in seen)  # forwards with prompt tokens ran ...
        assert {n for _, n in seen} == {1}  # ... at the count the decode steps use, like the decode steps
        assert torch.get_num_threads() == 2
    finally:
        hook.remove()


def test_the_policy_says_what_it_chose_and_what_it_measured(two_threads):
    policy = DecodeThreads("auto", clock=FakeClock({1: 1e-3, 2: 3e-3}))  # a busy core: one thread is faster
    assert "until the steps have been timed" in str(policy)
    run_steps(policy, 2)
    assert str(policy).startswith("decode threads: deciding (round 1 of at most 3)")
    run_steps(policy, 1)
    text = str(policy)
    assert text.startswith("decode threads: 1 of the caller's 2, the fastest by median step time")
    assert f"tried again in {_threads.RECHECK} steps" in text
    assert "1 thread 0.50 ms, 2 threads 1.50 ms (3 steps run)" in text  # (a step: half its cost, read twice)
    assert str(DecodeThreads(1)) == "decode threads: 1, as asked (decode_threads=1)"
    assert "left alone" in str(DecodeThreads(None))
