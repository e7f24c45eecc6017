"""Worker: one GPU's offload engine, composed of a host region and two direction handlers.

Owns: the host region (alone: it is the only object that knows both directions share that memory,
so it is the only one that may release it), the store handler and the load handler, and the
in-flight block bookkeeping that spans both directions. Borrows: the layout (and through it the
engine's tensors, which must outlive the worker).

Rules it enforces across directions, before anything is submitted (typed errors; the worker is
unchanged afterwards):

* a job may not read a block that an in-flight job writes (a store reading a device block a load
  is filling; a load reading a host record a store is filling: a record is loadable only after its
  store completed, docs/design.md §5 rule 4);
* a job may not write a block that an in-flight job reads or writes;
* job ids are unique among jobs in flight or finished and not yet returned by ``poll``/``wait``.

A job stays "in flight" until its result has been returned to the caller.

Shutdown contract (docs/design.md §6): shut down the store handler, then the load handler, each in its own
try/except, collecting failures. If either failed (or an issuer thread is still running), fall back
to a device-wide synchronize bounded by the remaining time. Clean the region up once, but only when
the device is proven idle; otherwise abandon it mapped and pinned (unmapping memory a DMA engine may
still write is worse than a leak) and say so. Then raise one :class:`ShutdownError` carrying every
failure — after all cleanup is done. ``shutdown`` is idempotent; every other call after it raises
:class:`ClosedError`.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Final, Literal, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvoffload import bindings
from kvoffload._descriptors import CopyPlan
from kvoffload.backends import (
    AutoBackend,
    Backend,
    CudaBackend,
    HostBackend,
    SmBackend,
    StagedBackend,
)
from kvoffload._pipeline import DiskPipeline
from kvoffload import calibration
from kvoffload.calibration import calibrate
from kvoffload.disk import DiskConfig, DiskRecordInfo, DiskStats, DiskTier
from kvoffload.errors import (
    ArgumentTypeError,
    BlockConflictError,
    ClosedError,
    DeviceMismatchError,
    InvalidArgumentError,
    JobIdError,
    ShutdownError,
    UnknownJobError,
    WaitTimeoutError,
)
from kvoffload.handler import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    BlockIds,
    DirectionHandler,
    as_block_ids,
    as_job_id,
    as_job_ids,
    as_timeout,
    check_pairs,
)
from kvoffload.layout import DeviceLayout
from kvoffload.records import Direction, TransferResult, WorkerStats
from kvoffload.region import RegionOwner

__all__ = ["DEFAULT_SM_CTAS", "DEFAULT_STAGING_BYTES", "BackendName", "PathName", "Worker", "WorkerParts"]

_log = logging.getLogger("kvoffload.worker")

BackendName = Literal["auto", "cuda", "host"]
PathName = Literal["auto", "dma", "staged", "sm"]
I64Array = npt.NDArray[np.int64]
I32Array = npt.NDArray[np.int32]
_BACKENDS: Final = ("auto", "cuda", "host")
_PATHS: Final = ("auto", "dma", "staged", "sm")
#: Device memory for the staged path's rings, both directions together.
DEFAULT_STAGING_BYTES: Final = 256 << 20
DEFAULT_STAGING_SLOTS: Final = 2
#: CTAs of the SM path's kernel: enough to fill the host link (measured: 8 CTAs move about 51 GB/s on an H200), few enough to leave the
#: SMs to compute.
DEFAULT_SM_CTAS: Final = 8
#: Pinned bounce memory for device <-> disk jobs: each half holds several disk requests, so that the
#: tier's I/O threads read in parallel (64 MiB is 32 records of 2 MiB).
DEFAULT_BOUNCE_BYTES: Final = 64 << 20
MAX_BOUNCE_SLOTS: Final = 256
_PIPELINE_DIRECTIONS: Final = (Direction.STORE_TO_DISK, Direction.LOAD_FROM_DISK)
#: Time a failed ``create`` gives the handlers it already started to stop.
_CREATE_ROLLBACK_TIMEOUT_S: Final = 10.0


class Memory(enum.Enum):
    """Where a block id points: the device cache, the host pool, or the disk tier."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"

    __hash__ = object.__hash__  # identity, as Direction's


#: (memory read, memory written) by a job of each direction.
SIDES: Final = {
    Direction.STORE: (Memory.DEVICE, Memory.HOST),
    Direction.LOAD: (Memory.HOST, Memory.DEVICE),
    Direction.DEMOTE: (Memory.HOST, Memory.DISK),
    Direction.PROMOTE: (Memory.DISK, Memory.HOST),
    Direction.STORE_TO_DISK: (Memory.DEVICE, Memory.DISK),
    Direction.LOAD_FROM_DISK: (Memory.DISK, Memory.DEVICE),
}


@attrs.define(eq=False)
class _Job:
    direction: Direction
    reads: I64Array
    writes: I64Array


#: Jobs of at most this many blocks are booked with scalar indexing (a few numpy calls on tiny
#: arrays cost more than a loop over their ids).
_SCALAR_BOOKING_MAX: Final = 16


class _Bookkeeping:
    """In-flight readers and writers per block of each memory (the caller holds the lock)."""

    def __init__(self, sizes: dict[Memory, int]) -> None:
        self.reads = {m: np.zeros(n, dtype=np.int32) for m, n in sizes.items()}
        self.writes = {m: np.zeros(n, dtype=np.int32) for m, n in sizes.items()}
        self.jobs: dict[int, _Job] = {}

    def check(self, job_id: int, direction: Direction, reads: I64Array, writes: I64Array,
              read_name: str, write_name: str) -> None:
        """Refuse a reused job id and any conflict with in-flight jobs (see the module docstring)."""
        if job_id in self.jobs:
            raise JobIdError(f"job {job_id} is already in flight or waiting to be polled")
        source, target = SIDES[direction]
        i = _first_busy(reads, self.writes[source])
        if i >= 0:
            other = self._holder(int(reads[i]), source, writers_only=True)
            raise BlockConflictError(
                f"{direction.value} job {job_id}: {read_name}[{i}] = {int(reads[i])} is being written "
                f"by in-flight job {other}; submit after it completed"
            )
        i = _first_busy(writes, self.reads[target], self.writes[target])
        if i >= 0:
            other = self._holder(int(writes[i]), target, writers_only=False)
            raise BlockConflictError(
                f"{direction.value} job {job_id}: {write_name}[{i}] = {int(writes[i])} is in use by "
                f"in-flight job {other}; submit after it completed"
            )

    def _holder(self, block: int, memory: Memory, *, writers_only: bool) -> str:
        """Name an in-flight job touching ``block`` of ``memory`` (the error path only)."""
        for job_id, job in self.jobs.items():
            source, target = SIDES[job.direction]
            candidates = [(job.writes, target)] + ([] if writers_only else [(job.reads, source)])
            for blocks, side in candidates:
                if side is memory and bool(np.any(blocks == block)):
                    return f"{job_id} ({job.direction.value})"
        return "(unknown)"

    def add(self, job_id: int, direction: Direction, reads: I64Array, writes: I64Array) -> None:
        source, target = SIDES[direction]
        _count(self.reads[source], reads, 1)
        _count(self.writes[target], writes, 1)
        self.jobs[job_id] = _Job(direction, reads, writes)

    def remove(self, job_id: int) -> None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        source, target = SIDES[job.direction]
        _count(self.reads[source], job.reads, -1)
        _count(self.writes[target], job.writes, -1)


def _first_busy(ids: I64Array, *counts: I32Array) -> int:
    """Index of the first id with a nonzero count in any of ``counts``, or -1."""
    if ids.shape[0] <= _SCALAR_BOOKING_MAX:
        for i, block in enumerate(ids.tolist()):
            for c in counts:
                if c[block]:
                    return i
        return -1
    busy = counts[0][ids] != 0
    for c in counts[1:]:
        busy |= c[ids] != 0
    return int(np.argmax(busy)) if bool(busy.any()) else -1


def _count(counts: I32Array, ids: I64Array, delta: int) -> None:
    """Add ``delta`` to the count of each id. ``add`` and ``remove`` pass one job's same array, so
    they take the same branch: a block a job lists twice (a store reading one device block into two
    records) counts once in the vector branch and twice in the scalar one, and is released alike."""
    if ids.shape[0] <= _SCALAR_BOOKING_MAX:
        for block in ids.tolist():
            counts[block] += delta
    else:
        counts[ids] += delta


@attrs.frozen(eq=False)
class WorkerParts:
    """What :meth:`Worker.create` built, handed to the worker that owns it from then on."""

    layout: DeviceLayout
    region: RegionOwner
    store_handler: DirectionHandler
    load_handler: DirectionHandler
    backend_name: str
    device_sync: Callable[[float], bool]
    num_host_blocks: int
    capabilities: bindings.Capabilities | None = None
    tier: DiskTier | None = None
    bounce: tuple[DirectionHandler, DirectionHandler] | None = None
    pipeline: DiskPipeline | None = None


class Worker:
    """Moves KV blocks between the engine's device cache and a host pool (see the module docstring).

    Build it with ``Worker.create(layout, num_host_blocks, ...)`` (``Worker(parts)`` takes what
    ``create`` assembled).
    Usable as a context manager (leaving the block calls :meth:`shutdown`).
    """

    def __init__(self, parts: WorkerParts) -> None:
        """Take ownership of the parts :meth:`create` built (use :meth:`create`).

        Raises:
            ArgumentTypeError: ``parts`` is not a :class:`WorkerParts`.
        """
        if not isinstance(parts, WorkerParts):
            raise ArgumentTypeError(
                "a Worker is built with Worker.create(layout, num_host_blocks, ...), not "
                f"Worker({type(parts).__name__})"
            )
        layout, region = parts.layout, parts.region
        self.layout = layout
        self.backend = parts.backend_name
        self.capabilities = parts.capabilities
        self.num_host_blocks = parts.num_host_blocks
        self._region = region
        self._store = parts.store_handler
        self._load = parts.load_handler
        self._device_sync = parts.device_sync
        self._tier = tier = parts.tier
        self._bounce = parts.bounce
        self._pipeline = parts.pipeline
        self._lock = threading.Lock()
        self._sizes = {Memory.DEVICE: layout.num_blocks, Memory.HOST: self.num_host_blocks}
        if tier is not None:
            self._sizes[Memory.DISK] = tier.num_blocks
        self._book = _Bookkeeping(self._sizes)
        self._ready: dict[int, tuple[int, TransferResult]] = {}
        self._closed = False

    # ---------------------------------------------------------------------------------- creation

    @classmethod
    def create(
        cls,
        layout: DeviceLayout,
        num_host_blocks: int,
        *,
        device: torch.device | str | None = None,
        backend: BackendName = "auto",
        shared_name: str | None = None,
        copy_method: bindings.CopyMethod | str | None = None,
        pin_chunk_bytes: int = bindings.PIN_CHUNK_BYTES,
        path: PathName = "auto",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        kernel_ctas: int | None = None,
        calibration_path: str | None = None,
        disk: DiskConfig | None = None,
        bounce_slots: int | None = None,
        check_memory: bool = True,
    ) -> Worker:
        """Build the region and both handlers; on any failure everything built so far is released.

        Args:
            layout: the engine's device cache, from :meth:`DeviceLayout.from_tensors`.
            num_host_blocks: host records in the pool (each ``layout.record_bytes`` bytes).
            device: the device the layout must be on (checked; None accepts the layout's).
            backend: ``"cuda"`` (CUDA tensors, copies by DMA), ``"host"`` (CPU tensors, copies on a
                thread), or ``"auto"``: cuda when the layout's tensors are on a CUDA device, host when
                they are CPU tensors.
            shared_name: None for an anonymous pool, else the pool is ``/dev/shm/<shared_name>``
                (unlinked as soon as it is mapped).
            copy_method: cuda backend only: ``"batch-ctypes"`` (default where the driver has batch
                memcpy), ``"batch-bindings"`` or ``"per-copy"``.
            pin_chunk_bytes: largest single host registration (rounded down to whole records).
            path: cuda backend only: how pages move. ``"dma"``: one batched DMA descriptor per page
                run. ``"staged"``: a copy kernel gathers pages into a device staging ring and the DMA
                engine moves whole records (link speed at any page size, little compute cost).
                ``"sm"``: the copy kernel reads and writes host memory directly (costs SMs).
                ``"auto"``: per job, dma or staged, whichever a calibration measured once per
                process (for this device and page geometry) to be faster for the job's direction
                and size; dma when a record does not fit a staging slot.
            staging_bytes: device memory of the staged path's rings, both directions together.
            staging_slots: slots per ring (at least 2, so that kernel and DMA overlap).
            kernel_ctas: CTAs of the copy kernel (default: every SM for staged, 8 for sm).
            calibration_path: a JSON file where the auto path's calibration is kept across
                processes (read when it has this device's and geometry's entry, written otherwise).
            disk: a disk tier below the host pool (:class:`~kvoffload.disk.DiskConfig`); enables
                :meth:`demote`, :meth:`promote`, :meth:`store_to_disk` and :meth:`load_from_disk`.
            bounce_slots: pinned records (beyond ``num_host_blocks``) that carry device <-> disk
                jobs; at least 2 (two halves used in turn). Default: about 64 MiB of records (at
                least 4, at most 256).
            check_memory: refuse a pool larger than the memory the machine can give (MemAvailable
                and the cgroup limit) before mapping anything; pass False only where the kernel
                under-reports it (a VM whose memory grows as it is used).

        Raises:
            ArgumentTypeError: ``layout`` or ``num_host_blocks`` of the wrong type.
            InvalidArgumentError: a bad size, backend name, copy method or shared name.
            DeviceMismatchError: ``device`` is not the layout's device, or the backend does not fit
                the layout's device.
            RegionError: the pool does not fit the memory available (the message gives the numbers),
                or could not be mapped (nothing is left behind).
            CudaError: the pool could not be pinned (nothing is left behind).
        """
        if not isinstance(layout, DeviceLayout):
            raise ArgumentTypeError(
                f"layout must be a DeviceLayout (from DeviceLayout.from_tensors), got {type(layout).__name__}"
            )
        if isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int):
            raise ArgumentTypeError(
                f"num_host_blocks = {num_host_blocks!r} must be a positive int, not a "
                f"{type(num_host_blocks).__name__}"
            )
        if num_host_blocks <= 0:
            raise InvalidArgumentError(f"num_host_blocks = {num_host_blocks} must be a positive int")
        chosen = _choose_backend(layout, backend, device)
        method = _copy_method(copy_method, chosen)
        _check_path(path, chosen, staging_bytes, staging_slots, kernel_ctas)
        if disk is not None and not isinstance(disk, DiskConfig):
            raise ArgumentTypeError(f"disk must be a DiskConfig or None, got {type(disk).__name__}")
        if bounce_slots is None:
            bounce_slots = max(4, min(MAX_BOUNCE_SLOTS, DEFAULT_BOUNCE_BYTES // layout.record_bytes))
            bounce_slots -= bounce_slots % 2
        if isinstance(bounce_slots, bool) or not isinstance(bounce_slots, int) or bounce_slots < 2:
            raise InvalidArgumentError(f"bounce_slots = {bounce_slots!r} must be an int >= 2")
        if not isinstance(check_memory, bool):
            raise ArgumentTypeError(f"check_memory = {check_memory!r} must be a bool")
        slots = bounce_slots if disk is not None else 0
        with contextlib.ExitStack() as undo:
            caps: bindings.Capabilities | None = None
            pinner: bindings.HostPinner = bindings.NoPinner()
            copier: bindings.Copier | None = None
            device_sync: Callable[[float], bool] = _host_sync
            if chosen == "cuda":
                index = _device_index(layout.device)
                caps = bindings.capabilities(index)
                copier = bindings.Copier.create(caps, method)
                pinner = bindings.CudaHostPinner(index)
                device_sync = functools.partial(bindings.synchronize_device, index)
            region = RegionOwner.create(
                num_records=num_host_blocks + slots, record_bytes=layout.record_bytes, pinner=pinner,
                shared_name=shared_name, chunk_bytes=pin_chunk_bytes, check_memory=check_memory,
            )
            undo.callback(region.cleanup)
            sequence = itertools.count()
            handlers = []
            for direction, num_src, num_dst in (
                (Direction.STORE, layout.num_blocks, num_host_blocks),
                (Direction.LOAD, num_host_blocks, layout.num_blocks),
            ):
                plan = CopyPlan(layout.page_table, region.base_ptr, region.chunk_records, direction)
                direction_backend: Backend = (
                    _cuda_backend(direction, layout, region, copier, path, staging_bytes,
                                  staging_slots, kernel_ctas, calibration_path)
                    if copier is not None
                    else HostBackend(direction)
                )
                if isinstance(direction_backend, CudaBackend):
                    undo.callback(direction_backend.release)
                handler = DirectionHandler.create(
                    direction=direction, plan=plan, backend=direction_backend,
                    num_src_blocks=num_src, num_dst_blocks=num_dst, sequence=sequence,
                )
                undo.callback(handler.shutdown, _CREATE_ROLLBACK_TIMEOUT_S)
                handlers.append(handler)
            tier: DiskTier | None = None
            bounce: tuple[DirectionHandler, DirectionHandler] | None = None
            pipeline: DiskPipeline | None = None
            if disk is not None:
                tier = DiskTier.create(disk, fingerprint=layout.fingerprint,
                                       record_bytes=layout.record_bytes, records=region.records(),
                                       sequence=sequence)
                undo.callback(tier.shutdown, _CREATE_ROLLBACK_TIMEOUT_S)
                bounce = _bounce_handlers(layout, region, copier, undo)
                pipeline = DiskPipeline.create(
                    to_slots=bounce[0], from_slots=bounce[1], tier=tier,
                    slot_rows=np.arange(num_host_blocks, num_host_blocks + slots, dtype=np.int64),
                    block_bytes=layout.block_bytes, sequence=sequence,
                )
                undo.callback(pipeline.shutdown, _CREATE_ROLLBACK_TIMEOUT_S)
            worker = cls(WorkerParts(
                layout=layout, region=region, store_handler=handlers[0], load_handler=handlers[1],
                backend_name=chosen, device_sync=device_sync, capabilities=caps,
                num_host_blocks=num_host_blocks, tier=tier, bounce=bounce, pipeline=pipeline,
            ))
            undo.pop_all()
        return worker

    # ------------------------------------------------------------------------------------- jobs

    def store(
        self, job_id: int, device_blocks: BlockIds, host_blocks: BlockIds, *, stream: object = None
    ) -> None:
        """Copy ``device_blocks[i]`` into host record ``host_blocks[i]``, after queued compute.

        The copy waits for every kernel queued on ``stream`` (default: the device's current stream)
        before this call, and reads the source in stream order, so it never copies a block the
        compute stream has not finished writing. The device blocks must not be overwritten until the
        job's result came back. The result comes from :meth:`poll` or :meth:`wait`.

        Raises (before anything is submitted; the worker is unchanged):
            ClosedError: after shutdown.
            JobIdError: a non-int job id, or one in flight or not yet returned.
            BlockIdTypeError, InvalidBlockIdError: non-integer, negative or out-of-range ids,
                unequal lengths, a host block twice.
            BlockConflictError: a device block an in-flight load writes, or a host block an in-flight
                job reads or writes.
            DeviceMismatchError: a stream of another device (any stream on the host backend).
        """
        self._submit(Direction.STORE, job_id, device_blocks, host_blocks, stream,
                     "device_blocks", "host_blocks")

    def load(
        self, job_id: int, host_blocks: BlockIds, device_blocks: BlockIds, *, stream: object = None
    ) -> None:
        """Copy host record ``host_blocks[i]`` into ``device_blocks[i]``, after queued compute.

        The copy waits for every kernel queued on ``stream`` before this call, so it never
        overwrites a block that queued compute still reads. The device blocks hold undefined bytes
        until the job's result came back with ``ok=True``.

        Raises (before anything is submitted; the worker is unchanged): as :meth:`store`, with the
        conflict rules mirrored (a host record an in-flight store writes; a device block an in-flight
        job reads or writes; a device block twice).
        """
        self._submit(Direction.LOAD, job_id, host_blocks, device_blocks, stream,
                     "host_blocks", "device_blocks")

    def demote(self, job_id: int, host_blocks: BlockIds, disk_blocks: BlockIds) -> None:
        """Write host records ``host_blocks[i]`` to disk records ``disk_blocks[i]`` (checksummed).

        The host records must not be changed until the result came back; on ``ok`` the disk records
        are valid (and survive a restart with ``DiskConfig(reuse=True)``).

        Raises (before anything is submitted; the worker is unchanged): ``ClosedError``,
        ``InvalidArgumentError`` without a disk tier, and the id and conflict errors of :meth:`store`
        (a host record an in-flight job writes; a disk record an in-flight job reads or writes).
        """
        self._submit(Direction.DEMOTE, job_id, host_blocks, disk_blocks, None,
                     "host_blocks", "disk_blocks")

    def promote(self, job_id: int, disk_blocks: BlockIds, host_blocks: BlockIds) -> None:
        """Read disk records ``disk_blocks[i]`` into host records ``host_blocks[i]``, verifying each.

        A record that fails its check (checksum, generation, I/O error) fails the job; its host
        record is zero-filled, never given another block's bytes.

        Raises: as :meth:`demote`, mirrored.
        """
        self._submit(Direction.PROMOTE, job_id, disk_blocks, host_blocks, None,
                     "disk_blocks", "host_blocks")

    def store_to_disk(
        self, job_id: int, device_blocks: BlockIds, disk_blocks: BlockIds, *, stream: object = None
    ) -> None:
        """Copy device blocks to disk records through the bounce slots, after queued compute.

        Ordered like :meth:`store` (after the work queued on ``stream`` before this call). The
        result comes back once every disk write finished.

        Raises: as :meth:`store`, with disk blocks in place of host blocks.
        """
        self._submit(Direction.STORE_TO_DISK, job_id, device_blocks, disk_blocks, stream,
                     "device_blocks", "disk_blocks")

    def load_from_disk(
        self, job_id: int, disk_blocks: BlockIds, device_blocks: BlockIds, *, stream: object = None
    ) -> None:
        """Copy disk records to device blocks through the bounce slots, after queued compute.

        Ordered like :meth:`load`. The result comes back only when no copy of the job still uses a
        bounce slot. A record that fails its check is not copied: its device block keeps its previous
        contents and the job is ``ok=False``.

        Raises: as :meth:`load`, with disk blocks in place of host blocks.
        """
        self._submit(Direction.LOAD_FROM_DISK, job_id, disk_blocks, device_blocks, stream,
                     "disk_blocks", "device_blocks")

    def _submit(
        self, direction: Direction, job_id: int, src_blocks: BlockIds, dst_blocks: BlockIds,
        stream: object, src_name: str, dst_name: str,
    ) -> None:
        self._check_open()
        if direction not in (Direction.STORE, Direction.LOAD) and self._tier is None:
            raise InvalidArgumentError(
                f"{direction.value} needs a disk tier: create the worker with disk=DiskConfig(...)"
            )
        job = as_job_id(job_id)
        source, target = SIDES[direction]
        num_src, num_dst = self._sizes[source], self._sizes[target]
        src = as_block_ids(src_name, src_blocks, num_src)
        dst = as_block_ids(dst_name, dst_blocks, num_dst)
        check_pairs(src, dst, src_name, dst_name)
        fence: object = None
        if self._pipeline is not None and direction in _PIPELINE_DIRECTIONS:
            fence = self._pipeline.fence(direction, stream)  # may raise DeviceMismatchError
        with self._lock:
            self._book.check(job, direction, src, dst, src_name, dst_name)
            self._book.add(job, direction, src, dst)
        try:
            if direction is Direction.STORE:
                self._store.submit_validated(job, src, dst, stream=stream)
            elif direction is Direction.LOAD:
                self._load.submit_validated(job, src, dst, stream=stream)
            elif direction is Direction.DEMOTE:
                assert self._tier is not None
                self._tier.write(job, src, dst)
            elif direction is Direction.PROMOTE:
                assert self._tier is not None
                self._tier.read(job, src, dst)
            else:
                assert self._pipeline is not None
                device, disk = (src, dst) if direction is Direction.STORE_TO_DISK else (dst, src)
                self._pipeline.submit(job, direction, device, disk, fence)
        except BaseException:
            with self._lock:
                self._book.remove(job)
            raise

    def poll(self) -> list[TransferResult]:
        """Every job finished since the last call, oldest completion first; never blocks.

        Raises:
            ClosedError: after shutdown.
        """
        self._check_open()
        found = self._store.poll_sequenced() + self._load.poll_sequenced()
        if self._tier is not None:
            found += self._tier.poll_sequenced()
        if self._pipeline is not None:
            found += self._pipeline.poll_sequenced()
        with self._lock:
            found.extend(self._ready.values())
            self._ready.clear()
            for _, result in found:
                self._book.remove(result.job_id)
        found.sort(key=lambda item: item[0])
        return [result for _, result in found]

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[TransferResult]:
        """Wait until the given jobs finished (either direction); return their results in order.

        Other jobs' results stay for :meth:`poll`. Waiting for a job also waits for the earlier jobs
        of its direction.

        Raises:
            ClosedError: after shutdown.
            JobIdError, InvalidArgumentError: malformed ids or timeout (before waiting).
            UnknownJobError: an id neither in flight nor finished-and-unreturned.
            WaitTimeoutError: the deadline passed; ``pending`` names the unfinished jobs, which stay
                in flight, and every finished one stays available.
        """
        self._check_open()
        ids = as_job_ids(job_ids)
        seconds = as_timeout(timeout)
        deadline = time.monotonic() + seconds
        with self._lock:
            jobs, ready = self._book.jobs, self._ready
            unknown = [j for j in ids if j not in jobs]
            if unknown:
                raise UnknownJobError(f"job(s) {unknown} are neither in flight nor waiting to be polled")
            wanted: dict[Direction, list[int]] = {}
            for j in ids:
                if j not in ready:
                    wanted.setdefault(jobs[j].direction, []).append(j)
        found: dict[int, tuple[int, TransferResult]] = {}
        try:
            for direction, some in wanted.items():
                if direction is Direction.STORE:
                    got = self._store.wait_until(some, deadline, seconds)
                elif direction is Direction.LOAD:
                    got = self._load.wait_until(some, deadline, seconds)
                else:
                    source: _ResultSource | None = (
                        self._pipeline if direction in _PIPELINE_DIRECTIONS else self._tier
                    )
                    assert source is not None
                    got = source.wait_sequenced(some, max(0.0, deadline - time.monotonic()))
                for item in got:
                    found[item[1].job_id] = item
        except BaseException as exc:  # what finished stays available to poll() and wait()
            with self._lock:
                ready.update(found)
                pending = [j for j in ids if j not in ready]
            if isinstance(exc, WaitTimeoutError):
                raise WaitTimeoutError(
                    f"job(s) {pending} did not finish within {seconds} s", pending=pending
                ) from exc
            raise
        with self._lock:
            gone = [j for j in ids if j not in found and j not in ready]
            if gone:  # another thread's wait or poll returned them meanwhile: keep the rest
                ready.update(found)
                raise UnknownJobError(f"job(s) {gone} were returned by a concurrent call")
            results = [(found[j] if j in found else ready.pop(j))[1] for j in ids]
            for j in ids:
                self._book.remove(j)
        return results

    # --------------------------------------------------------------------------------- inspection

    def disk_valid_blocks(self) -> dict[int, DiskRecordInfo]:
        """The disk records that hold verified data (the warm-restart index), by disk block.

        Raises:
            ClosedError: after shutdown.
            InvalidArgumentError: the worker has no disk tier.
        """
        self._check_open()
        if self._tier is None:
            raise InvalidArgumentError("the worker has no disk tier")
        return self._tier.valid_blocks()

    def disk_stats(self) -> DiskStats | None:
        """The disk tier's counters (jobs, bytes, each failure kind), or None without a tier."""
        return self._tier.stats() if self._tier is not None else None

    def host_records(self) -> torch.Tensor:
        """The host pool as ``uint8 [num_host_blocks, record_bytes]`` (a view: for inspection and
        tests; exactly the records ``host_blocks`` ids address, never the disk tier's bounce slots). Do not keep it past :meth:`shutdown`: a view still referenced then defers the unmap
        and triggers a ``ResourceWarning``.

        Raises:
            ClosedError: after shutdown.
        """
        self._check_open()
        return self._region.records()[: self.num_host_blocks]  # never the disk tier's bounce slots

    def stats(self) -> WorkerStats:
        """A snapshot of the configuration and of both directions' counters."""
        return WorkerStats(
            backend=self.backend,
            path=self._store.path,
            num_device_blocks=self.layout.num_blocks,
            num_host_blocks=self.num_host_blocks,
            record_bytes=self.layout.record_bytes,
            store=self._store.stats(),
            load=self._load.stats(),
        )

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    # ---------------------------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Drain both directions and release everything, with the contract of the module docstring.

        Idempotent. Returns within about ``timeout`` seconds whatever the device does.

        Raises:
            InvalidArgumentError: a malformed timeout (nothing is done then).
            ShutdownError: after all cleanup, carrying every failure; ``region_left_mapped`` when the
                region was abandoned because the device could not be proven idle.
        """
        seconds = as_timeout(timeout)
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + seconds
        failures: list[BaseException] = []
        failed = False
        for name, part in self._parts():
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
        with self._lock:
            self._ready.clear()
            self._book = _Bookkeeping({})
        if failures or left_mapped:
            raise ShutdownError("worker shutdown failed", failures, region_left_mapped=left_mapped)

    def _parts(self) -> list[tuple[str, _Stoppable]]:
        """What shutdown stops, in order: the pipeline (a client of the bounce handlers), the store
        and load handlers, the bounce handlers, the disk tier (its threads may read into host
        records); the region comes after all of them."""
        parts: list[tuple[str, _Stoppable]] = []
        if self._pipeline is not None:
            parts.append(("disk pipeline", self._pipeline))
        parts += [("store handler", self._store), ("load handler", self._load)]
        if self._bounce is not None:
            parts += [("bounce store handler", self._bounce[0]),
                      ("bounce load handler", self._bounce[1])]
        if self._tier is not None:
            parts.append(("disk tier", self._tier))
        return parts

    def _threads_stopped(self) -> bool:
        stopped = self._store.thread_stopped and self._load.thread_stopped
        if self._pipeline is not None:
            stopped = stopped and self._pipeline.thread_stopped
        if self._bounce is not None:
            stopped = stopped and self._bounce[0].thread_stopped and self._bounce[1].thread_stopped
        if self._tier is not None:
            stopped = stopped and self._tier.threads_stopped
        return stopped

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

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the worker was shut down")

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.shutdown()
            return
        try:
            self.shutdown()
        except ShutdownError as shutdown_error:  # the body's exception is the one to see
            _log.error("shutdown after an exception also failed: %s", shutdown_error)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(
                "Worker was never shut down; call shutdown() or use it as a context manager",
                ResourceWarning,
                stacklevel=2,
            )


def _host_sync(timeout_s: float) -> bool:
    """The host backend has no device: once its threads stopped, nothing touches the region."""
    return True


def _device_index(device: torch.device) -> int:
    index: int | None = device.index
    return index if index is not None else torch.cuda.current_device()


def _choose_backend(
    layout: DeviceLayout, backend: str, device: torch.device | str | None
) -> Literal["cuda", "host"]:
    if backend not in _BACKENDS:
        raise InvalidArgumentError(f"backend = {backend!r} must be one of {', '.join(_BACKENDS)}")
    if device is not None:
        try:
            wanted = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise DeviceMismatchError(f"device = {device!r} is not a torch device: {exc}") from exc
        index: int | None = wanted.index
        if wanted.type == "cuda" and index is None and layout.device.type == "cuda":
            wanted = torch.device("cuda", _device_index(wanted))
        if wanted != layout.device:
            raise DeviceMismatchError(
                f"device = {wanted} but the layout's tensors are on {layout.device}"
            )
    kind = layout.device.type
    if backend == "auto":
        if kind == "cuda":
            return "cuda"
        if kind == "cpu":
            return "host"
        raise DeviceMismatchError(f"no backend for tensors on {layout.device}")
    if backend == "cuda" and kind != "cuda":
        raise DeviceMismatchError(f"backend 'cuda' needs CUDA tensors; the layout is on {layout.device}")
    if backend == "host" and kind != "cpu":
        raise DeviceMismatchError(f"backend 'host' needs CPU tensors; the layout is on {layout.device}")
    return "cuda" if backend == "cuda" else "host"


def _check_path(
    path: str, backend: str, staging_bytes: int, staging_slots: int, kernel_ctas: int | None
) -> None:
    if path not in _PATHS:
        raise InvalidArgumentError(f"path = {path!r} must be one of {', '.join(_PATHS)}")
    if backend != "cuda" and path != "auto":
        raise InvalidArgumentError(f"path = {path!r} applies to the cuda backend only (backend is {backend!r})")
    for name, value, least in (("staging_bytes", staging_bytes, 1), ("staging_slots", staging_slots, 2)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(f"{name} = {value!r} must be an int")
        if value < least:
            raise InvalidArgumentError(f"{name} = {value} must be at least {least}")
    if kernel_ctas is not None:
        if isinstance(kernel_ctas, bool) or not isinstance(kernel_ctas, int):
            raise ArgumentTypeError(f"kernel_ctas = {kernel_ctas!r} must be an int or None")
        if kernel_ctas <= 0:
            raise InvalidArgumentError(f"kernel_ctas = {kernel_ctas} must be positive")


def _cuda_backend(
    direction: Direction,
    layout: DeviceLayout,
    region: RegionOwner,
    copier: bindings.Copier,
    path: str,
    staging_bytes: int,
    staging_slots: int,
    kernel_ctas: int | None,
    calibration_path: str | None,
) -> CudaBackend:
    """The backend of one direction for the chosen transfer path (see :meth:`Worker.create`)."""
    device = layout.device
    index = _device_index(device)
    per_direction = staging_bytes // 2
    slot_bytes = per_direction // staging_slots // 4096 * 4096
    fits = slot_bytes >= layout.record_bytes
    if path == "staged" and not fits:
        raise InvalidArgumentError(
            f"path 'staged': a host record of {layout.record_bytes} bytes does not fit a staging slot "
            f"of {slot_bytes} bytes (staging_bytes = {staging_bytes} over 2 directions x "
            f"{staging_slots} slots); raise staging_bytes or use path 'dma'"
        )
    if path == "dma" or (path == "auto" and not fits):
        return CudaBackend.create(direction, device, copier)
    if path == "sm":
        if not bindings.host_pointer_is_device_pointer(index, region.base_ptr):
            raise InvalidArgumentError("path 'sm' needs host memory the device addresses as is (UVA)")
        return SmBackend.create_sm(direction, device, copier, kernel_ctas or DEFAULT_SM_CTAS)
    ctas = kernel_ctas or bindings.multiprocessor_count(index)
    if path == "staged":
        return StagedBackend.create_staged(direction, device, copier, ctas, staging_slots, slot_bytes)
    mapped = bindings.host_pointer_is_device_pointer(index, region.base_ptr)
    choice = calibrate(device, layout.page_table, copier=copier,
                       staging_bytes_per_direction=per_direction, staging_slots=staging_slots,
                       kernel_ctas=ctas, persist_path=calibration_path, allow_sm=mapped)
    return AutoBackend.create_auto(
        direction, device, copier, ctas, staging_slots, slot_bytes,
        choice.chooser(direction), sm_ctas=calibration.SM_CTAS,
    )


def _copy_method(method: bindings.CopyMethod | str | None, backend: str) -> bindings.CopyMethod | None:
    if method is None:
        return None
    if backend != "cuda":
        raise InvalidArgumentError(f"copy_method applies to the cuda backend only (backend is {backend!r})")
    if isinstance(method, bindings.CopyMethod):
        return method
    try:
        return bindings.CopyMethod(method)
    except ValueError:
        names = ", ".join(m.value for m in bindings.CopyMethod)
        raise InvalidArgumentError(f"copy_method = {method!r} must be one of {names}") from None


class _ResultSource(Protocol):
    def wait_sequenced(
        self, job_ids: Iterable[int], timeout: float
    ) -> list[tuple[int, TransferResult]]: ...


class _Stoppable(Protocol):
    def shutdown(self, timeout: float) -> None: ...


def _bounce_handlers(
    layout: DeviceLayout, region: RegionOwner, copier: bindings.Copier | None,
    undo: contextlib.ExitStack,
) -> tuple[DirectionHandler, DirectionHandler]:
    """The handlers that copy device blocks to and from bounce rows (batched DMA or host copies);
    their ids and results are internal to the disk pipeline."""
    made = []
    for direction, num_src, num_dst in (
        (Direction.STORE, layout.num_blocks, region.num_records),
        (Direction.LOAD, region.num_records, layout.num_blocks),
    ):
        plan = CopyPlan(layout.page_table, region.base_ptr, region.chunk_records, direction)
        backend: Backend = (CudaBackend.create(direction, layout.device, copier)
                            if copier is not None else HostBackend(direction))
        handler = DirectionHandler.create(direction=direction, plan=plan, backend=backend,
                                          num_src_blocks=num_src, num_dst_blocks=num_dst)
        undo.callback(handler.shutdown, _CREATE_ROLLBACK_TIMEOUT_S)
        made.append(handler)
    return made[0], made[1]
