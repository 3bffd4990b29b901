"""Building blocks below attention: a decode-friendly linear layer, RMSNorm, feed-forward networks.

Decoding one token is a matrix-vector product bound by memory bandwidth, and how fast PyTorch's CPU kernels
stream a weight depends on its memory layout and on the number of rows a step feeds.  Weights keep
``torch.nn.Linear``'s logical shape ``(out, in)`` and, by default, its row-major memory; :func:`linear`
picks the kernel from the layout and the row count, for float32 CPU products that need no gradient
(decoding, prefill, evaluation):

* 1 to 3 rows and a row-major weight: ``weight @ x.T`` through MKL, with a single row padded to two
  (MKL's two-column product streams the weight with every thread, ~1.8x faster than oneDNN at one row and
  ~1.4x at two on the 2-core machine of ``benchmarks/generate.py``; one row alone takes a slower path);
* more rows up to 64, or a column-major weight (memory ``(in, out)``): oneDNN's linear kernel, which uses
  every thread where ``F.linear`` (MKL) uses one for a matrix-vector product.  From 4 rows up it streams
  a column-major weight 1.25-1.35x faster than a row-major one; :func:`to_decode_layout` lays a model out
  for the batch it will decode.  oneDNN keeps about 1 MiB per distinct row count for good (measured:
  2 GiB after 2,000 prompt lengths), so it serves decode-sized products only: beyond 64 rows (prefill,
  training-sized batches) ``F.linear`` runs, 5-15% slower there but with no memory that grows with the
  shapes seen;
* anything else (gradients, other dtypes and devices, ``torch.compile`` graphs): ``F.linear``.

oneDNN's kernel is a private PyTorch operator; :func:`linear` checks it once against ``F.linear`` and
falls back to ``F.linear`` when it is missing or disagrees.
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

    Float32 CPU products that autograd does not track take the fastest kernel for the weight's layout and
    the number of rows (see the module doc); everything else (gradients, other dtypes and devices,
    ``torch.compile`` graphs) is ``F.linear``.  Results agree with ``F.linear`` to float32 rounding.

    Example::

        >>> import torch
        >>> from attnkit.nn import linear
        >>> x, w = torch.randn(2, 8), torch.randn(3, 8)
        >>> torch.allclose(linear(x, w), x @ w.T, atol=1e-5)
        True
    """
    # (torch.compile: Inductor lowers these operators only for frozen weights, so graphs keep F.linear)
    # (autocast: F.linear, whose output dtype autocast decides; the fast paths would mix dtypes)
    if (not torch.compiler.is_compiling() and x.dtype is torch.float32 and weight.dtype is torch.float32
            and x.device.type == "cpu" and weight.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))
            and (bias is None or (bias.dtype is torch.float32 and bias.device.type == "cpu"))):
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if 1 <= rows <= _MKL_ROWS and weight.dim() == 2 and weight.stride(1) == 1 and weight.stride(0) == k:
            x2 = x.reshape(rows, k)
            if rows == 1:
                x2 = torch.cat([x2, x2])  # MKL streams (out, in) @ (in, 2) with every thread, (in, 1) with one
            y = torch.mm(weight, x2.t()).t()[:rows]  # (rows, out), a view of (out, 2 or 3)
            y = y + bias if bias is not None else y.contiguous()
            return y.view(*x.shape[:-1], weight.shape[0])
        if (rows > 1 or torch.get_num_threads() > 1) and rows <= _ONEDNN_ROWS and _onednn_linear_works():
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


_MKL_ROWS = 3  # up to this many rows a row-major weight goes through MKL's few-column product (module doc)
_ONEDNN_ROWS = 64  # up to this many rows oneDNN (its per-shape memory stays bounded); beyond, F.linear


def _column_major(w: Tensor) -> Tensor:
    """The same values, with memory laid out as ``w.t()`` (a no-op when already so)."""
    if w.dim() != 2 or (w.stride(0) == 1 and w.stride(1) == w.shape[0]):
        return w
    return w.detach().t().contiguous().t()


def _row_major(w: Tensor) -> Tensor:
    """The same values, contiguous (a no-op when already so)."""
    return w if w.is_contiguous() else w.detach().contiguous()


class Linear(nn.Linear):
    """``torch.nn.Linear`` whose forward is :func:`linear` (the fastest CPU kernel for the weight's layout
    and the number of rows; ``F.linear`` everywhere else).

    Input ``(..., in_features)``, output ``(..., out_features)``; numerically ``nn.Linear`` up to float32
    rounding.  The weight is row-major like ``nn.Linear``'s until :func:`to_decode_layout` changes it.

    Example::

        >>> import torch
        >>> from attnkit.nn import Linear
        >>> lin = Linear(4, 3)
        >>> lin.weight.shape, lin.weight.stride()
        (torch.Size([3, 4]), (4, 1))
        >>> lin(torch.randn(2, 4)).shape
        torch.Size([2, 3])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, _checks.flag("bias", bias), device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def to_decode_layout(module: nn.Module, batch_size: int = 1) -> nn.Module:
    """Lay out every ``nn.Linear`` weight (and a tied head's embedding) in ``module`` for decoding
    ``batch_size`` sequences a step, in place; returns ``module``.

    On CPU, float32 weights are read fastest row-major (``nn.Linear``'s default) up to 3 rows a step
    (1.5x faster at 1-2 rows) and column-major (memory ``(in, out)``) from 4 (1.25-1.35x faster for 4-32
    rows), bfloat16 weights column-major at every batch size (products 1.1-1.15x faster; whole decode
    steps equal at one sequence, 5% faster at eight), on the machine of ``benchmarks/generate.py``.  Other dtypes and devices are laid out row-major.  Values, shapes and
    parameter identity are unchanged; ``load_state_dict`` and ``weight.copy_`` keep the layout, assigning
    ``.data`` does not.  :func:`attnkit.generate` and :class:`attnkit.Engine` call this for the batch they
    decode.

    Example::

        >>> import torch
        >>> m = torch.nn.Linear(4, 3)
        >>> to_decode_layout(m, batch_size=8).weight.stride(), to_decode_layout(m).weight.stride()
        ((1, 3), (4, 1))
    """
    batch_size = _checks.positive_int("batch_size", batch_size)
    # a language model whose head is tied (lm_head None) streams its embedding like a Linear weight
    tied = {id(m.embed.weight) for m in module.modules()
            if isinstance(getattr(m, "embed", None), nn.Embedding) and getattr(m, "lm_head", False) is None}
    # the copies must be ordinary tensors even when called under inference_mode (as generate may be), or the
    # parameters could not be used for training afterwards
    with torch.inference_mode(False), torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, nn.Linear) or (isinstance(sub, nn.Embedding) and id(sub.weight) in tied):
                w = sub.weight
                if w.dim() == 2:
                    column = w.device.type == "cpu" and (w.dtype is torch.bfloat16 or (
                        w.dtype is torch.float32 and batch_size > _MKL_ROWS))
                    new = _column_major(w.data) if column else _row_major(w.data)
                    if new is not w.data:
                        w.data = new
    return module


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim.

    Computed in float32 (float64 for float64 inputs) and cast back before the weight, as Llama does.
    ``offset`` is what the stored weight lacks (Gemma stores ``w - 1`` and multiplies by ``1 + weight``;
    ``offset=1.0`` does that, in float32 with one cast at the end, as Gemma does); the weight starts at
    ``1 - offset``, the identity.  Input and output ``(..., dim)``.

    Example::

        >>> import torch
        >>> from attnkit.nn import RMSNorm
        >>> y = RMSNorm(8)(torch.full((2, 8), 3.0))
        >>> torch.allclose(y, torch.ones(2, 8), atol=1e-5)
        True
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        _checks.positive_int("dim", dim)
        self.eps = _checks.positive_float("eps", eps)
        self.offset = _checks.finite_float("offset", offset)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.offset))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.weight.to(h.dtype) + self.offset)).to(dtype)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset}" if self.offset else "")


def _dropout(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity`` for ``p == 0`` (one call less per use when decoding)."""
    p = _checks.probability("dropout", p)
    return nn.Dropout(p) if p > 0 else nn.Identity()


def make_norm(kind: str, dim: int, eps: float, offset: float = 0.0) -> nn.Module:
    _checks.choice("norm", kind, ("layer", "rms"))
    if kind == "layer" and offset:
        raise ValueError(f"norm_offset={offset!r} applies to RMSNorm only: use norm='rms' or norm_offset=0.0")
    return nn.LayerNorm(dim, eps=eps) if kind == "layer" else RMSNorm(dim, eps=eps, offset=offset)


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
        bias = _checks.flag("bias", bias)
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
