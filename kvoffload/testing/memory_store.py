"""An in-memory remote store for tests: the real store machinery over records kept in a dict.

:class:`MemoryCluster` holds the records (a dict several stores share: engine instances on one
"cluster") and builds stores over it: :meth:`MemoryCluster.factory` is a ``RemoteConfig.store``
factory, :meth:`MemoryCluster.index` a store for a Manager's lookups. Each store is a real
:class:`~kvoffload.remote.RemoteStoreBase` (lane, checksum threads, record verification, deadlines,
close contract) over a :class:`MemoryClient`, which injects faults on demand: ``gate`` (when set)
holds every call until it is opened, ``down`` fails every call as a refused connection, and the
cluster's ``faults`` (key -> :class:`~kvoffload.remote.RemoteErrorKind`) fail the puts and gets of
those keys alone with that kind, as a store reports a key it could not take (``store_full``,
``rejected``, ``transfer_failed``, ...), every other key of the call going through. It is
for tests of an engine's use of the remote tier on one machine; Mooncake and Redis Cluster are
tested against real services (tests/remote).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from kvoffload._record import PAGE_BYTES
from kvoffload.remote._args import as_host_rows
from kvoffload.remote._base import HEADER_SLOTS, OK, ChunkStatus, RemoteStoreBase
from kvoffload.remote._lane import Lane
from kvoffload.remote._types import RemoteErrorKind, RemoteStore

__all__ = ["MemoryClient", "MemoryCluster"]

#: Longest a call waits at a closed gate before it fails (a test that forgets to open it ends).
GATE_TIMEOUT_S: Final = 60.0

U8 = np.ndarray[Any, np.dtype[np.uint8]]
I64 = np.ndarray[Any, np.dtype[np.int64]]


class MemoryClient:
    """Keeps records in ``data`` (key -> header page + payload); see the module docstring. Owns
    nothing; borrows the host rows and the dict."""

    backend = "memory"

    def __init__(self, rows: U8, data: dict[bytes, bytes] | None = None,
                 faults: dict[bytes, RemoteErrorKind] | None = None) -> None:
        self.rows = rows
        self.data: dict[bytes, bytes] = {} if data is None else data
        self.faults: dict[bytes, RemoteErrorKind] = {} if faults is None else faults
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.down = False
        self.closed = 0

    def _hold(self) -> None:
        self.entered.set()
        gate = self.gate
        if gate is not None and not gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError(f"the memory store's gate stayed closed for {GATE_TIMEOUT_S:g} s")
        if self.down:
            raise ConnectionError("connection refused (the memory store is down)")

    def prepare_put(self, slot: int, headers: U8, rows: I64) -> None:
        """Nothing to stage: a put copies the header page and the row into the dict."""

    def put_chunk(self, keys: Sequence[bytes], headers: U8, rows: I64, slot: int) -> list[ChunkStatus]:
        """Keep each record under its key (a key that holds one keeps it: the first writer wins);
        a key in ``faults`` fails with its kind and keeps nothing."""
        self._hold()
        out = []
        for j, key in enumerate(keys):
            fault = self.faults.get(key)
            if fault is not None:
                out.append(ChunkStatus(fault, "injected by the memory store's faults"))
                continue
            self.data.setdefault(key, headers[j].tobytes() + self.rows[int(rows[j])].tobytes())
            out.append(OK)
        return out

    def get_chunk(self, keys: Sequence[bytes], headers: U8, rows: I64) -> list[ChunkStatus]:
        """Copy each key's record into its header page and host row (``not_found`` if absent,
        ``size_mismatch`` for a value of another size; a key in ``faults`` fails with its kind and
        copies nothing)."""
        self._hold()
        out = []
        for j, key in enumerate(keys):
            fault = self.faults.get(key)
            if fault is not None:
                out.append(ChunkStatus(fault, "injected by the memory store's faults"))
                continue
            value = self.data.get(key)
            if value is None:
                out.append(ChunkStatus(RemoteErrorKind.NOT_FOUND, "no such key"))
                continue
            want = PAGE_BYTES + self.rows.shape[1]
            if len(value) != want:  # as a real store's client reports a value of another size
                out.append(ChunkStatus(RemoteErrorKind.SIZE_MISMATCH, f"value of {len(value)} bytes, not {want}"))
                continue
            data = np.frombuffer(value, dtype=np.uint8)
            headers[j] = data[:PAGE_BYTES]
            self.rows[int(rows[j])] = data[PAGE_BYTES:]
            out.append(OK)
        return out

    def exists_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]:
        """Whether each key holds a record."""
        self._hold()
        return [ChunkStatus(present=k in self.data) for k in keys]

    def remove_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]:
        """Drop each key's record."""
        self._hold()
        for k in keys:
            self.data.pop(k, None)
        return [OK] * len(keys)

    def failure(self, exc: Exception) -> ChunkStatus:
        """Every failure of this client is the store being unreachable."""
        return ChunkStatus(RemoteErrorKind.UNAVAILABLE, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Drop the borrowed rows and count the close (tests check it ran once)."""
        self.rows = np.zeros((0, self.rows.shape[1]), dtype=np.uint8)
        self.closed += 1


class MemoryCluster:
    """One shared dict of records, and the clients of the stores built on it."""

    def __init__(self, batch: int = 4) -> None:
        """``batch``: records per client call of the stores built here."""
        self.data: dict[bytes, bytes] = {}
        #: Keys whose puts and gets fail with the given kind, in every store of the cluster (keys
        #: as the store sees them: a Worker's remote tier namespaces the engine's keys). Change it
        #: in place: the stores hold this dict.
        self.faults: Final[dict[bytes, RemoteErrorKind]] = {}
        self.clients: list[MemoryClient] = []
        self.batch = batch

    def factory(self, host_rows: object, fingerprint: str) -> RemoteStore:
        """A ``RemoteConfig.store`` factory: a store over ``host_rows`` (borrowed) on this cluster.
        The caller (a Worker's remote tier) closes it."""
        rows = as_host_rows(host_rows)
        client = MemoryClient(rows, self.data, self.faults)
        self.clients.append(client)
        return RemoteStoreBase(
            client=client, host_rows=rows,
            headers=np.zeros((HEADER_SLOTS * self.batch, PAGE_BYTES), np.uint8),
            fingerprint=fingerprint.encode(), batch_records=self.batch, checksum_threads=2,
            lane=Lane("kvoffload-test-remote"),
        )

    def index(self, fingerprint: str = "index") -> RemoteStore:
        """A store over one scratch row of its own, for ``Manager.create(..., remote=...)``; the
        caller closes it."""
        return self.factory(np.zeros((1, PAGE_BYTES), dtype=np.uint8), fingerprint)

    @property
    def client(self) -> MemoryClient:
        """The most recent store's client (faults are injected there)."""
        return self.clients[-1]
