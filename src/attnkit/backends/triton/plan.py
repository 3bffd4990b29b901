"""What the Triton kernels are told about a mask: tile lists, in-kernel predicates, and bitmaps.

Pure PyTorch (no triton): a mask's :class:`~attnkit.masks.BlockStructure` becomes per-row *tile lists*
(partial tiles first, then full ones, as the kernels in ``_triton_kernels`` read them), transposed for
the dk/dv kernel.  The built-in masks whose predicate the kernels evaluate themselves (causal, sliding
window, prefix LM, document, key padding by lengths, and ``&`` of them) become a few integers and id
tensors (:class:`Predicates`); every other mask is evaluated here, once, on its partial tiles only, into a
bitmap of 32-bit words.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...masks import Band, BlockStructure, Documents, KeyLengths, Mask, Prefix

Tensor = torch.Tensor

_BITMAP_CHUNK = 1 << 22  # mask elements evaluated at once when a bitmap is built
_INT32_SPAN = 1 << 32


@dataclass
class Predicates:
    """The element mask of a partial tile as the kernels evaluate it (query row ``q``, key ``k``).

    ``k >= q + lo_off`` (when set), ``k <= q + hi_off`` (when set), ``k <= q + prefix[0] or k < prefix[1]``,
    ``q_ids[b, q] == kv_ids[b, k]``, ``k < key_lengths[b]``; all that are set must hold.
    """

    lo_off: int | None = None
    hi_off: int | None = None
    prefix: tuple[int, int] | None = None
    doc: tuple[Tensor, Tensor] | None = None  # (B', Lq), (B', Lk) int64
    key_lengths: Tensor | None = None  # (B',) int64


def predicates(mask: Mask, q_len: int, kv_len: int, device: torch.device, batch: int = 1) -> Predicates | None:
    """The in-kernel form of ``mask`` for a batch of ``batch``, or None when it needs a bitmap.  Per-batch
    tables (key lengths) are one row per batch element: the kernels read them at ``b`` without broadcasting.

    Example::

        >>> from attnkit import masks
        >>> p = predicates(masks.causal() & masks.sliding_window(3), 4, 6, torch.device("cpu"))
        >>> p.lo_off, p.hi_off
        (-1, 2)
        >>> predicates(masks.strided(2), 4, 4, torch.device("cpu")) is None
        True
    """
    out = Predicates()

    def hi(value: int) -> None:
        out.hi_off = value if out.hi_off is None else min(out.hi_off, value)

    def lo(value: int) -> None:
        out.lo_off = value if out.lo_off is None else max(out.lo_off, value)

    for term in mask.conjuncts():
        form = term.form(q_len, kv_len)
        if isinstance(form, Band):
            if form.lo is not None:
                lo(form.lo)
            if form.hi is not None:
                hi(form.hi)
        elif isinstance(form, Prefix) and out.prefix is None:
            out.prefix = (form.offset, form.n)
        elif isinstance(form, Documents) and out.doc is None:
            out.doc = (
                form.q_ids.to(device=device, dtype=torch.int64).contiguous(),
                form.kv_ids.to(device=device, dtype=torch.int64).contiguous(),
            )
        elif isinstance(form, KeyLengths) and out.key_lengths is None:
            lengths = form.lengths.to(device=device, dtype=torch.int64)
            out.key_lengths = lengths.expand(batch).contiguous() if lengths.shape[0] == 1 else lengths.contiguous()
        else:
            return None
    return out


@dataclass
class TileLists:
    """Per row tile, the tiles to visit along the other axis (the kernels' ``Count``/``Index``/``TileId``).

    ``count (B', H', R, 2)`` int32 holds ``(n_partial, n_total)``; ``index (B', H', R, W)`` int32 the tiles,
    partial ones first; ``tile_id`` (same shape) the bitmap tile of each partial entry (0 elsewhere).
    """

    count: Tensor
    index: Tensor
    tile_id: Tensor

    @property
    def num_partial(self) -> int:
        return int(self.count[..., 0].sum())


def tile_lists(structure: BlockStructure) -> TileLists:
    """Merge a block structure's partial and full lists into one list per query tile, partial first.

    Partial entries are numbered row after row (the bitmap tiles, in :func:`bitmap`'s order).

    Example::

        >>> from attnkit import masks
        >>> t = tile_lists(masks.causal().block_structure(48, 48, 16))
        >>> t.count[0, 0].tolist(), t.index[0, 0].tolist()
        ([[1, 1], [1, 2], [1, 3]], [[0, 0, 0], [1, 0, 0], [2, 0, 1]])
    """
    npart, nfull = structure.partial_count, structure.full_count  # (B', H', R)
    # (torch.broadcast_shapes has no annotations in torch's sources)
    lead = torch.broadcast_shapes(npart.shape, nfull.shape)  # type: ignore[no-untyped-call]
    npart, nfull = npart.expand(lead), nfull.expand(lead)
    pidx = structure.partial_index.expand(*lead, structure.partial_index.shape[-1])
    fidx = structure.full_index.expand(*lead, structure.full_index.shape[-1])
    total = npart + nfull
    width = max(1, int(total.max()) if total.numel() else 0)
    dev = npart.device
    j = torch.arange(width, device=dev)
    pj = j.clamp(max=max(0, pidx.shape[-1] - 1))
    fj = (j - npart[..., None]).clamp(min=0, max=max(0, fidx.shape[-1] - 1))
    from_p = (
        pidx.gather(-1, pj.expand(*lead, width).contiguous())
        if pidx.shape[-1]
        else torch.zeros(*lead, width, dtype=torch.int32, device=dev)
    )
    from_f = (
        fidx.gather(-1, fj.contiguous()) if fidx.shape[-1] else torch.zeros(*lead, width, dtype=torch.int32, device=dev)
    )
    is_p = j < npart[..., None]
    live = j < total[..., None]
    index = torch.where(is_p, from_p, torch.where(live, from_f, 0)).to(torch.int32)
    first = (torch.cumsum(npart.reshape(-1), 0) - npart.reshape(-1)).view(lead)  # bitmap id of a row's first
    tile_id = torch.where(is_p, first[..., None] + j, 0).to(torch.int32)
    count = torch.stack([npart, total], dim=-1).to(torch.int32)
    return TileLists(count.contiguous(), index.contiguous(), tile_id.contiguous())


def transpose(lists: TileLists, num_cols: int) -> TileLists:
    """The same tiles listed per column tile (key tile) instead of per row tile, partial ones first.

    Example::

        >>> from attnkit import masks
        >>> t = transpose(tile_lists(masks.causal().block_structure(48, 48, 16)), 3)
        >>> t.count[0, 0].tolist(), t.index[0, 0].tolist()
        ([[1, 3], [1, 2], [1, 1]], [[0, 1, 2], [1, 2, 0], [2, 0, 0]])
    """
    count, index, tile_id = lists.count, lists.index, lists.tile_id
    Bp, Hp, R, W = index.shape
    dev = index.device
    j = torch.arange(W, device=dev)
    live = j < count[..., 1:2]  # (B', H', R, W)
    is_p = j < count[..., 0:1]
    bh = torch.arange(Bp * Hp, device=dev).view(Bp, Hp, 1, 1).expand_as(index)[live]
    row = torch.arange(R, device=dev).view(1, 1, R, 1).expand_as(index)[live]
    col = index[live].long()
    full = (~is_p)[live].long()
    tid = tile_id[live]
    group = bh * num_cols + col  # one list per (b', h', column tile)
    order = torch.argsort((group * 2 + full) * R + row)  # by list, partial first, rows ascending
    group, full, row, tid = group[order], full[order], row[order], tid[order]
    n_groups = Bp * Hp * num_cols
    n_part = torch.bincount(group[full == 0], minlength=n_groups)
    n_total = torch.bincount(group, minlength=n_groups)
    width = max(1, int(n_total.max()) if n_total.numel() else 0)
    start = torch.cumsum(n_total, 0) - n_total
    rank = torch.arange(group.numel(), device=dev) - start[group]
    index_t = torch.zeros(n_groups, width, dtype=torch.int32, device=dev)
    tile_t = torch.zeros(n_groups, width, dtype=torch.int32, device=dev)
    index_t[group, rank] = row.to(torch.int32)
    tile_t[group, rank] = torch.where(full == 0, tid, 0).to(torch.int32)
    count_t = torch.stack([n_part, n_total], dim=-1).to(torch.int32).view(Bp, Hp, num_cols, 2)
    return TileLists(count_t.contiguous(), index_t.view(Bp, Hp, num_cols, width), tile_t.view(Bp, Hp, num_cols, width))


def bitmap(mask: Mask, lists: TileLists, q_len: int, kv_len: int, block_m: int, block_n: int) -> Tensor:
    """The mask on every partial tile of ``lists`` (query-tile rows), packed ``(n_tiles, block_m, words)``.

    Bit ``c % 32`` of word ``c // 32`` in row ``r`` of tile ``t`` is the mask at query row
    ``i * block_m + r`` and key ``kt * block_n + c`` of that tile; positions past ``Lq``/``Lk`` are 0.
    The predicate is evaluated a chunk of tiles at a time, with batch/head/query/key index tensors shaped
    ``(N, 1, 1, 1)``, ``(N, 1, 1, 1)``, ``(N, 1, block_m, 1)``, ``(N, 1, 1, block_n)`` (N tiles).

    Example::

        >>> from attnkit import masks
        >>> m = masks.strided(2)
        >>> s = m.block_structure(4, 4, 2)
        >>> bitmap(m, tile_lists(s), 4, 4, 2, 2)[0].tolist()  # rows 0-1, keys 0-1: [[1, 0], [1, 1]]
        [[1], [3]]
    """
    count, index = lists.count, lists.index
    Bp, Hp, R, W = index.shape
    dev = index.device
    words = -(-block_n // 32)
    j = torch.arange(W, device=dev)
    is_p = j < count[..., 0:1]
    b = torch.arange(Bp, device=dev).view(Bp, 1, 1, 1).expand_as(index)[is_p]
    h = torch.arange(Hp, device=dev).view(1, Hp, 1, 1).expand_as(index)[is_p]
    r = torch.arange(R, device=dev).view(1, 1, R, 1).expand_as(index)[is_p]
    kt = index[is_p].long()  # row-major order: the order tile_lists numbered the partial entries in
    n = b.numel()
    out = torch.zeros(n, block_m, words, dtype=torch.int32, device=dev)
    rows = torch.arange(block_m, device=dev)
    cols = torch.arange(words * 32, device=dev)
    weights = torch.ones(32, dtype=torch.int64, device=dev) << torch.arange(32, device=dev)
    step = max(1, _BITMAP_CHUNK // (block_m * words * 32))
    for s0 in range(0, n, step):
        sl = slice(s0, min(n, s0 + step))
        q = r[sl].view(-1, 1, 1, 1) * block_m + rows.view(1, 1, -1, 1)  # (N, 1, BM, 1)
        k = kt[sl].view(-1, 1, 1, 1) * block_n + cols.view(1, 1, 1, -1)  # (N, 1, 1, 32*words)
        valid = (q < q_len) & (k < kv_len) & (cols.view(1, 1, 1, -1) < block_n)
        allowed = mask.evaluate(
            b[sl].view(-1, 1, 1, 1),
            h[sl].view(-1, 1, 1, 1),
            q.clamp(max=q_len - 1),
            k.clamp(max=kv_len - 1),
            q_len,
            kv_len,
        )
        allowed = (allowed & valid).expand(-1, 1, block_m, words * 32).reshape(-1, block_m, words, 32)
        packed = (allowed.to(torch.int64) * weights).sum(-1)  # (N, BM, words) in [0, 2^32)
        out[sl] = torch.where(packed >= _INT32_SPAN // 2, packed - _INT32_SPAN, packed).to(torch.int32)
    return out
