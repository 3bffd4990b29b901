"""Checks of plain arguments shared by every part of attnkit (each raises a TypeError naming the argument,
the value and what to pass).  Only the standard library and torch: any module may import it."""

from __future__ import annotations

import torch


def flag(name: str, value) -> bool:
    """``value`` as a Python bool: True/False, a numpy bool or a one-element bool tensor.

    Anything else is refused: strings first among them (``"no"`` and ``"false"`` are truthy), None, and
    numbers (``1`` is not a flag; pass ``bool(x)`` where a number is meant as one).

    Example::

        >>> from attnkit._checks import flag
        >>> flag("stream", False)
        False
        >>> flag("stream", "yes")
        Traceback (most recent call last):
        ...
        TypeError: stream must be True or False, got 'yes' (str)
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool and value.numel() == 1:
            return bool(value)
    elif type(value).__name__ in ("bool_", "bool") and type(value).__module__ == "numpy":
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r:.80} ({type(value).__name__})")
