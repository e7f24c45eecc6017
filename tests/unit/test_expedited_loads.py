"""The expedited load lane (``Worker.create(expedited_loads=True)``, docs/design.md §4): a load the
engine waits for within its step does not queue behind the regular loads.

On the host backend and on native issuers over the fake driver: an expedited load lands (bit-exact,
every page from its record) while a regular load is held inside its copy, where the same load
through the regular lane waits behind it (the control); the two lanes share one bookkeeping, so a
block one lane's load writes is refused to the other's; bad arguments are typed errors that change
nothing; each lane counts its own jobs; shutdown stops both lanes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from kvoffload import (
    ArgumentTypeError, BlockConflictError, ClosedError, DeviceLayout, InvalidArgumentError,
    WaitTimeoutError, Worker,
)
from kvoffload.backends.host import HostBackend
from kvoffload.backends.native import NativeBackend
from kvoffload.handler import BookedHandler, DirectionHandler
from kvoffload.records import Direction
from kvoffload.worker.assembly import (
    EXPEDITED_SM_MAX_BYTES, WorkerOptions, _expedited_options, _slot_bytes, _small_through_sm,
)
from tests.unit._native_fake import COMPUTE, FakeDriver
from tests.unit.test_call_front import BLOCKS, Inner
from tests.unit.test_host_end_to_end import HOST_BLOCKS, small_cache
from tests.unit.test_native_issuer import expected, moved

TIMEOUT_S = 30.0
#: How long a load behind a held one is given to show that it waits (the control).
HELD_S = 0.3


class _Held(HostBackend):
    """A host backend whose copies wait for ``gate`` once ``hold`` is set."""

    def __init__(self, direction: Direction) -> None:
        super().__init__(direction)
        self.hold = False
        self.gate = threading.Event()
        self.entered = threading.Event()

    def copy_one(self, dst: int, src: int, size: int) -> None:
        if self.hold:
            self.entered.set()
            self.gate.wait(TIMEOUT_S)
        super().copy_one(dst, src, size)


def _host_worker(backends: list[_Held], *, expedited_loads: bool = True) -> Worker:
    def factory(direction: Direction) -> _Held:
        backends.append(_Held(direction))
        return backends[-1]

    return Worker.create(small_cache("per-layer"), HOST_BLOCKS, backend_factory=factory,
                         expedited_loads=expedited_loads)


def _i(*values: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.array(values, dtype=np.int64)


def _fill(w: Worker) -> torch.Tensor:
    """Store device blocks 0..HOST_BLOCKS-1 into the same host records; returns their bytes."""
    ids = np.arange(HOST_BLOCKS, dtype=np.int64)
    w.store(100, ids, ids)
    assert all(r.ok for r in w.wait([100], TIMEOUT_S))
    return w.layout.gather_records(ids)


@pytest.mark.parametrize("ids", ["numpy", "list"])
def test_an_expedited_load_lands_while_a_regular_load_is_held(ids: str) -> None:
    backends: list[_Held] = []
    w = _host_worker(backends)
    regular = backends[1]
    try:
        assert [b.direction for b in backends] == [Direction.STORE, Direction.LOAD, Direction.LOAD]
        records = _fill(w)
        w.load(1, _i(0, 1), _i(0, 1))
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
        regular.hold = True
        w.load(2, _i(2, 3, 4), _i(12, 13, 14))  # held inside its copy
        assert regular.entered.wait(TIMEOUT_S)
        host, device = (_i(5, 6), _i(7, 8)) if ids == "numpy" else ([5, 6], [7, 8])
        w.load(3, host, device, expedited=True)
        (result,) = w.wait([3], TIMEOUT_S)
        assert result.ok and result.direction is Direction.LOAD
        assert torch.equal(w.layout.gather_records(_i(7, 8)), records[[5, 6]])
        assert [r.job_id for r in w.poll()] == []  # the regular load is still held
        regular.gate.set()
        assert all(r.ok for r in w.wait([2], TIMEOUT_S))
        assert torch.equal(w.layout.gather_records(_i(12, 13, 14)), records[[2, 3, 4]])
        stats = w.stats()
        assert stats.expedited is not None
        assert (stats.load.completed, stats.expedited.completed) == (2, 1)
    finally:
        regular.gate.set()
        w.shutdown(TIMEOUT_S)


def test_control_a_load_through_the_regular_lane_waits_behind_a_held_one() -> None:
    """The hazard the lane removes: the same load, not expedited, is not done while the one before
    it is held."""
    backends: list[_Held] = []
    w = _host_worker(backends)
    regular = backends[1]
    try:
        regular.hold = True
        w.load(2, _i(2, 3, 4), _i(2, 3, 4))
        assert regular.entered.wait(TIMEOUT_S)
        regular.hold = False
        w.load(3, _i(5, 6), _i(7, 8))
        with pytest.raises(WaitTimeoutError):
            w.wait([3], HELD_S)
        regular.gate.set()
        assert all(r.ok for r in w.wait([2, 3], TIMEOUT_S))
    finally:
        regular.gate.set()
        w.shutdown(TIMEOUT_S)


def test_the_lanes_share_the_bookkeeping() -> None:
    """A device block a held regular load writes is refused to an expedited load and to a store,
    and a host record an expedited load reads is refused to a store (BlockConflictError, nothing
    changed); once the load is back the same jobs go through."""
    backends: list[_Held] = []
    w = _host_worker(backends)
    regular, expedited = backends[1], backends[2]
    try:
        regular.hold = True
        w.load(1, _i(0, 1), _i(4, 5))
        assert regular.entered.wait(TIMEOUT_S)
        with pytest.raises(BlockConflictError, match="device"):
            w.load(2, _i(2), _i(5), expedited=True)
        with pytest.raises(BlockConflictError, match="device"):
            w.store(2, _i(4), _i(9))
        expedited.hold = True
        w.load(3, _i(6), _i(6), expedited=True)
        assert expedited.entered.wait(TIMEOUT_S)
        with pytest.raises(BlockConflictError, match="host"):
            w.store(4, _i(10), _i(6))
        with pytest.raises(BlockConflictError, match="device"):
            w.load(4, _i(7), _i(6))
        regular.gate.set()
        expedited.gate.set()
        assert all(r.ok for r in w.wait([1, 3], TIMEOUT_S))
        w.load(2, _i(2), _i(5), expedited=True)
        w.store(4, _i(10), _i(6))
        assert all(r.ok for r in w.wait([2, 4], TIMEOUT_S))
    finally:
        regular.gate.set()
        expedited.gate.set()
        w.shutdown(TIMEOUT_S)


def test_bad_expedited_arguments_are_typed_errors_that_change_nothing() -> None:
    with pytest.raises(ArgumentTypeError, match="expedited_loads = 1 must be a bool"):
        Worker.create(small_cache("per-layer"), HOST_BLOCKS, expedited_loads=1)  # type: ignore[arg-type]
    backends: list[_Held] = []
    with _host_worker(backends, expedited_loads=False) as w:
        assert len(backends) == 2 and w.stats().expedited is None
        for call in ("load", "load_by_layer"):
            with pytest.raises(InvalidArgumentError, match="expedited_loads=True"):
                getattr(w, call)(1, _i(0), _i(0), expedited=True)
        w.load(1, _i(0), _i(0))  # the id is free: nothing was booked
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
    with _host_worker([]) as w:
        for value in (1, "yes", None):
            with pytest.raises(ArgumentTypeError, match="expedited = .* must be a bool"):
                w.load(1, _i(0), _i(0), expedited=value)  # type: ignore[arg-type]
        w.load(1, _i(0), _i(0), expedited=True)
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))


def test_an_expedited_layered_load_lands_layer_by_layer_beside_a_held_load() -> None:
    backends: list[_Held] = []
    w = _host_worker(backends)
    regular = backends[1]
    try:
        records = _fill(w)
        regular.hold = True
        w.load(1, _i(0), _i(0))
        assert regular.entered.wait(TIMEOUT_S)
        layered = w.load_by_layer(2, _i(3, 4), _i(5, 6), expedited=True)
        for layer in range(len(w.layout.require_layers())):
            layered.wait_layer(layer)
        assert all(r.ok for r in w.wait([2], TIMEOUT_S))
        assert torch.equal(w.layout.gather_records(_i(5, 6)), records[[3, 4]])
        regular.gate.set()
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
    finally:
        regular.gate.set()
        w.shutdown(TIMEOUT_S)


def test_the_expedited_lanes_staging_ring_is_a_quarter_where_its_slots_still_hold_a_record() -> None:
    options = WorkerOptions(expedited_loads=True, expedited_path="staged")  # a lane's 128 MiB: 2 x 64 MiB
    small = _layout_of_records(1 << 20)
    assert _expedited_options(options, small, True).staging_bytes == options.staging_bytes // 4
    assert _slot_bytes(_expedited_options(options, small, True)) == 16 << 20
    big = _layout_of_records(20 << 20)  # a 20 MiB record fits a 64 MiB slot, not a 16 MiB one
    assert _expedited_options(options, big, True).staging_bytes == options.staging_bytes


def test_the_expedited_lane_takes_its_small_loads_through_sm_where_the_pool_is_mapped() -> None:
    layout = _layout_of_records(1 << 20)
    staged = WorkerOptions(path="staged", kernel_ctas=100, expedited_loads=True)
    lane = _expedited_options(staged, layout, True)
    assert (lane.path, lane.kernel_ctas, lane.lane_sm_bytes) == ("staged", 100, EXPEDITED_SM_MAX_BYTES)
    lane = _expedited_options(staged, layout, False)  # no UVA: the worker's path for every load
    assert (lane.path, lane.kernel_ctas, lane.lane_sm_bytes) == ("staged", 100, 0)
    for named in ("dma", "staged", "auto", "sm"):  # a path named: that path for every load
        told = attrs.evolve(staged, expedited_path=named)
        for mapped in (True, False):
            lane = _expedited_options(told, layout, mapped)
            assert (lane.path, lane.lane_sm_bytes) == (named, 0)
            assert lane.kernel_ctas == (100 if named == "staged" else None)  # CTAs of the worker's path
    assert (staged.path, staged.lane_sm_bytes) == ("staged", 0)  # the regular lanes' options untouched
    # the lane's auto shares the regular lanes' calibration, timed with their options (full ring)
    assert _expedited_options(attrs.evolve(staged, expedited_path="auto"), layout, True).regular is not None
    assert all(_expedited_options(o, layout, True).regular == o
               for o in (staged, attrs.evolve(staged, expedited_path="auto")))


def test_the_lanes_chooser_sends_small_jobs_through_sm_and_larger_ones_to_the_bulk_choice() -> None:
    choose = _small_through_sm(4, lambda blocks: "dma" if blocks < 16 else "staged")
    assert [choose(n) for n in (1, 4, 5, 15, 16)] == ["sm", "sm", "dma", "dma", "staged"]


def test_bad_expedited_paths_are_typed_errors_before_anything_is_built() -> None:
    cache = small_cache("per-layer")
    bad: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"expedited_loads": True, "expedited_path": 1}, ArgumentTypeError,
         "expedited_path = 1 must be a str or None, not a int"),
        ({"expedited_loads": True, "expedited_path": "fast"}, InvalidArgumentError,
         "expedited_path = 'fast' must be one of auto, dma, staged, sm or None"),
        ({"expedited_path": "sm"}, InvalidArgumentError,
         "expedited_path = 'sm' names the expedited lane's path: create the worker with expedited_loads=True"),
        ({"expedited_loads": True, "expedited_path": "sm"}, InvalidArgumentError,
         "expedited_path = 'sm' applies to the cuda backend only \\(backend is 'host'\\)"),
    ]
    bad.append(({"expedited_loads": True, "expedited_path": "auto", "backend_factory": HostBackend},
                InvalidArgumentError, "expedited_path = 'auto' names a path of the library's cuda backend; the "
                "backend_factory's backends move the lane's loads"))
    threads = set(threading.enumerate())
    for kwargs, kind, message in bad:
        with pytest.raises(kind, match=f"^{message}$"):
            Worker.create(cache, HOST_BLOCKS, **kwargs)  # type: ignore[arg-type]
    assert set(threading.enumerate()) == threads, "a refused create left a thread running"
    with Worker.create(cache, HOST_BLOCKS, expedited_loads=True, expedited_path="auto") as w:
        assert w.expedited_loads
        w.load(1, _i(0), _i(0), expedited=True)
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))

def _layout_of_records(record_bytes: int) -> DeviceLayout:
    """A CPU layout of 2 blocks whose host record is ``record_bytes`` (a multiple of 4 KiB)."""
    return DeviceLayout.from_tensors([torch.zeros(2, record_bytes, dtype=torch.uint8)], block_dim=0)


def test_shutdown_finishes_both_lanes_and_stops_their_threads() -> None:
    before = set(threading.enumerate())
    w = _host_worker([])
    assert len([t for t in threading.enumerate() if t not in before and t.name == "kvoffload-load"]) == 2
    for j in range(8):
        w.load(j, _i(j), _i(j), expedited=bool(j % 2))
    w.shutdown(TIMEOUT_S)
    assert w.closed
    with pytest.raises(ClosedError):
        w.load(9, _i(9), _i(9), expedited=True)
    for call in ("load", "load_by_layer"):  # a bad value too: every call after shutdown is closed
        with pytest.raises(ClosedError):
            getattr(w, call)(9, _i(9), _i(9), expedited="yes")
    without = _host_worker([], expedited_loads=False)
    without.shutdown(TIMEOUT_S)
    with pytest.raises(ClosedError):
        without.load(9, _i(9), _i(9), expedited=True)
    assert not [t for t in threading.enumerate() if t not in before and t.name.startswith("kvoffload")]


# ------------------------------------------------------------------ native issuers, fake driver


@pytest.fixture(params=[None, 1], ids=["one-layer", "four-layers"])
def native_lanes(request: pytest.FixtureRequest) -> Iterator[tuple[Worker, list[FakeDriver]]]:
    """A worker whose three lanes are native issuers, each over a fake driver of its own (so that
    one lane's copies can be held), with every job issued by the issuer thread; its cache tensor's
    four rows of a page are one layer or four."""
    keep: list[object] = []
    fakes: list[FakeDriver] = []

    def factory(direction: Direction) -> Any:
        fake = FakeDriver()
        fakes.append(fake)
        config = fake.config(store=direction is Direction.STORE, keep=keep, caller_issue_max=0)
        return NativeBackend.start(Inner(direction), config, index=0, choose=lambda _n: "dma",
                                   path_names={"dma": "dma"}, tables=None, keep=keep)

    layout = DeviceLayout.from_tensors([torch.zeros(BLOCKS, 4, 64, dtype=torch.uint8)], block_dim=0,
                                       layer_dim=request.param)
    w = Worker.create(layout, BLOCKS, backend_factory=factory, expedited_loads=True)
    try:
        yield w, fakes
    finally:
        for fake in fakes:
            for gate in fake.gate.values():
                gate.set()
        w.shutdown(TIMEOUT_S)
        keep.clear()


@pytest.mark.parametrize("expedite", [True, False], ids=["expedited", "control-regular-lane"])
def test_native_an_expedited_load_is_issued_and_lands_while_the_regular_lane_is_held(
    native_lanes: tuple[Worker, list[FakeDriver]], expedite: bool,
) -> None:
    """The regular lane's thread is held inside its job's copy; an expedited load (through the
    fast front) is issued by its own thread and comes back with every page from its record. The
    control sends the same load through the regular lane: it is not done while the lane is held."""
    w, fakes = native_lanes
    assert w._expedited_front is not None  # noqa: SLF001 - the expedited lane has a fast front
    gate, entered = threading.Event(), threading.Event()
    fakes[1].gate["cuMemcpyBatchAsync"] = gate
    fakes[1].entered["cuMemcpyBatchAsync"] = entered
    w.load(1, _i(0, 1), _i(0, 1))
    assert entered.wait(TIMEOUT_S)
    w.load(2, _i(4, 5, 6), _i(8, 9, 10), expedited=expedite)
    try:
        if expedite:
            (result,) = w.wait([2], TIMEOUT_S)
            assert result.ok, result.error
            plan = w._expedited._plan  # type: ignore[union-attr]  # noqa: SLF001
            assert moved(fakes[2], expected(plan, [8, 9, 10], [4, 5, 6])) == 0
            assert [r.job_id for r in w.poll()] == []  # the regular load is still held
        else:
            with pytest.raises(WaitTimeoutError):
                w.wait([2], HELD_S)
    finally:
        gate.set()
    assert all(r.ok for r in w.wait([1] if expedite else [1, 2], TIMEOUT_S))


@pytest.mark.parametrize("ids", ["numpy", "list"])
def test_native_an_expedited_layered_load_lands_layer_by_layer_while_the_regular_lane_is_held(
    native_lanes: tuple[Worker, list[FakeDriver]], ids: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``load_by_layer(..., expedited=True)``, through the fast front (numpy ids) and the validating
    path (lists), is issued by the expedited lane's thread: each layer's wait is enqueued on an
    event of that lane's driver and every page comes from its record while the regular lane is
    held; the regular lane's handler sees no layered job."""
    w, fakes = native_lanes
    regular_layered: list[object] = []
    for cls, name in ((BookedHandler, "submit_handed_off_layered"), (DirectionHandler, "submit_layered")):
        call = getattr(cls, name)

        def counted(self: DirectionHandler, *args: Any, _call: Any = call, **kwargs: Any) -> Any:
            if self is w._load:  # noqa: SLF001
                regular_layered.append(args)
            return _call(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    gate, entered = threading.Event(), threading.Event()
    fakes[1].gate["cuMemcpyBatchAsync"] = gate
    fakes[1].entered["cuMemcpyBatchAsync"] = entered
    w.load(1, _i(0, 1), _i(0, 1))
    assert entered.wait(TIMEOUT_S)
    try:
        host, device = ((_i(4, 5, 6), _i(8, 9, 10)) if ids == "numpy" else ([4, 5, 6], [8, 9, 10]))
        fakes[2].not_ready = 1 << 40  # in flight until the waits are enqueued (a done job's are not)
        layered = w.load_by_layer(2, host, device, stream=COMPUTE + 3, expedited=True)
        for layer in range(layered.num_layers):
            layered.wait_layer(layer, stream=COMPUTE + 5)
        fakes[2].not_ready = 0
        (result,) = w.wait([2], TIMEOUT_S)
        assert result.ok, result.error
        plan = w._expedited._plan  # type: ignore[union-attr]  # noqa: SLF001
        assert moved(fakes[2], expected(plan, [8, 9, 10], [4, 5, 6])) == 0
        waits = [c for c in fakes[2].snapshot() if c[0] == "cuStreamWaitEvent" and c[1] == COMPUTE + 5]
        assert len(waits) == layered.num_layers
        assert not regular_layered
        assert [r.job_id for r in w.poll()] == []  # the regular load is still held
    finally:
        gate.set()
    assert all(r.ok for r in w.wait([1], TIMEOUT_S))


class _Created:
    """What ``CudaBackend.create`` was called with (in place of a CUDA backend)."""

    def __init__(self, direction: Direction, device: torch.device, make_paths: object, *,
                 choose: Any = None, kernel_stream: bool = False, path_name: str | None = None,
                 layered: Any = None) -> None:
        self.direction = direction
        self.choose, self.kernel_stream, self.path_name = choose, kernel_stream, path_name
        self.layered = layered


@pytest.mark.parametrize("path", ["dma", "staged", "auto"])
@pytest.mark.parametrize("mapped", [True, False])
def test_the_lanes_cuda_backend_sends_loads_of_up_to_8_mib_through_sm(
    monkeypatch: pytest.MonkeyPatch, path: str, mapped: bool,
) -> None:
    """``_cuda_backend`` composed for the lane (CUDA's calls replaced): with the pool mapped, jobs of
    up to 8 MiB of 512 KiB records (16 blocks) go through ``sm`` and larger ones through the
    worker's path (auto: the calibrated choice); unmapped, every job through the worker's path.
    The regular lanes' options give no ``sm`` route."""
    from kvoffload import calibration
    from kvoffload.backends.cuda import CudaBackend
    from kvoffload.bindings import driver
    from kvoffload.worker import assembly

    monkeypatch.setattr(CudaBackend, "create", _Created)
    monkeypatch.setattr(driver, "host_pointer_is_device_pointer", lambda index, ptr: mapped)
    timed_with: list[object] = []

    layers_given: list[object] = []

    class Choice:
        def chooser(self, direction: Direction) -> Any:
            return lambda blocks: "dma" if blocks < 32 else "staged"

        def layered(self) -> dict[str, tuple[float, ...]]:  # staged from records apart beat sm
            return {"dma": (1.0,), "staged": (9.0,), "sm": (5.0,)}

    def calibrate(device: object, pages: object, **kwargs: Any) -> Choice:
        timed_with.append(kwargs["handler_for"].args[1])  # the options calibration times paths with
        layers_given.append(kwargs["layers"])
        return Choice()

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    layout = _layout_of_records(512 << 10)
    cuda: Any = type("FakeCuda", (), {"index": 0, "copier": type("C", (), {"path": "dma"})(),
                                      "capabilities": type("K", (), {"device_name": "fake"})()})()
    region: Any = type("FakeRegion", (), {"base_ptr": 1 << 20})()
    options = WorkerOptions(path=path, expedited_loads=True)
    lane = _expedited_options(options, layout, mapped)
    built: Any = assembly._cuda_backend(Direction.LOAD, layout, region, cuda, lane, "python")
    def bulk(blocks: int) -> str:
        return path if path != "auto" else ("dma" if blocks < 32 else "staged")

    expected = [("sm" if mapped and n <= 16 else bulk(n)) for n in (1, 16, 17, 31, 32)]
    choose = built.choose or (lambda n: path)
    assert [choose(n) for n in (1, 16, 17, 31, 32)] == expected
    assert built.kernel_stream == (path != "dma" or mapped)
    assert built.path_name == ("auto" if path == "auto" else path)  # results name each job's path
    assert all(o is options for o in timed_with)  # the lane's auto is timed with the regular options
    regular: Any = assembly._cuda_backend(Direction.LOAD, layout, region, cuda, options, "python")
    regular_choose = regular.choose or (lambda n: path)
    assert [regular_choose(n) for n in (1, 16, 17, 31, 32)] == [bulk(n) for n in (1, 16, 17, 31, 32)]
    # auto's layered loads get their own choice where sm is a path (the pool mapped), over the
    # jobs' size choice (the lane's included); a fixed path's never
    for made in (built, regular):
        assert (made.layered is not None) == (path == "auto" and mapped)
        if made.layered is not None:
            assert made.layered.__self__._size_choice is made.choose  # noqa: SLF001
            assert made.layered.__self__.keeps == {"staged"}  # the calibration's layered figures
    assert all(given is layout.layer_tables for given in layers_given)
    stores: Any = assembly._cuda_backend(Direction.STORE, layout, region, cuda, options, "python")
    assert stores.layered is None  # a layered job is a load
