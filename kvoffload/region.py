"""RegionOwner: the host pool's memory, from mapping to unmapping.

Owns: one memory mapping (anonymous, or of a shared pool's file), the file's descriptor, and the
host registrations (pinning) of the record area.
Borrows: the :class:`~kvoffload.bindings.pinning.HostPinner` that registers memory with the device.

``create`` maps, populates (``MAP_POPULATE``: registration of pre-faulted memory is ~7x faster; an
anonymous pool is private memory that a forked child sees as zero pages, see :func:`_map`),
pins in chunks (whole records and whole OS pages, at most ``PIN_CHUNK_BYTES`` each, rolled back in
reverse on failure) and makes the record view. Each step registers its undo; on any failure the
undos run and nothing leaks.

``cleanup`` runs exactly once, in this order: unpin every chunk, drop the views it made, unmap,
close the file. It marks itself released before the first
release call, so a failing release is never retried. It never unmaps memory that may still be
registered: when an unpin fails the mapping is left in place (and reported). A view still referenced
by the caller at cleanup never becomes a tensor over unmapped memory: the unmap is then deferred to
the moment the last view is dropped (CPython refuses to unmap a buffer that is still exported), and
a ``ResourceWarning`` says so. Nor is memory unmapped by anything but ``cleanup``: a region dropped
without one (its worker never shut down, a copy perhaps still running) stays mapped and pinned for
the rest of the process (the module keeps its mapping referenced, :data:`_MAPPED`), rather than the
mapping object's own finalizer unmapping it under the copies.

A shared region (:meth:`RegionOwner.attach_shared`) is one rank's mapping of a pool every rank of
an engine maps (docs/design.md §13): the attach itself (join, agree, populate, unlink once all
mapped) is :class:`~kvoffload.pool.session.PoolSession`'s; the region owns this rank's mapping of
the whole pool, its pinning and the file descriptor, and sees its own slices as its records (one
record every ``record_stride`` bytes). Its cleanup is the same as above and touches nothing of the
other ranks: they keep their own mappings and registrations, and the kernel frees the memory when
the last mapping goes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import os
import time
import warnings
from typing import Final

import torch

from kvoffload.bindings.pinning import PIN_CHUNK_BYTES, HostPinner, PinRollbackError, pin_chunks, unpin_chunks
from kvoffload._memory import host_memory_available
from kvoffload.errors import ClosedError, InvalidArgumentError, RegionError, ShutdownError, warn_on_del
from kvoffload.layout import RECORD_ALIGN_BYTES
from kvoffload.pool.header import Flag, data_offset, mark_left
from kvoffload.pool.session import SHM_DIR, PoolSession
from kvoffload.pool.spec import PoolRank

__all__ = ["SHM_DIR", "RegionOwner", "check_host_memory", "check_shm_room", "host_memory_available"]

_log = logging.getLogger("kvoffload.region")

#: How long a rank's cleanup waits for its pool file's lock to mark itself as left (the mark is for
#: inspection only: a lock held that long, by a rank stopped inside a header update, is logged).
MARK_LEFT_WAIT_S: Final = 0.2
#: ``madvise`` advice that gives a forked child zero pages in a range instead of the parent's
#: (Linux 4.14; the kernel's value where ``mmap`` does not name it).
_MADV_WIPEONFORK: Final = int(getattr(mmap, "MADV_WIPEONFORK", 18))
#: Every region's mapping, by ``id``, from its creation until its cleanup unmaps it: a region
#: dropped without a cleanup (its worker never shut down, a copy thread perhaps still running) then
#: keeps its memory mapped and pinned for the rest of the process, as its warning says, instead of
#: the mapping's own finalizer unmapping it under the copies. A region abandoned, or whose unpin
#: failed, stays here for good too.
_MAPPED: dict[int, mmap.mmap] = {}


def _mapping_address(mm: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # release the export at once so that close() is not refused because of it


class RegionOwner:
    """The host pool's mapping and pinning (see the module docstring for the full contract).

    Attributes:
        num_records: host records in the pool (blocks of a shared pool).
        record_bytes: bytes per record (a multiple of 4096).
        record_stride: bytes from one record to the next: ``record_bytes``, or a shared pool's block
            (every rank's slice).
        base_ptr: address of record 0 (this rank's slice of block 0 of a shared pool).
        pool: the shared pool and rank this region maps, or None for an anonymous region.
        shared_path: the shared pool's file name (unlinked once every rank mapped it), or None.
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
        records: torch.Tensor,
        record_stride: int | None = None,
        pool: PoolRank | None = None,
        shared_path: str | None = None,
    ) -> None:
        self.num_records = num_records
        self.record_bytes = record_bytes
        self.record_stride = record_bytes if record_stride is None else record_stride
        self.base_ptr = base_ptr
        self.pool = pool
        self.shared_path = shared_path
        self._mapping: mmap.mmap | None = mapping
        _MAPPED[id(mapping)] = mapping
        self._pinner = pinner
        self._chunks = chunks
        self._fd = fd
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
        chunk_bytes: int = PIN_CHUNK_BYTES,
        check_memory: bool = True,
    ) -> RegionOwner:
        """Map, populate and pin an anonymous pool of ``num_records`` records of ``record_bytes``.

        With ``check_memory`` (the default) the pool's size is first checked against the memory the
        machine can give (:func:`host_memory_available`): a pool that cannot fit is refused before
        anything is mapped, instead of being killed by the kernel while it is populated. Pass False
        only where the kernel under-reports what it can give (a VM whose memory grows on use).

        Raises:
            InvalidArgumentError: non-positive sizes, or a record size that is not a multiple of 4096.
            RegionError: the pool does not fit the memory available (the message gives both
                numbers) or mapping failed; nothing is left behind.
            KVOffloadError: pinning failed (e.g. :class:`~kvoffload.errors.CudaError`); nothing is
                left pinned or mapped.
        """
        _check_sizes(num_records, record_bytes, chunk_bytes)
        pool_bytes = num_records * record_bytes
        if check_memory:
            check_host_memory(pool_bytes, f"a host pool of {num_records} records of {record_bytes} bytes")
        with contextlib.ExitStack() as undo:
            mapping = _map(pool_bytes)
            rollback = _Rollback(mapping)
            undo.callback(rollback.unmap)
            address = _mapping_address(mapping)
            chunk = _record_aligned_chunk(chunk_bytes, record_bytes)
            chunks = rollback.pin(pinner, address, pool_bytes, chunk)
            undo.callback(rollback.unpin, pinner, chunks)
            records = _records_view(mapping, 0, num_records, record_bytes, record_bytes)
            undo.pop_all()
        return cls(
            mapping=mapping, base_ptr=address, num_records=num_records, record_bytes=record_bytes,
            pinner=pinner, chunks=chunks, fd=None, records=records,
        )

    @classmethod
    def attach_shared(
        cls,
        rank: PoolRank,
        *,
        num_records: int,
        record_bytes: int,
        pinner: HostPinner,
        chunk_bytes: int = PIN_CHUNK_BYTES,
        check_memory: bool = True,
    ) -> RegionOwner:
        """Attach this process as ``rank`` of a shared pool; returns once every rank mapped it.

        The pool holds ``num_records`` blocks of ``world_size`` slices of ``record_bytes`` (every
        rank must ask for the same). This rank populates its share of the pages, maps the whole
        pool, pins it in whole-block chunks (the registration maps the pages the other ranks
        populated; without a device the first copies do), and sees its own slices as its records
        (a strided view: ``record_stride`` bytes from one record to the next). The steps and their barriers are
        :class:`~kvoffload.pool.session.PoolSession`'s, bounded by ``rank.pool.attach_timeout_s``.

        With ``check_memory`` the whole pool is first checked against the memory available and the
        room left in ``/dev/shm`` (populating past it would kill the process with ``SIGBUS``).

        Raises (nothing of this rank is left mapped, pinned or linked; a failure of this rank after
        it joined fails every rank):
            InvalidArgumentError: bad sizes.
            RegionError: the pool does not fit, or mapping failed; its subclasses
                (:class:`~kvoffload.errors.SharedPoolError`) for the attach itself: a deadline
                passed, a rank died or failed, the ranks disagree, or the name is another live
                pool's.
            KVOffloadError: pinning failed.
        """
        _check_sizes(num_records, record_bytes, chunk_bytes)
        world = rank.world_size
        pool_bytes = num_records * record_bytes * world
        what = (f"shared pool {rank.name!r} ({num_records} blocks of {world} x {record_bytes} "
                "bytes)")
        if check_memory:
            check_host_memory(pool_bytes, what)
            check_shm_room(pool_bytes, what)
        deadline = time.monotonic() + rank.pool.attach_timeout_s
        session = PoolSession.join(rank, num_records=num_records, record_bytes=record_bytes,
                                   deadline=deadline)
        with contextlib.ExitStack() as undo:
            undo.callback(session.fail)
            start = data_offset()  # the block area starts on a page
            mapping = _map_shared(session, start + pool_bytes)
            rollback = _Rollback(mapping)
            undo.callback(rollback.unmap)
            session.populate_share(mapping)
            session.arrive(Flag.POPULATED, deadline)
            session.wait_all(Flag.POPULATED, deadline)
            address = _mapping_address(mapping)
            block = record_bytes * world
            chunk = _record_aligned_chunk(chunk_bytes, block)
            chunks = rollback.pin(pinner, address + start, pool_bytes, chunk)
            undo.callback(rollback.unpin, pinner, chunks)
            session.arrive(Flag.MAPPED, deadline)
            session.wait_all(Flag.MAPPED, deadline)
            offset = start + rank.rank * record_bytes
            records = _records_view(mapping, offset, num_records, record_bytes, block)
            undo.pop_all()
        return cls(
            mapping=mapping, base_ptr=address + offset, num_records=num_records,
            record_bytes=record_bytes, pinner=pinner, chunks=chunks, fd=session.take_fd(),
            records=records, record_stride=block, pool=rank, shared_path=session.path,
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
        return self._chunks[0][1] // self.record_stride if self._chunks else self.num_records

    def records(self) -> torch.Tensor:
        """The pool as ``uint8 [num_records, record_bytes]``, sharing the mapping's memory (this
        rank's slices of a shared pool: rows ``record_stride`` bytes apart).

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
            if left_mapped:  # it stays in _MAPPED
                _log.error("host region kept mapped: %d chunk(s) failed to unpin", len(failures))
            else:
                del _MAPPED[id(mapping)]
                self._unmap(mapping)
        self._close_file(failures)
        if failures:
            raise ShutdownError(
                "host region cleanup failed", failures, region_left_mapped=left_mapped
            )

    def abandon(self) -> None:
        """Give up the region without touching its memory: it stays pinned and mapped for the rest of
        the process (used when the device could not be proven idle). A shared pool's name is already
        unlinked, so nothing outlives the process. Runs once, like :meth:`cleanup`; never raises.
        """
        if self._released:
            return
        self._released = True
        self._records = None
        self._mapping = None  # it stays in _MAPPED
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
            if self.pool is not None:
                try:
                    mark_left(fd, self.pool.rank, time.monotonic() + MARK_LEFT_WAIT_S)
                except OSError as exc:  # LockTimeout among them; the header is for inspection only
                    _log.warning("shared pool %r: could not mark rank %d as left: %s",
                                 self.pool.name, self.pool.rank, exc)
            try:
                os.close(fd)
            except OSError as exc:
                failures.append(exc)

    __del__ = warn_on_del(
        "_released",
        "RegionOwner was never cleaned up; call cleanup() (its memory stays pinned until "
        "the process exits)"
    )


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


class _Rollback:
    """A failed create's undo of its mapping and pinning: the mapping is unmapped only when every
    chunk was unregistered (a failed unregistration, here or in ``pin_chunks``' own rollback,
    keeps it mapped for the rest of the process, as :meth:`RegionOwner.cleanup` does)."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._mapping = mapping
        self._kept = False

    def pin(self, pinner: HostPinner, ptr: int, nbytes: int, chunk: int) -> list[tuple[int, int]]:
        """:func:`pin_chunks`; a rollback of its own that failed keeps the mapping."""
        try:
            return pin_chunks(pinner, ptr, nbytes, chunk)
        except PinRollbackError as exc:
            self._keep(exc)
            raise

    def unpin(self, pinner: HostPinner, chunks: list[tuple[int, int]]) -> None:
        """Unregister ``chunks``; a failure keeps the mapping."""
        failures = unpin_chunks(pinner, chunks)
        if failures:
            self._keep(failures)

    def unmap(self) -> None:
        """Unmap, unless a registration may remain."""
        if not self._kept:
            self._mapping.close()

    def _keep(self, why: object) -> None:
        self._kept = True
        _MAPPED[id(self._mapping)] = self._mapping
        _log.error("a host pool whose creation failed stays mapped for the rest of the process: "
                   "unregistering its memory failed (%s)", why)


def _check_sizes(num_records: int, record_bytes: int, chunk_bytes: int) -> None:
    for name, value in (("num_records", num_records), ("record_bytes", record_bytes),
                        ("chunk_bytes", chunk_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidArgumentError(f"{name} = {value!r} must be a positive int")
    if record_bytes % RECORD_ALIGN_BYTES:
        raise InvalidArgumentError(
            f"record_bytes = {record_bytes} must be a multiple of {RECORD_ALIGN_BYTES}"
        )


def _record_aligned_chunk(chunk_bytes: int, unit: int) -> int:
    """The pin chunk: whole ``unit`` s (records, or a shared pool's blocks: a copy never crosses a
    chunk) and whole OS pages (two registrations never share a page; on a host of 64 KiB pages a
    record of 4 KiB pages is not one), at most ``chunk_bytes`` where one such unit fits it."""
    step = math.lcm(unit, mmap.PAGESIZE)
    return max(1, chunk_bytes // step) * step


def _map(nbytes: int) -> mmap.mmap:
    """Map and populate ``nbytes`` of anonymous private memory.

    An anonymous pool is private memory (populated several times faster than shared anonymous
    memory, which the kernel backs with shmem pages, and eligible for transparent huge pages),
    marked ``MADV_WIPEONFORK``: a forked child sees the range as fresh zero pages, so a fork neither
    copies the pinned pool nor shares its pages copy-on-write (which would move this process's
    writes away from the pages the device reads). The child keeps a mapping of its own at that
    address, so its unmap there (a copied object being freed) touches nothing else.
    """
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        raise RegionError(f"cannot map {nbytes} bytes of host memory: {exc}") from exc
    try:
        mapping.madvise(_MADV_WIPEONFORK)
    except OSError as exc:
        mapping.close()
        raise RegionError(f"cannot keep the host pool out of child processes: {exc}") from exc
    return mapping


def _map_shared(session: PoolSession, nbytes: int) -> mmap.mmap:
    """Map ``nbytes`` of the pool's file, shared, without populating it (the ranks populate their
    shares first, see :meth:`PoolSession.populate_share`)."""
    try:
        return mmap.mmap(session.fileno(), nbytes, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        raise RegionError(f"cannot map {nbytes} bytes of shared pool {session.path!r}: {exc}") from exc


def _records_view(
    mapping: mmap.mmap, offset: int, num_records: int, record_bytes: int, stride: int
) -> torch.Tensor:
    """``uint8 [num_records, record_bytes]`` at ``offset``, one row every ``stride`` bytes."""
    # The view keeps a memoryview of the mapping alive; CPython then refuses to unmap it early.
    flat = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)
    return flat.as_strided((num_records, record_bytes), (stride, 1), offset)


def check_shm_room(nbytes: int, what: str, directory: str = SHM_DIR) -> None:
    """Refuse ``nbytes`` of new shared memory when ``directory`` (a tmpfs) has less room left:
    touching a page past a tmpfs's size kills the process with ``SIGBUS``.

    Raises:
        RegionError: naming ``what``, its size and the room left.
    """
    try:
        st = os.statvfs(directory)
    except OSError:
        return
    room = st.f_bavail * st.f_frsize
    if nbytes > room:
        raise RegionError(
            f"{what} needs {nbytes / 2**30:.2f} GiB, but {directory} has {room / 2**30:.2f} GiB "
            "left; ask for fewer host blocks, or grow the tmpfs (mount -o remount,size=...)"
        )
