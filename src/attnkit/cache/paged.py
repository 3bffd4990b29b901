"""``PagedCache``: keys and values in a pool of fixed-size blocks, one block table per sequence.

Layout (shared with the attention that reads it, ``attnkit.backends.paged``), per layer::

    k_pool (num_blocks, Hkv, block_size, D)      v_pool (num_blocks, Hkv, block_size, Dv)
    block_table (B, max_blocks) int32            seq_lens (B,) int32

Position ``p`` of sequence ``b`` lives in block ``block_table[b, p // block_size]`` at offset
``p % block_size``.  Blocks are taken from the pool when a sequence grows into them and given back when it
ends; :meth:`PagedCache.fork` shares every block of a sequence with a new one (reference counts) and copies
the partially filled last block only when one of them writes to it (copy-on-write).  With prefix caching a
new sequence whose prompt starts with a run of full blocks already computed (identified by a hash of their
tokens chained with the hash of everything before them) reuses those blocks instead of recomputing them.

This module holds the cache objects; the free list, reference counts and prefix table are the block pool's
(``_block_pool``), the checked ``paged_attention`` function is ``_paged_decode``'s, and attention over the blocks
is a backend's (``attnkit.backends.paged``).
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Iterable, cast

import torch

from ..bias import BiasLike
from ..masks import Mask
from .._checks import flag, integer
from ..backends import paged as _kernel
from ..backends.paged import PoolLayout, block_runs, seq_view
from ..backends.call import check_sinks
from ._block_pool import BlockPool, PoolExhausted, SequenceBlocks
from ._common import Compute, attend, check_dtype, check_new_kv, layout_of, model_dims
from ._paged_decode import _prepare, explain_paged_attention, paged_attention
from ._pool_view import PoolLayer, PoolView
from ._protocol import CacheAttention, CacheRead

Tensor = torch.Tensor

__all__ = ["PagedCache", "PagedBatch", "PagedPacked", "PoolExhausted", "paged_attention", "explain_paged_attention"]


# ----------------------------------------------------------------------------- the cache


def _items(values: object) -> list[Any] | None:
    """The elements of an iterable that is not a string or a mapping, else None."""
    if isinstance(values, (str, bytes, dict)):
        return None
    try:
        return list(cast(Iterable[Any], values))  # (anything iterable; a TypeError otherwise)
    except TypeError:
        return None


def _token_ids(who: str, tokens: object) -> list[int]:
    """``tokens`` (a list of ints or a 1-D integer tensor) as a list of ints; anything else raises (a float
    would be truncated to another token, a string read character by character)."""
    if isinstance(tokens, Tensor):
        if tokens.dim() != 1 or tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(
                f"PagedCache.{who}: tokens must be a list or 1-D integer tensor of token ids, got a "
                f"{tuple(tokens.shape)} {tokens.dtype} tensor"
            )
        ids: list[int] = tokens.tolist()
        return ids
    items = _items(tokens)
    if items is None or not all(isinstance(t, Integral) and not isinstance(t, bool) for t in items):
        raise TypeError(f"PagedCache.{who}: tokens must be a list of int token ids, got {tokens!r:.80}")
    return [int(t) for t in items]


def _sequence_ids(who: str, seq_ids: object) -> list[int]:
    """``seq_ids`` (a list of the ids ``add_sequence`` returned) as a list of ints."""
    items = _items(seq_ids.tolist() if isinstance(seq_ids, Tensor) and seq_ids.dim() == 1 else seq_ids)
    if items is None or not all(isinstance(s, Integral) and not isinstance(s, bool) for s in items):
        raise TypeError(
            f"{who}: seq_ids must be a list of sequence ids (ints from add_sequence()), got "
            f"{seq_ids!r:.80}" + (f"; for one sequence pass [{seq_ids!r}]" if isinstance(seq_ids, Integral) else "")
        )
    return [int(s) for s in items]


class PagedCache:
    """A KV cache in a shared pool of fixed-size blocks, for many sequences of different lengths.

    Args:
        n_layers: decoder layers (each has its own ``k_pools[i]``/``v_pools[i]``; a block id is the same
            slot in every layer).
        num_blocks: blocks in the pool; ``block_size``: positions per block.
        n_kv_heads, d_head, d_value, dtype, device: the layout of one layer.
        prefix_caching: reuse full blocks of an identical prompt prefix (see :meth:`add_sequence`).

    Use: :meth:`add_sequence` (optionally with the prompt's token ids) returns a sequence id;
    :meth:`batch` gives the model-level cache for a forward over some sequences (``cache.layers``,
    ``cache.seq_len``, ``cache.positions(n)``); :meth:`free` returns a finished sequence's blocks at once.
    Blocks are reserved on demand (:meth:`reserve`, called by the first layer of a forward if not done
    before); when the pool cannot supply them a :class:`PoolExhausted` error names what was needed.

    Decoding one token per sequence returns an object whose ``attend`` runs :func:`paged_attention`
    through the block table; a multi-token step (a prompt) gathers the sequence's keys in position order.

    Example::

        >>> import torch
        >>> from attnkit.cache import PagedCache
        >>> cache = PagedCache(1, num_blocks=8, block_size=4, n_kv_heads=2, d_head=8)
        >>> a = cache.add_sequence()
        >>> k_all, v_all = cache.batch([a]).layers[0].update(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
        >>> k_all.shape, cache.length(a), cache.num_free_blocks
        (torch.Size([1, 2, 6, 8]), 6, 6)
        >>> b = cache.fork(a)                    # shares both blocks; the partial one is copied on write
        >>> cache.free(a); cache.free(b); cache.num_free_blocks
        8
    """

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        n_kv_heads: int,
        d_head: int,
        d_value: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        prefix_caching: bool = True,
    ) -> None:
        self.n_layers = integer("n_layers", n_layers, minimum=1)
        self.num_blocks = integer("num_blocks", num_blocks, minimum=1)
        self.block_size = integer("block_size", block_size, minimum=1)
        self.n_kv_heads = integer("n_kv_heads", n_kv_heads, minimum=1)
        self.d_head = integer("d_head", d_head, minimum=1)
        # d_value=0: a latent cache, whose values are part of the keys (attnkit.nn.LatentAttention)
        self.d_value = integer("d_value", d_value if d_value is not None else d_head, minimum=0)
        self.dtype = check_dtype("dtype", dtype)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.prefix_caching = flag("prefix_caching", prefix_caching)
        # stored block-major and contiguous: a span of block ids is one (blocks * Hkv, block_size, D) batch
        # that the decode's products read in place (see attnkit.backends.paged)
        shape_k = (num_blocks, n_kv_heads, block_size, d_head)
        shape_v = (num_blocks, n_kv_heads, block_size, self.d_value)
        with torch.inference_mode(False):  # ordinary tensors: written in and outside inference_mode alike
            self.k_pools = [torch.zeros(shape_k, dtype=dtype, device=self.device) for _ in range(n_layers)]
            self.v_pools = [torch.zeros(shape_v, dtype=dtype, device=self.device) for _ in range(n_layers)]
        self._alloc = BlockPool(num_blocks)
        self._workspace: tuple[Tensor, Tensor] | None = None  # flat k, v scratch of packed forwards' chunks
        self._seqs: dict[int, SequenceBlocks] = {}
        self._next_id = 0
        self.prefix_hits = 0  # blocks reused from the prefix cache so far

    @classmethod
    def for_model(
        cls,
        model: Any,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        prefix_caching: bool = True,
    ) -> "PagedCache":
        """A pool laid out for ``model`` (read from ``model.config`` and its parameters)."""
        d = model_dims(model)
        return cls(
            d["n_layers"],
            num_blocks,
            block_size,
            **layout_of(d, dtype, device),
            prefix_caching=prefix_caching,
        )

    # ------------------------------------------------------------------ sequences

    def _seq(self, sid: int) -> SequenceBlocks:
        s = None if isinstance(sid, bool) else self._seqs.get(sid)  # (True == 1 would find sequence 1)
        if s is None:
            raise ValueError(
                f"PagedCache: no sequence {sid!r} (live ones: {sorted(self._seqs)}); add it with add_sequence() first"
            )
        return s

    def add_sequence(self, tokens: object = None) -> int:
        """Start a sequence and return its id.  With the prompt's token ids (and prefix caching on), the
        longest run of its full blocks already in the cache is reused: :meth:`PagedCache.length` then tells how many
        positions are stored (at most ``len(tokens) - 1``, so the last prompt token is always computed)."""
        seq = SequenceBlocks(tokens=[] if tokens is None else _token_ids("add_sequence", tokens))
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = seq
        if self.prefix_caching and seq.tokens:
            seq.blocks, seq.hashes = self._alloc.match_prefix(seq.tokens, self.block_size)
            seq.length = len(seq.blocks) * self.block_size
            self.prefix_hits += len(seq.blocks)
        return sid

    def append_tokens(self, sid: int, tokens: object) -> None:
        """Record token ids of sequence ``sid`` (prompt continuation or sampled tokens) for prefix hashing."""
        seq = self._seq(sid)
        seq.tokens.extend(_token_ids("append_tokens", tokens))
        self._register(seq)

    def fork(self, sid: int) -> int:
        """A new sequence sharing every block of ``sid`` (reference counts; the partial last block is
        copied when either one writes to it).  Returns the new id."""
        src = self._seq(sid)
        for b in src.blocks:
            if b >= 0:  # (-1: a block a streaming cache gave back, PagedSinkCache)
                self._alloc.incref(b)
        new = self._next_id
        self._next_id += 1
        self._seqs[new] = SequenceBlocks(list(src.blocks), src.length, list(src.tokens), list(src.hashes))
        return new

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after the model's weights changed: cached keys and values were
        computed with the old ones); sequences keep their blocks, new ones no longer reuse any."""
        self._alloc.forget()
        for seq in self._seqs.values():
            seq.unshared = True  # its blocks hold keys/values of the old weights: never offered again

    def free(self, sid: int) -> None:
        """End sequence ``sid``: its blocks go back to the pool (full ones stay findable by their hash
        until the pool needs them)."""
        seq = self._seqs.pop(sid, None)
        if seq is None:
            raise ValueError(f"PagedCache: no sequence {sid!r} to free (live ones: {sorted(self._seqs)})")
        for b in reversed(seq.blocks):  # the deepest blocks are evicted first
            if b >= 0:  # (-1: a block a streaming cache gave back, PagedSinkCache)
                self._alloc.decref(b)

    def truncate(self, sid: int, length: int) -> None:
        """Keep the first ``length`` positions of sequence ``sid`` and their token ids (e.g. after a speculative
        step rejected some tokens): blocks past them go back to the pool, the next write starts at ``length``.
        A kept block that was cached for prefix reuse and is about to be overwritten is no longer offered (a
        shared one is copied on write as usual).  A ValueError if ``length`` is beyond what is stored.

        Example::

            >>> import torch
            >>> from attnkit.cache import PagedCache
            >>> pool = PagedCache(1, num_blocks=4, block_size=2, n_kv_heads=1, d_head=2)
            >>> s = pool.add_sequence()
            >>> _ = pool.batch([s]).layers[0].update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2))
            >>> pool.truncate(s, 2); pool.length(s), pool.num_free_blocks
            (2, 3)
        """
        seq = self._seq(sid)
        integer("length", length, minimum=0)
        if length > seq.length:
            raise ValueError(
                f"PagedCache.truncate: length={length} is beyond the {seq.length} positions stored for "
                f"sequence {sid}: a sequence can only be cut back"
            )
        bs = self.block_size
        keep = -(-length // bs)
        for b in reversed(seq.blocks[keep:]):
            self._alloc.decref(b)
        del seq.blocks[keep:]
        full = length // bs
        if keep > full and self._alloc.refs[seq.blocks[full]] == 1:
            self._alloc.unregister(seq.blocks[full])
        del seq.hashes[full:]
        del seq.tokens[length:]
        seq.length = length

    def length(self, sid: int) -> int:
        """Positions stored for sequence ``sid``."""
        return self._seq(sid).length

    def sequences(self) -> list[int]:
        return sorted(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never used, or cached and unreferenced)."""
        return self._alloc.num_free()

    def blocks_needed(self, sid: int, n_new: int) -> int:
        """Blocks that storing ``n_new`` more positions of ``sid`` takes from the pool (copy-on-write included)."""
        integer("n_new", n_new, minimum=0)
        seq = self._seq(sid)
        bs = self.block_size
        need = -(-(seq.length + n_new) // bs) - len(seq.blocks)
        if n_new > 0 and seq.length % bs and self._alloc.refs[seq.blocks[seq.length // bs]] > 1:
            need += 1
        return max(0, need)

    def reserve(self, sid: int, n_new: int) -> None:
        """Make room for ``n_new`` more positions of ``sid`` (new blocks, copy-on-write of a shared partial
        block); all or nothing: raises :class:`PoolExhausted` and changes nothing when the pool is short."""
        seq = self._seq(sid)
        need = self.blocks_needed(sid, n_new)
        if need > self._alloc.num_free():
            raise PoolExhausted(
                f"PagedCache pool exhausted: sequence {sid} needs {need} more block(s) of {self.block_size} "
                f"positions for {n_new} new token(s), but only {self._alloc.num_free()} of {self.num_blocks} "
                f"are free; free finished sequences, create the cache with more blocks, or let the Engine "
                f"preempt"
            )
        bs = self.block_size
        if n_new > 0 and seq.length % bs:
            i = seq.length // bs
            old = seq.blocks[i]
            if self._alloc.refs[old] > 1:  # copy-on-write of the shared, partially filled block
                new = self._alloc.allocate(prefer=seq.blocks[i - 1] + 1 if i else None)
                for kp, vp in zip(self.k_pools, self.v_pools):
                    kp[new].copy_(kp[old])
                    vp[new].copy_(vp[old])
                self._alloc.decref(old)
                seq.blocks[i] = new
        missing = -(-(seq.length + n_new) // bs) - len(seq.blocks)
        for j in range(missing):  # grow into the block after the last one when it is free
            prev = seq.blocks[-1] if seq.blocks else None
            seq.blocks.append(self._alloc.allocate(prefer=None if prev is None else prev + 1, want=missing - j))

    def _advance(self, sid: int, n: int) -> None:
        """``n`` more positions of sequence ``sid`` are written: count them, offer its newly full blocks."""
        seq = self._seqs[sid]
        seq.length += n
        self._register(seq)

    def _register(self, seq: SequenceBlocks) -> None:
        if not self.prefix_caching or seq.unshared:
            return
        full = min(seq.length, len(seq.tokens)) // self.block_size
        self._alloc.register_full(seq.blocks, seq.tokens, seq.hashes, full, self.block_size)

    # ------------------------------------------------------------------ forwards

    def _chunk_workspace(self, L: int, capacity: int) -> tuple[Tensor, Tensor]:
        """Contiguous ``(Hkv, L, D)`` and ``(Hkv, L, Dv)`` scratch for one layer's keys and values of a prompt
        chunk's sequence (:class:`PagedPacked`): kept between forwards and grown (to ``capacity`` positions,
        the sequence's reserved blocks) when a longer sequence needs it, so a chunk step allocates nothing."""
        H, D, Dv = self.n_kv_heads, self.d_head, self.d_value
        if self._workspace is None or self._workspace[0].numel() < H * L * D or self._workspace[1].numel() < H * L * Dv:
            cap = max(L, capacity)
            with torch.inference_mode(False):  # written in and outside inference_mode alike
                self._workspace = (
                    torch.empty(H * cap * D, dtype=self.dtype, device=self.device),
                    torch.empty(H * cap * Dv, dtype=self.dtype, device=self.device),
                )
        kw, vw = self._workspace
        return kw[: H * L * D].view(H, L, D), vw[: H * L * Dv].view(H, L, Dv)

    def packed(self, seq_ids: Iterable[Any], n_new: Iterable[Any]) -> "PagedPacked":
        """The model-level cache for one forward whose ``(1, sum(n_new))`` tokens pack ``n_new[i]`` new tokens of
        sequence ``seq_ids[i]`` after each other (decode tokens and prompt chunks mixed); pass
        ``positions=packed.positions()`` to the model.  See :class:`PagedPacked`."""
        ids = [int(s) for s in seq_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"PagedCache.packed: sequence ids repeat in {ids}")
        n_new = [integer("n_new", n, minimum=1) for n in n_new]
        if len(n_new) != len(ids):
            raise ValueError(f"PagedCache.packed: {len(ids)} sequences but {len(n_new)} counts of new tokens")
        for s in ids:
            self._seq(s)
        return PagedPacked(self, ids, n_new)

    def batch(self, seq_ids: object) -> "PagedBatch":
        """The model-level cache for one forward over sequences ``seq_ids`` (in this order)."""
        ids = _sequence_ids("PagedCache.batch", seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"PagedCache.batch: sequence ids repeat in {ids}; fork a sequence to decode it twice")
        for s in ids:
            self._seq(s)
        return PagedBatch(self, ids)

    def block_table(self, seq_ids: object) -> Tensor:
        """``(B, max_blocks)`` int32 block ids of ``seq_ids`` (rows padded with 0)."""
        seqs = [self._seq(s) for s in _sequence_ids("PagedCache.block_table", seq_ids)]
        width = max([len(s.blocks) for s in seqs], default=0)
        rows = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).view(len(seqs), width)

    def seq_lens(self, seq_ids: object) -> Tensor:
        """``(B,)`` int32 positions stored per sequence."""
        return torch.tensor(
            [self._seq(s).length for s in _sequence_ids("PagedCache.seq_lens", seq_ids)],
            dtype=torch.int32,
            device=self.device,
        )

    # ------------------------------------------------------------------ accounting

    def nbytes(self) -> int:
        """Bytes of the pools (every layer)."""
        return sum(t.nbytes for t in self.k_pools) + sum(t.nbytes for t in self.v_pools)

    def stats(self) -> dict[str, Any]:
        """Blocks in use, positions stored, and the share of the pool allocated but not filled (``waste``)."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for seq in self._seqs.values():
            for i, b in enumerate(seq.blocks):
                if b < 0:  # given back (PagedSinkCache)
                    continue
                fill[b] = max(fill.get(b, 0), min(bs, max(0, seq.length - i * bs)))
        used = len(fill)
        stored = sum(fill.values())
        return {
            "blocks_used": used,
            "blocks_free": self.num_free_blocks,
            "positions_stored": stored,
            "slots_allocated": used * bs,
            "waste": (used * bs - stored) / (self.num_blocks * bs),
            "prefix_hits": self.prefix_hits,
        }

    def __repr__(self) -> str:
        st = self.stats()
        return (
            f"PagedCache({self.n_layers} layers, {self.num_blocks} blocks x {self.block_size}, "
            f"{len(self._seqs)} sequences, {st['blocks_used']} blocks used, {self.nbytes() / 2**20:.2f} MiB)"
        )


class _Plan:
    """Where one forward writes and what it reads: computed once, shared by every layer."""

    def __init__(self, cache: PagedCache, ids: list[int], n_new: int):
        seqs = [cache._seqs[s] for s in ids]
        for sid in ids:
            cache.reserve(sid, n_new)
        bs, dev = cache.block_size, cache.device
        self.cache, self.ids, self.n_new = cache, ids, n_new
        starts = [s.length for s in seqs]
        self.lens = [st + n_new for st in starts]  # after the write
        blk, off = [], []
        for s, st in zip(seqs, starts):
            for p in range(st, st + n_new):
                blk.append(s.blocks[p // bs])
                off.append(p % bs)
        self.write_blocks = torch.tensor(blk, dtype=torch.long, device=dev)  # (B * n_new,)
        self.write_offsets = torch.tensor(off, dtype=torch.long, device=dev)
        self.blocks = [s.blocks[: -(-n // bs)] for s, n in zip(seqs, self.lens)]
        self.runs = [block_runs(b) for b in self.blocks]
        self._tables: tuple[Tensor, Tensor] | None = None
        self._layout: dict[bool, PoolLayout] | None = None

    @classmethod
    def reading(cls, cache: PagedCache, ids: list[int], lens: list[int]) -> "_Plan":
        """A plan that only reads: sequences ``ids`` holding ``lens`` positions (written already)."""
        self = cls.__new__(cls)
        bs = cache.block_size
        self.cache, self.ids, self.n_new, self.lens = cache, ids, 0, lens  # (writes nothing)
        self.blocks = [cache._seqs[s].blocks[: -(-n // bs)] for s, n in zip(ids, lens)]
        self.runs = [block_runs(b) for b in self.blocks]
        self._tables = None
        self._layout = None
        return self

    def layout(self, whole: bool = False) -> PoolLayout:
        """The pool-wide decode layout (built once per step, shared by every layer)."""
        if self._layout is None:
            self._layout = {}
        built = self._layout.get(whole)
        if built is None:
            built = self._layout[whole] = PoolLayout(
                self.blocks,
                self.lens,
                self.cache.block_size,
                self.cache.device,
                self.cache.num_blocks if whole else None,
            )
        return built

    def tables(self) -> tuple[Tensor, Tensor]:
        """``block_table (B, max_blocks)`` and ``seq_lens (B,)`` int32 tensors (for the GPU kernel)."""
        tables = self._tables
        if tables is None:
            tables = self._tables = (
                self.cache.block_table(self.ids),
                torch.tensor(self.lens, dtype=torch.int32, device=self.cache.device),
            )
        return tables

    def gather(self, pool: Tensor) -> tuple[Tensor, Tensor | None]:
        """Every stored position of each sequence, right-aligned: ``(B, Hkv, max_len, D)`` and the padding mask."""
        _, H, _, D = pool.shape
        # (Hkv, n, D) per sequence: a view of one run of blocks; a sequence with nothing stored yet is empty
        rows = [seq_view(pool, runs, n) if runs else pool.new_zeros(H, 0, D) for runs, n in zip(self.runs, self.lens)]
        if len(rows) == 1:
            return rows[0][None], None
        L = max(self.lens)
        out = pool.new_zeros(len(rows), H, L, D)
        for b, r in enumerate(rows):
            out[b, :, L - r.shape[1] :] = r  # right-align: every sequence ends at column L - 1 (bottom-right)
        if all(n == L for n in self.lens):
            return out, None
        cols = torch.arange(L, device=pool.device).view(1, -1)
        pad = torch.tensor([L - n for n in self.lens], device=pool.device).view(-1, 1)
        return out, (cols >= pad)[:, None, None, :]  # (B, 1, 1, L)


class _PagedDecode(CacheAttention):
    """What a decode step's layer returns: attention through the block table (see ``paged_attention``)."""

    def __init__(self, k_pool: Tensor, v_pool: Tensor, plan: _Plan):
        self.k_pool, self.v_pool, self.plan = k_pool, v_pool, plan

    def attend(
        self,
        q: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: BiasLike | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        value_dims: int | None = None,
        compute: Compute | None = None,
    ) -> Tensor:
        """``value_dims``: the values are the first ``value_dims`` channels of the stored keys (a latent cache,
        :class:`attnkit.nn.LatentAttention`, stores no values of its own); ``compute``: see
        :meth:`CacheAttention.attend` (the sequences' keys gathered right-aligned, with their padding mask)."""
        v_pool = self.v_pool if value_dims is None else self.k_pool[..., :value_dims]
        if compute is not None:
            k, pad = self.plan.gather(self.k_pool)
            v = k[..., :value_dims] if value_dims is not None else self.plan.gather(v_pool)[0]
            return attend(
                CacheRead(k, v, pad),
                q,
                mask=mask,
                bias=bias,
                scale=scale,
                softcap=softcap,
                sinks=sinks,
                compute=compute,
            )
        if q.is_cuda or sinks is not None:  # the Triton kernel when it takes the call (sinks: per sequence)
            table, lens = self.plan.tables()
            return paged_attention(
                q, self.k_pool, v_pool, table, lens, scale=scale, softcap=softcap, bias=bias, mask=mask, sinks=sinks
            )
        scale, softcap, mask, _ = _prepare(q, scale, softcap, bias, mask)
        return _kernel.attend_blocks(
            q,
            self.k_pool,
            v_pool,
            self.plan.lens,
            self.plan.runs,
            self.plan.layout,
            scale=scale,
            softcap=softcap,
            bias=bias,
            mask=mask,
        )


class PagedLayerCache(PoolLayer):
    """Layer ``index`` of a :class:`PagedBatch`: writes new keys/values into the pool through the plan."""

    _owner: PagedBatch

    def peek(self, n_new: int) -> tuple[int | None, bool]:
        """``(Lk, attends)`` of an update of ``n_new`` tokens (see ``StaticLayerCache.peek``): one token
        returns the paged decode object; more return the gathered keys, as long as the longest sequence."""
        o = self._owner
        return max((o.cache._seqs[s].length for s in o.ids), default=0) + n_new, n_new == 1

    def update(self, k: Tensor, v: Tensor) -> CacheRead | _PagedDecode:
        """Store ``k (B, Hkv, L_new, D)``, ``v`` for the batch's sequences; one new token each returns a
        paged decode object (``attend``), more return the gathered keys/values in position order."""
        o = self._owner
        c = o.cache
        check_new_kv(
            k,
            v,
            batch=len(o.ids),
            heads=c.n_kv_heads,
            d_head=c.d_head,
            d_value=c.d_value,
            dtype=c.dtype,
            device=c.device,
        )
        plan = o._plan_for(k.shape[2])
        kp, vp = self._pools()
        B, H, n, _ = k.shape
        kp[plan.write_blocks, :, plan.write_offsets] = k.transpose(1, 2).reshape(B * n, H, k.shape[3])  # (B*n, Hkv, D)
        vp[plan.write_blocks, :, plan.write_offsets] = v.transpose(1, 2).reshape(B * n, H, v.shape[3])
        out: CacheRead | _PagedDecode
        if n == 1:
            out = _PagedDecode(kp, vp, plan)
        else:
            k_all, mask = plan.gather(kp)  # (B, Hkv, L, D), right-aligned
            v_all, _ = plan.gather(vp)
            out = CacheRead(k_all, v_all, mask)
        return self._done(out)


class PagedBatch(PoolView):
    """The model-level view of a :class:`PagedCache` for a forward over some of its sequences.

    ``layers[i]`` writes layer ``i``; the last layer's update commits the new lengths (and registers
    newly filled blocks for prefix caching).  ``seq_len`` is the stored length when every sequence holds the
    same; a batch whose sequences differ in length must pass ``positions=batch.positions(L)`` (``(B, L)``
    long) to the model (its ``seq_len`` raises).

    Example::

        >>> import torch
        >>> from attnkit.cache import PagedCache
        >>> pool = PagedCache(1, num_blocks=4, block_size=4, n_kv_heads=1, d_head=2)
        >>> a, b = pool.add_sequence(), pool.add_sequence()
        >>> _ = pool.batch([a]).layers[0].update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
        >>> view = pool.batch([a, b])
        >>> view.positions(1).tolist(), pool.batch([a]).seq_len
        ([[3], [0]], 3)
    """

    def __init__(self, cache: PagedCache, ids: list[int]):
        self.cache, self.ids = cache, ids
        self.layers = tuple(PagedLayerCache(self, i) for i in range(cache.n_layers))
        self._plan: _Plan | None = None

    @property
    def seq_len(self) -> int:
        """The stored length of the batch's sequences, when they all hold the same (what a model's default
        positions read); sequences of different lengths raise: pass ``positions=batch.positions(L)``."""
        lens = [self.cache._seqs[s].length for s in self.ids]
        if len(set(lens)) > 1:
            raise ValueError(
                f"PagedBatch: its sequences hold different lengths {lens}, so default positions "
                f"(seq_len + arange(L)) would be wrong for all but the longest: pass "
                f"positions=batch.positions(L) to the model"
            )
        return lens[0] if lens else 0

    def positions(self, n_new: int) -> Tensor:
        """``(B, n_new)`` absolute positions of the next ``n_new`` tokens of each sequence."""
        integer("n_new", n_new, minimum=0)
        lens = torch.tensor([self.cache._seqs[s].length for s in self.ids], dtype=torch.long, device=self.cache.device)
        return lens.view(-1, 1) + torch.arange(n_new, device=self.cache.device).view(1, -1)

    def _plan_for(self, n_new: int) -> _Plan:
        if self._plan is None:
            self._plan = _Plan(self.cache, self.ids, n_new)
        elif self._plan.n_new != n_new:
            raise ValueError(f"PagedBatch: layers of one forward got {self._plan.n_new} and {n_new} new tokens")
        return self._plan

    def _commit(self) -> None:
        n_new = 0 if self._plan is None else self._plan.n_new
        for s in self.ids:
            self.cache._advance(s, n_new)
        self._plan = None

    def __repr__(self) -> str:
        return f"PagedBatch(sequences {self.ids}, lengths {[self.cache._seqs[s].length for s in self.ids]})"


# ----------------------------------------------------------------------------- packed forwards (chunked prefill)


class _PackedAttend(CacheAttention):
    """What a packed forward's layer returns: each sequence's queries attend to its own keys.

    The one-token segments (decode steps) attend together through the block tables, as a decode step does;
    each longer segment (a chunk of a prompt) attends to its sequence's keys read in position order, with
    the layer's mask and bias bottom-right aligned on that sequence alone."""

    def __init__(self, k_pool: Tensor, v_pool: Tensor, packed: "PagedPacked"):
        self.k_pool, self.v_pool, self.packed = k_pool, v_pool, packed

    def attend(
        self,
        q: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: BiasLike | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        value_dims: int | None = None,
        compute: Compute | None = None,
    ) -> Tensor:
        """``sinks``: as in :func:`attnkit.attention` (a logit per query head); ``value_dims``: the values are
        the first ``value_dims`` channels of the stored keys (a latent cache, :class:`attnkit.nn.LatentAttention`);
        ``compute``: see :meth:`CacheAttention.attend` (called for the decode rows together, then for each chunk)."""
        from ..functional import attention

        pk = self.packed
        _, Hq, T, D = q.shape
        dv = self.v_pool.shape[3] if value_dims is None else value_dims
        out = q.new_empty(1, Hq, T, dv)  # (1, Hq, T, Dv)
        dec = pk._decode_rows
        if dec:
            rows = torch.tensor([pk.offsets[i] for i in dec], device=q.device)
            qd = q[0, :, rows].transpose(0, 1).unsqueeze(2)  # (Bd, Hq, 1, D)
            od = _PagedDecode(self.k_pool, self.v_pool, pk._decode_plan()).attend(
                qd,
                mask=mask,
                bias=bias,
                scale=scale,
                softcap=softcap,
                sinks=sinks,
                value_dims=value_dims,
                compute=compute,
            )  # (Bd, Hq, 1, Dv)
            out[0, :, rows] = od[:, :, 0].transpose(0, 1)
        for i in pk._chunk_rows:
            a, n = pk.offsets[i], pk.n_new[i]
            k, v = pk._keys(self.k_pool, self.v_pool, i, value_dims is None)  # (1, Hkv, L, D), (1, Hkv, L, Dv)
            v = k[..., :value_dims] if value_dims is not None else cast(Tensor, v)  # (values read unless latent)
            qi = q[:, :, a : a + n]  # (1, Hq, n, D)
            if compute is not None:
                out[:, :, a : a + n] = compute(
                    qi, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks
                )
            elif _kernel.takes_chunk(qi, k, v, mask=mask, bias=bias, softcap=softcap):
                out[:, :, a : a + n] = _kernel.attend_chunk(
                    qi,
                    k,
                    v,
                    scale=D**-0.5 if scale is None else scale,
                    causal=mask is not None,
                    sinks=check_sinks(sinks, qi),
                )
            else:
                out[:, :, a : a + n] = attention(
                    qi, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks
                )
        return out


class PagedPackedLayerCache(PoolLayer):
    """Layer ``index`` of a :class:`PagedPacked`: writes the packed keys/values into the pool."""

    _owner: PagedPacked

    def peek(self, n_new: int) -> tuple[int | None, bool]:
        """``(None, True)``: the keys differ per sequence, and the returned object computes attention."""
        return None, True

    def update(self, k: Tensor, v: Tensor) -> _PackedAttend:
        """Store ``k (1, Hkv, T, D)``, ``v (1, Hkv, T, Dv)`` (the packed tokens) at their sequences' slots."""
        o = self._owner
        c = o.cache
        check_new_kv(
            k, v, batch=1, heads=c.n_kv_heads, d_head=c.d_head, d_value=c.d_value, dtype=c.dtype, device=c.device
        )
        if k.shape[2] != o.total:
            raise ValueError(
                f"PagedPacked: the forward packs {o.total} tokens ({o.n_new} per sequence) but layer "
                f"{self.index} got {k.shape[2]}"
            )
        o._reserve()
        kp, vp = self._pools()
        kp[o.write_blocks, :, o.write_offsets] = k[0].transpose(0, 1)  # (T, Hkv, D)
        vp[o.write_blocks, :, o.write_offsets] = v[0].transpose(0, 1)
        return self._done(_PackedAttend(kp, vp, o))


class PagedPacked(PoolView):
    """The model-level view of a :class:`PagedCache` for one forward over packed tokens of several sequences.

    The forward's ``(1, T)`` tokens are ``n_new[0]`` tokens of ``ids[0]``, then ``n_new[1]`` of ``ids[1]``, ...
    (queries of different lengths per sequence: decode tokens and chunks of prompts in one forward, the work
    following the real tokens).  Pass ``positions=packed.positions()`` (``(1, T)``) to the model; each
    sequence's queries attend only to its own keys (its mask bottom-right aligned on it alone).  The last
    layer commits the new lengths.  :meth:`last` gives the index of each sequence's last token in ``T``.

    The one-token segments attend together through the block tables, as a decode step does.  For a longer
    segment (a chunk of a prompt) each layer copies its sequence's keys and values in position order into a
    workspace the cache keeps (one layer's keys and values of the longest such sequence) and attends its
    queries to them: with no bias and softcap and a causal mask (or none), on the CPU, by
    ``attnkit.backends.paged.attend_chunk`` (the fused kernel on the keys before the chunk, then on its
    own keys causally, merged); otherwise by :func:`attnkit.attention`.

    Example::

        >>> import torch
        >>> from attnkit.cache import PagedCache
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny")).double()
        >>> pool = PagedCache.for_model(model, num_blocks=8, block_size=4)
        >>> a, b = pool.add_sequence(), pool.add_sequence()
        >>> with torch.no_grad():
        ...     view = pool.batch([a])
        ...     _ = model(torch.tensor([[1, 2, 3]]), cache=view, positions=view.positions(3))
        ...     packed = pool.packed([a, b], [1, 5])      # a decodes one token, b prefills five
        ...     logits = model(torch.tensor([[4, 9, 8, 7, 6, 5]]), cache=packed, positions=packed.positions())
        ...     alone = model(torch.tensor([[9, 8, 7, 6, 5]]))
        >>> bool(torch.allclose(logits[0, 1:], alone[0]))
        True
    """

    def __init__(self, cache: PagedCache, ids: list[int], n_new: list[int]):
        self.cache, self.ids, self.n_new = cache, ids, n_new
        self.total = sum(n_new)
        self.offsets = [0]
        for n in n_new[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.starts = [cache._seqs[s].length for s in ids]
        self.layers = tuple(PagedPackedLayerCache(self, i) for i in range(cache.n_layers))
        self._decode_rows = [i for i, n in enumerate(n_new) if n == 1]
        self._chunk_rows = [i for i, n in enumerate(n_new) if n > 1]
        self._reserved = self._committed = False
        self._plans: dict[str, _Plan] = {}

    @property
    def seq_len(self) -> int:
        raise ValueError(
            "PagedPacked: its sequences hold different lengths: pass positions=packed.positions() to the model"
        )

    def positions(self) -> Tensor:
        """``(1, T)`` absolute positions of the packed tokens."""
        pos = [st + j for st, n in zip(self.starts, self.n_new) for j in range(n)]
        return torch.tensor([pos], dtype=torch.long, device=self.cache.device)

    def last(self) -> Tensor:
        """``(len(ids),)`` index of each sequence's last token in the packed ``T``."""
        return torch.tensor(
            [a + n - 1 for a, n in zip(self.offsets, self.n_new)], dtype=torch.long, device=self.cache.device
        )

    def _reserve(self) -> None:
        if self._committed:
            raise ValueError(
                "PagedPacked: this view served its forward already; make a new one with "
                "PagedCache.packed(...) for the next"
            )
        if self._reserved:
            return
        c = self.cache
        need = sum(c.blocks_needed(s, n) for s, n in zip(self.ids, self.n_new))
        if need > c.num_free_blocks:
            raise PoolExhausted(
                f"PagedCache pool exhausted: a packed forward needs {need} more block(s) but only "
                f"{c.num_free_blocks} of {c.num_blocks} are free"
            )
        for s, n in zip(self.ids, self.n_new):
            c.reserve(s, n)
        bs = c.block_size
        blk, off = [], []
        for s, st, n in zip(self.ids, self.starts, self.n_new):
            seq = c._seqs[s]
            for p in range(st, st + n):
                blk.append(seq.blocks[p // bs])
                off.append(p % bs)
        self.write_blocks = torch.tensor(blk, dtype=torch.long, device=c.device)  # (T,)
        self.write_offsets = torch.tensor(off, dtype=torch.long, device=c.device)
        self._reserved = True

    def _read_plan(self) -> _Plan:
        if "all" not in self._plans:
            lens = [st + n for st, n in zip(self.starts, self.n_new)]
            self._plans["all"] = _Plan.reading(self.cache, self.ids, lens)
        return self._plans["all"]

    def _keys(self, k_pool: Tensor, v_pool: Tensor, i: int, values: bool = True) -> tuple[Tensor, Tensor | None]:
        """Sequence ``ids[i]``'s keys and values so far, ``(1, Hkv, L, D)`` and ``(1, Hkv, L, Dv)``, copied in
        position order into the cache's workspace (contiguous; overwritten by the next call); the values None
        when ``values`` is False (a latent cache's values are part of its keys)."""
        plan = self._read_plan()
        L, runs, c = plan.lens[i], plan.runs[i], self.cache
        kw, vw = c._chunk_workspace(L, len(c._seqs[self.ids[i]].blocks) * c.block_size)  # (its reserved blocks)
        return (
            _kernel.gather_positions(k_pool, runs, L, kw)[None],
            _kernel.gather_positions(v_pool, runs, L, vw)[None] if values else None,
        )

    def _decode_plan(self) -> _Plan:
        if "decode" not in self._plans:
            rows = self._decode_rows
            self._plans["decode"] = _Plan.reading(
                self.cache, [self.ids[i] for i in rows], [self.starts[i] + 1 for i in rows]
            )
        return self._plans["decode"]

    def _commit(self) -> None:
        self._committed = True
        for s, n in zip(self.ids, self.n_new):
            self.cache._advance(s, n)

    def __repr__(self) -> str:
        return f"PagedPacked(sequences {self.ids}, new tokens {self.n_new}, stored {self.starts})"
