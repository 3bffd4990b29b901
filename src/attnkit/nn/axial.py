"""Axial attention: attention along one axis of a grid at a time (Ho et al. 2019)."""

from __future__ import annotations

import torch
import torch.nn as nn

from . import _checks
from .attention import MultiHeadAttention

Tensor = torch.Tensor

__all__ = ["AxialAttention"]


class AxialAttention(nn.Module):
    """Attention along each axis of ``x (B, d_1, ..., d_n, dim)`` separately, the results summed.

    For every axis ``a`` in ``axes`` a :class:`MultiHeadAttention` attends along ``a`` only: a token sees
    the tokens that share all its other coordinates (its row, its column, ...).  That equals full
    attention over the flattened grid with the mask "same coordinates off axis ``a``", at
    ``O(N * d_a)`` cost instead of ``O(N^2)``; two axes give every token a path to every other in two
    layers.  ``axes=(1, 2)`` is rows and columns of an image ``(B, H, W, C)``; ``(1, 2, 3)`` a video or
    volume.  ``mha_options`` (``n_kv_heads``, ``mask``, ``positions``, ``backend``, ...) go to every
    per-axis module (``mask=masks.causal()`` makes each axis causal).

    ``forward(x) -> (B, d_1, ..., d_n, dim)``.

    Example::

        >>> import torch
        >>> from attnkit.nn import AxialAttention
        >>> axial = AxialAttention(16, 4)
        >>> axial(torch.randn(2, 5, 6, 16)).shape
        torch.Size([2, 5, 6, 16])
        >>> AxialAttention(16, 4, axes=(1, 2, 3))(torch.randn(1, 3, 4, 5, 16)).shape
        torch.Size([1, 3, 4, 5, 16])
    """

    def __init__(self, dim: int, n_heads: int, axes: tuple[int, ...] = (1, 2), **mha_options):
        super().__init__()
        if isinstance(axes, int):
            axes = (axes,)
        axes = tuple(axes)
        if not axes or any(isinstance(a, bool) or not isinstance(a, int) or a < 1 for a in axes):
            raise ValueError(f"axes={axes!r} must be grid axes of x (B, d_1, ..., d_n, dim): ints >= 1")
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes={axes!r} repeats an axis")
        mask = _checks.as_mask("mask", mha_options.get("mask"))
        if mask is not None and mask.batch_size() > 1:
            raise ValueError(
                f"mask={mask!r} holds one entry per sequence, but AxialAttention applies its mask to "
                f"every line of every grid along each axis (batch and other axes flattened): give a "
                f"mask that is the same for all, e.g. masks.causal(), or mask the inputs instead"
            )
        self.dim, self.axes = dim, axes
        self.attn = nn.ModuleList(MultiHeadAttention(dim, n_heads, **mha_options) for _ in axes)

    def forward(self, x: Tensor) -> Tensor:
        _checks.features("x", x, self.dim, what=f"(B, d_1, ..., d_n, dim={self.dim})", ndim=None)
        if x.dim() < max(self.axes) + 2:
            raise ValueError(
                f"x of shape {tuple(x.shape)} has no axis {max(self.axes)} before the feature axis: "
                f"axes={self.axes} need x.dim() >= {max(self.axes) + 2}"
            )
        if x.numel() == 0:  # an empty grid (some axis of size 0): nothing to attend
            return x.new_zeros(x.shape)
        out = None
        for axis, attn in zip(self.axes, self.attn):
            moved = x.movedim(axis, -2)  # (B, ..., d_axis, dim)
            lead = moved.shape[:-2]
            seq = moved.reshape(-1, moved.shape[-2], self.dim)  # (B * prod(other axes), d_axis, dim)
            y = attn(seq).reshape(*lead, moved.shape[-2], self.dim).movedim(-2, axis)
            out = y if out is None else out + y
        return out

    def extra_repr(self) -> str:
        return f"dim={self.dim}, axes={self.axes}"
