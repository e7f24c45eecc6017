"""Records of the remote tier: failure kinds, per-call results and statistics (frozen values)."""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

import attrs

from kvoffload.errors import (
    RemoteError,
    RemoteIntegrityError,
    RemoteMissError,
    RemoteStoreError,
    RemoteTimeoutError,
    RemoteUnavailableError,
)

__all__ = [
    "RemoteErrorKind",
    "RemoteOp",
    "RemoteResult",
    "RemoteStats",
    "RemoteStore",
    "RemoteTierStats",
    "remote_error",
]


class RemoteErrorKind(str, enum.Enum):
    """The ``kind`` of a :class:`~kvoffload.errors.RemoteError` (compares equal to its string).

    ``NOT_FOUND`` is a :class:`~kvoffload.errors.RemoteMissError`; ``SIZE_MISMATCH`` to
    ``CHECKSUM_MISMATCH`` are :class:`~kvoffload.errors.RemoteIntegrityError`; ``TIMEOUT`` is a
    :class:`~kvoffload.errors.RemoteTimeoutError`; ``UNAVAILABLE`` and ``CLOSED`` are
    :class:`~kvoffload.errors.RemoteUnavailableError`; the rest are
    :class:`~kvoffload.errors.RemoteStoreError`.
    """

    NOT_FOUND = "not_found"
    SIZE_MISMATCH = "size_mismatch"
    HEADER_INVALID = "header_invalid"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    KEY_MISMATCH = "key_mismatch"
    GENERATION_MISMATCH = "generation_mismatch"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    CLOSED = "closed"
    STORE_FULL = "store_full"
    TRANSFER_FAILED = "transfer_failed"
    REJECTED = "rejected"


_INTEGRITY = frozenset(
    {
        RemoteErrorKind.SIZE_MISMATCH,
        RemoteErrorKind.HEADER_INVALID,
        RemoteErrorKind.FINGERPRINT_MISMATCH,
        RemoteErrorKind.KEY_MISMATCH,
        RemoteErrorKind.GENERATION_MISMATCH,
        RemoteErrorKind.CHECKSUM_MISMATCH,
    }
)


def remote_error(
    kind: RemoteErrorKind,
    message: str,
    keys: Sequence[bytes] = (),
    *,
    code: int | None = None,
    settled: bool = True,
) -> RemoteError:
    """The typed error of one failure kind (see :class:`RemoteErrorKind` for the mapping)."""
    if kind is RemoteErrorKind.NOT_FOUND:
        return RemoteMissError(message, kind=kind.value, keys=keys, code=code)
    if kind in _INTEGRITY:
        return RemoteIntegrityError(message, kind=kind.value, keys=keys, code=code)
    if kind is RemoteErrorKind.TIMEOUT:
        return RemoteTimeoutError(message, keys=keys, settled=settled, code=code)
    if kind in (RemoteErrorKind.UNAVAILABLE, RemoteErrorKind.CLOSED):
        return RemoteUnavailableError(message, kind=kind.value, keys=keys, code=code)
    return RemoteStoreError(message, kind=kind.value, keys=keys, code=code)


class RemoteOp(enum.Enum):
    """Which remote call a result belongs to."""

    PUT = "put"
    GET = "get"
    EXISTS = "exists"
    REMOVE = "remove"


@attrs.frozen
class RemoteResult:
    """The outcome of one remote call, key by key (positions follow the call's ``keys``).

    Attributes:
        op: the call.
        succeeded: per key: ``put`` the store holds a value under the key (this record, or the
            value that was already there, which the put neither replaces nor reads: a value some
            other client wrote is found out by the ``get`` that verifies it); ``get`` the host row holds the
            verified record; ``exists`` the key is present; ``remove`` the key is gone (removed, or
            absent already).
        errors: per key, the :class:`~kvoffload.errors.RemoteError` that failed it, or None. An
            ``exists`` key that is simply absent has ``succeeded=False`` and no error.
        generations: ``put``: the generation written (0 where it failed); ``get``: the generation of
            the record read (0 where it failed); 0 for the other calls.
        nbytes: record bytes moved by the keys that succeeded (header page + host record each).
        seconds: wall time of the call, from the call to its return.
        settled: False only when the deadline passed while the store client was still inside the
            operation: until ``wait_idle`` returns True the client may still read (put) or write
            (get) the call's host rows, and the call's get rows are zero-filled once it returns.
    """

    op: RemoteOp
    succeeded: tuple[bool, ...]
    errors: tuple[RemoteError | None, ...]
    generations: tuple[int, ...]
    nbytes: int
    seconds: float
    settled: bool = True

    @property
    def ok(self) -> bool:
        """True when no key failed (an ``exists`` miss is not a failure)."""
        return all(e is None for e in self.errors)

    @property
    def failed(self) -> tuple[int, ...]:
        """Positions of the keys that failed, in order."""
        return tuple(i for i, e in enumerate(self.errors) if e is not None)

    @property
    def error(self) -> RemoteError | None:
        """The error of the lowest failed position, or None."""
        return next((e for e in self.errors if e is not None), None)


@attrs.frozen
class RemoteStats:
    """Counters of one remote store since it was created.

    ``failures`` counts failed keys per :class:`RemoteErrorKind` value (every kind is present);
    ``records_put``/``records_got`` count keys that succeeded, ``bytes_put``/``bytes_got`` their
    record bytes; ``abandoned`` counts calls whose deadline passed inside the store client, and
    ``busy`` how many of those are still running now.
    """

    backend: str
    record_bytes: int
    calls: int
    records_put: int
    records_got: int
    bytes_put: int
    bytes_got: int
    failures: Mapping[str, int]
    abandoned: int
    busy: int
    closed: bool


@attrs.frozen
class RemoteTierStats:
    """Counters of a Worker's remote tier (its ``put_remote``/``get_remote`` jobs) since creation.

    ``*_jobs`` count jobs submitted and ``failed_*_jobs`` those returned ``ok=False``;
    ``records_*``/``bytes_*`` the records (and their payload bytes) of keys that succeeded;
    ``failures`` counts failed keys per :class:`RemoteErrorKind` value (every kind is present), the
    tier's own deadline misses included. ``held_jobs`` counts returned jobs whose store call was
    abandoned at its deadline and has not returned yet: their host blocks stay booked (no job may
    write them, nor read what a get still writes). ``store`` is the store's own snapshot.
    """

    put_jobs: int
    get_jobs: int
    failed_put_jobs: int
    failed_get_jobs: int
    records_put: int
    records_got: int
    bytes_put: int
    bytes_got: int
    failures: Mapping[str, int]
    held_jobs: int
    queued_jobs: int
    store: RemoteStats


def frozen_counts(counts: Mapping[str, int]) -> Mapping[str, int]:
    """A read-only copy of a counter dict."""
    return types.MappingProxyType(dict(counts))


class RemoteStore(Protocol):
    """The narrow interface of a remote tier: what the Worker and the Manager may rely on.

    A store borrows host rows (``uint8[num_rows, record_bytes]``) at creation and moves whole
    records between them and the store: one header page (CRC32 of the payload, layout fingerprint,
    key, generation) plus the host record, verified on every get. Every call takes a deadline
    (``timeout`` seconds), never blocks past it, and reports store failures per key in its
    :class:`RemoteResult` with a typed :class:`~kvoffload.errors.RemoteError`; only bad arguments
    (typed ``InvalidArgumentError``/``TypeError`` subclasses, raised before anything is submitted)
    and calls after ``close`` (:class:`~kvoffload.errors.ClosedError`) raise. Calls may come from
    any thread; the caller must not let two calls in flight write one host row (or one read a row
    that another writes), and must leave the rows of an unsettled result alone until
    ``wait_idle`` returned True or the call's ``on_settled`` was called.
    """

    @property
    def backend(self) -> str:
        """The store's name."""
        ...

    @property
    def record_bytes(self) -> int:
        """Bytes of one host record."""
        ...

    @property
    def fingerprint(self) -> str:
        """The layout fingerprint every record carries."""
        ...

    def put(
        self,
        keys: Sequence[bytes],
        rows: Sequence[int] | npt.NDArray[np.int64],
        *,
        timeout: float,
        on_settled: Callable[[], None] | None = None,
    ) -> RemoteResult:
        """Store host rows ``rows[i]`` under ``keys[i]`` (a key that holds a record keeps it).
        ``on_settled`` is called once the client returned a call whose result was unsettled."""
        ...

    def get(
        self,
        keys: Sequence[bytes],
        rows: Sequence[int] | npt.NDArray[np.int64],
        *,
        timeout: float,
        generations: Sequence[int | None] | None = None,
        on_settled: Callable[[], None] | None = None,
    ) -> RemoteResult:
        """Read and verify the records under ``keys[i]`` into rows ``rows[i]``; a failed key's row
        is zero-filled (for an unsettled result: before ``on_settled`` is called)."""
        ...

    def exists(self, keys: Sequence[bytes], *, timeout: float) -> RemoteResult:
        """Which keys the store holds (``succeeded[i]``)."""
        ...

    def remove(self, keys: Sequence[bytes], *, timeout: float) -> RemoteResult:
        """Remove the records under ``keys`` (an absent key succeeds)."""
        ...

    def wait_idle(self, timeout: float) -> bool:
        """True once no call is queued or running inside the store client."""
        ...

    def stats(self) -> RemoteStats:
        """A snapshot of the counters."""
        ...

    def close(self, timeout: float = ...) -> None:
        """Drain and release everything, exactly once; later calls raise ``ClosedError``."""
        ...
