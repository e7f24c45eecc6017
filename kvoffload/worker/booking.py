"""Booking: which blocks of which memory the jobs in flight read and write.

Owns the per-block reader and writer counts of the device cache, the host pool and the disk tier, and
each in-flight job's blocks. It enforces the rules that span directions (docs/design.md §4): a job
may not read a block an in-flight job writes, nor write a block an in-flight job reads or writes.
A returned job whose copies may still run (a remote call abandoned at its deadline) keeps its blocks
as a *hold* until the worker learns that they stopped. Not thread-safe: the worker holds its lock
around every call.

:meth:`Bookkeeping.admit` checks a job and counts its blocks in one call into the native library
where it is available (docs/design.md §16: the numpy calls of the checks cost the engine's thread
more than the copy of a small job); on any failure the Python checks run and raise the precise
error, and a job is uncounted the way it was counted.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
from collections.abc import Callable
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload import native
from kvoffload._validate import check_pairs, check_range
from kvoffload.errors import BlockConflictError
from kvoffload.records import Direction

__all__ = ["SIDES", "Bookkeeping", "Memory"]

I64Array = npt.NDArray[np.int64]
I32Array = npt.NDArray[np.int32]


class Memory(enum.Enum):
    """Where a block id points: the device cache, the host pool, or the disk tier. ``REMOTE`` has no
    block ids (a remote job names keys): it is never booked, so jobs conflict only on their host
    blocks."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"

    __hash__ = object.__hash__  # identity, as Direction's


#: (memory read, memory written) by a job of each direction.
SIDES: Final = {
    Direction.STORE: (Memory.DEVICE, Memory.HOST),
    Direction.LOAD: (Memory.HOST, Memory.DEVICE),
    Direction.DEMOTE: (Memory.HOST, Memory.DISK),
    Direction.PROMOTE: (Memory.DISK, Memory.HOST),
    Direction.STORE_TO_DISK: (Memory.DEVICE, Memory.DISK),
    Direction.LOAD_FROM_DISK: (Memory.DISK, Memory.DEVICE),
    Direction.PUT_REMOTE: (Memory.HOST, Memory.REMOTE),
    Direction.GET_REMOTE: (Memory.REMOTE, Memory.HOST),
}


@attrs.define(eq=False)
class _Job:
    direction: Direction
    reads: I64Array
    writes: I64Array
    native: bool = False  # counted by the native library (uncounted by it too)


#: Jobs of at most this many blocks are booked with scalar indexing (a few numpy calls on tiny
#: arrays cost more than a loop over their ids).
SCALAR_BOOKING_MAX: Final = 16


class Bookkeeping:
    """In-flight readers and writers per block of each memory (the caller holds the lock)."""

    def __init__(self, sizes: dict[Memory, int], *, native_checks: bool = True) -> None:
        self.reads = {m: np.zeros(n, dtype=np.int32) for m, n in sizes.items()}
        self.writes = {m: np.zeros(n, dtype=np.int32) for m, n in sizes.items()}
        self.jobs: dict[int, _Job] = {}
        self.held: dict[int, tuple[int, _Job]] = {}  # hold token -> (job id, its blocks)
        self._tokens = itertools.count(1)
        lib = self._lib = native.available() if native_checks else None
        self._admit = lib.kvo_admit if lib is not None else None
        self._unadmit = lib.kvo_unadmit if lib is not None else None
        # The call front's admission and uncount (the same calls without ctypes), with their
        # per-direction specs.
        self._front = native.front() if lib is not None else None
        self._front_specs: dict[Direction, tuple[native.FrontSpec, int]] = {}
        # The counts' addresses (the arrays live as long as the bookkeeping) and, per destination
        # memory, the duplicate check's scratch.
        self._read_at = {m: ctypes.c_void_p(int(a.ctypes.data)) for m, a in self.reads.items()}
        self._write_at = {m: ctypes.c_void_p(int(a.ctypes.data)) for m, a in self.writes.items()}
        self._stamps: dict[Memory, tuple[I32Array, ctypes.c_void_p, ctypes.c_int64]] = {}
        self._admissions: dict[Direction, Callable[[int, I64Array, I64Array], bool]] = {}

    @property
    def checks_pairs(self) -> bool:
        """Whether :meth:`admit` checks the pairs and the ids' range itself (the caller then skips
        ``check_pairs`` and may pass ids of ``as_block_ids(..., ranged=False)``)."""
        return self._admit is not None

    def admit(self, job_id: int, direction: Direction, reads: I64Array, writes: I64Array,
              read_name: str, write_name: str, *, pairs_checked: bool = False) -> None:
        """:func:`~kvoffload._validate.check_pairs`, :meth:`check` and :meth:`add` in one call
        (into the native library where it is available). ``pairs_checked``: the caller already ran
        ``check_pairs`` on these ids (it is not run again where the library is not available).

        Raises (nothing counted): InvalidBlockIdError, BlockConflictError, as those checks.
        """
        admit = self._admit
        if self.admit_native(job_id, direction, reads, writes):
            return
        source, target = SIDES[direction]
        if admit is not None:  # the ids may be unranged (see checks_pairs)
            check_range(read_name, reads, self.reads[source].shape[0])
            check_range(write_name, writes, self.reads[target].shape[0])
        if not pairs_checked:
            check_pairs(reads, writes, read_name, write_name)
        self.check(job_id, direction, reads, writes, read_name, write_name)
        self.add(job_id, direction, reads, writes)

    def admit_native(self, job_id: int, direction: Direction, reads: I64Array, writes: I64Array) -> bool:
        """:meth:`admit`'s one call into the native library: True when the job was admitted and
        counted; False, with nothing counted, when the library is not available, the lengths differ
        or are 0, or any check fails (:meth:`admit` then names it). ``reads`` and ``writes`` must
        be writable, contiguous ``int64`` arrays the job owns."""
        return self.native_admission(direction)(job_id, reads, writes)

    def native_admission(self, direction: Direction) -> Callable[[int, I64Array, I64Array], bool]:
        """:meth:`admit_native` of ``direction`` as a call ``(job_id, reads, writes)``, its lookups
        made once (the worker's fast front makes it for every job)."""
        admission = self._admissions.get(direction)
        if admission is not None:
            return admission
        jobs, front = self.jobs, self._front
        if front is not None:
            admit_front, spec = front.admit, self._front_spec(direction)[1]

            def admission(job_id: int, reads: I64Array, writes: I64Array) -> bool:
                if not admit_front(spec, reads, writes):
                    return False
                jobs[job_id] = _Job(direction, reads, writes, True)
                return True
        elif self._admit is not None:
            admit, args = self._admit, self._native_args(direction)

            def admission(job_id: int, reads: I64Array, writes: I64Array) -> bool:
                n = reads.shape[0]
                if n != writes.shape[0] or not n:
                    return False
                if admit(native.address(reads), native.address(writes), n, *args) >= 0:
                    return False
                jobs[job_id] = _Job(direction, reads, writes, True)
                return True
        else:  # no library: the Python checks admit every job
            def admission(job_id: int, reads: I64Array, writes: I64Array) -> bool:
                return False
        self._admissions[direction] = admission
        return admission

    def _front_spec(self, direction: Direction) -> tuple[native.FrontSpec, int]:
        """The call front's spec of ``direction`` for its admission and uncount (and its address),
        built once: the same constants as :meth:`_native_args`. The bookkeeping owns it; callers
        hold its address, so it is never built again (that would free the one they hold)."""
        entry = self._front_specs.get(direction)
        if entry is not None:
            return entry
        assert self._lib is not None
        source, target = SIDES[direction]
        stamp, _, token = self._stamp(target)
        spec = native.front_spec(
            self._lib, src_limit=self.reads[source].shape[0],
            dst_limit=self.reads[target].shape[0], src_writes=self._write_at[source].value,
            src_reads=self._read_at[source].value, dst_reads=self._read_at[target].value,
            dst_writes=self._write_at[target].value, stamp=int(stamp.ctypes.data),
            token=ctypes.addressof(token))
        entry = self._front_specs[direction] = (spec, ctypes.addressof(spec))
        return entry

    def _stamp(self, memory: Memory) -> tuple[I32Array, ctypes.c_void_p, ctypes.c_int64]:
        """The duplicate check's scratch of a destination ``memory`` (its array, the array's address
        and the token), made once and shared by every direction that writes there."""
        stamp = self._stamps.get(memory)
        if stamp is None:
            array = np.zeros(self.reads[memory].shape[0], dtype=np.int32)
            stamp = self._stamps[memory] = (array, ctypes.c_void_p(int(array.ctypes.data)),
                                            ctypes.c_int64(0))
        return stamp

    def _native_args(self, direction: Direction) -> tuple[object, ...]:
        """kvo_admit's arguments after the ids for a job of ``direction`` (built once per direction,
        by :meth:`native_admission`): the limits, the counts' addresses and the destination memory's
        duplicate-check scratch."""
        source, target = SIDES[direction]
        stamp = self._stamp(target)
        return (self.reads[source].shape[0], self.reads[target].shape[0], self._write_at[source],
                self._read_at[source], self._read_at[target], self._write_at[target], stamp[1],
                ctypes.byref(stamp[2]))

    def check(self, job_id: int, direction: Direction, reads: I64Array, writes: I64Array,
              read_name: str, write_name: str) -> None:
        """Refuse any conflict with in-flight jobs (see the module docstring)."""
        source, target = SIDES[direction]
        i = _first_busy(reads, self.writes[source])
        if i >= 0:
            other = self._holder(int(reads[i]), source, writers_only=True)
            raise BlockConflictError(
                f"{direction.value} job {job_id}: {read_name}[{i}] = {int(reads[i])} is being written "
                f"by in-flight job {other}; submit after it completed"
            )
        i = _first_busy(writes, self.reads[target], self.writes[target])
        if i >= 0:
            other = self._holder(int(writes[i]), target, writers_only=False)
            raise BlockConflictError(
                f"{direction.value} job {job_id}: {write_name}[{i}] = {int(writes[i])} is in use by "
                f"in-flight job {other}; submit after it completed"
            )

    def _holder(self, block: int, memory: Memory, *, writers_only: bool) -> str:
        """Name an in-flight job touching ``block`` of ``memory`` (the error path only)."""
        jobs = [(f"{job_id}", job) for job_id, job in self.jobs.items()]
        jobs += [(f"{job_id}, returned, whose abandoned store call has not returned", job)
                 for job_id, job in self.held.values()]
        for name, job in jobs:
            source, target = SIDES[job.direction]
            candidates = [(job.writes, target)] + ([] if writers_only else [(job.reads, source)])
            for blocks, side in candidates:
                if side is memory and bool(np.any(blocks == block)):
                    return f"{name} ({job.direction.value})"
        return "(unknown)"

    def add(self, job_id: int, direction: Direction, reads: I64Array, writes: I64Array) -> None:
        source, target = SIDES[direction]
        _count(self.reads[source], reads, 1)
        _count(self.writes[target], writes, 1)
        self.jobs[job_id] = _Job(direction, reads, writes)

    def remove(self, job_id: int) -> None:
        """A returned job's blocks are free."""
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self._uncount(job)

    def hold(self, job_id: int) -> int:
        """A returned job keeps its blocks until :meth:`release` of the token returned."""
        job = self.jobs.pop(job_id)
        token = next(self._tokens)
        self.held[token] = (job_id, job)
        return token

    def release(self, token: int) -> None:
        """The held job's copies stopped: its blocks are free."""
        held = self.held.pop(token, None)
        if held is not None:
            self._uncount(held[1])

    def _uncount(self, job: _Job) -> None:
        source, target = SIDES[job.direction]
        if job.native:
            front = self._front
            if front is not None:
                spec = self._front_specs.get(job.direction) or self._front_spec(job.direction)
                front.unadmit(spec[1], job.reads, job.writes)
                return
            assert self._unadmit is not None
            self._unadmit(native.address(job.reads), native.address(job.writes), job.reads.shape[0],
                          self._read_at[source], self._write_at[target])
            return
        _count(self.reads[source], job.reads, -1)
        _count(self.writes[target], job.writes, -1)


def _first_busy(ids: I64Array, *counts: I32Array) -> int:
    """Index of the first id with a nonzero count in any of ``counts``, or -1."""
    if ids.shape[0] <= SCALAR_BOOKING_MAX:
        for i, block in enumerate(ids.tolist()):
            for c in counts:
                if c[block]:
                    return i
        return -1
    busy = counts[0][ids] != 0
    for c in counts[1:]:
        busy |= c[ids] != 0
    return int(np.argmax(busy)) if bool(busy.any()) else -1


def _count(counts: I32Array, ids: I64Array, delta: int) -> None:
    """Add ``delta`` to the count of each id. ``add`` and ``remove`` pass one job's same array, so
    they take the same branch: a block a job lists twice (a store reading one device block into two
    records) counts once in the vector branch and twice in the scalar one, and is released alike."""
    if ids.shape[0] <= SCALAR_BOOKING_MAX:
        for block in ids.tolist():
            counts[block] += delta
    else:
        counts[ids] += delta
