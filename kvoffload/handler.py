"""DirectionHandler: one direction's jobs, from submit to result.

Owns: its backend (copy stream and events, or the host copy), the FIFO of in-flight transfers, the
results not yet returned, and one issuer thread. Borrows: the copy plan's addresses (the device
tensors and the host records belong to the layout and the region; the worker keeps them alive for
longer than this handler).

``submit`` validates everything before touching the device, captures the compute-stream fence in the
caller's thread (so the job waits for the work queued before the call), appends the transfer to the
FIFO and hands it to the issuer thread, which builds the descriptors and enqueues the copies. The
caller therefore pays only for validation and one event record, however many pages the job has
(the driver's per-page cost is paid on the issuer thread, which releases the GIL while in the
driver) — except for jobs that are cheap to issue (few descriptors; more when none is in flight),
which are issued on the caller's thread when nothing else is queued (see
:data:`INLINE_ISSUE_MAX_DESCRIPTORS`).

Jobs of one direction run on one stream, so they finish in submission order: ``poll`` pops finished
transfers from the head only. A job that fails to issue or to complete comes back as a result with
``ok=False`` and its error; it is never dropped and never counted as done.

Shutdown contract (docs/design.md §6): look at the head transfer, wait for its end (with the deadline), pop it
only after the wait succeeded. If a wait raises or passes the deadline: log it, stop the issuer from
issuing anything more, clear the queue, keep the error, stop waiting. Then release the backend and
join the issuer thread *unconditionally*. Finally re-raise the kept error (several failures come as
one :class:`~kvoffload.errors.ShutdownError`). A second ``shutdown`` does nothing; every other call
after it raises :class:`~kvoffload.errors.ClosedError`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload._descriptors import CopyPlan
from kvoffload.backends import Backend, FailedTicket, Ticket
from kvoffload.errors import (
    ArgumentTypeError,
    BlockIdTypeError,
    ClosedError,
    DeviceMismatchError,
    InvalidArgumentError,
    InvalidBlockIdError,
    JobIdError,
    ShutdownError,
    TransferError,
    UnknownJobError,
    WaitTimeoutError,
)
from kvoffload.records import BlockIds, Direction, HandlerStats, TransferResult

__all__ = [
    "BlockIds",
    "DirectionHandler",
    "as_block_ids",
    "as_job_id",
    "as_job_ids",
    "as_timeout",
    "find_duplicate",
]

_log = logging.getLogger("kvoffload.handler")
#: Transfers abandoned by a failed drain: their tickets keep host buffers a copy may still read, so
#: they are kept for the rest of the process rather than freed under a running copy.
_ABANDONED: list[object] = []

I64Array = npt.NDArray[np.int64]

#: How long a handler's shutdown waits by default for its jobs to finish.
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 30.0
#: A job whose issue builds at most this many descriptors (``Backend.issue_cost``: a page each for
#: batched DMA, a block and a share of each chunk for the kernel paths) is issued on the caller's
#: thread when no other job is queued or being issued: it saves the thread handoff (tens of
#: microseconds) while the issue stays short (about 150 us for a 64 MiB staged job of 32 blocks).
INLINE_ISSUE_MAX_DESCRIPTORS: Final = 256
#: The same limit when no job is in flight at all (the first of a burst): the issuer thread would
#: first have to win the GIL from a caller that keeps submitting (up to the interpreter's switch
#: interval, 5 ms) while the copy engines idle. Later jobs of the burst go to the issuer thread,
#: which issues them while the first one moves. Batched DMA of many pages stays off the caller's
#: thread (the driver's per-page cost: milliseconds for 16k pages).
INLINE_ISSUE_IDLE_MAX_DESCRIPTORS: Final = 4096
#: The issuer thread is joined for at least this long even when the deadline has passed: an idle
#: thread stops within microseconds, and only a thread stuck in a copy should count as running.
ISSUER_JOIN_MIN_S: Final = 0.05
_EMPTY_PATH: Final = "none"


# ------------------------------------------------------------------------------------ validation


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
    if type(job_ids) is list and all(type(j) is int for j in job_ids):  # the common call
        ids: list[int] = list(job_ids)
    elif isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise JobIdError(f"job_ids must be a sequence of ints, got {type(job_ids).__name__}")
    else:
        ids = [as_job_id(j) for j in job_ids]
    if len(set(ids)) != len(ids):
        dup = next(j for j in ids if ids.count(j) > 1)
        raise JobIdError(f"job_ids lists job {dup} more than once")
    return ids


def as_timeout(timeout: object, name: str = "timeout") -> float:
    """Check a timeout in seconds: a finite, non-negative real number.

    Raises:
        InvalidArgumentError: negative, NaN or infinite (every wait has a deadline).
        ArgumentTypeError: not a number (also a ``TypeError``).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got {timeout!r}")
    value = float(timeout)
    if not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"{name} = {timeout!r} must be finite and >= 0 seconds")
    return value


#: Lists of at most this many ids are checked one by one (numpy's fixed cost is larger there).
_SHORT_IDS: Final = 16


def as_block_ids(name: str, values: object, limit: int) -> I64Array:
    """Convert block ids to an ``int64`` array and check every id is in ``[0, limit)``.

    Accepts a sequence of ints or a 1-D integer numpy array / torch tensor (anything numpy converts
    to a 1-D integer array); refuses bools, floats, strings and nested sequences. The result is
    always a new array: the caller may reuse its own buffer as soon as the call returns.

    Raises:
        BlockIdTypeError: not integers, or not one-dimensional.
        InvalidBlockIdError: a negative or out-of-range id (the message names the first one).
    """
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype.kind in "iu":
        ids = values.astype(np.int64)  # a copy, even of int64 ids
        # One reduction checks both bounds: a negative id (or a uint64 one past int64) reads as
        # a huge unsigned value. Errors are named by the general path below.
        if ids.size == 0 or int(ids.view(np.uint64).max()) < limit:
            return ids
    if isinstance(values, (str, bytes)) or values is None:
        raise BlockIdTypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    if isinstance(values, (set, frozenset, Mapping)) or (
        isinstance(values, Iterable) and not isinstance(values, (Sequence, np.ndarray))
        and not hasattr(values, "__array__")
    ):
        raise BlockIdTypeError(
            f"{name} must be an ordered sequence of ints (a list, tuple, numpy array or tensor), "
            f"got a {type(values).__name__}: ids pair up by position, so their order matters"
        )
    if isinstance(values, (list, tuple)):
        if len(values) > _SHORT_IDS and all(type(v) is int for v in values):
            try:
                ids = np.array(values, dtype=np.int64)
            except OverflowError:  # an id past int64: named by the loop below
                pass
            else:
                if int(ids.view(np.uint64).max()) < limit:  # negative ids read as huge
                    return ids
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise BlockIdTypeError(
                    f"{name}[{i}] = {v!r} is a {type(v).__name__}, not an int"
                )
            if not 0 <= v < limit:  # before any cast: a huge id must be named by its own value
                raise InvalidBlockIdError(_out_of_range(name, i, int(v), limit))
        return np.array(values, dtype=np.int64)  # every id is an int in range
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise BlockIdTypeError(f"{name} is not a sequence of ints: {exc}") from exc
    if array.ndim != 1:
        if array.ndim == 0:
            raise BlockIdTypeError(f"{name} must be a sequence of ints, got a scalar {values!r}")
        raise BlockIdTypeError(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise BlockIdTypeError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.min() < 0 or array.max() >= limit:  # compared in the ids' own dtype
        i = int(np.flatnonzero((array < 0) | (array >= limit))[0])
        raise InvalidBlockIdError(_out_of_range(name, i, int(array[i]), limit))
    return np.array(array, dtype=np.int64)  # a copy: never a view of the caller's buffer


def _out_of_range(name: str, index: int, value: int, limit: int) -> str:
    return f"{name}[{index}] = {value} is out of range (the pool has {limit} blocks: 0..{limit - 1})"


def find_duplicate(ids: I64Array) -> int | None:
    """Index of the first id that repeats an earlier one, or None."""
    if ids.size < 2:
        return None
    ordered = np.sort(ids)
    if not bool((ordered[1:] == ordered[:-1]).any()):  # the common case, without an argsort
        return None
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    repeats = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if repeats.size == 0:
        return None
    return int(order[repeats + 1].min())


# -------------------------------------------------------------------------------------- handler


@attrs.define(eq=False)
class _Transfer:
    job_id: int
    src: I64Array
    dst: I64Array
    nbytes: int
    fence: object
    issued: bool = False  # set under the handler's lock, with a notify of ``_issued``
    ticket: Ticket | None = None


class DirectionHandler:
    """Submits, tracks and drains the jobs of one direction (see the module docstring).

    Build it with :meth:`create`; ``__init__`` only stores fields (tests build it with mocks).
    Methods may be called from several threads; none blocks on a device event while holding the
    handler's lock.
    """

    def __init__(
        self,
        *,
        direction: Direction,
        plan: CopyPlan,
        backend: Backend,
        num_src_blocks: int,
        num_dst_blocks: int,
        sequence: Iterator[int] | None = None,
    ) -> None:
        self.direction = direction
        self.num_src_blocks = num_src_blocks
        self.num_dst_blocks = num_dst_blocks
        self._plan = plan
        self._backend: Backend | None = backend
        self._path = backend.path
        self._page_bytes = int(plan.pages.block_bytes)
        self._sequence = sequence if sequence is not None else itertools.count()
        self._lock = threading.Lock()
        self._issued = threading.Condition(self._lock)  # notified when a transfer was issued
        self._issue_waiters = 0  # threads waiting on ``_issued`` (under the lock)
        self._fifo: collections.deque[_Transfer] = collections.deque()
        self._done: dict[int, tuple[int, TransferResult]] = {}
        self._ids: set[int] = set()
        self._queue: queue.SimpleQueue[_Transfer | None] = queue.SimpleQueue()
        self._issue_lock = threading.Lock()  # held while a job is being issued: one at a time
        self._pending = 0  # jobs queued or being issued
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._submitted = 0
        self._completed = 0
        self._failed = 0
        self._bytes_done = 0
        self._busy_s = 0.0

    @classmethod
    def create(
        cls,
        *,
        direction: Direction,
        plan: CopyPlan,
        backend: Backend,
        num_src_blocks: int,
        num_dst_blocks: int,
        sequence: Iterator[int] | None = None,
    ) -> DirectionHandler:
        """A handler with its issuer thread started.

        ``sequence`` orders results across handlers (the worker shares one between its two).
        """
        handler = cls(
            direction=direction, plan=plan, backend=backend, num_src_blocks=num_src_blocks,
            num_dst_blocks=num_dst_blocks, sequence=sequence,
        )
        thread = threading.Thread(
            target=handler._issuer_loop, name=f"kvoffload-{direction.value}", daemon=True
        )
        handler._thread = thread
        thread.start()
        return handler

    # -------------------------------------------------------------------------------- properties

    @property
    def path(self) -> str:
        """The transfer path this handler's backend reports."""
        return self._path

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    @property
    def thread_stopped(self) -> bool:
        """True when the issuer thread is not running (it can issue no more copies)."""
        return self._thread is None or not self._thread.is_alive()

    def known_job(self, job_id: int) -> bool:
        """Whether ``job_id`` is in flight or finished and not yet returned."""
        with self._lock:
            return job_id in self._ids

    # ----------------------------------------------------------------------------------- submit

    def submit(
        self, job_id: int, src_blocks: BlockIds, dst_blocks: BlockIds, *, stream: object = None
    ) -> None:
        """Validate and submit one job; see :meth:`submit_validated` for what happens after.

        Raises (before anything is submitted; the handler is unchanged):
            ClosedError: after shutdown.
            JobIdError: a non-int job id, or one already in flight or unreturned.
            BlockIdTypeError, InvalidBlockIdError: malformed ids, unequal lengths, duplicate
                destinations.
            DeviceMismatchError: a stream of another device (or any stream for the host backend).
        """
        self._check_open()
        job = as_job_id(job_id)
        src = as_block_ids("src_blocks", src_blocks, self.num_src_blocks)
        dst = as_block_ids("dst_blocks", dst_blocks, self.num_dst_blocks)
        check_pairs(src, dst, "src_blocks", "dst_blocks")
        if self.known_job(job):
            raise JobIdError(f"job {job} is already in flight or waiting to be polled")
        self.submit_validated(job, src, dst, stream=stream)

    def fence(self, stream: object = None) -> object:
        """Capture the compute-stream position a later job must wait for (see :meth:`submit_validated`).

        Raises:
            ClosedError: after shutdown.
            DeviceMismatchError: the stream is not one of the backend's device.
        """
        self._check_open()
        backend = self._backend
        assert backend is not None
        return backend.fence(stream)

    def submit_validated(
        self, job_id: int, src: I64Array, dst: I64Array, *, stream: object = None,
        fence: object = None,
    ) -> None:
        """Submit a job whose ids the caller already validated.

        Orders the job after the work queued on ``stream`` (the compute stream) before this call,
        or, when ``fence`` (from :meth:`fence`) is given, after the work queued when it was taken.
        An empty job completes at once with ``ok=True``. A failure to capture the fence (a device
        fault) is reported as the job's failed result, not raised.

        Raises:
            ClosedError: after shutdown.
            DeviceMismatchError: the stream is not one of the backend's device.
        """
        self._check_open()
        backend = self._backend
        assert backend is not None
        nbytes = int(src.shape[0]) * self._page_bytes
        try:
            if fence is None:
                fence = backend.fence(stream)  # also for an empty job: it checks the stream argument
        except DeviceMismatchError:
            raise
        except Exception as exc:  # a device fault: the job is reported failed, never dropped
            self._record(job_id, self._result(job_id, False, nbytes, 0.0, self._path, exc))
            return
        if src.shape[0] == 0:
            self._record(job_id, self._result(job_id, True, 0, 0.0, _EMPTY_PATH, None))
            return
        transfer = _Transfer(job_id, src, dst, nbytes, fence)
        cost = backend.issue_cost(self._plan, int(src.shape[0]))
        with self._lock:
            self._advance()
            idle = not self._fifo  # no job in flight: nothing for this one to overlap with
            self._fifo.append(transfer)
            self._ids.add(job_id)
            self._submitted += 1
            # Nothing queued or being issued: a cheap job is issued here, without a thread handoff;
            # so is a costlier one when no job is in flight (see INLINE_ISSUE_MAX_DESCRIPTORS).
            limit = INLINE_ISSUE_MAX_DESCRIPTORS if not idle else INLINE_ISSUE_IDLE_MAX_DESCRIPTORS
            inline = cost <= limit and self._pending == 0 and backend.can_issue_here()
            self._pending += 1
            if inline:
                self._issue_lock.acquire()  # taken under _lock: no queued job can overtake this one
        if inline:
            try:
                self._issue(backend, transfer, None)
            finally:
                self._issue_lock.release()
        else:
            self._queue.put(transfer)

    def _issue(self, backend: Backend, transfer: _Transfer, init_error: BaseException | None) -> None:
        """Issue one transfer (the caller holds ``_issue_lock``) and publish its ticket."""
        if init_error is not None:
            transfer.ticket = _failed(init_error)
        elif self._abort.is_set():
            transfer.ticket = _failed(TransferError("the handler shut down before the job was issued"))
        else:
            try:
                transfer.ticket = backend.issue(self._plan, transfer.src, transfer.dst, transfer.fence)
            except Exception as exc:  # reported as the job's failure
                transfer.ticket = _failed(exc)
        transfer.fence = None  # the fence's event goes back to its pool once no job holds it
        with self._lock:
            self._pending -= 1
            transfer.issued = True
            if self._issue_waiters:
                self._issued.notify_all()

    def _issuer_loop(self) -> None:
        backend = self._backend
        assert backend is not None
        init_error: BaseException | None = None
        try:
            backend.start_thread()
        except Exception as exc:  # every job this thread would issue fails with it
            init_error = exc
        while True:
            transfer = self._queue.get()
            if transfer is None:
                return
            with self._issue_lock:
                self._issue(backend, transfer, init_error)

    # ------------------------------------------------------------------------------ completion

    def poll(self) -> list[TransferResult]:
        """Results of every job finished since the last ``poll``, in completion order.

        Never blocks. Raises :class:`ClosedError` after shutdown.
        """
        return [result for _, result in self.poll_sequenced()]

    def poll_sequenced(self) -> list[tuple[int, TransferResult]]:
        """As :meth:`poll`, each result with its completion sequence number."""
        self._check_open()
        with self._lock:
            self._advance()
            out = sorted(self._done.values(), key=lambda item: item[0])
            self._ids.difference_update(self._done)
            self._done.clear()
        return out

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[TransferResult]:
        """Wait until the given jobs finished; return their results in the order asked.

        Results of other jobs that finish meanwhile stay for the next ``poll``. Waiting for a job
        also waits for the jobs submitted before it in this direction (they finish in order).

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
        return self.wait_until(ids, time.monotonic() + seconds, seconds)

    def wait_until(
        self, ids: list[int], deadline: float, timeout: float
    ) -> list[tuple[int, TransferResult]]:
        """As :meth:`wait_sequenced` for ids the caller validated (distinct ints), until the
        ``time.monotonic()`` ``deadline``; ``timeout`` is only named in the error.

        Raises:
            ClosedError: after shutdown.
            UnknownJobError, WaitTimeoutError: as :meth:`wait`.
        """
        self._check_open()
        first = True
        while True:
            with self._lock:
                if first:
                    unknown = [j for j in ids if j not in self._ids]
                    if unknown:
                        raise UnknownJobError(
                            f"{self.direction.value} job(s) {unknown} are neither in flight nor "
                            "waiting to be polled"
                        )
                    first = False
                self._advance()
                done = self._done
                missing = [j for j in ids if j not in done]
                if not missing:
                    self._ids.difference_update(ids)
                    return [done.pop(j) for j in ids]
                head = self._fifo[0] if self._fifo else None
                remaining = deadline - time.monotonic()
                if head is not None and not head.issued and remaining > 0:
                    self._wait_issued(head, remaining)
                    continue
            if head is None:
                raise UnknownJobError(f"job(s) {missing} were returned by a concurrent call")
            if remaining <= 0:
                raise WaitTimeoutError(
                    f"{self.direction.value} job(s) {missing} did not finish within {timeout} s",
                    pending=missing,
                )
            ticket = head.ticket
            assert ticket is not None
            try:
                ticket.wait(remaining)
            except Exception:  # _advance records the failure as the job's result
                pass

    def _wait_issued(self, transfer: _Transfer, timeout: float) -> bool:
        """Wait (holding the lock, which the wait releases) until ``transfer`` was issued; True
        when it was within ``timeout``."""
        self._issue_waiters += 1
        try:
            return self._issued.wait_for(lambda: transfer.issued, timeout)
        finally:
            self._issue_waiters -= 1

    def _advance(self) -> None:
        """Pop finished transfers from the head (caller holds the lock; never blocks)."""
        while self._fifo:
            head = self._fifo[0]
            if not head.issued:
                return
            ticket = head.ticket
            assert ticket is not None
            try:
                if not ticket.done():
                    return
            except Exception as exc:  # completion failed: the job fails, the queue moves on
                self._fifo.popleft()
                self._record_locked(self._result(head.job_id, False, head.nbytes, 0.0, self._path, exc))
                continue
            self._fifo.popleft()
            self._record_locked(self._finished(head, ticket))

    def _finished(self, transfer: _Transfer, ticket: Ticket) -> TransferResult:
        error = ticket.error
        try:
            seconds = ticket.seconds()
        except Exception as exc:  # timing is advisory; a failed read must not fail the job
            _log.debug("could not read job %d's copy time: %s", transfer.job_id, exc)
            seconds = 0.0
        path = ticket.path or self._path
        return self._result(transfer.job_id, error is None, transfer.nbytes, seconds, path, error)

    def _result(
        self, job_id: int, ok: bool, nbytes: int, seconds: float, path: str, error: BaseException | None
    ) -> TransferResult:
        return TransferResult(
            job_id=job_id, direction=self.direction, ok=ok, nbytes=nbytes, seconds=seconds,
            path=path, error=error,
        )

    def _record(self, job_id: int, result: TransferResult) -> None:
        """Record the result of a job that finished at submit (empty, or failed to fence)."""
        with self._lock:
            self._submitted += 1
            self._ids.add(job_id)
            self._record_locked(result)

    def _record_locked(self, result: TransferResult) -> None:
        self._done[result.job_id] = (next(self._sequence), result)
        if result.ok:
            self._completed += 1
            self._bytes_done += result.nbytes
            self._busy_s += result.seconds
        else:
            self._failed += 1

    def stats(self) -> HandlerStats:
        """Counters since creation (also valid after shutdown)."""
        with self._lock:
            return HandlerStats(
                direction=self.direction,
                submitted=self._submitted,
                completed=self._completed,
                failed=self._failed,
                in_flight=len(self._fifo),
                bytes_done=self._bytes_done,
                busy_seconds=self._busy_s,
            )

    # ---------------------------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Drain and release, with the contract of the module docstring. Idempotent.

        Raises:
            InvalidArgumentError: a malformed timeout (nothing is done then).
            Exception: the drain's kept error, after everything was released; several failures come
                as one :class:`ShutdownError`.
        """
        seconds = as_timeout(timeout)
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + seconds
        kept: BaseException | None = None
        try:
            self._drain(deadline)
        except Exception as exc:
            _log.error("%s handler: drain failed, abandoning in-flight jobs: %s", self.direction.value, exc)
            kept = exc
            self._abort.set()
            with self._lock:
                _ABANDONED.extend(self._fifo)
                self._fifo.clear()
        finally:
            failures = self._release(deadline)
        if kept is not None and not failures:
            raise kept
        if kept is not None or len(failures) > 1:
            raise ShutdownError(
                f"{self.direction.value} handler shutdown failed",
                ([kept] if kept is not None else []) + failures,
            )
        if failures:
            raise failures[0]

    def _drain(self, deadline: float) -> None:
        while True:
            with self._lock:
                head = self._fifo[0] if self._fifo else None
            if head is None:
                return
            with self._lock:
                issued = self._wait_issued(head, max(0.0, deadline - time.monotonic()))
            if not issued:
                raise WaitTimeoutError(
                    f"{self.direction.value} job {head.job_id} was not issued before the shutdown "
                    "deadline", pending=[head.job_id],
                )
            ticket = head.ticket
            assert ticket is not None
            if not ticket.wait(max(0.0, deadline - time.monotonic())):
                raise WaitTimeoutError(
                    f"{self.direction.value} job {head.job_id} did not finish before the shutdown "
                    "deadline", pending=[head.job_id],
                )
            with self._lock:
                self._fifo.popleft()
                self._record_locked(self._finished(head, ticket))

    def _release(self, deadline: float) -> list[BaseException]:
        """Stop the issuer thread and release the backend; never raises, returns the failures."""
        failures: list[BaseException] = []
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.release()
            except Exception as exc:
                failures.append(exc)
        self._queue.put(None)
        thread = self._thread
        if thread is not None:
            thread.join(max(ISSUER_JOIN_MIN_S, deadline - time.monotonic()))
            if thread.is_alive():
                failures.append(
                    WaitTimeoutError(
                        f"the {self.direction.value} issuer thread did not stop before the deadline "
                        "(a copy may still be in progress)"
                    )
                )
        with self._lock:
            self._done.clear()
            self._ids.clear()
        return failures

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the {self.direction.value} handler was shut down")


def check_pairs(src: I64Array, dst: I64Array, src_name: str, dst_name: str) -> None:
    """Refuse unequal lengths and duplicate destinations (two copies into one block race).

    Raises:
        InvalidBlockIdError: naming the lengths or the duplicated destination.
    """
    if src.shape[0] != dst.shape[0]:
        raise InvalidBlockIdError(
            f"{src_name} has {src.shape[0]} ids but {dst_name} has {dst.shape[0]}: they pair up and "
            "must have equal lengths"
        )
    dup = find_duplicate(dst)
    if dup is not None:
        raise InvalidBlockIdError(
            f"{dst_name}[{dup}] = {int(dst[dup])} repeats an earlier destination: each block may be "
            "written once per job"
        )


def _failed(error: BaseException) -> Ticket:
    return FailedTicket(error)
