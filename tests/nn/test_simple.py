"""SingleHeadAttention (the article's worked example), AdditiveAttention (a written-out loop), AxialAttention."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnkit import masks
from attnkit.nn import AdditiveAttention, AxialAttention, MultiHeadAttention, SingleHeadAttention

D64 = torch.float64

# The first article, section 3: three tokens with d_model = 4, one head with d_k = 2.
X = [[1.0, 0.5, -0.2, 1.2], [0.3, -1.0, 0.8, 0.4], [-0.7, 0.6, 1.1, -0.5]]
W_Q = [[0.1, 0.4], [-0.2, 0.3], [0.5, -0.1], [0.2, 0.1]]
W_K = [[-0.3, 0.2], [0.1, 0.5], [0.4, -0.2], [-0.1, 0.3]]
W_V = [[0.2, -0.1], [0.3, 0.4], [-0.2, 0.1], [0.5, -0.3]]


def test_the_articles_worked_example_loads_into_a_single_head():
    head = SingleHeadAttention(4, 2).to(D64)
    with torch.no_grad():
        for p, w in ((head.W_q, W_Q), (head.W_k, W_K), (head.W_v, W_V)):
            p.copy_(torch.tensor(w, dtype=D64))
    x = torch.tensor(X, dtype=D64)
    q, k, v = head.project(x)
    torch.testing.assert_close(q, x @ torch.tensor(W_Q, dtype=D64), rtol=0, atol=0)
    # the article's hand computation of Q1 = x1 W_q: 0.1 - 0.1 - 0.1 + 0.24 and 0.4 + 0.15 + 0.02 + 0.12
    torch.testing.assert_close(q[0], torch.tensor([0.14, 0.69], dtype=D64), rtol=0, atol=1e-12)
    out, w = head(x, need_weights=True)
    s = (q @ k.T) / math.sqrt(2)
    torch.testing.assert_close(w, torch.softmax(s, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(head(x[None])[0], out, rtol=0, atol=1e-12)  # batched


def test_single_head_with_d_v_context_and_mask_goes_through_attend():
    head = SingleHeadAttention(6, 3, d_v=5).to(D64)
    calls = []
    head.register_attention_hook(lambda module, call, compute: calls.append(call.q.shape) or compute(call))
    x, ctx = torch.randn(2, 4, 6, dtype=D64), torch.randn(2, 7, 6, dtype=D64)
    out = head(x, ctx, mask=masks.key_padding([7, 3]))
    q, k, v = x @ head.W_q, ctx @ head.W_k, ctx @ head.W_v
    s = (q @ k.transpose(1, 2)) / math.sqrt(3)
    s[1, :, 3:] = float("-inf")
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=0, atol=1e-12)
    assert out.shape == (2, 4, 5) and calls == [torch.Size([2, 1, 4, 3])]
    with pytest.raises(ValueError, match="x has width 5"):
        head(torch.randn(2, 4, 5))


def additive_loop(att: AdditiveAttention, query, keys, values, allowed):
    """Bahdanau attention, one query and one key at a time."""
    B, Lq, Lk = query.shape[0], query.shape[1], keys.shape[1]
    out = torch.zeros(B, Lq, values.shape[-1], dtype=query.dtype)
    Wq, bq, Wk, v = att.W_q.weight, att.W_q.bias, att.W_k.weight, att.v
    for b, i in itertools.product(range(B), range(Lq)):
        scores = []
        for j in range(Lk):
            e = torch.dot(v, torch.tanh(Wq @ query[b, i] + bq + Wk @ keys[b, j]))
            scores.append(e if allowed[b, i, j] else torch.tensor(float("-inf"), dtype=query.dtype))
        scores = torch.stack(scores)
        if torch.isinf(scores).all():
            continue  # nothing to attend to: output 0
        a = torch.exp(scores - scores.max())
        a = a / a.sum()
        out[b, i] = sum(a[j] * values[b, j] for j in range(Lk))
    return out


@pytest.mark.parametrize("masking", ["none", "padding", "dense_with_empty_row"])
def test_additive_attention_matches_a_written_out_loop(masking):
    att = AdditiveAttention(q_dim=3, k_dim=5, hidden=4).to(D64)
    query, keys = torch.randn(2, 3, 3, dtype=D64), torch.randn(2, 4, 5, dtype=D64)
    values = torch.randn(2, 4, 6, dtype=D64)
    allowed = torch.ones(2, 3, 4, dtype=torch.bool)
    mask = None
    if masking == "padding":
        mask = masks.key_padding([4, 2])
        allowed[1, :, 2:] = False
    elif masking == "dense_with_empty_row":
        allowed = torch.rand(2, 3, 4) < 0.6
        allowed[0, 1] = False
        mask = allowed[:, None]  # (B, 1, Lq, Lk)
    out, w = att(query, keys, values, mask=mask, need_weights=True)
    torch.testing.assert_close(out, additive_loop(att, query, keys, values, allowed), rtol=0, atol=1e-12)
    assert w.shape == (2, 3, 4)
    out.sum().backward()
    assert att.v.grad is not None and att.W_k.weight.grad is not None


def test_additive_attention_errors():
    att = AdditiveAttention(3, 5, 4)
    with pytest.raises(ValueError, match="keys has width 3"):
        att(torch.randn(1, 2, 3), torch.randn(1, 4, 3))
    with pytest.raises(ValueError, match="values must have shape"):
        att(torch.randn(1, 2, 3), torch.randn(1, 4, 5), torch.randn(1, 3, 2))
    with pytest.raises(ValueError, match="mask does not fit"):
        att(torch.randn(1, 2, 3), torch.randn(1, 4, 5), mask=torch.ones(3, 3, dtype=torch.bool))


def axial_mask(shape, axis):
    """Over the flattened grid: token t may attend to token s iff they agree on every axis except ``axis``."""
    coords = torch.stack(torch.meshgrid(*[torch.arange(n) for n in shape], indexing="ij"), -1).reshape(-1, len(shape))
    same = coords[:, None, :] == coords[None, :, :]  # (N, N, n_axes)
    others = [d for d in range(len(shape)) if d != axis]
    return same[..., others].all(-1)


@pytest.mark.parametrize("shape,axes", [((3, 4), (1, 2)), ((2, 3, 4), (1, 2, 3)), ((2, 3, 4), (3,)), ((5, 2), (2,))])
def test_axial_attention_equals_full_attention_with_the_axial_mask(shape, axes):
    axial = AxialAttention(8, 2, axes=axes, n_kv_heads=1).to(D64)
    x = torch.randn(2, *shape, 8, dtype=D64)
    flat = x.reshape(2, -1, 8)  # (B, N, dim)
    expected = sum(mha(flat, mask=axial_mask(shape, a - 1)) for a, mha in zip(axes, axial.attn))
    torch.testing.assert_close(axial(x), expected.reshape(x.shape), rtol=0, atol=1e-12)


def test_axial_attention_causal_axes_and_errors():
    axial = AxialAttention(8, 2, mask=masks.causal()).to(D64)
    x = torch.randn(1, 3, 4, 8, dtype=D64)
    flat = x.reshape(1, -1, 8)
    causal = torch.arange(12)[:, None] >= torch.arange(12)[None, :]  # row-major order: causal on both axes
    expected = sum(m(flat, mask=axial_mask((3, 4), a) & causal) for a, m in enumerate(axial.attn))
    torch.testing.assert_close(axial(x), expected.reshape(x.shape), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="axes=\\(0, 1\\)"):
        AxialAttention(8, 2, axes=(0, 1))
    with pytest.raises(ValueError, match="repeats"):
        AxialAttention(8, 2, axes=(1, 1))
    with pytest.raises(ValueError, match="no axis 3"):
        AxialAttention(8, 2, axes=(1, 3))(torch.randn(1, 3, 4, 8))
    with pytest.raises(ValueError, match="x has width 6"):
        AxialAttention(8, 2)(torch.randn(1, 3, 4, 6))
    with pytest.raises(ValueError, match="one entry per sequence"):  # (it named the flattened batch of 6)
        AxialAttention(8, 2, mask=masks.key_padding([3, 2]))
    assert AxialAttention(8, 2)(torch.randn(2, 0, 5, 8)).shape == (2, 0, 5, 8)  # an empty grid (it crashed)
    assert isinstance(axial.attn[0], MultiHeadAttention)


def test_small_module_argument_errors():
    from attnkit.nn import AdditiveAttention, DecoderConfig, SingleHeadAttention

    with pytest.raises(TypeError, match="backend must be a string"):
        SingleHeadAttention(4, 2, backend=3)
    with pytest.raises(TypeError, match="values has dtype torch.int64"):
        AdditiveAttention(4, 4, 8)(torch.randn(1, 2, 4), torch.randn(1, 3, 4), torch.ones(1, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="t5_num_buckets=0"):
        DecoderConfig.preset("tiny", positions="t5", t5_num_buckets=0)
    with pytest.raises(ValueError, match="t5_max_distance=8.*must exceed"):
        DecoderConfig.preset("tiny", positions="t5", t5_max_distance=8)
    mha = MultiHeadAttention(16, 2, positions=None)
    with pytest.raises(ValueError, match="positions"):  # not read without rotary/sinusoidal, still checked
        mha(torch.randn(1, 4, 16), positions=torch.arange(7))


def test_threads_sharing_a_rotary_stack_leave_nothing_behind():
    """Concurrent Encoder forwards share one RotaryEmbedding: results stay exact and no forward's gathered
    tables stay attached afterwards (a thread restored another's share and kept its tensors alive)."""
    import threading

    from attnkit.nn import Encoder, RotaryEmbedding

    torch.manual_seed(0)
    rope = RotaryEmbedding(8)
    enc = Encoder(32, 1, 4, positions=rope).eval()
    xs = [torch.randn(1, n, 32) for n in (5, 9, 33)]
    with torch.no_grad():
        refs = [enc(x) for x in xs]
    bad = []

    def work(t):
        with torch.no_grad():
            for i in range(60):
                j = (i + t) % 3
                if not torch.allclose(enc(xs[j]), refs[j], atol=1e-6):
                    bad.append(j)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and rope._shared is None
