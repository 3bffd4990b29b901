"""The ``math`` backend: the textbook formula with materialised scores, and the oracle.

It takes every input the contract allows, in any floating dtype (float64 included), and is the only
backend that can also return the attention weights.  Half-precision inputs are computed in float32.
"""

from __future__ import annotations

import torch

from ..softmax import logsumexp, stable_softmax
from ._common import Call, accumulation_dtype, grouped_bias, grouped_index, modify_scores

Tensor = torch.Tensor


def _probabilities(call: Call) -> tuple[Tensor, Tensor]:
    """Softmax weights (B, Hkv, G, Lq, Lk) and lse (B, Hkv, G, Lq) in the accumulation dtype."""
    q, k = call.q, call.k
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    acc = accumulation_dtype(q.dtype)
    qg = q.reshape(B, Hkv, call.group, Lq, D).to(acc)  # (B, Hkv, G, Lq, D)
    kg = k.unsqueeze(2).to(acc)  # (B, Hkv, 1, Lk, D): shared by the G query heads, not copied
    s = torch.matmul(qg, kg.transpose(-1, -2)) * call.scale  # (B, Hkv, G, Lq, Lk)
    dev = q.device
    b, h, qi, ki = grouped_index(call, torch.arange(Lq, device=dev), torch.arange(Lk, device=dev))
    bias = grouped_bias(call.bias, call) if isinstance(call.bias, Tensor) else None
    s = modify_scores(s, call, b, h, qi, ki, bias_block=bias)
    return stable_softmax(s, dim=-1), logsumexp(s, dim=-1)


def weights(call: Call) -> Tensor:
    """Attention weights ``(B, Hq, Lq, Lk)`` in the input dtype (before dropout)."""
    p, _ = _probabilities(call)
    return p.reshape(call.batch, call.heads, call.q_len, call.kv_len).to(call.q.dtype)


def run(call: Call):
    p, lse = _probabilities(call)
    if call.dropout_p > 0:
        keep = torch.rand_like(p) >= call.dropout_p
        p = p * keep / (1.0 - call.dropout_p)
    vg = call.v.unsqueeze(2).to(p.dtype)  # (B, Hkv, 1, Lk, Dv)
    out = torch.matmul(p, vg)  # (B, Hkv, G, Lq, Dv)
    out = out.reshape(call.batch, call.heads, call.q_len, call.v.shape[-1]).to(call.q.dtype)
    if call.return_lse:
        lse_dtype = torch.promote_types(lse.dtype, torch.float32)
        return out, lse.reshape(call.batch, call.heads, call.q_len).to(lse_dtype)
    return out


def check(call: Call) -> str | None:
    return None


def cost(call: Call) -> float:
    # materialises the scores several times over: slower than a fused kernel, memory O(Lq * Lk)
    return 4.0 * call.flops()
