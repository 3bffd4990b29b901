"""Checks of plain arguments shared by every part of attnkit: flags, integers and numbers with bounds,
probabilities and choices.  Each returns the value (as a bool, int or float) or raises a TypeError or
ValueError naming the argument, the value and what to pass.  Only the standard library and torch: any
module may import it."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Literal, overload

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


@overload
def integer(name: str, value: object, *, minimum: int | None = None, allow_none: Literal[False] = False) -> int: ...
@overload
def integer(name: str, value: object, *, minimum: int | None = None, allow_none: bool) -> int | None: ...
def integer(name: str, value, *, minimum: int | None = None, allow_none: bool = False) -> int | None:
    """``value`` as an int (not a bool) ``>= minimum``; None passes where ``allow_none``.

    Example::

        >>> from attnkit._checks import integer
        >>> integer("block", 16, minimum=1)
        16
        >>> integer("block", 0, minimum=1)
        Traceback (most recent call last):
        ...
        ValueError: block=0 must be >= 1
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int{' or None' if allow_none else ''}, got {value!r} ({type(value).__name__})"
        )
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def number(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    fix: str = "",
) -> float:
    """``value``, a finite Python number (not a bool, not a tensor), as a float inside the bounds ``low`` and
    ``high`` (excluded where ``low_open`` / ``high_open``); ``fix`` ends the messages (e.g. what else may be
    passed).

    Example::

        >>> from attnkit._checks import number
        >>> number("dropout_p", 0.1, low=0.0, high=1.0, high_open=True)
        0.1
        >>> number("dropout_p", 1.0, low=0.0, high=1.0, high_open=True)
        Traceback (most recent call last):
        ...
        ValueError: dropout_p=1.0 must be < 1.0
    """
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name}={value!r} must be a Python number, not a tensor: pass float({name}) (a tensor "
            f"{name} would get no gradient here)"
        )
    if isinstance(value, bool) or not isinstance(value, Real) or not _finite(float(value)):
        raise ValueError(f"{name}={value!r} must be a finite number{fix}")
    x = float(value)
    if low is not None and (x < low or (low_open and x == low)):
        raise ValueError(f"{name}={value!r} must be {'>' if low_open else '>='} {low}{fix}")
    if high is not None and (x > high or (high_open and x == high)):
        raise ValueError(f"{name}={value!r} must be {'<' if high_open else '<='} {high}{fix}")
    return x


def _finite(x: float) -> bool:
    """``math.isfinite(x)`` by comparisons (NaN fails both), which ``torch.compile(dynamic=True)`` traces where it
    refuses ``math.isfinite`` of a number it keeps symbolic."""
    return -math.inf < x < math.inf


def _plain_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def finite_float(name: str, value) -> float:
    """``value``, a finite int or float (not a bool), as a float."""
    if not _plain_number(value) or not _finite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    return float(value)


@overload
def positive_float(name: str, value, *, allow_none: Literal[False] = False) -> float: ...
@overload
def positive_float(name: str, value, *, allow_none: bool) -> float | None: ...
def positive_float(name: str, value, *, allow_none: bool = False) -> float | None:
    """``value``, a finite int or float ``> 0``, as a float; None passes where ``allow_none``."""
    if value is None and allow_none:
        return None
    if not _plain_number(value) or not _finite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0{' (or None)' if allow_none else ''}")
    return float(value)


def probability(name: str, value) -> float:
    """``value``, an int or float in ``[0, 1)`` (a dropout rate), as a float."""
    if not _plain_number(value) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name}={value!r} must be a number in [0, 1)")
    return float(value)


def choice(name: str, value, options: tuple, *, fix: str = ""):
    """``value`` when it is one of ``options``; ``fix`` ends the message (e.g. what each option means)."""
    if value not in options:
        raise ValueError(f"{name}={value!r} is not one of {options}{fix}")
    return value


def int_in_range(name: str, value, low: int, high: int | None = None, *, fix: str = "") -> int:
    """``value``, an int (not a bool; a numpy int too, returned as an int) with ``low <= value`` and, when ``high``
    is given, ``value < high`` (an index); anything else raises ValueError, as the float checks do (:func:`integer` raises TypeError for a
    non-int).  ``fix`` ends the message (e.g. what the value counts, or what else may be passed).

    Example::

        >>> from attnkit._checks import int_in_range
        >>> int_in_range("row", 3, 0, 4)
        3
        >>> int_in_range("row", 4, 0, 4, fix=" (rows are 0-based)")
        Traceback (most recent call last):
        ...
        ValueError: row=4 must be an int in [0, 4) (rows are 0-based)
    """
    n = int(value) if isinstance(value, Integral) and not isinstance(value, bool) else None
    if n is None or n < low or (high is not None and n >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name}={value!r} must be an int {bound}{fix}")
    return n


def holds(ok: torch.Tensor, message: str) -> bool:
    """Whether a condition on tensor values holds (``ok``: a one-element bool tensor).

    Eagerly: ``bool(ok)``, for the caller to raise its own error, with the values.  While ``torch.compile`` or
    ``torch.export`` traces, the values are unknown (reading them would break the graph): the condition becomes
    an assertion in the graph (``torch._assert_async``), which raises a RuntimeError with ``message`` when the
    compiled code meets values that break it, and this returns True.

    Example::

        >>> import torch
        >>> from attnkit._checks import holds
        >>> lengths = torch.tensor([3, -1])
        >>> holds((lengths >= 0).all(), "lengths must be >= 0")
        False
    """
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
        return True
    return bool(ok)
