"""Chunked prefill over a PagedCache: a prompt chunk's attention over its sequence's keys (the fused split
kernel against the float64 oracle), the copy of a sequence's blocks into the workspace, and packed forwards
mixing decode tokens with chunks under every kind of layer mask and bias."""

import pytest
import torch

from attnkit import masks
from attnkit.backends import paged as kernel
from attnkit.cache import PagedCache
from attnkit.nn import DecoderConfig, DecoderLM
from attnkit.testing import check_against_oracle, random_qkv

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread is faster
needs_fused = pytest.mark.skipif(kernel._fused_cpu() is None, reason="this PyTorch build has no fused CPU flash kernel")


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("n,L", [(1, 9), (5, 5), (7, 40), (16, 300)])
@pytest.mark.parametrize("causal", [True, False])
def test_attend_chunk_meets_the_numerical_rule(dtype, hq, hkv, n, L, causal):
    """The chunk's queries are the last n positions of L: with a bottom-right causal mask the keys before the
    chunk and the chunk's own (causal) keys are two kernel calls merged by their log-sum-exps."""
    q, k, v = random_qkv(1, hq, hkv, n, L, 16, dtype=dtype, seed=n + L)
    mask = masks.causal() if causal else None

    def fn(q, k, v, mask=None):
        assert kernel.takes_chunk(q, k, v, mask=mask, bias=None, softcap=None)
        return kernel.attend_chunk(q, k, v, scale=16**-0.5, causal=mask is not None)

    check_against_oracle(fn, q, k, v, mask=mask)


def test_takes_chunk_leaves_other_calls_to_attention():
    q, k, v = random_qkv(1, 4, 2, 3, 8, 16)
    assert kernel.takes_chunk(q, k, v, mask=masks.causal(), bias=None, softcap=None)
    assert not kernel.takes_chunk(q, k, v, mask=masks.sliding_window(4), bias=None, softcap=None)
    assert not kernel.takes_chunk(q, k, v, mask=masks.causal(align="top_left"), bias=None, softcap=None)
    assert not kernel.takes_chunk(q, k, v, mask=None, bias=None, softcap=30.0)
    assert not kernel.takes_chunk(q, k, v[..., :8], mask=None, bias=None, softcap=None)  # Dv != D
    assert not kernel.takes_chunk(q.requires_grad_(), k, v, mask=None, bias=None, softcap=None)


@pytest.mark.parametrize("L", [1, 4, 13, 23])
def test_gather_positions_copies_a_fragmented_sequence_in_position_order(L):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(12, 2, 4, 8, generator=g)
    table = [7, 8, 2, 3, 4, 11]  # runs (7, 2), (2, 3), (11, 1)
    want = torch.stack([pool[table[p // 4], :, p % 4] for p in range(L)], dim=1)  # (Hkv, L, D)
    out = torch.full((2, L, 8), float("nan"))
    got = kernel.gather_positions(pool, kernel.block_runs(table[: -(-L // 4)]), L, out)
    assert got is out and torch.equal(got, want)


def _model(**over):
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig.preset("tiny", vocab_size=64, init_std=0.1, **over)).double().eval()


@pytest.mark.parametrize(
    "over, fused_calls",
    [
        ({}, 4),  # bottom-right causal: the fused split kernel, 2 chunks x 2 layers
        ({"n_kv_heads": 1}, 4),
        ({"positions": "alibi"}, 0),  # a bias: attention() on the workspace copy
        ({"n_layers": 2, "layer_masks": (masks.sliding_window(5), None)}, 2),  # the causal layer only
    ],
)
def test_packed_forward_gives_each_sequence_its_logits_alone(over, fused_calls, monkeypatch):
    """Decode tokens of two sequences and chunks of two prompts (one fragmented across the pool, one long
    enough to grow the workspace) in one forward equal each sequence's forward alone."""
    calls = []
    real = kernel.attend_chunk
    monkeypatch.setattr(kernel, "attend_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model(**over)
    pool = PagedCache.for_model(model, num_blocks=40, block_size=4)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (6, 9, 11, 30)]
    ids = [pool.add_sequence() for _ in seqs]
    with torch.no_grad():
        for sid, toks, n in zip(ids, seqs, (5, 8, 3, 0)):  # prefill the stored part of each
            if n:
                view = pool.batch([sid])
                model(torch.tensor([toks[:n]]), cache=view, positions=view.positions(n))
        new = [1, 1, 8, 30]  # two decode tokens, a chunk after a 3-token prefix, a whole 30-token prompt
        packed = pool.packed(ids, new)
        flat = [t for toks, n in zip(seqs, new) for t in toks[len(toks) - n :]]
        got = model(torch.tensor([flat]), cache=packed, positions=packed.positions())[0]  # (T, V)
        o = 0
        for toks, n in zip(seqs, new):
            alone = model(torch.tensor([toks]))[0, len(toks) - n :]
            torch.testing.assert_close(got[o : o + n], alone, rtol=1e-9, atol=1e-9)
            o += n
    assert [pool.length(s) for s in ids] == [len(t) for t in seqs]
    assert len(calls) == (fused_calls if kernel._fused_cpu() is not None else 0)
