"""The ``sdpa`` backend: PyTorch's fused ``scaled_dot_product_attention`` for the calls it takes exactly.

Masks are passed as ``is_causal`` where SDPA's top-left causal mask is the same as attnkit's, and as
a dense bool (or, with a bias, float) mask otherwise.  Rows that may attend to nothing are computed
against every key and then zeroed, so their output is 0 and their gradients are 0, never NaN.  Keys no
query may see (padding garbage, NaN and inf included) reach no row: a call whose output is not finite
while the mask hides keys is made again with those keys and values zeroed.

Attention sinks enter as one more key every row sees: its value is zero and its score is the sink logit,
carried on a few columns added to q (see ``_with_sink_key``).  The mask then goes to SDPA as a tensor with
that key's column allowed, and a row that sees no other key attends to the sink alone (output 0).

Numerics: on CPU this is PyTorch's fused kernel, whose backward takes the weights from a float32
log-sum-exp and ``D = rowsum(dO * O)`` from the output.  Its gradients ``dq``, ``dk``, ``dv`` exceed the
numerical rule's bound ``3 * naive + 1e-6`` by up to 2x when the largest scaled score is below 4 (a residue
of about 1e-6 on rows with one key), 3x from 4 to 16, 8x from 16 to 64 and about 100x above (README, "The
numerical rule"; ``tests/backends/test_flash_properties.py`` checks the bounds).  ``backend="math"`` holds
to the rule at every score.
"""

from __future__ import annotations

import threading
import weakref
from typing import cast

import torch
import torch.nn.functional as F

from ..bias import ScoreMod
from ..masks import Dense, Mask
from .call import Call, accumulation_dtype, graph_zero, single_query_window
from .scores import per_mask, zero_unseen
from .reads import reachable_tensors, tensor_key

Tensor = torch.Tensor

_MAX_DENSE = 1 << 28  # largest mask/bias (elements) this backend materialises
# mask -> {shape key: (dense mask, live rows, all live, tensor key, tensors)}: the layers of one model share
# a mask; weakly keyed, so a dropped mask frees its dense forms, and a few shapes are kept per mask
# (dense mask, live rows, all live, tensor key, tensors, hidden keys)
_DenseEntry = tuple[Tensor, Tensor, bool, tuple[tuple[int, object], ...], list[Tensor], "Tensor | None"]
_DENSE_CACHE: weakref.WeakKeyDictionary[Mask, dict[tuple[int, int, int, int, torch.device], _DenseEntry]] = (
    weakref.WeakKeyDictionary()
)
_DENSE_PER_MASK = 4
_LOCK = threading.Lock()


def _is_plain_causal(call: Call) -> bool:
    """A causal mask SDPA's ``is_causal`` computes (top-left aligned; the fused kernel gives NaN for a
    negative scale, so such a call takes the mask as a tensor)."""
    m = call.mask
    return (
        m is not None
        and (m.is_causal("top_left") or (m.is_causal(None) and call.q_len == call.kv_len))
        and call.scale > 0
    )


def _dense_size(call: Call) -> int:
    return call.batch * call.heads * call.q_len * call.kv_len


def _hidden_keys(call: Call, allowed: Tensor, traced: bool = False) -> Tensor | None:
    """Keys no query may see, as ``(B'', Hkv'', Lk)`` bool (``B''`` 1 or B, ``Hkv''`` 1 or Hkv), or None when
    every key is seen by some query (traced: always the tensor)."""
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    seen = allowed.any(dim=-2)  # (B', H', Lk)
    if seen.shape[1] > 1 and call.group > 1:  # a kv head's key is seen if one of its G query heads sees it
        seen = seen.view(seen.shape[0], call.kv_heads, call.group, -1).any(dim=2)
    if traced:
        return ~seen
    return None if bool(seen.all()) else ~seen


def _dense(call: Call) -> tuple[Tensor, Tensor, bool, Tensor | None]:
    """The mask as bool (B', H', Lq, Lk), which rows see a key, whether all do, and the keys no query may
    see (``_hidden_keys``); memoised per mask."""
    m = cast(Mask, call.mask)  # (called for calls with a mask)
    form = m.form(call.q_len, call.kv_len)
    if torch.compiler.is_compiling() or call.q.device.type == "meta":  # traced (or meta: shapes only): no Python
        # bool from tensor data, no traced tensors memoised
        allowed = (
            form.mask
            if isinstance(form, Dense)
            else m.to_dense(call.q_len, call.kv_len, batch=call.batch, heads=call.heads, device=call.q.device)
        )
        # False: empty rows handled, also if none
        return allowed, allowed.any(dim=-1, keepdim=True), False, _hidden_keys(call, allowed, traced=True)
    if isinstance(form, Dense):  # a user's bool tensor: pass it as it is
        allowed = form.mask
        live = allowed.any(dim=-1, keepdim=True)
        return allowed, live, bool(live.all()), _hidden_keys(call, allowed)
    key = (call.batch, call.heads, call.q_len, call.kv_len, call.q.device)
    # the tensors the mask reads, by identity and in-place version: an edited or rebound tensor makes the
    # memo stale (the entry holds them, so their ids cannot be reused meanwhile)
    tensors = reachable_tensors(m)
    state = tensor_key(tensors)
    with _LOCK:
        store = per_mask(_DENSE_CACHE, m)
        if store is None:
            store = {}  # (an unhashable mask: no memo)
        hit = store.get(key)
    if hit is not None and hit[3] == state:
        return hit[0], hit[1], hit[2], hit[5]
    allowed = m.to_dense(call.q_len, call.kv_len, batch=call.batch, heads=call.heads, device=call.q.device)
    live = allowed.any(dim=-1, keepdim=True)  # (B', H', Lq, 1): rows that see at least one key
    entry = (allowed, live, bool(live.all()), state, tensors, _hidden_keys(call, allowed))
    with _LOCK:
        store.pop(key, None)
        while len(store) >= _DENSE_PER_MASK:
            store.pop(next(iter(store)))
        store[key] = entry
    return entry[0], entry[1], entry[2], entry[5]


def _without_hidden(k: Tensor, v: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """``k``, ``v`` with the keys no query may see (``hidden``, ``(B'', Hkv'', Lk)``) zeroed (copies)."""
    seen = ~hidden
    return zero_unseen(k, seen), zero_unseen(v, seen)


def check(call: Call) -> str | None:
    if call.softcap is not None:
        return "SDPA has no softcap"
    if call.return_lse:
        return "SDPA does not return the log-sum-exp"
    if call.sinks is not None and call.scale == 0:
        return "with scale=0 the sink logit cannot ride on an extra key (it enters as logit / scale)"
    if call.sinks is not None and sinks_too_large(call):
        return (
            f"a sink logit of {float(call.sinks.detach().abs().max()):.3g} at scale={call.scale:.3g} is beyond "
            f"what the sink key can carry in {call.q.dtype} (the other backends take it)"
        )
    b = call.bias
    if isinstance(b, ScoreMod) and not (b.additive or b.scale_factor is not None):
        return f"SDPA takes only additive score modifiers (ALiBi, T5 buckets) or a scalar temperature, not {b!r}"
    needs_dense = (call.mask is not None and not _is_plain_causal(call)) or (isinstance(b, ScoreMod) and b.additive)
    if needs_dense and _dense_size(call) > _MAX_DENSE:
        return f"the mask/bias would be materialised as {_dense_size(call):,} elements (limit {_MAX_DENSE:,})"
    return None


def unfused_on_cpu(call: Call) -> bool:
    """Whether PyTorch runs ``call`` through its unfused math path: its fused CPU kernel needs the value head
    size equal to the query's (latent attention's decode, 576 against 512, fell back to it: a one-query step
    over 1,024 keys and 16 heads took ~100x the tiled backends' time)."""
    return call.q.device.type == "cpu" and call.q.shape[-1] != call.v.shape[-1]


def cost(call: Call) -> float:
    if call.q_len == 0 or call.kv_len == 0:  # nothing to compute (attention() returns zeros)
        return 0.0
    if unfused_on_cpu(call):  # PyTorch's math path: the scores materialised, k and v copied per query head
        return 8.0 * call.flops()
    window = single_query_window(call)
    if window is not None:  # decoding: only the visible keys are read
        return call.flops() * max(window[1] - window[0] + 1, 0) / call.kv_len
    if call.sinks is not None:  # copies of q, k, v one key and a few columns wider, the mask dense
        d = call.q.shape[-1]
        widen = (d + _sink_columns(d)) / d
        return call.flops() * widen * (1.6 if call.mask is not None else 1.0) * 1.1
    dense = call.mask is not None and not _is_plain_causal(call)
    return call.flops() * (1.6 if dense else (0.55 if call.mask is not None else 1.0))


def _sink_columns(d: int) -> int:
    """Columns added to q and k for a sink: three (the logit in three parts), rounded up so the width stays
    a multiple of 8 (the fused kernels' preference)."""
    return 3 + (-(d + 3)) % 8


def _sink_key_value(sinks: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """The smallest power of two ``c >= 1`` that keeps ``|sinks| / (scale * c)`` below a sixteenth of
    ``dtype``'s largest value (and of that over ``scale`` when ``scale > 1``), as a 0-dim tensor."""
    limit = torch.finfo(dtype).max / 16 / max(1.0, abs(scale))
    need = (sinks.abs().amax() / (abs(scale) * limit)).clamp(min=1.0)
    return torch.exp2(torch.ceil(torch.log2(need)))


def sinks_too_large(call: Call) -> bool:
    """Whether the sink key's value (:func:`_sink_key_value`) would overflow the inputs' dtype (float16 with a
    sink beyond about ``1.6e7 * scale``).  Read from the data (one sync, as the sinks' finiteness check makes);
    not while ``torch.compile`` traces."""
    if torch.compiler.is_compiling() or call.q.device.type == "meta" or call.scale == 0:
        return False  # (scale=0: check refuses the sinks anyway)
    dtype = call.q.dtype
    top = torch.finfo(dtype).max / 16
    sinks = cast(Tensor, call.sinks)  # (asked for calls with sinks)
    if torch.finfo(sinks.dtype).max / (abs(call.scale) * top / max(1.0, abs(call.scale))) <= top:
        return False  # no value of the sinks' dtype is too large: nothing to read (the usual case)
    c = _sink_key_value(sinks.detach().to(accumulation_dtype(dtype)), call.scale, dtype)
    return not bool(c <= torch.finfo(dtype).max / 16)


def _with_sink_key(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``q``, ``k``, ``v`` with the sinks as one more key that every query sees: its value is zero and its
    score is each head's sink logit.  q gains columns holding ``sink / scale`` (split into a rounded part
    and the remainder, so the logit keeps float32 precision in bfloat16), the keys zeros there, and the
    added key ones there and zeros elsewhere: its scaled score is ``sink`` for every row of that head, and
    with grouped heads each query head still gets its own logit.  Gradients reach ``sinks`` through q."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    extra = _sink_columns(D)
    acc = accumulation_dtype(q.dtype)
    # the added key holds c (a power of two, 1 unless needed) so that q's parts, sink / (scale * c), stay far
    # inside q's dtype (float16 holds at most 65504: sinks=2e4 at scale 1/4 would be inf); computed from the
    # tensors, with no sync and nothing data-dependent in the shapes
    c = _sink_key_value(sinks.detach().to(acc), scale, q.dtype)
    s = sinks.to(acc) / c / scale  # (B, Hq)
    parts: list[Tensor] = []
    left = s
    for _ in range(3):  # values that q's dtype holds exactly; their gradient stays in acc (no rounding)
        part = left + (left.to(q.dtype).to(acc) - left).detach()
        parts.append(part)
        left = left - part
    # the rows' gradients are summed in acc (a sum over Lq rows rounded to bfloat16 would be off by an ulp)
    stacked = torch.stack(parts, dim=-1)[:, :, None, :].expand(B, Hq, Lq, 3).to(q.dtype)
    q2 = torch.cat([q, stacked, q.new_zeros(B, Hq, Lq, extra - 3)], dim=-1)
    key = k.new_zeros(1, 1, 1, D + extra)
    key[..., D : D + 3] = c.to(k.dtype)
    k2 = torch.cat([torch.cat([k, k.new_zeros(B, Hkv, Lk, extra)], dim=-1), key.expand(B, Hkv, 1, D + extra)], dim=2)
    v2 = torch.cat([v, v.new_zeros(B, Hkv, 1, v.shape[-1])], dim=2)
    return q2, k2, v2


def _run_sinks(call: Call, q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor | None, gqa: bool) -> Tensor:
    """SDPA with the sinks as an extra key every row sees (:func:`_with_sink_key`).  A row whose mask
    allows no key attends to the sink alone: its output is the sink's zero value and its gradients are
    zero, as attnkit's rule says, without zeroing afterwards."""
    allowed = hidden = None
    if call.mask is not None:
        allowed, _, _, hidden = _dense(call)
    traced = torch.compiler.is_compiling() or q.device.type == "meta"
    if hidden is not None and traced:
        k, v = _without_hidden(k, v, hidden)

    sinks = cast(Tensor, call.sinks)  # (run for calls with sinks)

    def once(k: Tensor, v: Tensor) -> Tensor:
        q2, k2, v2 = _with_sink_key(q, k, v, sinks, scale)
        attn_mask = None
        if allowed is not None or bias is not None:
            Lq, Lk = call.q_len, call.kv_len
            rows = allowed if allowed is not None else torch.ones(1, 1, Lq, Lk, dtype=torch.bool, device=q.device)
            while rows.dim() < 4:
                rows = rows.unsqueeze(0)
            attn_mask = torch.cat([rows, rows.new_ones(*rows.shape[:-1], 1).expand(*rows.shape[:-1], 1)], dim=-1)
            if bias is not None:
                b = torch.broadcast_to(
                    bias.to(q.dtype),
                    # (torch.broadcast_shapes has no annotations in torch's sources)
                    (*torch.broadcast_shapes(bias.shape[:-1], rows.shape[:-1]), Lk),  # type: ignore[no-untyped-call]
                )
                b = torch.cat([b, b.new_zeros(*b.shape[:-1], 1)], dim=-1)
                attn_mask = b.masked_fill(~attn_mask, float("-inf"))
        return F.scaled_dot_product_attention(
            q2, k2, v2, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=scale, enable_gqa=gqa
        )

    out = once(k, v)
    # a NaN or inf in a key no query may see reaches the rows through SDPA's arithmetic (see run): only then
    # is the call made again with those keys zeroed
    if hidden is not None and not traced and not bool(torch.isfinite(out.detach()).all()):
        k, v = _without_hidden(k, v, hidden)
        out = once(k, v)
    return out


def run(call: Call) -> Tensor:
    q, k, v = call.q, call.k, call.v
    scale = call.scale
    bias = call.bias
    if isinstance(bias, ScoreMod) and not bias.additive:
        # a scalar temperature folds into the scale (check takes a non-additive modifier only with a factor)
        scale, bias = scale * cast(float, bias.scale_factor), None
    elif isinstance(bias, ScoreMod):
        bias = bias.materialize(
            call.q_len, call.kv_len, batch=call.batch, heads=call.heads, device=q.device, dtype=q.dtype
        )
    if bias is not None:
        while bias.dim() < 4:  # SDPA wants a mask of at least 2 dims; (B', H', Lq', Lk') broadcasts
            bias = bias.unsqueeze(0)
    gqa = True if call.group > 1 else False  # (a Python bool, a guard, also for symbolic head counts)
    if call.sinks is not None:
        return _run_sinks(call, q, k, v, scale, bias, gqa)
    if call.mask is None or _is_plain_causal(call):

        def plain(k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
            causal = call.mask is not None
            attn_mask = None if bias is None else bias.to(q.dtype)
            if causal and attn_mask is not None:  # SDPA takes either is_causal or attn_mask
                allowed = cast(Mask, call.mask).to_dense(call.q_len, k.shape[2], device=q.device)
                attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
                causal = False
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
            )

        # top-left causal with Lq < Lk: the keys past Lq are seen by no query; a NaN or inf there (padding
        # garbage) must not reach the rows: the call is made without them (traced: always; else when the
        # output is not finite)
        hides = call.mask is not None and call.q_len < call.kv_len
        traced = torch.compiler.is_compiling() or q.device.type == "meta"  # (no Python bool from tensor data)
        out = None if hides and traced else plain(k, v, bias)
        if hides and (out is None or not bool(torch.isfinite(out.detach()).all())):
            n = call.q_len
            out = plain(k[:, :, :n], v[:, :, :n], None if bias is None else bias[..., :n])
        return cast(Tensor, out)  # (None only when hides, and then computed just above)
    window = single_query_window(call)
    if window is not None:  # decoding one token against a cache: slice the visible keys
        lo, hi = window
        if hi < lo:
            return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device) + graph_zero(q, k, v)
        return F.scaled_dot_product_attention(
            q, k[:, :, lo : hi + 1], v[:, :, lo : hi + 1], dropout_p=call.dropout_p, scale=scale, enable_gqa=gqa
        )
    allowed, live, all_live, hidden = _dense(call)
    traced = torch.compiler.is_compiling()
    if hidden is not None and traced:
        k, v = _without_hidden(k, v, hidden)
    if not all_live:
        allowed = allowed | ~live  # compute empty rows against every key, then zero them below
    attn_mask = allowed if bias is None else bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=scale, enable_gqa=gqa
    )
    # SDPA adds the mask to the scores (NaN - inf is NaN) and weighs every value (0 * inf is NaN): a NaN or
    # inf in a key no query may see (padding garbage) reaches every row it shares a call with, also the
    # empty rows computed against every key.  Such a row's output is then not finite: only then is the call
    # made again with those keys zeroed (a check of the output, not a pass over the keys and values)
    if hidden is not None and not traced and q.device.type != "meta" and not bool(torch.isfinite(out.detach()).all()):
        k, v = _without_hidden(k, v, hidden)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=scale, enable_gqa=gqa
        )
    if not all_live:  # (where, not a product: a NaN in a key such a row cannot see must not leak into it)
        out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out
