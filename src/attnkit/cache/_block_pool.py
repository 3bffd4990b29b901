"""The block pool of a paged KV cache: free blocks, reference counts, and the prefix table.

Kept apart from the attention that reads the blocks (``attnkit.backends.paged``) and from the cache objects
that own sequences (``attnkit.cache.paged``).  A full block is identified by a hash of its tokens chained
with the hash of everything before it (:func:`chain`), so a new sequence whose prompt starts with blocks
already computed reuses them (:meth:`BlockPool.match_prefix`); blocks nobody holds stay findable until the
pool needs them (least recently used first).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from dataclasses import dataclass, field


class PoolExhausted(RuntimeError):
    """The block pool has fewer free blocks than a step needs."""


PoolExhausted.__module__ = "attnkit.cache.paged"  # where it is documented and exported


@dataclass
class SequenceBlocks:
    """One sequence of a paged cache: its blocks (in position order; -1 for one given back), what it stores."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # positions whose keys/values are stored
    tokens: list[int] = field(default_factory=list)  # known token ids (for prefix hashing)
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block registered so far
    unshared: bool = False  # registers no more blocks (its contents predate clear_prefix_cache)


def chain(parent: int, tokens: tuple[int, ...]) -> int:
    """The chained hash of a full block holding ``tokens`` after the blocks hashed to ``parent``."""
    return hash((parent, tokens))


ROOT = hash("attnkit.paged.root")  # the parent of a sequence's first block


class BlockPool:
    """Free blocks, reference counts, and the prefix table of full blocks (hash -> block).

    The free blocks are kept sorted so that a sequence can grow into the block right after its last one:
    a sequence whose blocks are consecutive is read as one view of the pool (see ``attnkit.backends.paged``).  A new
    run starts at the beginning of the largest free range, or in its middle when used blocks precede it
    (leaving them room to grow).
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks))  # sorted
        self.refs = [0] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached: reusable until evicted (LRU)
        self.table: dict[int, int] = {}  # chained hash -> block
        self.key: dict[
            int, tuple[int, int, tuple[int, ...]]
        ] = {}  # block -> (hash, parent hash, tokens): verified on lookup

    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def _is_free(self, b: int) -> bool:
        i = bisect_left(self.free, b)
        return i < len(self.free) and self.free[i] == b

    def _place(self, want: int) -> int:
        free = self.free
        best_start, best_len = free[0], 0
        start = prev = free[0]
        for b in free[1:] + [-1]:
            if b != prev + 1:
                if prev - start + 1 > best_len:
                    best_start, best_len = start, prev - start + 1
                start = b
            prev = b
        if best_start == 0 or best_len <= want:
            return best_start
        return best_start + (best_len - want) // 2

    def allocate(self, prefer: int | None = None, want: int = 1) -> int:
        """A block: ``prefer`` when it is free, else the start of a new run with room for ``want`` blocks,
        else the least recently used cached block."""
        if self.free:
            b = prefer if prefer is not None and self._is_free(prefer) else self._place(want)
            del self.free[bisect_left(self.free, b)]
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)  # least recently used cached block
            h = self.key.pop(b)[0]
            if self.table.get(h) == b:
                del self.table[h]
        else:
            raise PoolExhausted("no free block")
        self.refs[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.refs[b] == 0:
            self.evictable.pop(b, None)
        self.refs[b] += 1

    def decref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.key:
                self.evictable[b] = None
            else:
                insort(self.free, b)

    def lookup(self, h: int, parent: int, tokens: tuple[int, ...]) -> int | None:
        b = self.table.get(h)
        if b is None or self.key.get(b) != (h, parent, tokens):
            return None
        self.incref(b)
        return b

    def forget(self) -> None:
        """Drop the prefix table: cached blocks nobody holds become free; blocks in use stay with their
        sequences but are no longer offered to new ones."""
        for b in self.evictable:
            insort(self.free, b)
        self.evictable.clear()
        self.table.clear()
        self.key.clear()

    def unregister(self, b: int) -> None:
        """Block ``b`` is about to be overwritten: it no longer stands for the tokens it was registered with."""
        entry = self.key.pop(b, None)
        if entry is not None and self.table.get(entry[0]) == b:
            del self.table[entry[0]]

    def register(self, b: int, h: int, parent: int, tokens: tuple[int, ...]) -> None:
        if h in self.table or b in self.key:
            return  # the same content is cached in another block already
        self.table[h] = b
        self.key[b] = (h, parent, tokens)

    def match_prefix(self, tokens: list[int], block_size: int) -> tuple[list[int], list[int]]:
        """The longest run of cached full blocks that ``tokens`` starts with (never its last token: that one
        is always computed), as ``(blocks, their chained hashes)``; each block's reference is taken."""
        blocks, hashes, parent = [], [], ROOT
        for i in range((len(tokens) - 1) // block_size):
            chunk = tuple(tokens[i * block_size : (i + 1) * block_size])
            h = chain(parent, chunk)
            b = self.lookup(h, parent, chunk)
            if b is None:
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def register_full(
        self, blocks: list[int], tokens: list[int], hashes: list[int], full: int, block_size: int
    ) -> None:
        """Offer a sequence's full blocks ``len(hashes)`` to ``full - 1`` (``blocks``, holding ``tokens``) for
        prefix reuse, appending each one's chained hash to ``hashes``."""
        for i in range(len(hashes), full):
            parent = hashes[-1] if hashes else ROOT
            chunk = tuple(tokens[i * block_size : (i + 1) * block_size])
            h = chain(parent, chunk)
            self.register(blocks[i], h, parent, chunk)
            hashes.append(h)
