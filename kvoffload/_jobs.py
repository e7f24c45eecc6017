"""JobBook: jobs from submit to returned result, for every component that completes jobs.

Also here: :class:`Ticket`, the handle of one issued job (the backend seam's, see
:mod:`kvoffload.handler`), and :class:`FailedTicket`, the handle of a job that failed before anything
was enqueued (every backend and the handler make them).

Owns: the ids of the jobs in flight (submitted, result not yet returned) with the source that will
complete each, and the finished results not yet returned, in completion order. Borrows: its
*sources* (a direction handler, the disk tier, the disk pipeline), which publish results with
:meth:`JobBook.finish`.

One book serves one job front. A component used on its own keeps a book of its own; the Worker
gives its handlers, disk tier and pipeline one shared book, so a job id is unique across all of
them (checked once, at :meth:`JobBook.reserve`), ``poll`` returns every component's results in the
order they finished, and ``wait`` waits for any mix of them — nothing is merged by hand.

Completion reaches the book two ways. A source whose threads finish jobs by themselves (the disk
tier, the pipeline) *pushes*: it calls :meth:`finish` from its thread, and a waiter sleeps on the
book until it does. A source whose completions must be looked for (a handler: its jobs end with
device events) is *pulled*: ``poll`` and ``wait`` call its ``advance()``, which publishes whatever
finished, and a waiter blocks in its ``wait_progress()`` with the deadline. The book never calls a
source while holding its own lock (sources call :meth:`finish` under theirs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Final, NamedTuple, Protocol

import numpy as np

from kvoffload._seconds import WAIT_SLICE_S, as_timeout
from kvoffload.errors import ClosedError, JobIdError, UnknownJobError, WaitTimeoutError
from kvoffload.records import TransferResult

__all__ = ["BookedResult", "FailedTicket", "JobBook", "JobSource", "Ticket", "as_job_id", "as_job_ids",
           "as_timeout"]


def as_job_id(job_id: object) -> int:
    """Check that a job id is an ``int`` (not a bool) and return it.

    Raises:
        JobIdError: any other type.
    """
    if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
        raise JobIdError(f"job_id must be an int, got {type(job_id).__name__} {job_id!r}")
    return int(job_id)


def as_job_ids(job_ids: Iterable[object]) -> list[int]:
    """Check a collection of job ids (each as :func:`as_job_id`); duplicates are refused.

    Raises:
        JobIdError: a non-int id, a duplicate, or ``job_ids`` not iterable.
    """
    if type(job_ids) is list and len(job_ids) == 1 and type(job_ids[0]) is int:  # the common call
        return [job_ids[0]]
    if type(job_ids) is list and all(type(j) is int for j in job_ids):
        ids: list[int] = list(job_ids)
    elif (isinstance(job_ids, (str, bytes, bytearray, memoryview))
          or not isinstance(job_ids, Iterable) or getattr(job_ids, "ndim", 1) != 1):
        # bytes-like: a buffer of bytes is not a list of job ids (block ids refuse it too); a 0-d
        # or n-d array is not a sequence of ids either (iterating a 0-d one raises TypeError)
        dims = getattr(job_ids, "ndim", 1)
        raise JobIdError(f"job_ids must be a sequence of ints, got {type(job_ids).__name__}"
                         + (f" of {dims} dimensions" if dims != 1 else ""))
    else:
        ids = [as_job_id(j) for j in job_ids]
    if len(set(ids)) != len(ids):
        dup = next(j for j in ids if ids.count(j) > 1)
        raise JobIdError(f"job_ids lists job {dup} more than once")
    return ids



class JobSource(Protocol):
    """A component that completes jobs recorded in a :class:`JobBook`."""

    #: True when the source publishes results from its own threads (waiters sleep on the book);
    #: False when completions must be looked for (``advance`` and ``wait_progress``).
    pushes: bool

    def advance(self) -> None:
        """Publish the results of jobs that finished; never blocks."""

    def wait_progress(self, job_id: int, timeout: float) -> None:
        """Block for at most ``timeout`` seconds until ``job_id`` (or a job before it) may have
        finished; pulled sources only. Never raises for the job's own failure."""


class JobBook:
    """Ids in flight and results in completion order, with poll and a bounded wait (see the module
    docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._sources: list[JobSource] = []
        self._open: dict[int, JobSource] = {}
        self._done: dict[int, TransferResult] = {}  # insertion order is completion order
        self._waiters = 0
        self._closed = False

    def attach(self, source: JobSource) -> None:
        """Add a source whose completions ``poll`` and ``wait`` look for."""
        with self._lock:
            if source not in self._sources:
                self._sources.append(source)

    def reserve(self, job_id: int, source: JobSource) -> None:
        """Record a job about to be submitted to ``source``.

        Raises:
            JobIdError: the id is in flight or finished and not yet returned.
        """
        with self._lock:
            if job_id in self._open:
                raise JobIdError(f"job {job_id} is already in flight or waiting to be polled")
            self._open[job_id] = source

    def forget(self, job_id: int) -> None:
        """Drop the reservation of a job whose submit failed before anything was queued."""
        with self._lock:
            self._open.pop(job_id, None)
            self._done.pop(job_id, None)

    def finish(self, job_id: int, result: TransferResult) -> None:
        """Publish a job's result (a source's call; once per job)."""
        with self._lock:
            self._done[job_id] = result
            if self._waiters:
                self._finished.notify_all()

    def known(self, job_id: int) -> bool:
        """Whether ``job_id`` is in flight or finished and not yet returned."""
        with self._lock:
            return job_id in self._open

    def __len__(self) -> int:
        """Jobs in flight or finished and not yet returned."""
        with self._lock:
            return len(self._open)

    def poll(self) -> list[TransferResult]:
        """Every result published since the last call, oldest completion first; never blocks."""
        with self._lock:
            sources = list(self._sources)
        for source in sources:
            if not source.pushes:
                source.advance()
        with self._lock:
            results = list(self._done.values())
            for result in results:
                self._open.pop(result.job_id, None)
            self._done.clear()
        return results

    def wait(self, job_ids: Iterable[object], timeout: object) -> list[TransferResult]:
        """Wait until the jobs ``job_ids`` finished, for at most ``timeout`` seconds; return their
        results in the order asked. Other jobs' results stay for the next ``poll``.

        Raises:
            JobIdError, InvalidArgumentError: malformed ids or timeout (before waiting).
            UnknownJobError, WaitTimeoutError: as :meth:`wait_until`.
        """
        ids = as_job_ids(job_ids)
        seconds = as_timeout(timeout)
        return self.wait_until(ids, time.monotonic() + seconds, seconds)

    def wait_until(self, ids: list[int], deadline: float, timeout: float) -> list[TransferResult]:
        """Wait until the jobs ``ids`` (distinct ints, validated by the caller) finished, until the
        ``time.monotonic()`` ``deadline``; return their results in the order asked. ``timeout`` is
        only named in the error. Other jobs' results stay for the next ``poll``.

        A wait for a pulled source's job looks at the book again at least every
        :data:`WAIT_SLICE_S`, so that a shutdown meanwhile ends it (a job that never finishes
        would otherwise hold it to its deadline).

        Raises:
            UnknownJobError: an id neither in flight nor finished-and-unreturned, or one that a
                concurrent ``poll`` or ``wait`` returned meanwhile (the other jobs stay).
            WaitTimeoutError: the deadline passed; ``pending`` names the unfinished jobs, which stay
                in flight (the finished ones stay available too).
            ClosedError: the owner shut down (:meth:`clear`) before the jobs finished.
        """
        first_look = True
        while True:
            with self._lock:
                if self._closed:  # an attribute test: this is every wait's path
                    _raise_closed(ids)
                if first_look:  # checked in the first look, which also finds the sources to advance
                    unknown = [j for j in ids if j not in self._open]
                    if unknown:
                        raise UnknownJobError(
                            f"job(s) {unknown} are neither in flight nor waiting to be polled")
                    first_look = False
                sources = {id(s): s for j in ids if j not in self._done
                           and (s := self._open.get(j)) is not None and not s.pushes}
            for source in sources.values():
                source.advance()
            with self._lock:
                if self._closed:  # an attribute test: this is every wait's path
                    _raise_closed(ids)
                gone = [j for j in ids if j not in self._open]
                if gone:
                    raise UnknownJobError(f"job(s) {gone} were returned by a concurrent call")
                missing = [j for j in ids if j not in self._done]
                if not missing:
                    results = [self._done.pop(j) for j in ids]
                    for j in ids:
                        del self._open[j]
                    return results
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeoutError(
                        f"job(s) {missing} did not finish within {timeout} s; they are still in "
                        "flight: wait or poll for them again (their blocks stay booked until then)",
                        pending=missing,
                    )
                first = missing[0]
                source = self._open[first]
                if source.pushes:
                    self._waiters += 1
                    try:
                        self._finished.wait_for(
                            lambda: first in self._done or first not in self._open, remaining
                        )
                    finally:
                        self._waiters -= 1
                    continue
            source.wait_progress(first, min(remaining, WAIT_SLICE_S))

    def clear(self) -> None:
        """Forget every job and result, and end every wait with :class:`ClosedError` (the owner's
        shutdown)."""
        with self._lock:
            self._closed = True
            self._open.clear()
            self._done.clear()
            if self._waiters:
                self._finished.notify_all()


def _raise_closed(ids: list[int]) -> None:
    """Refuse a wait on a book its owner shut down (:meth:`JobBook.clear`).

    Raises:
        ClosedError: always.
    """
    raise ClosedError(f"job(s) {ids}: shut down while waiting; their results are gone")


class Ticket(Protocol):
    """The handle of one issued job.

    ``error`` is set when issuing failed part-way: the ticket still completes once whatever was
    enqueued has finished, and the job is then reported failed with that error. ``path`` names the
    path that moved the job (None: the backend's own).
    """

    error: BaseException | None
    path: str | None

    def done(self) -> bool:
        """Whether the job's copies finished; never blocks. Raises if completion failed."""

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for completion; True when done. Raises if completion failed."""

    def seconds(self) -> float:
        """How long the copies ran (valid once done)."""

    def release(self) -> None:
        """Give back what the ticket holds (its events); called once, after it completed and its
        result was read."""


class FailedTicket:
    """A job that failed before anything was enqueued. Holds nothing."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error
        self.path: str | None = None

    def done(self) -> bool:
        """Always: nothing was enqueued."""
        return True

    def wait(self, timeout_s: float) -> bool:
        """Always: nothing was enqueued."""
        return True

    def seconds(self) -> float:
        """0.0: nothing ran."""
        return 0.0

    def release(self) -> None:
        """Nothing to give back."""


class BookedResult(NamedTuple):
    """A booked job's outcome, as a booking backend's ``book_take`` takes it (the native issuer's
    book, docs/design.md §16): its id, its pairs, whether it succeeded, its device time (0.0 unless
    it did), the name of the path it took (None: it failed before it was handed over, or in its
    completion: the handler's path), its error and whether that came in its completion.

    A named tuple, not an attrs class: one is built for every job (a frozen attrs class sets each
    field through ``object.__setattr__``)."""

    job_id: int
    pairs: int
    ok: bool
    seconds: float
    path: str | None
    error: BaseException | None
    completion: bool  # it failed in its completion (its end's query failed, or it was given up)
    #: ``time.monotonic()`` nanoseconds: handed over, issue began, issued, found done (0: not)
    times_ns: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def times(self) -> tuple[float, float, float, float]:
        """:attr:`times_ns` in seconds."""
        a, b, c, d = self.times_ns
        return a / 1e9, b / 1e9, c / 1e9, d / 1e9
