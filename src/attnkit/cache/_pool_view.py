"""What the forward views of a block pool share (:class:`attnkit.cache.PagedCache` and
:class:`attnkit.cache.PagedSinkCache`): the model-level view of one forward and its layers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, TypeVar

import torch

Tensor = torch.Tensor

__all__ = ["PoolView", "PoolLayer"]

R = TypeVar("R")  # what a layer's update returns


class PoolView(ABC):
    """The model-level view of a block pool for one forward: ``cache`` (the pool), ``layers`` (one
    :class:`PoolLayer` each) and ``seq_len``; its last layer's update calls :meth:`_commit`."""

    cache: Any
    layers: tuple[Any, ...]

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """The stored length the model's default positions start at (views of ragged sequences raise)."""

    @abstractmethod
    def _commit(self) -> None:
        """The forward's new lengths, once its last layer has written them (called by :class:`PoolLayer`)."""

    def nbytes(self) -> int:
        n: int = self.cache.nbytes()
        return n

    def __len__(self) -> int:
        return len(self.layers)


class PoolLayer:
    """Layer ``index`` of a :class:`PoolView` of a block pool."""

    def __init__(self, owner: PoolView, index: int):
        self._owner, self.index = owner, index

    @property
    def length(self) -> int:
        return self._owner.seq_len

    @property
    def seq_len(self) -> int:
        """The view's stored length when its sequences hold the same (sequences of different lengths raise:
        the forward passes explicit positions to the model)."""
        return self._owner.seq_len

    def _pools(self) -> tuple[Tensor, Tensor]:
        c = self._owner.cache
        return c.k_pools[self.index], c.v_pools[self.index]

    def _done(self, out: R) -> R:
        """``out``, once the last layer has committed the forward's new lengths."""
        if self.index == self._owner.cache.n_layers - 1:
            self._owner._commit()
        return out

    def nbytes(self) -> int:
        kp, vp = self._pools()
        return kp.nbytes + vp.nbytes

    def reset(self) -> None:
        raise TypeError(
            f"a {type(self._owner).__name__} layer cannot be reset: free the sequences in the PagedCache instead"
        )
