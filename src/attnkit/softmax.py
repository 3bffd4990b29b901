"""Numerically stable softmax, log-sum-exp, and merging partial attention results.

Attention over a long key sequence can be computed in pieces: each piece gives its output
``out_i = softmax(s_i) @ v_i`` and the log-sum-exp ``lse_i = log(sum(exp(s_i)))`` of its scores.
:func:`merge` combines two pieces exactly; it is the step of online softmax (flash attention) and of
ring attention.  A row whose scores are all ``-inf`` (a fully masked row) has ``lse = -inf`` and
output 0, and merging with it changes nothing.

Attention sinks (a per-head logit ``sink`` in every row's denominator, with a zero value) are not a key:
merge the pieces computed *without* the sink, then add it once with :func:`add_sink`.  Merging two pieces
that each carry the sink would count it twice.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["stable_softmax", "logsumexp", "merge", "add_sink"]


def stable_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax that subtracts the row maximum first, so ``exp`` never overflows.

    A slice that is all ``-inf`` (nothing may be attended to) gives zeros, not NaN, and zero gradients.

    Example::

        >>> import torch
        >>> from attnkit.softmax import stable_softmax
        >>> stable_softmax(torch.tensor([1000.0, 1000.0])).tolist()
        [0.5, 0.5]
        >>> stable_softmax(torch.tensor([float("-inf"), float("-inf")])).tolist()
        [0.0, 0.0]
    """
    m = x.amax(dim=dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    s = e.sum(dim=dim, keepdim=True)
    return e / torch.where(s == 0, torch.ones_like(s), s)


def logsumexp(x: Tensor, dim: int = -1) -> Tensor:
    """``log(sum(exp(x)))`` along ``dim``, stable for large scores; ``-inf`` for an all ``-inf`` slice.

    Example::

        >>> import torch
        >>> from attnkit.softmax import logsumexp
        >>> round(logsumexp(torch.tensor([1000.0, 1000.0], dtype=torch.float64)).item(), 4)
        1000.6931
    """
    m = x.amax(dim=dim, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.exp(x - m).sum(dim=dim, keepdim=True)
    empty = s == 0
    out = torch.where(empty, torch.full_like(s, float("-inf")), m + torch.log(torch.where(empty, 1.0, s)))
    return out.squeeze(dim)


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial attention results over disjoint sets of keys.

    Args:
        out_a, out_b: ``(..., L, Dv)`` outputs, each normalised over its own keys.
        lse_a, lse_b: ``(..., L)`` their log-sum-exps (``-inf`` where a row saw no key).

    Returns:
        ``(out, lse)``: the output over the union of keys (in ``out_a``'s dtype, computed in float32
        at least) and its log-sum-exp (float32 at least).  Exact when either side is empty.

    Non-tensors and integer tensors raise a TypeError; pieces of different shapes, an lse that is not one value
    per row of its output, or tensors on different devices a ValueError.

    Example::

        >>> import torch
        >>> from attnkit.softmax import merge
        >>> s, v = torch.randn(4, 6), torch.randn(6, 3)
        >>> full = torch.softmax(s, -1) @ v
        >>> parts = [(torch.softmax(s[:, i:i+3], -1) @ v[i:i+3], torch.logsumexp(s[:, i:i+3], -1)) for i in (0, 3)]
        >>> out, lse = merge(*parts[0], *parts[1])
        >>> torch.allclose(out, full, atol=1e-6)
        True
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _check_float("merge", name, t)
    if out_a.dim() < 2:
        raise ValueError(f"merge: out_a must be (..., L, Dv), got shape {tuple(out_a.shape)}")
    if out_b.shape != out_a.shape:
        raise ValueError(
            f"merge: out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} must have one shape: "
            f"two pieces of the same rows, each (..., L, Dv)"
        )
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != out_a.shape[:-1]:
            raise ValueError(
                f"merge: {name} must be the log-sum-exp of each row of out_a {tuple(out_a.shape)}, "
                f"shape {tuple(out_a.shape[:-1])}, got {tuple(t.shape)}"
            )
    _check_devices("merge", out_a, (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)), "out_a")
    acc = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    la, lb = lse_a.to(acc), lse_b.to(acc)
    m = torch.maximum(la, lb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    empty = total == 0
    safe = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), m + torch.log(safe))
    oacc = torch.promote_types(out_a.dtype, acc)
    out = (out_a.to(oacc) * (wa / safe)[..., None] + out_b.to(oacc) * (wb / safe)[..., None]).to(out_a.dtype)
    return out, lse


def add_sink(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Add an attention sink to a result computed without one: ``exp(sink)`` joins each row's denominator.

    Args:
        out: ``(B, H, L, Dv)`` output normalised over its keys.
        lse: ``(B, H, L)`` its log-sum-exp (``-inf`` where a row saw no key).
        sinks: one logit per head, broadcastable to ``(B, H)`` (e.g. ``(H,)``).

    Returns:
        ``(out * exp(lse - lse'), lse')`` with ``lse' = logaddexp(lse, sink)``: the output with the sink in
        the denominator (in ``out``'s dtype) and the log-sum-exp that includes the sink.  A row that saw no
        key keeps output 0 and gets ``lse' = sink``.  Differentiable in all three inputs.  Apply it once,
        after :func:`merge`-ing the pieces: it is the step that ring attention and paged decoding use.

    Non-tensors and integer tensors raise a TypeError; an ``out`` that is not 4-D, an ``lse`` that is not one
    value per row of it, sinks that do not broadcast to ``(B, H)`` or hold a NaN or an infinity, or tensors on
    different devices a ValueError.

    Example::

        >>> import torch
        >>> from attnkit.softmax import add_sink
        >>> s, v, sink = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64), 0.5
        >>> ext = torch.cat([s, torch.full((4, 1), sink, dtype=torch.float64)], -1)
        >>> full = torch.softmax(ext, -1)[:, :6] @ v
        >>> out, lse = add_sink((torch.softmax(s, -1) @ v)[None, None], torch.logsumexp(s, -1)[None, None],
        ...                     torch.tensor([sink], dtype=torch.float64))
        >>> torch.allclose(out[0, 0], full), torch.allclose(lse[0, 0], torch.logsumexp(ext, -1))
        (True, True)
    """
    for name, t in (("out", out), ("lse", lse), ("sinks", sinks)):
        _check_float("add_sink", name, t)
    if out.dim() != 4:
        raise ValueError(f"add_sink: out must be (B, H, L, Dv), got shape {tuple(out.shape)}")
    if lse.shape != out.shape[:-1]:
        raise ValueError(
            f"add_sink: lse must be the log-sum-exp of each row of out {tuple(out.shape)}, shape "
            f"{tuple(out.shape[:-1])}, got {tuple(lse.shape)}"
        )
    B, H = out.shape[0], out.shape[1]
    if sinks.dim() > 2 or not _broadcasts(sinks.shape, (B, H)):
        raise ValueError(
            f"add_sink: sinks of shape {tuple(sinks.shape)} does not broadcast to (B, H)=({B}, {H}): "
            f"give one logit per head, shape ({H},) (or ({B}, {H}))"
        )
    _check_devices("add_sink", out, (("lse", lse), ("sinks", sinks)), "out")
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(sinks.detach()).all()):
        raise ValueError(
            f"add_sink: sinks holds a non-finite value ({sinks.detach().flatten()[:8].tolist()}): give "
            f"finite logits (with no sink, skip add_sink)"
        )
    return add_sink_unchecked(out, lse, sinks)


def add_sink_unchecked(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`add_sink` on inputs already checked (the backends' own step; no sync)."""
    acc = torch.promote_types(lse.dtype, torch.float32)
    B, H = lse.shape[0], lse.shape[1]
    sk = sinks.to(acc).expand(B, H)[..., None]  # (B, H, 1)
    la = lse.to(acc)
    lse_s = torch.logaddexp(la, sk)
    factor = torch.exp(la - lse_s)  # exp(-inf) = 0 for an empty row
    oacc = torch.promote_types(out.dtype, acc)
    return (out.to(oacc) * factor[..., None]).to(out.dtype), lse_s


# ---------------------------------------------------------------------- input checks


def _check_float(fn: str, name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a float tensor, got {type(t).__name__}: pass torch.tensor(...)")
    if not t.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a float tensor, got dtype {t.dtype}: use {name}.float()")


def _check_devices(fn: str, first: Tensor, others, first_name: str) -> None:
    for name, t in others:
        if t.device != first.device:
            raise ValueError(
                f"{fn}: {name} is on {t.device} but {first_name} is on {first.device}: put them on one device"
            )


def _broadcasts(shape, target) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        return False
