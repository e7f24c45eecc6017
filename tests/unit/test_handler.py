"""DirectionHandler: FIFO completion, failures reported never dropped, and the shutdown contract of
docs/design.md §6 (head-first wait, pop after success; on failure log, clear, keep the error; release
everything unconditionally; re-raise)."""

from __future__ import annotations

import threading
import time

import numpy as np
import numpy.typing as npt
import pytest

from kvoffload import (
    ClosedError,
    CudaError,
    DeviceMismatchError,
    InvalidBlockIdError,
    JobIdError,
    ShutdownError,
    UnknownJobError,
    WaitTimeoutError,
)
from kvoffload._descriptors import CopyPlan, PageTable
from kvoffload.handler import (
    INLINE_HEAD_MAX_DESCRIPTORS,
    INLINE_ISSUE_MAX_DESCRIPTORS,
    DirectionHandler,
)
from kvoffload.records import Direction
from kvoffload.testing import FakeBackend, FakeTicket
from tests.unit._threads import run_at_once

I64Array = npt.NDArray[np.int64]
HANG_GUARD_S = 30.0  # generous bound for "does not hang"; never a performance assertion


def make_plan(direction: Direction) -> CopyPlan:
    pages = PageTable(
        dev_base=np.array([0x10000], dtype=np.int64),
        dev_stride=np.array([4096], dtype=np.int64),
        nbytes=np.array([4096], dtype=np.int64),
        host_offset=np.array([0], dtype=np.int64),
        segment=np.array([0], dtype=np.int64),
        record_bytes=4096,
    )
    return CopyPlan(pages, host_base=0x900000, chunk_records=1 << 20, direction=direction)


def make_handler(backend: FakeBackend) -> DirectionHandler:
    return DirectionHandler.create(
        direction=backend.direction, plan=make_plan(backend.direction), backend=backend,
        num_src_blocks=16, num_dst_blocks=16,
    )


def wait_until_issued(backend: FakeBackend, count: int) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while len(backend.tickets) < count:
        assert time.monotonic() < deadline, "the issuer thread did not issue the jobs"
        time.sleep(0.001)


def test_results_come_in_submission_order_and_only_from_the_head() -> None:
    backend = FakeBackend(auto_finish=False)
    handler = make_handler(backend)
    try:
        for job in range(3):
            handler.submit(job, [job], [job])
        wait_until_issued(backend, 3)
        backend.tickets[1].finish()  # the second finished, the first not: nothing may be returned
        assert handler.poll() == []
        backend.tickets[0].finish()
        assert [r.job_id for r in handler.poll()] == [0, 1]
        backend.tickets[2].finish()
        assert [r.job_id for r in handler.wait([2], timeout=HANG_GUARD_S)] == [2]
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_issue_failure_comes_back_as_failed_result_never_dropped() -> None:
    backend = FakeBackend()
    backend.issue_error = CudaError("cuMemcpyBatchAsync", 1, "CUDA_ERROR_INVALID_VALUE", "injected")
    handler = make_handler(backend)
    try:
        handler.submit(7, [1, 2], [3, 4])
        (result,) = handler.wait([7], timeout=HANG_GUARD_S)
        assert not result.ok and result.error is backend.issue_error
        assert result.nbytes == 2 * 4096
        stats = handler.stats()
        assert (stats.completed, stats.failed, stats.bytes_done) == (0, 1, 0)
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_completion_failure_fails_that_job_and_the_queue_moves_on() -> None:
    backend = FakeBackend(auto_finish=False)
    handler = make_handler(backend)
    try:
        handler.submit(1, [1], [1])
        handler.submit(2, [2], [2])
        wait_until_issued(backend, 2)
        backend.tickets[0].done_error = CudaError("cuEventQuery", 719, "CUDA_ERROR_LAUNCH_FAILED", "x")
        backend.tickets[1].finish()
        results = handler.wait([1, 2], timeout=HANG_GUARD_S)
        assert [(r.job_id, r.ok) for r in results] == [(1, False), (2, True)]
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_wait_returns_asked_jobs_and_leaves_the_others_for_poll() -> None:
    backend = FakeBackend()
    handler = make_handler(backend)
    try:
        for job in range(4):
            handler.submit(job, [job], [job])
        assert [r.job_id for r in handler.wait([2], timeout=HANG_GUARD_S)] == [2]
        handler.wait([3], timeout=HANG_GUARD_S)
        assert [r.job_id for r in handler.poll()] == [0, 1]
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_wait_timeout_keeps_the_job_in_flight() -> None:
    backend = FakeBackend(auto_finish=False)
    handler = make_handler(backend)
    try:
        handler.submit(5, [1], [1])
        with pytest.raises(WaitTimeoutError, match=r"still in flight: wait or poll for them again") as info:
            handler.wait([5], timeout=0.01)
        assert info.value.pending == (5,)
        wait_until_issued(backend, 1)
        backend.tickets[0].finish()
        assert [r.ok for r in handler.wait([5], timeout=HANG_GUARD_S)] == [True]
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_empty_job_completes_at_once_without_issuing() -> None:
    backend = FakeBackend()
    handler = make_handler(backend)
    try:
        handler.submit(9, [], [])
        (result,) = handler.poll()
        assert (result.job_id, result.ok, result.nbytes, result.path) == (9, True, 0, "none")
        assert backend.issued == []
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_submit_validates_before_anything_is_queued() -> None:
    backend = FakeBackend()
    handler = make_handler(backend)
    try:
        with pytest.raises(InvalidBlockIdError, match="equal lengths"):
            handler.submit(1, [1, 2], [1])
        with pytest.raises(InvalidBlockIdError, match=r"dst_blocks\[1\] = 3"):
            handler.submit(1, [1, 2], [3, 3])
        with pytest.raises(DeviceMismatchError):
            handler.submit(1, [1], [1], stream=object())
        handler.submit(1, [1], [1])
        with pytest.raises(JobIdError, match="already in flight"):
            handler.submit(1, [2], [2])
        with pytest.raises(UnknownJobError):
            handler.wait([99], timeout=1.0)
        handler.wait([1], timeout=HANG_GUARD_S)
        assert handler.stats().submitted == 1
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_shutdown_drains_in_flight_jobs_then_releases_once() -> None:
    backend = FakeBackend(auto_finish=False)
    handler = make_handler(backend)
    for job in range(5):
        handler.submit(job, [job], [job])
    wait_until_issued(backend, 5)
    def finish_all() -> None:
        for ticket in backend.tickets:
            ticket.finish()

    finisher = threading.Timer(0.05, finish_all)
    finisher.start()
    handler.shutdown(timeout=HANG_GUARD_S)
    finisher.join()
    assert handler.stats().completed == 5
    assert backend.released == 1
    assert handler.thread_stopped
    handler.shutdown(timeout=HANG_GUARD_S)
    assert backend.released == 1


def test_drain_whose_wait_raises_clears_queue_releases_and_reraises() -> None:
    backend = FakeBackend(auto_finish=False)
    handler = make_handler(backend)
    for job in range(3):
        handler.submit(job, [job], [job])
    wait_until_issued(backend, 3)
    fault = CudaError("cuEventQuery", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "injected")
    backend.tickets[0].wait_error = fault
    with pytest.raises(CudaError) as info:
        handler.shutdown(timeout=HANG_GUARD_S)
    assert info.value is fault
    assert backend.released == 1
    assert handler.thread_stopped
    assert handler.stats().in_flight == 0
    with pytest.raises(ClosedError):
        handler.poll()


def test_a_job_whose_tickets_wait_raises_fails_with_that_error_without_spinning() -> None:
    """(A waiter's wait on such a ticket returned at once, again and again, until its deadline — a
    core spent — and the job then came back ok once ``done`` said so: the failure was lost.)"""
    backend = FakeBackend(auto_finish=False)
    handler = make_handler(backend)
    handler.submit(1, [1], [1])
    handler.submit(2, [2], [2])
    wait_until_issued(backend, 2)
    fault = CudaError("cuEventSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "injected")
    backend.tickets[0].wait_error = fault
    began = time.monotonic()
    (first,) = handler.wait([1], HANG_GUARD_S)
    assert time.monotonic() - began < HANG_GUARD_S / 2
    assert not first.ok and first.error is fault
    backend.tickets[0].finish()  # done() says True now: the job stays failed
    backend.tickets[1].finish()
    (second,) = handler.wait([2], HANG_GUARD_S)
    assert second.ok and handler.stats().failed == 1
    handler.shutdown(timeout=HANG_GUARD_S)


def test_drain_past_its_deadline_raises_and_still_releases() -> None:
    backend = FakeBackend(auto_finish=False)  # the job never finishes
    handler = make_handler(backend)
    handler.submit(1, [1], [1])
    wait_until_issued(backend, 1)
    with pytest.raises(WaitTimeoutError, match="did not finish before the shutdown deadline"):
        handler.shutdown(timeout=0.05)
    assert backend.released == 1
    assert handler.stats().in_flight == 0


def test_drain_failure_and_release_failure_come_as_one_shutdown_error() -> None:
    backend = FakeBackend(auto_finish=False)
    backend.release_error = RuntimeError("release broke")
    handler = make_handler(backend)
    handler.submit(1, [1], [1])
    wait_until_issued(backend, 1)
    with pytest.raises(ShutdownError) as info:
        handler.shutdown(timeout=0.05)
    kinds = [type(f) for f in info.value.failures]
    assert kinds == [WaitTimeoutError, RuntimeError]


def test_release_failure_alone_is_raised_after_a_clean_drain() -> None:
    backend = FakeBackend()
    backend.release_error = RuntimeError("release broke")
    handler = make_handler(backend)
    handler.submit(1, [1], [1])
    with pytest.raises(RuntimeError, match="release broke"):
        handler.shutdown(timeout=HANG_GUARD_S)
    assert handler.thread_stopped


def test_jobs_queued_behind_a_failed_drain_are_not_issued() -> None:
    backend = FakeBackend(auto_finish=False)
    gate = threading.Event()
    original_issue = backend.issue

    def slow_issue(plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> FakeTicket:
        gate.wait(HANG_GUARD_S)
        return original_issue(plan, src, dst, fence)

    backend.issue = slow_issue  # type: ignore[method-assign]
    handler = make_handler(backend)
    for job in range(3):
        handler.submit(job, [job], [job])
    with pytest.raises(ShutdownError) as info:
        handler.shutdown(timeout=0.05)  # job 0 is stuck in issue: the deadline passes
    assert [type(f) for f in info.value.failures] == [WaitTimeoutError, WaitTimeoutError]
    assert "issuer thread did not stop" in str(info.value)
    gate.set()
    deadline = time.monotonic() + HANG_GUARD_S
    while not handler.thread_stopped:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert len(backend.issued) == 1  # jobs 1 and 2 were abandoned, never issued


def test_store_and_load_descriptors_point_the_right_way() -> None:
    for direction in (Direction.STORE, Direction.LOAD):
        backend = FakeBackend(direction)
        handler = make_handler(backend)
        try:
            handler.submit(1, [2], [3])
            handler.wait([1], timeout=HANG_GUARD_S)
            (desc,) = backend.issued
            device, host = 0x10000 + 2 * 4096, 0x900000 + 3 * 4096
            if direction is Direction.LOAD:
                device, host = 0x10000 + 3 * 4096, 0x900000 + 2 * 4096
                assert (int(desc.srcs[0]), int(desc.dsts[0])) == (host, device)
            else:
                assert (int(desc.srcs[0]), int(desc.dsts[0])) == (device, host)
        finally:
            handler.shutdown(timeout=HANG_GUARD_S)


def test_small_job_with_nothing_pending_is_issued_on_the_callers_thread() -> None:
    backend = FakeBackend()
    backend.inline = True
    threads: list[int] = []
    original_issue = backend.issue

    def recording_issue(plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> FakeTicket:
        threads.append(threading.get_ident())
        return original_issue(plan, src, dst, fence)

    backend.issue = recording_issue  # type: ignore[method-assign]
    handler = make_handler(backend)
    try:
        handler.submit(1, [1], [1])
        assert threads == [threading.get_ident()]  # issued before submit returned, right here
        assert [r.job_id for r in handler.wait([1], timeout=HANG_GUARD_S)] == [1]
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def issuing_threads(backend: FakeBackend) -> list[int]:
    """Record the thread of every issue of ``backend``."""
    threads: list[int] = []
    original_issue = backend.issue

    def recording_issue(plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> FakeTicket:
        threads.append(threading.get_ident())
        return original_issue(plan, src, dst, fence)

    backend.issue = recording_issue  # type: ignore[method-assign]
    return threads


def issued_sources(backend: FakeBackend) -> list[list[int]]:
    """The source blocks of every issue, in order (from the fake's descriptors: 4096-byte pages,
    consecutive blocks merged into one copy)."""
    base = 0x10000 if backend.direction is Direction.STORE else 0x900000
    return [[(int(a) - base) // 4096 + k for a, n in zip(d.srcs, d.sizes) for k in range(int(n) // 4096)]
            for d in backend.issued]


def test_a_costly_job_with_nothing_in_flight_has_its_head_issued_here_and_the_rest_on_the_thread() -> None:
    backend = FakeBackend(auto_finish=False)
    backend.inline = True
    backend.cost_per_block = INLINE_ISSUE_MAX_DESCRIPTORS  # two blocks: over the plain limit
    threads = issuing_threads(backend)
    handler = make_handler(backend)
    here = threading.get_ident()
    try:
        handler.submit(1, [0, 1, 2, 3], [0, 1, 2, 3])  # nothing in flight: split
        wait_until_issued(backend, 2)
        assert threads[0] == here and threads[1] != here
        assert issued_sources(backend) == [[0], [1, 2, 3]]  # the head fits the head budget
        handler.submit(2, [4, 5], [4, 5])  # job 1 still in flight: the issuer thread takes it all
        wait_until_issued(backend, 3)
        assert threads[2] != here and issued_sources(backend)[2] == [4, 5]
        backend.tickets[0].finish()  # the head alone finished: the job has not
        assert handler.poll() == []
        backend.tickets[1].finish()
        (result,) = handler.wait([1], timeout=HANG_GUARD_S)
        assert result.ok and result.nbytes == 4 * 4096 and result.seconds > 0
        backend.tickets[2].finish()
        assert [r.job_id for r in handler.wait([2], timeout=HANG_GUARD_S)] == [2]
        assert handler.stats().submitted == 2 and handler.stats().completed == 2
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_a_split_job_is_halved_until_its_head_fits_the_head_budget() -> None:
    backend = FakeBackend()
    backend.inline = True
    backend.cost_per_block = INLINE_HEAD_MAX_DESCRIPTORS // 4 + 1  # 3 blocks fit, 4 do not
    handler = make_handler(backend)
    try:
        handler.submit(1, list(range(16)), list(range(16)))
        handler.wait([1], timeout=HANG_GUARD_S)
        assert [len(s) for s in issued_sources(backend)] == [2, 14]  # 8 -> 4 -> 2 pairs
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


class SizedFakeBackend(FakeBackend):
    """A fake that chooses a path by size as the CUDA backend does (``path_for``): ``mid`` from
    ``mid[0]`` to ``mid[1]`` blocks, ``bulk`` otherwise."""

    def __init__(self, mid: tuple[int, int] | None) -> None:
        super().__init__()
        self.mid = mid

    def path_for(self, pairs: int) -> str:
        return "mid" if self.mid is not None and self.mid[0] <= pairs <= self.mid[1] else "bulk"


@pytest.mark.parametrize("mid", [(1, 8), (5, 15), None],
                         ids=["head-would-change-path", "rest-would-change-path", "control-one-path"])
def test_a_costly_job_is_not_split_where_a_part_would_take_another_path(mid: tuple[int, int] | None) -> None:
    """The head cut off a job and its rest each go through the path chosen for their size: where
    either is not the whole job's path (a 20-block lane load had its 10-block head go through
    ``sm``; with size buckets the rest can fall in another bucket), the job is issued whole, by the
    thread. The control, one path at every size, is split as ever."""
    backend = SizedFakeBackend(mid)
    backend.inline = True
    backend.cost_per_block = INLINE_ISSUE_MAX_DESCRIPTORS // 8  # 16 blocks: over the plain limit
    handler = make_handler(backend)
    try:
        handler.submit(1, list(range(16)), list(range(16)))  # a head of 4 fits the head budget
        (result,) = handler.wait([1], timeout=HANG_GUARD_S)
        assert result.ok and result.nbytes == 16 * 4096
        sizes = [len(s) for s in issued_sources(backend)]
        assert sizes == ([16] if mid else [4, 12])
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


@pytest.mark.parametrize("failing", ["head", "rest"])
def test_a_split_job_fails_as_a_whole_when_either_part_fails(failing: str) -> None:
    backend = FakeBackend(auto_finish=False)
    backend.inline = True
    backend.cost_per_block = INLINE_ISSUE_MAX_DESCRIPTORS
    handler = make_handler(backend)
    try:
        handler.submit(1, [0, 1, 2, 3], [0, 1, 2, 3])
        wait_until_issued(backend, 2)
        head, rest = backend.tickets
        (head if failing == "head" else rest).error = CudaError("cuLaunchKernel", 1, "ERR", failing)
        head.finish()
        rest.finish()
        (result,) = handler.wait([1], timeout=HANG_GUARD_S)
        assert not result.ok and str(result.error).endswith(failing)
        assert handler.poll() == []  # one result for the job, never one per part
        assert [t.released for t in backend.tickets] == [1, 1]
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_shutdown_drains_a_split_job_and_reports_it_once() -> None:
    backend = FakeBackend()
    backend.inline = True
    backend.cost_per_block = INLINE_ISSUE_MAX_DESCRIPTORS
    handler = make_handler(backend)
    handler.submit(1, [0, 1, 2, 3], [0, 1, 2, 3])
    handler.shutdown(timeout=HANG_GUARD_S)
    assert handler.stats().completed == 1 and handler.stats().in_flight == 0
    assert backend.fences_taken == backend.fences_released == 1


def test_a_job_never_overtakes_one_queued_before_it() -> None:
    backend = FakeBackend()
    backend.inline = True
    gate = threading.Event()
    order: list[int] = []
    original_issue = backend.issue

    def gated_issue(plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> FakeTicket:
        if int(src[0]) == 0:
            gate.wait(HANG_GUARD_S)  # the first, big job is still being issued on the thread
        order.append(int(src[0]))
        return original_issue(plan, src, dst, fence)

    backend.issue = gated_issue  # type: ignore[method-assign]
    handler = make_handler(backend)
    try:
        backend.inline = False
        handler.submit(1, [0], [0])  # queued: the issuer thread holds it at the gate
        backend.inline = True
        handler.submit(2, [5], [5])  # small, but a job is pending: it must queue behind job 1
        handler.submit(3, [6], [6])
        gate.set()
        handler.wait([1, 2, 3], timeout=HANG_GUARD_S)
        assert order == [0, 5, 6]
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)


def test_threads_submitting_at_once_never_deadlock_and_every_job_comes_back() -> None:
    """The Python issuer's three ways to issue at once from several threads: small jobs on the
    caller's thread, costly ones split (a head here, the rest on the thread) or queued. Every
    thread's jobs come back, in its own submit order, and nothing hangs (the hand-off lock is
    taken under the handler's lock only when no job is pending, so its holder never needs that
    lock again)."""
    backend = FakeBackend()
    backend.inline = True
    backend.cost_per_block = INLINE_ISSUE_MAX_DESCRIPTORS // 2 + 1  # two blocks: over the limit
    handler = make_handler(backend)
    done: dict[int, list[int]] = {}

    def run(thread: int) -> None:
        ids = []
        for k in range(80):
            job = thread * 1000 + k
            blocks = [2 * thread] if k % 2 else [2 * thread, 2 * thread + 1]
            handler.submit(job, blocks, blocks)
            ids.append(job)
            if k % 8 == 7:
                handler.wait(ids[-8:], timeout=HANG_GUARD_S)
        done[thread] = ids

    errors = run_at_once(run, 4, 2 * HANG_GUARD_S)  # fails, without a shutdown, on a deadlock
    try:
        assert not errors
        assert sorted(done) == [0, 1, 2, 3]
        stats = handler.stats()
        assert stats.submitted == stats.completed == 320 and stats.in_flight == 0
    finally:
        handler.shutdown(timeout=HANG_GUARD_S)
