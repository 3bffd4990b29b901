"""The :class:`Mask` base class, its public protocol, and the combinators ``&``, ``|``, ``~``."""

from __future__ import annotations

import weakref
from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator, TypeAlias, Union

import torch

from ._blocks import (
    _EVAL_CHUNK,
    EMPTY,
    FULL,
    PARTIAL,
    BlockStructure,
    _and_tiles,
    _as_grid,
    _Band,
    _ceil_div,
    _check_int,
    _Grid,
    index_grid,
    _or_tiles,
    _pool_kinds,
    _structure_from_band,
    _structure_from_grid,
    _Tiling,
)

Tensor = torch.Tensor


def _grid_by_eval(mask: Mask, t: _Tiling) -> _Grid:
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
        allowed = mask.evaluate(b, h, q.clamp(max=t.q_len - 1), k, t.q_len, t.kv_len)
        allowed = _checked_bool(mask, allowed)
        lead = (allowed.shape[0], allowed.shape[1])
        allowed = allowed.expand(*lead, q.shape[2], kp)
        parts.append(_pool_kinds(allowed, valid, bq, bk))
    return _Grid(torch.cat(parts, dim=2))


def _checked_bool(mask: Mask, out: object) -> Tensor:
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"{mask!r}: the mask function must return a bool tensor, got {got}")
    while out.dim() < 4:
        out = out.unsqueeze(0)
    checked: Tensor = out
    return checked


def _checked_shape(mask: Mask, out: Tensor, *index: Tensor) -> Tensor:
    """``out`` when it broadcasts against the index tensors it was computed from, else a clear error."""
    shape = torch.broadcast_shapes(*(i.shape for i in index))  # type: ignore[no-untyped-call]  # (torch.functional is unannotated)
    try:
        torch.broadcast_shapes(out.shape, shape)  # type: ignore[no-untyped-call]  # (torch.functional is unannotated)
        return out
    except RuntimeError:
        raise ValueError(
            f"{mask!r}: the mask function returned shape {tuple(out.shape)} for index tensors that "
            f"broadcast to {tuple(shape)}: build the result from b, h, q_idx, kv_idx with "
            f"broadcasting ops (e.g. q_idx >= kv_idx), without reshaping them"
        ) from None


# ---------------------------------------------------------------- what Mask.form answers
# A built-in mask described on a (q_len, kv_len) score matrix in terms of query rows i and keys j, its
# alignment applied, so that a kernel can compute it from a few numbers or tensors instead of calling its
# predicate.


@dataclass(frozen=True, slots=True)
class Band:
    """A band of keys around each row (:func:`causal`, :func:`sliding_window`): row ``i`` sees key ``j`` iff
    ``i + lo <= j <= i + hi``; None means unbounded on that side."""

    lo: int | None
    hi: int | None


@dataclass(frozen=True, slots=True)
class Prefix:
    """A prefix seen by every row, causal after it (:func:`prefix_lm`): row ``i`` sees key ``j`` iff
    ``j <= i + offset`` or ``j < n``."""

    offset: int
    n: int


@dataclass(frozen=True, slots=True, eq=False)
class Documents:
    """Document ids (:func:`document`): row ``i`` of batch element ``b`` sees key ``j`` iff
    ``q_ids[b, i] == kv_ids[b, j]`` (``b`` clamped to the tensors' first axis, which may be 1)."""

    q_ids: Tensor  # (B', q_len) int
    kv_ids: Tensor  # (B', kv_len) int


@dataclass(frozen=True, slots=True, eq=False)
class KeyLengths:
    """Key padding given by lengths (:func:`key_padding`): key ``j`` of batch element ``b`` is visible iff
    ``j < lengths[b]`` (``b`` clamped: one length serves every batch element)."""

    lengths: Tensor  # (B',) int


@dataclass(frozen=True, slots=True, eq=False)
class Dense:
    """A bool tensor (:func:`from_dense`, or a tensor passed as ``mask=``): True where a query may attend."""

    mask: Tensor  # (B', H', Lq', Lk') bool, each axis 1 or the call's size


@dataclass(frozen=True, slots=True, eq=False)
class Varlen:
    """Packed sequences (:func:`varlen`): sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
    and keys ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; ``mask`` (or None) applies within each sequence."""

    cu_seqlens_q: Tensor  # (n + 1,) int
    cu_seqlens_k: Tensor  # (n + 1,) int
    mask: Mask | None


MaskForm: TypeAlias = Union[Band, Prefix, Documents, KeyLengths, Dense, Varlen]
"""What :meth:`Mask.form` returns for a mask a kernel can evaluate in place (None for other masks)."""


# ---------------------------------------------------------------------------- masks


# id(mask) -> (weak reference to the mask, its value key): Mask._cached_value_key's memo
_VALUE_KEYS: dict[int, tuple[weakref.ref[Mask], str | None]] = {}


class Mask:
    """A vectorised predicate ``(b, h, q_idx, kv_idx) -> bool`` and its block structure.

    A subclass implements :meth:`evaluate` (the predicate; query *rows*, masks that use positions apply their
    alignment) and answers the other public questions where it has something better than the default:
    :meth:`validate` (the sizes it applies to), :meth:`batch_size`, :meth:`is_causal`, :meth:`conjuncts` (the
    parts of an ``&``), :meth:`key_range` (one row's visible keys), :meth:`form` (what a kernel needs to
    evaluate it in place: a :class:`Band`, :class:`Prefix`, :class:`Documents`, :class:`KeyLengths`,
    :class:`Dense` or :class:`Varlen`), :meth:`is_positional`, :meth:`wraps_function`, :meth:`value_key` and
    :meth:`cheap_structure`.  Its block structure is derived by evaluating the predicate one chunk of query
    tiles at a time; the built-ins compute theirs arithmetically (the private ``_tiles``).

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> class Even(masks.Mask):   # keys at even positions only
        ...     def evaluate(self, b, h, q_idx, kv_idx, q_len, kv_len):
        ...         return (kv_idx % 2 == 0) & (q_idx >= 0)
        >>> (Even() & masks.causal()).to_dense(3, 3)[0, 0].int().tolist()
        [[1, 0, 0], [1, 0, 0], [1, 0, 1]]
    """

    # ---- the predicate (every subclass implements it)
    @abstractmethod
    def evaluate(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, q_len: int, kv_len: int) -> Tensor:
        """The predicate on broadcastable index tensors of a ``(q_len, kv_len)`` score matrix: batch ``b``,
        head ``h``, query *rows* ``q_idx`` and keys ``kv_idx`` (masks that use positions apply their alignment).
        A bool tensor broadcastable against the index tensors.

        Example::

            >>> import torch
            >>> from attnkit import masks
            >>> zero, i = torch.zeros(1, dtype=torch.long), torch.arange(3)
            >>> masks.causal().evaluate(zero, zero, i.view(-1, 1), i.view(1, -1), 3, 3).int()
            tensor([[1, 0, 0],
                    [1, 1, 0],
                    [1, 1, 1]], dtype=torch.int32)
        """
        raise NotImplementedError(f"{type(self).__name__} must implement evaluate(b, h, q_idx, kv_idx, q_len, kv_len)")

    # ---- private: how the built-ins compute their tiles and pick a size to be drawn at
    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        return _grid_by_eval(self, t)

    def _size(self) -> tuple[int, int] | None:
        """The (Lq, Lk) the mask is defined for, when it carries one (used to draw it)."""
        return None

    def _size_guess(self) -> tuple[int, int] | None:
        """A size to draw it at: the size it is defined for, else one that suits it (key lengths)."""
        return self._size()

    def _head_count(self) -> int:
        """The number of heads the mask carries data for (1 when it does not depend on the head)."""
        return 1

    # ---- public
    def mask_mod(self, q_len: int, kv_len: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """The predicate bound to a shape, as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""

        def mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return self.evaluate(b, h, q_idx, kv_idx, q_len, kv_len)

        return mod

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Check that the mask applies to a ``(batch, heads, q_len, kv_len)`` score matrix (ValueError if not)."""

    def batch_size(self) -> int:
        """The batch size the mask carries data for (1 when it does not depend on the batch).

        Example::

            >>> import torch
            >>> from attnkit import masks
            >>> masks.causal().batch_size(), masks.key_padding(torch.tensor([3, 5])).batch_size()
            (1, 2)
        """
        return 1

    def is_causal(self, align: str | None = "bottom_right") -> bool:
        """Whether this is the plain causal mask :func:`causal` with alignment ``align`` (``None``: either).

        Example::

            >>> from attnkit import masks
            >>> masks.causal().is_causal(), masks.causal(align="top_left").is_causal()
            (True, False)
            >>> masks.causal(align="top_left").is_causal(None), masks.sliding_window(3).is_causal()
            (True, False)
        """
        return False

    def conjuncts(self) -> tuple[Mask, ...]:
        """The masks whose ``&`` this mask is (names such as :func:`fixed` unwrapped; ``(self,)`` when it is
        no ``&``).

        Example::

            >>> from attnkit import masks
            >>> masks.causal() & masks.sliding_window(3) & masks.prefix_lm(2)
            ((causal(align='bottom_right') & sliding_window(left=3, right=0, align='bottom_right')) & prefix_lm(2, align='bottom_right'))
            >>> len((masks.causal() & masks.sliding_window(3) & masks.prefix_lm(2)).conjuncts())
            3
        """
        return (self,)

    def key_range(self, row: int, q_len: int, kv_len: int) -> tuple[float, float] | None:
        """The keys ``[lo, hi]`` query row ``row`` sees (plain numbers, ``-inf``/``inf`` when unbounded, not
        clipped to ``[0, kv_len)``), for masks that keep one interval per row, the same for every batch and
        head; None for other masks.

        Example::

            >>> from attnkit import masks
            >>> masks.sliding_window(3).key_range(0, 1, 10)   # one query at position 9
            (6, 9)
            >>> masks.causal().key_range(0, 1, 10), masks.strided(2).key_range(0, 1, 10)
            ((-inf, 9), None)
        """
        return None

    def form(self, q_len: int, kv_len: int) -> MaskForm | None:
        """What a kernel needs to know to evaluate this mask in place on a ``(q_len, kv_len)`` score matrix,
        alignment applied (rows ``i``, keys ``j``), or None when it has no such form and must be evaluated:

        - :class:`Band` ``(lo, hi)``: row ``i`` sees key ``j`` iff ``i + lo <= j <= i + hi`` (:func:`causal`,
          :func:`sliding_window`; None: unbounded on that side);
        - :class:`Prefix` ``(offset, n)``: ``j <= i + offset`` or ``j < n`` (:func:`prefix_lm`);
        - :class:`Documents` ``(q_ids, kv_ids)``: ``q_ids[b, i] == kv_ids[b, j]`` (:func:`document`);
        - :class:`KeyLengths` ``(lengths,)``: ``j < lengths[b]`` (:func:`key_padding` with lengths);
        - :class:`Dense` ``(mask,)``: the bool tensor itself (:func:`from_dense`, a tensor passed as ``mask=``);
        - :class:`Varlen` ``(cu_seqlens_q, cu_seqlens_k, mask)``: packed sequences (:func:`varlen`).

        Only a mask itself answers, not an ``&`` of masks: ask each of :meth:`conjuncts`.

        Example::

            >>> import torch
            >>> from attnkit import masks
            >>> masks.causal().form(4, 6), masks.sliding_window(3).form(4, 6)
            (Band(lo=None, hi=2), Band(lo=-1, hi=2))
            >>> masks.prefix_lm(3).form(4, 6)
            Prefix(offset=2, n=3)
            >>> masks.key_padding(torch.tensor([3, 5])).form(4, 6).lengths
            tensor([3, 5])
            >>> masks.strided(2).form(4, 6) is None, (masks.causal() & masks.sliding_window(3)).form(4, 6) is None
            (True, True)
        """
        return None

    def is_positional(self, align: str = "bottom_right") -> bool:
        """Whether the mask reads nothing but the query and key positions, with alignment ``align`` (the
        built-in ``causal``, ``sliding_window``, ``prefix_lm`` and ``block_local``, and ``&``, ``|``, ``~`` of
        such masks): one can then evaluate it per sequence of a paged cache from positions alone.

        Example::

            >>> import torch
            >>> from attnkit import masks
            >>> masks.causal().is_positional(), masks.causal(align="top_left").is_positional()
            (True, False)
            >>> (masks.causal() & masks.sliding_window(4)).is_positional()
            True
            >>> masks.key_padding(torch.tensor([3])).is_positional()
            False
        """
        return False

    def wraps_function(self) -> bool:
        """Whether this mask node calls a user function (:func:`from_fn`, :func:`from_flex`); parts of an
        ``&`` / ``|`` / ``~`` are not looked into.

        Example::

            >>> from attnkit import masks
            >>> masks.from_fn(lambda b, h, q, k: q >= k).wraps_function(), masks.causal().wraps_function()
            (True, False)
        """
        return False

    def value_key(self) -> str | None:
        """A string that identifies the mask by value when it is made only of built-ins that hold no tensors
        and no user functions (``causal()``, ``sliding_window(w)``, their combinations...), so that a mask
        rebuilt on every call can find what was computed for an equal one; None for other masks.

        Example::

            >>> import torch
            >>> from attnkit import masks
            >>> (masks.causal() & masks.sliding_window(3)).value_key() == (masks.causal() & masks.sliding_window(3)).value_key()
            True
            >>> masks.key_padding(torch.tensor([3])).value_key() is None
            True
        """
        return None

    def __eq__(self, other: object) -> bool:
        """Masks built alike compare equal (:meth:`value_key`); masks holding tensors or functions compare by
        identity."""
        if self is other:
            return True
        if not isinstance(other, Mask):
            return NotImplemented
        key = self._cached_value_key()
        return key is not None and key == other._cached_value_key()

    def __hash__(self) -> int:
        key = self._cached_value_key()
        return hash(key) if key is not None else object.__hash__(self)

    def _cached_value_key(self) -> str | None:
        """:meth:`value_key`, computed once (masks are dict keys on every attention call; a mask's value does
        not change).  Kept beside the mask, not in its attributes: the backends read a mask's attributes to
        describe it (plan caches, compile keys), and that description must not change once it is hashed."""
        ident = id(self)
        entry = _VALUE_KEYS.get(ident)
        if entry is not None and entry[0]() is self:
            return entry[1]
        key = self.value_key()

        def forget(_: weakref.ref[Mask], i: int = ident) -> None:
            _VALUE_KEYS.pop(i, None)

        _VALUE_KEYS[ident] = (weakref.ref(self, forget), key)
        return key

    def to_dict(self) -> dict[str, str]:
        """A JSON-ready description that :func:`attnkit.masks.from_dict` rebuilds an equal mask from.

        Only masks made of built-ins that hold no tensors serialise (those with a :meth:`value_key`): a mask
        from a Python function, a dense tensor, key lengths or document ids raises ValueError.

        Example::

            >>> from attnkit import masks
            >>> m = masks.causal() & masks.sliding_window(3)
            >>> m.to_dict()
            {'mask': "(causal(align='bottom_right') & sliding_window(left=3, right=0, align='bottom_right'))"}
            >>> masks.from_dict(m.to_dict()) == m
            True
        """
        key = self.value_key()
        if key is None:
            raise ValueError(
                f"{self!r} cannot be serialised: only masks built from attnkit's built-ins without "
                f"tensors (causal, sliding_window, prefix_lm, block_local, strided, fixed, dilated, "
                f"random_blocks and their &, |, ~) are; a mask from a Python function, a tensor, key "
                f"lengths or document ids must be rebuilt by the code that made it"
            )
        return {"mask": key}

    def cheap_structure(self) -> bool:
        """Whether :meth:`block_structure` is cheap to compute for another tiling: True for the built-ins
        (also those holding tensors: documents, key padding), False where it evaluates a user function or a
        dense tensor per element.

        Example::

            >>> from attnkit import masks
            >>> masks.causal().cheap_structure(), masks.from_fn(lambda b, h, q, k: q >= k).cheap_structure()
            (True, False)
        """
        return True

    def to_dense(
        self, q_len: int, kv_len: int, *, batch: int = 1, heads: int = 1, device: torch.device | str | None = None
    ) -> Tensor:
        """The mask as a bool tensor ``(B', H', q_len, kv_len)``; ``B'``/``H'`` are 1 where it does not vary."""
        _check_int("q_len", q_len)
        _check_int("kv_len", kv_len)
        self.validate(batch, heads, q_len, kv_len)
        b, h, q, k = index_grid(batch, heads, q_len, kv_len, device)
        out = _checked_bool(self, self.evaluate(b, h, q, k, q_len, kv_len))
        return out.expand(out.shape[0], out.shape[1], q_len, kv_len)

    def block_structure(
        self,
        q_len: int,
        kv_len: int,
        block_q: int = 128,
        block_k: int | None = None,
        *,
        batch: int = 1,
        heads: int = 1,
        device: torch.device | str | None = None,
    ) -> BlockStructure:
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
        self.validate(batch, heads, q_len, kv_len)
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
        self.validate(batch, heads, q_len, kv_len)
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
            m = _checked_bool(self, self.evaluate(b, h, q, k, q_len, kv_len))
            m = m.expand(nb, nh, q.shape[2], kv_len)
            total += int(m.sum())
        return total / (nb * nh * q_len * kv_len)

    def show(
        self, q_len: int | None = None, kv_len: int | None = None, *, batch: int = 0, head: int = 0, max_width: int = 64
    ) -> str:
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
        nb, nh = max(batch + 1, self.batch_size()), max(head + 1, self._head_count())
        self.validate(nb, nh, q_len, kv_len)
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


def _as_mask(x: object, op: str) -> Mask:
    if not isinstance(x, Mask):
        raise TypeError(
            f"cannot combine a Mask with {type(x).__name__} using {op!r}: "
            f"wrap a bool tensor with attnkit.masks.from_dense(t)"
        )
    return x


class _And(Mask):
    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        return self.a.evaluate(b, h, q, k, q_len, kv_len) & self.b.evaluate(b, h, q, k, q_len, kv_len)

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        return _and_tiles(self.a._tiles(t), self.b._tiles(t), t)

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        self.a.validate(batch, heads, q_len, kv_len)
        self.b.validate(batch, heads, q_len, kv_len)

    def _size(self) -> tuple[int, int] | None:
        return self.a._size() or self.b._size()

    def _size_guess(self) -> tuple[int, int] | None:
        return self._size() or self.a._size_guess() or self.b._size_guess()

    def batch_size(self) -> int:
        return max(self.a.batch_size(), self.b.batch_size())

    def _head_count(self) -> int:
        return max(self.a._head_count(), self.b._head_count())

    def conjuncts(self) -> tuple[Mask, ...]:
        return self.a.conjuncts() + self.b.conjuncts()

    def value_key(self) -> str | None:
        return repr(self) if self.a.value_key() is not None and self.b.value_key() is not None else None

    def cheap_structure(self) -> bool:
        return self.a.cheap_structure() and self.b.cheap_structure()

    def is_positional(self, align: str = "bottom_right") -> bool:
        return self.a.is_positional(align) and self.b.is_positional(align)

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


class _Or(_And):
    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        return self.a.evaluate(b, h, q, k, q_len, kv_len) | self.b.evaluate(b, h, q, k, q_len, kv_len)

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        return _or_tiles(self.a._tiles(t), self.b._tiles(t), t)

    def conjuncts(self) -> tuple[Mask, ...]:
        return (self,)

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class _Not(Mask):
    def __init__(self, a: Mask):
        self.a = a

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        return ~self.a.evaluate(b, h, q, k, q_len, kv_len)

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        return _Grid((FULL - _as_grid(self.a._tiles(t), t).kinds).to(torch.int8))

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        self.a.validate(batch, heads, q_len, kv_len)

    def _size(self) -> tuple[int, int] | None:
        return self.a._size()

    def _size_guess(self) -> tuple[int, int] | None:
        return self.a._size_guess()

    def batch_size(self) -> int:
        return self.a.batch_size()

    def _head_count(self) -> int:
        return self.a._head_count()

    def value_key(self) -> str | None:
        return repr(self) if self.a.value_key() is not None else None

    def cheap_structure(self) -> bool:
        return self.a.cheap_structure()

    def is_positional(self, align: str = "bottom_right") -> bool:
        return self.a.is_positional(align)

    def __repr__(self) -> str:
        return f"~{self.a!r}"


class _Named(Mask):
    """A mask defined as a combination of others, shown under its own name."""

    def __init__(self, name: str, inner: Mask):
        self.name, self.inner = name, inner

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, q_len: int, kv_len: int) -> Tensor:
        return self.inner.evaluate(b, h, q, k, q_len, kv_len)

    def _tiles(self, t: _Tiling) -> _Band | _Grid:
        return self.inner._tiles(t)

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        self.inner.validate(batch, heads, q_len, kv_len)

    def _size(self) -> tuple[int, int] | None:
        return self.inner._size()

    def _size_guess(self) -> tuple[int, int] | None:
        return self.inner._size_guess()

    def batch_size(self) -> int:
        return self.inner.batch_size()

    def _head_count(self) -> int:
        return self.inner._head_count()

    def conjuncts(self) -> tuple[Mask, ...]:
        return self.inner.conjuncts()

    def value_key(self) -> str | None:
        return repr(self) if self.inner.value_key() is not None else None

    def cheap_structure(self) -> bool:
        return self.inner.cheap_structure()

    def is_positional(self, align: str = "bottom_right") -> bool:
        return self.inner.is_positional(align)

    def __repr__(self) -> str:
        return self.name


def _leaves(mask: Mask) -> Iterator[Mask]:
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
