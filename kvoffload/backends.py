"""Backends: where a direction's copies run.

Owns, per direction: the copy stream and the events of its jobs (``cuda``), or nothing beyond the
thread-side copy (``host``). Borrows: the device tensors and host records (through the addresses in
the descriptors it is given) and the caller's compute stream (it only records an event on it).

A backend answers four questions for a :class:`~kvoffload.handler.DirectionHandler`:

* ``fence(stream)`` (caller's thread, at submit): capture the point in the compute stream the job
  must wait for. For ``cuda`` an event recorded on the compute stream, so the copy waits for every
  kernel queued before the submit: stores must not read blocks still being written (rule 1), loads
  must not overwrite blocks still being read (rule 2). For ``host`` the caller's program order is
  the compute order, so there is nothing to capture.
* ``issue(descriptors, fence)`` (the handler's issuer thread): make the copy stream wait for the
  fence, enqueue the copies with the direction's source access order (STREAM for stores, ANY for
  loads), record an end event; return a :class:`Ticket`.
* ``Ticket.done()`` / ``Ticket.wait(timeout)``: completion, never blocking past a deadline.
* ``release()``: drop streams and events; called exactly once by the handler's shutdown.

The ``host`` backend is a real implementation, not a mock: its copies are ``memmove`` on the
issuer thread, with the same descriptors, ordering and shutdown contract; the CPU-only suite and the
demo on a machine without a GPU run through it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Final, Protocol

import torch

from kvoffload import bindings
from kvoffload._descriptors import Descriptors
from kvoffload.errors import DeviceMismatchError, TransferError
from kvoffload.records import Direction

__all__ = ["Backend", "CudaBackend", "FailedTicket", "HostBackend", "Ticket", "new_event", "new_stream"]

#: Event-query backoff while waiting: starts short (small jobs finish in microseconds), grows to the
#: cap so that a long wait costs little CPU.
WAIT_POLL_MIN_S: Final = 20e-6
WAIT_POLL_MAX_S: Final = 1e-3
_MS_PER_S: Final = 1e3


def sleep_backoff(delay: float) -> float:
    """Sleep ``delay`` seconds and return the next, doubled, delay (capped)."""
    time.sleep(delay)
    return min(delay * 2, WAIT_POLL_MAX_S)


class Ticket(Protocol):
    """The handle of one issued job.

    ``error`` is set when issuing failed part-way: the ticket still completes once whatever was
    enqueued has finished, and the job is then reported failed with that error.
    """

    error: BaseException | None

    def done(self) -> bool:
        """Whether the job's copies finished; never blocks. Raises if completion failed."""

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for completion; True when done. Raises if completion failed."""

    def seconds(self) -> float:
        """How long the copies ran (valid once done)."""


class Backend(Protocol):
    """Where one direction's copies run (see the module docstring)."""

    name: str
    path: str
    direction: Direction

    def fence(self, stream: object | None) -> object:
        """Capture the compute-stream position the next job must wait for (caller's thread).

        Raises:
            DeviceMismatchError: ``stream`` is not a stream of the backend's device.
        """

    def start_thread(self) -> None:
        """Prepare the calling (issuer) thread for :meth:`issue`."""

    def issue(self, descriptors: Descriptors, fence: object) -> Ticket:
        """Enqueue one job's copies behind ``fence`` (issuer thread); never raises."""

    def release(self) -> None:
        """Drop streams and events; called once, after the last ticket completed or was abandoned."""


# ------------------------------------------------------------------------------------------ cuda


class CudaTicket:
    """A job issued on a CUDA stream: a start and an end event on the copy stream."""

    def __init__(
        self,
        start: torch.cuda.Event,
        end: torch.cuda.Event | None,
        error: BaseException | None,
        device_index: int,
    ) -> None:
        self.start = start
        self.end = end
        self.error = error
        self.device_index = device_index

    def done(self) -> bool:
        """``cuEventQuery`` on the end event; raises :class:`~kvoffload.errors.CudaError`."""
        if self.end is None:
            return True
        return bindings.event_done(self.end.cuda_event, self.device_index)

    def wait(self, timeout_s: float) -> bool:
        """Poll the end event with backoff until done or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        delay = WAIT_POLL_MIN_S
        while not self.done():
            if time.monotonic() >= deadline:
                return False
            delay = sleep_backoff(min(delay, max(0.0, deadline - time.monotonic())))
        return True

    def seconds(self) -> float:
        """Device time between the start and end events."""
        if self.end is None:
            return 0.0
        return float(self.start.elapsed_time(self.end)) / _MS_PER_S


class CudaBackend:
    """Copies on one CUDA copy stream per direction, with batched DMA.

    Owns: its copy stream, created for it with the driver (never torch's shared pool, never the
    legacy default stream) and destroyed exactly once — by :meth:`release`, or, when a job is being
    issued at that moment, by that issue as it returns. The events of its jobs are owned by their
    tickets. Borrows: the compute streams it fences on.
    """

    name = "cuda"

    def __init__(
        self,
        direction: Direction,
        device: torch.device,
        copier: bindings.Copier,
        stream_handle: int,
    ) -> None:
        self.direction = direction
        self.device = device
        self.copier = copier
        self.path = copier.path
        self._device_index = _index(device)
        self._handle = stream_handle
        self._stream: torch.cuda.Stream | None = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
            stream_handle, device=device
        )
        self._order = (
            bindings.SrcAccessOrder.STREAM
            if direction is Direction.STORE
            else bindings.SrcAccessOrder.ANY
        )
        self._state = threading.Lock()
        self._issuing = False
        self._destroy_pending = False

    @classmethod
    def create(
        cls, direction: Direction, device: torch.device, copier: bindings.Copier
    ) -> CudaBackend:
        """A backend with a copy stream of its own on ``device``."""
        return cls(direction, device, copier, bindings.create_stream(_index(device)))

    @property
    def access_order(self) -> bindings.SrcAccessOrder:
        """The source access order this direction's copies use."""
        return self._order

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The copy stream (None once released)."""
        return self._stream

    def fence(self, stream: object | None) -> object:
        """Record an event on the compute stream (default: the device's current stream)."""
        if stream is None:
            compute = torch.cuda.current_stream(self.device)
        elif isinstance(stream, torch.cuda.Stream):
            compute = stream
        else:
            raise DeviceMismatchError(
                f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}"
            )
        if compute.device != self.device:
            raise DeviceMismatchError(
                f"stream is on {compute.device} but the layout's tensors are on {self.device}"
            )
        event = new_event(timing=False)
        event.record(compute)
        return event

    def start_thread(self) -> None:
        """Make the device's context current in the issuer thread."""
        torch.cuda.set_device(self.device)
        bindings.make_context_current(self._device_index)

    def issue(self, descriptors: Descriptors, fence: object) -> Ticket:
        """Wait for the fence on the copy stream, enqueue the copies, record the end event."""
        with self._state:
            stream = self._stream
            if stream is None:
                return FailedTicket(TransferError("the backend was released before the job was issued"))
            self._issuing = True
        try:
            return self._issue_on(stream, descriptors, fence)
        finally:
            with self._state:
                self._issuing = False
                destroy = self._destroy_pending
            if destroy:
                self._destroy()

    def _issue_on(self, stream: torch.cuda.Stream, descriptors: Descriptors, fence: object) -> Ticket:
        assert isinstance(fence, torch.cuda.Event)
        start = new_event(timing=True)
        try:
            stream.wait_event(fence)
            start.record(stream)
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        error: BaseException | None = None
        try:
            self.copier.copy(
                descriptors.dsts, descriptors.srcs, descriptors.sizes, self._order, stream.cuda_stream
            )
        except Exception as exc:  # copies may be partly enqueued: wait for the end event anyway
            error = exc
        end = new_event(timing=True)
        try:
            end.record(stream)
        except Exception as exc:
            return FailedTicket(exc if error is None else error)
        return CudaTicket(start, end, error, self._device_index)

    def release(self) -> None:
        """Stop issuing and destroy the copy stream (now, or when the issue in progress returns).

        Raises:
            CudaError: the driver refused to destroy the stream.
        """
        with self._state:
            if self._stream is None:
                return
            self._stream = None
            if self._issuing:
                self._destroy_pending = True
                return
        self._destroy()

    def _destroy(self) -> None:
        handle, self._handle = self._handle, 0
        if handle:
            bindings.destroy_stream(self._device_index, handle)


def new_stream(device: torch.device) -> torch.cuda.Stream:
    """A fresh stream from torch's pool (never the legacy default stream)."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def new_event(*, timing: bool) -> torch.cuda.Event:
    """A CUDA event; created by the driver at its first record."""
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def _index(device: torch.device) -> int:
    index: int | None = device.index
    return index if index is not None else torch.cuda.current_device()


class FailedTicket:
    """A job that failed before anything was enqueued."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True

    def seconds(self) -> float:
        return 0.0


# ------------------------------------------------------------------------------------------ host


class HostTicket:
    """A job copied on the issuer thread: complete when :meth:`HostBackend.issue` returns it."""

    def __init__(self, elapsed_s: float, error: BaseException | None) -> None:
        self.error = error
        self._elapsed_s = elapsed_s

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True

    def seconds(self) -> float:
        return self._elapsed_s


class HostBackend:
    """Copies between CPU tensors and host records with ``memmove`` on the issuer thread.

    Owns nothing. Its fence is empty: the caller's program order is the compute order on CPU. Fault
    injection for tests subclasses it and overrides :meth:`copy_one` (raise, or block).
    """

    name = "host"
    path = "host"

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self._released = threading.Event()

    def fence(self, stream: object | None) -> object:
        """Nothing to capture; ``stream`` must be None (CPU work is synchronous)."""
        if stream is not None:
            raise DeviceMismatchError(
                f"the host backend takes no stream (got {type(stream).__name__}): CPU tensors have "
                "no compute stream to order after"
            )
        return None

    def start_thread(self) -> None:
        """No per-thread setup."""

    def issue(self, descriptors: Descriptors, fence: object) -> Ticket:
        """Copy every descriptor now; the ticket is complete when returned."""
        start = time.perf_counter()
        try:
            for dst, src, size in zip(
                descriptors.dsts.tolist(), descriptors.srcs.tolist(), descriptors.sizes.tolist()
            ):
                if self._released.is_set():
                    raise TransferError("the backend was released while the job was copying")
                self.copy_one(dst, src, size)
        except Exception as exc:
            return HostTicket(time.perf_counter() - start, exc)
        return HostTicket(time.perf_counter() - start, None)

    def copy_one(self, dst: int, src: int, size: int) -> None:
        """Copy ``size`` bytes from address ``src`` to address ``dst``."""
        ctypes.memmove(dst, src, size)

    def release(self) -> None:
        """Stop any job still copying at its next descriptor."""
        self._released.set()
