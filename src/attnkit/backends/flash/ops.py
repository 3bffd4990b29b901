"""The flash backend's compute: one plan job at a time, split into chunks that bound memory.

Layout: ``q``/``k``/``v`` are flattened to ``(B*H, L_pad, D)`` (padded to whole tiles, a copy only when
``L`` is not a multiple of the tile).  A chunk of a job is ``N`` query tiles of ``R`` rows with key
windows of ``W`` keys; its query rows and (for bands) key windows are ``as_strided`` views of those
tensors, so the hot path copies neither ``k`` nor ``v`` (grouped-query heads share them: the fused
kernel maps query head ``i`` to key head ``i // G``, the explicit path folds the ``G`` heads into rows).

Each chunk is computed either by PyTorch's fused CPU flash kernel (``aten::_scaled_dot_product_flash_
attention_for_cpu``, which returns the log-sum-exp; its backward recomputes from ``out`` and ``lse``)
with the element mask and any additive bias passed as a float mask, or by explicit matmuls and online
softmax in float32 (softcap, any score modifier, dropout, learnable biases, non-CPU devices).  Partial
results of a query tile are merged with their log-sum-exps.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, cast

import torch

from ...bias import ScoreMod
from ...masks import FULL
from ..fused import FUSED
from ..call import accumulation_dtype
from ..scores import zero_unseen
from .plan import Heads, Job, Plan

if TYPE_CHECKING:
    from ...masks import Mask
    from ..fused import Fused

Tensor = torch.Tensor

WORK_ELEMENTS = 1 << 24  # elements of per-chunk temporaries (scores, masks, window gradients): ~64 MB fp32
# Gathered key + value elements per chunk (128 MB fp32), in workspaces kept per thread.  Few big chunks:
# every call is a parallel region (costly on a busy machine) and every extra chunk makes the output an
# assembly of fresh pieces (page faults cost ~0.75 ms per MB here, as much as the attention on them).
GATHER_ELEMENTS = 1 << 25
WORKSPACE_BYTES = 64 << 20  # a gather workspace (keys or values) larger than this is not kept between calls
SPLIT_MASK_ELEMENTS = 1 << 20  # bigger element masks are confined to the partial key tiles of a chunk


# ----------------------------------------------------------------------------- dropout


_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser: a bijective avalanche on [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def dropout_keep(seed: int, b: Tensor, h: Tensor, q: Tensor, k: Tensor, p: float) -> Tensor:
    """Which attention weights dropout keeps, as a pure function of ``(seed, b, h, q_row, kv_idx)``.

    The forward and the backward evaluate it tile by tile and get the same pattern, without storing
    an ``Lq x Lk`` mask.  Each weight is kept with probability ``1 - p``.
    """
    s = _mix32(torch.tensor(seed & _M32) ^ 0x5BD1E995)
    row = _mix32((s ^ _mix32(b.to(torch.int64) * 40503 + h.to(torch.int64) + 1)) & _M32)
    row = _mix32(row ^ (q.to(torch.int64) & _M32))
    x = _mix32(row ^ _mul32(k.to(torch.int64) & _M32, 0x9E3779B1))
    threshold = min(int(round(p * (1 << 24))), 1 << 24)
    return (x >> 8) >= threshold


def draw_seed() -> int:
    """A dropout seed from torch's default generator (so ``torch.manual_seed`` makes it reproducible)."""
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


# ------------------------------------------------------------------------- the work


_LOCAL = threading.local()


_Workspaces = dict[tuple[str, torch.dtype, str], Tensor]  # (name, dtype, device) -> flat tensor


def _workspaces() -> _Workspaces:
    """This thread's gather workspaces ``{(name, dtype, device): flat tensor}`` (threads never share one)."""
    ws: _Workspaces | None = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = {}
    return ws


@dataclass
class Work:
    """Everything one forward/backward needs: the padded flat tensors, the plan and the settings."""

    plan: Plan
    batch: int
    hq: int
    hkv: int
    q3: Tensor  # (B*Hq, Lq_pad, D) input dtype, rows contiguous within a head (k3/v3 too; contiguous for gathers)
    k3: Tensor  # (B*Hkv, Lk_pad, D)
    v3: Tensor  # (B*Hkv, Lk_pad, Dv)
    scale: float
    softcap: float | None
    mask: Mask | None
    bias: Tensor | ScoreMod | None  # (B', H', Lq', Lk') float tensor | ScoreMod | None
    dropout_p: float
    seed: int
    fused: bool  # forward on the fused kernel
    bias_params: list[Tensor] = field(default_factory=list)  # tensors of a ScoreMod that need grads
    buffers: _Workspaces = field(default_factory=dict)  # gather workspaces too big to keep between calls
    bias_neginf: bool = False  # the tensor bias holds -inf: rows it leaves empty must get lse = -inf

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A reusable workspace: fresh large tensors are page-faulted in on first touch, which costs
        far more (~10x) than the gather that fills them, so gather workspaces are kept per thread
        between calls (up to ``WORKSPACE_BYTES``; bigger ones only for the chunks of one call)."""
        n = math.prod(shape)
        dev = self.q3.device
        keep = n * dtype.itemsize <= WORKSPACE_BYTES
        store = _workspaces() if keep else self.buffers
        key = (name, dtype, str(dev))
        buf = store.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=dev)
            store[key] = buf
        return buf[:n].view(shape)

    @property
    def acc(self) -> torch.dtype:
        return accumulation_dtype(self.q3.dtype)

    @property
    def lse_dtype(self) -> torch.dtype:
        return torch.promote_types(self.acc, torch.float32)

    @property
    def mask_dtype(self) -> torch.dtype:
        """dtype of the float mask handed to the fused kernel (float32 for half inputs)."""
        return self.acc


@dataclass
class Chunk:
    """Items ``[i0, i1)`` of a job: ``N`` query blocks of ``R`` rows, each with a window of ``W`` keys."""

    job: Job
    N: int
    R: int
    qrows: Tensor  # (N, R) query rows (padded coordinates)
    q_consecutive: bool
    qstart: int
    kcols: Tensor  # (N, W) key columns
    band: bool
    kstart: int
    kstep: int  # keys between the windows of consecutive items (bands)
    kinds: Tensor  # (N, w)
    first: bool  # writes its rows (the job's first chunk over them); later ones merge
    tiles: Tensor | None = None  # (N, w) gathered key tiles (gather chunks)
    block_k: int = 0

    @property
    def W(self) -> int:
        return self.kcols.shape[1]


def _split_full(ch: Chunk, bk: int) -> Iterator[Chunk]:
    """A tall shared-window chunk whose element mask would be large computes its runs of all-full key
    tiles without a mask and the rest with one (then merges): a causal block's prefix, a document's
    interior.  (Bands keep one call: their mask is one window pattern shared by every item.)"""
    full = (ch.kinds == FULL).all(0).tolist()  # (w,)
    if ch.N > 1 or ch.R * ch.W <= SPLIT_MASK_ELEMENTS or all(full) or not any(full):
        yield ch
        return
    runs, a = [], 0
    for j in range(1, len(full) + 1):
        if j == len(full) or full[j] != full[a]:
            runs.append((a, j))
            a = j
    for i, (a, b) in enumerate(runs):
        yield Chunk(
            ch.job,
            ch.N,
            ch.R,
            ch.qrows,
            ch.q_consecutive,
            ch.qstart,
            ch.kcols[:, a * bk : b * bk],
            ch.band,
            ch.kstart + a * bk if ch.band else 0,
            ch.kstep,
            ch.kinds[:, a:b],
            ch.first and i == 0,
            None if ch.tiles is None else ch.tiles[:, a:b],
            ch.block_k,
        )


def chunks(work: Work, job: Job, per_item: int) -> Iterator[Chunk]:
    """Split a job into chunks whose temporaries stay under ``WORK_ELEMENTS`` (and big masked chunks
    into their full and partial key ranges)."""
    for ch in _chunks(work, job, per_item):
        yield from _split_full(ch, work.plan.block_k)


def _chunks(work: Work, job: Job, per_item: int) -> Iterator[Chunk]:
    plan = work.plan
    bq, bk = plan.block_q, plan.block_k
    n, W = job.n, job.w * bk
    step = max(1, WORK_ELEMENTS // max(1, per_item))
    if job.tiles is not None:  # gathered windows: a chunk's copies fit the kept workspace
        d = work.k3.shape[-1] + work.v3.shape[-1]
        step = max(1, min(step, GATHER_ELEMENTS // max(1, job.heads.kcount * W * d)))
    merged = job.tiles is None and job.kstep == 0  # every row shares one window: one tall query block
    ar_r, ar_w = torch.arange(bq), torch.arange(W)
    for i0 in range(0, n, step):
        i1 = min(n, i0 + step)
        rows = job.rows[i0:i1]
        if merged:
            qstart = int(rows[0]) * bq
            R = (i1 - i0) * bq
            yield Chunk(
                job,
                1,
                R,
                (qstart + torch.arange(R)).view(1, R),
                True,
                qstart,
                (job.k0 * bk + ar_w).view(1, W),
                True,
                job.k0 * bk,
                0,
                job.kinds[i0:i1].amin(0, keepdim=True),
                job.first,
            )
            continue
        N = i1 - i0
        qrows = rows.view(-1, 1) * bq + ar_r
        tiles = None if job.tiles is None else job.tiles[i0:i1]
        if tiles is None:  # a band: each item's window a fixed step after the last one's
            kstart, kstep, block_k = (job.k0 + i0 * job.kstep) * bk, job.kstep * bk, 0
            kcols = kstart + torch.arange(N).view(-1, 1) * kstep + ar_w
        else:  # gathered key tiles
            kstart, kstep, block_k = 0, 0, bk
            kcols = (tiles[:, :, None] * bk + torch.arange(bk)).reshape(N, W)
        yield Chunk(
            job,
            N,
            bq,
            qrows,
            job.consecutive,
            int(rows[0]) * bq,
            kcols,
            tiles is None,
            kstart,
            kstep,
            job.kinds[i0:i1],
            job.first,
            tiles,
            block_k,
        )


# ------------------------------------------------------------------- views and scatters


def _heads_slice(x: Tensor, start: int, step: int, count: int) -> Tensor:
    return x[start : start + step * (count - 1) + 1 : step]


def rows_of(x: Tensor, heads: Heads, ch: Chunk) -> Tensor:
    """The chunk's query rows of a flat ``(B*Hq, L_pad, ...)`` tensor as ``(N, count, R, ...)``.  Each head's
    rows are contiguous; heads may lie further apart (``x.stride(0)``: a sequence's rows in a packed buffer)."""
    lp, hs = x.shape[1], x.stride(0)
    tail = tuple(x.shape[2:])
    e = int(math.prod(tail)) if tail else 1
    if ch.q_consecutive:
        size = (ch.N, heads.count, ch.R, *tail)
        stride = (ch.R * e, heads.qstep * hs, e, *([1] if tail else []))
        return x.as_strided(size, stride, x.storage_offset() + heads.q0 * hs + ch.qstart * e)
    xs = _heads_slice(x, heads.q0, heads.qstep, heads.count).view(heads.count, lp // ch.R, ch.R * e)
    g = xs.index_select(1, (ch.qrows[:, 0] // ch.R).to(x.device))  # (count, N, R*e): whole tiles
    return g.view(heads.count, ch.N, ch.R, *tail).transpose(0, 1)


def put_rows(x: Tensor, heads: Heads, ch: Chunk, value: Tensor, *, add: bool) -> None:
    """Write (or add) ``value (N, count, R, ...)`` into the chunk's rows of ``x``."""
    if ch.q_consecutive:
        view = rows_of(x, heads, ch)
        view.add_(value) if add else view.copy_(value)
        return
    lp, e = x.shape[1], int(math.prod(x.shape[2:]))
    xs = _heads_slice(x, heads.q0, heads.qstep, heads.count).view(heads.count, lp // ch.R, ch.R * e)
    idx = (ch.qrows[:, 0] // ch.R).to(x.device)  # whole query tiles
    flat = value.transpose(0, 1).reshape(heads.count, ch.N, ch.R * e).to(x.dtype)
    xs.index_add_(1, idx, flat) if add else xs.index_copy_(1, idx, flat)


def lse_rows(x: Tensor, heads: Heads, ch: Chunk) -> Tensor:
    """The chunk's rows of a log-sum-exp kept row-major as ``(L_pad, B*Hq)`` (the fused kernel's own
    order, so writing its result is a plain copy) as ``(N, count, R)``."""
    nh = x.shape[1]
    if ch.q_consecutive:
        return x.as_strided(
            (ch.N, heads.count, ch.R), (ch.R * nh, heads.qstep, nh), x.storage_offset() + ch.qstart * nh + heads.q0
        )
    xs = _heads_slice(x.t(), heads.q0, heads.qstep, heads.count).t()  # (L_pad, count)
    g = xs.index_select(0, ch.qrows.reshape(-1).to(x.device))  # (N*R, count)
    return g.view(ch.N, ch.R, heads.count).permute(0, 2, 1)


def put_lse(x: Tensor, heads: Heads, ch: Chunk, value: Tensor) -> None:
    """Write ``value (N, count, R)`` into the chunk's rows of a row-major ``(L_pad, B*Hq)`` lse."""
    if ch.q_consecutive:
        lse_rows(x, heads, ch).copy_(value)
        return
    xs = _heads_slice(x.t(), heads.q0, heads.qstep, heads.count).t()
    flat = value.permute(0, 2, 1).reshape(ch.N * ch.R, heads.count).to(x.dtype)
    xs.index_copy_(0, ch.qrows.reshape(-1).to(x.device), flat)


def keys_of(x: Tensor, heads: Heads, ch: Chunk, buf: Tensor | None = None) -> Tensor:
    """The chunk's key windows of a flat ``(B*Hkv, Lk_pad, E)`` tensor (rows contiguous within a head; contiguous
    for gathered windows) as ``(N, kcount, W, E)``; gathered windows are written into ``buf``
    (``(kcount, N*w, bk*E)``) when given."""
    lp, e, hs = x.shape[1], x.shape[2], x.stride(0)
    if ch.band:
        size = (ch.N, heads.kcount, ch.W, e)
        stride = (ch.kstep * e, heads.kstep * hs, e, 1)
        return x.as_strided(size, stride, x.storage_offset() + heads.k0 * hs + ch.kstart * e)
    bk = ch.block_k
    nt = lp // bk
    # one gather of (head, key tile) rows of the contiguous flat tensor, along dim 0 (PyTorch splits that
    # copy among its threads, not the one along dim 1)
    first = (heads.k0 + heads.kstep * torch.arange(heads.kcount, device=x.device)) * nt
    tiles = cast(Tensor, ch.tiles)  # (a gather chunk)
    rows = (first.view(-1, 1) + tiles.reshape(1, -1).to(x.device)).reshape(-1)
    g = torch.index_select(x.view(-1, bk * e), 0, rows, out=None if buf is None else buf.view(-1, bk * e))
    return g.view(heads.kcount, ch.N, ch.W, e).transpose(0, 1)  # from (kcount * N * w, bk * E)


def kv_of(work: Work, ch: Chunk) -> tuple[Tensor, Tensor]:
    """The chunk's key and value windows ``(N, kcount, W, D)``, ``(N, kcount, W, Dv)``: strided views for
    bands, gathered tiles (into reused workspaces) otherwise."""
    heads = ch.job.heads
    if ch.band:
        return keys_of(work.k3, heads, ch), keys_of(work.v3, heads, ch)
    n = ch.N * (ch.W // ch.block_k)
    bk = ch.block_k
    kb = work.buffer("k", (heads.kcount, n, bk * work.k3.shape[-1]), work.k3.dtype)
    vb = work.buffer("v", (heads.kcount, n, bk * work.v3.shape[-1]), work.v3.dtype)
    return keys_of(work.k3, heads, ch, kb), keys_of(work.v3, heads, ch, vb)


def add_keys(x: Tensor, heads: Heads, ch: Chunk, value: Tensor) -> None:
    """Add window gradients ``value (N, kcount, W, E)`` into ``x`` (windows may overlap)."""
    lp, e = x.shape[1], x.shape[2]
    if not ch.band:
        bk = ch.block_k
        xs = _heads_slice(x, heads.k0, heads.kstep, heads.kcount).view(heads.kcount, lp // bk, bk * e)
        flat = value.transpose(0, 1).reshape(heads.kcount, ch.N * (ch.W // bk), bk * e)
        xs.index_add_(1, cast(Tensor, ch.tiles).reshape(-1).to(x.device), flat.to(x.dtype))  # (a gather chunk)
        return
    base = x.storage_offset() + heads.k0 * x.stride(0) + ch.kstart * e
    hstride = heads.kstep * x.stride(0)
    if ch.N == 1 or ch.kstep == 0:
        x.as_strided((heads.kcount, ch.W, e), (hstride, e, 1), base).add_(value[0] if ch.N == 1 else value.sum(0))
        return
    step = ch.kstep
    for p0 in range(0, ch.W, step):  # pieces of one window step: those of different items never overlap
        r = min(step, ch.W - p0)
        view = x.as_strided((ch.N, heads.kcount, r, e), (step * e, hstride, e, 1), base + p0 * e)
        view.add_(value[:, :, p0 : p0 + r])


# ------------------------------------------------------------------ masks and biases


def _index_shapes(work: Work, heads: Heads, ch: Chunk, grouped: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tensors (batch, head, query row, key) for the chunk's scores.

    grouped: scores laid out (N, kcount, G, R, W) (explicit path); else (N, count, R, W) (fused mask).
    Rows and keys past the real lengths are clamped (their scores are discarded or masked).
    """
    dev = work.q3.device
    nh = heads.q0 + heads.qstep * torch.arange(heads.count, device=dev)
    b, h = nh // work.hq, nh % work.hq
    q = ch.qrows.to(dev).clamp(max=work.plan.q_len - 1)
    k = ch.kcols.to(dev).clamp(max=work.plan.kv_len - 1)
    if grouped:
        g = heads.count // heads.kcount
        hs: tuple[int, ...] = (1, heads.kcount, g, 1, 1)
        return b.view(hs), h.view(hs), q.view(ch.N, 1, 1, ch.R, 1), k.view(ch.N, 1, 1, 1, ch.W)
    hs = (1, heads.count, 1, 1)
    return b.view(hs), h.view(hs), q.view(ch.N, 1, ch.R, 1), k.view(ch.N, 1, 1, ch.W)


def _squeeze_to(x: object, shape: tuple[int, ...], what: str) -> Tensor:
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    while x.dim() > len(shape):
        if x.shape[0] != 1:
            raise ValueError(
                f"{what} returned shape {tuple(x.shape)} for index tensors of shape {shape}: it varies "
                f"along a batch/head dimension its block structure said it does not depend on"
            )
        x = x[0]
    return x.expand(shape)


def _eval_mask(work: Work, heads: Heads, rows: Tensor, cols: Tensor) -> Tensor:
    """The element mask (N, R, Wc) on the given rows (N, R) and columns (N, Wc), padding masked."""
    plan = work.plan
    dev = work.q3.device
    rows, cols = rows.to(dev), cols.to(dev)
    valid = (cols < plan.kv_len)[:, None, :]
    shape = (rows.shape[0], rows.shape[1], cols.shape[1])
    if work.mask is None:
        return valid.expand(shape)
    b = torch.tensor(heads.b or 0, device=dev).view(1, 1, 1)
    h = torch.tensor(heads.h or 0, device=dev).view(1, 1, 1)
    q = rows.clamp(max=plan.q_len - 1)[:, :, None]
    k = cols.clamp(max=plan.kv_len - 1)[:, None, :]
    allowed = work.mask.evaluate(b, h, q, k, plan.q_len, plan.kv_len)
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        raise TypeError(f"{work.mask!r}: the mask function must return a bool tensor")
    return _squeeze_to(allowed, shape, repr(work.mask)) & valid


def element_mask(work: Work, ch: Chunk) -> Tensor | None:
    """The chunk's element mask ``(N or 1, R, W)`` bool, or None when every tile is full.

    Only key-tile slots holding a partial tile are evaluated; a mask equal for every item (a sliding
    window, a causal diagonal) collapses to one item so the kernel reads it from cache.
    """
    need = (ch.kinds != FULL).any(0)  # (w,)
    if not bool(need.any()):
        return None
    bk = work.plan.block_k
    if bool(need.all()):
        m = _eval_mask(work, ch.job.heads, ch.qrows, ch.kcols)
    else:
        m = torch.ones(ch.N, ch.R, ch.W, dtype=torch.bool, device=work.q3.device)
        slots = need.tolist()
        j = 0
        while j < len(slots):
            if not slots[j]:
                j += 1
                continue
            j1 = j
            while j1 < len(slots) and slots[j1]:
                j1 += 1
            m[:, :, j * bk : j1 * bk] = _eval_mask(work, ch.job.heads, ch.qrows, ch.kcols[:, j * bk : j1 * bk])
            j = j1
    if m.shape[0] > 1 and bool((m == m[:1]).all()):
        m = m[:1]
    return m


MASK_CACHE_BYTES = 32 << 20  # element masks kept on a plan (beyond this they are re-evaluated on use)
FLOAT_MASK_CACHE_ELEMENTS = 1 << 20  # float masks for the fused kernel kept per chunk (4 MB in float32)


@dataclass
class Prepared:
    """A chunk with its element mask, evaluated once and kept on the plan (when small enough)."""

    chunk: Chunk
    mask: Tensor | None  # (N|1, R, W) bool; None when every tile is full (or when lazy)
    lazy: bool  # too big to keep: evaluate the mask on use
    live: Tensor | None  # (N|1, 1, R) rows with at least one allowed key; None when all are
    causal: bool = False  # the element mask is exactly the lower triangle of a square block
    fmask: dict[torch.dtype, Tensor] = field(default_factory=dict)  # float masks for the fused kernel, by dtype
    seen: Tensor | None = None  # (N|1, W) keys some row of the chunk may see; None when all are

    def element_mask(self, work: "Work") -> Tensor | None:
        if self.causal:
            ch = self.chunk
            return torch.ones(ch.R, ch.W, dtype=torch.bool, device=work.q3.device).tril()[None]
        return element_mask(work, self.chunk) if self.lazy else self.mask

    def kv(self, work: "Work", m: Tensor | None) -> tuple[Tensor, Tensor]:
        """The chunk's key and value windows (``kv_of``), with the keys no row of the chunk may see zeroed
        (``zero_unseen``) when there are any: NaN or inf in padding must not reach the rows that are seen.
        Such keys lie only in partial tiles, so full tiles (the common case) are read where they are."""
        kw, vw = kv_of(work, self.chunk)
        seen = seen_keys(work, self.chunk, m) if self.lazy else self.seen
        if seen is None:
            return kw, vw
        seen = seen[:, None, :]  # (N|1, 1, W) against (N, kcount, W, .)
        return zero_unseen(kw, seen), zero_unseen(vw, seen)

    def kernel_causal(self, work: "Work") -> bool:
        """Whether the fused kernel's own ``is_causal`` replaces the mask (it cannot add a bias too, and it
        gives NaN for a negative scale)."""
        return self.causal and work.bias is None and work.scale > 0

    def float_mask(self, work: "Work", m: Tensor | None) -> Tensor | None:
        if self.kernel_causal(work):
            return None
        if work.bias is not None or m is None or self.lazy:
            return float_mask(work, self.chunk.job.heads, self.chunk, m)
        dt = work.mask_dtype
        if dt in self.fmask:
            return self.fmask[dt]
        fm = cast(Tensor, float_mask(work, self.chunk.job.heads, self.chunk, m))  # (m is a mask: a tensor)
        if fm.numel() <= FLOAT_MASK_CACHE_ELEMENTS:  # a broadcast window pattern: keep it
            self.fmask[dt] = fm
        return fm


def seen_keys(work: Work, ch: Chunk, m: Tensor | None) -> Tensor | None:
    """``(N|1, W)`` bool: the chunk's keys some row may see under its element mask ``m`` (padding past Lk,
    zeros already, counts as seen), or None when every key is."""
    if m is None:
        return None
    seen = m.any(1) | (ch.kcols >= work.plan.kv_len).to(m.device)  # (N|1, W) | (N, W)
    if seen.shape[0] > 1 and bool((seen == seen[:1]).all()):
        seen = seen[:1]
    return None if bool(seen.all()) else seen


def prepared(work: Work, fused: bool, backward: bool) -> list[tuple[Job, list[Prepared]]]:
    """The plan's jobs split into chunks for one path and direction, with their element masks."""
    plan = work.plan
    key = ("chunks", fused, backward, work.bias is not None, str(work.q3.device))
    if key in plan.cache:
        return cast("list[tuple[Job, list[Prepared]]]", plan.cache[key])
    budget = MASK_CACHE_BYTES - plan.cache.get("mask_bytes", 0)
    out: list[tuple[Job, list[Prepared]]] = []
    for job in plan.jobs:
        items: list[Prepared] = []
        for ch in chunks(work, job, _per_item(work, job.heads, job, backward, fused)):
            partial = bool((ch.kinds != FULL).any())
            size = ch.N * ch.R * ch.W
            m = element_mask(work, ch) if partial and (size <= budget or ch.R == ch.W) else None
            if m is not None and ch.R == ch.W and m.shape[0] == 1 and torch.equal(m[0], torch.ones_like(m[0]).tril()):
                items.append(Prepared(ch, None, False, None, causal=True))  # the kernel's is_causal does it
                continue
            if partial and size > budget:
                items.append(Prepared(ch, None, True, None))
                continue
            live = None
            if m is not None:
                budget -= m.numel()
                live = m.any(-1)[:, None]
                live = None if bool(live.all()) else live
            items.append(Prepared(ch, m, False, live, seen=seen_keys(work, ch, m)))
        out.append((job, items))
    plan.cache["mask_bytes"] = MASK_CACHE_BYTES - budget
    plan.cache[key] = out
    return out


def bias_block(
    work: Work, heads: Heads, ch: Chunk, grouped: bool, dtype: torch.dtype, score: Tensor | None = None
) -> Tensor:
    """The bias on the chunk's scores: a gathered tensor-bias block, or a score modifier applied.

    With ``score`` given (explicit path) returns the modified score; otherwise the additive term alone.
    """
    b, h, q, k = _index_shapes(work, heads, ch, grouped)
    bias = cast("Tensor | ScoreMod", work.bias)  # (called only with a bias)
    if isinstance(bias, ScoreMod):
        base = torch.zeros((), dtype=dtype, device=q.device) if score is None else score
        out = bias.apply(base, b, h, q, k, work.plan.q_len, work.plan.kv_len)
        return out.to(dtype) if score is None else out
    block = bias[
        b if bias.shape[0] > 1 else 0,
        h if bias.shape[1] > 1 else 0,
        q if bias.shape[2] > 1 else 0,
        k if bias.shape[3] > 1 else 0,
    ].to(dtype)
    return block if score is None else score + block


def bias_index(work: Work, heads: Heads, ch: Chunk) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tuple into the (B', H', Lq', Lk') bias for the grouped score layout (for its gradient)."""
    b, h, q, k = _index_shapes(work, heads, ch, True)
    bias = cast(Tensor, work.bias)  # (a tensor bias: only it has a gradient here)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return (
        b if bias.shape[0] > 1 else zero,
        h if bias.shape[1] > 1 else zero,
        q if bias.shape[2] > 1 else zero,
        k if bias.shape[3] > 1 else zero,
    )


def _add_bias_grad(dbias: Tensor, index: tuple[Tensor, ...], dx: Tensor) -> None:
    """Accumulate the scores' gradient ``dx`` into the bias gradient at ``index``: summed first over the
    dims the bias broadcasts along (where the index does not vary), so every value lands once per element."""
    shape = torch.broadcast_shapes(*(i.shape for i in index))  # type: ignore[no-untyped-call]  # (unannotated in PyTorch)
    full = (1,) * (dx.dim() - len(shape)) + tuple(shape)
    dims = [d for d in range(dx.dim()) if full[d] == 1 and dx.shape[d] > 1]
    value = dx.sum(dims, keepdim=True) if dims else dx
    dbias.index_put_(index, value.reshape(shape).to(dbias.dtype), accumulate=True)


def float_mask(work: Work, heads: Heads, ch: Chunk, m: Tensor | None) -> Tensor | None:
    """The float ``attn_mask`` for the fused kernel: the additive bias with -inf where the mask forbids."""
    dt = work.mask_dtype
    if work.bias is not None:
        fm = bias_block(work, heads, ch, False, dt).expand(ch.N, heads.count, ch.R, ch.W).contiguous()
        if m is not None:
            fm.masked_fill_(~m[:, None], float("-inf"))
        return fm
    if m is None:
        return None
    return torch.zeros(m.shape[0], 1, ch.R, ch.W, dtype=dt, device=m.device).masked_fill_(~m[:, None], float("-inf"))


# ------------------------------------------------------------------------- explicit path


def _scores(work: Work, heads: Heads, ch: Chunk, qw: Tensor, kw: Tensor) -> tuple[Tensor, Tensor]:
    """Scaled scores ``(q·k) * scale`` (N, kcount, G, R, W) in the accumulation dtype, and the grouped
    queries (N, kcount, G*R, D) they came from.  The scale multiplies the products, as the textbook formula
    does, rather than being folded into the queries: at scores of magnitude 30 and more, the rounding of
    ``q * scale`` moves every score by about an ulp, which the softmax turns into relative errors of the
    weights several times the formula's own."""
    g = heads.count // heads.kcount
    qg = qw.reshape(ch.N, heads.kcount, g * ch.R, qw.shape[-1]).to(work.acc)  # (N, Hkv, G*R, D)
    s = torch.matmul(qg, kw.to(work.acc).transpose(-1, -2)).mul_(work.scale)  # (N, Hkv, G*R, W)
    return s.view(ch.N, heads.kcount, g, ch.R, ch.W), qg


def _modify(
    work: Work, heads: Heads, ch: Chunk, x: Tensor, m: Tensor | None, inplace: bool
) -> tuple[Tensor, Tensor | None]:
    """softcap, bias, mask on scaled scores in the grouped layout; also returns ``tanh`` of the softcap
    (for its derivative).  ``inplace`` overwrites ``x`` (no autograd through it)."""
    t = None
    if work.softcap is not None:
        if inplace:
            t = x.div_(work.softcap).tanh_()
            x = t.mul(work.softcap)
        else:
            x = work.softcap * torch.tanh(x / work.softcap)
    if work.bias is not None:
        if inplace and not isinstance(work.bias, ScoreMod):
            x = x.add_(bias_block(work, heads, ch, True, work.acc))
        else:
            x = bias_block(work, heads, ch, True, work.acc, score=x)
    if m is not None:
        fill = ~m[:, None, None]
        x = x.masked_fill_(fill, float("-inf")) if inplace else x.masked_fill(fill, float("-inf"))
    return x, t


def _keep(work: Work, heads: Heads, ch: Chunk) -> Tensor:
    dev = work.q3.device
    nh = heads.q0 + heads.qstep * torch.arange(heads.count, device=dev)
    g = heads.count // heads.kcount
    hs = (1, heads.kcount, g, 1, 1)
    b, h = (nh // work.hq).view(hs), (nh % work.hq).view(hs)
    q = ch.qrows.to(dev).view(ch.N, 1, 1, ch.R, 1)
    k = ch.kcols.to(dev).view(ch.N, 1, 1, 1, ch.W)
    return dropout_keep(work.seed, b, h, q, k, work.dropout_p)


def explicit_forward(work: Work, item: Prepared, m: Tensor | None) -> tuple[Tensor, Tensor]:
    """One chunk by matmuls and a float32 softmax: ``(out (N, count, R, Dv), lse (N, count, R))``."""
    ch = item.chunk
    heads = ch.job.heads
    g = heads.count // heads.kcount
    qw, (kw, vw) = rows_of(work.q3, heads, ch), item.kv(work, m)
    s, _ = _scores(work, heads, ch, qw, kw)
    x, _ = _modify(work, heads, ch, s, m, inplace=True)
    mx = x.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    p = x.sub_(mx).exp_()  # unnormalised weights, in place
    l = p.sum(-1, keepdim=True)  # noqa: E741
    # in float64: the rows several chunks cover merge these, and an lse of magnitude 30 rounded to float32 at
    # every merge would drift by several ulps (the result is rounded once, in ``forward``)
    wide = _merge_dtype(l.device)
    lse = torch.where(l > 0, mx.to(wide) + torch.log(l.to(wide)), float("-inf"))
    if work.dropout_p > 0:
        p.mul_(_keep(work, heads, ch)).mul_(1.0 / (1.0 - work.dropout_p))
    o = torch.matmul(p.view(ch.N, heads.kcount, g * ch.R, ch.W), vw.to(work.acc))  # (N, Hkv, G*R, Dv)
    o.div_(torch.where(l > 0, l, torch.ones_like(l)).view(ch.N, heads.kcount, g * ch.R, 1))
    return o.view(ch.N, heads.count, ch.R, -1), lse.view(ch.N, heads.count, ch.R)


# ------------------------------------------------------------------------------ drivers


def _merge_dtype(device: torch.device | str) -> torch.dtype:
    """dtype in which partial log-sum-exps are formed and merged: float64 (O(Lq) values), where it exists."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def _merge_into(o_acc: Tensor, l_acc: Tensor, o: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:  # noqa: E741
    """Online-softmax merge of a partial result (o, l) into (o_acc, l_acc); returns the new pair.

    ``lse = logaddexp(l_acc, l)`` and ``out = o_acc + (o - o_acc) * exp(l - lse)``; a row empty on both
    sides keeps ``lse = -inf`` and its zero output (the NaN weight of -inf - -inf is zeroed)."""
    lse = torch.logaddexp(l_acc, l)
    w = torch.exp(l - lse).nan_to_num_(0.0)
    return torch.lerp(o_acc, o.to(o_acc.dtype), w[..., None].to(o_acc.dtype)), lse


def _per_item(work: Work, heads: Heads, job: Job, backward: bool, fused: bool) -> int:
    bk, bq = work.plan.block_k, work.plan.block_q
    W = job.w * bk
    d = work.q3.shape[-1] + work.v3.shape[-1]
    shared = job.tiles is None and job.kstep == 0  # one window for all rows: its gradients do not grow
    windows = 0 if shared else heads.kcount * W * d
    if fused:
        partial = bool((job.kinds != FULL).any())
        per = (bq * W if partial else 0) + (heads.count * bq * W if work.bias is not None else 0)
        return per + (windows if backward else 0)  # gathered windows: bounded by GATHER_ELEMENTS
    return 3 * heads.count * bq * W + 2 * windows


def forward(work: Work) -> tuple[Tensor, Tensor]:
    """Run the plan: ``(out (B*Hq, Lq_pad, Dv), lse (Lq_pad, B*Hq))``; ``out`` in the accumulation dtype
    (or the input dtype when the fused kernel wrote every row once)."""
    plan = work.plan
    nh, dv = work.q3.shape[0], work.v3.shape[-1]
    dev = work.q3.device
    if work.fused and plan.whole_causal and work.bias is None and work.scale > 0:  # one call: the kernel's causal
        o, l = cast("Fused", FUSED)[0](work.q3[None], work.k3[None], work.v3[None], 0.0, True, scale=work.scale)  # noqa: E741
        return o[0], l[0].t()
    jobs = prepared(work, work.fused, False)
    if (
        work.fused
        and plan.covered
        and all(i.chunk.first and i.chunk.q_consecutive and j.heads.count == nh for j, its in jobs for i in its)
    ):
        return _forward_pieces(work)
    new = torch.empty if plan.covered else torch.zeros
    out = new(nh, plan.q_pad, dv, dtype=work.acc, device=dev)
    # (Lq_pad, B*Hq): partial lses are merged unrounded (see explicit_forward)
    lse = (torch.empty if plan.covered else torch.zeros)(plan.q_pad, nh, dtype=_merge_dtype(dev), device=dev)
    if not plan.covered:
        lse.fill_(float("-inf"))
    for job, items in prepared(work, work.fused, False):
        heads = job.heads
        for item in items:
            ch = item.chunk
            if work.fused:
                o, l = _fused_chunk(work, item)  # noqa: E741
            else:
                o, l = explicit_forward(work, item, item.element_mask(work))  # noqa: E741
            if ch.first:
                put_rows(out, heads, ch, o, add=False)
                put_lse(lse, heads, ch, l)
            elif ch.q_consecutive:  # merge in place into the output rows
                acc_l = lse_rows(lse, heads, ch)
                new_l = torch.logaddexp(acc_l, l.to(lse.dtype))
                w = torch.exp(l - new_l).nan_to_num_(0.0)
                rows_of(out, heads, ch).lerp_(o.to(out.dtype), w[..., None].to(out.dtype))
                acc_l.copy_(new_l)
            else:
                o_new, l_new = _merge_into(rows_of(out, heads, ch), lse_rows(lse, heads, ch), o, l.to(lse.dtype))
                put_rows(out, heads, ch, o_new, add=False)
                put_lse(lse, heads, ch, l_new)
    return out, lse.to(work.lse_dtype)


def _fused_chunk(work: Work, item: Prepared) -> tuple[Tensor, Tensor]:
    """One chunk on the fused kernel: ``(out (N, count, R, Dv), lse (N, count, R))``, -inf lse on rows
    that may attend to nothing here."""
    ch, heads = item.chunk, item.chunk.job.heads
    m = None if item.kernel_causal(work) else item.element_mask(work)
    qw, (kw, vw) = rows_of(work.q3, heads, ch), item.kv(work, m)
    o, l = cast("Fused", FUSED)[0](  # noqa: E741  (work.fused: this build has the kernel)
        qw,
        kw,
        vw,
        0.0,
        item.kernel_causal(work),
        attn_mask=item.float_mask(work, m),
        scale=work.scale,
    )
    live = item.live if not item.lazy else (None if m is None else m.any(-1)[:, None])
    if work.bias_neginf:  # a row the bias leaves without a finite score attends to nothing (the kernel says 0)
        fm = cast(Tensor, item.float_mask(work, m))  # (there is a bias: a tensor)
        seen = (fm != float("-inf")).any(-1)
        live = seen if live is None else live & seen
    if live is not None:  # rows with nothing to see: output 0 (a NaN in a key they cannot see stays out)
        l = torch.where(live, l, torch.full_like(l, float("-inf")))  # noqa: E741
        o = torch.where(live[..., None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    return o, l


def _forward_pieces(work: Work) -> tuple[Tensor, Tensor]:
    """Every row written once by a call over all heads (the usual band plan): concatenate the calls'
    outputs in row order (one copy) instead of copying each into a preallocated output."""
    nh = work.q3.shape[0]
    pieces: list[tuple[int, Tensor, Tensor]] = []
    for _, items in prepared(work, True, False):
        for item in items:
            o, l = _fused_chunk(work, item)  # noqa: E741
            ch = item.chunk
            pieces.append(
                (ch.qstart, o.transpose(0, 1).reshape(nh, ch.N * ch.R, -1), l.permute(0, 2, 1).reshape(ch.N * ch.R, nh))
            )
    pieces.sort(key=lambda p: p[0])
    if len(pieces) == 1:
        return pieces[0][1], pieces[0][2]
    return torch.cat([p[1] for p in pieces], dim=1), torch.cat([p[2] for p in pieces], dim=0)
