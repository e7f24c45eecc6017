"""The disk tier's file format: the file header, the record header, and how a file is opened.

Version 1; little-endian; every offset and size a multiple of 4096 (docs/design.md §9)::

    offset 0             file header page (4096 B): magic "KVOFDISK", version, record_bytes,
                         num_blocks, slot_bytes, data_offset, file_id (random, new at every
                         creation), the layout fingerprint (UTF-8), and at byte 4092 the CRC32 of
                         the page's first 4092 bytes
    4096 + b * slot      the slot of disk block b, slot = 4096 + record_bytes bytes: one record
                         in the format of :mod:`kvoffload._record` (header page with flags VALID
                         and CHECKSUM, the file id, disk block b, generation, payload CRC32 and key;
                         then the host record, byte for byte)

Opening (:func:`prepare_file`): a missing or zero-length file is created — header first, then
sized, so a crash leaves an empty file or a valid tier; a file with a tier header is reused or
recreated as the config says; **any other file is refused, never overwritten**.

A record is checked (:meth:`RecordCodec.verify`) against the index on every read, by the one
verification every tier uses (:func:`kvoffload._record.verify_record`): the header's magic, CRC,
version and VALID flag, the file id, payload size, the block id, the generation the index expects,
then the payload's CRC32 when the record was written with one.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import fcntl
import logging
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Final, cast

import attrs
import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

from kvoffload import _record as record
from kvoffload.disk.config import PAGE_BYTES, DiskConfig, DiskErrorKind
from kvoffload.errors import (
    ArgumentTypeError,
    DiskError,
    DiskFormatError,
    DiskIntegrityError,
    DiskInUseError,
    DiskIOError,
    DiskPathError,
    DuplicateKeyError,
    InvalidArgumentError,
    KeyTypeError,
)

__all__ = [
    "FILE_MODE",
    "FORMAT_VERSION",
    "MAX_KEY_BYTES",
    "MAX_SYSCALL_BYTES",
    "FileState",
    "RecordCodec",
    "aligned",
    "buf",
    "check_fingerprint",
    "check_keys",
    "check_path",
    "clear_records",
    "close_file",
    "close_quietly",
    "file_bytes",
    "keep_from_children",
    "lock_file",
    "mark_clean",
    "open_io_fd",
    "os_kind",
    "prepare_file",
    "span",
    "unlink_quietly",
]

_log = logging.getLogger("kvoffload.disk")

U8Array = npt.NDArray[np.uint8]

#: Version of the file format this module writes and reads.
FORMAT_VERSION: Final = 1
#: Linux moves at most this many bytes per read/write system call.
MAX_SYSCALL_BYTES: Final = 0x7FFFF000
#: Longest key a record header stores; longest layout fingerprint a file header stores.
MAX_KEY_BYTES: Final = record.MAX_KEY_BYTES
MAX_FINGERPRINT_BYTES: Final = record.MAX_FINGERPRINT_BYTES
check_fingerprint = record.check_fingerprint
FILE_MODE: Final = 0o600
_CRC_OFFSET: Final = PAGE_BYTES - 4
_FILE_MAGIC: Final = b"KVOFDISK"
# magic, version, reserved, record_bytes, num_blocks, slot_bytes, data_offset, file_id, fingerprint len
_FILE_HEADER: Final = struct.Struct("<8sIIQQQQQH")
_CRC: Final = struct.Struct("<I")
#: The file header's flags (its third field, zero in every file written before they existed).
#: CLEAN: the tier that last had the file shut down with every write completed and none failed.
_FILE_CLEAN: Final = 1


@attrs.frozen
class FileState:
    """What opening a tier file found or made on disk."""

    file_id: int
    reused: bool
    recreated: bool
    note: str
    fingerprint_mismatch: bool
    found_bytes: int = 0  # the file's size when it was opened (a reused file may be extended)
    cut_records: int = 0  # records the old end cut, whose headers were cleared before the extension
    clean: bool = False  # reused: the last tier on the file shut down cleanly (the mark now cleared)


@attrs.frozen
class RecordCodec:
    """Packs, parses and verifies the records of one tier file (its file id and record size), in the
    one record format of :mod:`kvoffload._record` (a disk record carries its file id and disk block;
    the layout fingerprint is in the file header, not in the record).

    Owns nothing; every method works on buffers it is given.
    """

    file_id: int
    record_bytes: int
    path: str

    def slot_offset(self, block: int) -> int:
        """Byte offset of disk block ``block``'s slot (its header page)."""
        return PAGE_BYTES + block * (PAGE_BYTES + self.record_bytes)

    def pack(self, page: U8Array, block: int, generation: int, crc: int, key: bytes,
             checksum: bool) -> None:
        """Write the header of one record into ``page`` (4096 zeroed-then-filled bytes)."""
        record.pack_header(page, file_id=self.file_id, block=block, generation=generation, crc=crc,
                           payload_bytes=self.record_bytes, key=key, checksum=checksum)

    def parse(self, headers: U8Array, offset: int) -> tuple[int, int, int, int, bytes] | str:
        """``(flags, block, generation, payload crc, key)`` of a record header of this file, or why it
        is not one."""
        header = record.parse_header(headers[offset : offset + PAGE_BYTES])
        if isinstance(header, str):
            return header
        if header.file_id != self.file_id or header.fingerprint is not None:
            return "the record belongs to another tier file (file id differs)"
        if header.payload_bytes != self.record_bytes:
            return (f"the record header says {header.payload_bytes} payload bytes, the tier has "
                    f"{self.record_bytes}")
        return header.flags, header.block, header.generation, header.crc, header.key

    def header_is_valid(self, flags: int) -> bool:
        """Whether parsed header flags mark the record valid."""
        return bool(flags & record.FLAG_VALID)

    def has_checksum(self, flags: int) -> bool:
        """Whether parsed header flags say the record was written with its payload's CRC32."""
        return bool(flags & record.FLAG_CHECKSUM)

    def has_magic(self, page: U8Array) -> bool:
        """Whether ``page`` starts like a record header (a damaged one counts as rejected)."""
        return record.has_magic(page)

    def verify(
        self, headers: U8Array, i: int, payload: U8Array, block: int, valid: bool, expected: int,
        require_checksum: bool, key: bytes | None = None,
    ) -> DiskIntegrityError | None:
        """Check record ``i`` of a read against the index (:func:`kvoffload._record.verify_record`,
        after the index's own VALID bit); None when it verified. A record written with a checksum
        has it checked whatever the reading tier's setting (a tier with ``checksum=False`` may read
        records a tier with ``checksum=True`` wrote, and a crash may have cut them); with
        ``require_checksum`` one written without does not verify; with ``key``, one whose header
        names another key does not either (``KEY_MISMATCH``: a valid record, of another key)."""
        where = f"disk block {block} of {self.path!r}"
        if not valid:
            return self._integrity(
                DiskErrorKind.NOT_VALID, block,
                f"{where} holds no valid record (never written, or its last write failed)",
            )
        verdict = record.verify_record(
            headers[i * PAGE_BYTES : (i + 1) * PAGE_BYTES], payload,
            record.Expected(payload_bytes=self.record_bytes, file_id=self.file_id, block=block,
                            generation=expected, check_payload=True,
                            require_checksum=require_checksum, key=key),
        )
        if verdict.fault is None:
            return None
        kind = _DISK_KINDS.get(verdict.fault, DiskErrorKind.HEADER_INVALID)
        return self._integrity(kind, block, f"{where}: {verdict.message}")

    def _integrity(self, kind: DiskErrorKind, block: int, message: str) -> DiskIntegrityError:
        return DiskIntegrityError(message, kind=kind, path=self.path, blocks=(block,))


#: The disk kind of each record fault (a size, key or fingerprint fault is a header the file does
#: not expect).
_DISK_KINDS: Final = {
    record.RecordFault.BLOCK_MISMATCH: DiskErrorKind.BLOCK_MISMATCH,
    record.RecordFault.GENERATION_MISMATCH: DiskErrorKind.GENERATION_MISMATCH,
    record.RecordFault.CHECKSUM_MISMATCH: DiskErrorKind.CHECKSUM_MISMATCH,
    record.RecordFault.KEY_MISMATCH: DiskErrorKind.KEY_MISMATCH,
}


def aligned(nbytes: int) -> U8Array:
    """A zeroed, page-aligned buffer (O_DIRECT needs aligned memory)."""
    raw = np.zeros(nbytes + PAGE_BYTES, dtype=np.uint8)
    shift = (-raw.ctypes.data) % PAGE_BYTES
    return raw[shift : shift + nbytes]


def buf(array: U8Array) -> Buffer:
    """A numpy array as a buffer for os, zlib and struct (numpy's stubs do not declare one)."""
    return cast(Buffer, array)


def span(first: int, n: int) -> str:
    return str(first) if n == 1 else f"{first}..{first + n - 1}"


def os_kind(code: int | None) -> DiskErrorKind:
    if code == errno_codes.EIO:
        return DiskErrorKind.EIO
    if code == errno_codes.ENOSPC:
        return DiskErrorKind.ENOSPC
    return DiskErrorKind.OS_ERROR


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def close_file(fd: int) -> None:
    """Close ``fd``, forgetting it as a tier file's descriptor (:func:`lock_file`,
    :func:`keep_from_children`) in the same step: no fork comes between the two (a child forked
    after the forgetting and before the close would keep a copy of the lock that nobody lets go of;
    forgotten after the close, the number's next owner's entry could be the one forgotten).

    Raises:
        OSError: the close failed (the descriptor is gone all the same).
    """
    with _no_fork():
        _LOCKED.pop(fd, None)
        os.close(fd)


def close_quietly(fd: int) -> None:
    """:func:`close_file`, its error ignored."""
    with contextlib.suppress(OSError):
        close_file(fd)


def file_bytes(num_blocks: int, record_bytes: int) -> int:
    return PAGE_BYTES + num_blocks * (PAGE_BYTES + record_bytes)


def check_keys(keys: object, count: int, *, unique: bool = False) -> list[bytes] | None:
    """The record keys of a disk request, one per disk block (None: none); with ``unique`` (a
    write: two records of one key would leave a warm restart only the newer) each key once.

    Raises:
        KeyTypeError: not a sequence of bytes.
        InvalidArgumentError: miscounted, or a key too long.
        DuplicateKeyError: with ``unique``, a key twice.
    """
    if keys is None:
        return None
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise KeyTypeError(
            f"keys must be a sequence of bytes (one per disk block), got {type(keys).__name__}"
        )
    if len(keys) != count:
        raise InvalidArgumentError(f"keys has {len(keys)} entries but disk_blocks has {count}")
    out: list[bytes] = []
    seen: set[bytes] = set()
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise KeyTypeError(f"keys[{i}] = {key!r} is a {type(key).__name__}, not bytes")
        if len(key) > MAX_KEY_BYTES:
            raise InvalidArgumentError(f"keys[{i}] has {len(key)} bytes; at most {MAX_KEY_BYTES}")
        if unique:
            if key in seen:
                raise DuplicateKeyError(f"keys[{i}] = {key!r:.80} appears twice in one write")
            seen.add(key)
        out.append(key)
    return out


def check_path(path: str) -> None:
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


def prepare_file(fd: int, config: DiskConfig, fingerprint: bytes, record_bytes: int) -> FileState:
    """Check an existing file against the config and reuse, extend or (re)create it."""
    path = config.path
    expected = file_bytes(config.num_blocks, record_bytes)
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
        clean = bool(_FILE_HEADER.unpack_from(first, 0)[2] & _FILE_CLEAN)
        if clean:  # from here on writes may be cut by a crash: the mark goes first, durably
            mark_clean(fd, config.path, False)
        note = ""
        cut = 0
        if size < expected:
            cut = _clear_cut_record(fd, config, record_bytes, size)
            _size_file(fd, config, expected)
            note = (f"the file was {size} bytes, {expected} expected: extended; records past the "
                    "old end are not valid")
        return FileState(file_id=file_id, reused=True, recreated=False, note=note,
                          fingerprint_mismatch=False, found_bytes=size, cut_records=cut, clean=clean)
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


def mark_clean(fd: int, path: str, clean: bool) -> None:
    """Set or clear the file header's CLEAN flag and make it durable (``fd`` may be an O_DIRECT
    descriptor: the page goes through an aligned buffer).

    A record written without a checksum cannot tell a write a crash cut short from a whole one, so
    a warm restart lists such records only from a file whose last tier shut down cleanly
    (docs/design.md §9.4): the flag is cleared when a tier opens the file, before any write, and set
    by its shutdown once every write completed and none failed.

    Setting it syncs the file's data first, then the flag: the flag is never on the disk before
    the records it vouches for.

    Raises:
        DiskIOError: the header cannot be read or written.
    """
    page = aligned(PAGE_BYTES)
    try:
        if clean:
            os.fdatasync(fd)
        got = os.preadv(fd, [buf(page)], 0)
        if got != PAGE_BYTES:
            raise DiskIOError(f"reading the header of {path!r} returned {got} of {PAGE_BYTES} bytes",
                              kind=DiskErrorKind.SHORT_READ, path=path)
        view = buf(page)
        fields = list(_FILE_HEADER.unpack_from(view, 0))
        fields[2] = (fields[2] | _FILE_CLEAN) if clean else (fields[2] & ~_FILE_CLEAN)
        _FILE_HEADER.pack_into(view, 0, *fields)
        _CRC.pack_into(view, _CRC_OFFSET, zlib.crc32(page[:_CRC_OFFSET].tobytes()))
        written = os.pwritev(fd, [buf(page)], 0)
        os.fdatasync(fd)
    except OSError as exc:
        raise DiskIOError(f"cannot mark the header of {path!r}: {exc.strerror}",
                          kind=os_kind(exc.errno), path=path, errno=exc.errno) from None
    if written != PAGE_BYTES:
        raise DiskIOError(f"marking the header of {path!r} wrote {written} of {PAGE_BYTES} bytes",
                          kind=DiskErrorKind.SHORT_WRITE, path=path)


def clear_records(fd: int, path: str, blocks: Sequence[int], slot_offset: Callable[[int], int]) -> None:
    """Clear the header pages of ``blocks`` (at ``slot_offset(block)``) and make it durable, so that
    no later warm restart lists them (``fd`` may be an O_DIRECT descriptor).

    Raises:
        DiskIOError: a header cannot be written.
    """
    zeros = aligned(PAGE_BYTES)
    try:
        for block in blocks:
            written = os.pwritev(fd, [buf(zeros)], slot_offset(block))
            if written != PAGE_BYTES:
                raise DiskIOError(
                    f"clearing the header of disk block {block} of {path!r} wrote {written} of "
                    f"{PAGE_BYTES} bytes", kind=DiskErrorKind.SHORT_WRITE, path=path, blocks=(block,),
                )
        os.fdatasync(fd)
    except OSError as exc:
        raise DiskIOError(f"cannot clear record headers of {path!r}: {exc.strerror}",
                          kind=os_kind(exc.errno), path=path, errno=exc.errno) from None


def _clear_cut_record(fd: int, config: DiskConfig, record_bytes: int, size: int) -> int:
    """Before a cut-short file is extended: clear the header of the record whose slot its end falls
    inside (its header whole, its payload cut), and make that durable before the extension. Returns
    how many it cleared (0 or 1).

    Why: the extension fills the cut payload's tail with zeros, and the slot, whole again, would be
    listed by the next warm restart with a payload that is not the one written (read back as
    ``checksum_mismatch``, or served with ``checksum=False``).

    Raises:
        DiskIOError: the header cannot be cleared.
    """
    slot = PAGE_BYTES + record_bytes
    block = (size - PAGE_BYTES) // slot
    start = PAGE_BYTES + block * slot
    if size <= PAGE_BYTES or block >= config.num_blocks or not start + PAGE_BYTES <= size < start + slot:
        return 0
    clear_records(fd, config.path, [block], lambda b: PAGE_BYTES + b * slot)
    return 1


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
) -> FileState:
    """Empty the file, write its header and make it durable, then size it: a crash at any point
    leaves an empty file (created again) or a tier whose records are not valid yet — never a file
    that is not a tier (sized before its header reached the disk, the file could be left with its
    whole size and a first page of zeros, which is never overwritten)."""
    expected = file_bytes(config.num_blocks, record_bytes)
    try:
        os.ftruncate(fd, 0)
    except OSError as exc:
        raise DiskIOError(f"cannot empty {config.path!r}: {exc.strerror}", kind=os_kind(exc.errno),
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
                          kind=os_kind(exc.errno), path=config.path, errno=exc.errno) from None
    if written != PAGE_BYTES:
        raise DiskIOError(
            f"writing the header of {config.path!r} wrote {written} of {PAGE_BYTES} bytes",
            kind=DiskErrorKind.SHORT_WRITE, path=config.path,
        )
    try:
        os.fdatasync(fd)
    except OSError as exc:
        raise DiskIOError(f"cannot make the header of {config.path!r} durable: {exc.strerror}",
                          kind=os_kind(exc.errno), path=config.path, errno=exc.errno) from None
    _size_file(fd, config, expected)
    return FileState(file_id=file_id, reused=False, recreated=recreated, note=note,
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
            kind=os_kind(exc.errno), path=config.path, errno=exc.errno,
        ) from None


#: The descriptors of tier files in this process (the one that holds the lock, and the O_DIRECT one
#: beside it), with the file's (device, inode): a child forked without ``exec`` lets go of its
#: copies at once (:func:`_let_go_in_child`), so that the lock lives as long as the tier that took
#: it, not as long as the longest-lived child, and the child cannot write to the file (its copy of
#: the tier, shut down there, would otherwise mark the file clean while the parent writes).
_LOCKED: dict[int, tuple[int, int]] = {}
#: A lock found held within this long of this process's last fork is tried again (every
#: :data:`FORK_RETRY_S`) until that long after it (the fork before the first refusal: later ones do
#: not extend the retry): a child forked without ``exec`` holds a copy
#: of the tier's lock until it runs :func:`_let_go_in_child`, as it starts, which a loaded host may
#: schedule after the parent has shut its tier down and opened the file again (seen on a 2-core CI
#: machine). A lock held with no fork that recent is refused at once.
FORK_SETTLE_S: Final = 1.0
#: How long a fork, or a tier descriptor's close, waits for the other to finish (:func:`_no_fork`):
#: each takes microseconds, so a wait this long means a close hung in the kernel; the fork then goes
#: ahead (its child may keep that descriptor's copy of the lock) rather than wait without end.
FORK_GUARD_WAIT_S: Final = 1.0
#: Held across a tier descriptor's close and its forgetting (:func:`close_file`), and by a fork
#: from just before it until just after it, in the parent and in the child.
_FORK_GUARD = threading.Lock()
#: Per thread: whether the fork this thread is making holds :data:`_FORK_GUARD`.
_forking = threading.local()
FORK_RETRY_S: Final = 1e-3
#: ``time.monotonic()`` of this process's last fork (None: none yet).
_forked_at: float | None = None


def _forked() -> None:
    """In the parent, after a fork: when, for :func:`lock_file`."""
    global _forked_at
    _forked_at = time.monotonic()


@contextlib.contextmanager
def _no_fork() -> Iterator[None]:
    """No fork of this process starts while the block runs (unless the guard is not had within
    :data:`FORK_GUARD_WAIT_S`: the block then runs all the same)."""
    held = _FORK_GUARD.acquire(timeout=FORK_GUARD_WAIT_S)
    try:
        yield
    finally:
        if held:
            _FORK_GUARD.release()


def _before_fork() -> None:
    _forking.held = _FORK_GUARD.acquire(timeout=FORK_GUARD_WAIT_S)


def _after_fork() -> None:
    """In the parent and in the child: the guard the fork held, released."""
    if getattr(_forking, "held", False):
        _forking.held = False
        _FORK_GUARD.release()


def lock_file(fd: int, path: str) -> str:
    """Take the tier file's lock on ``fd`` (an exclusive ``flock``, without waiting, but tried again
    for a child forked moments ago: :data:`FORK_SETTLE_S`): held by the open file description until
    it is closed, so by the set-up descriptor, which the tier keeps for its life (a child forked
    without ``exec`` lets go of its copy: :func:`_let_go_in_child`); gone with its process. Returns
    "" when taken, or why the file system has no such lock (logged; the tier then opens without
    one). The caller closes ``fd`` with :func:`close_file` (or :func:`close_quietly`).

    Raises:
        DiskInUseError: another open tier, in this process or another, holds it.
    """
    st = os.fstat(fd)
    _LOCKED[fd] = (st.st_dev, st.st_ino)  # before the lock: a fork in between is let go of too
    until: float | None = None  # set at the first refusal: later forks do not move it
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if until is None:
                    forked_at = _forked_at
                    until = forked_at + FORK_SETTLE_S if forked_at is not None else 0.0
                if time.monotonic() >= until:
                    raise
                time.sleep(FORK_RETRY_S)  # a child forked moments ago may hold it until it starts
    except BlockingIOError:
        _LOCKED.pop(fd, None)
        raise DiskInUseError(
            f"{path!r} is in use by another open disk tier (in this process or another): two tiers "
            "on one file would serve each other's records; give each worker a file of its own, or "
            "shut the other down first",
            kind=DiskErrorKind.IN_USE, path=path,
        ) from None
    except OSError as exc:  # ENOLCK, EOPNOTSUPP, EINVAL: a file system without flock
        _LOCKED.pop(fd, None)
        _log.warning("disk tier %s: the file cannot be locked (%s); a second tier on it is not refused",
                     path, exc.strerror)
        return f"not locked: {exc.strerror}"
    except BaseException:  # (an interrupt in a retry's sleep): the caller forgets nothing yet
        _LOCKED.pop(fd, None)
        raise
    return ""


def keep_from_children(fd: int) -> None:
    """A tier's descriptor of its file besides the lock's (the O_DIRECT one): a child forked without
    ``exec`` points its copy at ``/dev/null`` too. The caller closes ``fd`` with :func:`close_file`
    (or :func:`close_quietly`)."""
    st = os.fstat(fd)
    _LOCKED[fd] = (st.st_dev, st.st_ino)


def _let_go_in_child() -> None:
    """In a child forked without ``exec``: point each descriptor of a tier file (the lock's, and the
    O_DIRECT one) at ``/dev/null``, so that the parent's tier, and only it, holds the lock and
    writes the file (the child cannot use the tier: its threads did not come along). The number
    stays taken, so the child's copy of the tier closes nothing else; a number that now names
    another file is left alone."""
    held = list(_LOCKED.items())
    _LOCKED.clear()
    for fd, ident in held:
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != ident:
                continue
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.dup2(null, fd, inheritable=False)
            finally:
                os.close(null)
        except OSError:
            continue


def _in_child() -> None:
    _after_fork()
    _let_go_in_child()


def _in_parent() -> None:
    _after_fork()
    _forked()


# The hooks look each function up at each fork: tests replace them.
os.register_at_fork(before=lambda: _before_fork(), after_in_child=lambda: _in_child(),
                    after_in_parent=lambda: _in_parent())


def open_io_fd(
    path: str, direct: bool | None, setup_fd: int, open_file: Callable[[str, int], int]
) -> tuple[int, bool, str]:
    """The descriptor the I/O threads use: O_DIRECT when asked (``direct=True``: or fail) or when the
    file system accepts it (``None``; probed with one aligned read), else ``setup_fd``; and why.

    Raises:
        DiskPathError: the file cannot be opened with O_DIRECT for another reason than EINVAL.
        DiskIOError: the probe read failed for another reason than EINVAL.
        DiskError: ``direct=True`` and O_DIRECT cannot be used.
    """
    if direct is False:
        return setup_fd, False, "buffered: DiskConfig.direct = False"
    o_direct = getattr(os, "O_DIRECT", 0)
    refused = ""
    if not o_direct:
        refused = "this platform has no O_DIRECT"
    else:
        try:
            fd = open_file(path, os.O_RDWR | os.O_CLOEXEC | o_direct)
        except OSError as exc:
            if exc.errno != errno_codes.EINVAL:
                raise DiskPathError(
                    f"cannot open DiskConfig.path = {path!r} with O_DIRECT: {exc.strerror}"
                ) from None
            refused = f"the file system refused O_DIRECT at open ({exc.strerror})"
        else:
            probe = aligned(PAGE_BYTES)
            try:
                got = os.preadv(fd, [buf(probe)], 0)
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno_codes.EINVAL:
                    raise DiskIOError(
                        f"the O_DIRECT probe read of {path!r} failed: {exc.strerror}",
                        kind=os_kind(exc.errno), path=path, errno=exc.errno,
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
