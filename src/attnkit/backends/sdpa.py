"""The ``sdpa`` backend: PyTorch's fused ``scaled_dot_product_attention`` for the calls it takes exactly.

Masks are passed as ``is_causal`` where SDPA's top-left causal mask is the same as attnkit's, and as
a dense bool (or, with a bias, float) mask otherwise.  Rows that may attend to nothing are computed
against every key and then zeroed, so their output is 0 and their gradients are 0, never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..bias import ScoreMod
from ..masks import _Causal, _FromDense
from ._common import Call

Tensor = torch.Tensor

_MAX_DENSE = 1 << 28  # largest mask/bias (elements) this backend materialises


def _is_plain_causal(call: Call) -> bool:
    m = call.mask
    return isinstance(m, _Causal) and (m.align == "top_left" or call.q_len == call.kv_len)


def _dense_size(call: Call) -> int:
    return call.batch * call.heads * call.q_len * call.kv_len


def check(call: Call) -> str | None:
    if call.softcap is not None:
        return "SDPA has no softcap"
    if call.return_lse:
        return "SDPA does not return the log-sum-exp"
    b = call.bias
    if isinstance(b, ScoreMod) and not (b.additive or b.scale_factor is not None):
        return f"SDPA takes only additive score modifiers (ALiBi, T5 buckets) or a scalar temperature, not {b!r}"
    needs_dense = (call.mask is not None and not _is_plain_causal(call)) or (
        isinstance(b, ScoreMod) and b.additive)
    if needs_dense and _dense_size(call) > _MAX_DENSE:
        return f"the mask/bias would be materialised as {_dense_size(call):,} elements (limit {_MAX_DENSE:,})"
    return None


def cost(call: Call) -> float:
    dense = call.mask is not None and not _is_plain_causal(call)
    return call.flops() * (1.6 if dense else (0.55 if call.mask is not None else 1.0))


def run(call: Call):
    q, k, v = call.q, call.k, call.v
    scale = call.scale
    bias = call.bias
    if isinstance(bias, ScoreMod) and not bias.additive:
        scale, bias = scale * bias.scale_factor, None  # a scalar temperature folds into the scale
    elif isinstance(bias, ScoreMod):
        bias = bias.materialize(call.q_len, call.kv_len, batch=call.batch, heads=call.heads,
                                device=q.device, dtype=q.dtype)
    if bias is not None:
        while bias.dim() < 4:  # SDPA wants a mask of at least 2 dims; (B', H', Lq', Lk') broadcasts
            bias = bias.unsqueeze(0)
    gqa = call.group > 1
    if call.mask is None or _is_plain_causal(call):
        causal = call.mask is not None
        attn_mask = None if bias is None else bias.to(q.dtype)
        if causal and attn_mask is not None:  # SDPA takes either is_causal or attn_mask
            allowed = call.mask.to_dense(call.q_len, call.kv_len, device=q.device)
            attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
            causal = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p,
                                              is_causal=causal, scale=scale, enable_gqa=gqa)
    if isinstance(call.mask, _FromDense):  # a user's bool tensor: pass it as it is
        allowed = call.mask.t
    else:
        allowed = call.mask.to_dense(call.q_len, call.kv_len, batch=call.batch, heads=call.heads, device=q.device)
    live = allowed.any(dim=-1, keepdim=True)  # (B', H', Lq, 1): rows that see at least one key
    all_live = bool(live.all())
    if not all_live:
        allowed = allowed | ~live  # compute empty rows against every key, then zero them below
    attn_mask = allowed if bias is None else bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p,
                                         scale=scale, enable_gqa=gqa)
    if not all_live:
        out = out * live.to(out.dtype)
    return out
