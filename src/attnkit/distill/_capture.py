"""``capture(model)``: what each layer of an attnkit model attended with, and its hidden states."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn as nn

from ..diagnostics import attention_modules
from ..nn import AttentionCall
from ._losses import AttentionRecord

Tensor = torch.Tensor

__all__ = ["capture", "Capture", "attention_layers"]


def attention_layers(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """``(attention, blocks)``: the self-attention module of each layer of ``model``, in order, and the
    transformer blocks holding them (empty when the model has attention modules outside blocks).

    The layers of a model built from :class:`attnkit.nn.TransformerBlock` s (:class:`~attnkit.nn.DecoderLM`,
    :class:`~attnkit.nn.Encoder`, ...) are its blocks (their ``attn``; cross attention is not a layer here);
    otherwise every attnkit attention module is one.

    Example::

        >>> from attnkit.nn import DecoderConfig, DecoderLM
        >>> from attnkit.distill import attention_layers
        >>> attn, blocks = attention_layers(DecoderLM(DecoderConfig.preset("tiny", n_layers=3)))
        >>> len(attn), len(blocks)
        (3, 3)
    """
    from ..nn.blocks import TransformerBlock

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if blocks:
        return [b.attn for b in blocks], blocks
    return [m for _, m in attention_modules(model)], []


@dataclass
class Capture:
    """What :func:`capture` recorded in the last forward pass: per layer, an :class:`AttentionRecord`
    (``attention[i]``, the arguments of its attention call) and the layer's output ``hidden[i] (B, L, d)``
    (when the model is built from blocks).  Both stay in the forward's autograd graph."""

    attention: list[AttentionRecord | None] = field(default_factory=list)
    hidden: list[Tensor | None] = field(default_factory=list)


@contextmanager
def capture(model: nn.Module):
    """Record, while active, the attention inputs and hidden states of every layer of an attnkit model.

    ``capture`` puts an attention hook (:meth:`attnkit.nn.MultiHeadAttention.register_attention_hook`) on each
    layer's self-attention and keeps the :class:`attnkit.nn.AttentionCall` it sees as an
    :class:`AttentionRecord` (``q (B, Hq, Lq, D)``, ``k``, ``v`` after projections and rotary positions; mask,
    bias, scale, softcap, sinks).  A forward hook on each :class:`~attnkit.nn.TransformerBlock` keeps its
    output.  Nothing of size ``Lq x Lk`` is stored: the attention losses recompute the weights from the record
    in blocks of rows.  The model computes exactly what it computes without ``capture``; the hooks are
    removed on exit, also after an error.  A layer called several times keeps its last call.

    Yields:
        A :class:`Capture` filled by each forward pass (``attention`` and ``hidden`` indexed by layer).

    Example::

        >>> import torch
        >>> from attnkit.nn import DecoderConfig, DecoderLM
        >>> from attnkit.distill import capture
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> with capture(model) as cap:
        ...     _ = model(torch.randint(0, 256, (2, 7)))
        >>> cap.attention[0].q.shape, cap.attention[0].shape, cap.hidden[1].shape
        (torch.Size([2, 4, 7, 16]), (2, 4, 7, 7), torch.Size([2, 7, 64]))
        >>> with capture(model) as outer, capture(model) as inner:  # captures nest: both see each call
        ...     _ = model(torch.randint(0, 256, (1, 3)))
        >>> outer.attention[0].q is inner.attention[0].q
        True
    """
    attn, blocks = attention_layers(model)
    cap = Capture([None] * len(attn), [None] * len(blocks))
    hooks = []
    try:
        for i, module in enumerate(attn):
            hooks.append(cast(Any, module).register_attention_hook(_recorder(cap, i)))  # (nn.Module typed)
        for i, block in enumerate(blocks):
            hooks.append(block.register_forward_hook(_keeper(cap, i)))
        yield cap
    finally:
        for h in reversed(hooks):
            h.remove()


def _recorder(cap: Capture, i: int):
    """The attention hook keeping layer ``i``'s call in ``cap.attention[i]``."""

    def hook(module: nn.Module, call: AttentionCall, compute) -> Tensor:
        out = compute(call)
        cap.attention[i] = AttentionRecord(call.q, call.k, call.v, **call.weight_kwargs())
        return out

    return hook


def _keeper(cap: Capture, i: int):
    def hook(module, args, output):
        cap.hidden[i] = output
        return None

    return hook
