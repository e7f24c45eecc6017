"""The disk tier's configuration and the records it reports: what to open, how it was opened,
what it holds, what it counted. Plain values, validated at construction (typed errors naming the
field); this module imports neither torch nor numpy.
"""

from __future__ import annotations

import enum
import os
from typing import Final

import attrs

from kvoffload.errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "DEFAULT_IO_BYTES",
    "DEFAULT_IO_THREADS",
    "KIND_FIELDS",
    "MAX_IO_BYTES",
    "MAX_IO_THREADS",
    "PAGE_BYTES",
    "DiskCapabilities",
    "DiskConfig",
    "DiskErrorKind",
    "DiskRecordInfo",
    "DiskStats",
    "check_int",
]

#: Alignment of every offset, size and host buffer (O_DIRECT); also the size of each header page.
PAGE_BYTES: Final = 4096
#: I/O threads per tier unless configured.
DEFAULT_IO_THREADS: Final = 4
MAX_IO_THREADS: Final = 64
#: Payload bytes per system call unless configured (a run of records is split into calls of this).
DEFAULT_IO_BYTES: Final = 8 << 20
MAX_IO_BYTES: Final = 1 << 30


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
    KEY_MISMATCH = "key_mismatch"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    VERSION_MISMATCH = "version_mismatch"
    GEOMETRY_MISMATCH = "geometry_mismatch"
    NOT_A_TIER = "not_a_tier"
    DIRECT_REFUSED = "direct_refused"
    IN_USE = "in_use"


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
        checksum: write a CRC32 of every payload and verify it on every read; a warm restart then
            lists no record written without one. With False, a warm restart lists the records
            written without a CRC only from a file whose last tier shut down cleanly (a crash may
            have cut one), and clears them otherwise; records written with a CRC (by a tier with
            True) are still verified when read (docs/design.md §9.4).
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
        check_int("DiskConfig.num_blocks", self.num_blocks, 1, 1 << 40)
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
        check_int("DiskConfig.io_threads", self.io_threads, 1, MAX_IO_THREADS)
        if self.checksum_threads is not None:
            check_int("DiskConfig.checksum_threads", self.checksum_threads, 1, MAX_IO_THREADS)
        check_int("DiskConfig.io_bytes", self.io_bytes, PAGE_BYTES, MAX_IO_BYTES)
        if self.io_bytes % PAGE_BYTES:
            raise InvalidArgumentError(
                f"DiskConfig.io_bytes = {self.io_bytes} must be a multiple of {PAGE_BYTES} (O_DIRECT)"
            )


def check_int(name: str, value: object, low: int, high: int) -> None:
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
        field = KIND_FIELDS.get(DiskErrorKind(kind))
        return int(getattr(self, field)) if field is not None else 0

    @property
    def write_gbps(self) -> float:
        """Bytes written over the summed write time, GB/s (0.0 before any)."""
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0

    @property
    def read_gbps(self) -> float:
        """Bytes read over the summed read time, GB/s (0.0 before any)."""
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


KIND_FIELDS: Final[dict[DiskErrorKind, str]] = {
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
