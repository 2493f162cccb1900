"""Byte sizes, one rule each: how a byte count is written, how far a strided view reaches,
and what an argument that counts (bytes, iterations) may be.

Dependency-free, like :mod:`graphslot.errors`: every layer may import it (the backends
included).
"""

from __future__ import annotations

import operator
from typing import Sequence

from .errors import UsageError

__all__ = ["format_bytes", "view_extent", "as_integer", "whole_count"]

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(n: int | None, *, digits: int = 2, exact: bool = False) -> str:
    """``n`` bytes in the largest binary unit it reaches.

    Args:
        n: a byte count (negative counts are written with their sign); ``None`` for a
            figure that is not known.
        digits: decimals after the point (``1536`` -> ``"1.50 KiB"``).
        exact: use only a unit that divides ``n`` and write it without decimals
            (``2 << 20`` -> ``"2 MiB"``, ``3000`` -> ``"3000 B"``), for sizes that must be
            read back exactly (granularities, mappings).

    Returns:
        The text, e.g. ``"1.50 GiB"``, ``"512 B"``, or ``"-"`` for ``None``.
    """
    if n is None:
        return "-"
    for unit, scale in _UNITS:
        if exact:
            if n >= scale and n % scale == 0:
                return f"{n // scale} {unit}"
        elif abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n} B"


def view_extent(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """Bytes from a strided view's first element to just past its last.

    Args:
        shape: the view's sizes.
        stride: its strides in elements (non-negative), one per dimension.
        itemsize: bytes per element.

    Returns:
        ``(1 + sum((size - 1) * stride)) * itemsize``, or 0 for a view with no elements
        (a 0-d view spans one element).
    """
    if not all(shape):
        return 0
    return (1 + sum((int(s) - 1) * int(step) for s, step in zip(shape, stride))) * itemsize


def as_integer(value: object) -> int | None:
    """``value`` as a Python ``int`` where it is an integer (numpy's and torch's too,
    through ``operator.index``), else None: a bool of any kind (a bool tensor's
    ``__index__`` answers 1), a float or a string is none."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def whole_count(value: object, name: str, *, least: int = 0, of: str = "") -> int:
    """``value`` as a Python ``int`` of at least ``least`` (see :func:`as_integer`).

    Args:
        value: what the caller gave.
        name: the argument, for the message.
        least: the smallest value allowed.
        of: what it counts, for the message (``" of bytes"``).

    Raises:
        UsageError: ``"<name> must be an integer<of>, at least <least>, got <value>"``.
    """
    n = as_integer(value)
    if n is None or n < least:
        raise UsageError(f"{name} must be an integer{of}, at least {least}, got {value!r}")
    return n
