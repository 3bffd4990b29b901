"""What every backend shares: the score pipeline on a block (grouped heads, the score modifier, softcap, mask,
sinks), the accumulation dtype, the sinks' gradient and the paged checks.  Other packages that compute
attention themselves (caches, probes, losses) import it too."""

from __future__ import annotations

import weakref
from typing import TypeVar, cast

import torch

from ..bias import ScoreMod
from ..masks import Mask
from .call import Call


Tensor = torch.Tensor


def sink_grad(out: Tensor, lse: Tensor, dout: Tensor | None, dlse: Tensor | None, sinks: Tensor) -> Tensor:
    """The gradient of the sinks ``(B, Hq)`` from a result ``out (B, Hq, Lq, Dv)``, ``lse (B, Hq, Lq)`` that
    includes them: ``d sink = sum over rows of p_sink * (dlse - rowsum(dout * out))`` where
    ``p_sink = exp(sink - lse)`` (the weight the sink took; 1 in a row that saw no key, whose output is 0)."""
    acc = lse.dtype
    p = torch.exp(sinks.to(acc)[..., None] - lse)  # (B, Hq, Lq)
    g = torch.zeros_like(p)
    if dout is not None:
        g = g - (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        g = g + dlse.to(acc)
    return (p * g).sum(-1).to(sinks.dtype)


def grouped_heads(kv_heads: int, group: int, device: torch.device | str | None) -> Tensor:
    """Query head numbers ``(Hkv, G)``: query head ``hkv * G + g`` shares key/value head ``hkv``."""
    return torch.arange(kv_heads * group, device=device).view(kv_heads, group)


def grouped_index(call: Call, q_rows: Tensor, k_cols: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tensors that broadcast over the grouped score layout (B, Hkv, G, rows, cols).

    ``h`` counts query heads: query head ``hkv * G + g`` shares key/value head ``hkv``.
    """
    dev = call.q.device
    b = torch.arange(call.batch, device=dev).view(-1, 1, 1, 1, 1)
    h = grouped_heads(call.kv_heads, call.group, dev).view(1, call.kv_heads, call.group, 1, 1)
    return b, h, q_rows.view(1, 1, 1, -1, 1), k_cols.view(1, 1, 1, 1, -1)


def zero_unseen(x: Tensor, seen: Tensor) -> Tensor:
    """``x (..., L, E)`` with the rows (keys or values) that ``seen`` (bool, broadcastable to ``(..., L)``) marks
    False set to 0.

    A key no query may see gets weight 0, but a product with a zero weight still reads it (``0 * NaN`` is
    NaN, ``-inf + NaN`` is NaN): padding garbage, as in an uninitialised buffer, would reach every row.
    Zeroed, it cannot; its gradient is 0.  A ``where``, not a product, so NaN and inf are replaced too.
    """
    return torch.where(seen[..., None], x, torch.zeros((), dtype=x.dtype, device=x.device))


def grouped_bias(bias: Tensor, call: Call) -> Tensor:
    """A float bias broadcastable to (B, Hq, Lq, Lk), viewed as (B', Hkv|1, G|1, Lq', Lk')."""
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    b, h, lq, lk = bias.shape
    if h == 1:
        return bias.view(b, 1, 1, lq, lk)
    return bias.reshape(b, call.kv_heads, call.group, lq, lk)


def modify_scores(
    s: Tensor,
    call: Call,
    b: Tensor,
    h: Tensor,
    q: Tensor,
    k: Tensor,
    bias_block: Tensor | None = None,
    apply_mask: bool = True,
) -> Tensor:
    """softcap, then bias, then mask, on a block of scaled scores in the grouped layout.

    ``q``/``k`` are the block's query rows / keys as broadcastable index tensors; ``bias_block`` is the
    matching slice of a tensor bias (the caller slices it).
    """
    return score_pipeline(
        s,
        b,
        h,
        q,
        k,
        call.q_len,
        call.kv_len,
        softcap=call.softcap,
        bias=call.bias,
        mask=call.mask if apply_mask else None,
        bias_block=bias_block,
    )


def score_pipeline(
    s: Tensor,
    b: Tensor | None,
    h: Tensor | None,
    q: Tensor | None,
    k: Tensor | None,
    q_len: int,
    kv_len: int,
    *,
    softcap: float | None,
    bias: ScoreMod | Tensor | None,
    mask: Mask | None,
    bias_block: Tensor | None = None,
    mask_block: Tensor | None = None,
) -> Tensor:
    """softcap, then bias, then mask, on scaled scores ``s``: the one order every backend follows.

    ``b``, ``h``, ``q``, ``k`` are index tensors broadcastable to ``s`` (batch row, query head, query row,
    key; None where neither a score modifier nor a :class:`~attnkit.masks.Mask` reads them); ``q_len``/``kv_len`` are the lengths a mask or modifier aligns them with (bottom-right: query
    ``i`` sits at position ``i + kv_len - q_len``).  ``bias`` and ``mask`` are a score modifier and a
    :class:`~attnkit.masks.Mask` (or None); a tensor bias or bool mask enters already sliced to ``s`` as ``bias_block`` /
    ``mask_block`` (True = may attend).  A hidden score is ``-inf``.
    """
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if isinstance(bias, ScoreMod):
        b, h, q, k = cast("tuple[Tensor, Tensor, Tensor, Tensor]", (b, h, q, k))  # (given with a modifier)
        s = bias.apply(s, b, h, q, k, q_len, kv_len)
    elif bias_block is not None:
        s = s + bias_block.to(s.dtype)
    if mask is not None:
        b, h, q, k = cast("tuple[Tensor, Tensor, Tensor, Tensor]", (b, h, q, k))  # (given with a mask)
        allowed = mask.evaluate(b, h, q, k, q_len, kv_len)
        s = s.masked_fill(~allowed, float("-inf"))
    if mask_block is not None:
        s = s.masked_fill(~mask_block, float("-inf"))
    return s


def with_sinks(s: Tensor, sinks: Tensor) -> Tensor:
    """Scores ``s (..., L)`` with one more column: the sink logits (broadcastable to ``(..., 1)``), whose
    value is zero, so each row's softmax denominator counts them.  Drop the column after the softmax."""
    return torch.cat([s, sinks.to(s.dtype).expand(*s.shape[:-1], 1)], dim=-1)


_CHECKED_TABLES: list[
    tuple[object, ...]
] = []  # the last (block_table, seq_lens, versions) checked: a decode step checks once


def check_paged_values(
    who: str, block_table: Tensor, seq_lens: Tensor, num_blocks: int, block_size: int, bias_len: int | None = None
) -> None:
    """Raise ValueError unless every ``seq_lens`` is in ``[0, max_blocks * block_size]`` (and at most
    ``bias_len``) and every block id a sequence reads is in ``[0, num_blocks)``.  One host sync; the layers of
    a decode step share their table, so a table checked last time (same tensors, same versions) is not
    checked again."""
    versioned = not (block_table.is_inference() or seq_lens.is_inference())  # (no version counter to trust)
    key = (
        (block_table, seq_lens, block_table._version, seq_lens._version, num_blocks, block_size, bias_len)
        if versioned
        else None
    )
    if (
        key is not None
        and _CHECKED_TABLES
        and all(a is b if isinstance(a, Tensor) else a == b for a, b in zip(_CHECKED_TABLES[0], key))
    ):
        return
    B, max_blocks = block_table.shape
    if block_size < 1:
        raise ValueError(
            f"{who}: the pool's blocks hold {block_size} positions (its block dimension is empty): "
            f"give a pool (num_blocks, Hkv, block_size >= 1, D)"
        )
    if B:
        lo, hi = (int(x) for x in torch.aminmax(seq_lens))
        if lo < 0 or hi > max_blocks * block_size:
            raise ValueError(
                f"{who}: seq_lens holds {lo if lo < 0 else hi}, outside [0, {max_blocks * block_size}] "
                f"(block_table has {max_blocks} blocks of {block_size} per sequence)"
            )
        if bias_len is not None and hi > bias_len:
            raise ValueError(
                f"{who}: the bias covers {bias_len} keys but seq_lens holds {hi}: give a bias of at "
                f"least max(seq_lens) keys"
            )
        used = (
            torch.arange(max_blocks, device=block_table.device)
            < (seq_lens.long() + block_size - 1)[:, None] // block_size
        )
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"{who}: block_table[{b}, {j}] = {int(block_table[b, j])} is not a block of the pool "
                f"[0, {num_blocks}) but sequence {b} reads it (seq_lens[{b}] = {int(seq_lens[b])})"
            )
    _CHECKED_TABLES[:] = [key] if key is not None else []


_K = TypeVar("_K")
_V = TypeVar("_V")


def per_mask(store: weakref.WeakKeyDictionary[Mask, dict[_K, _V]], mask: Mask | None) -> dict[_K, _V] | None:
    """``mask``'s own memo dict in the weakly keyed ``store``, or None for a mask that cannot be a key (a
    subclass that defines ``__eq__`` without ``__hash__``, or uses ``__slots__`` without ``__weakref__``):
    such a mask is simply not memoised."""
    try:
        # (None cannot be weakly referenced either: a TypeError, so None)
        return store.setdefault(cast(Mask, mask), {})
    except TypeError:
        return None
