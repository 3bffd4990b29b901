"""Per-block summaries of a layer's cached keys, kept beside the cache and extended as blocks complete.

Content-based sparse attention chooses key blocks by scoring a summary of each block: MoBA the block's mean
key, NSA a learned compression of the block's keys and values.  Recomputing every summary at every decode
step would read every cached key; :class:`BlockSummaries` keeps them instead, computes a block's summary once,
when the block's last key arrives, and hands out all of them without reading the keys again.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

Tensor = torch.Tensor

__all__ = ["BlockSummaries", "summaries_of"]


class BlockSummaries:
    """Summaries of the blocks of one layer's keys: summary ``i`` covers keys ``i * stride .. i * stride + span -
    1`` and exists once they are all stored.

    ``key`` names what the summaries are computed with (the module, its block sizes, the versions of its weights):
    a different key starts over.  The summaries are only trusted for the positions the cache held before the
    current update (``prev_len``), so a cache cut back (:meth:`~attnkit.cache.StaticCache.truncate`, :meth:`~attnkit.cache.ModelCache.reset`) or refilled
    recomputes the blocks it lost.  Storage ``(B, H, capacity, D)`` per summarised tensor grows by doubling.
    """

    def __init__(self, span: int, stride: int, key: Hashable):
        self.span, self.stride, self.key = span, stride, key
        self.count = 0  # summaries computed (valid while the cache keeps their keys)
        self.buffers: tuple[Tensor, ...] = ()
        self.reads = 0  # key positions read to compute summaries (what a test can count)

    def complete(self, kv_len: int) -> int:
        """How many blocks the first ``kv_len`` keys complete."""
        return 0 if kv_len < self.span else (kv_len - self.span) // self.stride + 1

    def update(
        self,
        k: Tensor,
        v: Tensor | None,
        prev_len: int,
        summarise: Callable[[Tensor, Tensor | None], tuple[Tensor, ...]],
    ) -> tuple[Tensor, ...]:
        """The summaries of every block complete in ``k (B, H, Lk, D)`` (and ``v``): a tuple of ``(B, H, n, D')``.

        ``prev_len``: the keys the cache held before this update (the summaries of blocks within them are
        reused).  ``summarise(k_part, v_part)`` maps the keys of consecutive blocks, starting at a block start, to
        one summary per block; it is called on the keys of the newly completed blocks only.
        """
        valid = min(self.count, self.complete(prev_len))
        n = self.complete(k.shape[2])
        if n > valid:
            lo, hi = valid * self.stride, (n - 1) * self.stride + self.span
            new = summarise(k[:, :, lo:hi], None if v is None else v[:, :, lo:hi])  # each (B, H, n - valid, D')
            self.reads += hi - lo
            self._write(new, valid, n)
        self.count = n
        if not self.buffers:  # no block complete yet (fewer than ``span`` keys): no summary, in its shapes
            return summarise(k, v)
        return tuple(b[:, :, :n] for b in self.buffers)

    @torch.inference_mode(False)  # ordinary tensors: the cache may be written outside inference_mode later
    def _write(self, new: tuple[Tensor, ...], start: int, end: int) -> None:
        # the layout (batch, heads, dtype, device) is part of the key: buffers of another layout never meet
        if not self.buffers or self.buffers[0].shape[2] < end:
            capacity = max(end, 2 * (self.buffers[0].shape[2] if self.buffers else 0))
            grown = tuple(t.new_empty(*t.shape[:2], capacity, *t.shape[3:]) for t in new)  # (B, H, capacity, D')
            for g, b in zip(grown, self.buffers):
                g[:, :, :start].copy_(b[:, :, :start])
            self.buffers = grown
        for b, t in zip(self.buffers, new):
            b[:, :, start:end].copy_(t)

    def __repr__(self) -> str:
        return f"BlockSummaries({self.count} blocks of {self.span} every {self.stride}, {len(self.buffers)} tensors)"


def summaries_of(
    cache: object, name: str, *, span: int, stride: int, key: Hashable, layout: tuple[object, ...]
) -> BlockSummaries | None:
    """The summaries ``name`` a layer cache keeps (created on first use), or None for a cache that keeps none
    (one without a ``summaries`` dict).  A different ``key`` or ``layout`` (batch, heads, dtype, device of the
    keys) starts them over."""
    store = getattr(cache, "summaries", None)
    if not isinstance(store, dict):
        return None
    full_key = (key, span, stride, layout)
    found = store.get(name)
    if not isinstance(found, BlockSummaries) or found.key != full_key:
        found = store[name] = BlockSummaries(span, stride, full_key)
    return found
