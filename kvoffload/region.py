"""RegionOwner: the host pool's memory, from mapping to unmapping.

Owns: one memory mapping (anonymous, or of a shared file under ``/dev/shm``), its file descriptor
and file name (until unlinked), and the host registrations (pinning) of the record area.
Borrows: the :class:`~kvoffload.bindings.pinning.HostPinner` that registers memory with the device.

``create`` maps, populates (``MAP_POPULATE``: registration of pre-faulted memory is ~7x faster; an
anonymous pool is private memory that a forked child sees as zero pages, see :func:`_map`),
pins in chunks (record-aligned, at most ``PIN_CHUNK_BYTES`` each, rolled back in reverse on failure)
and makes the record view. Each step registers its undo; on any failure the undos run and nothing
leaks.

``cleanup`` runs exactly once, in this order: unpin every chunk, drop the views it made, unmap,
close the file, unlink the file (if still linked). It marks itself released before the first
release call, so a failing release is never retried. It never unmaps memory that may still be
registered: when an unpin fails the mapping is left in place (and reported). A view still referenced
by the caller at cleanup never becomes a tensor over unmapped memory: the unmap is then deferred to
the moment the last view is dropped (CPython refuses to unmap a buffer that is still exported), and
a ``ResourceWarning`` says so.

A shared region is unlinked as soon as every participant has mapped it, so a killed process leaves no
file behind. The file starts with one header page (magic, sizes, participant count, mapped count);
attaching participants update the mapped count under ``flock``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import re
import struct
import warnings
from typing import Final

import torch

from kvoffload.bindings.pinning import PIN_CHUNK_BYTES, HostPinner, pin_chunks, unpin_chunks
from kvoffload.errors import ClosedError, InvalidArgumentError, RegionError, ShutdownError, warn_on_del

__all__ = ["SHM_DIR", "RegionOwner", "check_host_memory", "host_memory_available"]

_log = logging.getLogger("kvoffload.region")

#: Where shared regions live (a tmpfs on Linux).
SHM_DIR: Final = "/dev/shm"
#: Bytes before the record area of a shared file: one OS page holding the header.
SHARED_HEADER_BYTES: Final = 4096
_SHARED_MAGIC: Final = b"KVOFFREG"
_SHARED_VERSION: Final = 1
_HEADER_FORMAT: Final = "<8sIIQQII"  # magic, version, pad, num_records, record_bytes, participants, mapped
_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_FILE_MODE: Final = 0o600
#: ``madvise`` advice that gives a forked child zero pages in a range instead of the parent's
#: (Linux 4.14; the kernel's value where ``mmap`` does not name it).
_MADV_WIPEONFORK: Final = int(getattr(mmap, "MADV_WIPEONFORK", 18))
#: Mappings that must never be unmapped (an unpin failed); kept referenced for the process lifetime.
_LEFT_MAPPED: list[mmap.mmap] = []


def _mapping_address(mm: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # release the export at once so that close() is not refused because of it


class RegionOwner:
    """The host pool's mapping and pinning (see the module docstring for the full contract).

    Attributes:
        num_records: host records in the pool.
        record_bytes: bytes per record (a multiple of 4096).
        base_ptr: address of record 0.
        shared_path: the shared file's path, or None for an anonymous region.
    """

    def __init__(
        self,
        *,
        mapping: mmap.mmap,
        base_ptr: int,
        num_records: int,
        record_bytes: int,
        pinner: HostPinner,
        chunks: list[tuple[int, int]],
        fd: int | None,
        shared_path: str | None,
        linked: bool,
        records: torch.Tensor,
    ) -> None:
        self.num_records = num_records
        self.record_bytes = record_bytes
        self.base_ptr = base_ptr
        self.shared_path = shared_path
        self._mapping: mmap.mmap | None = mapping
        self._pinner = pinner
        self._chunks = chunks
        self._fd = fd
        self._linked = linked
        self._records: torch.Tensor | None = records
        self._released = False

    # ---------------------------------------------------------------------------------- creation

    @classmethod
    def create(
        cls,
        *,
        num_records: int,
        record_bytes: int,
        pinner: HostPinner,
        shared_name: str | None = None,
        participants: int = 1,
        chunk_bytes: int = PIN_CHUNK_BYTES,
        check_memory: bool = True,
    ) -> RegionOwner:
        """Map, populate and pin a pool of ``num_records`` records of ``record_bytes`` bytes.

        With ``shared_name`` the pool is a file ``/dev/shm/<shared_name>`` (created exclusively) that
        ``participants`` processes map; the creator counts as the first. The file is unlinked as soon
        as all of them mapped it (at once when ``participants`` is 1).

        With ``check_memory`` (the default) the pool's size is first checked against the memory the
        machine can give (:func:`host_memory_available`): a pool that cannot fit is refused before
        anything is mapped, instead of being killed by the kernel while it is populated. Pass False
        only where the kernel under-reports what it can give (a VM whose memory grows on use).

        Raises:
            InvalidArgumentError: non-positive sizes, a record size that is not a multiple of 4096,
                a malformed shared name, or ``participants < 1``.
            RegionError: the pool does not fit the memory available (the message gives both
                numbers), the file exists or mapping failed; nothing is left behind.
            KVOffloadError: pinning failed (e.g. :class:`~kvoffload.errors.CudaError`); nothing is
                left pinned, mapped or linked.
        """
        _check_sizes(num_records, record_bytes, chunk_bytes)
        if shared_name is not None:
            _check_shared_name(shared_name)
        if isinstance(participants, bool) or not isinstance(participants, int) or participants < 1:
            raise InvalidArgumentError(f"participants = {participants!r} must be an int >= 1")
        pool_bytes = num_records * record_bytes
        if check_memory:
            check_host_memory(pool_bytes, f"a host pool of {num_records} records of {record_bytes} bytes")
        with contextlib.ExitStack() as undo:
            fd: int | None = None
            path: str | None = None
            header = 0
            if shared_name is not None:
                path = os.path.join(SHM_DIR, shared_name)
                header = SHARED_HEADER_BYTES
                fd = _create_file(path, header + pool_bytes)
                undo.callback(os.close, fd)
                undo.callback(_unlink_quietly, path)
            mapping = _map(fd, header + pool_bytes)
            undo.callback(mapping.close)
            address = _mapping_address(mapping)
            linked = path is not None
            if path is not None:
                struct.pack_into(
                    _HEADER_FORMAT, mapping, 0, _SHARED_MAGIC, _SHARED_VERSION, 0,
                    num_records, record_bytes, participants, 1,
                )
                if participants == 1:
                    _unlink_quietly(path)
                    linked = False
            chunk = _record_aligned_chunk(chunk_bytes, record_bytes)
            chunks = pin_chunks(pinner, address + header, pool_bytes, chunk)
            undo.callback(unpin_chunks, pinner, chunks)
            records = _records_view(mapping, header, num_records, record_bytes)
            undo.pop_all()
        return cls(
            mapping=mapping, base_ptr=address + header, num_records=num_records,
            record_bytes=record_bytes, pinner=pinner, chunks=chunks, fd=fd, shared_path=path,
            linked=linked, records=records,
        )

    @classmethod
    def attach(
        cls, shared_name: str, *, pinner: HostPinner, chunk_bytes: int = PIN_CHUNK_BYTES
    ) -> RegionOwner:
        """Map and pin a shared region another process created, as one more participant.

        The participant that completes the count unlinks the file.

        Raises:
            InvalidArgumentError: a malformed name.
            RegionError: no such region, a foreign file, or every participant already attached.
            KVOffloadError: pinning failed; nothing is left pinned or mapped.
        """
        _check_shared_name(shared_name)
        path = os.path.join(SHM_DIR, shared_name)
        with contextlib.ExitStack() as undo:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise RegionError(f"cannot open shared region {path!r}: {exc.strerror}") from exc
            undo.callback(os.close, fd)
            size = os.fstat(fd).st_size
            if size < SHARED_HEADER_BYTES:
                raise RegionError(f"{path!r} is not a kvoffload region ({size} bytes)")
            mapping = _map(fd, size)
            undo.callback(mapping.close)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                magic, version, _pad, num_records, record_bytes, participants, mapped = (
                    struct.unpack_from(_HEADER_FORMAT, mapping, 0)
                )
                if magic != _SHARED_MAGIC or version != _SHARED_VERSION:
                    raise RegionError(f"{path!r} is not a kvoffload region of version {_SHARED_VERSION}")
                if SHARED_HEADER_BYTES + num_records * record_bytes != size:
                    raise RegionError(f"{path!r} has {size} bytes, its header says otherwise")
                if mapped >= participants:
                    raise RegionError(
                        f"{path!r}: all {participants} participants already attached"
                    )
                mapped += 1
                struct.pack_into("<I", mapping, struct.calcsize(_HEADER_FORMAT) - 4, mapped)
                linked = True
                if mapped == participants:
                    _unlink_quietly(path)
                    linked = False
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            address = _mapping_address(mapping)
            chunk = _record_aligned_chunk(chunk_bytes, record_bytes)
            pool_bytes = num_records * record_bytes
            chunks = pin_chunks(pinner, address + SHARED_HEADER_BYTES, pool_bytes, chunk)
            undo.callback(unpin_chunks, pinner, chunks)
            records = _records_view(mapping, SHARED_HEADER_BYTES, num_records, record_bytes)
            undo.pop_all()
        return cls(
            mapping=mapping, base_ptr=address + SHARED_HEADER_BYTES, num_records=num_records,
            record_bytes=record_bytes, pinner=pinner, chunks=chunks, fd=fd, shared_path=path,
            linked=linked, records=records,
        )

    # ------------------------------------------------------------------------------------ access

    @property
    def released(self) -> bool:
        """True once :meth:`cleanup` or :meth:`abandon` ran."""
        return self._released

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """``(start, nbytes)`` of every pinned chunk, in registration order."""
        return tuple(self._chunks)

    @property
    def chunk_records(self) -> int:
        """Records per pin chunk (a copy never crosses a chunk boundary)."""
        return self._chunks[0][1] // self.record_bytes if self._chunks else self.num_records

    def records(self) -> torch.Tensor:
        """The pool as ``uint8 [num_records, record_bytes]``, sharing the mapping's memory.

        Raises:
            ClosedError: after cleanup.
        """
        if self._released or self._records is None:
            raise ClosedError("the host region was released")
        return self._records

    # ----------------------------------------------------------------------------------- release

    def cleanup(self) -> None:
        """Release everything, exactly once, in the order of the module docstring.

        A second call does nothing. Every step runs even when an earlier one failed, except the
        unmap, which is skipped (the mapping kept for the process lifetime) when an unpin failed.

        Raises:
            ShutdownError: after all steps ran, carrying every failure; ``region_left_mapped`` is set
                when the mapping was kept because an unpin failed.
        """
        if self._released:
            return
        self._released = True
        failures: list[BaseException] = list(unpin_chunks(self._pinner, self._chunks))
        self._chunks = []
        self._records = None
        left_mapped = bool(failures)
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            if left_mapped:
                _LEFT_MAPPED.append(mapping)
                _log.error("host region kept mapped: %d chunk(s) failed to unpin", len(failures))
            else:
                self._unmap(mapping)
        self._close_file(failures)
        if failures:
            raise ShutdownError(
                "host region cleanup failed", failures, region_left_mapped=left_mapped
            )

    def abandon(self) -> None:
        """Give up the region without touching its memory: it stays pinned and mapped for the rest of
        the process (used when the device could not be proven idle). The file name is still unlinked,
        so nothing outlives the process. Runs once, like :meth:`cleanup`; never raises.
        """
        if self._released:
            return
        self._released = True
        self._records = None
        if self._mapping is not None:
            _LEFT_MAPPED.append(self._mapping)
            self._mapping = None
        failures: list[BaseException] = []
        self._close_file(failures, keep_fd=True)
        for failure in failures:
            _log.error("abandoning host region: %s", failure)

    def _unmap(self, mapping: mmap.mmap) -> None:
        try:
            mapping.close()
        except BufferError:
            # A caller still holds a view: unmapping now would leave it over freed memory. CPython
            # unmaps when the last view is gone; the registration is already released.
            warnings.warn(
                "a view of the host region is still referenced at cleanup; the mapping is released "
                "when the last view is dropped",
                ResourceWarning,
                stacklevel=3,
            )

    def _close_file(self, failures: list[BaseException], keep_fd: bool = False) -> None:
        if self._fd is not None and not keep_fd:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as exc:
                failures.append(exc)
        if self._linked and self.shared_path is not None:
            self._linked = False
            try:
                os.unlink(self.shared_path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                failures.append(exc)

    __del__ = warn_on_del(
        "_released",
        "RegionOwner was never cleaned up; call cleanup() (its memory stays pinned until "
        "the process exits)"
    )


#: Where the kernel reports the memory it can give, and the cgroup (v2, then v1) limits.
PROC_MEMINFO: Final = "/proc/meminfo"
CGROUP_ROOT: Final = "/sys/fs/cgroup"


def host_memory_available(
    meminfo: str = PROC_MEMINFO, cgroup_root: str = CGROUP_ROOT
) -> tuple[int, str] | None:
    """The bytes of memory this process can still populate, and where that figure comes from.

    The smaller of the kernel's ``MemAvailable`` and the room left under this process's cgroup memory
    limit (v2 ``memory.max - memory.current``, else v1 ``memory.limit_in_bytes -
    memory.usage_in_bytes``). None when neither can be read (not Linux).
    """
    found: list[tuple[int, str]] = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file, name in (
        ("memory.max", "memory.current", "cgroup memory.max"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "cgroup memory limit"),
    ):
        try:
            with open(os.path.join(cgroup_root, limit_file)) as f:
                limit_text = f.read().strip()
            with open(os.path.join(cgroup_root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text != "max" and int(limit_text) < 1 << 60:  # v1 reports "no limit" as ~2**63
            found.append((max(0, int(limit_text) - usage), name))
        break
    return min(found) if found else None


def check_host_memory(nbytes: int, what: str) -> None:
    """Refuse ``nbytes`` of new host memory when the machine cannot give it (see
    :func:`host_memory_available`).

    Raises:
        RegionError: naming ``what``, its size and the memory available.
    """
    available = host_memory_available()
    if available is not None and nbytes > available[0]:
        raise RegionError(
            f"{what} needs {nbytes / 2**30:.2f} GiB, but this machine can give "
            f"{available[0] / 2**30:.2f} GiB ({available[1]}); ask for fewer host blocks (or pass "
            "check_memory=False where the kernel under-reports the memory it can give)"
        )


def _check_sizes(num_records: int, record_bytes: int, chunk_bytes: int) -> None:
    for name, value in (("num_records", num_records), ("record_bytes", record_bytes),
                        ("chunk_bytes", chunk_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidArgumentError(f"{name} = {value!r} must be a positive int")
    if record_bytes % mmap.PAGESIZE:
        raise InvalidArgumentError(
            f"record_bytes = {record_bytes} must be a multiple of the OS page size {mmap.PAGESIZE}"
        )


def _check_shared_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
        raise InvalidArgumentError(
            f"shared_name = {name!r} must be 1-200 characters of letters, digits, '.', '_' or '-', "
            "not starting with '.', '_' or '-'"
        )


def _record_aligned_chunk(chunk_bytes: int, record_bytes: int) -> int:
    return max(1, chunk_bytes // record_bytes) * record_bytes


def _create_file(path: str, nbytes: int) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    except FileExistsError as exc:
        raise RegionError(f"shared region {path!r} already exists") from exc
    except OSError as exc:
        raise RegionError(f"cannot create shared region {path!r}: {exc.strerror}") from exc
    try:
        os.ftruncate(fd, nbytes)
    except OSError as exc:
        os.close(fd)
        _unlink_quietly(path)
        raise RegionError(f"cannot size shared region {path!r} to {nbytes} bytes: {exc.strerror}") from exc
    return fd


def _map(fd: int | None, nbytes: int) -> mmap.mmap:
    """Map and populate ``nbytes``: of the file ``fd`` (shared), or anonymous memory.

    An anonymous pool is private memory (populated several times faster than shared anonymous
    memory, which the kernel backs with shmem pages, and eligible for transparent huge pages),
    marked ``MADV_WIPEONFORK``: a forked child sees the range as fresh zero pages, so a fork neither
    copies the pinned pool nor shares its pages copy-on-write (which would move this process's
    writes away from the pages the device reads). The child keeps a mapping of its own at that
    address, so its unmap there (a copied object being freed) touches nothing else.
    """
    shared = fd is not None
    flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | getattr(mmap, "MAP_POPULATE", 0)
    try:
        mapping = mmap.mmap(-1 if fd is None else fd, nbytes, flags=flags,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        raise RegionError(f"cannot map {nbytes} bytes of host memory: {exc}") from exc
    if not shared:
        try:
            mapping.madvise(_MADV_WIPEONFORK)
        except OSError as exc:
            mapping.close()
            raise RegionError(f"cannot keep the host pool out of child processes: {exc}") from exc
    return mapping


def _records_view(mapping: mmap.mmap, offset: int, num_records: int, record_bytes: int) -> torch.Tensor:
    # The view keeps a memoryview of the mapping alive; CPython then refuses to unmap it early.
    flat = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)
    return flat[offset : offset + num_records * record_bytes].view(num_records, record_bytes)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
