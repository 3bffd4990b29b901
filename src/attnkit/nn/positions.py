"""Position encodings that plug into :class:`~attnkit.nn.MultiHeadAttention` (``positions=...``).

Three ways to tell attention where tokens are:

* **rotary** (:class:`RotaryEmbedding`): queries and keys are rotated by their *absolute* positions
  before attention (and before keys enter a KV cache), so their dot product depends on the distance.
* **score bias** (:class:`ALiBi`, :class:`T5RelativeBias`): a term added to the scores from the
  *relative* distance ``p - j``, computed by :mod:`attnkit.bias` with the library's bottom-right
  alignment; with a KV cache that holds the keys in position order the distances stay exact.
* **absolute** (:class:`SinusoidalPositions`): ``sin``/``cos`` waves added to the inputs (of the queries
  and keys inside attention, or of the whole model at the embedding).

Each is a :class:`PositionEncoding`; ``extrapolates`` says whether positions beyond the trained
``max_seq_len`` are meaningful (ALiBi and T5 buckets: yes; rotary and sinusoidal: no).

Example::

    >>> import torch
    >>> from attnkit.nn import MultiHeadAttention, RotaryEmbedding
    >>> mha = MultiHeadAttention(32, 4, positions=RotaryEmbedding(8))
    >>> mha(torch.randn(2, 6, 32)).shape
    torch.Size([2, 6, 32])
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import bias as _bias
from . import _checks

Tensor = torch.Tensor

__all__ = ["PositionEncoding", "RotaryEmbedding", "ALiBi", "T5RelativeBias", "SinusoidalPositions"]


class PositionEncoding(nn.Module):
    """Base class of the position encodings :class:`~attnkit.nn.MultiHeadAttention` accepts.

    Hooks (each a no-op by default): :meth:`rotate` queries/keys ``(B, H, L, D)`` at absolute positions;
    :meth:`score_mod` gives an :mod:`attnkit.bias` modifier; :meth:`encode` gives vectors ``(..., L, dim)``
    to add to the query/key inputs.

    Example (a custom encoding: a fixed bias that only lets queries see keys within distance 2; a
    ``bias.from_fn`` function gets query *rows*, which are positions only without a KV cache: with a cache,
    build position-dependent biases from :func:`attnkit.bias.alibi` / :func:`~attnkit.bias.relative_buckets`,
    or the pattern as a mask, here ``masks.sliding_window(2, 2)``)::

        >>> import torch
        >>> from attnkit import bias
        >>> from attnkit.nn import MultiHeadAttention, PositionEncoding
        >>> class Near(PositionEncoding):
        ...     extrapolates = True
        ...     def score_mod(self):
        ...         return bias.from_fn(lambda s, b, h, q, k: s - 1e4 * ((q - k).abs() > 2).float())
        >>> MultiHeadAttention(16, 2, positions=Near())(torch.randn(1, 5, 16)).shape
        torch.Size([1, 5, 16])
    """

    extrapolates = False  # meaningful beyond the trained max_seq_len
    absolute = False  # needs the tokens' absolute positions (rotary, sinusoidal) rather than key order

    def rotate(self, x: Tensor, positions: Tensor, *, max_position: int | None = None) -> Tensor:
        return x

    def score_mod(self) -> _bias.ScoreMod | None:
        return None

    def encode(self, positions: Tensor) -> Tensor | None:
        return None

    def check_heads(self, n_heads: int, d_head: int, d_model: int) -> None:
        """Raise ValueError when this encoding cannot serve an attention of this layout."""


# ----------------------------------------------------------------------------------- rotary

_SCALINGS = ("linear", "ntk", "llama3")


def _parse_scaling(scaling, base: float | None = None) -> dict | None:
    """The validated scaling dict (``type``, ``factor``, llama3's factors), or None.  Hugging Face's form is
    accepted: ``rope_type`` beside or instead of ``type``, and ``rope_theta``, which must equal ``base``."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be None or a dict like {{'type': 'linear', 'factor': 2.0}}, got {scaling!r}")
    s = dict(scaling)
    kind, hf_kind = s.pop("type", None), s.pop("rope_type", None)
    if kind is not None and hf_kind is not None and kind != hf_kind:
        raise ValueError(f"scaling has type={kind!r} and rope_type={hf_kind!r}: give one")
    kind = kind if kind is not None else hf_kind
    theta = s.pop("rope_theta", None)
    if theta is not None and base is not None and float(theta) != float(base):
        raise ValueError(f"scaling['rope_theta']={theta!r} differs from the rotary base {base!r}: pass the same "
                         f"value as base (rope_theta in a DecoderConfig), or drop it from the scaling dict")
    if kind == "default":
        if s:
            raise ValueError(f"scaling has keys {sorted(s)} that the 'default' rope type does not use")
        return None
    if kind not in _SCALINGS:
        raise ValueError(f"scaling type {kind!r} is not one of {_SCALINGS} (give it as scaling['type'])")
    factor = _checks.positive_float("scaling['factor']", s.pop("factor", None))
    out = {"type": kind, "factor": factor}
    if kind == "llama3":
        out["low_freq_factor"] = _checks.positive_float("scaling['low_freq_factor']", s.pop("low_freq_factor", 1.0))
        out["high_freq_factor"] = _checks.positive_float("scaling['high_freq_factor']",
                                                         s.pop("high_freq_factor", 4.0))
        old = s.pop("original_max_position_embeddings", s.pop("original_max_seq_len", 8192))
        out["original_max_seq_len"] = _checks.positive_int("scaling['original_max_seq_len']", old)
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ValueError(f"llama3 scaling needs high_freq_factor > low_freq_factor, got "
                             f"{out['high_freq_factor']} and {out['low_freq_factor']}")
    s.pop("attention_factor", None)
    if s:
        raise ValueError(f"scaling has keys {sorted(s)} that {kind!r} scaling does not use")
    return out


class RotaryEmbedding(PositionEncoding):
    """Rotary position embedding (RoPE, Su et al. 2021) on the first ``dim`` dims of every head.

    Frequencies ``theta_i = base^(-2i/dim)``, ``i < dim/2``; the vector at absolute position ``p`` is
    rotated by the angles ``p * theta_i``.  Pairing: by default dims ``i`` and ``i + dim/2`` form a pair
    ("rotate half", GPT-NeoX and Hugging Face Llama); ``interleaved=True`` pairs ``2i`` and ``2i + 1``
    (the paper, GPT-J).  ``dim < d_head`` is partial rotary (the remaining dims pass through).

    Args:
        dim: rotated dims per head (even, <= d_head).
        base: ``theta`` (Llama: 10000, Llama 3: 500000).
        interleaved: pairing, see above.
        scaling: ``None`` or a dict ``{"type": "linear" | "ntk" | "llama3", "factor": f, ...}`` (Hugging
            Face's ``rope_scaling`` format is accepted): ``linear`` divides positions by ``f``; ``ntk``
            raises the base to ``base * f^(dim / (dim - 2))``; ``llama3`` rescales low frequencies
            (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
        max_seq_len: if given, positions ``>= max_seq_len`` raise ValueError (RoPE does not extrapolate).

    :meth:`rotate` takes ``x (B, H, L, D)`` and positions ``(L,)`` or ``(B, L)``; the angles are computed
    in float32 and cached per device.

    Example::

        >>> import torch
        >>> from attnkit.nn import RotaryEmbedding
        >>> rope = RotaryEmbedding(8)
        >>> q = torch.randn(1, 2, 5, 8)
        >>> a = rope.rotate(q, torch.arange(5)); b = rope.rotate(q, torch.arange(5) + 3)
        >>> torch.allclose(a @ a.transpose(-1, -2), b @ b.transpose(-1, -2), atol=1e-5)  # only distances matter
        True
    """

    absolute = True

    def __init__(self, dim: int, *, base: float = 10000.0, interleaved: bool = False, scaling: dict | None = None,
                 max_seq_len: int | None = None):
        super().__init__()
        _checks.positive_int("dim", dim)
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: dim={dim} must be even (dims are rotated in pairs)")
        self.dim = dim
        self.base = _checks.positive_float("base", base)
        self.interleaved = _checks.flag("interleaved", interleaved)
        self.scaling = _parse_scaling(scaling, self.base)
        self.max_seq_len = _checks.positive_int("max_seq_len", max_seq_len, allow_none=True)
        self.inv_freq = self._inv_freq()  # (dim/2,) float32; not a buffer, so model.to(dtype) keeps it exact
        self._tables: dict = {}
        self._shared = None  # (positions, (cos, sin)) while a model's forward shares one gather

    def _inv_freq(self) -> Tensor:
        d, base, s = self.dim, self.base, self.scaling
        if s is not None and s["type"] == "ntk":
            base = base * s["factor"] ** (d / (d - 2)) if d > 2 else base
        inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if s is None or s["type"] == "ntk":
            return inv
        if s["type"] == "linear":
            return inv / s["factor"]
        old, lo, hi = s["original_max_seq_len"], s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv / s["factor"] + smooth * inv
        return torch.where(wavelen > old / lo, inv / s["factor"], torch.where(wavelen < old / hi, inv, mid))

    def _table(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin ``(N, dim)`` for positions ``0 .. N-1`` (N >= n), expanded to the pairing."""
        key = (device, dtype)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < n:
            size = max(256, 1 << max(0, n - 1).bit_length())
            t = torch.arange(size, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(device))  # (N, dim/2)
            if self.interleaved:
                freqs = freqs.repeat_interleave(2, dim=-1)  # (N, dim): theta_0 theta_0 theta_1 theta_1 ...
            else:
                freqs = torch.cat([freqs, freqs], dim=-1)  # (N, dim): theta_0 .. theta_{d/2-1} twice
            cached = (freqs.cos().to(dtype), freqs.sin().to(dtype))
            self._tables[key] = cached
        return cached

    def cos_sin(self, positions: Tensor, dtype: torch.dtype = torch.float32, *,
                max_position: int | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin at ``positions`` ((L,) -> (L, dim); (B, L) -> (B, L, dim)) in ``dtype``.

        ``max_position``: the largest position, when the caller knows it without reading the tensor (and
        has checked it against ``max_seq_len``): nothing is synchronised or breaks a compiled graph."""
        shared = self._shared
        if shared is not None and shared[0] is positions:
            cos, sin = shared[1]  # gathered once by the model for all its layers
        else:
            cos, sin = self._gather(positions, max_position)
        return cos.to(dtype), sin.to(dtype)

    def _gather(self, positions: Tensor, max_position: int | None) -> tuple[Tensor, Tensor]:
        """float32 cos/sin at ``positions``.  A caller that knows (and checked) the largest position passes
        ``max_position`` so that the tensor is not read."""
        if positions.numel() == 0:
            z = torch.zeros(*positions.shape, self.dim, device=positions.device)
            return z, z
        if max_position is None:
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0:
                raise ValueError(f"RotaryEmbedding: positions must be >= 0, got min {lo}")
            if self.max_seq_len is not None and hi >= self.max_seq_len:
                raise ValueError(f"RotaryEmbedding: position {hi} is beyond max_seq_len={self.max_seq_len}; "
                                 f"rotary positions do not extrapolate: raise max_seq_len (with rope scaling) "
                                 f"or use ALiBi")
        else:
            hi = max_position
            if self.max_seq_len is not None and hi >= self.max_seq_len:
                raise ValueError(f"RotaryEmbedding: position {hi} is beyond max_seq_len={self.max_seq_len}; "
                                 f"rotary positions do not extrapolate: raise max_seq_len (with rope scaling) "
                                 f"or use ALiBi")
        cos, sin = self._table(hi + 1, positions.device, torch.float32)
        return cos[positions], sin[positions]

    def _share(self, positions: Tensor | None, max_position: int = 0) -> None:
        """Gather cos/sin for ``positions`` once for every layer of one forward; ``None`` ends the sharing."""
        self._shared = None if positions is None else (positions, self._gather(positions, max_position))

    def _rotate_pairs(self, x: Tensor) -> Tensor:
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((-x2, x1), dim=-1).flatten(-2)  # (..., dim): (-x1, x0, -x3, x2, ...)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def rotate(self, x: Tensor, positions: Tensor, *, max_position: int | None = None) -> Tensor:
        """``x (B, H, L, D)`` rotated at ``positions`` ``(L,)`` or ``(B, L)``; dims past ``dim`` pass through
        (``max_position`` as in :meth:`cos_sin`)."""
        if x.shape[-1] < self.dim:
            raise ValueError(f"RotaryEmbedding(dim={self.dim}) cannot rotate heads of size {x.shape[-1]}")
        cos, sin = self.cos_sin(positions, x.dtype, max_position=max_position)
        if cos.dim() == 3:  # (B, L, dim) -> (B, 1, L, dim)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.dim == x.shape[-1]:
            return x * cos + self._rotate_pairs(x) * sin
        xr, xp = x[..., : self.dim], x[..., self.dim:]
        return torch.cat((xr * cos + self._rotate_pairs(xr) * sin, xp), dim=-1)

    def check_heads(self, n_heads, d_head, d_model):
        if self.dim > d_head:
            raise ValueError(f"RotaryEmbedding(dim={self.dim}) is wider than the heads (d_head={d_head}): "
                             f"use dim <= d_head (partial rotary rotates the first dim dims)")

    def extra_repr(self) -> str:
        s = f"{self.dim}, base={self.base:g}"
        if self.interleaved:
            s += ", interleaved=True"
        if self.scaling:
            s += f", scaling={self.scaling}"
        return s


# ------------------------------------------------------------------------------ score biases


class ALiBi(PositionEncoding):
    """ALiBi (Press et al. 2022): adds ``-slope_h * |p - j|`` to the scores (via :func:`attnkit.bias.alibi`).

    ``slopes`` default to the paper's geometric sequence (:func:`attnkit.bias.alibi_slopes`).  No
    parameters; extrapolates to any length.

    Example::

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.nn import ALiBi, MultiHeadAttention
        >>> mha = MultiHeadAttention(32, 4, positions=ALiBi(4), mask=masks.causal())
        >>> mha(torch.randn(1, 7, 32)).shape
        torch.Size([1, 7, 32])
    """

    extrapolates = True

    def __init__(self, n_heads: int, slopes: Tensor | None = None):
        super().__init__()
        _checks.positive_int("n_heads", n_heads)
        slopes = _bias.alibi_slopes(n_heads) if slopes is None else torch.as_tensor(slopes, dtype=torch.float32)
        if slopes.shape != (n_heads,):
            raise ValueError(f"ALiBi: slopes must have shape ({n_heads},), got {tuple(slopes.shape)}")
        self.n_heads = n_heads
        self.slopes = slopes  # float32, not a buffer: model.to(bfloat16) must not round it
        self._mod = _bias.alibi(slopes)

    def score_mod(self):
        return self._mod

    def check_heads(self, n_heads, d_head, d_model):
        if n_heads != self.n_heads:
            raise ValueError(f"ALiBi was built for n_heads={self.n_heads} but the attention has {n_heads} "
                             f"query heads: use ALiBi({n_heads})")

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}"


class T5RelativeBias(PositionEncoding):
    """T5's learned relative position bias: ``table[h, bucket(j - p)]`` added to the scores.

    Distances below ``num_buckets / 4`` (bidirectional; ``/ 2`` causal) get their own bucket, larger ones
    share logarithmic buckets up to ``max_distance`` (:func:`attnkit.bias.relative_buckets`).
    ``bidirectional=True`` for encoders, ``False`` for causal decoders (only the past is bucketed).  The
    table ``(n_heads, num_buckets)`` is a parameter; one instance may be shared by every layer (as T5 does).

    Example::

        >>> import torch
        >>> from attnkit.nn import MultiHeadAttention, T5RelativeBias
        >>> t5 = T5RelativeBias(4, bidirectional=True)
        >>> t5.table.shape
        torch.Size([4, 32])
        >>> MultiHeadAttention(32, 4, positions=t5)(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    extrapolates = True

    def __init__(self, n_heads: int, num_buckets: int = 32, max_distance: int = 128, *, bidirectional: bool = True):
        super().__init__()
        _checks.positive_int("n_heads", n_heads)
        _checks.positive_int("num_buckets", num_buckets)
        _checks.positive_int("max_distance", max_distance)
        self.n_heads, self.max_distance = n_heads, max_distance
        self.bidirectional = _checks.flag("bidirectional", bidirectional)
        self.table = nn.Parameter(torch.randn(n_heads, num_buckets) * 0.02)
        self._mod = _bias.relative_buckets(self.table, bidirectional=self.bidirectional, max_distance=max_distance)

    def score_mod(self):
        self._mod.table = self.table  # follow .to(...) / load_state_dict replacing the parameter
        return self._mod

    def check_heads(self, n_heads, d_head, d_model):
        if n_heads != self.n_heads:
            raise ValueError(f"T5RelativeBias was built for n_heads={self.n_heads} but the attention has "
                             f"{n_heads} query heads: use T5RelativeBias({n_heads})")

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, num_buckets={self.table.shape[1]}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")


# ---------------------------------------------------------------------------------- absolute


class SinusoidalPositions(PositionEncoding):
    """The original Transformer's absolute encoding: ``pe[p, 2i] = sin(p / base^(2i/dim))``,
    ``pe[p, 2i+1] = cos(p / base^(2i/dim))``.

    :meth:`encode` maps positions ``(L,)`` or ``(B, L)`` to ``(L, dim)`` or ``(B, L, dim)`` (float32).
    Inside :class:`~attnkit.nn.MultiHeadAttention` it is added to the query and key inputs (not the
    values, as DETR does); at a model's embedding it is added to the token embeddings.

    Example::

        >>> import torch
        >>> from attnkit.nn import SinusoidalPositions
        >>> pe = SinusoidalPositions(4).encode(torch.arange(3))
        >>> pe.shape, pe[0].tolist()
        (torch.Size([3, 4]), [0.0, 1.0, 0.0, 1.0])
    """

    absolute = True

    def __init__(self, dim: int, *, base: float = 10000.0, max_seq_len: int | None = None):
        super().__init__()
        _checks.positive_int("dim", dim)
        if dim % 2:
            raise ValueError(f"SinusoidalPositions: dim={dim} must be even (sin/cos pairs)")
        self.dim, self.base = dim, _checks.positive_float("base", base)
        self.max_seq_len = _checks.positive_int("max_seq_len", max_seq_len, allow_none=True)
        self.inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def encode(self, positions: Tensor) -> Tensor:
        if positions.numel() and self.max_seq_len is not None and int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"SinusoidalPositions: position {int(positions.max())} is beyond "
                             f"max_seq_len={self.max_seq_len}")
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)  # (..., L, dim/2)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (..., L, dim) sin, cos interleaved

    def check_heads(self, n_heads, d_head, d_model):
        if self.dim != d_model:
            raise ValueError(f"SinusoidalPositions(dim={self.dim}) is added to inputs of width d_model={d_model}: "
                             f"use SinusoidalPositions({d_model})")

    def extra_repr(self) -> str:
        return f"{self.dim}, base={self.base:g}"
