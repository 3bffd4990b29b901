"""``SlidingWindowCache``: a ring buffer that keeps only the last ``window`` positions of each layer."""

from __future__ import annotations

from typing import Any

import torch

from ..masks import Band, Mask
from .._checks import integer
from ._common import LayoutCache, layout_of, model_dims, stored_for
from ._protocol import CacheRead

Tensor = torch.Tensor

__all__ = ["SlidingWindowCache", "SlidingWindowLayerCache", "window_of"]


def window_of(mask: object) -> int | None:
    """The number of positions a query may see (itself included) under ``mask``, when it is a causal
    sliding window (``masks.sliding_window(left)``, alone or AND-ed with other masks), else None.

    Example::

        >>> from attnkit import masks
        >>> from attnkit.cache import window_of
        >>> window_of(masks.causal() & masks.sliding_window(255))
        256
    """
    if not isinstance(mask, Mask):
        return None
    wins = []
    for part in mask.conjuncts():
        band = part.form(1, 1)  # (one query at its own position: the offsets are the window's sides)
        if isinstance(band, Band) and band.lo is not None:
            wins.append(-band.lo + 1)
    return min(wins) if wins else None


class SlidingWindowLayerCache:
    """One layer's last ``window`` keys and values in a ring of ``2 * window`` slots.

    Position ``p`` is written to slots ``p % window`` and ``p % window + window``, so the last ``n <= window``
    positions always sit, in position order, in the contiguous slots ``[(end - n) % window, ... + n)``:
    a decode step returns a view, never a copy.
    """

    def __init__(self, owner: "SlidingWindowCache", index: int):
        self.index = index
        self.window = owner.window
        self._layout, self._padding = owner.layout, owner.padding  # (the model-level cache's, shared)
        self.length = 0  # positions seen, including those that left the window
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @torch.inference_mode(False)  # ordinary tensors: the cache may be written outside inference_mode later
    def allocate(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Allocate the ring of ``2 * window`` slots, laid out as the cache was given or as ``k``, ``v``."""
        B, H, D, Dv, dtype, device = self._layout.storage(k, v)
        self.k = torch.zeros(B, H, 2 * self.window, D, dtype=dtype, device=device)  # (B, Hkv, 2W, D)
        self.v = torch.zeros(B, H, 2 * self.window, Dv, dtype=dtype, device=device)  # (B, Hkv, 2W, Dv)
        return self.k, self.v

    def update(self, k: Tensor, v: Tensor) -> CacheRead:
        """Store ``k (B, Hkv, L_new, D)``, ``v``; return the window's keys/values in position order, the new
        ones last, with a mask when some query may not see every returned key (window or padding)."""
        K, V = stored_for(self, k, v)
        W = self.window
        start, n = self.length, k.shape[2]
        end = start + n
        if n == 1:
            s = start % W
            K[:, :, s : s + 1] = k
            K[:, :, s + W : s + W + 1] = k
            V[:, :, s : s + 1] = v
            V[:, :, s + W : s + W + 1] = v
            self.length = end
            cnt = min(end, W)
            lo = (end - cnt) % W
            k_all, v_all = K[:, :, lo : lo + cnt], V[:, :, lo : lo + cnt]  # (B, Hkv, cnt, D): positions end-cnt..end-1
            return CacheRead(k_all, v_all, self._padding.key_mask(end - cnt, end, K.device))
        old = min(start, W)
        lo = (start - old) % W
        k_all = torch.cat([K[:, :, lo : lo + old], k], dim=2)  # (B, Hkv, old + n, D): positions start-old..end-1
        v_all = torch.cat([V[:, :, lo : lo + old], v], dim=2)
        m = min(n, W)
        pos = torch.arange(end - m, end, device=K.device)
        slots = torch.cat([pos % W, pos % W + W])  # (2m,)
        K.index_copy_(2, slots, k[:, :, n - m :].repeat(1, 1, 2, 1))
        V.index_copy_(2, slots, v[:, :, n - m :].repeat(1, 1, 2, 1))
        self.length = end
        mask = self._padding.key_mask(start - old, end, K.device)
        if old + n > W:  # some of the returned keys are older than a later query's window
            qpos = torch.arange(start, end, device=K.device).view(-1, 1)
            kpos = torch.arange(start - old, end, device=K.device).view(1, -1)
            win = (kpos > qpos - W)[None, None]  # (1, 1, n, Lk)
            mask = win if mask is None else mask & win
        return CacheRead(k_all, v_all, mask)

    @property
    def seq_len(self) -> int:
        """Positions stored in this layer (what an attention layer reads for its default positions)."""
        return self.length

    def peek(self, n_new: int) -> tuple[int, bool]:
        """``(Lk, attends)`` of an update of ``n_new`` tokens (see ``StaticLayerCache.peek``)."""
        W = self.window
        return (min(self.length + 1, W) if n_new == 1 else min(self.length, W) + n_new), False

    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        self.length = 0

    def __repr__(self) -> str:
        return f"SlidingWindowLayerCache(layer {self.index}, {self.length} seen, window {self.window})"


class SlidingWindowCache(LayoutCache):
    """A KV cache that keeps only the last ``window`` positions of each layer (Mistral-style decoding).

    Args:
        n_layers: decoder layers.
        window: positions a query may see, itself included: ``left + 1`` for a model whose mask is
            ``masks.sliding_window(left)``.  Memory does not grow with the sequence.
        batch_size, n_kv_heads, d_head, d_value, dtype, device: the layout (allocated now when given,
            else on the first update).

    ``update`` returns the window's keys and values in position order with the new ones last, so the
    model's bottom-right aligned masks and distance biases (ALiBi, T5) see the true distances, and RoPE keys
    keep the rotation of their absolute position.  ``seq_len`` counts every position seen.  With a model
    that has no window in its mask the cache truncates the context to ``window`` (a different model).

    Example::

        >>> import torch
        >>> from attnkit.cache import SlidingWindowCache
        >>> cache = SlidingWindowCache(1, window=4)
        >>> for t in range(6):
        ...     k_all, v_all = cache.layers[0].update(torch.full((1, 1, 1, 2), float(t)), torch.zeros(1, 1, 1, 2))
        >>> k_all[0, 0, :, 0].tolist(), cache.seq_len
        ([2.0, 3.0, 4.0, 5.0], 6)
    """

    def __init__(
        self,
        n_layers: int,
        window: int,
        *,
        batch_size: int | None = None,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        d_value: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.window = integer("window", window, minimum=1)
        self._build_layers(SlidingWindowLayerCache, n_layers, batch_size, n_kv_heads, d_head, d_value, dtype, device)

    @classmethod
    def for_model(
        cls,
        model: Any,
        batch_size: int,
        window: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> "SlidingWindowCache":
        """A cache for ``model``; ``window`` defaults to the widest sliding window of the model's layers
        (``model.config.layer_mask(i)``, else ``model.config.mask``), which must bound every layer."""
        d = model_dims(model)
        if window is None:
            cfg: Any = getattr(model, "config", None)
            if hasattr(cfg, "layer_mask") and getattr(cfg, "layer_masks", None) is not None:
                masks = [cfg.layer_mask(i) for i in range(d["n_layers"])]
            else:
                masks = [getattr(cfg, "mask", None)] * d["n_layers"]
            wins = [window_of(m) if isinstance(m, Mask) else None for m in masks]
            full = [i for i, w in enumerate(wins) if w is None]
            bounded = [w for w in wins if w is not None]
            if full:
                raise ValueError(
                    f"window is required: layers {full} of the model attend without a causal sliding "
                    f"window (their mask: {masks[full[0]]!r}), so a ring buffer would drop keys they "
                    f"read; use cache='static' (or pass window=... to keep that many positions)"
                )
            window = max(bounded)
        return cls(
            d["n_layers"],
            window,
            batch_size=batch_size,
            **layout_of(d, dtype, device),
        )

    def __repr__(self) -> str:
        return (
            f"SlidingWindowCache({len(self.layers)} layers, window {self.window}, {self.seq_len} seen, "
            f"{self.nbytes() / 2**20:.2f} MiB)"
        )
