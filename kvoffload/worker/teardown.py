"""The Worker's shutdown sequence (docs/design.md §6): stop the parts in order, prove the device idle,
then release the region, or abandon it when the device could not be proven idle.

Owns nothing: the Worker owns the parts and the region and hands them here once, at construction.
:meth:`Teardown.run` is the one release path; the Worker calls it once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvoffload.errors import ShutdownError, WaitTimeoutError
from kvoffload.region import RegionOwner

__all__ = ["Stoppable", "Teardown"]

_log = logging.getLogger("kvoffload.worker")


class Stoppable(Protocol):
    """A part the worker shuts down before it releases the region."""

    def shutdown(self, timeout: float) -> None: ...

    @property
    def thread_stopped(self) -> bool: ...


class Teardown:
    """Stops ``parts`` in the given order, then releases ``region`` (see the module docstring)."""

    def __init__(
        self,
        parts: Sequence[tuple[str, Stoppable]],
        region: RegionOwner,
        device_sync: Callable[[float], bool],
    ) -> None:
        self._parts = list(parts)
        self._region = region
        self._device_sync = device_sync

    @property
    def parts(self) -> tuple[tuple[str, Stoppable], ...]:
        """The parts, named, in the order they are stopped."""
        return tuple(self._parts)

    def run(self, seconds: float) -> None:
        """Stop every part and release the region within about ``seconds``.

        Raises:
            ShutdownError: after all cleanup, carrying every failure; ``region_left_mapped`` when
                the region was abandoned because the device could not be proven idle.
        """
        deadline = time.monotonic() + seconds
        failures: list[BaseException] = []
        failed = False
        for name, part in self._parts:
            try:
                part.shutdown(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                _log.error("%s shutdown failed: %s", name, exc)
                failures.append(exc)
                failed = True
        idle = True
        if failed or not self._threads_stopped():
            idle = self._fallback_sync(deadline, failures) and self._threads_stopped()
        left_mapped = False
        if idle:
            try:
                self._region.cleanup()
            except ShutdownError as exc:
                failures.extend(exc.failures)
                left_mapped = exc.region_left_mapped
            except Exception as exc:
                failures.append(exc)
        else:
            self._region.abandon()
            left_mapped = True
        if failures or left_mapped:
            raise ShutdownError("worker shutdown failed", failures, region_left_mapped=left_mapped)

    def _threads_stopped(self) -> bool:
        return all(part.thread_stopped for _, part in self._parts)

    def _fallback_sync(self, deadline: float, failures: list[BaseException]) -> bool:
        """Device-wide synchronize bounded by the deadline; True only if the device proved idle."""
        try:
            synced = self._device_sync(max(0.0, deadline - time.monotonic()))
        except Exception as exc:
            _log.error("fallback device synchronize failed: %s", exc)
            failures.append(exc)
            return False
        if not synced:
            failures.append(WaitTimeoutError("the fallback device synchronize did not finish in time"))
        return synced
