"""attnkit.testing.check_against_oracle must catch a wrong implementation in each part it claims to check."""

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.testing import check_against_oracle


def _qkv(grad=(True, True, True)):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 5, 8, generator=g).requires_grad_(w) for w in grad]


class _WrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return attnkit.attention(q.detach(), k.detach(), v.detach())

    @staticmethod
    def backward(ctx, g):
        return -7 * g, None, -7 * g


def test_gradients_of_the_inputs_that_require_them_are_checked():
    q, k, v = _qkv((False, False, True))  # only v: its gradient is still compared
    with pytest.raises(AssertionError, match="dv"):
        check_against_oracle(lambda q, k, v: _WrongBackward.apply(q, k, v), q, k, v)
    report = check_against_oracle(attnkit.attention, *_qkv((False, False, False)))
    assert report["grads"] == "none checked"
    with pytest.raises(ValueError, match="grad=True but none of q, k, v requires grad"):
        check_against_oracle(attnkit.attention, *_qkv((False, False, False)), grad=True)


def test_lse_shape_dtype_and_dropout():
    q, k, v = _qkv()

    def bad_lse(q, k, v, **kw):
        out, lse = attnkit.attention(q, k, v, **kw)
        return out, lse + 1.0

    with pytest.raises(AssertionError, match="lse"):
        check_against_oracle(bad_lse, q, k, v, mask=masks.causal(), return_lse=True)
    check_against_oracle(attnkit.attention, q, k, v, mask=masks.causal(), return_lse=True)
    with pytest.raises(AssertionError, match="expected \\(1, 2, 5, 8\\) and torch.float32"):
        check_against_oracle(lambda q, k, v: attnkit.attention(q, k, v).double(), q, k, v)
    with pytest.raises(AssertionError, match="output of shape \\(1, 1, 2, 5, 8\\)"):
        check_against_oracle(lambda q, k, v: attnkit.attention(q, k, v)[None], q, k, v)
    with pytest.raises(ValueError, match="the oracle has no dropout"):
        check_against_oracle(attnkit.attention, q, k, v, dropout_p=0.5)
