"""Stable softmax, log-sum-exp and the merge of partial attention results."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit.softmax import logsumexp, merge, stable_softmax

INF = float("inf")


def test_stable_softmax_survives_huge_scores():
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4]])
    p = stable_softmax(x)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p, torch.softmax(x.double(), -1).float())
    naive = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)
    assert torch.isnan(naive).any()  # what the articles warn about


def test_stable_softmax_all_masked_row_is_zero_with_zero_grad():
    x = torch.tensor([[-INF, -INF, -INF], [0.0, 1.0, -INF]], requires_grad=True)
    p = stable_softmax(x)
    assert p[0].tolist() == [0.0, 0.0, 0.0]
    (p * torch.randn(2, 3)).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[0] == 0).all()


def test_softmax_of_the_article_example():
    # section 2.3 of the first article: scores [2.0, -1.0, 0.5] -> about [0.79, 0.04, 0.18]
    p = stable_softmax(torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64))
    expected = torch.exp(torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(p, expected / expected.sum())
    assert abs(p.sum().item() - 1) < 1e-12


def test_logsumexp():
    x = torch.tensor([[1000.0, 1000.0], [-INF, -INF], [0.0, -INF]], dtype=torch.float64)
    out = logsumexp(x)
    assert out[0].item() == pytest.approx(1000 + torch.log(torch.tensor(2.0)).item())
    assert out[1].item() == -INF
    assert out[2].item() == 0.0


@given(
    n=st.integers(1, 12),
    split=st.integers(0, 12),
    dv=st.integers(1, 5),
    mask_a=st.booleans(),
    mask_b=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_merge_equals_attention_over_the_union(n, split, dv, mask_a, mask_b, seed):
    split = min(split, n)
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(3, n, generator=g, dtype=torch.float64) * 5
    v = torch.randn(n, dv, generator=g, dtype=torch.float64)
    if mask_a:
        s[:, :split] = -INF
    if mask_b:
        s[:, split:] = -INF

    def part(sl):
        ss, vv = s[:, sl], v[sl]
        return stable_softmax(ss) @ vv if ss.shape[1] else torch.zeros(3, dv, dtype=torch.float64), logsumexp(
            ss
        ) if ss.shape[1] else torch.full((3,), -INF, dtype=torch.float64)

    out, lse = merge(*part(slice(0, split)), *part(slice(split, n)))
    torch.testing.assert_close(out, stable_softmax(s) @ v, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, logsumexp(s), atol=1e-12, rtol=0)


def test_merge_with_empty_side_is_exact_and_keeps_dtype():
    out = torch.randn(2, 4, 3, dtype=torch.bfloat16)
    lse = torch.randn(2, 4)
    empty_out = torch.zeros(2, 4, 3, dtype=torch.bfloat16)
    empty_lse = torch.full((2, 4), -INF)
    m_out, m_lse = merge(out, lse, empty_out, empty_lse)
    assert m_out.dtype == torch.bfloat16 and m_lse.dtype == torch.float32
    assert torch.equal(m_out, out) and torch.equal(m_lse, lse)
    both_out, both_lse = merge(empty_out, empty_lse, empty_out, empty_lse)
    assert (both_out == 0).all() and (both_lse == -INF).all()


def test_merge_gradients_are_finite_for_empty_sides():
    out = torch.randn(4, 3, requires_grad=True)
    lse = torch.full((4,), -INF, requires_grad=True)
    out_b = torch.randn(4, 3, requires_grad=True)
    lse_b = torch.randn(4, requires_grad=True)
    m, l_ = merge(out, lse, out_b, lse_b)
    (m.sum() + l_.sum()).backward()
    for t in (out, lse, out_b, lse_b):
        assert torch.isfinite(t.grad).all()
