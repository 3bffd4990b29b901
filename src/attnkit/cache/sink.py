"""``SinkCache``: StreamingLLM's attention-sink cache for generating past a model's context.

Each layer keeps the first ``n_sink`` tokens and the last ``window - 1`` before the current one, so a decode
step attends to at most ``n_sink + window`` keys however long the generation runs.  Positions are those
*within the cache*, as in StreamingLLM: the attended keys sit at positions ``0 .. n-1`` and the current
query at ``n - 1``, whatever their positions in the text were.  With rotary embeddings the keys are stored
un-rotated and rotated at their cache positions at every step (the model rotates the query at the cache
position it reads from ``seq_len``); other position methods (ALiBi, none) see the cache positions directly.

What it keeps: the sink tokens and a window of recent ones, not the text in between — a model forgets what
left the window (StreamingLLM keeps perplexity stable over long streams; it does not extend what the model
can recall).  Its results are not those of full attention once the window is exceeded.

:class:`PagedSinkCache` keeps the same tokens in a block pool for many sequences (what ``attnkit.Engine(...,
n_sink=, window=)`` decodes with): blocks that left the window go back to the pool.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .._checks import integer
from ..bias import BiasLike
from ..masks import Mask
from ._common import Compute, ModelCache, check_new_kv, layout_of, model_dims
from ._pool_view import PoolLayer, PoolView
from ._protocol import CacheAttention, CacheRead
from ._block_pool import SequenceBlocks
from .paged import PagedCache, PoolExhausted

Tensor = torch.Tensor

__all__ = ["SinkCache", "PagedSinkCache"]


def _unrotate(rope: Any, k: Tensor, positions: Tensor) -> Tensor:
    """``k (B, Hkv, n, D)``, rotated by ``rope`` at ``positions`` (``(n,)`` or ``(B, n)``), rotated back: the
    key before its rotation."""
    cos, sin = rope.cos_sin(positions, k.dtype)
    if cos.dim() == 3:  # (B, n, dim) -> (B, 1, n, dim)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    kr, kp = k[..., : rope.dim], k[..., rope.dim :]
    raw = kr * cos - rope._rotate_pairs(kr) * sin  # the inverse rotation
    if rope.attention_factor != 1.0:  # cos and sin carry the factor (YaRN, LongRoPE): rotating back multiplied by it
        raw = raw / rope.attention_factor**2  # again, where the inverse divides by it
    return torch.cat([raw, kp], dim=-1)


def _rotary(model: Any) -> Any:
    """The model's :class:`attnkit.nn.RotaryEmbedding` when it has one (else None), after checking that every
    layer rotates with it: the cache rotates the kept keys at their positions within the cache itself."""
    cfg = getattr(model, "config", None)
    for name, why in (
        ("rope_layers", "some layers have no positions"),
        ("rope_local_theta", "some layers rotate with another base"),
        ("kv_lora_rank", "latent attention rotates a separate key part"),
    ):
        if getattr(cfg, name, None) is not None:
            raise ValueError(
                f"a sink cache rotates every layer's kept keys with the model's one rotary embedding, "
                f"but this model has {name}={getattr(cfg, name)!r} ({why}): it cannot be decoded "
                f"with attention sinks; use a full cache"
            )
    rope = getattr(model, "positions", None)
    rotary = callable(getattr(rope, "rotate", None)) and callable(getattr(rope, "cos_sin", None))
    return rope if rotary else None


class SinkLayerCache:
    """One layer: ``(B, Hkv, n, D)`` keys (un-rotated) and values of the sink tokens and the recent window."""

    def __init__(self, owner: "SinkCache", index: int):
        self._owner, self.index = owner, index
        self.length = 0  # tokens seen
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @property
    def seq_len(self) -> int:
        """The cache position of the next token (what the model rotates its query at)."""
        return 0 if self.k is None else min(self.k.shape[2], self._owner.capacity - 1)

    def _unrotate(self, k: Tensor, start: int) -> Tensor:
        rope = self._owner.rope
        if rope is None:
            return k
        return _unrotate(rope, k, torch.arange(start, start + k.shape[2], device=k.device))

    def update(self, k: Tensor, v: Tensor) -> CacheRead:
        o = self._owner
        n = k.shape[2]
        if self.k is not None and self.v is not None:
            check_new_kv(
                k,
                v,
                batch=self.k.shape[0],
                heads=self.k.shape[1],
                d_head=self.k.shape[3],
                d_value=self.v.shape[3],
                dtype=self.k.dtype,
                device=self.k.device,
            )
        if n != 1 and self.length:
            raise ValueError(
                f"SinkCache takes a prompt and then one token per step, got {n} new tokens after {self.length}"
            )
        if n > o.capacity:
            raise ValueError(
                f"a prompt of {n} tokens does not fit SinkCache's n_sink + window = {o.capacity}: "
                f"shorten it or make the window larger"
            )
        raw = self._unrotate(k, self.seq_len)
        self.k = raw if self.k is None else torch.cat([self.k, raw], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        if self.k.shape[2] > o.capacity:  # evict the oldest token after the sinks
            s = o.n_sink
            self.k = torch.cat([self.k[:, :, :s], self.k[:, :, s + 1 :]], dim=2)
            self.v = torch.cat([self.v[:, :, :s], self.v[:, :, s + 1 :]], dim=2)
        self.length += n
        k_all = self.k if o.rope is None else o.rope.rotate(self.k, torch.arange(self.k.shape[2], device=k.device))
        return CacheRead(k_all, self.v)

    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        self.length, self.k, self.v = 0, None, None

    def __repr__(self) -> str:
        return (
            f"SinkLayerCache(layer {self.index}, {self.length} seen, {0 if self.k is None else self.k.shape[2]} kept)"
        )


class SinkCache(ModelCache):
    """StreamingLLM's cache: the first ``n_sink`` tokens plus a sliding ``window`` (the current token
    included), at positions within the cache (see the module docstring for what it keeps).

    Args:
        n_layers: decoder layers.
        n_sink: tokens kept from the start (StreamingLLM: 4).
        window: recent tokens attended at each step, the current one included.
        rope: the model's :class:`attnkit.nn.RotaryEmbedding` (None for models without rotary positions).

    Use :meth:`for_model`, e.g. ``generate(model, prompts, n, cache=lambda m, b, L: SinkCache.for_model(m))``.
    Prompts of one length only (no left padding).

    Example::

        >>> import torch, attnkit
        >>> from attnkit.cache import SinkCache
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny")).eval()
        >>> out = attnkit.generate(model, [[1, 2, 3]], 40, cache=lambda m, b, L: SinkCache.for_model(m, 4, 16))
        >>> len(out[0])
        40
    """

    def __init__(self, n_layers: int, n_sink: int, window: int, *, rope: Any = None) -> None:
        super().__init__()
        integer("n_layers", n_layers, minimum=1)
        self.n_sink = integer("n_sink", n_sink, minimum=0)
        self.window = integer("window", window, minimum=1)
        self.capacity = self.n_sink + self.window
        self.rope = rope
        self.layers = tuple(SinkLayerCache(self, i) for i in range(n_layers))

    @classmethod
    def for_model(cls, model: Any, n_sink: int = 4, window: int = 1024) -> "SinkCache":
        """A cache for an :class:`attnkit.nn.DecoderLM` (its rotary embedding, when it has one)."""
        d = model_dims(model)
        return cls(d["n_layers"], n_sink, window, rope=_rotary(model))

    @property
    def seq_len(self) -> int:
        n: int = self.layers[-1].seq_len
        return n

    def set_left_padding(self, pad: Any) -> None:
        if pad is not None and any(int(p) for p in pad):
            raise ValueError("SinkCache takes prompts of one length (no left padding): generate them one at a time")


# ----------------------------------------------------------------------------- the same tokens in a block pool


class PagedSinkCache(PagedCache):
    """StreamingLLM's sink cache over a :class:`~attnkit.cache.PagedCache` pool, for many sequences at once
    (what :class:`attnkit.decoding.Engine` decodes with when given ``n_sink`` and ``window``).

    Each sequence keeps what :class:`SinkCache` keeps: its first ``n_sink`` tokens and the last ``window``
    (the current one included), at positions within the cache (``0 .. n-1`` for the ``n`` kept keys, the
    newest query at ``n - 1``; ``batch.positions(L)`` gives them, and ``seq_len`` reads them).  Position
    ``p`` of a sequence is stored in block ``p // block_size`` as in the plain pool, with rotary keys stored
    un-rotated; a forward reads the kept keys in order and rotates them at their positions within the cache,
    so a step's result is that of :class:`SinkCache`.  Each block that left the window goes back to the pool
    as soon as the sequence has moved past it (its entry in ``block_table`` becomes ``-1``): a sequence
    never holds more than :attr:`max_blocks_per_sequence` blocks however long it runs.  The non-sink tokens of
    a block that holds sinks, and the oldest tokens of a partly evicted block, are masked token by token.

    A forward of several tokens of one sequence must end within ``n_sink + window`` positions (nothing is
    evicted before that, so its queries attend causally); past that each sequence takes one token per forward
    (``PagedSinkCache`` then streams: a prompt may be longer than the window when its tail is fed one token at
    a time, as the Engine does).  Prefix caching shares only blocks that lie wholly within the first
    ``n_sink + window`` positions (computed before anything was evicted, so equal for every sequence with that
    prefix); :meth:`truncate` is refused (evicted positions cannot come back).

    Args:
        n_layers, num_blocks, block_size, n_kv_heads, d_head, d_value, dtype, device, prefix_caching: as for
            :class:`~attnkit.cache.PagedCache`.
        n_sink: tokens kept from the start (StreamingLLM: 4).
        window: recent tokens attended at each step, the current one included.
        rope: the model's :class:`attnkit.nn.RotaryEmbedding` (None without rotary positions).

    Example::

        >>> import torch
        >>> from attnkit.cache import PagedSinkCache, SinkCache
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny")).double().eval()
        >>> pool = PagedSinkCache.for_model(model, num_blocks=8, block_size=4, n_sink=2, window=6)
        >>> ref = SinkCache.for_model(model, n_sink=2, window=6)
        >>> a = pool.add_sequence()
        >>> with torch.no_grad():
        ...     for tok in [5, 1, 7, 3, 9, 2, 8, 4, 6, 11, 12, 13, 14, 15]:   # past n_sink + window = 8
        ...         view = pool.batch([a])
        ...         out = model(torch.tensor([[tok]]), cache=view, positions=view.positions(1))
        ...         want = model(torch.tensor([[tok]]), cache=ref)
        >>> bool(torch.allclose(out, want)), pool.length(a), pool.batch([a]).seq_len
        (True, 14, 7)
        >>> pool.block_table([a]).tolist(), pool.max_blocks_per_sequence   # positions 4-7 went back
        ([[0, -1, 2, 3]], 4)
    """

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        n_sink: int,
        window: int,
        rope: Any = None,
        n_kv_heads: int,
        d_head: int,
        d_value: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        prefix_caching: bool = True,
    ) -> None:
        super().__init__(
            n_layers,
            num_blocks,
            block_size,
            n_kv_heads=n_kv_heads,
            d_head=d_head,
            d_value=d_value,
            dtype=dtype,
            device=device,
            prefix_caching=prefix_caching,
        )
        self.n_sink = integer("n_sink", n_sink, minimum=0)
        self.window = integer("window", window, minimum=1)
        self.capacity = self.n_sink + self.window
        if self.d_value == 0:
            raise ValueError(
                "PagedSinkCache: d_value=0 is a latent cache (values inside the keys), which a sink "
                "cache does not store: give d_value"
            )
        self.rope = rope
        self._sink_blocks = -(-self.n_sink // block_size)  # the blocks holding sink tokens, never given back

    @classmethod
    def for_model(
        cls,
        model: Any,
        num_blocks: int,
        block_size: int = 16,
        *,
        n_sink: int = 4,
        window: int = 1024,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        prefix_caching: bool = True,
    ) -> "PagedSinkCache":
        """A pool laid out for ``model`` (its config, parameters and rotary embedding, when it has one)."""
        rope = _rotary(model)
        d = model_dims(model)
        return cls(
            d["n_layers"],
            num_blocks,
            block_size,
            n_sink=n_sink,
            window=window,
            rope=rope,
            **layout_of(d, dtype, device),
            prefix_caching=prefix_caching,
        )

    @property
    def max_blocks_per_sequence(self) -> int:
        """The most blocks one sequence holds at any time, those of the sinks plus those the ``window``
        newest positions can straddle (``ceil(n_sink / bs) + ceil((window - 1) / bs) + 1``)."""
        return self._sink_blocks + -(-(self.window - 1) // self.block_size) + 1

    def kept(self, length: int) -> list[int]:
        """The positions a sequence of ``length`` tokens attends to from its newest one: all of them while
        ``length <= n_sink + window``, then the sinks and the last ``window``."""
        if length <= self.capacity:
            return list(range(length))
        return list(range(self.n_sink)) + list(range(length - self.window, length))

    def cache_position(self, sid: int) -> int:
        """The position within the cache of sequence ``sid``'s next token (``min(length, n_sink + window - 1)``)."""
        return min(self.length(sid), self.capacity - 1)

    # ------------------------------------------------------------------ blocks

    def add_sequence(self, tokens: object = None) -> int:
        sid = super().add_sequence(tokens)
        self._evict(self._seqs[sid])
        return sid

    def _advance(self, sid: int, n: int) -> None:
        super()._advance(sid, n)
        self._evict(self._seqs[sid])

    def _evict(self, seq: SequenceBlocks) -> None:
        """Give back the blocks of ``seq`` that only hold tokens its next query no longer reads."""
        bs = self.block_size
        keep_from = max(self.n_sink, seq.length + 1 - self.window)  # the oldest non-sink position read next
        i = min(keep_from // bs, len(seq.blocks)) - 1  # blocks below i were given back already
        while i >= self._sink_blocks and seq.blocks[i] >= 0:
            self._alloc.decref(seq.blocks[i])
            seq.blocks[i] = -1
            i -= 1

    def _register(self, seq: SequenceBlocks) -> None:
        if not self.prefix_caching or seq.unshared:
            return
        full = min(seq.length, len(seq.tokens), self.capacity) // self.block_size  # computed before any eviction
        self._alloc.register_full(seq.blocks, seq.tokens, seq.hashes, full, self.block_size)

    def truncate(self, sid: int, length: int) -> None:
        raise ValueError(
            "PagedSinkCache.truncate: a sink cache gives evicted positions back to the pool, so it "
            "cannot cut a sequence back; use a PagedCache for speculative decoding"
        )

    # ------------------------------------------------------------------ forwards

    def batch(self, seq_ids: object) -> "PagedSinkBatch":  # type: ignore[override]  # (the sink pool's own view)
        """The model-level cache for one forward over sequences ``seq_ids``; pass ``positions=view.positions(L)``
        (positions within the cache) or let the model read ``view.seq_len``."""
        return PagedSinkBatch(self, super().batch(seq_ids).ids)

    def packed(  # type: ignore[override]  # (the sink pool's own view)
        self,
        seq_ids: Iterable[Any],
        n_new: Iterable[Any],
    ) -> "PagedSinkPacked":
        """The model-level cache for one forward packing ``n_new[i]`` tokens of ``seq_ids[i]`` (see
        :meth:`PagedCache.packed`); pass ``positions=packed.positions()``."""
        base = super().packed(seq_ids, n_new)
        return PagedSinkPacked(self, base.ids, base.n_new)

    def __repr__(self) -> str:
        return (
            super().__repr__().replace("PagedCache(", f"PagedSinkCache(n_sink={self.n_sink}, window={self.window}, ", 1)
        )


class _SinkPlan:
    """Where one forward writes (at true positions) and what each sequence reads (its kept keys, in order)."""

    def __init__(self, cache: PagedSinkCache, ids: list[int], n_new: list[int]):
        C, bs, dev = cache.capacity, cache.block_size, cache.device
        seqs = [cache._seqs[sid] for sid in ids]
        starts = [seq.length for seq in seqs]
        for sid, st, n in zip(ids, starts, n_new):
            if n > 1 and st + n > C:
                raise ValueError(
                    f"PagedSinkCache: sequence {sid} holds {st} tokens and the forward adds {n}, past "
                    f"n_sink + window = {C}: past that a sequence takes one token per forward (each "
                    f"token's window differs); feed at most {max(1, C - st)} now"
                )
        need = sum(cache.blocks_needed(s, n) for s, n in zip(ids, n_new))
        if need > cache.num_free_blocks:
            raise PoolExhausted(
                f"PagedSinkCache pool exhausted: the forward needs {need} more block(s) but only "
                f"{cache.num_free_blocks} of {cache.num_blocks} are free"
            )
        for sid, n in zip(ids, n_new):
            cache.reserve(sid, n)
        blk, off, pos = [], [], []
        for seq, st, n in zip(seqs, starts, n_new):
            for p in range(st, st + n):
                blk.append(seq.blocks[p // bs])
                off.append(p % bs)
                pos.append(min(p, C - 1))  # its position within the cache
        self.n_new = n_new
        self.write_blocks = torch.tensor(blk, dtype=torch.long, device=dev)  # (sum(n_new),)
        self.write_offsets = torch.tensor(off, dtype=torch.long, device=dev)
        self.write_positions = torch.tensor(pos, dtype=torch.long, device=dev)
        self.reads: list[tuple[Tensor, Tensor]] = []  # per sequence: (blocks (L,), offsets (L,)) of its kept keys
        for seq, st, n in zip(seqs, starts, n_new):
            L = st + n
            kept = (
                torch.arange(L, device=dev)
                if L <= C
                else torch.cat([torch.arange(cache.n_sink, device=dev), torch.arange(L - cache.window, L, device=dev)])
            )
            table = torch.tensor(seq.blocks, dtype=torch.long, device=dev)
            self.reads.append((table[kept // bs], kept % bs))
        self.rope, self.dev = cache.rope, dev

    def keys(self, pool: Tensor, i: int, rotate: bool) -> Tensor:
        """Sequence ``i``'s kept keys (or values) ``(1, Hkv, L, D)``, rotated at ``0 .. L-1`` when ``rotate``."""
        blk, off = self.reads[i]
        x = pool[blk, :, off].transpose(0, 1)[None]  # (L, Hkv, D) -> (1, Hkv, L, D)
        if rotate and self.rope is not None:
            x = self.rope.rotate(x, torch.arange(x.shape[2], device=self.dev))
        return x

    def padded(self, k_pool: Tensor, v_pool: Tensor) -> tuple[Tensor, ...]:
        """Every sequence's kept keys and values, rotated and right-aligned: ``(B, Hkv, L, D)``, ``(B, Hkv, L,
        Dv)`` and, when their lengths differ, the ``(B, 1, 1, L)`` mask of the real columns."""
        B = len(self.reads)
        if B == 1:
            return self.keys(k_pool, 0, True), self.keys(v_pool, 0, False)
        lens = [blk.shape[0] for blk, _ in self.reads]
        L = max(lens)
        # right-aligned: each sequence's newest key at column L - 1; the columns before its first key read that
        # key again (masked out) and sit at position 0
        idx = [
            torch.cat([blk.new_zeros(L - n), torch.arange(n, device=self.dev)]) for n, (blk, _) in zip(lens, self.reads)
        ]
        blk = torch.stack([b_[i] for i, (b_, _) in zip(idx, self.reads)])  # (B, L)
        off = torch.stack([o[i] for i, (_, o) in zip(idx, self.reads)])
        k_all = k_pool[blk, :, off].transpose(1, 2)  # (B, L, Hkv, D) -> (B, Hkv, L, D)
        v_all = v_pool[blk, :, off].transpose(1, 2)
        if self.rope is not None:
            if self.rope.length_dependent:  # its frequencies follow each sequence's own largest position
                for b, n in enumerate(lens):
                    k_all[b, :, L - n :] = self.keys(k_pool, b, True)[0]
            else:
                k_all = self.rope.rotate(k_all, torch.stack(idx))  # at positions 0 .. n-1 within the cache
        if all(n == L for n in lens):
            return k_all, v_all
        cols = torch.arange(L, device=self.dev).view(1, -1)
        pad = torch.tensor([L - n for n in lens], device=self.dev).view(-1, 1)
        return k_all, v_all, (cols >= pad)[:, None, None, :]  # (B, 1, 1, L)


class _SinkLayer(PoolLayer):
    """Layer ``index`` of a :class:`PagedSinkBatch` or :class:`PagedSinkPacked`."""

    _owner: PagedSinkBatch | PagedSinkPacked

    def peek(self, n_new: int) -> tuple[int | None, bool]:
        return self._owner._peek(n_new)

    def update(self, k: Tensor, v: Tensor) -> CacheRead | _SinkPackedAttend:
        """Store the new ``k (B, Hkv, L_new, D)`` (un-rotated from their positions within the cache) and ``v``;
        return what the queries attend to (see the view)."""
        o = self._owner
        c = o.cache
        check_new_kv(
            k, v, batch=o._batch, heads=c.n_kv_heads, d_head=c.d_head, d_value=c.d_value, dtype=c.dtype, device=c.device
        )
        plan = o._plan_for(k.shape[2])
        B, H, n, D = k.shape
        if c.rope is not None:
            k = _unrotate(c.rope, k, plan.write_positions.view(B, n))  # as stored: rotated when read
        kp, vp = self._pools()
        kp[plan.write_blocks, :, plan.write_offsets] = k.transpose(1, 2).reshape(B * n, H, D)  # (B*n, Hkv, D)
        vp[plan.write_blocks, :, plan.write_offsets] = v.transpose(1, 2).reshape(B * n, H, v.shape[3])
        return self._done(o._read(kp, vp, plan))


class PagedSinkBatch(PoolView):
    """The model-level view of a :class:`PagedSinkCache` for a forward of ``L`` tokens of each of some
    sequences: each layer returns the sequences' kept keys and values rotated at their positions within the
    cache (right-aligned, with a mask of the real columns when their lengths differ).  ``positions(L)``
    gives the new tokens' positions within the cache; ``seq_len`` reads them when every sequence has the same."""

    def __init__(self, cache: PagedSinkCache, ids: list[int]):
        self.cache, self.ids = cache, ids
        self._batch = len(ids)
        self.layers = tuple(_SinkLayer(self, i) for i in range(cache.n_layers))
        self._plan: _SinkPlan | None = None

    @property
    def seq_len(self) -> int:
        """The position within the cache of the next token, when the sequences share it."""
        pos = [self.cache.cache_position(s) for s in self.ids]
        if len(set(pos)) > 1:
            raise ValueError(
                f"PagedSinkBatch: its sequences' next tokens sit at different positions {pos}: pass "
                f"positions=batch.positions(L) to the model"
            )
        return pos[0] if pos else 0

    def positions(self, n_new: int) -> Tensor:
        """``(B, n_new)`` positions within the cache of the next ``n_new`` tokens of each sequence."""
        integer("n_new", n_new, minimum=0)
        c = self.cache
        lens = [c.length(s) for s in self.ids]
        rows = [[min(n + j, c.capacity - 1) for j in range(n_new)] for n in lens]
        return torch.tensor(rows, dtype=torch.long, device=c.device).view(len(lens), n_new)

    def _peek(self, n_new: int) -> tuple[int | None, bool]:
        return max((len(self.cache.kept(self.cache.length(s) + n_new)) for s in self.ids), default=0), False

    def _plan_for(self, n_new: int) -> _SinkPlan:
        if self._plan is None:
            self._plan = _SinkPlan(self.cache, self.ids, [n_new] * len(self.ids))
        elif self._plan.n_new[0] != n_new:
            raise ValueError(f"PagedSinkBatch: layers of one forward got {self._plan.n_new[0]} and {n_new} new tokens")
        return self._plan

    def _read(self, k_pool: Tensor, v_pool: Tensor, plan: _SinkPlan) -> CacheRead:
        return CacheRead(*plan.padded(k_pool, v_pool))

    def _commit(self) -> None:
        n_new = 0 if self._plan is None else self._plan.n_new[0]
        for s in self.ids:
            self.cache._advance(s, n_new)
        self._plan = None

    def __repr__(self) -> str:
        return f"PagedSinkBatch(sequences {self.ids}, lengths {[self.cache.length(s) for s in self.ids]})"


class _SinkPackedAttend(CacheAttention):
    """What a packed forward's layer returns: each sequence's queries attend to its own kept keys."""

    def __init__(self, k_pool: Tensor, v_pool: Tensor, view: "PagedSinkPacked", plan: _SinkPlan):
        self.k_pool, self.v_pool, self.view, self.plan = k_pool, v_pool, view, plan

    def attend(
        self,
        q: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        bias: BiasLike | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        compute: Compute | None = None,
    ) -> Tensor:
        """``compute``: see :meth:`CacheAttention.attend` (called for each sequence's queries and kept keys)."""
        from ._common import attend

        _, Hq, T, _ = q.shape
        out = q.new_empty(1, Hq, T, self.v_pool.shape[3])  # (1, Hq, T, Dv)
        for i, (a, n) in enumerate(zip(self.view.offsets, self.view.n_new)):
            kv = CacheRead(self.plan.keys(self.k_pool, i, True), self.plan.keys(self.v_pool, i, False))
            out[:, :, a : a + n] = attend(
                kv, q[:, :, a : a + n], mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks, compute=compute
            )
        return out


class PagedSinkPacked(PoolView):
    """The model-level view of a :class:`PagedSinkCache` for one forward over packed tokens of several
    sequences (see :class:`~attnkit.cache.PagedPacked`): ``positions()`` gives each token's position within
    the cache, ``last()`` each sequence's last token in ``T``; a sequence's chunk of more than one token must
    end within ``n_sink + window`` positions."""

    def __init__(self, cache: PagedSinkCache, ids: list[int], n_new: list[int]):
        self.cache, self.ids, self.n_new = cache, ids, n_new
        self._batch = 1
        self.offsets = [0]
        for n in n_new[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.total = sum(n_new)
        self.layers = tuple(_SinkLayer(self, i) for i in range(cache.n_layers))
        self._plan: _SinkPlan | None = None
        self._committed = False

    @property
    def seq_len(self) -> int:
        raise ValueError(
            "PagedSinkPacked: its sequences hold different lengths: pass positions=packed.positions() to the model"
        )

    def positions(self) -> Tensor:
        """``(1, T)`` positions within the cache of the packed tokens."""
        c = self.cache
        pos = [min(c.length(s) + j, c.capacity - 1) for s, n in zip(self.ids, self.n_new) for j in range(n)]
        return torch.tensor([pos], dtype=torch.long, device=c.device)

    def last(self) -> Tensor:
        """``(len(ids),)`` index of each sequence's last token in the packed ``T``."""
        return torch.tensor(
            [a + n - 1 for a, n in zip(self.offsets, self.n_new)], dtype=torch.long, device=self.cache.device
        )

    def _peek(self, n_new: int) -> tuple[int | None, bool]:
        return None, True

    def _plan_for(self, n_new: int) -> _SinkPlan:
        if self._committed:
            raise ValueError(
                "PagedSinkPacked: this view served its forward already; make a new one with "
                "PagedSinkCache.packed(...) for the next"
            )
        if n_new != self.total:
            raise ValueError(
                f"PagedSinkPacked: the forward packs {self.total} tokens ({self.n_new} per sequence) "
                f"but a layer got {n_new}"
            )
        if self._plan is None:
            self._plan = _SinkPlan(self.cache, self.ids, self.n_new)
        return self._plan

    def _read(self, k_pool: Tensor, v_pool: Tensor, plan: _SinkPlan) -> _SinkPackedAttend:
        return _SinkPackedAttend(k_pool, v_pool, self, plan)

    def _commit(self) -> None:
        self._committed = True
        for s, n in zip(self.ids, self.n_new):
            self.cache._advance(s, n)

    def __repr__(self) -> str:
        return f"PagedSinkPacked(sequences {self.ids}, new tokens {self.n_new})"
