"""``attention()``: validate, pick a backend, run it."""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from typing import Callable, Literal, overload

import torch
from torch.utils.hooks import RemovableHandle

from . import backends as _backends
from .backends import math as _math
from .backends.call import Call, empty_result, graph_zero, is_empty, layout_swap_suspected, make_call, refuse_foreign
from .backends.scores import per_mask
from .bias import BiasLike
from .masks import Mask, MaskLike, nothing_visible, positions_unchecked

Tensor = torch.Tensor

__all__ = ["attention", "attention_weights", "observe_attention"]


# observe_attention's observers, by handle id (attnkit.diagnostics.probe adds one while it runs)
_observers: "OrderedDict[int, Callable[..., object]]" = OrderedDict()


def observe_attention(observer: Callable[..., object]) -> RemovableHandle:
    """Call ``observer(q, k, v, *, mask, bias, scale, softcap, out)`` after every :func:`attnkit.attention`
    call, in every thread, until the returned handle's ``remove()`` (the handle is also a context manager).

    ``out`` is the call's output ``(B, Hq, Lq, Dv)`` (without the log-sum-exp of ``return_lse=True``); the
    other arguments are the call's own.  An observer sees, it does not change: what it returns is ignored.
    :func:`attnkit.diagnostics.probe` observes this way the models that call :func:`attnkit.attention` themselves.

    Example::

        >>> import torch, attnkit
        >>> from attnkit.functional import observe_attention
        >>> shapes = []
        >>> with observe_attention(lambda q, k, v, *, out, **kw: shapes.append(tuple(out.shape))):
        ...     _ = attnkit.attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
        >>> _ = attnkit.attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
        >>> shapes  # the second call came after the handle was removed
        [(1, 2, 3, 4)]
    """
    if not callable(observer):
        raise TypeError(
            f"observe_attention: observer must be callable as observer(q, k, v, *, mask, bias, scale, "
            f"softcap, out), got {type(observer).__name__}"
        )
    handle = RemovableHandle(_observers)
    _observers[handle.id] = observer
    return handle


# mask -> {shape: whether it leaves every row empty} (weakly keyed; a few shapes per mask)
_CHECKED_VISIBLE: "weakref.WeakKeyDictionary[Mask, dict]" = weakref.WeakKeyDictionary()
_CHECKED_PER_MASK = 16


def _warn_if_nothing_visible(call: Call) -> None:
    """Warn when the mask leaves every query of a non-empty call with nothing to attend to, for masks whose
    parts may read positions differently (a ``from_fn`` or BlockMask predicate over query rows, or parts
    aligned both ways when ``Lq != Lk``): the mark of a row predicate combined with bottom-right masks.
    Evaluated once per mask and shape; the built-in masks on their own are not checked."""
    m = call.mask
    if m is None or call.q.device.type == "meta" or torch.compiler.is_compiling():  # (a dense mask has no unchecked
        # positions)
        return
    if not positions_unchecked(m, call.q_len, call.kv_len):
        return
    key = (call.batch, call.heads, call.q_len, call.kv_len)
    memo = per_mask(_CHECKED_VISIBLE, m)
    empty = None if memo is None else memo.get(key)
    if empty is None:
        empty = nothing_visible(m, call.batch, call.heads, call.q_len, call.kv_len, call.q.device)
        if memo is not None:
            if len(memo) >= _CHECKED_PER_MASK:
                memo.clear()
            memo[key] = empty
    if empty:  # (Python's warning filters show it once per calling line)
        warnings.warn(
            f"mask {m!r} leaves every query of this (B, H, Lq, Lk)=({call.batch}, {call.heads}, "
            f"{call.q_len}, {call.kv_len}) call with no key to attend to: the output is all zeros. A "
            f"from_fn predicate gets query rows (as in FlexAttention) while the built-in masks use "
            f"positions row + Lk - Lq: give it positions with masks.from_fn(fn, align='bottom_right'), "
            f"or align the built-ins with align='top_left'",
            stacklevel=3,
        )


def _warn_if_layout_swapped(call: Call) -> None:
    """Warn when FlashAttention's ``(B, L, H, D)`` tensors look read as ``(B, H, L, D)`` (see
    ``layout_swap_suspected``): the causal mask would leave most rows with nothing to see."""
    if not layout_swap_suspected(call):
        return
    hq, lq, lk = call.q.shape[1], call.q_len, call.kv_len
    warnings.warn(
        f"attention: q {tuple(call.q.shape)} and k {tuple(call.k.shape)} read as (B, H, L, D) give "
        f"Hq = Hkv = {hq} and Lq={lq} > Lk={lk}, so the causal mask leaves the first {lq - lk} of every "
        f"{lq} query rows with no key (output 0). If these are FlashAttention's (B, L, H, D) tensors, pass "
        f"q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) (and transpose the output back)",
        stacklevel=3,
    )


# ---------------------------------------------------------------------- public API


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: MaskLike | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: Literal[False] = False,
    backend: str = "auto",
    **unknown: object,
) -> Tensor: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: MaskLike | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: Literal[True],
    backend: str = "auto",
    **unknown: object,
) -> tuple[Tensor, Tensor]: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: MaskLike | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    **unknown: object,
) -> Tensor | tuple[Tensor, Tensor]: ...


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: MaskLike | None = None,
    bias: BiasLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    **unknown: object,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention: ``softmax(mask(bias(softcap(q @ k^T * scale)))) @ v``.

    Args:
        q: ``(B, Hq, Lq, D)`` queries.
        k: ``(B, Hkv, Lk, D)`` keys; ``Hq`` must be a multiple of ``Hkv`` (grouped-query attention;
            ``Hkv = 1`` is multi-query).  Query head ``h`` uses key/value head ``h // (Hq // Hkv)``.
        v: ``(B, Hkv, Lk, Dv)`` values; ``Dv`` may differ from ``D``.
        mask: ``None``, an :class:`attnkit.masks.Mask`, a bool tensor broadcastable to
            ``(B, Hq, Lq, Lk)`` (True means "may attend"), or a FlexAttention ``BlockMask`` (converted with
            :func:`attnkit.masks.from_flex`).
        bias: ``None``, a float tensor broadcastable to ``(B, Hq, Lq, Lk)`` added to the scores, or an
            :mod:`attnkit.bias` modifier (ALiBi, T5 buckets, temperature, ``from_fn``).
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(D)``.  A magnitude above ``sqrt(finfo.max)`` of the
            dtype the scores are computed in (float32 for half inputs: about ``1.8e19``) is refused: it would
            overflow the scores to inf.
        softcap: ``s`` maps a score ``x`` to ``s * tanh(x / s)`` (Gemma 2); applied before the bias.
        sinks: attention sinks (GPT-OSS): a float tensor ``(Hq,)`` (or broadcastable to ``(B, Hq)``), one
            logit per query head added to every row's softmax denominator with a zero value:
            ``out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij))``.  Differentiable.  Not
            touched by ``mask``, ``bias``, ``softcap`` or ``scale``.
        dropout_p: dropout on the attention weights (reproducible under ``torch.manual_seed``).
        return_lse: also return the log-sum-exp of each row's final scores; with ``sinks``, of the whole
            denominator (``logaddexp(lse_without_sink, sink)``): see :func:`attnkit.softmax.add_sink`
            for merging pieces computed with a sink.
        backend: ``"auto"`` or a name from :func:`attnkit.backends.available`.
        **unknown: keyword arguments of other attention functions (SDPA's ``is_causal``, ``attn_mask``,
            ``enable_gqa``; FlashAttention's ``causal``, ``window_size``, ``softmax_scale``; FlexAttention's
            ``block_mask``, ``score_mod``) raise a TypeError naming the attnkit equivalent.

    Returns:
        ``out (B, Hq, Lq, Dv)`` in the input dtype; with ``return_lse``, also ``lse (B, Hq, Lq)``
        (float32, float64 for float64 inputs).

    Query row ``i`` sits at position ``i + Lk - Lq`` (bottom-right), so with a causal mask and
    ``Lq < Lk`` the last query sees every key, and with ``Lq > Lk`` the first rows see none::

        Lq=2, Lk=5 causal      Lq=5, Lk=2 causal
           █ █ █ █ ·              · ·    <- sees nothing: output 0, lse -inf
           █ █ █ █ █              · ·
                                  · ·
                                  █ ·
                                  █ █

    A row that may attend to nothing gives output 0, ``lse = -inf`` and zero gradients, never NaN.  When a
    mask with a ``from_fn`` (or BlockMask) part leaves *every* row of a call with nothing, a warning says so.
    Meta tensors give the output's shape (on ``math`` or ``sdpa``; ``flash`` refuses them).
    With ``sinks`` such a row's denominator is ``exp(sink)`` alone: output 0, ``lse = sink``, zero
    gradients for ``q``, ``k``, ``v`` and the sink (the sink's only gradient from it comes through ``lse``).

    Example::

        >>> import torch, attnkit
        >>> from attnkit import masks
        >>> q = torch.randn(2, 8, 10, 64); k = v = torch.randn(2, 2, 10, 64)
        >>> out = attnkit.attention(q, k, v, mask=masks.causal())
        >>> out.shape
        torch.Size([2, 8, 10, 64])
    """
    refuse_foreign("attention", unknown)
    call = make_call(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        return_lse=return_lse,
        sinks=sinks,
    )
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    chosen = _backends.select(call, backend)
    if is_empty(call):
        result = empty_result(call)
    else:
        _warn_if_nothing_visible(call)
        _warn_if_layout_swapped(call)
        result = chosen.run(call)
    if _observers:
        out = result[0] if return_lse else result
        for observe in tuple(_observers.values()):
            observe(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, out=out)
    return result


def attention_weights(
    q: Tensor,
    k: Tensor,
    v: Tensor | None = None,
    *,
    mask=None,
    bias=None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    **unknown,
) -> Tensor:
    """The attention weights ``(B, Hq, Lq, Lk)`` that :func:`attention` would apply (before dropout).

    With ``sinks`` a row's weights sum to ``1 - exp(sink - lse)``, the sink's share left out.

    Computed by the ``math`` backend (the weights are materialised by definition).  ``v`` is accepted
    for symmetry with :func:`attention` and only used for validation.  A fully masked row is all zeros.
    Keyword arguments of other attention functions raise a TypeError naming the attnkit equivalent.

    Example::

        >>> import torch, attnkit
        >>> q = k = torch.randn(1, 1, 3, 4)
        >>> w = attnkit.attention_weights(q, k, mask=attnkit.masks.causal())
        >>> torch.allclose(w.sum(-1), torch.ones(1, 1, 3))
        True
    """
    refuse_foreign("attention_weights", unknown)
    if v is None:
        v = k
    call = make_call(q, k, v, mask=mask, bias=bias, scale=scale, softcap=softcap, sinks=sinks)
    if is_empty(call):
        return torch.zeros(
            call.batch, call.heads, call.q_len, call.kv_len, dtype=q.dtype, device=q.device
        ) + graph_zero(q, k)
    _warn_if_nothing_visible(call)
    return _math.weights(call)
