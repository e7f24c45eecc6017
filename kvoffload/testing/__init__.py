"""Testing aids for integrators: the worker contract suite and backends to inject.

``check_worker_contract(make_worker)`` runs the behaviour every :class:`~kvoffload.Worker` promises;
:class:`FakeBackend` (jobs that complete when told to, failures on demand) and :class:`HostBackend`
(real ``memmove`` copies, to subclass for fault injection) plug into
``Worker.create(..., backend_factory=...)``. :class:`MemoryCluster` is a remote
store in this process (the real store machinery over a dict, faults on demand) for ``Worker.create(...,
remote=RemoteConfig(store=cluster.factory))`` and ``Manager.create(..., remote=cluster.index())``;
:class:`MooncakeServices` and :class:`RedisClusterServices` start real store services on this machine
for the remote tier's tests and benches (:mod:`kvoffload.testing.services`).

The contract suite:

It runs the behaviour every :class:`~kvoffload.Worker` promises against a worker the integrator
builds (any backend, any path, their own layout), and raises ``AssertionError`` naming the clause
that failed. The suite owns nothing: each clause builds a worker with ``make_worker`` and shuts it
down. It writes the device blocks it uses (pick a layout whose contents the test owns).

Clauses: bit-exact round trips with random block ids; FIFO results per direction; empty jobs;
validation before submit (typed errors, the worker unchanged); in-flight conflicts refused;
``wait`` with a deadline; idempotent shutdown and ``ClosedError`` after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import numpy as np
import torch

from kvoffload.backends.host import HostBackend
from kvoffload.errors import BlockConflictError, ClosedError, InvalidBlockIdError, JobIdError, UnknownJobError
from kvoffload.handler import Backend, Ticket
from kvoffload.layout import DeviceLayout
from kvoffload.records import Direction
from kvoffload.testing.fake import FakeBackend, FakeTicket
from kvoffload.testing.memory_store import MemoryClient, MemoryCluster
from kvoffload.testing.services import (
    MooncakeServices,
    RedisClusterServices,
    ServiceError,
    enter_loopback_namespace,
    loopback_only,
)
from kvoffload.worker.worker import Worker

__all__ = [
    "CLAUSES",
    "Backend",
    "FakeBackend",
    "FakeTicket",
    "HostBackend",
    "MemoryClient",
    "MemoryCluster",
    "MooncakeServices",
    "RedisClusterServices",
    "ServiceError",
    "Ticket",
    "check_worker_contract",
    "enter_loopback_namespace",
    "loopback_only",
]

WAIT_S: Final = 60.0
POLL_INTERVAL_S: Final = 0.001
WorkerFactory = Callable[[], Worker]


def _round_trip(make: WorkerFactory) -> None:
    with make() as w:
        layout = w.layout
        n = min(layout.num_blocks // 2, w.num_host_blocks, 48)
        rng = np.random.default_rng(7)
        src = rng.choice(layout.num_blocks // 2, n, replace=False)
        dst = layout.num_blocks // 2 + rng.choice(layout.num_blocks // 2, n, replace=False)
        host = rng.choice(w.num_host_blocks, n, replace=False)
        layout.scatter_records(src, _random_records(layout, n))
        original = layout.gather_records(src)
        layout.scatter_records(dst, torch.zeros_like(original))
        w.store(1, src, host)
        (stored,) = w.wait([1], WAIT_S)
        assert stored.ok and stored.direction is Direction.STORE, f"store failed: {stored}"
        got = w.host_records()[torch.as_tensor(host)].to(layout.device)
        assert _pages_equal(layout, got, original), "host records differ from the stored blocks"
        w.load(2, host, dst)
        (loaded,) = w.wait([2], WAIT_S)
        assert loaded.ok and loaded.direction is Direction.LOAD, f"load failed: {loaded}"
        assert _pages_equal(layout, layout.gather_records(dst), original), "loaded blocks differ"
        assert stored.nbytes == loaded.nbytes == n * layout.block_bytes, "nbytes is not the job's"


def _fifo(make: WorkerFactory) -> None:
    with make() as w:
        count = min(8, w.num_host_blocks, w.layout.num_blocks)
        for job in range(count):
            w.store(job, [job], [job])
        results = w.wait(list(range(count)), WAIT_S)
        assert [r.job_id for r in results] == list(range(count)), "wait returned another order"
        assert w.poll() == [], "poll returned results wait already returned"
        for job in range(count, 2 * count):
            w.store(job, [job - count], [job - count])
        deadline = time.monotonic() + WAIT_S
        seen: list[int] = []
        while len(seen) < count and time.monotonic() < deadline:
            seen += [r.job_id for r in w.poll()]
            time.sleep(POLL_INTERVAL_S)
        assert seen == list(range(count, 2 * count)), f"poll returned {seen}"


def _empty_jobs(make: WorkerFactory) -> None:
    with make() as w:
        w.store(1, [], [])
        w.load(2, [], [])
        results = {r.job_id: r for r in w.wait([1, 2], WAIT_S)}
        assert all(r.ok and r.nbytes == 0 for r in results.values()), f"empty jobs: {results}"


def _validation(make: WorkerFactory) -> None:
    with make() as w:
        before = w.stats()
        bad: list[tuple[Callable[[], object], type[Exception]]] = [
            (lambda: w.store(1, [0, 1], [0]), InvalidBlockIdError),
            (lambda: w.store(1, [-1], [0]), InvalidBlockIdError),
            (lambda: w.store(1, [w.layout.num_blocks], [0]), InvalidBlockIdError),
            (lambda: w.load(1, [w.num_host_blocks], [0]), InvalidBlockIdError),
            (lambda: w.load(1, [0, 1], [2, 2]), InvalidBlockIdError),
            (lambda: w.store(1.5, [0], [0]), JobIdError),  # type: ignore[arg-type]
            (lambda: w.wait([12345], 1.0), UnknownJobError),
        ]
        for call, kind in bad:
            try:
                call()
            except kind:
                pass
            else:
                raise AssertionError(f"{kind.__name__} was not raised")
        assert w.stats() == before, "a refused call changed the worker"
        assert w.poll() == [], "a refused call produced a result"


def _conflicts(make: WorkerFactory) -> None:
    with make() as w:
        w.store(1, [0], [0])
        calls: list[Callable[[], None]] = [
            lambda: w.load(2, [0], [1]), lambda: w.store(2, [1], [0]), lambda: w.store(1, [2], [2]),
        ]
        for call in calls:
            try:
                call()
            except (BlockConflictError, JobIdError):
                pass
            else:
                raise AssertionError("a job conflicting with an in-flight job was accepted")
        w.wait([1], WAIT_S)
        w.load(2, [0], [1])  # accepted once the store's result came back
        w.wait([2], WAIT_S)


def _closed(make: WorkerFactory) -> None:
    w = make()
    w.store(1, [0], [0])
    w.shutdown(WAIT_S)
    w.shutdown(WAIT_S)
    after: list[Callable[[], object]] = [
        lambda: w.store(2, [0], [0]), w.poll, lambda: w.wait([1], 1.0), w.host_records,
    ]
    for call in after:
        try:
            call()
        except ClosedError:
            pass
        else:
            raise AssertionError("a call after shutdown did not raise ClosedError")
    assert w.stats().store.completed == 1, "shutdown did not drain the in-flight job"


def _random_records(layout: DeviceLayout, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8, device=layout.device)


def _pages_equal(layout: DeviceLayout, a: torch.Tensor, b: torch.Tensor) -> bool:
    table = layout.page_table
    return all(
        torch.equal(a[:, o : o + n], b[:, o : o + n])
        for o, n in zip(table.host_offset.tolist(), table.nbytes.tolist())
    )


#: Every clause, by name, in the order :func:`check_worker_contract` runs them.
CLAUSES: Final[dict[str, Callable[[WorkerFactory], None]]] = {
    "round trip is bit-exact": _round_trip,
    "results come in order": _fifo,
    "empty jobs complete": _empty_jobs,
    "bad input is refused before submit": _validation,
    "in-flight conflicts are refused": _conflicts,
    "shutdown drains, is idempotent, then ClosedError": _closed,
}


def check_worker_contract(make_worker: WorkerFactory) -> None:
    """Run every clause against fresh workers from ``make_worker`` (a zero-argument callable).

    The worker's layout needs at least 16 device blocks and 8 host blocks.

    Raises:
        AssertionError: naming the clause and what broke.
    """
    for name, clause in CLAUSES.items():
        try:
            clause(make_worker)
        except AssertionError as exc:
            raise AssertionError(f"worker contract, {name!r}: {exc}") from exc
