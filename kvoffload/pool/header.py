"""The shared pool's file header and the liveness of the processes it names (docs/design.md §13).

A shared pool is one file under ``/dev/shm``: a header page, then ``num_records`` blocks of
``world_size`` rank slices of ``record_bytes`` each (rank ``r``'s slice of block ``b`` at
``data_offset() + b * world_size * record_bytes + r * record_bytes``; the block area starts on an
OS page, 4096 bytes in on a host of 4 KiB pages, 64 KiB in on one of 64 KiB pages). The header
says who takes part (one slot per rank: process id and start time, a nonce of the attach, the
geometry it asked for, how far it got), which launch of the engine it is (a digest of the token its
ranks share, when they name one) and how the attach stands (joining, ready, failed and why).
Every change to it is made under ``flock`` of the file, by ``pwrite`` of the whole page; readers
take the lock shared.

Pure data and ``/proc`` reads: no torch, no mapping (the OS page size only).
"""

from __future__ import annotations

import enum
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import attrs

__all__ = [
    "HEADER_BYTES",
    "PROC_DIR",
    "MAX_WORLD_SIZE",
    "NO_LAUNCH",
    "VERSION",
    "Failure",
    "Flag",
    "Header",
    "LockTimeout",
    "Slot",
    "State",
    "data_offset",
    "locked",
    "mark_left",
    "new_header",
    "process_start",
    "read_header",
    "write_header",
]

#: Bytes of the header (the first page of the file on a host of 4 KiB pages).
HEADER_BYTES: Final = 4096
MAGIC: Final = b"KVOFPOOL"
#: The format this library writes: 2 added the launch's digest. Version 1 files (read as naming
#: no launch) are replaced when stale and refused while their ranks live.
VERSION: Final = 2
#: Versions this library reads.
READ_VERSIONS: Final = (1, 2)
#: Most ranks one pool can have (one 64-bit mask names any set of them).
MAX_WORLD_SIZE: Final = 64
# magic, version, world_size, generation, state, failure, failed-ranks mask, phase, num_records,
# record_bytes, created (ns since the epoch)
_HEAD: Final = struct.Struct("<8sIIQIIQIIQQQ")
# the launch's digest, after the head (zeros, as in every file written before it was there: none)
_LAUNCH: Final = struct.Struct("<16s")
_LAUNCH_AT: Final = _HEAD.size
#: The digest of a pool whose ranks named no launch.
NO_LAUNCH: Final = bytes(_LAUNCH.size)
# pid, flags, start time (clock ticks since boot), nonce, record_bytes, num_records
_SLOT: Final = struct.Struct("<IIQQQQ")
_SLOTS_AT: Final = 128
assert _LAUNCH_AT + _LAUNCH.size <= _SLOTS_AT and _SLOTS_AT + MAX_WORLD_SIZE * _SLOT.size <= HEADER_BYTES


class State(enum.IntEnum):
    """Where the attach stands."""

    JOINING = 1  #: ranks are registering
    READY = 2  #: every rank registered and they agree on the geometry: the file has its full size
    FAILED = 3  #: the attach failed (``Header.failure`` says why); nobody joins it any more


class Failure(enum.IntEnum):
    """Why an attach failed (``Header.failed`` names the ranks, ``Header.phase`` the step)."""

    NONE = 0
    TIMEOUT = 1  #: the deadline passed; the ranks named had not reached ``phase``
    MISMATCH = 2  #: the ranks disagree on record size or record count
    RANK_LOST = 3  #: the ranks named died during the attach
    RANK_FAILED = 4  #: the ranks named gave up (an error of their own)


class Flag(enum.IntFlag):
    """How far one rank got; each step is taken after the previous one."""

    NONE = 0
    ARRIVED = 1  #: registered its geometry
    POPULATED = 2  #: populated its share of the pool's pages
    MAPPED = 4  #: mapped and registered (pinned) the whole pool
    LEFT = 8  #: released its mapping (its worker shut down)


@attrs.frozen
class Slot:
    """One rank's entry: ``pid == 0`` means the rank has not arrived."""

    pid: int = 0
    flags: Flag = Flag.NONE
    start: int = 0
    nonce: int = 0
    record_bytes: int = 0
    num_records: int = 0

    @property
    def taken(self) -> bool:
        """Whether a process registered as this rank."""
        return self.pid != 0

    def alive(self) -> bool:
        """Whether the process that registered is still running (same pid and start time; a zombie
        counts as dead)."""
        return self.taken and process_start(self.pid) == self.start


@attrs.frozen
class Header:
    """The decoded header page."""

    world_size: int
    generation: int
    state: State
    failure: Failure
    failed: int  # mask of ranks
    phase: Flag
    num_records: int
    record_bytes: int
    created_ns: int
    slots: tuple[Slot, ...]
    #: The digest of the launch its creator named (:data:`NO_LAUNCH`: none).
    launch: bytes = NO_LAUNCH
    #: The format version the file was written in (:meth:`encode` writes :data:`VERSION`).
    version: int = VERSION

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every rank's slice."""
        return self.world_size * self.record_bytes

    @property
    def data_bytes(self) -> int:
        """Bytes of the block area (0 until the geometry is agreed)."""
        return self.num_records * self.block_bytes

    def ranks_without(self, flag: Flag) -> tuple[int, ...]:
        """The ranks whose slot lacks ``flag`` (for ``ARRIVED``: the ranks that did not arrive)."""
        return tuple(r for r, s in enumerate(self.slots) if not s.flags & flag)

    def failed_ranks(self) -> tuple[int, ...]:
        """The ranks ``failed`` names."""
        return tuple(r for r in range(self.world_size) if self.failed >> r & 1)

    def dead_ranks(self) -> tuple[int, ...]:
        """Registered ranks whose process is gone."""
        return tuple(r for r, s in enumerate(self.slots) if s.taken and not s.alive())

    def live_ranks(self) -> tuple[int, ...]:
        """Registered ranks whose process still runs."""
        return tuple(r for r, s in enumerate(self.slots) if s.alive())

    def replace(self, **changes: object) -> Header:
        """A copy with ``changes``."""
        return attrs.evolve(self, **changes)  # type: ignore[arg-type]

    def with_slot(self, rank: int, slot: Slot) -> Header:
        """A copy with rank ``rank``'s slot replaced."""
        slots = list(self.slots)
        slots[rank] = slot
        return attrs.evolve(self, slots=tuple(slots))

    def encode(self) -> bytes:
        """The header page (``HEADER_BYTES`` bytes)."""
        page = bytearray(HEADER_BYTES)
        _HEAD.pack_into(page, 0, MAGIC, VERSION, self.world_size, self.generation, self.state,
                        self.failure, self.failed, self.phase, 0, self.num_records,
                        self.record_bytes, self.created_ns)
        _LAUNCH.pack_into(page, _LAUNCH_AT, self.launch)
        for rank, s in enumerate(self.slots):
            _SLOT.pack_into(page, _SLOTS_AT + rank * _SLOT.size, s.pid, s.flags, s.start, s.nonce,
                            s.record_bytes, s.num_records)
        return bytes(page)


def data_offset() -> int:
    """Bytes of the file before its first block: the header, padded to the OS page size where pages
    are larger than it, so that the block area, its pinned chunks and the ranks' shares populated
    with ``madvise`` all start on a page. Every process of one host (every rank and viewer of a
    pool) agrees on it."""
    return max(HEADER_BYTES, mmap.PAGESIZE)


def decode(page: bytes) -> Header | None:
    """The header in ``page``, or None when it is not a kvoffload pool header of this version."""
    if len(page) < HEADER_BYTES:
        return None
    (magic, version, world, generation, state, failure, failed, phase, _pad, num_records,
     record_bytes, created) = _HEAD.unpack_from(page, 0)
    if magic != MAGIC or version not in READ_VERSIONS or not 1 <= world <= MAX_WORLD_SIZE:
        return None
    try:
        state_, failure_ = State(state), Failure(failure)
    except ValueError:
        return None
    slots = tuple(
        Slot(pid, Flag(flags), start, nonce, rbytes, nrec)
        for pid, flags, start, nonce, rbytes, nrec in (
            _SLOT.unpack_from(page, _SLOTS_AT + r * _SLOT.size) for r in range(world)
        )
    )
    (launch,) = _LAUNCH.unpack_from(page, _LAUNCH_AT) if version >= 2 else (NO_LAUNCH,)
    return Header(world, generation, state_, failure_, failed, Flag(phase), num_records,
                  record_bytes, created, slots, launch, version)


def new_header(world_size: int, generation: int, created_ns: int, launch: bytes = NO_LAUNCH) -> Header:
    """The header of a pool no rank joined yet (``launch``: the digest of the launch its creator
    named)."""
    return Header(world_size, generation, State.JOINING, Failure.NONE, 0, Flag.NONE, 0, 0,
                  created_ns, tuple(Slot() for _ in range(world_size)), launch)


def read_header(fd: int) -> Header | None:
    """The header of the open file ``fd`` (None: not a pool header, or a file shorter than it)."""
    return decode(os.pread(fd, HEADER_BYTES, 0))


def write_header(fd: int, header: Header) -> None:
    """Write the whole header page (the caller holds the lock)."""
    page = header.encode()
    if os.pwrite(fd, page, 0) != len(page):
        raise OSError("short write of the shared pool header")


def mark_left(fd: int, rank: int, deadline: float) -> None:
    """Record in the header that ``rank`` released its mapping (for inspection only).

    Raises:
        LockTimeout: the lock was not taken by ``deadline`` (nothing written).
    """
    with locked(fd, deadline=deadline):
        header = read_header(fd)
        if header is None or not 0 <= rank < header.world_size:
            return
        slot = header.slots[rank]
        write_header(fd, header.with_slot(rank, attrs.evolve(slot, flags=slot.flags | Flag.LEFT)))


class LockTimeout(TimeoutError):
    """The header's lock was not taken before the deadline: another process holds it (a rank
    stopped, e.g. by a debugger or SIGSTOP, inside a header update). Its callers turn it into their
    own error or log it."""


#: The first and the longest sleep between two tries of a held lock.
LOCK_POLL_S: Final = 0.0002
LOCK_MAX_POLL_S: Final = 0.01


@contextmanager
def locked(fd: int, *, deadline: float, shared: bool = False) -> Iterator[None]:
    """Hold ``flock`` on ``fd`` (exclusive unless ``shared``) for the block, taken before the
    ``time.monotonic()`` ``deadline`` (tried without blocking, with sleeps of
    :data:`LOCK_POLL_S` doubling to :data:`LOCK_MAX_POLL_S`).

    Raises:
        LockTimeout: the deadline passed with the lock held elsewhere.
    """
    mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    poll = LOCK_POLL_S
    while True:
        try:
            fcntl.flock(fd, mode)
            break
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout("the shared pool file's lock is held by another process") from None
            time.sleep(min(poll, left))
            poll = min(LOCK_MAX_POLL_S, poll * 2)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


#: Where the kernel describes processes.
PROC_DIR: Final = "/proc"


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or None when it does not run (no
    such process, or a zombie: killed and not yet reaped). The pair (pid, start) names one process
    even after its pid is reused."""
    try:
        with open(f"{PROC_DIR}/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])
