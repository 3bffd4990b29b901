"""PyTorch's fused CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward),
as the flash backend, the packed (varlen) kernel and the paged chunk attention call it: entries that take
their tensors in any layout."""

from __future__ import annotations

from typing import Any, Callable, cast

import torch

Tensor = torch.Tensor

FusedForward = Callable[..., "tuple[Tensor, Tensor]"]  # (q, k, v, dropout_p, is_causal, attn_mask, scale) -> (out, lse)
FusedBackward = Callable[..., "tuple[Tensor, Tensor, Tensor]"]  # (grad_out, q, k, v, out, lse, ...) -> (dq, dk, dv)
Fused = tuple[FusedForward, FusedBackward]

_FWD_ARGS = ["query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"]
_BWD_ARGS = ["grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"]


def dense_rows(x: Tensor) -> Tensor:
    """``x``, or a contiguous copy when its last stride is not 1: the fused kernel reads each row of ``q``,
    ``k``, ``v``, ``out``, ``grad_out`` as consecutive elements whatever that stride says (a feature-major
    tensor, as a biased linear layer may return for a few rows, gave wrong numbers or NaN)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def fused_ops() -> Fused | None:
    """PyTorch's fused CPU flash kernel ``(forward, backward)``, or None when this build lacks it or its
    signature changed (the explicit path then computes everything); both take tensors in any layout."""
    try:
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    except (AttributeError, RuntimeError):
        return None
    fa = [a.name for a in fwd._schema.arguments]
    ba = [a.name for a in bwd._schema.arguments]
    if fa != _FWD_ARGS or ba != _BWD_ARGS or len(fwd._schema.returns) != 2 or len(bwd._schema.returns) != 3:
        return None

    def forward(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kw: Any) -> tuple[Tensor, Tensor]:
        return cast("tuple[Tensor, Tensor]", fwd(dense_rows(q), dense_rows(k), dense_rows(v), *args, **kw))

    def backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, *args: Any, **kw: Any
    ) -> tuple[Tensor, Tensor, Tensor]:
        return cast("tuple[Tensor, Tensor, Tensor]", bwd(*map(dense_rows, (dout, q, k, v, out)), *args, **kw))

    return forward, backward


FUSED = fused_ops()  # (forward, backward), or None
