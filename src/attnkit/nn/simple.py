"""The articles' single head (:class:`SingleHeadAttention`) and Bahdanau's :class:`AdditiveAttention`."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..functional import attention_weights
from . import _checks
from .attention import _Attends
from .layers import Linear

Tensor = torch.Tensor

__all__ = ["SingleHeadAttention", "AdditiveAttention"]


def _batched(name: str, x, width: int, what: str) -> tuple[Tensor, bool]:
    """``x`` as ``(B, L, width)``; a 2-D ``(L, width)`` input is one unbatched sequence."""
    _checks.features(name, x, width, what=what, ndim=None)
    if x.dim() == 2:
        return x.unsqueeze(0), True
    if x.dim() != 3:
        raise ValueError(f"{name} must have shape {what} or (L, {width}), got {tuple(x.shape)}")
    return x, False


class SingleHeadAttention(_Attends):
    """One attention head with separate ``W_q``, ``W_k`` ``(d_model, d_k)`` and ``W_v`` ``(d_model, d_v)``,
    exactly as the first article writes it: ``Q = X W_q``, ``K = X W_k``, ``V = X W_v``, then
    ``softmax(Q K^T / sqrt(d_k)) V``.  There is no output projection.

    ``forward(x, context=None, *, mask=None, need_weights=False)``: ``x (B, L, d_model)`` (or one
    unbatched sequence ``(L, d_model)``) -> ``(B, L, d_v)``; with ``context (B, Lc, d_model)`` keys and
    values come from the context.  :meth:`project` returns ``Q, K, V``.  The attention itself goes
    through ``_attend`` (one head).

    Example (the article's worked example: 3 tokens, ``d_model = 4``, ``d_k = 2``)::

        >>> import torch
        >>> from attnkit.nn import SingleHeadAttention
        >>> head = SingleHeadAttention(4, 2)
        >>> with torch.no_grad():
        ...     _ = head.W_q.copy_(torch.tensor([[0.1, 0.4], [-0.2, 0.3], [0.5, -0.1], [0.2, 0.1]]))
        >>> x = torch.tensor([[1.0, 0.5, -0.2, 1.2], [0.3, -1.0, 0.8, 0.4], [-0.7, 0.6, 1.1, -0.5]])
        >>> q, k, v = head.project(x)
        >>> [round(t, 2) for t in q[0].tolist()]  # Q1 in the article
        [0.14, 0.69]
        >>> head(x).shape
        torch.Size([3, 2])
    """

    def __init__(self, d_model: int, d_k: int, d_v: int | None = None, *, backend: str = "auto"):
        super().__init__()
        _checks.positive_int("d_model", d_model)
        _checks.positive_int("d_k", d_k)
        d_v = d_k if d_v is None else _checks.positive_int("d_v", d_v)
        self.d_model, self.d_k, self.d_v, self.backend = d_model, d_k, d_v, _checks.backend(backend)
        bound = 1.0 / math.sqrt(d_model)
        self.W_q = nn.Parameter(torch.empty(d_model, d_k).uniform_(-bound, bound))
        self.W_k = nn.Parameter(torch.empty(d_model, d_k).uniform_(-bound, bound))
        self.W_v = nn.Parameter(torch.empty(d_model, d_v).uniform_(-bound, bound))

    def project(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``Q = x W_q`` ``(..., L, d_k)``, ``K = c W_k`` ``(..., Lc, d_k)``, ``V = c W_v`` ``(..., Lc, d_v)``
        with ``c = x`` unless a context is given."""
        what = f"(B, L, d_model={self.d_model})"
        _checks.features("x", x, self.d_model, what=what, ndim=None)
        c = x if context is None else context
        if context is not None:
            _checks.features("context", context, self.d_model, what=f"(B, Lc, d_model={self.d_model})", ndim=None)
        return x @ self.W_q, c @ self.W_k, c @ self.W_v

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask=None, need_weights: bool = False):
        need_weights = _checks.flag("need_weights", need_weights)
        xb, unbatched = _batched("x", x, self.d_model, f"(B, L, d_model={self.d_model})")
        cb = None
        if context is not None:
            cb, _ = _batched("context", context, self.d_model, f"(B, Lc, d_model={self.d_model})")
            if cb.shape[0] != xb.shape[0]:
                raise ValueError(f"context has batch {cb.shape[0]} but x has {xb.shape[0]}")
        q, k, v = self.project(xb, cb)
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, L, d): one head
        m = _checks.as_mask("mask", mask)
        _checks.check_mask_shape("mask", m, q.shape[0], 1, q.shape[2], k.shape[2])
        out = self._attend(
            q, k, v, mask=m, bias=None, scale=1.0 / math.sqrt(self.d_k), softcap=None, dropout_p=0.0
        ).squeeze(1)  # (B, L, d_v)
        w = attention_weights(q, k, v, mask=m, scale=1.0 / math.sqrt(self.d_k)).squeeze(1) if need_weights else None
        if unbatched:
            out = out.squeeze(0)
            w = None if w is None else w.squeeze(0)
        return (out, w) if need_weights else out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_k={self.d_k}, d_v={self.d_v}"


class AdditiveAttention(_Attends):
    """Additive (Bahdanau) attention: ``score(q, k) = v^T tanh(W_q q + W_k k)``, softmax over the keys.

    Queries and keys may have different widths (``q_dim``, ``k_dim``); ``hidden`` is the width of the
    tanh layer.  ``forward(query (B, Lq, q_dim), keys (B, Lk, k_dim), values=None, *, mask=None,
    need_weights=False) -> (B, Lq, Dv)``; ``values (B, Lk, Dv)`` default to ``keys``.  ``mask``: a Mask or
    a bool tensor broadcastable to ``(B, 1, Lq, Lk)`` (True = may attend); a row with nothing to attend
    gives 0.  The scores ``(B, Lq, Lk)`` are materialised (memory ``B Lq Lk hidden``) and handed to
    ``_attend`` as the bias of a zero-width dot product, so masks, dropout and diagnostics work as for
    every other module.

    Example::

        >>> import torch
        >>> from attnkit.nn import AdditiveAttention
        >>> att = AdditiveAttention(q_dim=8, k_dim=5, hidden=16)
        >>> out, w = att(torch.randn(2, 3, 8), torch.randn(2, 7, 5), need_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 3, 5]), torch.Size([2, 3, 7]))
    """

    def __init__(self, q_dim: int, k_dim: int, hidden: int, *, dropout: float = 0.0, backend: str = "auto"):
        super().__init__()
        for name, val in (("q_dim", q_dim), ("k_dim", k_dim), ("hidden", hidden)):
            _checks.positive_int(name, val)
        self.q_dim, self.k_dim, self.hidden, self.backend = q_dim, k_dim, hidden, _checks.backend(backend)
        self.dropout = _checks.probability("dropout", dropout)
        self.W_q = Linear(q_dim, hidden, bias=True)  # the one bias of the tanh layer
        self.W_k = Linear(k_dim, hidden, bias=False)
        self.v = nn.Parameter(torch.empty(hidden).uniform_(-1 / math.sqrt(hidden), 1 / math.sqrt(hidden)))

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """``v^T tanh(W_q q_i + W_k k_j)`` for every pair: ``(B, Lq, Lk)``."""
        hq = self.W_q(query)  # (B, Lq, hidden)
        hk = self.W_k(keys)  # (B, Lk, hidden)
        return torch.tanh(hq.unsqueeze(2) + hk.unsqueeze(1)) @ self.v  # (B, Lq, Lk)

    def forward(
        self, query: Tensor, keys: Tensor, values: Tensor | None = None, *, mask=None, need_weights: bool = False
    ):
        need_weights = _checks.flag("need_weights", need_weights)
        _checks.features("query", query, self.q_dim, what=f"(B, Lq, q_dim={self.q_dim})")
        _checks.features("keys", keys, self.k_dim, what=f"(B, Lk, k_dim={self.k_dim})")
        values = keys if values is None else values
        if not isinstance(values, torch.Tensor) or values.dim() != 3 or values.shape[:2] != keys.shape[:2]:
            got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"values must have shape (B, Lk, Dv) with (B, Lk)={tuple(keys.shape[:2])}, got {got}")
        if not values.is_floating_point():
            raise TypeError(f"values has dtype {values.dtype}: pass a float tensor (e.g. values.float())")
        if query.shape[0] != keys.shape[0]:
            raise ValueError(f"query has batch {query.shape[0]} but keys have {keys.shape[0]}")
        B, Lq, Lk = query.shape[0], query.shape[1], keys.shape[1]
        s = self.scores(query, keys).unsqueeze(1)  # (B, 1, Lq, Lk)
        m = _checks.as_mask("mask", mask)
        _checks.check_mask_shape("mask", m, B, 1, Lq, Lk)
        q0 = s.new_zeros(B, 1, Lq, 1)  # zero-width dot product: the scores are all in the bias
        k0 = s.new_zeros(B, 1, Lk, 1)
        v = values.unsqueeze(1)  # (B, 1, Lk, Dv)
        dropout_p = self.dropout if self.training else 0.0
        out = self._attend(q0, k0, v, mask=m, bias=s, scale=1.0, softcap=None, dropout_p=dropout_p).squeeze(1)
        if need_weights:
            return out, attention_weights(q0, k0, v, mask=m, bias=s, scale=1.0).squeeze(1)
        return out

    def extra_repr(self) -> str:
        return f"q_dim={self.q_dim}, k_dim={self.k_dim}, hidden={self.hidden}"
