"""The Triton backend (run by Triton's interpreter on the CPU) on the silent wrong answers of packed sequences:
head-dependent masks under ``masks.varlen``, q/k/v views strided in any dimension, and extreme sinks.

The cases run in one child Python started with ``TRITON_INTERPRET=1`` by the ``interpreted`` fixture
(``tests/backends/conftest.py`` says why); shapes are tiny (the interpreter runs every program in Python).
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.testing import check_against_oracle


def _triton(q, k, v, **kwargs):
    return attnkit.attention(q, k, v, backend="triton", **kwargs)


def _qkv(dtype=torch.float32, hq=2, hkv=2, lq=21, lk=21, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, generator=g).to(dtype) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))


def _head_dependent(inner):
    def case():
        q, k, v = _qkv()
        cu_q, cu_k = torch.tensor([0, 3, 12, 21]), torch.tensor([0, 5, 12, 21])
        for t in (q, k, v):
            t.requires_grad_()
        check_against_oracle(_triton, q, k, v, mask=masks.varlen(cu_q, cu_k, inner))

    return case


def _strided(dim):
    def case():
        q, k, v = _qkv(hq=4, hkv=2)
        views = []
        for t in (q, k, v):
            wide = list(t.shape)
            wide[dim] *= 2
            base = torch.full(wide, float("nan"))
            view = base[tuple(slice(None, None, 2) if i == dim else slice(None) for i in range(4))]
            view.copy_(t)
            views.append(view)
        out = _triton(*views, mask=masks.causal())
        want = attnkit.attention(q, k, v, mask=masks.causal(), backend="math")
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)

    return case


def _extreme_sinks(dtype):
    def case():
        q, k, v = _qkv(dtype, hq=4, hkv=2)
        sinks = torch.tensor([2e4, -2e4, 0.3, 6e4])
        check_against_oracle(_triton, q, k, v, mask=masks.causal(), sinks=sinks)

    return case


CASES = {
    "varlen-head0-or-diagonal": _head_dependent(masks.from_fn(lambda b, h, i, j: (h == 0) | (i == j))),
    "varlen-causal-and-odd-heads": _head_dependent(
        masks.causal() & masks.from_fn(lambda b, h, i, j: (h % 2 == 1) | (j == 0))
    ),
    **{f"strided-dim{d}": _strided(d) for d in range(4)},
    **{
        f"sinks-{str(dt).replace('torch.', '')}": _extreme_sinks(dt)
        for dt in (torch.float16, torch.bfloat16, torch.float32)
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_case(name, interpreted):
    verdict = interpreted[name]
    if verdict is not None:
        pytest.fail(f"case {name!r} failed under the Triton interpreter:\n{verdict}", pytrace=False)
