"""SinkCache (StreamingLLM): the first n_sink tokens plus a sliding window, at positions within the cache."""

import pytest
import torch

import attnkit
from attnkit.cache import SinkCache
from _models import tiny_decoder


def _model(positions="rope", **kw):
    return tiny_decoder(positions=positions, max_seq_len=256, **kw)


@pytest.mark.parametrize("positions", ["rope", "alibi"])
def test_within_capacity_it_decodes_like_the_static_cache(positions):
    model = _model(positions)
    prompt = [5, 9, 2, 33, 7]
    sink = attnkit.generate(model, [prompt], 20, cache=lambda m, b, L: SinkCache.for_model(m, 4, 40))[0]
    assert sink == attnkit.generate(model, [prompt], 20, cache="static")[0]


def test_past_the_window_generation_stays_finite_and_keeps_the_sinks():
    model = _model()
    cache = SinkCache.for_model(model, n_sink=4, window=12)
    prompt = [5, 9, 2, 33, 7, 1]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache)
        first = [layer.k[:, :, :4].clone() for layer in cache.layers]
        tok = int(logits[0, -1].argmax())
        for _ in range(60):  # far past n_sink + window = 16
            logits = model(torch.tensor([[tok]]), cache=cache)
            assert bool(torch.isfinite(logits).all())
            tok = int(logits[0, -1].argmax())
    for layer, f in zip(cache.layers, first):
        assert layer.k.shape[2] == 16 and layer.length == 66
        torch.testing.assert_close(layer.k[:, :, :4], f)  # the sink tokens stay, un-rotated as stored
    assert cache.seq_len == 15


def test_each_step_equals_a_fresh_forward_over_the_kept_tokens_for_one_layer():
    # one layer: a token's key and value depend only on the token itself, so the cached step must equal a
    # forward over exactly the kept tokens (positions 0..n-1: positions within the cache)
    model = tiny_decoder(n_layers=1, max_seq_len=256)
    n_sink, window = 3, 8
    cache = SinkCache.for_model(model, n_sink, window)
    seq = [4, 8, 15, 16, 23]
    with torch.no_grad():
        logits = model(torch.tensor([seq]), cache=cache)[0, -1]
        for _ in range(30):
            seq.append(int(logits.argmax()))
            logits = model(torch.tensor([seq[-1:]]), cache=cache)[0, -1]
            kept = seq if len(seq) <= n_sink + window else seq[:n_sink] + seq[-window:]
            ref = model(torch.tensor([kept]))[0, -1]
            torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_bad_use_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="does not fit"):
        model(torch.zeros(1, 20, dtype=torch.long), cache=SinkCache.for_model(model, 4, 8))
    with pytest.raises(ValueError, match="one length"):
        attnkit.generate(model, [[1, 2, 3], [4]], 3, cache=lambda m, b, L: SinkCache.for_model(m, 4, 8))
