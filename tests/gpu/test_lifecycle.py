"""Lifecycle on the real driver: shutdown with a hundred jobs in flight, a drain whose event wait
raises, registrations released exactly once, driver faults reported as failed jobs, a refused end
record that keeps its job in flight until its copies ran."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from cuda.bindings import driver as cuda_driver

from kvoffload import CudaError, PathName, ShutdownError, SrcAccessOrder, WaitTimeoutError, Worker
from kvoffload.backends.cuda import CudaBackend, CudaTicket, DmaPath
from kvoffload.backends.native import NativeBackend, NativeTicket
from kvoffload.bindings import driver
from kvoffload.testing import DeviceHold
from tests.gpu._helpers import SLEEP_CYCLES, TIMEOUT_S, cache, stall
from tests.gpu.conftest import Figures

HANG_GUARD_S = 120.0  # "does not hang" bound; never a performance assertion


class RecordingPinner(driver.CudaHostPinner):
    """The real pinner, recording what it registered and unregistered."""

    registered: list[int] = []
    unregistered: list[int] = []

    def register(self, ptr: int, nbytes: int) -> None:
        super().register(ptr, nbytes)
        self.registered.append(ptr)

    def unregister(self, ptr: int) -> None:
        super().unregister(ptr)
        self.unregistered.append(ptr)


@pytest.fixture
def recording_pinner(device: torch.device) -> RecordingPinner:
    """The real pinner, injected into the workers a test creates (``Worker.create(pinner=...)``)."""
    RecordingPinner.registered = []
    RecordingPinner.unregistered = []
    return RecordingPinner(device.index or 0)


def run_with_guard(fn: Callable[[], None]) -> BaseException | None:
    """Run ``fn`` on a thread; fail the test if it does not return within the hang guard."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "shutdown hung"
    return outcome[0]


#: Jobs kept in flight behind a stalled compute stream. The driver accepts only so much work on
#: streams that wait: with hundreds of queued jobs, submitting blocks in the driver until the compute
#: stream moves (measured on the H200: 520 one-block jobs took the whole 1 s stall to submit).
JOBS_IN_FLIGHT = 100


def test_shutdown_with_jobs_in_flight_drains_unpins_and_unmaps(
    device: torch.device, recording_pinner: RecordingPinner, figures: Figures
) -> None:
    layout = cache("per-layer", device, num_blocks=256, layers=8)
    w = Worker.create(layout, 600, pin_chunk_bytes=64 * layout.record_bytes, pinner=recording_pinner)
    region = w._region
    compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(compute):
        stall(SLEEP_CYCLES * 40)  # ~0.2 s: every job stays queued behind compute
    for job in range(JOBS_IN_FLIGHT):
        w.store(job, [job % layout.num_blocks], [job], stream=compute)
    in_flight = w.stats().store.in_flight
    stalled = not compute.query()
    t0 = time.perf_counter()
    error = run_with_guard(lambda: w.shutdown(timeout=30.0))
    elapsed = time.perf_counter() - t0
    assert error is None, error
    assert stalled and in_flight == JOBS_IN_FLIGHT, "the stall ended early: nothing was in flight"
    figures.add(f"shutdown with {in_flight} store jobs in flight (behind a ~0.2 s stall)",
                f"{elapsed:8.3f} s")
    stats = w.stats().store
    assert (stats.completed, stats.failed, stats.in_flight) == (JOBS_IN_FLIGHT, 0, 0)
    assert region.released
    assert len(recording_pinner.registered) == 10  # 600 records in chunks of 64
    assert sorted(recording_pinner.unregistered) == sorted(recording_pinner.registered)
    assert recording_pinner.unregistered == list(reversed(recording_pinner.registered))


def test_drain_whose_event_wait_raises_still_tears_everything_down(
    device: torch.device, recording_pinner: RecordingPinner, monkeypatch: pytest.MonkeyPatch,
    figures: Figures,
) -> None:
    layout = cache("per-layer", device, num_blocks=128, layers=4)
    w = Worker.create(layout, 64, pinner=recording_pinner)
    region = w._region
    for job in range(40):
        w.store(job, [job], [job])
    injected = CudaError("cuEventQuery", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "injected fault")

    def failing_wait(self: object, timeout_s: float) -> bool:
        raise injected

    def failing_book_wait(self: object, job_id: object, timeout_s: float) -> bool:
        raise injected

    def failing_book_take(self: object) -> list[object]:
        raise injected

    monkeypatch.setattr(CudaTicket, "wait", failing_wait)
    monkeypatch.setattr(NativeTicket, "wait", failing_wait)
    # the native issuer's drain takes the finished results first (all of them, when the jobs were
    # done by then), then waits for the rest: both fail
    monkeypatch.setattr(NativeBackend, "book_wait", failing_book_wait)
    monkeypatch.setattr(NativeBackend, "book_take", failing_book_take)
    t0 = time.perf_counter()
    error = run_with_guard(lambda: w.shutdown(timeout=5.0))
    elapsed = time.perf_counter() - t0
    figures.add("shutdown whose drain raises (timeout 5 s)", f"{elapsed:8.3f} s")
    assert isinstance(error, ShutdownError)
    assert injected in error.failures
    assert not error.region_left_mapped  # the fallback synchronize proved the device idle
    assert region.released
    assert sorted(recording_pinner.unregistered) == sorted(recording_pinner.registered)


def test_driver_fault_fails_that_job_and_later_jobs_still_work(device: torch.device) -> None:
    layout = cache("per-layer", device, num_blocks=64, layers=2)
    with Worker.create(layout, 16, path="dma", issuer="python") as w:  # it corrupts the copier's attributes
        backend = w._store._backend
        assert isinstance(backend, CudaBackend)
        dma = backend.paths["dma"]
        assert isinstance(dma, DmaPath)
        pointers = dma.copier._attrs_ptr
        good_attrs = pointers[SrcAccessOrder.STREAM]
        # An INVALID source access order is refused by the driver itself (CUDA_ERROR_INVALID_VALUE).
        invalid = cuda_driver.CUmemcpyAttributes()
        pointers[SrcAccessOrder.STREAM] = invalid.getPtr()
        w.store(1, [13, 20], [0, 5])  # apart on both sides: several copies, one batched call
        (bad,) = w.wait([1], TIMEOUT_S)
        pointers[SrcAccessOrder.STREAM] = good_attrs
        assert not bad.ok
        assert isinstance(bad.error, CudaError), bad.error
        assert bad.error.call == "cuMemcpyBatchAsync"
        assert bad.error.name == "CUDA_ERROR_INVALID_VALUE"
        assert w.stats().store.failed == 1
        w.store(2, [5], [1])
        (good,) = w.wait([2], TIMEOUT_S)
        assert good.ok, good.error
        assert torch.equal(w.host_records()[1].to(device), layout.gather_records([5])[0])


def _refuse_end_records(monkeypatch: pytest.MonkeyPatch, refusals: int) -> list[int]:
    """From now on, refuse the records of timing events from the second on, ``refusals`` of them: a
    Python-issued job records its start and then its end on timing events (everything else it
    records comes from the other pool), and a refused end is tried once more with a fresh one.
    Returns the count of timing records seen, updated as they come."""
    real = driver.Event.record
    seen = [0]

    def record(self: driver.Event, stream: int) -> None:
        pool = self._pool
        if pool is not None and pool.timing:
            seen[0] += 1
            if 2 <= seen[0] < 2 + refusals:
                raise CudaError("cuEventRecord", 999, "CUDA_ERROR_UNKNOWN", "refused by the test")
        real(self, stream)

    monkeypatch.setattr(driver.Event, "record", record)
    return seen


@pytest.mark.parametrize("refusals", [1, 2], ids=["refused-once", "control-refused-twice"])
@pytest.mark.parametrize("how", ["store", "load", "load_by_layer"])
@pytest.mark.parametrize("path", ["dma", "sm", "staged"])
def test_a_job_whose_end_record_is_refused_stays_in_flight_until_its_copies_ran(
    path: PathName, how: str, refusals: int, device: torch.device, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Python issuer records a refused end once more on a fresh event, and the job, failed,
    ends only once that end completed (docs/design.md §5 rule 5). Its fence is on a held stream, so
    none of its copies can run until the release. The control's end is refused twice, which the
    issuer takes as the context's failure: that job ends at once while the hold is held, which
    proves that the test sees a job that ends before its copies ran. One layer: a layered job of
    more is issued in two parts (layer 0 on the caller's thread, the rest on the issuer's), whose
    second keeps the job in flight whatever happened to the first's end."""
    layout = cache("kv-separate", device, num_blocks=64, layers=1)
    assert layout.layers is not None and len(layout.layers) == 1
    with Worker.create(layout, 16, path=path, issuer="python") as w:

        def submit(job_id: int, stream: torch.cuda.Stream | None) -> None:
            if how == "store":
                w.store(job_id, [3, 9], [job_id, job_id + 8], stream=stream)
            elif how == "load":
                w.load(job_id, [1, 9], [20 + job_id, 40 + job_id], stream=stream)
            else:
                w.load_by_layer(job_id, [1, 9], [20 + job_id, 40 + job_id], stream=stream)

        submit(1, None)  # the same job once, untouched: what the path builds for its first job
        (first,) = w.wait([1], TIMEOUT_S)
        assert first.ok, first.error
        with DeviceHold(device, limit_s=60.0) as hold:
            seen = _refuse_end_records(monkeypatch, refusals)
            submit(2, hold.stream)
            began = time.monotonic()
            while seen[0] < 3 and time.monotonic() - began < TIMEOUT_S:  # start, end, end again
                time.sleep(0.001)
            assert seen[0] == 3, f"{seen[0]} timing records, not 3 (start, end refused, end again)"
            if refusals == 2:
                (early,) = w.wait([2], 10.0)
                assert hold.held() and not early.ok
                hold.release()
            else:
                with pytest.raises(WaitTimeoutError):
                    w.wait([2], 0.3)
                assert hold.held(), "the hold ended before the check"
                assert w.stats().load.in_flight + w.stats().store.in_flight == 1
                hold.release()
                (late,) = w.wait([2], TIMEOUT_S)
                assert not late.ok
                assert isinstance(late.error, CudaError) and late.error.call == "cuEventRecord", late.error
        monkeypatch.undo()
        submit(3, None)  # the worker goes on
        (after,) = w.wait([3], TIMEOUT_S)
        assert after.ok, after.error
