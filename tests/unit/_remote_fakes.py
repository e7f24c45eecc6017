"""A scripted store client behind the real remote-store machinery, for CPU tests of the remote tier.

:class:`ScriptedClient` keeps records in a dict that several stores may share (two engine instances
on one "cluster"); ``gate`` (when set) holds every call until it is opened, ``down`` makes every
call fail as a refused connection. :func:`store_factory` is a ``RemoteConfig.store`` factory that
builds a real :class:`~kvoffload.remote.RemoteStoreBase` (lane, checksum threads, verification, close
contract) over such a client. The stores themselves run against real services in tests/remote.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvoffload._record import PAGE_BYTES
from kvoffload.remote import RemoteStore, RemoteStoreBase
from kvoffload.remote._args import as_host_rows
from kvoffload.remote._base import HEADER_SLOTS, OK, ChunkStatus
from kvoffload.remote._lane import Lane
from kvoffload.remote._types import RemoteErrorKind

U8 = np.ndarray[Any, np.dtype[np.uint8]]
I64 = np.ndarray[Any, np.dtype[np.int64]]


class ScriptedClient:
    """Keeps records in ``data`` (key -> header page + payload); see the module docstring."""

    backend = "scripted"

    def __init__(self, rows: U8, data: dict[bytes, bytes] | None = None) -> None:
        self.rows = rows
        self.data: dict[bytes, bytes] = {} if data is None else data
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.down = False
        self.closed = 0
        self.late_write: bytes | None = None  # a get writes this into its rows after the gate

    def _hold(self) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(60)
        if self.down:
            raise ConnectionError("connection refused (the scripted store is down)")

    def prepare_put(self, slot: int, headers: U8, rows: I64) -> None:
        pass

    def put_chunk(self, keys: Sequence[bytes], headers: U8, rows: I64, slot: int) -> list[ChunkStatus]:
        self._hold()
        for j, key in enumerate(keys):
            self.data.setdefault(key, headers[j].tobytes() + self.rows[int(rows[j])].tobytes())
        return [OK] * len(keys)

    def get_chunk(self, keys: Sequence[bytes], headers: U8, rows: I64) -> list[ChunkStatus]:
        self._hold()
        out = []
        for j, key in enumerate(keys):
            value = self.data.get(key)
            if value is None:
                out.append(ChunkStatus(RemoteErrorKind.NOT_FOUND, "no such key"))
                continue
            data = np.frombuffer(value, dtype=np.uint8)
            headers[j] = data[:PAGE_BYTES]
            self.rows[int(rows[j])] = data[PAGE_BYTES:]
            out.append(OK)
        return out

    def exists_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]:
        self._hold()
        return [ChunkStatus(present=k in self.data) for k in keys]

    def remove_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]:
        self._hold()
        for k in keys:
            self.data.pop(k, None)
        return [OK] * len(keys)

    def failure(self, exc: Exception) -> ChunkStatus:
        return ChunkStatus(RemoteErrorKind.UNAVAILABLE, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.closed += 1


class Cluster:
    """One shared dict of records, and the clients of the stores built on it."""

    def __init__(self, batch: int = 4) -> None:
        self.data: dict[bytes, bytes] = {}
        self.clients: list[ScriptedClient] = []
        self.batch = batch

    def factory(self, host_rows: object, fingerprint: str) -> RemoteStore:
        """A ``RemoteConfig.store`` factory: a real store machinery over a scripted client."""
        rows = as_host_rows(host_rows)
        client = ScriptedClient(rows, self.data)
        self.clients.append(client)
        return RemoteStoreBase(
            client=client, host_rows=rows,
            headers=np.zeros((HEADER_SLOTS * self.batch, PAGE_BYTES), np.uint8),
            fingerprint=fingerprint.encode(), batch_records=self.batch, checksum_threads=2,
            lane=Lane("kvoffload-test-remote"),
        )

    @property
    def client(self) -> ScriptedClient:
        """The most recent store's client."""
        return self.clients[-1]
