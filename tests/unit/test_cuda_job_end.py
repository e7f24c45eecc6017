"""The Python issuer's job end (``kvoffload.backends.cuda.end_job``) with stand-in events: a refused
end record is tried once more with a fresh event, and the job then stays in flight until that end
completes (docs/design.md §5 rule 5); refused twice, the job ends at once with its events given
back."""

from __future__ import annotations

from typing import cast

import pytest

from kvoffload._jobs import FailedTicket
from kvoffload.backends.cuda import CudaLayerMarks, CudaTicket, end_job
from kvoffload.bindings import driver
from kvoffload.errors import CudaError

STREAM = 7


def refusal(call: str = "cuEventRecord") -> CudaError:
    return CudaError(call, 999, "CUDA_ERROR_UNKNOWN", "refused for the test")


class StandIn:
    """An event whose records are refused while ``refuse`` is set; remembers its stream."""

    def __init__(self, name: str, *, refuse: bool = False) -> None:
        self.name = name
        self.refuse = refuse
        self.recorded_on: int | None = None
        self.complete = False
        self.releases = 0

    def record(self, stream: int) -> None:
        if self.refuse:
            raise refusal()
        self.recorded_on = stream

    def done(self) -> bool:
        return self.complete

    def release(self) -> None:
        self.releases += 1


def ev(event: StandIn) -> driver.Event:
    return cast(driver.Event, event)


class Fresh:
    """Hands out the fresh events ``end_job`` asks for."""

    def __init__(self, *, refuse: bool = False, fail_take: bool = False) -> None:
        self.refuse = refuse
        self.fail_take = fail_take
        self.given: list[StandIn] = []

    def __call__(self) -> driver.Event:
        if self.fail_take:
            raise refusal("cuEventCreate")
        event = StandIn(f"fresh{len(self.given)}", refuse=self.refuse)
        self.given.append(event)
        return ev(event)


def test_an_accepted_end_makes_the_ticket_wait_for_it() -> None:
    start, end, fresh = StandIn("start"), StandIn("end"), Fresh()
    ticket = end_job(ev(start), ev(end), STREAM, None, "dma", fresh)
    assert isinstance(ticket, CudaTicket)
    assert ticket.end is ev(end) and ticket.error is None and ticket.path == "dma"
    assert end.recorded_on == STREAM and not fresh.given
    assert not ticket.done()
    end.complete = True
    assert ticket.done()


@pytest.mark.parametrize("earlier", [None, "copy"], ids=["copies-enqueued", "copies-failed"])
def test_a_refused_end_is_recorded_again_and_the_job_fails_only_once_it_completes(earlier: str | None) -> None:
    copy_error = None if earlier is None else refusal("cuMemcpyBatchAsync")
    start, end, fresh = StandIn("start"), StandIn("end", refuse=True), Fresh()
    ticket = end_job(ev(start), ev(end), STREAM, copy_error, "dma", fresh)
    assert isinstance(ticket, CudaTicket), "the job ended at once while its copies may still run"
    (again,) = fresh.given
    assert ticket.end is ev(again) and again.recorded_on == STREAM
    assert end.releases == 1 and start.releases == 0  # the refused event back; the start is the ticket's
    # the job fails with the first failure: the copies', else the refused record
    if copy_error is not None:
        assert ticket.error is copy_error
    else:
        assert isinstance(ticket.error, CudaError) and ticket.error.call == "cuEventRecord"
    assert not ticket.done(), "in flight until the second end completes"
    again.complete = True
    assert ticket.done()
    ticket.release()
    assert start.releases == 1 and again.releases == 1


@pytest.mark.parametrize("fresh", [Fresh(refuse=True), Fresh(fail_take=True)], ids=["refused-twice", "no-event"])
def test_an_end_that_cannot_be_recorded_at_all_ends_the_job_at_once(fresh: Fresh) -> None:
    start, end = StandIn("start"), StandIn("end", refuse=True)
    ticket = end_job(ev(start), ev(end), STREAM, None, "sm", fresh)
    assert isinstance(ticket, FailedTicket)
    assert isinstance(ticket.error, CudaError) and ticket.error.call == "cuEventRecord"
    assert start.releases == 1 and end.releases == 1
    assert all(e.releases == 1 for e in fresh.given)


class Marks:
    """Stand-in layer marks: records the layers marked after a failure, refusing from ``refuse_at``."""

    def __init__(self, refuse_at: int | None = None) -> None:
        self.refuse_at = refuse_at
        self.calls: list[tuple[int, int]] = []

    def record_rest(self, stream: int, upto: int) -> None:
        self.calls.append((stream, upto))
        if self.refuse_at is not None:
            raise refusal()


@pytest.mark.parametrize("refuse", [False, True], ids=["marked", "mark-refused"])
def test_a_failed_layered_job_marks_its_rest_after_its_end_and_keeps_it(refuse: bool) -> None:
    marks = Marks(refuse_at=0 if refuse else None)
    start, end = StandIn("start"), StandIn("end")
    error = refusal("cuLaunchKernel")
    ticket = end_job(ev(start), ev(end), STREAM, error, "sm", Fresh(), (cast(CudaLayerMarks, marks), 4))
    assert marks.calls == [(STREAM, 4)]
    # a refused mark leaves the rest unmarked (their waits say they did not land); the job keeps its end
    assert isinstance(ticket, CudaTicket) and ticket.end is ev(end) and ticket.error is error


def test_a_layered_job_that_succeeded_marks_nothing_more() -> None:
    marks = Marks()
    ticket = end_job(ev(StandIn("s")), ev(StandIn("e")), STREAM, None, "dma", Fresh(),
                     (cast(CudaLayerMarks, marks), 2))
    assert isinstance(ticket, CudaTicket) and ticket.error is None and not marks.calls
