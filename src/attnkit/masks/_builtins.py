"""The built-in masks: intervals (causal, sliding window, prefix LM, block local, key padding), key columns,
documents, strided, dilated, global tokens and random blocks, and the functions that build them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from .._checks import holds
from ._base import Band, Documents, KeyLengths, Mask, Prefix, _Named
from ._blocks import (
    _BIG,
    EMPTY,
    FULL,
    PARTIAL,
    _and_tiles,
    _Band,
    _band_from_keys,
    _ceil_div,
    _check_align,
    _check_bool,
    _check_int,
    _Grid,
    _index_tensor,
    _offset,
    _or_tiles,
    _pool_kinds,
    _short_list,
    _Tiling,
)

Tensor = torch.Tensor


class _Interval(Mask):
    """Key j visible from query position p iff lo(p) <= j <= hi(p), with lo and hi nondecreasing in p.

    Such masks have an arithmetic block structure: a query tile spanning positions [P0, P1] sees the
    keys [lo(P0), hi(P1)], and every one of its rows sees the keys [lo(P1), hi(P0)].
    """

    align = "bottom_right"

    def _bounds(self, b: Tensor, h: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        lo, hi = self._bounds(b, h, q + _offset(self.align, q_len, kv_len))
        return (k >= lo) & (k <= hi)

    def _row_bounds(self, p: int) -> tuple[float, float]:
        """``_bounds`` of one position in plain numbers (no tensor work on the decode path)."""
        zero = torch.zeros((), dtype=torch.long)
        lo, hi = self._bounds(zero, zero, torch.full((), p, dtype=torch.long))
        return int(lo), int(hi)

    def key_range(self, row: int, q_len: int, kv_len: int) -> tuple[float, float] | None:
        return self._row_bounds(row + _offset(self.align, q_len, kv_len))

    def is_positional(self, align: str = "bottom_right") -> bool:
        return self.align == align

    def value_key(self) -> str | None:
        return repr(self)

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
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

    def _bounds(self, b: Tensor, h: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        return _const(p, -_BIG), p

    def _row_bounds(self, p: int) -> tuple[float, float]:
        return -math.inf, p

    def is_causal(self, align: str | None = "bottom_right") -> bool:
        return align is None or self.align == align

    def form(self, q_len: int, kv_len: int) -> Band:
        return Band(None, _offset(self.align, q_len, kv_len))

    def __repr__(self) -> str:
        return f"causal(align={self.align!r})"


class _SlidingWindow(_Interval):
    def __init__(self, left: int | None, right: int | None, align: str):
        _check_int("left", left, allow_none=True)
        _check_int("right", right, allow_none=True)
        self.left, self.right, self.align = left, right, _check_align(align)

    def _bounds(self, b: Tensor, h: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        lo = _const(p, -_BIG) if self.left is None else p - self.left
        hi = _const(p, _BIG) if self.right is None else p + self.right
        return lo, hi

    def _row_bounds(self, p: int) -> tuple[float, float]:
        return (-math.inf if self.left is None else p - self.left), (math.inf if self.right is None else p + self.right)

    def form(self, q_len: int, kv_len: int) -> Band:
        off = _offset(self.align, q_len, kv_len)
        return Band(None if self.left is None else off - self.left, None if self.right is None else off + self.right)

    def __repr__(self) -> str:
        return f"sliding_window(left={self.left}, right={self.right}, align={self.align!r})"


class _PrefixLM(_Interval):
    def __init__(self, n: int, align: str):
        _check_int("n", n)
        self.n, self.align = n, _check_align(align)

    def _bounds(self, b: Tensor, h: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        return _const(p, -_BIG), torch.clamp(p, min=self.n - 1)

    def _row_bounds(self, p: int) -> tuple[float, float]:
        return -math.inf, max(p, self.n - 1)

    def form(self, q_len: int, kv_len: int) -> Prefix:
        return Prefix(_offset(self.align, q_len, kv_len), self.n)

    def __repr__(self) -> str:
        return f"prefix_lm({self.n}, align={self.align!r})"


class _BlockLocal(_Interval):
    def __init__(self, block: int, align: str):
        _check_int("block", block, minimum=1)
        self.block, self.align = block, _check_align(align)

    def _bounds(self, b: Tensor, h: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        lo = torch.div(p, self.block, rounding_mode="floor") * self.block
        return lo, lo + self.block - 1

    def _row_bounds(self, p: int) -> tuple[float, float]:
        lo = p // self.block * self.block
        return lo, lo + self.block - 1

    def __repr__(self) -> str:
        return f"block_local({self.block}, align={self.align!r})"


class _KeyLengths(_Interval):
    def __init__(self, lengths: Tensor):
        self.lengths = lengths

    def _bounds(self, b: Tensor, h: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
        lengths = self.lengths.to(p.device)
        return _const(p, 0), lengths[b.clamp(max=len(lengths) - 1)] - 1 + torch.zeros_like(p)

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        lengths = self.lengths.to(k.device)
        return k < lengths[b.clamp(max=len(lengths) - 1)]

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        n = len(self.lengths)
        if n not in (1, batch):
            raise ValueError(f"key_padding: got {n} lengths for a batch of {batch}: give one length per sequence")
        too_long = self.lengths > kv_len
        if not holds(~too_long.any(), "key_padding: a length exceeds the key length Lk; each length must be <= Lk"):
            i = int(too_long.nonzero()[0, 0])
            raise ValueError(
                f"key_padding: lengths[{i}]={int(self.lengths[i])} exceeds the key length "
                f"Lk={kv_len}; each length must be <= Lk"
            )

    def _size_guess(self) -> tuple[int, int] | None:  # (the lengths fix no key length: any Lk >= the longest fits)
        n = int(self.lengths.max()) if len(self.lengths) else 0
        return (n, n)

    def batch_size(self) -> int:
        return len(self.lengths)

    def key_range(self, row: int, q_len: int, kv_len: int) -> tuple[float, float] | None:
        return None  # (one interval per batch element)

    def is_positional(self, align: str = "bottom_right") -> bool:
        return False

    def value_key(self) -> str | None:
        return None

    def form(self, q_len: int, kv_len: int) -> KeyLengths:
        return KeyLengths(self.lengths)

    def __repr__(self) -> str:
        return f"key_padding(lengths={_short_list(self.lengths)})"


class _KeyColumns(Mask):
    """A mask that depends on the key only: key j visible iff keep[b, j] (keep is (B', Lk) or a rule)."""

    def __init__(self, name: str, keep: Tensor | None = None, rule: Callable[[Tensor], Tensor] | None = None):
        self.name, self.keep, self.rule = name, keep, rule

    def _keep(self, kv_len: int, device: torch.device) -> Tensor:
        if self.keep is not None:
            return self.keep.to(device)
        assert self.rule is not None  # (built with keep= or rule=)
        return self.rule(torch.arange(kv_len, device=device)).view(1, -1)

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        keep = self._keep(kv_len, k.device)  # (B', Lk)
        return keep[b.clamp(max=keep.shape[0] - 1), k] & torch.ones_like(q, dtype=torch.bool)

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        keep = self._keep(t.kv_len, t.device)
        pad = t.nk * t.block_k - t.kv_len
        valid = torch.arange(t.nk * t.block_k, device=t.device) < t.kv_len
        keep = torch.nn.functional.pad(keep, (0, pad))
        kinds = _pool_kinds(keep[:, None, :], valid.view(1, 1, -1), 1, t.block_k)  # (B', 1, nk)
        return _Grid(kinds[:, None, :, :])  # (B', 1, 1, nk)

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        if self.keep is not None:
            n, lk = self.keep.shape
            if n not in (1, batch) or lk != kv_len:
                raise ValueError(
                    f"key_padding: the key mask has shape {(n, lk)}, expected ({batch}, {kv_len}) "
                    f"(one row per sequence, one column per key)"
                )

    def _size(self) -> tuple[int, int] | None:
        return None if self.keep is None else (self.keep.shape[1], self.keep.shape[1])

    def batch_size(self) -> int:
        return 1 if self.keep is None else self.keep.shape[0]

    def value_key(self) -> str | None:
        return repr(self) if self.keep is None else None  # a column rule named by its parameters (fixed())

    def cheap_structure(self) -> bool:
        return self.keep is None

    def __repr__(self) -> str:
        return self.name


class _Document(Mask):
    def __init__(self, q_ids: Tensor, kv_ids: Tensor | None):
        self.q_ids = q_ids if q_ids.dim() == 2 else q_ids.view(1, -1)
        self.kv_ids = None if kv_ids is None else (kv_ids if kv_ids.dim() == 2 else kv_ids.view(1, -1))

    def _ids(self, q_len: int, kv_len: int, device: torch.device | None) -> tuple[Tensor, Tensor]:
        if self.kv_ids is None:  # one id sequence for the keys; queries sit at their bottom-right positions
            kv = self.q_ids.to(device)
            off = kv_len - q_len
            return kv[:, off : off + q_len], kv
        return self.q_ids.to(device), self.kv_ids.to(device)

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        qi, ki = self._ids(q_len, kv_len, q.device)
        bq = b.clamp(max=qi.shape[0] - 1)
        bk = b.clamp(max=ki.shape[0] - 1)
        same: Tensor = qi[bq, q] == ki[bk, k]
        return same

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        qi, ki = self._ids(t.q_len, t.kv_len, t.device)

        def tile_range(ids: Tensor, block: int, n: int) -> tuple[Tensor, Tensor]:
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

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        for name, ids, _n in (("ids", self.q_ids, None), ("kv_ids", self.kv_ids, kv_len)):
            if ids is None:
                continue
            if ids.shape[0] not in (1, batch):
                raise ValueError(
                    f"document: {name} has {ids.shape[0]} rows for a batch of {batch}: "
                    f"give one row per sequence or a single 1-D tensor"
                )
        if self.kv_ids is None:
            if self.q_ids.shape[1] != kv_len:
                raise ValueError(
                    f"document: ids has length {self.q_ids.shape[1]} but the keys have Lk={kv_len}: "
                    f"give one id per key, or pass kv_ids"
                )
            if q_len > kv_len:
                raise ValueError(
                    f"document: Lq={q_len} queries but only Lk={kv_len} keys: with one ids tensor the "
                    f"queries are the last Lq keys (Lq <= Lk); pass kv_ids for separate query ids"
                )
        elif self.q_ids.shape[1] != q_len or self.kv_ids.shape[1] != kv_len:
            raise ValueError(
                f"document: ids/kv_ids have lengths {self.q_ids.shape[1]}/{self.kv_ids.shape[1]}, "
                f"expected Lq={q_len} and Lk={kv_len}"
            )

    def batch_size(self) -> int:
        return max(self.q_ids.shape[0], 1 if self.kv_ids is None else self.kv_ids.shape[0])

    def _size(self) -> tuple[int, int] | None:
        n = self.q_ids.shape[1]
        return (n, n) if self.kv_ids is None else (n, self.kv_ids.shape[1])

    def form(self, q_len: int, kv_len: int) -> Documents:
        return Documents(*self._ids(q_len, kv_len, None))

    def __repr__(self) -> str:
        return f"document({self.q_ids.shape[1]} ids)" if self.kv_ids is None else "document(ids, kv_ids)"


class _Strided(Mask):
    def __init__(self, stride: int, causal: bool, align: str):
        _check_int("stride", stride, minimum=1)
        self.stride, self.causal, self.align = stride, _check_bool("causal", causal), _check_align(align)

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        d = q + _offset(self.align, q_len, kv_len) - k
        ok = (d.abs() < self.stride) | (torch.remainder(d, self.stride) == 0)
        return ok & (d >= 0) if self.causal else ok

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
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

    def value_key(self) -> str | None:
        return repr(self)

    def __repr__(self) -> str:
        return f"strided({self.stride}, causal={self.causal}, align={self.align!r})"


class _Dilated(Mask):
    def __init__(self, window: int, dilation: int, causal: bool, align: str):
        _check_int("window", window)
        _check_int("dilation", dilation, minimum=1)
        self.window, self.dilation = window, dilation
        self.causal, self.align = _check_bool("causal", causal), _check_align(align)

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        d = q + _offset(self.align, q_len, kv_len) - k
        span = self.window * self.dilation
        ok = (torch.remainder(d, self.dilation) == 0) & (d <= span) & (d >= (0 if self.causal else -span))
        return ok

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
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

    def value_key(self) -> str | None:
        return repr(self)

    def __repr__(self) -> str:
        return f"dilated(window={self.window}, dilation={self.dilation}, causal={self.causal}, align={self.align!r})"


class _GlobalTokens(Mask):
    def __init__(self, indices: Tensor, align: str):
        self.indices, self.align = indices, _check_align(align)

    def _member(self, positions: Tensor) -> Tensor:
        return torch.isin(positions, self.indices.to(positions.device))

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        return self._member(q + _offset(self.align, q_len, kv_len)) | self._member(k)

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        off = _offset(self.align, t.q_len, t.kv_len)
        rows = torch.arange(t.nq * t.block_q, device=t.device)
        keys = torch.arange(t.nk * t.block_k, device=t.device)
        qm = self._member(rows + off).view(1, -1)
        km = self._member(keys).view(1, -1)
        qk = _pool_kinds(qm, (rows < t.q_len).view(1, -1), 1, t.block_q)  # (1, nq)
        kk = _pool_kinds(km, (keys < t.kv_len).view(1, -1), 1, t.block_k)  # (1, nk)
        kinds = torch.maximum(qk.view(-1, 1), kk.view(1, -1))
        return _Grid(kinds[None, None])

    def __repr__(self) -> str:
        return f"global_tokens({_short_list(self.indices)}, align={self.align!r})"


_RANDOM_TABLES = 16  # block tables a random_blocks mask keeps (one per query-block range and key-block count)
_M31 = (1 << 31) - 1
_IntOrTensor = TypeVar("_IntOrTensor", int, Tensor)


def _mix31(x: _IntOrTensor) -> _IntOrTensor:
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
            part = table[a : a + r.shape[0]]
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

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        table = self.table(q_len, kv_len).to(q.device)
        first = self._rows(q_len, kv_len)[0]
        p = q + _offset(self.align, q_len, kv_len)
        out = table[
            torch.div(p, self.block, rounding_mode="floor") - first, torch.div(k, self.block, rounding_mode="floor")
        ]
        return out & (k <= p) if self.causal else out

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
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

    def value_key(self) -> str | None:
        return repr(self)

    def __repr__(self) -> str:
        return (
            f"random_blocks(block={self.block}, n={self.n}, seed={self.seed}, causal={self.causal}, "
            f"align={self.align!r})"
        )


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


def key_padding(lengths: Tensor | Sequence[int]) -> Mask:
    """Padding: only real keys may be attended to.

    ``lengths``: a sequence or ``(B,)`` int tensor with the number of real keys of each sequence (the
    first ``lengths[b]`` keys are real), or a ``(B, Lk)`` bool tensor with True for real keys (also for
    left padding).
    """
    try:  # a tensor is held (in-place changes are seen); anything else is copied (a numpy array's later
        t = lengths if isinstance(lengths, Tensor) else torch.tensor(lengths)  # writes are not)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"key_padding: lengths must be a list or tensor of ints, or a (B, Lk) bool tensor, got {lengths!r}"
        ) from None
    if t.dtype == torch.bool:
        if t.dim() != 2:
            raise ValueError(f"key_padding: a bool key mask must have shape (B, Lk), got {tuple(t.shape)}")
        return _KeyColumns(f"key_padding(bool {tuple(t.shape)})", keep=t)
    if t.dim() == 2 and not t.is_floating_point():
        raise TypeError(
            f"key_padding: a (B, Lk) key mask must be a bool tensor (True = real key), got dtype "
            f"{t.dtype}: pass mask.bool() (a 0/1 attention_mask), or lengths (B,)"
        )
    t = _index_tensor("key_padding lengths", t, ndim=(1,))
    if not holds((t >= 0).all(), "key_padding: lengths must be >= 0"):
        raise ValueError(f"key_padding: lengths must be >= 0, got {t.tolist()}")
    return _KeyLengths(t)


def document(
    ids: Tensor | Sequence[int] | Sequence[Sequence[int]],
    kv_ids: Tensor | Sequence[int] | Sequence[Sequence[int]] | None = None,
) -> Mask:
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


def global_tokens(indices: Tensor | Sequence[int], *, align: str = "bottom_right") -> Mask:
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
