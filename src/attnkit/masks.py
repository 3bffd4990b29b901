"""What may attend to what.

A :class:`Mask` is a vectorised predicate over ``(batch, head, query row, key
index)`` plus its *block structure*: for a tiling of the ``(Lq, Lk)`` score
matrix into ``(block_q, block_k)`` tiles, which tiles are empty, which are full
(every element may attend) and which are partial.  Built-in masks compute their
block structure arithmetically, so a sliding window over a million tokens never
materialises ``Lq x Lk`` anything.

Positions follow the library's contract: query row ``i`` sits at absolute
position ``p = i + Lk - Lq`` ("bottom-right", the alignment of decoding against
a cache).  Masks that care about positions take ``align="top_left"`` to use
``p = i`` instead::

    Lq=2, Lk=5, causal(align="bottom_right")   causal(align="top_left")
        k: 0 1 2 3 4                               k: 0 1 2 3 4
    q0     █ █ █ █ ·                           q0     █ · · · ·
    q1     █ █ █ █ █                           q1     █ █ · · ·

Masks combine with ``&``, ``|`` and ``~``.  ``True`` means "may attend".  A mask is a value: build a new one
rather than changing its attributes.  The tensors it holds (ids, lengths, indices) may be changed in place
(backends notice it through PyTorch's version counter); lists and numpy arrays are copied when the mask is
built, and writes that bypass PyTorch (through a numpy view of a tensor, or ``.data``) are not seen.

Example::

    >>> from attnkit import masks
    >>> m = masks.causal() & masks.sliding_window(3)
    >>> m.to_dense(4, 4)[0, 0].int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ._checks import flag, integer

Tensor = torch.Tensor

__all__ = [
    "Mask",
    "BlockStructure",
    "causal",
    "sliding_window",
    "key_padding",
    "document",
    "prefix_lm",
    "block_local",
    "strided",
    "fixed",
    "dilated",
    "global_tokens",
    "random_blocks",
    "from_fn",
    "from_flex",
    "from_dense",
    "varlen",
]

_ALIGNS = ("bottom_right", "top_left")
_BIG = 1 << 40  # stands for "unbounded" in key-index arithmetic; far beyond any length
_EVAL_CHUNK = 1 << 22  # elements evaluated at once when a tile grid is derived by evaluation
_DRAW_MAX = 64  # characters per side a BlockStructure draws (wider tilings are pooled, as Mask.show does)
_LIST_MAX = 8  # entries of an index list a mask's repr spells out

EMPTY, PARTIAL, FULL = 0, 1, 2  # tile kinds


# --------------------------------------------------------------------------- helpers


def _check_align(align: str) -> str:
    if align not in _ALIGNS:
        raise ValueError(f"align={align!r} is not one of {_ALIGNS}: use 'bottom_right' (query row i at "
                         f"position i + Lk - Lq, the decoding alignment) or 'top_left' (row i at position i)")
    return align


def _offset(align: str, q_len: int, kv_len: int) -> int:
    return kv_len - q_len if align == "bottom_right" else 0


def _check_int(name: str, value, *, minimum: int = 0, allow_none: bool = False) -> None:
    integer(name, value, minimum=minimum, allow_none=allow_none)


def _check_bool(name: str, value) -> bool:
    return flag(name, value)  # (a string such as "false" would be truthy)


def _index_tensor(name: str, values, *, ndim: Sequence[int]) -> Tensor:
    try:
        t = values if isinstance(values, Tensor) else torch.tensor(values)  # (a numpy array is copied)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be integers (a list or an int tensor), got {values!r}") from None
    if t.numel() == 0 and not t.dtype == torch.bool:
        t = t.to(torch.long)  # ([] and an empty numpy array default to a float dtype: they hold no non-integer)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dimensions, got shape {tuple(t.shape)}")
    return t.to(torch.long)


def _index_grid(batch: int, heads: int, q_len: int, kv_len: int, device=None) -> tuple[Tensor, ...]:
    """Index tensors b (B,1,1,1), h (1,H,1,1), q (1,1,Lq,1), k (1,1,1,Lk) that broadcast to (B, H, Lq, Lk)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    return (torch.arange(batch, device=device).view(-1, 1, 1, 1), torch.arange(heads, device=device).view(1, -1, 1, 1),
            torch.arange(q_len, device=device).view(1, 1, -1, 1), torch.arange(kv_len, device=device).view(1, 1, 1, -1))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _short_list(t: Tensor) -> str:
    """``t.tolist()`` for a repr, the first entries only when it is long."""
    if t.numel() <= _LIST_MAX:
        return str(t.tolist())
    head = ", ".join(str(x) for x in t[:_LIST_MAX].tolist())
    return f"[{head}, ... ({t.numel()} in all)]"


@dataclass(frozen=True)
class _Tiling:
    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    batch: int
    heads: int
    device: torch.device

    @property
    def nq(self) -> int:
        return _ceil_div(self.q_len, self.block_q)

    @property
    def nk(self) -> int:
        return _ceil_div(self.kv_len, self.block_k)

    def rows(self) -> tuple[Tensor, Tensor]:
        """First and last query row of every query tile, each (nq,)."""
        r0 = torch.arange(self.nq, device=self.device) * self.block_q
        return r0, torch.clamp(r0 + self.block_q, max=self.q_len) - 1

    def cols(self) -> tuple[Tensor, Tensor]:
        """First and last key of every key tile, each (nk,)."""
        s0 = torch.arange(self.nk, device=self.device) * self.block_k
        return s0, torch.clamp(s0 + self.block_k, max=self.kv_len) - 1

    def index(self) -> tuple[Tensor, Tensor]:
        """Batch and head index tensors shaped to broadcast as (B, H, 1)."""
        b = torch.arange(self.batch, device=self.device).view(-1, 1, 1)
        h = torch.arange(self.heads, device=self.device).view(1, -1, 1)
        return b, h


@dataclass
class _Band:
    """Per query tile, candidate key tiles [lo, hi) with the full ones [flo, fhi) inside; each (B', H', nq)."""

    lo: Tensor
    hi: Tensor
    flo: Tensor
    fhi: Tensor

    def grid(self, nk: int) -> "_Grid":
        s = torch.arange(nk, device=self.lo.device)
        inside = (s >= self.lo[..., None]) & (s < self.hi[..., None])
        full = (s >= self.flo[..., None]) & (s < self.fhi[..., None])
        kinds = torch.where(full, FULL, torch.where(inside, PARTIAL, EMPTY)).to(torch.int8)
        return _Grid(kinds)


@dataclass
class _Grid:
    """Tile kinds (B', H', nq', nk) int8, each leading dim 1 where the mask does not depend on it."""

    kinds: Tensor


def _band_from_keys(t: _Tiling, kmin: Tensor, kmax: Tensor, fmin: Tensor, fmax: Tensor) -> _Band:
    """Tile ranges from key-index bounds: candidates [kmin, kmax], full [fmin, fmax] (both inclusive)."""
    bk, nk, last = t.block_k, t.nk, t.kv_len - 1
    kmin, kmax = kmin.clamp(min=0), kmax.clamp(max=last)
    empty = kmin > kmax
    lo = torch.where(empty, 0, torch.div(kmin, bk, rounding_mode="floor"))
    hi = torch.where(empty, 0, torch.div(kmax, bk, rounding_mode="floor") + 1)
    fmin, fmax = fmin.clamp(min=0), fmax.clamp(max=last)
    flo = torch.div(fmin + bk - 1, bk, rounding_mode="floor")
    fhi = torch.where(fmax >= last, nk, torch.div(fmax + 1, bk, rounding_mode="floor"))
    flo, fhi = torch.maximum(flo, lo), torch.minimum(fhi, hi)
    fempty = (fhi <= flo) | empty | (fmin > fmax)
    flo, fhi = torch.where(fempty, lo, flo), torch.where(fempty, lo, fhi)
    lo, hi, flo, fhi = torch.broadcast_tensors(lo, hi, flo, fhi)
    return _Band(lo, hi, flo, fhi)


def _as_grid(x: _Band | _Grid, t: _Tiling) -> _Grid:
    return x.grid(t.nk) if isinstance(x, _Band) else x


def _and_tiles(a: _Band | _Grid, b: _Band | _Grid, t: _Tiling) -> _Band | _Grid:
    if isinstance(a, _Band) and isinstance(b, _Band):
        lo, hi = torch.maximum(a.lo, b.lo), torch.minimum(a.hi, b.hi)
        flo, fhi = torch.maximum(a.flo, b.flo), torch.minimum(a.fhi, b.fhi)
        empty, fempty = hi <= lo, fhi <= flo
        lo, hi = torch.where(empty, 0, lo), torch.where(empty, 0, hi)
        flo, fhi = torch.where(fempty | empty, lo, flo), torch.where(fempty | empty, lo, fhi)
        return _Band(lo, hi, flo, fhi)
    return _Grid(torch.minimum(_as_grid(a, t).kinds, _as_grid(b, t).kinds))


def _or_tiles(a: _Band | _Grid, b: _Band | _Grid, t: _Tiling) -> _Band | _Grid:
    if isinstance(a, _Band) and isinstance(b, _Band):
        ea, eb = a.hi <= a.lo, b.hi <= b.lo
        contiguous = ea | eb | (torch.maximum(a.lo, b.lo) <= torch.minimum(a.hi, b.hi))
        if bool(contiguous.all()):
            lo = torch.minimum(torch.where(ea, _BIG, a.lo), torch.where(eb, _BIG, b.lo))
            hi = torch.maximum(torch.where(ea, -_BIG, a.hi), torch.where(eb, -_BIG, b.hi))
            empty = ea & eb
            lo, hi = torch.where(empty, 0, lo), torch.where(empty, 0, hi)
            fa, fb = a.fhi > a.flo, b.fhi > b.flo
            touch = fa & fb & (torch.maximum(a.flo, b.flo) <= torch.minimum(a.fhi, b.fhi))
            a_bigger = (a.fhi - a.flo) >= (b.fhi - b.flo)
            flo = torch.where(touch, torch.minimum(a.flo, b.flo), torch.where(a_bigger, a.flo, b.flo))
            fhi = torch.where(touch, torch.maximum(a.fhi, b.fhi), torch.where(a_bigger, a.fhi, b.fhi))
            none = ~(fa | fb)
            flo, fhi = torch.where(none, lo, flo), torch.where(none, lo, fhi)
            lo, hi, flo, fhi = torch.broadcast_tensors(lo, hi, flo, fhi)
            return _Band(lo, hi, flo, fhi)
    return _Grid(torch.maximum(_as_grid(a, t).kinds, _as_grid(b, t).kinds))


def _pool_kinds(allowed: Tensor, valid: Tensor, bq: int, bk: int) -> Tensor:
    """Tile kinds of an element mask (..., nq*bq, nk*bk), counting only `valid` elements."""
    *lead, rows, cols = allowed.shape
    shape = (*lead, rows // bq, bq, cols // bk, bk)
    any_ = (allowed & valid).reshape(shape).any(dim=-1).any(dim=-2)
    all_ = (allowed | ~valid).reshape(shape).all(dim=-1).all(dim=-2)
    return torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)


def _grid_by_eval(mask: "Mask", t: _Tiling) -> _Grid:
    """Tile kinds by evaluating the predicate one chunk of query tiles at a time (never all of Lq x Lk)."""
    bq, bk, nq, nk = t.block_q, t.block_k, t.nq, t.nk
    kp = nk * bk
    b = torch.arange(t.batch, device=t.device).view(-1, 1, 1, 1)
    h = torch.arange(t.heads, device=t.device).view(1, -1, 1, 1)
    k = torch.arange(kp, device=t.device).view(1, 1, 1, -1)
    kvalid = k < t.kv_len
    k = k.clamp(max=t.kv_len - 1)
    per_tile_row = max(1, t.batch * t.heads * bq * kp)
    step = max(1, _EVAL_CHUNK // per_tile_row)
    parts = []
    for start in range(0, nq, step):
        stop = min(nq, start + step)
        q = torch.arange(start * bq, stop * bq, device=t.device).view(1, 1, -1, 1)
        valid = (q < t.q_len) & kvalid
        allowed = mask._mod(b, h, q.clamp(max=t.q_len - 1), k, t.q_len, t.kv_len)
        allowed = _checked_bool(mask, allowed)
        lead = (allowed.shape[0], allowed.shape[1])
        allowed = allowed.expand(*lead, q.shape[2], kp)
        parts.append(_pool_kinds(allowed, valid, bq, bk))
    return _Grid(torch.cat(parts, dim=2))


def _checked_bool(mask: "Mask", out) -> Tensor:
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"{mask!r}: the mask function must return a bool tensor, got {got}")
    while out.dim() < 4:
        out = out.unsqueeze(0)
    return out


def _checked_shape(mask: "Mask", out: Tensor, *index: Tensor) -> Tensor:
    """``out`` when it broadcasts against the index tensors it was computed from, else a clear error."""
    shape = torch.broadcast_shapes(*(i.shape for i in index))
    try:
        torch.broadcast_shapes(out.shape, shape)
        return out
    except RuntimeError:
        raise ValueError(f"{mask!r}: the mask function returned shape {tuple(out.shape)} for index tensors that "
                         f"broadcast to {tuple(shape)}: build the result from b, h, q_idx, kv_idx with "
                         f"broadcasting ops (e.g. q_idx >= kv_idx), without reshaping them") from None


# ------------------------------------------------------------------ block structure


@dataclass
class BlockStructure:
    """Which tiles of the ``(Lq, Lk)`` score matrix a kernel must visit.

    For every ``(batch, head, query tile)`` (a leading dim is 1 where the mask does not depend on it),
    the key tiles that are *full* (every element may attend: no element mask needed) and *partial*
    (the element mask must be applied), as counts plus index tensors padded to the row maximum (the
    layout of FlexAttention's ``BlockMask``).  Empty tiles appear in neither list.

    Attributes:
        q_len, kv_len, block_q, block_k: the tiling.
        full_count: ``(B', H', nq)`` int32.
        full_index: ``(B', H', nq, max_full)`` int32; entries past ``full_count`` are padding (0).
        partial_count, partial_index: the same for partial tiles.
    """

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    full_count: Tensor
    full_index: Tensor
    partial_count: Tensor
    partial_index: Tensor

    @property
    def num_q_tiles(self) -> int:
        return _ceil_div(self.q_len, self.block_q)

    @property
    def num_k_tiles(self) -> int:
        return _ceil_div(self.kv_len, self.block_k)

    def kinds(self) -> Tensor:
        """Dense tile kinds ``(B', H', nq, nk)`` int8: 0 empty, 1 partial, 2 full (for small tilings)."""
        nk = self.num_k_tiles
        out = torch.zeros(*self.full_count.shape, nk, dtype=torch.int8, device=self.full_count.device)
        for count, index, kind in ((self.partial_count, self.partial_index, PARTIAL),
                                   (self.full_count, self.full_index, FULL)):
            if index.shape[-1] == 0:
                continue
            live = torch.arange(index.shape[-1], device=index.device) < count[..., None].long()
            src = torch.where(live, kind, EMPTY).to(torch.int8)
            out.scatter_reduce_(-1, index.long(), src, reduce="amax")
        return out

    def visited_fraction(self) -> float:
        """Share of all tiles a kernel visits (full plus partial)."""
        n = self.full_count.numel() * self.num_k_tiles
        return float((self.full_count.sum() + self.partial_count.sum()) / max(1, n))

    def __str__(self) -> str:
        """The tiles of batch 0, head 0, one character each; at most ``64`` per side: a wider tiling is drawn
        one character per group of tiles (full when all are, empty when all are, else partial)."""
        nq, nk = self.num_q_tiles, self.num_k_tiles
        g = _ceil_div(max(nq, nk, 1), _DRAW_MAX)  # tiles per character and side
        gq, gk = _ceil_div(nq, g), _ceil_div(nk, g)
        counts = []  # full and visited tiles per character, (gq, gk) each, counted from the index lists
        dev = self.full_count.device
        edges = (torch.arange(gk + 1, dtype=torch.int32, device=dev) * g).expand(nq, gk + 1).contiguous()
        for count, index in ((self.full_count, self.full_index), (self.partial_count, self.partial_index)):
            count, index = count[0, 0], index[0, 0]  # (nq,), (nq, m)
            live = torch.arange(index.shape[-1], dtype=torch.int32, device=dev) < count[:, None]
            index = torch.where(live, index.to(torch.int32), torch.iinfo(torch.int32).max)  # padding sorts last
            if index.shape[-1] > 1 and bool((index[:, 1:] < index[:, :-1]).any()):
                index = index.sort(dim=-1).values
            per_row = torch.searchsorted(index, edges).diff(dim=-1)  # (nq, gk): tiles of each row per character
            per_row = torch.nn.functional.pad(per_row, (0, 0, 0, gq * g - nq))
            counts.append(per_row.view(gq, g, gk).sum(1).view(-1))
        r, c = torch.arange(gq, device=dev).view(-1, 1), torch.arange(gk, device=dev).view(1, -1)
        area = ((torch.clamp((r + 1) * g, max=nq) - r * g) * (torch.clamp((c + 1) * g, max=nk) - c * g)).view(-1)
        kinds = torch.where(counts[0] == area, FULL, torch.where(counts[0] + counts[1] > 0, PARTIAL, EMPTY))
        kinds = kinds.view(gq, gk)
        grouped = f", one character per {g}x{g} tiles" if g > 1 else ""
        lines = [f"BlockStructure({self.q_len}x{self.kv_len}, tiles {self.block_q}x{self.block_k}, "
                 f"{nq}x{nk} tiles, visited {self.visited_fraction():.1%}{grouped}; █ full, ░ partial, · empty)"]
        chars = {EMPTY: "·", PARTIAL: "░", FULL: "█"}
        for row in kinds.tolist():
            lines.append(" " + "".join(chars[c] for c in row))
        return "\n".join(lines)

    __repr__ = __str__


def _structure_from_band(band: _Band, t: _Tiling) -> BlockStructure:
    nfull = band.fhi - band.flo
    npart = (band.hi - band.lo) - nfull
    mf = int(nfull.max()) if nfull.numel() else 0
    mp = int(npart.max()) if npart.numel() else 0
    j = torch.arange(mf, device=band.lo.device)
    full_index = band.flo[..., None] + j
    full_index = torch.where(j < nfull[..., None], full_index, 0)
    j = torch.arange(mp, device=band.lo.device)
    before = (band.flo - band.lo)[..., None]
    partial_index = torch.where(j < before, band.lo[..., None] + j, band.fhi[..., None] + j - before)
    partial_index = torch.where(j < npart[..., None], partial_index, 0)
    return BlockStructure(t.q_len, t.kv_len, t.block_q, t.block_k, nfull.to(torch.int32),
                          full_index.to(torch.int32), npart.to(torch.int32), partial_index.to(torch.int32))


def _structure_from_grid(grid: _Grid, t: _Tiling) -> BlockStructure:
    kinds = grid.kinds
    if kinds.shape[-2] != t.nq:
        kinds = kinds.expand(*kinds.shape[:-2], t.nq, kinds.shape[-1])
    kinds = kinds.expand(*kinds.shape[:-1], t.nk) if kinds.shape[-1] == 1 else kinds
    out = []
    for kind in (FULL, PARTIAL):
        hit = kinds == kind
        count = hit.sum(-1)
        m = int(count.max()) if count.numel() else 0
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)[..., :m]
        live = torch.arange(m, device=kinds.device) < count[..., None]
        out += [count.to(torch.int32), torch.where(live, order, 0).to(torch.int32)]
    return BlockStructure(t.q_len, t.kv_len, t.block_q, t.block_k, *out)


# ---------------------------------------------------------------------------- masks


class Mask:
    """A vectorised predicate ``(b, h, q_idx, kv_idx) -> bool`` and its block structure.

    Subclasses implement ``_mod(b, h, q, k, q_len, kv_len)`` (``q`` are query *rows*; masks that use
    positions apply their alignment) and may implement ``_tiles`` arithmetically; the default derives
    tiles by evaluating the predicate one chunk of query tiles at a time.
    """

    # ---- to implement
    def _mod(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        raise NotImplementedError

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        return _grid_by_eval(self, t)

    def _validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Raise ValueError when the mask cannot apply to these sizes."""

    def _size(self) -> tuple[int, int] | None:
        """The (Lq, Lk) the mask is defined for, when it carries one (used to draw it)."""
        return None

    def _size_guess(self) -> tuple[int, int] | None:
        """A size to draw it at: the size it is defined for, else one that suits it (key lengths)."""
        return self._size()

    def _batch_size(self) -> int:
        """The batch size the mask carries data for (1 when it does not depend on the batch)."""
        return 1

    # ---- public
    def mask_mod(self, q_len: int, kv_len: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """The predicate bound to a shape, as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""
        def mod(b, h, q_idx, kv_idx):
            return self._mod(b, h, q_idx, kv_idx, q_len, kv_len)
        return mod

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Check that the mask applies to a ``(batch, heads, q_len, kv_len)`` score matrix."""
        self._validate(batch, heads, q_len, kv_len)

    def to_dense(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1,
                 device: torch.device | str | None = None) -> Tensor:
        """The mask as a bool tensor ``(B', H', q_len, kv_len)``; ``B'``/``H'`` are 1 where it does not vary."""
        _check_int("q_len", q_len)
        _check_int("kv_len", kv_len)
        self._validate(batch, heads, q_len, kv_len)
        b, h, q, k = _index_grid(batch, heads, q_len, kv_len, device)
        out = _checked_bool(self, self._mod(b, h, q, k, q_len, kv_len))
        return out.expand(out.shape[0], out.shape[1], q_len, kv_len)

    def block_structure(self, q_len: int, kv_len: int, block_q: int = 128, block_k: int | None = None, *,
                        batch: int = 1, heads: int = 1,
                        device: torch.device | str | None = None) -> BlockStructure:
        """The tiles a kernel must visit for a ``(q_len, kv_len)`` score matrix.

        Example::

            >>> from attnkit import masks
            >>> s = masks.causal().block_structure(256, 256, 128)
            >>> s.full_count[0, 0].tolist(), s.partial_count[0, 0].tolist()
            ([0, 1], [1, 1])
        """
        block_k = block_q if block_k is None else block_k
        _check_int("block_q", block_q, minimum=1)
        _check_int("block_k", block_k, minimum=1)
        _check_int("q_len", q_len)
        _check_int("kv_len", kv_len)
        self._validate(batch, heads, q_len, kv_len)
        device = torch.device(device) if device is not None else torch.device("cpu")
        t = _Tiling(q_len, kv_len, block_q, block_k, batch, heads, device)
        if t.nq == 0 or t.nk == 0:
            z = torch.zeros(1, 1, t.nq, dtype=torch.int32, device=device)
            zi = torch.zeros(1, 1, t.nq, 0, dtype=torch.int32, device=device)
            return BlockStructure(q_len, kv_len, block_q, block_k, z, zi, z.clone(), zi.clone())
        tiles = self._tiles(t)
        if isinstance(tiles, _Band):
            return _structure_from_band(tiles, t)
        return _structure_from_grid(tiles, t)

    def density(self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1) -> float:
        """Share of ``(query, key)`` pairs that may attend, counted a chunk of rows at a time."""
        for name, value in (("q_len", q_len), ("kv_len", kv_len), ("batch", batch), ("heads", heads)):
            _check_int(name, value)
        self._validate(batch, heads, q_len, kv_len)
        return self._density(q_len, kv_len, torch.arange(batch), torch.arange(heads))

    def _density(self, q_len: int, kv_len: int, bs: Tensor, hs: Tensor) -> float:
        """Share of allowed pairs over the batch elements ``bs`` and heads ``hs`` (int64 index tensors)."""
        if q_len == 0 or kv_len == 0:
            return 0.0
        nb, nh = bs.numel(), hs.numel()
        b, h = bs.view(-1, 1, 1, 1), hs.view(1, -1, 1, 1)
        k = torch.arange(kv_len).view(1, 1, 1, -1)
        step = max(1, _EVAL_CHUNK // max(1, nb * nh * kv_len))
        total = 0
        for start in range(0, q_len, step):
            q = torch.arange(start, min(q_len, start + step)).view(1, 1, -1, 1)
            m = _checked_bool(self, self._mod(b, h, q, k, q_len, kv_len))
            m = m.expand(nb, nh, q.shape[2], kv_len)
            total += int(m.sum())
        return total / (nb * nh * q_len * kv_len)

    def show(self, q_len: int | None = None, kv_len: int | None = None, *, batch: int = 0, head: int = 0,
             max_width: int = 64) -> str:
        """Draw the mask: one character per element (█ may attend, · may not), or per tile when wide.

        ``q_len``/``kv_len`` default to the size the mask carries (else 16); ``batch`` and ``head`` pick what is
        drawn; at most ``max_width`` characters per side."""
        size = self._size_guess()
        if q_len is None:
            q_len = size[0] if size else 16
        if kv_len is None:
            kv_len = size[1] if size else q_len
        _check_int("q_len", q_len)
        _check_int("kv_len", kv_len)
        _check_int("batch", batch)
        _check_int("head", head)
        _check_int("max_width", max_width, minimum=1)
        nb, nh = max(batch + 1, self._batch_size()), head + 1
        self._validate(nb, nh, q_len, kv_len)
        density = self._density(q_len, kv_len, torch.tensor([batch]), torch.tensor([head]))  # of what is drawn
        header = f"{self!r}  {q_len}x{kv_len}, density {density:.1%}"
        if max(q_len, kv_len) <= max_width:
            dense = self.to_dense(q_len, kv_len, batch=nb, heads=nh)
            dense = dense[min(batch, dense.shape[0] - 1), min(head, dense.shape[1] - 1)]
            rows = ["".join("█" if x else "·" for x in row) for row in dense.tolist()]
            return "\n".join([header, *(" " + r for r in rows)])
        block = _ceil_div(max(q_len, kv_len), max_width)
        s = self.block_structure(q_len, kv_len, block, batch=nb, heads=nh)
        kinds = s.kinds()
        kinds = kinds[min(batch, kinds.shape[0] - 1), min(head, kinds.shape[1] - 1)]
        chars = {EMPTY: "·", PARTIAL: "░", FULL: "█"}
        rows = ["".join(chars[c] for c in row) for row in kinds.tolist()]
        legend = f"  (one character per {block}x{block} tile: █ full, ░ partial, · empty)"
        return "\n".join([header + legend, *(" " + r for r in rows)])

    def __str__(self) -> str:
        return self.show()

    def __and__(self, other: "Mask") -> "Mask":
        return _And(self, _as_mask(other, "&"))

    def __or__(self, other: "Mask") -> "Mask":
        return _Or(self, _as_mask(other, "|"))

    def __invert__(self) -> "Mask":
        return _Not(self)


def _leaves(mask: Mask):
    """The masks a combination (``&``, ``|``, ``~``, a named pattern) is built from, recursively."""
    stack = [mask]
    while stack:
        m = stack.pop()
        if isinstance(m, _And):  # (and _Or)
            stack += [m.a, m.b]
        elif isinstance(m, _Not):
            stack.append(m.a)
        elif isinstance(m, _Named):
            stack.append(m.inner)
        else:
            yield m


def _decodes_differently(mask: Mask) -> tuple[Mask, str] | None:
    """A part of ``mask`` that a causal model would apply differently when decoding with a KV cache than in
    a full forward, and why; or None.  A non-causal ``random_blocks`` draws among ``ceil(Lk / block)`` key
    blocks, which grow as the cache does; a ``top_left`` part puts a step's query at row 0."""
    for m in _leaves(mask):
        if isinstance(m, _RandomBlocks) and not m.causal:
            return m, (f"whose draw changes with the key length; use masks.random_blocks({m.block}, {m.n}, "
                       f"seed={m.seed}, causal=True)")
        if getattr(m, "align", None) == "top_left":
            return m, ("aligned top_left: a decoding step's query sits at row 0, not at its position; use "
                       "align='bottom_right' (the default)")
        if isinstance(m, _FromFlex):
            return m, ("a FlexAttention BlockMask is built for one (Q_LEN, KV_LEN) and gets query rows; build the "
                       "pattern from the position-aware masks or from_fn(fn, align='bottom_right')")
        if isinstance(m, _FromFn) and m.align is None:
            return m, ("a from_fn predicate gets query rows, not positions (a decoding step's query is row 0); "
                       "give it positions with from_fn(fn, align='bottom_right'), build the pattern from the "
                       "position-aware masks (sliding_window, strided, dilated, global_tokens, "
                       "random_blocks(causal=True), ...) or pass it per call as mask=")
    return None


def _reads_absolute_positions(mask: Mask) -> Mask | None:
    """A part of ``mask`` that reads absolute query/key positions (or may: ``from_fn``, ``from_dense``, ...)
    rather than only their distance ``p - j``, or None: shifting every position of a row by the same amount
    (left padding) changes what such a part allows.  A top-left aligned part counts: its queries sit at
    their row numbers, which do not move with the keys."""
    relative = (_Causal, _SlidingWindow, _Strided, _Dilated)
    return next((m for m in _leaves(mask) if not (isinstance(m, relative) and m.align == "bottom_right")), None)


def _as_mask(x, op: str) -> Mask:
    if not isinstance(x, Mask):
        raise TypeError(f"cannot combine a Mask with {type(x).__name__} using {op!r}: "
                        f"wrap a bool tensor with attnkit.masks.from_dense(t)")
    return x


class _And(Mask):
    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def _mod(self, b, h, q, k, q_len, kv_len):
        return self.a._mod(b, h, q, k, q_len, kv_len) & self.b._mod(b, h, q, k, q_len, kv_len)

    def _tiles(self, t):
        return _and_tiles(self.a._tiles(t), self.b._tiles(t), t)

    def _validate(self, *args):
        self.a._validate(*args)
        self.b._validate(*args)

    def _size(self):
        return self.a._size() or self.b._size()

    def _size_guess(self):
        return self._size() or self.a._size_guess() or self.b._size_guess()

    def _batch_size(self):
        return max(self.a._batch_size(), self.b._batch_size())

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"


class _Or(_And):
    def _mod(self, b, h, q, k, q_len, kv_len):
        return self.a._mod(b, h, q, k, q_len, kv_len) | self.b._mod(b, h, q, k, q_len, kv_len)

    def _tiles(self, t):
        return _or_tiles(self.a._tiles(t), self.b._tiles(t), t)

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"


class _Not(Mask):
    def __init__(self, a: Mask):
        self.a = a

    def _mod(self, b, h, q, k, q_len, kv_len):
        return ~self.a._mod(b, h, q, k, q_len, kv_len)

    def _tiles(self, t):
        return _Grid((FULL - _as_grid(self.a._tiles(t), t).kinds).to(torch.int8))

    def _validate(self, *args):
        self.a._validate(*args)

    def _size(self):
        return self.a._size()

    def _size_guess(self):
        return self.a._size_guess()

    def _batch_size(self):
        return self.a._batch_size()

    def __repr__(self):
        return f"~{self.a!r}"


class _Named(Mask):
    """A mask defined as a combination of others, shown under its own name."""

    def __init__(self, name: str, inner: Mask):
        self.name, self.inner = name, inner

    def _mod(self, *args):
        return self.inner._mod(*args)

    def _tiles(self, t):
        return self.inner._tiles(t)

    def _validate(self, *args):
        self.inner._validate(*args)

    def _size(self):
        return self.inner._size()

    def _size_guess(self):
        return self.inner._size_guess()

    def _batch_size(self):
        return self.inner._batch_size()

    def __repr__(self):
        return self.name


class _Interval(Mask):
    """Key j visible from query position p iff lo(p) <= j <= hi(p), with lo and hi nondecreasing in p.

    Such masks have an arithmetic block structure: a query tile spanning positions [P0, P1] sees the
    keys [lo(P0), hi(P1)], and every one of its rows sees the keys [lo(P1), hi(P0)].
    """

    align = "bottom_right"

    def _bounds(self, b: Tensor, h: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _mod(self, b, h, q, k, q_len, kv_len):
        lo, hi = self._bounds(b, h, q + _offset(self.align, q_len, kv_len))
        return (k >= lo) & (k <= hi)

    def _tiles(self, t):
        r0, r1 = t.rows()
        off = _offset(self.align, t.q_len, t.kv_len)
        b, h = t.index()
        lo0, hi0 = self._bounds(b, h, (r0 + off).view(1, 1, -1))
        lo1, hi1 = self._bounds(b, h, (r1 + off).view(1, 1, -1))
        return _band_from_keys(t, lo0, hi1, lo1, hi0)


def _const(p: Tensor, value: int) -> Tensor:
    return torch.full_like(p, value)


class _Causal(_Interval):
    def __init__(self, align: str):
        self.align = _check_align(align)

    def _bounds(self, b, h, p):
        return _const(p, -_BIG), p

    def __repr__(self):
        return f"causal(align={self.align!r})"


class _SlidingWindow(_Interval):
    def __init__(self, left, right, align):
        _check_int("left", left, allow_none=True)
        _check_int("right", right, allow_none=True)
        self.left, self.right, self.align = left, right, _check_align(align)

    def _bounds(self, b, h, p):
        lo = _const(p, -_BIG) if self.left is None else p - self.left
        hi = _const(p, _BIG) if self.right is None else p + self.right
        return lo, hi

    def __repr__(self):
        return f"sliding_window(left={self.left}, right={self.right}, align={self.align!r})"


class _PrefixLM(_Interval):
    def __init__(self, n: int, align: str):
        _check_int("n", n)
        self.n, self.align = n, _check_align(align)

    def _bounds(self, b, h, p):
        return _const(p, -_BIG), torch.clamp(p, min=self.n - 1)

    def __repr__(self):
        return f"prefix_lm({self.n}, align={self.align!r})"


class _BlockLocal(_Interval):
    def __init__(self, block: int, align: str):
        _check_int("block", block, minimum=1)
        self.block, self.align = block, _check_align(align)

    def _bounds(self, b, h, p):
        lo = torch.div(p, self.block, rounding_mode="floor") * self.block
        return lo, lo + self.block - 1

    def __repr__(self):
        return f"block_local({self.block}, align={self.align!r})"


class _KeyLengths(_Interval):
    def __init__(self, lengths: Tensor):
        self.lengths = lengths

    def _bounds(self, b, h, p):
        lengths = self.lengths.to(p.device)
        return _const(p, 0), lengths[b.clamp(max=len(lengths) - 1)] - 1 + torch.zeros_like(p)

    def _mod(self, b, h, q, k, q_len, kv_len):
        lengths = self.lengths.to(k.device)
        return k < lengths[b.clamp(max=len(lengths) - 1)]

    def _validate(self, batch, heads, q_len, kv_len):
        n = len(self.lengths)
        if n not in (1, batch):
            raise ValueError(f"key_padding: got {n} lengths for a batch of {batch}: give one length per sequence")
        if torch.compiler.is_compiling():  # (a check on the values would break the graph; eager calls make it)
            return
        too_long = self.lengths > kv_len
        if bool(too_long.any()):
            i = int(too_long.nonzero()[0, 0])
            raise ValueError(f"key_padding: lengths[{i}]={int(self.lengths[i])} exceeds the key length "
                             f"Lk={kv_len}; each length must be <= Lk")

    def _size_guess(self):  # (the lengths fix no key length: any Lk >= the longest fits)
        n = int(self.lengths.max()) if len(self.lengths) else 0
        return (n, n)

    def _batch_size(self):
        return len(self.lengths)

    def __repr__(self):
        return f"key_padding(lengths={_short_list(self.lengths)})"


class _KeyColumns(Mask):
    """A mask that depends on the key only: key j visible iff keep[b, j] (keep is (B', Lk) or a rule)."""

    def __init__(self, name: str, keep: Tensor | None = None, rule: Callable[[Tensor], Tensor] | None = None):
        self.name, self.keep, self.rule = name, keep, rule

    def _keep(self, kv_len: int, device) -> Tensor:
        if self.keep is not None:
            return self.keep.to(device)
        return self.rule(torch.arange(kv_len, device=device)).view(1, -1)

    def _mod(self, b, h, q, k, q_len, kv_len):
        keep = self._keep(kv_len, k.device)  # (B', Lk)
        return keep[b.clamp(max=keep.shape[0] - 1), k] & torch.ones_like(q, dtype=torch.bool)

    def _tiles(self, t):
        keep = self._keep(t.kv_len, t.device)
        pad = t.nk * t.block_k - t.kv_len
        valid = torch.arange(t.nk * t.block_k, device=t.device) < t.kv_len
        keep = torch.nn.functional.pad(keep, (0, pad))
        kinds = _pool_kinds(keep[:, None, :], valid.view(1, 1, -1), 1, t.block_k)  # (B', 1, nk)
        return _Grid(kinds[:, None, :, :])  # (B', 1, 1, nk)

    def _validate(self, batch, heads, q_len, kv_len):
        if self.keep is not None:
            n, lk = self.keep.shape
            if n not in (1, batch) or lk != kv_len:
                raise ValueError(f"key_padding: the key mask has shape {(n, lk)}, expected ({batch}, {kv_len}) "
                                 f"(one row per sequence, one column per key)")

    def _size(self):
        return None if self.keep is None else (self.keep.shape[1], self.keep.shape[1])

    def _batch_size(self):
        return 1 if self.keep is None else self.keep.shape[0]

    def __repr__(self):
        return self.name


class _Document(Mask):
    def __init__(self, q_ids: Tensor, kv_ids: Tensor | None):
        self.q_ids = q_ids if q_ids.dim() == 2 else q_ids.view(1, -1)
        self.kv_ids = None if kv_ids is None else (kv_ids if kv_ids.dim() == 2 else kv_ids.view(1, -1))

    def _ids(self, q_len, kv_len, device):
        if self.kv_ids is None:  # one id sequence for the keys; queries sit at their bottom-right positions
            kv = self.q_ids.to(device)
            off = kv_len - q_len
            return kv[:, off:off + q_len], kv
        return self.q_ids.to(device), self.kv_ids.to(device)

    def _mod(self, b, h, q, k, q_len, kv_len):
        qi, ki = self._ids(q_len, kv_len, q.device)
        bq = b.clamp(max=qi.shape[0] - 1)
        bk = b.clamp(max=ki.shape[0] - 1)
        return qi[bq, q] == ki[bk, k]

    def _tiles(self, t):
        qi, ki = self._ids(t.q_len, t.kv_len, t.device)

        def tile_range(ids, block, n):
            pad = n * block - ids.shape[1]
            lo = torch.nn.functional.pad(ids, (0, pad), value=int(ids.max()) + 1 if ids.numel() else 0)
            hi = torch.nn.functional.pad(ids, (0, pad), value=int(ids.min()) - 1 if ids.numel() else 0)
            return lo.view(ids.shape[0], n, block).amin(-1), hi.view(ids.shape[0], n, block).amax(-1)

        qmin, qmax = tile_range(qi, t.block_q, t.nq)  # (B', nq)
        kmin, kmax = tile_range(ki, t.block_k, t.nk)  # (B', nk)
        qmin, qmax = qmin[:, None, :, None], qmax[:, None, :, None]
        kmin, kmax = kmin[:, None, None, :], kmax[:, None, None, :]
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        overlap = (qmax >= kmin) & (kmax >= qmin)
        return _Grid(torch.where(full, FULL, torch.where(overlap, PARTIAL, EMPTY)).to(torch.int8))

    def _validate(self, batch, heads, q_len, kv_len):
        for name, ids, n in (("ids", self.q_ids, None), ("kv_ids", self.kv_ids, kv_len)):
            if ids is None:
                continue
            if ids.shape[0] not in (1, batch):
                raise ValueError(f"document: {name} has {ids.shape[0]} rows for a batch of {batch}: "
                                 f"give one row per sequence or a single 1-D tensor")
        if self.kv_ids is None:
            if self.q_ids.shape[1] != kv_len:
                raise ValueError(f"document: ids has length {self.q_ids.shape[1]} but the keys have Lk={kv_len}: "
                                 f"give one id per key, or pass kv_ids")
            if q_len > kv_len:
                raise ValueError(f"document: Lq={q_len} queries but only Lk={kv_len} keys: with one ids tensor the "
                                 f"queries are the last Lq keys (Lq <= Lk); pass kv_ids for separate query ids")
        elif self.q_ids.shape[1] != q_len or self.kv_ids.shape[1] != kv_len:
            raise ValueError(f"document: ids/kv_ids have lengths {self.q_ids.shape[1]}/{self.kv_ids.shape[1]}, "
                             f"expected Lq={q_len} and Lk={kv_len}")

    def _batch_size(self):
        return max(self.q_ids.shape[0], 1 if self.kv_ids is None else self.kv_ids.shape[0])

    def _size(self):
        n = self.q_ids.shape[1]
        return (n, n) if self.kv_ids is None else (n, self.kv_ids.shape[1])

    def __repr__(self):
        return f"document({self.q_ids.shape[1]} ids)" if self.kv_ids is None else "document(ids, kv_ids)"


class _Strided(Mask):
    def __init__(self, stride: int, causal: bool, align: str):
        _check_int("stride", stride, minimum=1)
        self.stride, self.causal, self.align = stride, _check_bool("causal", causal), _check_align(align)

    def _mod(self, b, h, q, k, q_len, kv_len):
        d = q + _offset(self.align, q_len, kv_len) - k
        ok = (d.abs() < self.stride) | (torch.remainder(d, self.stride) == 0)
        return ok & (d >= 0) if self.causal else ok

    def _tiles(self, t):
        s = self.stride
        local = _SlidingWindow(s - 1, 0 if self.causal else s - 1, self.align)._tiles(t)
        r0, r1 = t.rows()
        c0, c1 = t.cols()
        off = _offset(self.align, t.q_len, t.kv_len)
        dlo = (r0 + off).view(-1, 1) - c1.view(1, -1)  # smallest p - j in the tile, (nq, nk)
        dhi = (r1 + off).view(-1, 1) - c0.view(1, -1)
        if self.causal:
            dlo = dlo.clamp(min=0)
        hit = (dhi >= dlo) & (torch.div(dhi, s, rounding_mode="floor") * s >= dlo)
        dmin = (r0 + off).view(-1, 1) - c1.view(1, -1)
        full = hit & ((s == 1) | (dmin == dhi)) & (dmin >= (0 if self.causal else -_BIG))
        grid = _Grid(torch.where(full, FULL, torch.where(hit, PARTIAL, EMPTY)).to(torch.int8)[None, None])
        return _or_tiles(local, grid, t)

    def __repr__(self):
        return f"strided({self.stride}, causal={self.causal}, align={self.align!r})"


class _Dilated(Mask):
    def __init__(self, window: int, dilation: int, causal: bool, align: str):
        _check_int("window", window)
        _check_int("dilation", dilation, minimum=1)
        self.window, self.dilation = window, dilation
        self.causal, self.align = _check_bool("causal", causal), _check_align(align)

    def _mod(self, b, h, q, k, q_len, kv_len):
        d = q + _offset(self.align, q_len, kv_len) - k
        span = self.window * self.dilation
        ok = (torch.remainder(d, self.dilation) == 0) & (d <= span) & (d >= (0 if self.causal else -span))
        return ok

    def _tiles(self, t):
        s, span = self.dilation, self.window * self.dilation
        r0, r1 = t.rows()
        c0, c1 = t.cols()
        off = _offset(self.align, t.q_len, t.kv_len)
        dmin = (r0 + off).view(-1, 1) - c1.view(1, -1)
        dmax = (r1 + off).view(-1, 1) - c0.view(1, -1)
        low = 0 if self.causal else -span
        dlo, dhi = dmin.clamp(min=low), dmax.clamp(max=span)
        hit = (dhi >= dlo) & (torch.div(dhi, s, rounding_mode="floor") * s >= dlo)
        full = hit & ((s == 1) | (dmin == dmax)) & (dmin >= low) & (dmax <= span)
        return _Grid(torch.where(full, FULL, torch.where(hit, PARTIAL, EMPTY)).to(torch.int8)[None, None])

    def __repr__(self):
        return f"dilated(window={self.window}, dilation={self.dilation}, causal={self.causal}, align={self.align!r})"


class _GlobalTokens(Mask):
    def __init__(self, indices: Tensor, align: str):
        self.indices, self.align = indices, _check_align(align)

    def _member(self, positions: Tensor) -> Tensor:
        return torch.isin(positions, self.indices.to(positions.device))

    def _mod(self, b, h, q, k, q_len, kv_len):
        return self._member(q + _offset(self.align, q_len, kv_len)) | self._member(k)

    def _tiles(self, t):
        off = _offset(self.align, t.q_len, t.kv_len)
        rows = torch.arange(t.nq * t.block_q, device=t.device)
        keys = torch.arange(t.nk * t.block_k, device=t.device)
        qm = self._member(rows + off).view(1, -1)
        km = self._member(keys).view(1, -1)
        qk = _pool_kinds(qm, (rows < t.q_len).view(1, -1), 1, t.block_q)  # (1, nq)
        kk = _pool_kinds(km, (keys < t.kv_len).view(1, -1), 1, t.block_k)  # (1, nk)
        kinds = torch.maximum(qk.view(-1, 1), kk.view(1, -1))
        return _Grid(kinds[None, None])

    def __repr__(self):
        return f"global_tokens({_short_list(self.indices)}, align={self.align!r})"


_RANDOM_TABLES = 16  # block tables a random_blocks mask keeps (one per query-block range and key-block count)
_M31 = (1 << 31) - 1


def _mix31(x):
    """A 31-bit integer hash of int64 tensors or Python ints (every intermediate below 2^62: no overflow)."""
    x = x & _M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def _seed31(seed: int) -> int:
    """Every bit of a seed of any size folded into 31 bits (seeds 0 and 2^31 draw differently)."""
    x = 0x2545F491
    while True:
        x = _mix31(x ^ (seed & _M31))
        seed >>= 31
        if not seed:
            return x


class _RandomBlocks(Mask):
    def __init__(self, block: int, n: int, seed: int, causal: bool, align: str):
        _check_int("block", block, minimum=1)
        _check_int("n", n)
        _check_int("seed", seed)
        self.block, self.n, self.seed = block, n, seed
        self.causal, self.align = _check_bool("causal", causal), _check_align(align)
        self._cache: dict[tuple[int, int, int], Tensor] = {}

    def _rows(self, q_len: int, kv_len: int) -> tuple[int, int]:
        """The first query block (by position) of a ``(q_len, kv_len)`` call and how many there are."""
        off = _offset(self.align, q_len, kv_len)
        if q_len == 0:
            return 0, 0
        first, last = off // self.block, (off + q_len - 1) // self.block
        return first, last - first + 1

    def _draw(self, first: int, rows: int, nkb: int) -> Tensor:
        """Chosen key blocks of query blocks ``first .. first + rows - 1`` among ``nkb``: the ``n`` with the
        smallest hash of (seed, query block, key block) among the candidates (all ``nkb``, or with
        ``causal`` those up to the query's own block)."""
        table = torch.zeros(rows, nkb, dtype=torch.bool)
        n = min(self.n, nkb)
        if rows == 0 or n == 0:
            return table
        c = torch.arange(nkb, dtype=torch.int64).view(1, -1)
        base = torch.tensor(_seed31(self.seed), dtype=torch.int64)
        step = max(1, (1 << 22) // nkb)  # rows drawn at a time: bounded memory at any length
        for a in range(0, rows, step):
            r = torch.arange(first + a, first + min(rows, a + step), dtype=torch.int64).view(-1, 1)
            key = (_mix31(_mix31(base ^ (r & _M31)) ^ c) << 31) | c  # ties broken by the key block
            if self.causal:
                key = torch.where(c <= r, key, torch.full_like(key, torch.iinfo(torch.int64).max))
            top = key.topk(n, dim=1, largest=False)
            part = table[a:a + r.shape[0]]
            part.scatter_(1, top.indices, top.values != torch.iinfo(torch.int64).max)
        return table

    def table(self, q_len: int, kv_len: int) -> Tensor:
        """The bool table ``(query blocks, ceil(Lk/block))`` of chosen key blocks, one row per query block a
        ``(q_len, kv_len)`` call's positions touch (the block holding the first query's position first)."""
        first, rows = self._rows(q_len, kv_len)
        key = (first, rows, _ceil_div(kv_len, self.block))
        table = self._cache.pop(key, None)  # re-inserted: the memo keeps the most recent shapes
        if table is None:
            table = self._draw(*key)
            while len(self._cache) >= _RANDOM_TABLES:  # (decoding meets a new key length every step)
                self._cache.pop(next(iter(self._cache)), None)
        self._cache[key] = table
        return table

    def _mod(self, b, h, q, k, q_len, kv_len):
        table = self.table(q_len, kv_len).to(q.device)
        first = self._rows(q_len, kv_len)[0]
        p = q + _offset(self.align, q_len, kv_len)
        out = table[torch.div(p, self.block, rounding_mode="floor") - first,
                    torch.div(k, self.block, rounding_mode="floor")]
        return out & (k <= p) if self.causal else out

    def _tiles(self, t):
        table = self.table(t.q_len, t.kv_len).to(t.device).to(torch.int64)
        first = self._rows(t.q_len, t.kv_len)[0]
        off = _offset(self.align, t.q_len, t.kv_len)
        ii = torch.nn.functional.pad(table.cumsum(0).cumsum(1), (1, 0, 1, 0))  # integral image
        r0, r1 = t.rows()
        c0, c1 = t.cols()
        a0 = (torch.div(r0 + off, self.block, rounding_mode="floor") - first).view(-1, 1)
        a1 = (torch.div(r1 + off, self.block, rounding_mode="floor") - first + 1).view(-1, 1)
        b0, b1 = (c0 // self.block).view(1, -1), (c1 // self.block + 1).view(1, -1)
        count = ii[a1, b1] - ii[a0, b1] - ii[a1, b0] + ii[a0, b0]
        area = (a1 - a0) * (b1 - b0)
        kinds = torch.where(count == area, FULL, torch.where(count > 0, PARTIAL, EMPTY)).to(torch.int8)
        grid = _Grid(kinds[None, None])
        return _and_tiles(grid, _Causal(self.align)._tiles(t), t) if self.causal else grid

    def __repr__(self):
        return (f"random_blocks(block={self.block}, n={self.n}, seed={self.seed}, causal={self.causal}, "
                f"align={self.align!r})")


class _FromFn(Mask):
    """``fn(b, h, q_idx, kv_idx)``; ``q_idx`` is the query row (``align=None``, FlexAttention's convention) or
    the query's position under ``align``."""

    def __init__(self, fn: Callable, name: str | None, align: str | None = None):
        if not callable(fn):
            raise TypeError(f"from_fn: fn must be callable as fn(b, h, q_idx, kv_idx) -> bool tensor, got {fn!r}")
        self.fn, self.name = fn, name or getattr(fn, "__name__", "fn")
        self.align = None if align is None else _check_align(align)

    def _mod(self, b, h, q, k, q_len, kv_len):
        p = q if self.align is None else q + _offset(self.align, q_len, kv_len)
        return _checked_shape(self, _checked_bool(self, self.fn(b, h, p, k)), b, h, p, k)

    def __repr__(self):
        return f"from_fn({self.name})" if self.align is None else f"from_fn({self.name}, align={self.align!r})"


class _FlexPredicate:
    """A FlexAttention ``BlockMask`` as one predicate: an element may attend when its block is full, or when
    its block is partial and the BlockMask's ``mask_mod`` allows it (empty blocks are never visited)."""

    def __init__(self, kinds: Tensor, mask_mod: Callable, block_size: tuple[int, int]):
        self.kinds, self.mask_mod, self.block_size = kinds, mask_mod, block_size  # kinds (B', H', nq, nk) int8

    def __call__(self, b, h, q_idx, kv_idx):
        kinds = self.kinds.to(q_idx.device)
        bi = b.clamp(max=kinds.shape[0] - 1) if kinds.shape[0] > 1 else torch.zeros_like(b)
        hi = h.clamp(max=kinds.shape[1] - 1) if kinds.shape[1] > 1 else torch.zeros_like(h)
        kind = kinds[bi, hi, torch.div(q_idx, self.block_size[0], rounding_mode="floor"),
                     torch.div(kv_idx, self.block_size[1], rounding_mode="floor")]
        allowed = self.mask_mod(b, h, q_idx, kv_idx)
        if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
            got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
            raise TypeError(f"from_flex: the BlockMask's mask_mod must return a bool tensor, got {got}")
        return (kind == FULL) | ((kind == PARTIAL) & allowed)


class _FromFlex(_FromFn):
    """A FlexAttention ``BlockMask``: its ``mask_mod`` over query rows, restricted to its blocks, for the
    sequence lengths it was built for."""

    def __init__(self, predicate: _FlexPredicate, seq_lengths: tuple[int, int], fixed_lengths: bool):
        super().__init__(predicate, "block_mask")
        self.seq_lengths, self.fixed_lengths = seq_lengths, fixed_lengths

    def _validate(self, batch, heads, q_len, kv_len):
        kinds = self.fn.kinds
        if self.fixed_lengths and (q_len, kv_len) != self.seq_lengths:
            raise ValueError(f"from_flex: the BlockMask was built for (Q_LEN, KV_LEN)={self.seq_lengths} but the call "
                             f"has Lq={q_len}, Lk={kv_len}: build it for these lengths (create_block_mask(..., "
                             f"Q_LEN={q_len}, KV_LEN={kv_len})), as flex_attention requires")
        if kinds.shape[0] not in (1, batch) or kinds.shape[1] not in (1, heads):
            raise ValueError(f"from_flex: the BlockMask has batch and heads {tuple(kinds.shape[:2])}, which do not "
                             f"broadcast to B={batch}, Hq={heads}: build it with B=None/H=None (broadcast) or the "
                             f"call's sizes")

    def _size(self):
        return self.seq_lengths

    def _batch_size(self):
        return self.fn.kinds.shape[0]

    def __repr__(self):
        name = getattr(self.fn.mask_mod, "__name__", "mask_mod")
        return f"from_flex({name}, seq_lengths={self.seq_lengths}, BLOCK_SIZE={self.fn.block_size})"


class _FromDense(Mask):
    def __init__(self, t: Tensor):
        self.t = t

    def _mod(self, b, h, q, k, q_len, kv_len):
        t = self.t.to(q.device)
        bi = b.clamp(max=t.shape[0] - 1) if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h.clamp(max=t.shape[1] - 1) if t.shape[1] > 1 else torch.zeros_like(h)
        qi = q if t.shape[2] > 1 else torch.zeros_like(q)
        ki = k if t.shape[3] > 1 else torch.zeros_like(k)
        return t[bi, hi, qi, ki]

    def _tiles(self, t):
        m = self.t.to(t.device).expand(self.t.shape[0], self.t.shape[1], t.q_len, t.kv_len)
        qp, kp = t.nq * t.block_q - t.q_len, t.nk * t.block_k - t.kv_len
        m = torch.nn.functional.pad(m, (0, kp, 0, qp))
        rows = torch.arange(m.shape[2], device=t.device).view(-1, 1) < t.q_len
        cols = torch.arange(m.shape[3], device=t.device).view(1, -1) < t.kv_len
        return _Grid(_pool_kinds(m, rows & cols, t.block_q, t.block_k))

    def _validate(self, batch, heads, q_len, kv_len):
        b, h, lq, lk = self.t.shape
        ok = b in (1, batch) and h in (1, heads) and lq in (1, q_len) and lk in (1, kv_len)
        if not ok:
            hint = ""
            if (b, h) == (1, 1) and lq == batch != q_len and lk == kv_len:
                hint = (": it looks like a (B, Lk) padding mask, which needs the head and query axes: pass "
                        "mask[:, None, None, :], or masks.key_padding(mask)")
            raise ValueError(f"from_dense: the mask has shape {tuple(self.t.shape)}, which does not broadcast to "
                             f"(B, H, Lq, Lk)=({batch}, {heads}, {q_len}, {kv_len}){hint}")

    def _size(self):
        return (self.t.shape[2], self.t.shape[3])

    def _batch_size(self):
        return self.t.shape[0]

    def __repr__(self):
        return f"from_dense({tuple(self.t.shape)})"


# ------------------------------------------------------------------ public builders


def causal(align: str = "bottom_right") -> Mask:
    """Each query sees the keys at or before its position: ``kv_idx <= p``.

    With ``Lq < Lk`` (decoding against a cache) the default alignment lets the last query see every key;
    with ``Lq > Lk`` the first ``Lq - Lk`` rows see nothing and their output is 0 (never NaN).
    """
    return _Causal(align)


def sliding_window(left: int | None, right: int | None = 0, *, align: str = "bottom_right") -> Mask:
    """``sliding_window(n)`` sees ``n + 1`` keys (FlashAttention's ``window_size``); Hugging Face's ``sliding_window=W`` is ``sliding_window(W - 1)``.

    Key ``j`` is visible from query position ``p`` iff ``p - left <= j <= p + right`` (FlashAttention's
    ``window_size=(left, right)``).  ``right`` defaults to 0, so the window is causal on its own: no
    ``causal() &`` is needed.  ``None`` means unbounded on that side, so ``sliding_window(255)`` is a causal
    window of 256 keys (Mistral's and Hugging Face's ``sliding_window=256``), ``sliding_window(w, w)`` a
    symmetric one (Longformer) and ``sliding_window(None)`` is :func:`causal`.

    Example::

        >>> from attnkit import masks
        >>> masks.sliding_window(2).to_dense(4, 4)[0, 0, 3].int().tolist()  # position 3 sees 3 keys
        [0, 1, 1, 1]
    """
    return _SlidingWindow(left, right, align)


def key_padding(lengths) -> Mask:
    """Padding: only real keys may be attended to.

    ``lengths``: a sequence or ``(B,)`` int tensor with the number of real keys of each sequence (the
    first ``lengths[b]`` keys are real), or a ``(B, Lk)`` bool tensor with True for real keys (also for
    left padding).
    """
    try:  # a tensor is held (in-place changes are seen); anything else is copied (a numpy array's later
        t = lengths if isinstance(lengths, Tensor) else torch.tensor(lengths)  # writes are not)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"key_padding: lengths must be a list or tensor of ints, or a (B, Lk) bool tensor, got "
                        f"{lengths!r}") from None
    if t.dtype == torch.bool:
        if t.dim() != 2:
            raise ValueError(f"key_padding: a bool key mask must have shape (B, Lk), got {tuple(t.shape)}")
        return _KeyColumns(f"key_padding(bool {tuple(t.shape)})", keep=t)
    if t.dim() == 2 and not t.is_floating_point():
        raise TypeError(f"key_padding: a (B, Lk) key mask must be a bool tensor (True = real key), got dtype "
                        f"{t.dtype}: pass mask.bool() (a 0/1 attention_mask), or lengths (B,)")
    t = _index_tensor("key_padding lengths", t, ndim=(1,))
    if bool((t < 0).any()):
        raise ValueError(f"key_padding: lengths must be >= 0, got {t.tolist()}")
    return _KeyLengths(t)


def document(ids, kv_ids=None) -> Mask:
    """Packed sequences: a query sees only keys of the same document.

    ``ids``: ``(Lk,)`` or ``(B, Lk)`` document id of every token (queries use the ids at their
    bottom-right positions), or the query ids ``(Lq,)``/``(B, Lq)`` when ``kv_ids`` gives the keys'.
    Combine with :func:`causal` for packed causal language modelling.
    """
    q_ids = _index_tensor("document ids", ids, ndim=(1, 2))
    k_ids = None if kv_ids is None else _index_tensor("document kv_ids", kv_ids, ndim=(1, 2))
    return _Document(q_ids, k_ids)


def prefix_lm(n: int, *, align: str = "bottom_right") -> Mask:
    """Prefix LM: every query sees the first ``n`` keys (the prefix, bidirectional) and is causal after."""
    return _PrefixLM(n, align)


def block_local(block: int, *, align: str = "bottom_right") -> Mask:
    """Local attention within fixed blocks: ``p // block == j // block``."""
    return _BlockLocal(block, align)


def strided(stride: int, *, causal: bool = True, align: str = "bottom_right") -> Mask:
    """Sparse Transformer's strided pattern (Child et al. 2019): a query at ``p`` sees the previous
    ``stride`` positions (``0 <= p - j < stride``) and every ``stride``-th one (``(p - j) % stride == 0``).
    With ``causal=False`` both parts extend to both sides."""
    return _Strided(stride, causal, align)


@dataclass(frozen=True)
class _SummaryColumns:
    """The rule of :func:`fixed`'s summary columns: key ``j`` is one iff ``j % block >= block - summary``
    (a class, not a lambda: masks pickle, so do the models holding them)."""

    block: int
    summary: int

    def __call__(self, j: Tensor) -> Tensor:
        return (j % self.block) >= self.block - self.summary


def fixed(block: int, summary: int, *, causal: bool = True, align: str = "bottom_right") -> Mask:
    """Sparse Transformer's fixed pattern: a query sees its own block (``p // block == j // block``) and
    the last ``summary`` positions of every block (``j % block >= block - summary``); causal by default."""
    _check_int("block", block, minimum=1)
    _check_int("summary", summary, minimum=1)
    if summary > block:
        raise ValueError(f"fixed: summary={summary} must be <= block={block}")
    _check_bool("causal", causal)
    _check_align(align)
    cols = _KeyColumns(f"summary_columns({block}, {summary})", rule=_SummaryColumns(block, summary))
    inner = _BlockLocal(block, align) | cols
    if causal:
        inner = inner & _Causal(align)
    return _Named(f"fixed({block}, {summary}, causal={causal}, align={align!r})", inner)


def dilated(window: int, dilation: int, *, causal: bool = False, align: str = "bottom_right") -> Mask:
    """Longformer's dilated sliding window: key ``j`` is visible iff ``d = p - j`` is a multiple of
    ``dilation`` and ``|d| <= window * dilation`` (``0 <= d`` when causal): ``window`` keys on each side."""
    return _Dilated(window, dilation, causal, align)


def global_tokens(indices, *, align: str = "bottom_right") -> Mask:
    """Longformer / BigBird global attention: tokens at ``indices`` see everything and are seen by all.
    Combine with a local pattern: ``sliding_window(w, w) | global_tokens([0])``."""
    t = _index_tensor("global_tokens indices", indices, ndim=(1,))
    if bool((t < 0).any()):
        raise ValueError(f"global_tokens: indices must be >= 0, got {t.tolist()}")
    return _GlobalTokens(t, align)


def random_blocks(block: int, n: int, seed: int = 0, *, causal: bool = False, align: str = "bottom_right") -> Mask:
    """BigBird's random attention: each block of ``block`` query positions sees ``n`` key blocks drawn at random.

    The draw is a hash of ``(seed, query block, key block)``: the same for every batch element and head,
    reproducible, and it depends on a query's *position* (its row plus ``Lk - Lq`` under the default
    alignment), never on ``Lq``.  Without ``causal`` a query block draws among all ``ceil(Lk / block)`` key
    blocks, so the draw depends on ``Lk`` (an encoder's whole sequence).  With ``causal=True`` it draws among
    the blocks up to its own and sees no key after its position: the draw depends on the position alone, so
    decoding with a KV cache sees what a full forward sees — use it in causal models (a ``DecoderLM``
    refuses the non-causal form, whose draw would change as the cache grows).

    Example::

        >>> from attnkit import masks
        >>> m = masks.random_blocks(4, 1, seed=0, causal=True)
        >>> full = m.to_dense(16, 16)[0, 0]
        >>> bool((m.to_dense(1, 11)[0, 0, 0] == full[10, :11]).all())  # one decoding step, position 10
        True
    """
    return _RandomBlocks(block, n, seed, causal, align)


def from_fn(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], *, name: str | None = None,
            align: str | None = None) -> Mask:
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


def from_flex(block_mask) -> Mask:
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
    needed = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "BLOCK_SIZE", "seq_lengths",
              "mask_mod")
    if not all(hasattr(block_mask, n) for n in needed):
        raise TypeError(f"from_flex: expected a torch.nn.attention.flex_attention.BlockMask, got "
                        f"{type(block_mask).__name__}")
    import torch.nn.attention.flex_attention as flex  # (the caller holds a BlockMask: already imported)

    if block_mask.mask_mod is getattr(flex, "_sliced_mask_mod_error", None):
        raise ValueError("from_flex: this BlockMask was sliced (block_mask[...]), which drops its mask_mod: pass "
                         "the BlockMask it was sliced from, built for the batch and heads you need")
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    q_len, kv_len = (int(x) for x in block_mask.seq_lengths)
    nq, nk = _ceil_div(q_len, bq), _ceil_div(kv_len, bk)
    lead = tuple(block_mask.kv_num_blocks.shape[:-1])  # (B', H')
    kinds = torch.zeros(*lead, nq, max(nk, 1), dtype=torch.int8, device=block_mask.kv_num_blocks.device)
    for count, index, kind in ((block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL),
                               (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL)):
        if count is None or index.shape[-1] == 0:
            continue
        count, index = count[..., :nq, None].long(), index[..., :nq, :].long()
        live = torch.arange(index.shape[-1], device=index.device) < count
        kinds.scatter_reduce_(-1, index.clamp(0, kinds.shape[-1] - 1), torch.where(live, kind, EMPTY).to(torch.int8),
                              reduce="amax")
    large = getattr(flex, "_LARGE_SPARSE_BLOCK_SIZE", None)  # flex's "no block mask": any lengths
    fixed_lengths = not (bq == bk == large)
    return _FromFlex(_FlexPredicate(kinds, block_mask.mask_mod, (bq, bk)), (q_len, kv_len), fixed_lengths)


def _nothing_visible(mask: Mask, batch: int, heads: int, q_len: int, kv_len: int, device=None) -> bool:
    """True when ``mask`` lets no query of a ``(batch, heads, q_len, kv_len)`` call see any key, evaluated a
    chunk of rows at a time (stopping at the first chunk that sees something)."""
    b, h, _, k = _index_grid(batch, heads, 0, kv_len, device)
    step = max(1, _EVAL_CHUNK // max(1, batch * heads * kv_len))
    for start in range(0, q_len, step):
        q = torch.arange(start, min(q_len, start + step), device=k.device).view(1, 1, -1, 1)
        if bool(_checked_bool(mask, mask._mod(b, h, q, k, q_len, kv_len)).any()):
            return False
    return True


def _positions_unchecked(mask: Mask, q_len: int, kv_len: int) -> bool:
    """Whether ``mask`` has a part that may read positions differently from the others: a ``from_fn`` (or
    BlockMask) predicate over query rows, or, when ``Lq != Lk``, parts aligned both top-left and
    bottom-right."""
    aligns = set()
    for m in _leaves(mask):
        if isinstance(m, _FromFn) and m.align is None:
            return True
        if getattr(m, "align", None) in _ALIGNS:
            aligns.add(m.align)
    return q_len != kv_len and len(aligns) > 1


def from_dense(t: Tensor) -> Mask:
    """A mask from a bool tensor broadcastable to ``(B, H, Lq, Lk)`` (True = may attend)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_dense: expected a bool tensor, got {type(t).__name__}")
    if t.dtype != torch.bool:
        raise TypeError(f"from_dense: the mask must be a bool tensor (True = may attend), got dtype {t.dtype}; "
                        f"convert with t.bool() or pass a float tensor as bias=")
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


def _check_per_sequence(mask: Mask) -> None:
    for m in _leaves(mask):
        if not isinstance(m, _PER_SEQUENCE):
            raise ValueError(f"varlen: mask {m!r} cannot be applied within each packed sequence (it holds data "
                             f"for one fixed length); use causal, sliding_window, prefix_lm, block_local, strided, "
                             f"dilated, global_tokens or from_fn (they see each sequence's own rows and keys), "
                             f"combined with &, | and ~")


class _Varlen(Mask):
    """Packed sequences on one ``(Tq, Tk)`` score matrix: sequence ``s`` owns query rows
    ``cu_q[s]:cu_q[s+1]`` and keys ``cu_k[s]:cu_k[s+1]``; ``inner`` applies with each sequence's own rows,
    keys and lengths."""

    def __init__(self, cu_q: Tensor, cu_k: Tensor, inner: Mask | None):
        self.cu_q, self.cu_k, self.inner = cu_q, cu_k, inner

    @property
    def num_sequences(self) -> int:
        return self.cu_q.numel() - 1

    def _locate(self, q: Tensor, k: Tensor):
        """Per element: the query's sequence, its local row, its sequence's local key index of ``k``, the
        sequence's lengths, and whether ``k`` belongs to the same sequence."""
        cq, ck = self.cu_q.to(q.device), self.cu_k.to(q.device)
        last = max(0, self.num_sequences - 1)
        sq = (torch.searchsorted(cq, q.contiguous(), right=True) - 1).clamp(0, last)
        sk = (torch.searchsorted(ck, k.contiguous(), right=True) - 1).clamp(0, last)
        return sq, sk, cq, ck

    def _mod(self, b, h, q, k, q_len, kv_len):
        cq, ck = self.cu_q.to(q.device), self.cu_k.to(q.device)
        sq = (torch.searchsorted(cq, q.contiguous(), right=True) - 1).clamp(0, max(0, self.num_sequences - 1))
        lo, hi, exact = self._row_keys(self.inner, b, h, sq, q, cq, ck)
        if exact:  # intervals: per-row key bounds (global, inside the row's sequence), two comparisons per key
            return (k >= lo) & (k <= hi)
        sq, sk, cq, ck = self._locate(q, k)
        same = sq == sk
        if self.inner is None:
            return same
        lq, lk = cq[sq + 1] - cq[sq], ck[sq + 1] - ck[sq]  # the query's sequence lengths, (..., Lq, 1)
        return same & self.inner._mod(b, h, q - cq[sq], k - ck[sq], lq, lk)

    def _row_keys(self, m: Mask | None, b, h, s, r, cq, ck):
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

    def _tiles(self, t):
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
        return _band_from_keys(t, kmin, kmax, fmin, fmax)

    def _validate(self, batch, heads, q_len, kv_len):
        tq, tk = int(self.cu_q[-1]), int(self.cu_k[-1])
        if batch != 1:
            raise ValueError(f"varlen: the packed sequences are one batch element, got a batch of {batch}: view "
                             f"packed q (Tq, H, D) as (1, H, Tq, D)")
        if (q_len, kv_len) != (tq, tk):
            raise ValueError(f"varlen: cu_seqlens end at Tq={tq} and Tk={tk}, but the score matrix is "
                             f"(Lq, Lk)=({q_len}, {kv_len}): the last entries must be the packed lengths")

    def _size(self):
        return (int(self.cu_q[-1]), int(self.cu_k[-1]))

    def __repr__(self):
        inner = "" if self.inner is None else f", mask={self.inner!r}"
        return f"varlen({self.num_sequences} sequences{inner})"


def _cu_seqlens(name: str, values) -> Tensor:
    t = _index_tensor(f"varlen {name}", values, ndim=(1,))
    if t.numel() == 0:
        raise ValueError(f"varlen: {name} must have n + 1 entries (0 first), got an empty tensor: pass [0] "
                         f"for no sequences")
    if int(t[0]) != 0:
        raise ValueError(f"varlen: {name} must start at 0, got {t[:4].tolist()}...: it holds prefix sums of the "
                         f"sequence lengths, [0, L0, L0 + L1, ...]")
    steps = t.diff()
    if bool((steps < 0).any()):
        i = int((steps < 0).nonzero()[0, 0])
        raise ValueError(f"varlen: {name} must not decrease, got {name}[{i}]={int(t[i])} > {name}[{i + 1}]="
                         f"{int(t[i + 1])}: it holds prefix sums of the lengths (cumsum of the lengths, 0 first)")
    return t


def varlen(cu_seqlens_q, cu_seqlens_k=None, mask: Mask | None = None) -> Mask:
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
        raise ValueError(f"varlen: cu_seqlens_q has {cu_q.numel()} entries and cu_seqlens_k {cu_k.numel()}: both "
                         f"need n + 1 entries for the same n sequences")
    if cu_k.device != cu_q.device:
        raise ValueError(f"varlen: cu_seqlens_q is on {cu_q.device} and cu_seqlens_k on {cu_k.device}: put both on "
                         f"one device")
    if mask is not None:
        if not isinstance(mask, Mask):
            raise TypeError(f"varlen: mask must be None or an attnkit.masks.Mask applied within each sequence, "
                            f"got {type(mask).__name__}")
        _check_per_sequence(mask)
    return _Varlen(cu_q, cu_k, mask)
