"""Timeouts: the one check every wait's deadline goes through (``as_timeout``) and the longest a
wait takes (:data:`MAX_TIMEOUT_S`). Imports nothing heavy: the scheduler-side Manager uses it
without numpy or torch."""

from __future__ import annotations

import threading
from typing import Final

from kvoffload.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["MAX_TIMEOUT_S", "WAIT_SLICE_S", "as_timeout"]

#: The longest timeout a wait takes (``threading.TIMEOUT_MAX``, about 292 years): a lock's or a
#: thread's wait raises ``OverflowError`` past it.
MAX_TIMEOUT_S: Final = threading.TIMEOUT_MAX

#: A long wait looks again at least this often (seconds) for a shutdown that ended it or gave its
#: work up (the job book's waits, ``LayerLoad.wait_layer``, the disk pipeline's steps). For a job's
#: wait each slice starts the ticket's wait again, spin included (2 ms on the native issuer, 5 ms
#: on the Python one): about 1% and 2% of a core over a long wait.
WAIT_SLICE_S: Final = 0.25


def as_timeout(timeout: object, name: str = "timeout", *, positive: bool = False) -> float:
    """Check a timeout in seconds: a finite, non-negative (``positive``: > 0) real number a wait
    can take.

    Raises:
        InvalidArgumentError: negative (``positive``: or zero), NaN, infinite, or over
            :data:`MAX_TIMEOUT_S` (every wait has a deadline).
        ArgumentTypeError: not a number (also a ``TypeError``).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got {timeout!r}")
    if not 0 <= timeout <= MAX_TIMEOUT_S or (positive and timeout == 0):  # NaN, inf, an int too
        raise InvalidArgumentError(  # large for a float fail it too
            f"{name} = {timeout!r} must be finite and {'>' if positive else '>='} 0 seconds (at most "
            f"{MAX_TIMEOUT_S:.3g})"
        )
    return float(timeout)
