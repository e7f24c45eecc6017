"""DiskTier: host records in a local file, the tier below the host pool.

Owns: the file descriptors of the tier file (the I/O one; the set-up one, holding the file's lock,
when O_DIRECT made them two), the I/O threads and the checksum threads, the per-record
index (which disk records hold verified data, with their generation and key), the bookkeeping of
requests in flight and the results not yet returned. Borrows: the host records tensor
(``uint8 [n, record_bytes]``, rows 4096-aligned; bounce slots are simply more rows of it). It belongs
to the region; the Worker keeps it alive, and mapped, for longer than the tier, and must not unmap it
while a thread of the tier may still use it (see *Shutdown*).

The file format, how a file is opened and how a record is verified are in
:mod:`kvoffload.disk.format` (docs/design.md §9); which records a read may return is the
:class:`~kvoffload.disk.index.DiskIndex`'s. A failed read zero-fills the destination rows of the
blocks that failed (after a short read or an I/O error: every row of that system call); rows of
blocks that verified keep their bytes, but the request completes as a whole with ``ok=False``.

Threads: the I/O and checksum threads are the tier's :class:`~kvoffload.disk.stages.DiskStages`.

Requests: ``write``/``read`` are jobs (``Direction.DEMOTE``/``PROMOTE``) whose results the tier's
threads publish in its job book (:class:`~kvoffload._jobs.JobBook`: its own, or the Worker's shared
one), as :class:`~kvoffload.records.TransferResult` like the handlers' (a job completes as a whole;
``path`` is ``"disk-direct"`` or ``"disk-buffered"``). ``write_records`` and
``read_records`` are the same operations for the Worker's GPU <-> disk pipeline through bounce
slots: they return a :class:`DiskIO` handle instead of a polled result. Both kinds are validated
before anything is submitted (typed errors; the tier is unchanged), split by contiguous runs of disk
blocks into system calls, and run in FIFO order. The tier refuses a request that would write a disk
block an in-flight request reads or writes, or read one an in-flight request writes
(:class:`~kvoffload.errors.BlockConflictError`). It does not track host rows: the caller (the
Worker's bookkeeping) must not let two requests in flight write one host row, or one read a row
that another writes.

What the Worker can rely on for the GPU <-> disk pipeline is :class:`DiskIO`'s contract
(:mod:`kvoffload.disk.requests`).

Shutdown contract (docs/design.md §6): mark closed; drain the requests in flight head-first (oldest first)
with the deadline. If the drain passes its deadline: log it, stop issuing (requests not yet started
fail at once), forget the queue, keep the error. Then stop the I/O and checksum threads, each joined
with the remaining time. Only when every thread stopped is the descriptor closed (exactly once) and
the borrowed host records dropped; a thread that did not stop may still be inside a system call on
the file and the host rows, so the descriptor (and the records reference) are then kept for the rest
of the process and the :class:`~kvoffload.errors.DiskShutdownError` says so (``fd_left_open``).
Finally raise one ``DiskShutdownError`` carrying every failure. ``shutdown`` is idempotent; every call
after it raises :class:`~kvoffload.errors.ClosedError` except ``stats``, ``capabilities`` and the
properties. No cleanup in ``__del__`` (a ``ResourceWarning`` at most).

Fault injection: every system call on the tier file goes through :meth:`DiskTier._pread`,
:meth:`DiskTier._pwrite` and :meth:`DiskTier._open_file`; tests subclass the tier and override them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Final, cast

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import Buffer

from kvoffload._jobs import JobBook, as_job_id, as_timeout
from kvoffload._validate import as_block_ids, check_pairs
from kvoffload.disk.config import (
    KIND_FIELDS,
    PAGE_BYTES,
    DiskCapabilities,
    DiskConfig,
    DiskErrorKind,
    DiskRecordInfo,
    DiskStats,
    check_int,
)
from kvoffload.disk.format import (
    FILE_MODE,
    MAX_SYSCALL_BYTES,
    FileState,
    RecordCodec,
    check_fingerprint,
    check_keys,
    check_path,
    clear_records,
    close_file,
    close_quietly,
    file_bytes,
    keep_from_children,
    lock_file,
    mark_clean,
    open_io_fd,
    prepare_file,
    unlink_quietly,
)
from kvoffload.disk.index import DiskIndex, scan_headers
from kvoffload.disk.requests import DiskIO, Outcome, Piece
from kvoffload.disk.stages import IO_JOIN_MIN_S, DiskStages
from kvoffload.errors import (
    ArgumentTypeError,
    BlockConflictError,
    ClosedError,
    DiskIOError,
    DiskPathError,
    DiskShutdownError,
    InvalidArgumentError,
    WaitTimeoutError,
    warn_on_del,
)
from kvoffload.records import DEFAULT_SHUTDOWN_TIMEOUT_S, BlockIds, Direction, TransferResult

__all__ = ["DiskTier"]

_log = logging.getLogger("kvoffload.disk")

I64Array = npt.NDArray[np.int64]
U8Array = npt.NDArray[np.uint8]

_IOV_MAX: Final = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class DiskTier:
    """A file of host records with an index, I/O threads and jobs (see the module docstring).

    Build it with :meth:`create`; ``__init__`` only stores fields. Every method may be called from
    any thread; none waits for I/O while holding the tier's lock.
    """

    def __init__(
        self,
        *,
        config: DiskConfig,
        fd: int,
        direct: bool,
        reason: str,
        fingerprint: str,
        record_bytes: int,
        records: torch.Tensor,
        host: U8Array,
        state: FileState,
        book: JobBook | None = None,
    ) -> None:
        self.config = config
        self.path = config.path
        self.num_blocks = config.num_blocks
        self.record_bytes = record_bytes
        self.slot_bytes = PAGE_BYTES + record_bytes
        self.num_host_rows = int(host.shape[0])
        self.direct = direct
        self.transfer_path = "disk-direct" if direct else "disk-buffered"
        self._reason = reason
        self._fingerprint = fingerprint
        self._state = state
        self._fd: int | None = fd
        self._pid = os.getpid()  # a copy in a child forked without exec never marks the file
        # The set-up descriptor, kept open when the I/O one is another: it holds the file's lock
        # (moving the lock to the I/O descriptor would leave a moment with none, docs/design.md §9.2).
        self._lock_fd: int | None = None
        self._records: torch.Tensor | None = records
        self._host: U8Array | None = host
        self._checksum = config.checksum
        self.checksum_threads = (
            (config.checksum_threads or config.io_threads) if config.checksum else 0
        )
        self._records_per_io = max(1, min(config.io_bytes // record_bytes, _IOV_MAX // 2))
        self._codec = RecordCodec(state.file_id, record_bytes, config.path)
        self._index = DiskIndex(self.num_blocks)
        self._owns_book = book is None
        self._book = book if book is not None else JobBook()
        self._book.attach(self)
        self._lock = threading.Lock()
        self._stages = DiskStages(
            path=self.path, fd=fd, host=host, codec=self._codec, index=self._index,
            checksum=config.checksum, pread=self._pread, pwrite=self._pwrite,
            finish=self._finish_piece,
        )
        self._closed = False
        self._disk_reads = np.zeros(self.num_blocks, dtype=np.int32)
        self._disk_writes = np.zeros(self.num_blocks, dtype=np.int32)
        self._serial = itertools.count()
        self._inflight: dict[int, DiskIO] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self._failures: collections.Counter[DiskErrorKind] = collections.Counter()
        if state.fingerprint_mismatch:
            self._failures[DiskErrorKind.FINGERPRINT_MISMATCH] += 1
        self._seconds = {True: 0.0, False: 0.0}

    # ---------------------------------------------------------------------------------- creation

    @classmethod
    def create(
        cls,
        config: DiskConfig,
        *,
        fingerprint: str,
        record_bytes: int,
        records: torch.Tensor,
        book: JobBook | None = None,
    ) -> DiskTier:
        """Open (or create) the tier file, rebuild the index when reusing it, start the I/O threads.

        Args:
            config: the file and how to use it.
            fingerprint: the layout's fingerprint (``DeviceLayout.fingerprint``), stored in the file
                header; a reused file must carry the same one.
            record_bytes: bytes per host record (a multiple of 4096; ``DeviceLayout.record_bytes``).
            records: the host rows the tier reads and writes: a CPU ``uint8`` tensor
                ``[n, record_bytes]`` with contiguous, 4096-aligned rows (the region's records view,
                bounce slots included; one rank's slices of a shared pool are rows a block apart). Borrowed: it must stay alive and mapped until ``shutdown``
                returned (and longer if the tier reports ``fd_left_open``).
            book: where job results are published (the Worker shares one between its components);
                None gives the tier a book of its own, released with it.

        Raises (nothing is left open or started):
            ArgumentTypeError, InvalidArgumentError: a bad config, fingerprint, record size or
                records tensor (wrong dtype, device, shape, strides or alignment).
            DiskPathError: the path is a directory, its parent is missing, it is not a regular file,
                or it cannot be opened.
            DiskInUseError: another open tier (in this process or another) holds the file.
            DiskFormatError: an existing file that is not a tier file, or (with ``reuse`` and without
                ``recreate``) a tier file of another version, fingerprint or geometry.
            DiskError: ``direct=True`` and the file system refuses O_DIRECT.
            DiskIOError: the file cannot be sized (e.g. ``enospc``) or its header written.
        """
        if not isinstance(config, DiskConfig):
            raise ArgumentTypeError(f"config must be a DiskConfig, got {type(config).__name__}")
        fingerprint_bytes = check_fingerprint(fingerprint)
        check_int("record_bytes", record_bytes, PAGE_BYTES, MAX_SYSCALL_BYTES - PAGE_BYTES)
        if record_bytes % PAGE_BYTES:
            raise InvalidArgumentError(
                f"record_bytes = {record_bytes} must be a multiple of {PAGE_BYTES} (O_DIRECT alignment)"
            )
        host = _host_view(records, record_bytes)
        path = config.path
        check_path(path)
        with contextlib.ExitStack() as undo:
            existed = os.path.exists(path)
            setup_fd = cls._open_path(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
            undo.callback(close_quietly, setup_fd)
            locked = lock_file(setup_fd, path) == ""  # before the file is read or changed
            if not existed:  # only once locked: a file another tier holds is never removed
                undo.callback(unlink_quietly, path)
            state = prepare_file(setup_fd, config, fingerprint_bytes, record_bytes)
            fd, direct, reason = cls._open_io_fd(path, config.direct, setup_fd)
            if fd != setup_fd:
                undo.callback(close_quietly, fd)
                keep_from_children(fd)
            tier = cls(
                config=config, fd=fd, direct=direct, reason=reason, fingerprint=fingerprint,
                record_bytes=record_bytes, records=records, host=host, state=state, book=book,
            )
            undo.callback(tier._abandon)
            if state.reused:
                tier._rebuild_index()
            tier._stages.start(config.io_threads, tier.checksum_threads)
            undo.pop_all()
        if fd != setup_fd:
            if locked:  # the lock stays with the set-up descriptor, for the tier's life
                tier._lock_fd = setup_fd
            else:
                close_quietly(setup_fd)
        return tier

    @classmethod
    def _open_file(cls, path: str, flags: int) -> int:
        """``os.open`` of the tier file (overridden by fault-injection tests)."""
        return os.open(path, flags, FILE_MODE)

    @classmethod
    def _open_path(cls, path: str, flags: int) -> int:
        try:
            return cls._open_file(path, flags)
        except OSError as exc:
            raise DiskPathError(f"cannot open DiskConfig.path = {path!r}: {exc.strerror}") from None

    @classmethod
    def _open_io_fd(cls, path: str, direct: bool | None, setup_fd: int) -> tuple[int, bool, str]:
        """The descriptor the I/O threads use (:func:`~kvoffload.disk.format.open_io_fd`)."""
        return open_io_fd(path, direct, setup_fd, cls._open_file)

    def _rebuild_index(self) -> None:
        """Read every record header (on ``io_threads`` helper threads) and index the valid ones:
        those written without a checksum only from a file its last tier shut down cleanly, and only
        for a tier with ``checksum=False``; from any other file they are cleared (a crash may have
        cut them, and no later restart may list them)."""
        fd = self._fd
        assert fd is not None
        chunk = max(1, -(-self.num_blocks // (self.config.io_threads * 4)))
        ranges = [(b, min(b + chunk, self.num_blocks)) for b in range(0, self.num_blocks, chunk)]
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.io_threads, thread_name_prefix="kvoffload-disk-scan"
        ) as pool:
            parts = list(pool.map(
                lambda r: scan_headers(self._pread, fd, self._codec, self._state.found_bytes, r[0], r[1]),
                ranges,
            ))
        unchecked: list[tuple[int, int, bytes]] = []
        for found, rejected, newest, without_checksum in parts:
            self._index.load(found, rejected, newest)
            unchecked += without_checksum
        self._index.load([], self._state.cut_records, 0)  # cleared when the file was extended
        if not unchecked:
            return
        if not self._state.clean:  # a crash may have cut any of them: they go for good
            clear_records(fd, self.path, [block for block, _, _ in unchecked], self._codec.slot_offset)
            self._index.load([], len(unchecked), 0)
        elif self._checksum:  # whole, but this tier verifies every read: not listed, left as they are
            self._index.load([], len(unchecked), 0)
        else:
            self._index.load(unchecked, 0, 0)

    # -------------------------------------------------------------------------------- properties

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    @property
    def thread_stopped(self) -> bool:
        """True when none of the tier's threads runs (none can touch the file or the host rows)."""
        return self._stages.threads_stopped

    def capabilities(self) -> DiskCapabilities:
        """How the tier was opened (direct or buffered and why, geometry, warm restart)."""
        return DiskCapabilities(
            path=self.path, direct=self.direct, reason=self._reason,
            transfer_path=self.transfer_path, num_blocks=self.num_blocks,
            record_bytes=self.record_bytes, slot_bytes=self.slot_bytes,
            file_bytes=file_bytes(self.num_blocks, self.record_bytes),
            io_threads=self.config.io_threads, io_bytes=self.config.io_bytes,
            records_per_io=self._records_per_io, checksum_threads=self.checksum_threads,
            checksum=self._checksum,
            fingerprint=self._fingerprint, file_id=self._state.file_id, reused=self._state.reused,
            recreated=self._state.recreated, note=self._state.note,
            indexed_records=self._index.indexed, rejected_records=self._index.rejected,
        )

    def valid_blocks(self) -> dict[int, DiskRecordInfo]:
        """The index: every disk block holding a record that may be read, with its generation and key.

        A snapshot (later requests change the index, not this dict). It is *header-verified*
        (docs/design.md §9.4): after a warm restart it lists the records whose header verified and
        whose slot lies wholly inside the file as found; payloads are verified on every read, and a
        block leaves the index on any failed read (checksum, header, short read or I/O error).

        Raises:
            ClosedError: after shutdown.
        """
        self._check_open()
        return self._index.records()

    def stats(self) -> DiskStats:
        """Counters since creation (see :class:`DiskStats`); also valid after shutdown."""
        with self._lock:
            c = self._counts
            f = self._failures
            return DiskStats(
                write_requests=c["write_requests"], read_requests=c["read_requests"],
                write_failed=c["write_failed"], read_failed=c["read_failed"],
                in_flight=len(self._inflight), records_written=c["records_written"],
                records_read=c["records_read"], bytes_written=c["records_written"] * self.record_bytes,
                bytes_read=c["records_read"] * self.record_bytes,
                write_seconds=self._seconds[True], read_seconds=self._seconds[False],
                **{field: f[kind] for kind, field in KIND_FIELDS.items()},
            )

    # ------------------------------------------------------------------------------------- jobs

    def write(
        self,
        job_id: int,
        host_blocks: BlockIds,
        disk_blocks: BlockIds,
        *,
        keys: Sequence[bytes] | None = None,
    ) -> None:
        """Submit a DEMOTE job: host row ``host_blocks[i]`` -> disk record ``disk_blocks[i]``.

        ``keys[i]`` (optional, at most :data:`MAX_KEY_BYTES`) is stored in the record's header and
        reported by :meth:`valid_blocks`, so an engine can map its blocks again after a restart. The
        result comes from :meth:`poll`/:meth:`wait`; on ``ok`` the records are in the index.

        Raises (before anything is submitted; the tier is unchanged):
            ClosedError: after shutdown.
            JobIdError: a non-int job id, or one in flight or not yet returned.
            BlockIdTypeError, InvalidBlockIdError: malformed or out-of-range ids, unequal lengths,
                a disk block twice.
            KeyTypeError, InvalidArgumentError: keys that are not bytes, too long, or miscounted;
                ``DuplicateKeyError`` for a key twice.
            BlockConflictError: a disk block an in-flight request reads or writes.
        """
        self._check_open()
        job = as_job_id(job_id)
        rows = as_block_ids("host_blocks", host_blocks, self.num_host_rows)
        blocks = as_block_ids("disk_blocks", disk_blocks, self.num_blocks)
        check_pairs(rows, blocks, "host_blocks", "disk_blocks")
        key_list = check_keys(keys, int(blocks.shape[0]), unique=True)
        self._reserved_submit(Direction.DEMOTE, job, blocks, rows, key_list)

    def read(self, job_id: int, disk_blocks: BlockIds, host_blocks: BlockIds) -> None:
        """Submit a PROMOTE job: disk record ``disk_blocks[i]`` -> host row ``host_blocks[i]``.

        Each record is verified (module docstring); on failure the job is ``ok=False`` and the rows
        of the blocks that failed are zero-filled.

        Raises (before anything is submitted; the tier is unchanged): as :meth:`write`, with a host
        block twice refused, and a disk block an in-flight request writes.
        """
        self._check_open()
        job = as_job_id(job_id)
        blocks = as_block_ids("disk_blocks", disk_blocks, self.num_blocks)
        rows = as_block_ids("host_blocks", host_blocks, self.num_host_rows)
        check_pairs(blocks, rows, "disk_blocks", "host_blocks")
        self._reserved_submit(Direction.PROMOTE, job, blocks, rows, None)

    def write_validated(self, job_id: int, host_rows: I64Array, disk_blocks: I64Array, *,
                        keys: list[bytes] | None = None) -> None:
        """:meth:`write` of ids and keys the caller validated (:func:`check_keys`), with the id
        already reserved in the book (the Worker's call). Raises ``ClosedError`` and
        ``BlockConflictError`` only."""
        self._submit(Direction.DEMOTE, job_id, disk_blocks, host_rows, keys)

    def read_validated(self, job_id: int, disk_blocks: I64Array, host_rows: I64Array, *,
                       keys: list[bytes] | None = None) -> None:
        """:meth:`read` of ids the caller validated, with the id already reserved in the book (the
        Worker's call); with ``keys`` (validated), a record whose header names another key fails
        (``KEY_MISMATCH``) as one that fails its checksum does. Raises ``ClosedError`` and
        ``BlockConflictError`` only."""
        self._submit(Direction.PROMOTE, job_id, disk_blocks, host_rows, keys)

    def _reserved_submit(
        self, direction: Direction, job_id: int, blocks: I64Array, rows: I64Array,
        keys: list[bytes] | None,
    ) -> None:
        self._book.reserve(job_id, self)
        try:
            self._submit(direction, job_id, blocks, rows, keys)
        except BaseException:
            self._book.forget(job_id)
            raise

    def write_records(
        self, host_rows: BlockIds, disk_blocks: BlockIds, *, keys: Sequence[bytes] | None = None
    ) -> DiskIO:
        """As :meth:`write`, for the Worker's pipeline: returns a :class:`DiskIO` handle instead of a
        polled result (module docstring: what the caller can rely on). Same validation and errors,
        without the job id."""
        self._check_open()
        rows = as_block_ids("host_rows", host_rows, self.num_host_rows)
        blocks = as_block_ids("disk_blocks", disk_blocks, self.num_blocks)
        check_pairs(rows, blocks, "host_rows", "disk_blocks")
        key_list = check_keys(keys, int(blocks.shape[0]), unique=True)
        return self._submit(Direction.DEMOTE, None, blocks, rows, key_list)

    def read_records(self, disk_blocks: BlockIds, host_rows: BlockIds, *,
                     keys: Sequence[bytes] | None = None) -> DiskIO:
        """As :meth:`read`, for the Worker's pipeline: returns a :class:`DiskIO` handle instead of a
        polled result. Same validation and errors, without the job id; ``keys`` as
        :meth:`read_validated`'s."""
        self._check_open()
        blocks = as_block_ids("disk_blocks", disk_blocks, self.num_blocks)
        rows = as_block_ids("host_rows", host_rows, self.num_host_rows)
        check_pairs(blocks, rows, "disk_blocks", "host_rows")
        key_list = check_keys(keys, int(blocks.shape[0]))
        return self._submit(Direction.PROMOTE, None, blocks, rows, key_list)

    def _submit(
        self, direction: Direction, job_id: int | None, blocks: I64Array, rows: I64Array,
        keys: list[bytes] | None,
    ) -> DiskIO:
        write = direction is Direction.DEMOTE
        runs = self._split(blocks)
        io = DiskIO(direction=direction, job_id=job_id, disk_blocks=blocks, host_rows=rows,
                    record_bytes=self.record_bytes, pieces=len(runs))
        pieces = [
            Piece(io, write, int(blocks[pos[0]]), pos, rows[pos],
                   [keys[int(p)] for p in pos] if keys is not None else None)
            for pos in runs
        ]
        with self._lock:
            if self._closed:
                raise ClosedError("the disk tier was shut down")
            self._check_conflicts(write, blocks, job_id)
            self._counts["write_requests" if write else "read_requests"] += 1
            if not pieces:
                self._complete_locked(io)
                return io
            if write:
                self._disk_writes[blocks] += 1
            else:
                self._disk_reads[np.unique(blocks)] += 1
            io._serial = next(self._serial)
            self._inflight[io._serial] = io
            # under the tier's lock: shutdown's stop markers always come after
            self._stages.enqueue(pieces, to_checksum=write and self._checksum)
        return io

    def _split(self, blocks: I64Array) -> list[I64Array]:
        """Positions of each system call: runs of consecutive disk blocks, at most records_per_io."""
        if blocks.shape[0] == 0:
            return []
        order = np.argsort(blocks, kind="stable")
        ordered = blocks[order]
        breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
        out: list[I64Array] = []
        for run in np.split(order, breaks):
            for start in range(0, run.shape[0], self._records_per_io):
                out.append(run[start : start + self._records_per_io])
        return out

    def _check_conflicts(self, write: bool, blocks: I64Array, job_id: int | None) -> None:
        what = f"job {job_id}" if job_id is not None else "request"
        op = "write" if write else "read"
        busy = self._disk_writes[blocks]
        if write:
            busy = busy | self._disk_reads[blocks]
        hits = np.flatnonzero(busy)
        if hits.size:
            i = int(hits[0])
            doing = "written" if self._disk_writes[blocks[i]] else "read"
            raise BlockConflictError(
                f"disk {op} {what}: disk_blocks[{i}] = {int(blocks[i])} is being {doing} by an "
                "in-flight request; submit after it completed"
            )

    def _pread(self, fd: int, buffers: list[U8Array], offset: int) -> int:
        """``os.preadv`` (overridden by fault-injection tests: short reads, EIO, stalls)."""
        return os.preadv(fd, cast("list[Buffer]", buffers), offset)

    def _pwrite(self, fd: int, buffers: list[U8Array], offset: int) -> int:
        """``os.pwritev`` (overridden by fault-injection tests: short writes, EIO, ENOSPC, stalls)."""
        return os.pwritev(fd, cast("list[Buffer]", buffers), offset)

    def _finish_piece(self, piece: Piece, outcome: Outcome) -> None:
        io = piece.io
        with self._lock:
            if io._start == 0.0 or outcome.start < io._start:
                io._start = outcome.start
            io._end = max(io._end, outcome.end)
            io._errors.extend(outcome.errors)
            io._failed.extend(outcome.failed)
            self._counts["records_written" if piece.write else "records_read"] += outcome.records_ok
            for kind in outcome.kinds:
                self._failures[kind] += 1
            io._remaining -= 1
            if io._remaining == 0:
                if piece.write:
                    self._disk_writes[io.disk_blocks] -= 1
                else:
                    self._disk_reads[np.unique(io.disk_blocks)] -= 1
                self._complete_locked(io)

    def _complete_locked(self, io: DiskIO) -> None:
        if io._serial is not None:
            self._inflight.pop(io._serial, None)
        write = io.direction is Direction.DEMOTE
        if io._errors:
            self._counts["write_failed" if write else "read_failed"] += 1
        io._event.set()
        self._seconds[write] += io.seconds
        if io.job_id is not None:
            path = self.transfer_path if io.nbytes else "none"
            result = TransferResult(
                job_id=io.job_id, direction=io.direction, ok=io.ok, nbytes=io.nbytes,
                seconds=io.seconds, path=path, error=io.error,
            )
            self._book.finish(io.job_id, result)

    # ------------------------------------------------------------------------------- completion

    #: Results are published by the tier's own threads (waiters sleep on the book).
    pushes = True

    def advance(self) -> None:
        """Nothing to look for: the tier's threads publish results as requests complete."""

    def wait_progress(self, job_id: int, timeout: float) -> None:
        """Not called: the book waits for a pushing source itself."""

    def poll(self) -> list[TransferResult]:
        """Results of every job finished since the last call, in completion order (the book's: with
        a shared book, its other sources' too); never blocks.

        Raises:
            ClosedError: after shutdown.
        """
        self._check_open()
        return self._book.poll()

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[TransferResult]:
        """Wait until the given jobs finished; return their results in the order asked.

        Other jobs' results stay for :meth:`poll`. Jobs run concurrently: waiting for one does not
        wait for earlier ones.

        Raises:
            ClosedError: after shutdown.
            JobIdError, InvalidArgumentError: malformed ids or timeout (before waiting).
            UnknownJobError: an id neither in flight nor finished-and-unreturned.
            WaitTimeoutError: the deadline passed; ``pending`` names the unfinished jobs, which stay
                in flight (the finished ones stay available too).
        """
        self._check_open()
        return self._book.wait(job_ids, timeout)

    # ---------------------------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Drain, stop the threads and close the file, with the contract of the module docstring.

        Idempotent. Returns within about ``timeout`` seconds whatever the disk does.

        Raises:
            InvalidArgumentError: a malformed timeout (nothing is done then).
            DiskShutdownError: after all cleanup, carrying every failure; ``fd_left_open`` when an
                I/O thread did not stop (the descriptor and the host records are still in use).
        """
        seconds = as_timeout(timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + seconds
        failures: list[BaseException] = []
        try:
            self._drain(deadline)
        except Exception as exc:
            _log.error("disk tier %s: drain failed, abandoning in-flight I/O: %s", self.path, exc)
            failures.append(exc)
            self._stages.abort()
            with self._lock:
                self._inflight.clear()
        stopped = self._stages.stop(deadline)
        if not stopped:
            alive = self._stages.alive()
            failures.append(WaitTimeoutError(
                f"disk thread(s) {alive} did not stop before the deadline (a system call on "
                f"{self.path!r} may still be running)"
            ))
        elif not failures and self._counts["write_failed"] == 0 and not self._mark_clean(deadline):
            stopped = False  # the mark's thread may still be in a system call on the file
            failures.append(WaitTimeoutError(
                f"marking {self.path!r} as shut down cleanly did not finish before the deadline"))
        if stopped:
            fd, self._fd = self._fd, None
            self._host = None
            self._records = None
            if fd is not None:
                try:
                    close_file(fd)  # (the lock's descriptor where the tier reads through it)
                except OSError as exc:
                    failures.append(exc)
            lock_fd, self._lock_fd = self._lock_fd, None
            if lock_fd is not None:  # last: the file is another tier's to open from here on
                close_quietly(lock_fd)
        if self._owns_book:
            self._book.clear()
        if failures:
            raise DiskShutdownError(
                f"disk tier {self.path!r} shutdown failed", failures, fd_left_open=not stopped
            )

    def _mark_clean(self, deadline: float) -> bool:
        """Every write completed whole: mark the file clean (:func:`~kvoffload.disk.format.mark_clean`,
        which syncs the file, so on a thread of its own joined by ``deadline``). False when the
        thread is still running at the deadline (it then owns the descriptor's last use); a failed
        mark is only logged (the next restart then lists only records it can verify)."""
        fd = self._fd
        if fd is None or os.getpid() != self._pid:  # a forked child's copy: the file is the parent's
            return True

        def mark() -> None:
            try:
                mark_clean(fd, self.path, True)
            except DiskIOError as exc:
                _log.warning("disk tier %s: not marked clean: %s", self.path, exc)

        thread = threading.Thread(target=mark, name="kvoffload-disk-mark", daemon=True)
        thread.start()
        # at least IO_JOIN_MIN_S, as the I/O threads: a shutdown given no time (0) still marks the
        # file of an idle tier and closes it (it left the descriptors open and the file locked)
        thread.join(max(IO_JOIN_MIN_S, deadline - time.monotonic()))
        return not thread.is_alive()

    def _drain(self, deadline: float) -> None:
        while True:
            with self._lock:
                head = next(iter(self._inflight.values()), None)
            if head is None:
                return
            if not head._event.wait(max(0.0, deadline - time.monotonic())):
                what = f"job {head.job_id}" if head.job_id is not None else "a DiskIO request"
                raise WaitTimeoutError(
                    f"disk {head.direction.value} {what} did not finish before the shutdown deadline",
                    pending=[head.job_id] if head.job_id is not None else [],
                )

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the disk tier was shut down")

    def _abandon(self) -> None:
        """A failed ``create``: no thread runs and the undo list closes the file; mark it closed."""
        self._closed = True
        self._fd = None
        self._host = None
        self._records = None

    __del__ = warn_on_del(
        "_closed",
        "DiskTier was never shut down; call shutdown() (its file stays open and its threads "
        "idle until the process exits)"
    )


def _host_view(records: object, record_bytes: int) -> U8Array:
    """The records tensor as a numpy array sharing its memory, after checking it fits O_DIRECT."""
    if not isinstance(records, torch.Tensor):
        raise ArgumentTypeError(f"records must be a torch.Tensor, got {type(records).__name__}")
    if records.device.type != "cpu" or records.dtype != torch.uint8 or records.dim() != 2:
        raise InvalidArgumentError(
            f"records must be a CPU uint8 tensor [n, record_bytes], got {records.dtype} "
            f"{tuple(records.shape)} on {records.device}"
        )
    if records.shape[0] < 1 or records.shape[1] != record_bytes:
        raise InvalidArgumentError(
            f"records has shape {tuple(records.shape)}; expected [n >= 1, {record_bytes}]"
        )
    row_stride, byte_stride = records.stride()
    if byte_stride != 1 or row_stride < record_bytes or row_stride % PAGE_BYTES:
        raise InvalidArgumentError(
            f"records rows must be contiguous and {PAGE_BYTES}-aligned (strides (n * {PAGE_BYTES} >= "
            f"{record_bytes}, 1)), got {records.stride()}"
        )
    if records.data_ptr() % PAGE_BYTES:
        raise InvalidArgumentError(
            f"records must start at a multiple of {PAGE_BYTES} bytes (O_DIRECT), got address "
            f"{records.data_ptr():#x}"
        )
    if records.requires_grad:
        raise InvalidArgumentError("records must not require grad")
    host: U8Array = records.numpy()
    return host
