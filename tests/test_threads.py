"""The decode-step thread policy: measured on the live steps, and the caller's thread count given back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import _threads
from attnkit._threads import DecodeThreads
from attnkit.nn import DecoderConfig, DecoderLM, clear_decode_choices, decode_products


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


# --- the chosen counts kept per machine between processes -------------------------------------------------------

STEP = "a test model, width 8; batch 1"  # a step shape (attnkit._threads.step_shape's form)
QUIET = {1: 1.0, 2: 0.5}  # two threads clearly faster
ONE_WINS = {1: 1.0, 2: 1.5}  # one thread faster, two only 1.5x slower: no sign of a busy core
BUSY = {1: 1.0, 2: 3.0}  # two threads 3x slower than one: a core busy with another process


@pytest.fixture
def stored(monkeypatch, tmp_path, two_threads):
    """Thread choices stored under tmp_path, with a fresh process's state (``fresh()`` starts another: nothing
    in memory, the file not read yet); ``written()``: whether the file was written since the last call (each
    write moves a new file into place)."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path))
    last = [None]

    def written() -> bool:
        files = list(tmp_path.glob("decode-choices-*.json"))
        now = files[0].stat().st_ino if files else None
        changed, last[0] = now != last[0], now
        return changed

    def fresh():
        monkeypatch.setattr(_threads, "_CHOICES", {})
        monkeypatch.setattr(_threads, "_FILES", {})
        monkeypatch.setattr(_threads, "_PROBLEM", [])

    fresh()
    return fresh, written


def _record(tmp_path, key=f"threads {STEP}@2"):
    (found,) = tmp_path.glob("decode-choices-*.json")
    return json.loads(found.read_text())["choices"].get(key)


def test_a_decision_is_stored_and_a_new_process_starts_from_it(stored, tmp_path):
    fresh, written = stored
    policy = DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP)
    assert run_steps(policy, 3) == [2, 2, 1]  # untimed first step, one round, decided
    assert _record(tmp_path) == {"threads": 1, "seconds": {"1": 0.5, "2": 0.75}, "fastest": {"1": 0.5, "2": 0.75}}
    assert written() and run_steps(policy, 10) == [1] * 10 and not written()  # (nothing written per step)

    fresh()  # another process on the same machine
    policy = DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP)
    assert run_steps(policy, 1 + _threads.RECHECK) == [2] + [1] * _threads.RECHECK  # no probing round
    assert str(policy).startswith("decode threads: 1 of the caller's 2, stored by an earlier process")
    (choice,) = decode_products().threads
    assert choice.origin == "stored" and choice.threads == 1 and choice.seconds == {1: 0.5, 2: 0.75}
    assert run_steps(policy, 2) == [2, 1]  # the periodic re-check still runs; it agrees: nothing written
    assert policy.chosen == 1 and not written()
    other = DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape="another model; batch 1")
    assert run_steps(other, 3) == [2, 2, 1]  # another step shape: probed for itself


def test_a_new_process_generates_at_the_stored_count_without_probing(stored, tmp_path):
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    shape = _threads.step_shape(model, "generate, batch 1")
    assert "DecoderLM" in shape and "batch 1" in shape
    run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=shape), 3)  # stores 1 thread for its steps
    child = """
import torch
import attnkit
from attnkit import _threads
from attnkit.nn import DecoderConfig, DecoderLM, decode_products
_threads.SLOWER = float("inf")  # (no re-check for steps slowed by the machine's load: this test's steps are real)
torch.set_num_threads(2)
torch.manual_seed(0)
model = DecoderLM(DecoderConfig.preset("tiny")).eval()
seen = []
model.register_forward_pre_hook(lambda m, a: seen.append(torch.get_num_threads()))
attnkit.generate(model, [[1, 2, 3]], 10)
print(seen)
print([(c.origin, c.threads) for c in decode_products().threads])
"""
    env = {**os.environ, "ATTNKIT_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(_threads.__file__).parents[1]), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # the prefill and the untimed first decode step at the caller's 2, then the stored count (probing would run
    # the next step at 2)
    assert out.stdout.splitlines() == [str([2, 2] + [1] * 8), "[('stored', 1)]"]


@pytest.mark.parametrize(
    "now, why",
    [(BUSY, "2 threads ran 3.0x slower than 1"), (ONE_WINS, "2 threads ran 3.0x slower against 1 than when")],
    ids=["slower-than-one-thread", "slower-than-stored"],
)
def test_a_recheck_on_a_busy_core_changes_the_count_but_not_the_file(stored, tmp_path, now, why):
    fresh, written = stored
    run_steps(DecodeThreads("auto", clock=FakeClock(QUIET), shape=STEP), 3)
    assert _record(tmp_path)["threads"] == 2 and written()
    fresh()
    policy = DecodeThreads("auto", clock=FakeClock(now), shape=STEP)  # busy from the start: no slowdown seen
    counts = run_steps(policy, 2 + _threads.RECHECK + 3)
    assert counts[: 2 + _threads.RECHECK] == [2] * (1 + _threads.RECHECK) + [1]  # the periodic re-check ...
    assert policy.chosen == 1 and counts[-3:] == [1] * 3  # ... moves this process to one thread ...
    assert _record(tmp_path)["threads"] == 2 and not written()  # ... and leaves the file as it was
    (choice,) = decode_products().threads
    assert choice.origin == "measured" and choice.threads == 1 and why in choice.unstored
    assert f"not stored: {why}" in str(decode_products()) and "the file keeps 2" in str(choice)


def test_a_recheck_without_signs_of_a_busy_core_updates_the_file(stored, tmp_path):
    fresh, written = stored
    run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP), 3)
    assert _record(tmp_path)["threads"] == 1 and written()
    fresh()
    policy = DecodeThreads("auto", clock=FakeClock(QUIET), shape=STEP)  # quieter now: two threads win
    run_steps(policy, 2 + _threads.RECHECK)
    assert policy.chosen == 2 and _record(tmp_path)["threads"] == 2 and written()
    assert "(measured now, stored)" in str(decode_products())


def test_steps_whose_fastest_disagree_with_their_medians_are_not_stored(stored, tmp_path):
    clock = FakeClock({1: 1.0, 2: 0.9})  # close: every round runs, the medians decide
    policy = DecodeThreads("auto", clock=clock, shape=STEP)
    run_steps(policy, 1 + 2 * (_threads.PROBE - 1))
    clock.cost = {1: 0.5, 2: 0.9}  # one quick one-thread step in the last round (medians still pick 2)
    run_steps(policy, 2)
    assert policy.chosen == 2 and not list(tmp_path.glob("decode-choices-*.json"))
    assert "its fastest steps pick 1 thread(s)" in decode_products().threads[0].unstored


def test_clear_decode_choices_forgets_the_stored_counts(stored, tmp_path):
    fresh, _ = stored
    run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP), 3)
    assert decode_products().threads and _record(tmp_path)
    assert clear_decode_choices() is not None
    assert decode_products().threads == () and not list(tmp_path.glob("decode-choices-*.json"))
    assert run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP), 3) == [2, 2, 1]  # probed again


def test_storing_off_or_no_shape_reads_and_writes_nothing(stored, tmp_path, monkeypatch):
    fresh, written = stored
    run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS)), 3)  # no shape: nothing kept
    assert decode_products().threads == () and not list(tmp_path.iterdir())
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", "")
    run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP), 3)
    assert not list(tmp_path.iterdir())
    (choice,) = decode_products().threads
    assert "storing is off" in choice.unstored and decode_products().file is None


def test_a_malformed_stored_count_is_probed_again(stored, tmp_path):
    fresh, _ = stored
    run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP), 3)
    (found,) = tmp_path.glob("decode-choices-*.json")
    data = json.loads(found.read_text())
    data["choices"][f"threads {STEP}@2"]["threads"] = 7  # not a count these steps try
    found.write_text(json.dumps(data))
    fresh()
    assert run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP), 3) == [2, 2, 1]


def test_decode_products_lists_the_thread_counts_with_their_step_times(stored):
    run_steps(DecodeThreads("auto", clock=FakeClock(ONE_WINS), shape=STEP), 3)
    text = str(decode_products())
    assert "Decode-step thread counts (decode_threads='auto')" in text
    assert (
        f"  {STEP}, 2 threads available: 1, the fastest by median step time; median step 1 thread 500.00 ms, " in text
    )
    assert "2 threads 750.00 ms (measured now, stored)" in text


def test_generate_and_engine_choices_are_listed_by_model_and_batch(two_threads, monkeypatch):
    monkeypatch.setattr(_threads, "_CHOICES", {})  # (earlier tests' tiny models have the same shape)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    attnkit.generate(model, [[1, 2, 3]], 10)  # 9 decode steps: the probing ends within PROBE rounds
    engine = attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)
    engine.add([1, 2, 3], 12)
    engine.run()
    listed = [c for c in decode_products().threads if c.step.startswith(_threads.step_shape(model, "")[:-2])]
    assert {c.step.rsplit("; ", 1)[1] for c in listed} == {"generate, batch 1", "Engine, up to 2 rows"}
    assert all(c.available == 2 and c.threads in (1, 2) and set(c.seconds) == {1, 2} for c in listed)
    assert all(c.unstored.startswith("storing is off") for c in listed)  # (the suite stores nothing)
