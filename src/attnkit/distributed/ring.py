"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each of the ``W`` ranks holds ``L / W`` queries, keys and values (see :func:`attnkit.distributed.shard`).
The key/value blocks travel around the ring (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``)
with batched point-to-point ops that run while the rank computes on the block it holds; partial results
over each block are merged in float32 with their log-sum-exps (:func:`attnkit.softmax.merge`).  The
backward pass sends the key/value blocks around once more, together with their gradient accumulators,
and recomputes each block's scores from ``(q, k, out, lse)``.

Masks and score modifiers are evaluated at *global* positions, so every mask of :mod:`attnkit.masks` and
modifier of :mod:`attnkit.bias` means what it means on one process.  The mask's block structure over the
global ``L x L`` score matrix says which (query tile, key tile) pairs are empty: those are never computed,
and when the trailing steps of the ring are empty on every rank (a sliding window with
``layout="contiguous"``) the ring stops early and the gradients go straight home.

Within one step a rank works through its (query rows, key columns) items of at most ``_BLOCK`` rows and
``4 * _BLOCK`` columns, so the memory a step needs does not grow with ``L``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._checks import flag, int_in_range
from ..backends.call import check_qkv, check_sinks, make_call
from ..backends.scores import zero_unseen
from ..bias import ScoreMod
from ..functional import attention
from ..masks import EMPTY, FULL, Mask
from ..softmax import add_sink_unchecked as add_sink  # (inputs checked by the call)
from ..softmax import merge
from ._layout import Layout, check_divisible, check_layout, group_info

Tensor = torch.Tensor

__all__ = ["ring_attention", "ring_context", "RingContext"]

_BLOCK = 256  # query rows per work item (and the key-tile width used to find empty tiles); 4x that in keys

_profile: dict | None = None  # set to a dict to accumulate per-rank timings (benchmarks/ring.py reads it)


# ------------------------------------------------------------------ global positions


class _Placed(Mask):
    """``inner`` evaluated at global positions: local row ``i`` is position ``row0 + i``, column ``j`` is
    ``col0 + j``, in a ``seq_len x seq_len`` score matrix."""

    def __init__(self, inner: Mask, row0: int, col0: int, seq_len: int):
        self.inner, self.row0, self.col0, self.seq_len = inner, row0, col0, seq_len

    def evaluate(self, b, h, q, k, q_len, kv_len):
        return self.inner.evaluate(b, h, q + self.row0, k + self.col0, self.seq_len, self.seq_len)

    def batch_size(self):
        return self.inner.batch_size()

    def __repr__(self):
        return f"placed({self.inner!r}, rows from {self.row0}, keys from {self.col0}, L={self.seq_len})"


class _PlacedBias(ScoreMod):
    """A score modifier evaluated at global positions (see :class:`_Placed`)."""

    def __init__(self, inner: ScoreMod, row0: int, col0: int, seq_len: int):
        self.inner, self.row0, self.col0, self.seq_len = inner, row0, col0, seq_len
        self.additive, self.scale_factor = inner.additive, inner.scale_factor

    def apply(self, score, b, h, q, k, q_len, kv_len):
        return self.inner.apply(score, b, h, q + self.row0, k + self.col0, self.seq_len, self.seq_len)

    def __repr__(self):
        return f"placed({self.inner!r}, rows from {self.row0}, keys from {self.col0}, L={self.seq_len})"


# ------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class _Item:
    """One piece of work: local query ``rows`` against the ``cols`` of the key block being held."""

    rows: slice
    cols: slice
    row0: int  # global position of rows.start
    col0: int  # global position of cols.start
    masked: bool  # some tile inside is partial: the mask must be evaluated elementwise


@dataclass
class _Plan:
    hops: int  # ring steps after the first: step i (0..hops) holds the block of rank (r - i) % W
    items: list[list[_Item]]  # this rank's work at each step
    work: int  # score elements this rank computes per forward (B x Hq x rows x cols summed)


def _tile_size(chunk: int) -> int:
    """Width of the tiles used to find empty regions: a divisor of ``chunk`` (so tiles never straddle two
    ranks' chunks) close to ``_BLOCK``; the whole chunk when it has no usable divisor."""
    if chunk <= _BLOCK:
        return chunk
    best = next(d for d in range(_BLOCK, 0, -1) if chunk % d == 0)
    return best if 4 * best >= _BLOCK else chunk


def _tile_kinds(mask: Mask | None, lay: Layout, g: int, batch: int, heads: int, device) -> tuple[Tensor, Tensor]:
    """``(kmax, kmin)``, each ``(NT, NT)`` int8 over the global tile grid: the most and least visible kind of
    every tile over batch and heads (EMPTY only where no (b, h) sees anything; FULL only where all see all)."""
    nt = lay.seq_len // g
    if mask is None:
        full = torch.full((nt, nt), FULL, dtype=torch.int8)
        return full, full
    kinds = mask.block_structure(lay.seq_len, lay.seq_len, g, g, batch=batch, heads=heads, device=device).kinds()
    return kinds.amax(dim=(0, 1)).cpu(), kinds.amin(dim=(0, 1)).cpu()


def _hops(kmax: Tensor, lay: Layout, g: int) -> int:
    """The last ring step at which some rank has a non-empty tile (the same number on every rank)."""
    W = lay.world
    owner = lay.owner().repeat_interleave(lay.chunk // g)  # (NT,): the rank holding each tile
    onehot = torch.nn.functional.one_hot(owner, W).to(torch.float32)  # (NT, W)
    need = (onehot.T @ (kmax > EMPTY).to(torch.float32) @ onehot) > 0  # (W, W): rank r needs rank s's keys
    hops = 0
    for r in range(W):
        for i in range(W):
            if need[r, (r - i) % W]:
                hops = max(hops, i)
    return hops


def _runs(kmax_row: list[int], kmin_row: list[int]) -> list[tuple[int, int, bool]]:
    """Maximal runs ``[a, b)`` of non-empty tiles with one ``masked`` flag."""
    out, j, n = [], 0, len(kmax_row)
    while j < n:
        if kmax_row[j] == EMPTY:
            j += 1
            continue
        masked = kmin_row[j] != FULL
        e = j + 1
        while e < n and kmax_row[e] != EMPTY and (kmin_row[e] != FULL) == masked:
            e += 1
        out.append((j, e, masked))
        j = e
    return out


def _make_plan(mask: Mask | None, lay: Layout, rank: int, batch: int, heads: int, device) -> _Plan:
    c = lay.chunk
    g = _tile_size(c)
    tpc = c // g  # tiles per chunk
    kmax, kmin = _tile_kinds(mask, lay, g, batch, heads, device)
    hops = _hops(kmax, lay, g) if lay.world > 1 else 0
    my_tiles = [s // g + t for s in lay.starts(rank) for t in range(tpc)]
    kmax_rows, kmin_rows = kmax[my_tiles].tolist(), kmin[my_tiles].tolist()
    cols_per_item = 4 * _BLOCK
    items: list[list[_Item]] = []
    work = 0
    for i in range(hops + 1):
        src = (rank - i) % lay.world
        step: list[_Item] = []
        for qi, q_start in enumerate(lay.starts(rank)):
            for t in range(tpc):
                tile_row = qi * tpc + t
                local_row0, row0 = qi * c + t * g, q_start + t * g
                for ki, k_start in enumerate(lay.starts(src)):
                    first = k_start // g
                    runs = _runs(kmax_rows[tile_row][first : first + tpc], kmin_rows[tile_row][first : first + tpc])
                    for a, b, masked in runs:
                        for c0 in range(a * g, b * g, cols_per_item):
                            c1 = min(b * g, c0 + cols_per_item)
                            cols = slice(ki * c + c0, ki * c + c1)
                            for p0 in range(0, g, _BLOCK):
                                p1 = min(g, p0 + _BLOCK)
                                step.append(
                                    _Item(
                                        slice(local_row0 + p0, local_row0 + p1), cols, row0 + p0, k_start + c0, masked
                                    )
                                )
                                work += (p1 - p0) * (c1 - c0)
        items.append(step)
    return _Plan(hops, items, work * batch * heads)


# ------------------------------------------------------------------- communication


@dataclass
class _Config:
    group: object
    rank: int
    world: int
    layout: Layout
    plan: _Plan
    mask: Mask | None
    bias: ScoreMod | None
    scale: float
    softcap: float | None
    timings: dict = field(default_factory=lambda: {"compute_s": 0.0, "cpu_s": 0.0, "wait_s": 0.0})

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world


_TAG_KV, _TAG_DKV, _TAG_HOME = 0, 2, 4  # gloo matches messages by tag: keys/values, their grads, the last hop


def _exchange(send: list[Tensor], to: int, frm: int, group, tag: int) -> tuple[list[Tensor], list, list]:
    """Post sends of ``send`` to group rank ``to`` and receives of same-shaped tensors from ``frm``.

    Returns the receive buffers and the pending works as ``(sends, receives)``; a backend that coalesces
    the batch into one work (NCCL) gives no separate sends, and everything is in ``receives``.
    """
    recv = [torch.empty_like(t) for t in send]
    ops = []
    for j, (s, r) in enumerate(zip(send, recv)):
        ops.append(dist.P2POp(dist.isend, s, group=group, group_peer=to, tag=tag + j))
        ops.append(dist.P2POp(dist.irecv, r, group=group, group_peer=frm, tag=tag + j))
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(ops):
        return recv, works[0::2], works[1::2]
    return recv, [], works


def _wait(reqs, cfg: _Config) -> None:
    t0 = time.perf_counter()
    for req in reqs:
        req.wait()
    cfg.timings["wait_s"] += time.perf_counter() - t0


class _Clock:
    """Adds the wall and CPU time of a block of compute to ``cfg.timings``."""

    def __init__(self, cfg: _Config):
        self.cfg = cfg

    def __enter__(self):
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def __exit__(self, *exc):
        self.cfg.timings["compute_s"] += time.perf_counter() - self.t0
        self.cfg.timings["cpu_s"] += time.process_time() - self.c0


# ------------------------------------------------------------------------ the op


def _forward(q: Tensor, k: Tensor, v: Tensor, cfg: _Config) -> tuple[Tensor, Tensor]:
    """Local ``out (B, Hq, n, Dv)`` in q's dtype and ``lse (B, Hq, n)`` (float32 at least)."""
    B, Hq, n, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(B, Hq, n, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((B, Hq, n), float("-inf"), dtype=acc, device=q.device)
    L = cfg.layout.seq_len
    kv = [k, v]
    for i in range(cfg.plan.hops + 1):
        nxt, sends, recvs = (
            _exchange(kv, cfg.next, cfg.prev, cfg.group, _TAG_KV) if i < cfg.plan.hops else (None, [], [])
        )
        with _Clock(cfg):
            kb, vb = kv
            for it in cfg.plan.items[i]:
                mask = _Placed(cfg.mask, it.row0, it.col0, L) if it.masked else None
                bias = None if cfg.bias is None else _PlacedBias(cfg.bias, it.row0, it.col0, L)
                o, l = attention(  # noqa: E741
                    q[:, :, it.rows],
                    kb[:, :, it.cols],
                    vb[:, :, it.cols],
                    mask=mask,
                    bias=bias,
                    scale=cfg.scale,
                    softcap=cfg.softcap,
                    return_lse=True,
                )
                out[:, :, it.rows], lse[:, :, it.rows] = merge(out[:, :, it.rows], lse[:, :, it.rows], o, l)
        _wait(sends + recvs, cfg)
        if nxt is not None:
            kv = nxt
    return out.to(q.dtype), lse


def _block_grads(
    q: Tensor, kb: Tensor, vb: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, it: _Item, cfg: _Config
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one item: ``dq (B, Hq, r, D)``, ``dk (B, Hkv, c, D)``, ``dv (B, Hkv, c, Dv)``.

    ``p = exp(s - lse)`` with the scores ``s`` recomputed at global positions; ``ds = p * (dp - delta)``
    where ``dp = dout @ v^T`` and ``delta = rowsum(dout * out) - dlse``; a softcap or a non-additive
    modifier is differentiated through with autograd.
    """
    B, Hq, _, D = q.shape
    Hkv = kb.shape[1]
    G = Hq // Hkv
    acc = lse.dtype
    r, c = it.rows.stop - it.rows.start, it.cols.stop - it.cols.start
    qg = q[:, :, it.rows].to(acc).reshape(B, Hkv, G, r, D)  # (B, Hkv, G, r, D)
    kg = kb[:, :, it.cols].to(acc).unsqueeze(2)  # (B, Hkv, 1, c, D): shared by the G query heads
    vg = vb[:, :, it.cols].to(acc).unsqueeze(2)  # (B, Hkv, 1, c, Dv)
    dog = dout[:, :, it.rows].to(acc).reshape(B, Hkv, G, r, -1)  # (B, Hkv, G, r, Dv)
    dev = q.device
    bi = torch.arange(B, device=dev).view(-1, 1, 1, 1, 1)
    hi = torch.arange(Hq, device=dev).view(1, Hkv, G, 1, 1)
    qi = (it.row0 + torch.arange(r, device=dev)).view(1, 1, 1, -1, 1)
    ki = (it.col0 + torch.arange(c, device=dev)).view(1, 1, 1, 1, -1)
    L = cfg.layout.seq_len

    if it.masked:
        allowed = cfg.mask.evaluate(bi, hi, qi, ki, L, L)  # broadcastable to (B, Hkv, G, r, c)
        seen = allowed.expand(B, Hkv, G, r, c).any(dim=-2).any(dim=2, keepdim=True)  # (B, Hkv, 1, c)
        if not bool(seen.all()):  # keys no query here may see (padding garbage) must not reach dq, dk
            kg, vg = zero_unseen(kg, seen), zero_unseen(vg, seen)
    chain = cfg.softcap is not None or (cfg.bias is not None and not cfg.bias.additive)
    s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(cfg.scale)  # (B, Hkv, G, r, c)
    if chain:  # differentiate through the softcap / modifier: keep its graph, work on a copy
        raw = s.requires_grad_(True)
        with torch.enable_grad():
            if cfg.softcap is not None:
                s = cfg.softcap * torch.tanh(s / cfg.softcap)
            if cfg.bias is not None:
                s = cfg.bias.apply(s, bi, hi, qi, ki, L, L).to(acc)
        p = s.detach().clone()
    else:
        p = s if cfg.bias is None else cfg.bias.apply(s, bi, hi, qi, ki, L, L).to(acc)
    # in place from here: p holds the scores, then the weights; ds starts as dp = dout @ v^T
    if it.masked:
        p.masked_fill_(~allowed, float("-inf"))
    lse_g = lse[:, :, it.rows].reshape(B, Hkv, G, r, 1)
    lse_g = torch.where(torch.isfinite(lse_g), lse_g, torch.full_like(lse_g, float("inf")))  # empty rows: p = 0
    p.sub_(lse_g).exp_()  # (B, Hkv, G, r, c): exp(s - lse)
    ds = torch.matmul(dog, vg.transpose(-1, -2))  # (B, Hkv, G, r, c)
    ds.sub_(delta[:, :, it.rows].reshape(B, Hkv, G, r, 1)).mul_(p)
    if chain:
        (ds,) = torch.autograd.grad(s, raw, ds)
    dq = torch.matmul(ds, kg).reshape(B, Hq, r, D) * cfg.scale  # (B, Hq, r, D)
    dk = torch.einsum("bhgrc,bhgrd->bhcd", ds, qg) * cfg.scale  # (B, Hkv, c, D): summed over the group
    dv = torch.einsum("bhgrc,bhgrd->bhcd", p, dog)  # (B, Hkv, c, Dv)
    return dq, dk, dv


def _backward(q, k, v, out, lse, dout, dlse, cfg: _Config) -> tuple[Tensor, Tensor, Tensor]:
    acc = lse.dtype
    if dout is None:
        dout = torch.zeros_like(out)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, Hq, n): rowsum(dout * out)
    if dlse is not None:
        delta = delta - dlse.to(acc)  # d lse / d s = p, so ds = p * (dp - delta + dlse)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = [k, v]
    dkv_in: list[Tensor] | None = None  # grads of the block held, from the ranks that held it before
    dkv_sends: list = []  # our grads of the previous block, on their way to the next rank
    dkv_recvs: list = []
    hops = cfg.plan.hops
    for i in range(hops + 1):
        nxt, kv_sends, kv_recvs = _exchange(kv, cfg.next, cfg.prev, cfg.group, _TAG_KV) if i < hops else (None, [], [])
        _wait(dkv_sends, cfg)  # sent while the last step ended: lets those buffers go before new ones come
        dkv_sends = []
        mine = None  # this rank's grads for the block held
        if cfg.plan.items[i] or i == 0:
            mine = [torch.zeros(t.shape, dtype=acc, device=q.device) for t in kv]
            with _Clock(cfg):
                for it in cfg.plan.items[i]:
                    gq, gk, gv = _block_grads(q, kv[0], kv[1], dout, lse, delta, it, cfg)
                    dq[:, :, it.rows] += gq
                    mine[0][:, :, it.cols] += gk
                    mine[1][:, :, it.cols] += gv
        if i > 0:
            _wait(dkv_recvs, cfg)
            if mine is None:
                mine = dkv_in
            else:
                for a, b in zip(mine, dkv_in):
                    a += b
            dkv_in = None
        if i < hops:
            dkv_in, dkv_sends, dkv_recvs = _exchange(mine, cfg.next, cfg.prev, cfg.group, _TAG_DKV)
        elif hops > 0:  # the block held now belongs to rank r - hops: send its grads home, receive ours
            kv = nxt = None
            dkv_in, dkv_sends, dkv_recvs = _exchange(
                mine, (cfg.rank - hops) % cfg.world, (cfg.rank + hops) % cfg.world, cfg.group, _TAG_HOME
            )
        else:
            dkv_in = mine
        del mine  # the sends in flight keep it alive until they are done
        _wait(kv_sends + kv_recvs, cfg)
        if nxt is not None:
            kv = nxt
    _wait(dkv_sends + dkv_recvs, cfg)
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


def _record(cfg: _Config, phase: str) -> None:
    if _profile is not None:
        for name, value in cfg.timings.items():
            _profile[f"{phase}_{name}"] = _profile.get(f"{phase}_{name}", 0.0) + value
        _profile[f"{phase}_elements"] = _profile.get(f"{phase}_elements", 0) + cfg.plan.work
        cfg.timings = {name: 0.0 for name in cfg.timings}


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out, lse = _forward(q, k, v, cfg)
        _record(cfg, "forward")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, dout, dlse, ctx.cfg)
        _record(ctx.cfg, "backward")
        return dq, dk, dv, None


# ------------------------------------------------------------------- input checks


def _describe(x) -> str:
    """How a setting reads on every rank alike (no per-process addresses)."""
    if x is None:
        return "None"
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor {tuple(x.shape)}"
    if callable(x) and not isinstance(x, (Mask, ScoreMod)):
        return f"{type(x).__name__} {getattr(x, '__qualname__', '')}".rstrip()
    return repr(x)


_DIGESTS: dict[int, tuple] = {}  # id(tensor) -> (weakref, version, data_ptr, digest): one pass per tensor version
_DIGEST_CHUNK = 1 << 20  # elements read at a time: memory stays bounded whatever the mask's size


def _tensor_digest(t: torch.Tensor) -> tuple:
    """A tensor's shape, dtype, requires_grad and two checksums of its bytes (equal on every rank that holds
    the same values; a differing element changes them).  Read a chunk at a time, and once per tensor
    version: the layers of a model passing one mask pay for it once."""
    import weakref

    head = (tuple(t.shape), str(t.dtype), bool(t.requires_grad))
    memo = _DIGESTS.get(id(t))
    if memo is not None and memo[0]() is t and memo[1] == t._version and memo[2] == t.data_ptr():
        return head + memo[3]
    x = t.detach().contiguous().view(-1)
    if x.is_complex():
        x = torch.view_as_real(x).view(-1)
    data = x.view(torch.uint8) if x.numel() else x.new_zeros(0, dtype=torch.uint8)  # the bytes: NaN == NaN
    total = weighted = 0
    for a in range(0, data.numel(), _DIGEST_CHUNK):
        c = data[a : a + _DIGEST_CHUNK].to(torch.int64)
        w = torch.arange(a, a + c.numel(), dtype=torch.int64, device=c.device).remainder_(977).add_(1)
        total += int(c.sum())
        weighted += int((c * w).sum())
    digest = (total, weighted)
    if not t.is_inference():  # (inference tensors have no version counter to trust)
        if len(_DIGESTS) > 256:
            _DIGESTS.clear()
        _DIGESTS[id(t)] = (weakref.ref(t), t._version, t.data_ptr(), digest)
    return head + digest


def _contents(x, depth: int = 0) -> list:
    """What a mask or bias holds, comparable across processes: the values of its tensors (and of those its
    functions reach), not only how it prints (``document(32 ids)`` looks alike whatever the ids)."""
    from ..backends.reads import reachable_tensors

    if depth > 8:
        return []
    if isinstance(x, torch.Tensor):
        return [_tensor_digest(x)]
    if isinstance(x, (Mask, ScoreMod)):
        out: list = [type(x).__name__]
        for name, value in sorted(vars(x).items()):
            if not name.startswith("_"):  # (private attributes hold derived memos)
                out += [name, *_contents(value, depth + 1)]
        return out
    if isinstance(x, (list, tuple)):
        return [c for item in x for c in _contents(item, depth + 1)]
    if callable(x):
        return [_tensor_digest(t) for t in reachable_tensors(x)]
    return [repr(x)]


def _agree(group, rank: int, world: int, q, k, v, check=None, **settings):
    """Share every rank's view of the call and raise the same error on every rank when they differ.

    One ``all_gather_object`` before any other communication: a rank with bad input cannot leave the
    others waiting for its key/value blocks.  ``check()`` (the call's remaining validation) runs first on
    every rank, and its error is shared too; its result is returned.
    """
    error = result = None
    try:
        check_qkv(q, k, v)
        b = settings.get("bias")
        if callable(b) and not isinstance(b, (ScoreMod, torch.Tensor)):
            raise TypeError(
                f"bias must be None or an attnkit.bias modifier, got the callable {getattr(b, '__name__', type(b).__name__)}: "
                "wrap a function fn(score, b, h, q_idx, kv_idx) with attnkit.bias.from_fn(fn)"
            )
        if check is not None:
            result = check()
    except (TypeError, ValueError) as e:
        error = (type(e).__name__, str(e))
    tensors = all(isinstance(t, torch.Tensor) for t in (q, k, v))
    mine = {
        "q shape": tuple(q.shape) if tensors else None,
        "k shape": tuple(k.shape) if tensors else None,
        "v shape": tuple(v.shape) if tensors else None,
        "dtype": str(q.dtype) if tensors else None,
        "device type": q.device.type if tensors else None,
        "requires grad": bool(tensors and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))),
        **{name: _describe(value) for name, value in settings.items()},
        **{f"{name}'s values": _contents(settings[name]) for name in ("mask", "bias") if name in settings},
        "error": error,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise (TypeError if error[0] == "TypeError" else ValueError)(f"ring_attention on rank {rank}: {error[1]}")
    for r, e in enumerate(everyone):
        if e["error"] is not None:
            raise ValueError(f"ring_attention: rank {r} rejected its input, so this rank stops too: {e['error'][1]}")
    for name in mine:
        values = [e[name] for e in everyone]
        if any(x != values[0] for x in values):
            if name.endswith("values"):
                same = [r for r, x in enumerate(values) if x == values[0]]
                raise ValueError(
                    f"ring_attention: the {name.split(chr(39))[0]} holds different values on the "
                    f"{world} ranks (ranks {same} agree with rank 0; the tensors it holds, or those "
                    f"its functions read, differ elsewhere): every rank must pass the same mask and "
                    f"bias, describing the full sequence"
                )
            listing = ", ".join(f"rank {r}: {x}" for r, x in enumerate(values))
            fix = (
                "every rank must hold an equal part of one sequence, (B, H, L/W, D), cut with "
                "attnkit.distributed.shard; to ring-attend an uneven length, pad it to a multiple of 2W "
                "(zigzag) or W (contiguous) and mask the padding with attnkit.masks.key_padding"
                if name.endswith("shape")
                else "every rank must make the same call"
            )
            raise ValueError(f"ring_attention: the {name} differs across the {world} ranks ({listing}): {fix}")
    return result


def _check_bias_constant(bias: ScoreMod, q: Tensor, heads: int, seq_len: int) -> None:
    """ring_attention gives no gradient to a modifier's own tensors: refuse ones that require grad."""
    if not torch.is_grad_enabled():
        return
    one = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=q.device)
    h = torch.arange(heads, device=q.device).view(1, -1, 1, 1)
    score = torch.zeros(1, heads, 1, 1, dtype=q.dtype, device=q.device)
    with torch.enable_grad():
        probe = bias.apply(score, one, h, one, one, seq_len, seq_len)
    if isinstance(probe, torch.Tensor) and probe.requires_grad:
        raise ValueError(
            f"ring_attention: bias={bias!r} holds tensors that require grad (learnable slopes, "
            f"tables or temperatures); ring_attention does not train them: pass them detached "
            f"(e.g. alibi(slopes.detach())) or use attnkit.attention on one process"
        )


# ---------------------------------------------------------------------- public API


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    bias=None,
    scale: float | None = None,
    softcap: float | None = None,
    group=None,
    layout: str = "zigzag",
    return_lse: bool = False,
    sinks: Tensor | None = None,
):
    """Attention over a sequence sharded across a process group (context parallelism).

    Call it on every rank of ``group`` with that rank's shards; the result equals this rank's rows of
    ``attnkit.attention`` on the full sequence (self-attention: queries and keys are the same positions).

    Args:
        q: ``(B, Hq, L/W, D)`` this rank's queries, cut by :func:`attnkit.distributed.shard` with ``layout``.
        k: ``(B, Hkv, L/W, D)`` this rank's keys; ``Hq`` a multiple of ``Hkv`` (grouped-query attention,
            no copies of k or v).
        v: ``(B, Hkv, L/W, Dv)`` this rank's values.
        mask: ``None``, an :class:`attnkit.masks.Mask` for the full ``L x L`` matrix (e.g. ``causal()``,
            ``sliding_window(w)``, ``document(ids)`` with the ``L`` global ids), or a bool tensor
            broadcastable to ``(B, Hq, L, L)``.  Evaluated at global positions; empty tiles are skipped.
        bias: ``None`` or an :mod:`attnkit.bias` modifier (ALiBi, T5 buckets, temperature, ``from_fn``),
            evaluated at global positions.  Its own tensors get no gradient: ones that require grad (a
            learned T5 table) are refused, and so is a dense ``(L, L)`` float bias (it defeats sharding).
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.
        softcap: ``s`` maps a score ``x`` to ``s * tanh(x / s)``, before the bias.
        group: the process group (default: the world); ``W`` is its size.
        layout: how the sequence was cut: ``"zigzag"`` (default; balanced causal work) or ``"contiguous"``
            (a sliding window then only talks to the neighbouring rank).
        return_lse: also return the log-sum-exp ``(B, Hq, L/W)`` of each row (differentiable).
        sinks: as in :func:`attnkit.attention` (one logit per query head, the same on every rank): the ring
            merges the blocks without it and adds it once, at the end (:func:`attnkit.softmax.add_sink`);
            the sinks get their gradient on every rank (sum it like any replicated parameter's).

    Returns:
        ``out (B, Hq, L/W, Dv)`` in q's dtype, and with ``return_lse`` also ``lse (B, Hq, L/W)`` (float32,
        float64 for float64 inputs).  A row that may attend to nothing gives 0 and ``-inf``.

    Every rank must call it with the same shapes, dtype, mask, bias and settings; that is checked first
    (one small all-gather), so a mismatch, e.g. uneven shards, raises the same ``ValueError`` on every
    rank instead of hanging.  The backward pass is collective too: every rank must backpropagate.

    Example::

        >>> import torch, torch.distributed as dist, attnkit
        >>> from attnkit.distributed import ring_attention, shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchrun: W ranks
        >>> q, k, v = torch.randn(3, 1, 4, 32, 16).unbind(0)
        >>> out = ring_attention(shard(q), shard(k), shard(v), mask=attnkit.masks.causal())
        >>> torch.allclose(out, shard(attnkit.attention(q, k, v, mask=attnkit.masks.causal())), atol=1e-6)
        True
        >>> dist.destroy_process_group()
    """
    layout = check_layout(layout)
    rank, world = group_info(group)

    def check():  # on every rank inside _agree, so that one rank's bad input stops them all
        flag("return_lse", return_lse)
        n = q.shape[2]
        if k.shape[2] != n:
            raise ValueError(
                f"ring_attention is self-attention over one sharded sequence: q and k must hold the "
                f"same positions, got local lengths Lq={n} and Lk={k.shape[2]}"
            )
        if layout == "zigzag" and n % 2:
            raise ValueError(
                f"ring_attention: layout='zigzag' shards hold two equal chunks, but the local length "
                f"is {n} (odd): cut the sequence with attnkit.distributed.shard(x, layout='zigzag'), "
                f"or pass layout='contiguous' if that is how it was cut"
            )
        L = n * world
        check_divisible(L, world, layout, "ring_attention")
        if isinstance(bias, torch.Tensor):
            raise TypeError(
                f"ring_attention: bias must be None or an attnkit.bias modifier, got a "
                f"{tuple(bias.shape)} tensor: a dense (L, L) bias defeats sharding the sequence; "
                f"express it as a function of positions with attnkit.bias.from_fn(fn)"
            )
        # built as attention() builds its call: this rank's shard with the scale, softcap and sinks, then the
        # full sequence (an L x L score matrix) with the mask and bias, on shape-only stand-ins for q, k, v
        make_call(q, k, v, scale=scale, softcap=softcap, sinks=sinks)
        B, Hq, _, D = q.shape
        shape_only = q.new_empty(1, 1, 1, 1)
        try:
            call = make_call(
                shape_only.expand(B, Hq, L, D),
                shape_only.expand(B, k.shape[1], L, D),
                shape_only.expand(B, v.shape[1], L, v.shape[3]),
                mask=mask,
                bias=bias,
                scale=scale,
                softcap=softcap,
                sinks=sinks,
            )
        except ValueError as e:
            raise ValueError(
                f"ring_attention: the mask and bias describe the full sequence, an L x L score "
                f"matrix with L = {world} ranks x {n} local tokens = {L} (e.g. document ids for all "
                f"L tokens): {e}"
            ) from None
        if isinstance(call.bias, ScoreMod):  # (a tensor bias was refused above)
            _check_bias_constant(call.bias, q, q.shape[1], L)
        return call.mask, call.bias, call.scale, call.softcap

    mask, bias, scale, softcap = _agree(
        group,
        rank,
        world,
        q,
        k,
        v,
        check,
        mask=mask,
        bias=bias,
        scale=scale,
        softcap=softcap,
        layout=layout,
        return_lse=bool(return_lse),
    )
    B, Hq, n, D = q.shape
    L = n * world
    if n == 0:
        res = attention(q, k, v, return_lse=True, sinks=sinks)
        return res if return_lse else res[0]
    lay = Layout(layout, world, L)
    plan = _make_plan(mask, lay, rank, B, Hq, q.device)
    cfg = _Config(group, rank, world, lay, plan, mask, bias, scale, softcap)
    out, lse = _RingAttention.apply(q, k.contiguous(), v.contiguous(), cfg)
    if sinks is not None:  # once, after every block was merged: a sink is not a key
        out, lse = add_sink(out, lse, check_sinks(sinks, q))
    return (out, lse) if return_lse else out


class RingContext:
    """What :func:`ring_context` yields: the modules it routes, and this rank's global positions.

    Attributes:
        modules: the names (as in ``model.named_modules()``) of the attention modules whose attention now
            runs as ring attention.
        layout, group: as given to :func:`ring_context`.
    """

    def __init__(self, modules: list[str], layout: str, group):
        self.modules, self.layout, self.group = modules, layout, group

    def positions(self, local_len: int, device=None) -> Tensor:
        """The global positions ``(local_len,)`` of this rank's ``local_len`` tokens: what RoPE (``positions=``)
        needs, since a shard's tokens are not at ``0 .. local_len - 1`` of the whole sequence."""
        local_len = int_in_range("local_len", local_len, 0, fix=" (this rank's tokens)")
        from ._layout import shard

        _, world = group_info(self.group)
        return shard(torch.arange(local_len * world, device=device), dim=0, group=self.group, layout=self.layout)

    def __repr__(self) -> str:
        return f"RingContext(layout={self.layout!r}, modules={self.modules})"


def _refuse_what_ring_cannot_do(name: str):
    """A forward pre-hook refusing the calls whose result would be wrong on a shard: cross-attention, a KV
    cache, and the weights (they would cover this rank's keys only)."""

    def check(module, args, kwargs):
        where = f"ring_context: module {name or '(model)'!r}"
        if (len(args) > 1 and args[1] is not None) or kwargs.get("context") is not None:
            raise ValueError(
                f"{where} was given a context: ring attention is self-attention over one sharded "
                f"sequence; run cross-attention outside the context"
            )
        if kwargs.get("cache") is not None:
            raise ValueError(
                f"{where} was given a KV cache: ring attention computes over shards of one full "
                f"sequence; decode with a cache outside the context"
            )
        if kwargs.get("need_weights"):
            raise ValueError(
                f"{where}: need_weights=True would give the weights over this rank's keys only; "
                f"compute them outside the context (on one process)"
            )
        return None

    return check


def _ring_hook(layout: str, group, name: str):
    """The attention hook computing a module's attention as :func:`ring_attention`."""

    def hook(module, call, compute):
        if call.dropout_p:
            raise ValueError(
                f"ring_context: module {name or '(model)'!r} is training with attention dropout "
                f"{call.dropout_p}, which ring attention does not have: build it with dropout=0.0 or "
                f"call model.eval()"
            )
        return ring_attention(call.q, call.k, call.v, group=group, layout=layout, **call.weight_kwargs())

    return hook


@contextmanager
def ring_context(model: torch.nn.Module, *, layout: str = "zigzag", group=None):
    """Run the attention of ``model``'s :mod:`attnkit.nn` attention modules as :func:`ring_attention` while the
    context is active: every rank feeds the model its own shard of one long sequence.

    Inside the context each attention module (``MultiHeadAttention``, and so every ``TransformerBlock``,
    ``DecoderLM`` ... layer) computes exact attention over the whole sharded sequence; every other part of a
    transformer layer is per token and needs no change.  The module's masks and position biases (causal,
    sliding window, ALiBi, ...) are evaluated at global positions.  Two things are the caller's: cut the
    inputs with :func:`attnkit.distributed.shard` (``dim=1`` for ``(B, L, d_model)``) with the same ``layout``,
    and pass RoPE the tokens' global positions (``positions=ctx.positions(local_len)``).  Attention dropout is
    refused (ring attention has none: call ``model.eval()``), and so are cross-attention and a KV cache (ring
    attention is self-attention over one sequence) and ``need_weights=True`` (the weights of a shard's keys
    alone are not the attention weights).  A model that calls :func:`attnkit.attention` itself calls
    :func:`ring_attention` in its place.  On exit (also after an error) the modules compute as before; the
    replacement is an attention hook on each module (``register_attention_hook``), so other models are untouched.

    Yields:
        A :class:`RingContext` (``ctx.modules``: the routed modules; ``ctx.positions(n)``).

    Example (``torchrun --nproc-per-node 4 script.py``; here one process)::

        >>> import torch, torch.distributed as dist
        >>> from attnkit import masks
        >>> from attnkit.distributed import ring_context, shard, unshard
        >>> from attnkit.nn import TransformerBlock
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> block = TransformerBlock(32, 4, mask=masks.causal()).eval()
        >>> x = torch.randn(1, 64, 32)                           # (B, L, d_model), the same on every rank
        >>> with ring_context(block) as ctx:
        ...     out = block(shard(x, dim=1))                     # (B, L/W, d_model): this rank's tokens
        >>> ctx.modules, torch.allclose(unshard(out, dim=1), block(x), atol=1e-5)
        (['attn'], True)
        >>> dist.destroy_process_group()
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ring_context: model must be a torch.nn.Module, got {type(model).__name__}")
    layout = check_layout(layout)
    modules = [
        (name, m) for name, m in model.named_modules() if callable(getattr(type(m), "register_attention_hook", None))
    ]
    if not modules:
        raise ValueError(
            f"ring_context: {type(model).__name__} has no attnkit.nn attention module (one with "
            f"register_attention_hook, e.g. MultiHeadAttention); a model that calls attnkit.attention "
            f"itself calls attnkit.distributed.ring_attention in its place"
        )
    hooks = []
    try:
        for name, module in modules:
            hooks.append(module.register_attention_hook(_ring_hook(layout, group, name)))
            hooks.append(module.register_forward_pre_hook(_refuse_what_ring_cannot_do(name), with_kwargs=True))
        yield RingContext([name for name, _ in modules], layout, group)
    finally:
        for hook in reversed(hooks):
            hook.remove()
