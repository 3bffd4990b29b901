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


import torch
import torch.nn as nn

from .. import bias as _bias
from . import _checks
from .rope_scaling import RopeScaling, _plain

Tensor = torch.Tensor

__all__ = ["PositionEncoding", "RotaryEmbedding", "ALiBi", "T5RelativeBias", "SinusoidalPositions"]


class PositionEncoding(nn.Module):
    """Base class of the position encodings :class:`~attnkit.nn.MultiHeadAttention` accepts.

    Hooks (each a no-op by default): ``rotate`` queries/keys ``(B, H, L, D)`` at absolute positions;
    ``score_mod`` gives an :mod:`attnkit.bias` modifier; ``encode`` gives vectors ``(..., L, dim)``
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


def _scaling(scaling, base: float | None = None) -> RopeScaling | None:
    """``scaling`` as a :class:`~attnkit.nn.RopeScaling` (a dict read by its ``from_hf``), or None."""
    if scaling is None or isinstance(scaling, RopeScaling):
        return scaling
    if not isinstance(scaling, dict):
        raise TypeError(
            f"scaling must be None, a RopeScaling (e.g. attnkit.nn.LinearScaling(2.0)) or a dict like "
            f"{{'type': 'linear', 'factor': 2.0}}, got {scaling!r}"
        )
    return RopeScaling.from_hf(scaling, base)


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
        scaling: ``None``, a :class:`~attnkit.nn.RopeScaling` (the typed form, e.g.
            ``YaRNScaling(4.0, original_max_seq_len=4096)``), or its dict form ``{"type": ..., "factor": f, ...}``
            read by :meth:`RopeScaling.from_hf <attnkit.nn.RopeScaling.from_hf>` (Hugging Face's
            ``rope_scaling`` / ``rope_parameters`` format is accepted, ``original_max_position_embeddings`` for
            ``original_max_seq_len``); kept as ``scaling`` (typed):

            * ``linear`` (:class:`~attnkit.nn.LinearScaling`): positions divided by ``f``;
            * ``ntk`` (:class:`~attnkit.nn.NTKScaling`): the base raised to ``base * f^(dim / (dim - 2))``
              (static NTK-aware scaling);
            * ``llama3`` (:class:`~attnkit.nn.Llama3Scaling`): low frequencies divided by ``f``, high ones kept,
              a smooth blend between (``low_freq_factor``, ``high_freq_factor``, ``original_max_seq_len``);
            * ``yarn`` (:class:`~attnkit.nn.YaRNScaling`): per-frequency blend of interpolated (``/ f``) and
              original frequencies over the wavelengths between ``beta_fast`` and ``beta_slow`` rotations in
              ``original_max_seq_len`` (``truncate`` rounds that range to whole dims), and the rotated queries and
              keys multiplied by ``attention_factor`` (default ``0.1 ln f + 1``, or DeepSeek's ratio of that form
              with ``mscale`` and ``mscale_all_dim``);
            * ``longrope`` (:class:`~attnkit.nn.LongRoPEScaling`): frequencies divided by ``short_factor`` (one
              per pair) while a sequence's length is at most ``original_max_seq_len``, by ``long_factor`` once it
              is not, and the rotated queries and keys multiplied by ``attention_factor`` (default
              ``sqrt(1 + ln f / ln original_max_seq_len)``; 1 without ``factor``);
            * ``dynamic`` (dynamic NTK, :class:`~attnkit.nn.DynamicNTKScaling`): while a sequence's length is at
              most ``original_max_seq_len`` the frequencies are the plain ones; a sequence of length
              ``n > original_max_seq_len`` uses the base ``base * (f n / original_max_seq_len - (f - 1))^(dim /
              (dim - 2))``.

            The last two pick each sequence's frequencies from its own length, never from the batch: a row
            whose positions start at 0 (a prompt computed at once) takes its largest position + 1 for all its
            tokens, as transformers does for one sequence; a row continuing a cached sequence (decode steps, the
            tokens a speculative step verifies) gives each token its own ``p + 1``, as decoding it one token at
            a time would.  Keys already in a KV cache keep the rotation they were stored with (transformers'
            batched calls take the batch's largest position instead, and its dynamic NTK keeps the frequencies of
            the longest call it has seen).
        max_seq_len: if given, positions ``>= max_seq_len`` raise ValueError (RoPE does not extrapolate).

    ``rotate`` takes ``x (B, H, L, D)`` and positions ``(L,)`` or ``(B, L)``; the angles are computed
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

    def __init__(
        self,
        dim: int,
        *,
        base: float = 10000.0,
        interleaved: bool = False,
        scaling: RopeScaling | dict | None = None,
        max_seq_len: int | None = None,
    ):
        super().__init__()
        _checks.positive_int("dim", dim)
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: dim={dim} must be even (dims are rotated in pairs)")
        self.dim = dim
        self.base = _checks.positive_float("base", base)
        self.interleaved = _checks.flag("interleaved", interleaved)
        self.scaling = _scaling(scaling, self.base)
        self.max_seq_len = _checks.positive_int("max_seq_len", max_seq_len, allow_none=True)
        self.attention_factor = 1.0 if self.scaling is None else self.scaling.attention_factor
        short = getattr(self.scaling, "short_factor", None)
        if short is not None and len(short) != dim // 2:
            raise ValueError(
                f"longrope scaling has {len(short)} short/long factors but "
                f"RotaryEmbedding(dim={dim}) rotates {dim // 2} pairs: give one factor per pair"
            )
        # (dim/2,) float32, the frequencies of calls within the original length; not a buffer, so model.to(dtype)
        # keeps it exact
        self.inv_freq = self.inv_freq_for(0)
        self._tables: dict = {}
        self._shared = None  # (positions, (cos, sin)) while a model's forward shares one gather

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on the sequence's length (LongRoPE, dynamic NTK)."""
        return self.scaling is not None and self.scaling.length_dependent

    def _variant(self, n: int):
        """Which frequency set a call whose positions are ``< n`` uses: None (the fixed one), "long" (LongRoPE
        past the original length) or ``n`` itself (dynamic NTK past the original length)."""
        s = self.scaling
        if s is None or not s.length_dependent or n <= s.original_max_seq_len:  # type: ignore[attr-defined]
            return None
        return "long" if s.type == "longrope" else n

    def inv_freq_for(self, seq_len: int) -> Tensor:
        """The inverse frequencies ``(dim/2,)`` (float32) of a call whose positions are all ``< seq_len``.

        Only LongRoPE and dynamic NTK depend on ``seq_len`` (see ``scaling``); the others return
        ``inv_freq``.  The rotated vectors are also multiplied by ``attention_factor``.

        Example::

            >>> rope = RotaryEmbedding(8, scaling={"type": "dynamic", "factor": 2.0, "original_max_seq_len": 16})
            >>> torch.equal(rope.inv_freq_for(16), rope.inv_freq), bool((rope.inv_freq_for(32) < rope.inv_freq).all())
            (True, False)
            >>> bool((rope.inv_freq_for(32)[1:] < rope.inv_freq[1:]).all())  # pair 0 (frequency 1) is kept
            True
        """
        if self.scaling is None:
            return _plain(self.base, self.dim)
        return self.scaling.inv_freq(self.base, self.dim, seq_len)

    def _table(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin ``(N, dim)`` for positions ``0 .. N-1`` (N >= n), expanded to the pairing and multiplied by
        the attention factor, with the frequencies of a call whose positions are ``< n``."""
        if torch.compiler.is_compiling():
            # computed in the graph, not cached: a table stored in (or looked up from) the dict while traced would
            # put a guard on the dict's keys, which the first call's own entry then fails (a recompile)
            return self._new_table(n, n, device, dtype)
        variant = self._variant(n)
        key = (variant, device, dtype)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < n:
            if isinstance(variant, int):  # dynamic NTK: a table per length; keep only the newest one
                self._tables = {k: t for k, t in self._tables.items() if not isinstance(k[0], int)}
                size = n
            else:
                size = max(256, 1 << max(0, n - 1).bit_length())
                if variant is None and self.length_dependent:
                    size = min(size, self.scaling.original_max_seq_len)  # type: ignore[union-attr] # past it the frequencies change
                size = max(size, n)
            cached = self._new_table(size, n, device, dtype)
            self._tables[key] = cached
        return cached

    def _new_table(self, size: int, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin ``(size, dim)`` for positions ``0 .. size-1`` with the frequencies of a call whose
        positions are ``< n`` (see :meth:`_table`)."""
        t = torch.arange(size, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq_for(n).to(device))  # (N, dim/2)
        if self.interleaved:
            freqs = freqs.repeat_interleave(2, dim=-1)  # (N, dim): theta_0 theta_0 theta_1 theta_1 ...
        else:
            freqs = torch.cat([freqs, freqs], dim=-1)  # (N, dim): theta_0 .. theta_{d/2-1} twice
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def cos_sin(
        self, positions: Tensor, dtype: torch.dtype = torch.float32, *, max_position: int | None = None
    ) -> tuple[Tensor, Tensor]:
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
                raise ValueError(
                    f"RotaryEmbedding: position {hi} is beyond max_seq_len={self.max_seq_len}; "
                    f"rotary positions do not extrapolate: raise max_seq_len (with rope scaling) "
                    f"or use ALiBi"
                )
        else:
            hi = max_position
            if self.max_seq_len is not None and hi >= self.max_seq_len:
                raise ValueError(
                    f"RotaryEmbedding: position {hi} is beyond max_seq_len={self.max_seq_len}; "
                    f"rotary positions do not extrapolate: raise max_seq_len (with rope scaling) "
                    f"or use ALiBi"
                )
        if self.length_dependent:
            return self._gather_per_sequence(positions, hi)
        cos, sin = self._table(hi + 1, positions.device, torch.float32)
        return cos[positions], sin[positions]

    def _lengths(self, positions: Tensor) -> Tensor:
        """The length whose frequencies each token takes (LongRoPE, dynamic NTK), like ``positions``: a row whose
        positions start at 0 is a prompt computed at once, and every token of it takes the row's length (its
        largest position + 1, as transformers); a row that continues a sequence (a decode step, tokens a
        speculative step verifies) gives each token its own length ``p + 1``, as decoding it alone one token at a
        time would.  So a sequence's rotations never depend on the other rows of the batch."""
        rows = positions.reshape(-1, positions.shape[-1])  # (R, L)
        first, last = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True)
        return torch.where(first == 0, last + 1, rows + 1).reshape(positions.shape)

    def _gather_per_sequence(self, positions: Tensor, hi: int) -> tuple[Tensor, Tensor]:
        """float32 cos/sin at ``positions`` with each token's frequencies chosen from its own length
        (:meth:`_lengths`)."""
        if torch.compiler.is_compiling():  # the lengths are read from the tensor: only one-token calls compile
            if positions.shape[-1] != 1 or positions.dim() != 1:
                raise ValueError(
                    f"rope scaling {self.scaling.type!r} picks each sequence's frequencies from its "  # type: ignore[union-attr]
                    f"own length, which a compiled forward cannot read: compile one-token decode steps "
                    f"only (positions=None), or call it without torch.compile"
                )
            cos, sin = self._table(hi + 1, positions.device, torch.float32)
            return cos[positions], sin[positions]
        lengths = self._lengths(positions)
        old = self.scaling.original_max_seq_len  # type: ignore[union-attr]
        # tokens that share a frequency set share a table: a length <= old (the plain set), LongRoPE's long set,
        # or each length past old (dynamic NTK)
        group = (lengths > old).long() if self.scaling.type == "longrope" else lengths.clamp(min=old)  # type: ignore[union-attr]
        keys = torch.unique(group).tolist()
        if len(keys) == 1:  # the usual case: one set for the whole call
            cos, sin = self._table(int(lengths.max()), positions.device, torch.float32)
            return cos[positions], sin[positions]
        cos = torch.empty(*positions.shape, self.dim, device=positions.device)
        sin = torch.empty_like(cos)
        for key in keys:
            sel = group == key
            c, s = self._table(int(lengths[sel].max()), positions.device, torch.float32)
            cos[sel], sin[sel] = c[positions[sel]], s[positions[sel]]
        return cos, sin

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
        xr, xp = x[..., : self.dim], x[..., self.dim :]
        return torch.cat((xr * cos + self._rotate_pairs(xr) * sin, xp), dim=-1)

    def check_heads(self, n_heads, d_head, d_model):
        if self.dim > d_head:
            raise ValueError(
                f"RotaryEmbedding(dim={self.dim}) is wider than the heads (d_head={d_head}): "
                f"use dim <= d_head (partial rotary rotates the first dim dims)"
            )

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
            raise ValueError(
                f"ALiBi was built for n_heads={self.n_heads} but the attention has {n_heads} "
                f"query heads: use ALiBi({n_heads})"
            )

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}"


def _check_t5_layout(n_heads: int, num_buckets: int, max_distance: int, *, bidirectional: bool) -> None:
    """Raise what :class:`T5RelativeBias` would raise for this bucket layout, without building a table (and so
    without drawing from the global random generator)."""
    _checks.positive_int("n_heads", n_heads)
    _checks.positive_int("num_buckets", num_buckets)
    _checks.positive_int("max_distance", max_distance)
    _bias.relative_buckets(
        torch.zeros(1, num_buckets),
        bidirectional=_checks.flag("bidirectional", bidirectional),
        max_distance=max_distance,
    )


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
        _check_t5_layout(n_heads, num_buckets, max_distance, bidirectional=bidirectional)
        self.n_heads, self.max_distance = n_heads, max_distance
        self.bidirectional = _checks.flag("bidirectional", bidirectional)
        self.table = nn.Parameter(torch.randn(n_heads, num_buckets) * 0.02)
        self._mod = _bias.relative_buckets(self.table, bidirectional=self.bidirectional, max_distance=max_distance)

    def score_mod(self):
        self._mod.table = self.table  # follow .to(...) / load_state_dict replacing the parameter
        return self._mod

    def check_heads(self, n_heads, d_head, d_model):
        if n_heads != self.n_heads:
            raise ValueError(
                f"T5RelativeBias was built for n_heads={self.n_heads} but the attention has "
                f"{n_heads} query heads: use T5RelativeBias({n_heads})"
            )

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, num_buckets={self.table.shape[1]}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )


# ---------------------------------------------------------------------------------- absolute


class SinusoidalPositions(PositionEncoding):
    """The original Transformer's absolute encoding: ``pe[p, 2i] = sin(p / base^(2i/dim))``,
    ``pe[p, 2i+1] = cos(p / base^(2i/dim))``.

    ``encode`` maps positions ``(L,)`` or ``(B, L)`` to ``(L, dim)`` or ``(B, L, dim)`` (float32).
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
            raise ValueError(
                f"SinusoidalPositions: position {int(positions.max())} is beyond max_seq_len={self.max_seq_len}"
            )
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)  # (..., L, dim/2)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (..., L, dim) sin, cos interleaved

    def check_heads(self, n_heads, d_head, d_model):
        if self.dim != d_model:
            raise ValueError(
                f"SinusoidalPositions(dim={self.dim}) is added to inputs of width d_model={d_model}: "
                f"use SinusoidalPositions({d_model})"
            )

    def extra_repr(self) -> str:
        return f"{self.dim}, base={self.base:g}"
