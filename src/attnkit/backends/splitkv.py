"""The ``splitkv`` backend: decode attention on the CPU, the keys split into chunks merged by log-sum-exp.

A decode step asks one query (or a few) per head about a long cache.  PyTorch's fused kernel treats each
query head alone, so with grouped-query heads it streams every key and value ``G = Hq / Hkv`` times, and it
splits its work over (batch, heads), which a batch of one with few heads leaves uneven.  Here the ``G``
query heads that share a key/value head are one matrix of ``G * Lq`` rows (``q`` viewed as
``(B, Hkv, G*Lq, D)``; keys and values are read in place, never repeated or copied), so each key is read
once per step.  One query under a causal or sliding-window mask sees one window of keys, read as a view
without the mask.  Without mask, bias or softcap the call is three operations (scores, softmax, weighted
sum over the grouped rows).  When (sequence, kv head) pieces are fewer than :data:`SPLIT_BELOW` (torch's
thread count by default), and for masks, score modifiers and softcap, the keys of each piece are viewed
as ``C`` chunks of ``n`` keys (``(C, n, D)``, a view; ``C = 1`` when there are pieces enough), each chunk
gives its own normalised output and log-sum-exp, and the chunks merge as :func:`attnkit.softmax.merge`
merges two (flash-decoding).  :func:`paged_decode` does the same over a paged pool, a block per chunk.

Masks, score modifiers, softcap and sinks apply as in every backend (the order of the contract); keys
that no query may see reach no row, also when they hold NaN or inf (padding garbage); a row that may
see nothing gives 0 and ``lse = -inf``.  Forward only (no gradients), CPU, floating dtypes; half inputs
are accumulated in float32.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import torch

from ..softmax import add_sink_unchecked as add_sink  # (inputs checked by the call)
from .call import Call, accumulation_dtype, single_query_window
from .scores import modify_scores

if TYPE_CHECKING:
    from ..bias import ScoreMod
    from ..masks import Mask

Tensor = torch.Tensor

# Below this many (sequence, kv head) pieces the keys are split into chunks: fewer pieces than threads
# leave threads idle (None: torch's thread count)
SPLIT_BELOW: int | None = None
CHUNKS = 16  # chunks per (sequence, kv head) when split: more pieces than threads, so none waits long
MIN_CHUNK = 512  # keys per chunk at least (shorter chunks cost more in per-chunk work than they spread)
# auto takes this backend for CPU calls with at most DECODE_ROWS query rows per kv head (G * Lq) and at
# least MIN_KEYS keys over the batch; below, one fused kernel call costs less than this backend's
# operations (measured in one process on the 2-core machine, batch 1, 8 query / 2 kv heads, D=128, on a
# busy machine: 0.38x SDPA at 4k keys, 0.69x at 8k, 1.73x at 32k; batch 4 at 8k: 1.76x)
DECODE_ROWS = 64
MIN_KEYS = 16384


def check(call: Call) -> str | None:
    """Backend hook: None when the call is taken, else why not."""
    if call.q.device.type != "cpu":
        return f"split-KV decoding runs on the CPU, the tensors are on {call.q.device.type}"
    if call.needs_grad:
        return "split-KV decoding computes no gradients (call under torch.no_grad(), or use flash or math)"
    if call.dropout_p > 0:
        return "split-KV decoding has no dropout"
    if not call.q.is_floating_point():
        return f"split-KV decoding takes floating dtypes, got {call.q.dtype}"
    return None


def wins(call: Call) -> bool:
    """Whether ``call`` is a CPU decode call this backend beats PyTorch's fused kernel on: few query rows per
    kv head against at least :data:`MIN_KEYS` keys over the batch (see :func:`cost`)."""
    return call.group * call.q_len <= DECODE_ROWS and call.batch * call.kv_len >= MIN_KEYS and check(call) is None


def cost(call: Call) -> float:
    """Backend hook: half the fused kernel's cost for the long decode calls it wins (:func:`wins`), the
    materialised scores' cost (like ``math``) otherwise."""
    if call.q_len == 0 or call.kv_len == 0:
        return 0.0
    return call.flops() * (0.5 if wins(call) else 4.0)


def _split(call: Call) -> tuple[int, int]:
    """``(C, n)``: chunks per (sequence, kv head) and keys per chunk (the last ``Lk - C*n`` keys are one
    more, shorter chunk)."""
    Lk = call.kv_len
    below = torch.get_num_threads() if SPLIT_BELOW is None else SPLIT_BELOW
    if call.batch * call.kv_heads >= below or Lk < 2 * MIN_CHUNK:
        return 1, Lk
    n = max(MIN_CHUNK, -(-Lk // CHUNKS))
    return Lk // n, n


def _bias_rows(call: Call) -> Tensor | None:
    """A tensor bias as ``(B|1, Hkv|1, G*Lq|1, Lk|1)``, the layout of the grouped query rows."""
    bias = call.bias
    if not isinstance(bias, Tensor):
        return None
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    Bb, Hb, Lqb, Lkb = bias.shape
    if Hb == 1 and Lqb == 1:
        return bias  # (B|1, 1, 1, Lk|1): every row alike
    G, Lq = call.group, call.q_len
    return bias.expand(Bb, call.heads, Lq, Lkb).reshape(Bb, call.kv_heads, G * Lq, Lkb)


def _pieces(
    call: Call,
    qg: Tensor,
    bias_rows: Tensor | None,
    bs: slice,
    hs: slice,
    a: int,
    C: int,
    n: int,
    acc: torch.dtype,
    kv: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Keys ``a .. a + C*n`` of sequences ``bs`` and kv heads ``hs`` as ``C`` chunks of ``n``: each chunk's
    normalised output ``(Bx, Hx, C, G*Lq, Dv)`` and log-sum-exp ``(Bx, Hx, C, G*Lq)``, in ``acc``.  ``kv``:
    those chunks' keys and values ``(Bx, Hx, C, n, D|Dv)`` when they are not ``call.k``'s (a paged pool)."""
    G, Lq = call.group, call.q_len
    dev = call.q.device
    if kv is None:
        # views (Bx, Hx, C, n, D|Dv), no copy (PyTorch leaves Tensor.unflatten unannotated)
        k = call.k[bs, hs, a : a + C * n].unflatten(2, (C, n))  # type: ignore[no-untyped-call]  # (Bx, Hx, C, n, D)
        v = call.v[bs, hs, a : a + C * n].unflatten(2, (C, n))  # type: ignore[no-untyped-call]  # (Bx, Hx, C, n, Dv)
    else:
        k, v = kv
    q = qg[bs, hs].unsqueeze(2)  # (Bx, Hx, 1, G*Lq, D)
    s = torch.matmul(q, k.transpose(-1, -2))  # (Bx, Hx, C, G*Lq, n)
    s = s.to(acc) * call.scale
    modified = call.mask is not None or call.bias is not None or call.softcap is not None
    allowed = None
    if modified:
        rows = torch.arange(G * Lq, device=dev)
        bi = torch.arange(call.batch, device=dev)[bs].view(-1, 1, 1, 1, 1)
        hi = torch.arange(call.kv_heads, device=dev)[hs].view(1, -1, 1, 1, 1) * G + (rows // Lq).view(
            1, 1, 1, -1, 1
        )  # query head of each row
        qi = (rows % Lq).view(1, 1, 1, -1, 1)
        ki = (a + torch.arange(C * n, device=dev)).view(1, 1, C, 1, n)
        block = None
        if bias_rows is not None:
            block = bias_rows[
                bs if bias_rows.shape[0] > 1 else slice(None), hs if bias_rows.shape[1] > 1 else slice(None)
            ]  # (Bx|1, Hx|1, GL|1, Lk|1)
            block = (
                block[..., a : a + C * n].unflatten(-1, (C, n))  # type: ignore[no-untyped-call]  # (as above)
                if block.shape[-1] > 1
                else block.unsqueeze(-1)
            ).transpose(-3, -2)  # (Bx|1, Hx|1, C|1, GL|1, n|1)
        s = modify_scores(s, call, bi, hi, qi, ki, bias_block=block, apply_mask=False)
        if call.mask is not None:
            allowed = call.mask.evaluate(bi, hi, qi, ki, Lq, call.kv_len)
            s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (Bx, Hx, C, G*Lq, 1)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=acc))  # a row that sees nothing: exp(-inf) = 0
    p = torch.exp(s - m)
    total = p.sum(dim=-1)  # (Bx, Hx, C, G*Lq)
    o = torch.matmul(p.to(v.dtype), v)  # (Bx, Hx, C, G*Lq, Dv)
    if allowed is not None and not bool(torch.isfinite(o).all()):
        # a weight 0 still reads its value (0 * NaN is NaN): values that no row of the chunk sees are zeroed
        seen = torch.broadcast_to(allowed, s.shape).any(dim=-2)  # (Bx, Hx, C, n)
        o = torch.matmul(p.to(v.dtype), torch.where(seen[..., None], v, torch.zeros((), dtype=v.dtype)))
    empty = total == 0
    safe = torch.where(empty, torch.ones((), dtype=acc), total)
    o = o.to(acc) / safe[..., None]
    lse = torch.where(empty, torch.full((), float("-inf"), dtype=acc), m.squeeze(-1) + torch.log(safe))
    return o, lse


def _merge(o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge chunks ``o (..., C, R, Dv)``, ``lse (..., C, R)`` over ``C``: ``(..., R, Dv)``, ``(..., R)``."""
    m = lse.amax(dim=-2, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=lse.dtype))
    w = torch.exp(lse - m)  # (..., C, R): 0 for an empty chunk
    total = w.sum(dim=-2)  # (..., R)
    empty = total == 0
    safe = torch.where(empty, torch.ones((), dtype=total.dtype), total)
    out = (o * (w / safe.unsqueeze(-2))[..., None]).sum(dim=-3)
    return out, torch.where(empty, torch.full((), float("-inf"), dtype=total.dtype), m.squeeze(-2) + torch.log(safe))


def _window(call: Call) -> tuple[int, int] | None:
    """The keys ``[lo, hi]`` one query sees under an interval mask (causal, sliding window: the same for
    every sequence and head) and no bias: those keys are read as a view, without the mask."""
    return single_query_window(call) if call.mask is not None else None


def _plain(call: Call, acc: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """No mask, bias or softcap: ``softmax(q k^T * scale) v`` in three operations over the grouped rows,
    ``(B, Hkv, G*Lq, Dv)``, with the log-sum-exp ``(B, Hkv, G*Lq)`` when the call needs it (else None)."""
    q = call.q
    B, Hq, Lq, D = q.shape
    qg = (q.to(acc) * call.scale).to(q.dtype).reshape(B, call.kv_heads, call.group * Lq, D)  # (B, Hkv, G*Lq, D)
    s = torch.matmul(qg, call.k.transpose(-1, -2)).to(acc)  # (B, Hkv, G*Lq, Lk)
    lse = torch.logsumexp(s, dim=-1) if call.return_lse or call.sinks is not None else None
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p.to(call.v.dtype), call.v).to(acc), lse


def run(call: Call) -> Tensor | tuple[Tensor, Tensor]:
    """Backend hook: ``out (B, Hq, Lq, Dv)``, with ``lse (B, Hq, Lq)`` when ``call.return_lse``."""
    q = call.q
    B, Hq, Lq, _ = q.shape
    Hkv, Lk, Dv = call.kv_heads, call.kv_len, call.v.shape[-1]
    acc = accumulation_dtype(q.dtype)
    window = _window(call) if B * Hq * Lq and Lk else None
    if window is not None and window[1] >= window[0]:  # one query, an interval mask: its keys, no mask
        lo, hi = window
        return run(
            dataclasses.replace(call, k=call.k[:, :, lo : hi + 1], v=call.v[:, :, lo : hi + 1], mask=None, cache={})
        )
    if B * Hq * Lq == 0 or Lk == 0 or window is not None:  # (an empty window: nothing to see)
        out = q.new_zeros(B, Hq, Lq, Dv)
        lse: Tensor | None = torch.full((B, Hq, Lq), float("-inf"), dtype=acc, device=q.device)
    elif call.mask is None and call.bias is None and call.softcap is None and _split(call)[0] == 1:
        o, lse = _plain(call, acc)
        out = o.reshape(B, Hq, Lq, Dv)  # (B, Hkv, G*Lq, Dv) -> (B, Hq, Lq, Dv)
        lse = None if lse is None else lse.reshape(B, Hq, Lq)
    else:
        qg = q.reshape(B, Hkv, call.group * Lq, q.shape[-1])  # (B, Hkv, G*Lq, D): a view of contiguous q
        bias_rows = _bias_rows(call)
        C, n = _split(call)
        outs, lses = [], []
        pieces = (
            [(slice(b, b + 1), slice(h, h + 1)) for b in range(B) for h in range(Hkv)]
            if C > 1
            else [(slice(None), slice(None))]
        )  # split: one (sequence, kv head) at a time
        for bs, hs in pieces:
            o, lse = _pieces(call, qg, bias_rows, bs, hs, 0, C, n, acc)
            if C * n < Lk:  # the last, shorter chunk
                o2, lse2 = _pieces(call, qg, bias_rows, bs, hs, C * n, 1, Lk - C * n, acc)
                o, lse = torch.cat([o, o2], dim=2), torch.cat([lse, lse2], dim=2)
            o, lse = _merge(o, lse) if o.shape[2] > 1 else (o.squeeze(2), lse.squeeze(2))
            outs.append(o)
            lses.append(lse)
        if len(pieces) > 1:  # (B*Hkv, 1, 1, G*Lq, ...) pieces back to (B, Hkv, G*Lq, ...)
            o = torch.cat(outs).view(B, Hkv, *outs[0].shape[2:])
            lse = torch.cat(lses).view(B, Hkv, *lses[0].shape[2:])
        out = o.reshape(B, Hq, Lq, Dv)  # (B, Hkv, G*Lq, Dv) -> (B, Hq, Lq, Dv)
        lse = cast(Tensor, lse).reshape(B, Hq, Lq)  # (pieces is never empty)
    if call.sinks is not None:
        out, lse = add_sink(out, cast(Tensor, lse), call.sinks)  # (lse is computed when there are sinks)
    out = out.to(q.dtype)
    if call.return_lse:
        lse = cast(Tensor, lse)  # (and when the call returns it)
        return out, lse.to(torch.promote_types(lse.dtype, torch.float32))
    return out


def takes_paged(
    q: Tensor, k_pool: Tensor, runs: list[list[tuple[int, int]]], lens: list[int], mask: object, bias: object
) -> bool:
    """Whether :func:`paged_decode` takes a paged decode call: CPU, no gradients, one query per sequence,
    a block-major pool, each sequence's blocks one run of consecutive ids, and a sequence of at least
    :data:`MIN_KEYS` keys; a mask, when given, an :class:`attnkit.masks.Mask`, a bias None or a modifier."""
    from ..masks import Mask

    return (
        q.device.type == "cpu"
        and q.shape[2] == 1
        and q.is_floating_point()
        and not (torch.is_grad_enabled() and (q.requires_grad or k_pool.requires_grad))
        and k_pool.is_contiguous()
        and max(lens, default=0) >= MIN_KEYS
        and all(len(r) <= 1 for r in runs)
        and (mask is None or isinstance(mask, Mask))
        and (bias is None or not isinstance(bias, Tensor))
    )


def paged_decode(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    runs: list[list[tuple[int, int]]],
    lens: list[int],
    *,
    scale: float,
    softcap: float | None = None,
    bias: ScoreMod | None = None,
    mask: Mask | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Decode attention over a paged pool whose sequences each hold one run of consecutive blocks
    (:func:`takes_paged`): each block is a chunk, read where it lies, and the chunks merge by log-sum-exp.

    ``q (B, Hq, 1, D)``; ``k_pool (NB, Hkv, bs, D)``, ``v_pool (NB, Hkv, bs, Dv)``; ``runs[b]`` is
    ``[(first block, count)]`` (or empty), ``lens[b]`` the keys of sequence ``b``; ``sinks (B, Hq)`` or None.
    Masks and modifiers see each sequence's own positions (its query at ``lens[b] - 1``).  Returns
    ``(B, Hq, 1, Dv)`` in ``q``'s dtype; a sequence without keys gets zeros.
    """
    from ..masks import key_padding

    B, Hq, Lq, D = q.shape
    Hkv, bs, Dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[3]
    acc = accumulation_dtype(q.dtype)
    outs: list[Tensor] = []
    for b in range(B):
        L = lens[b]
        if L == 0 or not runs[b]:
            out = q.new_zeros(1, Hq, Lq, Dv)
            lse = torch.full((1, Hq, Lq), float("-inf"), dtype=acc)
        else:
            first, count = runs[b][0]
            kv = (
                k_pool[first : first + count].transpose(0, 1).unsqueeze(0),  # (1, Hkv, N, bs, D): a view
                v_pool[first : first + count].transpose(0, 1).unsqueeze(0),
            )  # (1, Hkv, N, bs, Dv)
            hidden = key_padding([L])  # the unfilled end of the last block
            shape = torch.zeros((), dtype=q.dtype).expand  # (k and v of the call: shapes only, no memory)
            call = Call(
                q[b : b + 1],
                shape(1, Hkv, L, D),
                shape(1, Hkv, L, Dv),
                hidden if mask is None else hidden & mask,
                bias,
                scale,
                softcap,
                0.0,
                True,
            )
            qg = call.q.reshape(1, Hkv, call.group * Lq, D)  # (1, Hkv, G*Lq, D)
            o, lse = _pieces(call, qg, None, slice(None), slice(None), 0, count, bs, acc, kv)
            o, lse = _merge(o, lse)  # (1, Hkv, G*Lq, Dv), (1, Hkv, G*Lq)
            out, lse = o.reshape(1, Hq, Lq, Dv), lse.reshape(1, Hq, Lq)
        if sinks is not None:
            out, lse = add_sink(out, lse, sinks[b : b + 1])
        outs.append(out.to(q.dtype))
    return torch.cat(outs)
