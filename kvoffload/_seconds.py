"""Timeouts: the one check every wait's deadline goes through (``as_timeout``) and the longest a
wait takes (:data:`MAX_TIMEOUT_S`). Imports nothing heavy: the scheduler-side Manager uses it
without numpy or torch."""

from __future__ import annotations

import threading
from typing import Final

from kvoffload.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["MAX_TIMEOUT_S", "as_timeout"]

#: The longest timeout a wait takes (``threading.TIMEOUT_MAX``, about 292 years): a lock's or a
#: thread's wait raises ``OverflowError`` past it.
MAX_TIMEOUT_S: Final = threading.TIMEOUT_MAX


def as_timeout(timeout: object, name: str = "timeout") -> float:
    """Check a timeout in seconds: a finite, non-negative real number a wait can take.

    Raises:
        InvalidArgumentError: negative, NaN, infinite, or over :data:`MAX_TIMEOUT_S` (every wait
            has a deadline).
        ArgumentTypeError: not a number (also a ``TypeError``).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got {timeout!r}")
    if not 0 <= timeout <= MAX_TIMEOUT_S:  # NaN, inf and an int too large for a float fail it too
        raise InvalidArgumentError(
            f"{name} = {timeout!r} must be finite and >= 0 seconds (at most {MAX_TIMEOUT_S:.3g})"
        )
    return float(timeout)
