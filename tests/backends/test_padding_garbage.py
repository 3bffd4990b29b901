"""Keys and values that no query may see (padding, an uninitialised buffer) can hold anything, NaN and inf
included: on every backend the visible rows, their gradients and the lse are those of the same call with
zeros there, and the gradient of the hidden slots is 0."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends.flash import autograd as _flash_impl
from attnkit.backends.call import make_call

FILLS = [float("nan"), float("inf"), float("-inf")]


def _flash(fused):
    def fn(q, k, v, **kw):
        return _flash_impl._run(make_call(q, k, v, **kw), fused=fused)

    return fn


BACKENDS = {
    "math": lambda q, k, v, **kw: attnkit.attention(q, k, v, backend="math", **kw),
    "sdpa": lambda q, k, v, **kw: attnkit.attention(q, k, v, backend="sdpa", **kw),
    "auto": lambda q, k, v, **kw: attnkit.attention(q, k, v, **kw),
    "flash-fused": _flash(None),
    "flash-explicit": _flash(False),
    "flash-small-tiles": lambda q, k, v, **kw: _flash_impl._run(make_call(q, k, v, **kw), 4, 4, fused=False),
}

LENGTHS = [13, 20, 6]
B, HKV, G, L, D = 3, 2, 2, 20, 8


def _junk() -> torch.Tensor:
    """(B, 1, L) True at the padded keys."""
    return (torch.arange(L)[None, :] >= torch.tensor(LENGTHS)[:, None])[:, None]


MASKS = {
    "key_padding": lambda: masks.key_padding(LENGTHS),
    "key_padding-causal": lambda: masks.key_padding(LENGTHS) & masks.causal(),
    "bool-tensor": lambda: ~_junk()[:, :, None, :],  # (B, 1, 1, Lk): a cache's padding mask
    "bool-tensor-full": lambda: (~_junk()[:, :, None, :]).expand(B, HKV * G, L, L).clone(),
}


def _run(fn, q, k, v, mask, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    result = fn(q, k, v, mask=mask, **kw)
    out, lse = result if isinstance(result, tuple) else (result, None)
    g = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    if lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * torch.randn(lse.shape, generator=g)).sum()
    loss.backward()
    return out.detach(), lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_hidden_garbage_changes_nothing(backend, mask, fill):
    """NaN or inf in the hidden keys (and the opposite infinity or NaN in the hidden values: each reaches the
    rows by its own way, the scores or the weighted sum)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(B, HKV * G, L, D), torch.randn(B, HKV, L, D), torch.randn(B, HKV, L, D)
    junk = _junk()[..., None].expand(B, HKV, L, D)
    k0, v0 = k.masked_fill(junk, 0.0), v.masked_fill(junk, 0.0)
    bad_k = k0.masked_fill(junk, fill)
    bad_v = v0.masked_fill(junk, -fill if fill == fill else float("inf"))
    kw = {"return_lse": True} if backend.startswith("flash") or backend == "math" else {}
    want = _run(BACKENDS[backend], q, k0, v0, MASKS[mask](), **kw)
    got = _run(BACKENDS[backend], q, bad_k, bad_v, MASKS[mask](), **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if a is None:
            continue
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    for name, grad in (("dk", got[3]), ("dv", got[4])):
        assert torch.equal(grad[junk], torch.zeros_like(grad[junk])), f"{name} of the hidden slots is not 0"


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("backend", ["sdpa", "math", "flash-fused", "flash-explicit"])
def test_keys_past_a_top_left_causal_mask_are_hidden(backend, fill):
    """Top-left causal with Lq < Lk: the keys past Lq are seen by no query."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, D), torch.randn(1, 2, 9, D), torch.randn(1, 2, 9, D)
    mask = masks.causal(align="top_left")
    want = _run(BACKENDS[backend], q, k, v, mask)
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[:, :, 5:] = fill
    bad_v[:, :, 5:] = fill
    got = _run(BACKENDS[backend], q, bad_k, bad_v, mask)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
        torch.testing.assert_close(
            a[..., :5, :] if name in ("dk", "dv") else a,
            b[..., :5, :] if name in ("dk", "dv") else b,
            msg=lambda m: f"{name}: {m}",
        )
    assert torch.equal(got[3][:, :, 5:], torch.zeros_like(got[3][:, :, 5:]))
    assert torch.equal(got[4][:, :, 5:], torch.zeros_like(got[4][:, :, 5:]))


def test_a_nan_key_that_is_seen_still_gives_nan():
    """Only hidden slots are cleaned: a NaN a query may see is the caller's NaN (nothing is hidden)."""
    q, k, v = torch.randn(1, 1, 4, D), torch.randn(1, 1, 6, D), torch.randn(1, 1, 6, D)
    v[0, 0, 2] = float("nan")
    for backend in ("math", "sdpa", "flash-fused", "flash-explicit"):
        out = BACKENDS[backend](q, k, v, mask=masks.key_padding([4]))
        out = out[0] if isinstance(out, tuple) else out
        assert torch.isnan(out).all(), backend
