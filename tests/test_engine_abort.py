"""Engine.abort: a waiting or running request leaves at once, its blocks back in the pool, the others unchanged."""

import pytest
import torch

import attnkit
from attnkit.nn import DecoderConfig, DecoderLM

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.preset("tiny")).eval()


@pytest.mark.parametrize("chunked", [None, 8])
def test_abort_running_frees_its_blocks_and_admits_the_next(model, chunked):
    engine = attnkit.Engine(model, cache_blocks=32, block_size=4, max_batch=1, max_batched_tokens=chunked)
    a = engine.add(list(range(1, 20)), 40)
    b = engine.add([4, 5, 6], 6)
    engine.step()
    assert [r.rid for r in engine.running] == [a] and engine.cache.stats()["blocks_used"] > 0
    assert engine.abort(a)
    assert engine.cache.stats()["blocks_used"] == 0 and engine.cache.num_free_blocks == 32
    assert not engine.running and [r.rid for r in engine.waiting] == [b]
    engine.step()
    assert [r.rid for r in engine.running] == [b]  # the freed slot went to the waiting request
    done = engine.run()
    assert a not in done and done[b] == attnkit.generate(model, [[4, 5, 6]], 6)[0]
    assert not engine.abort(a)  # gone already


def test_abort_waiting_finished_and_unknown(model):
    engine = attnkit.Engine(model, cache_blocks=32, block_size=4, max_batch=1)
    a, b, c = engine.add([1, 2], 3, logprobs=1), engine.add([3], 3), engine.add([5, 6], 3)
    assert engine.abort(b)
    done = engine.run()
    assert sorted(done) == [a, c]
    assert engine.token_logprobs(a) and len(engine.token_logprobs(a)) == 3
    assert engine.abort(a) and a not in engine.results and a not in engine.logprobs
    assert not engine.abort(99)
    assert engine.take(c) == attnkit.generate(model, [[5, 6]], 3)[0]


def test_token_logprobs_while_running(model):
    engine = attnkit.Engine(model, cache_blocks=32, block_size=4, max_batch=2)
    rid = engine.add([1, 2, 3], 5, logprobs=0)
    engine.step()
    engine.step()
    assert [lp.token for lp in engine.token_logprobs(rid)] == engine.running[0].out
    with pytest.raises(KeyError, match="no request 7"):
        engine.token_logprobs(7)
