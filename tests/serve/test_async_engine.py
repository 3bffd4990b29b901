"""AsyncEngine: the Engine driven from its own thread, fed from other threads and asyncio loops."""

import asyncio
import threading

import pytest
import torch

import attnkit
from attnkit.decoding import SamplingParams
from attnkit.nn import DecoderConfig, DecoderLM
from attnkit.serve import AsyncEngine, Overloaded

from .conftest import slow_steps

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.preset("tiny")).eval()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 200, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def _engine(model, **kw):
    kw.setdefault("cache_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_batch", 3)
    return attnkit.Engine(model, **kw)


def _slow(engine):
    slow_steps(engine)
    return engine


@pytest.mark.parametrize("chunked", [None, 6], ids=["whole-prefill", "chunked-prefill"])
def test_streams_from_many_threads_equal_generate_alone(model, chunked):
    prompts = _prompts(8)
    lengths = [3 + 2 * i for i in range(8)]
    out = {}
    with AsyncEngine(_engine(model, max_batched_tokens=chunked)) as engine:

        def client(i):
            stream = engine.submit(prompts[i], lengths[i])
            out[i] = (stream.tokens, [d.finish_reason for d in stream])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert engine.wait_idle()
        assert engine.stats()["blocks_used"] == 0
    for i in range(8):
        tokens, reasons = out[i]
        assert tokens == attnkit.generate(model, [prompts[i]], lengths[i])[0]
        assert reasons[-1] == "length" and reasons.count("length") == 1


def test_async_streams_and_logprobs(model):
    prompts = _prompts(6, seed=1)

    async def main(engine):
        async def one(p):
            stream = await engine.asubmit(p, 6, logprobs=2)
            lps = []
            async for d in stream:
                assert len(d.logprobs) == len(d.tokens)
                lps += d.logprobs
            return stream.tokens, lps

        return await asyncio.gather(*(one(p) for p in prompts))

    with AsyncEngine(_engine(model)) as engine:
        results = asyncio.run(main(engine))
    for p, (tokens, lps) in zip(prompts, results):
        ref = attnkit.generate(model, [p], 6, logprobs=2)
        assert tokens == ref.tokens[0]
        assert [lp.token for lp in lps] == tokens
        assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in ref.logprobs[0]], abs=1e-5)


def test_abort_frees_blocks_at_once_and_the_slot_goes_to_the_next(model):
    with AsyncEngine(_slow(_engine(model, max_batch=1))) as engine:
        long = engine.submit([1, 2, 3], 200)
        waiting = engine.submit([4, 5], 5)
        first = next(iter(long))
        assert first.tokens and engine.stats()["waiting"] == 1
        long.abort()
        deltas = list(waiting)
        assert deltas[-1].finish_reason == "length"
        assert waiting.tokens == attnkit.generate(model, [[4, 5]], 5)[0]
        assert long.finish_reason == "abort" and len(long.tokens) < 200
        assert engine.wait_idle()
        assert engine.stats()["blocks_used"] == 0 and engine.engine.cache.num_free_blocks == 64
        assert engine.finished == {"abort": 1, "length": 1}


def test_bad_arguments_raise_in_the_caller_and_the_worker_lives_on(model):
    with AsyncEngine(_engine(model)) as engine:
        with pytest.raises(ValueError, match="prompt"):
            engine.submit([], 3)
        with pytest.raises(ValueError, match="temperature"):
            engine.submit([1], 3, temperature=-1.0)
        assert list(engine.submit([1, 2], 2))[-1].finish_reason == "length"


def test_submit_takes_one_sampling_object_as_the_keywords(model):
    plain = attnkit.generate(model, [[1, 2, 3]], 12)[0]
    eos = plain[4]  # ends the stream early: its finish reason is "stop"
    kw = dict(temperature=0.0, eos_id=eos, logprobs=1)
    with AsyncEngine(_engine(model)) as engine:
        by_object = engine.submit([1, 2, 3], 12, sampling=SamplingParams(**kw))
        by_keywords = engine.submit([1, 2, 3], 12, **kw)
        list(by_object), list(by_keywords)
        assert by_object.tokens == by_keywords.tokens == plain[: plain.index(eos) + 1]
        assert by_object.finish_reason == by_keywords.finish_reason == "stop"
        with pytest.raises(TypeError, match="not both|pass one SamplingParams"):
            engine.submit([1], 3, sampling=SamplingParams(), seed=1)


def test_a_full_queue_is_refused(model):
    with AsyncEngine(_slow(_engine(model, max_batch=1)), max_waiting=1) as engine:
        a = engine.submit([1, 2], 200)
        next(iter(a))  # running
        b = engine.submit([3], 3)  # waits
        with pytest.raises(Overloaded, match="max_waiting=1"):
            engine.submit([4], 3)
        a.abort()
        assert list(b)[-1].finish_reason == "length"


def test_close_ends_every_stream(model):
    engine = AsyncEngine(_engine(model, max_batch=1))
    a, b = engine.submit([1, 2], 200), engine.submit([3], 200)
    engine.close()
    assert a.finish_reason == "abort" and b.finish_reason == "abort"
    assert list(b)[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1], 2)


def test_a_failing_step_ends_its_requests_with_an_error_not_the_worker(model, caplog):
    engine = _engine(model)
    real, calls = engine.step, []

    def flaky():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real()

    engine.step = flaky
    with AsyncEngine(engine) as ae:
        s = ae.submit([1, 2, 3], 10)
        last = list(s)[-1]
        assert last.finish_reason == "error" and "boom" in last.error
        assert ae.stats()["blocks_used"] == 0
        after = ae.submit([1, 2, 3], 4)
        assert list(after)[-1].finish_reason == "length"
        assert after.tokens == attnkit.generate(model, [[1, 2, 3]], 4)[0]
    assert "engine step failed" in caplog.text


def test_zero_new_tokens_finishes_at_once(model):
    with AsyncEngine(_engine(model)) as engine:
        s = engine.submit([1, 2], 0)
        assert [d.finish_reason for d in s] == ["length"] and s.tokens == []


def test_a_stream_from_a_thread_is_not_async_iterable(model):
    with AsyncEngine(_engine(model)) as engine:
        s = engine.submit([1, 2], 1)
        with pytest.raises(RuntimeError, match="asubmit"):
            s.__aiter__()
        list(s)


def test_engine_must_be_an_engine(model):
    with pytest.raises(TypeError, match="attnkit.Engine"):
        AsyncEngine(model)
    with pytest.raises(ValueError, match="max_waiting"):
        AsyncEngine(_engine(model), max_waiting=-1)


def test_one_wakeup_of_the_loop_per_step_for_all_its_streams(model):
    prompts = _prompts(4, seed=5)

    async def main(engine):
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kw):
            if threading.current_thread().name == "attnkit-engine":
                wakeups.append(callback)
            return real(callback, *args, **kw)

        loop.call_soon_threadsafe = counting
        try:
            streams = [await engine.asubmit(p, 6) for p in prompts]
            for s in streams:
                async for _ in s:
                    pass
        finally:
            del loop.call_soon_threadsafe
        return streams, wakeups

    with AsyncEngine(_slow(_engine(model, max_batch=4))) as engine:
        streams, wakeups = asyncio.run(main(engine))
        steps = engine.engine.stats["steps"]
    assert [s.tokens for s in streams] == [attnkit.generate(model, [p], 6)[0] for p in prompts]
    deliveries = [cb for cb in wakeups if getattr(cb, "__name__", "") in ("set", "_set_all")]
    assert steps >= 6 and len(deliveries) <= steps  # 4 streams got a token at most steps, woken together
