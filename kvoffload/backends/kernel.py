"""The transfer paths that run the copy kernel: ``sm`` (the kernel reads and writes the mapped host
pool) and ``staged`` (the kernel gathers pages into a device staging ring, the DMA engine moves
whole records).

Both are :class:`~kvoffload.backends.cuda.TransferPath` objects a
:class:`~kvoffload.backends.cuda.CudaBackend` composes (``auto`` holds both beside batched DMA).
They share one :class:`SegmentTables` per backend: the per-layout segment table the kernel reads,
uploaded once to device memory on the kernel stream (one per layer for layered loads, each moved by
a launch of its own: docs/design.md §12).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from kvoffload._descriptors import (
    CopyPlan,
    StagedChunk,
    kernel_segments,
    plan_staged,
    plan_staged_part,
)
from kvoffload._jobs import FailedTicket
from kvoffload.backends.cuda import (
    BOTH,
    KERNEL,
    CudaLayerMarks,
    CudaStreams,
    PathTicket,
    StreamName,
    end_job,
)
from kvoffload.bindings import driver
from kvoffload.bindings.copier import Copier
from kvoffload.bindings.kernel import KERNEL_ROWS, CopyKernel, KernelLauncher
from kvoffload.errors import TransferError
from kvoffload.records import Direction

__all__ = ["CHUNK_ISSUE_COST", "SM_CTAS", "STAGED_CTAS", "SegmentTables", "SmPath", "StagedPath", "device_buffer"]

I64Array = npt.NDArray[np.int64]
#: What issuing one staged chunk costs the host (a kernel launch, a DMA call, three events), in
#: descriptors of batched DMA (about a microsecond each in the driver).
CHUNK_ISSUE_COST: Final = 40
#: CTAs of the ``sm`` path's kernel unless configured: enough to fill the host link, few enough to
#: leave the SMs to compute. One direction at a time 4 moved as fast as 8, on a host where ``sm``
#: loads run at 0.86-0.90x a pinned copy and on one where they run at 0.62x (both directions at
#: once 5% slower), while a GEMM beside ``sm`` stores lost 16-20% on two hosts against 47%
#: (docs/design.md §16, *`sm` at 4 CTAs*).
SM_CTAS: Final = 4
#: CTAs of the ``staged`` path's gather kernel unless configured; 0: one per SM.
STAGED_CTAS: Final = 0
#: Row indices 0..n of a staging slot, for chunks of up to one launch's records.
_ROWS: Final = np.arange(KERNEL_ROWS, dtype=np.int64)


def device_buffer(streams: CudaStreams, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Device memory for a backend's streams, allocated on its kernel stream.

    Never on the caller's stream: a block torch hands out there is safe only for that stream's work
    — the caller's pending kernels may still write a block it freed — while the kernel paths write
    their buffers before the compute fence (the table upload, a load's DMA into the ring).
    """
    assert streams.kernel_stream is not None
    with torch.cuda.stream(streams.kernel_stream):
        return torch.empty(shape, dtype=dtype, device=streams.device)


class SegmentTables:
    """The kernel's per-plan segment tables in device memory (see ``kernel_segments``).

    Owns: each table and its pinned source (the upload may still run), until :meth:`release`;
    torch frees them once the kernel stream's work on them finished.
    """

    def __init__(self, streams: CudaStreams) -> None:
        self._streams = streams
        self._tables: dict[CopyPlan, tuple[torch.Tensor, torch.Tensor, int, int]] = {}

    def get(self, plan: CopyPlan) -> tuple[int, int]:
        """(device address, rows) of ``plan``'s table, uploaded once on the kernel stream (every
        kernel launched there after it sees the table)."""
        cached = self._tables.get(plan)
        if cached is None:
            table = kernel_segments(plan.pages)
            source = torch.from_numpy(table).pin_memory()
            on_device = device_buffer(self._streams, table.shape, torch.int64)
            assert self._streams.kernel_stream is not None
            with torch.cuda.stream(self._streams.kernel_stream):
                on_device.copy_(source, non_blocking=True)
            cached = self._tables[plan] = (on_device, source, on_device.data_ptr(), int(table.shape[0]))
        return cached[2], cached[3]

    def release(self) -> None:
        """Drop every table (a second call does nothing)."""
        self._tables.clear()


class SmPath:
    """The SM path: one kernel on the kernel stream between the device cache and the mapped host
    records (no DMA engine), with a bounded number of CTAs. Fast for jobs of a few blocks, but the
    kernel competes with compute for SMs and memory bandwidth. Owns its launcher's parameter
    buffers; borrows the shared tables."""

    name = "sm"
    stream: StreamName = KERNEL

    def __init__(self, direction: Direction, kernel: CopyKernel, tables: SegmentTables, ctas: int) -> None:
        self.direction = direction
        self.launcher: KernelLauncher = kernel.launcher()
        self.tables = tables
        self.ctas = ctas

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """A kernel row per block (the per-page work is the kernel's)."""
        return pairs

    def issue(
        self, streams: CudaStreams, plan: CopyPlan, src: I64Array, dst: I64Array, fence: driver.Event
    ) -> PathTicket:
        """Wait for the fence on the kernel stream, launch, record the end event."""
        store = self.direction is Direction.STORE
        device_blocks, host_blocks = (src, dst) if store else (dst, src)
        kstream = streams.kernel
        try:
            start, end = streams.job_events()
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        error: BaseException | None = None
        try:
            segments, count = self.tables.get(plan)
            fence.wait_on(kstream)  # rules 1 and 2: after the compute queued before the submit
            start.record(kstream)
            self.launcher.launch(segments, count, device_blocks, host_blocks, plan.host_base,
                                 plan.host_stride, store, self.ctas, kstream)
        except Exception as exc:
            error = exc
        return end_job(start, end, kstream, error, self.name, streams.timing_event)

    def issue_layers(
        self, streams: CudaStreams, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array,
        fence: driver.Event, marks: CudaLayerMarks, first: int,
    ) -> PathTicket:
        """Wait for the fence on the kernel stream, then one launch and one mark per layer."""
        store = self.direction is Direction.STORE
        device_blocks, host_blocks = (src, dst) if store else (dst, src)
        kstream = streams.kernel
        try:
            start, end = streams.job_events()
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        error: BaseException | None = None
        try:
            tables = [self.tables.get(plan) for plan in plans]
            fence.wait_on(kstream)  # rule 2, for every layer: they all follow the fence
            start.record(kstream)
            for layer, (plan, (segments, count)) in enumerate(zip(plans, tables), first):
                self.launcher.launch(segments, count, device_blocks, host_blocks, plan.host_base,
                                     plan.host_stride, store, self.ctas, kstream)
                marks.record(layer, kstream)
        except Exception as exc:
            error = exc
        return end_job(start, end, kstream, error, self.name, streams.timing_event,
                       (marks, first + len(plans)))

    def end_stream(self, streams: CudaStreams) -> int:
        """The kernel stream."""
        return streams.kernel

    def release(self) -> None:
        """Drop the segment tables it shares (idempotent: the staged path may drop them too)."""
        self.tables.release()


class StagedPath:
    """The staged path: the copy kernel moves pages between the device cache and a staging ring in
    device memory (at HBM speed, in short bursts), and the DMA engine moves whole records between
    the ring and the host pool (large copies: link speed at any page size). Chunks rotate over the
    ring's slots so that the kernel of one chunk overlaps the DMA of the previous one.

    Owns: the staging ring (device memory from torch's allocator, allocated on the kernel stream and
    marked as used by the copy stream, so it is neither handed out while another stream's work may
    still use it nor reused before their work finished) and one pair of events per slot. A slot is
    written only after the event recorded after its previous read, through stream waits, whatever
    the host does (docs/design.md §5 rule 5).
    """

    name = "staged"
    stream: StreamName = BOTH

    def __init__(
        self, direction: Direction, streams: CudaStreams, kernel: CopyKernel, copier: Copier,
        tables: SegmentTables, ctas: int, slots: int, slot_bytes: int,
    ) -> None:
        self.direction = direction
        self.copier = copier
        self.launcher: KernelLauncher = kernel.launcher()
        self.tables = tables
        self.ctas = ctas
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._staging: torch.Tensor | None = device_buffer(streams, (slots * slot_bytes,), torch.uint8)
        copy_stream = torch.cuda.ExternalStream(streams.copy, device=streams.device)  # type: ignore[no-untyped-call]
        self._staging.record_stream(copy_stream)
        base = self._staging.data_ptr()
        self.slot_bases = tuple(base + i * slot_bytes for i in range(slots))
        self._filled = [driver.Event(streams.events) for _ in range(slots)]
        self._drained = [driver.Event(streams.events) for _ in range(slots)]
        self._next_slot = 0

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """A kernel row and a record copy per block, and :data:`CHUNK_ISSUE_COST` per chunk (its
        kernel launch, DMA call and events)."""
        rows = max(1, self.slot_bytes // plan.pages.record_bytes)
        return 2 * pairs + CHUNK_ISSUE_COST * -(-pairs // rows)

    def issue(
        self, streams: CudaStreams, plan: CopyPlan, src: I64Array, dst: I64Array, fence: driver.Event
    ) -> PathTicket:
        """Every chunk: gather into a slot and DMA it out (store), or DMA into a slot and scatter
        (load); the end event follows the last chunk on the stream it ends on."""
        rows = self.slot_bytes // plan.pages.record_bytes
        if rows == 0:
            return FailedTicket(TransferError(
                f"a host record of {plan.pages.record_bytes} bytes does not fit a staging slot of "
                f"{self.slot_bytes} bytes"
            ))
        chunks = plan_staged(plan, src, dst, self.slot_bases, rows, self._next_slot)
        self._next_slot = (self._next_slot + len(chunks)) % self.slots
        try:
            start, end = streams.job_events()
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        store = self.direction is Direction.STORE
        stream, kstream = streams.copy, streams.kernel
        error: BaseException | None = None
        try:
            segments = self.tables.get(plan)
            if store:
                fence.wait_on(kstream)  # rule 1: the kernel reads pages compute may still write
                start.record(kstream)
            else:
                start.record(stream)
                fence.wait_on(kstream)  # rule 2: the kernel writes pages compute may still read
            for chunk in chunks:
                if store:
                    self._store_chunk(streams, chunk, plan, segments)
                else:
                    self._load_chunk(streams, chunk, plan, segments)
        except Exception as exc:  # part of the job may be enqueued: the end event still follows it
            error = exc
        if not store or error is not None:
            error = self._join_at_end(streams, store, error)
        return end_job(start, end, self.end_stream(streams), error, self.name, streams.timing_event)

    def issue_layers(
        self, streams: CudaStreams, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array,
        fence: driver.Event, marks: CudaLayerMarks, first: int,
    ) -> PathTicket:
        """A load, layer after layer: each layer's byte ranges of the records DMA'd into slot rows
        that hold only them (:attr:`~kvoffload._descriptors.CopyPlan.compact`: many more blocks per
        chunk than whole records) and scattered from there, chunks rotating over the ring as for
        whole records; its mark recorded on the kernel stream after its last scatter."""
        if self.direction is not Direction.LOAD:
            return FailedTicket(TransferError("a layered staged job is a load"))
        try:
            start, end = streams.job_events()
        except Exception as exc:  # nothing was enqueued: the job fails at once
            return FailedTicket(exc)
        stream, kstream = streams.copy, streams.kernel
        error: BaseException | None = None
        try:
            start.record(stream)
            fence.wait_on(kstream)  # rule 2, for every layer: the scatters follow the fence
            for layer, plan in enumerate(plans, first):
                chunks = plan_staged_part(plan, src, dst, self.slot_bases, self.slot_bytes,
                                          self._next_slot)
                self._next_slot = (self._next_slot + len(chunks)) % self.slots
                compact = plan.compact
                segments = self.tables.get(compact)
                for chunk in chunks:
                    self._load_chunk(streams, chunk, compact, segments)
                marks.record(layer, kstream)
        except Exception as exc:  # part of the job may be enqueued: the end event still follows it
            error = exc
        error = self._join_at_end(streams, False, error)
        return end_job(start, end, kstream, error, self.name, streams.timing_event,
                       (marks, first + len(plans)))

    @staticmethod
    def _join_at_end(streams: CudaStreams, store: bool, error: BaseException | None) -> BaseException | None:
        """Make the stream the job ends on wait for the other one: a load's kernel stream for its
        DMA (no DMA of a failed chunk after the end), a failed store's copy stream for its kernel
        stream (no gather of a failed chunk, which reads the job's device blocks, after the end; a
        store that issued every chunk ends after its last gather through its last DMA). A refused
        wait fails the job, which still ends on its stream: after every scatter of a load, so no
        device block is written after it (a failed chunk's DMA may still fill its staging slot,
        which the next DMA into that slot follows on the same stream); for a store, a gather left
        running only fills a slot that its next gather follows on the same stream. Returns the
        job's error."""
        waiter, other = (streams.copy, streams.kernel) if store else (streams.kernel, streams.copy)
        try:
            streams.wait(waiter, other)
        except Exception as exc:
            return error or exc
        return error

    def end_stream(self, streams: CudaStreams) -> int:
        """A store ends on the copy stream (its last DMA), a load on the kernel stream (its last
        scatter); either way after everything queued on both streams before it."""
        return streams.copy if self.direction is Direction.STORE else streams.kernel

    def _gather(self, streams: CudaStreams, chunk: StagedChunk, plan: CopyPlan,
                segments: tuple[int, int]) -> None:
        """Launch the kernel moving ``chunk``'s pages between the device cache and its slot."""
        count = int(chunk.device_blocks.shape[0])
        rows = _ROWS[:count] if count <= _ROWS.shape[0] else np.arange(count, dtype=np.int64)
        self.launcher.launch(segments[0], segments[1], chunk.device_blocks, rows,
                             self.slot_bases[chunk.slot], plan.pages.record_bytes,
                             self.direction is Direction.STORE, self.ctas, streams.kernel)

    def _store_chunk(
        self, streams: CudaStreams, chunk: StagedChunk, plan: CopyPlan, segments: tuple[int, int]
    ) -> None:
        stream, kstream = streams.copy, streams.kernel
        self._drained[chunk.slot].wait_on(kstream)  # rule 5: the slot's last DMA finished
        self._gather(streams, chunk, plan, segments)
        self._filled[chunk.slot].record(kstream)
        self._filled[chunk.slot].wait_on(stream)
        self.copier.copy(chunk.dma.dsts, chunk.dma.srcs, chunk.dma.sizes,
                         driver.SrcAccessOrder.STREAM, stream)
        self._drained[chunk.slot].record(stream)

    def _load_chunk(
        self, streams: CudaStreams, chunk: StagedChunk, plan: CopyPlan, segments: tuple[int, int]
    ) -> None:
        stream, kstream = streams.copy, streams.kernel
        self._drained[chunk.slot].wait_on(stream)  # rule 5: the slot's last kernel finished
        self.copier.copy(chunk.dma.dsts, chunk.dma.srcs, chunk.dma.sizes,
                         driver.SrcAccessOrder.ANY, stream)
        self._filled[chunk.slot].record(stream)
        self._filled[chunk.slot].wait_on(kstream)
        self._gather(streams, chunk, plan, segments)
        self._drained[chunk.slot].record(kstream)

    def release(self) -> None:
        """Drop the ring (torch frees it once both streams finished their work on it) and the segment
        tables, and give the slot events back. A second call does nothing."""
        self._staging = None
        self.tables.release()
        events, self._filled, self._drained = self._filled + self._drained, [], []
        for event in events:
            event.release()
