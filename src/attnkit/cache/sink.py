"""``SinkCache``: StreamingLLM's attention-sink cache for generating past a model's context.

Each layer keeps the first ``n_sink`` tokens and the last ``window - 1`` before the current one, so a decode
step attends to at most ``n_sink + window`` keys however long the generation runs.  Positions are those
*within the cache*, as in StreamingLLM: the attended keys sit at positions ``0 .. n-1`` and the current
query at ``n - 1``, whatever their positions in the text were.  With rotary embeddings the keys are stored
un-rotated and rotated at their cache positions at every step (the model rotates the query at the cache
position it reads from ``seq_len``); other position methods (ALiBi, none) see the cache positions directly.

What it keeps: the sink tokens and a window of recent ones, not the text in between — a model forgets what
left the window (StreamingLLM keeps perplexity stable over long streams; it does not extend what the model
can recall).  Its results are not those of full attention once the window is exceeded.
"""

from __future__ import annotations

import torch

from .._checks import integer
from ._common import ModelCache, check_new_kv, model_dims

Tensor = torch.Tensor

__all__ = ["SinkCache"]


class SinkLayerCache:
    """One layer: ``(B, Hkv, n, D)`` keys (un-rotated) and values of the sink tokens and the recent window."""

    def __init__(self, owner: "SinkCache", index: int):
        self._owner, self.index = owner, index
        self.length = 0  # tokens seen
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @property
    def seq_len(self) -> int:
        """The cache position of the next token (what the model rotates its query at)."""
        return 0 if self.k is None else min(self.k.shape[2], self._owner.capacity - 1)

    def _unrotate(self, k: Tensor, start: int) -> Tensor:
        rope = self._owner.rope
        if rope is None:
            return k
        pos = torch.arange(start, start + k.shape[2], device=k.device)
        cos, sin = rope.cos_sin(pos, k.dtype)
        kr, kp = k[..., :rope.dim], k[..., rope.dim:]
        return torch.cat([kr * cos - rope._rotate_pairs(kr) * sin, kp], dim=-1)  # the inverse rotation

    def update(self, k: Tensor, v: Tensor):
        o = self._owner
        n = k.shape[2]
        if self.k is not None:
            check_new_kv(k, v, batch=self.k.shape[0], heads=self.k.shape[1], d_head=self.k.shape[3],
                         d_value=self.v.shape[3], dtype=self.k.dtype, device=self.k.device)
        if n != 1 and self.length:
            raise ValueError(f"SinkCache takes a prompt and then one token per step, got {n} new tokens after "
                             f"{self.length}")
        if n > o.capacity:
            raise ValueError(f"a prompt of {n} tokens does not fit SinkCache's n_sink + window = {o.capacity}: "
                             f"shorten it or make the window larger")
        raw = self._unrotate(k, self.seq_len)
        self.k = raw if self.k is None else torch.cat([self.k, raw], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        if self.k.shape[2] > o.capacity:  # evict the oldest token after the sinks
            s = o.n_sink
            self.k = torch.cat([self.k[:, :, :s], self.k[:, :, s + 1:]], dim=2)
            self.v = torch.cat([self.v[:, :, :s], self.v[:, :, s + 1:]], dim=2)
        self.length += n
        k_all = self.k if o.rope is None else o.rope.rotate(self.k, torch.arange(self.k.shape[2], device=k.device))
        return k_all, self.v

    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        self.length, self.k, self.v = 0, None, None

    def __repr__(self) -> str:
        return f"SinkLayerCache(layer {self.index}, {self.length} seen, {0 if self.k is None else self.k.shape[2]} kept)"


class SinkCache(ModelCache):
    """StreamingLLM's cache: the first ``n_sink`` tokens plus a sliding ``window`` (the current token
    included), at positions within the cache (see the module docstring for what it keeps).

    Args:
        n_layers: decoder layers.
        n_sink: tokens kept from the start (StreamingLLM: 4).
        window: recent tokens attended at each step, the current one included.
        rope: the model's :class:`attnkit.nn.RotaryEmbedding` (None for models without rotary positions).

    Use :meth:`for_model`, e.g. ``generate(model, prompts, n, cache=lambda m, b, L: SinkCache.for_model(m))``.
    Prompts of one length only (no left padding).

    Example::

        >>> import torch, attnkit
        >>> from attnkit.cache import SinkCache
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> model = DecoderLM(DecoderConfig.preset("tiny")).eval()
        >>> out = attnkit.generate(model, [[1, 2, 3]], 40, cache=lambda m, b, L: SinkCache.for_model(m, 4, 16))
        >>> len(out[0])
        40
    """

    def __init__(self, n_layers: int, n_sink: int, window: int, *, rope=None):
        super().__init__()
        integer("n_layers", n_layers, minimum=1)
        self.n_sink = integer("n_sink", n_sink, minimum=0)
        self.window = integer("window", window, minimum=1)
        self.capacity = self.n_sink + self.window
        self.rope = rope
        self.layers = tuple(SinkLayerCache(self, i) for i in range(n_layers))

    @classmethod
    def for_model(cls, model, n_sink: int = 4, window: int = 1024) -> "SinkCache":
        """A cache for an :class:`attnkit.nn.DecoderLM` (its rotary embedding, when it has one)."""
        d = model_dims(model)
        rope = getattr(model, "positions", None)
        rotary = callable(getattr(rope, "rotate", None)) and callable(getattr(rope, "cos_sin", None))
        return cls(d["n_layers"], n_sink, window, rope=rope if rotary else None)

    @property
    def seq_len(self) -> int:
        return self.layers[-1].seq_len

    def set_left_padding(self, pad) -> None:
        if pad is not None and any(int(p) for p in pad):
            raise ValueError("SinkCache takes prompts of one length (no left padding): generate them one at a time")
