"""Worker: one GPU's offload engine, composed of a host region, two direction handlers (and an
optional second load lane, the expedited loads'), an optional disk tier and an optional remote tier.

Owns: the host region (alone: it is the only object that knows both directions share that memory, so
it is the only one that may release it; of a shared pool, this rank's mapping and registration,
never another rank's: docs/design.md §13), the store and load handlers (the expedited lane's too),
the disk tier, its pipeline and bounce handlers, the remote tier, the job book they share, and the
in-flight block bookkeeping that spans directions. Borrows: the layout (and through it the engine's
tensors, which must outlive the worker).

Every job method validates its arguments, books the job's blocks, reserves its id in the book and
hands it to the component its direction routes to (a table, built once). ``store``, ``load`` and
``load_by_layer`` of a native issuer first try a fast front (:meth:`Worker._front`) that does the
same for numpy ids in one pass and declines, changing nothing, any job that is not plainly valid.
Rules it enforces before anything is submitted (typed errors; the worker is unchanged afterwards;
docs/design.md §4):

* a job may not read a block that an in-flight job writes (a store reading a device block a load
  is filling; a load reading a host record a store is filling: a record is loadable only after its
  store completed, docs/design.md §5 rule 4);
* a job may not write a block that an in-flight job reads or writes;
* job ids are unique among jobs in flight or finished and not yet returned by ``poll``/``wait``.

A job stays "in flight" until its result has been returned to the caller.

Shutdown contract (docs/design.md §6): shut down the pipeline, the store handler, the load handler,
the expedited load handler, the bounce handlers, the disk tier and the remote tier, each in its own
try/except, collecting failures. If any failed (or a thread of theirs still runs), fall back to a
device-wide synchronize bounded by the remaining time. Clean the region up once, but only when the
device is proven idle; otherwise abandon it mapped and pinned (unmapping memory a DMA engine may
still write is worse than a leak) and say so. Then raise one :class:`ShutdownError` carrying every
failure — after all cleanup is done. ``shutdown`` is idempotent; every other call after it raises
:class:`ClosedError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Final, NoReturn

import numpy as np
import numpy.typing as npt
import torch

from kvoffload._descriptors import PageTable
from kvoffload._jobs import JobSource, as_job_id, as_timeout
from kvoffload._layer_load import LayerLoad, LayerMarks
from kvoffload._validate import as_block_ids, check_pairs, check_range
from kvoffload.bindings.pinning import PIN_CHUNK_BYTES, HostPinner
from kvoffload.disk.config import DiskCapabilities, DiskConfig, DiskRecordInfo, DiskStats
from kvoffload.disk.format import check_keys as check_disk_keys
from kvoffload.errors import (
    ArgumentTypeError,
    ClosedError,
    DeviceMismatchError,
    InvalidArgumentError,
    InvalidBlockIdError,
    JobIdError,
    LayerError,
    ShutdownError,
    warn_on_del,
)
from kvoffload.handler import Backend, BookedHandler, DirectionHandler
from kvoffload.layout import DeviceLayout
from kvoffload.pool import PoolRank
from kvoffload.records import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    BlockIds,
    Direction,
    DriverCallStats,
    TransferResult,
    WorkerStats,
)
from kvoffload.remote._types import RemoteTierStats
from kvoffload.remote.config import RemoteConfig
from kvoffload.remote.tier import check_keys
from kvoffload.worker.assembly import (
    CREATE_ROLLBACK_TIMEOUT_S,
    DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_SLOTS,
    BackendName,
    IssuerName,
    PathName,
    WorkerOptions,
    WorkerParts,
    assemble,
)
from kvoffload.worker.booking import SIDES, Bookkeeping, Memory
from kvoffload.worker.teardown import Stoppable, Teardown

if TYPE_CHECKING:
    from kvoffload.bindings.driver import CopyMethod

__all__ = ["BackendName", "IssuerName", "PathName", "Worker", "WorkerParts"]

_log = logging.getLogger("kvoffload.worker")

I64Array = npt.NDArray[np.int64]
#: The directions that go through the disk pipeline (their fence is taken before booking).
_PIPELINE_DIRECTIONS: Final = (Direction.STORE_TO_DISK, Direction.LOAD_FROM_DISK)
_REMOTE_DIRECTIONS: Final = (Direction.PUT_REMOTE, Direction.GET_REMOTE)
_I64: Final = np.dtype(np.int64)
#: ``(job, src, dst, stream, fence, keys)``: hands a validated, booked, reserved job to its
#: component (``keys``: the disk records' keys of a disk job that names them, else None).
_Submit = Callable[[int, I64Array, I64Array, object, object, "list[bytes] | None"], None]
#: A fast front's lane (see ``Worker._front``): the handler, its reader of the caller's current
#: stream, its early wake (the fewest pairs of a job to wake the issuer thread for, and the call)
#: and the bookkeeping's native admission of its direction.
_FrontLane = tuple[
    BookedHandler, Callable[[], int], "tuple[int, Callable[[], object]] | None",
    Callable[[int, I64Array, I64Array], bool],
]


class Worker:
    """Moves KV blocks between the engine's device cache and a host pool (see the module docstring).

    Build it with ``Worker.create(layout, num_host_blocks, ...)`` (``Worker(parts)`` takes what
    ``create`` assembled). Usable as a context manager (leaving the block calls :meth:`shutdown`).
    ``shared`` is the shared pool's rank this worker maps (None for a pool of its own).
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
        # Built first: it owns the parts from here on, and a failure of the rest of this
        # constructor tears them down (nothing else would: create's own rollback has ended).
        self._teardown = Teardown(_stop_order(parts), parts.region, parts.device_sync)
        try:
            self._take(parts)
        except BaseException:
            try:
                self._teardown.run(CREATE_ROLLBACK_TIMEOUT_S)
            except ShutdownError as failed:  # the constructor's own error is the one raised
                _log.error("tearing down a worker whose construction failed: %s", failed)
            raise
        self._closed = False
        self._closing = threading.Lock()  # makes one shutdown the one that tears down
        self._torn_down = threading.Event()  # set once that shutdown's teardown ended
        self._teardown_error: ShutdownError | None = None  # what that teardown raised

    def _take(self, parts: WorkerParts) -> None:
        """The constructor's state, over the parts (the teardown is built already)."""
        self.layout = parts.layout
        self.backend = parts.backend_name
        #: Who issues the jobs' copies: ``"native"`` (the C issuer thread) or ``"python"``.
        self.issuer = parts.issuer
        self.capabilities = parts.capabilities
        self.num_host_blocks = parts.num_host_blocks
        self.shared: PoolRank | None = parts.region.pool
        self._region = parts.region
        self._store = parts.store_handler
        self._load = parts.load_handler
        self._expedited = parts.expedited_handler
        #: Whether the worker has the expedited load lane (``create(expedited_loads=True)``).
        self.expedited_loads = parts.expedited_handler is not None
        self._tier = parts.tier
        self._pipeline = parts.pipeline
        self._remote = parts.remote
        self._jobs = parts.book
        self._lock = threading.Lock()
        self._sizes = {Memory.DEVICE: parts.layout.num_blocks, Memory.HOST: parts.num_host_blocks}
        if parts.tier is not None:
            self._sizes[Memory.DISK] = parts.tier.num_blocks
        self._sizes[Memory.REMOTE] = 0  # remote jobs name keys: only their host blocks are booked
        self._book = Bookkeeping(self._sizes)
        self._holds: dict[int, threading.Event] = {}  # booking token -> settle event of its call
        self._routes = self._route_table()
        # The fast front's directions (see _front): a booking backend and the native admission.
        self._fronts = {
            direction: self._front_lane(direction, handler)
            for direction, handler in ((Direction.STORE, self._store), (Direction.LOAD, self._load))
            if isinstance(handler, BookedHandler) and self._book.checks_pairs
        }
        # The expedited load lane's fast front, as the load direction's.
        expedited = self._expedited
        self._expedited_front = (
            self._front_lane(Direction.LOAD, expedited)
            if isinstance(expedited, BookedHandler) and self._book.checks_pairs
            else None
        )

    def _route_table(self) -> dict[Direction, tuple[JobSource, _Submit]]:
        """Where each direction's jobs go: the component that completes them and its submit call."""
        store, load = self._store, self._load
        routes: dict[Direction, tuple[JobSource, _Submit]] = {
            Direction.STORE: (store, lambda j, s, d, stream, _f, _k: store.submit_validated(j, s, d, stream=stream)),
            Direction.LOAD: (load, lambda j, s, d, stream, _f, _k: load.submit_validated(j, s, d, stream=stream)),
        }
        tier, pipeline = self._tier, self._pipeline
        if tier is not None and pipeline is not None:
            routes[Direction.DEMOTE] = (tier, lambda j, s, d, _s, _f, k: tier.write_validated(j, s, d, keys=k))
            routes[Direction.PROMOTE] = (tier, lambda j, s, d, _s, _f, k: tier.read_validated(j, s, d, keys=k))
            routes[Direction.STORE_TO_DISK] = (
                pipeline,
                lambda j, s, d, _s, fence, k: pipeline.submit(j, Direction.STORE_TO_DISK, s, d, fence, keys=k))
            routes[Direction.LOAD_FROM_DISK] = (
                pipeline,
                lambda j, s, d, _s, fence, k: pipeline.submit(j, Direction.LOAD_FROM_DISK, d, s, fence, keys=k))
        if self._remote is not None:  # remote jobs are submitted by _submit_remote (they carry keys)
            for direction in _REMOTE_DIRECTIONS:
                routes[direction] = (self._remote, _no_submit)
        return routes

    # ---------------------------------------------------------------------------------- creation

    @classmethod
    def create(
        cls,
        layout: DeviceLayout,
        num_host_blocks: int,
        *,
        device: torch.device | str | None = None,
        backend: BackendName = "auto",
        shared: PoolRank | None = None,
        shared_name: str | None = None,
        copy_method: CopyMethod | str | None = None,
        pin_chunk_bytes: int = PIN_CHUNK_BYTES,
        path: PathName = "auto",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_slots: int = DEFAULT_STAGING_SLOTS,
        kernel_ctas: int | None = None,
        calibration_path: str | None = None,
        disk: DiskConfig | None = None,
        bounce_slots: int | None = None,
        remote: RemoteConfig | None = None,
        check_memory: bool = True,
        backend_factory: Callable[[Direction], Backend] | None = None,
        pinner: HostPinner | None = None,
        issuer: IssuerName = "auto",
        expedited_loads: bool = False,
        expedited_path: PathName | None = None,
    ) -> Worker:
        """Build the region and both handlers; on any failure everything built so far is released.

        Args:
            layout: the engine's device cache, from :meth:`DeviceLayout.from_tensors`.
            num_host_blocks: host records in the pool (each ``layout.record_bytes`` bytes).
            device: the device the layout must be on (checked; None accepts the layout's).
            backend: ``"cuda"`` (CUDA tensors, copies by DMA), ``"host"`` (CPU tensors, copies on a
                thread), or ``"auto"``: cuda when the layout's tensors are on a CUDA device, host when
                they are CPU tensors.
            shared: this process's rank of a pool every tensor-parallel rank maps
                (``SharedPool(name=..., world_size=N).rank(r)``, docs/design.md §13); None for a
                pool of this worker's own. ``create`` then returns once every rank mapped the pool
                (or raises on every rank: see Raises). Each rank copies into and out of its own
                slice of each host block; ``num_host_blocks`` (and the bounce slots) and the layout's
                record size must be the same on every rank.
            shared_name: the same as ``shared=SharedPool(shared_name, world_size=1).rank(0)``: a
                one-rank pool under ``/dev/shm/<shared_name>``, unlinked once mapped.
            copy_method: cuda backend only: ``"batch-ctypes"`` (default where the driver has batch
                memcpy), ``"batch-bindings"`` or ``"per-copy"``.
            pin_chunk_bytes: largest single host registration (rounded down to whole records and
                whole OS pages; one multiple of both, at least, where one record is larger).
            path: cuda backend only: how pages move. ``"dma"``: one batched DMA descriptor per page
                run. ``"staged"``: a copy kernel gathers pages into a device staging ring and the DMA
                engine moves whole records (link speed at any page size, little compute cost).
                ``"sm"``: the copy kernel reads and writes host memory directly (costs SMs).
                ``"auto"``: per job, the path a calibration measured once per process (for this
                device and page geometry) to be fastest for the job's direction and size (for bulk
                jobs, alone and with both directions at once); dma when a record does not fit a
                staging slot.
            staging_bytes: device memory of the staged path's rings, both directions together.
            staging_slots: slots per ring (at least 2, so that kernel and DMA overlap).
            kernel_ctas: CTAs of the copy kernel (default: every SM for staged, 4 for sm).
            calibration_path: a JSON file where the auto path's calibration is kept across
                processes (read when it has this device's and geometry's entry, written otherwise).
            disk: a disk tier below the host pool (:class:`~kvoffload.DiskConfig`); enables
                :meth:`demote`, :meth:`promote`, :meth:`store_to_disk` and :meth:`load_from_disk`.
            bounce_slots: pinned records (beyond ``num_host_blocks``) that carry device <-> disk
                jobs; at least 2 (two halves used in turn). Default: about 64 MiB of records (at
                least 4, at most 256).
            remote: a remote tier (:class:`~kvoffload.RemoteConfig`): a store shared with other
                engine instances; enables :meth:`put_remote` and :meth:`get_remote`.
            check_memory: refuse a pool larger than the memory the machine can give (MemAvailable
                and the cgroup limit) before mapping anything; pass False only where the kernel
                under-reports it (a VM whose memory grows as it is used).
            backend_factory: ``direction -> backend``: builds each direction's backend in place of
                the host or CUDA one (tests, and integrators bringing their own copy engine; see
                ``kvoffload.testing.FakeBackend`` for what a backend does). Called once per
                handler: with ``expedited_loads``, twice with ``Direction.LOAD``, and each call
                must return a backend of its own.
            pinner: registers the pool with the device in place of the CUDA pinner (tests).
            issuer: cuda backend only: who plans and enqueues a job's copies. ``"native"``: a C
                thread per direction, handed each job by one call (the caller pays a few
                microseconds, the link starts at once whatever the engine's Python does, and
                completion is signalled: docs/design.md §16); built with the machine's C compiler
                on first use. ``"python"``: the handler's issuer thread (and the caller's, for
                small jobs). ``"auto"``: native where it builds, else python with a warning
                (python without one under ``copy_method="batch-bindings"``, a cross-check the native
                issuer does not run).
            expedited_loads: a second load lane for ``load(..., expedited=True)`` and
                ``load_by_layer(..., expedited=True)``: loads the engine waits for within its step
                (a request that already runs) never queue behind the regular loads in the library
                (docs/design.md §4, *Two load lanes*). The lane has a backend of its own (on CUDA
                its streams and its issuer thread); the link is shared, so both lanes' loads move
                at once.
            expedited_path: cuda backend, with ``expedited_loads`` only: the lane's transfer path
                for every load (the names of ``path``). None (default): ``path``, except that
                loads of at most 8 MiB go through ``"sm"`` where the device addresses the pool as
                is. On the H100s measured the copy engine took one direction's copies in the order
                they came, whichever stream they came from, so a lane's ``dma`` or ``staged`` load
                can wait on the device for the regular lane's copies (measured 6.6-16.1x its time
                alone right after a 64 MiB load in most processes; in others not held); an ``sm``
                load (the copy kernel reads the pool: no copy engine) shares the link instead,
                0.92-1.89x (2.79x beside an ``sm`` regular load, once 5.16x; docs/design.md §4,
                *A lane no copy engine holds*). ``sm`` loads take SMs from compute while they run
                (4 CTAs). The lane's staging ring, where its path stages, is ``staging_bytes / 8``
                more device memory where its slots still hold a record. Refused with
                ``backend_factory`` (its backends move the lane's loads).

        Raises:
            ArgumentTypeError: ``layout`` or ``num_host_blocks`` of the wrong type.
            InvalidArgumentError: a bad size, backend name, path, copy method or shared name, both
                ``shared`` and ``shared_name``, or an ``expedited_path`` without ``expedited_loads``.
            DeviceMismatchError: ``device`` is not the layout's device, or the backend does not fit
                the layout's device.
            RegionError: the pool does not fit the memory available (the message gives the numbers),
                or could not be mapped (nothing is left behind).
            SharedPoolError: (a ``RegionError``) attaching the shared pool failed, on every rank
                alike: :class:`~kvoffload.errors.PoolTimeoutError` (ranks that did not arrive or map
                it within ``attach_timeout_s``), :class:`~kvoffload.errors.PoolRankFailedError` (a
                rank died or failed meanwhile), :class:`~kvoffload.errors.PoolMismatchError` (the
                ranks' record sizes or counts differ), :class:`~kvoffload.errors.PoolCollisionError`
                (the name is another live pool's). Nothing is left mapped, pinned or in /dev/shm.
            CudaError: the pool could not be pinned (nothing is left behind).
            DiskError: the disk tier could not be opened (a file that is not a tier, another
                fingerprint, a path that cannot be used; nothing is left behind).
            RemoteUnavailableError: the remote store's package is missing or its cluster could not
                be joined (nothing is left behind).
        """
        options = WorkerOptions(
            device=device, backend=backend, shared=shared, shared_name=shared_name,
            copy_method=copy_method,
            pin_chunk_bytes=pin_chunk_bytes, path=path, staging_bytes=staging_bytes,
            staging_slots=staging_slots, kernel_ctas=kernel_ctas, calibration_path=calibration_path,
            disk=disk, bounce_slots=bounce_slots, remote=remote, check_memory=check_memory,
            backend_factory=backend_factory, pinner=pinner, issuer=issuer,
            expedited_loads=expedited_loads, expedited_path=expedited_path,
        )
        return cls(assemble(layout, num_host_blocks, options))

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
        if not self._front(self._fronts.get(Direction.STORE), job_id, device_blocks, host_blocks, stream):
            self._submit(Direction.STORE, job_id, device_blocks, host_blocks, stream,
                         "device_blocks", "host_blocks")

    def load(
        self, job_id: int, host_blocks: BlockIds, device_blocks: BlockIds, *, stream: object = None,
        expedited: bool = False,
    ) -> None:
        """Copy host record ``host_blocks[i]`` into ``device_blocks[i]``, after queued compute.

        The copy waits for every kernel queued on ``stream`` before this call, so it never
        overwrites a block that queued compute still reads. The device blocks hold undefined bytes
        until the job's result came back with ``ok=True``. ``expedited``: through the second load
        lane (a worker created with ``expedited_loads=True``), so that it does not wait behind the
        regular loads; a wait for it waits for the earlier expedited loads only.

        Raises (before anything is submitted; the worker is unchanged): as :meth:`store`, with the
        conflict rules mirrored (a host record an in-flight store writes; a device block an in-flight
        job reads or writes, in either lane; a device block twice), and
            ArgumentTypeError: ``expedited`` is not a bool.
            InvalidArgumentError: ``expedited=True`` on a worker without the expedited lane.
        """
        if expedited is False:
            front, lane = self._fronts.get(Direction.LOAD), None
        else:
            front, lane = self._expedited_front, self._expedited_lane(expedited)
        if not self._front(front, job_id, host_blocks, device_blocks, stream):
            self._submit(Direction.LOAD, job_id, host_blocks, device_blocks, stream,
                         "host_blocks", "device_blocks", lane=lane)

    def load_by_layer(
        self, job_id: int, host_blocks: BlockIds, device_blocks: BlockIds, *, stream: object = None,
        expedited: bool = False,
    ) -> LayerLoad:
        """:meth:`load`, landing layer after layer (docs/design.md §12): returns a
        :class:`LayerLoad` whose ``wait_layer(i, stream)`` orders a stream after layer ``i``'s pages
        of this job, so that compute on layer ``i`` starts while later layers are still moving.

        The layers are the layout's (``layout.layers``, 0 first); a ``staged`` load of narrow
        layers from records apart is moved in groups of consecutive layers, and ``wait_layer(i)``
        then waits for layer ``i``'s group (docs/design.md §12). Like :meth:`load`, every layer's
        copies wait for the work queued on ``stream`` before this call (rule 2 holds per layer) and
        the job's result comes through :meth:`poll`/:meth:`wait` as a whole; until then the device
        blocks of a layer not yet waited for hold undefined bytes. The native issuer's thread issues
        the layers as soon as the job is handed over, but for layer 0 when the thread is idle and
        that layer costs few driver calls (``sm``, or ``staged`` with strided copies): then the
        caller issues it inside the hand-off; the Python issuer issues layer 0 on the caller's
        thread when no other load is queued for issue. ``expedited``: through the second load lane,
        as :meth:`load`.

        Raises (before anything is submitted; the worker is unchanged): as :meth:`load`, and
            LayerError: the layout has no layers (its tensor names do not say them: pass
                ``layers=`` to ``DeviceLayout.from_tensors``).
        """
        if expedited is False:
            handler, front = self._load, self._fronts.get(Direction.LOAD)
        else:
            handler, front = self._expedited_lane(expedited)[0], self._expedited_front
        try:
            tables = self.layout.require_layers()
        except LayerError:
            self._check_open()  # after shutdown, ClosedError whatever the layout (as every call then)
            raise
        marks = self._front_layered(front, job_id, host_blocks, device_blocks, stream, tables)
        if marks is not None:
            return LayerLoad(job_id, marks, self._check_open)
        made: list[LayerMarks] = []

        def submit(j: int, s: I64Array, d: I64Array, on: object, _f: object, _k: list[bytes] | None) -> None:
            made.append(handler.submit_layered(j, s, d, tables, stream=on))

        job = self._submit(Direction.LOAD, job_id, host_blocks, device_blocks, stream,
                           "host_blocks", "device_blocks", lane=(handler, submit))
        return LayerLoad(job, made[0], self._check_open)

    def demote(self, job_id: int, host_blocks: BlockIds, disk_blocks: BlockIds, *,
               keys: Sequence[bytes] | None = None) -> None:
        """Write host records ``host_blocks[i]`` to disk records ``disk_blocks[i]`` (checksummed).

        The host records must not be changed until the result came back; on ``ok`` the disk records
        are valid (and survive a restart with ``DiskConfig(reuse=True)``). ``keys[i]`` (optional,
        at most 1024 bytes, ``b""`` for none) is stored in record ``disk_blocks[i]``'s header: after
        a warm restart :meth:`disk_valid_blocks` names each record's key, so an engine can find
        its cache again (docs/design.md §9.4).

        Raises (before anything is submitted; the worker is unchanged): ``ClosedError``,
        ``InvalidArgumentError`` without a disk tier, and the id and conflict errors of :meth:`store`
        (a host record an in-flight job writes; a disk record an in-flight job reads or writes);
        ``KeyTypeError`` for keys that are not a sequence of bytes, ``InvalidArgumentError`` for
        keys of another count than the disk blocks or a key too long, ``DuplicateKeyError`` for a
        key twice (a warm restart would keep only one of its records).
        """
        self._submit(Direction.DEMOTE, job_id, host_blocks, disk_blocks, None,
                     "host_blocks", "disk_blocks", keys=keys)

    def promote(self, job_id: int, disk_blocks: BlockIds, host_blocks: BlockIds, *,
                keys: Sequence[bytes] | None = None) -> None:
        """Read disk records ``disk_blocks[i]`` into host records ``host_blocks[i]``, verifying each.

        A record that fails its check (checksum, generation, I/O error) fails the job; its host
        record is zero-filled, never given another block's bytes. With ``keys``, a record whose
        header names another key than ``keys[i]`` fails too (``DiskErrorKind.KEY_MISMATCH``; it
        stays listed: it is a valid record of that other key).

        Raises: as :meth:`demote`, mirrored.
        """
        self._submit(Direction.PROMOTE, job_id, disk_blocks, host_blocks, None,
                     "disk_blocks", "host_blocks", keys=keys)

    def store_to_disk(
        self, job_id: int, device_blocks: BlockIds, disk_blocks: BlockIds, *, stream: object = None,
        keys: Sequence[bytes] | None = None,
    ) -> None:
        """Copy device blocks to disk records through the bounce slots, after queued compute.

        Ordered like :meth:`store` (after the work queued on ``stream`` before this call). The
        result comes back once every disk write finished. ``keys`` as :meth:`demote`'s.

        Raises: as :meth:`store`, with disk blocks in place of host blocks, and the keys' errors of
        :meth:`demote`.
        """
        self._submit(Direction.STORE_TO_DISK, job_id, device_blocks, disk_blocks, stream,
                     "device_blocks", "disk_blocks", keys=keys)

    def load_from_disk(
        self, job_id: int, disk_blocks: BlockIds, device_blocks: BlockIds, *, stream: object = None,
        keys: Sequence[bytes] | None = None,
    ) -> None:
        """Copy disk records to device blocks through the bounce slots, after queued compute.

        Ordered like :meth:`load`. The result comes back only when no copy of the job still uses a
        bounce slot. A record that fails its check is not copied: its device block keeps its previous
        contents and the job is ``ok=False``. ``keys`` as :meth:`promote`'s: a record whose header
        names another key fails so.

        Raises: as :meth:`load`, with disk blocks in place of host blocks, and the keys' errors of
        :meth:`demote`.
        """
        self._submit(Direction.LOAD_FROM_DISK, job_id, disk_blocks, device_blocks, stream,
                     "disk_blocks", "device_blocks", keys=keys)

    def put_remote(self, job_id: int, host_blocks: BlockIds, keys: Sequence[bytes]) -> None:
        """Store host records ``host_blocks[i]`` in the remote store under ``keys[i]``.

        Runs on the remote tier's thread. Each record carries its CRC32, the layout fingerprint, its
        key and a generation (docs/design.md §9.1); a key the store already holds keeps its record
        (the first writer wins; the key counts as stored). The host records must not change until
        the result came back (jobs that would write them are refused meanwhile). ``ok=False`` with
        one typed :class:`~kvoffload.errors.RemoteError` naming every failed key when any key failed
        (store unavailable or full, or the job's deadline ``RemoteConfig.job_timeout_s`` passed).

        Raises (before anything is submitted; the worker is unchanged):
            ClosedError: after shutdown.
            InvalidArgumentError: no remote tier; ``keys`` and ``host_blocks`` of unequal lengths;
                a key of 0 or more than 1024 bytes.
            JobIdError, BlockIdTypeError, InvalidBlockIdError: as :meth:`store`.
            KeyTypeError, DuplicateKeyError: a key that is not bytes, or one key twice.
            BlockConflictError: a host record an in-flight job writes (a store, promote or get into
                it, or a returned get whose abandoned store call has not returned).
        """
        self._submit_remote(Direction.PUT_REMOTE, job_id, host_blocks, keys)

    def get_remote(self, job_id: int, keys: Sequence[bytes], host_blocks: BlockIds) -> None:
        """Read the records under ``keys[i]`` into host records ``host_blocks[i]``, verifying each.

        Runs on the remote tier's thread. A record is served only when its header, size, layout
        fingerprint, key and payload CRC32 verify. On ``ok`` the host records hold the records byte
        for byte. With ``ok=False`` (a miss, a record that failed its checks, the store unavailable,
        the deadline) ``error.keys`` names every failed key; the host record of a failed key holds
        zeros, that of a key that succeeded its verified record. If the deadline passed while the
        store client still wrote into them (``RemoteTimeoutError.settled`` False), the host blocks
        stay booked after the result was returned — no job may read or write them — until the
        client returned the call and zero-filled them (:meth:`remote_wait_idle`).

        Raises (before anything is submitted; the worker is unchanged): as :meth:`put_remote`, the
        host blocks being destinations: one host block twice, or one an in-flight job reads or
        writes.
        """
        self._submit_remote(Direction.GET_REMOTE, job_id, host_blocks, keys)

    def _submit_remote(self, direction: Direction, job_id: int, host_blocks: BlockIds, keys: object) -> None:
        self._check_open()
        remote = self._remote
        if remote is None:
            raise InvalidArgumentError(
                f"{direction.value} needs a remote tier: create the worker with remote=RemoteConfig(...)"
            )
        job = as_job_id(job_id)
        rows = as_block_ids("host_blocks", host_blocks, self.num_host_blocks)
        key_list = check_keys(keys, int(rows.shape[0]))
        reads, writes = (rows, rows[:0]) if direction is Direction.PUT_REMOTE else (rows[:0], rows)
        check_pairs(writes, writes, "host_blocks", "host_blocks")
        with self._lock:
            self._check_open()  # again: a shutdown may have begun since the first look
            self._drop_settled()
            self._book.check(job, direction, reads, writes, "host_blocks", "host_blocks")
            if job in self._book.jobs:
                self._refuse_booked(job, remote)
            self._jobs.reserve(job, remote)
            self._book.add(job, direction, reads, writes)
        try:
            remote.submit(job, direction, key_list, rows)
        except BaseException:
            with self._lock:
                self._book.remove(job)
                self._jobs.forget(job)
            raise

    def _front_lane(self, direction: Direction, handler: BookedHandler) -> _FrontLane:
        """The fast front's lane of a booked handler of ``direction`` (see :meth:`_front`)."""
        return (handler, handler.current_stream_reader(), handler.early_wake(),
                self._book.native_admission(direction))

    def _expedited_lane(self, expedited: object) -> tuple[DirectionHandler, _Submit]:
        """The expedited load lane's handler and submit call, for ``expedited`` not False.

        Raises:
            ClosedError: after shutdown (as every call then, whatever its arguments).
            ArgumentTypeError: ``expedited`` is not a bool.
            InvalidArgumentError: the worker has no expedited lane.
        """
        self._check_open()
        if type(expedited) is not bool:
            raise ArgumentTypeError(f"expedited = {expedited!r} must be a bool")
        handler = self._expedited
        if handler is None:
            raise InvalidArgumentError(
                "expedited=True needs the second load lane: create the worker with "
                "expedited_loads=True"
            )
        return handler, lambda j, s, d, stream, _f, _k: handler.submit_validated(j, s, d, stream=stream)

    def _front(self, lane: _FrontLane | None, job_id: object, src_blocks: object, dst_blocks: object,
               stream: object) -> bool:
        """The fast front door of ``store`` and ``load`` (docs/design.md §16): a job of a native
        issuer's direction with an ``int`` id and one-dimensional ``int64`` numpy ids, submitted in
        one pass (the ids copied, admitted and counted in one call into the library, the id
        reserved, the job handed over), with an issuer thread that is out of work woken first
        for a job its caller will not issue (one with work told that the caller is coming). True
        when the job was submitted. False, with nothing changed (but a thread perhaps woken or
        told), for any other job or any failed check:
        :meth:`_submit` then validates it from the start and submits it or raises its precise
        error, so the two doors differ only in speed.
        """
        taken = self._front_take(lane, job_id, src_blocks, dst_blocks, stream, wake=True)
        if taken is None:
            return False
        job, handler, src, dst, handle = taken
        try:
            handler.submit_handed_off(job, src, dst, handle)
        except BaseException:
            self._front_forget(job)
            raise
        return True

    def _front_layered(self, lane: _FrontLane | None, job_id: object, host_blocks: object,
                       device_blocks: object, stream: object,
                       tables: tuple[PageTable, ...]) -> LayerMarks | None:
        """:meth:`_front` for ``load_by_layer`` over the layout's ``tables``: the job's marks when
        it was submitted, None (nothing changed) when :meth:`_submit` is to validate it. No early
        wake: the caller issues layer 0 itself when the thread is idle (docs/design.md §16)."""
        taken = self._front_take(lane, job_id, host_blocks, device_blocks, stream, wake=False)
        if taken is None:
            return None
        job, handler, src, dst, handle = taken
        try:
            return handler.submit_handed_off_layered(job, src, dst, handle, tables)
        except BaseException:
            self._front_forget(job)
            raise

    def _front_take(
        self, lane: _FrontLane | None, job_id: object, src_blocks: object, dst_blocks: object,
        stream: object, *, wake: bool,
    ) -> tuple[int, BookedHandler, I64Array, I64Array, int] | None:
        """The fast front's checks and bookkeeping: for a job it takes, its id, its handler, its
        own copies of the ids (admitted and counted, the id reserved) and its stream's handle, for
        the handler to hand over (or :meth:`_front_forget` to undo); None, with nothing changed
        (but a thread perhaps woken or told, with ``wake``), for any other job."""
        if (lane is None or type(job_id) is not int or type(src_blocks) is not np.ndarray
                or type(dst_blocks) is not np.ndarray or src_blocks.dtype is not _I64
                or dst_blocks.dtype is not _I64 or src_blocks.ndim != 1 or dst_blocks.ndim != 1
                or self._closed):
            return None
        handler, current_stream, early, admit = lane
        if wake and early is not None and src_blocks.shape[0] >= early[0]:
            early[1]()  # a job its caller will not issue: the thread wakes while the checks run
        if stream is None:
            handle = current_stream()
        else:
            try:
                handle = handler.stream_handle(stream)
            except DeviceMismatchError:
                return None  # raised by _submit, after the checks of the ids, as ever
        src, dst = src_blocks.copy(), dst_blocks.copy()  # the job's own: the caller may reuse its
        with self._lock:
            book = self._book
            if (self._closed or self._holds or job_id in book.jobs  # a shutdown since the first look
                    or not admit(job_id, src, dst)):
                return None
            try:
                self._jobs.reserve(job_id, handler)
            except JobIdError:  # finished and not yet returned: _submit says so
                book.remove(job_id)
                return None
        return job_id, handler, src, dst, handle

    def _refuse_booked(self, job: int, source: JobSource) -> NoReturn:
        """Under the lock: refuse a job whose id the bookkeeping still holds. In the job book it is
        in flight or unreturned (the book's own error); else another thread's ``poll`` or ``wait``
        took its result and has not freed its blocks yet, and until it has the id is not free
        (a job admitted then would take the returning job's place in the bookkeeping: its blocks
        never freed, or the new job's freed by the old one's return).

        Raises:
            JobIdError: always.
        """
        self._jobs.reserve(job, source)  # raises JobIdError while the id is in the job book
        self._jobs.forget(job)
        raise JobIdError(
            f"job {job} is being returned by another thread's poll or wait (its blocks are not free "
            "yet); submit it again once that call returned"
        )

    def _front_forget(self, job_id: int) -> None:
        """Undo :meth:`_front_take`'s bookkeeping of a job its handler refused (it raised)."""
        with self._lock:
            self._book.remove(job_id)
            self._jobs.forget(job_id)

    def _submit(
        self, direction: Direction, job_id: int, src_blocks: BlockIds, dst_blocks: BlockIds,
        stream: object, src_name: str, dst_name: str, *,
        lane: tuple[JobSource, _Submit] | None = None, keys: Sequence[bytes] | None = None,
    ) -> int:
        """Validate, book, reserve and hand over one job (``lane``: the component and submit call
        in place of the direction's route, for the expedited lane and layered loads; ``keys``: a
        disk job's record keys, checked here); returns the job id."""
        self._check_open()
        route = self._routes.get(direction)
        if route is None:
            raise InvalidArgumentError(
                f"{direction.value} needs a disk tier: create the worker with disk=DiskConfig(...)"
            )
        source, submit = route if lane is None else lane
        job = as_job_id(job_id)
        from_memory, to_memory = SIDES[direction]
        # The native admission checks the ids' range (and pairs) itself, in the same call.
        ranged = not self._book.checks_pairs
        src_limit, dst_limit = self._sizes[from_memory], self._sizes[to_memory]
        src = as_block_ids(src_name, src_blocks, src_limit, ranged=ranged)
        dst = as_block_ids(dst_name, dst_blocks, dst_limit, ranged=ranged)
        if ranged:
            check_pairs(src, dst, src_name, dst_name)
        elif keys is not None and src.shape[0] != dst.shape[0]:  # before the keys are counted
            check_pairs(src, dst, src_name, dst_name)
        disk_ids = src if from_memory is Memory.DISK else dst
        key_list = check_disk_keys(keys, int(disk_ids.shape[0]), unique=to_memory is Memory.DISK)
        fence: object = None
        if self._pipeline is not None and direction in _PIPELINE_DIRECTIONS:
            fence = self._pipeline.fence(direction, stream)  # may raise DeviceMismatchError
        try:
            with self._lock:
                self._check_open()  # again: a shutdown may have begun since the first look
                self._drop_settled()
                try:
                    if job in self._book.jobs:  # an id in flight: refused as ever, nothing counted
                        check_range(src_name, src, src_limit)
                        check_range(dst_name, dst, dst_limit)
                        check_pairs(src, dst, src_name, dst_name)
                        self._book.check(job, direction, src, dst, src_name, dst_name)
                        self._refuse_booked(job, source)
                    self._book.admit(job, direction, src, dst, src_name, dst_name,  # pairs, conflicts
                                     pairs_checked=ranged)
                except InvalidBlockIdError:
                    if not ranged:  # an id past int64 is named by its own value, as ever
                        as_block_ids(src_name, src_blocks, src_limit)
                        as_block_ids(dst_name, dst_blocks, dst_limit)
                    raise
                try:
                    self._jobs.reserve(job, source)
                except BaseException:
                    self._book.remove(job)
                    raise
        except BaseException:
            if fence is not None:
                self._pipeline.release_fence(direction, fence)  # type: ignore[union-attr]
            raise
        try:
            submit(job, src, dst, stream, fence, key_list)
        except BaseException:
            with self._lock:
                self._book.remove(job)
                self._jobs.forget(job)
            if fence is not None:  # refused (a shutdown since the checks): the job never took it
                self._pipeline.release_fence(direction, fence)  # type: ignore[union-attr]
            raise
        return job

    def poll(self) -> list[TransferResult]:
        """Every job finished since the last call, oldest completion first; never blocks.

        Raises:
            ClosedError: after shutdown.
        """
        self._check_open()
        results = self._jobs.poll()
        self._release(results)
        return results

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[TransferResult]:
        """Wait until the given jobs finished (any direction); return their results in order.

        Other jobs' results stay for :meth:`poll`. Waiting for a job also waits for the earlier jobs
        of its direction (of its lane, for loads: an expedited load's wait waits for the earlier
        expedited loads only).

        Raises:
            ClosedError: after shutdown.
            JobIdError, InvalidArgumentError: malformed ids or timeout (before waiting).
            UnknownJobError: an id neither in flight nor finished-and-unreturned, or one another
                thread's ``poll``/``wait`` returned meanwhile (the other jobs stay available).
            WaitTimeoutError: the deadline passed; ``pending`` names the unfinished jobs, which stay
                in flight, and every finished one stays available.
            ClosedError: also when another thread's :meth:`shutdown` ended while waiting (within
                about 0.25 s of it, whatever the wait's own deadline).
        """
        self._check_open()
        results = self._jobs.wait(job_ids, timeout)
        self._release(results)
        return results

    def _release(self, results: list[TransferResult]) -> None:
        """The returned jobs leave the bookkeeping: their blocks are free for later jobs, except
        those of a remote job whose abandoned store call may still use them (held until it returns)."""
        if results:
            with self._lock:
                for result in results:
                    settle = None
                    if self._remote is not None and result.direction in _REMOTE_DIRECTIONS:
                        settle = self._remote.take_unsettled(result.job_id)
                    if settle is None:
                        self._book.remove(result.job_id)
                    elif result.job_id in self._book.jobs:  # not when a shutdown cleared the book
                        self._holds[self._book.hold(result.job_id)] = settle

    def _drop_settled(self) -> None:
        """Under the lock: free the blocks of held jobs whose store calls returned."""
        for token in [t for t, event in self._holds.items() if event.is_set()]:
            self._book.release(token)
            del self._holds[token]

    # --------------------------------------------------------------------------------- inspection

    def disk_valid_blocks(self) -> dict[int, DiskRecordInfo]:
        """The disk records that may be read (the index), by disk block: after a warm restart the
        records whose header verified (payloads are verified on every read; a block that fails a
        read leaves the index), then every record whose write completed (docs/design.md §9.4).

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

    def disk_capabilities(self) -> DiskCapabilities | None:
        """How the disk tier was opened (direct or buffered I/O and why, geometry, warm restart),
        or None without a tier."""
        return self._tier.capabilities() if self._tier is not None else None

    def remote_stats(self) -> RemoteTierStats | None:
        """The remote tier's counters (jobs, records, failed keys by kind, held jobs, the store's
        own), or None without a remote tier."""
        return self._remote.stats() if self._remote is not None else None

    def remote_wait_idle(self, timeout: float) -> bool:
        """Wait until no remote job is queued or running and every abandoned store call returned
        (their host blocks are then free); True if so within ``timeout`` seconds.

        Raises:
            ClosedError: after shutdown. InvalidArgumentError: no remote tier, or a bad timeout.
        """
        self._check_open()
        if self._remote is None:
            raise InvalidArgumentError("the worker has no remote tier")
        idle = self._remote.wait_idle(timeout)
        with self._lock:
            self._drop_settled()
        return idle

    def host_records(self) -> torch.Tensor:
        """The host pool as ``uint8 [num_host_blocks, record_bytes]`` (a view: for inspection and
        tests; exactly the records ``host_blocks`` ids address, never the disk tier's bounce slots).
        Of a shared pool, this rank's slices only (rows a block apart; ``SharedPool.inspect`` shows
        every rank's). Do not keep it past :meth:`shutdown`: a view still referenced then defers the
        unmap and triggers a ``ResourceWarning``.

        Raises:
            ClosedError: after shutdown.
        """
        self._check_open()
        return self._region.records()[: self.num_host_blocks]  # never the disk tier's bounce slots

    def driver_call_stats(self) -> dict[Direction, DriverCallStats]:
        """Where the calling threads waited inside the CUDA driver behind the native issuer, per
        direction it issues (:class:`~kvoffload.records.DriverCallStats`: the issuer's longest
        driver calls, the callers' calls over 100 us by what the issuer was doing in the driver
        then; docs/design.md §16), of the regular lanes (the expedited load lane has a thread of
        its own). Empty for a worker without the native issuer. A diagnostic: it tells whether the
        engine's thread stalled behind the library's own driver calls.

        Raises:
            ClosedError: after shutdown.
            TransferError: a shutdown running meanwhile released a backend.
        """
        self._check_open()
        out: dict[Direction, DriverCallStats] = {}
        for direction, handler in ((Direction.STORE, self._store), (Direction.LOAD, self._load)):
            stats = handler.driver_call_stats()
            if stats is not None:
                out[direction] = stats
        return out

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
            expedited=self._expedited.stats() if self._expedited is not None else None,
        )

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    def shutdown(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Drain both directions and release everything, with the contract of the module docstring.

        Idempotent. Returns within about ``timeout`` seconds whatever the device does. A call while
        another thread's shutdown is still tearing down waits for it (up to ``timeout``) and ends as
        it ended: it returns once the worker's copies stopped and its memory was released, or
        raises the failures that teardown met. A call after a shutdown ended returns.

        Raises:
            InvalidArgumentError: a malformed timeout (nothing is done then).
            ShutdownError: after all cleanup, carrying every failure; ``region_left_mapped`` when the
                region was abandoned because the device could not be proven idle. Also when another
                thread's shutdown was still tearing down after ``timeout`` (``region_left_mapped``:
                the copies are not known to have stopped).
        """
        seconds = as_timeout(timeout)
        with self._closing:
            first, self._closed = not self._closed, True
            waited = not first and not self._torn_down.is_set()
        if not first:
            if not self._torn_down.wait(seconds):
                raise ShutdownError(
                    f"another thread's shutdown of this worker was still tearing it down after {seconds} s",
                    region_left_mapped=True,
                )
            failed = self._teardown_error
            if waited and failed is not None:  # that teardown's outcome is this call's too
                raise ShutdownError("another thread's shutdown of this worker failed", failed.failures,
                                    region_left_mapped=failed.region_left_mapped)
            return
        try:
            self._teardown.run(seconds)
        except ShutdownError as exc:
            self._teardown_error = exc
            raise
        finally:
            self._jobs.clear()
            with self._lock:
                self._book = Bookkeeping({})
                self._holds = {}
            self._torn_down.set()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the worker was shut down: build another with Worker.create")

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

    __del__ = warn_on_del(
        "_closed",
        "Worker was never shut down; call shutdown() or use it as a context manager"
    )


def _no_submit(
    job: int, src: I64Array, dst: I64Array, stream: object, fence: object, keys: list[bytes] | None,
) -> None:
    """The route of a direction submitted by its own method (remote jobs carry keys, not ids)."""
    raise AssertionError("remote jobs are submitted by Worker._submit_remote")


def _stop_order(parts: WorkerParts) -> list[tuple[str, Stoppable]]:
    """What a worker's shutdown stops, in order: the pipeline (a client of the bounce handlers),
    the store and load handlers, the bounce handlers, the disk tier and the remote tier (their
    threads may read into host records); the region comes after all of them."""
    stop_order: list[tuple[str, Stoppable]] = []
    if parts.pipeline is not None:
        stop_order.append(("disk pipeline", parts.pipeline))
    stop_order += [("store handler", parts.store_handler), ("load handler", parts.load_handler)]
    if parts.expedited_handler is not None:
        stop_order.append(("expedited load handler", parts.expedited_handler))
    if parts.bounce is not None:
        stop_order += [("bounce store handler", parts.bounce[0]), ("bounce load handler", parts.bounce[1])]
    if parts.tier is not None:
        stop_order.append(("disk tier", parts.tier))
    if parts.remote is not None:
        stop_order.append(("remote tier", parts.remote))
    return stop_order
