"""MoBA, NSA and DSA attention under torch.compile: one graph (fullgraph=True), forward and backward equal to
eager."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.nn import DeepSeekSparseAttention, IndexerConfig, MoBAAttention, NSAAttention, RotaryEmbedding

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _moba():
    return MoBAAttention(32, 4, 2, block=4, top_k=2, positions=RotaryEmbedding(8))


def _nsa():
    return NSAAttention(
        32,
        4,
        2,
        compress_block=4,
        compress_stride=2,
        select_block=4,
        select_count=3,
        window=5,
        positions=RotaryEmbedding(8),
    )


def _dsa():
    dims = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)
    return DeepSeekSparseAttention(
        32,
        4,
        **dims,
        q_lora_rank=24,
        positions=RotaryEmbedding(8, interleaved=True),
        mask=masks.causal(),
        indexer=IndexerConfig(4, 8, 16),
    )


@pytest.mark.parametrize("build", [_moba, _nsa, _dsa], ids=["moba", "nsa", "dsa"])
def test_compiles_in_one_graph_forward_and_backward(build):
    torch.manual_seed(0)
    m = build()
    x = torch.randn(2, 23, 32, requires_grad=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    out, ref = compiled(x), m(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    wrt = [x, *m.parameters()]
    grads = torch.autograd.grad(out.square().sum(), wrt, allow_unused=True)
    want = torch.autograd.grad(ref.square().sum(), wrt, allow_unused=True)
    assert sum(g is not None for g in grads) > 3
    for p, g, w in zip(wrt, grads, want):  # a part the output does not reach (DSA's indexer): None or zeros
        zero = torch.zeros_like(p)
        torch.testing.assert_close(zero if g is None else g, zero if w is None else w, rtol=1e-4, atol=1e-5)
