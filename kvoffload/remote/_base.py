"""The machinery every remote store shares: the calls, checksums, verification, deadlines, close.

A store owns one *lane* thread (:mod:`kvoffload.remote._lane`) that makes every call into the store client, one after the other,
and a small pool of checksum threads; it borrows the host rows (``uint8[n, record_bytes]``) from its
creator. Callers submit a call from any thread and wait for it until the call's deadline:

* put: the records are cut into chunks of ``batch_records``; the checksum threads compute each
  chunk's payload CRC32s and header pages (and the client's staged copy, if it sends copies) ahead
  of the lane, in two slots, so the client sends chunk k while chunk k+1 is prepared; the lane
  hands each chunk to the client;
* get: the lane fetches chunk k into the header pages and the host rows while the checksum threads
  verify chunk k-1 (:func:`kvoffload._record.verify_record`, the check every tier's records get);
  a key that failed anywhere has its host row zero-filled before the call returns;
* exists and remove: chunks of keys, no checksums.

Deadlines: the lane checks the deadline before each chunk and fails the keys of the chunks not yet
started (``timeout``, settled: the client never saw them). A caller whose deadline passes while the
lane is still inside the client gets every key failed with ``timeout`` and ``settled=False``: the
client may still read (put) or write (get) the call's rows until :meth:`RemoteStoreBase.wait_idle`
says the store is idle, or until the call's ``on_settled`` was called (on the lane, once the client
returned it); when such a get returns, the lane zero-fills all its rows before ``on_settled``. A call
not yet started at its deadline is dropped from the queue (settled).

Close contract: mark closed (later calls raise :class:`~kvoffload.errors.ClosedError`); calls already
queued run (each bounded by its own deadline) unless the close deadline passes first, when the calls
not started are failed (``closed``) and the caller of a call still inside the client stops waiting
(its result is unsettled, as at its own deadline). The lane is joined with the deadline; only when it
stopped are the client's registrations released and the client closed, exactly once, on a thread
of their own joined with the time left (at least :data:`RELEASE_JOIN_MIN_S`: a client's close may
wait on a service that stopped answering). A lane still inside the client keeps the client open for
the rest of the process (closing it under a running call could let the call touch freed memory):
the lane releases it when that call returns. Either way the
:class:`~kvoffload.errors.RemoteShutdownError` says so (``client_left_open``). ``close`` is
idempotent; no cleanup in ``__del__``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Final, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload import _record as record
from kvoffload.errors import ArgumentTypeError, ClosedError, RemoteError, RemoteShutdownError, RemoteTimeoutError
from kvoffload.remote._args import as_generations, as_keys, as_rows, as_timeout
from kvoffload.remote._lane import Lane, Op, OpState
from kvoffload.remote._types import (
    RemoteErrorKind,
    RemoteOp,
    RemoteResult,
    RemoteStats,
    frozen_counts,
)

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT_S",
    "HEADER_SLOTS",
    "OK",
    "ChunkStatus",
    "RemoteStoreBase",
    "StoreClient",
]

U8Array = npt.NDArray[np.uint8]
I64Array = npt.NDArray[np.int64]
#: An op's succeeded, errors, generations and bytes as its caller gets them (``_outcome``).
_Outcome = tuple[tuple[bool, ...], tuple[RemoteError | None, ...], tuple[int, ...], int]

DEFAULT_CLOSE_TIMEOUT_S: Final = 10.0
#: The least a close waits for the client's release, even past its deadline (a close given no time
#: still closes an idle client).
RELEASE_JOIN_MIN_S: Final = 0.1
#: Chunks of header pages: the client moves one while the checksum threads prepare the next.
HEADER_SLOTS: Final = 2


@attrs.frozen
class ChunkStatus:
    """One key's outcome of a client call: ``kind`` None on success (``present`` for exists)."""

    kind: RemoteErrorKind | None = None
    message: str = ""
    code: int | None = None
    present: bool = True


OK: Final = ChunkStatus()


class StoreClient(Protocol):
    """The seam between the shared machinery and one store's client (called on the lane only).

    Each method handles one chunk (at most ``batch_records`` keys) and returns one status per key;
    it may raise for a failure of the whole chunk (the store maps the exception through
    :meth:`failure`). ``headers`` are the chunk's header pages (``uint8[len(keys), PAGE_BYTES]``),
    ``rows`` the host row indices; a get writes each key's header page and host row.
    """

    backend: str

    def prepare_put(self, slot: int, headers: U8Array, rows: I64Array) -> None:
        """Checksum thread, after the chunk's header pages were packed: stage what ``put_chunk`` of
        the same ``slot`` (0..HEADER_SLOTS-1) will send, if the client sends copies."""
        ...

    def put_chunk(self, keys: Sequence[bytes], headers: U8Array, rows: I64Array, slot: int) -> list[ChunkStatus]: ...

    def get_chunk(self, keys: Sequence[bytes], headers: U8Array, rows: I64Array) -> list[ChunkStatus]: ...

    def exists_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]: ...

    def remove_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]: ...

    def failure(self, exc: Exception) -> ChunkStatus:
        """The status every key of a chunk gets when the client raised ``exc``."""
        ...

    def close(self) -> None:
        """Release the client's registrations and connections (called once, lane stopped)."""
        ...


class RemoteStoreBase:
    """The shared part of a remote store (see the module docstring for the threads and contracts).

    Owns: the lane thread, the checksum threads, the header pages, the store client (through the
    ``StoreClient`` a subclass hands in). Borrows: the host rows; they must stay mapped until
    ``close`` returned without ``client_left_open``.
    """

    def __init__(
        self,
        *,
        client: StoreClient,
        host_rows: U8Array,
        headers: U8Array,
        fingerprint: bytes,
        batch_records: int,
        checksum_threads: int,
        lane: Lane,
    ) -> None:
        self._client = client
        self._rows: U8Array | None = host_rows
        self._headers = headers
        self._fingerprint = fingerprint
        self._batch = batch_records
        self._record_bytes = int(host_rows.shape[1])
        self._num_rows = int(host_rows.shape[0])
        self._checksum_threads = checksum_threads
        self._pool = concurrent.futures.ThreadPoolExecutor(checksum_threads, "kvoffload-remote-crc")
        self._lane = lane
        self._lock = lane.lock
        self._closed = False
        self._released = False
        self._last_generation = 0
        self._calls = 0
        self._records_put = self._records_got = self._bytes_put = self._bytes_got = 0
        self._failures = {k.value: 0 for k in RemoteErrorKind}
        self._abandoned = 0
        lane.bind_finish(self._finish)
        lane.start(self._run)

    # -------------------------------------------------------------------------------- public

    @property
    def backend(self) -> str:
        """The store's name: ``"mooncake"`` or ``"redis-cluster"``."""
        return self._client.backend

    @property
    def record_bytes(self) -> int:
        """Bytes of one host record (a stored record is ``record.PAGE_BYTES`` more)."""
        return self._record_bytes

    @property
    def num_rows(self) -> int:
        """Number of host rows the store borrows."""
        return self._num_rows

    @property
    def fingerprint(self) -> str:
        """The layout fingerprint written into, and required from, every record."""
        return self._fingerprint.decode()

    def put(
        self,
        keys: Sequence[bytes],
        rows: Sequence[int] | I64Array,
        *,
        timeout: float,
        on_settled: Callable[[], None] | None = None,
    ) -> RemoteResult:
        """Store the host rows ``rows[i]`` as records under ``keys[i]``, within ``timeout`` seconds.

        Each record gets a new generation (increasing in this process, from the wall clock). A key
        that already holds a value keeps it (the first writer wins; the key still counts as
        succeeded, and the value is not read: one that is not a record of this layout fails the
        ``get`` that verifies it). The rows are only read; they must not change until the call returns (and, for
        an unsettled result, until ``wait_idle`` or ``on_settled``). ``on_settled`` is called only
        for an unsettled result, on the lane thread, once the client returned the call (it must not
        block). Store failures are in the result, never raised.

        Raises:
            KeyTypeError, DuplicateKeyError, InvalidArgumentError, InvalidBlockIdError,
            BlockIdTypeError, ArgumentTypeError: bad arguments (nothing was submitted).
            ClosedError: after ``close``.
        """
        key_list = as_keys(keys, unique=True)
        row_ids = as_rows(rows, len(key_list), self._num_rows, unique=False)
        op = self._make_op(RemoteOp.PUT, key_list, row_ids, timeout, None, on_settled)
        op.put_generations = self._new_generations(len(key_list))
        return self._submit(op)

    def get(
        self,
        keys: Sequence[bytes],
        rows: Sequence[int] | I64Array,
        *,
        timeout: float,
        generations: Sequence[int | None] | None = None,
        on_settled: Callable[[], None] | None = None,
    ) -> RemoteResult:
        """Read the records under ``keys[i]`` into host rows ``rows[i]`` and verify every one.

        ``generations[i]`` (optional) is the generation the caller expects for key i (None: any).
        A key that succeeded has its row holding the verified host record; the row of every key
        that failed (missing, not verified, not read in time, store error) is zero-filled, never
        left with a partial or foreign record: at the return, or, for an unsettled result, once the
        client returned the call, before ``on_settled`` is called (as for :meth:`put`). Store
        failures are in the result, never raised.

        Raises:
            KeyTypeError, DuplicateKeyError, InvalidArgumentError, InvalidBlockIdError (a row named
            twice, out of range), BlockIdTypeError, ArgumentTypeError: bad arguments (nothing was
            submitted). ClosedError: after ``close``.
        """
        key_list = as_keys(keys, unique=True)
        row_ids = as_rows(rows, len(key_list), self._num_rows, unique=True)
        expected = as_generations(generations, len(key_list))
        return self._submit(self._make_op(RemoteOp.GET, key_list, row_ids, timeout, expected, on_settled))

    def exists(self, keys: Sequence[bytes], *, timeout: float) -> RemoteResult:
        """Which keys the store holds a record under (``succeeded[i]``), without reading them.

        A present key may still fail its get (another layout, damaged, evicted meanwhile).

        Raises:
            KeyTypeError, InvalidArgumentError, ArgumentTypeError: bad arguments. ClosedError.
        """
        key_list = as_keys(keys, unique=False)
        return self._submit(self._make_op(RemoteOp.EXISTS, key_list, None, timeout, None))

    def remove(self, keys: Sequence[bytes], *, timeout: float) -> RemoteResult:
        """Remove the records under ``keys`` (a key already absent succeeds).

        Raises:
            KeyTypeError, InvalidArgumentError, ArgumentTypeError: bad arguments. ClosedError.
        """
        key_list = as_keys(keys, unique=False)
        return self._submit(self._make_op(RemoteOp.REMOVE, key_list, None, timeout, None))

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no call of this store is queued or running; True if it got there in time.

        After an unsettled result, the call's host rows may be reused once this returned True.
        """
        deadline = time.monotonic() + as_timeout(timeout)
        with self._lane.cond:
            while self._lane.queue or self._lane.running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lane.cond.wait(left)
        return True

    def stats(self) -> RemoteStats:
        """A snapshot of the counters (usable after ``close``)."""
        with self._lock:
            return RemoteStats(
                backend=self.backend, record_bytes=self._record_bytes, calls=self._calls,
                records_put=self._records_put, records_got=self._records_got,
                bytes_put=self._bytes_put, bytes_got=self._bytes_got,
                failures=frozen_counts(self._failures), abandoned=self._abandoned,
                busy=int(self._lane.running is not None and self._lane.running.state is OpState.ABANDONED),
                closed=self._closed,
            )

    def close(self, timeout: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Drain and release everything (module docstring: *Close contract*); idempotent.

        Raises:
            RemoteShutdownError: after all cleanup ran, when the lane did not stop in time (the
                client was left open) or releasing the client failed.
            ArgumentTypeError, InvalidArgumentError: a bad timeout (nothing changed).
        """
        deadline = time.monotonic() + as_timeout(timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        failures: list[BaseException] = []
        stopped = self._lane.stop(deadline, self._zero_failed)
        self._released = True
        released = False
        if stopped:
            released = self._release_by(deadline, failures)
        else:
            failures.append(
                TimeoutError(
                    f"the {self.backend} store's lane was still inside the client at the close deadline; "
                    "the client is released when that call returns"
                )
            )
            if self._lane.release_when_stopped(self._release_quietly):
                released = self._release_by(deadline, failures)  # it stopped meanwhile
        if failures:
            raise RemoteShutdownError(
                f"closing the {self.backend} store failed", failures, client_left_open=not released
            )

    def _release_by(self, deadline: float, failures: list[BaseException]) -> bool:
        """:meth:`_release` on a thread of its own, joined by ``deadline`` (at least
        :data:`RELEASE_JOIN_MIN_S`); its failures go to ``failures``. False when it still runs then:
        the client's close is left to that thread, and a failure says so."""
        found: list[BaseException] = []
        thread = threading.Thread(target=lambda: found.extend(self._release()),
                                  name=f"kvoffload-{self.backend}-close", daemon=True)
        thread.start()
        thread.join(max(RELEASE_JOIN_MIN_S, deadline - time.monotonic()))
        if thread.is_alive():
            failures.append(TimeoutError(
                f"the {self.backend} client's close had not returned at the close deadline; it goes on "
                "in its own thread"
            ))
            return False
        failures.extend(found)
        return True

    def _release(self) -> list[BaseException]:
        """Stop the checksum threads, close the client and drop the rows (the lane has stopped)."""
        failures: list[BaseException] = []
        self._pool.shutdown(wait=True)
        try:
            self._client.close()
        except Exception as exc:  # noqa: BLE001 - collected and re-raised by close
            failures.append(exc)
        self._rows = None
        return failures

    def _release_quietly(self) -> None:
        """The lane's last act after a close that timed out: release, and warn what failed."""
        for failure in self._release():
            warnings.warn(f"releasing the {self.backend} store after close: {failure}", ResourceWarning, stacklevel=1)

    def __enter__(self) -> RemoteStoreBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            warnings.warn(f"a {type(self).__name__} was never closed", ResourceWarning, stacklevel=1)

    # ------------------------------------------------------------------------- caller side

    def _make_op(
        self,
        kind: RemoteOp,
        keys: list[bytes],
        rows: I64Array | None,
        timeout: float,
        expected: list[int | None] | None,
        on_settled: Callable[[], None] | None = None,
    ) -> Op:
        seconds = as_timeout(timeout)
        if on_settled is not None and not callable(on_settled):
            raise ArgumentTypeError(f"on_settled = {on_settled!r} must be callable or None")
        if self._closed:
            raise ClosedError(f"the {self.backend} store is closed")
        return Op(kind, keys, rows, time.monotonic() + seconds, expected, on_settled)

    def _new_generations(self, count: int) -> list[int]:
        with self._lock:
            first = max(time.time_ns(), self._last_generation + 1)
            self._last_generation = first + count - 1
        return list(range(first, first + count))

    def _submit(self, op: Op) -> RemoteResult:
        start = time.monotonic()
        if not op.keys:
            return self._result(op, start)
        self._lane.push(op, self._closed_check)
        op.done.wait(max(0.0, op.deadline - time.monotonic()))
        with self._lock:
            self._calls += 1
            if op.state is OpState.DONE:
                pass
            elif op.state is OpState.PENDING:
                op.state = OpState.CANCELLED
                self._lane.drop(op)
                self._fail_all(op, settled=True)
                self._zero_failed(op)  # never started: nothing else touches its rows
            elif op.state is OpState.RUNNING:
                op.state = OpState.ABANDONED
                self._abandoned += 1
                self._fail_all(op, settled=False)
            outcome = self._outcome(op)  # a snapshot: an abandoned op's lists still change
            self._count(op, outcome)
            return self._result(op, start, outcome)

    def _closed_check(self) -> None:
        if self._closed:
            raise ClosedError(f"the {self.backend} store is closed")

    def _fail_all(self, op: Op, *, settled: bool) -> None:
        where = "before the store client started it" if settled else "while the store client was running it"
        what = "the store's close deadline" if time.monotonic() < op.deadline else f"the {op.kind.value} deadline"
        n = len(op.keys)
        named = f"key {op.keys[0]!r}" if n == 1 else f"{n} keys ({op.keys[0]!r}, ...)"
        # One error for every key, naming them all: an error object per key cost about 10 us each
        # under the lock, so a call of 200,000 keys returned 2 s past its deadline (an audit).
        error = RemoteTimeoutError(f"{named}: {what} passed {where}", keys=tuple(op.keys), settled=settled)
        op.succeeded[:] = [False] * n
        op.generations[:] = [0] * n
        op.errors[:] = [error] * n
        op.nbytes = 0
        op.settled = settled

    def _outcome(self, op: Op) -> _Outcome:
        """The op's succeeded, errors, generations and bytes as the caller gets them: a key with an
        error never succeeded. (The lane writes an abandoned op's lists without the lock: a key it
        finds present after the caller's deadline failed it stays failed.)"""
        errors = tuple(op.errors)
        succeeded = tuple(ok and error is None for ok, error in zip(op.succeeded, errors))
        generations = tuple(g if error is None else 0 for g, error in zip(op.generations, errors))
        moved = op.kind in (RemoteOp.PUT, RemoteOp.GET)
        nbytes = sum(succeeded) * (record.PAGE_BYTES + self._record_bytes) if moved else 0
        return succeeded, errors, generations, nbytes

    def _count(self, op: Op, outcome: _Outcome) -> None:
        succeeded, errors, _, nbytes = outcome
        ok = sum(succeeded) if op.kind in (RemoteOp.PUT, RemoteOp.GET) else 0
        if op.kind is RemoteOp.PUT:
            self._records_put += ok
            self._bytes_put += nbytes
        elif op.kind is RemoteOp.GET:
            self._records_got += ok
            self._bytes_got += nbytes
        for error in errors:
            if error is not None:
                self._failures[error.kind] = self._failures.get(error.kind, 0) + 1

    def _result(self, op: Op, start: float, outcome: _Outcome | None = None) -> RemoteResult:
        succeeded, errors, generations, nbytes = self._outcome(op) if outcome is None else outcome
        return RemoteResult(
            op=op.kind, succeeded=succeeded, errors=errors, generations=generations, nbytes=nbytes,
            seconds=time.monotonic() - start, settled=op.settled,
        )

    # --------------------------------------------------------------------------- lane side

    def _run(self, op: Op) -> None:
        """Run one op on the lane (the state is RUNNING); never raises."""
        try:
            if op.kind is RemoteOp.PUT:
                self._run_put(op)
            elif op.kind is RemoteOp.GET:
                self._run_get(op)
            else:
                self._run_keys(op)
        except Exception as exc:  # noqa: BLE001 - a bug must fail the op, not kill the lane
            for i in range(len(op.keys)):
                if op.errors[i] is None and not op.succeeded[i]:
                    op.fail(i, RemoteErrorKind.REJECTED, f"internal error: {type(exc).__name__}: {exc}")
        if op.kind is RemoteOp.GET:
            self._zero_failed(op)
        op.nbytes = sum(op.succeeded) * (record.PAGE_BYTES + self._record_bytes) if op.kind in (RemoteOp.PUT, RemoteOp.GET) else 0

    def _chunks(self, n: int) -> list[range]:
        return [range(i, min(i + self._batch, n)) for i in range(0, n, self._batch)]

    def _late(self, op: Op, chunks: list[range], first: int) -> bool:
        """Fail the keys of chunks ``first..`` when the deadline passed (they never started)."""
        if time.monotonic() < op.deadline:
            return False
        for chunk in chunks[first:]:
            for i in chunk:
                op.fail(i, RemoteErrorKind.TIMEOUT, f"the {op.kind.value} deadline passed before it started")
        return True

    def _call(self, op: Op, chunk: range, fn: Callable[[], list[ChunkStatus]]) -> list[ChunkStatus]:
        try:
            statuses = fn()
        except Exception as exc:  # noqa: BLE001 - the client's own errors, mapped per store
            return [self._client.failure(exc)] * len(chunk)
        if len(statuses) != len(chunk):
            return [ChunkStatus(RemoteErrorKind.REJECTED, f"the client answered {len(statuses)} of {len(chunk)} keys")] * len(chunk)
        return statuses

    def _page_slot(self, k: int, size: int) -> U8Array:
        start = (k % HEADER_SLOTS) * self._batch
        return self._headers[start : start + size]

    def _prepare(self, op: Op, chunk: range, k: int) -> None:
        """Checksum thread: payload CRCs and header pages of put chunk ``k``, then the client's staging."""
        rows = self._rows
        assert rows is not None and op.rows is not None
        pages = self._page_slot(k, len(chunk))
        for j, i in enumerate(chunk):
            row = rows[int(op.rows[i])]
            record.pack_header(
                pages[j], file_id=0, block=0, generation=op.put_generations[i],
                crc=record.payload_crc(row), payload_bytes=self._record_bytes, key=op.keys[i],
                fingerprint=self._fingerprint,
            )
        self._client.prepare_put(k % HEADER_SLOTS, pages, op.rows[chunk.start : chunk.stop])

    def _run_put(self, op: Op) -> None:
        assert op.rows is not None
        chunks = self._chunks(len(op.keys))
        ready: dict[int, concurrent.futures.Future[None]] = {}
        for k in range(min(HEADER_SLOTS, len(chunks))):
            ready[k] = self._pool.submit(self._prepare, op, chunks[k], k)
        try:
            for k, chunk in enumerate(chunks):
                ready.pop(k).result()
                if self._late(op, chunks, k):
                    break
                pages = self._page_slot(k, len(chunk))
                rows = op.rows[chunk.start : chunk.stop]
                keys = op.keys[chunk.start : chunk.stop]
                slot = k % HEADER_SLOTS
                for i, status in zip(chunk, self._call(op, chunk, lambda: self._client.put_chunk(keys, pages, rows, slot))):
                    if status.kind is None:
                        op.succeeded[i] = True
                        op.generations[i] = op.put_generations[i]
                    else:
                        op.fail(i, status.kind, status.message, status.code)
                if k + HEADER_SLOTS < len(chunks):
                    ready[k + HEADER_SLOTS] = self._pool.submit(
                        self._prepare, op, chunks[k + HEADER_SLOTS], k + HEADER_SLOTS
                    )
        finally:
            for future in ready.values():  # never leave a checksum thread on the header pages
                future.result()

    def _verify(self, op: Op, chunk: range, pages: U8Array, part: range) -> None:
        """Checksum thread: verify the records ``part`` (positions in ``chunk``) of one get chunk that
        the client read."""
        rows = self._rows
        assert rows is not None and op.rows is not None and op.expected is not None
        for j in part:
            i = chunk[j]
            if op.errors[i] is not None:
                continue
            verdict = record.verify_record(
                pages[j], rows[int(op.rows[i])],
                record.Expected(payload_bytes=self._record_bytes, fingerprint=self._fingerprint,
                                key=op.keys[i], generation=op.expected[i], require_checksum=True),
            )
            if verdict.fault is None:
                op.succeeded[i] = True
                op.generations[i] = verdict.generation
            else:
                op.fail(i, _REMOTE_KINDS.get(verdict.fault, RemoteErrorKind.HEADER_INVALID), verdict.message)

    def _run_get(self, op: Op) -> None:
        assert op.rows is not None
        chunks = self._chunks(len(op.keys))
        # a chunk's records are verified in up to checksum_threads parts at once, so that the last
        # chunk's check (the only one not hidden behind a transfer) takes 1/threads of its time
        checks: dict[int, list[concurrent.futures.Future[None]]] = {}
        try:
            for k, chunk in enumerate(chunks):
                for future in checks.pop(k - HEADER_SLOTS, ()):
                    future.result()
                if self._late(op, chunks, k):
                    break
                pages = self._page_slot(k, len(chunk))
                rows = op.rows[chunk.start : chunk.stop]
                keys = op.keys[chunk.start : chunk.stop]
                for i, status in zip(chunk, self._call(op, chunk, lambda: self._client.get_chunk(keys, pages, rows))):
                    if status.kind is not None:
                        op.fail(i, status.kind, status.message, status.code)
                checks[k] = [self._pool.submit(self._verify, op, chunk, pages, part)
                             for part in _parts(len(chunk), self._checksum_threads)]
        finally:
            for futures in checks.values():
                for future in futures:
                    future.result()

    def _run_keys(self, op: Op) -> None:
        chunks = self._chunks(len(op.keys))
        for k, chunk in enumerate(chunks):
            if self._late(op, chunks, k):
                break
            keys = op.keys[chunk.start : chunk.stop]
            fn = self._client.exists_chunk if op.kind is RemoteOp.EXISTS else self._client.remove_chunk
            for i, status in zip(chunk, self._call(op, chunk, lambda: fn(keys))):
                if status.kind is None:
                    op.succeeded[i] = status.present
                else:
                    op.fail(i, status.kind, status.message, status.code)

    def _zero_failed(self, op: Op) -> None:
        """Zero-fill the host rows of a get's failed keys (never partial or foreign bytes). A
        put's rows are its source: never touched (a put that failed or never started leaves the
        host copy it was to write as it was)."""
        rows = self._rows
        if op.kind is not RemoteOp.GET or rows is None or op.rows is None:
            return
        for i, ok in enumerate(op.succeeded):
            if not ok:
                rows[int(op.rows[i])].fill(0)

    def _finish(self, op: Op) -> None:
        """Lane, under the lock: the op returned from the client."""
        if op.state is OpState.ABANDONED and op.kind is RemoteOp.GET and self._rows is not None and op.rows is not None:
            for row in op.rows:  # the caller was told every key failed
                self._rows[int(row)].fill(0)


def _parts(n: int, parts: int) -> list[range]:
    """``range(n)`` cut into at most ``parts`` consecutive, non-empty ranges of near-equal length."""
    parts = max(1, min(parts, n))
    bounds = [n * p // parts for p in range(parts + 1)]
    return [range(bounds[p], bounds[p + 1]) for p in range(parts)]


#: The remote kind of each record fault (a record naming a disk block is not a remote record).
_REMOTE_KINDS: Final = {
    record.RecordFault.SIZE_MISMATCH: RemoteErrorKind.SIZE_MISMATCH,
    record.RecordFault.FINGERPRINT_MISMATCH: RemoteErrorKind.FINGERPRINT_MISMATCH,
    record.RecordFault.KEY_MISMATCH: RemoteErrorKind.KEY_MISMATCH,
    record.RecordFault.GENERATION_MISMATCH: RemoteErrorKind.GENERATION_MISMATCH,
    record.RecordFault.CHECKSUM_MISMATCH: RemoteErrorKind.CHECKSUM_MISMATCH,
}
