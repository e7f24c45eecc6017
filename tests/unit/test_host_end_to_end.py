"""The whole Worker end to end on the host backend: random data, random block ids, bit-exact round
trips for every layout, a random job stream checked against a reference model, shutdown with many
jobs in flight, and injected copy faults."""

from __future__ import annotations

import math
import mmap
import os
import random
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload import (
    BlockConflictError, ClosedError, DeviceLayout, Direction, ShutdownError, TransferError,
    TransferResult, UnknownJobError, Worker,
)
from kvoffload.backends.host import HostBackend
from kvoffload.cli.demo import LAYOUTS, build_cache
from kvoffload.cli.demo import main as demo_main
from kvoffload.region import SHM_DIR

TIMEOUT_S = 60.0
NUM_BLOCKS = 48
HOST_BLOCKS = 40


def small_cache(kind: str, seed: int = 0) -> DeviceLayout:
    tensors, block_dim = build_cache(
        kind, num_blocks=NUM_BLOCKS, layers=3, kv_heads=2, head_dim=32, block_size=4,
        dtype=torch.bfloat16, device=torch.device("cpu"),
        seed=seed,
    )
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim)


@pytest.fixture
def worker() -> Iterator[Worker]:
    with Worker.create(small_cache("per-layer"), HOST_BLOCKS) as w:
        yield w


@pytest.mark.parametrize("kind", LAYOUTS)
def test_round_trip_is_bit_exact_for_every_layout(kind: str) -> None:
    layout = small_cache(kind, seed=hash(kind) % 1000)
    rng = np.random.default_rng(1)
    src = rng.choice(NUM_BLOCKS, size=12, replace=False)
    dst = rng.choice(np.setdiff1d(np.arange(NUM_BLOCKS), src), size=12, replace=False)
    host = rng.choice(HOST_BLOCKS, size=12, replace=False)
    original = layout.gather_records(src)
    with Worker.create(layout, HOST_BLOCKS) as w:
        w.store(1, src, host)
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
        assert torch.equal(w.host_records()[host], original)
        w.load(2, host, dst)
        (result,) = w.wait([2], TIMEOUT_S)
        assert result.ok and result.nbytes == 12 * layout.block_bytes and result.path == "host"
    assert torch.equal(layout.gather_records(dst), original)
    assert torch.equal(layout.gather_records(src), original)


def test_random_job_stream_matches_a_reference_model() -> None:
    layout = small_cache("per-layer", seed=3)
    rng = random.Random(7)
    expected_host: dict[int, torch.Tensor] = {}
    expected_dev = {b: layout.gather_records([b])[0] for b in range(NUM_BLOCKS)}
    in_flight: dict[int, tuple[Direction, list[int], list[int]]] = {}
    with Worker.create(layout, HOST_BLOCKS) as w:
        def busy(direction_side: str) -> set[int]:
            out: set[int] = set()
            for direction, src, dst in in_flight.values():
                dev, host = (src, dst) if direction is Direction.STORE else (dst, src)
                out.update(dev if direction_side == "dev" else host)
            return out

        def settle(results: list[TransferResult]) -> None:
            for r in results:
                assert r.ok, r.error
                direction, src, dst = in_flight.pop(r.job_id)
                if direction is Direction.STORE:
                    for d, h in zip(src, dst):
                        expected_host[h] = expected_dev[d]
                else:
                    for h, d in zip(src, dst):
                        expected_dev[d] = expected_host[h]

        for job in range(300):
            n = rng.randint(0, 6)
            free_dev = sorted(set(range(NUM_BLOCKS)) - busy("dev"))
            free_host = sorted(set(range(HOST_BLOCKS)) - busy("host"))
            stored = sorted(set(expected_host) & set(free_host))
            if rng.random() < 0.5 or len(stored) < n:
                n = min(n, len(free_dev), len(free_host))
                src, dst = rng.sample(free_dev, n), rng.sample(free_host, n)
                w.store(job, src, dst)
                in_flight[job] = (Direction.STORE, src, dst)
            else:
                n = min(n, len(free_dev))
                src, dst = rng.sample(stored, n), rng.sample(free_dev, n)
                w.load(job, src, dst)
                in_flight[job] = (Direction.LOAD, src, dst)
            if rng.random() < 0.3:
                settle(w.poll())
        settle(w.wait(list(in_flight), TIMEOUT_S))
        records = w.host_records()
        for h, want in expected_host.items():
            assert torch.equal(records[h], want), f"host record {h}"
        del records
    for d, want in expected_dev.items():
        assert torch.equal(layout.gather_records([d])[0], want), f"device block {d}"


def test_poll_returns_both_directions_in_completion_order(worker: Worker) -> None:
    worker.store(1, [0], [0])
    worker.wait([1], TIMEOUT_S)
    worker.store(2, [1], [1])
    worker.load(3, [0], [5])
    worker.wait([2, 3], TIMEOUT_S)
    worker.store(4, [2], [2])
    worker.wait([4], TIMEOUT_S)
    assert worker.poll() == []
    worker.store(5, [3], [3])
    worker.load(6, [1], [6])
    results = {r.job_id: r for r in worker.wait([5, 6], TIMEOUT_S)}
    assert results[5].direction is Direction.STORE and results[6].direction is Direction.LOAD


def test_shutdown_with_500_jobs_in_flight_finishes_them_and_releases_the_region() -> None:
    layout = small_cache("block-major")
    w = Worker.create(layout, 512)
    region = w._region
    for job in range(500):
        w.store(job, [job % NUM_BLOCKS], [job])
    w.shutdown(timeout=TIMEOUT_S)
    stats = w.stats().store
    assert (stats.submitted, stats.completed, stats.failed, stats.in_flight) == (500, 500, 0, 0)
    assert region.released


def test_conflicts_of_jobs_of_many_blocks_are_named_and_released(worker: Worker) -> None:
    """Jobs of more than a few blocks are booked with array operations (small ones id by id): the
    conflict names the first clashing id, and completion releases exactly what the job held."""
    worker.store(1, list(range(20)), list(range(20)))  # not waited for: stays in the books
    reads_written = list(range(20, 39)) + [19]
    with pytest.raises(BlockConflictError,
                       match=r"load job 2: host_blocks\[19\] = 19 is being written by in-flight job 1"):
        worker.load(2, reads_written, list(range(20, 40)))
    repeated_reads = list(range(40, 48)) * 2 + [40, 41, 42, 43]
    writes_in_use = list(range(21, 40)) + [5]
    with pytest.raises(BlockConflictError,
                       match=r"store job 3: host_blocks\[19\] = 5 is in use by in-flight job 1"):
        worker.store(3, repeated_reads, writes_in_use)
    assert all(r.ok for r in worker.wait([1], TIMEOUT_S))
    worker.load(2, reads_written, list(range(20, 40)))
    assert all(r.ok for r in worker.wait([2], TIMEOUT_S))
    worker.store(3, repeated_reads, writes_in_use)
    worker.store(4, list(range(20)), list(range(6, 21)) + [0, 1, 2, 3, 4])  # job 1's blocks are free
    assert all(r.ok for r in worker.wait([3, 4], TIMEOUT_S))


class FailingBackend(HostBackend):
    """Fails every copy that writes into the address range ``[lo, hi)``."""

    lo = 0
    hi = 0

    def copy_one(self, dst: int, src: int, size: int) -> None:
        if self.lo <= dst < self.hi:
            raise TransferError(f"injected copy fault at {dst:#x}")
        super().copy_one(dst, src, size)


def test_failed_copy_reports_ok_false_and_other_jobs_are_unaffected() -> None:
    layout = small_cache("per-layer")
    with Worker.create(layout, HOST_BLOCKS, backend_factory=FailingBackend) as w:
        records = w.host_records()
        FailingBackend.lo = records[3].data_ptr()
        FailingBackend.hi = FailingBackend.lo + layout.record_bytes
        del records
        w.store(1, [0], [3])
        w.store(2, [1], [4])
        results = {r.job_id: r for r in w.wait([1, 2], TIMEOUT_S)}
        assert not results[1].ok and isinstance(results[1].error, TransferError)
        assert results[2].ok
        assert w.stats().store.failed == 1
        assert torch.equal(w.host_records()[4], layout.gather_records([1])[0])


class StuckBackend(HostBackend):
    """Blocks in its first copy until ``gate`` is set: a copy that never finishes."""

    gate = threading.Event()

    def copy_one(self, dst: int, src: int, size: int) -> None:
        self.gate.wait(TIMEOUT_S)
        super().copy_one(dst, src, size)


def test_stuck_copy_shutdown_returns_and_leaves_the_region_mapped() -> None:
    StuckBackend.gate.clear()
    w = Worker.create(small_cache("per-layer"), HOST_BLOCKS, backend_factory=StuckBackend)
    w.store(1, [0], [0])
    try:
        with pytest.raises(ShutdownError) as info:
            w.shutdown(timeout=0.2)
        assert info.value.region_left_mapped
        assert "left mapped" in str(info.value)
    finally:
        StuckBackend.gate.set()


@pytest.mark.parametrize("stuck", [True, False])
def test_a_wait_ends_with_closed_error_when_another_thread_shuts_the_worker_down(stuck: bool) -> None:
    """A waiter of a job that never finishes (a stuck copy), or of one queued behind it, is not
    held to its own 300 s deadline by a shutdown of 0.2 s: it ends with ClosedError soon after the
    shutdown (without the book's close it waited out its deadline; the 10 s join bounds it)."""
    StuckBackend.gate.clear()
    w = Worker.create(small_cache("per-layer"), HOST_BLOCKS, backend_factory=StuckBackend)
    w.store(1, [0], [0])
    w.store(2, [1], [1])
    outcome: list[BaseException | list[TransferResult]] = []

    def waiter() -> None:
        try:
            outcome.append(w.wait([1] if stuck else [2], 300.0))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        with pytest.raises(ShutdownError):
            w.shutdown(timeout=0.2)
        thread.join(10.0)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], ClosedError)
        assert "shut down while waiting" in str(outcome[0])
    finally:
        StuckBackend.gate.set()
        thread.join(TIMEOUT_S)


class GatedBackend(HostBackend):
    """Holds every copy until ``gate`` is set: jobs stay queued, not yet issued."""

    gate = threading.Event()

    def copy_one(self, dst: int, src: int, size: int) -> None:
        self.gate.wait(TIMEOUT_S)
        super().copy_one(dst, src, size)


def test_a_caller_may_reuse_its_id_buffers_as_soon_as_submit_returns() -> None:
    """Engines refill one preallocated id buffer per step: a queued job must keep the ids it was
    given, for its copies and for the conflict bookkeeping."""
    GatedBackend.gate.clear()
    layout = small_cache("per-layer")
    device_ids = np.array([0, 1, 2], dtype=np.int64)
    host_ids = np.array([5, 6, 7], dtype=np.int64)
    with Worker.create(layout, HOST_BLOCKS, backend_factory=GatedBackend) as w:
        try:
            w.store(1, device_ids, host_ids)  # held in its first copy: job 2 stays queued
            w.store(2, device_ids + 3, host_ids + 3)
            device_ids[:] = [10, 11, 12]  # the caller refills its buffers for the next step
            host_ids[:] = [20, 21, 22]
            w.store(3, device_ids, host_ids)  # records 20-22 are free: no conflict with job 1
        finally:
            GatedBackend.gate.set()
        assert all(r.ok for r in w.wait([1, 2, 3], TIMEOUT_S))
        records = w.host_records()
        assert torch.equal(records[[5, 6, 7]], layout.gather_records([0, 1, 2]))
        assert torch.equal(records[[20, 21, 22]], layout.gather_records([10, 11, 12]))
        del records
        w.store(4, [0, 1, 2], [5, 6, 7])  # the bookkeeping released exactly what each job held
        w.load(5, [20], [30])
        assert all(r.ok for r in w.wait([4, 5], TIMEOUT_S))


def test_shared_region_worker_round_trip_leaves_no_file() -> None:
    name = f"kvoffload-test-{uuid.uuid4().hex}"
    layout = small_cache("mla")
    with Worker.create(layout, HOST_BLOCKS, shared_name=name) as w:
        assert not os.path.exists(os.path.join(SHM_DIR, name))
        w.store(1, [5, 6], [0, 1])
        assert w.wait([1], TIMEOUT_S)[0].ok
        assert torch.equal(w.host_records()[:2], layout.gather_records([5, 6]))


def test_demo_runs_the_host_backend_verifies_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    status = demo_main(["--backend", "host", "--layers", "2", "--device-blocks", "64",
                        "--host-blocks", "32", "--blocks-per-job", "8", "--link-bytes", str(1 << 24),
                        "--quiet"])
    out = capsys.readouterr().out
    assert status == 0
    assert "host backend" in out
    assert re.search(r"mismatched\s+0 blocks", out)
    assert re.search(r"result\s+OK", out)


class HoldingBackend(HostBackend):
    """Holds a copy while ``hold`` is set, until ``gate`` is set."""

    hold = threading.Event()
    gate = threading.Event()

    def copy_one(self, dst: int, src: int, size: int) -> None:
        if self.hold.is_set():
            self.gate.wait(TIMEOUT_S)
        super().copy_one(dst, src, size)


def test_a_wait_that_loses_a_job_to_a_concurrent_call_keeps_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait for [1, 3] whose job 1 (already finished) is returned by another thread's wait while
    it waits for job 3: it names job 1, and job 3's result and bookkeeping are not lost."""
    HoldingBackend.hold.clear()
    HoldingBackend.gate.clear()
    with Worker.create(small_cache("per-layer"), HOST_BLOCKS, backend_factory=HoldingBackend) as w:
        w.store(1, [0], [0])
        w._store.wait_issued(TIMEOUT_S)
        HoldingBackend.hold.set()
        w.store(3, [1], [1])  # held in its copy until the gate opens
        store_progress = w._store.wait_progress

        def another_thread_takes_job_1(job_id: int, timeout: float) -> None:
            assert [r.job_id for r in w.wait([1], TIMEOUT_S)] == [1]
            HoldingBackend.gate.set()
            store_progress(job_id, timeout)

        with monkeypatch.context() as patch:
            patch.setattr(w._store, "wait_progress", another_thread_takes_job_1)
            with pytest.raises(UnknownJobError, match=r"job\(s\) \[1\] were returned by a concurrent"):
                w.wait([1, 3], TIMEOUT_S)
        HoldingBackend.hold.clear()
        assert [r.job_id for r in w.wait([3], TIMEOUT_S)] == [3]
        w.store(4, [2], [1])  # job 3 released host block 1
        assert w.wait([4], TIMEOUT_S)[0].ok


# ------------------------------------------------ an id returned by another thread, a shutdown racing


@pytest.mark.parametrize("refuse", [True, False], ids=["rule", "control-book-only"])
def test_an_id_whose_result_is_being_returned_is_not_free_until_its_blocks_are(
    refuse: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread's ``wait`` took job 7's result from the job book and has not freed its blocks
    yet (the two steps of Worker.wait): a submit of job 7 then is refused and changes nothing. The
    control asks only the job book, as before: the submit is refused too, but it took the returning
    job's place in the bookkeeping, so a job 7 never submitted stays in flight for ever and block 0
    is never free again."""
    from kvoffload import JobIdError, WaitTimeoutError
    if not refuse:
        monkeypatch.setattr(Worker, "_refuse_booked", lambda self, job, source: self._jobs.reserve(job, source))
    w = Worker.create(small_cache("per-layer"), HOST_BLOCKS)
    try:
        w.store(7, [0], [0])
        results = w._jobs.wait([7], TIMEOUT_S)  # the first step of another thread's wait
        with pytest.raises(JobIdError, match="being returned by another thread" if refuse else None):
            w.store(7, [1], [1])
        w._release(results)  # its second step
        if refuse:
            with pytest.raises(UnknownJobError):
                w.wait([7], 1.0)
            w.store(7, [1], [1])
            w.store(8, [2], [0])
            assert all(r.ok for r in w.wait([7, 8], TIMEOUT_S))
        else:
            with pytest.raises(WaitTimeoutError):
                w.wait([7], 0.3)
            with pytest.raises(BlockConflictError):
                w.store(8, [2], [0])
    finally:
        w.shutdown()


def test_a_submit_overtaken_by_a_shutdown_gets_closed_error() -> None:
    """A submit that passed its first closed check before another thread's shutdown: the shutdown
    cleared the bookkeeping (a KeyError came out of its admission), or released the handler's
    backend (an AssertionError). Now ClosedError, whatever the timing."""
    w = Worker.create(small_cache("per-layer"), HOST_BLOCKS)
    real = w._check_open
    calls = [0]

    def check_then_shut_down() -> None:
        real()
        calls[0] += 1
        if calls[0] == 1:
            w.shutdown(TIMEOUT_S)

    w._check_open = check_then_shut_down  # type: ignore[method-assign]
    with pytest.raises(ClosedError):
        w.store(1, [0], [0])



def test_a_handler_submit_overtaken_by_its_shutdown_gets_closed_error_and_queues_nothing() -> None:
    """The handler's whole shutdown (drain, release) runs between a submit's first look and its
    queueing: the job was queued on a released backend and never completed (the caller got no
    error). The queueing looks again under the handler's lock."""
    w = Worker.create(small_cache("per-layer"), HOST_BLOCKS)
    try:
        handler = w._store
        real = handler._open_backend

        def look_then_shut_down() -> Any:
            backend = real()
            handler.shutdown(TIMEOUT_S)
            return backend

        handler._open_backend = look_then_shut_down  # type: ignore[method-assign]
        with pytest.raises(ClosedError, match="handler was shut down"):
            handler.submit_validated(2, np.zeros(1, np.int64), np.zeros(1, np.int64))
        assert not handler._fifo
    finally:
        w.shutdown()


def test_a_host_of_64k_pages_round_trips_records_of_4k_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records stay padded to 4 KiB where the OS pages are 64 KiB (simulated: the pool plans with
    ``mmap.PAGESIZE``); the pool pins whole pages of them, and a round trip is bit-exact."""
    monkeypatch.setattr(mmap, "PAGESIZE", 65536)
    layout = small_cache("per-layer")
    assert layout.record_bytes % 65536, "the records must not be whole 64 KiB pages for this test"
    src, host, dst = [1, 7, 30], [0, 17, 39], [2, 8, 31]
    original = layout.gather_records(src)
    # the smallest chunks: one multiple of the record and the page each, which runs split at
    with Worker.create(layout, HOST_BLOCKS, pin_chunk_bytes=1) as w:
        assert w._region.chunk_records == math.lcm(layout.record_bytes, 65536) // layout.record_bytes > 1
        w.store(1, src, host)
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
        w.load(2, host, dst)
        assert all(r.ok for r in w.wait([2], TIMEOUT_S))
    assert torch.equal(layout.gather_records(dst), original)
