"""The flash backend's plan: which (query tile, key window) pairs to compute, grouped into a few big calls.

The score matrix ``(Lq, Lk)`` is tiled into ``(block_q, block_k)`` tiles and the mask's block structure
says which tiles are visited (full or partial).  The plan turns the visited tiles into *jobs*; one job is
computed by one batched call (or a few, when it is split to bound memory):

* a **band**: consecutive query tiles whose visited key tiles form one run of the same length ``w``,
  starting ``kstep`` tiles further for each query tile.  Its key windows are an ``as_strided`` view of
  ``k`` and ``v`` (no copy): the interior of a sliding window is one band.  The clipped windows in
  front of it (the first tiles, whose windows start at key 0) are folded into one call.
* a **shared window** (``kstep == 0``): consecutive query tiles computed as one tall block against one
  window: no mask, a document's interior, and a causal mask's growing prefixes grouped while the
  padded work stays within ``1 + SHARED_WASTE`` of the visited work (about ten calls at L = 16384).
* a **gather**: query tiles whose visited key tiles are scattered (random blocks, BigBird); their key
  tiles are copied into contiguous windows of at most ``MAX_GATHER_KEYS`` keys, and query tiles with
  the same number of tiles in one window step share a job.  Used when it needs far fewer calls.

A query tile covered by several jobs merges the partial results with their log-sum-exps (online
softmax); jobs are ordered so that each query tile's first job writes its rows and later ones merge.
A plain causal mask on ``Lq == Lk`` needs none of this: the fused kernel's own ``is_causal`` computes it
in one call (``Plan.whole_causal``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypedDict, cast

import torch

from ...masks import FULL, PARTIAL, Mask

Tensor = torch.Tensor

BLOCK_Q = 128  # query rows per tile: big enough for efficient GEMMs, small enough to skip empty tiles
BLOCK_K = 128  # keys per tile (the granularity of skipping and of the element mask)
MAX_GATHER_KEYS = 4096  # keys gathered into one window in the irregular (gather) path (the kernel loops over them)
BAND_CALLS_PER_GATHER = 2  # bands (no copies) are preferred unless gathering needs less than half the calls
ABSORB_WASTE = 2  # extra masked windows allowed when folding a band's clipped leading windows into one call
SHARED_WASTE = 0.25  # extra (masked) work allowed when single-row windows share one call


class _Run(TypedDict):
    """One run of key tiles that consecutive query tiles visit, as the band planner grows it."""

    ri: int  # the run's index within its row
    rows: list[int]  # query tiles
    pos: list[int]  # each one's position of the run's first tile in its row's list
    lo: int  # first key tile (of the first row)
    w: int  # tiles per row
    kstep: int  # the start's step from one row to the next
    last: int  # the last row's first tile


_Elsewhere = Callable[[_Run, int, int], bool]  # (run, lo, hi): whether its row visits [lo, hi) in another run


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Heads:
    """The heads one job computes, as strided ranges of the flat ``(B*Hq)`` and ``(B*Hkv)`` layouts.

    Query head ``q0 + qstep*i`` uses key/value head ``k0 + kstep*(i // (count // kcount))``.
    ``b``/``h`` are the batch element / query head the job is restricted to (masks that depend on them),
    or None when the job covers all of them.
    """

    q0: int
    qstep: int
    count: int
    k0: int
    kstep: int
    kcount: int
    b: int | None
    h: int | None


@dataclass
class Job:
    """Query tiles ``rows`` (n,) with their key windows of ``w`` tiles each.

    ``tiles is None``: a band; row ``i``'s window starts at key tile ``k0 + i*kstep`` (``rows`` are
    consecutive; ``kstep == 0`` means every row shares one window).  Otherwise ``tiles (n, w)`` lists
    the gathered key tiles.  ``kinds (n, w)`` int8 says which tiles are FULL or PARTIAL.
    """

    heads: Heads
    rows: Tensor  # (n,) int64 query tile indices
    consecutive: bool
    w: int
    k0: int
    kstep: int
    tiles: Tensor | None  # (n, w) int64 for gather jobs
    kinds: Tensor  # (n, w) int8
    first: bool  # no earlier job covered these rows: write instead of merge

    @property
    def n(self) -> int:
        return self.rows.shape[0]

    @property
    def pairs(self) -> int:
        return self.n * self.w


@dataclass
class Plan:
    """The tiling and the jobs for one ``(B, Hq, Hkv, Lq, Lk)`` shape and mask."""

    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    nq: int
    nk: int
    jobs: list[Job]
    visited_pairs: int  # visited (query tile, key tile) pairs, summed over the structure's (B', H')
    partial_pairs: int  # ... of which partial (need the element mask)
    total_pairs: int  # all pairs over the same (B', H')
    covered: bool  # every query tile has a job (else rows without one are zero)
    whole_causal: bool = False  # a plain causal mask on Lq == Lk: the fused kernel's own is_causal does it
    cache: dict[object, Any] = field(default_factory=dict)  # prepared chunks (with element masks) per chunking

    @property
    def q_pad(self) -> int:
        return self.nq * self.block_q

    @property
    def kv_pad(self) -> int:
        return self.nk * self.block_k

    @property
    def visited_fraction(self) -> float:
        return self.visited_pairs / max(1, self.total_pairs)

    @property
    def partial_fraction(self) -> float:
        return self.partial_pairs / max(1, self.total_pairs)


def choose_tiling(q_len: int, kv_len: int, block_q: int | None = None, block_k: int | None = None) -> tuple[int, int]:
    """Tile sizes: the defaults, shrunk to the sequence when it is shorter (no padding for short inputs)."""
    bq = BLOCK_Q if block_q is None else block_q
    bk = BLOCK_K if block_k is None else block_k
    return max(1, min(bq, q_len)), max(1, min(bk, kv_len))


def structure(
    mask: Mask | None,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    bq: int,
    bk: int,
    device: torch.device | str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Visited key tiles per (b', h', query tile), sorted: ``(tiles, kinds, counts)``.

    ``tiles``/``kinds``: (B', H', nq, C) int64 / int8, padded with tile ``nk`` (sorted last) past
    ``counts`` (B', H', nq).  With no mask every tile is visited and full.  A key tile that holds
    padding (``Lk`` not a multiple of ``bk``) is marked PARTIAL so that the padding is masked.
    """
    nq, nk = _ceil_div(q_len, bq), _ceil_div(kv_len, bk)
    if mask is None:
        tiles = torch.arange(nk).view(1, 1, 1, nk).expand(1, 1, nq, nk)
        kinds = torch.full((1, 1, nq, nk), FULL, dtype=torch.int8)
        counts = torch.full((1, 1, nq), nk, dtype=torch.int64)
    else:
        s = mask.block_structure(q_len, kv_len, bq, bk, batch=batch, heads=heads, device=device)
        fc, fi = s.full_count.long().cpu(), s.full_index.long().cpu()
        pc, pi = s.partial_count.long().cpu(), s.partial_index.long().cpu()
        fc, pc = torch.broadcast_tensors(fc, pc)  # type: ignore[no-untyped-call]  # (unannotated in PyTorch)
        lead = fc.shape
        fi, pi = fi.expand(*lead, fi.shape[-1]), pi.expand(*lead, pi.shape[-1])
        fvalid = torch.arange(fi.shape[-1]) < fc[..., None]
        pvalid = torch.arange(pi.shape[-1]) < pc[..., None]
        tiles = torch.cat([torch.where(fvalid, fi, nk), torch.where(pvalid, pi, nk)], dim=-1)
        kinds = torch.cat(
            [torch.full(fi.shape, FULL, dtype=torch.int8), torch.full(pi.shape, PARTIAL, dtype=torch.int8)], dim=-1
        )
        tiles, order = tiles.sort(dim=-1, stable=True)
        kinds = kinds.gather(-1, order)
        counts = fc + pc
    if kv_len % bk:
        kinds = torch.where(tiles == nk - 1, torch.tensor(PARTIAL, dtype=torch.int8), kinds)
    return tiles, kinds, counts


def _heads_for(bi: int | None, hi: int | None, batch: int, hq: int, hkv: int) -> Heads:
    g = hq // hkv
    if bi is None and hi is None:
        return Heads(0, 1, batch * hq, 0, 1, batch * hkv, None, None)
    if hi is None:
        b = cast(int, bi)  # (not both None: the first case)
        return Heads(b * hq, 1, hq, b * hkv, 1, hkv, bi, None)
    if bi is None:
        return Heads(hi, hq, batch, hi // g, hkv, batch, None, hi)
    return Heads(bi * hq + hi, 1, 1, bi * hkv + hi // g, 1, 1, bi, hi)


def _segments(tiles: Tensor, counts: Tensor) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Maximal runs of consecutive visited tiles, row by row (vectorised).

    ``tiles`` (nq, C) sorted per row, valid below ``counts`` (nq,).  Returns, per run in (row, position)
    order: row, run index within the row, first tile, length, and its position in the row's list.
    """
    nq, C = tiles.shape
    valid = torch.arange(C) < counts[:, None]
    prev = torch.cat([torch.full((nq, 1), -2, dtype=tiles.dtype), tiles[:, :-1]], dim=1)
    new = valid & (tiles != prev + 1)
    rows, pos = new.nonzero(as_tuple=True)
    ri = (new.cumsum(1) - 1)[rows, pos]
    same_row = torch.cat([rows[1:] == rows[:-1], torch.zeros(1, dtype=torch.bool)])
    end = torch.where(same_row, torch.cat([pos[1:], pos.new_zeros(1)]), counts[rows])
    return rows.tolist(), ri.tolist(), tiles[rows, pos].tolist(), (end - pos).tolist(), pos.tolist()


def _band_jobs(heads: Heads, tiles: Tensor, kinds: Tensor, counts: Tensor) -> list[Job]:
    """Consecutive query tiles whose r-th runs have one length and evenly spaced starts: one job each."""
    rows, ris, los, ws, poss = _segments(tiles, counts)
    order = sorted(range(len(rows)), key=lambda i: (ris[i], rows[i]))
    raw: list[_Run] = []
    cur: _Run | None = None
    for i in order:
        t, ri, lo, w = rows[i], ris[i], los[i], ws[i]
        if cur is not None and cur["ri"] == ri and cur["rows"][-1] == t - 1 and cur["w"] == w:
            step = lo - cur["last"]
            if (len(cur["rows"]) == 1 and step >= 0) or step == cur["kstep"]:
                cur["rows"].append(t)
                cur["pos"].append(poss[i])
                cur["kstep"], cur["last"] = step, lo
                continue
        cur = {"ri": ri, "rows": [t], "pos": [poss[i]], "lo": lo, "w": w, "kstep": 0, "last": lo}
        raw.append(cur)
    row_tiles: dict[int, list[int]] = {}
    several = {t for t, ri in zip(rows, ris) if ri > 0}  # rows with more than one run of tiles

    def elsewhere(r: _Run, lo: int, hi: int) -> bool:
        """Whether row ``r["rows"][0]`` visits a tile in ``[lo, hi)`` outside its own run ``r``: padding a
        window over it would compute that tile twice (once here, once in the job of its other run)."""
        t = r["rows"][0]
        if t not in several:  # one run (every row of a causal or window mask): nothing elsewhere
            return False
        if t not in row_tiles:
            row_tiles[t] = tiles[t, : int(counts[t])].tolist()
        own = range(r["lo"], r["lo"] + r["w"])
        return any(lo <= x < hi and x not in own for x in row_tiles[t])

    jobs = _absorb_leading_rows(heads, raw, kinds, elsewhere)
    singles: list[_Run] = []
    for r in raw:
        if len(r["rows"]) == 1:
            singles.append(r)
        elif r["rows"]:
            rows_t, pos_t = torch.tensor(r["rows"]), torch.tensor(r["pos"])
            job_kinds = kinds[rows_t[:, None], pos_t[:, None] + torch.arange(r["w"])]  # (n, w)
            jobs.append(Job(heads, rows_t, True, r["w"], r["lo"], r["kstep"], None, job_kinds, r["ri"] == 0))
    return jobs + _shared_windows(heads, singles, kinds, elsewhere)


def _shared_windows(heads: Heads, singles: list[_Run], kinds: Tensor, elsewhere: _Elsewhere) -> list[Job]:
    """Group consecutive single-row windows (a causal mask's growing prefixes, a document's boundary
    tiles) into calls over the union of their windows while the padded work stays within
    ``1 + SHARED_WASTE`` of the visited work; the padding is masked.  A row joins only when the union
    holds no tile the row visits in another run (``elsewhere``): that tile would be counted twice."""
    jobs: list[Job] = []
    group: list[_Run] = []

    def flush() -> None:
        if not group:
            return
        lo = min(r["lo"] for r in group)
        hi = max(r["lo"] + r["w"] for r in group)
        window = torch.arange(lo, hi)
        rows_kinds = []
        for r in group:
            inside = (window >= r["lo"]) & (window < r["lo"] + r["w"])
            own = kinds[r["rows"][0], (r["pos"][0] + (window - r["lo"])).clamp(0, kinds.shape[1] - 1)]
            rows_kinds.append(torch.where(inside, own, torch.tensor(PARTIAL, dtype=torch.int8)))
        jobs.append(
            Job(
                heads,
                torch.tensor([r["rows"][0] for r in group]),
                True,
                hi - lo,
                lo,
                0,
                None,
                torch.stack(rows_kinds),
                group[0]["ri"] == 0,
            )
        )
        group.clear()

    for r in sorted(singles, key=lambda r: (r["ri"], r["rows"][0])):
        if group and group[-1]["ri"] == r["ri"] and group[-1]["rows"][0] == r["rows"][0] - 1:
            lo = min(r["lo"], *(g["lo"] for g in group))
            hi = max(r["lo"] + r["w"], *(g["lo"] + g["w"] for g in group))
            visited = r["w"] + sum(g["w"] for g in group)
            if (len(group) + 1) * (hi - lo) <= (1 + SHARED_WASTE) * visited and not any(
                elsewhere(m, lo, hi) for m in (*group, r)
            ):
                group.append(r)
                continue
        flush()
        group.append(r)
    flush()
    return jobs


def _absorb_leading_rows(heads: Heads, raw: list[_Run], kinds: Tensor, elsewhere: _Elsewhere) -> list[Job]:
    """Fold the short windows in front of a band (the first tiles of a sliding window, whose windows are
    clipped at key 0) into one call with the band's first window, at most ``ABSORB_WASTE`` windows of
    extra (masked) work, and only rows that visit no other tile of that window in another run
    (``elsewhere``).  One call instead of one per leading row.  Mutates ``raw``; returns new jobs."""
    jobs = []
    for j, r in enumerate(raw):
        if len(r["rows"]) < 2 or r["kstep"] <= 0:
            continue
        lo0, w0 = r["lo"], r["w"]
        take, waste, expect = [], 0, r["rows"][0] - 1
        for p in reversed(raw[:j]):
            if p["ri"] != r["ri"] or len(p["rows"]) != 1 or p["rows"][0] != expect:
                break
            if (
                p["lo"] < lo0
                or p["lo"] + p["w"] > lo0 + w0
                or waste + w0 - p["w"] > ABSORB_WASTE * w0
                or elsewhere(p, lo0, lo0 + w0)
            ):
                break
            waste += w0 - p["w"]
            take.append(p)
            expect -= 1
        if not take:
            continue
        members = [(p["rows"][0], p["lo"], p["w"], p["pos"][0]) for p in reversed(take)]
        members.append((r["rows"][0], lo0, w0, r["pos"][0]))
        window = torch.arange(lo0, lo0 + w0)
        rows_kinds = []
        for t, lo, w, pos in members:
            inside = (window >= lo) & (window < lo + w)
            own = kinds[t, (pos + (window - lo)).clamp(0, kinds.shape[1] - 1)]
            rows_kinds.append(torch.where(inside, own, torch.tensor(PARTIAL, dtype=torch.int8)))
        jobs.append(
            Job(
                heads,
                torch.tensor([m[0] for m in members]),
                True,
                w0,
                lo0,
                0,
                None,
                torch.stack(rows_kinds),
                r["ri"] == 0,
            )
        )
        for p in take:
            p["rows"], p["pos"] = [], []
        r["rows"], r["pos"], r["lo"] = r["rows"][1:], r["pos"][1:], lo0 + r["kstep"]
    return jobs


def _gather_jobs(heads: Heads, tiles: Tensor, kinds: Tensor, counts: Tensor, per_window: int) -> list[Job]:
    """Each query tile's visited key tiles in windows of ``per_window`` tiles; query tiles with the same
    number of tiles in the same window step share a job."""
    jobs = []
    steps = _ceil_div(int(counts.max()), per_window) if counts.numel() else 0
    for j in range(steps):
        lengths = (counts - j * per_window).clamp(0, per_window)
        for w in sorted(set(lengths.tolist()) - {0}):
            rows_t = (lengths == w).nonzero().view(-1)
            cols = slice(j * per_window, j * per_window + w)
            consecutive = bool(rows_t.numel() == 1 or (rows_t.diff() == 1).all())
            jobs.append(Job(heads, rows_t, consecutive, w, 0, 0, tiles[rows_t, cols], kinds[rows_t, cols], j == 0))
    return jobs


SCATTERED_RUNS = 4  # runs of visited tiles per query tile from which a pattern may be scattered


def _scattered(tiles: Tensor, counts: Tensor) -> bool:
    """Whether the visited tiles form many runs per query tile (``SCATTERED_RUNS`` or more on average) whose
    starts move irregularly from one query tile to the next (content-chosen blocks): the band planner would
    find no bands there and only cost time (it walks the runs in Python), so the gather path is taken."""
    nq, C = tiles.shape
    if nq < 3 or C == 0:
        return False
    valid = torch.arange(C) < counts[:, None]
    prev = torch.cat([torch.full((nq, 1), -2, dtype=tiles.dtype), tiles[:, :-1]], dim=1)
    new = valid & (tiles != prev + 1)
    runs = new.sum(1)
    if float(runs.double().mean()) < SCATTERED_RUNS:
        return False
    starts = torch.full((nq, int(runs.max())), -1, dtype=tiles.dtype)
    rows, pos = new.nonzero(as_tuple=True)
    starts[rows, (new.cumsum(1) - 1)[rows, pos]] = tiles[rows, pos]
    live = starts >= 0
    step = starts[1:] - starts[:-1]
    same = (step[1:] == step[:-1]) & live[2:] & live[1:-1] & live[:-2]
    return float(same.double().mean()) < 0.5


def build(
    mask: Mask | None,
    batch: int,
    hq: int,
    hkv: int,
    q_len: int,
    kv_len: int,
    bq: int,
    bk: int,
    device: torch.device | str | None,
) -> Plan:
    """The plan for one call shape (see the module docstring)."""
    nq, nk = _ceil_div(q_len, bq), _ceil_div(kv_len, bk)
    tiles, kinds, counts = structure(mask, batch, hq, q_len, kv_len, bq, bk, device)
    bp, hp = counts.shape[0], counts.shape[1]
    per_b, per_h = bp > 1, hp > 1
    jobs: list[Job] = []
    visited = int(counts.sum())
    partial = int(((kinds == PARTIAL) & (torch.arange(kinds.shape[-1]) < counts[..., None])).sum())
    per_window = max(1, MAX_GATHER_KEYS // bk)
    for bi in range(bp):
        for hi in range(hp):
            heads = _heads_for(bi if per_b else None, hi if per_h else None, batch, hq, hkv)
            t, k, c = tiles[bi, hi], kinds[bi, hi], counts[bi, hi]  # (nq, C), (nq, C), (nq,)
            gathers = _gather_jobs(heads, t, k, c, per_window)
            if _scattered(t, c):  # (a data-dependent selection: bands would be about one call per run)
                jobs += gathers
                continue
            bands = _band_jobs(heads, t, k, c)
            jobs += bands if len(bands) <= BAND_CALLS_PER_GATHER * len(gathers) else gathers
    jobs.sort(key=lambda j: not j.first)  # every row's first job writes before any job merges into it
    covered = sum(j.n for j in jobs if j.first) == bp * hp * nq
    whole_causal = mask is not None and mask.is_causal(None) and q_len == kv_len and bq == bk
    return Plan(bq, bk, q_len, kv_len, nq, nk, jobs, visited, partial, bp * hp * nq * nk, covered, whole_causal)
