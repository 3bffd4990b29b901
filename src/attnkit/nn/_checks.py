"""Input checks shared by the modules: each raises ValueError/TypeError naming the argument, the value and the fix."""

from __future__ import annotations

import dataclasses
from typing import Literal, TypeVar, overload

import torch

from .. import masks as _masks
from .._checks import integer

# re-exported: the modules' checks of plain arguments
from .._checks import choice, finite_float, flag, int_in_range, number, positive_float, probability  # noqa: F401

Tensor = torch.Tensor
_Config = TypeVar("_Config")


@overload
def positive_int(name: str, value, *, allow_none: Literal[False] = False) -> int: ...
@overload
def positive_int(name: str, value, *, allow_none: bool) -> int | None: ...
def positive_int(name: str, value, *, allow_none: bool = False) -> int | None:
    """A size: an int ``>= 1`` (None passes where ``allow_none``)."""
    return integer(name, value, minimum=1, allow_none=allow_none)


def config_or_fields(
    kind: type[_Config], config, fields: tuple, options: dict, *, owner: str, positional: tuple[str, ...], what: str
) -> tuple[_Config | None, tuple]:
    """``(config, ())`` when a constructor was given a ``kind`` config (and nothing beside it), else ``(None,
    fields)``: the ``what`` (fields, options) given by position, ``config`` the first of them, at most as many as
    ``positional`` names.  A TypeError for a config beside fields, a config that is neither, or too many."""
    name = kind.__name__
    if isinstance(config, kind):
        if fields or options:
            given = ", ".join([f"{len(fields)} positional"] * bool(fields) + list(options))
            raise TypeError(
                f"{owner} got {'an' if name[0] in 'AEIOU' else 'a'} {name} and the {what} {given}: pass "
                f"one or the other (config.replace(...) makes a config with some fields changed)"
            )
        return config, ()
    if config is not None and (isinstance(config, bool) or not isinstance(config, int)):
        raise TypeError(
            f"{owner} takes an attnkit.nn.{name}, or its {what} ({owner}({', '.join(positional[:2])}, "
            f"...)), got {type(config).__name__} {config!r:.60}"
        )
    fields = fields if config is None else (config, *fields)
    if len(fields) > len(positional):
        raise TypeError(
            f"{owner} takes at most {len(positional)} {what} by position ({', '.join(positional)}), "
            f"got {len(fields)}: pass the others by keyword"
        )
    return None, fields


def config_of(
    kind: type[_Config], config, fields: tuple, options: dict, *, owner: str, positional: tuple[str, ...], beside: str
) -> _Config:
    """The ``kind`` config (a dataclass) a module constructor was given: ``config`` itself, or, as a convenience,
    the one its fields make (``fields`` by position: at most ``positional``, in the dataclass's order; ``options``
    by keyword).  ``beside`` names the constructor's other keywords, for the message of an unknown one."""
    given, fields = config_or_fields(kind, config, fields, options, owner=owner, positional=positional, what="fields")
    if given is not None:
        return given
    name = kind.__name__
    try:
        return kind(*fields, **options)
    except TypeError as e:  # a missing or unknown field
        names = ", ".join(f.name for f in dataclasses.fields(kind))  # type: ignore[arg-type]
        raise TypeError(
            f"{owner}: {str(e).split('() ', 1)[-1]} (its options are {beside} and {name}'s fields: {names})"
        ) from None


def config_object(name: str, config, kind: type) -> None:
    """``config`` is a ``kind`` (a module's config dataclass), for ``Module.from_config``."""
    if not isinstance(config, kind):
        raise TypeError(
            f"{name} takes an attnkit.nn.{kind.__name__}, got {type(config).__name__}: build one, "
            f"e.g. {kind.__name__}(...), or pass the options to the module's constructor"
        )


def backend(value) -> str:
    """A backend name: a string, checked against the registry when the module computes attention."""
    if not isinstance(value, str):
        raise TypeError(f"backend must be a string such as 'auto', got {type(value).__name__}")
    return value


def head_layout(d_model: int, n_heads: int, n_kv_heads: int | None, d_head: int | None) -> tuple[int, int]:
    """Validated ``(n_kv_heads, d_head)``."""
    positive_int("d_model", d_model)
    positive_int("n_heads", n_heads)
    positive_int("n_kv_heads", n_kv_heads, allow_none=True)
    positive_int("d_head", d_head, allow_none=True)
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if n_heads % n_kv_heads != 0:
        raise ValueError(
            f"got n_heads={n_heads} and n_kv_heads={n_kv_heads}: n_heads must be a multiple of "
            f"n_kv_heads (grouped-query attention); try n_kv_heads in "
            f"{[h for h in range(1, n_heads + 1) if n_heads % h == 0]}"
        )
    if d_head is None:
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}: choose n_heads that "
                f"divides d_model, or give d_head explicitly (the heads then project to "
                f"n_heads * d_head and back)"
            )
        d_head = d_model // n_heads
    return n_kv_heads, d_head


def features(name: str, x, width: int, *, what: str, ndim: int | None = 3) -> None:
    """``x`` is a float tensor whose last dim is ``width``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have shape {what}, got {tuple(x.shape)}")
    if x.shape[-1] != width:
        raise ValueError(
            f"{name} has width {x.shape[-1]} (shape {tuple(x.shape)}) but this module expects {width}: {what}"
        )


def token_ids(name: str, ids, vocab_size: int) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a LongTensor (B, L) of token ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.long, torch.int32):
        raise TypeError(f"{name} must hold integer token ids (int64 or int32), got dtype {ids.dtype}")
    if ids.dim() != 2:
        fix = f"add a batch dim with {name}[None]" if ids.dim() == 1 else "one row of token ids per sequence"
        raise ValueError(f"{name} must have shape (B, L), got {tuple(ids.shape)}: {fix}")
    # on the CPU (where a bad id is an IndexError deep in the embedding): on a GPU the check would cost a
    # host sync every forward; under torch.compile it would break the graph
    if ids.numel() and vocab_size is not None and ids.device.type == "cpu" and not torch.compiler.is_compiling():
        lo, hi = (int(t) for t in torch.aminmax(ids))
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size}): check the "
                f"tokenizer matches the model (config.vocab_size={vocab_size})"
            )


def as_mask(name: str, mask) -> _masks.Mask | None:
    """``None``, a Mask, or a bool tensor (2 to 4 dims, broadcastable to (B, H, Lq, Lk)) as a Mask."""
    if mask is None or isinstance(mask, _masks.Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(
                f"{name} must be a bool tensor (True = may attend), got dtype {mask.dtype}: "
                f"use {name}.bool() for a 0/1 mask"
            )
        if not 2 <= mask.dim() <= 4:
            raise ValueError(
                f"{name} must have 2 to 4 dims broadcastable to (B, H, Lq, Lk), got shape "
                f"{tuple(mask.shape)}; for key padding use attnkit.masks.key_padding(lengths)"
            )
        return _masks.from_dense(mask)
    raise TypeError(f"{name} must be None, an attnkit.masks.Mask or a bool tensor, got {type(mask).__name__}")


def causal_model_mask(name: str, mask) -> _masks.Mask | None:
    """:func:`as_mask` for a causal model's mask: refuses parts that would decode differently with a cache."""
    mask = as_mask(name, mask)
    found = None if mask is None else _masks._decodes_differently(mask)
    if found is not None:
        part, why = found
        raise ValueError(
            f"{name} contains {part!r}, {why}: decoding with a KV cache would see other keys than a full forward"
        )
    return mask


def check_mask_shape(name: str, mask: _masks.Mask | None, batch: int, heads: int, q_len: int, kv_len: int) -> None:
    if mask is None:
        return
    try:
        mask.validate(batch, heads, q_len, kv_len)
    except ValueError as e:
        raise ValueError(
            f"{name} does not fit the attention scores (B, H, Lq, Lk)=({batch}, {heads}, {q_len}, {kv_len}): {e}"
        ) from None


def combine(*ms: _masks.Mask | None) -> _masks.Mask | None:
    out = None
    for m in ms:
        if m is not None:
            out = m if out is None else out & m
    return out


def cache_kv(kv) -> tuple[Tensor, Tensor, _masks.Mask | None]:
    """What a layer cache's ``update(k, v)`` returned, when not a :class:`attnkit.cache.CacheAttention`: a
    :class:`attnkit.cache.CacheRead` (or a plain ``(k, v)`` / ``(k, v, extra_mask)``) as ``(k_all, v_all,
    extra_mask or None)``."""
    if not isinstance(kv, (tuple, list)) or len(kv) not in (2, 3):
        raise TypeError(
            f"cache.update(k, v) must return a CacheRead (or a (k, v) / (k, v, extra_mask) tuple) or "
            f"a CacheAttention (an object with attend()), got {type(kv).__name__}"
        )
    return kv[0], kv[1], as_mask("the cache's extra_mask", kv[2]) if len(kv) == 3 else None


def positions_tensor(name: str, positions, batch: int, length: int, device) -> Tensor:
    """Absolute positions as a long tensor (L,) or (B, L)."""
    if not isinstance(positions, torch.Tensor):
        positions = torch.as_tensor(positions)
    if positions.dtype == torch.bool or positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"{name} must hold integer positions, got dtype {positions.dtype}")
    if positions.dim() == 1 and positions.shape[0] == length:
        pass
    elif positions.dim() == 2 and positions.shape[1] == length and positions.shape[0] in (1, batch):
        pass
    else:
        raise ValueError(
            f"{name} must have shape (L,)=({length},) or (B, L)=({batch}, {length}), got {tuple(positions.shape)}"
        )
    return positions.to(device=device, dtype=torch.long)
