"""FakeBackend: a backend whose jobs complete when a test says so, for lifecycle tests without a GPU.

It satisfies the backend protocol (:class:`kvoffload.testing.Backend`) without copying a byte: each
issue builds the job's descriptors (so a test sees what would move) and returns a :class:`FakeTicket`
that completes at once (``auto_finish``) or when the test calls ``finish()``. Failures on demand:
``issue_error`` fails the next jobs, ``release_error`` the release, a ticket's ``wait_error`` (its
``wait`` raises) and ``done_error`` (its ``done`` raises) fail its job with that error. Owns nothing.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from kvoffload.errors import DeviceMismatchError
from kvoffload.records import Direction
from kvoffload._descriptors import CopyPlan, Descriptors

__all__ = ["FakeBackend", "FakeTicket"]

I64Array = npt.NDArray[np.int64]
#: What a fake job reports as its copy time.
FAKE_SECONDS = 0.001


class FakeTicket:
    """Completes when :meth:`finish` is called; ``wait`` and ``done`` may be made to raise."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.path: str | None = None
        self.wait_error: BaseException | None = None
        self.done_error: BaseException | None = None
        self.released = 0
        self._event = threading.Event()

    def finish(self) -> None:
        """Complete the job."""
        self._event.set()

    def done(self) -> bool:
        """Whether :meth:`finish` was called (raises ``done_error`` when set)."""
        if self.done_error is not None:
            raise self.done_error
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait for :meth:`finish` (raises ``wait_error`` when set)."""
        if self.wait_error is not None:
            raise self.wait_error
        return self._event.wait(timeout_s)

    def seconds(self) -> float:
        """:data:`FAKE_SECONDS`."""
        return FAKE_SECONDS

    def release(self) -> None:
        """Counts the releases (the handler releases a ticket once, after reading its result)."""
        self.released += 1


class FakeBackend:
    """Issues :class:`FakeTicket` s (see the module docstring)."""

    name = "fake"
    path = "fake"

    def __init__(self, direction: Direction = Direction.STORE, auto_finish: bool = True) -> None:
        self.direction = direction
        self.auto_finish = auto_finish
        self.tickets: list[FakeTicket] = []
        self.issued: list[Descriptors] = []
        self.fences_taken = 0
        self.fences_released = 0
        self.released = 0
        self.release_error: Exception | None = None
        self.issue_error: Exception | None = None
        self.inline = False
        self.cost_per_block = 1  # descriptors the issue of one block builds (Backend.issue_cost)

    def fence(self, stream: object | None) -> object:
        """A token; ``stream`` must be None (there is no device)."""
        if stream is not None:
            raise DeviceMismatchError("the fake backend takes no stream")
        self.fences_taken += 1
        return object()

    def release_fence(self, fence: object) -> None:
        """Counts the fences given back."""
        self.fences_released += 1

    def start_thread(self) -> None:
        """No per-thread setup."""

    def can_issue_here(self) -> bool:
        """``inline``: whether jobs may be issued on the submitting thread."""
        return self.inline

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """``cost_per_block`` per block."""
        return pairs * self.cost_per_block

    def issue(self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> FakeTicket:
        """Record the job's descriptors and return its ticket (finished at once with
        ``auto_finish``; failed with ``issue_error`` when set)."""
        descriptors = plan.build(src, dst)
        ticket = FakeTicket()
        ticket.error = self.issue_error
        self.issued.append(descriptors)
        self.tickets.append(ticket)
        if self.auto_finish:
            ticket.finish()
        return ticket

    def release(self) -> None:
        """Counts the releases (raises ``release_error`` when set)."""
        self.released += 1
        if self.release_error is not None:
            raise self.release_error
