"""Score modifiers: functions of ``(score, b, h, q_idx, kv_idx)`` applied to the scaled scores.

They are applied after ``scale`` and ``softcap`` and before the mask (FlashAttention's order), so
``attention(q, k, v, bias=alibi(slopes), mask=causal())`` computes
``softmax(where(mask, softcap(q·k * scale) - slope_h * |p - j|, -inf)) @ v``.

Positions follow the contract: query row ``i`` sits at ``p = i + Lk - Lq`` unless ``align="top_left"``.
The head index ``h`` counts *query* heads (``0 .. Hq-1``), also under grouped-query attention.

Example::

    >>> import torch, attnkit
    >>> from attnkit import bias, masks
    >>> q = k = v = torch.randn(1, 4, 8, 16)
    >>> out = attnkit.attention(q, k, v, bias=bias.alibi(bias.alibi_slopes(4)), mask=masks.causal())
    >>> out.shape
    torch.Size([1, 4, 8, 16])
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Callable, TypeAlias, Union

import torch

from ._checks import flag
from . import _checks
from .masks import _check_align, _offset, index_grid

Tensor = torch.Tensor

__all__ = [
    "ScoreMod",
    "BiasLike",
    "alibi",
    "alibi_slopes",
    "relative_buckets",
    "t5_bucket",
    "temperature",
    "from_fn",
    "compose",
    "from_dict",
]


class ScoreMod:
    """A score modifier.  Subclasses implement :meth:`apply` (``q_idx`` are query rows; position-aware
    modifiers apply their alignment) with broadcastable index tensors, and :meth:`validate` where it has sizes
    to check; other code calls them and asks :meth:`is_positional`.

    ``additive`` modifiers (ALiBi, T5 buckets) can also be materialised as a float bias tensor
    (:meth:`materialize`) for backends that only take a dense bias.  Kernels that compute a modifier in
    place read ``scale_factor`` (a temperature: every score times that number, else None) and ``slopes``
    (ALiBi's ``(Hq,)`` slopes, else None)::

        >>> import torch
        >>> from attnkit import bias
        >>> bias.temperature(2.0).scale_factor, bias.alibi(torch.tensor([0.5])).slopes
        (0.5, tensor([0.5000]))
    """

    additive = False
    scale_factor: float | None = None  # a pure rescaling of every score (temperature), foldable into `scale`
    slopes: Tensor | None = None  # ALiBi's (Hq,) slopes: adds -slope * |p - j| (kernels compute it in place)

    @abstractmethod
    def apply(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, q_len: int, kv_len: int
    ) -> Tensor:
        """The modified scores, on broadcastable index tensors of a ``(q_len, kv_len)`` score matrix: batch
        ``b``, head ``h``, query *rows* ``q_idx`` and keys ``kv_idx`` (position-aware modifiers apply their
        alignment).  Every subclass implements it.

        Example::

            >>> import torch
            >>> from attnkit import bias
            >>> zero, i = torch.zeros(1, dtype=torch.long), torch.arange(3)
            >>> bias.alibi(torch.tensor([1.0])).apply(torch.zeros(3, 3), zero, zero, i.view(-1, 1),
            ...                                        i.view(1, -1), 3, 3)
            tensor([[ 0., -1., -2.],
                    [-1.,  0., -1.],
                    [-2., -1.,  0.]])
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement apply(score, b, h, q_idx, kv_idx, q_len, kv_len)"
        )

    def validate(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Check that the modifier applies to a ``(batch, heads, q_len, kv_len)`` score matrix (ValueError if
        not)."""

    def is_positional(self, align: str = "bottom_right") -> bool:
        """Whether the modifier reads nothing but the head and the query and key positions, with alignment
        ``align`` (the built-in ``alibi``, ``relative_buckets`` and ``temperature``): one can then apply it
        per sequence of a paged cache from positions alone.

        Example::

            >>> import torch
            >>> from attnkit import bias
            >>> bias.alibi(torch.tensor([0.5])).is_positional(), bias.temperature(2.0).is_positional()
            (True, True)
            >>> bias.from_fn(lambda s, b, h, q, k: s).is_positional()
            False
        """
        return False

    def _spec(self) -> dict | None:
        """A JSON-ready description of the modifier's values, None when it wraps a user function."""
        return None

    def __eq__(self, other):
        """Built-in modifiers with equal values compare equal (slopes, tables and temperatures element by
        element); a modifier from a user function equals only itself."""
        if self is other:
            return True
        if not isinstance(other, ScoreMod):
            return NotImplemented
        spec = self._spec()
        return spec is not None and spec == other._spec()

    def __hash__(self):  # by kind only: the tensors a modifier holds may change in place
        return hash(type(self).__name__) if type(self)._spec is not ScoreMod._spec else object.__hash__(self)

    def to_dict(self) -> dict:
        """A JSON-ready description that :func:`attnkit.bias.from_dict` rebuilds an equal modifier from (tensors
        as lists of floats); a modifier from a user function (:func:`from_fn`) raises ValueError.

        Example::

            >>> import torch
            >>> from attnkit import bias
            >>> mod = bias.compose(bias.temperature(2.0), bias.alibi(torch.tensor([0.5, 0.25])))
            >>> mod.to_dict()
            {'type': 'compose', 'mods': [{'type': 'temperature', 't': 2.0}, {'type': 'alibi', 'slopes': [0.5, 0.25], 'align': 'bottom_right'}]}
            >>> bias.from_dict(mod.to_dict()) == mod
            True
        """
        spec = self._spec()
        if spec is None:
            raise ValueError(
                f"{self!r} cannot be serialised: it calls a Python function; only attnkit's built-in "
                f"modifiers (alibi, relative_buckets, temperature and compose of them) are"
            )
        return spec

    def score_mod(self, q_len: int, kv_len: int) -> Callable[..., Tensor]:
        """Bound to a shape, as FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``."""

        def mod(score, b, h, q_idx, kv_idx):
            return self.apply(score, b, h, q_idx, kv_idx, q_len, kv_len)

        return mod

    def materialize(
        self,
        q_len: int,
        kv_len: int,
        *,
        batch: int = 1,
        heads: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """The additive term as a float tensor ``(B', H', q_len, kv_len)`` (additive modifiers only)."""
        if not self.additive:
            raise TypeError(f"{self!r} is not additive and cannot be materialised as a bias tensor")
        self.validate(batch, heads, q_len, kv_len)
        b, h, q, k = index_grid(batch, heads, q_len, kv_len, device)
        zero = torch.zeros((), device=b.device, dtype=dtype)
        out = self.apply(zero, b, h, q, k, q_len, kv_len).to(dtype)
        while out.dim() < 4:
            out = out.unsqueeze(0)
        return out.expand(out.shape[0], out.shape[1], q_len, kv_len)


BiasLike: TypeAlias = Union[ScoreMod, Tensor]
"""What ``bias=`` takes (with ``None`` for no bias): a :class:`ScoreMod` or a float tensor broadcastable to
``(B, Hq, Lq, Lk)``, added to the scores."""


def _head_param(name: str, values, *, positive: bool) -> Tensor:
    what = f"{name} must be a 1-D float tensor or a list of numbers, one per query head"
    if isinstance(values, (str, bytes)):  # (a string would be read as one number per character)
        raise TypeError(f"{what}, got {values!r:.80}")
    try:
        t = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{what}, got {values!r:.80}") from None
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{what}, got dtype {t.dtype}")
    if not t.is_floating_point():
        t = t.to(torch.float32)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor with one value per query head, got shape {tuple(t.shape)}")
    if t.device.type != "meta" and not bool(torch.isfinite(t.detach()).all()):
        raise ValueError(f"{name} must be finite numbers, got {t.detach().tolist()}")
    if positive and bool((t.detach() <= 0).any()):
        raise ValueError(f"{name} must be > 0, got {t.detach().tolist()}")
    return t


class _ALiBi(ScoreMod):
    additive = True

    def __init__(self, slopes: Tensor, align: str):
        self.slopes, self.align = slopes, _check_align(align)

    def apply(self, score, b, h, q, k, q_len, kv_len):
        slopes = self.slopes.to(device=h.device)
        p = q + _offset(self.align, q_len, kv_len)
        return score - slopes[h] * (p - k).abs().to(slopes.dtype)

    def validate(self, batch, heads, q_len, kv_len):
        if len(self.slopes) != heads:
            raise ValueError(
                f"alibi: got {len(self.slopes)} slopes for Hq={heads} query heads: "
                f"give one slope per query head (attnkit.bias.alibi_slopes({heads}))"
            )

    def is_positional(self, align="bottom_right"):
        return self.align == align

    def __repr__(self):
        return f"alibi({len(self.slopes)} slopes, align={self.align!r})"

    def _spec(self):
        return {"type": "alibi", "slopes": self.slopes.detach().cpu().tolist(), "align": self.align}


def alibi(slopes, *, align: str = "bottom_right") -> ScoreMod:
    """ALiBi (Press et al. 2022): adds ``-slopes[h] * |p - j|`` to the score of query position ``p``
    and key ``j``.  ``slopes`` is ``(Hq,)``, a tensor (learnable if it requires grad) or a list."""
    return _ALiBi(_head_param("alibi slopes", slopes, positive=False), align)


def alibi_slopes(n_heads: int) -> Tensor:
    """The paper's geometric slopes ``2^(-8 i / n)``, ``i = 1..n``, for ``n`` a power of two; otherwise
    the slopes of the nearest smaller power of two followed by every other slope of the next one.

    Example::

        >>> from attnkit.bias import alibi_slopes
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    _checks.int_in_range("alibi_slopes: n_heads", n_heads, 1)

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = power_of_two(closest)
    if closest < n_heads:
        slopes += power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def t5_bucket(
    relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket of ``relative_position = j - p``: exact buckets for small distances, logarithmic
    ones up to ``max_distance``; with ``bidirectional=False`` only the past (``j <= p``) is bucketed."""
    bidirectional = flag("bidirectional", bidirectional)
    n = -relative_position
    ret = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).to(ret.dtype) * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(ret.dtype)
    large = large.clamp(max=num_buckets - 1)
    return ret + torch.where(is_small, n, large)


class _RelativeBuckets(ScoreMod):
    additive = True

    def __init__(self, table: Tensor, bidirectional: bool, max_distance: int, align: str):
        self.table, self.bidirectional, self.max_distance = table, bool(bidirectional), max_distance
        self.align = _check_align(align)

    def apply(self, score, b, h, q, k, q_len, kv_len):
        p = q + _offset(self.align, q_len, kv_len)
        bucket = t5_bucket(
            k - p, bidirectional=self.bidirectional, num_buckets=self.table.shape[1], max_distance=self.max_distance
        )
        return score + self.table.to(h.device)[h, bucket]

    def validate(self, batch, heads, q_len, kv_len):
        if self.table.shape[0] != heads:
            raise ValueError(
                f"relative_buckets: the table has {self.table.shape[0]} rows for Hq={heads} query "
                f"heads: give a (Hq, num_buckets) table"
            )

    def is_positional(self, align="bottom_right"):
        return self.align == align

    def __repr__(self):
        h, n = self.table.shape
        return f"relative_buckets({h}x{n}, bidirectional={self.bidirectional}, max_distance={self.max_distance})"

    def _spec(self):
        return {
            "type": "relative_buckets",
            "table": self.table.detach().cpu().tolist(),
            "bidirectional": self.bidirectional,
            "max_distance": self.max_distance,
            "align": self.align,
        }


def relative_buckets(
    table: Tensor, *, bidirectional: bool = True, max_distance: int = 128, align: str = "bottom_right"
) -> ScoreMod:
    """T5's relative position bias: adds ``table[h, bucket(j - p)]``.

    ``table``: ``(Hq, num_buckets)`` float tensor, usually a learned parameter (gradients flow into it).
    ``bidirectional=False`` is the decoder's (causal) bucketing.
    """
    if not isinstance(table, torch.Tensor) or not table.is_floating_point() or table.dim() != 2:
        got = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"relative_buckets: table must be a float tensor (Hq, num_buckets), got {got}")
    bidirectional = flag("bidirectional", bidirectional)
    if table.shape[1] < 2 or (bidirectional and table.shape[1] < 4):
        raise ValueError(f"relative_buckets: num_buckets={table.shape[1]} is too small (need >= 4 bidirectional)")
    _checks.int_in_range("relative_buckets: max_distance", max_distance, 2)
    max_exact = (table.shape[1] // 2 if bidirectional else table.shape[1]) // 2
    if max_distance <= max_exact:
        raise ValueError(
            f"relative_buckets: max_distance={max_distance} must exceed the {max_exact} exact buckets "
            f"({table.shape[1]} buckets{', half per direction' if bidirectional else ''}): the "
            f"logarithmic buckets span max_exact .. max_distance; raise max_distance or use fewer buckets"
        )
    return _RelativeBuckets(table, bidirectional, max_distance, align)


class _Temperature(ScoreMod):
    def __init__(self, t):
        self.t = t
        self.scale_factor = (1.0 / float(t)) if not isinstance(t, torch.Tensor) else None

    def apply(self, score, b, h, q, k, q_len, kv_len):
        if isinstance(self.t, torch.Tensor):
            return score / self.t.to(h.device)[h]
        return score / self.t

    def validate(self, batch, heads, q_len, kv_len):
        if isinstance(self.t, torch.Tensor) and len(self.t) != heads:
            raise ValueError(f"temperature: got {len(self.t)} temperatures for Hq={heads} query heads")

    def is_positional(self, align="bottom_right"):
        return True  # (reads the head alone)

    def __repr__(self):
        return f"temperature({self.t if not isinstance(self.t, torch.Tensor) else self.t.tolist()})"

    def _spec(self):
        return {
            "type": "temperature",
            "t": self.t.detach().cpu().tolist() if isinstance(self.t, torch.Tensor) else self.t,
        }


def temperature(t) -> ScoreMod:
    """Divide every score by ``t`` (> 0): ``t > 1`` flattens the attention, ``t < 1`` sharpens it.
    ``t`` is a number or a ``(Hq,)`` tensor of per-head temperatures."""
    if isinstance(t, torch.Tensor):
        t = _head_param("temperature", t, positive=True)
    else:
        t = _checks.positive_float("temperature: t", t)
    return _Temperature(t)


class _FromFn(ScoreMod):
    def __init__(self, fn, name):
        if not callable(fn):
            raise TypeError(f"from_fn: fn must be callable as fn(score, b, h, q_idx, kv_idx) -> score, got {fn!r}")
        self.fn, self.name = fn, name or getattr(fn, "__name__", "fn")

    def apply(self, score, b, h, q, k, q_len, kv_len):
        out = self.fn(score, b, h, q, k)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise TypeError(
                f"{self!r}: fn must return a float tensor of scores, got "
                f"{out.dtype if isinstance(out, torch.Tensor) else type(out).__name__}"
            )
        _check_score_shape(self, out, score, b, h, q, k)
        return out

    def __repr__(self):
        return f"from_fn({self.name})"


def _check_score_shape(mod: ScoreMod, out: Tensor, score: Tensor, *index: Tensor) -> None:
    """Raise unless ``out`` holds one score per element: it broadcasts against ``score`` and the index tensors
    without growing them, and keeps every axis along which ``score`` varies (no reduction, no reshape)."""
    shape = torch.broadcast_shapes(score.shape, *(i.shape for i in index))
    try:
        ok = torch.broadcast_shapes(out.shape, shape) == shape
    except RuntimeError:
        ok = False
    lead = len(shape) - out.dim()
    ok = ok and all(
        s == 1 or (d >= lead and out.shape[d - lead] == s)
        for d, s in enumerate((1,) * (len(shape) - score.dim()) + tuple(score.shape))
    )
    if not ok:
        raise ValueError(
            f"{mod!r}: fn returned shape {tuple(out.shape)} for scores of shape {tuple(score.shape)} "
            f"(index tensors broadcasting to {tuple(shape)}): return one score per element, built from "
            f"score, b, h, q_idx, kv_idx with elementwise, broadcasting ops (e.g. "
            f"score - (q_idx - kv_idx).abs()), without reshaping or reducing them"
        )


def from_fn(fn: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor], *, name: str | None = None) -> ScoreMod:
    """A modifier from ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's ``score_mod``);
    ``q_idx`` is the query row.  It must be elementwise in ``score`` and broadcast over the indices."""
    return _FromFn(fn, name)


class _Compose(ScoreMod):
    def __init__(self, mods: tuple[ScoreMod, ...]):
        self.mods = mods
        self.additive = all(m.additive for m in mods)

    def apply(self, score, b, h, q, k, q_len, kv_len):
        for m in self.mods:
            score = m.apply(score, b, h, q, k, q_len, kv_len)
        return score

    def validate(self, *args):
        for m in self.mods:
            m.validate(*args)

    def __repr__(self):
        return " then ".join(map(repr, self.mods))

    def _spec(self):
        specs = [m._spec() for m in self.mods]
        return None if None in specs else {"type": "compose", "mods": specs}


def compose(*mods: ScoreMod) -> ScoreMod:
    """Apply several modifiers in order, e.g. ``compose(temperature(2.0), alibi(slopes))``."""
    for m in mods:
        if not isinstance(m, ScoreMod):
            raise TypeError(f"compose: expected attnkit.bias modifiers, got {type(m).__name__}")
    return _Compose(tuple(mods))


def from_dict(data: dict) -> ScoreMod:
    """The modifier a :meth:`ScoreMod.to_dict` description stands for (float32 tensors from the lists).

    Example::

        >>> from attnkit import bias
        >>> bias.from_dict({"type": "temperature", "t": 2.0})
        temperature(2.0)
    """
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"bias.from_dict takes a dict with a 'type' as ScoreMod.to_dict gives, got {data!r:.120}")
    d = dict(data)
    kind = d.pop("type")
    try:
        if kind == "alibi":
            return alibi(torch.tensor(d.pop("slopes"), dtype=torch.float32), **d)
        if kind == "relative_buckets":
            return relative_buckets(torch.tensor(d.pop("table"), dtype=torch.float32), **d)
        if kind == "temperature":
            t = d.pop("t")
            return temperature(torch.tensor(t, dtype=torch.float32) if isinstance(t, list) else t, **d)
        if kind == "compose":
            return compose(*(from_dict(m) for m in d.pop("mods")), **d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"bias.from_dict: {data!r:.120} is not a {kind!r} description ({e})") from None
    raise ValueError(
        f"bias.from_dict: type {kind!r} is not one of 'alibi', 'relative_buckets', 'temperature', 'compose'"
    )
