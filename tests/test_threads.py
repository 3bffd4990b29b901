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


def test_auto_keeps_the_faster_count_and_follows_a_change(two_threads):
    clock = FakeClock({1: 1.0, 2: 3.0})  # a busy core: one thread is faster
    policy = DecodeThreads("auto", clock=clock)
    counts = run_steps(policy, 6 + 40)
    assert sorted(counts[:6]) == [1, 1, 1, 2, 2, 2]  # probing: both counts in turn
    assert policy.chosen == 1 and counts[6:6 + _threads.RECHECK].count(1) == _threads.RECHECK
    assert 2 in counts[6 + _threads.RECHECK:]  # re-checked
    clock.cost = {1: 1.0, 2: 0.5}  # the machine became quiet: two threads win again
    counts = run_steps(policy, 3 * (_threads.RECHECK + 1))
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

    gen = importlib.import_module("attnkit.generate")  # (the module: attnkit.generate is the function)

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
