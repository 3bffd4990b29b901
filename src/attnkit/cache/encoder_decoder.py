"""The cache of an encoder-decoder: a self-attention cache and a cross-attention cache side by side."""

from __future__ import annotations

from typing import Any, Sequence

from .static import StaticCache


class EncoderDecoderCache:
    """The cache of an encoder-decoder's decoder: a self-attention cache and a cross-attention cache.

    ``layers`` are ``self_cache.layers`` (the target tokens' keys/values), ``cross_layers`` are
    ``cross_cache.layers`` (the encoder output's keys/values, filled by the first ``decode`` call and read
    afterwards), ``seq_len`` is the self cache's.  Any appending cache serves for either part.

    Example::

        >>> import torch
        >>> from attnkit.cache import EncoderDecoderCache, StaticCache
        >>> cache = EncoderDecoderCache(StaticCache(2, max_len=16), StaticCache(2, max_len=9))
        >>> len(cache.layers), len(cache.cross_layers), cache.seq_len
        (2, 2, 0)
    """

    def __init__(self, self_cache: Any, cross_cache: Any) -> None:
        for name, c in (("self_cache", self_cache), ("cross_cache", cross_cache)):
            if not hasattr(c, "layers"):
                raise TypeError(
                    f"{name} must be a model-level cache with one per-layer cache per decoder layer "
                    f"(e.g. StaticCache(n_layers, max_len)), got {type(c).__name__}"
                )
        if len(self_cache.layers) != len(cross_cache.layers):
            raise ValueError(
                f"the self cache has {len(self_cache.layers)} layers but the cross cache "
                f"{len(cross_cache.layers)}: give both one per decoder layer"
            )
        self.self_cache, self.cross_cache = self_cache, cross_cache

    @classmethod
    def for_model(cls, model: Any, batch_size: int, max_len: int, source_len: int) -> "EncoderDecoderCache":
        """Two :class:`StaticCache` s for ``model``: ``max_len`` target and ``source_len`` source positions."""
        return cls(
            StaticCache.for_model(model, batch_size, max_len), StaticCache.for_model(model, batch_size, source_len)
        )

    @property
    def layers(self) -> Sequence[Any]:
        layers: Sequence[Any] = self.self_cache.layers
        return layers

    @property
    def cross_layers(self) -> Sequence[Any]:
        layers: Sequence[Any] = self.cross_cache.layers
        return layers

    @property
    def seq_len(self) -> int:
        n: int = self.self_cache.seq_len
        return n

    def nbytes(self) -> int:
        n: int = self.self_cache.nbytes() + self.cross_cache.nbytes()
        return n

    def reset(self) -> None:
        self.self_cache.reset()
        self.cross_cache.reset()

    def __repr__(self) -> str:
        return f"EncoderDecoderCache(self={self.self_cache!r}, cross={self.cross_cache!r})"
