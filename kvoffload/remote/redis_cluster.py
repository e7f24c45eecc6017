"""RedisClusterStore: the remote tier on a Redis Cluster (``redis`` with ``hiredis``, optional extra).

A record is one Redis string: the header page followed by the host record. A put copies each chunk's
records into a staging buffer the store owns (two slots of ``batch_records`` records, filled by the
checksum threads ahead of the sends) and sends them with
``SET key value NX`` in one pipeline (the first writer wins, as on Mooncake); a get receives each
value as ``bytes`` and copies it into the header page and the host row. Keys are stored as
``key_prefix + key`` and spread over the cluster's slots.

A node that refuses connections (it died) fails only its own keys of a chunk: the chunk runs again
node by node (:meth:`_RedisClient._execute`); whether the other nodes still serve their slots is
the cluster's setting ``cluster-require-full-coverage`` (with ``yes``, the default, they refuse
every key once the cluster has marked the node failed).

The store's rules: with ``maxmemory`` and an eviction policy such as ``allkeys-lru`` a full node
evicts (an evicted key is a clean miss later); under ``noeviction`` it refuses writes with an OOM
error (``store_full``). Errors map to kinds: a refused or dropped connection, a cluster that is down
or a node that does not answer within ``socket_timeout_s`` -> ``unavailable``; OOM -> ``store_full``;
any other error reply -> ``rejected``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload.errors import ArgumentTypeError, InvalidArgumentError, RemoteUnavailableError
from kvoffload._record import PAGE_BYTES
from kvoffload.remote._args import (
    DEFAULT_BATCH_RECORDS,
    DEFAULT_CHECKSUM_THREADS,
    as_host_rows,
    as_timeout,
    check_common,
    check_fingerprint,
)
from kvoffload.remote._base import HEADER_SLOTS, OK, ChunkStatus, RemoteStoreBase
from kvoffload.remote._lane import Lane
from kvoffload.remote._types import RemoteErrorKind

__all__ = ["RedisClusterConfig", "RedisClusterStore"]

U8Array = npt.NDArray[np.uint8]
I64Array = npt.NDArray[np.int64]

#: Attempts of one command against the cluster (a retry after a refused connection is immediate).
CLUSTER_ATTEMPTS: Final = 2
_UNAVAILABLE: Final = (
    "ConnectionError", "TimeoutError", "ClusterDownError", "MaxConnectionsError",
    "SlotNotCoveredError", "RedisClusterException", "MasterDownError", "BusyLoadingError",
    "TryAgainError",
)


def _refused(exc: BaseException) -> bool:
    """A connection to a node was refused or dropped (not a timeout): redis-py's ``ConnectionError``."""
    return any(type(e).__name__ == "ConnectionError" for e in (exc, exc.__cause__) if e is not None)


def _as_nodes(nodes: object) -> tuple[tuple[str, int], ...]:
    if isinstance(nodes, (str, bytes)) or not isinstance(nodes, Sequence) or not nodes:
        raise ArgumentTypeError(
            f"RedisClusterConfig.nodes must be a non-empty sequence of (host, port), got {nodes!r}"
        )
    out: list[tuple[str, int]] = []
    for i, node in enumerate(nodes):
        if not isinstance(node, tuple) or len(node) != 2:
            raise ArgumentTypeError(f"RedisClusterConfig.nodes[{i}] = {node!r} must be a (host, port) tuple")
        host, port = node
        if not isinstance(host, str) or not host:
            raise InvalidArgumentError(f"RedisClusterConfig.nodes[{i}] host {host!r} must be a non-empty str")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidArgumentError(f"RedisClusterConfig.nodes[{i}] port {port!r} must be an int in 1..65535")
        out.append((host, port))
    return tuple(out)


@attrs.frozen
class RedisClusterConfig:
    """How to reach a Redis Cluster. Validated at construction (typed errors naming the field).

    Attributes:
        nodes: one or more ``(host, port)`` of the cluster (the rest is discovered).
        key_prefix: prepended to every stored key.
        socket_timeout_s: a node that does not answer a command within this fails the chunk.
        connect_timeout_s: deadline of one connection attempt.
        password: the cluster's password, if it has one.
        batch_records: records per pipeline (also the staging buffer's size in records).
        checksum_threads: threads computing and verifying CRC32s beside the transfers.
        setup_timeout_s: deadline of connecting and reading the slot map in ``create``.
    """

    nodes: tuple[tuple[str, int], ...] = attrs.field(converter=_as_nodes)
    key_prefix: bytes = b"kvoffload/"
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    password: str | None = None
    batch_records: int = DEFAULT_BATCH_RECORDS
    checksum_threads: int = DEFAULT_CHECKSUM_THREADS
    setup_timeout_s: float = 30.0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.key_prefix, bytes):
            raise ArgumentTypeError(f"RedisClusterConfig.key_prefix must be bytes, got {type(self.key_prefix).__name__}")
        if self.password is not None and not isinstance(self.password, str):
            raise ArgumentTypeError("RedisClusterConfig.password must be a str or None")
        for name in ("socket_timeout_s", "connect_timeout_s", "setup_timeout_s"):
            as_timeout(getattr(self, name), f"RedisClusterConfig.{name}", positive=True)
        check_common(self.batch_records, self.checksum_threads)


class _RedisClient:
    """The ``StoreClient`` over one ``redis.cluster.RedisCluster`` (owned; closed once)."""

    backend = "redis-cluster"

    def __init__(self, cluster: Any, rows: U8Array, prefix: bytes, batch: int) -> None:
        self._cluster = cluster
        self._rows = rows
        self._prefix = prefix
        self._record_bytes = int(rows.shape[1])
        self._staging = np.empty((HEADER_SLOTS, batch, PAGE_BYTES + self._record_bytes), dtype=np.uint8)

    def _pipeline(self, keys: Sequence[bytes], command: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._execute(keys, lambda pipe, j, key: getattr(pipe, command)(key, *args, **kwargs))

    def _execute(self, keys: Sequence[bytes], queue: Callable[[Any, int, bytes], object]) -> list[Any]:
        """One reply (or the exception that failed it) per key: ``queue(pipe, j, stored key)``
        queues key ``j``'s command; the chunk runs as one pipeline.

        A pipeline fails whole when one node refuses its connection (a node that died). Then each
        node's keys run again as a pipeline of their own, so only the dead node's keys fail. Every
        command here is safe to run twice (``SET NX``, ``GET``, ``EXISTS``, ``DEL``). A node that
        does not answer (a timeout) fails the chunk: running the others again would wait for it a
        second time."""
        stored = [self._prefix + key for key in keys]
        try:
            return self._run(stored, range(len(keys)), queue)
        except Exception as exc:  # noqa: BLE001 - mapped per key by the caller
            if not _refused(exc):
                raise
            by_node: dict[str, list[int]] = {}
            for j, key in enumerate(stored):
                by_node.setdefault(self._cluster.get_node_from_key(key).name, []).append(j)
            if len(by_node) < 2:
                raise
        replies: list[Any] = [None] * len(keys)
        for indices in by_node.values():
            try:
                for j, reply in zip(indices, self._run(stored, indices, queue)):
                    replies[j] = reply
            except Exception as exc:  # noqa: BLE001 - that node's keys fail, the others stand
                for j in indices:
                    replies[j] = exc
        return replies

    def _run(self, stored: Sequence[bytes], indices: Iterable[int], queue: Callable[[Any, int, bytes], object]) -> list[Any]:
        pipe = self._cluster.pipeline(transaction=False)
        for j in indices:
            queue(pipe, j, stored[j])
        return list(pipe.execute(raise_on_error=False))

    def prepare_put(self, slot: int, headers: U8Array, rows: I64Array) -> None:
        """Copy each record (header page, host row) into staging slot ``slot`` as one value."""
        staging = self._staging[slot]
        for j, row in enumerate(rows):
            staging[j, :PAGE_BYTES] = headers[j]
            staging[j, PAGE_BYTES:] = self._rows[int(row)]

    def put_chunk(self, keys: Sequence[bytes], headers: U8Array, rows: I64Array, slot: int) -> list[ChunkStatus]:
        staging = self._staging[slot]
        replies = self._execute(keys, lambda pipe, j, key: pipe.set(key, memoryview(staging[j]), nx=True))
        return [self.failure(r) if isinstance(r, Exception) else OK for r in replies]

    def get_chunk(self, keys: Sequence[bytes], headers: U8Array, rows: I64Array) -> list[ChunkStatus]:
        want = PAGE_BYTES + self._record_bytes
        out: list[ChunkStatus] = []
        for j, (value, row) in enumerate(zip(self._pipeline(keys, "get"), rows)):
            if isinstance(value, Exception):
                out.append(self.failure(value))
            elif value is None:
                out.append(ChunkStatus(RemoteErrorKind.NOT_FOUND, "no such key"))
            elif len(value) != want:
                out.append(ChunkStatus(RemoteErrorKind.SIZE_MISMATCH, f"the value has {len(value)} bytes, a record is {want}"))
            else:
                data = np.frombuffer(value, dtype=np.uint8)
                headers[j] = data[:PAGE_BYTES]
                self._rows[int(row)] = data[PAGE_BYTES:]
                out.append(OK)
        return out

    def exists_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]:
        return [
            self.failure(r) if isinstance(r, Exception) else ChunkStatus(present=bool(r))
            for r in self._pipeline(keys, "exists")
        ]

    def remove_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]:
        return [self.failure(r) if isinstance(r, Exception) else OK for r in self._pipeline(keys, "delete")]

    def failure(self, exc: Exception) -> ChunkStatus:
        name = type(exc).__name__
        message = f"Redis {name}: {exc}"
        if name == "OutOfMemoryError" or str(exc).startswith("OOM"):
            return ChunkStatus(RemoteErrorKind.STORE_FULL, message)
        if any(type(e).__name__ in _UNAVAILABLE for e in (exc, exc.__cause__) if e is not None):
            return ChunkStatus(RemoteErrorKind.UNAVAILABLE, message)
        return ChunkStatus(RemoteErrorKind.REJECTED, message)

    def close(self) -> None:
        """Close the cluster client and drop the borrowed rows."""
        self._rows = np.zeros((0, self._record_bytes), dtype=np.uint8)  # the host pool may be unmapped now
        self._cluster.close()


class RedisClusterStore(RemoteStoreBase):
    """The remote tier on a Redis Cluster; see :class:`RemoteStoreBase` for the calls.

    Owns the cluster client (its connections), the staging buffer, the lane and the checksum
    threads. Borrows the host rows. Create it with :meth:`create`; release it with ``close``.
    """

    @classmethod
    def create(cls, config: RedisClusterConfig, *, host_rows: object, fingerprint: str) -> RedisClusterStore:
        """Connect to the cluster, read its slot map, start the lane.

        Raises:
            ArgumentTypeError, InvalidArgumentError: a bad argument (nothing was started).
            RemoteUnavailableError: the ``redis`` package is missing, or the cluster could not be
                reached within ``setup_timeout_s`` (nothing is left open).
        """
        if not isinstance(config, RedisClusterConfig):
            raise ArgumentTypeError(f"config must be a RedisClusterConfig, got {type(config).__name__}")
        rows = as_host_rows(host_rows)
        fp = check_fingerprint(fingerprint)
        try:
            cluster_mod: Any = importlib.import_module("redis.cluster")
            retry_mod: Any = importlib.import_module("redis.retry")
            backoff_mod: Any = importlib.import_module("redis.backoff")
        except ImportError as exc:
            raise RemoteUnavailableError(
                f"RedisClusterStore needs the 'redis' extra (pip install 'kvoffload[redis]'): {exc}",
                kind=RemoteErrorKind.UNAVAILABLE.value,
            ) from exc
        headers = np.zeros((HEADER_SLOTS * config.batch_records, PAGE_BYTES), dtype=np.uint8)
        lane = Lane("kvoffload-remote-redis")

        def connect() -> Any:
            cluster = cluster_mod.RedisCluster(
                startup_nodes=[cluster_mod.ClusterNode(h, p) for h, p in config.nodes],
                password=config.password, socket_timeout=config.socket_timeout_s,
                socket_connect_timeout=config.connect_timeout_s,
                retry=retry_mod.Retry(backoff_mod.NoBackoff(), CLUSTER_ATTEMPTS - 1),
                require_full_coverage=True,
            )
            try:
                cluster.ping(target_nodes=cluster_mod.RedisCluster.PRIMARIES)
            except BaseException:
                cluster.close()
                raise
            return cluster

        try:
            cluster = lane.call(connect, config.setup_timeout_s)
        except Exception as exc:  # noqa: BLE001 - every way of not reaching the cluster
            raise RemoteUnavailableError(
                f"connecting to the Redis cluster at {config.nodes} failed: {type(exc).__name__}: {exc}",
                kind=RemoteErrorKind.UNAVAILABLE.value,
            ) from exc
        client = _RedisClient(cluster, rows, config.key_prefix, config.batch_records)
        return cls(
            client=client, host_rows=rows, headers=headers, fingerprint=fp,
            batch_records=config.batch_records, checksum_threads=config.checksum_threads, lane=lane,
        )
