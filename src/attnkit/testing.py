"""Checking an attention implementation against the float64 oracle with the numerical rule.

The rule (README, "The contract"): ``max|out - oracle| <= 2 * max|naive - oracle| + 1e-6``, where ``oracle`` is the
textbook formula in float64 and ``naive`` the same formula in the input's dtype; gradients use factor 3.

Example::

    >>> import torch, attnkit
    >>> from attnkit.testing import check_against_oracle
    >>> q = torch.randn(1, 4, 9, 16, requires_grad=True); k = torch.randn(1, 2, 11, 16, requires_grad=True)
    >>> v = torch.randn(1, 2, 11, 16, requires_grad=True)
    >>> report = check_against_oracle(attnkit.attention, q, k, v, mask=attnkit.masks.causal())
    >>> report["out"]["ok"]
    True
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ._checks import flag
from .bias import ScoreMod
from .masks import Mask, index_grid

Tensor = torch.Tensor

__all__ = ["reference", "check_against_oracle", "random_qkv", "max_err"]


def random_qkv(
    batch: int,
    q_heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    value_dim: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
    seed: int = 0,
) -> list[Tensor]:
    """Reproducible ``[q, k, v]``: ``q (batch, q_heads, q_len, head_dim)``, ``k (batch, kv_heads, kv_len,
    head_dim)``, ``v (batch, kv_heads, kv_len, value_dim or head_dim)``, standard normal values drawn in float32
    from a generator seeded with ``seed`` (the same values whatever ``dtype``), then cast to ``dtype``.

    Example::

        >>> from attnkit.testing import random_qkv
        >>> q, k, v = random_qkv(2, 4, 2, 9, 11, 16, dtype=torch.float64, requires_grad=True)
        >>> tuple(q.shape), tuple(k.shape), v.dtype, v.requires_grad
        ((2, 4, 9, 16), (2, 2, 11, 16), torch.float64, True)
    """
    g = torch.Generator().manual_seed(seed)
    shapes = (
        (batch, q_heads, q_len, head_dim),
        (batch, kv_heads, kv_len, head_dim),
        (batch, kv_heads, kv_len, head_dim if value_dim is None else value_dim),
    )
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad) for shape in shapes]


def reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    bias=None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """The textbook formula, written out, in ``dtype`` (default: the inputs' dtype).

    ``sinks`` (``(Hq,)`` or broadcastable to ``(B, Hq)``) adds ``exp(sink)`` to each row's denominator:
    ``out_i = sum_j exp(s_ij) v_j / (exp(sink) + sum_j exp(s_ij))``, ``lse_i = log`` of that denominator.

    Heads are repeated for grouped-query attention and the mask is materialised: this is the
    definition, not an implementation to use.  Returns ``(out, lse)``; a row that may attend to
    nothing gives 0 and ``-inf``.
    """
    dtype = dtype or q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, Lk, D)
    v = v.repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, Lk, Dv)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale  # (B, Hq, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if isinstance(bias, ScoreMod):
        b, h, qi, ki = index_grid(B, Hq, Lq, Lk, q.device)
        s = bias.apply(s, b, h, qi, ki, Lq, Lk).to(dtype)
    elif bias is not None:
        s = s + bias.to(dtype)
    if mask is not None:
        dense = mask.to_dense(Lq, Lk, batch=B, heads=Hq, device=q.device) if isinstance(mask, Mask) else mask
        s = s.masked_fill(~dense, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).expand(B, Hq)[:, :, None]  # (B, Hq, 1)
        top = s.amax(dim=-1) if Lk > 0 else sink.expand(B, Hq, Lq)  # (no keys: the sink alone)
        m = torch.maximum(top, sink).detach()  # finite: the sink is
        e = torch.exp(s - m[..., None])
        den = e.sum(dim=-1) + torch.exp(sink - m)
        return (e / den[..., None]) @ v, m + torch.log(den)
    lse = torch.logsumexp(s, dim=-1)
    w = torch.softmax(s, dim=-1)
    w = torch.where(torch.isnan(w), torch.zeros_like(w), w)  # rows with nothing to attend to
    return w @ v, lse


def max_err(a: Tensor, b: Tensor) -> float:
    """The largest ``|a - b|``, in float64; infinities of one sign count as equal, an empty tensor gives 0.0."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    d = torch.where(both_inf, torch.zeros_like(a), (a - b).abs()).detach()
    return float(d.max())


def check_against_oracle(
    fn: Callable[..., object],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    grad: bool | None = None,
    factor: float = 2.0,
    grad_factor: float = 3.0,
    atol: float = 1e-6,
    seed: int = 0,
    **kwargs,
) -> dict:
    """Run ``fn(q, k, v, **kwargs)`` and compare it with the float64 oracle under the numerical rule.

    ``kwargs`` may hold ``mask``, ``bias``, ``scale``, ``softcap``, ``sinks`` (passed to the reference too)
    and anything else ``fn`` takes; a ``sinks`` tensor that requires grad has its gradient checked too.  The output must have the oracle's shape and the input's dtype; with
    ``return_lse=True`` the log-sum-exp is checked too.  Gradients: ``grad=None`` checks those of the
    inputs that require grad (the report says ``"grads": "none checked"`` when none does), ``grad=True``
    requires at least one, ``grad=False`` checks none.  ``dropout_p > 0`` is refused (the oracle has no
    dropout: compare dropout under a shared keep pattern instead).  Raises ``AssertionError`` with the
    errors and bounds when the rule does not hold; returns them otherwise.
    """
    if float(kwargs.get("dropout_p", 0.0) or 0.0) > 0:
        raise ValueError(
            f"check_against_oracle: dropout_p={kwargs['dropout_p']} — the oracle has no dropout; "
            f"check dropout against a formula using the same keep pattern"
        )
    grad = None if grad is None else flag("grad", grad)
    ref_kw = {n: kwargs[n] for n in ("mask", "bias", "scale", "softcap") if n in kwargs}
    sinks = kwargs.pop("sinks", None)
    wants = [bool(t.requires_grad) for t in (q, k, v)] if grad is not False else [False] * 3
    if grad is True and not any(wants):
        raise ValueError(
            "check_against_oracle: grad=True but none of q, k, v requires grad: call "
            "requires_grad_() on the inputs whose gradients should be checked"
        )
    if sinks is not None and grad is not False and sinks.requires_grad:
        wants.append(True)
    elif sinks is not None:
        wants.append(False)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    leaves = [t.detach().clone().requires_grad_(w) for t, w in zip(inputs, wants)]
    result = fn(*leaves[:3], **kwargs, **({} if sinks is None else {"sinks": leaves[3]}))
    out, lse = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
    o64 = [t.detach().double().requires_grad_(w) for t, w in zip(inputs, wants)]
    oracle, oracle_lse = reference(*o64[:3], **ref_kw, sinks=o64[3] if sinks is not None else None, dtype=torch.float64)
    nv = [t.detach().clone().requires_grad_(w) for t, w in zip(inputs, wants)]
    naive, naive_lse = reference(*nv[:3], **ref_kw, sinks=nv[3] if sinks is not None else None, dtype=q.dtype)
    if tuple(out.shape) != tuple(oracle.shape) or out.dtype != q.dtype:
        raise AssertionError(
            f"output of shape {tuple(out.shape)} and dtype {out.dtype}, expected {tuple(oracle.shape)} and {q.dtype}"
        )
    report = {}
    e_out, e_naive = max_err(out, oracle), max_err(naive, oracle)
    report["out"] = {"err": e_out, "naive": e_naive, "bound": factor * e_naive + atol}
    if kwargs.get("return_lse") and lse is not None:
        if tuple(lse.shape) != tuple(oracle_lse.shape):
            raise AssertionError(f"lse of shape {tuple(lse.shape)}, expected {tuple(oracle_lse.shape)}")
        e, en = max_err(lse, oracle_lse), max_err(naive_lse, oracle_lse)
        report["lse"] = {"err": e, "naive": en, "bound": factor * en + atol}
    if any(wants):
        g = torch.Generator().manual_seed(seed)
        go = torch.randn(oracle.shape, generator=g, dtype=torch.float64).to(oracle.device)
        out.backward(go.to(device=out.device, dtype=out.dtype))
        oracle.backward(go)
        naive.backward(go.to(naive.dtype))
        for name, a, o, n, w in zip(("q", "k", "v", "sinks"), leaves, o64, nv, wants):
            if not w:
                continue
            ga = a.grad if a.grad is not None else torch.zeros_like(a)
            gn = n.grad if n.grad is not None else torch.zeros_like(n)
            e, en = max_err(ga, o.grad), max_err(gn, o.grad)
            report[f"d{name}"] = {"err": e, "naive": en, "bound": grad_factor * en + atol}
    for item in report.values():
        item["ok"] = bool(item["err"] <= item["bound"])
    bad = {n: r for n, r in report.items() if not r["ok"]}
    if not any(wants):
        report["grads"] = "none checked"
    if bad:
        raise AssertionError(
            "numerical rule violated: "
            + "; ".join(
                f"{n}: max|err|={r['err']:.3e} > bound {r['bound']:.3e} (naive {r['naive']:.3e})"
                for n, r in bad.items()
            )
        )
    return report
