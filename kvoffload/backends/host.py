"""The host backend: copies between CPU tensors and host records with ``memmove`` on the issuer
thread.

It is a real implementation, not a mock: the same descriptors, ordering and shutdown contract as the
CUDA backend, so the CPU suite runs the whole worker end to end through it, and the demo uses it on
a machine without a GPU (saying so). Owns nothing; its fence is empty, because on the CPU the
caller's program order is the compute order. A layered load (docs/design.md §12) copies layer
after layer and marks each (:class:`~kvoffload._layer_load.HostLayerMarks`) as soon as it is copied.
Fault injection in tests subclasses it and overrides :meth:`HostBackend.copy_one` (raise, or block).
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import numpy.typing as npt

from kvoffload._descriptors import CopyPlan
from kvoffload._layer_load import HostLayerMarks, LayerMarks
from kvoffload.errors import DeviceMismatchError, TransferError
from kvoffload.records import Direction

__all__ = ["HostBackend", "HostTicket"]

I64Array = npt.NDArray[np.int64]


class HostTicket:
    """A job copied on the issuer thread: complete when :meth:`HostBackend.issue` returns it."""

    def __init__(self, elapsed_s: float, error: BaseException | None) -> None:
        self.error = error
        self.path: str | None = None
        self._elapsed_s = elapsed_s

    def done(self) -> bool:
        """Always: the copy ran before the ticket was made."""
        return True

    def wait(self, timeout_s: float) -> bool:
        """Always: the copy ran before the ticket was made."""
        return True

    def seconds(self) -> float:
        """Thread time of the copy."""
        return self._elapsed_s

    def release(self) -> None:
        """Nothing to give back."""


class HostBackend:
    """Copies between CPU tensors and host records with ``memmove`` (see the module docstring)."""

    name = "host"

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self._released = threading.Event()

    @property
    def path(self) -> str:
        """``"host"``."""
        return "host"

    def fence(self, stream: object | None) -> object:
        """Nothing to capture; ``stream`` must be None (CPU work is synchronous)."""
        if stream is not None:
            raise DeviceMismatchError(
                f"the host backend takes no stream (got {type(stream).__name__}): CPU tensors have "
                "no compute stream to order after"
            )
        return None

    def release_fence(self, fence: object) -> None:
        """Nothing to give back."""

    def start_thread(self) -> None:
        """No per-thread setup."""

    def can_issue_here(self) -> bool:
        """Never: host copies run on the issuer thread, not on the caller's."""
        return False

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """One copy per page (done during the issue itself)."""
        return pairs * plan.pages.num_pages

    def issue(self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> HostTicket:
        """Copy every page now; the ticket is complete when returned."""
        start = time.perf_counter()
        try:
            self._copy(plan, src, dst)
        except Exception as exc:
            return HostTicket(time.perf_counter() - start, exc)
        return HostTicket(time.perf_counter() - start, None)

    def layer_marks(self, count: int) -> HostLayerMarks:
        """Marks a waiting caller blocks on until its layer was copied."""
        return HostLayerMarks(count)

    def issue_layers(
        self, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array, fence: object,
        marks: LayerMarks, first: int = 0,
    ) -> HostTicket:
        """Copy layers ``first``.. now (``plans[i]`` is layer ``first + i``), marking each once
        copied; the ticket is complete when returned (a failure leaves the later layers unmarked:
        the handler settles them)."""
        start = time.perf_counter()
        try:
            for layer, plan in enumerate(plans, first):
                self._copy(plan, src, dst)
                assert isinstance(marks, HostLayerMarks)
                marks.mark(layer)
        except Exception as exc:
            return HostTicket(time.perf_counter() - start, exc)
        return HostTicket(time.perf_counter() - start, None)

    def _copy(self, plan: CopyPlan, src: I64Array, dst: I64Array) -> None:
        descriptors = plan.build(src, dst)
        for to, frm, size in zip(
            descriptors.dsts.tolist(), descriptors.srcs.tolist(), descriptors.sizes.tolist()
        ):
            if self._released.is_set():
                raise TransferError("the backend was released while the job was copying")
            self.copy_one(to, frm, size)

    def copy_one(self, dst: int, src: int, size: int) -> None:
        """Copy ``size`` bytes from address ``src`` to address ``dst``."""
        ctypes.memmove(dst, src, size)

    def release(self) -> None:
        """Stop any job still copying at its next descriptor."""
        self._released.set()
