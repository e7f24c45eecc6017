"""Testing aids for integrators: the worker contract suite and backends to inject.

``check_worker_contract(make_worker)`` runs the behaviour every :class:`~kvoffload.Worker` promises;
:class:`DeviceHold` holds a CUDA stream on the device until the test lets it go;
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
that failed (an unexpected exception, or a clause that outlives its deadline, is reported the same
way). The suite owns nothing: each clause builds a worker with ``make_worker`` and shuts it down.
It writes every device block and host record of the workers it builds (pick a layout whose contents
the test owns), and needs at least 16 device blocks and 8 host blocks.

Clauses (:data:`CLAUSES`): bit-exact round trips of jobs of several sizes, every result ``ok`` with
its own job id, size and direction, no byte outside a job's blocks changed, and the counters of
what moved; results once each, in submission order per direction, ``wait`` returning exactly the
jobs asked for and by its deadline; empty jobs; validation before submit (typed errors for bad ids,
destinations and job ids, the worker unchanged and a valid job accepted after); a job id unique
across directions until its result came back; in-flight conflicts on host and device blocks refused
with ``BlockConflictError``; layer-by-layer loads, each layer's pages landed by its ``wait_layer``
(when the layout says its layers); expedited loads (a worker with ``expedited_loads``): bit-exact,
counted in ``stats().expedited``, their blocks and ids booked against the regular lane's jobs, or
refused with ``InvalidArgumentError`` without the lane; a job held on the device (a CUDA worker:
a load fenced on a stream :class:`DeviceHold` holds until the suite lets it go): counted in flight,
not polled, ``wait`` raising ``WaitTimeoutError`` by its deadline, each ``wait_layer`` of a load
whose ``LayerLoad.on_device`` returning at once and ordering its stream after the layer (a read
enqueued after it finds the layer landed), then the load bit-exact and counted once; shutdown
draining, idempotent, ``ClosedError`` after it, and no thread of the worker left. ``clauses=`` runs
some of them.

What the suite cannot do: make a copy fail (test failure paths with a :class:`HostBackend` subclass
or :class:`FakeBackend`), or hold a job of a worker that is not on a CUDA device (the held-job
clause checks nothing there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Final

import numpy as np
import torch

from kvoffload._descriptors import PageTable
from kvoffload._seconds import as_timeout
from kvoffload.backends.host import HostBackend
from kvoffload.errors import (
    BlockConflictError,
    ClosedError,
    InvalidArgumentError,
    InvalidBlockIdError,
    JobIdError,
    UnknownJobError,
    WaitTimeoutError,
)
from kvoffload.handler import Backend, Ticket
from kvoffload.layout import DeviceLayout
from kvoffload.records import Direction, TransferResult
from kvoffload.testing.fake import FakeBackend, FakeTicket
from kvoffload.testing.hold import DeviceHold
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
    "DeviceHold",
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


#: The deadline of each of the suite's waits, unless ``check_worker_contract`` is given another.
WAIT_S: Final = 60.0
POLL_INTERVAL_S: Final = 0.001
#: The held-job clause: the timeout of its wait for a job held on the device, how much later that
#: wait may raise, and how long the suite holds the device at most (the hold's own release).
HELD_WAIT_S: Final = 0.05
HELD_WAIT_SLACK_S: Final = 1.0
HOLD_LIMIT_S: Final = 5.0
#: How many streams the held-job clause tries for one whose work runs beside the hold, and how long
#: it waits for each.
FREE_STREAM_TRIES: Final = 8
FREE_STREAM_WAIT_S: Final = 0.25
#: The fewest device blocks and host blocks the suite's jobs need.
MIN_DEVICE_BLOCKS: Final = 16
MIN_HOST_BLOCKS: Final = 8
WorkerFactory = Callable[[], Worker]


class _Run:
    """One clause's worker factory and deadline."""

    def __init__(self, make: WorkerFactory, wait_s: float) -> None:
        self.make = make
        self.wait_s = wait_s

    def worker(self) -> Worker:
        w = self.make()
        if w.layout.num_blocks < MIN_DEVICE_BLOCKS or w.num_host_blocks < MIN_HOST_BLOCKS:
            w.shutdown(self.wait_s)
            raise _TooSmall(
                f"the worker has {w.layout.num_blocks} device blocks and {w.num_host_blocks} host "
                f"blocks; the contract suite needs at least {MIN_DEVICE_BLOCKS} and {MIN_HOST_BLOCKS}"
            )
        return w


class _TooSmall(InvalidArgumentError):
    """The worker is too small for the suite (raised as it is, not as a broken clause)."""


def _check_result(result: TransferResult, job_id: int, direction: Direction, nbytes: int) -> None:
    assert result.job_id == job_id, f"a result for job {job_id} came back as job {result.job_id}"
    assert result.ok, f"job {job_id} failed: {result}"
    assert result.direction is direction, f"job {job_id} came back as a {result.direction.value}"
    assert result.nbytes == nbytes, f"job {job_id} reports {result.nbytes} bytes, not {nbytes}"


#: Bytes of records the suite reads at once to take their digests (it never holds a copy of a
#: whole cache or pool: an engine-sized one would not fit beside it).
DIGEST_CHUNK_BYTES: Final = 64 << 20


def _digests(rows: Callable[[list[int]], torch.Tensor], count: int, record_bytes: int,
             weights: torch.Tensor) -> torch.Tensor:
    """A digest per record ``0 .. count-1`` (``rows(ids)`` reads them, ``uint8 [len(ids),
    record_bytes]``): their bytes weighted by odd ``weights``, so any one changed byte changes it.
    Read in chunks of :data:`DIGEST_CHUNK_BYTES`; returned on the CPU."""
    step = max(1, DIGEST_CHUNK_BYTES // (8 * record_bytes))
    out = []
    for start in range(0, count, step):
        chunk = rows(list(range(start, min(count, start + step))))
        out.append((chunk.to(torch.int64) * weights.to(chunk.device)).sum(dim=1).cpu())
    return torch.cat(out)


def _fill(layout: DeviceLayout, host: torch.Tensor) -> None:
    """Random bytes in every device block and host record, a chunk at a time."""
    step = max(1, DIGEST_CHUNK_BYTES // layout.record_bytes)
    for start in range(0, layout.num_blocks, step):
        ids = list(range(start, min(layout.num_blocks, start + step)))
        layout.scatter_records(ids, _random_records(layout, len(ids)))
    for start in range(0, host.shape[0], step):
        host[start : start + step].random_(0, 256)


def _round_trip(run: _Run) -> None:
    with run.worker() as w:
        layout, hosts = w.layout, w.num_host_blocks
        rng = np.random.default_rng(7)
        half = layout.num_blocks // 2
        sizes = [1, 2, 3]
        sizes.append(max(1, min(hosts - sum(sizes), half - sum(sizes), 48)))
        _fill(layout, w.host_records())
        weights = torch.randint(0, 1 << 30, (layout.record_bytes,), dtype=torch.int64) * 2 + 1

        def device_digests() -> torch.Tensor:
            return _digests(layout.gather_records, layout.num_blocks, layout.record_bytes, weights)

        def host_digests() -> torch.Tensor:
            records = w.host_records()
            return _digests(lambda ids: records[ids], hosts, layout.record_bytes, weights)

        device_before, host_before = device_digests(), host_digests()
        stats_before = w.stats()
        host_ids = rng.permutation(hosts)[: sum(sizes)]
        dst_ids = half + rng.permutation(layout.num_blocks - half)[: sum(sizes)]
        jobs, start = [], 0
        for job, size in enumerate(sizes, start=1):
            src = rng.choice(half, size, replace=False)
            part = slice(start, start + size)
            jobs.append((job, src, host_ids[part], dst_ids[part], layout.gather_records(src)))
            start += size
        for job, src, hst, _, _ in jobs:
            w.store(job, src, hst)
        for (job, src, hst, _, original), stored in zip(jobs, w.wait([j for j, *_ in jobs], run.wait_s)):
            _check_result(stored, job, Direction.STORE, len(src) * layout.block_bytes)
            got = w.host_records()[torch.as_tensor(hst)].to(layout.device)
            assert _pages_equal(layout, got, original), f"store job {job}: host records differ from the stored blocks"
        untouched = torch.as_tensor(np.setdiff1d(np.arange(hosts), host_ids))
        host_after_stores = host_digests()
        assert torch.equal(host_after_stores[untouched], host_before[untouched]), \
            "a store changed a host record outside its job"
        assert torch.equal(device_digests(), device_before), "a store changed a device block"
        for job, _, hst, dst, _ in jobs:
            w.load(job + len(jobs), hst, dst)
        loads = [j + len(jobs) for j, *_ in jobs]
        for (job, src, _, dst, original), loaded in zip(jobs, w.wait(loads, run.wait_s)):
            _check_result(loaded, job + len(jobs), Direction.LOAD, len(src) * layout.block_bytes)
            assert _pages_equal(layout, layout.gather_records(dst), original), \
                f"load job {job + len(jobs)}: loaded blocks differ from the stored ones"
        others = torch.as_tensor(np.setdiff1d(np.arange(layout.num_blocks), dst_ids))
        assert torch.equal(device_digests()[others], device_before[others]), \
            "a load changed a device block outside its job"
        assert torch.equal(host_digests(), host_after_stores), "a load changed a host record"
        moved = sum(sizes) * layout.block_bytes
        stats = w.stats()
        for name in ("store", "load"):
            now, then = getattr(stats, name), getattr(stats_before, name)
            counted = (now.completed - then.completed, now.failed - then.failed, now.in_flight,
                       now.bytes_done - then.bytes_done)
            assert counted == (len(jobs), 0, 0, moved), \
                f"stats().{name} counted (completed, failed, in flight, bytes) = {counted}, not " \
                f"{(len(jobs), 0, 0, moved)}"


def _order(run: _Run) -> None:
    with run.worker() as w:
        count = min(8, w.num_host_blocks, w.layout.num_blocks)
        for job in range(count):
            w.store(job, [job], [job])
        results = w.wait(list(range(count)), run.wait_s)
        assert [r.job_id for r in results] == list(range(count)), "wait returned another order"
        assert all(r.ok for r in results), f"a store failed: {results}"
        assert w.poll() == [], "poll returned results wait already returned"
        for job in range(count, 2 * count):
            w.load(job, [job - count], [job - count])
        deadline = time.monotonic() + run.wait_s
        seen: list[TransferResult] = []
        while len(seen) < count and time.monotonic() < deadline:
            seen += w.poll()
            time.sleep(POLL_INTERVAL_S)
        assert [r.job_id for r in seen] == list(range(count, 2 * count)), \
            f"poll returned the loads {[r.job_id for r in seen]}"
        assert all(r.ok and r.direction is Direction.LOAD for r in seen), f"a load failed: {seen}"
        jobs = [100, 101, 102, 103]
        for job in jobs:
            w.store(job, [job % count], [job % count])
        picked = w.wait([102], run.wait_s)
        assert [r.job_id for r in picked] == [102], f"wait([102]) returned {[r.job_id for r in picked]}"
        rest = w.wait([103, 100, 101], run.wait_s)
        assert [r.job_id for r in rest] == [103, 100, 101], \
            f"wait([103, 100, 101]) returned {[r.job_id for r in rest]}"
        assert w.poll() == [], "poll returned results wait already returned"
        w.store(200, [0], [0])
        began = time.monotonic()
        try:
            got = w.wait([200], 0.0)
            took = time.monotonic() - began
            assert [r.job_id for r in got] == [200], \
                f"wait([200], timeout=0) returned {[r.job_id for r in got]}: neither its result nor WaitTimeoutError"
        except WaitTimeoutError:
            took = time.monotonic() - began
            w.wait([200], run.wait_s)
        assert took < min(1.0, run.wait_s), f"wait(..., timeout=0) took {took:.2f} s"


def _empty_jobs(run: _Run) -> None:
    with run.worker() as w:
        w.store(1, [], [])
        w.load(2, [], [])
        results = {r.job_id: r for r in w.wait([1, 2], run.wait_s)}
        assert set(results) == {1, 2}, f"empty jobs came back as {sorted(results)}"
        assert all(r.ok and r.nbytes == 0 for r in results.values()), f"empty jobs: {results}"


def _refused(call: Callable[[], object], kind: type[Exception], what: str) -> None:
    try:
        call()
    except kind:
        return
    except Exception as exc:
        raise AssertionError(f"{what}: raised {type(exc).__name__} ({exc}), not {kind.__name__}") from exc
    raise AssertionError(f"{what} was accepted; expected {kind.__name__}")


def _validation(run: _Run) -> None:
    with run.worker() as w:
        blocks, hosts = w.layout.num_blocks, w.num_host_blocks
        before = w.stats()
        bad: list[tuple[Callable[[], object], type[Exception], str]] = [
            (lambda: w.store(1, [0, 1], [0]), InvalidBlockIdError, "a store of unequal lengths"),
            (lambda: w.store(1, [-1], [0]), InvalidBlockIdError, "a store of device block -1"),
            (lambda: w.store(1, [0], [-1]), InvalidBlockIdError, "a store into host block -1"),
            (lambda: w.load(1, [-1], [0]), InvalidBlockIdError, "a load of host block -1"),
            (lambda: w.load(1, [0], [-1]), InvalidBlockIdError, "a load into device block -1"),
            (lambda: w.store(1, [blocks], [0]), InvalidBlockIdError, "a store of a device block past the end"),
            (lambda: w.store(1, [0], [hosts]), InvalidBlockIdError, "a store into a host block past the end"),
            (lambda: w.store(1, [0, 1], [2, 2]), InvalidBlockIdError, "a store into one host block twice"),
            (lambda: w.load(1, [hosts], [0]), InvalidBlockIdError, "a load of a host block past the end"),
            (lambda: w.load(1, [0], [blocks]), InvalidBlockIdError, "a load into a device block past the end"),
            (lambda: w.load(1, [0, 1], [2, 2]), InvalidBlockIdError, "a load into one device block twice"),
            (lambda: w.store(1.5, [0], [0]), JobIdError, "a job id of 1.5"),  # type: ignore[arg-type]
            (lambda: w.store(True, [0], [0]), JobIdError, "a job id of True"),
            (lambda: w.wait([12345], 1.0), UnknownJobError, "a wait for a job never submitted"),
        ]
        for call, kind, what in bad:
            _refused(call, kind, what)
        assert w.stats() == before, "a refused call changed the worker"
        assert w.poll() == [], "a refused call produced a result"
        w.store(1, [0, 1], [0, 1])  # every refused call left the blocks and the id free
        (stored,) = w.wait([1], run.wait_s)
        _check_result(stored, 1, Direction.STORE, 2 * w.layout.block_bytes)
        _refused(lambda: w.wait([1], 1.0), UnknownJobError, "a wait for a job whose result was returned")


def _job_ids(run: _Run) -> None:
    with run.worker() as w:
        w.store(1, [0], [0])
        _refused(lambda: w.load(1, [1], [1]), JobIdError, "a load with the id of a store not returned")
        _refused(lambda: w.store(1, [2], [2]), JobIdError, "a store with the id of a store not returned")
        (stored,) = w.wait([1], run.wait_s)
        _check_result(stored, 1, Direction.STORE, w.layout.block_bytes)
        w.load(1, [0], [1])  # free once its result came back
        _refused(lambda: w.load(1, [2], [2]), JobIdError, "a load with the id of a load not returned")
        _refused(lambda: w.store(1, [3], [3]), JobIdError, "a store with the id of a load not returned")
        (loaded,) = w.wait([1], run.wait_s)
        _check_result(loaded, 1, Direction.LOAD, w.layout.block_bytes)


def _conflicts(run: _Run) -> None:
    with run.worker() as w:
        w.store(1, [0], [0])  # reads device 0, writes host 0
        _refused(lambda: w.load(2, [0], [1]), BlockConflictError, "a load of a host block a store writes")
        _refused(lambda: w.store(2, [1], [0]), BlockConflictError, "a store into a host block a store writes")
        _refused(lambda: w.load(2, [5], [0]), BlockConflictError, "a load into a device block a store reads")
        w.load(3, [4], [6])  # reads host 4, writes device 6
        _refused(lambda: w.load(4, [5], [6]), BlockConflictError, "a load into a device block a load writes")
        _refused(lambda: w.store(4, [6], [5]), BlockConflictError, "a store of a device block a load writes")
        _refused(lambda: w.store(4, [7], [4]), BlockConflictError, "a store into a host block a load reads")
        results = w.wait([1, 3], run.wait_s)
        assert [r.job_id for r in results] == [1, 3] and all(r.ok for r in results), f"jobs: {results}"
        w.load(2, [0], [1])  # accepted once the results came back
        w.store(4, [6], [5])
        assert all(r.ok for r in w.wait([2, 4], run.wait_s)), "a job after the conflicts failed"


def _stored(run: _Run, w: Worker) -> tuple[list[int], list[int], torch.Tensor]:
    """Store job 1: up to 4 random device blocks from block 0 into as many host records; returns
    the host records, the last as many device blocks (to load into) and the blocks' bytes."""
    layout = w.layout
    n = min(4, w.num_host_blocks)
    src, hosts = list(range(n)), list(range(n))
    layout.scatter_records(src, _random_records(layout, n))
    original = layout.gather_records(src)
    w.store(1, src, hosts)
    _check_result(w.wait([1], run.wait_s)[0], 1, Direction.STORE, n * layout.block_bytes)
    return hosts, list(range(layout.num_blocks - n, layout.num_blocks)), original


def _layers(run: _Run) -> None:
    with run.worker() as w:
        layout = w.layout
        if layout.layers is None:  # the layout does not say its layers: nothing to check
            return
        hosts, dst, original = _stored(run, w)
        n = len(hosts)
        layout.scatter_records(dst, torch.zeros_like(original))
        stream = None
        if layout.device.type == "cuda":  # the load follows ``stream``, not the stream that zeroed
            torch.cuda.synchronize(layout.device)
            stream = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
        load = w.load_by_layer(2, hosts, dst, stream=stream)
        for i, table in enumerate(layout.layer_tables):
            load.wait_layer(i, stream, timeout=run.wait_s)
            if stream is not None:
                with torch.cuda.stream(stream):
                    got = layout.gather_records(dst)
                stream.synchronize()
            else:
                got = layout.gather_records(dst)
            assert _pages_equal(layout, got, original, table), f"layer {i} had not landed by its wait_layer"
        _check_result(w.wait([2], run.wait_s)[0], 2, Direction.LOAD, n * layout.block_bytes)


def _expedited(run: _Run) -> None:
    with run.worker() as w:
        layout = w.layout
        if not w.expedited_loads:  # no lane: refused before anything is submitted
            _refused(lambda: w.load(1, [0], [0], expedited=True), InvalidArgumentError,
                     "an expedited load on a worker without the expedited lane")
            w.load(1, [0], [0])  # the id was left free
            _check_result(w.wait([1], run.wait_s)[0], 1, Direction.LOAD, layout.block_bytes)
            return
        hosts, dst, original = _stored(run, w)
        n = len(hosts)
        before = w.stats()
        w.load(2, hosts, dst, expedited=True)  # reads hosts, writes dst until its result came back
        _refused(lambda: w.load(3, [n], dst[:1]), BlockConflictError,
                 "a regular load into a device block an expedited load writes")
        _refused(lambda: w.store(3, [n], hosts[:1]), BlockConflictError,
                 "a store into a host record an expedited load reads")
        _refused(lambda: w.load(2, [n], [n]), JobIdError, "a regular load with an expedited load's id")
        _check_result(w.wait([2], run.wait_s)[0], 2, Direction.LOAD, n * layout.block_bytes)
        if layout.device.type == "cuda":
            torch.cuda.synchronize(layout.device)
        assert _pages_equal(layout, layout.gather_records(dst), original), \
            "an expedited load's blocks differ from the stored ones"
        after = w.stats()
        assert after.expedited is not None and before.expedited is not None, \
            "stats().expedited is None on a worker with the expedited lane"
        lanes = (after.expedited.completed - before.expedited.completed, after.load.completed - before.load.completed)
        assert lanes == (1, 0), f"an expedited load was counted (expedited, load) = {lanes}, not (1, 0)"


def _held(run: _Run) -> None:
    with run.worker() as w:
        layout = w.layout
        if layout.device.type != "cuda":  # the suite holds a job only behind a CUDA stream
            return
        hosts, dst, original = _stored(run, w)
        n = len(hosts)
        # ids on the device: a list would be copied to it with a synchronize of the reader, which
        # waits for the held load once the reader waits for a layer
        dst_index = torch.as_tensor(dst, dtype=torch.long, device=layout.device)
        # the same load once, not held: what a worker builds for its first load (plans, tables,
        # memory), where a host wait is no defect, is built before the hold
        if layout.layers is not None:
            w.load_by_layer(3, hosts, dst)
        else:
            w.load(3, hosts, dst)
        _check_result(w.wait([3], run.wait_s)[0], 3, Direction.LOAD, n * layout.block_bytes)
        layout.scatter_records(dst, torch.zeros_like(original))
        torch.cuda.synchronize(layout.device)
        before = w.stats().load
        reads: list[torch.Tensor] = []
        with DeviceHold(layout.device, HOLD_LIMIT_S) as hold:
            # the load's fence is taken on the held stream: none of its copies can run until the release
            layered = w.load_by_layer(2, hosts, dst, stream=hold.stream) if layout.layers is not None else None
            if layered is None:
                w.load(2, hosts, dst, stream=hold.stream)
            in_flight = w.stats().load.in_flight - before.in_flight
            assert in_flight == 1, f"stats().load.in_flight rose by {in_flight}, not 1, with a load held on the device"
            polled = w.poll()
            assert polled == [], f"poll returned {polled} while the stream the load was given was held " \
                "on the device: the load did not wait for its stream="
            began = time.monotonic()
            try:
                got = w.wait([2], HELD_WAIT_S)
            except WaitTimeoutError:
                took = time.monotonic() - began
            else:
                took = time.monotonic() - began
                if hold.released_by_limit:
                    raise AssertionError(f"wait([2], timeout={HELD_WAIT_S}) returned {[r.job_id for r in got]} "
                                         f"after {took:.2f} s: it outlived its timeout until the suite's hold on "
                                         f"the device ended at its limit ({HOLD_LIMIT_S:.0f} s)")
                raise AssertionError(f"wait([2], timeout={HELD_WAIT_S}) returned {[r.job_id for r in got]} after "
                                     f"{took:.2f} s while the stream the load was given was held on the "
                                     "device: the load did not wait for its stream=")
            assert took < HELD_WAIT_S + HELD_WAIT_SLACK_S, \
                f"wait([2], timeout={HELD_WAIT_S}) of a load held on the device raised WaitTimeoutError after {took:.2f} s"
            # (a wait_layer that waits on the host is _layers' to check; a reader that shares the
            # held stream's hardware queue would read only after the release, proving nothing)
            reader = _free_stream(layout.device, hold) if layered is not None and layered.on_device else None
            if layered is not None and reader is not None:
                for i in range(len(layout.layer_tables)):
                    layered.wait_layer(i, reader, timeout=run.wait_s)
                    with torch.cuda.stream(reader):
                        reads.append(layout.gather_records(dst_index))
            assert not hold.released_by_limit, \
                f"wait_layer blocked the host until the suite's hold on the device ended at its limit " \
                f"({HOLD_LIMIT_S:.0f} s): it must make the stream wait, not the caller"
        (loaded,) = w.wait([2], run.wait_s)
        _check_result(loaded, 2, Direction.LOAD, n * layout.block_bytes)
        if reader is not None:
            reader.synchronize()
        for i, (table, got_layer) in enumerate(zip(layout.layer_tables, reads)):
            assert _pages_equal(layout, got_layer, original, table), \
                f"a read after wait_layer({i}, stream) found layer {i} not landed: the stream did not wait for it"
        torch.cuda.synchronize(layout.device)
        assert _pages_equal(layout, layout.gather_records(dst), original), "the held load's blocks differ from the stored ones"
        after = w.stats().load
        counted = (after.in_flight - before.in_flight, after.completed - before.completed, after.failed - before.failed)
        assert counted == (0, 1, 0), \
            f"stats().load counted (in flight, completed, failed) = {counted} after the held load, not (0, 1, 0)"


def _free_stream(device: torch.device, hold: DeviceHold) -> torch.cuda.Stream | None:
    """A stream whose work runs while ``hold`` holds the device (one that shares the held stream's
    hardware queue waits with it), or None when none of a few of torch's streams does."""
    for _ in range(FREE_STREAM_TRIES):
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        probe = torch.cuda.Event()  # type: ignore[no-untyped-call]
        probe.record(stream)
        deadline = time.monotonic() + FREE_STREAM_WAIT_S
        ran: Callable[[], bool] = probe.query
        while not ran() and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        if ran() and hold.held():
            return stream
    return None


def _closed(run: _Run) -> None:
    before = set(threading.enumerate())
    w = run.worker()
    try:
        w.store(1, [0], [0])
    finally:
        w.shutdown(run.wait_s)
    w.shutdown(run.wait_s)
    after: list[tuple[Callable[[], object], str]] = [
        (lambda: w.store(2, [0], [0]), "store"), (lambda: w.load(2, [0], [0]), "load"), (w.poll, "poll"),
        (lambda: w.wait([1], 1.0), "wait"), (w.host_records, "host_records"),
    ]
    if w.layout.layers is not None:
        after.append((lambda: w.load_by_layer(2, [0], [0]), "load_by_layer"))
    for call, name in after:
        _refused(call, ClosedError, f"{name} after shutdown")
    stats = w.stats()
    assert (stats.store.completed, stats.store.in_flight) == (1, 0), "shutdown did not drain the in-flight job"
    deadline = time.monotonic() + min(5.0, run.wait_s)
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = [t for t in left if t.is_alive()]
    assert not left, f"threads left running after shutdown: {[t.name for t in left]}"


def _random_records(layout: DeviceLayout, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8, device=layout.device)


def _pages_equal(layout: DeviceLayout, a: torch.Tensor, b: torch.Tensor, table: PageTable | None = None) -> bool:
    table = layout.page_table if table is None else table
    return all(
        torch.equal(a[:, o : o + n], b[:, o : o + n])
        for o, n in zip(table.host_offset.tolist(), table.nbytes.tolist())
    )


#: Every clause, by name, in the order :func:`check_worker_contract` runs them.
CLAUSES: Final[dict[str, Callable[[_Run], None]]] = {
    "round trips are bit-exact and touch only their blocks": _round_trip,
    "results come back once, in order, as asked": _order,
    "empty jobs complete": _empty_jobs,
    "bad input is refused before submit": _validation,
    "a job id is unique until its result came back": _job_ids,
    "in-flight conflicts are refused": _conflicts,
    "each layer has landed by its wait_layer": _layers,
    "expedited loads take their own lane, or are refused without one": _expedited,
    "a job held on the device keeps its deadlines, counters and layer order": _held,
    "shutdown drains, is idempotent, then ClosedError": _closed,
}


def _chosen(clauses: Iterable[str] | None) -> dict[str, Callable[[_Run], None]]:
    """The clauses to run, in :data:`CLAUSES`' order; every name checked before any runs."""
    if clauses is None:
        return dict(CLAUSES)
    if isinstance(clauses, (str, bytes)):
        raise InvalidArgumentError(f"clauses must be an iterable of clause names, not the string {clauses!r}")
    names = list(clauses)
    unknown = [n for n in names if not isinstance(n, str) or n not in CLAUSES]
    if unknown:
        raise InvalidArgumentError(f"clauses names {unknown!r}, not clauses of the suite; they are {list(CLAUSES)!r}")
    if not names:
        raise InvalidArgumentError("clauses names no clause; omit it to run them all")
    return {name: clause for name, clause in CLAUSES.items() if name in names}


def check_worker_contract(make_worker: WorkerFactory, *, timeout_s: float = WAIT_S,
                          clauses: Iterable[str] | None = None) -> None:
    """Run every clause (or those named in ``clauses``, keys of :data:`CLAUSES`, in that dict's
    order) against fresh workers from ``make_worker`` (a zero-argument callable).

    The worker's layout needs at least :data:`MIN_DEVICE_BLOCKS` device blocks and the worker
    :data:`MIN_HOST_BLOCKS` host blocks. ``timeout_s`` is the deadline of each wait the suite makes;
    a clause still running after a few of them is reported as hung (its thread is left behind).
    Each clause runs on a thread of its own, which takes the caller's CUDA device and stream and
    its grad and inference modes; anything else thread-local that ``make_worker`` relies on is
    not there. The suite reads the workers' blocks and records in chunks of
    :data:`DIGEST_CHUNK_BYTES` and keeps digests of them, never a copy of a whole cache or pool.

    Raises:
        AssertionError: naming the clause and what broke (an exception the clause did not expect,
            or a clause past its deadline, included).
        InvalidArgumentError: ``timeout_s`` is not a finite number > 0, ``clauses`` is a string or
            names no clause or one that is not a key of :data:`CLAUSES`, or the worker is too small.
    """
    wait_s = as_timeout(timeout_s, "timeout_s", positive=True)
    chosen = _chosen(clauses)
    run = _Run(make_worker, wait_s)
    # what of the caller's thread a factory may rely on, given to each clause's thread
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    device = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream() if cuda else None
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    for name, clause in chosen.items():
        failure: list[BaseException] = []

        def body(clause: Callable[[_Run], None] = clause) -> None:
            try:
                if device is not None and stream is not None:
                    torch.cuda.set_device(device)
                    torch.cuda.set_stream(stream)
                # in this order: entering inference_mode(False) turns grad on
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    clause(run)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
                failure.append(exc)

        thread = threading.Thread(target=body, name=f"kvoffload-contract-{name}", daemon=True)
        thread.start()
        limit = 8 * wait_s + 10.0  # a clause makes a few waits, each with its deadline
        thread.join(limit)
        if thread.is_alive():
            raise AssertionError(f"worker contract, {name!r}: did not finish within {limit:.0f} s (a call "
                                 "blocked past its deadline?)")
        if not failure:
            continue
        exc = failure[0]
        if isinstance(exc, _TooSmall):
            raise InvalidArgumentError(str(exc)) from None
        if not isinstance(exc, Exception):  # a test's skip or exit, a KeyboardInterrupt: as it is
            raise exc
        if isinstance(exc, AssertionError):
            raise AssertionError(f"worker contract, {name!r}: {exc}") from exc
        raise AssertionError(f"worker contract, {name!r}: raised {type(exc).__name__}: {exc}") from exc
