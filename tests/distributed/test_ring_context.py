"""ring_context: a model's attnkit.nn attention runs as ring attention while the context is active (one gloo
process here; tests/distributed/test_long_context_example.py runs it on two under torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from attnkit import masks
from attnkit.distributed import ring, ring_context, shard
from attnkit.nn import DecoderConfig, DecoderLM, MultiHeadAttention


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_every_attention_module_is_routed_and_restored(one_rank, monkeypatch):
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    ids = torch.randint(0, 256, (1, 16))
    expected = model(ids)
    calls = []
    real = ring.ring_attention

    def counting(*args, **kwargs):
        calls.append(kwargs["layout"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ring, "ring_attention", counting)
    with ring_context(model, layout="contiguous") as ctx:
        out = model(ids, positions=ctx.positions(16))
    assert ctx.modules == ["layers.0.attn", "layers.1.attn"] and calls == ["contiguous", "contiguous"]
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    model(ids)
    assert len(calls) == 2  # not routed any more
    assert ctx.positions(8).tolist() == shard(torch.arange(8), dim=0, layout="contiguous").tolist()


def test_a_model_with_attention_sinks_runs_in_the_ring(one_rank):
    """The wrapper passes the layers' learned sinks on (it took no ``sinks`` and raised TypeError)."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", attention_sinks=True, init_std=0.3)).eval()
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "sinks", None) is not None:
                m.sinks.normal_(0.0, 2.0)  # sinks that change the output
    ids = torch.randint(0, 256, (1, 16))
    expected = model(ids)
    with ring_context(model, layout="contiguous") as ctx:
        out = model(ids, positions=ctx.positions(16))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_a_hook_already_installed_stays_and_the_ring_goes_after_an_error(one_rank, monkeypatch):
    mha = MultiHeadAttention(16, 2, mask=masks.causal()).eval()
    x = torch.randn(1, 4, 16)
    expected = mha(x)
    seen = []
    mha.register_attention_hook(lambda module, call, compute: seen.append(call.q.shape) or compute(call))
    with pytest.raises(RuntimeError, match="boom"):
        with ring_context(mha):
            raise RuntimeError("boom")
    monkeypatch.setattr(ring, "ring_attention", lambda *a, **kw: pytest.fail("still routed to the ring"))
    torch.testing.assert_close(mha(x), expected, rtol=0, atol=0)
    assert seen == [(1, 2, 4, 8)]


def test_refusals(one_rank):
    mha = MultiHeadAttention(16, 2, dropout=0.1)  # training mode with attention dropout
    with ring_context(mha):
        with pytest.raises(ValueError, match="attention dropout 0.1.*model.eval"):
            mha(torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="has no attnkit.nn attention module"):
        with ring_context(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        with ring_context("model"):
            pass
    with pytest.raises(ValueError, match="layout"):
        with ring_context(mha, layout="spiral"):
            pass
    with ring_context(mha.eval()) as ctx:
        with pytest.raises(ValueError, match="local_len"):
            ctx.positions(-1)
        x = torch.randn(1, 4, 16)
        with pytest.raises(ValueError, match="need_weights=True would give the weights over this rank's keys"):
            mha(x, need_weights=True)
        with pytest.raises(ValueError, match="given a context"):
            mha(x, x)
        with pytest.raises(ValueError, match="given a KV cache"):
            mha(x, cache=object())
    out, w = mha(x, need_weights=True)  # outside the context: as before
    assert w.shape == (1, 2, 4, 4)


def test_the_long_context_example_uses_the_public_way():
    text = (Path(__file__).resolve().parents[2] / "examples" / "long_context.py").read_text()
    assert "ring_context(" in text and "_attend" not in text
