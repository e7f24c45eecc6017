"""The reusable worker contract (kvoffload.testing) holds for the host backend, and it catches a
worker that breaks a clause: one defect per broken worker, each once passed by the suite (found by
mutation testing of the suite) unless noted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import pytest
import torch

from kvoffload import DeviceLayout, Direction, InvalidArgumentError, TransferResult, Worker
from kvoffload._layer_load import HostLayerMarks
from kvoffload.backends.host import HostBackend
from kvoffload.cli._caches import build_cache
from kvoffload.testing import check_worker_contract
from tests.unit._wrappers import Wrapper


def layout(num_blocks: int = 64) -> DeviceLayout:
    tensors, block_dim = build_cache("per-layer", num_blocks=num_blocks, layers=2, kv_heads=2, head_dim=32,
                                     block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim)


def make(backend: Callable[[Direction], HostBackend] = HostBackend, num_blocks: int = 64,
         host_blocks: int = 32) -> Worker:
    return Worker.create(layout(num_blocks), host_blocks, backend_factory=backend)


def test_the_host_backend_keeps_the_worker_contract() -> None:
    assert layout().layers is not None  # the layer clause runs
    check_worker_contract(make)


def test_a_worker_with_the_expedited_lane_keeps_the_worker_contract() -> None:
    check_worker_contract(lambda: Worker.create(layout(), 32, expedited_loads=True))


def _lanes(expedited: Callable[[Direction], HostBackend]) -> Worker:
    """A worker whose expedited lane's backend is ``expedited``'s (the regular lanes' are sound)."""
    made: list[int] = []

    def factory(direction: Direction) -> HostBackend:
        made.append(1)
        return expedited(direction) if len(made) == 3 else HostBackend(direction)

    return Worker.create(layout(), 32, backend_factory=factory, expedited_loads=True)


def _regular_only() -> Worker:
    """A worker with the lane whose ``load`` sends every load through the regular lane."""
    w = Worker.create(layout(), 32, expedited_loads=True)
    regular = w.load

    def load(job_id: int, host_blocks: Any, device_blocks: Any, *, stream: object = None,
             expedited: bool = False) -> None:
        regular(job_id, host_blocks, device_blocks, stream=stream)

    w.load = load  # type: ignore[method-assign]
    return w


@pytest.mark.parametrize(("make_worker", "what"), [
    (lambda: _lanes(DroppingBackend), "an expedited load's blocks differ"),
    (_regular_only, r"counted \(expedited, load\) = \(0, 1\)"),
], ids=["expedited lane drops pages", "expedited loads in the regular lane"])
def test_the_contract_catches_a_broken_expedited_lane(make_worker: Callable[[], Worker], what: str) -> None:
    with pytest.raises(AssertionError, match=rf"worker contract, 'expedited loads .*': .*{what}"):
        check_worker_contract(make_worker)


def test_the_smallest_worker_the_suite_takes_keeps_it_and_a_smaller_one_is_refused() -> None:
    check_worker_contract(lambda: make(num_blocks=16, host_blocks=8))
    with pytest.raises(InvalidArgumentError, match="8 device blocks and 4 host blocks; the contract suite "
                       "needs at least 16 and 8"):
        check_worker_contract(lambda: make(num_blocks=8, host_blocks=4))


# ----------------------------------------------------------------------- broken backends


class DroppingBackend(HostBackend):
    """Skips every other page (the suite caught this one before)."""

    def __init__(self, direction: Direction) -> None:
        super().__init__(direction)
        self.count = 0

    def copy_one(self, dst: int, src: int, size: int) -> None:
        self.count += 1
        if self.count % 2:
            super().copy_one(dst, src, size)


class OnlyFirstJobCopies(HostBackend):
    """Every job after a direction's first reports ok and copies nothing (stale descriptors)."""

    def __init__(self, direction: Direction) -> None:
        super().__init__(direction)
        self.jobs = 0

    def _copy(self, plan: Any, src: Any, dst: Any) -> None:
        self.jobs += 1
        if self.jobs == 1:
            super()._copy(plan, src, dst)


class LoadWritesAnExtraBlock(HostBackend):
    """A load also writes its first record into a device block the job does not name."""

    def _copy(self, plan: Any, src: Any, dst: Any) -> None:
        super()._copy(plan, src, dst)
        if self.direction is Direction.LOAD and len(dst):
            extra = next(b for b in range(64) if b not in set(dst.tolist()))
            super()._copy(plan, src[:1], np.array([extra], dtype=np.int64))


class LayersMarkedBeforeTheCopy(HostBackend):
    """A layer-by-layer load marks every layer landed before it copies."""

    def issue_layers(self, plans: Any, src: Any, dst: Any, fence: Any, marks: Any, first: int = 0) -> Any:
        for layer in range(first, first + len(plans)):
            marks.mark(layer)
        time.sleep(0.2)
        return super().issue_layers(plans, src, dst, fence, HostLayerMarks(first + len(plans)), first)


@pytest.mark.parametrize(("backend", "clause", "what"), [
    (DroppingBackend, "round trips are bit-exact", "host records differ"),
    (OnlyFirstJobCopies, "round trips are bit-exact", "store job 2: host records differ"),
    (LoadWritesAnExtraBlock, "round trips are bit-exact", "a load changed a device block outside its job"),
    (LayersMarkedBeforeTheCopy, "each layer has landed by its wait_layer", "layer 0 had not landed"),
], ids=lambda v: getattr(v, "__name__", None))
def test_the_contract_catches_a_broken_backend(backend: Callable[[Direction], HostBackend], clause: str,
                                               what: str) -> None:
    with pytest.raises(AssertionError, match=rf"worker contract, '{clause}.*': .*{what}"):
        check_worker_contract(lambda: make(backend))


# ----------------------------------------------------------------------- broken wrappers


class WaitReturnsWhatIsDone(Wrapper):
    """``wait(ids)`` returns whichever results came first."""

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[TransferResult]:
        done: list[TransferResult] = []
        while len(done) < len(job_ids):
            done += self.inner.poll()
        return done[: len(job_ids)]


class IdsUniquePerDirection(Wrapper):
    """A load may take the id of a store in flight (the wrapper books load ids apart)."""

    SHIFT = 10_000

    def __init__(self, inner: Worker) -> None:
        super().__init__(inner)
        self.loads: set[int] = set()

    def load(self, job_id: int, host_blocks: Any, device_blocks: Any, **kwargs: Any) -> None:
        self.inner.load(job_id + self.SHIFT, host_blocks, device_blocks, **kwargs)
        self.loads.add(job_id)

    def _back(self, results: list[TransferResult]) -> list[TransferResult]:
        import attrs
        out = []
        for r in results:
            if r.job_id >= self.SHIFT:
                self.loads.discard(r.job_id - self.SHIFT)
                r = attrs.evolve(r, job_id=r.job_id - self.SHIFT)
            out.append(r)
        return out

    def poll(self) -> list[TransferResult]:
        return self._back(self.inner.poll())

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[TransferResult]:
        inner = [j + self.SHIFT if j in self.loads else j for j in job_ids]
        return self._back(self.inner.wait(inner, timeout))


class ConflictsAsJobIdErrors(Wrapper):
    """A block conflict comes back as a JobIdError."""

    def load(self, job_id: int, host_blocks: Any, device_blocks: Any, **kwargs: Any) -> None:
        from kvoffload import BlockConflictError, JobIdError
        try:
            self.inner.load(job_id, host_blocks, device_blocks, **kwargs)
        except BlockConflictError as exc:
            raise JobIdError(str(exc)) from exc


class FailuresCountedAsBytes(Wrapper):
    """stats() counts each job's bytes twice."""

    def stats(self) -> Any:
        import attrs
        s = self.inner.stats()
        return attrs.evolve(s, store=attrs.evolve(s.store, bytes_done=2 * s.store.bytes_done))


class WaitNeverReturns(Wrapper):
    """``wait`` ignores its deadline (a lost result hangs it)."""

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[TransferResult]:
        threading.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.parametrize(("wrapper", "clause", "what"), [
    (WaitReturnsWhatIsDone, "results come back once", r"wait\(\[102\]\) returned \[100\]"),
    (IdsUniquePerDirection, "a job id is unique", "a load with the id of a store not returned was accepted"),
    (ConflictsAsJobIdErrors, "in-flight conflicts", "raised JobIdError .*, not BlockConflictError"),
    (FailuresCountedAsBytes, "round trips", r"stats\(\)\.store counted"),
], ids=lambda v: getattr(v, "__name__", None))
def test_the_contract_catches_a_broken_wrapper(wrapper: type[Wrapper], clause: str, what: str) -> None:
    with pytest.raises(AssertionError, match=rf"worker contract, '{clause}.*': .*{what}"):
        check_worker_contract(lambda: cast(Worker, wrapper(make())))


def test_a_clause_past_its_deadline_is_reported_not_waited_for_ever() -> None:
    """(A wait that ignored its deadline hung the suite.) The clause's thread is left behind."""
    began = time.monotonic()
    with pytest.raises(AssertionError, match="'round trips.*': did not finish within 12 s"):
        check_worker_contract(lambda: cast(Worker, WaitNeverReturns(make())), timeout_s=0.25)
    assert time.monotonic() - began < 60


def test_an_unexpected_exception_is_reported_with_its_clause() -> None:
    class Raising(Wrapper):
        def poll(self) -> list[TransferResult]:
            raise RuntimeError("poll broke")

    with pytest.raises(AssertionError, match="'results come back once.*': raised RuntimeError: poll broke"):
        check_worker_contract(lambda: cast(Worker, Raising(make())))


def test_each_clause_runs_with_the_callers_grad_mode_and_a_skip_stays_a_skip() -> None:
    """(Clauses run on threads of their own: the factory saw grad on under ``no_grad``, and a
    ``pytest.skip`` in it came back as the clause's failure.)"""
    seen: list[bool] = []

    def recording() -> Worker:
        seen.append(torch.is_grad_enabled())
        return make()

    with torch.no_grad():
        check_worker_contract(recording)
    assert seen and not any(seen)
    with pytest.raises(pytest.skip.Exception):
        check_worker_contract(lambda: pytest.skip("no device here"))


def test_clauses_runs_the_named_clauses_only_and_bad_names_are_refused_before_any_runs() -> None:
    from kvoffload.testing import CLAUSES
    built: list[int] = []

    def counting() -> Worker:
        built.append(1)
        return make()

    held = "a job held on the device keeps its deadlines, counters and layer order"
    assert held in CLAUSES
    check_worker_contract(counting, clauses=["empty jobs complete", held])  # held: nothing to hold on a CPU worker
    assert len(built) == 2
    check_worker_contract(lambda: cast(Worker, WaitReturnsWhatIsDone(make())), clauses=["empty jobs complete"])
    for bad, what in [(["no such clause"], r"names \['no such clause'\], not clauses of the suite"),
                      ("empty jobs complete", "not the string"), ([], "names no clause"),
                      ([3], r"names \[3\]")]:
        with pytest.raises(InvalidArgumentError, match=what):
            check_worker_contract(counting, clauses=bad)  # type: ignore[arg-type]
    assert len(built) == 2


def test_a_device_hold_is_refused_off_cuda_with_a_typed_error() -> None:
    from kvoffload.testing import DeviceHold
    with pytest.raises(InvalidArgumentError, match="needs a CUDA device, not cpu"):
        DeviceHold(torch.device("cpu"), 1.0)
    for limit in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(InvalidArgumentError, match="limit_s must be a finite number"):
            DeviceHold(torch.device("cuda", 0), limit)  # type: ignore[arg-type]
