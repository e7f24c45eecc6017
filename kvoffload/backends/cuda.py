"""The CUDA backend: one direction's copies on streams of its own, through the transfer paths it was
given.

Owns, per direction: its streams (:class:`CudaStreams`: a copy stream, and a kernel stream when a
path runs the copy kernel; created with the driver, never taken from torch's shared pool, destroyed
exactly once), and the transfer paths it was built with (each may own device buffers and events).
Borrows: the device tensors and host records (through the addresses in the copy plan) and the
caller's compute stream (it only records an event on it).

The backend is composed, not inherited: :class:`DmaPath` (batched DMA, here) and the kernel paths
(:mod:`kvoffload.backends.kernel`: ``sm`` and ``staged``) are interchangeable
:class:`TransferPath` objects, and a chooser picks one per job — always the same one for a fixed
path, the calibrated one for ``auto``. Jobs of one direction finish in submission order whichever
path moved them: a path runs on the copy stream, on the kernel stream, or on both (``staged``, which
ends after everything queued on either before it); a job on one stream first waits for the other
when the previous job ended there.

A layered load (docs/design.md §12) runs its layers one after the other on the same path and
records one pooled event per layer as that layer's last copy is enqueued (:class:`CudaLayerMarks`);
``wait_layer`` then makes the caller's stream wait for that event on the device.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Final, Literal, Protocol, Union

import numpy as np
import numpy.typing as npt
import torch

from kvoffload._descriptors import CopyPlan
from kvoffload._jobs import FailedTicket
from kvoffload._layer_load import LayerMarks
from kvoffload.bindings import driver
from kvoffload.bindings.copier import Copier
from kvoffload.errors import DeviceMismatchError, TransferError, WaitTimeoutError
from kvoffload.records import Direction

__all__ = [
    "CudaBackend",
    "CudaLayerMarks",
    "CudaStreams",
    "CudaTicket",
    "DmaPath",
    "LayeredChooser",
    "PathTicket",
    "TransferPath",
    "access_order",
    "current_device_index",
    "current_device_reader",
    "current_stream_handle",
    "device_index",
    "end_job",
]

I64Array = npt.NDArray[np.int64]


#: A layered load's path from its host records and how many records in a run its issuer moves as
#: one strided copy (0: none); ``auto``'s is :meth:`kvoffload.calibration.LayeredChoice.path`.
LayeredChooser = Callable[[I64Array, int], str]
#: What a transfer path's issue returns.
PathTicket = Union["CudaTicket", FailedTicket]
#: Waiting first polls without sleeping (yielding the GIL) for this long, then sleeps with a doubling
#: backoff capped so that a long wait costs little CPU. A sleep overshoots by the timer slack (tens of
#: microseconds or more), which a job that ends within the spin never pays (up to ~250 MiB); a
#: longer one pays it once on milliseconds. Only a thread that waits spins, and it yields the GIL.
WAIT_SPIN_S: Final = 5e-3
WAIT_POLL_MIN_S: Final = 50e-6
WAIT_POLL_MAX_S: Final = 100e-6
#: The kernel stream's priority (``cuStreamCreateWithPriority``; 0 is the lowest, negative values
#: are higher, clamped to the device's range): the copy kernel's CTAs are scheduled ahead of
#: pending compute CTAs of lower priority.
KERNEL_STREAM_PRIORITY: Final = 0
#: Where a path's jobs run.
StreamName = Literal["copy", "kernel", "both"]
COPY: Final = "copy"
KERNEL: Final = "kernel"
BOTH: Final = "both"


def poll_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Call ``done`` until it is true or ``timeout_s`` passed; True when it became true.

    Spins (yielding the GIL) for :data:`WAIT_SPIN_S`, then sleeps with a doubling backoff.
    """
    now = time.monotonic()
    deadline = now + timeout_s
    spin_until = now + min(WAIT_SPIN_S, timeout_s)
    delay = WAIT_POLL_MIN_S
    while not done():
        now = time.monotonic()
        if now >= deadline:
            return False
        if now < spin_until:
            time.sleep(0)
            continue
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, WAIT_POLL_MAX_S)
    return True


def access_order(direction: Direction) -> driver.SrcAccessOrder:
    """The source access order of a direction's copies: STREAM for stores (their source is device
    memory compute may still write), ANY for loads (pinned host memory no stream writes while the
    load is in flight; docs/design.md §5 rules 1 and 3)."""
    return driver.SrcAccessOrder.STREAM if direction is Direction.STORE else driver.SrcAccessOrder.ANY


def device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (the current device when it names none)."""
    index: int | None = device.index
    return index if index is not None else torch.cuda.current_device()


_raw_current_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_raw_current_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)


def current_stream_handle(index: int) -> int:
    """The handle of the calling thread's current torch stream on the device (torch's raw accessor
    where it has one: a tenth of the cost of building the stream object)."""
    if _raw_current_stream is not None:
        return int(_raw_current_stream(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def current_stream_reader(index: int) -> Callable[[], int]:
    """A call without arguments that returns :func:`current_stream_handle` of device ``index``:
    torch's raw accessor bound to the device where it has one (no Python frame per call)."""
    if _raw_current_stream is not None:
        return functools.partial(_raw_current_stream, index)
    return functools.partial(current_stream_handle, index)


def current_device_reader() -> Callable[[], int]:
    """A call without arguments that returns the calling thread's current CUDA device: torch's raw
    accessor where it has one (no Python frame of its own), else :func:`current_device_index`."""
    return _raw_current_device if _raw_current_device is not None else current_device_index


def current_device_index() -> int:
    """The calling thread's current CUDA device (torch's raw accessor where it has one: it skips
    the lazy-initialisation check, done by then, as the backends exist)."""
    if _raw_current_device is not None:
        return int(_raw_current_device())
    return torch.cuda.current_device()


class CudaTicket:
    """A job issued on CUDA streams: a start event before its first copy and an end event after its
    last (pooled events, given back by :meth:`release`)."""

    def __init__(
        self,
        start: driver.Event,
        end: driver.Event | None,
        error: BaseException | None,
        path: str | None = None,
    ) -> None:
        self.start = start
        self.end = end
        self.error = error
        self.path = path
        self._done = end is None

    def done(self) -> bool:
        """``cuEventQuery`` on the end event until it reports completion (then no more queries);
        raises :class:`~kvoffload.errors.CudaError`."""
        if not self._done:
            assert self.end is not None
            self._done = self.end.done()
        return self._done

    def wait(self, timeout_s: float) -> bool:
        """Poll the end event (spinning briefly, then with backoff) until done or ``timeout_s``."""
        return poll_until(self.done, timeout_s)

    def seconds(self) -> float:
        """Device time between the start and end events (0.0 for a job that failed: its start event
        may not have been recorded)."""
        if self.end is None or self.error is not None:
            return 0.0
        return self.start.seconds_until(self.end)

    def release(self) -> None:
        """Give both events back to their pool (the job completed: nothing waits on them)."""
        self.start.release()
        if self.end is not None:
            self.end.release()


def end_job(
    start: driver.Event, end: driver.Event, stream: int, error: BaseException | None, path: str,
    fresh: Callable[[], driver.Event], rest: tuple[CudaLayerMarks, int] | None = None,
) -> PathTicket:
    """The ticket of a job whose start is recorded: its end recorded on ``stream`` (the stream it
    ends on, after everything it enqueued); for a layered job that failed (``rest``: its marks and
    the layer it stops before), the marks its failure left unmarked after the end.

    A refused end record is tried once more with a ``fresh`` event (taken before the refused one is
    destroyed, so that it is another event): the job's copies may be in flight, and only a recorded
    end tells when they are done (docs/design.md §5 rule 5: a failed job ends only once none of its
    copies touches its buffers). The job then fails with the refusal, but ends with that end.
    Refused twice, the context is taken as failed (none of its work runs again) and the job ends at
    once, its events given back. A refused mark leaves its layer and the later ones unmarked: their
    waits say they did not land.
    """
    try:
        end.record(stream)
    except Exception as exc:
        error = error or exc
        try:
            again = fresh()
        except Exception:
            end.discard()
            start.release()
            return FailedTicket(error)
        end.discard()  # never pooled again: a fault tied to it would come back to its next taker
        end = again
        try:
            end.record(stream)
        except Exception:
            start.release()
            end.release()
            return FailedTicket(error)
    if error is not None and rest is not None:
        marks, upto = rest
        try:
            marks.record_rest(stream, upto)
        except Exception:  # noqa: S110 - the layers left unmarked get no event (see above)
            pass
    return CudaTicket(start, end, error, path)


class CudaLayerMarks:
    """The layers of one layered job on CUDA: one pooled event per layer, recorded on the stream
    where that layer's last copy was enqueued (docs/design.md §12).

    Owns each layer's event from its record until :meth:`release` (the handler's, once the job's
    result was published) or, when waits are inside their stream wait then, until the last of them
    left; borrows the backend's stream resolution. A wait counts itself under the marks' lock and
    enqueues ``cuStreamWaitEvent`` on the caller's stream outside it (a stream wait may block on a
    full stream, and the handler releases the marks under its own lock: docs/design.md §6), so the
    event cannot go back to its pool (and be recorded by another job) before the wait was enqueued.
    """

    on_device = True

    def __init__(self, count: int, pool: driver.EventPool, index: int,
                 stream_handle: Callable[[object | None], int]) -> None:
        self._count = count
        self._pool = pool
        self._index = index
        self._stream_handle = stream_handle
        self._events: list[driver.Event | None] = [None] * count
        self._marked = 0  # layers whose event is recorded, or that will get none
        self._released = False
        self._waiters = 0  # waits between their look at an event and their stream wait's return
        self._cond = threading.Condition()

    @property
    def count(self) -> int:
        """Layers of the job."""
        return self._count

    def record(self, layer: int, stream: int) -> None:
        """Layer ``layer``'s copies are enqueued on ``stream`` (and earlier layers' before them).

        Raises:
            CudaError: the event could not be taken or recorded (the layer stays unmarked).
        """
        event = driver.Event(self._pool)
        try:
            event.record(stream)
        except BaseException:
            event.release()
            raise
        with self._cond:
            self._events[layer] = event
            self._marked = layer + 1
            self._cond.notify_all()

    def record_rest(self, stream: int, upto: int) -> None:
        """Mark the layers before ``upto`` a failed issue left unmarked, after what it enqueued on
        ``stream``."""
        for layer in range(self._marked, upto):
            self.record(layer, stream)

    def settle(self) -> None:
        """The issue returned: layers still unmarked get no event (their waits return at once)."""
        with self._cond:
            self._marked = self._count
            self._cond.notify_all()

    def wait(self, layer: int, stream: object | None, timeout_s: float) -> bool:
        """Enqueue on ``stream`` (default: the device's current stream) a wait for layer
        ``layer``'s event; waits on the host only until the event is recorded. False when the
        issue ended without recording it (nothing to wait for: the layer will not land).

        Raises:
            DeviceMismatchError: a stream of another device, or not a stream.
            WaitTimeoutError: the layer was not issued within ``timeout_s``.
            CudaError: the driver refused the stream wait.
        """
        handle = self._stream_handle(stream)
        with self._cond:
            if not self._cond.wait_for(lambda: self._marked > layer or self._released, timeout_s):
                raise WaitTimeoutError(
                    f"layer {layer} was not handed to the device within {timeout_s} s (earlier jobs "
                    "were still being issued)"
                )
            if self._released:  # finished: its result was published, nothing to wait for
                return True
            event = self._events[layer]
            if event is None:  # never recorded: the issue ended without the layer
                return False
            self._waiters += 1  # its events stay out of the pool until this wait was enqueued
        try:
            if current_device_index() == self._index:
                event.wait_on(handle)
            else:
                with torch.cuda.device(self._index):
                    event.wait_on(handle)
        finally:
            self._leave()
        return True

    def _leave(self) -> None:
        """A wait's stream wait returned: the last one out after the release gives the events back."""
        with self._cond:
            self._waiters -= 1
            events = self._take_events() if self._released and not self._waiters else []
        _give_back(events)

    def release(self) -> None:
        """Give every event back (the job finished: nothing will wait on them), now or, while waits
        are inside their stream wait, when the last of them left. Idempotent."""
        with self._cond:
            self._released = True
            self._cond.notify_all()
            events = [] if self._waiters else self._take_events()
        _give_back(events)

    def _take_events(self) -> list[driver.Event | None]:
        """The events, taken out (the caller holds the lock)."""
        events, self._events = self._events, [None] * self._count
        return events


def _give_back(events: list[driver.Event | None]) -> None:
    for event in events:
        if event is not None:
            event.release()


class CudaStreams:
    """The streams of one direction's backend, and the event pools its jobs draw from.

    Owns: the copy stream and, when asked for, the kernel stream (both non-blocking, created with
    the driver), destroyed exactly once by :meth:`destroy`. Borrows: the process-wide event pools.
    """

    def __init__(self, index: int, device: torch.device, copy: int, kernel: int) -> None:
        self.index = index
        self.device = device
        self.copy = copy
        self.kernel = kernel  # 0: none
        self.timing_events = driver.event_pool(index, timing=True)
        self.events = driver.event_pool(index, timing=False)
        self.kernel_stream: torch.cuda.Stream | None = (
            torch.cuda.ExternalStream(kernel, device=device)  # type: ignore[no-untyped-call]
            if kernel else None
        )

    @classmethod
    def create(cls, device: torch.device, *, kernel: bool) -> CudaStreams:
        """A copy stream, and a kernel stream when ``kernel``; nothing leaks if creation fails.

        Raises:
            CudaError: the driver could not create a stream.
        """
        index = device_index(device)
        copy = driver.create_stream(index)
        try:
            second = driver.create_stream(index, KERNEL_STREAM_PRIORITY) if kernel else 0
        except BaseException:
            driver.destroy_stream(index, copy)
            raise
        return cls(index, device, copy, second)

    def timing_event(self) -> driver.Event:
        """An event from the timing pool (a job's start or end).

        Raises:
            CudaError: the driver could not create one.
        """
        return driver.Event(self.timing_events)

    def job_events(self) -> tuple[driver.Event, driver.Event]:
        """A job's start and end events (the start given back when the end cannot be had).

        Raises:
            CudaError: the driver could not create one.
        """
        start = driver.Event(self.timing_events)
        try:
            return start, driver.Event(self.timing_events)
        except BaseException:
            start.release()
            raise

    def wait(self, waiter: int, stream: int) -> None:
        """Make ``waiter`` wait for the work queued on ``stream`` so far (a pooled event, recorded,
        waited for and given back: a stream wait captures the record it was enqueued after).

        Raises:
            CudaError: the driver refused.
        """
        marker = driver.Event(self.events)
        try:
            marker.record(stream)
            marker.wait_on(waiter)
        finally:
            marker.release()

    def destroy(self) -> None:
        """Destroy both streams (work still queued on them completes first). A second call does
        nothing.

        Raises:
            CudaError: the driver refused (the other stream is destroyed anyway).
        """
        handles = [h for h in (self.copy, self.kernel) if h]
        self.copy = self.kernel = 0
        self.kernel_stream = None
        failure: BaseException | None = None
        for handle in handles:
            try:
                driver.destroy_stream(self.index, handle)
            except Exception as exc:  # the other stream must still go
                failure = failure or exc
        if failure is not None:
            raise failure


class TransferPath(Protocol):
    """One way of moving a job's pages, run on streams it borrows from its backend."""

    #: The name reported in results (``"dma"``, ``"dma-loop"``, ``"staged"``, ``"sm"``).
    name: str
    #: Where its jobs run: the copy stream, the kernel stream, or both.
    stream: StreamName

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """Host work of issuing ``pairs`` blocks, in descriptors (see ``Backend.issue_cost``)."""

    def issue(
        self, streams: CudaStreams, plan: CopyPlan, src: I64Array, dst: I64Array, fence: driver.Event
    ) -> PathTicket:
        """Enqueue the job behind ``fence``; never raises (a failure is the ticket's ``error``)."""

    def issue_layers(
        self, streams: CudaStreams, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array,
        fence: driver.Event, marks: CudaLayerMarks, first: int,
    ) -> PathTicket:
        """:meth:`issue`, layer after layer (``plans[i]`` is layer ``first + i``), recording each
        layer's mark after its last copy."""

    def end_stream(self, streams: CudaStreams) -> int:
        """The stream a job of this path ends on (for a path on one stream: that stream)."""

    def release(self) -> None:
        """Drop buffers and events; called once, by the backend's release, before its streams go."""


class DmaPath:
    """Batched DMA on the copy stream: one descriptor per page run. Owns nothing."""

    stream: StreamName = COPY

    def __init__(self, direction: Direction, copier: Copier) -> None:
        self.direction = direction
        self.copier = copier
        self.order = access_order(direction)
        self.name = copier.path

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """One descriptor per page (the driver's cost grows with it)."""
        return pairs * plan.pages.num_pages

    def issue(
        self, streams: CudaStreams, plan: CopyPlan, src: I64Array, dst: I64Array, fence: driver.Event
    ) -> PathTicket:
        """Wait for the fence on the copy stream, enqueue the copies, record the end event."""
        stream = streams.copy
        descriptors = plan.build(src, dst)
        try:
            start, end = streams.job_events()
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        try:
            fence.wait_on(stream)
            start.record(stream)
        except Exception as exc:  # nothing was enqueued: the job fails at once
            start.release()
            end.release()
            return FailedTicket(exc)
        error: BaseException | None = None
        try:
            self.copier.copy(descriptors.dsts, descriptors.srcs, descriptors.sizes, self.order, stream)
        except Exception as exc:  # copies may be partly enqueued: wait for the end event anyway
            error = exc
        return end_job(start, end, stream, error, self.name, streams.timing_event)

    def issue_layers(
        self, streams: CudaStreams, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array,
        fence: driver.Event, marks: CudaLayerMarks, first: int,
    ) -> PathTicket:
        """Wait for the fence, then per layer: its copies, its mark; then the end event."""
        stream = streams.copy
        try:
            start, end = streams.job_events()
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        try:
            fence.wait_on(stream)  # rule 2, for every layer: they all follow the fence
            start.record(stream)
        except Exception as exc:  # nothing was enqueued: the job fails at once
            start.release()
            end.release()
            return FailedTicket(exc)
        error: BaseException | None = None
        try:
            for layer, plan in enumerate(plans, first):
                d = plan.build(src, dst)
                self.copier.copy(d.dsts, d.srcs, d.sizes, self.order, stream)
                marks.record(layer, stream)
        except Exception as exc:  # part of the job may be enqueued: the end follows it
            error = exc
        return end_job(start, end, stream, error, self.name, streams.timing_event,
                       (marks, first + len(plans)))

    def end_stream(self, streams: CudaStreams) -> int:
        """The copy stream."""
        return streams.copy

    def release(self) -> None:
        """Nothing to drop."""


class CudaBackend:
    """One direction's copies on CUDA streams through its transfer paths (see the module docstring).

    Owns its :class:`CudaStreams` and its paths; ``release`` drops the paths' buffers and destroys
    the streams exactly once — at once, or, when a job is being issued at that moment, by that
    issue as it returns. The events of a job are owned by its ticket; a fence by whoever took it.
    """

    name = "cuda"

    def __init__(
        self,
        direction: Direction,
        streams: CudaStreams,
        paths: Mapping[str, TransferPath],
        choose: Callable[[int], str],
        path_name: str,
        layered: LayeredChooser | None = None,
    ) -> None:
        self.direction = direction
        self.device = streams.device
        self.streams = streams
        self.paths = dict(paths)
        self._choose = choose
        self._layered = layered
        self._path_name = path_name
        self._index = streams.index
        self._state = threading.Lock()
        self._released = False
        self._issuing = False
        self._destroy_pending = False
        self._last_end = 0  # the stream the previous job ended on (0: none yet)

    @classmethod
    def create(
        cls,
        direction: Direction,
        device: torch.device,
        make_paths: Callable[[CudaStreams], Mapping[str, TransferPath]],
        *,
        choose: Callable[[int], str] | None = None,
        kernel_stream: bool = False,
        path_name: str | None = None,
        layered: LayeredChooser | None = None,
    ) -> CudaBackend:
        """Create the streams, then the paths on them (``make_paths``), then the backend; whatever
        was made is released if a later step fails.

        ``choose`` maps a job's block count to a path name (default: the only path); ``path_name``
        is what results report when a ticket names no path (default: that path's name);
        ``layered`` chooses a layered load's path (default: ``choose``'s for its size).

        Raises:
            CudaError: a stream or a path's buffer could not be created.
        """
        streams = CudaStreams.create(device, kernel=kernel_stream)
        try:
            paths = make_paths(streams)
        except BaseException:
            streams.destroy()
            raise
        if choose is None:
            (only,) = paths
            choose = lambda _blocks: only  # noqa: E731 - a fixed path
        name = path_name if path_name is not None else next(iter(paths.values())).name
        return cls(direction, streams, paths, choose, name, layered)

    @property
    def path(self) -> str:
        """The path name results report (``"auto"`` for a calibrated choice)."""
        return self._path_name

    def fence(self, stream: object | None) -> object:
        """Record a pooled event on the compute stream (default: the device's current stream); the
        caller gives it back with :meth:`release_fence` once the last job waiting for it was issued.

        The event is recorded with this backend's device current (a caller whose current device is
        another one gets it switched for the call and restored): the handle of a legacy default
        stream (0) names the stream of the current device.
        """
        handle = self.stream_handle(stream)
        if current_device_index() == self._index:
            return self._record_fence(handle)
        with torch.cuda.device(self._index):
            return self._record_fence(handle)

    def stream_handle(self, stream: object | None) -> int:
        """The handle of ``stream``, a stream of this backend's device (None: its current stream).

        Raises:
            DeviceMismatchError: a stream of another device, or not a ``torch.cuda.Stream``.
        """
        if stream is None:
            return current_stream_handle(self._index)
        if isinstance(stream, torch.cuda.Stream):
            if stream.device != self.device:
                raise DeviceMismatchError(
                    f"stream is on {stream.device} but the layout's tensors are on {self.device}"
                )
            return int(stream.cuda_stream)
        raise DeviceMismatchError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")

    def _record_fence(self, stream: int) -> driver.Event:
        event = driver.Event(self.streams.events)
        try:
            event.record(stream)
        except BaseException:
            event.release()
            raise
        return event

    def release_fence(self, fence: object) -> None:
        """Give the fence's event back to its pool."""
        if isinstance(fence, driver.Event):
            fence.release()

    def start_thread(self) -> None:
        """Make the device's context current in the issuer thread."""
        torch.cuda.set_device(self.device)
        driver.make_context_current(self._index)

    def can_issue_here(self) -> bool:
        """True when the calling thread's current device is this backend's. Issuing there makes the
        device's primary context current on the thread if it was not (the context the CUDA runtime,
        and so torch, uses for that device)."""
        return current_device_index() == self._index

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """The cost of the path chosen for ``pairs`` blocks."""
        return self.paths[self._choose(pairs)].issue_cost(plan, pairs)

    def path_for(self, pairs: int) -> str:
        """The path a job of ``pairs`` blocks takes (the handler splits no job whose head or rest
        would go another way than the whole job)."""
        return self._choose(pairs)

    #: This Python issuer's staged rows go as descriptors, never strided copies.
    strided_min_rows: Final = 0

    def layered_path_for(self, host_blocks: I64Array) -> str:
        """The path a layered load from ``host_blocks`` takes: ``auto``'s
        :meth:`~kvoffload.calibration.LayeredChoice.path` where the worker has one (this Python
        issuer's staged rows go as descriptors, never strided copies), else as a whole job's."""
        if self._layered is not None:
            return self._layered(host_blocks, 0)
        return self._choose(int(host_blocks.shape[0]))

    def layer_marks(self, count: int) -> CudaLayerMarks:
        """Marks for a layered job of ``count`` layers (events come from the non-timing pool)."""
        return CudaLayerMarks(count, self.streams.events, self._index, self.stream_handle)

    def issue_layers(
        self, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array, fence: object,
        marks: LayerMarks, first: int = 0,
    ) -> PathTicket:
        """Issue layers ``first``.. of a layered job on the path chosen for its size (as
        :meth:`issue`)."""
        assert isinstance(marks, CudaLayerMarks)
        return self.issue(plans[0], src, dst, fence, (plans, marks, first))

    def issue(
        self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object,
        layered: tuple[tuple[CopyPlan, ...], CudaLayerMarks, int] | None = None,
    ) -> PathTicket:
        """Issue the job on the path chosen for its size, ordered after the previous job (layer
        after layer when ``layered`` gives the layers' plans and marks)."""
        with self._state:
            if self._released:
                return FailedTicket(TransferError("the backend was released before the job was issued"))
            self._issuing = True
        try:
            try:
                driver.ensure_context_current(self._index)
            except Exception as exc:  # nothing was enqueued: the job fails at once
                return FailedTicket(exc)
            assert isinstance(fence, driver.Event)
            return self._issue_on(plan, src, dst, fence, layered)
        finally:
            with self._state:
                self._issuing = False
                destroy = self._destroy_pending
            if destroy:
                self._destroy()

    def _issue_on(
        self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: driver.Event,
        layered: tuple[tuple[CopyPlan, ...], CudaLayerMarks, int] | None,
    ) -> PathTicket:
        path = self.paths[self.layered_path_for(src) if layered is not None else self._choose(int(src.shape[0]))]
        streams = self.streams

        def run() -> PathTicket:
            if layered is None:
                return path.issue(streams, plan, src, dst, fence)
            return path.issue_layers(streams, layered[0], src, dst, fence, layered[1], layered[2])

        if path.stream == BOTH:
            ticket = run()
            if isinstance(ticket, CudaTicket):  # something was enqueued: it ends on that stream
                self._last_end = path.end_stream(streams)
            return ticket
        own, other = (
            (streams.copy, streams.kernel) if path.stream == COPY else (streams.kernel, streams.copy)
        )
        if other and self._last_end == other:
            try:
                streams.wait(own, other)
            except Exception as exc:  # nothing was enqueued: the job fails at once
                return FailedTicket(exc)
        self._last_end = own
        return run()

    def release(self) -> None:
        """Stop issuing, drop the paths' buffers and destroy the streams (now, or when the issue in
        progress returns).

        Raises:
            CudaError: the driver refused to destroy a stream.
        """
        with self._state:
            if self._released:
                return
            self._released = True
            if self._issuing:
                self._destroy_pending = True
                return
        self._destroy()

    def _destroy(self) -> None:
        # The paths' torch buffers go first, while their streams still exist: torch's allocator
        # may act on a block's streams when the block is freed (a freed buffer that outlived its
        # stream crashed the process when the streams were destroyed first).
        for path in self.paths.values():
            path.release()
        self.streams.destroy()
