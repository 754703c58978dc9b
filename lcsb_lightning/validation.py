"""Argument checks shared by the library's constructors: fail fast, naming the argument, its value and
what is allowed."""

from __future__ import annotations

import numbers
from typing import Any


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an ``int`` if it is a whole number (``4`` or ``4.0``, not ``True``) ``>= minimum``.

    Raises:
        ValueError: naming ``name``, ``value`` and the allowed range.

    Example::

        >>> check_int("switch_every", 2.0, 1)
        2
        >>> check_int("switch_every", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: `switch_every` must be an integer >= 1, got 0.
    """
    whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)
