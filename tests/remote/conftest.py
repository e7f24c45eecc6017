"""Fixtures for the remote-tier tests: real Mooncake and Redis Cluster services on this machine.

At start-up the test process moves into a new loopback-only network namespace (Mooncake's listeners
bind every interface, so it may run only there); Redis runs there too. Where the machine forbids the
namespace, the Mooncake tests skip with the kernel's reason and the Redis tests run on 127.0.0.1 of
the host's namespace. A missing package or program skips with its reason too, except under
``KVOFFLOAD_REQUIRE_REMOTE=1`` (CI), where it fails.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvoffload.remote import (
    MooncakeConfig,
    MooncakeStore,
    RedisClusterConfig,
    RedisClusterStore,
    RemoteConfig,
    RemoteStoreBase,
)
from kvoffload.testing import MooncakeServices, RedisClusterServices, ServiceError, enter_loopback_namespace

REQUIRE = os.environ.get("KVOFFLOAD_REQUIRE_REMOTE") == "1"
NAMESPACE_REFUSED: str | None = None
BACKENDS = ("mooncake", "redis")


def pytest_configure(config: pytest.Config) -> None:
    global NAMESPACE_REFUSED
    try:
        enter_loopback_namespace()
    except ServiceError as exc:
        NAMESPACE_REFUSED = str(exc)
        print(f"\nremote tests: no loopback-only network namespace ({exc}); Mooncake tests will skip")


def _unavailable(reason: str) -> None:
    if REQUIRE:
        pytest.fail(f"KVOFFLOAD_REQUIRE_REMOTE=1 but {reason}")
    pytest.skip(reason)


class Cluster:
    """One running store service and what the tests do to it besides the kvoffload store."""

    def __init__(self, backend: str, services: MooncakeServices | RedisClusterServices) -> None:
        self.backend = backend
        self.services = services
        self._raw: Any = None
        self._stores: list[RemoteStoreBase] = []

    def store(self, rows: np.ndarray[Any, np.dtype[np.uint8]], fingerprint: str = "layout-A",
              *, prefix: str | None = None, **config: Any) -> RemoteStoreBase:
        """A kvoffload store on this cluster under ``prefix`` (closed at the end of the test)."""
        if isinstance(self.services, MooncakeServices):
            store: RemoteStoreBase = MooncakeStore.create(
                self.services.config(key_prefix=prefix or "kvo/", **config), host_rows=rows, fingerprint=fingerprint
            )
        else:
            store = RedisClusterStore.create(
                self.services.config(key_prefix=(prefix or "kvo/").encode(), **config),
                host_rows=rows, fingerprint=fingerprint,
            )
        self._stores.append(store)
        return store

    def raw(self) -> Any:
        if self._raw is None:
            self._raw = self.services.raw_client()
        return self._raw

    def raw_get(self, prefix: str, key: bytes) -> bytes:
        """The stored value, read by the store's own client."""
        if self.backend == "mooncake":
            return bytes(self.raw().get(prefix + key.hex()))
        value = self.raw().get(prefix.encode() + key)
        assert value is not None
        return bytes(value)

    def raw_set(self, prefix: str, key: bytes, value: bytes) -> None:
        """Overwrite the stored value through the store's own client."""
        if self.backend == "mooncake":
            assert self.raw().upsert(prefix + key.hex(), value) == 0
        else:
            assert self.raw().set(prefix.encode() + key, value)

    def remote_config(self, prefix: str, **config: Any) -> RemoteConfig:
        """A RemoteConfig for a Worker on this cluster under ``prefix`` (store fields by keyword,
        ``job_timeout_s`` too)."""
        timeout = config.pop("job_timeout_s", 30.0)
        if isinstance(self.services, MooncakeServices):
            store: MooncakeConfig | RedisClusterConfig = self.services.config(key_prefix=prefix, **config)
        else:
            store = self.services.config(key_prefix=prefix.encode(), **config)
        return RemoteConfig(store=store, job_timeout_s=timeout)

    @property
    def address(self) -> str:
        """The replay's ``--remote-address`` of this cluster."""
        if isinstance(self.services, MooncakeServices):
            return self.services.master_address
        return ",".join(f"{h}:{p}" for h, p in self.services.nodes)

    def close(self) -> None:
        for store in self._stores:
            store.close()
        if self._raw is not None:
            self._raw.close()


def start_services(backend: str, **kwargs: Any) -> MooncakeServices | RedisClusterServices:
    if backend == "mooncake":
        if NAMESPACE_REFUSED is not None:
            pytest.skip(f"Mooncake needs a loopback-only network namespace: {NAMESPACE_REFUSED}")
        try:
            return MooncakeServices.start(**kwargs)
        except ServiceError as exc:
            _unavailable(f"Mooncake services could not start: {exc}")
    try:
        return RedisClusterServices.start(**kwargs)
    except ServiceError as exc:
        _unavailable(f"Redis Cluster could not start: {exc}")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module", params=BACKENDS)
def shared_services(request: pytest.FixtureRequest) -> Iterator[MooncakeServices | RedisClusterServices]:
    """One service set per backend for the tests that do not damage it."""
    services = start_services(str(request.param))
    try:
        yield services
    finally:
        services.stop()


@pytest.fixture
def cluster(shared_services: MooncakeServices | RedisClusterServices) -> Iterator[Cluster]:
    backend = "mooncake" if isinstance(shared_services, MooncakeServices) else "redis"
    c = Cluster(backend, shared_services)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def fresh_cluster() -> Iterator[Callable[..., Cluster]]:
    """Start a private service set (for tests that kill, pause or fill it)."""
    started: list[Cluster] = []

    def make(backend: str, **kwargs: Any) -> Cluster:
        c = Cluster(backend, start_services(backend, **kwargs))
        started.append(c)
        return c

    try:
        yield make
    finally:
        for c in started:
            try:
                c.close()
            finally:
                c.services.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}/"


def random_rows(n: int, record_bytes: int, seed: int = 0) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, size=(n, record_bytes), dtype=np.uint8)
