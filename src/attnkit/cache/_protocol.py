"""The layer-cache protocol: what a layer cache's ``update`` returns, and the protocol an attention layer reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, Union

import torch

Tensor = torch.Tensor

__all__ = ["CacheRead", "CacheAttention", "CacheResult", "LayerCache"]


class CacheRead(tuple[Any, ...]):
    """What a layer cache's ``update`` returns when the attention layer computes attention itself: the keys
    ``k (B, Hkv, Lk, D)`` and values ``v (B, Hkv, Lk, Dv)`` attention must see, in position order, and the
    cache's own ``mask`` (None, or a Mask or bool tensor broadcastable to ``(B, Hq, L_new, Lk)``: the padding
    of a ragged batch, a window) that the layer ANDs with its masks.

    It is a tuple, ``(k, v)`` without a mask and ``(k, v, mask)`` with one, so it unpacks as the cache
    contract's tuples always did; ``read.k``, ``read.v`` and ``read.mask`` name the parts.

    Example::

        >>> import torch
        >>> from attnkit.cache import CacheRead, StaticCache
        >>> read = StaticCache(1, max_len=8).layers[0].update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
        >>> isinstance(read, CacheRead), read.k.shape, read.mask
        (True, torch.Size([1, 2, 3, 4]), None)
        >>> k_all, v_all = read
    """

    __slots__ = ()

    def __new__(cls, k: Tensor, v: Tensor, mask: Any = None) -> "CacheRead":
        return tuple.__new__(cls, (k, v) if mask is None else (k, v, mask))

    @property
    def k(self) -> Tensor:
        """The keys ``(B, Hkv, Lk, D)``."""
        key: Tensor = self[0]
        return key

    @property
    def v(self) -> Tensor:
        """The values ``(B, Hkv, Lk, Dv)``."""
        value: Tensor = self[1]
        return value

    @property
    def mask(self) -> Any:
        """The cache's own mask, or None."""
        return self[2] if len(self) == 3 else None

    def __repr__(self) -> str:
        mask = "" if self.mask is None else f", mask {type(self.mask).__name__}"
        return f"CacheRead(k {tuple(self.k.shape)}, v {tuple(self.v.shape)}{mask})"


class CacheAttention(ABC):
    """What a layer cache's ``update`` returns when the cache computes the attention itself (the paged cache's
    decode step reads the pool through the block table; the quantized cache reads its store a chunk at a
    time): ``attend(q, *, mask, bias, scale, softcap, sinks, compute) -> (B, Hq, L_new, Dv)`` for ``q (B, Hq, L_new,
    D)``, with the layer's masks and score modifiers as :func:`attnkit.attention` takes them.

    The built-in caches' results subclass it; any other object with an ``attend`` method counts as one too
    (``isinstance`` checks for the method, as :class:`collections.abc.Iterable` does for ``__iter__``).
    """

    __slots__ = ()

    @abstractmethod
    def attend(
        self,
        q: Tensor,
        *,
        mask: Any = None,
        bias: Any = None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        compute: Any = None,
    ) -> Tensor:
        """Attention of ``q (B, Hq, L_new, D)`` over what the cache holds: ``(B, Hq, L_new, Dv)``.

        ``compute``: None, or the attention to run instead of the cache's own kernel (``compute(q, k, v, *, mask,
        bias, scale, softcap, sinks)``, the layer's attention through its hooks): the cache then reads its keys
        and values in position order (for each piece it attends separately) and calls ``compute`` on them."""

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        if cls is CacheAttention:
            return any(callable(vars(base).get("attend")) for base in other.__mro__) or NotImplemented
        return NotImplemented


CacheResult = Union[CacheRead, CacheAttention]


class LayerCache(Protocol):
    """One layer's KV cache, as an attention layer (:class:`attnkit.nn.MultiHeadAttention` ``cache=``) uses it.

    ``update(k, v)`` stores the new keys ``k (B, Hkv, L_new, D)`` (rotated at their absolute positions) and
    values ``v (B, Hkv, L_new, Dv)`` and returns a :class:`CacheRead` (the keys and values attention must see,
    in position order, so query row ``i`` sits at position ``i + Lk - L_new``) or a :class:`CacheAttention`
    (the cache computes attention itself).  A plain ``(k, v)`` or ``(k, v, mask)`` tuple is read as a
    :class:`CacheRead`.  Optional, where a cache can tell: ``peek(n_new) -> (Lk or None, attends)``, what an
    update of ``n_new`` tokens would return, so the layer rejects a bad call before anything is stored (the
    built-in caches have it), and ``seq_len``, the positions stored (the layer's default positions start there).
    """

    def update(self, k: Tensor, v: Tensor) -> CacheResult: ...
