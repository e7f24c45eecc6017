"""The worker's fast front and the library's call front, on CPU (native issuers over the fake
driver of :mod:`tests.unit._native_fake`):

* ``store``/``load`` of numpy ``int64`` ids go through the fast front, anything else through the
  validating path, with the same results;
* every bad job the front sees is declined, and the validating path raises exactly what it raises
  with no front, leaving the worker unchanged;
* the call front (a CPython extension) admits, refuses and counts as the ctypes call does, refuses
  arrays it cannot read, and without Python's headers the library is called through ctypes, with
  the same results.
"""

from __future__ import annotations

import ctypes
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import (
    ClosedError, CudaError, DeviceLayout, DeviceMismatchError, JobIdError, NativeBuildError, ShutdownError,
    WaitTimeoutError, Worker, native,
)
from kvoffload.backends.native import NativeBackend, NativeLayerMarks
from kvoffload.handler import BookedHandler, DirectionHandler
from kvoffload.records import Direction, TransferResult
from kvoffload.worker.booking import Bookkeeping, Memory
from tests.unit._native_fake import COMPUTE, FakeDriver, wait_until
from tests.unit._threads import run_at_once
from tests.unit.test_native_issuer import expected, moved

I64 = npt.NDArray[np.int64]
BLOCKS = 16
TIMEOUT_S = 30.0


class Inner:
    """What a native backend takes over, on CPU: streams are ints; anything else is refused as the
    CUDA backend refuses a stream that is not one of its device's."""

    path = "auto"

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.device = torch.device("cpu")

    def stream_handle(self, stream: object | None) -> int:
        if stream is None:
            return COMPUTE
        if type(stream) is not int:
            raise DeviceMismatchError(f"stream must be a stream of the device, got {stream!r}")
        return stream

    def release(self) -> None:
        pass


def make_worker(keep: list[object], *, call_front: bool = True, tune: dict[str, int] | None = None,
                layer_dim: int | None = None) -> Worker:
    """A worker whose two directions are native issuers over one fake driver (``call_front``
    False: the library is called through ctypes; ``tune``: config fields to set; ``layer_dim=1``:
    the cache tensor's four rows of a page are four layers, else the tensor is one)."""
    fake = FakeDriver()
    keep.append(fake)

    def factory(direction: Direction) -> Any:
        config = fake.config(store=direction is Direction.STORE, keep=keep)
        for name, value in (tune or {}).items():
            setattr(config, name, value)
        backend = NativeBackend.start(Inner(direction), config, index=0, choose=lambda _n: "dma",
                                      path_names={"dma": "dma"}, tables=None, keep=keep)
        if not call_front:
            backend._front_hand_off = None  # noqa: SLF001 - the ctypes calls, on purpose
            backend._front_calls = None  # noqa: SLF001
            backend._front = None  # noqa: SLF001 - the book's calls too
        return backend

    layout = DeviceLayout.from_tensors([torch.zeros(BLOCKS, 4, 64, dtype=torch.uint8)], block_dim=0,
                                       layer_dim=layer_dim)
    worker = Worker.create(layout, BLOCKS, backend_factory=factory)
    if not call_front:
        worker._book._front = None  # noqa: SLF001
    return worker


@pytest.fixture
def worker() -> Iterator[Worker]:
    keep: list[object] = []
    w = make_worker(keep)
    try:
        yield w
    finally:
        w.shutdown(TIMEOUT_S)


def doors(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the jobs each door hands to the handlers (a layered load's door counts as its
    whole-job door's)."""
    counts = {"front": 0, "validating": 0}

    def counted(name: str, door: str) -> None:
        for cls in (DirectionHandler, BookedHandler):  # each class's own door
            if name not in vars(cls):
                continue
            call = vars(cls)[name]

            def via(self: DirectionHandler, *args: Any, _call: Any = call, **kwargs: Any) -> Any:
                counts[door] += 1  # (an override does not call the base class's door)
                return _call(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, via)

    counted("submit_handed_off", "front")
    counted("submit_handed_off_layered", "front")
    counted("submit_validated", "validating")
    counted("submit_layered", "validating")
    return counts


def test_the_worker_reports_where_its_callers_waited_in_the_driver_per_native_direction() -> None:
    """Each job's fence is recorded by its caller in the hand-off: one caller's call per job; after
    shutdown the call raises ClosedError. A worker without the native issuer reports
    nothing."""
    keep: list[object] = []
    w = make_worker(keep)
    try:
        ids = np.arange(4, dtype=np.int64)
        w.store(1, ids, ids + 4)
        w.store(2, [8, 9], [12, 13])  # the validating path records its fence in the hand-off too
        w.load(3, ids + 8, ids + 4)
        assert all(r.ok for r in w.wait([1, 2, 3], TIMEOUT_S))
        stats = w.driver_call_stats()
        assert set(stats) == {Direction.STORE, Direction.LOAD}
        assert (stats[Direction.STORE].caller_calls, stats[Direction.LOAD].caller_calls) == (2, 1)
        assert set(stats[Direction.LOAD].longest_ns) == {"record", "wait", "copy", "launch", "query"}
    finally:
        w.shutdown(TIMEOUT_S)
    with pytest.raises(ClosedError):
        w.driver_call_stats()
    layout = DeviceLayout.from_tensors([torch.zeros(BLOCKS, 4, 64, dtype=torch.uint8)], block_dim=0)
    with Worker.create(layout, BLOCKS, backend="host") as host:
        assert host.driver_call_stats() == {}


def test_numpy_jobs_take_the_front_and_other_ids_the_validating_path(
    worker: Worker, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert set(worker._fronts) == {Direction.STORE, Direction.LOAD}  # noqa: SLF001
    counts = doors(monkeypatch)
    ids = np.arange(4, dtype=np.int64)
    worker.store(1, ids, ids + 4)
    worker.load(2, ids + 8, ids + 4)
    assert counts == {"front": 2, "validating": 0}
    worker.store(3, [8, 9], [12, 13])  # a list
    worker.store(4, torch.tensor([10, 11]), np.array([14, 15], dtype=np.int32))  # a tensor, int32
    worker.store(np.int64(5), np.array([12], dtype=np.int64), np.array([1], dtype=np.int64))  # numpy id
    worker.load(6, np.array([], dtype=np.int64), np.array([], dtype=np.int64))  # empty
    assert counts == {"front": 2, "validating": 4}
    results = {r.job_id: r for r in worker.wait([1, 2, 3, 4, 5, 6], TIMEOUT_S)}
    assert all(r.ok for r in results.values())
    assert [results[j].direction for j in (1, 2, 3, 4, 5, 6)] == [
        Direction.STORE, Direction.LOAD, Direction.STORE, Direction.STORE, Direction.STORE,
        Direction.LOAD]
    assert results[1].nbytes == results[2].nbytes == 4 * 4 * 64
    assert results[3].nbytes == 2 * 4 * 64 and results[6].nbytes == 0


def _state(w: Worker) -> tuple[Any, ...]:
    book = w._book  # noqa: SLF001
    counts = tuple(a.tobytes() for m in (Memory.DEVICE, Memory.HOST)
                   for a in (book.reads[m], book.writes[m]))
    return (counts, sorted(book.jobs), sorted(w._jobs._open))  # noqa: SLF001


def _outcome(w: Worker, call: str, args: tuple[object, ...], stream: object) -> str:
    before = _state(w)
    try:
        getattr(w, call)(*args, stream=stream)
    except Exception as exc:  # the outcome compared between the two doors
        assert _state(w) == before, "a refused job changed the worker"
        return f"{type(exc).__name__}: {exc}"
    return "submitted"


def _i(*values: int) -> I64:
    return np.array(values, dtype=np.int64)


#: (call, args, stream): jobs the front sees and must leave to the validating path's error.
BAD_JOBS: list[tuple[str, tuple[object, ...], object]] = [
    ("store", (10, _i(0, 16), _i(0, 1)), None),                    # a device id out of range
    ("store", (10, _i(0, 1), _i(0, -1)), None),                    # a negative host id
    ("load", (10, _i(0, 1), _i(3, 3)), None),                      # a device block twice
    ("store", (10, _i(0, 1), _i(2, 2)), None),                     # a host block twice
    ("store", (10, _i(0, 1, 2), _i(0, 1)), None),                  # unequal lengths
    ("store", (10, np.array([1 << 63], dtype=np.uint64), _i(0)), None),  # uint64 past int64
    ("store", (10, _i(0), _i(0)), "not a stream"),                 # a bad stream
    ("store", (10, _i(0, 16), _i(0, 1)), "not a stream"),          # bad ids before a bad stream
    ("store", (True, _i(0), _i(0)), None),                         # a bool job id
    ("store", (1.0, _i(0), _i(0)), None),                          # a float job id
    ("store", (10, np.array([0.0, 1.0]), _i(0, 1)), None),         # float ids
    ("store", (10, np.zeros((2, 1), dtype=np.int64), _i(0, 1)), None),  # 2-D ids
    ("store", (7, _i(5), _i(5)), None),                            # a job id in flight
    ("load", (10, _i(6), _i(4)), None),                            # a device block a store reads
    ("store", (10, _i(8), _i(6)), None),                           # a host record a store writes
    ("load", (10, _i(6), _i(9)), None),                            # a record being written
]


#: BAD_JOBS' loads again, layer by layer.
BAD_LAYERED = [("load_by_layer", args, stream) for call, args, stream in BAD_JOBS if call == "load"]


@pytest.mark.parametrize("case", range(len(BAD_JOBS) + len(BAD_LAYERED)))
def test_a_bad_job_raises_through_the_front_as_without_it_and_changes_nothing(case: int) -> None:
    call, args, stream = (BAD_JOBS + BAD_LAYERED)[case]
    outcomes = []
    for front in (True, False):
        keep: list[object] = []
        w = make_worker(keep, layer_dim=1)
        try:
            if not front:
                w._fronts = {}  # noqa: SLF001 - the validating path alone
            w.store(7, _i(4), _i(6), stream=None)  # in flight: device 4 read, host 6 written
            w.load(8, _i(7), _i(5), stream=None)   # in flight: host 7 read, device 5 written
            outcomes.append(_outcome(w, call, args, stream))
            w.wait([7, 8], TIMEOUT_S)
        finally:
            w.shutdown(TIMEOUT_S)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0] != "submitted"


@pytest.mark.parametrize("call_front", [True, False], ids=["call front", "ctypes"])
def test_a_numpy_layered_load_takes_the_front_and_lands_every_layer_where_it_belongs(
    call_front: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the front as through the validating path: the fence recorded on the caller's stream
    in the hand-off, every page from its record, and each layer's wait on the device for an event
    the issue recorded after that layer's copies (the control: the same load with list ids)."""
    counts = doors(monkeypatch)
    keep: list[object] = []
    w = make_worker(keep, call_front=call_front, layer_dim=1)
    fake = keep[0]
    assert isinstance(fake, FakeDriver)
    try:
        assert w.layout.num_layers == 4
        plan = w._load._plan  # noqa: SLF001 - the whole job's pages, for the expected bytes
        for job, (host, device) in enumerate((([3, 9, 4], [7, 1, 12]), ([5, 0], [2, 14]))):
            ids: Any = (_i(*host), _i(*device)) if job == 0 else (host, device)
            fake.not_ready = 1 << 40  # in flight until the waits are enqueued (a done job's are not)
            load = w.load_by_layer(job, *ids, stream=COMPUTE + 3)
            assert load.num_layers == 4
            for layer in (0, 3, 1, 2):
                load.wait_layer(layer, stream=COMPUTE + 5)
            fake.not_ready = 0
            (result,) = w.wait([job], TIMEOUT_S)
            assert result.ok, result.error
            assert moved(fake, expected(plan, device, host)) == 0
        assert counts == {"front": 1, "validating": 1}
        calls = fake.snapshot()
        fences = [c for c in calls if c[0] == "cuEventRecord" and c[2] == COMPUTE + 3]
        assert len(fences) == 2  # each job's, in its hand-off
        waits = [(k, c[2]) for k, c in enumerate(calls) if c[0] == "cuStreamWaitEvent" and c[1] == COMPUTE + 5]
        assert len(waits) == 8 and len({e for _, e in waits[:4]}) == 4
        for k, event in waits:  # each layer's event was recorded before the wait, after copies
            recorded = [i for i, c in enumerate(calls[:k]) if c[0] == "cuEventRecord" and c[1] == event]
            assert recorded and any(c[0] in ("cuMemcpyBatchAsync", "cuMemcpyAsync")
                                    for c in calls[:recorded[-1]])
        assert not w._book.jobs  # noqa: SLF001
    finally:
        w.shutdown(TIMEOUT_S)
    assert fake.events_destroyed == fake.events_created


def test_a_layered_hand_off_that_raises_is_the_jobs_failed_result_and_its_layers_wait_no_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keep: list[object] = []
    w = make_worker(keep, layer_dim=1)
    try:
        def refuse(*_args: object) -> Any:
            raise RuntimeError("boom")

        backend = w._load._backend  # noqa: SLF001
        monkeypatch.setattr(backend, "booked_hand_off_call", lambda _plans, whole: refuse)
        load = w.load_by_layer(1, _i(3, 4), _i(3, 4))
        started = time.monotonic()
        load.wait_layer(2, stream=COMPUTE, timeout=TIMEOUT_S)  # settled: returns, nothing to wait for
        assert time.monotonic() - started < TIMEOUT_S / 2
        (result,) = w.wait([1], TIMEOUT_S)
        assert not result.ok and isinstance(result.error, RuntimeError)
        monkeypatch.undo()
        handler = w._load  # noqa: SLF001
        assert isinstance(handler, BookedHandler)
        handler._booked_layered.clear()  # noqa: SLF001 - bound again, to the backend's call
        w.load_by_layer(2, _i(3, 4), _i(3, 4)).wait_layer(3, stream=COMPUTE)
        assert w.wait([2], TIMEOUT_S)[0].ok
        assert not w._book.jobs  # noqa: SLF001
    finally:
        w.shutdown(TIMEOUT_S)


def blocked_on(marks: NativeLayerMarks) -> int:
    """Waits blocked on the marks' condition (0 while none was made)."""
    cond: Any = marks._cond  # noqa: SLF001
    return 0 if cond is None else len(cond._waiters)


@pytest.mark.parametrize("handed_over", [True, False], ids=["handed over", "hand-off raised"])
def test_a_layer_waited_for_before_the_hand_off_returned_waits_for_it(
    handed_over: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The marks' condition is made by the first wait that must block: a wait that comes before the
    hand-off (another thread holding the marks) blocks until the hand-off attached the job (its
    ``attach`` wakes it: the handler's ``settle`` is held back here), then enqueues its stream wait
    on the layer's event; one whose hand-off raised returns False once the handler's ``settle``
    woke it; one that nothing wakes ends with ``WaitTimeoutError``. The waiter's own timeout is far
    longer than the test's join, so only a wake-up ends it in time (a predicate checked at the
    timeout would say the same, later)."""
    keep: list[object] = []
    w = make_worker(keep, layer_dim=1)
    fake = keep[0]
    assert isinstance(fake, FakeDriver)
    backend = w._load._backend  # noqa: SLF001
    assert isinstance(backend, NativeBackend)
    made: list[NativeLayerMarks] = []
    waiters: list[threading.Thread] = []
    waited: list[object] = []

    def wait_early(count: int) -> NativeLayerMarks:
        marks = NativeLayerMarks(backend, count)
        made.append(marks)
        with pytest.raises(WaitTimeoutError):  # nothing attached or settled it yet
            marks.wait(0, COMPUTE, 0.01)
        waiter = threading.Thread(target=lambda: waited.append(marks.wait(1, COMPUTE + 5, 20 * TIMEOUT_S)),
                                  daemon=True)  # (a shutdown's release ends it, should the test fail)
        waiter.start()
        waiters.append(waiter)
        assert wait_until(lambda: blocked_on(marks) == 1)  # the condition the waiter made
        return marks

    def refuse(*_args: object) -> Any:
        raise RuntimeError("boom")

    try:
        monkeypatch.setattr(backend, "layer_marks", wait_early)
        if handed_over:
            settle = NativeLayerMarks.settle
            monkeypatch.setattr(NativeLayerMarks, "settle", lambda self: None)  # attach alone wakes it
        else:
            monkeypatch.setattr(backend, "booked_hand_off_call", lambda _plans, whole: refuse)
        fake.not_ready = 1 << 40  # in flight until the wait is enqueued
        w.load_by_layer(1, _i(3, 4), _i(5, 6), stream=COMPUTE + 3)
        (waiter,) = waiters
        waiter.join(TIMEOUT_S)
        assert not waiter.is_alive() and waited == [handed_over]
        waits = [c for c in fake.snapshot() if c[0] == "cuStreamWaitEvent" and c[1] == COMPUTE + 5]
        assert len(waits) == int(handed_over)
        if handed_over:
            settle(made[0])
        fake.not_ready = 0
        (result,) = w.wait([1], TIMEOUT_S)
        assert result.ok is handed_over
        assert len(made) == 1 and not w._book.jobs  # noqa: SLF001
    finally:
        fake.not_ready = 0
        w.shutdown(TIMEOUT_S)
    assert fake.events_destroyed == fake.events_created


@pytest.mark.parametrize("call", ["store", "load_by_layer"])
def test_a_shutdown_between_the_fronts_checks_and_its_hand_off_is_a_closed_error(
    call: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread's shutdown runs right after the front took the job (as a switch of the GIL
    there lets it): the submit raises ``ClosedError`` (an ``AttributeError`` on the released
    backend before: the store direction's first job, or any layered load; found by a lifecycle
    fuzz), and nothing is left behind."""
    keep: list[object] = []
    w = make_worker(keep, layer_dim=1)
    take = Worker._front_take

    def then_shut_down(self: Worker, *args: Any, **kwargs: Any) -> Any:
        taken = take(self, *args, **kwargs)
        if taken is not None:
            other = threading.Thread(target=self.shutdown, args=(TIMEOUT_S,))
            other.start()
            other.join(TIMEOUT_S)
        return taken

    monkeypatch.setattr(Worker, "_front_take", then_shut_down)
    try:
        with pytest.raises(ClosedError):
            getattr(w, call)(1, _i(3, 4), _i(5, 6))
        assert w.closed
    finally:
        w.shutdown(TIMEOUT_S)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvoffload")]
    assert all(part.thread_stopped for _, part in w._teardown.parts)  # noqa: SLF001 - the library's threads


def test_an_unreturned_job_keeps_its_id_through_the_front(worker: Worker) -> None:
    worker.store(1, _i(0), _i(0))
    with pytest.raises(JobIdError, match="already in flight or waiting to be polled"):
        worker.store(1, _i(1), _i(1))
    (result,) = worker.wait([1], TIMEOUT_S)
    assert result.ok
    worker.store(1, _i(1), _i(1))  # returned: the id is free again
    assert worker.wait([1], TIMEOUT_S)[0].ok


@pytest.mark.parametrize("call_front", [True, False], ids=["call front", "ctypes"])
def test_jobs_complete_alike_through_the_call_front_and_through_ctypes(call_front: bool) -> None:
    keep: list[object] = []
    w = make_worker(keep, call_front=call_front)
    try:
        backend = w._store._backend  # noqa: SLF001
        assert isinstance(backend, NativeBackend)
        assert (backend._front_hand_off is not None) is call_front  # noqa: SLF001
        for job in range(6):
            ids = _i(job, job + 6)
            if job % 2:
                w.load(job, ids, ids)
            else:
                w.store(job, ids, ids)
        results = w.wait(list(range(6)), TIMEOUT_S)
        assert [(r.job_id, r.ok, r.nbytes) for r in results] == [(j, True, 2 * 4 * 64) for j in range(6)]
        book = w._book  # noqa: SLF001
        assert not book.jobs
        assert all(not a.any() for m in (Memory.DEVICE, Memory.HOST) for a in (book.reads[m], book.writes[m]))
    finally:
        w.shutdown(TIMEOUT_S)


@pytest.mark.parametrize("call_front", [True, False], ids=["call front", "ctypes"])
def test_the_front_records_its_fence_on_the_callers_stream_in_the_hand_off(call_front: bool) -> None:
    keep: list[object] = []
    w = make_worker(keep, call_front=call_front)
    fake = keep[0]
    assert isinstance(fake, FakeDriver)
    try:
        w.store(1, _i(0, 1), _i(0, 1))  # the current stream (the reader's)
        w.load(2, _i(2), _i(2), stream=COMPUTE + 7)  # a stream given
        assert all(r.ok for r in w.wait([1, 2], TIMEOUT_S))
        fences = [c[2] for c in fake.of("cuEventRecord") if c[2] in (COMPUTE, COMPUTE + 7)]
        assert fences == [COMPUTE, COMPUTE + 7]
        waits = [c[2] for c in fake.of("cuStreamWaitEvent")]
        assert len(waits) >= 2  # each job's copy stream waited for its fence
    finally:
        w.shutdown(TIMEOUT_S)
    assert fake.events_destroyed == fake.events_created


@pytest.mark.parametrize("call_front", [True, False], ids=["call front", "ctypes"])
def test_a_front_job_whose_fence_fails_to_record_is_a_failed_result_and_returns_its_blocks(
    call_front: bool,
) -> None:
    keep: list[object] = []
    w = make_worker(keep, call_front=call_front)
    fake = keep[0]
    assert isinstance(fake, FakeDriver)
    try:
        fake.fail["cuEventRecord"] = 1  # CUDA_ERROR_INVALID_VALUE, in the hand-off's call
        w.store(1, _i(0, 1), _i(0, 1))  # not raised: the job's failure
        (result,) = w.wait([1], TIMEOUT_S)
        assert not result.ok and isinstance(result.error, CudaError)
        assert "cuEventRecord" in str(result.error)
        book = w._book  # noqa: SLF001
        assert not book.jobs
        assert all(not a.any() for m in (Memory.DEVICE, Memory.HOST) for a in (book.reads[m], book.writes[m]))
        w.store(1, _i(0, 1), _i(0, 1))  # the id and the blocks are free again
        assert w.wait([1], TIMEOUT_S)[0].ok
    finally:
        w.shutdown(TIMEOUT_S)


def test_a_hand_off_that_raises_is_the_jobs_failed_result_and_the_next_job_goes_through(
    worker: Worker, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*_args: object) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(worker._store, "_booked_call", refuse)  # noqa: SLF001 - the backend's call
    worker.store(1, _i(3), _i(3))
    (result,) = worker.wait([1], TIMEOUT_S)
    assert not result.ok and isinstance(result.error, RuntimeError)
    monkeypatch.undo()
    worker.store(2, _i(3), _i(3))
    assert worker.wait([2], TIMEOUT_S)[0].ok
    assert worker._store.wait_issued(TIMEOUT_S)  # noqa: SLF001 - nothing left pending


@pytest.mark.parametrize("doors", [("front", "front"), ("front", "list"), ("list", "front")])
def test_a_submit_waiting_for_a_hand_off_in_progress_never_deadlocks_it(doors: tuple[str, str]) -> None:
    """Thread A's hand-off is held inside its fence's record while thread B submits to the same
    direction; once the record returns both jobs are handed over, in the order of the hand-offs.
    (B used to wait for the hand-off lock holding the handler's lock, which A needed next.)"""
    keep: list[object] = []
    w = make_worker(keep)
    fake = keep[0]
    assert isinstance(fake, FakeDriver)
    gate, inside = threading.Event(), threading.Event()
    fake.gate_on[("cuEventRecord", COMPUTE)] = gate
    fake.entered["cuEventRecord"] = inside
    errors: list[BaseException] = []

    def submit(job: int, door: str) -> None:
        try:
            ids: Any = _i(job) if door == "front" else [job]
            w.store(job, ids, ids)
        except BaseException as exc:  # reported below
            errors.append(exc)

    first = threading.Thread(target=submit, args=(1, doors[0]), daemon=True)
    second = threading.Thread(target=submit, args=(2, doors[1]), daemon=True)
    first.start()
    assert inside.wait(TIMEOUT_S)  # A is inside its hand-off's fence record
    second.start()
    time.sleep(0.2)  # B reaches the hand-off and waits (the outcome does not depend on it)
    gate.set()
    first.join(TIMEOUT_S)
    second.join(TIMEOUT_S)
    assert not first.is_alive() and not second.is_alive(), "two submits deadlocked"
    assert not errors
    results = w.wait([1, 2], TIMEOUT_S)
    assert [r.ok for r in results] == [True, True]
    w.shutdown(TIMEOUT_S)


@pytest.mark.parametrize("control", [False, True])
def test_a_wait_never_waits_behind_a_hand_off_recording_its_fence(control: bool) -> None:
    """Thread A's hand-off is held inside its fence's record (the driver's record can wait
    milliseconds behind the issuer thread's batch call); the engine's wait for an earlier job
    returns meanwhile: a call into the book counts itself in under a lock of its own, not under
    the backend's, which the hand-off holds through its call. The control counts in under the
    backend's lock: the wait is held until the record returns."""
    keep: list[object] = []
    w = make_worker(keep)
    fake = keep[0]
    assert isinstance(fake, FakeDriver)
    w.store(1, _i(1), _i(1))
    backend = w._store._backend  # noqa: SLF001
    assert isinstance(backend, NativeBackend)
    count_lock = backend._count_lock  # noqa: SLF001
    if control:
        backend._count_lock = backend._lock  # noqa: SLF001
    gate, inside = threading.Event(), threading.Event()
    fake.gate_on[("cuEventRecord", COMPUTE)] = gate
    fake.entered_on[("cuEventRecord", COMPUTE)] = inside
    submit = threading.Thread(target=w.store, args=(2, _i(2), _i(2)), daemon=True)
    submit.start()
    try:
        assert inside.wait(TIMEOUT_S)  # A is inside its hand-off's fence record
        returned: list[TransferResult] = []
        waiter = threading.Thread(target=lambda: returned.extend(w.wait([1], TIMEOUT_S)), daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert bool(returned) is not control
    finally:
        gate.set()
        submit.join(TIMEOUT_S)
    waiter.join(TIMEOUT_S)
    backend._count_lock = count_lock  # noqa: SLF001 - the release takes both: not one lock twice
    assert [r.ok for r in returned] == [True]
    assert w.wait([2], TIMEOUT_S)[0].ok
    w.shutdown(TIMEOUT_S)


@pytest.mark.parametrize("control", [False, True])
def test_a_wait_for_a_job_being_handed_over_blocks_until_it_is_in_the_book(
    control: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thread A's hand-off of job 2 is held inside its fence's record: job 2 is reserved, not yet
    in the library's book. A wait for it blocks behind the hand-off (within its deadline), then
    waits in the library: a handful of looks in 0.3 s. The control, whose wait does not wait out
    the hand-off, looks again and again (the book says "not here" at once each time)."""
    keep: list[object] = []
    w = make_worker(keep)
    fake = keep[0]
    assert isinstance(fake, FakeDriver)
    w.store(1, _i(1), _i(1))
    assert w.wait([1], TIMEOUT_S)[0].ok  # the whole-job hand-off's call is built
    backend = w._store._backend  # noqa: SLF001
    assert isinstance(backend, NativeBackend)
    looks: list[int] = []
    once = backend._book_wait_once  # noqa: SLF001

    def counted(key: int, last: bool, timeout_s: float) -> int:
        done = once(key, last, timeout_s)
        looks.append(done)
        return done

    monkeypatch.setattr(backend, "_book_wait_once", counted)
    lock = backend._lock  # noqa: SLF001 - the hand-off's (its call took it when it was built)
    gate, inside = threading.Event(), threading.Event()
    fake.gate_on[("cuEventRecord", COMPUTE)] = gate
    fake.entered_on[("cuEventRecord", COMPUTE)] = inside
    submit = threading.Thread(target=w.store, args=(2, _i(2), _i(2)), daemon=True)
    submit.start()
    returned: list[TransferResult] = []
    try:
        assert inside.wait(TIMEOUT_S)
        if control:
            backend._lock = threading.Lock()  # noqa: SLF001 - a lock no hand-off holds
        waiter = threading.Thread(target=lambda: returned.extend(w.wait([2], TIMEOUT_S)), daemon=True)
        waiter.start()
        time.sleep(0.3)
        held = len(looks)
    finally:
        backend._lock = lock  # noqa: SLF001
        gate.set()
        submit.join(TIMEOUT_S)
    waiter.join(TIMEOUT_S)
    assert [r.ok for r in returned] == [True]
    if control:
        assert held > 100
    else:
        assert 1 <= held <= 4
    w.shutdown(TIMEOUT_S)


def test_threads_submitting_at_once_through_both_doors_get_every_result() -> None:
    keep: list[object] = []
    w = make_worker(keep)

    def run(thread: int) -> None:
        for k in range(60):
            job, block = thread * 1000 + k, thread  # each thread its own block
            ids: Any = _i(block) if k % 2 else [block]
            if k % 3:
                w.store(job, ids, ids)
            else:
                w.load(job, ids, ids)
            (result,) = w.wait([job], TIMEOUT_S)
            assert result.ok and result.job_id == job

    assert not run_at_once(run, 4, 2 * TIMEOUT_S)
    book = w._book  # noqa: SLF001
    assert not book.jobs
    w.shutdown(TIMEOUT_S)


def test_a_completion_failure_reads_alike_through_the_call_front_and_through_ctypes() -> None:
    outcomes = []
    for call_front in (True, False):
        keep: list[object] = []
        w = make_worker(keep, call_front=call_front)
        fake = keep[0]
        assert isinstance(fake, FakeDriver)
        try:
            fake.fail["cuEventQuery"] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS, found by the thread
            w.store(1, _i(0), _i(0))
            (result,) = w.wait([1], TIMEOUT_S)
            assert not result.ok and isinstance(result.error, CudaError)
            outcomes.append((type(result.error).__name__, str(result.error)))
            assert not w._book.jobs  # noqa: SLF001 - its blocks were uncounted
        finally:
            w.shutdown(TIMEOUT_S)
    assert outcomes[0] == outcomes[1]
    assert "cuEventQuery" in outcomes[0][1]


def test_the_call_fronts_job_calls_refuse_what_they_cannot_read() -> None:
    front = native.front()
    assert front is not None
    lib = native.library()
    spec = native.front_spec(lib)
    at = ctypes.addressof(spec)
    for call, args in (("job_take", (at, 0, False)), ("job_release", (at, 0)),
                       ("job_wait", (at, 0, 1000)), ("job_take", (0, 1, True))):
        with pytest.raises(ValueError, match="null"):
            getattr(front, call)(*args)
    with pytest.raises(TypeError, match="3 arguments"):
        front.job_wait(at, 1)
    with pytest.raises(TypeError, match="3 arguments"):
        front.job_take(at, 1)
    reads = np.zeros(2, dtype=np.int64)
    with pytest.raises(TypeError, match="reads must be"):
        front.unadmit(at, reads.astype(np.int32), reads)
    with pytest.raises(TypeError, match="writes must be"):
        front.unadmit(at, reads, [0, 0])
    with pytest.raises(ValueError, match="differ in length"):
        front.unadmit(at, reads, reads[:1])
    with pytest.raises(TypeError, match="2 arguments"):
        front.job_release(at)
    with pytest.raises(TypeError, match="3 arguments"):
        front.admit(at, reads)
    with pytest.raises(TypeError, match="10 arguments"):
        front.hand_off(at, 0)
    for device, host, error, message in ((reads.astype(np.int32), reads, TypeError, "device ids must be"),
                                         (reads, [0, 0], TypeError, "host ids must be"),
                                         (reads, reads[:1], ValueError, "differ in length")):
        with pytest.raises(error, match=message):  # refused before the library is called
            front.hand_off(at, 0, 0, 0, device, host, 0, 0, 0, 0)


def _admit(book: Bookkeeping, job: int, direction: Direction, reads: I64, writes: I64) -> bool:
    return book.admit_native(job, direction, reads, writes)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(
    st.sampled_from([Direction.STORE, Direction.LOAD, Direction.DEMOTE]),
    st.lists(st.integers(-1, 12), min_size=0, max_size=12),
    st.lists(st.integers(-1, 12), min_size=0, max_size=12),
    st.booleans(),
), min_size=1, max_size=25))
def test_the_call_front_admits_refuses_and_counts_as_the_ctypes_call(
    jobs: list[tuple[Direction, list[int], list[int], bool]],
) -> None:
    sizes = {Memory.DEVICE: 12, Memory.HOST: 12, Memory.DISK: 12}
    front, plain = Bookkeeping(sizes), Bookkeeping(sizes)
    assert front._front is not None  # noqa: SLF001 - this machine builds it (CI too)
    plain._front = None  # noqa: SLF001
    for job, (direction, src, dst, finish_one) in enumerate(jobs):
        reads, writes = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
        assert _admit(front, job, direction, reads, writes) == _admit(plain, job, direction, reads, writes)
        if finish_one and front.jobs:
            first = next(iter(front.jobs))
            front.remove(first)
            plain.remove(first)
        for memory in sizes:
            assert np.array_equal(front.reads[memory], plain.reads[memory])
            assert np.array_equal(front.writes[memory], plain.writes[memory])


@pytest.mark.parametrize("reads", [
    np.arange(8, dtype=np.int64)[::2],           # not contiguous
    np.arange(4, dtype=np.int32),                # int32
    np.arange(4, dtype=np.float64),              # float
    np.arange(4, dtype=np.int64).reshape(2, 2),  # 2-D
    np.arange(4, dtype=np.int64).astype(">i8"),  # big-endian
    [0, 1, 2, 3],                                # not a buffer
    np.arange(3, dtype=np.int64),                # a length other than the writes'
    np.arange(0, dtype=np.int64),                # empty
], ids=["strided", "int32", "float", "2-D", "big-endian", "list", "length", "empty"])
def test_the_call_front_refuses_ids_it_cannot_read_and_counts_nothing(reads: Any) -> None:
    module = native.front()
    assert module is not None
    book = Bookkeeping({Memory.DEVICE: 8, Memory.HOST: 8})
    spec = book._front_spec(Direction.STORE)  # noqa: SLF001
    writes = np.arange(4, dtype=np.int64) if getattr(reads, "size", 4) else np.arange(0, dtype=np.int64)
    assert module.admit(spec[1], reads, writes) is False
    assert not any(a.any() for m in (Memory.DEVICE, Memory.HOST) for a in (book.reads[m], book.writes[m]))
    assert module.admit(spec[1], np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64)) is True


def test_a_directions_front_spec_is_built_once() -> None:
    # Its address is held by the admission: a second build would free the spec it points to.
    book = Bookkeeping({Memory.DEVICE: 8, Memory.HOST: 8})
    admission = book.native_admission(Direction.STORE)
    first = book._front_spec(Direction.STORE)  # noqa: SLF001
    assert book._front_spec(Direction.STORE) is first  # noqa: SLF001
    assert book._front_spec(Direction.LOAD) is not first  # noqa: SLF001
    assert admission(1, np.arange(2, dtype=np.int64), np.arange(2, dtype=np.int64))
    book.remove(1)
    assert not any(a.any() for m in (Memory.DEVICE, Memory.HOST) for a in (book.reads[m], book.writes[m]))


def test_without_pythons_headers_the_front_is_not_built_and_ctypes_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    paths = dict(sysconfig.get_paths())
    paths["include"] = str(tmp_path / "no-headers")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    with pytest.raises(NativeBuildError, match="Python's headers are not installed"):
        native.build_front(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(native, "build_front", lambda: (_ for _ in ()).throw(NativeBuildError("x")))
    assert native.front.__wrapped__() is None
    monkeypatch.setattr(native, "front", lambda: None)
    book = Bookkeeping({Memory.DEVICE: 8, Memory.HOST: 8})
    assert book._front is None and book.checks_pairs  # noqa: SLF001
    assert book.admit_native(1, Direction.STORE, np.arange(2, dtype=np.int64), np.arange(2, dtype=np.int64))


def test_the_call_front_builds_into_a_directory_once(tmp_path: Path) -> None:
    first = native.build_front(tmp_path)
    assert first.name.startswith("kvoffload-front-") and first.exists()
    mtime = first.stat().st_mtime_ns
    assert native.build_front(tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left


def early_wakes(expect_spin_ns: int) -> list[int]:
    """Through the fast front, with callers issuing jobs of up to 2 pages (pairs here): the store
    issuer's early wakes after a 2-pair job and then after a 3-pair job, each handed to a blocked
    thread."""
    keep: list[object] = []
    w = make_worker(keep, tune={"caller_issue_max": 2, "expect_spin_ns": expect_spin_ns})
    backend = w._store._backend  # noqa: SLF001
    assert isinstance(backend, NativeBackend)
    wakes = []
    try:
        for job, pairs in ((0, 2), (1, 3)):
            time.sleep(0.05)  # the thread is out of work and blocked
            w.store(job, _i(*range(pairs)), _i(*range(pairs)))
            assert w.wait([job], TIMEOUT_S)[0].ok
            out = (ctypes.c_int64 * 6)()
            backend.lib.kvo_issuer_counts(backend._issuer, out)  # noqa: SLF001
            wakes.append(int(out[4]))
    finally:
        w.shutdown(TIMEOUT_S)
    return wakes


@pytest.mark.parametrize("through", ["call front", "ctypes"])
def test_the_front_wakes_the_thread_early_for_a_job_its_caller_will_not_issue(
    through: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if through == "ctypes":
        monkeypatch.setattr(native, "front", lambda: None)
    # Control: with the early wake off no job wakes the thread before its hand-off.
    assert early_wakes(0) == [0, 0], "the control woke the thread: the test proves nothing"
    assert early_wakes(200_000) == [0, 1]  # the 2-pair job is its caller's; the 3-pair job is not


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "control"])
def test_a_shutdown_returns_by_its_deadline_while_a_hand_off_is_held_in_its_driver_call(
    bounded: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hand-off holds the backend's lock across its fence's record on the caller's stream; a
    shutdown's drain and release took that lock without a deadline, so ``shutdown(0.5)`` waited as
    long as the driver held the record (found by a review). Now the shutdown fails by its deadline,
    leaving the issuer and the pool to the process. The control's drain waits on the lock without
    one: the shutdown returns only after the record is let go."""
    keep: list[object] = []
    w = make_worker(keep)
    fake = keep[0]
    assert isinstance(fake, FakeDriver)
    ids = np.array([1], dtype=np.int64)
    w.store(1, ids, ids)
    assert w.wait([1], TIMEOUT_S)[0].ok
    if not bounded:
        def close_book_unbounded(backend: NativeBackend, timeout_s: float) -> None:
            with backend._lock:  # noqa: SLF001 - the control: no deadline
                backend._book_closed = True  # noqa: SLF001

        monkeypatch.setattr(NativeBackend, "close_book", close_book_unbounded)
    gate, inside = threading.Event(), threading.Event()
    fake.gate_on[("cuEventRecord", COMPUTE)] = gate
    fake.entered_on[("cuEventRecord", COMPUTE)] = inside
    submitted: list[BaseException | None] = []

    def submit() -> None:
        try:
            w.store(2, ids + 1, ids + 1)
            submitted.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            submitted.append(exc)

    backends = [w._store._backend, w._load._backend]  # noqa: SLF001 - released below, once free
    submitter = threading.Thread(target=submit)
    submitter.start()
    opener = threading.Timer(10.0, gate.set)  # the control's shutdown returns after this
    failed = False
    try:
        assert inside.wait(TIMEOUT_S)
        opener.start()
        try:
            w.shutdown(0.5)
        except ShutdownError:
            failed = True
        held = not gate.is_set()
    finally:
        gate.set()
        opener.cancel()
        submitter.join(TIMEOUT_S)
        for backend in backends:  # what the failed shutdown left to the process, let go of here
            if isinstance(backend, NativeBackend):
                backend.release_within(TIMEOUT_S)
    assert held == bounded and (failed or not bounded)
    assert not submitter.is_alive() and len(submitted) == 1
