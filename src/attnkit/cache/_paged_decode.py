"""``paged_attention``: attention of new queries over keys and values in a block pool through a block table
(the Triton kernel on a GPU when it takes the call, the CPU reader of ``attnkit.backends.paged`` otherwise),
checked as :func:`attnkit.attention` checks its arguments; and ``explain_paged_attention``, which says which
path a call takes and why.  The cache objects that fill the pool are in ``paged``."""

from __future__ import annotations

import torch

from ..bias import BiasLike
from ..masks import Mask
from ..backends import paged as _kernel
from ..backends.call import check_bias_kind, check_mask_kind, check_modifiers, check_sinks

Tensor = torch.Tensor

__all__ = ["paged_attention", "explain_paged_attention"]


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    bias: BiasLike | None = None,
    mask: Mask | Tensor | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of each sequence's newest queries over its keys, read through its block table.

    Args:
        q: ``(B, Hq, Lq, D)``; query row ``i`` of sequence ``b`` sits at position ``seq_lens[b] - Lq + i``
            (``Lq = 1`` when decoding).
        k_pool: ``(num_blocks, Hkv, block_size, D)``; ``Hq`` a multiple of ``Hkv`` (grouped-query heads
            share their key/value head: nothing is repeated).
        v_pool: ``(num_blocks, Hkv, block_size, Dv)``.
        block_table: ``(B, max_blocks)`` int32; position ``p`` of sequence ``b`` is in block
            ``block_table[b, p // block_size]``.  Entries past a sequence's blocks are ignored.
        seq_lens: ``(B,)`` int32 keys stored per sequence (the new ones included).
        scale, softcap: as in :func:`attnkit.attention`.
        bias: None, an :mod:`attnkit.bias` modifier (ALiBi, T5 buckets, ...) evaluated per sequence with
            its own length, or a float tensor broadcastable to ``(B, Hq, Lq, Lk)`` indexed by key position.
        mask: None, an :class:`attnkit.masks.Mask` evaluated per sequence (bottom-right: the last query of
            sequence ``b`` at position ``seq_lens[b] - 1``), or a bool tensor like ``bias``.
        sinks: as in :func:`attnkit.attention`, ``(Hq,)`` or broadcastable to ``(B, Hq)``: one logit per
            query head in each row's denominator (such calls are attended per sequence, on every device).

    Returns:
        ``(B, Hq, Lq, Dv)`` in ``q``'s dtype.  A sequence with ``seq_lens[b] = 0`` gets zeros.

    On CUDA tensors, with no mask beyond causal, the Triton kernel ``attnkit.backends.triton.paged_decode``
    runs when it takes the call (its ``check_paged_decode``).  Elsewhere the pool is read where it lies
    (grouped-query heads are not repeated; the softmax runs in float32 for half inputs).  A decode step
    (``Lq = 1``) whose mask and bias read only positions and heads (causal, sliding window, prefix-LM and
    block-local masks; ALiBi, T5 buckets, temperature; softcap) reads the used spans of the pool in one
    pass for the whole batch: each block is scored with the query of the sequence that owns it, in one
    batched product per span however the blocks are scattered, modified at its own positions, and a
    softmax over each sequence's blocks follows.  Otherwise each sequence is attended alone: a contiguous ``(num_blocks, Hkv, block_size, D)``
    pool (:class:`PagedCache`'s storage) takes one matrix product per run of consecutive block ids, and
    a head-major pool (``(Hkv, num_blocks, ...)`` storage) reads a run as one ``(Hkv, L, D)`` view, with
    PyTorch's fused kernel when nothing modifies the scores (a head-major decode step takes whichever
    of the two reads fewer bytes).  :func:`explain_paged_attention` says which of these paths a call takes.

    Example::

        >>> import torch
        >>> from attnkit.cache import paged_attention
        >>> k_pool = v_pool = torch.randn(8, 2, 4, 16)             # 8 blocks of 4 positions, 2 kv heads
        >>> table = torch.tensor([[3, 5, 0], [1, 0, 0]], dtype=torch.int32)
        >>> lens = torch.tensor([7, 2], dtype=torch.int32)
        >>> paged_attention(torch.randn(2, 4, 1, 16), k_pool, v_pool, table, lens).shape
        torch.Size([2, 4, 1, 16])
    """
    _kernel.check_paged_args(q, k_pool, v_pool, block_table, seq_lens)
    scale, softcap, mask, sinks = _prepare(q, scale, softcap, bias, mask, sinks)
    return _kernel.attend_table(
        q, k_pool, v_pool, block_table, seq_lens, scale=scale, softcap=softcap, bias=bias, mask=mask, sinks=sinks
    )


def explain_paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    bias: BiasLike | None = None,
    mask: Mask | Tensor | None = None,
    sinks: Tensor | None = None,
) -> str:
    """How :func:`paged_attention` computes this call, as one line: the path (``triton``, ``splitkv``,
    ``pool``: one pass over the pool for the whole batch, or ``per sequence``) and why.  Arguments and errors
    as for :func:`paged_attention`; nothing is computed.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.cache import explain_paged_attention
        >>> k_pool = v_pool = torch.randn(8, 2, 4, 16)
        >>> table = torch.tensor([[3, 5, 0], [1, 0, 0]], dtype=torch.int32)
        >>> lens = torch.tensor([7, 2], dtype=torch.int32)
        >>> explain_paged_attention(torch.randn(2, 4, 1, 16), k_pool, v_pool, table, lens).split(":")[0]
        'pool'
        >>> print(explain_paged_attention(torch.randn(2, 4, 3, 16), k_pool, v_pool, table, lens))
        per sequence: one attention per sequence over its runs of blocks (3 queries per sequence; the pool path takes decode steps)
    """
    _kernel.check_paged_args(q, k_pool, v_pool, block_table, seq_lens)
    scale, softcap, mask, sinks = _prepare(q, scale, softcap, bias, mask, sinks)
    return _kernel.explain_table(
        q, k_pool, v_pool, block_table, seq_lens, scale=scale, softcap=softcap, bias=bias, mask=mask, sinks=sinks
    )


def _prepare(
    q: Tensor,
    scale: float | None,
    softcap: float | None,
    bias: BiasLike | None,
    mask: Mask | Tensor | None,
    sinks: Tensor | None = None,
) -> tuple[float, float | None, Mask | Tensor | None, Tensor | None]:
    """``(scale, softcap, mask, sinks)`` checked for the kernel as :func:`attnkit.attention` checks them (the
    shared checks of ``attnkit.backends.call``; the lengths differ per sequence, so a tensor mask or bias is
    checked against each one's when it is read): ``scale`` a float (``1/sqrt(D)`` by default), ``sinks``
    ``(B, Hq)`` or None, and a decode step's bottom-right causal mask dropped."""
    try:
        checked = check_mask_kind(mask, q)
        scale, softcap = check_modifiers(q, scale, softcap, check_bias_kind(bias, q))
        sinks = check_sinks(sinks, q)
    except (TypeError, ValueError) as e:
        raise type(e)(f"paged_attention: {e}") from None
    if checked is not mask:
        raise TypeError(
            "paged_attention: mask takes no FlexAttention BlockMask (its blocks are laid out for one key length, "
            "and each sequence has its own): pass an attnkit.masks.Mask"
        )
    if isinstance(mask, Mask) and mask.is_causal("bottom_right") and q.shape[2] == 1:
        mask = None  # the newest query sees every stored key
    return scale, softcap, mask, sinks
