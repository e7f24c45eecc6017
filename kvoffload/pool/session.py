"""One rank's attach of a shared pool: join, agree, populate, map, unlink (docs/design.md §13).

Owns: the pool file's descriptor from :meth:`PoolSession.join` until it is handed over
(:meth:`PoolSession.take_fd`, to the region that maps the pool) or released by
:meth:`PoolSession.fail`. Borrows nothing.

The steps, each a barrier every rank passes before any goes on, all bounded by one deadline:

1. *Join.* The first rank creates the file complete (an unnamed ``O_TMPFILE`` whose header already
   registers it, then linked under the name: nobody ever sees a half-written file); the others
   register in their slot under ``flock``. A file found under the name is joined only when it is a
   pool of the same generation and world size whose registered processes all live and whose slot
   for this rank is free. One whose attach failed, or one a registered process of which is dead
   (a crashed earlier run), is stale: it is marked failed and unlinked, and a fresh one is
   created. Another live pool under the name is a :class:`~kvoffload.errors.PoolCollisionError`;
   it is left untouched. The rank that completes the registrations checks that every rank asked
   for the same geometry (else every rank fails with
   :class:`~kvoffload.errors.PoolMismatchError`) and sizes the file.
2. *Populate.* Each rank faults in its own share of the pool's pages (one ``world_size``-th), so
   that the cost of populating is split among the ranks.
3. *Map.* Each rank maps and pins the whole pool (the caller's step), then marks itself mapped. The
   rank that completes the count unlinks the name: from then on the memory is freed by the kernel
   when the last mapping goes, however each process ends.

While it waits, a rank checks that every registered process still runs; a dead one fails the
attach at once (:class:`~kvoffload.errors.PoolRankFailedError`). When the deadline passes, the
rank marks the attach failed, naming the ranks that had not reached the step
(:class:`~kvoffload.errors.PoolTimeoutError`). Whoever marks an attach failed unlinks the file,
and every rank that sees the mark raises the same error (built from the header, so every rank
names the same ranks); nothing is left in ``/dev/shm``. A file is unlinked only while it is the
one under the name (same inode), never a newer pool's.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from kvoffload.errors import (
    PoolCollisionError,
    PoolMismatchError,
    PoolRankFailedError,
    PoolTimeoutError,
    RegionError,
    SharedPoolError,
)
from kvoffload.pool.header import (
    NO_LAUNCH,
    VERSION,
    Failure,
    Flag,
    Header,
    LockTimeout,
    Slot,
    State,
    data_offset,
    locked,
    new_header,
    process_start,
    read_header,
    write_header,
)
from kvoffload.pool.spec import PoolRank

__all__ = ["SHM_DIR", "PoolSession", "populate"]

_log = logging.getLogger("kvoffload.pool")

#: Where shared pools live (a tmpfs on Linux).
SHM_DIR: Final = "/dev/shm"
_FILE_MODE: Final = 0o600
#: Poll interval of the barriers (a header read under a shared lock), and of the liveness check.
POLL_S: Final = 0.002
MAX_POLL_S: Final = 0.02
LIVENESS_EVERY_S: Final = 0.05
#: How long past the attach's deadline (or past now, when that went) a rank waits for the pool
#: file's lock; a lock held longer is a rank stopped inside a header update: the step then raises
#: PoolTimeoutError, without marking the attach failed (it cannot write the header).
LOCK_GRACE_S: Final = 0.1
#: How long :meth:`PoolSession.fail` waits for the file's lock before it gives up marking.
FAIL_LOCK_S: Final = 0.1
#: ``madvise`` advice that faults pages in, readable / writable (Linux 5.14); older kernels refuse it.
_MADV_POPULATE_READ: Final = int(getattr(mmap, "MADV_POPULATE_READ", 22))
_MADV_POPULATE_WRITE: Final = int(getattr(mmap, "MADV_POPULATE_WRITE", 23))
_STEP_NAMES: Final = {Flag.ARRIVED: "arrive at", Flag.POPULATED: "populate their share of",
                      Flag.MAPPED: "map"}


class PoolSession:
    """One rank's attach of a shared pool (see the module docstring)."""

    def __init__(self, spec: PoolRank, fd: int, path: str, header: Header) -> None:
        self.spec = spec
        self.path = path
        self.header = header
        self._fd: int | None = fd

    # -------------------------------------------------------------------------------------- join

    @classmethod
    def join(
        cls, spec: PoolRank, *, num_records: int, record_bytes: int, deadline: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> PoolSession:
        """Register this rank and wait until every rank registered and agreed (step 1).

        Returns with the file sized for ``num_records`` blocks of ``world_size`` slices of
        ``record_bytes``. ``deadline`` is a ``clock()`` time.

        Raises (this rank holds nothing of the pool then; a file it marked failed is unlinked):
            PoolCollisionError: the name is held by another live pool, by a file that is not a
                kvoffload pool, or this rank is held by a live process.
            PoolMismatchError: the ranks asked for different geometries.
            PoolTimeoutError: not every rank arrived by ``deadline``.
            PoolRankFailedError: a registered rank died or gave up.
            RegionError: the file could not be created or sized.
        """
        path = os.path.join(SHM_DIR, spec.name)
        pid = os.getpid()
        start = process_start(pid)
        if start is None:
            raise RegionError(f"cannot read this process's start time from /proc/{pid}/stat")
        me = Slot(pid, Flag.ARRIVED, start, secrets.randbits(63) | 1, record_bytes, num_records)
        while True:
            if clock() >= deadline:
                raise PoolTimeoutError(
                    f"shared pool {spec.name!r}: rank {spec.rank} could not register before its "
                    f"deadline (a stale pool under the name was still being cleaned up)",
                    pool=spec.name, ranks=(spec.rank,),
                )
            session = cls._create(spec, path, me) or cls._join_existing(spec, path, me, deadline)
            if session is not None:
                break
            time.sleep(POLL_S)
        try:
            session.wait_all(Flag.ARRIVED, deadline, clock=clock)
        except BaseException:
            session.fail()
            raise
        return session

    @classmethod
    def _create(cls, spec: PoolRank, path: str, me: Slot) -> PoolSession | None:
        """A new file, already registering this rank, linked under the name; None if one exists."""
        try:
            fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, _FILE_MODE)
        except OSError as exc:
            raise RegionError(f"cannot create a shared pool file in {SHM_DIR}: {exc.strerror}") from exc
        try:
            header = _settle(new_header(spec.world_size, spec.pool.generation, time.time_ns(),
                                        spec.pool.launch_digest).with_slot(spec.rank, me), fd, spec)
            write_header(fd, header)
            _link(fd, path)
        except FileExistsError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            raise RegionError(f"cannot create shared pool {path!r}: {exc.strerror}") from exc
        except BaseException:
            os.close(fd)
            raise
        return cls(spec, _named(fd, path), path, header)

    @classmethod
    def _join_existing(cls, spec: PoolRank, path: str, me: Slot, deadline: float) -> PoolSession | None:
        """Register in the file under the name; None when it vanished or was stale (then replaced
        by the next round).

        Raises:
            PoolTimeoutError: the file's lock was held elsewhere until ``deadline``.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RegionError(f"cannot open shared pool {path!r}: {exc.strerror}") from exc
        try:
            with locked(fd, deadline=_lock_deadline(deadline)):
                header = cls._register(spec, path, me, fd)
        except LockTimeout:
            os.close(fd)
            raise _lock_timeout(spec, "register") from None
        except BaseException:
            os.close(fd)
            raise
        if header is None:
            os.close(fd)
            return None
        return cls(spec, fd, path, header)

    @staticmethod
    def _register(spec: PoolRank, path: str, me: Slot, fd: int) -> Header | None:
        """Under the lock: this rank registered in the file ``fd`` (the new header), or None when
        the file is gone or stale (then it is marked failed and unlinked).

        Raises:
            PoolCollisionError: the file is not a pool, another live pool (another generation,
                world size or launch, or another version of the file's format), or this rank is
                taken.
            PoolRankFailedError, PoolTimeoutError, PoolMismatchError: the file is this launch's
                (``SharedPool.launch``; a rank of it still runs) and its attach failed, or one of
                its ranks died (marked failed and unlinked).
        """
        status = os.fstat(fd)
        if status.st_nlink == 0:  # unlinked since we opened it: look again
            return None
        header = read_header(fd) if stat.S_ISREG(status.st_mode) else None
        if header is None:
            raise PoolCollisionError(
                f"{path!r} exists and is not a kvoffload shared pool; it is left alone (remove it, "
                "or choose another name)", pool=spec.name,
            )
        ours = spec.pool.launch_digest
        if (ours != NO_LAUNCH and header.launch == ours and header.live_ranks()
                and (header.state is State.FAILED or header.dead_ranks())):
            # this launch's attach (a rank of it still runs), failed or with a rank lost: its ranks
            # fail with its error, and so does this one, rather than wait in a pool of its own
            raise failure_error(spec.name, _give_up(header, fd, path), spec.pool.attach_timeout_s)
        if header.state is State.FAILED or header.dead_ranks() or not header.live_ranks():
            _log.warning("shared pool %r: replacing a stale file (%s)", spec.name, _stale_reason(header))
            _give_up(header, fd, path)
            return None
        if header.version != VERSION:
            live, pids = _holders(header)
            raise PoolCollisionError(
                f"shared pool {spec.name!r} is held by ranks of another kvoffload version (rank(s) "
                f"{_names(live)} held by pid(s) {_names(pids)}; its header is of version "
                f"{header.version}, this library's {VERSION}): every rank of one engine must run the "
                "same kvoffload", pool=spec.name, ranks=live, pids=pids,
            )
        if (header.generation, header.world_size) != (spec.pool.generation, spec.world_size):
            live, pids = _holders(header)
            raise PoolCollisionError(
                f"shared pool {spec.name!r} is held by another live pool (generation "
                f"{header.generation}, world_size {header.world_size}; rank(s) {_names(live)} held "
                f"by pid(s) {_names(pids)}), not generation {spec.pool.generation}, world_size "
                f"{spec.world_size}; choose another name", pool=spec.name, ranks=live, pids=pids,
            )
        if header.launch != ours:
            live, pids = _holders(header)
            if header.launch == NO_LAUNCH:
                differs = "named no launch; this rank names one"
            elif ours == NO_LAUNCH:
                differs = "named a launch; this rank names none"
            else:
                differs = "named another launch than this rank's"
            raise PoolCollisionError(
                f"shared pool {spec.name!r} is held by another launch of an engine (rank(s) "
                f"{_names(live)} held by pid(s) {_names(pids)} {differs}): every rank of one "
                "launch must pass the same SharedPool.launch; choose another name for another engine",
                pool=spec.name, ranks=live, pids=pids,
            )
        taken = header.slots[spec.rank]
        if taken.taken:
            raise PoolCollisionError(
                f"rank {spec.rank} of shared pool {spec.name!r} is already held by live pid "
                f"{taken.pid} (two engines using one name and generation, or rank {spec.rank} "
                "started twice)", pool=spec.name, ranks=(spec.rank,), pids=(taken.pid,),
            )
        header = _settle(header.with_slot(spec.rank, me), fd, spec)
        write_header(fd, header)
        return header

    # ---------------------------------------------------------------------------------- barriers

    def populate_share(self, mapping: mmap.mmap) -> None:
        """Fault in this rank's share of the block area of ``mapping`` (the whole file, mapped
        shared): one ``world_size``-th of its pages, so that the ranks populate the pool together
        (step 2)."""
        page, data = mmap.PAGESIZE, self.header.data_bytes
        pages = -(-data // page)  # the last one may be partly past the block area: the file's end
        rank, world = self.spec.rank, self.spec.world_size
        first, last = pages * rank // world, pages * (rank + 1) // world
        if last > first:
            populate(mapping, data_offset() + first * page, min(last * page, data) - first * page,
                     fd=self._fd)

    def arrive(self, flag: Flag, deadline: float) -> None:
        """Mark this rank as having reached ``flag``; the rank that completes the ``MAPPED`` count
        unlinks the name. ``deadline`` (``time.monotonic()``) bounds the wait for the file's lock.

        Raises:
            SharedPoolError: the attach failed meanwhile (the error every rank raises).
            PoolTimeoutError: the file's lock was held elsewhere until ``deadline``.
        """
        fd = self._require_fd()
        with self._locked(fd, deadline, flag):
            header = self._read(fd)
            if header.state is State.FAILED:
                raise self._error(header)
            slot = header.slots[self.spec.rank]
            header = header.with_slot(self.spec.rank, Slot(
                slot.pid, slot.flags | flag, slot.start, slot.nonce, slot.record_bytes,
                slot.num_records))
            write_header(fd, header)
            if not header.ranks_without(Flag.MAPPED):
                _unlink_if_same(self.path, fd)
        self.header = header

    def wait_all(
        self, flag: Flag, deadline: float, *, clock: Callable[[], float] = time.monotonic
    ) -> Header:
        """Wait until every rank reached ``flag`` (``ARRIVED``: until the attach is ready).

        Raises:
            SharedPoolError: the attach failed (a rank's mark, a dead rank seen here, or the deadline
                passed here: then this rank marks it failed and unlinks the file).
        """
        fd = self._require_fd()
        poll = POLL_S
        next_check = clock()
        while True:
            with self._locked(fd, deadline, flag, shared=True):
                header = self._read(fd)
            if _done(header, flag):
                self.header = header
                if flag is Flag.MAPPED:  # in case the rank that completed it died first
                    _unlink_if_same_locked(self.path, fd)
                return header
            if header.state is State.FAILED:
                raise self._error(header)
            now = clock()
            if now >= next_check or now >= deadline:
                next_check = now + LIVENESS_EVERY_S
                with self._locked(fd, deadline, flag):
                    header = self._read(fd)
                    if _done(header, flag):
                        continue
                    if header.state is not State.FAILED:
                        dead = header.dead_ranks()
                        if dead:
                            header = self._declare(fd, header, Failure.RANK_LOST, dead, flag)
                        elif now >= deadline:
                            header = self._declare(fd, header, Failure.TIMEOUT,
                                                   header.ranks_without(flag), flag)
                if header.state is State.FAILED:
                    raise self._error(header)
            time.sleep(min(poll, max(0.0, deadline - now)))
            poll = min(MAX_POLL_S, poll * 2)

    @contextlib.contextmanager
    def _locked(self, fd: int, deadline: float, flag: Flag, *, shared: bool = False) -> Iterator[None]:
        """:func:`~kvoffload.pool.header.locked` for a barrier step, until :data:`LOCK_GRACE_S`
        past ``deadline`` (or past now, once that went).

        Raises:
            PoolTimeoutError: the lock was held elsewhere until ``deadline``.
        """
        try:
            with locked(fd, deadline=_lock_deadline(deadline), shared=shared):
                yield  # the steps' bodies take no lock: a LockTimeout is the one above
        except LockTimeout:
            raise _lock_timeout(self.spec, _STEP_NAMES.get(flag, "register at")) from None

    # ----------------------------------------------------------------------------- hand-over, end

    def fileno(self) -> int:
        """The pool file's descriptor (still owned by the session).

        Raises:
            RegionError: after :meth:`take_fd` or :meth:`fail`.
        """
        return self._require_fd()

    def take_fd(self) -> int:
        """Hand the file descriptor over to the caller (the region that maps the pool closes it)."""
        fd = self._require_fd()
        self._fd = None
        return fd

    def fail(self) -> None:
        """Give up this rank's attach: mark the attach failed by this rank (unless it failed already
        or completed), unlink the file if it is still the one under the name, close the descriptor.
        Idempotent; never raises (a failure is logged)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with locked(fd, deadline=time.monotonic() + FAIL_LOCK_S):
                header = read_header(fd)
                if header is not None and header.state is not State.FAILED and header.ranks_without(
                    Flag.MAPPED
                ):
                    self._declare(fd, header, Failure.RANK_FAILED, (self.spec.rank,), Flag.NONE)
                else:
                    _unlink_if_same(self.path, fd)
        except OSError as exc:  # LockTimeout among them: the file is left as it is
            _log.error("shared pool %r: could not mark the attach failed: %s", self.spec.name, exc)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _declare(self, fd: int, header: Header, failure: Failure, ranks: tuple[int, ...],
                 phase: Flag) -> Header:
        """Mark the attach failed (the caller holds the lock) and unlink the file."""
        header = header.replace(state=State.FAILED, failure=failure, failed=_mask(ranks), phase=phase)
        write_header(fd, header)
        _unlink_if_same(self.path, fd)
        return header

    def _require_fd(self) -> int:
        if self._fd is None:
            raise RegionError(f"shared pool {self.spec.name!r}: this rank's attach is over")
        return self._fd

    def _read(self, fd: int) -> Header:
        header = read_header(fd)
        if header is None:
            raise RegionError(f"shared pool {self.path!r}: its header was overwritten")
        return header

    def _error(self, header: Header) -> SharedPoolError:
        """The error every rank raises for a failed attach, from the header alone."""
        return failure_error(self.spec.name, header, self.spec.pool.attach_timeout_s)


def failure_error(name: str, header: Header, timeout_s: float) -> SharedPoolError:
    """The typed error of the failed attach ``header`` describes."""
    ranks = header.failed_ranks()
    pids = _names(header.slots[r].pid for r in ranks if header.slots[r].taken)
    done = "; nothing of it is left in /dev/shm"
    if header.failure is Failure.TIMEOUT:
        step = _STEP_NAMES.get(header.phase, "attach")
        return PoolTimeoutError(
            f"shared pool {name!r}: rank(s) {_names(ranks)} of {header.world_size} did not {step} "
            f"the pool within the deadline (attach_timeout_s = {timeout_s:g}){done}",
            pool=name, ranks=ranks,
        )
    if header.failure is Failure.MISMATCH:
        groups: dict[tuple[int, int], list[int]] = {}
        for r, s in enumerate(header.slots):
            groups.setdefault((s.record_bytes, s.num_records), []).append(r)
        said = "; ".join(f"record_bytes {rb}, num_records {nr} on rank(s) {_names(rs)}"
                         for (rb, nr), rs in groups.items())
        return PoolMismatchError(
            f"the ranks of shared pool {name!r} disagree on its geometry ({said}): every rank must "
            f"have the same host record size and num_host_blocks (and bounce slots){done}",
            pool=name, ranks=ranks,
        )
    why = "died (its process is gone)" if header.failure is Failure.RANK_LOST else "gave up (see its log)"
    return PoolRankFailedError(
        f"shared pool {name!r}: rank(s) {_names(ranks)} (pid {pids}) {why} while the pool was being "
        f"attached{done}", pool=name, ranks=ranks,
    )


def populate(
    mapping: mmap.mmap, offset: int, nbytes: int, *, fd: int | None = None, allocate: bool = True
) -> None:
    """Fault in ``nbytes`` of a shared mapping from ``offset`` (page-aligned).

    With ``allocate``, ``madvise(MADV_POPULATE_WRITE)`` (the pages are allocated and zeroed);
    without, ``MADV_POPULATE_READ``, which only maps pages that another rank allocated (several
    times cheaper). On a kernel without them (before 5.14), a temporary populated mapping of the
    file ``fd`` over the same range (skipped without ``fd``).

    Raises:
        RegionError: the kernel could not give the pages.
    """
    try:
        mapping.madvise(_MADV_POPULATE_WRITE if allocate else _MADV_POPULATE_READ, offset, nbytes)
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise RegionError(f"cannot populate {nbytes} bytes of the shared pool: {exc}") from exc
    if fd is None:
        return
    try:
        mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                  offset=offset).close()
    except (OSError, ValueError) as exc:
        raise RegionError(f"cannot populate {nbytes} bytes of the shared pool: {exc}") from exc


def _settle(header: Header, fd: int, spec: PoolRank) -> Header:
    """After a registration: once every rank arrived, READY with the agreed geometry and the file
    sized, or FAILED with the ranks that differ from rank 0."""
    if header.ranks_without(Flag.ARRIVED):
        return header
    first = header.slots[0]
    differ = tuple(r for r, s in enumerate(header.slots)
                   if (s.record_bytes, s.num_records) != (first.record_bytes, first.num_records))
    if differ:
        return header.replace(state=State.FAILED, failure=Failure.MISMATCH, failed=_mask(differ),
                              phase=Flag.ARRIVED)
    ready = header.replace(state=State.READY, num_records=first.num_records,
                           record_bytes=first.record_bytes)
    try:
        os.ftruncate(fd, data_offset() + ready.data_bytes)
    except OSError as exc:
        raise RegionError(
            f"cannot size shared pool {spec.name!r} to {ready.data_bytes} bytes: {exc.strerror}"
        ) from exc
    return ready


def _done(header: Header, flag: Flag) -> bool:
    if header.state is not State.READY:
        return False
    return flag is Flag.ARRIVED or not header.ranks_without(flag)


def _named(fd: int, path: str) -> int:
    """A descriptor of the file ``fd`` opened by its name ``path`` (``fd`` closed), so that
    ``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` show the pool's name (an ``O_TMPFILE``'s descriptor
    keeps its anonymous name after the link); ``fd`` itself when the name is no longer this file."""
    try:
        named = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return fd
    here, there = os.fstat(fd), os.fstat(named)
    if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
        os.close(named)
        return fd
    os.close(fd)
    return named


def _link(fd: int, path: str) -> None:
    """Give the unnamed file ``fd`` the name ``path`` (``linkat`` with ``AT_SYMLINK_FOLLOW`` through
    ``/proc/self/fd``; a directory descriptor makes ``os.link`` use it).

    Raises:
        FileExistsError: the name exists.
        OSError: any other failure.
    """
    directory = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=directory)
    finally:
        os.close(directory)


def _unlink_if_same(path: str, fd: int) -> None:
    """Unlink ``path`` if it is still the file ``fd`` (never a newer pool created under the name).

    The caller holds ``fd``'s exclusive lock: every unlink of a pool file's name is made under that
    file's lock, so between the check and the unlink no other rank can remove the name (after which
    a newer pool could be linked under it and be unlinked here)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return
    if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _lock_deadline(deadline: float) -> float:
    """Until when an attach step waits for the pool file's lock: :data:`LOCK_GRACE_S` past its
    ``deadline``, or past now once that went."""
    return max(deadline, time.monotonic()) + LOCK_GRACE_S


def _unlink_if_same_locked(path: str, fd: int) -> None:
    """:func:`_unlink_if_same` under ``fd``'s exclusive lock, taken within :data:`LOCK_GRACE_S`
    (else left to the lock's holder, which unlinks the name itself)."""
    with contextlib.suppress(LockTimeout), locked(fd, deadline=time.monotonic() + LOCK_GRACE_S):
        _unlink_if_same(path, fd)


def _lock_timeout(spec: PoolRank, step: str) -> PoolTimeoutError:
    """The error of a rank whose step waited for the pool file's lock until its deadline."""
    return PoolTimeoutError(
        f"shared pool {spec.name!r}: rank {spec.rank} could not {step} the pool before its deadline: "
        "the pool file's lock stayed held by another process (a rank stopped inside a header update?)",
        pool=spec.name, ranks=(spec.rank,),
    )


def _give_up(header: Header, fd: int, path: str) -> Header:
    """Under the lock: mark the file's attach failed (its dead ranks lost, unless it failed
    already) and unlink it; the header it has then."""
    if header.state is not State.FAILED:
        header = header.replace(state=State.FAILED, failure=Failure.RANK_LOST, failed=_mask(header.dead_ranks()))
        write_header(fd, header)
    _unlink_if_same(path, fd)
    return header


def _holders(header: Header) -> tuple[tuple[int, ...], list[int]]:
    """The ranks of ``header`` whose process runs, and their process ids."""
    live = header.live_ranks()
    return live, [header.slots[r].pid for r in live]


def _stale_reason(header: Header) -> str:
    if header.state is State.FAILED:
        return "its attach failed"
    dead = header.dead_ranks()
    return f"rank(s) {_names(dead)} are dead" if dead else "no live rank holds it"


def _mask(ranks: tuple[int, ...]) -> int:
    return sum(1 << r for r in set(ranks))


def _names(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in values) or "none"
