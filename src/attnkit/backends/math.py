"""The ``math`` backend: the textbook formula with materialised scores, and the oracle.

It takes every input the contract allows, in any floating dtype (float64 included), and is the only
backend that can also return the attention weights.  Half-precision inputs are computed in float32.
"""

from __future__ import annotations

import torch

from ..softmax import logsumexp, stable_softmax
from .call import Call, accumulation_dtype
from .scores import grouped_bias, grouped_index, modify_scores, with_sinks, zero_unseen

Tensor = torch.Tensor


def _seen_keys(call: Call, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor | None:
    """Which keys some query may see, ``(B|1, Hkv|1, 1, Lk)`` bool, or None when the mask hides none."""
    if call.mask is None:
        return None
    allowed = call.mask.evaluate(b, h, qi, ki, call.q_len, call.kv_len)  # broadcastable to (B, Hkv, G, Lq, Lk)
    while allowed.dim() < 5:
        allowed = allowed.unsqueeze(0)
    seen = allowed.any(dim=-2).any(dim=2, keepdim=True)  # (B|1, Hkv|1, 1, Lk)
    if torch.compiler.is_compiling() or seen.device.type == "meta":  # (no Python bool from tensor data)
        return seen
    return None if bool(seen.all()) else seen


def _probabilities(call: Call) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax weights (B, Hkv, G, Lq, Lk), lse (B, Hkv, G, Lq) in the accumulation dtype, and the values
    (B, Hkv, 1, Lk, Dv) to weigh (zero where no query may see the key)."""
    q, k = call.q, call.k
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    acc = accumulation_dtype(q.dtype)
    dev = q.device
    b, h, qi, ki = grouped_index(call, torch.arange(Lq, device=dev), torch.arange(Lk, device=dev))
    qg = q.reshape(B, Hkv, call.group, Lq, D).to(acc)  # (B, Hkv, G, Lq, D)
    kg = k.unsqueeze(2).to(acc)  # (B, Hkv, 1, Lk, D): shared by the G query heads, not copied
    vg = call.v.unsqueeze(2).to(acc)  # (B, Hkv, 1, Lk, Dv)
    seen = _seen_keys(call, b, h, qi, ki) if Lq and Lk else None
    if seen is not None:  # keys no query may see (padding garbage: NaN, inf) must reach no row
        kg, vg = zero_unseen(kg, seen), zero_unseen(vg, seen)
    s = torch.matmul(qg, kg.transpose(-1, -2)) * call.scale  # (B, Hkv, G, Lq, Lk)
    bias = grouped_bias(call.bias, call) if isinstance(call.bias, Tensor) else None
    s = modify_scores(s, call, b, h, qi, ki, bias_block=bias)
    if call.sinks is not None:  # one more column: the sink's logit, whose value is zero
        s = with_sinks(s, call.sinks.reshape(B, Hkv, call.group, 1, 1))
        return stable_softmax(s, dim=-1)[..., :Lk], logsumexp(s, dim=-1), vg
    return stable_softmax(s, dim=-1), logsumexp(s, dim=-1), vg


def weights(call: Call) -> Tensor:
    """Attention weights ``(B, Hq, Lq, Lk)`` in the input dtype (before dropout)."""
    p, _, _ = _probabilities(call)
    return p.reshape(call.batch, call.heads, call.q_len, call.kv_len).to(call.q.dtype)


def run(call: Call) -> Tensor | tuple[Tensor, Tensor]:
    p, lse, vg = _probabilities(call)
    if call.dropout_p > 0:
        keep = torch.rand_like(p) >= call.dropout_p
        p = p * keep / (1.0 - call.dropout_p)
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
