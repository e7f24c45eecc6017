"""MooncakeStore: the remote tier on Mooncake Store (``mooncake-transfer-engine``, optional extra).

Zero-copy: at creation the client registers the borrowed host rows and its own header pages with
the transfer engine, once; a put hands the engine each record as two buffers (its header page and
its host row) through ``batch_put_from_multi_buffers``, and a get lands them the same way through
``batch_get_into_multi_buffers``. Keys are stored as ``key_prefix + key.hex()``.

The store's own rules, as this client sees them: a put of a key that exists keeps the existing
object (the first writer wins); a remove is forced past the object's lease (a get racing it
reads a record that fails its checks, never a foreign one served); when the cluster's memory is full
the master evicts objects whose lease expired, and refuses puts (``store_full``) while none can be
evicted; an evicted key is a clean miss. Status codes map to kinds: -704 ``not_found``; -200 and -1700 ``store_full``; -900 and -901
``unavailable``; -600 and -800 on a get ``size_mismatch`` when the object's size is not one record
of this layout, else ``transfer_failed``; -707 ``transfer_failed``; any other ``rejected``.

Mooncake's transfer listeners bind every interface whatever address is configured: run it on a
trusted network (the tests and the bench run it inside a loopback-only network namespace).
"""

from __future__ import annotations

import importlib
import socket
import threading
import time
from collections.abc import Sequence
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

__all__ = ["MooncakeConfig", "MooncakeStore"]

U8Array = npt.NDArray[np.uint8]
I64Array = npt.NDArray[np.int64]

#: Mooncake ErrorCode values this client tells apart.
NO_AVAILABLE_HANDLE: Final = -200
INVALID_PARAMS: Final = -600
OBJECT_NOT_FOUND: Final = -704
OBJECT_ALREADY_EXISTS: Final = -705
LEASE_EXPIRED: Final = -707
TRANSFER_FAIL: Final = -800
RPC_FAIL: Final = -900
RPC_TIMEOUT: Final = -901
TENANT_QUOTA_EXCEEDED: Final = -1700
_KINDS: Final = {
    OBJECT_NOT_FOUND: RemoteErrorKind.NOT_FOUND,
    NO_AVAILABLE_HANDLE: RemoteErrorKind.STORE_FULL,
    TENANT_QUOTA_EXCEEDED: RemoteErrorKind.STORE_FULL,
    RPC_FAIL: RemoteErrorKind.UNAVAILABLE,
    RPC_TIMEOUT: RemoteErrorKind.UNAVAILABLE,
    INVALID_PARAMS: RemoteErrorKind.TRANSFER_FAILED,
    TRANSFER_FAIL: RemoteErrorKind.TRANSFER_FAILED,
    LEASE_EXPIRED: RemoteErrorKind.TRANSFER_FAILED,
}


def _status(code: int, what: str) -> ChunkStatus:
    kind = _KINDS.get(code, RemoteErrorKind.REJECTED)
    return ChunkStatus(kind, f"Mooncake {what} returned {code} ({kind.value})", code)


def _str(name: str, value: object, *, empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"MooncakeConfig.{name} must be a str, got {type(value).__name__}")
    if not value and not empty:
        raise InvalidArgumentError(f"MooncakeConfig.{name} must not be empty")
    return value


#: The transfer engine's protocols this tier is documented and tested with; another name made the
#: client's set-up retry for minutes holding the GIL.
PROTOCOLS: Final = ("tcp", "rdma")
#: The largest size the client's set-up takes (a C ``size_t`` past which its binding raises an
#: untyped ``TypeError``; any real size is far below).
MAX_SIZE_BYTES: Final = (1 << 63) - 1


def _size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"MooncakeConfig.{name} must be an int number of bytes, got {value!r}")
    if not 0 <= value <= MAX_SIZE_BYTES:
        raise InvalidArgumentError(f"MooncakeConfig.{name} = {value} must be in 0 .. {MAX_SIZE_BYTES} bytes")
    return value


def _master(address: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) as ``(host, port)``.

    Raises:
        InvalidArgumentError: not ``host:port`` with a port in 1..65535.
    """
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    plain = port.isascii() and port.isdigit() and host.isprintable() and not any(c.isspace() for c in host)
    if not sep or not host or not plain or not 0 < int(port) < 65536:
        raise InvalidArgumentError(
            f"MooncakeConfig.master_address = {address!r} must be host:port (a host without spaces, "
            "a port of ASCII digits in 1..65535)")
    return host, int(port)


@attrs.frozen
class MooncakeConfig:
    """How to join a Mooncake Store cluster. Validated at construction (typed errors naming the field).

    Attributes:
        master_address: the master's ``host:port``.
        metadata_server: the transfer engine's metadata service (``"P2PHANDSHAKE"``: none needed).
        local_hostname: the address other processes reach this one at.
        protocol: the transfer engine's protocol (``"tcp"`` or ``"rdma"``, :data:`PROTOCOLS`).
        device_names: RDMA devices (empty for TCP).
        local_buffer_bytes: the client's own buffer (used only by non-zero-copy calls).
        global_segment_bytes: memory this process lends to the cluster (0: it only uses the store).
        key_prefix: prepended to every stored key (several tiers can share one cluster).
        batch_records: records per client call.
        checksum_threads: threads computing and verifying CRC32s beside the transfers.
        setup_timeout_s: deadline of joining the cluster in ``create`` (> 0).
    """

    master_address: str = attrs.field()
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_names: str = ""
    local_buffer_bytes: int = 16 << 20
    global_segment_bytes: int = 0
    key_prefix: str = "kvoffload/"
    batch_records: int = DEFAULT_BATCH_RECORDS
    checksum_threads: int = DEFAULT_CHECKSUM_THREADS
    setup_timeout_s: float = 30.0

    def __attrs_post_init__(self) -> None:
        _str("master_address", self.master_address)
        _str("metadata_server", self.metadata_server)
        _str("local_hostname", self.local_hostname)
        _master(self.master_address)
        if _str("protocol", self.protocol) not in PROTOCOLS:
            raise InvalidArgumentError(f"MooncakeConfig.protocol = {self.protocol!r} must be one of {PROTOCOLS}")
        _str("device_names", self.device_names, empty=True)
        _str("key_prefix", self.key_prefix, empty=True)
        _size("local_buffer_bytes", self.local_buffer_bytes)
        _size("global_segment_bytes", self.global_segment_bytes)
        check_common(self.batch_records, self.checksum_threads)
        as_timeout(self.setup_timeout_s, "MooncakeConfig.setup_timeout_s", positive=True)


def _reach_master(config: MooncakeConfig) -> float:
    """Open and close one TCP connection to the master within ``setup_timeout_s``.

    The client's ``setup`` holds the GIL while it retries (about 90 s against a closed port), so
    the lane's deadline cannot end it; a master that cannot be reached is found here instead. A
    master that accepts connections and does not answer (stopped, overloaded) still holds the set-up
    until it answers.

    Every address of the name is tried in turn within the one deadline (the name resolved on a
    thread, since resolution has no timeout of its own).

    Returns the deadline (``time.monotonic()``), which the set-up keeps too.

    Raises:
        RemoteUnavailableError: no connection within the deadline.
    """
    host, port = _master(config.master_address)
    deadline = time.monotonic() + config.setup_timeout_s
    found: list[Any] = []
    failure: list[BaseException] = []

    def resolve() -> None:  # getaddrinfo has no timeout of its own: on a thread joined by the deadline
        try:
            found.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            failure.append(exc)

    resolver = threading.Thread(target=resolve, name="kvoffload-mooncake-resolve", daemon=True)
    resolver.start()
    resolver.join(config.setup_timeout_s)
    reason = "the name did not resolve in time" if resolver.is_alive() else (
        str(failure[0]) if failure else "no address")
    for family, kind, proto, _, address in found:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.settimeout(left)
                probe.connect(address)
            return deadline
        except OSError as exc:
            reason = exc.strerror or str(exc)
    raise RemoteUnavailableError(
        f"the Mooncake master at {config.master_address} cannot be reached within "
        f"{config.setup_timeout_s:g} s: {reason}", kind=RemoteErrorKind.UNAVAILABLE.value,
    )


class _MooncakeClient:
    """The ``StoreClient`` over one ``MooncakeDistributedStore`` (owned; closed once)."""

    backend = "mooncake"

    def __init__(self, store: Any, rows: U8Array, headers: U8Array, prefix: str) -> None:
        self._store = store
        self._rows = rows
        self._headers = headers
        self._prefix = prefix
        self._record_bytes = int(rows.shape[1])
        self._rows_base = int(rows.ctypes.data)
        self._headers_base = int(headers.ctypes.data)
        self._sizes = [PAGE_BYTES, self._record_bytes]

    def name(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def _buffers(self, headers: U8Array, rows: I64Array) -> list[list[int]]:
        first = int(headers.ctypes.data)
        return [
            [first + j * PAGE_BYTES, self._rows_base + int(r) * self._record_bytes]
            for j, r in enumerate(rows)
        ]

    def prepare_put(self, slot: int, headers: U8Array, rows: I64Array) -> None:
        """Nothing to stage: the engine reads the header pages and the rows where they are."""

    def put_chunk(self, keys: Sequence[bytes], headers: U8Array, rows: I64Array, slot: int) -> list[ChunkStatus]:
        codes = self._store.batch_put_from_multi_buffers(
            [self.name(k) for k in keys], self._buffers(headers, rows), [self._sizes] * len(keys)
        )
        return [OK if c in (0, OBJECT_ALREADY_EXISTS) else _status(c, "put") for c in codes]

    def get_chunk(self, keys: Sequence[bytes], headers: U8Array, rows: I64Array) -> list[ChunkStatus]:
        names = [self.name(k) for k in keys]
        codes = self._store.batch_get_into_multi_buffers(
            names, self._buffers(headers, rows), [self._sizes] * len(keys)
        )
        want = PAGE_BYTES + self._record_bytes
        out: list[ChunkStatus] = []
        for name, code in zip(names, codes):
            if code == want:
                out.append(OK)
            elif code >= 0:
                out.append(ChunkStatus(RemoteErrorKind.SIZE_MISMATCH, f"read {code} bytes, a record is {want}"))
            elif code in (INVALID_PARAMS, TRANSFER_FAIL) and 0 <= (size := int(self._store.get_size(name))) != want:
                out.append(ChunkStatus(
                    RemoteErrorKind.SIZE_MISMATCH, f"the stored object has {size} bytes, a record is {want}", code
                ))
            else:
                out.append(_status(code, "get"))
        return out

    def exists_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]:
        codes = self._store.batch_is_exist([self.name(k) for k in keys])
        return [ChunkStatus(present=c == 1) if c in (0, 1) else _status(c, "exists") for c in codes]

    def remove_chunk(self, keys: Sequence[bytes]) -> list[ChunkStatus]:
        codes = self._store.batch_remove([self.name(k) for k in keys], force=True)
        return [OK if c in (0, OBJECT_NOT_FOUND) else _status(c, "remove") for c in codes]

    def failure(self, exc: Exception) -> ChunkStatus:
        return ChunkStatus(RemoteErrorKind.REJECTED, f"the Mooncake client raised {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Unregister the rows and header pages, close the client, drop the borrowed rows."""
        codes = [
            self._store.unregister_buffer(self._rows_base),
            self._store.unregister_buffer(self._headers_base),
            self._store.close(),
        ]
        self._rows = self._headers = _NO_ROWS  # the host pool may be unmapped now
        if any(codes):
            raise RemoteUnavailableError(
                f"releasing the Mooncake client returned {codes} (unregister rows, headers, close)",
                kind=RemoteErrorKind.REJECTED.value,
            )


_NO_ROWS: Final[U8Array] = np.zeros((0, PAGE_BYTES), dtype=np.uint8)


def _aligned(nbytes: int) -> U8Array:
    raw = np.zeros(nbytes + PAGE_BYTES, dtype=np.uint8)
    shift = (-raw.ctypes.data) % PAGE_BYTES
    return raw[shift : shift + nbytes]


class MooncakeStore(RemoteStoreBase):
    """The remote tier on a Mooncake Store cluster; see :class:`RemoteStoreBase` for the calls.

    Owns the Mooncake client (its connection to the master, its transfer engine, the registration of
    the host rows and of its header pages), the lane and the checksum threads. Borrows the host
    rows. Create it with :meth:`create`; release it with ``close`` (or a ``with`` block).
    """

    @classmethod
    def create(cls, config: MooncakeConfig, *, host_rows: object, fingerprint: str) -> MooncakeStore:
        """Join the cluster, register the host rows and the header pages, start the lane.

        Args:
            config: the cluster and the tuning (validated already).
            host_rows: ``uint8[n, record_bytes]`` (numpy or CPU torch, pinned or not), borrowed.
            fingerprint: the layout fingerprint every record carries and must match when read.

        Raises:
            ArgumentTypeError, InvalidArgumentError: a bad argument (nothing was started).
            RemoteUnavailableError: the ``mooncake`` package is missing, the master cannot be
                reached, or the cluster could not be joined or the memory registered in
                ``setup_timeout_s`` (nothing is left open, except a set-up thread that did not return
                in time, which is abandoned). The client's set-up holds the GIL, so a master that
                accepts connections and does not answer holds this call until it answers.
        """
        if not isinstance(config, MooncakeConfig):
            raise ArgumentTypeError(f"config must be a MooncakeConfig, got {type(config).__name__}")
        rows = as_host_rows(host_rows)
        fp = check_fingerprint(fingerprint)
        try:
            module: Any = importlib.import_module("mooncake.store")
        except ImportError as exc:
            raise RemoteUnavailableError(
                "MooncakeStore needs the 'mooncake' extra (pip install 'kvoffload[mooncake]'): "
                f"{exc}", kind=RemoteErrorKind.UNAVAILABLE.value,
            ) from exc
        deadline = _reach_master(config)  # the client's set-up holds the GIL: its lane's deadline cannot end it
        headers = _aligned(HEADER_SLOTS * config.batch_records * PAGE_BYTES).reshape(-1, PAGE_BYTES)
        lane = Lane("kvoffload-remote-mooncake")

        def setup() -> Any:
            store = module.MooncakeDistributedStore()
            rc = store.setup(
                config.local_hostname, config.metadata_server, config.global_segment_bytes,
                config.local_buffer_bytes, config.protocol, config.device_names, config.master_address,
            )
            if rc != 0:
                store.close()
                raise RemoteUnavailableError(
                    f"joining the Mooncake cluster at {config.master_address} failed (setup returned {rc})",
                    kind=RemoteErrorKind.UNAVAILABLE.value, code=int(rc),
                )
            registered: list[int] = []
            for base, size in ((int(rows.ctypes.data), rows.nbytes), (int(headers.ctypes.data), headers.nbytes)):
                rc = store.register_buffer(base, size)
                if rc != 0:
                    for done in registered:
                        store.unregister_buffer(done)
                    store.close()
                    raise RemoteUnavailableError(
                        f"registering {size} bytes at {base:#x} with Mooncake failed ({rc})",
                        kind=RemoteErrorKind.UNAVAILABLE.value, code=int(rc),
                    )
                registered.append(base)
            return store

        try:
            store = lane.call(setup, max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise RemoteUnavailableError(
                f"joining the Mooncake cluster at {config.master_address} did not finish within "
                f"{config.setup_timeout_s:g} s", kind=RemoteErrorKind.UNAVAILABLE.value,
            ) from exc
        except RemoteUnavailableError:
            raise
        except Exception as exc:  # noqa: BLE001 - the client's own errors, e.g. its binding's TypeError
            raise RemoteUnavailableError(
                f"joining the Mooncake cluster at {config.master_address} failed: "
                f"{type(exc).__name__}: {exc}", kind=RemoteErrorKind.UNAVAILABLE.value,
            ) from exc
        client = _MooncakeClient(store, rows, headers, config.key_prefix)
        return cls(
            client=client, host_rows=rows, headers=headers, fingerprint=fp,
            batch_records=config.batch_records, checksum_threads=config.checksum_threads, lane=lane,
        )
