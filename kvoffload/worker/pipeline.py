"""The GPU <-> disk pipeline: device blocks to disk records and back, through pinned bounce slots.

Owns: one thread that runs these jobs one after another, in submission order. Borrows: two direction
handlers (device <-> bounce rows, with books of their own: their results never reach the engine), the
disk tier, the bounce rows of the host region, and the job book where it publishes each job's result
(the Worker's shared book: the pipeline is a source that pushes).

The bounce slots are split into sets used in turn, so that disk I/O into some sets overlaps the
device copies of others:

* store to disk: copy a round of device blocks into a free set (after the caller's compute fence),
  then write the set to disk; a set is filled again only after its disk write finished.
* load from disk: read rounds of records from disk into every free set, copy each set to its device
  blocks (after the caller's compute fence) as its read completes; a set is read into again only
  after its device copy finished (docs/design.md §5 rule 5 — the reused bounce slot that a peer's disk load
  overwrote while its last copy still read it). A job's result is reported only after its trailing
  copies finished: nothing it started still touches a slot.

A record that fails to read (checksum, generation, I/O error) is not copied to its device block,
whose previous contents stay; the job is reported ``ok=False`` with the error. A job never copies
another block's bytes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import Final, Literal

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload._jobs import JobBook, as_timeout
from kvoffload._seconds import WAIT_SLICE_S
from kvoffload.disk.requests import DiskIO
from kvoffload.disk.stages import IO_JOIN_MIN_S
from kvoffload.disk.tier import DiskTier
from kvoffload.errors import ClosedError, ShutdownError, TransferError, WaitTimeoutError
from kvoffload.handler import DirectionHandler
from kvoffload.records import Direction, TransferResult

__all__ = ["DiskPipeline"]

_log = logging.getLogger("kvoffload.pipeline")

I64Array = npt.NDArray[np.int64]
# A step (a device copy, a disk request) is waited for until it ended, however long: a job whose
# request or copy still runs must not end, since its bounce slots and device blocks would be used
# again under it. The waits look for a shutdown that gave up every WAIT_SLICE_S.

#: The bounce slots form this many sets, each a round of records; reads (or writes) of every free
#: set are in flight at once, so several disk requests overlap the device copies.
SLOT_SETS: Final = 4
_PATH: Final = "bounce"


@attrs.define(eq=False)
class _Job:
    job_id: int
    direction: Direction
    device_blocks: I64Array
    disk_blocks: I64Array
    fence: object
    keys: list[bytes] | None = None  # the records' keys, by position (None: no keys)
    submitted: float = attrs.field(factory=time.perf_counter)


class DiskPipeline:
    """Runs STORE_TO_DISK and LOAD_FROM_DISK jobs (see the module docstring).

    Build it with :meth:`create`. Methods may be called from any thread.
    """

    def __init__(
        self,
        *,
        to_slots: DirectionHandler,
        from_slots: DirectionHandler,
        tier: DiskTier,
        slot_rows: I64Array,
        block_bytes: int,
        book: JobBook,
    ) -> None:
        if slot_rows.shape[0] < 2:
            raise ValueError("the disk pipeline needs at least 2 bounce slots")
        count = min(SLOT_SETS, slot_rows.shape[0])
        size = slot_rows.shape[0] // count
        self._sets = tuple(slot_rows[i * size : (i + 1) * size] for i in range(count))
        self._to_slots = to_slots
        self._from_slots = from_slots
        self._tier = tier
        self._block_bytes = block_bytes
        self._book = book
        book.attach(self)
        self._ids = itertools.count()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Held across the look at ``_closed`` and the job's queueing in :meth:`submit`, and across
        #: the shutdown's close and its stop word: a job is never queued behind the stop word (it
        #: would never run, finish or give its fence back).
        self._queue_lock = threading.Lock()

    @classmethod
    def create(
        cls, *, to_slots: DirectionHandler, from_slots: DirectionHandler, tier: DiskTier,
        slot_rows: I64Array, block_bytes: int, book: JobBook,
    ) -> DiskPipeline:
        """A pipeline with its thread started; results are published in ``book``."""
        pipeline = cls(to_slots=to_slots, from_slots=from_slots, tier=tier, slot_rows=slot_rows,
                       block_bytes=block_bytes, book=book)
        thread = threading.Thread(target=pipeline._run, name="kvoffload-disk-pipeline", daemon=True)
        pipeline._thread = thread
        thread.start()
        return pipeline

    @property
    def thread_stopped(self) -> bool:
        """True when the pipeline thread is not running."""
        return self._thread is None or not self._thread.is_alive()

    def _handler(self, direction: Direction) -> DirectionHandler:
        return self._to_slots if direction is Direction.STORE_TO_DISK else self._from_slots

    def fence(self, direction: Direction, stream: object) -> object:
        """Capture the caller's compute-stream position for a job of ``direction``; the pipeline
        owns it once the job is submitted (and gives it back when the job finished), the caller
        until then (:meth:`release_fence`).

        Raises:
            DeviceMismatchError: a stream of another device (any stream on the host backend).
        """
        return self._handler(direction).fence(stream)

    def release_fence(self, direction: Direction, fence: object) -> None:
        """Give back a fence of :meth:`fence` that no submitted job holds."""
        self._handler(direction).release_fence(fence)

    def submit(
        self, job_id: int, direction: Direction, device_blocks: I64Array, disk_blocks: I64Array,
        fence: object, *, keys: list[bytes] | None = None,
    ) -> None:
        """Queue a validated job (its id reserved in the book, which gets its result; ``keys``: the
        records' keys, validated: written by a store, checked by a load). The job owns ``fence``
        from here on.

        Raises:
            ClosedError: after shutdown.
        """
        with self._queue_lock:
            if self._closed:
                raise ClosedError("the disk pipeline was shut down")
            self._queue.put(_Job(job_id, direction, device_blocks, disk_blocks, fence, keys))

    # --------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            error: BaseException | None = None
            if self._abort.is_set():
                error = TransferError("the disk pipeline shut down before the job ran")
            else:
                try:
                    if job.direction is Direction.STORE_TO_DISK:
                        self._store(job)
                    else:
                        self._load(job)
                except Exception as exc:  # reported as the job's failure
                    error = exc
            self._finish(job, error)

    def _rounds(self, job: _Job) -> collections.deque[slice]:
        size = self._sets[0].shape[0]
        total = job.device_blocks.shape[0]
        return collections.deque(slice(at, min(at + size, total)) for at in range(0, total, size))

    def _store(self, job: _Job) -> None:
        """Device -> set (copy), then set -> disk (write); a set is refilled only after its write."""
        rounds = self._rounds(job)
        free = collections.deque(range(len(self._sets)))
        copying: collections.deque[tuple[int, slice, int]] = collections.deque()
        writing: collections.deque[tuple[int, DiskIO]] = collections.deque()
        first_error: BaseException | None = None
        try:
            while rounds or copying or writing:
                while rounds and free and first_error is None:
                    index, part = free.popleft(), rounds.popleft()
                    rows = self._sets[index][: part.stop - part.start]
                    copy = next(self._ids)
                    self._to_slots.submit(copy, job.device_blocks[part], rows, fence=job.fence)
                    copying.append((index, part, copy))
                if copying:
                    index, part, copy = copying.popleft()
                    error = self._copy_error(self._to_slots, copy)
                    if error is None and first_error is None:
                        rows = self._sets[index][: part.stop - part.start]
                        keys = job.keys[part] if job.keys is not None else None
                        writing.append((index, self._tier.write_records(rows, job.disk_blocks[part], keys=keys)))
                    else:
                        first_error = first_error or error
                        free.append(index)
                # Reclaim sets whose write finished; block only when nothing else can move.
                while writing and (writing[0][1].done() or (not copying and (not free or not rounds))):
                    index, io = writing.popleft()
                    error = self._io_error(io)  # waited for first, whatever failed before (rule 5)
                    first_error = first_error or error
                    free.append(index)
                if first_error is not None:
                    rounds.clear()
        finally:
            # drain: no write may still read a slot, nor copy write one, after the job ends (each
            # waited for before the first error is kept: `first_error or wait()` skipped the wait
            # once an error was kept, and a set was refilled under a write still reading it)
            for _, pending in writing:
                error = self._io_error(pending)
                first_error = first_error or error
            for _, _, copy in copying:
                error = self._copy_error(self._to_slots, copy)
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _load(self, job: _Job) -> None:
        """Disk -> set (read), then set -> device (copy); a set is read into again only after its
        copy finished (rule 5), and every set's read is in flight while there is work for it."""
        rounds = self._rounds(job)
        free = collections.deque(range(len(self._sets)))
        reading: collections.deque[tuple[int, slice, DiskIO]] = collections.deque()
        copying: collections.deque[tuple[int, int]] = collections.deque()
        first_error: BaseException | None = None
        try:
            while rounds or reading or copying:
                while rounds and free:
                    index, part = free.popleft(), rounds.popleft()
                    rows = self._sets[index][: part.stop - part.start]
                    keys = job.keys[part] if job.keys is not None else None
                    reading.append((index, part, self._tier.read_records(job.disk_blocks[part], rows, keys=keys)))
                if reading:
                    index, part, io = reading.popleft()
                    rows = self._sets[index][: part.stop - part.start]
                    if not self._ended(io):
                        raise TransferError(f"the disk pipeline shut down while job {job.job_id}'s read ran")
                    keep = np.ones(rows.shape[0], dtype=bool)
                    if not io.ok:
                        first_error = first_error or io.error
                        keep[list(io.failed)] = False  # a record that failed never reaches the device
                    copy = next(self._ids)
                    self._from_slots.submit(copy, rows[keep], job.device_blocks[part][keep],
                                            fence=job.fence)
                    copying.append((index, copy))
                # Reclaim sets whose copy finished; block only when nothing else can move.
                while copying:
                    index, copy = copying[0]
                    must_wait = not reading and (not free or not rounds)
                    result = (self._copy_outcome(self._from_slots, copy) if must_wait
                              else _copy_result(self._from_slots, copy))
                    if result is None:
                        break
                    copying.popleft()
                    if result is not False:
                        first_error = first_error or result
                    free.append(index)
        finally:
            for _, _, pending_io in reading:  # drain: no read may still write a slot after the job
                self._ended(pending_io)
            for _, copy in copying:  # drain: the job ends only when no copy still reads a slot
                error = self._copy_error(self._from_slots, copy)  # (waited for first, as above)
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _ended(self, io: DiskIO) -> bool:
        """Wait until the disk request ended; False when a shutdown gave up first (it then owns the
        slots' fate: :meth:`shutdown` reports them in use)."""
        while not io.wait(WAIT_SLICE_S):
            if self._abort.is_set():
                return False
        return True

    def _io_error(self, io: DiskIO) -> BaseException | None:
        """The error of a disk request, once it ended (see :meth:`_ended`)."""
        if not self._ended(io):
            return TransferError("the disk pipeline shut down while a disk request ran")
        return None if io.ok else io.error

    def _copy_outcome(self, handler: DirectionHandler, copy: int) -> BaseException | Literal[False]:
        """:func:`_copy_result` once the copy ended (see :meth:`_ended`)."""
        while True:
            try:
                (result,) = handler.wait([copy], WAIT_SLICE_S)
            except WaitTimeoutError:
                if self._abort.is_set():
                    return TransferError("the disk pipeline shut down while a bounce copy ran")
                continue
            return False if result.ok else (result.error or TransferError("a bounce copy failed"))

    def _copy_error(self, handler: DirectionHandler, copy: int) -> BaseException | None:
        """The error of a bounce copy, once it ended (see :meth:`_ended`)."""
        result = self._copy_outcome(handler, copy)
        return None if result is False else result

    def _finish(self, job: _Job, error: BaseException | None) -> None:
        nbytes = int(job.device_blocks.shape[0]) * self._block_bytes
        result = TransferResult(
            job_id=job.job_id, direction=job.direction, ok=error is None, nbytes=nbytes,
            seconds=time.perf_counter() - job.submitted, path=_PATH, error=error,
        )
        # Every copy that waited for the fence was issued (and finished): it goes back to its pool.
        self._handler(job.direction).release_fence(job.fence)
        self._book.finish(job.job_id, result)

    # ------------------------------------------------------------------------------- completion

    #: Results are published by the pipeline's thread (waiters sleep on the book).
    pushes = True

    def advance(self) -> None:
        """Nothing to look for: the pipeline's thread publishes results as jobs finish."""

    def wait_progress(self, job_id: int, timeout: float) -> None:
        """Not called: the book waits for a pushing source itself."""

    def shutdown(self, timeout: float) -> None:
        """Let queued jobs finish (bounded by ``timeout``), then stop the thread. Idempotent.

        Raises:
            ShutdownError: the thread did not stop in time (a job may still use the slots).
        """
        seconds = as_timeout(timeout)
        with self._queue_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        thread = self._thread
        if thread is None:
            return
        thread.join(max(seconds, IO_JOIN_MIN_S))  # an idle thread stops in a moment, even at 0
        if thread.is_alive():
            self._abort.set()
            raise ShutdownError("the disk pipeline did not stop before the deadline",
                                [WaitTimeoutError("a GPU <-> disk job is still running")])


def _copy_result(handler: DirectionHandler, copy: int) -> BaseException | Literal[False] | None:
    """None while the copy runs; False when it finished well; its error when it failed."""
    try:
        (result,) = handler.wait([copy], 0.0)
    except WaitTimeoutError:
        return None
    return False if result.ok else (result.error or TransferError("a bounce copy failed"))
