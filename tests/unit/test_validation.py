"""Bad input to Worker.create/store/load/wait on the host backend: every call is refused with its
typed error and a precise message, before anything is submitted, and leaves the worker unchanged
(same stats, no new result, host records and device blocks untouched, a valid job still bit-exact).

A job stays in flight until poll()/wait() returned its result, so the conflict tests keep a job in
flight simply by not polling it: no timing is involved.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from kvoffload import (
    BlockConflictError,
    BlockIdTypeError,
    ClosedError,
    DeviceLayout,
    DeviceMismatchError,
    Direction,
    InvalidArgumentError,
    InvalidBlockIdError,
    JobIdError,
    KVOffloadError,
    TransferResult,
    UnknownJobError,
    Worker,
    WorkerStats,
)
from kvoffload.errors import ArgumentTypeError

NUM_DEVICE_BLOCKS = 16
NUM_HOST_BLOCKS = 8
WAIT_S = 30.0  # a deadline, never a timing assertion: the host backend finishes in microseconds
VALID_STORE_JOB, VALID_LOAD_JOB = 900, 901


def _any(value: object) -> Any:
    """An intentionally ill-typed argument (the runtime check is under test)."""
    return value


def random_bf16(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * 2), dtype=torch.uint8, generator=gen)
    return raw.view(torch.bfloat16)


@pytest.fixture
def layout() -> DeviceLayout:
    gen = torch.Generator().manual_seed(7)
    tensors = {f"l{i}": random_bf16((2, NUM_DEVICE_BLOCKS, 4, 2, 32), gen) for i in range(2)}
    return DeviceLayout.from_tensors(tensors, block_dim=1)


@pytest.fixture
def worker(layout: DeviceLayout) -> Iterator[Worker]:
    w = Worker.create(layout, NUM_HOST_BLOCKS)
    try:
        gen = torch.Generator().manual_seed(8)
        shape = (NUM_HOST_BLOCKS, layout.record_bytes)
        w.host_records().copy_(torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen))
        yield w
    finally:
        w.shutdown()


# -------------------------------------------------------------------------------------- helpers


@attrs.frozen(eq=False)
class Snapshot:
    stats: WorkerStats
    records: torch.Tensor
    device: torch.Tensor


def snapshot(w: Worker) -> Snapshot:
    return Snapshot(
        stats=w.stats(),
        records=w.host_records().clone(),
        device=w.layout.gather_records(range(NUM_DEVICE_BLOCKS)),
    )


def _all_but(n: int, excluded: Sequence[int]) -> list[int]:
    return [i for i in range(n) if i not in excluded]


def _payload_mask(layout: DeviceLayout) -> torch.Tensor:
    mask = torch.zeros(layout.record_bytes, dtype=torch.bool)
    table = layout.page_table
    for offset, size in zip(table.host_offset.tolist(), table.nbytes.tolist()):
        mask[offset : offset + size] = True
    return mask


def host_payload(w: Worker, blocks: Sequence[int]) -> torch.Tensor:
    """The page bytes of host records (a job copies pages; record padding is not part of a block)."""
    return w.host_records()[list(blocks)][:, _payload_mask(w.layout)]


def device_payload(w: Worker, blocks: Sequence[int]) -> torch.Tensor:
    """The page bytes of device blocks, in host-record order."""
    return w.layout.gather_records(list(blocks))[:, _payload_mask(w.layout)]


def assert_unchanged(
    w: Worker,
    before: Snapshot,
    *,
    rejected_job: int | None,
    in_flight: Sequence[int] = (),
    host_written: Sequence[int] = (),
    device_written: Sequence[int] = (),
) -> None:
    """The refused call left no trace; jobs submitted before it still complete normally."""
    assert w.stats() == before.stats
    if in_flight:
        results = w.wait(list(in_flight), WAIT_S)
        assert [r.job_id for r in results] == list(in_flight)
        assert all(r.ok for r in results), results
    assert w.poll() == []
    keep = _all_but(NUM_HOST_BLOCKS, host_written)
    assert torch.equal(w.host_records()[keep], before.records[keep])
    keep = _all_but(NUM_DEVICE_BLOCKS, device_written)
    assert torch.equal(w.layout.gather_records(keep), before.device[keep])
    if rejected_job is not None:
        with pytest.raises(UnknownJobError):  # the refused job was never registered
            w.wait([rejected_job], 0.0)


def assert_valid_jobs_work(w: Worker) -> None:
    """A store and a load submitted now complete with ok=True and move the exact bytes."""
    device_src, host, device_dst = [3, 12], [6, 1], [9, 0]
    w.store(VALID_STORE_JOB, device_src, host)
    (stored,) = w.wait([VALID_STORE_JOB], WAIT_S)
    assert stored.ok and stored.nbytes == 2 * w.layout.block_bytes
    expected = device_payload(w, device_src)
    assert torch.equal(host_payload(w, host), expected)
    w.load(VALID_LOAD_JOB, host, device_dst)
    (loaded,) = w.wait([VALID_LOAD_JOB], WAIT_S)
    assert loaded.ok and loaded.direction is Direction.LOAD
    assert torch.equal(device_payload(w, device_dst), expected)


def assert_error(
    info: pytest.ExceptionInfo[BaseException],
    error: type[BaseException],
    also: tuple[type[BaseException], ...],
) -> None:
    assert type(info.value) is error, f"{type(info.value).__name__} is not exactly {error.__name__}"
    assert isinstance(info.value, KVOffloadError)
    for builtin in also:
        assert isinstance(info.value, builtin), f"{error.__name__} should also be a {builtin.__name__}"


# ------------------------------------------------------------------------ malformed store/load


@attrs.frozen
class BadCall:
    call: Callable[[Worker], object]
    error: type[BaseException]
    also: tuple[type[BaseException], ...]
    match: str


@attrs.frozen
class BadCreate:
    call: Callable[[DeviceLayout], object]
    error: type[BaseException]
    also: tuple[type[BaseException], ...]
    match: str


VALUE = (ValueError,)
TYPE_AND_VALUE = (TypeError, ValueError)

BAD_CALLS = {
    "store-float-tensor-requiring-grad": BadCall(  # an untyped RuntimeError from numpy before
        lambda w: w.store(1, torch.zeros(2, requires_grad=True), [0, 1]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks is not a sequence of ints: .*requires grad",
    ),
    "store-unequal-lengths": BadCall(
        lambda w: w.store(1, [0, 1], [0]), InvalidBlockIdError, VALUE,
        r"device_blocks has 2 ids but host_blocks has 1: they pair up and must have equal lengths",
    ),
    "load-unequal-lengths": BadCall(
        lambda w: w.load(1, [0], [0, 1]), InvalidBlockIdError, VALUE,
        r"host_blocks has 1 ids but device_blocks has 2",
    ),
    "store-device-id-out-of-range": BadCall(
        lambda w: w.store(1, [0, 16], [0, 1]), InvalidBlockIdError, VALUE,
        r"device_blocks\[1\] = 16 is out of range \(the pool has 16 blocks: 0\.\.15\)",
    ),
    "store-host-id-out-of-range": BadCall(
        lambda w: w.store(1, [0, 1], [7, 8]), InvalidBlockIdError, VALUE,
        r"host_blocks\[1\] = 8 is out of range \(the pool has 8 blocks: 0\.\.7\)",
    ),
    "load-host-id-out-of-range": BadCall(
        lambda w: w.load(1, [8], [0]), InvalidBlockIdError, VALUE,
        r"host_blocks\[0\] = 8 is out of range \(the pool has 8 blocks",
    ),
    "load-device-id-out-of-range": BadCall(
        lambda w: w.load(1, [0], np.asarray([100])), InvalidBlockIdError, VALUE,
        r"device_blocks\[0\] = 100 is out of range \(the pool has 16 blocks",
    ),
    "store-negative-device-id": BadCall(
        lambda w: w.store(1, [-1], [0]), InvalidBlockIdError, VALUE,
        r"device_blocks\[0\] = -1 is out of range",
    ),
    "load-negative-host-id": BadCall(
        lambda w: w.load(1, [0, -2], [0, 1]), InvalidBlockIdError, VALUE,
        r"host_blocks\[1\] = -2 is out of range",
    ),
    # numpy ids: the native admission checks their range in its own call (as_block_ids skips it)
    "store-numpy-device-id-out-of-range": BadCall(
        lambda w: w.store(1, np.asarray([0, 16], dtype=np.int32), np.asarray([0, 1])), InvalidBlockIdError,
        VALUE, r"device_blocks\[1\] = 16 is out of range \(the pool has 16 blocks: 0\.\.15\)",
    ),
    "load-numpy-negative-device-id": BadCall(
        lambda w: w.load(1, np.asarray([0, 1]), np.asarray([3, -4])), InvalidBlockIdError, VALUE,
        r"device_blocks\[1\] = -4 is out of range",
    ),
    "store-numpy-uint64-past-int64": BadCall(
        lambda w: w.store(1, np.asarray([0, 2**63 + 5], dtype=np.uint64), np.asarray([0, 1])),
        InvalidBlockIdError, VALUE, r"device_blocks\[1\] = 9223372036854775813 is out of range",
    ),
    "store-numpy-range-before-lengths": BadCall(
        lambda w: w.store(1, np.asarray([0, 99]), np.asarray([0])), InvalidBlockIdError, VALUE,
        r"device_blocks\[1\] = 99 is out of range",
    ),
    "load-numpy-range-before-duplicates": BadCall(
        lambda w: w.load(1, np.asarray([0, 1]), np.asarray([99, 99])), InvalidBlockIdError, VALUE,
        r"device_blocks\[0\] = 99 is out of range",
    ),
    "store-float-id": BadCall(
        lambda w: w.store(1, _any([0, 1.0]), [0, 1]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks\[1\] = 1\.0 is a float, not an int",
    ),
    "load-float-id": BadCall(
        lambda w: w.load(1, [0], _any([2.5])), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks\[0\] = 2\.5 is a float, not an int",
    ),
    "store-bool-id": BadCall(
        lambda w: w.store(1, _any([True]), [0]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks\[0\] = True is a bool, not an int",
    ),
    "store-numpy-bool-array": BadCall(
        lambda w: w.store(1, np.asarray([True, False]), [0, 1]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must hold integers, got dtype bool",
    ),
    "store-string-ids": BadCall(
        lambda w: w.store(1, _any("01"), [0, 1]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must be a sequence of ints, got str",
    ),
    "store-bytearray-ids": BadCall(  # bytes of ids would read as ids 0..255
        lambda w: w.store(1, _any(bytearray(b"\x01")), [0]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must be a sequence of ints, got bytearray",
    ),
    "store-masked-ids": BadCall(  # the mask was dropped: masked-out ids were moved
        lambda w: w.store(1, np.ma.masked_array([0, 1], mask=[False, True]), [0, 1]), BlockIdTypeError,
        TYPE_AND_VALUE, r"device_blocks is a masked array: its mask would be ignored",
    ),
    "load-memoryview-ids": BadCall(
        lambda w: w.load(1, _any(memoryview(b"\x01")), [0]), BlockIdTypeError, TYPE_AND_VALUE,
        r"host_blocks must be a sequence of ints, got memoryview",
    ),
    "store-string-id-element": BadCall(
        lambda w: w.store(1, [0], _any(["1"])), BlockIdTypeError, TYPE_AND_VALUE,
        r"host_blocks\[0\] = '1' is a str, not an int",
    ),
    "store-nested-list": BadCall(
        lambda w: w.store(1, _any([[0, 1]]), [0]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks\[0\] = \[0, 1\] is a list, not an int",
    ),
    "load-2d-numpy-array": BadCall(
        lambda w: w.load(1, np.asarray([[0, 1]]), [0, 1]), BlockIdTypeError, TYPE_AND_VALUE,
        r"host_blocks must be one-dimensional, got shape \(1, 2\)",
    ),
    "store-numpy-float-array": BadCall(
        lambda w: w.store(1, _any(np.asarray([0.0, 1.0])), [0, 1]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must hold integers, got dtype float64",
    ),
    "load-torch-float-tensor": BadCall(
        lambda w: w.load(1, _any(torch.tensor([0.0])), [0]), BlockIdTypeError, TYPE_AND_VALUE,
        r"host_blocks must hold integers, got dtype float32",
    ),
    # an empty array of another dtype was an empty job (found by an API audit)
    "store-empty-float-array": BadCall(
        lambda w: w.store(1, _any(np.zeros(0)), []), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must hold integers, got dtype float64",
    ),
    "load-empty-bool-tensor": BadCall(
        lambda w: w.load(1, [], _any(torch.zeros(0, dtype=torch.bool))), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must hold integers, got dtype bool",
    ),
    "store-none": BadCall(
        lambda w: w.store(1, _any(None), [0]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must be a sequence of ints, got NoneType",
    ),
    "load-none": BadCall(
        lambda w: w.load(1, [0], _any(None)), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must be a sequence of ints, got NoneType",
    ),
    "store-scalar-id": BadCall(
        lambda w: w.store(1, _any(3), [0]), BlockIdTypeError, TYPE_AND_VALUE,
        r"device_blocks must be a sequence of ints, got a scalar 3",
    ),
    "store-duplicate-host-destination": BadCall(
        lambda w: w.store(1, [0, 1, 2], [3, 5, 3]), InvalidBlockIdError, VALUE,
        r"host_blocks\[2\] = 3 repeats an earlier destination: each block may be written once per job",
    ),
    "load-duplicate-device-destination": BadCall(
        lambda w: w.load(1, [0, 1], [9, 9]), InvalidBlockIdError, VALUE,
        r"device_blocks\[1\] = 9 repeats an earlier destination",
    ),
    "job-id-float": BadCall(
        lambda w: w.store(_any(1.0), [0], [0]), JobIdError, VALUE,
        r"job_id must be an int, got float 1\.0",
    ),
    "job-id-str": BadCall(
        lambda w: w.load(_any("1"), [0], [0]), JobIdError, VALUE,
        r"job_id must be an int, got str '1'",
    ),
    "job-id-bool": BadCall(
        lambda w: w.store(_any(True), [0], [0]), JobIdError, VALUE,
        r"job_id must be an int, got bool True",
    ),
    "job-id-none": BadCall(
        lambda w: w.load(_any(None), [0], [0]), JobIdError, VALUE,
        r"job_id must be an int, got NoneType None",
    ),
    "store-stream-on-host-backend": BadCall(
        lambda w: w.store(1, [0], [0], stream=object()), DeviceMismatchError, VALUE,
        r"the host backend takes no stream \(got object\)",
    ),
    "load-stream-on-host-backend": BadCall(
        lambda w: w.load(1, [0], [0], stream="cuda:0"), DeviceMismatchError, VALUE,
        r"the host backend takes no stream \(got str\)",
    ),
}


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in BAD_CALLS.items()])
def test_malformed_job_is_refused_and_leaves_worker_unchanged(worker: Worker, case: BadCall) -> None:
    before = snapshot(worker)
    with pytest.raises(case.error, match=case.match) as info:
        case.call(worker)
    assert_error(info, case.error, case.also)
    assert_unchanged(worker, before, rejected_job=1)
    assert_valid_jobs_work(worker)


# ---------------------------------------------------------------------------------------- wait


BAD_WAITS = {
    "unknown-job-next-to-a-known-one": BadCall(
        lambda w: w.wait([7, 42], WAIT_S), UnknownJobError, (KeyError,),
        r"^job\(s\) \[42\] are neither in flight nor waiting to be polled$",
    ),
    "negative-timeout": BadCall(
        lambda w: w.wait([7], -1.0), InvalidArgumentError, VALUE,
        r"timeout = -1\.0 must be finite and >= 0 seconds",
    ),
    "nan-timeout": BadCall(
        lambda w: w.wait([7], float("nan")), InvalidArgumentError, VALUE,
        r"timeout = nan must be finite and >= 0 seconds",
    ),
    "infinite-timeout": BadCall(
        lambda w: w.wait([7], float("inf")), InvalidArgumentError, VALUE,
        r"timeout = inf must be finite and >= 0 seconds",
    ),
    "timeout-over-threading-max": BadCall(  # a lock's wait would raise OverflowError
        lambda w: w.wait([7], 1e10), InvalidArgumentError, VALUE,
        r"timeout = 10000000000\.0 must be finite and >= 0 seconds \(at most 9\.22e\+09\)",
    ),
    "huge-int-timeout": BadCall(  # too large for a float: not an OverflowError
        lambda w: w.wait([7], 10**400), InvalidArgumentError, VALUE,
        r"timeout = 1000+ must be finite and >= 0 seconds",
    ),
    "string-timeout": BadCall(
        lambda w: w.wait([7], _any("1")), ArgumentTypeError, TYPE_AND_VALUE,
        r"timeout must be a number of seconds, got '1'",
    ),
    "duplicate-ids": BadCall(
        lambda w: w.wait([7, 7], WAIT_S), JobIdError, VALUE, r"job_ids lists job 7 more than once",
    ),
    "string-ids": BadCall(
        lambda w: w.wait(_any("7"), WAIT_S), JobIdError, VALUE,
        r"job_ids must be a sequence of ints, got str",
    ),
    "float-id": BadCall(
        lambda w: w.wait(_any([7.0]), WAIT_S), JobIdError, VALUE,
        r"job_id must be an int, got float 7\.0",
    ),
    # a plain TypeError from iterating it (found by an API audit)
    "0-d-array-ids": BadCall(
        lambda w: w.wait(_any(np.asarray(7)), WAIT_S), JobIdError, VALUE,
        r"job_ids must be a sequence of ints, got ndarray of 0 dimensions",
    ),
    "0-d-tensor-ids": BadCall(
        lambda w: w.wait(_any(torch.tensor(7)), WAIT_S), JobIdError, VALUE,
        r"job_ids must be a sequence of ints, got Tensor of 0 dimensions",
    ),
    "2-d-array-ids": BadCall(
        lambda w: w.wait(_any(np.asarray([[7]])), WAIT_S), JobIdError, VALUE,
        r"job_ids must be a sequence of ints, got ndarray of 2 dimensions",
    ),
    # read as job 7 (found by an API audit); block ids refuse bytes-like objects too
    "bytearray-ids": BadCall(
        lambda w: w.wait(_any(bytearray(b"\x07")), WAIT_S), JobIdError, VALUE,
        r"job_ids must be a sequence of ints, got bytearray$",
    ),
    "memoryview-ids": BadCall(
        lambda w: w.wait(_any(memoryview(b"\x07")), WAIT_S), JobIdError, VALUE,
        r"job_ids must be a sequence of ints, got memoryview$",
    ),
}


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in BAD_WAITS.items()])
def test_malformed_wait_is_refused_and_keeps_the_pending_job(worker: Worker, case: BadCall) -> None:
    worker.store(7, [3], [2])
    before = snapshot(worker)
    with pytest.raises(case.error, match=case.match) as info:
        case.call(worker)
    assert_error(info, case.error, case.also)
    assert_unchanged(worker, before, rejected_job=None, in_flight=[7], host_written=[2])
    assert torch.equal(host_payload(worker, [2]), device_payload(worker, [3]))
    assert_valid_jobs_work(worker)


def test_wait_for_a_job_already_returned_raises_unknown_job(worker: Worker) -> None:
    worker.store(1, [3], [2])
    assert [r.job_id for r in worker.wait([1], WAIT_S)] == [1]
    with pytest.raises(UnknownJobError, match=r"job\(s\) \[1\] are neither in flight") as info:
        worker.wait([1], WAIT_S)
    assert_error(info, UnknownJobError, (KeyError,))


# -------------------------------------------------------------------------------------- job ids


def test_job_id_in_flight_is_refused_in_both_directions_and_reusable_after_wait(
    worker: Worker,
) -> None:
    worker.store(1, [3], [2])
    before = snapshot(worker)
    again: list[Callable[[], None]] = [
        lambda: worker.store(1, [4], [5]),
        lambda: worker.load(1, [0], [10]),
    ]
    for submit in again:
        with pytest.raises(JobIdError, match=r"job 1 is already in flight or waiting to be polled") as info:
            submit()
        assert_error(info, JobIdError, VALUE)
    # Ids out of range are named first, as ever, numpy ones too (their range is checked late).
    for ids, name in ((np.asarray([2**63 + 1], dtype=np.uint64), "device_blocks"),
                      (np.asarray([-3]), "device_blocks")):
        with pytest.raises(InvalidBlockIdError, match=rf"{name}\[0\] = {int(ids[0])} is out of range"):
            worker.store(1, ids, np.asarray([5]))
    assert_unchanged(worker, before, rejected_job=1, in_flight=[1], host_written=[2])

    worker.load(1, [2], [10])
    (result,) = worker.wait([1], WAIT_S)
    assert result.ok and result.direction is Direction.LOAD
    assert torch.equal(device_payload(worker, [10]), device_payload(worker, [3]))


def test_job_id_waiting_to_be_polled_is_refused_until_polled(worker: Worker) -> None:
    worker.store(1, [], [])  # an empty job finishes at submit and waits to be polled
    before = snapshot(worker)
    with pytest.raises(JobIdError, match=r"job 1 is already in flight or waiting to be polled") as info:
        worker.load(1, [0], [10])
    assert_error(info, JobIdError, VALUE)
    assert worker.stats() == before.stats
    assert [r.job_id for r in worker.poll()] == [1]

    worker.load(1, [0], [10])
    assert [r.ok for r in worker.wait([1], WAIT_S)] == [True]
    assert torch.equal(device_payload(worker, [10]), host_payload(worker, [0]))


# ------------------------------------------------------------------------------------ conflicts


@attrs.frozen
class Job:
    direction: Direction
    src: list[int]
    dst: list[int]

    def submit(self, w: Worker, job_id: int) -> None:
        if self.direction is Direction.STORE:
            w.store(job_id, self.src, self.dst)
        else:
            w.load(job_id, self.src, self.dst)

    @property
    def host_written(self) -> list[int]:
        return self.dst if self.direction is Direction.STORE else []

    @property
    def device_written(self) -> list[int]:
        return self.dst if self.direction is Direction.LOAD else []


def store(src: list[int], dst: list[int]) -> Job:
    return Job(Direction.STORE, src, dst)


def load(src: list[int], dst: list[int]) -> Job:
    return Job(Direction.LOAD, src, dst)


CONFLICTS = [
    pytest.param(
        load([0], [4]), store([7, 4], [5, 6]),
        r"store job 2: device_blocks\[1\] = 4 is being written by in-flight job 1 \(load\); "
        r"submit after it completed",
        id="store-reads-device-block-a-load-writes",
    ),
    pytest.param(
        store([3], [2]), load([5, 2], [8, 9]),
        r"load job 2: host_blocks\[1\] = 2 is being written by in-flight job 1 \(store\)",
        id="load-reads-host-block-a-store-writes",
    ),
    pytest.param(
        load([2], [9]), store([3], [2]),
        r"store job 2: host_blocks\[0\] = 2 is in use by in-flight job 1 \(load\)",
        id="store-writes-host-block-a-load-reads",
    ),
    pytest.param(
        store([3], [2]), store([4, 5], [0, 2]),
        r"store job 2: host_blocks\[1\] = 2 is in use by in-flight job 1 \(store\)",
        id="store-writes-host-block-a-store-writes",
    ),
    pytest.param(
        store([3], [2]), load([5], [3]),
        r"load job 2: device_blocks\[0\] = 3 is in use by in-flight job 1 \(store\)",
        id="load-writes-device-block-a-store-reads",
    ),
    pytest.param(
        load([5], [3]), load([6, 0], [11, 3]),
        r"load job 2: device_blocks\[1\] = 3 is in use by in-flight job 1 \(load\)",
        id="load-writes-device-block-a-load-writes",
    ),
]


@pytest.mark.parametrize(("blocker", "conflicting", "match"), CONFLICTS)
def test_job_conflicting_with_an_in_flight_job_is_refused_until_it_completed(
    worker: Worker, blocker: Job, conflicting: Job, match: str
) -> None:
    blocker.submit(worker, 1)  # in flight until its result is returned: it is not polled here
    before = snapshot(worker)
    with pytest.raises(BlockConflictError, match=match) as info:
        conflicting.submit(worker, 2)
    assert_error(info, BlockConflictError, VALUE)
    assert_unchanged(
        worker, before, rejected_job=2, in_flight=[1],
        host_written=blocker.host_written, device_written=blocker.device_written,
    )
    if blocker.direction is Direction.STORE:
        assert torch.equal(host_payload(worker, blocker.dst), device_payload(worker, blocker.src))
    else:
        assert torch.equal(device_payload(worker, blocker.dst), host_payload(worker, blocker.src))

    conflicting.submit(worker, 2)  # what the message promises: accepted once job 1 completed
    (result,) = worker.wait([2], WAIT_S)
    assert result.ok
    assert_valid_jobs_work(worker)


def test_two_stores_may_read_the_same_device_block(worker: Worker) -> None:
    worker.store(1, [3], [0])
    worker.store(2, [3], [1])
    assert [(r.job_id, r.ok) for r in worker.wait([1, 2], WAIT_S)] == [(1, True), (2, True)]
    expected = device_payload(worker, [3, 3])
    assert torch.equal(host_payload(worker, [0, 1]), expected)


def test_two_loads_may_read_the_same_host_block(worker: Worker) -> None:
    worker.load(1, [2], [8])
    worker.load(2, [2], [9])
    assert [(r.job_id, r.ok) for r in worker.wait([1, 2], WAIT_S)] == [(1, True), (2, True)]
    assert torch.equal(device_payload(worker, [8, 9]), host_payload(worker, [2, 2]))


def test_one_job_may_read_the_same_source_twice(worker: Worker) -> None:
    worker.store(1, [3, 3], [0, 1])
    worker.load(2, [5, 5], [8, 9])
    assert [r.ok for r in worker.wait([1, 2], WAIT_S)] == [True, True]
    assert torch.equal(host_payload(worker, [0, 1]), device_payload(worker, [3, 3]))
    assert torch.equal(device_payload(worker, [8, 9]), host_payload(worker, [5, 5]))


# ----------------------------------------------------------------------------------- empty jobs


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
@pytest.mark.parametrize(
    "empty", [pytest.param([], id="list"), pytest.param(np.zeros(0, dtype=np.int64), id="numpy")]
)
def test_empty_job_completes_at_submit_with_ok_and_no_bytes(
    worker: Worker, direction: Direction, empty: Any
) -> None:
    before = snapshot(worker)
    if direction is Direction.STORE:
        worker.store(1, empty, empty)
    else:
        worker.load(1, empty, empty)
    assert worker.poll() == [
        TransferResult(job_id=1, direction=direction, ok=True, nbytes=0, seconds=0.0, path="none")
    ]
    counters = worker.stats().store if direction is Direction.STORE else worker.stats().load
    assert (counters.submitted, counters.completed, counters.failed, counters.in_flight) == (1, 1, 0, 0)
    assert counters.bytes_done == 0
    assert torch.equal(worker.host_records(), before.records)
    assert torch.equal(worker.layout.gather_records(range(NUM_DEVICE_BLOCKS)), before.device)
    assert_valid_jobs_work(worker)


def test_empty_job_with_a_stream_on_the_host_backend_is_refused(worker: Worker) -> None:
    with pytest.raises(DeviceMismatchError, match=r"the host backend takes no stream"):
        worker.store(1, [], [], stream=object())


# --------------------------------------------------------------------------------- after close


AFTER_SHUTDOWN: dict[str, Callable[[Worker], object]] = {
    "store": lambda w: w.store(1, [0], [0]),
    "load": lambda w: w.load(1, [0], [0]),
    "poll": lambda w: w.poll(),
    "wait": lambda w: w.wait([1], WAIT_S),
    "host_records": lambda w: w.host_records(),
}


@pytest.mark.parametrize("call", [pytest.param(c, id=n) for n, c in AFTER_SHUTDOWN.items()])
def test_calls_after_shutdown_raise_closed_error(
    worker: Worker, call: Callable[[Worker], object]
) -> None:
    worker.store(1, [3], [2])  # shutdown drains it
    worker.shutdown()
    with pytest.raises(ClosedError, match=r"^the worker was shut down: build another with Worker.create$") as info:
        call(worker)
    assert_error(info, ClosedError, ())
    assert not isinstance(info.value, ValueError)  # "you closed it" is not "bad argument"


def test_shutdown_twice_is_a_no_op(worker: Worker) -> None:
    worker.store(1, [3], [2])
    worker.shutdown()
    stats = worker.stats()
    assert stats.store.completed == 1 and stats.store.in_flight == 0
    worker.shutdown()
    worker.shutdown(timeout=0.0)
    assert worker.closed
    assert worker.stats() == stats


# -------------------------------------------------------------------------------------- create


def _kvoffload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvoffload-")]


BAD_CREATES = {
    "zero-host-blocks": BadCreate(
        lambda lay: Worker.create(lay, 0), InvalidArgumentError, VALUE,
        r"num_host_blocks = 0 must be a positive int",
    ),
    "negative-host-blocks": BadCreate(
        lambda lay: Worker.create(lay, -1), InvalidArgumentError, VALUE,
        r"num_host_blocks = -1 must be a positive int",
    ),
    "bool-host-blocks": BadCreate(
        lambda lay: Worker.create(lay, True), ArgumentTypeError, TYPE_AND_VALUE,
        r"num_host_blocks = True must be a positive int",
    ),
    "float-host-blocks": BadCreate(
        lambda lay: Worker.create(lay, _any(1.5)), ArgumentTypeError, TYPE_AND_VALUE,
        r"num_host_blocks = 1\.5 must be a positive int",
    ),
    "host-pool-past-a-mapping": BadCreate(  # an untyped OverflowError with check_memory=False before
        lambda lay: Worker.create(lay, 2**63, check_memory=False), InvalidArgumentError, VALUE,
        r"num_host_blocks = 9223372036854775808: a host pool of 9223372036854775808 records of \d+ "
        r"bytes is past the 9223372036854775807 bytes a mapping can have",
    ),
    "unknown-backend": BadCreate(
        lambda lay: Worker.create(lay, 8, backend=_any("gpu")), InvalidArgumentError, VALUE,
        r"backend = 'gpu' must be one of auto, cuda, host",
    ),
    "array-backend": BadCreate(  # numpy's "truth value is ambiguous" before
        lambda lay: Worker.create(lay, 8, backend=_any(np.array(["host"]))), ArgumentTypeError,
        TYPE_AND_VALUE, r"backend = array\(\['host'\].* must be a str, not a ndarray",
    ),
    "array-path": BadCreate(
        lambda lay: Worker.create(lay, 8, path=_any(np.array(["auto"]))), ArgumentTypeError,
        TYPE_AND_VALUE, r"path = array\(\['auto'\].* must be a str, not a ndarray",
    ),
    "int-calibration-path": BadCreate(  # open(5) would have opened (and closed) file descriptor 5
        lambda lay: Worker.create(lay, 8, calibration_path=_any(5)), ArgumentTypeError,
        TYPE_AND_VALUE, r"calibration_path = 5 must be a path \(str or os\.PathLike\) or None",
    ),
    "string-pinner": BadCreate(
        lambda lay: Worker.create(lay, 8, pinner=_any("x")), ArgumentTypeError, TYPE_AND_VALUE,
        r"pinner = 'x' must have register\(ptr, nbytes\) and unregister\(ptr\)",
    ),
    "factory-of-no-backend": BadCreate(
        lambda lay: Worker.create(lay, 8, backend_factory=lambda d: _any(object())), ArgumentTypeError,
        TYPE_AND_VALUE, r"backend_factory\('store'\) returned <object object at .*>, which has no fence, "
                        r"release_fence, issue, issue_cost, release",
    ),
    "string-bounce-slots-without-disk": BadCreate(
        lambda lay: Worker.create(lay, 8, bounce_slots=_any("x")), ArgumentTypeError, TYPE_AND_VALUE,
        r"bounce_slots = 'x' must be an int >= 2, not a str",
    ),
    "string-pin-chunk-bytes": BadCreate(  # was InvalidArgumentError naming "chunk_bytes"
        lambda lay: Worker.create(lay, 8, pin_chunk_bytes=_any("x")), ArgumentTypeError, TYPE_AND_VALUE,
        r"pin_chunk_bytes = 'x' must be a positive int, not a str",
    ),
    "zero-pin-chunk-bytes": BadCreate(
        lambda lay: Worker.create(lay, 8, pin_chunk_bytes=0), InvalidArgumentError, VALUE,
        r"pin_chunk_bytes = 0 must be a positive int",
    ),
    "int-shared-name": BadCreate(
        lambda lay: Worker.create(lay, 8, shared_name=_any(5)), ArgumentTypeError, TYPE_AND_VALUE,
        r"shared_name = 5 must be a str, not a int",
    ),
    "cuda-backend-for-cpu-tensors": BadCreate(
        lambda lay: Worker.create(lay, 8, backend="cuda"), DeviceMismatchError, VALUE,
        r"backend 'cuda' needs CUDA tensors; the layout is on cpu",
    ),
    "copy-method-on-host-backend": BadCreate(
        lambda lay: Worker.create(lay, 8, copy_method="per-copy"), InvalidArgumentError, VALUE,
        r"copy_method = .per-copy. applies to the cuda backend only \(backend is 'host'\)",
    ),
    "shared-name-with-parent-dir": BadCreate(
        lambda lay: Worker.create(lay, 8, shared_name="../x"), InvalidArgumentError, VALUE,
        r"shared_name = '\.\./x' must be 1-200 characters of letters, digits",
    ),
    "shared-name-empty": BadCreate(
        lambda lay: Worker.create(lay, 8, shared_name=""), InvalidArgumentError, VALUE,
        r"shared_name = '' must be 1-200 characters",
    ),
    "shared-name-with-slash": BadCreate(
        lambda lay: Worker.create(lay, 8, shared_name="a/b"), InvalidArgumentError, VALUE,
        r"shared_name = 'a/b' must be 1-200 characters",
    ),
    "layout-not-a-device-layout": BadCreate(
        lambda lay: Worker.create(_any(dict(lay.tensors)), 8), ArgumentTypeError, TYPE_AND_VALUE,
        r"layout must be a DeviceLayout \(from DeviceLayout\.from_tensors\), got dict",
    ),
    "device-cuda-for-cpu-layout": BadCreate(
        lambda lay: Worker.create(lay, 8, device="cuda:0"), DeviceMismatchError, VALUE,
        r"device = cuda:0 but the layout's tensors are on cpu",
    ),
    "device-meta-for-cpu-layout": BadCreate(
        lambda lay: Worker.create(lay, 8, device=torch.device("meta")), DeviceMismatchError, VALUE,
        r"device = meta but the layout's tensors are on cpu",
    ),
    "device-not-a-device": BadCreate(
        lambda lay: Worker.create(lay, 8, device="nonsense"), DeviceMismatchError, VALUE,
        r"device = 'nonsense' is not a torch device",
    ),
}


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in BAD_CREATES.items()])
def test_bad_create_arguments_are_refused_with_nothing_left_running(
    layout: DeviceLayout, case: BadCreate
) -> None:
    threads_before = _kvoffload_threads()
    with pytest.raises(case.error, match=case.match) as info:
        case.call(layout)
    assert_error(info, case.error, case.also)
    assert _kvoffload_threads() == threads_before
    with Worker.create(layout, NUM_HOST_BLOCKS, device="cpu", backend="host") as w:
        assert_valid_jobs_work(w)


@pytest.mark.parametrize("size", [pytest.param(1.5, id="float"), pytest.param(True, id="bool")])
def test_pool_size_of_the_wrong_type_raises_argument_type_error(
    layout: DeviceLayout, size: object
) -> None:
    with pytest.raises(ArgumentTypeError, match=r"num_host_blocks = .* must be a positive int") as info:
        Worker.create(layout, _any(size))
    assert isinstance(info.value, TypeError)


def test_timeout_that_is_not_a_number_is_a_type_error(worker: Worker) -> None:
    with pytest.raises(TypeError, match=r"timeout must be a number of seconds, got '1'"):
        worker.wait([], _any("1"))
