"""The ``flash`` backend: tiled, block-sparse attention in PyTorch ops, with a memory-efficient backward.

The ``(Lq, Lk)`` score matrix is cut into tiles (128 x 128 by default) and only the tiles the mask's
block structure marks non-empty are computed; the element mask is applied only on partial tiles.  The
visited tiles are grouped into a few large batched calls (see ``plan``): a sliding window is one
call whose key windows are strided views of ``k`` and ``v``, a scattered pattern gathers its key tiles
into contiguous windows.  Rows covered by several calls are merged with their log-sum-exps (online
softmax, float32).  The backward recomputes each tile's scores from ``(q, k, v, out, lse)``: it keeps
``O((Lq + Lk) * D)`` memory plus a bounded working set per call, never ``O(Lq * Lk)``.

Two ways to compute a call, chosen per call:

* on CPU, PyTorch's fused flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its
  backward), fed the element mask and any additive bias (tensor, ALiBi, T5 buckets) as a float mask;
* everywhere else, and for softcap, non-additive score modifiers, dropout and biases that need
  gradients: explicit matmuls with float32 online softmax (the public-API path).

Dropout draws one seed from torch's generator and derives each weight's keep decision from
``(seed, b, h, q_idx, kv_idx)``, so the backward regenerates exactly the forward's pattern.

Numerics: the explicit backward recomputes each row's weights ``exp(x - max) / sum`` and its row term
``D = rowsum(p * dp)`` from the recomputed scores themselves (rows covered by several calls first sum their
statistics over the calls), never from a saved lse or the output, and scales the products ``(q·k) * scale``
as the textbook formula does: its gradients meet the numerical rule at any score magnitude, and a row with
one visible key gets exactly 0.  The fused path's backward is PyTorch's kernel, with the bounds documented
for the ``sdpa`` backend (README, "The numerical rule").  Keys no row of a tile may see are zeroed in
partial tiles, so padding garbage (NaN, inf) reaches no row; full tiles are read where they are.

Example::

    >>> import torch, attnkit
    >>> from attnkit import masks
    >>> q, k, v = (torch.randn(1, 2, 300, 32) for _ in range(3))
    >>> out = attnkit.attention(q, k, v, mask=masks.sliding_window(63), backend="flash")
    >>> ref = attnkit.attention(q, k, v, mask=masks.sliding_window(63), backend="math")
    >>> bool(torch.allclose(out, ref, atol=1e-5))
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import operators
from ..call import Call, empty_result, is_empty, make_call
from . import custom_ops
from .autograd import (
    CALL_OVERHEAD_FLOPS,
    EXPLICIT_FACTOR,
    FUSED_FACTOR,
    FUSED_MASKED_FACTOR,
    _bias_needs_grad,
    _check_block,
    _forward_plan,
    _fusable,
    _run,
    _unreached_reason,
)

# packed sequences as one batched call: what attnkit.attention_varlen and its choice (``backends.packed``) use
from . import varlen as _varlen
from .ops import draw_seed as draw_seed
from .varlen import OWN_TILES_MIN as OWN_TILES_MIN
from .varlen import segment_call as segment_call

if TYPE_CHECKING:
    from ...bias import BiasLike
    from ...masks import MaskLike

varlen_attention = _varlen.attention
varlen_segments = _varlen.segments
varlen_settings = _varlen.settings

Tensor = torch.Tensor

__all__ = ["flash_attention"]


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: MaskLike | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse tiled attention (the ``flash`` backend), with the arguments of :func:`attnkit.attention`.

    Args:
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``, ``Hq % Hkv == 0``
            (grouped-query heads share ``k``/``v`` without copies).
        mask, bias, scale, softcap, dropout_p, return_lse, sinks: as in :func:`attnkit.attention` (the
            sinks enter each row's final normalisation and its lse; the backward's tiles are unchanged).
        block_q, block_k: tile sizes (default 128 x 128, shrunk to short sequences).  Smaller tiles skip
            more of a sparse mask but make smaller matrix products.

    Returns:
        ``out (B, Hq, Lq, Dv)`` in the input dtype; with ``return_lse``, also ``lse (B, Hq, Lq)`` (float32,
        float64 for float64 inputs).  A row that may attend to nothing gives 0 and ``lse = -inf``.

    Only tiles the mask's block structure marks non-empty are computed::

        causal sliding window, 128 x 128 tiles          visited   element mask
            q tile 0   █ · · · · ·                       1 tile    diagonal only
            q tile 1   █ ░ · · · ·                       2 tiles
            q tile 2   ░ █ ░ · · ·   <- one strided      3 tiles   first and last
            q tile 3   · ░ █ ░ · ·      view of k, v
                                                         (█ full, ░ partial, · skipped)

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.backends.flash import flash_attention
        >>> q = torch.randn(1, 8, 1000, 64); k = v = torch.randn(1, 2, 1000, 64)
        >>> out, lse = flash_attention(q, k, v, mask=masks.sliding_window(255), return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 8, 1000, 64]), torch.Size([1, 8, 1000]))
    """
    call = make_call(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        return_lse=return_lse,
        sinks=sinks,
    )
    block_q, block_k = _check_block("block_q", block_q), _check_block("block_k", block_k)
    if is_empty(call):
        return empty_result(call)
    if torch.compiler.is_compiling() and block_q is None and block_k is None:  # one operator node when traced
        return run(call)
    return _run(call, block_q, block_k)


# ----------------------------------------------------------------- backend hooks


def run(call: Call) -> Tensor | tuple[Tensor, Tensor]:
    """Backend hook: compute a validated call (``out``, or ``(out, lse)`` with ``return_lse``); while
    ``torch.compile`` or ``torch.export`` traces, through the custom operators (``custom_ops``)."""
    if torch.compiler.is_compiling():
        return custom_ops.run(call)
    return _run(call)


def check(call: Call) -> str | None:
    """Backend hook: None (flash takes every mask, bias, dtype and device), unless a score modifier's
    function reads a tensor that requires grad where flash cannot find it to give it its gradient (for a
    traced call: where its custom operators cannot take it)."""
    reason = _unreached_reason(call)
    if reason is None and (operators.deciding() or torch.compiler.is_compiling()):
        reason = custom_ops.traced_reason(call)
    return reason


def cost(call: Call) -> float:
    """Backend hook: the visited share of the dense work (full tiles at the fused kernel's rate, partial
    ones at the masked rate, or all at the explicit path's), plus a cost per batched call."""
    if call.q_len == 0 or call.kv_len == 0:
        return 0.0
    plan = _forward_plan(call)
    bias_grad, _ = _bias_needs_grad(call)
    if _fusable(call, bias_grad):
        full = plan.visited_fraction - plan.partial_fraction
        work = full * FUSED_FACTOR + plan.partial_fraction * FUSED_MASKED_FACTOR
    else:
        work = plan.visited_fraction * EXPLICIT_FACTOR
    return call.flops() * work + len(plan.jobs) * CALL_OVERHEAD_FLOPS
