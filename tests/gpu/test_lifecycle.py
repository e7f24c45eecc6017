"""Lifecycle on the real driver: shutdown with a hundred jobs in flight, a drain whose event wait
raises, registrations released exactly once, driver faults reported as failed jobs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from cuda.bindings import driver as cuda_driver

from kvoffload import CudaError, ShutdownError, SrcAccessOrder, Worker
from kvoffload.backends.cuda import CudaBackend, CudaTicket, DmaPath
from kvoffload.backends.native import NativeBackend, NativeTicket
from kvoffload.bindings import driver
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
