"""Data-dependent block masks: key blocks chosen per ``(batch, head, query block)`` from a tensor.

Content-based sparse attention (MoBA, NSA's selection branch) scores key blocks from the data and keeps the
best few for each block of queries.  :func:`selected_blocks` turns such a choice (key-block indices) into a
:class:`Mask`; :func:`top_k_blocks` makes the choice from scores.  Its block structure comes from the
indices, so the tiled kernels visit only the chosen tiles, and it combines with ``&`` like every mask.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._base import Mask
from ._blocks import EMPTY, FULL, PARTIAL, _ceil_div, _check_int, _Grid, _short_list, _Tiling

Tensor = torch.Tensor

_TABLES = 4  # selection tables kept per mask (one per key length and device)


def _blocks(block: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(block, tuple) and len(block) == 2:
        bq, bk = block
    elif isinstance(block, (tuple, list)):
        raise ValueError(f"block={block!r} must be an int or a pair (block_q, block_k)")
    else:
        bq = bk = block
    _check_int("block_q" if isinstance(block, tuple) else "block", bq, minimum=1)
    _check_int("block_k" if isinstance(block, tuple) else "block", bk, minimum=1)
    return bq, bk


class _SelectedBlocks(Mask):
    """Query row ``i`` sees key ``j`` iff key block ``j // block_k`` is among ``indices[b, h, i // block_q]``."""

    def __init__(self, indices: Tensor, block_q: int, block_k: int):
        self.indices, self.block_q, self.block_k = indices, block_q, block_k
        self._cache: dict[tuple[int, str, int], Tensor] = {}

    def table(self, num_key_blocks: int, device: torch.device | str | None = None) -> Tensor:
        """The chosen key blocks as a bool table ``(B', H', query blocks, num_key_blocks)`` (True: chosen)."""
        idx = self.indices if device is None else self.indices.to(device)
        key = (num_key_blocks, str(idx.device), self.indices._version)
        table = self._cache.pop(key, None)  # re-inserted: the memo keeps the most recent ones
        if table is None:
            idx = torch.where(idx < 0, num_key_blocks, idx).clamp(max=num_key_blocks)  # -1: an unused slot
            table = torch.zeros(*idx.shape[:-1], num_key_blocks + 1, dtype=torch.bool, device=idx.device)
            table = table.scatter_(-1, idx, True)[..., :num_key_blocks]
            while len(self._cache) >= _TABLES:
                self._cache.pop(next(iter(self._cache)))
        self._cache[key] = table
        return table

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        q, k = torch.as_tensor(q), torch.as_tensor(k)
        t = self.table(_ceil_div(kv_len, self.block_k), k.device)
        b, h = torch.as_tensor(b, device=k.device), torch.as_tensor(h, device=k.device)
        qb = torch.div(q, self.block_q, rounding_mode="floor").clamp(max=t.shape[2] - 1)
        kb = torch.div(k, self.block_k, rounding_mode="floor")
        out: Tensor = t[b.clamp(max=t.shape[0] - 1), h.clamp(max=t.shape[1] - 1), qb, kb]
        return out

    def _tiles(self, t: _Tiling) -> _Grid:
        bq, bk = self.block_q, self.block_k
        table = self.table(_ceil_div(t.kv_len, bk), t.device)
        r0, r1 = t.rows()
        c0, c1 = t.cols()
        a0 = torch.div(r0, bq, rounding_mode="floor").view(-1, 1)  # the query blocks a tile's rows touch
        a1 = torch.div(r1, bq, rounding_mode="floor").view(-1, 1) + 1
        k0 = torch.div(c0, bk, rounding_mode="floor").view(1, -1)  # ... and the key blocks its keys touch
        k1 = torch.div(c1, bk, rounding_mode="floor").view(1, -1) + 1
        area = (a1 - a0) * (k1 - k0)
        lead = table.shape[:2]
        flat = table.reshape(-1, *table.shape[2:])
        kinds = torch.empty(flat.shape[0], a0.shape[0], k0.shape[1], dtype=torch.int8, device=table.device)
        for i in range(flat.shape[0]):  # one (b', h') at a time: the integral image is (query blocks, key blocks)
            ii = torch.nn.functional.pad(flat[i].to(torch.int32).cumsum(0).cumsum(1), (1, 0, 1, 0))
            count = ii[a1, k1] - ii[a0, k1] - ii[a1, k0] + ii[a0, k0]
            kinds[i] = torch.where(count == area, FULL, torch.where(count > 0, PARTIAL, EMPTY))
        return _Grid(kinds.view(*lead, *kinds.shape[1:]))

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        nb, nh, nqb = self.indices.shape[:3]
        if nb not in (1, batch):
            raise ValueError(
                f"selected_blocks: the selection has batch size {nb} for a batch of {batch}: give one "
                f"selection per sequence (or one, shape (1, ...), for all)"
            )
        if nh not in (1, heads):
            raise ValueError(
                f"selected_blocks: the selection has {nh} heads for {heads} query heads: give one per "
                f"query head (repeat a grouped-query selection over its group) or one for all"
            )
        want = _ceil_div(q_len, self.block_q)
        if nqb != want:
            raise ValueError(
                f"selected_blocks: the selection has {nqb} query blocks, but Lq={q_len} with "
                f"block_q={self.block_q} makes {want}: pass indices of shape (B, H, {want}, k)"
            )
        if torch.compiler.is_compiling() or self.indices.numel() == 0:  # (a check on values would break the graph)
            return
        nkb, top = _ceil_div(kv_len, self.block_k), int(self.indices.max())
        if top >= nkb:
            raise ValueError(
                f"selected_blocks: the selection holds key block {top}, but Lk={kv_len} with "
                f"block_k={self.block_k} has {nkb} key blocks (0..{nkb - 1}): indices must be < {nkb} "
                f"(-1 marks an unused slot)"
            )

    def _size_guess(self) -> tuple[int, int] | None:
        rows = self.indices.shape[2] * self.block_q
        top = int(self.indices.max()) + 1 if self.indices.numel() else 0
        return rows, max(rows, top * self.block_k)

    def batch_size(self) -> int:
        return self.indices.shape[0]

    def _head_count(self) -> int:
        return self.indices.shape[1]

    def selection(self) -> tuple[Tensor, int, int]:
        """``(indices, block_q, block_k)``: the chosen key blocks ``(B', H', query blocks, k)`` (-1: unused)."""
        return self.indices, self.block_q, self.block_k

    def __repr__(self) -> str:
        if self.indices.numel() <= 8:
            shown = _short_list(self.indices.reshape(-1))
            return (
                f"selected_blocks({shown} of shape {tuple(self.indices.shape)}, block=({self.block_q}, {self.block_k}))"
            )
        return f"selected_blocks(indices {tuple(self.indices.shape)}, block=({self.block_q}, {self.block_k}))"


def _check_indices(indices: object) -> Tensor:
    if not isinstance(indices, Tensor):
        try:
            indices = torch.tensor(indices)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"selected_blocks: indices must be an int tensor (B, H, query blocks, k), got {type(indices).__name__}"
            ) from None
    if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
        raise TypeError(
            f"selected_blocks: indices must hold integers (key-block numbers), got dtype {indices.dtype}:"
            f" to choose from scores use masks.top_k_blocks(scores, k, block=...)"
        )
    if indices.dim() != 4:
        raise ValueError(
            f"selected_blocks: indices must have shape (B, H, query blocks, k) (4 dimensions, 1 where "
            f"the choice is shared), got shape {tuple(indices.shape)}"
        )
    if not torch.compiler.is_compiling() and indices.numel() and int(indices.min()) < -1:
        raise ValueError(
            f"selected_blocks: indices must be key-block numbers >= 0, or -1 for an unused slot; got "
            f"{int(indices.min())}"
        )
    return indices if indices.dtype == torch.long else indices.long()


def selected_blocks(indices: Tensor | Sequence[object], block: int | tuple[int, int]) -> Mask:
    """Key blocks chosen per ``(batch, head, query block)``: the mask of content-based block-sparse attention.

    ``indices``: an int tensor ``(B, H, ceil(Lq / block_q), k)`` (``B`` or ``H`` may be 1 when the choice is
    shared): query row ``i`` of batch ``b`` and head ``h`` may attend to key ``j`` iff key block
    ``j // block_k`` is one of ``indices[b, h, i // block_q]``.  ``-1`` marks an unused slot (a query block
    with fewer choices); repeated entries count once.  ``block``: an int, or a pair ``(block_q, block_k)``.
    Query blocks count query *rows* (a decoding step's single query is block 0 of its call).

    Its block structure is read from the indices: the tiled kernels visit only the chosen tiles, forward
    and backward.  Combine it with ``&`` (:func:`causal` for a causal model, :func:`key_padding`,
    :func:`document`).  The indices are not differentiable; a tensor modified in place is noticed.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> idx = torch.tensor([[0], [0], [2]]).view(1, 1, 3, 1)       # query blocks 0, 1, 2 of 2 rows
        >>> m = masks.selected_blocks(idx, block=2)
        >>> m.to_dense(6, 6)[0, 0, ::2].int().tolist()                  # rows 0, 2 and 4
        [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]]
    """
    bq, bk = _blocks(block)
    return _SelectedBlocks(_check_indices(indices), bq, bk)


def top_k_blocks(scores: Tensor, k: int, block: int | tuple[int, int]) -> Mask:
    """:func:`selected_blocks` of the ``k`` highest-scoring key blocks of every ``(batch, head, query block)``.

    ``scores``: a float tensor ``(B, H, query blocks, key blocks)``; a score of ``-inf`` is never chosen
    (a future block in a causal model), so a row with fewer than ``k`` finite scores chooses fewer blocks.
    Ties go to the lower block.  The choice is not differentiable.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> s = torch.tensor([[3.0, 1.0, 2.0], [0.0, float("-inf"), float("-inf")]]).view(1, 1, 2, 3)
        >>> masks.top_k_blocks(s, 2, block=4).selection()[0].tolist()
        [[[[0, 2], [0, -1]]]]
    """
    if not isinstance(scores, Tensor) or not scores.is_floating_point():
        raise TypeError(
            f"top_k_blocks: scores must be a float tensor (B, H, query blocks, key blocks), got "
            f"{scores.dtype if isinstance(scores, Tensor) else type(scores).__name__}"
        )
    if scores.dim() != 4:
        raise ValueError(
            f"top_k_blocks: scores must have shape (B, H, query blocks, key blocks), got shape {tuple(scores.shape)}"
        )
    _check_int("k", k, minimum=1)
    nkb = scores.shape[-1]
    if k > nkb:
        raise ValueError(f"top_k_blocks: k={k} is larger than the number of key blocks ({nkb}): choose k <= {nkb}")
    bq, bk = _blocks(block)
    scores = scores.detach()
    if not torch.compiler.is_compiling() and bool(torch.isnan(scores).any()):
        raise ValueError("top_k_blocks: scores hold NaN: no choice can be made from them")
    picked = _stable_top_k(scores, k)
    finite = scores.gather(-1, picked) > float("-inf")
    return _SelectedBlocks(torch.where(finite, picked, -1), bq, bk)


def _stable_top_k(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest scores per row, ties to the lower index, sorted by index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values
