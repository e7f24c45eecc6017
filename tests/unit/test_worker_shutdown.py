"""Worker.shutdown follows docs/design.md §6: store, then load, each isolated; a bounded device-sync fallback
when either failed; the region cleaned exactly once, or left mapped when the device is not proven
idle; one ShutdownError with every failure, raised after all cleanup.

The worker is built with ``Worker.__new__`` and given mock collaborators that record their calls.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvoffload import ClosedError, CudaError, InvalidArgumentError, ShutdownError, Worker
from kvoffload.records import Direction
from kvoffload._jobs import JobBook
from kvoffload.worker.booking import Bookkeeping, Memory
from kvoffload.worker.teardown import Teardown


class FakeHandler:
    """Records its shutdown; raises ``error`` from it when given one."""

    def __init__(self, name: str, calls: list[str], error: Exception | None = None) -> None:
        self.name = name
        self.direction = Direction.STORE if name == "store" else Direction.LOAD
        self.calls = calls
        self.error = error
        self.thread_stopped = True
        self.timeouts: list[float] = []

    def shutdown(self, timeout: float) -> None:
        self.calls.append(self.name)
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error


class FakeRegion:
    """Records cleanup and abandon; ``cleanup`` raises ``error`` when given one."""

    def __init__(self, calls: list[str], error: Exception | None = None) -> None:
        self.calls = calls
        self.error = error
        self.num_records = 8

    def cleanup(self) -> None:
        self.calls.append("region")
        if self.error is not None:
            raise self.error

    def abandon(self) -> None:
        self.calls.append("abandon")


def make_worker(
    calls: list[str],
    *,
    store_error: Exception | None = None,
    load_error: Exception | None = None,
    sync: Callable[[float], bool] | None = None,
    region_error: Exception | None = None,
) -> tuple[Worker, FakeHandler, FakeHandler]:
    def default_sync(timeout: float) -> bool:
        calls.append("sync")
        return True

    store = FakeHandler("store", calls, store_error)
    load = FakeHandler("load", calls, load_error)
    worker = Worker.__new__(Worker)  # only what the shutdown contract is about
    worker._teardown = Teardown(
        [("store handler", store), ("load handler", load)],
        FakeRegion(calls, region_error),  # type: ignore[arg-type]
        sync if sync is not None else default_sync,
    )
    worker._lock = threading.Lock()
    worker._book = Bookkeeping({Memory.DEVICE: 4, Memory.HOST: 8})
    worker._jobs = JobBook()
    worker._fronts = {}  # no fast front: every call takes the validating path
    worker._closed = False
    worker._closing = threading.Lock()
    worker._torn_down = threading.Event()
    worker._teardown_error = None
    return worker, store, load


def test_shutdown_runs_store_then_load_then_region() -> None:
    calls: list[str] = []
    worker, _, _ = make_worker(calls)
    worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "region"]


def test_store_handler_failure_still_shuts_down_load_syncs_and_cleans_region_once() -> None:
    calls: list[str] = []
    failure = CudaError("cuEventQuery", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "injected")
    worker, _, _ = make_worker(calls, store_error=failure)
    with pytest.raises(ShutdownError) as info:
        worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "sync", "region"]
    assert info.value.failures == (failure,)
    assert not info.value.region_left_mapped


def test_both_handler_failures_are_carried_in_order() -> None:
    calls: list[str] = []
    first, second = RuntimeError("store broke"), RuntimeError("load broke")
    worker, _, _ = make_worker(calls, store_error=first, load_error=second)
    with pytest.raises(ShutdownError) as info:
        worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "sync", "region"]
    assert info.value.failures == (first, second)


def test_fallback_sync_timeout_leaves_region_mapped_and_says_so() -> None:
    calls: list[str] = []

    def sync(timeout: float) -> bool:
        calls.append("sync")
        return False

    worker, _, _ = make_worker(calls, load_error=RuntimeError("load broke"), sync=sync)
    with pytest.raises(ShutdownError) as info:
        worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "sync", "abandon"]
    assert info.value.region_left_mapped
    assert "left mapped" in str(info.value)
    assert len(info.value.failures) == 2  # the handler's failure and the sync timeout


def test_fallback_sync_failure_leaves_region_mapped() -> None:
    calls: list[str] = []
    sync_error = CudaError("cuCtxSynchronize", 999, "CUDA_ERROR_UNKNOWN", "injected")

    def sync(timeout: float) -> bool:
        calls.append("sync")
        raise sync_error

    worker, _, _ = make_worker(calls, store_error=RuntimeError("store broke"), sync=sync)
    with pytest.raises(ShutdownError) as info:
        worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "sync", "abandon"]
    assert info.value.region_left_mapped
    assert sync_error in info.value.failures


def test_running_issuer_thread_means_device_not_idle_even_after_clean_handler_shutdown() -> None:
    calls: list[str] = []
    worker, store, _ = make_worker(calls)
    store.thread_stopped = False  # a copy may still be issued after any synchronize
    with pytest.raises(ShutdownError) as info:
        worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "sync", "abandon"]
    assert info.value.region_left_mapped


def test_region_cleanup_failure_is_raised_after_everything_ran() -> None:
    calls: list[str] = []
    unpin = CudaError("cuMemHostUnregister", 713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "x")
    worker, _, _ = make_worker(
        calls, region_error=ShutdownError("host region cleanup failed", [unpin], region_left_mapped=True)
    )
    with pytest.raises(ShutdownError) as info:
        worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "region"]
    assert info.value.failures == (unpin,)
    assert info.value.region_left_mapped


def test_shutdown_is_idempotent() -> None:
    calls: list[str] = []
    worker, _, _ = make_worker(calls)
    worker.shutdown(timeout=5.0)
    worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "region"]


def test_failed_shutdown_is_not_retried_by_a_second_call() -> None:
    calls: list[str] = []
    worker, _, _ = make_worker(calls, store_error=RuntimeError("store broke"))
    with pytest.raises(ShutdownError):
        worker.shutdown(timeout=5.0)
    worker.shutdown(timeout=5.0)
    assert calls == ["store", "load", "sync", "region"]


class HeldHandler(FakeHandler):
    """A handler whose shutdown (its drain) goes on until ``release`` is set."""

    def __init__(self, name: str, calls: list[str]) -> None:
        super().__init__(name, calls)
        self.entered = threading.Event()
        self.release = threading.Event()

    def shutdown(self, timeout: float) -> None:
        self.entered.set()
        self.release.wait(30.0)
        super().shutdown(timeout)


@pytest.mark.parametrize("second_timeout", [5.0, 0.2])
def test_a_shutdown_while_another_threads_tears_down_waits_for_it_or_says_it_did_not_end(
    second_timeout: float,
) -> None:
    """A second shutdown while the first still drains returns only once the teardown ended (the
    engine may free its cache then), or raises ``ShutdownError`` at its own timeout; it never tears
    down twice (it returned at once while a copy went on: found by a lifecycle fuzz)."""
    calls: list[str] = []
    worker, _, _ = make_worker(calls)
    held = HeldHandler("store", calls)
    worker._teardown = Teardown([("store handler", held)], FakeRegion(calls), lambda _t: True)  # type: ignore[arg-type]
    first = threading.Thread(target=worker.shutdown, args=(30.0,))
    first.start()
    assert held.entered.wait(10.0)
    timer = threading.Timer(0.5, held.release.set)
    timer.start()
    began = time.monotonic()
    try:
        if second_timeout < 0.5:
            with pytest.raises(ShutdownError, match="still tearing it down after 0.2 s") as raised:
                worker.shutdown(second_timeout)
            assert "region" not in calls
            assert raised.value.region_left_mapped  # the copies are not known to have stopped
        else:
            worker.shutdown(second_timeout)
            assert calls == ["store", "region"], "the second call returned before the teardown ended"
            assert time.monotonic() - began >= 0.4
    finally:
        held.release.set()
        first.join(10.0)
        timer.cancel()
    assert calls == ["store", "region"]


def test_a_shutdown_that_waited_for_a_failed_teardown_raises_its_failures() -> None:
    """The first call's teardown left the region mapped: a second call that waited for it raises
    the same failures, region left mapped (it returned normally, so its caller could free memory a
    copy still wrote: found by a review); a call after it ended returns, as ever."""
    calls: list[str] = []
    worker, _, _ = make_worker(calls, store_error=RuntimeError("store broke"), sync=lambda _t: False)
    held = HeldHandler("load", calls)
    store = worker._teardown._parts[0][1]
    worker._teardown = Teardown([("load handler", held), ("store handler", store)],
                                FakeRegion(calls), lambda _t: False)  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def first() -> None:
        try:
            worker.shutdown(30.0)
        except ShutdownError as exc:
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    assert held.entered.wait(10.0)
    threading.Timer(0.3, held.release.set).start()
    with pytest.raises(ShutdownError, match="another thread's shutdown of this worker failed") as raised:
        worker.shutdown(10.0)
    thread.join(10.0)
    assert raised.value.region_left_mapped and "store broke" in str(raised.value)
    assert errors and errors[0].region_left_mapped  # type: ignore[attr-defined]
    worker.shutdown(1.0)  # after it ended: returns


def test_every_call_after_shutdown_raises_closed_error() -> None:
    calls: list[str] = []
    worker, _, _ = make_worker(calls)
    worker.shutdown(timeout=5.0)
    with pytest.raises(ClosedError):
        worker.store(1, [0], [0])
    with pytest.raises(ClosedError):
        worker.load(2, [0], [0])
    with pytest.raises(ClosedError):
        worker.poll()
    with pytest.raises(ClosedError):
        worker.wait([1], timeout=1.0)
    with pytest.raises(ClosedError):
        worker.host_records()


def test_handlers_share_one_deadline() -> None:
    calls: list[str] = []
    worker, store, load = make_worker(calls)
    worker.shutdown(timeout=5.0)
    assert 0 < load.timeouts[0] <= store.timeouts[0] <= 5.0


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf"), 10**400, "5"])
def test_malformed_shutdown_timeout_is_refused_without_side_effects(timeout: object) -> None:
    calls: list[str] = []
    worker, _, _ = make_worker(calls)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        worker.shutdown(timeout=timeout)  # type: ignore[arg-type]
    assert calls == []
    assert not worker.closed


def test_context_manager_keeps_the_body_exception_when_shutdown_also_fails() -> None:
    calls: list[str] = []
    worker, _, _ = make_worker(calls, store_error=RuntimeError("store broke"))
    with pytest.raises(KeyError, match="body"):
        with worker:
            raise KeyError("body")
    assert calls == ["store", "load", "sync", "region"]


def test_bookkeeping_is_dropped_at_shutdown() -> None:
    calls: list[str] = []
    worker, _, _ = make_worker(calls)
    worker._book.add(3, Direction.STORE, np.array([1]), np.array([2]))
    worker.shutdown(timeout=5.0)
    assert worker._book.jobs == {}


def test_a_worker_never_shut_down_warns_when_collected_and_releases_nothing() -> None:
    import gc

    import torch

    from kvoffload import DeviceLayout

    layout = DeviceLayout.from_tensors({"kv": torch.zeros(2, 8, 4, 64, dtype=torch.bfloat16)}, 1)
    w = Worker.create(layout, 4)
    region = w._region
    try:
        with pytest.warns(ResourceWarning, match="Worker was never shut down"):
            w.__del__()
        assert not region.released  # a finalizer never releases: the owner's shutdown does
    finally:
        w.shutdown()
    gc.collect()


def test_an_unclosed_worker_at_interpreter_exit_prints_no_traceback() -> None:
    import subprocess
    import sys

    code = (
        "import torch, kvoffload\n"
        "t = {'kv': torch.zeros(2, 8, 4, 64, dtype=torch.bfloat16)}\n"
        "w = kvoffload.Worker.create(kvoffload.DeviceLayout.from_tensors(t, 1), 4)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
