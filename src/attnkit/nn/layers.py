"""Building blocks below attention: a decode-friendly linear layer, RMSNorm, feed-forward networks.

Weights are stored *column-major*: a weight has the logical shape ``(out, in)`` of ``torch.nn.Linear`` (so
``state_dict`` keys, ``load_state_dict`` and ``weight.copy_(w)`` work unchanged) but its memory is laid out
as ``(in, out)``.  Decoding one token is a matrix-vector product bound by memory bandwidth, and on CPU
``F.linear`` streams a weight laid out as ``(in, out)`` about 1.6x faster than the default layout
(``benchmarks/model.py`` measures it); training matmuls run at the same speed in both layouts.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _checks

Tensor = torch.Tensor

__all__ = ["Linear", "RMSNorm", "FeedForward", "to_decode_layout"]


def _column_major(w: Tensor) -> Tensor:
    """The same values, with memory laid out as ``w.t()`` (a no-op when already so)."""
    if w.dim() != 2 or (w.stride(0) == 1 and w.stride(1) == w.shape[0]):
        return w
    return w.detach().t().contiguous().t()


class Linear(nn.Linear):
    """``torch.nn.Linear`` with its ``(out, in)`` weight stored column-major (memory ``(in, out)``).

    Input ``(..., in_features)``, output ``(..., out_features)``; numerically identical to ``nn.Linear``.

    Example::

        >>> import torch
        >>> from attnkit.nn import Linear
        >>> lin = Linear(4, 3)
        >>> lin.weight.shape, lin.weight.stride()
        (torch.Size([3, 4]), (1, 3))
        >>> lin(torch.randn(2, 4)).shape
        torch.Size([2, 3])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = nn.Parameter(_column_major(self.weight))


def to_decode_layout(module: nn.Module) -> nn.Module:
    """Store every ``nn.Linear`` / ``nn.Embedding`` weight in ``module`` column-major, in place; returns it.

    Use it after assigning weights with ``param.data = ...`` (``load_state_dict`` and ``copy_`` keep the
    layout by themselves).  Values, shapes and parameter identity are unchanged.

    Example::

        >>> import torch
        >>> m = torch.nn.Linear(4, 3)
        >>> to_decode_layout(m).weight.stride()
        (1, 3)
    """
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            w = sub.weight
            if w.dim() == 2 and not (w.stride(0) == 1 and w.stride(1) == w.shape[0]):
                w.data = _column_major(w.data)
    return module


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x^2) + eps) * weight`` over the last dim.

    Computed in float32 (float64 for float64 inputs) and cast back before the weight, as Llama does.
    Input and output ``(..., dim)``.

    Example::

        >>> import torch
        >>> from attnkit.nn import RMSNorm
        >>> y = RMSNorm(8)(torch.full((2, 8), 3.0))
        >>> torch.allclose(y, torch.ones(2, 8), atol=1e-5)
        True
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        _checks.positive_int("dim", dim)
        self.eps = _checks.positive_float("eps", eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _dropout(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity`` for ``p == 0`` (one call less per use when decoding)."""
    p = _checks.probability("dropout", p)
    return nn.Dropout(p) if p > 0 else nn.Identity()


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    _checks.choice("norm", kind, ("layer", "rms"))
    return nn.LayerNorm(dim, eps=eps) if kind == "layer" else RMSNorm(dim, eps=eps)


class FeedForward(nn.Module):
    """The position-wise feed-forward network: ``down(act(up(x)))``.

    ``kind="gelu"``: ``up`` maps ``d_model -> d_ff``, GELU, ``down`` maps back.
    ``kind="swiglu"``: ``up`` maps ``d_model -> 2 * d_ff`` with its weight rows stacked ``[gate; up]``
    (one matmul), then ``silu(gate) * up`` and ``down`` (Llama's MLP with ``gate_proj``/``up_proj`` fused).
    Input and output ``(B, L, d_model)``.

    Example::

        >>> import torch
        >>> from attnkit.nn import FeedForward
        >>> ffn = FeedForward(16, 32, kind="swiglu")
        >>> ffn.up_proj.weight.shape, ffn(torch.randn(2, 5, 16)).shape
        (torch.Size([64, 16]), torch.Size([2, 5, 16]))
    """

    def __init__(self, d_model: int, d_ff: int, kind: str = "gelu", *, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        _checks.positive_int("d_model", d_model)
        _checks.positive_int("d_ff", d_ff)
        self.kind = _checks.choice("ffn", kind, ("gelu", "swiglu"))
        self.d_ff = d_ff
        self.up_proj = Linear(d_model, d_ff * (2 if kind == "swiglu" else 1), bias=bias)
        self.down_proj = Linear(d_ff, d_model, bias=bias)
        self.dropout = _dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up_proj(x)  # (B, L, d_ff) or (B, L, 2 d_ff)
        if self.kind == "swiglu":
            gate, up = h.split(self.d_ff, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.down_proj(self.dropout(h))
