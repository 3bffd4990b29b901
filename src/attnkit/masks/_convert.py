"""Masks from elsewhere: a function (``from_fn``), a FlexAttention ``BlockMask`` (``from_flex``), a bool tensor
(``from_dense``), packed variable-length sequences (``varlen``); and the questions callers ask about a mask's parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, cast

import torch

from .._checks import holds
from ._base import Dense, Mask, Varlen, _And, _checked_bool, _checked_shape, _leaves, _Named, _Or
from ._blocks import (
    _ALIGNS,
    _BIG,
    _EVAL_CHUNK,
    EMPTY,
    FULL,
    PARTIAL,
    _Band,
    _band_from_keys,
    _ceil_div,
    _check_align,
    _Grid,
    index_grid,
    _index_tensor,
    _offset,
    _pool_kinds,
    _Tiling,
)
from ._builtins import (
    _BlockLocal,
    _Causal,
    _Dilated,
    _GlobalTokens,
    _Interval,
    _PrefixLM,
    _RandomBlocks,
    _SlidingWindow,
    _Strided,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

Tensor = torch.Tensor


class _FromFn(Mask):
    """``fn(b, h, q_idx, kv_idx)``; ``q_idx`` is the query row (``align=None``, FlexAttention's convention) or
    the query's position under ``align``."""

    def __init__(self, fn: Callable[..., Tensor], name: str | None, align: str | None = None):
        if not callable(fn):
            raise TypeError(f"from_fn: fn must be callable as fn(b, h, q_idx, kv_idx) -> bool tensor, got {fn!r}")
        self.fn, self.name = fn, name or getattr(fn, "__name__", "fn")
        self.align = None if align is None else _check_align(align)

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        p = q if self.align is None else q + _offset(self.align, q_len, kv_len)
        return _checked_shape(self, _checked_bool(self, self.fn(b, h, p, k)), b, h, p, k)

    def wraps_function(self) -> bool:
        return True

    def cheap_structure(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"from_fn({self.name})" if self.align is None else f"from_fn({self.name}, align={self.align!r})"


class _FlexPredicate:
    """A FlexAttention ``BlockMask`` as one predicate: an element may attend when its block is full, or when
    its block is partial and the BlockMask's ``mask_mod`` allows it (empty blocks are never visited)."""

    def __init__(self, kinds: Tensor, mask_mod: Callable[..., object], block_size: tuple[int, int]):
        self.kinds, self.mask_mod, self.block_size = kinds, mask_mod, block_size  # kinds (B', H', nq, nk) int8

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        kinds = self.kinds.to(q_idx.device)
        bi = b.clamp(max=kinds.shape[0] - 1) if kinds.shape[0] > 1 else torch.zeros_like(b)
        hi = h.clamp(max=kinds.shape[1] - 1) if kinds.shape[1] > 1 else torch.zeros_like(h)
        kind = kinds[
            bi,
            hi,
            torch.div(q_idx, self.block_size[0], rounding_mode="floor"),
            torch.div(kv_idx, self.block_size[1], rounding_mode="floor"),
        ]
        allowed = self.mask_mod(b, h, q_idx, kv_idx)
        if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
            got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
            raise TypeError(f"from_flex: the BlockMask's mask_mod must return a bool tensor, got {got}")
        out: Tensor = (kind == FULL) | ((kind == PARTIAL) & allowed)
        return out


class _FromFlex(_FromFn):
    """A FlexAttention ``BlockMask``: its ``mask_mod`` over query rows, restricted to its blocks, for the
    sequence lengths it was built for."""

    def __init__(self, predicate: _FlexPredicate, seq_lengths: tuple[int, int], fixed_lengths: bool):
        super().__init__(predicate, "block_mask")
        self.seq_lengths, self.fixed_lengths = seq_lengths, fixed_lengths

    @property
    def _predicate(self) -> _FlexPredicate:
        return cast(_FlexPredicate, self.fn)  # (the function this mask was built with)

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        kinds = self._predicate.kinds
        if self.fixed_lengths and (q_len, kv_len) != self.seq_lengths:
            raise ValueError(
                f"from_flex: the BlockMask was built for (Q_LEN, KV_LEN)={self.seq_lengths} but the call "
                f"has Lq={q_len}, Lk={kv_len}: build it for these lengths (create_block_mask(..., "
                f"Q_LEN={q_len}, KV_LEN={kv_len})), as flex_attention requires"
            )
        if kinds.shape[0] not in (1, batch) or kinds.shape[1] not in (1, heads):
            raise ValueError(
                f"from_flex: the BlockMask has batch and heads {tuple(kinds.shape[:2])}, which do not "
                f"broadcast to B={batch}, Hq={heads}: build it with B=None/H=None (broadcast) or the "
                f"call's sizes"
            )

    def _size(self) -> tuple[int, int] | None:
        return self.seq_lengths

    def batch_size(self) -> int:
        return int(self._predicate.kinds.shape[0])

    def __repr__(self) -> str:
        name = getattr(self._predicate.mask_mod, "__name__", "mask_mod")
        return f"from_flex({name}, seq_lengths={self.seq_lengths}, BLOCK_SIZE={self._predicate.block_size})"


class _FromDense(Mask):
    def __init__(self, t: Tensor):
        self.t = t

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        t = self.t.to(q.device)
        bi = b.clamp(max=t.shape[0] - 1) if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h.clamp(max=t.shape[1] - 1) if t.shape[1] > 1 else torch.zeros_like(h)
        qi = q if t.shape[2] > 1 else torch.zeros_like(q)
        ki = k if t.shape[3] > 1 else torch.zeros_like(k)
        return t[bi, hi, qi, ki]

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        m = self.t.to(t.device).expand(self.t.shape[0], self.t.shape[1], t.q_len, t.kv_len)
        qp, kp = t.nq * t.block_q - t.q_len, t.nk * t.block_k - t.kv_len
        m = torch.nn.functional.pad(m, (0, kp, 0, qp))
        rows = torch.arange(m.shape[2], device=t.device).view(-1, 1) < t.q_len
        cols = torch.arange(m.shape[3], device=t.device).view(1, -1) < t.kv_len
        return _Grid(_pool_kinds(m, rows & cols, t.block_q, t.block_k))

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        b, h, lq, lk = self.t.shape
        ok = b in (1, batch) and h in (1, heads) and lq in (1, q_len) and lk in (1, kv_len)
        if not ok:
            hint = ""
            if (b, h) == (1, 1) and lq == batch != q_len and lk == kv_len:
                hint = (
                    ": it looks like a (B, Lk) padding mask, which needs the head and query axes: pass "
                    "mask[:, None, None, :], or masks.key_padding(mask)"
                )
            raise ValueError(
                f"from_dense: the mask has shape {tuple(self.t.shape)}, which does not broadcast to "
                f"(B, H, Lq, Lk)=({batch}, {heads}, {q_len}, {kv_len}){hint}"
            )

    def _size(self) -> tuple[int, int] | None:
        return (self.t.shape[2], self.t.shape[3])

    def batch_size(self) -> int:
        return self.t.shape[0]

    def form(self, q_len: int, kv_len: int) -> Dense:
        return Dense(self.t)

    def cheap_structure(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"from_dense({tuple(self.t.shape)})"


def from_fn(
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], *, name: str | None = None, align: str | None = None
) -> Mask:
    """A mask from a vectorised predicate ``fn(b, h, q_idx, kv_idx) -> bool tensor``.

    The arguments are broadcastable int64 index tensors.  By default (``align=None``) ``q_idx`` is the query
    *row*, as in FlexAttention's ``mask_mod``; with ``align="bottom_right"`` it is the query's *position*
    ``row + Lk - Lq``, as the built-in masks use by default, so ``from_fn(fn, align="bottom_right") & causal()``
    speaks of the same positions when ``Lq != Lk`` (decoding against a cache, too), and
    ``align="top_left"`` says explicitly that positions are rows.  A row predicate ``&`` a bottom-right
    built-in can leave every query with nothing to see when ``Lq != Lk``; :func:`attnkit.attention` warns
    when a mask with a ``from_fn`` part leaves every row of a call empty.  Its block structure is derived
    by evaluating ``fn`` one chunk of tiles at a time, never on the whole ``Lq x Lk``.

    ``fn`` must be a pure function of its arguments and of the tensors it reads: backends keep what they
    derive (block structure, dense form) per mask object, and notice when a tensor it holds — through a
    closure, a default argument, a bound method's object (or a list or dict among those), or a global
    tensor it names — is changed in place or rebound between calls (between a forward and its backward such
    a change is an error, as for autograd's saved tensors).  Python state it reads otherwise (a counter, a
    global list of tensors), and writes that bypass PyTorch's version counter (through a numpy view), are
    not seen: make a new mask when they change.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> doc = torch.tensor([0, 0, 1, 1, 1])
        >>> m = masks.from_fn(lambda b, h, i, j: doc[i] == doc[j])
        >>> m.to_dense(5, 5)[0, 0].int().tolist()[2]
        [0, 0, 1, 1, 1]
        >>> near = masks.from_fn(lambda b, h, p, j: p - j < 2, align="bottom_right")  # positions, like causal()
        >>> (near & masks.causal()).to_dense(2, 4)[0, 0].int().tolist()
        [[0, 1, 1, 0], [0, 0, 1, 1]]
    """
    return _FromFn(fn, name, align)


def from_flex(block_mask: BlockMask) -> Mask:
    """A mask from a FlexAttention ``BlockMask`` (the inverse of :meth:`Mask.mask_mod`).

    The result follows ``flex_attention``'s kernels: its ``mask_mod`` gets query *rows* (``q_idx`` is the row,
    FlexAttention has no alignment) and applies in the BlockMask's partial blocks, every element of its full
    blocks attends, and nothing in the blocks it leaves out.  (``flex_attention`` run eagerly, uncompiled,
    evaluates ``mask_mod`` everywhere instead; the two agree for a BlockMask whose blocks match its
    ``mask_mod``, as ``create_block_mask`` builds them.)  It carries the BlockMask's
    ``(Q_LEN, KV_LEN)`` and applies only to calls of those lengths, as ``flex_attention`` does; its batch
    and head sizes broadcast.  The BlockMask's block tables are read when the mask is built.
    :func:`attnkit.attention` also takes a ``BlockMask`` as ``mask=`` and converts it with this function.

    Example::

        >>> import torch, attnkit
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> from attnkit import masks
        >>> bm = create_block_mask(lambda b, h, q, k: q >= k, None, None, 4, 4, device="cpu")
        >>> masks.from_flex(bm).to_dense(4, 4)[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    """
    needed = (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "BLOCK_SIZE",
        "seq_lengths",
        "mask_mod",
    )
    if not all(hasattr(block_mask, n) for n in needed):
        raise TypeError(
            f"from_flex: expected a torch.nn.attention.flex_attention.BlockMask, got {type(block_mask).__name__}"
        )
    import torch.nn.attention.flex_attention as flex  # (the caller holds a BlockMask: already imported)

    if block_mask.mask_mod is getattr(flex, "_sliced_mask_mod_error", None):
        raise ValueError(
            "from_flex: this BlockMask was sliced (block_mask[...]), which drops its mask_mod: pass "
            "the BlockMask it was sliced from, built for the batch and heads you need"
        )
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    q_len, kv_len = (int(x) for x in block_mask.seq_lengths)
    nq, nk = _ceil_div(q_len, bq), _ceil_div(kv_len, bk)
    lead = tuple(block_mask.kv_num_blocks.shape[:-1])  # (B', H')
    kinds = torch.zeros(*lead, nq, max(nk, 1), dtype=torch.int8, device=block_mask.kv_num_blocks.device)
    for count, index, kind in (
        (block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL),
    ):
        if count is None or index is None or index.shape[-1] == 0:
            continue
        count, index = count[..., :nq, None].long(), index[..., :nq, :].long()
        live = torch.arange(index.shape[-1], device=index.device) < count
        kinds.scatter_reduce_(
            -1, index.clamp(0, kinds.shape[-1] - 1), torch.where(live, kind, EMPTY).to(torch.int8), reduce="amax"
        )
    large = getattr(flex, "_LARGE_SPARSE_BLOCK_SIZE", None)  # flex's "no block mask": any lengths
    fixed_lengths = not (bq == bk == large)
    return _FromFlex(_FlexPredicate(kinds, block_mask.mask_mod, (bq, bk)), (q_len, kv_len), fixed_lengths)


def from_dense(t: Tensor) -> Mask:
    """A mask from a bool tensor broadcastable to ``(B, H, Lq, Lk)`` (True = may attend)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_dense: expected a bool tensor, got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise TypeError(
            f"from_dense: the mask must be a bool tensor (True = may attend), got dtype {t.dtype}; "
            f"convert with t.bool() or pass a float tensor as bias="
        )
    if t.dim() > 4 or t.dim() < 2:
        raise ValueError(f"from_dense: the mask must have 2 to 4 dims (..., Lq, Lk), got shape {tuple(t.shape)}")
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return _FromDense(t)


# ------------------------------------------------------------------ packed variable-length sequences

# leaves a varlen mask can apply per sequence: their predicates take per-element lengths and local indices
_PER_SEQUENCE = (_Causal, _SlidingWindow, _PrefixLM, _BlockLocal, _Strided, _Dilated, _GlobalTokens, _FromFn)


def _per_sequence(mask: Mask) -> bool:
    """Whether ``mask`` can be applied within each packed sequence (see :func:`varlen`)."""
    return all(isinstance(m, _PER_SEQUENCE) for m in _leaves(mask))


def _check_per_sequence(mask: Mask, fn: str = "varlen") -> None:
    for m in _leaves(mask):
        if not isinstance(m, _PER_SEQUENCE):
            part = "" if m is mask else f" (its part {m!r})"
            raise ValueError(
                f"{fn}: mask={mask!r}{part} cannot be applied within each packed sequence (it holds "
                f"data for one fixed length); use causal, sliding_window, prefix_lm, block_local, "
                f"strided, dilated, global_tokens or from_fn (they see each sequence's own rows and "
                f"keys), combined with &, | and ~"
            )


class _Varlen(Mask):
    """Packed sequences on one ``(Tq, Tk)`` score matrix: sequence ``s`` owns query rows
    ``cu_q[s]:cu_q[s+1]`` and keys ``cu_k[s]:cu_k[s+1]``; ``inner`` applies with each sequence's own rows,
    keys and lengths."""

    def __init__(self, cu_q: Tensor, cu_k: Tensor, inner: Mask | None):
        self.cu_q, self.cu_k, self.inner = cu_q, cu_k, inner

    @property
    def num_sequences(self) -> int:
        return self.cu_q.numel() - 1

    def form(self, q_len: int, kv_len: int) -> Varlen:
        return Varlen(self.cu_q, self.cu_k, self.inner)

    def _locate(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per element: the query's sequence, its local row, its sequence's local key index of ``k``, the
        sequence's lengths, and whether ``k`` belongs to the same sequence."""
        cq, ck = self.cu_q.to(q.device), self.cu_k.to(q.device)
        last = max(0, self.num_sequences - 1)
        sq = (torch.searchsorted(cq, q.contiguous(), right=True) - 1).clamp(0, last)
        sk = (torch.searchsorted(ck, k.contiguous(), right=True) - 1).clamp(0, last)
        return sq, sk, cq, ck

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        cq, ck = self.cu_q.to(q.device), self.cu_k.to(q.device)
        sq = (torch.searchsorted(cq, q.contiguous(), right=True) - 1).clamp(0, max(0, self.num_sequences - 1))
        lo, hi, exact = self._row_keys(self.inner, b, h, sq, q, cq, ck)
        if exact:  # intervals: per-row key bounds (global, inside the row's sequence), two comparisons per key
            inside: Tensor = (k >= lo) & (k <= hi)
            return inside
        sq, sk, cq, ck = self._locate(q, k)
        same: Tensor = sq == sk
        if self.inner is None:
            return same
        lq, lk = cq[sq + 1] - cq[sq], ck[sq + 1] - ck[sq]  # the query's sequence lengths, (..., Lq, 1)
        # (the per-sequence masks take per-element length tensors where other masks take ints)
        return same & self.inner.evaluate(b, h, q - cq[sq], k - ck[sq], cast(int, lq), cast(int, lk))

    def _row_keys(
        self, m: Mask | None, b: Tensor, h: Tensor, s: Tensor, r: Tensor, cq: Tensor, ck: Tensor
    ) -> tuple[Tensor, Tensor, bool]:
        """Global key bounds ``(lo, hi, exact)`` of query row ``r`` of sequence ``s`` under the per-sequence
        mask ``m``: arithmetic for intervals and their ``&`` (``exact``: every key in between may attend);
        else the whole sequence (not exact: the element mask decides)."""
        start, stop = ck[s], ck[s + 1] - 1
        if m is None:
            return start, stop, True
        if isinstance(m, _Named):
            return self._row_keys(m.inner, b, h, s, r, cq, ck)
        if isinstance(m, _And) and not isinstance(m, _Or):
            lo_a, hi_a, ex_a = self._row_keys(m.a, b, h, s, r, cq, ck)
            lo_b, hi_b, ex_b = self._row_keys(m.b, b, h, s, r, cq, ck)
            return torch.maximum(lo_a, lo_b), torch.minimum(hi_a, hi_b), ex_a and ex_b
        if isinstance(m, _Interval):
            off = (ck[s + 1] - ck[s]) - (cq[s + 1] - cq[s]) if m.align == "bottom_right" else 0
            lo, hi = m._bounds(b, h, r - cq[s] + off)
            return torch.maximum(lo + start, start), torch.minimum(hi + start, stop), True
        return start + torch.zeros_like(r), stop + torch.zeros_like(r), False

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        r0, r1 = t.rows()
        cq, ck = self.cu_q.to(t.device), self.cu_k.to(t.device)
        s0, _, _, _ = self._locate(r0, r0)
        s1, _, _, _ = self._locate(r1, r1)
        b, h = t.index()
        r0, r1, s0, s1 = (x.view(1, 1, -1) for x in (r0, r1, s0, s1))
        # bounds are nondecreasing in the row within a sequence, and later sequences own later keys
        lo_first, hi_first, exact = self._row_keys(self.inner, b, h, s0, r0, cq, ck)
        lo_last, hi_last, _ = self._row_keys(self.inner, b, h, s1, r1, cq, ck)
        one = s0 == s1  # a query tile inside one sequence; one that spans a boundary visits no full tile
        kmin = torch.where(one, lo_first, torch.minimum(lo_first, ck[s0 + 1]))
        kmax = torch.where(one, hi_last, torch.maximum(hi_last, ck[s1] - 1))
        if exact:
            lo_r1, _, _ = self._row_keys(self.inner, b, h, s0, r1, cq, ck)  # every row sees [lo(r1), hi(r0)]
            fmin, fmax = torch.where(one, lo_r1, _BIG), torch.where(one, hi_first, -_BIG)
        else:
            fmin, fmax = torch.full_like(kmin, _BIG), torch.full_like(kmax, -_BIG)
            # the element mask decides inside the bounds: a head axis it has (a from_fn reading h) must stay in
            # the structure, which tells the kernels whether one mask serves every head
            lead = self._lead(t, r0.view(-1), s0.view(-1), cq, ck)
            kmin, kmax, fmin, fmax = (x + lead for x in (kmin, kmax, fmin, fmax))
        return _band_from_keys(t, kmin, kmax, fmin, fmax)

    def _lead(self, t: _Tiling, rows: Tensor, seqs: Tensor, cq: Tensor, ck: Tensor) -> Tensor:
        """Zeros ``(B', H', 1)`` with the batch and head axes the inner mask's predicate has, found by evaluating
        it on every batch element and head at each query tile's first row and its sequence's first key (an
        element-wise predicate that reads ``b`` or ``h`` returns those axes, as the tile grids of masks are
        derived by evaluation)."""
        b = torch.arange(t.batch, device=t.device).view(-1, 1, 1, 1)
        h = torch.arange(t.heads, device=t.device).view(1, -1, 1, 1)
        q = rows.view(1, 1, -1, 1)
        k = ck[seqs].clamp(max=max(0, t.kv_len - 1)).view(1, 1, -1, 1)
        got = _checked_bool(self, self.evaluate(b, h, q, k, t.q_len, t.kv_len))
        return torch.zeros(got.shape[0], got.shape[1], 1, dtype=torch.long, device=t.device)

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        if batch != 1:
            raise ValueError(
                f"varlen: the packed sequences are one batch element, got a batch of {batch}: view "
                f"packed q (Tq, H, D) as (1, H, Tq, D)"
            )
        ends = (self.cu_q[-1] == q_len) & (self.cu_k[-1] == kv_len)
        if not holds(ends, "varlen: cu_seqlens must end at the packed lengths (Lq, Lk) of the score matrix"):
            tq, tk = int(self.cu_q[-1]), int(self.cu_k[-1])
            raise ValueError(
                f"varlen: cu_seqlens end at Tq={tq} and Tk={tk}, but the score matrix is "
                f"(Lq, Lk)=({q_len}, {kv_len}): the last entries must be the packed lengths"
            )

    def _size(self) -> tuple[int, int] | None:
        return (int(self.cu_q[-1]), int(self.cu_k[-1]))

    def __repr__(self) -> str:
        inner = "" if self.inner is None else f", mask={self.inner!r}"
        return f"varlen({self.num_sequences} sequences{inner})"


def _cu_seqlens(name: str, values: Tensor | Sequence[int]) -> Tensor:
    t = _index_tensor(f"varlen {name}", values, ndim=(1,))
    if t.numel() == 0:
        raise ValueError(
            f"varlen: {name} must have n + 1 entries (0 first), got an empty tensor: pass [0] for no sequences"
        )
    if not holds(t[0] == 0, f"varlen: {name} must start at 0"):
        raise ValueError(
            f"varlen: {name} must start at 0, got {t[:4].tolist()}...: it holds prefix sums of the "
            f"sequence lengths, [0, L0, L0 + L1, ...]"
        )
    steps = t.diff()
    if not holds((steps >= 0).all(), f"varlen: {name} must not decrease"):
        i = int((steps < 0).nonzero()[0, 0])
        raise ValueError(
            f"varlen: {name} must not decrease, got {name}[{i}]={int(t[i])} > {name}[{i + 1}]="
            f"{int(t[i + 1])}: it holds prefix sums of the lengths (cumsum of the lengths, 0 first)"
        )
    return t


def varlen(
    cu_seqlens_q: Tensor | Sequence[int], cu_seqlens_k: Tensor | Sequence[int] | None = None, mask: Mask | None = None
) -> Mask:
    """Packed variable-length sequences: each sequence attends only within itself.

    ``cu_seqlens_q``: prefix sums ``[0, L0, L0 + L1, ..., Tq]`` (n + 1 entries) of the query lengths of
    ``n`` sequences packed along one axis; ``cu_seqlens_k`` the same for the keys (default: the queries').
    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and keys
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of a ``(1, H, Tq, Tk)`` score matrix.  ``mask`` (causal, sliding
    window, prefix LM, block local, strided, dilated, global tokens, ``from_fn``, and their ``&``, ``|``, ``~``)
    applies within each sequence with that sequence's own rows, keys and lengths: bottom-right alignment
    puts local row ``i`` at ``i + Lk_s - Lq_s``, top-left at ``i``; a ``from_fn`` predicate gets local rows
    and keys.  The block structure is arithmetic: a kernel visits only the tiles of each sequence.
    :func:`attnkit.attention_varlen` applies it to packed ``(T, H, D)`` tensors.

    Example::

        >>> from attnkit import masks
        >>> m = masks.varlen([0, 2, 5], [0, 3, 5], mask=masks.causal())
        >>> m.to_dense(5, 5)[0, 0].int().tolist()
        [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    """
    cu_q = _cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else _cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"varlen: cu_seqlens_q has {cu_q.numel()} entries and cu_seqlens_k {cu_k.numel()}: both "
            f"need n + 1 entries for the same n sequences"
        )
    if cu_k.device != cu_q.device:
        raise ValueError(
            f"varlen: cu_seqlens_q is on {cu_q.device} and cu_seqlens_k on {cu_k.device}: put both on one device"
        )
    if mask is not None:
        if not isinstance(mask, Mask):
            raise TypeError(
                f"varlen: mask must be None or an attnkit.masks.Mask applied within each sequence, "
                f"got {type(mask).__name__}"
            )
        _check_per_sequence(mask)
    return _Varlen(cu_q, cu_k, mask)


# ------------------------------------------------------------------ questions about a mask


def nothing_visible(
    mask: Mask, batch: int, heads: int, q_len: int, kv_len: int, device: torch.device | str | None = None
) -> bool:
    """True when ``mask`` lets no query of a ``(batch, heads, q_len, kv_len)`` call see any key, evaluated a
    chunk of rows at a time (stopping at the first chunk that sees something)."""
    b, h, _, k = index_grid(batch, heads, 0, kv_len, device)
    step = max(1, _EVAL_CHUNK // max(1, batch * heads * kv_len))
    for start in range(0, q_len, step):
        q = torch.arange(start, min(q_len, start + step), device=k.device).view(1, 1, -1, 1)
        if bool(_checked_bool(mask, mask.evaluate(b, h, q, k, q_len, kv_len)).any()):
            return False
    return True


def positions_unchecked(mask: Mask, q_len: int, kv_len: int) -> bool:
    """Whether ``mask`` has a part that may read positions differently from the others: a ``from_fn`` (or
    BlockMask) predicate over query rows, or, when ``Lq != Lk``, parts aligned both top-left and
    bottom-right."""
    aligns = set()
    for m in _leaves(mask):
        if isinstance(m, _FromFn) and m.align is None:
            return True
        align = getattr(m, "align", None)
        if align in _ALIGNS:
            aligns.add(align)
    return q_len != kv_len and len(aligns) > 1


def _decodes_differently(mask: Mask) -> tuple[Mask, str] | None:
    """A part of ``mask`` that a causal model would apply differently when decoding with a KV cache than in
    a full forward, and why; or None.  A non-causal ``random_blocks`` draws among ``ceil(Lk / block)`` key
    blocks, which grow as the cache does; a ``top_left`` part puts a step's query at row 0."""
    for m in _leaves(mask):
        if isinstance(m, _RandomBlocks) and not m.causal:
            return m, (
                f"whose draw changes with the key length; use masks.random_blocks({m.block}, {m.n}, "
                f"seed={m.seed}, causal=True)"
            )
        if getattr(m, "align", None) == "top_left":
            return m, (
                "aligned top_left: a decoding step's query sits at row 0, not at its position; use "
                "align='bottom_right' (the default)"
            )
        if isinstance(m, _FromFlex):
            return m, (
                "a FlexAttention BlockMask is built for one (Q_LEN, KV_LEN) and gets query rows; build the "
                "pattern from the position-aware masks or from_fn(fn, align='bottom_right')"
            )
        if isinstance(m, _FromFn) and m.align is None:
            return m, (
                "a from_fn predicate gets query rows, not positions (a decoding step's query is row 0); "
                "give it positions with from_fn(fn, align='bottom_right'), build the pattern from the "
                "position-aware masks (sliding_window, strided, dilated, global_tokens, "
                "random_blocks(causal=True), ...) or pass it per call as mask="
            )
    return None


def reads_absolute_positions(mask: Mask) -> Mask | None:
    """A part of ``mask`` that reads absolute query/key positions (or may: ``from_fn``, ``from_dense``, ...)
    rather than only their distance ``p - j``, or None: shifting every position of a row by the same amount
    (left padding) changes what such a part allows.  A top-left aligned part counts: its queries sit at
    their row numbers, which do not move with the keys."""
    relative = (_Causal, _SlidingWindow, _Strided, _Dilated)
    return next((m for m in _leaves(mask) if not (isinstance(m, relative) and m.align == "bottom_right")), None)
