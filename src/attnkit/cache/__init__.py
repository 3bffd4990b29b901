"""KV caches for decoding: each a small object with one ``update`` step per layer.

A model-level cache has ``cache.layers`` (one per decoder layer) and ``cache.seq_len`` (positions stored
before the current forward).  Decoder layer ``i`` calls ``cache.layers[i].update(k, v)`` with its new keys
``(B, Hkv, L_new, D)`` (already rotated at their absolute positions) and values; the update returns what
attention must see, in position order, so query row ``i`` sits at position ``i + Lk - L_new``:

- a :class:`CacheRead`: ``(k_all, v_all)``, or ``(k_all, v_all, extra_mask)`` with a bool mask broadcastable
  to ``(B, Hq, L_new, Lk)`` (padding of a ragged batch, a window), AND-ed with the layer's mask (a tuple, so it
  unpacks as one; ``read.k``, ``read.v``, ``read.mask``); or
- a :class:`CacheAttention`: an object with ``attend(q, *, mask, bias, scale, softcap) -> (B, Hq, L_new, Dv)``
  that computes the attention itself (the paged cache's decode step reads the pool through the block table).

:class:`LayerCache` is that protocol as a type.  A layer cache may also offer ``peek(n_new) -> (Lk or None,
attends)``: what an update of ``n_new`` tokens would return, before it is made (the built-in ones do), so an
attention layer rejects a bad call without storing anything.  A cache of your own may return plain
``(k, v)`` / ``(k, v, mask)`` tuples: they are read as a :class:`CacheRead`.

The caches: :class:`StaticCache` (preallocated), :class:`SlidingWindowCache` (a ring holding the window),
:class:`PagedCache` (a block pool shared by many sequences, with fork and prefix caching) and
:class:`QuantizedCache` (int8/int4 with per-group scales) and :class:`SinkCache` (StreamingLLM: the first
tokens plus a sliding window, at positions within the cache, for generating past the context), with
:class:`PagedSinkCache` keeping the same tokens in a block pool for many sequences.

Example::

    >>> import torch, attnkit
    >>> from attnkit.cache import StaticCache
    >>> cache = StaticCache(1, max_len=8)
    >>> k = v = torch.randn(1, 2, 3, 4)
    >>> k_all, v_all = cache.layers[0].update(k, v)      # a 3-token prompt
    >>> k_all, v_all = cache.layers[0].update(k[:, :, :1], v[:, :, :1])  # one decode step
    >>> q = torch.randn(1, 4, 1, 4)                       # 4 query heads share the 2 kv heads
    >>> attnkit.attention(q, k_all, v_all, mask=attnkit.masks.causal()).shape
    torch.Size([1, 4, 1, 4])
"""

from ._common import ModelCache, attend, model_dims
from ._summaries import BlockSummaries, summaries_of
from ._protocol import CacheAttention, CacheRead, CacheResult, LayerCache
from .encoder_decoder import EncoderDecoderCache
from .paged import PagedBatch, PagedCache, PagedPacked, PoolExhausted, explain_paged_attention, paged_attention
from .quantized import QuantizedCache, dequantize_groups, quantize_groups
from .sink import PagedSinkCache, SinkCache
from .sliding import SlidingWindowCache, window_of
from .static import StaticCache

__all__ = [
    "attend",
    "CacheRead",
    "CacheAttention",
    "CacheResult",
    "LayerCache",
    "ModelCache",
    "StaticCache",
    "SlidingWindowCache",
    "PagedCache",
    "PagedBatch",
    "PagedPacked",
    "QuantizedCache",
    "EncoderDecoderCache",
    "PoolExhausted",
    "paged_attention",
    "explain_paged_attention",
    "window_of",
    "quantize_groups",
    "dequantize_groups",
    "SinkCache",
    "PagedSinkCache",
    "model_dims",
    "BlockSummaries",
    "summaries_of",
]
