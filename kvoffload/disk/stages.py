"""The disk tier's two stages: I/O threads (one system call at a time each) and checksum threads.

Owns: its threads and the two queues between them. Borrows from its tier: the file descriptor, the
host rows, the record codec, the index, the tier's ``pread``/``pwrite`` (so that fault injection
reaches every system call) and the callback that completes a piece.

The payload CRC32 (:func:`kvoffload._record.payload_crc`: ISA-L's where installed, else zlib's)
releases the GIL, as ``os.preadv``/``os.pwritev`` do. CRCs run on checksum threads *beside* the I/O
threads: a write's CRCs and headers are made before its system call is queued, a
read's records are verified after its system call; so the disk always has ``io_threads`` requests
in flight and never waits for a CRC (computing CRCs on the I/O threads themselves cost 13-25% of the
throughput on a 2-core machine). A piece that fails in any way fails every record it carries; a
read's destination rows are then zero-filled, never left with another block's bytes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload._record import payload_crc
from kvoffload.disk.config import PAGE_BYTES, DiskErrorKind
from kvoffload.disk.format import RecordCodec, aligned, os_kind, span
from kvoffload.disk.index import DiskIndex
from kvoffload.disk.requests import Outcome, Piece
from kvoffload.errors import DiskIOError, TransferError

__all__ = ["IO_JOIN_MIN_S", "DiskStages"]

_log = logging.getLogger("kvoffload.disk")

U8Array = npt.NDArray[np.uint8]
#: ``(fd, buffers, offset) -> bytes moved``: a vectored system call on the tier file.
SystemCall = Callable[[int, "list[U8Array]", int], int]
#: Each thread is joined for at least this long even when the deadline has passed: an idle thread
#: stops within microseconds, and only one stuck in a system call should count as running.
IO_JOIN_MIN_S: Final = 0.05


class DiskStages:
    """I/O and checksum threads over one tier file (see the module docstring)."""

    def __init__(
        self, *, path: str, fd: int, host: U8Array, codec: RecordCodec, index: DiskIndex,
        checksum: bool, pread: SystemCall, pwrite: SystemCall,
        finish: Callable[[Piece, Outcome], None],
    ) -> None:
        self.path = path
        self.checksum = checksum
        self._fd: int | None = fd
        self._host: U8Array | None = host
        self._codec = codec
        self._index = index
        self._pread_fn = pread
        self._pwrite_fn = pwrite
        self._finish = finish
        self.slot_bytes = PAGE_BYTES + codec.record_bytes
        self._lock = threading.Lock()
        self._io_queue: collections.deque[Piece | None] = collections.deque()
        self._io_wake = threading.Condition(self._lock)
        self._cpu_queue: collections.deque[Piece | None] = collections.deque()
        self._cpu_wake = threading.Condition(self._lock)
        self._stopping = False
        self._abort = threading.Event()
        self._threads: list[threading.Thread] = []
        self._cpu_threads: list[threading.Thread] = []
        self._zero_page = aligned(PAGE_BYTES)

    def start(self, io_threads: int, checksum_threads: int) -> None:
        """Start the threads; on failure the ones started are stopped and the error raised."""
        try:
            for i in range(io_threads):
                thread = threading.Thread(target=self._io_loop, name=f"kvoffload-disk-io-{i}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)
            for i in range(checksum_threads):
                thread = threading.Thread(target=self._cpu_loop, name=f"kvoffload-disk-crc-{i}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)
                self._cpu_threads.append(thread)
        except BaseException:
            self.stop(time.monotonic() + IO_JOIN_MIN_S)
            raise

    def enqueue(self, pieces: list[Piece], to_checksum: bool) -> None:
        """Queue the pieces of one request (behind every piece queued before)."""
        with self._lock:
            (self._cpu_queue if to_checksum else self._io_queue).extend(pieces)
            (self._cpu_wake if to_checksum else self._io_wake).notify(len(pieces))

    def abort(self) -> None:
        """Fail every piece not started yet at its next stage (a drain that passed its deadline)."""
        self._abort.set()

    @property
    def threads_stopped(self) -> bool:
        """True when none of the threads runs (none can touch the file or the host rows)."""
        return not any(thread.is_alive() for thread in self._threads)

    def alive(self) -> list[str]:
        """Names of the threads still running."""
        return [t.name for t in self._threads if t.is_alive()]

    def stop(self, deadline: float) -> bool:
        """Post one stop marker per thread (behind any queued piece) and join; True if all stopped.
        Once they did, the stages drop their references to the descriptor and the host rows."""
        with self._lock:
            self._stopping = True
            io_threads = len(self._threads) - len(self._cpu_threads)
            self._io_queue.extend([None] * io_threads)
            self._io_wake.notify_all()
            self._cpu_queue.extend([None] * len(self._cpu_threads))
            self._cpu_wake.notify_all()
        for thread in self._threads:
            thread.join(max(IO_JOIN_MIN_S, deadline - time.monotonic()))
        if not self.threads_stopped:
            return False
        self._fd = None
        self._host = None
        return True

    def _io_loop(self) -> None:
        while True:
            piece = self._take(self._io_queue, self._io_wake)
            if piece is None:
                return
            self._step(piece, self._io_step)

    def _cpu_loop(self) -> None:
        while True:
            piece = self._take(self._cpu_queue, self._cpu_wake)
            if piece is None:
                return
            self._step(piece, self._cpu_step)

    def _take(
        self, queue: collections.deque[Piece | None], wake: threading.Condition
    ) -> Piece | None:
        with self._lock:
            while not queue:
                wake.wait()
            return queue.popleft()

    def _hand_over(self, piece: Piece, to_io: bool) -> bool:
        """Queue a piece for the other stage; False once the threads were told to stop."""
        with self._lock:
            if self._stopping:
                return False
            (self._io_queue if to_io else self._cpu_queue).append(piece)
            (self._io_wake if to_io else self._cpu_wake).notify()
        return True

    def _step(self, piece: Piece, stage: Callable[[Piece], bool]) -> None:
        """Run one stage of a piece; finish the piece when the stage says so or anything failed."""
        if piece.outcome is None:
            piece.outcome = Outcome(start=time.monotonic())
        try:
            if self._abort.is_set():
                self._fail(piece, TransferError("the disk tier shut down before this I/O completed"))
                finished = True
            else:
                finished = stage(piece)
        except Exception as exc:  # a defect must fail the request, never kill the thread
            _log.exception("disk tier %s: unexpected failure of an I/O piece", self.path)
            self._fail(piece, exc.with_traceback(None))
            finished = True
        if finished:
            piece.outcome.end = time.monotonic()
            piece.headers = None
            self._finish(piece, piece.outcome)

    def _cpu_step(self, piece: Piece) -> bool:
        """Checksum thread: CRC and headers before a write; verification after a read."""
        if piece.write:
            self._prepare_write(piece)
            if self._hand_over(piece, to_io=True):
                return False
            self._fail(piece, TransferError("the disk tier shut down before this write was issued"))
            return True
        self._verify_read(piece)
        return True

    def _io_step(self, piece: Piece) -> bool:
        """I/O thread: the system call; reads go on to verification (on a checksum thread if on)."""
        if piece.write:
            if piece.headers is None:
                self._prepare_write(piece)
            self._write_piece(piece)
            return True
        if not self._read_piece(piece):
            return True
        if self.checksum and self._hand_over(piece, to_io=False):
            return False
        self._verify_read(piece)
        return True

    def _fail(self, piece: Piece, error: BaseException) -> None:
        """Fail every record of a piece; a read's destination rows are zero-filled."""
        outcome = piece.outcome
        assert outcome is not None
        outcome.errors.append((int(piece.positions[0]), error))
        outcome.failed.extend(int(p) for p in piece.positions)
        host = self._host
        if not piece.write and host is not None:
            for row in piece.rows:
                host[int(row)].fill(0)

    def _prepare_write(self, piece: Piece) -> None:
        """Allocate the records' generations, drop them from the index, build their header pages."""
        host = self._host
        assert host is not None
        n = int(piece.rows.shape[0])
        first = piece.first_block
        piece.generation = self._index.begin_write(first, n)
        headers = aligned(n * PAGE_BYTES)
        for i in range(n):
            crc = payload_crc(host[int(piece.rows[i])]) if self.checksum else 0
            key = piece.keys[i] if piece.keys is not None else b""
            self._codec.pack(headers[i * PAGE_BYTES : (i + 1) * PAGE_BYTES], first + i,
                             piece.generation + i, crc, key, self.checksum)
        piece.headers = headers

    def _write_piece(self, piece: Piece) -> None:
        """One ``pwritev`` of ``[h0, p0, h1, p1, ...]``; publish the records in the index on success."""
        host, fd, headers, outcome = self._host, self._fd, piece.headers, piece.outcome
        assert host is not None and fd is not None and headers is not None and outcome is not None
        n = int(piece.rows.shape[0])
        first = piece.first_block
        iov: list[U8Array] = []
        for i in range(n):
            iov.append(headers[i * PAGE_BYTES : (i + 1) * PAGE_BYTES])
            iov.append(host[int(piece.rows[i])])
        offset = self._codec.slot_offset(first)
        total = n * self.slot_bytes
        error: DiskIOError | None = None
        try:
            done = self._pwrite_fn(fd, iov, offset)
        except OSError as exc:
            error = self._os_error("pwritev", exc, first, n, offset)
        else:
            if done != total:
                error = DiskIOError(
                    f"pwritev of disk blocks {span(first, n)} ({total} bytes at offset {offset}) of "
                    f"{self.path!r} wrote {done} bytes",
                    kind=DiskErrorKind.SHORT_WRITE, path=self.path, blocks=range(first, first + n),
                )
        if error is None:
            self._index.publish(first, piece.generation, piece.keys, n)
            outcome.records_ok = n
            return
        self._zero_headers(fd, first, n)
        outcome.kinds.append(DiskErrorKind(error.kind))
        self._fail(piece, error)

    def _read_piece(self, piece: Piece) -> bool:
        """One ``preadv`` into header pages and the host rows; False (rows zero-filled) if it failed."""
        host, fd, outcome = self._host, self._fd, piece.outcome
        assert host is not None and fd is not None and outcome is not None
        n = int(piece.rows.shape[0])
        first = piece.first_block
        piece.index_valid, piece.index_generation = valid, generation = self._index.snapshot(first, n)
        headers = aligned(n * PAGE_BYTES)
        iov: list[U8Array] = []
        for i in range(n):
            iov.append(headers[i * PAGE_BYTES : (i + 1) * PAGE_BYTES])
            iov.append(host[int(piece.rows[i])])
        piece.headers = headers
        offset = self._codec.slot_offset(first)
        total = n * self.slot_bytes
        error: DiskIOError | None = None
        try:
            done = self._pread_fn(fd, iov, offset)
        except OSError as exc:
            error = self._os_error("preadv", exc, first, n, offset)
        else:
            if done != total:
                error = DiskIOError(
                    f"preadv of disk blocks {span(first, n)} ({total} bytes at offset {offset}) of "
                    f"{self.path!r} returned {done} bytes: the file ends early (truncated?)",
                    kind=DiskErrorKind.SHORT_READ, path=self.path, blocks=range(first, first + n),
                )
        if error is None:
            return True
        outcome.kinds.append(DiskErrorKind(error.kind))
        self._index.unlist_unchanged(first, valid, generation)
        self._fail(piece, error)
        return False

    def _verify_read(self, piece: Piece) -> None:
        """Verify every record of a read piece; zero-fill and un-index the ones that fail."""
        host, headers, outcome = self._host, piece.headers, piece.outcome
        valid, expected = piece.index_valid, piece.index_generation
        assert host is not None and headers is not None and outcome is not None
        assert valid is not None and expected is not None
        first = piece.first_block
        dropped: list[tuple[int, int]] = []
        for i in range(int(piece.rows.shape[0])):
            row = host[int(piece.rows[i])]
            failure = self._codec.verify(headers, i, row, first + i, bool(valid[i]), int(expected[i]),
                                         self.checksum, piece.keys[i] if piece.keys is not None else None)
            if failure is None:
                outcome.records_ok += 1
                continue
            row.fill(0)
            outcome.kinds.append(DiskErrorKind(failure.kind))
            outcome.errors.append((int(piece.positions[i]), failure))
            outcome.failed.append(int(piece.positions[i]))
            if failure.kind not in (DiskErrorKind.NOT_VALID, DiskErrorKind.KEY_MISMATCH):
                dropped.append((first + i, int(expected[i])))  # (another key's record stays listed)
        if dropped:
            self._index.unlist(dropped)

    def _zero_headers(self, fd: int, first: int, n: int) -> None:
        """Best effort after a failed write: zero the slots' headers so a restart cannot revive them."""
        for block in range(first, first + n):
            try:
                self._pwrite_fn(fd, [self._zero_page], self._codec.slot_offset(block))
            except OSError as exc:
                _log.warning("disk tier %s: could not invalidate block %d's header: %s",
                             self.path, block, exc.strerror)

    def _os_error(self, call: str, exc: OSError, first: int, n: int, offset: int) -> DiskIOError:
        code = exc.errno
        return DiskIOError(
            f"{call} of disk blocks {span(first, n)} at offset {offset} of {self.path!r} failed: "
            f"{exc.strerror} (errno {code})",
            kind=os_kind(code), path=self.path, blocks=range(first, first + n), errno=code,
        )
