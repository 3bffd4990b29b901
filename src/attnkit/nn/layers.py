"""Building blocks below attention: a decode-friendly linear layer, RMSNorm, feed-forward networks.

Weights are stored *column-major*: a weight has the logical shape ``(out, in)`` of ``torch.nn.Linear`` (so
``state_dict`` keys, ``load_state_dict`` and ``weight.copy_(w)`` work unchanged) but its memory is laid out
as ``(in, out)``.  Decoding one token is a matrix-vector product bound by memory bandwidth, and on CPU
``F.linear`` streams a weight laid out as ``(in, out)`` about 1.6x faster than the default layout
(``benchmarks/model.py`` measures it); training matmuls run at the same speed in both layouts.

Float32 products on CPU that need no gradient (decoding, prefill, evaluation) go through oneDNN's linear
kernel, which uses every thread for a matrix-vector product where ``F.linear`` (MKL) uses one: about 1.4x
faster at one token and 2x at 8 tokens per step on a 2-core machine (``benchmarks/generate.py``).  That
kernel is a private PyTorch operator; :func:`linear` checks it once against ``F.linear`` and falls back to
``F.linear`` when it is missing or disagrees.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _checks

Tensor = torch.Tensor

__all__ = ["Linear", "RMSNorm", "FeedForward", "to_decode_layout", "linear"]

_ONEDNN: bool | None = None  # whether torch.ops.mkldnn._linear_pointwise works here (probed on first use)


def _onednn_linear_works() -> bool:
    """Probe oneDNN's linear operator once: present, same shape and values as ``F.linear``."""
    global _ONEDNN
    if _ONEDNN is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*s, generator=g) for s in ((3, 2, 24), (40, 24), (40,)))
            w = _column_major(w)
            y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            _ONEDNN = bool(y.shape == (3, 2, 40) and torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
        except (AttributeError, RuntimeError, NotImplementedError, TypeError):
            _ONEDNN = False
    return _ONEDNN


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``: ``x (..., in)``, ``weight (out, in)``, ``bias (out,)`` -> ``(..., out)``.

    Float32 CPU products that autograd does not track run on oneDNN's multi-threaded kernel (see the module
    doc); everything else (gradients, other dtypes and devices, one thread with one row, where MKL is as
    fast, and ``torch.compile`` graphs) is ``F.linear``.  Results agree with ``F.linear`` to float32
    rounding.

    Example::

        >>> import torch
        >>> from attnkit.nn import linear
        >>> x, w = torch.randn(2, 8), torch.randn(3, 8)
        >>> torch.allclose(linear(x, w), x @ w.T, atol=1e-5)
        True
    """
    # (torch.compile: Inductor lowers this operator only for frozen weights, so graphs keep F.linear)
    if (not torch.compiler.is_compiling() and x.dtype is torch.float32 and weight.dtype is torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and (bias is None or (bias.dtype is torch.float32 and bias.device.type == "cpu"))
            and (x.numel() > x.shape[-1] or torch.get_num_threads() > 1) and _onednn_linear_works()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


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

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


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
    ``kind="geglu"``: the same with ``gelu_tanh(gate) * up`` (GELU with the tanh approximation, Hugging
    Face's ``gelu_pytorch_tanh``: Gemma's MLP).  Input and output ``(B, L, d_model)``.

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
        self.kind = _checks.choice("ffn", kind, ("gelu", "swiglu", "geglu"))
        self.d_ff = d_ff
        self.up_proj = Linear(d_model, d_ff * (1 if kind == "gelu" else 2), bias=bias)
        self.down_proj = Linear(d_ff, d_model, bias=bias)
        self.dropout = _dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up_proj(x)  # (B, L, d_ff) or, gated, (B, L, 2 d_ff)
        if self.kind == "gelu":
            h = F.gelu(h)
        else:
            gate, up = h.split(self.d_ff, dim=-1)
            h = (F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")) * up
        return self.down_proj(self.dropout(h))
