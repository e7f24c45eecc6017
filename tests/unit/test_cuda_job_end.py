"""The Python issuer's job end (``kvoffload.backends.cuda.end_job``) with stand-in events: a refused
end record is tried once more with another event, and the job then stays in flight until that end
completes (docs/design.md §5 rule 5); refused twice, the job ends at once with its events given
back. A failed staged store's end follows the gather it launched. And releasing a job's layer marks
never waits for a stream wait in progress. Needs the ``cuda`` extra to import the backend (no
device: the GPU suite refuses real records)."""

from __future__ import annotations

import threading
from typing import Any, cast

import numpy as np
import pytest

pytest.importorskip("cuda.bindings", reason="the CUDA backend needs the 'cuda' extra (cuda-bindings)")

from kvoffload._jobs import FailedTicket  # noqa: E402
from kvoffload.backends import kernel as kernel_path  # noqa: E402
from kvoffload.backends.cuda import CudaLayerMarks, CudaStreams, CudaTicket, end_job  # noqa: E402
from kvoffload.bindings import driver  # noqa: E402
from kvoffload.errors import CudaError  # noqa: E402
from kvoffload.records import Direction  # noqa: E402
from tests.unit.test_shared_pool import strided_plan  # noqa: E402

STREAM = 7


def refusal(call: str = "cuEventRecord") -> CudaError:
    return CudaError(call, 999, "CUDA_ERROR_UNKNOWN", "refused for the test")


class StandIn:
    """An event whose records are refused while ``refuse`` is set; logs what happens to it."""

    def __init__(self, name: str, log: list[str], *, refuse: bool = False) -> None:
        self.name = name
        self.log = log
        self.refuse = refuse
        self.recorded_on: int | None = None
        self.complete = False

    def record(self, stream: int) -> None:
        if self.refuse:
            self.log.append(f"refused {self.name}")
            raise refusal()
        self.log.append(f"record {self.name}")
        self.recorded_on = stream

    def done(self) -> bool:
        return self.complete

    def release(self) -> None:
        self.log.append(f"release {self.name}")

    def discard(self) -> None:
        self.log.append(f"discard {self.name}")


def ev(event: StandIn) -> driver.Event:
    return cast(driver.Event, event)


class Fresh:
    """Hands out the other events ``end_job`` asks for."""

    def __init__(self, log: list[str], *, refuse: bool = False, fail_take: bool = False) -> None:
        self.log = log
        self.refuse = refuse
        self.fail_take = fail_take
        self.given: list[StandIn] = []

    def __call__(self) -> driver.Event:
        if self.fail_take:
            self.log.append("take failed")
            raise refusal("cuEventCreate")
        event = StandIn(f"fresh{len(self.given)}", self.log, refuse=self.refuse)
        self.log.append(f"take {event.name}")
        self.given.append(event)
        return ev(event)


def test_an_accepted_end_makes_the_ticket_wait_for_it() -> None:
    log: list[str] = []
    start, end, fresh = StandIn("start", log), StandIn("end", log), Fresh(log)
    ticket = end_job(ev(start), ev(end), STREAM, None, "dma", fresh)
    assert isinstance(ticket, CudaTicket)
    assert ticket.end is ev(end) and ticket.error is None and ticket.path == "dma"
    assert log == ["record end"] and end.recorded_on == STREAM
    assert not ticket.done()
    end.complete = True
    assert ticket.done()


@pytest.mark.parametrize("earlier", [None, "copy"], ids=["copies-enqueued", "copies-failed"])
def test_a_refused_end_is_recorded_again_on_another_event_and_the_job_fails_once_it_completes(
    earlier: str | None,
) -> None:
    log: list[str] = []
    copy_error = None if earlier is None else refusal("cuMemcpyBatchAsync")
    start, end, fresh = StandIn("start", log), StandIn("end", log, refuse=True), Fresh(log)
    ticket = end_job(ev(start), ev(end), STREAM, copy_error, "dma", fresh)
    assert isinstance(ticket, CudaTicket), "the job ended at once while its copies may still run"
    (again,) = fresh.given
    # the other event is taken before the refused one goes, which is destroyed, not pooled (the
    # pool hands out its last event first: given back, it would be the one taken)
    assert log == ["refused end", "take fresh0", "discard end", "record fresh0"]
    assert ticket.end is ev(again) and again.recorded_on == STREAM
    if copy_error is not None:  # the job fails with the first failure: the copies', else the record
        assert ticket.error is copy_error
    else:
        assert isinstance(ticket.error, CudaError) and ticket.error.call == "cuEventRecord"
    assert not ticket.done(), "in flight until the second end completes"
    again.complete = True
    assert ticket.done()
    ticket.release()
    assert log[-2:] == ["release start", "release fresh0"]


@pytest.mark.parametrize("how", ["refused-twice", "no-event"])
def test_an_end_that_cannot_be_recorded_at_all_ends_the_job_at_once(how: str) -> None:
    log: list[str] = []
    fresh = Fresh(log, refuse=how == "refused-twice", fail_take=how == "no-event")
    start, end = StandIn("start", log), StandIn("end", log, refuse=True)
    ticket = end_job(ev(start), ev(end), STREAM, None, "sm", fresh)
    assert isinstance(ticket, FailedTicket)
    assert isinstance(ticket.error, CudaError) and ticket.error.call == "cuEventRecord"
    if how == "refused-twice":
        assert log == ["refused end", "take fresh0", "discard end", "refused fresh0",
                       "release start", "release fresh0"]
    else:
        assert log == ["refused end", "take failed", "discard end", "release start"]


class Marks:
    """Stand-in layer marks: logs the layers marked after a failure, refusing on request."""

    def __init__(self, log: list[str], *, refuse: bool = False) -> None:
        self.log = log
        self.refuse = refuse

    def record_rest(self, stream: int, upto: int) -> None:
        self.log.append(f"marks before {upto} on {stream}")
        if self.refuse:
            raise refusal()


@pytest.mark.parametrize("refuse", [False, True], ids=["marked", "mark-refused"])
def test_a_failed_layered_job_marks_its_rest_after_its_end_and_keeps_its_end(refuse: bool) -> None:
    log: list[str] = []
    start, end = StandIn("start", log), StandIn("end", log)
    error = refusal("cuLaunchKernel")
    marks = cast(CudaLayerMarks, Marks(log, refuse=refuse))
    ticket = end_job(ev(start), ev(end), STREAM, error, "sm", Fresh(log), (marks, 4))
    assert log == ["record end", f"marks before 4 on {STREAM}"]
    # a refused mark leaves the rest unmarked (their waits say they did not land); the job keeps its end
    assert isinstance(ticket, CudaTicket) and ticket.end is ev(end) and ticket.error is error


def test_a_layered_job_that_succeeded_marks_nothing_more() -> None:
    log: list[str] = []
    ticket = end_job(ev(StandIn("s", log)), ev(StandIn("e", log)), STREAM, None, "dma", Fresh(log),
                     (cast(CudaLayerMarks, Marks(log)), 2))
    assert isinstance(ticket, CudaTicket) and ticket.error is None and log == ["record e"]


class _Streams:
    """The staged path's streams: logs stream waits and every event's fate; ``refuse_on`` refuses
    the first record of a slot event on that stream."""

    copy, kernel = 1, 2

    def __init__(self, log: list[str], refuse_on: int) -> None:
        self.log = log
        self.refuse_on = refuse_on
        self.taken = 0

    def job_events(self) -> tuple[driver.Event, driver.Event]:
        return ev(StandIn("start", self.log)), ev(StandIn("end", self.log))

    def timing_event(self) -> driver.Event:
        return ev(StandIn("fresh", self.log))

    def wait(self, waiter: int, stream: int) -> None:
        self.log.append(f"stream {waiter} waits for {stream}")


class _SlotEvent:
    def __init__(self, streams: _Streams, name: str) -> None:
        self.streams, self.name = streams, name

    def record(self, stream: int) -> None:
        if stream == self.streams.refuse_on:
            self.streams.refuse_on = 0
            raise refusal()
        self.streams.log.append(f"{self.name} on {stream}")

    def wait_on(self, stream: int) -> None:
        pass


class _Anything:
    def get(self, plan: object) -> tuple[int, int]:
        return 0, 1

    def launch(self, *args: Any) -> None:
        self.launches = getattr(self, "launches", 0) + 1

    def copy(self, *args: Any) -> None:
        pass

    def wait_on(self, stream: int) -> None:
        pass


def _staged(direction: Direction, streams: _Streams) -> kernel_path.StagedPath:
    path = kernel_path.StagedPath.__new__(kernel_path.StagedPath)
    anything: Any = _Anything()
    path.direction, path.copier, path.launcher, path.tables = direction, anything, anything, anything
    path.ctas, path.slots, path.slot_bytes, path._next_slot = 8, 2, 1 << 20, 0
    path.slot_bases = (1 << 30, (1 << 30) + (1 << 20))
    path._filled = [cast(driver.Event, _SlotEvent(streams, f"filled{i}")) for i in range(2)]
    path._drained = [cast(driver.Event, _SlotEvent(streams, f"drained{i}")) for i in range(2)]
    return path


@pytest.mark.parametrize("failed", [False, True], ids=["issued", "failed-after-its-gather"])
def test_a_failed_staged_store_ends_after_the_gather_it_launched(failed: bool) -> None:
    """A store ends on the copy stream. One whose chunk failed after its gather was launched (the
    record for its DMA's wait refused) makes that stream wait for the kernel stream first: the
    gather reads the job's device blocks, and must not run after the job ended (rule 5)."""
    log: list[str] = []
    streams = _Streams(log, refuse_on=_Streams.kernel if failed else 0)
    path = _staged(Direction.STORE, streams)
    plan = strided_plan(Direction.STORE, [4096], 1, 0)
    ids = np.arange(2, dtype=np.int64)
    ticket = path.issue(cast(CudaStreams, streams), plan, ids, ids, cast(driver.Event, _Anything()))
    assert isinstance(ticket, CudaTicket) and (ticket.error is not None) == failed
    joins = [line for line in log if line.startswith("stream")]
    if failed:
        assert joins == [f"stream {_Streams.copy} waits for {_Streams.kernel}"]
        assert log.index(joins[0]) < log.index("record end")
    else:  # its last DMA follows its last gather already: nothing more on the hot path
        assert joins == []


HANG_S = 30.0  # "does not hang" bound; never a performance assertion


class _HeldEvent:
    """A layer's event whose stream wait blocks until ``gate`` is set (a full stream)."""

    def __init__(self, *_: object) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        self.releases = 0

    def record(self, stream: int) -> None:
        pass

    def wait_on(self, stream: int) -> None:
        self.entered.set()
        assert self.gate.wait(HANG_S)

    def release(self) -> None:
        self.releases += 1


def test_releasing_layer_marks_does_not_wait_for_a_stream_wait_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's stream wait was enqueued under the marks' lock, which their release (by the
    handler, under its own lock) then waited for: a stream wait blocked on a full stream held every
    ``wait``, ``poll`` and the shutdown of that direction without a deadline (found by an audit). The
    release now returns at once and the event goes back to its pool when the wait left."""
    import kvoffload.backends.cuda as cuda_backend

    made: list[_HeldEvent] = []

    def take(pool: object) -> _HeldEvent:
        made.append(_HeldEvent())
        return made[-1]

    monkeypatch.setattr(driver, "Event", take)
    monkeypatch.setattr(cuda_backend, "current_device_index", lambda: 0)
    marks = CudaLayerMarks(2, cast(driver.EventPool, None), 0, lambda stream: 0)
    marks.record(0, STREAM)
    (event,) = made
    waiter = threading.Thread(target=lambda: marks.wait(0, None, HANG_S), daemon=True)
    waiter.start()
    assert event.entered.wait(HANG_S)
    releaser = threading.Thread(target=marks.release, daemon=True)
    releaser.start()
    releaser.join(HANG_S / 10)
    finished, early = not releaser.is_alive(), event.releases
    event.gate.set()
    waiter.join(HANG_S)
    assert finished, "the release waited for a stream wait in progress"
    assert early == 0, "the event went back to its pool while a stream wait used it"
    assert event.releases == 1, "the event went back to its pool while a wait used it, or never"
    assert marks.wait(1, None, HANG_S), "released: a later wait returns at once"
