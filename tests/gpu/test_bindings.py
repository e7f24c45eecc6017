"""Driver bindings on the real driver: capabilities, checked errors with names, host registration,
the legacy default stream refused, the access order of each direction, bounded synchronize."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest
import torch

from kvoffload import CudaError, Direction, InvalidArgumentError, SrcAccessOrder, Worker
from kvoffload.backends.cuda import CudaBackend, DmaPath
from kvoffload.bindings import driver
from kvoffload.bindings.copier import Copier
from kvoffload.backends.native import NativeBackend
from tests.gpu._helpers import TIMEOUT_S, cache, cuda_backend
from tests.gpu.conftest import Figures


def test_capabilities_report_driver_device_and_batch_memcpy(device: torch.device,
                                                            figures: Figures) -> None:
    caps = driver.capabilities(device.index or 0)
    assert caps.driver_version >= 12000
    assert caps.device_name == torch.cuda.get_device_name(device)
    if caps.driver_version >= driver.BATCH_ABI_CUDA_12_8:
        assert caps.batch_memcpy and caps.copy_method is driver.CopyMethod.BATCH_CTYPES
    figures.add("driver / batch ABI / device",
                f"{caps.driver_version} / {caps.batch_abi_version} / {caps.device_name}")


def test_registering_a_range_twice_is_a_named_cuda_error(device: torch.device) -> None:
    pinner = driver.CudaHostPinner(device.index or 0)
    buf = mmap.mmap(-1, 1 << 20)
    array = np.frombuffer(buf, dtype=np.uint8)
    ptr = array.ctypes.data
    pinner.register(ptr, 1 << 20)
    try:
        with pytest.raises(CudaError) as info:
            pinner.register(ptr, 1 << 20)
        assert info.value.call == "cuMemHostRegister"
        assert info.value.name == "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
        assert info.value.code == 712
    finally:
        pinner.unregister(ptr)
    with pytest.raises(CudaError, match="CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"):
        pinner.unregister(ptr)
    del array
    buf.close()


def test_legacy_default_stream_is_refused(device: torch.device) -> None:
    copier = Copier.create(driver.capabilities(device.index or 0))
    empty = np.zeros(1, dtype=np.uint64)
    with pytest.raises(InvalidArgumentError, match="legacy default stream"):
        copier.copy(empty, empty, empty, SrcAccessOrder.STREAM, 0)


class RecordingCopier:
    """Wraps a real copier and records the access order of every call."""

    def __init__(self, inner: Copier) -> None:
        self.inner = inner
        self.path = inner.path
        self.orders: list[SrcAccessOrder] = []

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
             order: SrcAccessOrder, stream: int) -> None:
        self.orders.append(order)
        self.inner.copy(dsts, srcs, sizes, order, stream)


def test_stores_read_in_stream_order_and_loads_may_read_any_time(device: torch.device) -> None:
    layout = cache("per-layer", device, num_blocks=32, layers=2)
    with Worker.create(layout, 8, path="dma", issuer="python") as w:
        recorders = {}
        for handler in (w._store, w._load):
            backend = handler._backend
            assert isinstance(backend, CudaBackend)
            dma = backend.paths["dma"]
            assert isinstance(dma, DmaPath)
            recorders[handler.direction] = RecordingCopier(dma.copier)
            dma.copier = recorders[handler.direction]  # type: ignore[assignment]
        w.store(1, [1], [1])
        w.wait([1], TIMEOUT_S)
        w.load(2, [1], [2])
        w.wait([2], TIMEOUT_S)
    assert recorders[Direction.STORE].orders == [SrcAccessOrder.STREAM]
    assert recorders[Direction.LOAD].orders == [SrcAccessOrder.ANY]


def test_the_native_issuer_copies_with_each_directions_access_order(device: torch.device) -> None:
    layout = cache("per-layer", device, num_blocks=32, layers=2)
    with Worker.create(layout, 8, path="dma", issuer="native") as w:
        for handler, order in ((w._store, SrcAccessOrder.STREAM), (w._load, SrcAccessOrder.ANY)):
            backend = handler._backend
            assert isinstance(backend, NativeBackend)
            dma = cuda_backend(handler).paths["dma"]
            assert isinstance(dma, DmaPath)
            config = backend._keep[0]
            assert config.batch_attrs == dma.copier.attrs_pointer(order)


def test_bounded_synchronize_reports_an_idle_device(device: torch.device) -> None:
    torch.cuda.synchronize(device)
    assert driver.synchronize_device(device.index or 0, 10.0)


def test_pooled_event_is_not_ready_then_done_and_returns_to_its_pool_when_released(device: torch.device) -> None:
    pool = driver.EventPool(device.index or 0, timing=True)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    start, end = driver.Event(pool), driver.Event(pool)
    start.record(stream.cuda_stream)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10**8)  # type: ignore[no-untyped-call]
    end.record(stream.cuda_stream)
    assert not end.done()
    stream.synchronize()
    assert end.done()
    assert start.seconds_until(end) > 0
    handles = {start.handle, end.handle}
    start.release()
    end.release()
    end.release()  # a second release gives nothing back twice
    assert pool.free == 2
    assert driver.Event(pool).handle in handles


def test_events_work_from_a_thread_with_no_current_context(device: torch.device) -> None:
    pool = driver.EventPool(device.index or 0, timing=False)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    outcome: list[object] = []

    def run() -> None:  # a fresh thread: no context is current in it
        try:
            event = driver.Event(pool)
            event.record(stream.cuda_stream)
            outcome.append(event.done() or stream.query())
        except Exception as exc:  # reported below
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert outcome == [True]


def test_each_direction_owns_a_stream_of_its_own_until_shutdown(device: torch.device) -> None:
    layout = cache("per-layer", device, num_blocks=32, layers=2)
    w = Worker.create(layout, 8)
    backends = [cuda_backend(h) for h in (w._store, w._load)]
    handles = {b.streams.copy for b in backends}
    assert len(handles) == 2 and 0 not in handles
    assert torch.cuda.current_stream(device).cuda_stream not in handles
    pool = {torch.cuda.Stream(device).cuda_stream for _ in range(40)}  # type: ignore[no-untyped-call]
    assert not handles & pool  # never one of torch's shared pool streams
    w.shutdown(timeout=TIMEOUT_S)
    assert all(b.streams.copy == 0 for b in backends)
