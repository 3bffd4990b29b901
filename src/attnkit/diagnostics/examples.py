"""Small models that show each of the doctor's symptoms on purpose, for learning to read its reports.

Each is built from a seed in a fraction of a second, with random weights and random token ids:

- ``healthy``: a tiny :class:`~attnkit.nn.DecoderLM` (init std 0.25) with the usual ``1/sqrt(d_k)``
  scaling: its attention is neither flat nor peaked.
- ``uniform``: the same model with ``W_q`` and ``W_k`` initialised 1000x smaller (the article's first
  cause: Q/K initialisation too small).
- ``sharp``: the same model without the ``1/sqrt(d_k)`` scaling (``temperature = 1/sqrt(d_head)``).
- ``saturated``: the same model with ``W_q`` and ``W_k`` 8x larger (huge queries and keys).
- ``vanishing_gradient``: sixteen Post-LN attention layers without residual connections.

Example::

    >>> from attnkit.diagnostics import doctor
    >>> from attnkit.diagnostics.examples import example
    >>> model, batch = example("sharp")
    >>> sorted(doctor(model, batch).kinds)
    ['sharp']
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import masks
from .. import _checks
from ..nn import DecoderConfig, DecoderLM, MultiHeadAttention

Tensor = torch.Tensor

__all__ = ["EXAMPLES", "example"]

EXAMPLES = ("healthy", "uniform", "sharp", "saturated", "vanishing_gradient")
VOCAB = 64
_QK_SMALL, _QK_LARGE = 1e-3, 8.0


class _DeepPostLN(nn.Module):
    """``x = LayerNorm(attention(x))`` repeated, with no residual path: gradients fade with depth."""

    def __init__(self, d_model: int = 32, n_heads: int = 4, n_layers: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.layers = nn.ModuleList(MultiHeadAttention(d_model, n_heads, mask=masks.causal()) for _ in range(n_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)  # (B, L, d_model)
        for attn, norm in zip(self.layers, self.norms):
            x = norm(attn(x))  # Post-LN, no residual
        return self.head(x)  # (B, L, VOCAB)


def _scale_qk(model: nn.Module, factor: float) -> None:
    """Multiply the query and key rows of every fused q/k/v projection by ``factor``."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MultiHeadAttention):
                rows = (m.n_heads + m.n_kv_heads) * m.d_head  # weight rows [q; k; v]
                m.qkv_proj.weight[:rows] *= factor
                if m.qkv_proj.bias is not None:
                    m.qkv_proj.bias[:rows] *= factor


def example(name: str, *, seed: int = 0, batch_size: int = 4, seq_len: int = 32) -> tuple[nn.Module, Tensor]:
    """Build the example model ``name`` (see :data:`EXAMPLES`) and a batch of token ids ``(B, L)``.

    Example::

        >>> from attnkit.diagnostics.examples import example
        >>> model, ids = example("healthy", seq_len=8)
        >>> model(ids).shape
        torch.Size([4, 8, 64])
    """
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}: choose one of {', '.join(EXAMPLES)}")
    for arg, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        _checks.int_in_range(arg, value, 2)
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "vanishing_gradient":
            model: nn.Module = _DeepPostLN()
        else:
            cfg = DecoderConfig(
                vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=max(64, seq_len), init_std=0.25
            )
            model = DecoderLM(cfg)
            if name == "uniform":
                _scale_qk(model, _QK_SMALL)
            elif name == "saturated":
                _scale_qk(model, _QK_LARGE)
            elif name == "sharp":
                for m in model.modules():
                    if isinstance(m, MultiHeadAttention):
                        m.temperature = 1.0 / math.sqrt(m.d_head)  # scale = 1 / (sqrt(d) * t) = 1: unscaled
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)
    return model.eval(), ids
