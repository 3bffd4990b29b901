"""Rope scaling (exported by :mod:`attnkit.nn`): how a :class:`~attnkit.nn.RotaryEmbedding` stretches its frequencies past the length a model
was trained at, one typed dataclass per method.

* :class:`LinearScaling`: positions divided by ``factor`` (position interpolation);
* :class:`NTKScaling`: the base raised to ``base * factor^(dim / (dim - 2))`` (static NTK-aware scaling);
* :class:`Llama3Scaling`: low frequencies divided by ``factor``, high ones kept, a smooth blend between;
* :class:`YaRNScaling`: a per-frequency blend of interpolated and original frequencies, and the rotated queries
  and keys multiplied by an attention factor;
* :class:`LongRoPEScaling`: per-pair factors, short ones up to the original length and long ones past it;
* :class:`DynamicNTKScaling`: NTK's base growing with each sequence's length past the original length.

Each checks its fields when built (a ValueError or TypeError naming the field, the value and the fix) and
gives the inverse frequencies of a call (:meth:`RopeScaling.inv_freq`).  :meth:`RopeScaling.from_hf` reads
the dict form: Hugging Face's ``rope_scaling`` / ``rope_parameters`` (``rope_type``,
``original_max_position_embeddings``) or attnkit's (``type``, ``original_max_seq_len``), as
:class:`~attnkit.nn.DecoderConfig` stores it; :meth:`RopeScaling.to_dict` and :meth:`RopeScaling.to_hf` write
those two forms back.

Example::

    >>> from attnkit.nn import RopeScaling, RotaryEmbedding, YaRNScaling
    >>> yarn = YaRNScaling(4.0, original_max_seq_len=4096)
    >>> round(yarn.attention_factor, 4)  # 0.1 ln 4 + 1
    1.1386
    >>> hf = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    >>> RopeScaling.from_hf(hf) == yarn
    True
    >>> rope = RotaryEmbedding(64, base=10000.0, scaling=yarn)
    >>> rope.inv_freq.shape, rope.attention_factor == yarn.attention_factor
    (torch.Size([32]), True)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import _checks

Tensor = torch.Tensor

__all__ = [
    "RopeScaling",
    "LinearScaling",
    "NTKScaling",
    "Llama3Scaling",
    "YaRNScaling",
    "LongRoPEScaling",
    "DynamicNTKScaling",
]


def _exponents(dim: int) -> Tensor:
    """``2i / dim`` for the ``dim/2`` rotated pairs, float32."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _plain(base: float, dim: int) -> Tensor:
    """The unscaled inverse frequencies ``base^(-2i/dim)`` ``(dim/2,)``, float32."""
    return 1.0 / (base ** _exponents(dim))


def _ntk_base(base: float, dim: int, factor: float) -> float:
    """The base NTK-aware scaling raises ``base`` to for a stretch of ``factor``."""
    return base * factor ** (dim / (dim - 2)) if dim > 2 else base


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _factors(name: str, value) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"scaling[{name!r}] must be a list of positive floats (one per rotated pair), got {value!r}")
    return tuple(_checks.positive_float(f"scaling[{name!r}][{i}]", float(f)) for i, f in enumerate(value))


def _original_len(value) -> int:
    return _checks.positive_int("scaling['original_max_seq_len']", value)


class RopeScaling:
    """Base of the rope scalings: ``type`` (the name in the dict forms), ``length_dependent`` (the frequencies
    depend on a sequence's length: LongRoPE, dynamic NTK), ``attention_factor`` (what the rotated queries and
    keys are multiplied by) and :meth:`inv_freq`."""

    type: ClassVar[str]
    length_dependent: ClassVar[bool] = False
    attention_factor = 1.0

    def inv_freq(self, base: float, dim: int, seq_len: int) -> Tensor:
        """The inverse frequencies ``(dim/2,)`` (float32) of a call whose positions are all ``< seq_len``, for a
        rotary embedding of ``dim`` dims and base ``base``."""
        raise NotImplementedError

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # a frozen dataclass's field, normalised while it is checked

    def to_dict(self) -> dict:
        """attnkit's dict form, ``{"type": ..., fields}`` (fields left at None omitted), which :meth:`from_hf`
        reads back."""
        out: dict = {"type": self.type}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_hf(self) -> dict:
        """Hugging Face's ``rope_parameters`` form (without ``rope_theta``): ``rope_type``,
        ``original_max_position_embeddings`` for ``original_max_seq_len``."""
        out = self.to_dict()
        out["rope_type"] = out.pop("type")
        if "original_max_seq_len" in out:
            out["original_max_position_embeddings"] = out.pop("original_max_seq_len")
        return out

    @classmethod
    def from_hf(cls, scaling: dict, base: float | None = None) -> "RopeScaling | None":
        """The scaling a dict describes, or None for Hugging Face's ``"default"`` rope type.

        Hugging Face's form is accepted (``rope_type`` beside or instead of ``type``,
        ``original_max_position_embeddings`` for ``original_max_seq_len``, keys left at None taking their
        defaults) and ``rope_theta``, which must equal ``base`` when both are given.  Called on a subclass
        (``YaRNScaling.from_hf(d)``), the dict must be of that type.

        Example::

            >>> from attnkit.nn import RopeScaling
            >>> RopeScaling.from_hf({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
            LinearScaling(factor=2.0)
        """
        if not isinstance(scaling, dict):
            raise TypeError(f"scaling must be None or a dict like {{'type': 'linear', 'factor': 2.0}}, got {scaling!r}")
        s = dict(scaling)
        kind, hf_kind = s.pop("type", None), s.pop("rope_type", None)
        if kind is not None and hf_kind is not None and kind != hf_kind:
            raise ValueError(f"scaling has type={kind!r} and rope_type={hf_kind!r}: give one")
        kind = kind if kind is not None else hf_kind
        theta = s.pop("rope_theta", None)
        if theta is not None and base is not None and float(theta) != float(base):
            raise ValueError(
                f"scaling['rope_theta']={theta!r} differs from the rotary base {base!r}: pass the same "
                f"value as base (rope_theta in a DecoderConfig), or drop it from the scaling dict"
            )
        if kind == "default":
            if s:
                raise ValueError(f"scaling has keys {sorted(s)} that the 'default' rope type does not use")
            return None
        if kind not in _KINDS:
            raise ValueError(f"scaling type {kind!r} is not one of {tuple(_KINDS)} (give it as scaling['type'])")
        kind_cls = _KINDS[kind]
        if cls is not RopeScaling and kind_cls is not cls:
            raise ValueError(f"{cls.__name__}.from_hf got a {kind!r} scaling: use RopeScaling.from_hf for any type")
        names = {f.name for f in dataclasses.fields(kind_cls)}  # type: ignore[arg-type]
        old = None
        if "original_max_seq_len" in names:
            old = s.pop("original_max_position_embeddings", None)
            old = s.pop("original_max_seq_len", old)
        if "original_max_seq_len" in names and old is None and kind != "llama3":
            raise ValueError(
                f"{kind} scaling needs scaling['original_max_seq_len'] (Hugging Face's "
                f"original_max_position_embeddings): the context length the model was trained at"
            )
        if "attention_factor" not in names:
            unused = _checks.positive_float(
                "scaling['attention_factor']", s.pop("attention_factor", None), allow_none=True
            )
            if unused not in (None, 1.0):
                raise ValueError(
                    f"scaling['attention_factor']={unused} is not used by {kind!r} scaling: drop it "
                    f"(only yarn and longrope scale the rotated queries and keys)"
                )
        if kind == "yarn":  # (transformers' defaults for a missing or zero beta)
            s["beta_fast"], s["beta_slow"] = s.pop("beta_fast", None) or 32.0, s.pop("beta_slow", None) or 1.0
            s["truncate"] = bool(s.pop("truncate", True))
        if kind == "longrope":
            for name in ("short_factor", "long_factor"):
                if name not in s:
                    raise ValueError(f"longrope scaling needs scaling[{name!r}]: a list of dim/2 positive floats")
        fields = {"factor": s.pop("factor", None)}
        if old is not None:
            fields["original_max_seq_len"] = old
        unknown = sorted(k for k in s if k not in names)
        if unknown:
            raise ValueError(f"scaling has keys {unknown} that {kind!r} scaling does not use")
        fields.update({k: v for k, v in s.items() if v is not None})
        return kind_cls(**fields)


@dataclass(frozen=True)
class LinearScaling(RopeScaling):
    """Position interpolation: positions divided by ``factor`` (every frequency divided by it).

    Example::

        >>> from attnkit.nn import LinearScaling
        >>> LinearScaling(4.0).to_hf()
        {'factor': 4.0, 'rope_type': 'linear'}
    """

    type: ClassVar[str] = "linear"
    factor: float  # the stretch of the context, > 0

    def __post_init__(self):
        self._set("factor", _checks.positive_float("scaling['factor']", self.factor))

    def inv_freq(self, base: float, dim: int, seq_len: int) -> Tensor:
        return _plain(base, dim) / self.factor


@dataclass(frozen=True)
class NTKScaling(RopeScaling):
    """Static NTK-aware scaling: the base raised to ``base * factor^(dim / (dim - 2))``.

    Example::

        >>> from attnkit.nn import NTKScaling, RotaryEmbedding
        >>> rope = RotaryEmbedding(8, scaling=NTKScaling(4.0))  # base 10000 * 4^(8/6)
        >>> round(float(rope.inv_freq[1] ** -4))
        63496
    """

    type: ClassVar[str] = "ntk"
    factor: float  # the stretch of the context, > 0

    def __post_init__(self):
        self._set("factor", _checks.positive_float("scaling['factor']", self.factor))

    def inv_freq(self, base: float, dim: int, seq_len: int) -> Tensor:
        return _plain(_ntk_base(base, dim, self.factor), dim)


@dataclass(frozen=True)
class DynamicNTKScaling(RopeScaling):
    """Dynamic NTK: while a sequence's length is at most ``original_max_seq_len`` the frequencies are the plain
    ones; a sequence of length ``n > original_max_seq_len`` uses the base
    ``base * (factor n / original_max_seq_len - (factor - 1))^(dim / (dim - 2))``.

    Example::

        >>> import torch
        >>> from attnkit.nn import DynamicNTKScaling, RotaryEmbedding
        >>> rope = RotaryEmbedding(8, scaling=DynamicNTKScaling(2.0, original_max_seq_len=16))
        >>> rope.length_dependent, torch.equal(rope.inv_freq_for(16), rope.inv_freq)
        (True, True)
    """

    type: ClassVar[str] = "dynamic"
    length_dependent: ClassVar[bool] = True
    factor: float  # > 0
    original_max_seq_len: int  # the context length the model was trained at

    def __post_init__(self):
        self._set("factor", _checks.positive_float("scaling['factor']", self.factor))
        self._set("original_max_seq_len", _original_len(self.original_max_seq_len))

    def inv_freq(self, base: float, dim: int, seq_len: int) -> Tensor:
        f, old = self.factor, self.original_max_seq_len
        if seq_len > old and dim > 2:
            base = base * ((f * seq_len / old) - (f - 1)) ** (dim / (dim - 2))
        return _plain(base, dim)


@dataclass(frozen=True)
class Llama3Scaling(RopeScaling):
    """Llama 3.1's: wavelengths longer than ``original_max_seq_len / low_freq_factor`` divided by ``factor``,
    shorter than ``original_max_seq_len / high_freq_factor`` kept, a smooth blend between.

    Example::

        >>> from attnkit.nn import Llama3Scaling
        >>> Llama3Scaling(8.0).to_dict()
        {'type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_seq_len': 8192}
    """

    type: ClassVar[str] = "llama3"
    factor: float  # > 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0  # > low_freq_factor
    original_max_seq_len: int = 8192  # Llama 3's

    def __post_init__(self):
        self._set("factor", _checks.positive_float("scaling['factor']", self.factor))
        self._set("low_freq_factor", _checks.positive_float("scaling['low_freq_factor']", self.low_freq_factor))
        self._set("high_freq_factor", _checks.positive_float("scaling['high_freq_factor']", self.high_freq_factor))
        self._set("original_max_seq_len", _original_len(self.original_max_seq_len))
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )

    def inv_freq(self, base: float, dim: int, seq_len: int) -> Tensor:
        inv = _plain(base, dim)
        old, lo, hi, f = self.original_max_seq_len, self.low_freq_factor, self.high_freq_factor, self.factor
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / f + smooth * inv
        return torch.where(wavelen > old / lo, inv / f, torch.where(wavelen < old / hi, inv, mid))


@dataclass(frozen=True)
class YaRNScaling(RopeScaling):
    """YaRN: a per-frequency blend of interpolated (``/ factor``) and original frequencies over the wavelengths
    between ``beta_fast`` and ``beta_slow`` rotations in ``original_max_seq_len`` (``truncate`` rounds that range
    to whole dims), and the rotated queries and keys multiplied by ``attention_factor`` (default
    ``0.1 ln factor + 1``, or DeepSeek's ratio of that form with ``mscale`` and ``mscale_all_dim``).

    Example::

        >>> from attnkit.nn import YaRNScaling
        >>> YaRNScaling(4.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0).attention_factor  # a ratio of 1
        1.0
    """

    type: ClassVar[str] = "yarn"
    factor: float  # > 0
    original_max_seq_len: int  # the context length the model was trained at
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # type: ignore[assignment] # None: from factor (and mscale, mscale_all_dim); set when built

    def __post_init__(self):
        factor = _checks.positive_float("scaling['factor']", self.factor)
        self._set("factor", factor)
        self._set("original_max_seq_len", _original_len(self.original_max_seq_len))
        self._set("beta_fast", _checks.positive_float("scaling['beta_fast']", self.beta_fast))
        self._set("beta_slow", _checks.positive_float("scaling['beta_slow']", self.beta_slow))
        self._set("truncate", _checks.flag("scaling['truncate']", self.truncate))
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                self._set(name, _checks.finite_float(f"scaling[{name!r}]", getattr(self, name)))
        attention_factor = _checks.positive_float("scaling['attention_factor']", self.attention_factor, allow_none=True)
        if attention_factor is None:  # YaRN's sqrt(1/t) = 0.1 ln(s) + 1, or DeepSeek's ratio of two of them
            if self.mscale and self.mscale_all_dim:
                attention_factor = yarn_mscale(factor, self.mscale) / yarn_mscale(factor, self.mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        self._set("attention_factor", float(attention_factor))

    def inv_freq(self, base: float, dim: int, seq_len: int) -> Tensor:
        """Dims rotating more than ``beta_fast`` times over the original length keep their frequency, dims
        rotating fewer than ``beta_slow`` times are interpolated (``/ factor``), a linear ramp between."""
        inv = _plain(base, dim)
        old, f, d = self.original_max_seq_len, self.factor, dim

        def dim_of(rotations: float) -> float:  # the (fractional) dim that turns `rotations` times in `old` positions
            return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        if lo == hi:
            hi += 0.001  # a ramp of zero width would divide by zero
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)  # 0: keep, 1: interpolate
        keep = 1 - ramp
        pos_freqs = 1.0 / inv  # base^(2i/d)
        return (1.0 / (f * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


@dataclass(frozen=True)
class LongRoPEScaling(RopeScaling):
    """LongRoPE (Phi-3): frequencies divided by ``short_factor`` (one per rotated pair) while a sequence's length
    is at most ``original_max_seq_len``, by ``long_factor`` once it is not, and the rotated queries and keys
    multiplied by ``attention_factor`` (default ``sqrt(1 + ln factor / ln original_max_seq_len)``; 1 without
    ``factor``, which sets only that default).

    Example::

        >>> import torch
        >>> from attnkit.nn import LongRoPEScaling, RotaryEmbedding
        >>> rope = RotaryEmbedding(4, scaling=LongRoPEScaling([1.0, 1.0], [2.0, 4.0], original_max_seq_len=8))
        >>> torch.allclose(rope.inv_freq_for(9), rope.inv_freq / torch.tensor([2.0, 4.0]))  # past 8: the long factors
        True
    """

    type: ClassVar[str] = "longrope"
    length_dependent: ClassVar[bool] = True
    short_factor: tuple[float, ...]  # one per rotated pair (dim/2)
    long_factor: tuple[float, ...]  # as many as short_factor
    original_max_seq_len: int  # the context length the model was trained at
    factor: float | None = None
    attention_factor: float | None = None  # type: ignore[assignment] # None: from factor; set when built

    def __post_init__(self):
        factor = _checks.positive_float("scaling['factor']", self.factor, allow_none=True)
        self._set("factor", factor)
        attention_factor = _checks.positive_float("scaling['attention_factor']", self.attention_factor, allow_none=True)
        old = _original_len(self.original_max_seq_len)
        self._set("original_max_seq_len", old)
        for name in ("short_factor", "long_factor"):
            self._set(name, _factors(name, getattr(self, name)))
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"longrope scaling: short_factor has {len(self.short_factor)} entries and "
                f"long_factor {len(self.long_factor)}: give one per rotated pair (dim/2) in each"
            )
        if attention_factor is None:  # sqrt(1 + ln(s) / ln(L_original)), 1 without a factor
            if factor is None or factor <= 1.0:
                attention_factor = 1.0
            else:
                attention_factor = math.sqrt(1 + math.log(factor) / math.log(old))
        self._set("attention_factor", float(attention_factor))

    def inv_freq(self, base: float, dim: int, seq_len: int) -> Tensor:
        ext = self.long_factor if seq_len > self.original_max_seq_len else self.short_factor
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base ** _exponents(dim))


_KINDS: dict[str, type[RopeScaling]] = {
    c.type: c for c in (LinearScaling, NTKScaling, Llama3Scaling, YaRNScaling, LongRoPEScaling, DynamicNTKScaling)
}
