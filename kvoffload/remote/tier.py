"""RemoteTier: a Worker's remote tier — ``put_remote``/``get_remote`` jobs on the tier's own thread
(docs/design.md §14).

Owns: the remote store (built from a :class:`~kvoffload.remote.config.RemoteConfig` over the host
rows, closed at shutdown), the job thread and its FIFO queue, and the holds of store calls abandoned
at their deadline. Borrows: the host rows (the Worker's pool; they must stay mapped until shutdown
returned without ``client_left_open``) and the job book its results are published in.

Jobs (``Direction.PUT_REMOTE``: host records -> records under keys; ``Direction.GET_REMOTE``: keys ->
host records, every record verified) are validated and booked by the Worker, then queued here; the
job thread makes one store call per job with the time left of the job's deadline (counted from its
submission, ``RemoteConfig.job_timeout_s``) and publishes a :class:`~kvoffload.records.TransferResult`
in the book (a pushing source). A job completes as a whole: ``ok`` only when every key succeeded;
otherwise ``error`` is one typed :class:`~kvoffload.errors.RemoteError` of the first failed key's
class, naming the job, every failed key (``keys``) and how many failed of each kind (``kinds``). The host
rows of a failed get hold zeros for each key that failed and the verified record for each that
succeeded; never a partial or unverified record.

Deadlines: a job whose deadline passed before its store call started fails ``timeout`` (settled).
A store call still inside the client at the deadline is *abandoned*: the job fails ``timeout`` with
``settled=False``, and until the client returned the call (the store calls ``on_settled``, after
zero-filling an abandoned get's rows) it may still read (put) or write (get) the job's host rows.
:meth:`RemoteTier.take_unsettled` hands the Worker that call's settle event when it returns the
job's result, so the Worker keeps the job's host blocks booked until the event is set.

Shutdown contract (docs/design.md §6): mark closed (later submits raise ``ClosedError``); let the
queued jobs run (each bounded by its own deadline) until the shutdown deadline, then fail the ones
not started (``closed``) and keep the error; close the store with the time left (a call still inside
the client is abandoned at that deadline, which wakes the job thread); join the job thread. Only
when the thread stopped and the store's client was released are the host rows dropped; a client left
open may still use them, so :attr:`thread_stopped` stays False and the Worker keeps its region
mapped. Finally raise one :class:`~kvoffload.errors.RemoteShutdownError` carrying every failure.
``shutdown`` is idempotent; no cleanup in ``__del__`` (a ``ResourceWarning`` at most).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload._jobs import JobBook, as_timeout
from kvoffload.errors import (
    ClosedError,
    InvalidArgumentError,
    RemoteError,
    RemoteShutdownError,
    RemoteTimeoutError,
    WaitTimeoutError,
    warn_on_del,
)
from kvoffload.records import Direction, TransferResult
from kvoffload.remote._args import as_host_rows, as_keys
from kvoffload.remote._types import (
    RemoteErrorKind,
    RemoteResult,
    RemoteStore,
    RemoteTierStats,
    frozen_counts,
    remote_error,
)
from kvoffload.remote.config import RemoteConfig, open_store

__all__ = ["RemoteTier", "check_keys"]

I64Array = npt.NDArray[np.int64]
U8Array = npt.NDArray[np.uint8]

#: How long shutdown waits for the job thread after the store was closed, even past the deadline:
#: the store's close wakes the thread's call, and the thread then only publishes and exits.
THREAD_EXIT_GRACE_S: Final = 1.0
_DIRECTIONS: Final = (Direction.PUT_REMOTE, Direction.GET_REMOTE)


@attrs.define(eq=False)
class _Job:
    job_id: int
    direction: Direction
    keys: list[bytes]
    rows: I64Array
    deadline: float


class RemoteTier:
    """A store and the thread that runs a Worker's remote jobs on it (see the module docstring).

    Build it with :meth:`create`; ``__init__`` only stores fields.
    """

    #: Results are published by the tier's thread (waiters sleep on the book).
    pushes = True

    def __init__(self, *, store: RemoteStore, rows: U8Array, book: JobBook, timeout_s: float) -> None:
        self._store = store
        self._rows: U8Array | None = rows
        self.record_bytes = int(rows.shape[1])
        self.num_rows = int(rows.shape[0])
        self.timeout_s = timeout_s
        self._book = book
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._unsettled: dict[int, threading.Event] = {}
        self._outstanding: set[threading.Event] = set()
        self._closed = False
        self._stopping = False
        self._client_left_open = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._failures = {k.value: 0 for k in RemoteErrorKind}
        self._thread = threading.Thread(target=self._loop, name="kvoffload-remote-tier", daemon=True)

    @classmethod
    def create(cls, config: RemoteConfig, *, host_rows: object, fingerprint: str, book: JobBook) -> RemoteTier:
        """Build the store ``config`` names over ``host_rows`` (borrowed) and start the job thread.

        Raises:
            ArgumentTypeError, InvalidArgumentError: a bad config or host rows (nothing started).
            RemoteUnavailableError: the store's package is missing or its cluster cannot be joined
                (nothing is left open).
        """
        rows = as_host_rows(host_rows)
        store = open_store(config, host_rows=host_rows, fingerprint=fingerprint)
        try:
            tier = cls(store=store, rows=rows, book=book, timeout_s=config.job_timeout_s)
            tier._thread.start()
        except BaseException:
            store.close()
            raise
        book.attach(tier)
        return tier

    # ---------------------------------------------------------------------------------- queries

    @property
    def backend(self) -> str:
        """The store's name (``"mooncake"``, ``"redis-cluster"``, or an injected store's)."""
        return self._store.backend

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    @property
    def thread_stopped(self) -> bool:
        """True when nothing of the tier can touch the host rows: the job thread stopped and the
        store's client was released (not left open inside a call)."""
        return not self._thread.is_alive() and not self._client_left_open

    def stats(self) -> RemoteTierStats:
        """Counters since creation (also after shutdown)."""
        store = self._store.stats()
        with self._cond:
            c = self._counts
            return RemoteTierStats(
                put_jobs=c["put_jobs"], get_jobs=c["get_jobs"], failed_put_jobs=c["failed_put_jobs"],
                failed_get_jobs=c["failed_get_jobs"], records_put=c["records_put"],
                records_got=c["records_got"], bytes_put=c["records_put"] * self.record_bytes,
                bytes_got=c["records_got"] * self.record_bytes, failures=frozen_counts(self._failures),
                held_jobs=len(self._outstanding), queued_jobs=len(self._queue) + (self._running is not None),
                store=store,
            )

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no job is queued or running and every abandoned store call returned; True if
        that happened within ``timeout`` seconds (then no call of the tier touches the host rows)."""
        deadline = time.monotonic() + as_timeout(timeout)
        with self._cond:
            while self._queue or self._running is not None or self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return self._store.wait_idle(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------------------------- jobs

    def submit(self, job_id: int, direction: Direction, keys: list[bytes], rows: I64Array) -> None:
        """Queue a job the Worker validated, booked and reserved in the book.

        Raises:
            ClosedError: after shutdown (nothing queued).
        """
        assert direction in _DIRECTIONS
        job = _Job(job_id, direction, keys, rows, time.monotonic() + self.timeout_s)
        with self._cond:
            if self._closed:
                raise ClosedError("the remote tier was shut down")
            self._counts["put_jobs" if direction is Direction.PUT_REMOTE else "get_jobs"] += 1
            self._queue.append(job)
            self._cond.notify_all()

    def take_unsettled(self, job_id: int) -> threading.Event | None:
        """The settle event of job ``job_id`` if its store call was abandoned and has not returned
        (the Worker's call when it returns the job's result; once per job), else None."""
        with self._cond:
            event = self._unsettled.pop(job_id, None)
        return None if event is None or event.is_set() else event

    def advance(self) -> None:
        """Nothing to look for: the tier's thread publishes results as jobs finish."""

    def wait_progress(self, job_id: int, timeout: float) -> None:
        """Not called: the book waits for a pushing source itself."""

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._running = job
            result, kinds, ok_keys = self._run(job)
            with self._cond:
                self._running = None
                self._count(job, result, kinds, ok_keys)
                self._cond.notify_all()
            self._book.finish(job.job_id, result)

    def _run(self, job: _Job) -> tuple[TransferResult, collections.Counter[str], int]:
        """One job's store call (never raises): its result, its failed keys by kind, and how many
        keys succeeded."""
        if time.monotonic() >= job.deadline:
            error: RemoteError = RemoteTimeoutError(
                f"{job.direction.value} job {job.job_id}: its deadline of {self.timeout_s:g} s passed "
                "before the store was called", keys=job.keys,
            )
            return self._failed(job, error)
        hold = threading.Event()
        with self._cond:
            self._outstanding.add(hold)
        settled = lambda: self._settled(hold)  # noqa: E731 - called on the store's lane
        left = max(0.0, job.deadline - time.monotonic())
        try:
            if job.direction is Direction.PUT_REMOTE:
                outcome = self._store.put(job.keys, job.rows, timeout=left, on_settled=settled)
            else:
                outcome = self._store.get(job.keys, job.rows, timeout=left, on_settled=settled)
        except ClosedError as exc:
            self._settled(hold)
            error = remote_error(RemoteErrorKind.CLOSED, f"{job.direction.value} job {job.job_id}: {exc}", job.keys)
            return self._failed(job, error)
        except Exception as exc:  # noqa: BLE001 - a store's bug fails the job, not the thread
            self._settled(hold)
            error = remote_error(
                RemoteErrorKind.REJECTED,
                f"{job.direction.value} job {job.job_id}: the store raised {type(exc).__name__}: {exc}", job.keys,
            )
            return self._failed(job, error)
        if outcome.settled:
            self._settled(hold)
        else:
            with self._cond:
                self._unsettled[job.job_id] = hold
        kinds = collections.Counter(str(e.kind) for e in outcome.errors if e is not None)
        result = TransferResult(
            job_id=job.job_id, direction=job.direction, ok=outcome.ok,
            nbytes=len(job.keys) * self.record_bytes, seconds=outcome.seconds, path=self.backend,
            error=_job_error(job, outcome, kinds),
        )
        return result, kinds, sum(outcome.succeeded)

    def _settled(self, hold: threading.Event) -> None:
        """The store returned a call (or never started it): its rows are free again."""
        hold.set()
        with self._cond:
            self._outstanding.discard(hold)
            self._cond.notify_all()

    def _failed(self, job: _Job, error: RemoteError) -> tuple[TransferResult, collections.Counter[str], int]:
        """A job failed by the tier itself (no store call ran): a get's rows are zero-filled."""
        rows = self._rows
        if job.direction is Direction.GET_REMOTE and rows is not None:
            rows[job.rows] = 0
        result = TransferResult(
            job_id=job.job_id, direction=job.direction, ok=not job.keys,
            nbytes=len(job.keys) * self.record_bytes, seconds=0.0, path=self.backend,
            error=error if job.keys else None,
        )
        return result, collections.Counter({str(error.kind): len(job.keys)}), 0

    def _count(self, job: _Job, result: TransferResult, kinds: collections.Counter[str], ok_keys: int) -> None:
        """Under the lock: a finished job's counters."""
        put = job.direction is Direction.PUT_REMOTE
        if not result.ok:
            self._counts["failed_put_jobs" if put else "failed_get_jobs"] += 1
        for kind, n in kinds.items():
            self._failures[kind] = self._failures.get(kind, 0) + n
        self._counts["records_put" if put else "records_got"] += ok_keys

    # ---------------------------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float) -> None:
        """Drain, close the store and stop the thread, with the contract of the module docstring.

        Raises:
            InvalidArgumentError: a malformed timeout (nothing is done then).
            RemoteShutdownError: after all cleanup, carrying every failure; ``client_left_open``
                when a store call was still inside the client (the host rows are still in use).
        """
        seconds = as_timeout(timeout)
        with self._cond:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + seconds
        failures: list[BaseException] = []
        with self._cond:
            while (self._queue or self._running is not None) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            cancelled = list(self._queue)
            self._queue.clear()
            self._stopping = True
            self._cond.notify_all()
        for job in cancelled:
            error = remote_error(
                RemoteErrorKind.CLOSED,
                f"{job.direction.value} job {job.job_id}: the worker shut down before it started", job.keys,
            )
            result, kinds, _ = self._failed(job, error)
            with self._cond:
                self._count(job, result, kinds, 0)
            self._book.finish(job.job_id, result)
        if cancelled:
            failures.append(WaitTimeoutError(
                f"remote tier: {len(cancelled)} queued job(s) had not started at the shutdown deadline",
                pending=[job.job_id for job in cancelled],
            ))
        try:
            self._store.close(max(0.0, deadline - time.monotonic()))
        except RemoteShutdownError as exc:
            failures.append(exc)
            self._client_left_open = exc.client_left_open
        except Exception as exc:  # noqa: BLE001 - collected and re-raised below
            failures.append(exc)
        self._thread.join(max(THREAD_EXIT_GRACE_S, deadline - time.monotonic()))
        if self._thread.is_alive():
            failures.append(WaitTimeoutError("the remote tier's job thread did not stop"))
        if self.thread_stopped:
            self._rows = None
        if failures:
            raise RemoteShutdownError(
                "remote tier shutdown failed", failures, client_left_open=self._client_left_open
            )

    __del__ = warn_on_del("_closed", "RemoteTier was never shut down; call shutdown()")


def _job_error(job: _Job, outcome: RemoteResult, kinds: collections.Counter[str]) -> RemoteError | None:
    """One error for a job whose keys failed: the first failed key's class and kind, a message that
    counts the failures by kind, and every failed key."""
    failed = outcome.failed
    first = outcome.error
    if first is None:
        return None
    summary = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
    message = (f"{job.direction.value} job {job.job_id}: {len(failed)} of {len(job.keys)} keys failed "
               f"({summary}); first: {first}")
    keys = tuple(job.keys[i] for i in failed)
    if isinstance(first, RemoteTimeoutError):
        return RemoteTimeoutError(message, keys=keys, settled=outcome.settled, code=first.code, kinds=kinds)
    return type(first)(message, kind=first.kind, keys=keys, code=first.code, kinds=kinds)


def check_keys(keys: object, count: int) -> list[bytes]:
    """A job's keys: ``count`` distinct keys of 1..MAX_KEY_BYTES bytes (see ``Worker.put_remote``).

    Raises:
        KeyTypeError, DuplicateKeyError, InvalidArgumentError: naming the key and the rule.
    """
    key_list = as_keys(keys, unique=True)
    if len(key_list) != count:
        raise InvalidArgumentError(f"keys has {len(key_list)} entries but host_blocks has {count}")
    return key_list
