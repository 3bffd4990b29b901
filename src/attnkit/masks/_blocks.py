"""The block structure of a mask: tilings, tile kinds, and the shared index helpers of the masks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .._checks import flag, integer

Tensor = torch.Tensor


_ALIGNS = ("bottom_right", "top_left")
_BIG = 1 << 40  # stands for "unbounded" in key-index arithmetic; far beyond any length
_EVAL_CHUNK = 1 << 22  # elements evaluated at once when a tile grid is derived by evaluation
_DRAW_MAX = 64  # characters per side a BlockStructure draws (wider tilings are pooled, as Mask.show does)
_LIST_MAX = 8  # entries of an index list a mask's repr spells out

EMPTY, PARTIAL, FULL = 0, 1, 2  # tile kinds


# --------------------------------------------------------------------------- helpers


def _check_align(align: str) -> str:
    if align not in _ALIGNS:
        raise ValueError(
            f"align={align!r} is not one of {_ALIGNS}: use 'bottom_right' (query row i at "
            f"position i + Lk - Lq, the decoding alignment) or 'top_left' (row i at position i)"
        )
    return align


def _offset(align: str, q_len: int, kv_len: int) -> int:
    return kv_len - q_len if align == "bottom_right" else 0


def _check_int(name: str, value: object, *, minimum: int = 0, allow_none: bool = False) -> None:
    integer(name, value, minimum=minimum, allow_none=allow_none)


def _check_bool(name: str, value: object) -> bool:
    return flag(name, value)  # (a string such as "false" would be truthy)


def _index_tensor(name: str, values: object, *, ndim: Sequence[int]) -> Tensor:
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


def index_grid(
    batch: int, heads: int, q_len: int, kv_len: int, device: torch.device | str | None = None
) -> tuple[Tensor, ...]:
    """Index tensors b (B,1,1,1), h (1,H,1,1), q (1,1,Lq,1), k (1,1,1,Lk) that broadcast to (B, H, Lq, Lk)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    return (
        torch.arange(batch, device=device).view(-1, 1, 1, 1),
        torch.arange(heads, device=device).view(1, -1, 1, 1),
        torch.arange(q_len, device=device).view(1, 1, -1, 1),
        torch.arange(kv_len, device=device).view(1, 1, 1, -1),
    )


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
    lo, hi, flo, fhi = torch.broadcast_tensors(lo, hi, flo, fhi)  # type: ignore[no-untyped-call]  # (torch.functional is unannotated)
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
            lo, hi, flo, fhi = torch.broadcast_tensors(lo, hi, flo, fhi)  # type: ignore[no-untyped-call]  # (torch.functional is unannotated)
            return _Band(lo, hi, flo, fhi)
    return _Grid(torch.maximum(_as_grid(a, t).kinds, _as_grid(b, t).kinds))


def _pool_kinds(allowed: Tensor, valid: Tensor, bq: int, bk: int) -> Tensor:
    """Tile kinds of an element mask (..., nq*bq, nk*bk), counting only `valid` elements."""
    *lead, rows, cols = allowed.shape
    shape = (*lead, rows // bq, bq, cols // bk, bk)
    any_ = (allowed & valid).reshape(shape).any(dim=-1).any(dim=-2)
    all_ = (allowed | ~valid).reshape(shape).all(dim=-1).all(dim=-2)
    return torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)


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
        for count, index, kind in (
            (self.partial_count, self.partial_index, PARTIAL),
            (self.full_count, self.full_index, FULL),
        ):
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
        lines = [
            f"BlockStructure({self.q_len}x{self.kv_len}, tiles {self.block_q}x{self.block_k}, "
            f"{nq}x{nk} tiles, visited {self.visited_fraction():.1%}{grouped}; █ full, ░ partial, · empty)"
        ]
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
    return BlockStructure(
        t.q_len,
        t.kv_len,
        t.block_q,
        t.block_k,
        nfull.to(torch.int32),
        full_index.to(torch.int32),
        npart.to(torch.int32),
        partial_index.to(torch.int32),
    )


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
