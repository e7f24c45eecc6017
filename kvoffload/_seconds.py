"""Timeouts: the one check every wait's deadline goes through (``as_timeout``), and the finiteness
test under it. Imports nothing heavy: the scheduler-side Manager uses it without numpy or torch."""

from __future__ import annotations

import math

from kvoffload.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["as_timeout", "is_finite"]


def as_timeout(timeout: object, name: str = "timeout") -> float:
    """Check a timeout in seconds: a finite, non-negative real number.

    Raises:
        InvalidArgumentError: negative, NaN, infinite or too large for a float (every wait has a
            deadline).
        ArgumentTypeError: not a number (also a ``TypeError``).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got {timeout!r}")
    if not is_finite(timeout) or timeout < 0:
        raise InvalidArgumentError(f"{name} = {timeout!r} must be finite and >= 0 seconds")
    return float(timeout)


def is_finite(value: float) -> bool:
    """Whether ``value`` is a finite number: an int too large for a float is not (``math.isfinite``
    raises ``OverflowError`` for it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
