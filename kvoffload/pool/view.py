"""``PoolView``: a whole shared pool mapped for a test or an operator (``SharedPool.inspect``).

Owns: one mapping of the pool file and its descriptor, until :meth:`PoolView.close`. It takes no
part in the attach and registers nothing: it is one more mapping of the same memory (which keeps
that memory alive while it is open).

Where the pool is found: the file ``/dev/shm/<name>`` while it is linked (an attach in progress, or
a stale file); once every rank mapped it the name is gone, and the file is reached through a
process that holds it open (``/proc/<pid>/fd``): the one given, else this process, else any process
of this user.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload.errors import ClosedError, RegionError, warn_on_del
from kvoffload.pool.header import PROC_DIR, Flag, Header, State, data_offset, read_header

__all__ = ["PoolRankInfo", "PoolView", "SharedPoolInfo"]

U8Array = npt.NDArray[np.uint8]
_SHM_DIR: Final = "/dev/shm"
_DELETED: Final = " (deleted)"


@attrs.frozen
class PoolRankInfo:
    """One rank as the pool's header records it (``alive`` is checked when the info is read)."""

    rank: int
    pid: int
    alive: bool
    arrived: bool
    populated: bool
    mapped: bool
    left: bool
    record_bytes: int
    num_records: int


@attrs.frozen
class SharedPoolInfo:
    """What a shared pool's header says, read by :attr:`PoolView.info`.

    ``state`` is ``"joining"``, ``"ready"`` or ``"failed"`` (``failure`` then names why:
    ``"timeout"``, ``"mismatch"``, ``"rank_lost"`` or ``"rank_failed"``, about ``failed_ranks``).
    ``linked`` is whether the name is still in ``/dev/shm`` (an attach in progress, or a stale file).
    Block ``b``'s slice of rank ``r`` is at byte ``b * block_bytes + r * record_bytes`` of the block
    area.
    """

    name: str
    path: str
    linked: bool
    world_size: int
    generation: int
    state: str
    failure: str | None
    failed_ranks: tuple[int, ...]
    num_records: int
    record_bytes: int
    block_bytes: int
    ranks: tuple[PoolRankInfo, ...]


class PoolView:
    """A mapping of a whole shared pool (see the module docstring). Use it as a context manager or
    call :meth:`close`; drop the arrays it gave out first (the mapping stays until they are gone)."""

    def __init__(self, *, name: str, path: str, fd: int, mapping: mmap.mmap | None,
                 writable: bool) -> None:
        self.name = name
        self.path = path
        self.writable = writable
        self._fd: int | None = fd
        self._mapping = mapping
        self._closed = False

    @classmethod
    def open(cls, name: str, *, pid: int | None = None, writable: bool = False) -> PoolView:
        """Find and map the pool ``name`` (see the module docstring).

        Raises:
            RegionError: no such pool, or a file that is not a kvoffload pool.
        """
        path = _find(name, pid)
        # O_NONBLOCK: a FIFO under the name must not block the open (it is refused below).
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise RegionError(f"cannot open shared pool {name!r} at {path!r}: {exc.strerror}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RegionError(f"{path!r} is not a kvoffload shared pool (not a regular file)")
            header = read_header(fd)
            if header is None:
                raise RegionError(f"{path!r} is not a kvoffload shared pool")
            size = os.fstat(fd).st_size
            mapping = None
            end = data_offset() + header.data_bytes
            if header.state is State.READY and size >= end:
                access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
                mapping = mmap.mmap(fd, end, access=access)
        except BaseException:
            os.close(fd)
            raise
        return cls(name=name, path=path, fd=fd, mapping=mapping, writable=writable)

    @property
    def info(self) -> SharedPoolInfo:
        """The header as it is now.

        Raises:
            ClosedError: after :meth:`close`.
        """
        fd = self._require_open()
        header = read_header(fd)
        if header is None:
            raise RegionError(f"{self.path!r}: its header was overwritten")
        return _info(self.name, self.path, header, linked=os.fstat(fd).st_nlink > 0)

    def blocks(self) -> U8Array:
        """The block area as ``uint8 [num_records, world_size, record_bytes]`` (``[b, r]`` is rank
        ``r``'s slice of block ``b``), sharing the pool's memory; read-only unless the view was
        opened ``writable``.

        Raises:
            ClosedError: after :meth:`close`.
            RegionError: the pool's geometry was not agreed when it was opened (still joining).
        """
        fd = self._require_open()
        if self._mapping is None:
            raise RegionError(f"shared pool {self.name!r} had no agreed geometry when it was opened")
        header = read_header(fd)
        assert header is not None
        flat: U8Array = np.frombuffer(self._mapping, dtype=np.uint8, count=header.data_bytes,
                                      offset=data_offset())
        return flat.reshape(header.num_records, header.world_size, header.record_bytes)

    def close(self) -> None:
        """Unmap and close (once; a second call does nothing). An array still referenced keeps the
        mapping until it is dropped."""
        if self._closed:
            return
        self._closed = True
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            with contextlib.suppress(BufferError):  # an array still holds it: unmapped with it
                mapping.close()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _require_open(self) -> int:
        if self._closed or self._fd is None:
            raise ClosedError("the pool view was closed")
        return self._fd

    def __enter__(self) -> PoolView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    __del__ = warn_on_del("_closed", "PoolView was never closed; call close()")


def _info(name: str, path: str, header: Header, *, linked: bool) -> SharedPoolInfo:
    ranks = tuple(
        PoolRankInfo(rank=r, pid=s.pid, alive=s.alive(), arrived=bool(s.flags & Flag.ARRIVED),
                     populated=bool(s.flags & Flag.POPULATED), mapped=bool(s.flags & Flag.MAPPED),
                     left=bool(s.flags & Flag.LEFT), record_bytes=s.record_bytes,
                     num_records=s.num_records)
        for r, s in enumerate(header.slots)
    )
    failure = header.failure.name.lower() if header.state is State.FAILED else None
    return SharedPoolInfo(
        name=name, path=path, linked=linked, world_size=header.world_size,
        generation=header.generation, state=header.state.name.lower(), failure=failure,
        failed_ranks=header.failed_ranks(), num_records=header.num_records,
        record_bytes=header.record_bytes, block_bytes=header.block_bytes, ranks=ranks,
    )


def _find(name: str, pid: int | None) -> str:
    """A path that opens the pool ``name``: its file, or a process's descriptor of it."""
    linked = os.path.join(_SHM_DIR, name)
    if pid is None and os.path.exists(linked):
        return linked
    if pid is not None:
        candidates: list[int] = [pid]
    else:
        others = sorted(int(p) for p in os.listdir(PROC_DIR) if p.isdigit() and int(p) != os.getpid())
        candidates = [os.getpid(), *others]
    for candidate in candidates:
        found = _descriptor_of(candidate, linked)
        if found is not None:
            return found
    where = f"process {pid}" if pid is not None else "any process of this user"
    raise RegionError(f"no shared pool {name!r}: no file {linked!r}, and {where} holds none")


def _descriptor_of(pid: int, path: str) -> str | None:
    fds = f"{PROC_DIR}/{pid}/fd"
    try:
        entries = os.listdir(fds)
    except OSError:
        return None
    for entry in entries:
        try:
            target = os.readlink(f"{fds}/{entry}")
        except OSError:
            continue
        if target in (path, path + _DELETED):
            return f"{fds}/{entry}"
    return None
