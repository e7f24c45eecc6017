"""DiskTier: host records in a local file, the tier below the host pool.

Owns: the file descriptor of the tier file, the I/O threads and the checksum threads, the per-record
index (which disk records hold verified data, with their generation and key), the bookkeeping of
requests in flight and the results not yet returned. Borrows: the host records tensor
(``uint8 [n, record_bytes]``, rows 4096-aligned; bounce slots are simply more rows of it). It belongs
to the region; the Worker keeps it alive, and mapped, for longer than the tier, and must not unmap it
while a thread of the tier may still use it (see *Shutdown*).

File format (version 1; little-endian; every offset and size a multiple of 4096)::

    offset 0             file header page (4096 B): magic "KVOFDISK", version, record_bytes,
                         num_blocks, slot_bytes, data_offset, file_id (random, new at every
                         creation), the layout fingerprint (UTF-8), and at byte 4092 the CRC32 of
                         the page's first 4092 bytes
    4096 + b * slot      the slot of disk block b, slot = 4096 + record_bytes bytes:
                           record header page (4096 B): magic "KVOFREC1", version, flags (VALID,
                           CHECKSUM), file_id, disk block id b, generation, payload bytes, CRC32 of
                           the payload, the record's key (<= MAX_KEY_BYTES), and at byte 4092 the
                           CRC32 of the page's first 4092 bytes
                           payload (record_bytes B): the host record, byte for byte

A record is written by ONE ``pwritev`` of ``[header page, payload]`` at its slot, and a run of
consecutive disk blocks by one ``pwritev``/``preadv`` of ``[h0, p0, h1, p1, ...]`` (at most
``io_bytes`` of payload and ``IOV_MAX / 2`` records per call; a record larger than ``io_bytes`` is
still one call). Slots are page-aligned and disjoint, so concurrent writers never share a page, and
O_DIRECT moves the host rows to and from the disk without a copy. A torn write or a crash leaves a
slot whose header CRC fails, or whose payload does not match the CRC in its header: it fails its
check when read and is never served. The header names its block and generation, so a record is never
served as another block, nor as a write the index does not expect. A write that did not land at all
leaves the previous record, which still verifies, but only as itself (its own generation and key):
inside the process the index dropped the block when the write started, and a failed write also
zeroes the slot's header (best effort); after a restart such a record comes back under its old key.
Durability across a power loss is not promised (no ``fsync``); a record torn by one fails its checks.

Verification, on every read: the header's CRC, magic, version, file id and VALID flag, the block id,
the generation the index expects, then (with ``DiskConfig.checksum``, when the record was written
with one) the payload's CRC32. The index is
the authority: a block it does not hold is refused (``not_valid``) whatever the file says, and a
block whose read fails in any way (a check, a short read, an I/O error) is dropped from it. After a
warm restart the index is header-verified (docs/design.md §9.4). A failed read zero-fills the destination rows of the
blocks that failed (after a short read or an I/O error: every row of that system call); rows of
blocks that verified keep their bytes, but the request completes as a whole with ``ok=False``.

Threads: ``zlib.crc32`` releases the GIL, as ``os.preadv``/``os.pwritev`` do. CRCs run on checksum
threads *beside* the I/O threads: a write's CRCs and headers are made before its system call is
queued, a read's records are verified after its system call; so the disk always has ``io_threads``
requests in flight and never waits for a CRC (computing CRCs on the I/O threads themselves cost
13-25% of the throughput in ``kvoffload.disk_bench`` on a 2-core machine).

Requests: ``write``/``read`` are jobs (``Direction.DEMOTE``/``PROMOTE``) whose results come back
through ``poll``/``wait`` as :class:`~kvoffload.records.TransferResult`, like the handlers' (a job
completes as a whole; ``path`` is ``"disk-direct"`` or ``"disk-buffered"``). ``write_records`` and
``read_records`` are the same operations for the Worker's GPU <-> disk pipeline through bounce
slots: they return a :class:`DiskIO` handle instead of a polled result. Both kinds are validated
before anything is submitted (typed errors; the tier is unchanged), split by contiguous runs of disk
blocks into system calls, and run in FIFO order. The tier refuses a request that would write a disk
block an in-flight request reads or writes, or read one an in-flight request writes
(:class:`~kvoffload.errors.BlockConflictError`). It does not track host rows: the caller (the
Worker's bookkeeping) must not let two requests in flight write one host row, or one read a row
that another writes.

What the Worker can rely on for the GPU <-> disk pipeline (``write_records``/``read_records``):

* the call validates, enqueues and returns a :class:`DiskIO` at once, from any thread; it never
  waits for I/O (it takes the tier's lock for bookkeeping only);
* until the handle is done, the tier's threads read (a write) or write (a read) its host rows:
  leave them alone. Once ``DiskIO.done()`` is true or ``DiskIO.wait(t)`` returned True, no thread of
  the tier touches them again, whatever the outcome, so the slot may be reused or handed to a copy
  engine (docs/design.md §5 rule 5 on the disk side; draining the host<->device copies is the Worker's part);
* ``ok`` means every record was written in full (the index then lists it under a new generation) or
  read and verified. With ``ok=False``, ``error`` is the failure of the lowest failed position (a
  :class:`~kvoffload.errors.DiskError` unless the tier shut down), ``failed`` names every failed
  position, and for a read their rows are zero-filled: never another block's bytes, never stale bytes
  presented as valid;
* a write reads each host row twice (CRC, then ``pwritev``): a row changed in between is detected by
  every later read (``checksum_mismatch``), never served;
* ``shutdown`` waits for these handles too, and stops every thread before the descriptor is closed.

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
import enum
import errno as errno_codes
import itertools
import logging
import os
import stat
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final, cast

import attrs
import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import Buffer

from kvoffload.errors import (
    ArgumentTypeError,
    BlockConflictError,
    ClosedError,
    DiskError,
    DiskFormatError,
    DiskIntegrityError,
    DiskIOError,
    DiskPathError,
    DiskShutdownError,
    InvalidArgumentError,
    JobIdError,
    KeyTypeError,
    TransferError,
    UnknownJobError,
    WaitTimeoutError,
)
from kvoffload.handler import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    BlockIds,
    as_block_ids,
    as_job_id,
    as_job_ids,
    as_timeout,
    check_pairs,
)
from kvoffload.records import Direction, TransferResult

__all__ = [
    "DEFAULT_IO_BYTES",
    "DEFAULT_IO_THREADS",
    "FORMAT_VERSION",
    "MAX_KEY_BYTES",
    "PAGE_BYTES",
    "DiskCapabilities",
    "DiskConfig",
    "DiskErrorKind",
    "DiskIO",
    "DiskRecordInfo",
    "DiskStats",
    "DiskTier",
]

_log = logging.getLogger("kvoffload.disk")

I64Array = npt.NDArray[np.int64]
U8Array = npt.NDArray[np.uint8]

#: Version of the file format this module writes and reads.
FORMAT_VERSION: Final = 1
#: Alignment of every offset, size and host buffer (O_DIRECT); also the size of each header page.
PAGE_BYTES: Final = 4096
#: I/O threads per tier unless configured.
DEFAULT_IO_THREADS: Final = 4
MAX_IO_THREADS: Final = 64
#: Payload bytes per system call unless configured (a run of records is split into calls of this).
DEFAULT_IO_BYTES: Final = 8 << 20
MAX_IO_BYTES: Final = 1 << 30
#: Linux moves at most this many bytes per read/write system call.
MAX_SYSCALL_BYTES: Final = 0x7FFFF000
#: Longest key a record header stores.
MAX_KEY_BYTES: Final = 1024
MAX_FINGERPRINT_BYTES: Final = 2048
#: Each I/O thread is joined for at least this long even when the deadline has passed: an idle
#: thread stops within microseconds, and only one stuck in a system call should count as running.
IO_JOIN_MIN_S: Final = 0.05
_FILE_MODE: Final = 0o600
_CRC_OFFSET: Final = PAGE_BYTES - 4
_FILE_MAGIC: Final = b"KVOFDISK"
_RECORD_MAGIC: Final = b"KVOFREC1"
# magic, version, reserved, record_bytes, num_blocks, slot_bytes, data_offset, file_id, fingerprint len
_FILE_HEADER: Final = struct.Struct("<8sIIQQQQQH")
# magic, version, flags, file_id, block, generation, payload bytes, payload crc, key length
_RECORD_HEADER: Final = struct.Struct("<8sIIQQQQIH")
_CRC: Final = struct.Struct("<I")
_FLAG_VALID: Final = 1
_FLAG_CHECKSUM: Final = 2
_IOV_MAX: Final = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class DiskErrorKind(str, enum.Enum):
    """The ``kind`` of a :class:`~kvoffload.errors.DiskError` (compares equal to its string)."""

    SHORT_READ = "short_read"
    SHORT_WRITE = "short_write"
    EIO = "eio"
    ENOSPC = "enospc"
    OS_ERROR = "os_error"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    HEADER_INVALID = "header_invalid"
    BLOCK_MISMATCH = "block_mismatch"
    GENERATION_MISMATCH = "generation_mismatch"
    NOT_VALID = "not_valid"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    VERSION_MISMATCH = "version_mismatch"
    GEOMETRY_MISMATCH = "geometry_mismatch"
    NOT_A_TIER = "not_a_tier"
    DIRECT_REFUSED = "direct_refused"


# ---------------------------------------------------------------------------------------- records


def _as_path(value: str | os.PathLike[str]) -> str:
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise ArgumentTypeError(
            f"DiskConfig.path must be a str or os.PathLike of str, got {type(value).__name__} {value!r}"
        )
    if not path or "\0" in path:
        raise InvalidArgumentError(f"DiskConfig.path = {path!r} must be a non-empty path without NUL")
    return path


@attrs.frozen
class DiskConfig:
    """How to open the disk tier. Validated at construction (typed errors naming the field).

    Attributes:
        path: the tier file. Its parent directory must exist. A missing or zero-length file is
            created; any other file that is not a kvoffload tier is refused, never overwritten
            (``DiskFormatError``, kind ``not_a_tier``).
        num_blocks: disk records in the file (the file holds ``4096 + num_blocks * (4096 +
            record_bytes)`` bytes).
        reuse: warm restart: open an existing tier file with the same layout fingerprint and geometry
            and rebuild the index from its record headers. With False, an existing tier file is
            recreated empty.
        recreate: with ``reuse``, a tier file of another fingerprint, version or geometry is recreated
            empty instead of refused (only meaningful with ``reuse=True``).
        io_threads: I/O threads: each runs one system call at a time, so this is the number of
            requests the tier keeps in flight on the disk.
        checksum_threads: threads that compute the CRCs before writes and verify records after reads,
            beside the I/O threads so that the disk never waits for a CRC (None: ``io_threads``;
            none are started with ``checksum=False``).
        direct: True: O_DIRECT or fail; False: buffered I/O; None: O_DIRECT when the file system
            accepts it, else buffered (``DiskTier.capabilities()`` says which and why).
        checksum: write a CRC32 of every payload and verify it on every read.
        io_bytes: payload bytes per system call (a multiple of 4096); a run of consecutive disk
            blocks is moved in calls of at most this (but at least one whole record).
        preallocate: reserve the file's blocks at creation (``posix_fallocate``), so that running out
            of space is reported by ``create`` rather than by a later write. On a file system
            without ``fallocate`` support glibc emulates it by writing every block (slow for large
            files): pass False there (the file is then sized sparse with ``ftruncate``).
    """

    path: str = attrs.field(converter=_as_path)
    num_blocks: int
    reuse: bool = False
    recreate: bool = False
    io_threads: int = DEFAULT_IO_THREADS
    checksum_threads: int | None = None
    direct: bool | None = None
    checksum: bool = True
    io_bytes: int = DEFAULT_IO_BYTES
    preallocate: bool = True

    def __attrs_post_init__(self) -> None:
        _check_int("DiskConfig.num_blocks", self.num_blocks, 1, 1 << 40)
        for name in ("reuse", "recreate", "checksum", "preallocate"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ArgumentTypeError(f"DiskConfig.{name} = {value!r} must be a bool")
        if self.direct is not None and not isinstance(self.direct, bool):
            raise ArgumentTypeError(f"DiskConfig.direct = {self.direct!r} must be True, False or None")
        if self.recreate and not self.reuse:
            raise InvalidArgumentError(
                "DiskConfig.recreate = True only applies with reuse = True (without reuse an existing "
                "tier file is always recreated)"
            )
        _check_int("DiskConfig.io_threads", self.io_threads, 1, MAX_IO_THREADS)
        if self.checksum_threads is not None:
            _check_int("DiskConfig.checksum_threads", self.checksum_threads, 1, MAX_IO_THREADS)
        _check_int("DiskConfig.io_bytes", self.io_bytes, PAGE_BYTES, MAX_IO_BYTES)
        if self.io_bytes % PAGE_BYTES:
            raise InvalidArgumentError(
                f"DiskConfig.io_bytes = {self.io_bytes} must be a multiple of {PAGE_BYTES} (O_DIRECT)"
            )


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} = {value!r} must be an int, not a {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidArgumentError(f"{name} = {value} must be in [{low}, {high}]")


@attrs.frozen
class DiskRecordInfo:
    """One disk record the index holds as valid: its block, generation and key (b"" if none)."""

    block: int
    generation: int
    key: bytes


@attrs.frozen
class DiskCapabilities:
    """How a tier was opened.

    Attributes:
        path: the tier file.
        direct: True when the tier uses O_DIRECT, False for buffered I/O.
        reason: why (``"O_DIRECT accepted"``, or what refused it, or the configuration).
        transfer_path: ``"disk-direct"`` or ``"disk-buffered"`` (``TransferResult.path``).
        num_blocks, record_bytes: the file's geometry; ``slot_bytes`` = 4096 + ``record_bytes``.
        file_bytes: the file's size.
        io_threads, io_bytes: as configured; ``records_per_io``: most records per system call.
        checksum_threads: threads computing and verifying CRCs (0 with ``checksum=False``).
        checksum: whether payload CRCs are written and verified.
        fingerprint: the layout fingerprint in the file header; ``file_id``: the file's random id.
        reused: True when an existing file was opened warm (its index rebuilt from the headers).
        recreated: True when an existing tier file was replaced by an empty one.
        note: what happened to an existing file (why it was recreated, or extended), else "".
        indexed_records: records found valid when the index was rebuilt (0 for a new file).
        rejected_records: record headers found damaged when the index was rebuilt (not indexed).
    """

    path: str
    direct: bool
    reason: str
    transfer_path: str
    num_blocks: int
    record_bytes: int
    slot_bytes: int
    file_bytes: int
    io_threads: int
    io_bytes: int
    records_per_io: int
    checksum_threads: int
    checksum: bool
    fingerprint: str
    file_id: int
    reused: bool
    recreated: bool
    note: str
    indexed_records: int
    rejected_records: int


@attrs.frozen
class DiskStats:
    """Counters since the tier was created (also valid after shutdown).

    Requests are jobs and :class:`DiskIO` requests together. Bytes count payload bytes of records
    written in full or read and verified. ``*_seconds`` sum the requests' wall time (first system
    call started to last one finished). Failure counters count events: a failed system call once, a
    record that failed verification once. ``fingerprint_mismatches`` is 1 when ``create`` recreated a
    file of another fingerprint.
    """

    write_requests: int
    read_requests: int
    write_failed: int
    read_failed: int
    in_flight: int
    records_written: int
    records_read: int
    bytes_written: int
    bytes_read: int
    write_seconds: float
    read_seconds: float
    short_reads: int
    short_writes: int
    eio: int
    enospc: int
    os_errors: int
    checksum_mismatches: int
    header_invalid: int
    block_mismatches: int
    generation_mismatches: int
    not_valid: int
    fingerprint_mismatches: int

    def failures(self, kind: DiskErrorKind | str) -> int:
        """The counter of one failure kind (0 for kinds not counted here)."""
        field = _KIND_FIELDS.get(DiskErrorKind(kind))
        return int(getattr(self, field)) if field is not None else 0

    @property
    def write_gbps(self) -> float:
        """Bytes written over the summed write time, GB/s (0.0 before any)."""
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    @property
    def read_gbps(self) -> float:
        """Bytes read over the summed read time, GB/s (0.0 before any)."""
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


_KIND_FIELDS: Final[dict[DiskErrorKind, str]] = {
    DiskErrorKind.SHORT_READ: "short_reads",
    DiskErrorKind.SHORT_WRITE: "short_writes",
    DiskErrorKind.EIO: "eio",
    DiskErrorKind.ENOSPC: "enospc",
    DiskErrorKind.OS_ERROR: "os_errors",
    DiskErrorKind.CHECKSUM_MISMATCH: "checksum_mismatches",
    DiskErrorKind.HEADER_INVALID: "header_invalid",
    DiskErrorKind.BLOCK_MISMATCH: "block_mismatches",
    DiskErrorKind.GENERATION_MISMATCH: "generation_mismatches",
    DiskErrorKind.NOT_VALID: "not_valid",
    DiskErrorKind.FINGERPRINT_MISMATCH: "fingerprint_mismatches",
}


# --------------------------------------------------------------------------------------- requests


class DiskIO:
    """The handle of one request (a job, or a ``write_records``/``read_records`` call).

    ``done()``/``wait(timeout)`` say when every system call of the request finished; from then on no
    thread of the tier touches its host rows. ``ok``, ``error``, ``failed`` and ``seconds`` are final
    once done. Thread-safe.
    """

    def __init__(self, *, direction: Direction, job_id: int | None, disk_blocks: I64Array,
                 host_rows: I64Array, record_bytes: int, pieces: int) -> None:
        self.direction = direction
        self.job_id = job_id
        self.disk_blocks = disk_blocks
        self.host_rows = host_rows
        self.nbytes = int(disk_blocks.shape[0]) * record_bytes
        self._remaining = pieces
        self._event = threading.Event()
        self._errors: list[tuple[int, BaseException]] = []
        self._failed: list[int] = []
        self._start = 0.0
        self._end = 0.0
        self._serial: int | None = None

    def done(self) -> bool:
        """True once every system call of the request finished (never blocks)."""
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when done.

        Raises:
            InvalidArgumentError: a negative, NaN or infinite timeout.
        """
        return self._event.wait(as_timeout(timeout))

    @property
    def ok(self) -> bool:
        """True when done and every record moved (and, for a read, verified)."""
        return self._event.is_set() and not self._errors

    @property
    def error(self) -> BaseException | None:
        """The failure of the lowest failed position (None while running or when ok)."""
        if not self._event.is_set() or not self._errors:
            return None
        return min(self._errors, key=lambda item: item[0])[1]

    @property
    def failed(self) -> tuple[int, ...]:
        """Positions in the request (indices into its block lists) that failed, ascending."""
        return tuple(sorted(self._failed)) if self._event.is_set() else ()

    @property
    def seconds(self) -> float:
        """Wall time from the first system call's start to the last one's end (0.0 if none ran)."""
        return max(0.0, self._end - self._start) if self._event.is_set() else 0.0


@attrs.define(eq=False)
class _Piece:
    """One system call's worth of a request: a run of consecutive disk blocks."""

    io: DiskIO
    write: bool
    first_block: int
    positions: I64Array
    rows: I64Array
    keys: list[bytes] | None
    outcome: _Outcome | None = None
    headers: U8Array | None = None  # one page per record: built before a write, read by a read
    generation: int = 0  # of the first record (a write)
    index_valid: npt.NDArray[np.bool_] | None = None  # the index when a read was issued
    index_generation: npt.NDArray[np.uint64] | None = None


@attrs.define(eq=False)
class _Outcome:
    """What one piece did (filled on the tier's threads, applied under the lock)."""

    start: float
    end: float = 0.0
    errors: list[tuple[int, BaseException]] = attrs.field(factory=list)
    failed: list[int] = attrs.field(factory=list)
    records_ok: int = 0
    kinds: list[DiskErrorKind] = attrs.field(factory=list)


@attrs.frozen
class _FileState:
    """What ``create`` found or made on disk."""

    file_id: int
    reused: bool
    recreated: bool
    note: str
    fingerprint_mismatch: bool
    found_bytes: int = 0  # the file's size when it was opened (a reused file may be extended)


# ------------------------------------------------------------------------------------------ tier


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
        state: _FileState,
        sequence: Iterator[int] | None = None,
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
        self._records: torch.Tensor | None = records
        self._host: U8Array | None = host
        self._checksum = config.checksum
        self.checksum_threads = (
            (config.checksum_threads or config.io_threads) if config.checksum else 0
        )
        self._records_per_io = max(1, min(config.io_bytes // record_bytes, _IOV_MAX // 2))
        self._sequence = sequence if sequence is not None else itertools.count()
        self._lock = threading.Lock()
        self._io_queue: collections.deque[_Piece | None] = collections.deque()
        self._io_wake = threading.Condition(self._lock)
        self._cpu_queue: collections.deque[_Piece | None] = collections.deque()
        self._cpu_wake = threading.Condition(self._lock)
        self._stopping = False
        self._abort = threading.Event()
        self._threads: list[threading.Thread] = []
        self._cpu_threads: list[threading.Thread] = []
        self._closed = False
        self._valid = np.zeros(self.num_blocks, dtype=np.bool_)
        self._generation = np.zeros(self.num_blocks, dtype=np.uint64)
        self._keys: dict[int, bytes] = {}
        self._next_generation = 1
        self._indexed = 0
        self._rejected = 0
        self._disk_reads = np.zeros(self.num_blocks, dtype=np.int32)
        self._disk_writes = np.zeros(self.num_blocks, dtype=np.int32)
        self._serial = itertools.count()
        self._inflight: dict[int, DiskIO] = {}
        self._jobs: dict[int, DiskIO] = {}
        self._done: dict[int, tuple[int, TransferResult]] = {}
        self._zero_page = _aligned(PAGE_BYTES)
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
        sequence: Iterator[int] | None = None,
    ) -> DiskTier:
        """Open (or create) the tier file, rebuild the index when reusing it, start the I/O threads.

        Args:
            config: the file and how to use it.
            fingerprint: the layout's fingerprint (``DeviceLayout.fingerprint``), stored in the file
                header; a reused file must carry the same one.
            record_bytes: bytes per host record (a multiple of 4096; ``DeviceLayout.record_bytes``).
            records: the host rows the tier reads and writes: a CPU ``uint8`` tensor
                ``[n, record_bytes]`` with contiguous, 4096-aligned rows (the region's records view,
                bounce slots included). Borrowed: it must stay alive and mapped until ``shutdown``
                returned (and longer if the tier reports ``fd_left_open``).
            sequence: numbers results in completion order across components (the Worker shares one
                between its handlers and the tier).

        Raises (nothing is left open or started):
            ArgumentTypeError, InvalidArgumentError: a bad config, fingerprint, record size or
                records tensor (wrong dtype, device, shape, strides or alignment).
            DiskPathError: the path is a directory, its parent is missing, it is not a regular file,
                or it cannot be opened.
            DiskFormatError: an existing file that is not a tier file, or (with ``reuse`` and without
                ``recreate``) a tier file of another version, fingerprint or geometry.
            DiskError: ``direct=True`` and the file system refuses O_DIRECT.
            DiskIOError: the file cannot be sized (e.g. ``enospc``) or its header written.
        """
        if not isinstance(config, DiskConfig):
            raise ArgumentTypeError(f"config must be a DiskConfig, got {type(config).__name__}")
        fingerprint_bytes = _check_fingerprint(fingerprint)
        _check_int("record_bytes", record_bytes, PAGE_BYTES, MAX_SYSCALL_BYTES - PAGE_BYTES)
        if record_bytes % PAGE_BYTES:
            raise InvalidArgumentError(
                f"record_bytes = {record_bytes} must be a multiple of {PAGE_BYTES} (O_DIRECT alignment)"
            )
        host = _host_view(records, record_bytes)
        path = config.path
        _check_path(path)
        with contextlib.ExitStack() as undo:
            existed = os.path.exists(path)
            setup_fd = cls._open_path(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
            if not existed:
                undo.callback(_unlink_quietly, path)
            undo.callback(_close_quietly, setup_fd)
            state = _prepare_file(setup_fd, config, fingerprint_bytes, record_bytes)
            fd, direct, reason = cls._open_io_fd(path, config.direct, setup_fd)
            if fd != setup_fd:
                undo.callback(_close_quietly, fd)
            tier = cls(
                config=config, fd=fd, direct=direct, reason=reason, fingerprint=fingerprint,
                record_bytes=record_bytes, records=records, host=host, state=state,
                sequence=sequence,
            )
            undo.callback(tier._abandon)
            if state.reused:
                tier._rebuild_index()
            tier._start_threads()
            undo.pop_all()
        if fd != setup_fd:
            _close_quietly(setup_fd)
        return tier

    @classmethod
    def _open_file(cls, path: str, flags: int) -> int:
        """``os.open`` of the tier file (overridden by fault-injection tests)."""
        return os.open(path, flags, _FILE_MODE)

    @classmethod
    def _open_path(cls, path: str, flags: int) -> int:
        try:
            return cls._open_file(path, flags)
        except OSError as exc:
            raise DiskPathError(f"cannot open DiskConfig.path = {path!r}: {exc.strerror}") from None

    @classmethod
    def _open_io_fd(cls, path: str, direct: bool | None, setup_fd: int) -> tuple[int, bool, str]:
        """The descriptor the I/O threads use: O_DIRECT when asked or accepted, else ``setup_fd``."""
        if direct is False:
            return setup_fd, False, "buffered: DiskConfig.direct = False"
        o_direct = getattr(os, "O_DIRECT", 0)
        refused = ""
        if not o_direct:
            refused = "this platform has no O_DIRECT"
        else:
            try:
                fd = cls._open_file(path, os.O_RDWR | os.O_CLOEXEC | o_direct)
            except OSError as exc:
                if exc.errno != errno_codes.EINVAL:
                    raise DiskPathError(
                        f"cannot open DiskConfig.path = {path!r} with O_DIRECT: {exc.strerror}"
                    ) from None
                refused = f"the file system refused O_DIRECT at open ({exc.strerror})"
            else:
                probe = _aligned(PAGE_BYTES)
                try:
                    got = os.preadv(fd, [_buf(probe)], 0)
                except OSError as exc:
                    os.close(fd)
                    if exc.errno != errno_codes.EINVAL:
                        raise DiskIOError(
                            f"the O_DIRECT probe read of {path!r} failed: {exc.strerror}",
                            kind=_os_kind(exc.errno), path=path, errno=exc.errno,
                        ) from None
                    refused = f"the file system refused an aligned O_DIRECT read ({exc.strerror})"
                else:
                    if got == PAGE_BYTES:
                        return fd, True, "O_DIRECT accepted"
                    os.close(fd)
                    refused = f"the O_DIRECT probe read returned {got} of {PAGE_BYTES} bytes"
        if direct is True:
            raise DiskError(
                f"DiskConfig.direct = True but O_DIRECT cannot be used on {path!r}: {refused}",
                kind=DiskErrorKind.DIRECT_REFUSED, path=path,
            )
        _log.info("disk tier %s: buffered I/O (%s)", path, refused)
        return setup_fd, False, f"buffered: {refused}"

    def _rebuild_index(self) -> None:
        """Read every record header (on ``io_threads`` helper threads) and index the valid ones."""
        fd = self._fd
        assert fd is not None
        chunk = max(1, -(-self.num_blocks // (self.config.io_threads * 4)))
        ranges = [(b, min(b + chunk, self.num_blocks)) for b in range(0, self.num_blocks, chunk)]
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.io_threads, thread_name_prefix="kvoffload-disk-scan"
        ) as pool:
            parts = list(pool.map(lambda r: self._scan(fd, r[0], r[1]), ranges))
        for found, rejected, newest in parts:
            for block, generation, key in found:
                self._valid[block] = True
                self._generation[block] = generation
                if key:
                    self._keys[block] = key
            self._indexed += len(found)
            self._rejected += rejected
            # above every generation in the file, indexed or not: a stale record never matches
            self._next_generation = max(self._next_generation, newest + 1)

    def _scan(self, fd: int, start: int, stop: int) -> tuple[list[tuple[int, int, bytes]], int, int]:
        """Valid headers of blocks ``[start, stop)``, the count rejected, the newest generation."""
        page = _aligned(PAGE_BYTES)
        found: list[tuple[int, int, bytes]] = []
        rejected = 0
        newest = 0
        for block in range(start, stop):
            try:
                got = self._pread(fd, [page], self._slot_offset(block))
            except OSError as exc:
                _log.warning("disk tier %s: header of block %d unreadable: %s", self.path, block,
                             exc.strerror)
                rejected += 1
                continue
            if got != PAGE_BYTES:
                continue  # past the end of a file that was cut short: never written
            header = self._parse_header(page, 0)
            if isinstance(header, str):
                if page[: len(_RECORD_MAGIC)].tobytes() == _RECORD_MAGIC:
                    rejected += 1
                continue
            flags, hdr_block, generation, _crc, key = header
            newest = max(newest, generation)
            cut = self._slot_offset(block) + self.slot_bytes > self._state.found_bytes
            if hdr_block != block or not flags & _FLAG_VALID or cut:
                rejected += 1
                continue
            found.append((block, generation, key))
        return found, rejected, newest

    def _start_threads(self) -> None:
        cpu_threads = self.checksum_threads
        try:
            for i in range(self.config.io_threads):
                thread = threading.Thread(
                    target=self._io_loop, name=f"kvoffload-disk-io-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
            for i in range(cpu_threads):
                thread = threading.Thread(
                    target=self._cpu_loop, name=f"kvoffload-disk-crc-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
                self._cpu_threads.append(thread)
        except BaseException:
            self._stop_threads(time.monotonic() + IO_JOIN_MIN_S)
            raise

    # -------------------------------------------------------------------------------- properties

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    @property
    def threads_stopped(self) -> bool:
        """True when none of the tier's threads runs (none can touch the file or the host rows)."""
        return not any(t.is_alive() for t in self._threads)

    def capabilities(self) -> DiskCapabilities:
        """How the tier was opened (direct or buffered and why, geometry, warm restart)."""
        return DiskCapabilities(
            path=self.path, direct=self.direct, reason=self._reason,
            transfer_path=self.transfer_path, num_blocks=self.num_blocks,
            record_bytes=self.record_bytes, slot_bytes=self.slot_bytes,
            file_bytes=_file_bytes(self.num_blocks, self.record_bytes),
            io_threads=self.config.io_threads, io_bytes=self.config.io_bytes,
            records_per_io=self._records_per_io, checksum_threads=self.checksum_threads,
            checksum=self._checksum,
            fingerprint=self._fingerprint, file_id=self._state.file_id, reused=self._state.reused,
            recreated=self._state.recreated, note=self._state.note,
            indexed_records=self._indexed, rejected_records=self._rejected,
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
        with self._lock:
            blocks = np.flatnonzero(self._valid)
            gens = self._generation[blocks]
            return {
                int(b): DiskRecordInfo(int(b), int(g), self._keys.get(int(b), b""))
                for b, g in zip(blocks, gens)
            }

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
                **{field: f[kind] for kind, field in _KIND_FIELDS.items()},
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
            KeyTypeError, InvalidArgumentError: keys that are not bytes, too long, or miscounted.
            BlockConflictError: a disk block an in-flight request reads or writes.
        """
        self._check_open()
        job = as_job_id(job_id)
        rows = as_block_ids("host_blocks", host_blocks, self.num_host_rows)
        blocks = as_block_ids("disk_blocks", disk_blocks, self.num_blocks)
        check_pairs(rows, blocks, "host_blocks", "disk_blocks")
        key_list = _check_keys(keys, int(blocks.shape[0]))
        self._submit(Direction.DEMOTE, job, blocks, rows, key_list)

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
        self._submit(Direction.PROMOTE, job, blocks, rows, None)

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
        key_list = _check_keys(keys, int(blocks.shape[0]))
        return self._submit(Direction.DEMOTE, None, blocks, rows, key_list)

    def read_records(self, disk_blocks: BlockIds, host_rows: BlockIds) -> DiskIO:
        """As :meth:`read`, for the Worker's pipeline: returns a :class:`DiskIO` handle instead of a
        polled result. Same validation and errors, without the job id."""
        self._check_open()
        blocks = as_block_ids("disk_blocks", disk_blocks, self.num_blocks)
        rows = as_block_ids("host_rows", host_rows, self.num_host_rows)
        check_pairs(blocks, rows, "disk_blocks", "host_rows")
        return self._submit(Direction.PROMOTE, None, blocks, rows, None)

    def _submit(
        self, direction: Direction, job_id: int | None, blocks: I64Array, rows: I64Array,
        keys: list[bytes] | None,
    ) -> DiskIO:
        write = direction is Direction.DEMOTE
        runs = self._split(blocks)
        io = DiskIO(direction=direction, job_id=job_id, disk_blocks=blocks, host_rows=rows,
                    record_bytes=self.record_bytes, pieces=len(runs))
        pieces = [
            _Piece(io, write, int(blocks[pos[0]]), pos, rows[pos],
                   [keys[int(p)] for p in pos] if keys is not None else None)
            for pos in runs
        ]
        with self._lock:
            if self._closed:
                raise ClosedError("the disk tier was shut down")
            if job_id is not None and job_id in self._jobs:
                raise JobIdError(f"job {job_id} is already in flight or waiting to be polled")
            self._check_conflicts(write, blocks, job_id)
            self._counts["write_requests" if write else "read_requests"] += 1
            if job_id is not None:
                self._jobs[job_id] = io
            if not pieces:
                self._complete_locked(io)
                return io
            if write:
                self._disk_writes[blocks] += 1
            else:
                self._disk_reads[np.unique(blocks)] += 1
            io._serial = next(self._serial)
            self._inflight[io._serial] = io
            # under the lock: shutdown's stop markers always come after
            to_cpu = write and self._checksum
            (self._cpu_queue if to_cpu else self._io_queue).extend(pieces)
            (self._cpu_wake if to_cpu else self._io_wake).notify(len(pieces))
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

    # ------------------------------------------------------------------------- the two stages

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
        self, queue: collections.deque[_Piece | None], wake: threading.Condition
    ) -> _Piece | None:
        with self._lock:
            while not queue:
                wake.wait()
            return queue.popleft()

    def _hand_over(self, piece: _Piece, to_io: bool) -> bool:
        """Queue a piece for the other stage; False once the threads were told to stop."""
        with self._lock:
            if self._stopping:
                return False
            (self._io_queue if to_io else self._cpu_queue).append(piece)
            (self._io_wake if to_io else self._cpu_wake).notify()
        return True

    def _step(self, piece: _Piece, stage: Callable[[_Piece], bool]) -> None:
        """Run one stage of a piece; finish the piece when the stage says so or anything failed."""
        if piece.outcome is None:
            piece.outcome = _Outcome(start=time.monotonic())
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
            self._finish_piece(piece, piece.outcome)

    def _cpu_step(self, piece: _Piece) -> bool:
        """Checksum thread: CRC and headers before a write; verification after a read."""
        if piece.write:
            self._prepare_write(piece)
            if self._hand_over(piece, to_io=True):
                return False
            self._fail(piece, TransferError("the disk tier shut down before this write was issued"))
            return True
        self._verify_read(piece)
        return True

    def _io_step(self, piece: _Piece) -> bool:
        """I/O thread: the system call; reads go on to verification (on a checksum thread if on)."""
        if piece.write:
            if piece.headers is None:
                self._prepare_write(piece)
            self._write_piece(piece)
            return True
        if not self._read_piece(piece):
            return True
        if self._checksum and self._hand_over(piece, to_io=False):
            return False
        self._verify_read(piece)
        return True

    def _fail(self, piece: _Piece, error: BaseException) -> None:
        """Fail every record of a piece; a read's destination rows are zero-filled."""
        outcome = piece.outcome
        assert outcome is not None
        outcome.errors.append((int(piece.positions[0]), error))
        outcome.failed.extend(int(p) for p in piece.positions)
        host = self._host
        if not piece.write and host is not None:
            for row in piece.rows:
                host[int(row)].fill(0)

    def _prepare_write(self, piece: _Piece) -> None:
        """Allocate the records' generations, drop them from the index, build their header pages."""
        host = self._host
        assert host is not None
        n = int(piece.rows.shape[0])
        first = piece.first_block
        with self._lock:
            piece.generation = self._next_generation
            self._next_generation += n
            self._valid[first : first + n] = False
        headers = _aligned(n * PAGE_BYTES)
        for i in range(n):
            crc = zlib.crc32(_buf(host[int(piece.rows[i])])) if self._checksum else 0
            key = piece.keys[i] if piece.keys is not None else b""
            self._pack_header(headers[i * PAGE_BYTES : (i + 1) * PAGE_BYTES], first + i,
                              piece.generation + i, crc, key)
        piece.headers = headers

    def _write_piece(self, piece: _Piece) -> None:
        """One ``pwritev`` of ``[h0, p0, h1, p1, ...]``; publish the records in the index on success."""
        host, fd, headers, outcome = self._host, self._fd, piece.headers, piece.outcome
        assert host is not None and fd is not None and headers is not None and outcome is not None
        n = int(piece.rows.shape[0])
        first = piece.first_block
        iov: list[U8Array] = []
        for i in range(n):
            iov.append(headers[i * PAGE_BYTES : (i + 1) * PAGE_BYTES])
            iov.append(host[int(piece.rows[i])])
        offset = self._slot_offset(first)
        total = n * self.slot_bytes
        error: DiskIOError | None = None
        try:
            done = self._pwrite(fd, iov, offset)
        except OSError as exc:
            error = self._os_error("pwritev", exc, first, n, offset)
        else:
            if done != total:
                error = DiskIOError(
                    f"pwritev of disk blocks {_span(first, n)} ({total} bytes at offset {offset}) of "
                    f"{self.path!r} wrote {done} bytes",
                    kind=DiskErrorKind.SHORT_WRITE, path=self.path, blocks=range(first, first + n),
                )
        if error is None:
            with self._lock:
                self._valid[first : first + n] = True
                self._generation[first : first + n] = np.arange(
                    piece.generation, piece.generation + n, dtype=np.uint64
                )
                for i in range(n):
                    key = piece.keys[i] if piece.keys is not None else b""
                    if key:
                        self._keys[first + i] = key
                    else:
                        self._keys.pop(first + i, None)
            outcome.records_ok = n
            return
        self._zero_headers(fd, first, n)
        outcome.kinds.append(DiskErrorKind(error.kind))
        self._fail(piece, error)

    def _read_piece(self, piece: _Piece) -> bool:
        """One ``preadv`` into header pages and the host rows; False (rows zero-filled) if it failed."""
        host, fd, outcome = self._host, self._fd, piece.outcome
        assert host is not None and fd is not None and outcome is not None
        n = int(piece.rows.shape[0])
        first = piece.first_block
        with self._lock:
            piece.index_valid = valid = self._valid[first : first + n].copy()
            piece.index_generation = generation = self._generation[first : first + n].copy()
        headers = _aligned(n * PAGE_BYTES)
        iov: list[U8Array] = []
        for i in range(n):
            iov.append(headers[i * PAGE_BYTES : (i + 1) * PAGE_BYTES])
            iov.append(host[int(piece.rows[i])])
        piece.headers = headers
        offset = self._slot_offset(first)
        total = n * self.slot_bytes
        error: DiskIOError | None = None
        try:
            done = self._pread(fd, iov, offset)
        except OSError as exc:
            error = self._os_error("preadv", exc, first, n, offset)
        else:
            if done != total:
                error = DiskIOError(
                    f"preadv of disk blocks {_span(first, n)} ({total} bytes at offset {offset}) of "
                    f"{self.path!r} returned {done} bytes: the file ends early (truncated?)",
                    kind=DiskErrorKind.SHORT_READ, path=self.path, blocks=range(first, first + n),
                )
        if error is None:
            return True
        outcome.kinds.append(DiskErrorKind(error.kind))
        self._unindex(first, valid, generation)
        self._fail(piece, error)
        return False

    def _unindex(
        self, first: int, valid: npt.NDArray[np.bool_], generation: npt.NDArray[np.uint64]
    ) -> None:
        """Drop blocks ``first..`` from the index after a failed read of them — unless a write
        replaced them since the read was issued (their generation moved on)."""
        n = int(valid.shape[0])
        with self._lock:
            same = (
                valid & self._valid[first : first + n]
                & (self._generation[first : first + n] == generation)
            )
            self._valid[first : first + n] &= ~same
            for i in np.flatnonzero(same).tolist():
                self._keys.pop(first + i, None)

    def _verify_read(self, piece: _Piece) -> None:
        """Verify every record of a read piece; zero-fill and un-index the ones that fail."""
        host, headers, outcome = self._host, piece.headers, piece.outcome
        valid, expected = piece.index_valid, piece.index_generation
        assert host is not None and headers is not None and outcome is not None
        assert valid is not None and expected is not None
        first = piece.first_block
        dropped: list[tuple[int, int]] = []
        for i in range(int(piece.rows.shape[0])):
            row = host[int(piece.rows[i])]
            failure = self._verify(headers, i, row, first + i, bool(valid[i]), int(expected[i]))
            if failure is None:
                outcome.records_ok += 1
                continue
            row.fill(0)
            outcome.kinds.append(DiskErrorKind(failure.kind))
            outcome.errors.append((int(piece.positions[i]), failure))
            outcome.failed.append(int(piece.positions[i]))
            if failure.kind != DiskErrorKind.NOT_VALID:
                dropped.append((first + i, int(expected[i])))
        if dropped:
            with self._lock:
                for block, generation in dropped:
                    if self._valid[block] and int(self._generation[block]) == generation:
                        self._valid[block] = False
                        self._keys.pop(block, None)

    def _verify(
        self, headers: U8Array, i: int, payload: U8Array, block: int, valid: bool, expected: int
    ) -> DiskIntegrityError | None:
        """Check record ``i`` of a read against the index (module docstring: the order of checks)."""
        where = f"disk block {block} of {self.path!r}"
        if not valid:
            return self._integrity(
                DiskErrorKind.NOT_VALID, block,
                f"{where} holds no valid record (never written, or its last write failed)",
            )
        header = self._parse_header(headers, i * PAGE_BYTES)
        if isinstance(header, str):
            return self._integrity(DiskErrorKind.HEADER_INVALID, block, f"{where}: {header}")
        flags, hdr_block, generation, crc, _key = header
        if not flags & _FLAG_VALID:
            return self._integrity(DiskErrorKind.HEADER_INVALID, block, f"{where}: not marked valid")
        if hdr_block != block:
            return self._integrity(
                DiskErrorKind.BLOCK_MISMATCH, block,
                f"{where}: the record header names disk block {hdr_block} (another block's data)",
            )
        if generation != expected:
            return self._integrity(
                DiskErrorKind.GENERATION_MISMATCH, block,
                f"{where}: the record is generation {generation}, the index expects {expected}",
            )
        if self._checksum and flags & _FLAG_CHECKSUM:
            actual = zlib.crc32(_buf(payload))
            if actual != crc:
                return self._integrity(
                    DiskErrorKind.CHECKSUM_MISMATCH, block,
                    f"{where}: payload CRC32 {actual:#010x} does not match the header's {crc:#010x}",
                )
        return None

    def _integrity(self, kind: DiskErrorKind, block: int, message: str) -> DiskIntegrityError:
        return DiskIntegrityError(message, kind=kind, path=self.path, blocks=(block,))

    def _parse_header(self, buf: U8Array, offset: int) -> tuple[int, int, int, int, bytes] | str:
        """``(flags, block, generation, payload crc, key)`` of a record header, or why it is invalid."""
        page = buf[offset : offset + PAGE_BYTES]
        magic, version, flags, file_id, block, generation, nbytes, crc, key_len = (
            _RECORD_HEADER.unpack_from(_buf(page), 0)
        )
        if magic != _RECORD_MAGIC:
            return "no record header (never written, or the header was lost)"
        (stored,) = _CRC.unpack_from(_buf(page), _CRC_OFFSET)
        if zlib.crc32(_buf(page[:_CRC_OFFSET])) != stored:
            return "the record header's CRC32 does not match (torn or damaged header)"
        if version != FORMAT_VERSION:
            return f"record format version {version}, expected {FORMAT_VERSION}"
        if file_id != self._state.file_id:
            return "the record belongs to another tier file (file id differs)"
        if nbytes != self.record_bytes or key_len > MAX_KEY_BYTES:
            return f"the record header says {nbytes} payload bytes, the tier has {self.record_bytes}"
        start = _RECORD_HEADER.size
        return flags, block, generation, crc, page[start : start + key_len].tobytes()

    def _pack_header(self, page: U8Array, block: int, generation: int, crc: int, key: bytes) -> None:
        flags = _FLAG_VALID | (_FLAG_CHECKSUM if self._checksum else 0)
        page.fill(0)
        _RECORD_HEADER.pack_into(
            _buf(page), 0, _RECORD_MAGIC, FORMAT_VERSION, flags, self._state.file_id, block, generation,
            self.record_bytes, crc, len(key),
        )
        page[_RECORD_HEADER.size : _RECORD_HEADER.size + len(key)] = np.frombuffer(key, dtype=np.uint8)
        _CRC.pack_into(_buf(page), _CRC_OFFSET, zlib.crc32(_buf(page[:_CRC_OFFSET])))

    def _zero_headers(self, fd: int, first: int, n: int) -> None:
        """Best effort after a failed write: zero the slots' headers so a restart cannot revive them."""
        for block in range(first, first + n):
            try:
                self._pwrite(fd, [self._zero_page], self._slot_offset(block))
            except OSError as exc:
                _log.warning("disk tier %s: could not invalidate block %d's header: %s",
                             self.path, block, exc.strerror)

    def _os_error(self, call: str, exc: OSError, first: int, n: int, offset: int) -> DiskIOError:
        code = exc.errno
        return DiskIOError(
            f"{call} of disk blocks {_span(first, n)} at offset {offset} of {self.path!r} failed: "
            f"{exc.strerror} (errno {code})",
            kind=_os_kind(code), path=self.path, blocks=range(first, first + n), errno=code,
        )

    def _slot_offset(self, block: int) -> int:
        return PAGE_BYTES + block * self.slot_bytes

    def _pread(self, fd: int, buffers: list[U8Array], offset: int) -> int:
        """``os.preadv`` (overridden by fault-injection tests: short reads, EIO, stalls)."""
        return os.preadv(fd, cast("list[Buffer]", buffers), offset)

    def _pwrite(self, fd: int, buffers: list[U8Array], offset: int) -> int:
        """``os.pwritev`` (overridden by fault-injection tests: short writes, EIO, ENOSPC, stalls)."""
        return os.pwritev(fd, cast("list[Buffer]", buffers), offset)

    def _finish_piece(self, piece: _Piece, outcome: _Outcome) -> None:
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
        if io.job_id is not None and io.job_id in self._jobs:
            path = self.transfer_path if io.nbytes else "none"
            result = TransferResult(
                job_id=io.job_id, direction=io.direction, ok=io.ok, nbytes=io.nbytes,
                seconds=io.seconds, path=path, error=io.error,
            )
            self._done[io.job_id] = (next(self._sequence), result)

    # ------------------------------------------------------------------------------- completion

    def poll(self) -> list[TransferResult]:
        """Results of every job finished since the last call, in completion order; never blocks.

        Raises:
            ClosedError: after shutdown.
        """
        return [result for _, result in self.poll_sequenced()]

    def poll_sequenced(self) -> list[tuple[int, TransferResult]]:
        """As :meth:`poll`, each result with its completion sequence number."""
        self._check_open()
        with self._lock:
            out = sorted(self._done.values(), key=lambda item: item[0])
            for job_id in self._done:
                self._jobs.pop(job_id, None)
            self._done.clear()
        return out

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
        return [result for _, result in self.wait_sequenced(job_ids, timeout)]

    def wait_sequenced(
        self, job_ids: Iterable[int], timeout: float
    ) -> list[tuple[int, TransferResult]]:
        """As :meth:`wait`, each result with its completion sequence number."""
        self._check_open()
        ids = as_job_ids(job_ids)
        seconds = as_timeout(timeout)
        with self._lock:
            unknown = [j for j in ids if j not in self._jobs]
            if unknown:
                raise UnknownJobError(
                    f"disk job(s) {unknown} are neither in flight nor waiting to be polled"
                )
            handles = [self._jobs[j] for j in ids]
        deadline = time.monotonic() + seconds
        for handle in handles:
            handle._event.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            pending = [j for j in ids if j not in self._done]
            if pending:
                if any(j not in self._jobs for j in pending):
                    raise UnknownJobError(f"disk job(s) {pending} were returned by a concurrent call")
                raise WaitTimeoutError(
                    f"disk job(s) {pending} did not finish within {seconds} s", pending=pending
                )
            for j in ids:
                self._jobs.pop(j, None)
            return [self._done.pop(j) for j in ids]

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
            self._abort.set()
            with self._lock:
                self._inflight.clear()
        stopped = self._stop_threads(deadline)
        if not stopped:
            alive = [t.name for t in self._threads if t.is_alive()]
            failures.append(WaitTimeoutError(
                f"disk thread(s) {alive} did not stop before the deadline (a system call on "
                f"{self.path!r} may still be running)"
            ))
        else:
            fd, self._fd = self._fd, None
            self._host = None
            self._records = None
            if fd is not None:
                try:
                    os.close(fd)
                except OSError as exc:
                    failures.append(exc)
        with self._lock:
            self._done.clear()
            self._jobs.clear()
        if failures:
            raise DiskShutdownError(
                f"disk tier {self.path!r} shutdown failed", failures, fd_left_open=not stopped
            )

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

    def _stop_threads(self, deadline: float) -> bool:
        """Post one stop marker per thread (behind any queued piece) and join; True if all stopped."""
        with self._lock:
            self._stopping = True
            io_threads = len(self._threads) - len(self._cpu_threads)
            self._io_queue.extend([None] * io_threads)
            self._io_wake.notify_all()
            self._cpu_queue.extend([None] * len(self._cpu_threads))
            self._cpu_wake.notify_all()
        for thread in self._threads:
            thread.join(max(IO_JOIN_MIN_S, deadline - time.monotonic()))
        return self.threads_stopped

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the disk tier was shut down")

    def _abandon(self) -> None:
        """A failed ``create``: no thread runs and the undo list closes the file; mark it closed."""
        self._closed = True
        self._fd = None
        self._host = None
        self._records = None

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(
                "DiskTier was never shut down; call shutdown() (its file stays open and its threads "
                "idle until the process exits)",
                ResourceWarning,
                stacklevel=2,
            )


# ---------------------------------------------------------------------------------------- helpers


def _aligned(nbytes: int) -> U8Array:
    """A zeroed, page-aligned buffer (O_DIRECT needs aligned memory)."""
    raw = np.zeros(nbytes + PAGE_BYTES, dtype=np.uint8)
    shift = (-raw.ctypes.data) % PAGE_BYTES
    return raw[shift : shift + nbytes]


def _buf(array: U8Array) -> Buffer:
    """A numpy array as a buffer for os, zlib and struct (numpy's stubs do not declare one)."""
    return cast(Buffer, array)


def _span(first: int, n: int) -> str:
    return str(first) if n == 1 else f"{first}..{first + n - 1}"


def _os_kind(code: int | None) -> DiskErrorKind:
    if code == errno_codes.EIO:
        return DiskErrorKind.EIO
    if code == errno_codes.ENOSPC:
        return DiskErrorKind.ENOSPC
    return DiskErrorKind.OS_ERROR


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _file_bytes(num_blocks: int, record_bytes: int) -> int:
    return PAGE_BYTES + num_blocks * (PAGE_BYTES + record_bytes)


def _check_fingerprint(fingerprint: object) -> bytes:
    if not isinstance(fingerprint, str):
        raise ArgumentTypeError(
            f"fingerprint must be a str (DeviceLayout.fingerprint), got {type(fingerprint).__name__}"
        )
    encoded = fingerprint.encode()
    if not encoded or len(encoded) > MAX_FINGERPRINT_BYTES:
        raise InvalidArgumentError(
            f"fingerprint must be 1..{MAX_FINGERPRINT_BYTES} bytes of UTF-8, got {len(encoded)}"
        )
    return encoded


def _check_keys(keys: object, count: int) -> list[bytes] | None:
    if keys is None:
        return None
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise KeyTypeError(
            f"keys must be a sequence of bytes (one per disk block), got {type(keys).__name__}"
        )
    if len(keys) != count:
        raise InvalidArgumentError(f"keys has {len(keys)} entries but disk_blocks has {count}")
    out: list[bytes] = []
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise KeyTypeError(f"keys[{i}] = {key!r} is a {type(key).__name__}, not bytes")
        if len(key) > MAX_KEY_BYTES:
            raise InvalidArgumentError(f"keys[{i}] has {len(key)} bytes; at most {MAX_KEY_BYTES}")
        out.append(key)
    return out


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
    if records.stride() != (record_bytes, 1):
        raise InvalidArgumentError(
            f"records rows must be contiguous (strides ({record_bytes}, 1)), got {records.stride()}"
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


def _check_path(path: str) -> None:
    if os.path.isdir(path):
        raise DiskPathError(
            f"DiskConfig.path = {path!r} is a directory; give a file path inside it "
            f"(e.g. {os.path.join(path, 'kv.bin')!r})"
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise DiskPathError(
            f"the parent directory {parent!r} of DiskConfig.path = {path!r} does not exist"
        )
    if not os.path.isdir(parent):
        raise DiskPathError(f"the parent {parent!r} of DiskConfig.path = {path!r} is not a directory")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise DiskPathError(f"cannot inspect DiskConfig.path = {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise DiskPathError(f"DiskConfig.path = {path!r} exists and is not a regular file")


def _prepare_file(fd: int, config: DiskConfig, fingerprint: bytes, record_bytes: int) -> _FileState:
    """Check an existing file against the config and reuse, extend or (re)create it."""
    path = config.path
    expected = _file_bytes(config.num_blocks, record_bytes)
    size = os.fstat(fd).st_size
    if size == 0:
        return _create_file(fd, config, fingerprint, record_bytes, recreated=False, note="",
                            mismatch=False)
    first = os.pread(fd, PAGE_BYTES, 0)
    if first[: len(_FILE_MAGIC)] != _FILE_MAGIC:
        raise DiskFormatError(
            f"{path!r} holds {size} bytes and is not a kvoffload disk tier (it does not start with "
            f"{_FILE_MAGIC!r}); a file that is not a tier is never overwritten: remove it or choose "
            "another path",
            kind=DiskErrorKind.NOT_A_TIER, path=path,
        )
    problem = _header_problem(first, config, fingerprint, record_bytes)
    if problem is None and config.reuse:
        file_id = _FILE_HEADER.unpack_from(first, 0)[7]
        note = ""
        if size < expected:
            _size_file(fd, config, expected)
            note = (f"the file was {size} bytes, {expected} expected: extended; records past the "
                    "old end are not valid")
        return _FileState(file_id=file_id, reused=True, recreated=False, note=note,
                          fingerprint_mismatch=False, found_bytes=size)
    if problem is None:
        return _create_file(fd, config, fingerprint, record_bytes, recreated=True,
                            note="reuse=False: the existing tier file was recreated empty",
                            mismatch=False)
    kind, message = problem
    if config.reuse and not config.recreate:
        raise DiskFormatError(
            f"{path!r} cannot be reused: {message} (pass DiskConfig(recreate=True) to recreate it)",
            kind=kind, path=path,
        )
    _log.warning("disk tier %s: recreating the file: %s", path, message)
    return _create_file(fd, config, fingerprint, record_bytes, recreated=True,
                        note=f"recreated: {message}",
                        mismatch=kind is DiskErrorKind.FINGERPRINT_MISMATCH)


def _header_problem(
    page: bytes, config: DiskConfig, fingerprint: bytes, record_bytes: int
) -> tuple[DiskErrorKind, str] | None:
    intact = len(page) == PAGE_BYTES and (
        zlib.crc32(page[:_CRC_OFFSET]) == _CRC.unpack_from(page, _CRC_OFFSET)[0]
    )
    if not intact:
        return DiskErrorKind.HEADER_INVALID, "its file header is damaged (CRC32 mismatch)"
    _magic, version, _r, rec, blocks, slot, data, _fid, fp_len = _FILE_HEADER.unpack_from(page, 0)
    if version != FORMAT_VERSION:
        return (DiskErrorKind.VERSION_MISMATCH,
                f"format version {version}, this library reads {FORMAT_VERSION}")
    stored = page[_FILE_HEADER.size : _FILE_HEADER.size + fp_len]
    if stored != fingerprint:
        return (DiskErrorKind.FINGERPRINT_MISMATCH,
                f"it holds another layout (fingerprint {stored.decode(errors='replace')[:16]}..., "
                f"this layout is {fingerprint.decode()[:16]}...)")
    if (rec, blocks, slot, data) != (record_bytes, config.num_blocks, PAGE_BYTES + rec, PAGE_BYTES):
        return (DiskErrorKind.GEOMETRY_MISMATCH,
                f"it holds {blocks} records of {rec} bytes, the config asks for {config.num_blocks} of "
                f"{record_bytes}")
    return None


def _create_file(
    fd: int, config: DiskConfig, fingerprint: bytes, record_bytes: int, *, recreated: bool, note: str,
    mismatch: bool,
) -> _FileState:
    """Empty the file, write its header, then size it: a crash at any point leaves an empty file
    (created again) or a tier whose records are not valid yet — never a file that is not a tier."""
    expected = _file_bytes(config.num_blocks, record_bytes)
    try:
        os.ftruncate(fd, 0)
    except OSError as exc:
        raise DiskIOError(f"cannot empty {config.path!r}: {exc.strerror}", kind=_os_kind(exc.errno),
                          path=config.path, errno=exc.errno) from None
    file_id = int.from_bytes(os.urandom(8), "little")
    page = bytearray(PAGE_BYTES)
    _FILE_HEADER.pack_into(page, 0, _FILE_MAGIC, FORMAT_VERSION, 0, record_bytes, config.num_blocks,
                           PAGE_BYTES + record_bytes, PAGE_BYTES, file_id, len(fingerprint))
    page[_FILE_HEADER.size : _FILE_HEADER.size + len(fingerprint)] = fingerprint
    _CRC.pack_into(page, _CRC_OFFSET, zlib.crc32(bytes(page[:_CRC_OFFSET])))
    try:
        written = os.pwrite(fd, bytes(page), 0)
    except OSError as exc:
        raise DiskIOError(f"cannot write the header of {config.path!r}: {exc.strerror}",
                          kind=_os_kind(exc.errno), path=config.path, errno=exc.errno) from None
    if written != PAGE_BYTES:
        raise DiskIOError(
            f"writing the header of {config.path!r} wrote {written} of {PAGE_BYTES} bytes",
            kind=DiskErrorKind.SHORT_WRITE, path=config.path,
        )
    _size_file(fd, config, expected)
    return _FileState(file_id=file_id, reused=False, recreated=recreated, note=note,
                      fingerprint_mismatch=mismatch)


def _size_file(fd: int, config: DiskConfig, nbytes: int) -> None:
    try:
        if config.preallocate:
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    except OSError as exc:
        try:
            free = os.statvfs(config.path)
            room = f"; the file system has {free.f_bavail * free.f_frsize} bytes free"
        except OSError:
            room = ""
        raise DiskIOError(
            f"cannot size {config.path!r} to {nbytes} bytes: {exc.strerror}{room}",
            kind=_os_kind(exc.errno), path=config.path, errno=exc.errno,
        ) from None
