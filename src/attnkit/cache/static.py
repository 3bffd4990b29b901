"""``StaticCache``: keys and values preallocated for ``max_len`` positions, written in place."""

from __future__ import annotations

from typing import Any

import torch

from .._checks import integer
from ._common import LayoutCache, layout_of, max_len_of, model_dims, stored_for
from ._protocol import CacheRead

Tensor = torch.Tensor

__all__ = ["StaticCache", "StaticLayerCache"]


class StaticLayerCache:
    """One layer's keys ``(B, Hkv, max_len, D)`` and values ``(B, Hkv, max_len, Dv)``, allocated once.

    :meth:`update` writes the new positions in place and returns views of every position stored so far,
    in position order; nothing is reallocated or concatenated while decoding.
    """

    def __init__(self, owner: "StaticCache", index: int):
        self.index = index
        self.max_len = owner.max_len
        self._layout, self._padding = owner.layout, owner.padding  # (the model-level cache's, shared)
        self.length = 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        # per-block summaries of the keys an attention layer keeps beside them (MoBA's block means, NSA's
        # compressed keys), by name; each checks itself against the stored length (cache._summaries)
        self.summaries: dict[str, object] = {}

    @torch.inference_mode(False)  # ordinary tensors: the cache may be written outside inference_mode later
    def allocate(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Allocate the storage for ``max_len`` positions, laid out as the cache was given or as ``k``, ``v``."""
        B, H, D, Dv, dtype, device = self._layout.storage(k, v)
        self.k = torch.zeros(B, H, self.max_len, D, dtype=dtype, device=device)  # (B, Hkv, max_len, D)
        self.v = torch.zeros(B, H, self.max_len, Dv, dtype=dtype, device=device)  # (B, Hkv, max_len, Dv)
        return self.k, self.v

    def update(self, k: Tensor, v: Tensor) -> CacheRead:
        """Store ``k (B, Hkv, L_new, D)``, ``v (B, Hkv, L_new, Dv)``; return everything attention should see:
        ``(k_all, v_all)`` of length ``length + L_new``, plus the padding mask of a left-padded batch."""
        K, V = stored_for(self, k, v)
        start, n = self.length, k.shape[2]
        end = start + n
        if end > K.shape[2]:
            raise ValueError(
                f"StaticCache overflow in layer {self.index}: it holds max_len={K.shape[2]} positions, "
                f"{start} are stored and {n} more were given; create the cache with a larger "
                f"max_len (at least {end})"
            )
        K.narrow(2, start, n).copy_(k)
        V.narrow(2, start, n).copy_(v)
        self.length = end
        k_all, v_all = K.narrow(2, 0, end), V.narrow(2, 0, end)  # (B, Hkv, end, D), (B, Hkv, end, Dv): views
        return CacheRead(k_all, v_all, self._padding.key_mask(0, end, K.device))

    @property
    def seq_len(self) -> int:
        """Positions stored in this layer (what an attention layer reads for its default positions)."""
        return self.length

    def peek(self, n_new: int) -> tuple[int, bool]:
        """``(Lk, attends)`` of an update of ``n_new`` tokens, before it is made: the key length it returns and
        whether it returns an object computing attention (an attention layer checks its call first, so a
        rejected call leaves the cache as it was)."""
        return self.length + n_new, False

    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.nbytes + self.v.nbytes

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (later ones are overwritten by the next update)."""
        integer("length", length, minimum=0)
        if length > self.length:
            raise ValueError(
                f"StaticCache.truncate: length={length} is beyond the {self.length} positions stored in "
                f"layer {self.index}: a cache can only be cut back"
            )
        self.length = length

    def reset(self) -> None:
        self.length = 0
        self.summaries.clear()

    def __repr__(self) -> str:
        shape = "unallocated" if self.k is None else f"k {tuple(self.k.shape)} {self.k.dtype}"
        return f"StaticLayerCache(layer {self.index}, {self.length} stored, {shape})"


class StaticCache(LayoutCache):
    """A KV cache preallocated for ``max_len`` positions in every layer (static shapes, no reallocation).

    Args:
        n_layers: decoder layers (one ``StaticLayerCache`` each, in ``cache.layers``).
        max_len: positions each layer can hold (prompt plus new tokens).
        batch_size, n_kv_heads, d_head, d_value, dtype, device: the layout; when given, storage is
            allocated now, otherwise on the first update from the shapes it sees.

    Storage per layer: keys ``(B, Hkv, max_len, D)`` and values ``(B, Hkv, max_len, Dv)``.  ``update``
    returns views ``(B, Hkv, length, D)`` of the stored positions in position order.  Writing past
    ``max_len`` raises a ValueError.  The buffers never move, so a model using the cache runs under
    ``torch.compile`` (the growing length becomes a dynamic size after the first recompilation).

    Example::

        >>> import torch
        >>> from attnkit.cache import StaticCache
        >>> cache = StaticCache(2, max_len=16, batch_size=1, n_kv_heads=2, d_head=8)
        >>> k = v = torch.randn(1, 2, 5, 8)
        >>> k_all, v_all = cache.layers[0].update(k, v)
        >>> _ = cache.layers[1].update(k, v)
        >>> k_all.shape, cache.seq_len
        (torch.Size([1, 2, 5, 8]), 5)
    """

    def __init__(
        self,
        n_layers: int,
        max_len: int,
        *,
        batch_size: int | None = None,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        d_value: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.max_len = integer("max_len", max_len, minimum=1)
        self._build_layers(StaticLayerCache, n_layers, batch_size, n_kv_heads, d_head, d_value, dtype, device)

    @classmethod
    def for_model(
        cls,
        model: Any,
        batch_size: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> "StaticCache":
        """A cache laid out for ``model`` (read from ``model.config``); ``max_len`` defaults to its
        ``max_seq_len``, ``dtype``/``device`` to its parameters'."""
        d = model_dims(model)
        return cls(
            d["n_layers"],
            max_len_of(d, max_len),
            batch_size=batch_size,
            **layout_of(d, dtype, device),
        )

    def truncate(self, length: int) -> None:
        """Roll every layer back to its first ``length`` positions (e.g. tokens a speculative step rejected):
        the next update writes from position ``length``.  The storage stays; a ValueError if ``length`` is
        beyond what is stored.

        Example::

            >>> import torch
            >>> from attnkit.cache import StaticCache
            >>> cache = StaticCache(1, max_len=8, batch_size=1, n_kv_heads=1, d_head=2)
            >>> _ = cache.layers[0].update(torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2))
            >>> cache.truncate(3); cache.seq_len
            3
        """
        integer("length", length, minimum=0)
        if length > self.seq_len:
            raise ValueError(
                f"StaticCache.truncate: length={length} is beyond the {self.seq_len} positions stored: "
                f"a cache can only be cut back"
            )
        for layer in self.layers:
            layer.truncate(length)

    def __repr__(self) -> str:
        return (
            f"StaticCache({len(self.layers)} layers, {self.seq_len}/{self.max_len} positions, "
            f"{self.nbytes() / 2**20:.2f} MiB)"
        )
