"""Attention hooks: the public way to observe or replace the attention an :mod:`attnkit.nn` module computes."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch.utils.hooks import RemovableHandle

Tensor = torch.Tensor

__all__ = ["AttentionCall", "AttentionHook"]


@dataclass(frozen=True)
class AttentionCall:
    """One attention computation of an :mod:`attnkit.nn` module, as an attention hook sees it.

    ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)`` and ``v (B, Hkv, Lk, Dv)`` after the projections and the
    positions (rotary embeddings applied); ``mask`` and ``bias`` the module's masks and score modifiers for
    this call (the cache's and the call's masks included); ``scale``, ``softcap``, ``dropout_p`` and
    ``sinks`` (learned sink logits ``(Hq,)``, or None) as :func:`attnkit.attention` takes them.  The module
    computes ``attnkit.attention(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap,
    dropout_p=dropout_p, sinks=sinks, backend=module.backend)``, giving ``(B, Hq, Lq, Dv)``.

    A hook that changes the computation passes a modified call on: ``call.replace(mask=...)``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Any = None
    bias: Any = None
    scale: float | None = None
    softcap: float | None = None
    dropout_p: float = 0.0
    sinks: Tensor | None = None

    def replace(self, **changes: Any) -> "AttentionCall":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def weight_kwargs(self) -> dict[str, Any]:
        """``mask``, ``bias``, ``scale``, ``softcap`` and ``sinks``, the fields that fix the attention weights, as
        keyword arguments of :func:`attnkit.attention` (or a function taking its keywords); ``dropout_p`` is left
        to the caller, as not every computation takes it.

        Example::

            >>> import torch
            >>> from attnkit.nn import AttentionCall
            >>> q = torch.randn(1, 2, 3, 4)
            >>> sorted(AttentionCall(q, q, q, scale=0.5).weight_kwargs().items())
            [('bias', None), ('mask', None), ('scale', 0.5), ('sinks', None), ('softcap', None)]
        """
        return {name: getattr(self, name) for name in _WEIGHT_FIELDS}


_WEIGHT_FIELDS = ("mask", "bias", "scale", "softcap", "sinks")


# hook(module, call, compute) -> out: compute(call) runs the hooks registered before this one and then the module's
# own attention; a hook may call it (observe, or change the call) or not (replace the computation).
AttentionHook = Callable[[torch.nn.Module, AttentionCall, Callable[[AttentionCall], Tensor]], Tensor]

_NO_HOOKS: Mapping[int, AttentionHook] = {}  # (read only) the hooks of a module that never registered one


def register(
    hooks: "OrderedDict[int, AttentionHook] | None", hook: AttentionHook
) -> tuple[OrderedDict, RemovableHandle]:
    """Add ``hook`` to a module's hooks (a new dict when None): the dict and the handle removing the hook."""
    if not callable(hook):
        raise TypeError(
            f"register_attention_hook: hook must be callable as hook(module, call, compute), got {type(hook).__name__}"
        )
    if hooks is None:
        hooks = OrderedDict()
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return hooks, handle


def run(
    module: torch.nn.Module,
    hooks: Mapping[int, AttentionHook],
    call: AttentionCall,
    compute: Callable[[AttentionCall], Tensor],
) -> Tensor:
    """``call`` through ``hooks`` (the last registered outermost) down to ``compute``."""
    chain = tuple(hooks.values())  # (a hook removed while running does not change this call)

    def step(i: int, c: AttentionCall) -> Tensor:
        if not isinstance(c, AttentionCall):
            raise TypeError(
                f"an attention hook called compute() with {type(c).__name__}: pass the AttentionCall "
                f"it was given, or call.replace(...)"
            )
        if i < 0:
            return compute(c)
        return chain[i](module, c, lambda nxt: step(i - 1, nxt))

    return step(len(chain) - 1, call)
