"""Host registration (pinning) in chunks, behind a small protocol.

Owns nothing: :func:`pin_chunks` returns the chunks it registered, and their owner (the region)
unregisters them with :func:`unpin_chunks` before it unmaps the memory. This module imports no
CUDA: the host backend pins with :class:`NoPinner`; the CUDA pinner lives with the driver calls
(:class:`kvoffload.bindings.driver.CudaHostPinner`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

from kvoffload.errors import InvalidArgumentError, KVOffloadError

__all__ = ["PIN_CHUNK_BYTES", "HostPinner", "NoPinner", "PinRollbackError", "pin_chunks", "unpin_chunks"]

#: Largest single host registration; one registration of >= 512 GiB fails on r580 drivers.
PIN_CHUNK_BYTES: Final = 64 << 30


class PinRollbackError(KVOffloadError):
    """Pinning failed, and so did unregistering some of the chunks it had registered: that memory
    may still be registered, and must not be unmapped."""


class HostPinner(Protocol):
    """Registers host memory with the device (page-locks it for DMA) and unregisters it.

    ``register`` either registers the whole range or raises with nothing registered; ``unregister``
    takes the start address of a range that ``register`` accepted.
    """

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock ``[ptr, ptr + nbytes)`` for DMA."""

    def unregister(self, ptr: int) -> None:
        """Release the registration that starts at ``ptr``."""



class NoPinner:
    """A pinner for the host backend: host memory needs no registration. Owns nothing."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Accept the range without doing anything."""

    def unregister(self, ptr: int) -> None:
        """Accept the release without doing anything."""


def pin_chunks(
    pinner: HostPinner, ptr: int, nbytes: int, chunk_bytes: int
) -> list[tuple[int, int]]:
    """Register ``[ptr, ptr + nbytes)`` in chunks of at most ``chunk_bytes``.

    Returns the ``(start, nbytes)`` of every registered chunk. If one registration fails, the chunks
    registered so far are unregistered in reverse order and the first error is raised; failures of
    that rollback are chained to it, so nothing is left registered silently.

    Raises:
        InvalidArgumentError: ``nbytes`` or ``chunk_bytes`` not positive.
        KVOffloadError: whatever the pinner raised; :class:`PinRollbackError` when the rollback
            failed too.
    """
    if nbytes <= 0 or chunk_bytes <= 0:
        raise InvalidArgumentError(
            f"pin_chunks needs positive sizes (nbytes = {nbytes}, chunk_bytes = {chunk_bytes})"
        )
    done: list[tuple[int, int]] = []
    offset = 0
    try:
        while offset < nbytes:
            size = min(chunk_bytes, nbytes - offset)
            pinner.register(ptr + offset, size)
            done.append((ptr + offset, size))
            offset += size
    except BaseException as exc:
        rollback = unpin_chunks(pinner, done)
        if rollback:
            raise PinRollbackError(
                f"pinning failed at offset {offset} and {len(rollback)} chunk(s) could not be "
                f"unregistered: {rollback}"
            ) from exc
        raise
    return done


def unpin_chunks(pinner: HostPinner, chunks: Sequence[tuple[int, int]]) -> list[BaseException]:
    """Unregister chunks in reverse order of registration; returns the failures (never raises)."""
    failures: list[BaseException] = []
    for start, _size in reversed(chunks):
        try:
            pinner.unregister(start)
        except Exception as exc:  # collected: every other chunk must still be released
            failures.append(exc)
    return failures

