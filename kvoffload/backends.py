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
* ``issue(plan, src, dst, fence)`` (the handler's issuer thread): make the copy stream wait for
  the fence, enqueue the copies with the direction's source access order (STREAM for stores, ANY
  for loads), record an end event; return a :class:`Ticket`.
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
from collections.abc import Callable
from typing import Final, Protocol, TypeVar

import torch

from kvoffload import bindings
import numpy as np
import numpy.typing as npt

from kvoffload._descriptors import CopyPlan, StagedChunk, kernel_segments, plan_staged
from kvoffload.errors import DeviceMismatchError, TransferError
from kvoffload.records import Direction

I64Array = npt.NDArray[np.int64]

__all__ = [
    "AutoBackend",
    "Backend",
    "CudaBackend",
    "FailedTicket",
    "HostBackend",
    "KernelBackend",
    "SmBackend",
    "StagedBackend",
    "Ticket",
    "new_event",
    "new_stream",
]

#: Waiting first polls without sleeping for this long (small jobs finish in tens of microseconds and
#: a sleep would add its own granularity to their latency), then sleeps with a doubling backoff
#: capped so that a long wait costs little CPU.
#: What issuing one staged chunk costs the host (a kernel launch, a DMA call, three events), in
#: descriptors of batched DMA (about a microsecond each in the driver).
CHUNK_ISSUE_COST: Final = 40
WAIT_SPIN_S: Final = 100e-6
WAIT_POLL_MIN_S: Final = 50e-6
WAIT_POLL_MAX_S: Final = 100e-6
#: Row indices 0..n of a staging slot, for chunks of up to this many records.
_ROWS: Final = np.arange(1024, dtype=np.int64)


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


class Ticket(Protocol):
    """The handle of one issued job.

    ``error`` is set when issuing failed part-way: the ticket still completes once whatever was
    enqueued has finished, and the job is then reported failed with that error.
    """

    error: BaseException | None
    #: The path that moved the job when it differs from the backend's (``auto``), else None.
    path: str | None

    def done(self) -> bool:
        """Whether the job's copies finished; never blocks. Raises if completion failed."""

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for completion; True when done. Raises if completion failed."""

    def seconds(self) -> float:
        """How long the copies ran (valid once done)."""


class Backend(Protocol):
    """Where one direction's copies run (see the module docstring)."""

    name: str
    direction: Direction

    @property
    def path(self) -> str:
        """The transfer-path name reported in results."""

    def fence(self, stream: object | None) -> object:
        """Capture the compute-stream position the next job must wait for (caller's thread).

        Raises:
            DeviceMismatchError: ``stream`` is not a stream of the backend's device.
        """

    def start_thread(self) -> None:
        """Prepare the calling (issuer) thread for :meth:`issue`."""

    def can_issue_here(self) -> bool:
        """Whether :meth:`issue` may run on the calling thread (a submitter's) as it is."""

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """Host work of issuing a job of ``pairs`` blocks, in descriptors (copies or kernel rows)
        built and handed to the driver: what the handler weighs to issue it on the caller's thread."""

    def issue(self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> Ticket:
        """Enqueue the copies of the pairs ``(src[i], dst[i])`` behind ``fence`` (issuer thread);
        never raises: a failure is the ticket's ``error``."""

    def release(self) -> None:
        """Drop streams and events; called once, after the last ticket completed or was abandoned."""


# ------------------------------------------------------------------------------------------ cuda


class CudaTicket:
    """A job issued on CUDA streams: a start event before its first copy and an end event after
    its last (pooled events: they go back to the pool with the ticket)."""

    def __init__(
        self,
        start: bindings.Event,
        end: bindings.Event | None,
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
        self._timing_events = bindings.event_pool(self._device_index, timing=True)
        self._events = bindings.event_pool(self._device_index, timing=False)

    @classmethod
    def create(
        cls, direction: Direction, device: torch.device, copier: bindings.Copier
    ) -> CudaBackend:
        """A backend with a copy stream of its own on ``device``."""
        return cls(direction, device, copier, bindings.create_stream(_index(device)))

    @property
    def path(self) -> str:
        """``"dma"`` (batched) or ``"dma-loop"`` (per-copy fallback)."""
        return self.copier.path

    @property
    def access_order(self) -> bindings.SrcAccessOrder:
        """The source access order this direction's copies use."""
        return self._order

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The copy stream (None once released)."""
        return self._stream

    def fence(self, stream: object | None) -> object:
        """Record a pooled event on the compute stream (default: the device's current stream); the
        event goes back to the pool when the last job that waits for it was issued.

        The event is created and recorded with this backend's device current (a caller whose
        current device is another one gets it switched for the call and restored): the handle of a
        legacy default stream (0) names the stream of the current device.
        """
        if stream is None:
            handle = current_stream_handle(self._device_index)
        elif isinstance(stream, torch.cuda.Stream):
            if stream.device != self.device:
                raise DeviceMismatchError(
                    f"stream is on {stream.device} but the layout's tensors are on {self.device}"
                )
            handle = stream.cuda_stream
        else:
            raise DeviceMismatchError(
                f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}"
            )
        if current_device_index() == self._device_index:
            return self._record_fence(handle)
        with torch.cuda.device(self._device_index):
            return self._record_fence(handle)

    def _record_fence(self, stream: int) -> bindings.Event:
        event = bindings.Event(self._events)
        event.record(stream)
        return event

    def start_thread(self) -> None:
        """Make the device's context current in the issuer thread."""
        torch.cuda.set_device(self.device)
        bindings.make_context_current(self._device_index)

    def can_issue_here(self) -> bool:
        """True when the calling thread's current device is this backend's. Issuing there makes the
        device's primary context current on the thread if it was not (the context the CUDA runtime,
        and so torch, uses for that device)."""
        return current_device_index() == self._device_index

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """One descriptor per page (batched DMA; the driver's cost grows with it)."""
        return pairs * plan.pages.num_pages

    def issue(self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> Ticket:
        """Wait for the fence on the copy stream, enqueue the copies, record the end event."""
        with self._state:
            if self._stream is None:
                return FailedTicket(TransferError("the backend was released before the job was issued"))
            stream = self._handle
            self._issuing = True
        try:
            try:
                bindings.ensure_context_current(self._device_index)
            except Exception as exc:  # nothing was enqueued: the job fails at once
                return FailedTicket(exc)
            return self._issue_on(stream, plan, src, dst, fence)
        finally:
            with self._state:
                self._issuing = False
                destroy = self._destroy_pending
            if destroy:
                self._destroy()

    def _issue_on(
        self, stream: int, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object
    ) -> Ticket:
        """Enqueue one job on the copy stream ``stream`` (the batched-DMA path); subclasses add
        other paths."""
        assert isinstance(fence, bindings.Event)
        descriptors = plan.build(src, dst)
        try:
            start, end = bindings.Event(self._timing_events), bindings.Event(self._timing_events)
            fence.wait_on(stream)
            start.record(stream)
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        error: BaseException | None = None
        try:
            self.copier.copy(
                descriptors.dsts, descriptors.srcs, descriptors.sizes, self._order, stream
            )
        except Exception as exc:  # copies may be partly enqueued: wait for the end event anyway
            error = exc
        try:
            end.record(stream)
        except Exception as exc:
            return FailedTicket(exc if error is None else error)
        return CudaTicket(start, end, error)

    def _stream_waits_for(self, waiter: int, stream: int) -> None:
        """Make ``waiter`` wait for the work queued on ``stream`` so far (an event of the pool,
        recorded and waited for, then dropped)."""
        marker = bindings.Event(self._events)
        marker.record(stream)
        marker.wait_on(waiter)

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


class KernelBackend(CudaBackend):
    """Base of the paths that run the copy kernel: a second stream of its own for the kernel.

    Owns (besides the copy stream): the kernel stream, destroyed exactly once like the copy stream.
    """

    def __init__(
        self,
        direction: Direction,
        device: torch.device,
        copier: bindings.Copier,
        stream_handle: int,
        kernel: bindings.CopyKernel,
        kernel_stream_handle: int,
        ctas: int,
    ) -> None:
        super().__init__(direction, device, copier, stream_handle)
        self.kernel = kernel
        self.launcher = kernel.launcher()
        self.ctas = ctas
        self._kernel_handle = kernel_stream_handle
        self._kernel_stream: torch.cuda.Stream = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
            kernel_stream_handle, device=device
        )
        # Per plan: the table on the device, its pinned source, its address and its rows.
        self._tables: dict[CopyPlan, tuple[torch.Tensor, torch.Tensor, int, int]] = {}

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """A kernel row per block (the per-page work is the kernel's): O(blocks), whatever the
        page count."""
        return pairs

    def _device_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Device memory for this backend's streams, allocated on the kernel stream.

        Never on the caller's stream: a block torch hands out there is safe only for that stream's
        work — the caller's pending kernels may still write a block it freed — while this backend
        writes its buffers before the compute fence (the table upload, a load's DMA into the ring).
        """
        with torch.cuda.stream(self._kernel_stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def _segments(self, plan: CopyPlan) -> tuple[int, int]:
        """(device address, rows) of ``plan``'s :func:`kernel_segments` table, uploaded once per plan.

        The upload runs on the kernel stream, so every kernel launched there after it sees the
        table; the pinned source is kept with the table (the copy may still be running).
        """
        cached = self._tables.get(plan)
        if cached is None:
            table = kernel_segments(plan.pages)
            source = torch.from_numpy(table).pin_memory()
            on_device = self._device_buffer(table.shape, torch.int64)
            with torch.cuda.stream(self._kernel_stream):
                on_device.copy_(source, non_blocking=True)
            cached = self._tables[plan] = (on_device, source, on_device.data_ptr(), int(table.shape[0]))
        return cached[2], cached[3]

    def _issue_direct(
        self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object, ctas: int
    ) -> Ticket:
        """The SM path: one kernel on the kernel stream between the device cache and the mapped
        host records, with ``ctas`` CTAs."""
        assert isinstance(fence, bindings.Event)
        store = self.direction is Direction.STORE
        device_blocks, host_blocks = (src, dst) if store else (dst, src)
        kstream = self._kernel_handle
        try:
            start, end = bindings.Event(self._timing_events), bindings.Event(self._timing_events)
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        error: BaseException | None = None
        try:
            segments, count = self._segments(plan)
            fence.wait_on(kstream)
            start.record(kstream)
            self.launcher.launch(segments, count, device_blocks, host_blocks, plan.host_base,
                                 plan.pages.record_bytes, store, ctas, kstream)
        except Exception as exc:
            error = exc
        try:
            end.record(kstream)
        except Exception as exc:
            return FailedTicket(exc if error is None else error)
        return CudaTicket(start, end, error)

    def _destroy(self) -> None:
        self._tables.clear()  # torch frees the tables once the kernel stream's work finished
        super()._destroy()
        handle, self._kernel_handle = self._kernel_handle, 0
        if handle:
            bindings.destroy_stream(self._device_index, handle)


class SmBackend(KernelBackend):
    """SM path: the copy kernel reads and writes host records directly through their device mapping
    (no DMA engine), with a bounded number of CTAs. Fast for any page size, but the kernel competes
    with compute for SMs and memory bandwidth.
    """

    @classmethod
    def create_sm(
        cls, direction: Direction, device: torch.device, copier: bindings.Copier, ctas: int
    ) -> SmBackend:
        """An SM backend with two streams of its own; nothing leaks if construction fails."""
        return _with_two_streams(
            device, lambda copy, kernel, fn: cls(direction, device, copier, copy, fn, kernel, ctas)
        )

    @property
    def path(self) -> str:
        """``"sm"``."""
        return "sm"

    def _issue_on(
        self, stream: int, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object
    ) -> Ticket:
        return self._issue_direct(plan, src, dst, fence, self.ctas)

class StagedBackend(KernelBackend):
    """Staged path: the copy kernel moves pages between the device cache and a staging ring in
    device memory (at HBM speed, in short bursts), and the DMA engine moves whole records between the
    ring and the host pool (large copies: link speed at any page size). Chunks rotate over the ring's
    slots so that the kernel of one chunk overlaps the DMA of the previous one.

    Owns (besides its two streams): the staging ring (device memory from torch's allocator,
    allocated on the kernel stream and marked as used by the copy stream, so it is neither handed
    out while another stream's work may still use the block nor reused before their work finished) and
    one pair of events per slot. docs/design.md §5 rule 5 holds on the device: a slot is written only after
    the event recorded after its previous read, through stream waits, whatever the host does.
    """

    @property
    def path(self) -> str:
        """``"staged"``."""
        return "staged"

    def __init__(
        self,
        direction: Direction,
        device: torch.device,
        copier: bindings.Copier,
        stream_handle: int,
        kernel: bindings.CopyKernel,
        kernel_stream_handle: int,
        ctas: int,
        slots: int,
        slot_bytes: int,
    ) -> None:
        super().__init__(direction, device, copier, stream_handle, kernel, kernel_stream_handle, ctas)
        self.slots = slots
        self.slot_bytes = slot_bytes
        assert self._stream is not None
        self._staging: torch.Tensor | None = self._device_buffer((slots * slot_bytes,), torch.uint8)
        self._staging.record_stream(self._stream)
        base = self._staging.data_ptr()
        self.slot_bases = tuple(base + i * slot_bytes for i in range(slots))
        self._filled = [bindings.Event(self._events) for _ in range(slots)]
        self._drained = [bindings.Event(self._events) for _ in range(slots)]
        self._next_slot = 0

    @classmethod
    def create_staged(
        cls, direction: Direction, device: torch.device, copier: bindings.Copier, ctas: int,
        slots: int, slot_bytes: int,
    ) -> StagedBackend:
        """A staged backend with two streams of its own; nothing leaks if construction fails."""
        return _with_two_streams(
            device, lambda copy, kernel, fn: cls(direction, device, copier, copy, fn, kernel, ctas,
                                                 slots, slot_bytes)
        )

    def _issue_on(
        self, stream: int, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object
    ) -> Ticket:
        assert isinstance(fence, bindings.Event)
        rows = self.slot_bytes // plan.pages.record_bytes
        if rows == 0:
            return FailedTicket(TransferError(
                f"a host record of {plan.pages.record_bytes} bytes does not fit a staging slot of "
                f"{self.slot_bytes} bytes"
            ))
        chunks = plan_staged(plan, src, dst, self.slot_bases, rows, self._next_slot)
        self._next_slot = (self._next_slot + len(chunks)) % self.slots
        try:
            start, end = bindings.Event(self._timing_events), bindings.Event(self._timing_events)
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        store = self.direction is Direction.STORE
        kstream = self._kernel_handle
        error: BaseException | None = None
        last = kstream if not store else stream
        try:
            segments = self._segments(plan)
            if store:
                fence.wait_on(kstream)  # rule 1: the kernel reads pages compute may still write
                start.record(kstream)
            else:
                start.record(stream)
                fence.wait_on(kstream)  # rule 2: the kernel writes pages compute may still read
            for chunk in chunks:
                if store:
                    self._store_chunk(stream, chunk, plan, segments)
                else:
                    self._load_chunk(stream, chunk, plan, segments)
        except Exception as exc:  # part of the job may be enqueued: the end event still follows it
            error = exc
        try:
            if not store:
                self._stream_waits_for(kstream, stream)  # no DMA of a failed chunk after the end
            end.record(last)
        except Exception as exc:
            return FailedTicket(exc if error is None else error)
        return CudaTicket(start, end, error, path="staged")

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """A kernel row and a record copy per block, and :data:`CHUNK_ISSUE_COST` per chunk (its
        kernel launch, DMA call and events)."""
        rows = max(1, self.slot_bytes // plan.pages.record_bytes)
        return 2 * pairs + CHUNK_ISSUE_COST * -(-pairs // rows)

    def _gather(self, chunk: StagedChunk, plan: CopyPlan, segments: tuple[int, int]) -> None:
        """Launch the kernel moving ``chunk``'s pages between the device cache and its slot."""
        count = int(chunk.device_blocks.shape[0])
        rows = _ROWS[:count] if count <= _ROWS.shape[0] else np.arange(count, dtype=np.int64)
        self.launcher.launch(segments[0], segments[1], chunk.device_blocks, rows,
                             self.slot_bases[chunk.slot], plan.pages.record_bytes,
                             self.direction is Direction.STORE, self.ctas, self._kernel_handle)

    def _store_chunk(
        self, stream: int, chunk: StagedChunk, plan: CopyPlan, segments: tuple[int, int]
    ) -> None:
        kstream = self._kernel_handle
        self._drained[chunk.slot].wait_on(kstream)  # rule 5: the slot's last DMA finished
        self._gather(chunk, plan, segments)
        self._filled[chunk.slot].record(kstream)
        self._filled[chunk.slot].wait_on(stream)
        self.copier.copy(chunk.dma.dsts, chunk.dma.srcs, chunk.dma.sizes,
                         bindings.SrcAccessOrder.STREAM, stream)
        self._drained[chunk.slot].record(stream)

    def _load_chunk(
        self, stream: int, chunk: StagedChunk, plan: CopyPlan, segments: tuple[int, int]
    ) -> None:
        kstream = self._kernel_handle
        self._drained[chunk.slot].wait_on(stream)  # rule 5: the slot's last kernel finished
        self.copier.copy(chunk.dma.dsts, chunk.dma.srcs, chunk.dma.sizes,
                         bindings.SrcAccessOrder.ANY, stream)
        self._filled[chunk.slot].record(stream)
        self._filled[chunk.slot].wait_on(kstream)
        self._gather(chunk, plan, segments)
        self._drained[chunk.slot].record(kstream)

    def _destroy(self) -> None:
        self._staging = None  # torch frees it once both streams finished their work on it
        super()._destroy()


class AutoBackend(StagedBackend):
    """Auto path: each job takes the path the calibration found fastest for its direction and
    size — batched DMA, staged, or (for the smallest jobs, when the host pool is mapped) the SM
    kernel. ``TransferResult.path`` names the path each job took.

    Jobs finish in submission order whichever path moved them. DMA jobs run on the copy stream and
    SM jobs on the kernel stream; a staged job spans both and ends after everything queued on
    either before it. So a DMA or SM job whose stream differs from the one the previous job ended
    on first waits for that stream (an event), and consecutive jobs of one path wait for nothing
    more than their stream order.
    """

    def __init__(
        self,
        direction: Direction,
        device: torch.device,
        copier: bindings.Copier,
        stream_handle: int,
        kernel: bindings.CopyKernel,
        kernel_stream_handle: int,
        ctas: int,
        slots: int,
        slot_bytes: int,
        choose: Callable[[int], str],
        sm_ctas: int = 8,
    ) -> None:
        super().__init__(direction, device, copier, stream_handle, kernel, kernel_stream_handle,
                         ctas, slots, slot_bytes)
        self._choose = choose
        self.sm_ctas = sm_ctas
        self._last_end = 0  # the stream the previous job ended on (0: none yet)

    @classmethod
    def create_auto(
        cls, direction: Direction, device: torch.device, copier: bindings.Copier, ctas: int,
        slots: int, slot_bytes: int, choose: Callable[[int], str], sm_ctas: int = 8,
    ) -> AutoBackend:
        """An auto backend with two streams of its own; nothing leaks if construction fails."""
        return _with_two_streams(
            device, lambda copy, kernel, fn: cls(direction, device, copier, copy, fn, kernel, ctas,
                                                 slots, slot_bytes, choose, sm_ctas)
        )

    @property
    def path(self) -> str:
        """``"auto"`` (each result names the path its job took)."""
        return "auto"

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """The cost of the path the calibration picks for ``pairs`` blocks."""
        chosen = self._choose(pairs)
        if chosen == "dma":
            return CudaBackend.issue_cost(self, plan, pairs)
        if chosen == "sm":
            return KernelBackend.issue_cost(self, plan, pairs)
        return StagedBackend.issue_cost(self, plan, pairs)

    def _issue_on(
        self, stream: int, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object
    ) -> Ticket:
        chosen = self._choose(int(src.shape[0]))
        kstream = self._kernel_handle
        if chosen == "staged":
            ticket = StagedBackend._issue_on(self, stream, plan, src, dst, fence)
            if isinstance(ticket, CudaTicket):  # something was enqueued: it ends on that stream
                self._last_end = kstream if self.direction is Direction.LOAD else stream
            return ticket
        own, other = (stream, kstream) if chosen == "dma" else (kstream, stream)
        if self._last_end == other:
            try:
                self._stream_waits_for(own, other)
            except Exception as exc:  # nothing was enqueued: the job fails at once
                return FailedTicket(exc)
        self._last_end = own
        if chosen == "dma":
            ticket = CudaBackend._issue_on(self, stream, plan, src, dst, fence)
        else:
            ticket = self._issue_direct(plan, src, dst, fence, self.sm_ctas)
        ticket.path = chosen
        return ticket


_B = TypeVar("_B", bound="KernelBackend")


def _with_two_streams(
    device: torch.device, make: Callable[[int, int, bindings.CopyKernel], _B]
) -> _B:
    """Create a copy stream and a kernel stream, then the backend; destroy both if that fails."""
    index = _index(device)
    kernel = bindings.CopyKernel.for_device(index)
    copy_stream = bindings.create_stream(index)
    try:
        kernel_stream = bindings.create_stream(index)
        try:
            return make(copy_stream, kernel_stream, kernel)
        except BaseException:
            bindings.destroy_stream(index, kernel_stream)
            raise
    except BaseException:
        bindings.destroy_stream(index, copy_stream)
        raise


def new_stream(device: torch.device) -> torch.cuda.Stream:
    """A fresh stream from torch's pool (never the legacy default stream)."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def new_event(*, timing: bool) -> torch.cuda.Event:
    """A CUDA event; created by the driver at its first record."""
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


_raw_current_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """The handle of the calling thread's current torch stream on the device (torch's raw accessor
    where it has one: a tenth of the cost of building the stream object)."""
    if _raw_current_stream is not None:
        return int(_raw_current_stream(device_index))
    return int(torch.cuda.current_stream(device_index).cuda_stream)


_raw_current_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)


def current_device_index() -> int:
    """The calling thread's current CUDA device (torch's raw accessor where it has one: it skips
    the lazy-initialisation check, done by then, as the backends exist)."""
    if _raw_current_device is not None:
        return int(_raw_current_device())
    return torch.cuda.current_device()


def _index(device: torch.device) -> int:
    index: int | None = device.index
    return index if index is not None else torch.cuda.current_device()


class FailedTicket:
    """A job that failed before anything was enqueued."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error
        self.path: str | None = None

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
        self.path: str | None = None
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

    @property
    def path(self) -> str:
        """``"host"``."""
        return "host"

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

    def can_issue_here(self) -> bool:
        """Never: host copies run on the issuer thread, not on the caller's."""
        return False

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """One copy per page (done during the issue itself)."""
        return pairs * plan.pages.num_pages

    def issue(self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> Ticket:
        """Copy every page now; the ticket is complete when returned."""
        start = time.perf_counter()
        try:
            descriptors = plan.build(src, dst)
            for to, frm, size in zip(
                descriptors.dsts.tolist(), descriptors.srcs.tolist(), descriptors.sizes.tolist()
            ):
                if self._released.is_set():
                    raise TransferError("the backend was released while the job was copying")
                self.copy_one(to, frm, size)
        except Exception as exc:
            return HostTicket(time.perf_counter() - start, exc)
        return HostTicket(time.perf_counter() - start, None)

    def copy_one(self, dst: int, src: int, size: int) -> None:
        """Copy ``size`` bytes from address ``src`` to address ``dst``."""
        ctypes.memmove(dst, src, size)

    def release(self) -> None:
        """Stop any job still copying at its next descriptor."""
        self._released.set()
