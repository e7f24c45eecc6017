"""The native issuer on CPU, built with this machine's compiler and driven through a fake driver
(:mod:`tests.unit._native_fake`): every path moves exactly the right bytes (checked by provenance,
through the staging ring too), DMA descriptors merge as the Python plan merges them, jobs wait for
their fence before anything else on their streams, a fence given back early is never re-recorded
before its wait was enqueued, a staging slot is rewritten only after the event recorded after its
last read, layers are marked in order and waited for on the given stream, failures come back as
failed results, and shutdown is bounded whatever the thread is doing."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import (
    ArgumentTypeError,
    BlockConflictError,
    ClosedError,
    InvalidBlockIdError,
    CudaError,
    DeviceLayout,
    InvalidArgumentError,
    KVOffloadError,
    NativeBuildError,
    ShutdownError,
    TransferError,
    WaitTimeoutError,
    Worker,
)
from kvoffload import native
from kvoffload._descriptors import CopyPlan, PageTable, kernel_segments, staged_chunk_rows
from kvoffload._jobs import JobBook
from kvoffload.backends import native as native_backend
from kvoffload.backends.cuda import LayeredChooser
from kvoffload.backends.native import NativeBackend, NativeLayerMarks
from kvoffload.calibration import LayeredChoice
from kvoffload.handler import ISSUER_JOIN_MIN_S, BookedHandler, DirectionHandler
from kvoffload.records import Direction
from kvoffload.worker.booking import Bookkeeping, Memory
from kvoffload.worker.teardown import Teardown
from tests.unit.test_staged_plan import plan_for
from tests.unit._native_fake import COMPUTE, COPY, GRANULE, IDLE, KERNEL, TEST_STRIDED_MIN_ROWS, FakeDriver, wait_until

I64 = npt.NDArray[np.int64]
SLOT_BASES = ((1 << 44), (1 << 44) + (1 << 30), (1 << 44) + (2 << 30))
TIMEOUT_S = 30.0
NUM_BLOCKS = 64
#: For the tests that hold the issuer thread inside a driver call of an issue: every job is the
#: thread's to issue (by default an idle thread's small job is issued by its caller).
THREAD_ISSUES = {"caller_issue_max": 0}


class Inner:
    """What the native backend takes over, on CPU: streams are plain ints."""

    path = "auto"

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.device = torch.device("cpu")
        self.released = 0

    def stream_handle(self, stream: object | None) -> int:
        return COMPUTE if stream is None else int(stream)  # type: ignore[call-overload]

    def release(self) -> None:
        self.released += 1


def make_plan(direction: Direction, page_sizes: list[int], *, block_major: bool = False) -> CopyPlan:
    """The staged-plan tests' plan (pages in separate allocations, or one allocation with each
    block's pages back to back), records exactly as long as the pages."""
    return plan_for(direction, page_sizes, block_major=block_major,
                    record=sum((p + 15) // 16 * 16 for p in page_sizes))


class Harness:
    """A handler over a native backend over the fake driver."""

    def __init__(self, direction: Direction, path: str, plan: CopyPlan, *, slot_bytes: int = 0,
                 not_ready: int = 0, batch: bool = True, controls: int = 0,
                 give_way_ns: int = 200_000, idle_spin_ns: int = 0,
                 tune: dict[str, int] | None = None, layered: LayeredChooser | None = None) -> None:
        self.fake = FakeDriver(not_ready=not_ready)
        self.keep: list[object] = []
        self.tables: dict[int, I64] = {}
        slot_bytes = slot_bytes or 3 * plan.pages.record_bytes
        config = self.fake.config(store=direction is Direction.STORE, slots=SLOT_BASES,
                                  slot_bytes=slot_bytes, batch=batch, keep=self.keep,
                                  give_way_ns=give_way_ns, idle_spin_ns=idle_spin_ns)
        config.controls = controls
        for name, value in (tune or {}).items():
            setattr(config, name, value)
        self.inner = Inner(direction)
        self.backend = NativeBackend.start(
            self.inner, config, index=0, choose=lambda _n: path,
            path_names={name: name for name in (path, "sm", "dma")} if layered else {path: path},
            tables=self.table, keep=self.keep, layered=layered,
        )
        self.plan = plan
        self.handler = DirectionHandler.create(direction=direction, plan=plan, backend=self.backend,
                                               num_src_blocks=NUM_BLOCKS, num_dst_blocks=NUM_BLOCKS)

    def table(self, plan: CopyPlan) -> tuple[int, int]:
        array = self.tables.setdefault(id(plan), kernel_segments(plan.pages))
        self.keep.append(plan)
        return int(array.ctypes.data), int(array.shape[0])

    def run(self, job: int, src: list[int], dst: list[int], **kwargs: Any) -> Any:
        self.handler.submit(job, src, dst, **kwargs)
        (result,) = self.handler.wait([job], TIMEOUT_S)
        return result

    def close(self) -> None:
        self.handler.shutdown(TIMEOUT_S)


def expected(plan: CopyPlan, device: list[int], host: list[int]) -> dict[int, int]:
    """Destination granule -> source address, as the job should leave them."""
    p = plan.pages
    out: dict[int, int] = {}
    for d, h in zip(device, host):
        for base, stride, nbytes, offset in zip(p.dev_base.tolist(), p.dev_stride.tolist(),
                                                p.nbytes.tolist(), p.host_offset.tolist()):
            dev = base + d * stride
            rec = plan.host_base + h * plan.host_stride + offset
            for k in range(0, nbytes, GRANULE):
                if plan.direction is Direction.STORE:
                    out[rec + k] = dev + k
                else:
                    out[dev + k] = rec + k
    return out


def moved(fake: FakeDriver, want: dict[int, int]) -> int:
    """Granules whose bytes did not come from where they should."""
    return sum(1 for dst, src in want.items() if fake.provenance.get(dst) != src)


PATHS = ("dma", "sm", "staged")
LAYOUTS = {
    "per-tensor": dict(page_sizes=[512, 256, 1024, 128]),
    "block-major": dict(page_sizes=[512, 512, 512, 512], block_major=True),
    "odd pages": dict(page_sizes=[100, 36, 260]),
}


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_path_moves_exactly_the_jobs_pages(direction: Direction, path: str, layout: str) -> None:
    plan = make_plan(direction, **LAYOUTS[layout])  # type: ignore[arg-type]
    h = Harness(direction, path, plan)
    try:
        rng = np.random.default_rng(1)
        device = rng.permutation(NUM_BLOCKS)[:10].tolist()
        host = rng.permutation(NUM_BLOCKS)[:10].tolist()
        src, dst = (device, host) if direction is Direction.STORE else (host, device)
        result = h.run(0, src, dst)
        assert result.ok, result.error
        assert result.path == path
        assert moved(h.fake, expected(plan, device, host)) == 0
    finally:
        h.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    direction=st.sampled_from([Direction.STORE, Direction.LOAD]),
    block_major=st.booleans(),
    pages=st.lists(st.sampled_from([64, 128, 256, 1024]), min_size=1, max_size=4),
    pairs=st.lists(st.tuples(st.integers(0, NUM_BLOCKS - 1), st.integers(0, NUM_BLOCKS - 1)),
                   min_size=1, max_size=12, unique_by=lambda t: t[0]),
    batch=st.booleans(),
)
def test_dma_descriptors_merge_as_the_python_plan_merges_them(
    direction: Direction, block_major: bool, pages: list[int], pairs: list[tuple[int, int]], batch: bool,
) -> None:
    plan = make_plan(direction, pages, block_major=block_major)
    device = [d for d, _ in pairs]
    host = [h for _, h in pairs]
    if direction is Direction.LOAD:  # destinations (device blocks) are distinct; sources may repeat
        pass
    else:
        host = list(dict.fromkeys(host)) + [x for x in range(NUM_BLOCKS) if x not in host]
        host = host[: len(device)]
    h = Harness(direction, "dma", plan, batch=batch)
    try:
        src, dst = (device, host) if direction is Direction.STORE else (host, device)
        assert h.run(0, src, dst).ok
        reference = plan.build(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
        copies = sum(c[2] for c in h.fake.of("cuMemcpyBatchAsync")) + len(h.fake.of("cuMemcpyAsync"))
        assert copies == reference.count
        if not batch:
            assert not h.fake.of("cuMemcpyBatchAsync")
        assert moved(h.fake, expected(plan, device, host)) == 0
    finally:
        h.close()


@pytest.mark.parametrize(("pages", "calls"), [
    (1, [64]),
    (20, [64, 128, 256, 512, 320]),
    (40, [64, 128, 256, 512, 1024, 576]),
])
def test_a_long_dma_job_goes_to_the_driver_in_growing_bounded_batches(pages: int, calls: list[int]) -> None:
    """The driver holds a lock through one batch call, and the caller's fence record waits for it:
    a job of more copies than one batch takes is cut into several calls, of at most 1024. And the
    copy engine starts on a call's copies only once the call returned: the first call takes 64, each
    next one twice as many (one call of 1024 held a job's first byte for 350-380 us on an H100)."""
    plan = make_plan(Direction.STORE, [64] * pages)  # pages in allocations of their own: nothing merges
    h = Harness(Direction.STORE, "dma", plan)
    try:
        device, host = list(range(64)), list(range(63, -1, -1))
        assert h.run(0, device, host).ok
        assert [c[2] for c in h.fake.of("cuMemcpyBatchAsync")] == calls
        assert moved(h.fake, expected(plan, device, host)) == 0
    finally:
        h.close()


def strided_plan(direction: Direction, page_sizes: list[int], **kwargs: Any) -> CopyPlan:
    """``make_plan``'s pages with records 3 records apart in the pool (one rank's slices of a shared
    pool, docs/design.md §13): a job's records never continue each other."""
    plan = make_plan(direction, page_sizes, **kwargs)
    return attrs.evolve(plan, host_stride=3 * plan.pages.record_bytes)


#: Host records of a staged job: runs of 5 and 4 consecutive records inside one pinned area (5
#: records an area), runs of 2 and 1 below ``STRIDED_MIN_ROWS``, and a run of 4 that an area's
#: end cuts into 2 + 2.
STRIDED_HOSTS = [10, 11, 12, 13, 14, 20, 21, 33, 40, 41, 42, 43, 48, 49, 50, 51]


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("min_rows", [TEST_STRIDED_MIN_ROWS, 0])
@pytest.mark.parametrize("shuffled", [False, True])
def test_staged_rows_of_consecutive_records_go_as_strided_copies(
    direction: Direction, layout: str, min_rows: int, shuffled: bool,
) -> None:
    """Rows of at least STRIDED_MIN_ROWS records that follow each other in one pinned area go as one
    cuMemcpy2DAsync per run of the record; the rest as descriptors. 0 turns strided copies off.
    Either way the job moves exactly its bytes. The pairs come in host order (the issuer keeps
    their order) or shuffled (it sorts them by host record first: the same runs)."""
    assert TEST_STRIDED_MIN_ROWS == 4, "the host runs below are chosen for 4"
    plan = strided_plan(direction, **LAYOUTS[layout])  # type: ignore[arg-type]
    h = Harness(direction, "staged", plan, slot_bytes=64 * plan.pages.record_bytes,
                tune={"strided_min_rows": min_rows})
    try:
        device = np.random.default_rng(3).permutation(NUM_BLOCKS)[:len(STRIDED_HOSTS)].tolist()
        host = STRIDED_HOSTS
        if shuffled:
            pairs = list(zip(host, device))
            random.Random(5).shuffle(pairs)
            host, device = [p[0] for p in pairs], [p[1] for p in pairs]
            assert host != sorted(host)
        src, dst = (device, host) if direction is Direction.STORE else (host, device)
        assert h.run(0, src, dst).ok
        assert moved(h.fake, expected(plan, device, host)) == 0
        strided = h.fake.of("cuMemcpy2DAsync")
        descriptors = sum(c[2] for c in h.fake.of("cuMemcpyBatchAsync")) + len(h.fake.of("cuMemcpyAsync"))
        if min_rows:
            assert sorted(c[2] for c in strided) == [4, 5]  # whole records: one run each
            assert all(c[1] == COPY for c in strided)
            assert descriptors == len(STRIDED_HOSTS) - 9
        else:
            assert not strided and descriptors == len(STRIDED_HOSTS)
    finally:
        h.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    direction=st.sampled_from([Direction.STORE, Direction.LOAD]),
    layout=st.sampled_from(list(LAYOUTS)),
    host=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=24, unique=True),
    seed=st.integers(0, 2**16),
    slot_rows=st.integers(1, 9),
    min_rows=st.sampled_from([0, 1, 2, 3, 4]),
    spread=st.sampled_from([1, 3]),
    edge=st.integers(0, 3),
)
def test_a_staged_job_moves_exactly_its_bytes_whatever_its_records_runs(
    direction: Direction, layout: str, host: list[int], seed: int, slot_rows: int, min_rows: int,
    spread: int, edge: int,
) -> None:
    """Random host records (runs of consecutive ones among them), chunks of 1-9 rows, strided copies
    from 1-4 rows or never, records back to back or apart, an edge chunk of 0-3 records: every
    granule comes from its place, and the chunks (of a job alone) are ``staged_chunk_rows``'s."""
    plan = make_plan(direction, **LAYOUTS[layout])  # type: ignore[arg-type]
    plan = attrs.evolve(plan, host_stride=spread * plan.pages.record_bytes)
    h = Harness(direction, "staged", plan, slot_bytes=slot_rows * plan.pages.record_bytes,
                tune={"strided_min_rows": min_rows, "edge_bytes": edge * plan.pages.record_bytes})
    try:
        device = np.random.default_rng(seed).permutation(NUM_BLOCKS)[:len(host)].tolist()
        src, dst = (device, host) if direction is Direction.STORE else (host, device)
        assert h.run(0, src, dst).ok
        assert moved(h.fake, expected(plan, device, host)) == 0
        chunks = [c[3] for c in h.fake.of("cuLaunchKernel")]
        assert chunks == staged_chunk_rows(len(host), slot_rows, edge, direction is Direction.STORE)
        if min_rows == 0 or spread == 1:
            assert not h.fake.of("cuMemcpy2DAsync")
    finally:
        h.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(host=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=2, max_size=NUM_BLOCKS, unique=True),
       seed=st.integers(0, 2**16))
def test_a_staged_jobs_rows_go_through_the_slot_in_host_order(host: list[int], seed: int) -> None:
    """The issuer sorts a staged job's pairs by host record (a radix sort of record and index, or
    none when they ascend already): slot row k holds the record of rank k, for records in any order,
    and the job moves exactly its bytes."""
    plan = make_plan(Direction.STORE, [256, 128])
    h = Harness(Direction.STORE, "staged", plan, slot_bytes=NUM_BLOCKS * plan.pages.record_bytes,
                tune={"strided_min_rows": 0, "edge_bytes": 0})
    try:
        device = np.random.default_rng(seed).permutation(NUM_BLOCKS)[:len(host)].tolist()
        assert h.run(0, device, host).ok
        assert moved(h.fake, expected(plan, device, host)) == 0
        p, pair_of = plan.pages, {record_id: i for i, record_id in enumerate(host)}
        for rank, record_id in enumerate(sorted(host)):  # the slot's row `rank` holds its pair's block
            row = SLOT_BASES[0] + rank * p.record_bytes + int(p.host_offset[0])
            block = int(p.dev_base[0]) + device[pair_of[record_id]] * int(p.dev_stride[0])
            assert h.fake.provenance[row] == block, f"record {record_id} is not in row {rank}"
    finally:
        h.close()


def test_a_layered_staged_load_moves_each_layers_spans_of_consecutive_records_as_strided_copies() -> None:
    pages = [256, 256, 512, 512, 128, 128]  # three layers of two pages
    plan = make_plan(Direction.LOAD, pages)
    h = Harness(Direction.LOAD, "staged", plan)
    try:
        host, device = [5, 6, 7, 8, 9, 12], [40, 11, 2, 63, 30, 17]
        h.handler._book.reserve(0, h.handler)  # what the worker does before a layered submit
        h.handler.submit_layered(0, np.array(host, dtype=np.int64), np.array(device, dtype=np.int64),
                                 layer_tables(plan))
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok, result.error
        assert moved(h.fake, expected(plan, device, host)) == 0
        # One strided copy per layer (its two pages are one run of the record) of the 5 records,
        # the sixth record's span as one copy.
        assert [c[2] for c in h.fake.of("cuMemcpy2DAsync")] == [5, 5, 5]
        assert len(h.fake.of("cuMemcpyAsync")) == 3 and not h.fake.of("cuMemcpyBatchAsync")
    finally:
        h.close()


@pytest.mark.parametrize("front", [True, False])
def test_auto_moves_a_layered_load_of_narrow_spans_from_records_apart_through_sm(
    front: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layered load whose size bucket takes staged: from consecutive records (one strided copy a
    layer) it stays staged; from records apart (a descriptor per record and layer) it takes sm.
    The control, the size bucket's path alone, moves both through staged."""
    if not front:
        monkeypatch.setattr(native, "front", lambda: None)  # the ctypes hand-off
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])  # three layers of two pages
    for rule in (None, LayeredChoice(lambda _n: "staged", layer_tables(plan)).path):
        h = Harness(Direction.LOAD, "staged", plan, layered=rule)
        try:
            for job, host in enumerate(([5, 6, 7, 8, 9, 10, 11, 12], [1, 3, 5, 7, 9, 11, 13, 15])):
                device = list(range(40, 48))
                submit_layered(h, job, host, device)
                (result,) = h.handler.wait([job], TIMEOUT_S)
                assert result.ok, result.error
                assert moved(h.fake, expected(plan, device, host)) == 0
                apart = job == 1
                assert result.path == ("sm" if apart and rule is not None else "staged"), (rule, host)
        finally:
            h.close()


def test_a_layered_load_takes_sm_where_copies_in_pieces_may_leave_its_runs_no_strided_copy() -> None:
    """Copies cut in pieces (``piece_bytes``) can leave a run of records no strided copy (the
    issuer's strided_rows): the choice then counts every row as a descriptor, and a load from
    consecutive records takes sm. The control, without pieces, stays staged."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    host, device = [5, 6, 7, 8, 9, 10, 11, 12], list(range(40, 48))
    for pieces in (0, 512):
        h = Harness(Direction.LOAD, "staged", plan,
                    layered=LayeredChoice(lambda _n: "staged", layer_tables(plan)).path,
                    tune={"piece_bytes": pieces})
        try:
            submit_layered(h, 0, host, device)
            (result,) = h.handler.wait([0], TIMEOUT_S)
            assert result.ok, result.error
            assert moved(h.fake, expected(plan, device, host)) == 0
            assert result.path == ("sm" if pieces else "staged"), pieces
        finally:
            h.close()


@pytest.mark.parametrize("run", [40, 64])
def test_the_library_moves_only_runs_of_64_records_of_wide_copies_as_strided_copies(run: int) -> None:
    """A strided copy costs the copy engine about as much as a few dozen narrow descriptors
    (docs/design.md §12): with the library's STRIDED_MIN_ROWS and the threshold the same at any
    width (strided_row_bytes 0, as for copies of 64 KiB and wider), a layered load's run of 40
    records goes as descriptors, one of 64 as one strided copy a layer. The control (4, the former
    value) moves both as strided copies. Every byte lands either way."""
    assert native_backend.STRIDED_MIN_ROWS == 64
    plan = attrs.evolve(make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128]), chunk_records=1024)
    for min_rows in (4, native_backend.STRIDED_MIN_ROWS):
        strided = _strided_copies_of_a_run(plan, run, {"strided_min_rows": min_rows, "strided_row_bytes": 0})
        assert strided == (3 if run >= min_rows else 0), (min_rows, run, strided)


def _strided_copies_of_a_run(plan: CopyPlan, run: int, tune: dict[str, int]) -> int:
    """The strided copies of a layered load (``layer_tables``' three layers) of ``run`` records
    that follow each other, through ``staged`` tuned by ``tune``; asserts every byte landed."""
    h = Harness(Direction.LOAD, "staged", plan, slot_bytes=128 * plan.pages.record_bytes,
                tune={**THREAD_ISSUES, "edge_bytes": 0, **tune})
    try:
        host, device = list(range(run)), list(range(NUM_BLOCKS - run, NUM_BLOCKS))
        submit_layered(h, 0, host, device)
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok, result.error
        assert moved(h.fake, expected(plan, device, host)) == 0
        return len(h.fake.of("cuMemcpy2DAsync"))
    finally:
        h.close()


@pytest.mark.parametrize(("run", "expected_strided"), [(6, 0), (10, 1), (20, 1), (40, 2), (64, 3)])
def test_the_narrower_a_layers_copies_the_shorter_the_runs_that_go_as_strided_copies(
    run: int, expected_strided: int,
) -> None:
    """With strided_row_bytes a layer's runs go as strided copies from ceil(its copies' mean width /
    strided_row_bytes) records, at least 8 and at most strided_min_rows (docs/design.md §12). At 32
    bytes a record, three layers of K and V pages of 128 / 512 / 2048 bytes (copies of 256 B, 1 KiB
    and 4 KiB) need runs of 8 / 32 / 64 records: a run of 6 goes as descriptors in every layer, one
    of 10 or 20 as a strided copy in the narrowest layer, 40 in two, 64 in all three. The control,
    strided_row_bytes 0, needs 64 in every layer. Every byte lands either way."""
    plan = attrs.evolve(make_plan(Direction.LOAD, [128, 128, 512, 512, 2048, 2048]), chunk_records=1024)
    by_width = _strided_copies_of_a_run(plan, run, {"strided_min_rows": 64, "strided_row_bytes": 32})
    assert by_width == expected_strided, (run, by_width)
    uniform = _strided_copies_of_a_run(plan, run, {"strided_min_rows": 64, "strided_row_bytes": 0})
    assert uniform == (3 if run >= 64 else 0), (run, uniform)


def test_the_strided_floor_is_no_higher_than_strided_min_rows() -> None:
    """A ceiling below the floor of 8 records is the threshold at any width: with strided_min_rows
    4 a run of 5 goes as strided copies in every layer, however narrow (control: 6 of 8 below
    strided_row_bytes' floor would leave them descriptors)."""
    plan = attrs.evolve(make_plan(Direction.LOAD, [128, 128, 512, 512, 2048, 2048]), chunk_records=1024)
    assert _strided_copies_of_a_run(plan, 5, {"strided_min_rows": 4, "strided_row_bytes": 32}) == 3
    assert _strided_copies_of_a_run(plan, 5, {"strided_min_rows": 64, "strided_row_bytes": 32}) == 0


def layer_tables(plan: CopyPlan) -> tuple[PageTable, ...]:
    """Layers of two pages each of a plan (three of a six-page plan)."""
    p = plan.pages
    return tuple(
        PageTable(dev_base=p.dev_base[i:i + 2], dev_stride=p.dev_stride[i:i + 2], nbytes=p.nbytes[i:i + 2],
                  host_offset=p.host_offset[i:i + 2], segment=p.segment[i:i + 2], record_bytes=p.record_bytes)
        for i in range(0, p.num_pages, 2)
    )


def _last_before(calls: list[tuple[Any, ...]], index: int,
                 match: Callable[[tuple[Any, ...]], bool]) -> tuple[Any, ...] | None:
    found = [call for call in calls[:index] if match(call)]
    return found[-1] if found else None


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_job_waits_for_its_fence_before_it_touches_a_page(path: str, direction: Direction) -> None:
    plan = make_plan(direction, [256, 256])
    h = Harness(direction, path, plan)
    try:
        assert h.run(0, [1, 2, 3, 4], [5, 6, 7, 8]).ok
        calls = h.fake.snapshot()
        (fence,) = [c for c in calls if c[0] == "cuEventRecord" and c[2] == COMPUTE]
        waited = [i for i, c in enumerate(calls) if c[0] == "cuStreamWaitEvent" and c[2] == fence[1]]
        assert waited, "no stream waited for the fence"
        # The stream that touches device pages (the DMA's for dma, the kernel's otherwise) waited
        # for the fence before the first such copy or launch.
        touching = KERNEL if path != "dma" else COPY
        assert calls[waited[0]][1] == touching
        first_touch = next(i for i, c in enumerate(calls)
                           if c[0] in COPIES and c[1] == touching)
        assert waited[0] < first_touch
    finally:
        h.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("limit", [0, native_backend.CALLER_ISSUE_MAX])  # by the thread, by the caller
def test_a_layered_load_waits_for_its_fence_before_its_first_layer_touches_a_page(path: str, limit: int) -> None:
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    h = Harness(Direction.LOAD, path, plan, tune={"caller_issue_max": limit})
    try:
        time.sleep(0.05)  # the thread blocks, out of work
        submit_layered(h, 0, [5, 6, 7, 8], [1, 2, 3, 4])
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok, result.error
        calls = h.fake.snapshot()
        (fence,) = [c for c in calls if c[0] == "cuEventRecord" and c[2] == COMPUTE]
        touching = KERNEL if path != "dma" else COPY
        waited = next(i for i, c in enumerate(calls) if c[0] == "cuStreamWaitEvent" and c[2] == fence[1])
        first_touch = next(i for i, c in enumerate(calls) if c[0] in COPIES and c[1] == touching)
        assert calls[waited][1] == touching and waited < first_touch
        assert counts(h)[2] == (1 if limit else 0)  # dma: pairs in a run, two direct copies
    finally:
        h.close()


def test_a_fence_given_back_early_is_not_recorded_again_before_its_wait() -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "dma", plan, tune=THREAD_ISSUES)
    backend = h.backend
    try:
        # Control: a fence given back with no job holding it is the next one taken (the pool is
        # LIFO): a test that compares events can see a reuse.
        first = backend.fence(None)
        backend.release_fence(first)
        again = backend.fence(None)
        backend.release_fence(again)
        records = [c[1] for c in h.fake.of("cuEventRecord") if c[2] == COMPUTE]
        assert records[0] == records[1], "the control did not reuse the event: the test proves nothing"
        # The thread is held inside its first stream wait (the job's fence wait, on the copy stream).
        gate, entered = threading.Event(), threading.Event()
        h.fake.gate["cuStreamWaitEvent"] = gate
        h.fake.entered["cuStreamWaitEvent"] = entered
        fence = backend.fence(None)
        ticket = backend.issue(plan, np.array([1], dtype=np.int64), np.array([2], dtype=np.int64), fence)
        backend.release_fence(fence)  # the handler gives it back as soon as issue returns
        assert entered.wait(TIMEOUT_S)
        later = backend.fence(None)
        records = [c[1] for c in h.fake.of("cuEventRecord") if c[2] == COMPUTE]
        assert records[-1] != records[-2], "a fence still to be waited for was recorded again"
        del h.fake.gate["cuStreamWaitEvent"]
        gate.set()
        assert ticket.wait(TIMEOUT_S)
        ticket.release()
        backend.release_fence(later)
    finally:
        h.fake.gate.clear()
        h.close()


def thread_calls_while_a_caller_records(give_way_ns: int) -> int:
    """The thread's driver calls made while a caller's thread is inside its fence's record (held
    there by the test), the thread having been mid-issue of a job of many copies."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "dma", plan, batch=False, give_way_ns=give_way_ns, tune=THREAD_ISSUES)
    thread_gate, inside = threading.Event(), threading.Event()
    caller_gate = threading.Event()
    taken: list[object] = []
    taker = threading.Thread(target=lambda: taken.append(h.backend.fence(None)))
    try:
        h.fake.gate["cuMemcpyAsync"] = thread_gate
        h.fake.entered["cuMemcpyAsync"] = inside
        h.handler.submit(0, list(range(0, 16, 2)), list(range(1, 17, 2)))  # 8 unmerged copies
        assert inside.wait(TIMEOUT_S)  # the thread is inside its first copy
        h.fake.gate_on[("cuEventRecord", COMPUTE)] = caller_gate
        before = len(h.fake.snapshot())
        taker.start()
        assert wait_until(lambda: len(h.fake.snapshot()) > before)  # the caller is inside its record
        seen = len(h.fake.snapshot())
        del h.fake.gate["cuMemcpyAsync"]
        thread_gate.set()  # the thread leaves its copy while the caller is still in its record
        wait_until(lambda: len(h.fake.snapshot()) > seen + 2, timeout_s=0.5)
        during = len(h.fake.snapshot()) - seen
        caller_gate.set()
        taker.join(TIMEOUT_S)
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok
        h.backend.release_fence(taken[0])
        return during
    finally:
        thread_gate.set()
        caller_gate.set()
        h.close()


def test_the_thread_gives_way_to_a_callers_driver_call() -> None:
    # Control: a thread that never gives way goes on issuing while the caller is held in its call.
    assert thread_calls_while_a_caller_records(0) > 2, "the control did not issue: the test proves nothing"
    assert thread_calls_while_a_caller_records(30 * 10**9) == 0


def held_fence(h: Harness, hold_s: float) -> None:
    """Take and give back a fence whose record the fake driver holds for ``hold_s``."""
    gate = threading.Event()
    h.fake.gate_on[("cuEventRecord", COMPUTE)] = gate
    timer = threading.Timer(hold_s, gate.set)
    timer.start()
    try:
        h.backend.release_fence(h.backend.fence(None))
    finally:
        del h.fake.gate_on[("cuEventRecord", COMPUTE)]
        timer.join()


def test_a_callers_slow_driver_call_is_counted_by_the_issuing_sides_call_in_progress() -> None:
    """A caller's fence record held 0.2 s while the thread is held inside a copy counts as slow
    under "copy", and the copy (held until after it) is the thread's longest call; one held while the
    thread is idle counts under "none"; every record counts as a call. (Only the held calls' times
    are bounded: a quick call on a loaded machine may take over 100 us too.)"""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "dma", plan, batch=False, tune=THREAD_ISSUES)
    thread_gate, inside = threading.Event(), threading.Event()
    try:
        h.backend.release_fence(h.backend.fence(None))
        assert h.backend.call_stats().caller_calls == 1
        h.fake.gate["cuMemcpyAsync"] = thread_gate
        h.fake.entered["cuMemcpyAsync"] = inside
        h.handler.submit(0, [0], [1])  # its fence recorded in the hand-off: a quick call
        assert inside.wait(TIMEOUT_S)  # the thread is inside the job's copy
        held_fence(h, 0.2)
        del h.fake.gate["cuMemcpyAsync"]
        thread_gate.set()
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok
        held_fence(h, 0.2)  # the thread idle
        stats = h.backend.call_stats()
        assert set(stats.slow_caller_calls) == {"none", "record", "wait", "copy", "launch", "query"}
        assert stats.slow_caller_calls["copy"] >= 1 and stats.slow_caller_calls["none"] >= 1
        # the hold's timer starts before the call enters the driver: the call is held a little less
        assert stats.caller_calls == 4 and stats.caller_longest_ns >= 150_000_000
        assert stats.longest_ns["copy"] >= 200_000_000  # held from before the caller's record to after it
        assert set(stats.longest_ns) == {"record", "wait", "copy", "launch", "query"}
    finally:
        thread_gate.set()
        h.close()
    with pytest.raises(TransferError, match="released"):
        h.backend.call_stats()


def unwaited_slot_writes(direction: Direction, controls: int, strided: bool = False, edge: bool = False) -> int:
    """Writes into a staging slot not preceded by a wait for the event recorded after the slot's
    last read, over a job of 6 chunks through 3 slots (``strided``: of 2 consecutive records each,
    strided copies from 2 rows on, so every chunk's DMA is one; ``edge``: the job alone's edge chunk
    of one record, the other chunks shifted by one row)."""
    plan = (strided_plan if strided else make_plan)(direction, [256, 256])
    record = plan.pages.record_bytes
    h = Harness(direction, "staged", plan, slot_bytes=2 * record, controls=controls,  # 2 rows a slot
                tune={"strided_min_rows": 2, "edge_bytes": record if edge else 0})
    try:
        device = list(range(0, 40, 3))[:11]  # 11 pairs: 6 chunks, every slot used twice
        host = [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12] if strided else list(range(20, 31))
        src, dst = (device, host) if direction is Direction.STORE else (host, device)
        assert h.run(0, src, dst).ok
        assert moved(h.fake, expected(plan, device, host)) == 0
        if not edge:
            assert len(h.fake.of("cuMemcpy2DAsync")) == (5 if strided else 0)
        else:  # [1, 2, 2, 2, 2, 2] for the store, reversed for the load
            launched = [c[3] for c in h.fake.of("cuLaunchKernel")]
            assert launched == staged_chunk_rows(11, 2, 1, direction is Direction.STORE)
        calls = h.fake.snapshot()
        # Writes into a slot: the gather launch (store) or the DMA from the host (load).
        writers, writer_stream, reader_stream = (
            (("cuLaunchKernel",), KERNEL, COPY) if direction is Direction.STORE
            else (("cuMemcpyBatchAsync", "cuMemcpyAsync", "cuMemcpy2DAsync"), COPY, KERNEL)
        )
        writes = [i for i, c in enumerate(calls) if c[0] in writers and c[1] == writer_stream]
        assert len(writes) == 6
        unwaited = 0
        for i in writes[3:]:  # the second use of each slot
            wait = _last_before(calls, i, lambda c: c[0] == "cuStreamWaitEvent" and c[1] == writer_stream)
            event = wait[2] if wait is not None else None
            record_call = _last_before(calls, i, lambda c: c[0] == "cuEventRecord" and c[1] == event)
            unwaited += record_call is None or record_call[2] != reader_stream
        return unwaited
    finally:
        h.close()


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
@pytest.mark.parametrize(("strided", "edge"), [(False, False), (True, False), (False, True)])
def test_a_staging_slot_is_rewritten_only_after_its_last_read(direction: Direction, strided: bool,
                                                               edge: bool) -> None:
    control = unwaited_slot_writes(direction, native.CONTROL_SKIP_SLOT_WAIT, strided, edge)
    assert control > 0, "the control wrote every slot after a wait: the check proves nothing"
    assert unwaited_slot_writes(direction, 0, strided, edge) == 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("host", [[3, 4, 5, 6, 9], [5, 6, 7, 8, 9]])  # the second: strided if staged
def test_layers_are_marked_in_order_and_waited_for_on_the_given_stream(path: str, host: list[int]) -> None:
    pages = [256, 256, 512, 512, 128, 128]  # three layers of two pages
    plan = make_plan(Direction.LOAD, pages)
    tables = layer_tables(plan)
    h = Harness(Direction.LOAD, path, plan)
    try:
        device = [10, 11, 12, 13, 14]
        in_flight = threading.Event()  # the job stays in flight until the waits were enqueued
        h.fake.gate["cuEventQuery"] = in_flight
        h.handler._book.reserve(0, h.handler)  # what the worker does before a layered submit
        marks = h.handler.submit_layered(0, np.array(host, dtype=np.int64), np.array(device, dtype=np.int64),
                                         tables)
        assert isinstance(marks, NativeLayerMarks)
        for layer in (2, 0, 1):
            marks.wait(layer, IDLE, TIMEOUT_S)
        del h.fake.gate["cuEventQuery"]
        in_flight.set()
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok, result.error
        assert moved(h.fake, expected(plan, device, host)) == 0
        calls = h.fake.snapshot()
        waits = [i for i, c in enumerate(calls) if c[0] == "cuStreamWaitEvent" and c[1] == IDLE]
        assert len(waits) == 3
        # The last record of each waited event before its wait (pooled events are reused).
        marked = [max(i for i, c in enumerate(calls[:w]) if c[0] == "cuEventRecord" and c[1] == calls[w][2])
                  for w in waits]
        order = [marked[1], marked[2], marked[0]]  # layers 0, 1, 2
        assert order == sorted(order), "layers were not marked in order"
        # Each layer's mark follows its own copies and precedes the next layer's.
        copies = [i for i, c in enumerate(calls)
                  if c[0] in ("cuLaunchKernel", "cuMemcpyBatchAsync", "cuMemcpyAsync", "cuMemcpy2DAsync")]
        for layer, at in enumerate(order):
            assert any(i < at for i in copies), f"layer {layer} marked before any copy"
            if layer + 1 < len(order):
                assert any(at < i < order[layer + 1] for i in copies), f"layer {layer + 1} has no copy after mark {layer}"
        marks.wait(1, IDLE, TIMEOUT_S)  # after the result: returns at once, enqueues nothing
        assert len([c for c in h.fake.snapshot() if c[0] == "cuStreamWaitEvent" and c[1] == IDLE]) == 3
    finally:
        h.close()


class CountingLibrary:
    """The library, or the call front, with its job releases counted (what a ticket hands back,
    and when)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.releases = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def kvo_job_release(self, job: int) -> None:
        self.releases += 1
        self._lib.kvo_job_release(job)

    def job_release(self, spec: int, job: int) -> None:
        self.releases += 1
        self._lib.job_release(spec, job)

    def kvo_job_take(self, job: int, release: int, *out: Any) -> int:
        state = int(self._lib.kvo_job_take(job, release, *out))
        self.releases += bool(release) and state == native.JOB_DONE
        return state

    def job_take(self, spec: int, job: int, release: bool) -> Any:
        taken = self._lib.job_take(spec, job, release)
        self.releases += release and taken is not None
        return taken


def counted(ticket: native_backend.NativeTicket, call_front: bool) -> CountingLibrary:
    """Count the ticket's releases of its job, through the call front or (``call_front`` False)
    through ctypes."""
    if call_front:
        assert ticket._front is not None  # the call front is built here
        counting = CountingLibrary(ticket._front)
        ticket._front = counting  # type: ignore[assignment]
    else:
        counting = CountingLibrary(ticket._lib)
        ticket._lib = counting  # type: ignore[assignment]
        ticket._front = None
    return counting


@contextlib.contextmanager
def closing_harness() -> Iterator[tuple[Harness, threading.Event]]:
    """A dma store harness and the event that lets its held queries through (see
    :func:`held_in_flight`); on leaving, every gate opens and the harness is closed."""
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]))
    in_flight = threading.Event()
    try:
        yield h, in_flight
    finally:
        h.fake.gate.clear()
        in_flight.set()
        h.close()


def held_in_flight(h: Harness, call_front: bool,
                   in_flight: threading.Event) -> tuple[native_backend.NativeTicket, CountingLibrary]:
    """A 1-pair job issued through ``h`` whose completion query blocks until ``in_flight`` is set
    (the thread is inside it when this returns), with its ticket's releases counted."""
    queried = threading.Event()
    h.fake.gate["cuEventQuery"] = in_flight
    h.fake.entered["cuEventQuery"] = queried
    fence = h.backend.fence(None)
    ticket = h.backend.issue(h.plan, np.array([1], dtype=np.int64), np.array([2], dtype=np.int64), fence)
    h.backend.release_fence(fence)
    assert isinstance(ticket, native_backend.NativeTicket)
    counting = counted(ticket, call_front)
    assert queried.wait(TIMEOUT_S)
    return ticket, counting


@pytest.mark.parametrize("call_front", [True, False], ids=["call front", "ctypes"])
def test_a_ticket_released_under_a_waiter_keeps_its_job_until_the_wait_left_the_library(
    call_front: bool,
) -> None:
    with closing_harness() as (h, in_flight):
        ticket, counting = held_in_flight(h, call_front, in_flight)  # a waiter blocks in the library
        outcome: list[bool] = []
        waiter = threading.Thread(target=lambda: outcome.append(ticket.wait(TIMEOUT_S)))
        waiter.start()
        assert wait_until(lambda: ticket._users == 1)
        ticket.release()  # another thread is done with the job while the waiter is still inside
        assert counting.releases == 0, "the job was released under a waiter"
        del h.fake.gate["cuEventQuery"]
        in_flight.set()
        waiter.join(TIMEOUT_S)
        assert outcome == [True] and counting.releases == 1  # the waiter, leaving, let it go
        ticket.release()
        assert counting.releases == 1


@pytest.mark.parametrize("waiter_inside", [False, True], ids=["alone", "under a waiter"])
@pytest.mark.parametrize("call_front", [True, False], ids=["call front", "ctypes"])
def test_the_call_that_finds_a_job_done_releases_it_unless_a_waiter_is_inside(
    call_front: bool, waiter_inside: bool,
) -> None:
    with closing_harness() as (h, in_flight):
        ticket, counting = held_in_flight(h, call_front, in_flight)
        assert not ticket.done() and counting.releases == 0  # in flight: nothing is dropped
        if waiter_inside:  # as a wait in progress does: a call counted inside the library
            assert ticket._enter()
        del h.fake.gate["cuEventQuery"]
        in_flight.set()
        assert wait_until(ticket.done)  # the thread found it done
        # Alone, the call that found it done dropped the reference; under a waiter it kept it.
        assert counting.releases == (0 if waiter_inside else 1)
        assert ticket.error is None and ticket.times()[3] > 0  # its outcome is kept
        ticket.release()
        assert counting.releases == (0 if waiter_inside else 1)
        if waiter_inside:
            ticket._leave()  # the wait left the library: the reference goes now
        assert counting.releases == 1
        ticket.release()
        assert counting.releases == 1


class LettingGo:
    """The call front, whose ``job_take`` raises ``MemoryError`` once it let go of a done job (as
    when the result's tuple cannot be built after the library dropped the ticket's reference), and
    which records any later call about that job instead of making it (the job may be freed)."""

    def __init__(self, front: Any) -> None:
        self._front = front
        self.gone: set[int] = set()
        self.after: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._front, name)

    def job_take(self, spec: int, job: int, release: bool) -> Any:
        if job in self.gone:
            self.after.append("job_take")
            return None
        taken = self._front.job_take(spec, job, release)
        if release and taken is not None:
            self.gone.add(job)
            raise MemoryError
        return taken

    def job_wait(self, spec: int, job: int, timeout_ns: int) -> bool:
        if job in self.gone:
            self.after.append("job_wait")
            return True
        return bool(self._front.job_wait(spec, job, timeout_ns))

    def job_release(self, spec: int, job: int) -> None:
        if job in self.gone:
            self.after.append("job_release")
            return
        self._front.job_release(spec, job)


def test_a_result_lost_after_the_library_let_go_of_its_job_fails_the_job_and_never_calls_again() -> None:
    """(A MemoryError after a releasing take left the ticket unreleased: its next call freed the job
    a second time.)"""
    with closing_harness() as (h, _):
        fence = h.backend.fence(None)
        ticket = h.backend.issue(h.plan, np.array([1], dtype=np.int64), np.array([2], dtype=np.int64), fence)
        h.backend.release_fence(fence)
        assert isinstance(ticket, native_backend.NativeTicket) and ticket._front is not None
        assert ticket._front.job_wait(ticket._spec, ticket._job, int(TIMEOUT_S * 1e9))
        front = LettingGo(ticket._front)
        ticket._front = front  # type: ignore[assignment]
        with pytest.raises(MemoryError):
            ticket.done()  # the call that found it done let go of it, then its result failed
        assert ticket.done(), "the job is never reported"
        assert isinstance(ticket.error, TransferError) and "MemoryError" in str(ticket.error)
        assert ticket.wait(TIMEOUT_S)
        ticket.release()
        assert front.after == [], f"called the library about a job it had let go of: {front.after}"


def test_a_ticket_keeps_the_call_fronts_spec_it_calls_through() -> None:
    """(A ticket kept only the spec's address: a ticket that outlived its backend called through
    freed memory, a crash.)"""
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]))
    try:
        fence = h.backend.fence(None)
        ticket = h.backend.issue(h.plan, np.array([1], dtype=np.int64), np.array([2], dtype=np.int64), fence)
        h.backend.release_fence(fence)
        assert isinstance(ticket, native_backend.NativeTicket) and ticket._front is not None
        assert ticket._front.job_wait(ticket._spec, ticket._job, int(TIMEOUT_S * 1e9))
        spec = h.backend._front_spec  # noqa: SLF001
        assert ticket._spec == ctypes.addressof(spec)
        assert any(o is spec for o in gc.get_referents(ticket)), "the ticket does not keep its spec"
    finally:
        h.close()
    assert ticket.done() and ticket.error is None  # through the spec, after the backend went
    ticket.release()


def counts(h: Harness) -> tuple[int, ...]:
    """The issuer's counts so far: hand-offs that signalled the thread, idle naps, jobs their
    callers issued, jobs their waiters found done, early wakes, callers announced to a busy
    thread (kvo_issuer_counts)."""
    out = (ctypes.c_int64 * 6)()
    h.backend.lib.kvo_issuer_counts(h.backend._issuer, out)  # noqa: SLF001
    return tuple(int(v) for v in out)


def naps_after_a_job(idle_nap_ns: int) -> tuple[int, int]:
    """Idle naps of 1 ms (or none) for 200 ms after a job: the naps in the first 100 ms, and those
    from 400 to 700 ms (when the thread blocks until woken); then a job is still taken."""
    h = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [256]),
                tune={"idle_nap_ns": idle_nap_ns, "idle_light_ns": 200_000_000})
    try:
        assert h.run(0, [1], [2]).ok
        start = time.monotonic()
        time.sleep(0.1)
        early = counts(h)[1]
        time.sleep(max(0.0, start + 0.4 - time.monotonic()))
        before = counts(h)[1]
        time.sleep(0.3)
        late = counts(h)[1] - before
        assert h.run(1, [3], [4]).ok  # a hand-off wakes the thread, napping or not
        return early, late
    finally:
        h.close()


def test_out_of_work_the_thread_naps_for_a_while_then_blocks_until_woken() -> None:
    # Control: without naps the thread blocks until woken at once.
    assert naps_after_a_job(0) == (0, 0), "the control napped: the test proves nothing"
    early, late = naps_after_a_job(1_000_000)
    assert early >= 20  # about one a millisecond
    assert late == 0  # past the light period: blocked until woken


COPIES = ("cuMemcpyBatchAsync", "cuMemcpyAsync", "cuLaunchKernel", "cuMemcpy2DAsync")


def copy_threads(fake: FakeDriver, start: int = 0) -> set[int]:
    """The threads that made the copy calls logged from ``start`` on."""
    with fake._lock:  # noqa: SLF001
        return {t for c, t in zip(fake.calls[start:], fake.threads[start:]) if c[0] in COPIES}


@pytest.mark.parametrize("path", PATHS)
def test_a_small_job_handed_to_an_idle_thread_is_issued_by_its_caller(path: str) -> None:
    plan = make_plan(Direction.STORE, [256, 512])
    main = threading.get_ident()
    for limit in (0, 4):  # the control first: the thread issues every job
        h = Harness(Direction.STORE, path, plan, tune={"caller_issue_max": limit})
        try:
            time.sleep(0.05)  # the thread blocks, out of work
            assert h.run(0, [1, 2], [3, 4]).ok  # 2 pairs x 2 pages: 4 pages
            assert moved(h.fake, expected(plan, [1, 2], [3, 4])) == 0
            by = copy_threads(h.fake)
            assert (by == {main}) == (limit > 0), f"limit {limit}: copies made by {by}"
            start = len(h.fake.snapshot())
            time.sleep(0.05)
            assert h.run(1, [5, 6, 7], [8, 9, 10]).ok  # 6 pages: over the limit, the thread's
            assert moved(h.fake, expected(plan, [5, 6, 7], [8, 9, 10])) == 0
            assert main not in copy_threads(h.fake, start)
            assert counts(h)[2] == (1 if limit else 0)
        finally:
            h.close()


#: Host records of a 5-block layered load: consecutive (strided copies when staged), scattered (5
#: descriptors a layer), and 20 scattered (more descriptors than a caller issues of a layer).
LAYERED_HOSTS = {"consecutive": [5, 6, 7, 8, 9], "scattered": [3, 14, 7, 22, 9],
                 "many": list(range(0, 60, 3))}


def submit_layered(h: Harness, job: int, host: list[int], device: list[int]) -> NativeLayerMarks:
    """A layered load of the three layers of ``layer_tables``, submitted as the worker does."""
    h.handler._book.reserve(job, h.handler)  # noqa: SLF001 - what the worker does before a layered submit
    marks = h.handler.submit_layered(job, np.array(host, dtype=np.int64), np.array(device, dtype=np.int64),
                                     layer_tables(h.plan))
    assert isinstance(marks, NativeLayerMarks)
    return marks


def callers_copies_of_a_layered_load(h: Harness, plan: CopyPlan, host: list[int],
                                     device: list[int]) -> list[tuple[Any, ...]]:
    """Submit a layered load to ``h``'s idle thread; once it landed bit-exact, the copy calls made
    on this (the caller's) thread inside the submit."""
    main = threading.get_ident()
    time.sleep(0.05)  # the thread blocks, out of work
    marks = submit_layered(h, 0, host, device)
    mine = [c for c, t in zip(h.fake.snapshot(), h.fake.threads) if t == main and c[0] in COPIES]
    marks.wait(0, IDLE, TIMEOUT_S)
    (result,) = h.handler.wait([0], TIMEOUT_S)
    assert result.ok, result.error
    assert moved(h.fake, expected(plan, device, host)) == 0
    return mine


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hosts", list(LAYERED_HOSTS))
def test_an_idle_threads_layered_load_has_its_first_layer_issued_by_its_caller_when_cheap(
    path: str, hosts: str,
) -> None:
    """The caller issues layer 0 (sm: one launch; staged and dma: strided copies, a dma layer's
    direct ones, and at most 16 descriptors), marks it, and queues the rest for the thread; never
    a layer of more descriptors."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])  # three layers of two pages
    host = LAYERED_HOSTS[hosts]
    device = list(range(40, 40 + len(host)))
    cheap = path == "sm" or hosts != "many"  # "many": 40 descriptors
    main = threading.get_ident()
    for limit in (0, native_backend.CALLER_ISSUE_MAX):  # the control first: the thread issues all
        h = Harness(Direction.LOAD, path, plan, tune={"caller_issue_max": limit})
        try:
            mine = callers_copies_of_a_layered_load(h, plan, host, device)
            calls = h.fake.snapshot()
            theirs = [c for c, t in zip(calls, h.fake.threads) if t != main and c[0] in COPIES]
            if limit and cheap:
                # Layer 0's copies, every one of them, before the call returned; the thread's the
                # other two layers' (as many calls each here).
                assert mine and len(theirs) == 2 * len(mine), (mine, theirs)
                assert counts(h)[2] == 1
            else:
                assert not mine and counts(h)[2] == 0
        finally:
            h.close()


@pytest.mark.parametrize("runs", [16, 17])
def test_a_caller_issues_a_staged_first_layer_of_at_most_16_strided_copies(runs: int) -> None:
    """Host records in ``runs`` runs of 2 (strided copies from 2 rows here), one chunk: the caller
    issues layer 0 when it is at most 16 strided copies, else the thread issues every layer (with
    copies not cut in pieces, the default, the count went unchecked: a caller made one strided copy
    per run, 64 of them for 256 records in runs of 4). Every page lands from its record."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])  # three layers of two pages
    area = plan.chunk_records  # a strided copy stays inside one pinned area of records
    starts = [a for a in range(0, NUM_BLOCKS - 1) if a % area < area - 1 and a % 3 == 0][:runs]
    assert len(starts) == runs
    host = [a + k for a in starts for k in range(2)]
    device = list(range(len(host)))
    h = Harness(Direction.LOAD, "staged", plan, slot_bytes=64 << 10, tune={"strided_min_rows": 2})
    try:
        mine = callers_copies_of_a_layered_load(h, plan, host, device)
        strided = [c for c in mine if c[0] == "cuMemcpy2DAsync"]
        if runs <= 16:
            assert len(strided) == runs and counts(h)[2] == 1, mine  # layer 0's, by the caller
        else:
            assert not mine and counts(h)[2] == 0, f"the caller made {len(strided)} strided copies"
    finally:
        h.close()


@pytest.mark.parametrize("edge", [0, 512])
def test_a_layered_staged_loads_last_layer_ends_in_its_edge_chunk_and_the_others_in_whole_slots(edge: int) -> None:
    """12 records of three layers (rows of 512, 1024 and 256 bytes: 10, 5 and 21 a slot): layers 0
    and 1 in whole slots, the caller issuing layer 0; the last layer, the job's end, in chunks
    growing to its edge chunk of 512 bytes (2 rows) — one chunk of 12 rows without an edge. Every
    page lands from its record."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    host = list(range(20, 32))
    device = np.random.default_rng(5).permutation(64)[:12].tolist()
    h = Harness(Direction.LOAD, "staged", plan, tune={"edge_bytes": edge})
    main = threading.get_ident()
    try:
        time.sleep(0.05)  # the thread blocks, out of work
        marks = submit_layered(h, 0, host, device)
        marks.wait(0, IDLE, TIMEOUT_S)
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok, result.error
        assert moved(h.fake, expected(plan, device, host)) == 0
        launches = [(c[3], t == main) for c, t in zip(h.fake.snapshot(), h.fake.threads) if c[0] == "cuLaunchKernel"]
        last = staged_chunk_rows(12, 21, edge // 256, False)
        assert last == ([10, 2] if edge else [12])
        assert [n for n, _ in launches] == [10, 2] + [5, 5, 2] + last
        assert [n for n, mine in launches if mine] == [10, 2]
    finally:
        h.close()


def test_a_staged_job_behind_one_in_flight_keeps_whole_slots_and_one_alone_takes_its_edge_chunk() -> None:
    """Two stores of 12 records (3 a slot), the second handed over while the first is in flight
    (its end event not ready for its first 20000 queries): the first, alone, takes chunks growing from
    its edge chunk of one record; the second keeps whole slots (its gather overlaps the first's
    DMA anyway). Both move exactly their bytes. Without an edge both keep whole slots."""
    plan = make_plan(Direction.STORE, **LAYOUTS["per-tensor"])  # type: ignore[arg-type]
    record = plan.pages.record_bytes
    for edge in (record, 0):
        h = Harness(Direction.STORE, "staged", plan, not_ready=20000, tune={"edge_bytes": edge})
        try:
            time.sleep(0.05)  # the thread blocks, out of work
            first, second = list(range(12)), list(range(20, 32))
            h.handler.submit(0, first, first)
            h.handler.submit(1, second, second)
            results = h.handler.wait([0, 1], TIMEOUT_S)
            assert all(r.ok for r in results)
            want = expected(plan, first, first) | expected(plan, second, second)
            assert moved(h.fake, want) == 0
            chunks = [c[3] for c in h.fake.of("cuLaunchKernel")]
            alone = staged_chunk_rows(12, 3, 1, True) if edge else [3, 3, 3, 3]
            assert alone == ([1, 3, 3, 3, 2] if edge else [3, 3, 3, 3])
            assert chunks == alone + [3, 3, 3, 3]
        finally:
            h.close()


def test_a_failed_first_layer_in_its_callers_hands_fails_the_job_and_leaves_nothing_to_the_thread() -> None:
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    h = Harness(Direction.LOAD, "staged", plan)
    main = threading.get_ident()
    try:
        time.sleep(0.05)
        h.fake.fail["cuMemcpy2DAsync"] = 700
        marks = submit_layered(h, 0, [5, 6, 7, 8, 9], [1, 2, 3, 4, 10])
        for layer in (2, 0, 1):  # every layer is marked (after what was enqueued): no wait hangs
            marks.wait(layer, IDLE, TIMEOUT_S)
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert not result.ok and "cuMemcpy2DAsync" in str(result.error)
        copies = [(c[0], t == main) for c, t in zip(h.fake.snapshot(), h.fake.threads) if c[0] in COPIES]
        assert copies == [("cuMemcpy2DAsync", True)], copies  # nothing after the failure, by anyone
        assert counts(h)[2] == 1
    finally:
        h.close()


def hand_off_directly(h: Harness, plan: CopyPlan, device: int, host: int) -> native_backend.NativeTicket:
    """A one-block sm job of ``plan`` handed to the library itself (not through the handler, which
    hands jobs over one at a time), behind a fence recorded on the compute stream."""
    dev, rec, error = np.array([device], dtype=np.int64), np.array([host], dtype=np.int64), ctypes.c_int64()
    plans = h.backend._plan_array((plan,), whole=True)  # noqa: SLF001
    job = h.backend.lib.kvo_hand_off(h.backend._issuer, COMPUTE, None, native.PATH_SM, 1,  # noqa: SLF001
                                     native.address(dev), native.address(rec), 1, plans, 0, 0,
                                     ctypes.byref(error))
    assert job, error.value
    return native_backend.NativeTicket(h.backend.lib, int(job), "sm")


def test_a_job_handed_over_while_a_caller_issues_a_first_layer_is_issued_after_the_whole_layered_job() -> None:
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    h = Harness(Direction.LOAD, "sm", plan)
    gate, launching = threading.Event(), threading.Event()
    try:
        time.sleep(0.05)
        h.fake.gate["cuLaunchKernel"] = gate
        h.fake.entered["cuLaunchKernel"] = launching
        first = threading.Thread(target=lambda: submit_layered(h, 0, [5, 6, 7], [1, 2, 3]))
        first.start()
        assert launching.wait(TIMEOUT_S)  # the layered job's caller is inside layer 0's launch
        del h.fake.gate["cuLaunchKernel"]
        second = hand_off_directly(h, plan_for(Direction.LOAD, [256, 256, 512, 512, 128, 128]), 20, 21)
        gate.set()
        first.join(TIMEOUT_S)
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok and second.wait(TIMEOUT_S)
        second.release()
        launches = [(c[3], t == first.ident) for c, t in zip(h.fake.snapshot(), h.fake.threads)
                    if c[0] == "cuLaunchKernel"]  # (rows, by the layered job's caller)
        # Layer 0 by its caller, layers 1 and 2 by the thread, then the job handed over meanwhile.
        assert [by_caller for _, by_caller in launches] == [True, False, False, False]
        assert [rows for rows, _ in launches] == [3, 3, 3, 1]
    finally:
        gate.set()
        h.close()


def test_a_job_handed_over_while_a_caller_issues_is_issued_after_it_and_by_no_one_meanwhile() -> None:
    # The handler hands jobs over one at a time; the library keeps the order on its own too: a job
    # handed to it directly while a caller issues is queued, and the thread issues it afterwards.
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, tune={"caller_issue_max": 64})
    gate, launching = threading.Event(), threading.Event()
    try:
        time.sleep(0.05)
        h.fake.gate["cuLaunchKernel"] = gate
        h.fake.entered["cuLaunchKernel"] = launching
        first = threading.Thread(target=lambda: h.handler.submit(0, [1], [2]))
        first.start()
        assert launching.wait(TIMEOUT_S)  # the first job's caller is inside its launch
        del h.fake.gate["cuLaunchKernel"]
        during = len(h.fake.snapshot())
        second = hand_off_directly(h, plan, 3, 4)
        time.sleep(0.1)
        issued = [c for c, t in zip(h.fake.snapshot()[during:], h.fake.threads[during:])
                  if t != first.ident and c[0] in (*COPIES, "cuStreamWaitEvent")]
        assert not issued, f"issued beside the caller's issue: {issued}"
        gate.set()
        first.join(TIMEOUT_S)
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok and second.wait(TIMEOUT_S)
        second.release()
        assert moved(h.fake, {**expected(plan, [1], [2]), **expected(plan, [3], [4])}) == 0
        launches = [(c, t) for c, t in zip(h.fake.snapshot(), h.fake.threads) if c[0] == "cuLaunchKernel"]
        assert [t == first.ident for _, t in launches] == [True, False]  # the caller's, then the thread's
    finally:
        gate.set()
        h.close()


def test_a_caller_issues_in_the_issuers_context_and_gets_its_own_back() -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "dma", plan, tune={"caller_issue_max": 64})
    main = threading.get_ident()
    try:
        time.sleep(0.05)
        h.fake.current[main] = 0x77  # the caller's thread has another context current
        start = len(h.fake.snapshot())
        assert h.run(0, [1], [2]).ok
        mine = [c for c, t in zip(h.fake.snapshot()[start:], h.fake.threads[start:])
                if t == main and c[0] in ("cuCtxSetCurrent", *COPIES)]
        names = [c[0] for c in mine]
        assert names[0] == names[-1] == "cuCtxSetCurrent" and len(names) > 2
        assert all(n in COPIES for n in names[1:-1])
        assert mine[0][1] in (0, None) and mine[-1][1] == 0x77  # the issuer's (NULL here), then its own
        assert h.fake.current[main] == 0x77
    finally:
        h.close()


def signals_over_jobs_one_at_a_time(idle_spin_ns: int) -> int:
    """Hand-offs that had to signal the thread, over 5 jobs each handed over after the one before
    it was done (the thread out of work each time)."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, idle_spin_ns=idle_spin_ns, tune=THREAD_ISSUES)
    try:
        time.sleep(0.05)  # the thread is out of work (spinning or blocked) before the first job
        for job in range(5):
            assert h.run(job, [job], [job + 10]).ok
        return counts(h)[0]
    finally:
        h.close()  # with a 60 s spin, bounded only if the spinning thread sees the stop


def test_a_job_handed_to_a_thread_out_of_work_is_taken_without_a_wake_up() -> None:
    # Control: a thread that blocks as soon as it is out of work is signalled by every hand-off.
    assert signals_over_jobs_one_at_a_time(0) == 5, "the control was not signalled: the test proves nothing"
    assert signals_over_jobs_one_at_a_time(60 * 10**9) == 0


def expect_then_hand_off(expect: bool, spin_ns: int = 10 * 10**9) -> tuple[int, int, int]:
    """A blocked thread, told (or not) that a hand-off is coming, then a job handed over 50 ms
    later: what kvo_issuer_expect returned (0 without it), the hand-offs that had to signal the
    thread, and the calls that woke it."""
    h = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [256]),
                tune={**THREAD_ISSUES, "expect_spin_ns": spin_ns})
    lib = h.backend.lib
    try:
        time.sleep(0.05)  # out of work: blocked
        woke = int(lib.kvo_issuer_expect(h.backend._issuer)) if expect else 0  # noqa: SLF001
        time.sleep(0.05)
        assert h.run(0, [1], [2]).ok
        assert moved(h.fake, expected(h.plan, [1], [2])) == 0
        return woke, counts(h)[0], counts(h)[4]
    finally:
        h.close()


def test_a_thread_told_a_hand_off_is_coming_wakes_and_takes_it_without_a_signal() -> None:
    # Control: a hand-off to a blocked thread signals it.
    assert expect_then_hand_off(False) == (0, 1, 0), "the control was not signalled: the test proves nothing"
    assert expect_then_hand_off(True) == (1, 0, 1)
    # A thread whose look ended (1 ms) blocks again: the hand-off signals it, and it is taken.
    assert expect_then_hand_off(True, spin_ns=1_000_000) == (1, 1, 1)


def test_an_early_wake_after_the_backend_was_released_calls_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [256]))
    calls: list[object] = []
    wake = h.backend.early_wake(4)
    assert wake is not None
    monkeypatch.setattr(h.backend, "_expect", calls.append)  # counts the calls into the library
    wake[1]()
    assert len(calls) == 1
    h.close()  # the issuer is stopped and freed
    wake[1]()  # a front that took a job before the shutdown: nothing is called
    assert len(calls) == 1


def test_a_thread_with_work_or_an_early_wake_off_is_not_woken() -> None:
    # A thread with work is told that a caller is coming (2) unless that is off too (0); never woken.
    h = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [256]), tune=THREAD_ISSUES)
    quiet = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [256]),
                    tune={**THREAD_ISSUES, "caller_coming_ns": 0})
    off = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [256]),
                  tune={"expect_spin_ns": 0, "caller_coming_ns": 0})
    try:
        time.sleep(0.05)
        assert off.backend.lib.kvo_issuer_expect(off.backend._issuer) == 0  # noqa: SLF001
        assert off.backend.early_wake(4) is None
        tickets = []
        for harness, answer in ((h, 2), (quiet, 0)):
            harness.fake.not_ready = 1 << 40
            ticket = _issue(harness, 1)
            assert wait_until(lambda: ticket.times()[2] != 0)  # in flight
            assert harness.backend.lib.kvo_issuer_expect(harness.backend._issuer) == answer  # noqa: SLF001
            assert counts(harness)[4:] == (0, answer // 2)  # woken by none; told by the one that said so
            tickets.append((harness, ticket))
        for harness, ticket in tickets:
            harness.fake.not_ready = 0
            assert ticket.wait(TIMEOUT_S)
            ticket.release()
    finally:
        for harness in (h, quiet):
            harness.fake.not_ready = 0
            harness.close()
        off.close()


def thread_calls_while_an_announced_caller_comes(coming_ns: int) -> tuple[int, int]:
    """A thread held mid-issue of a job of many copies is told that a caller is coming, then let
    go: kvo_issuer_expect's answer, and the thread's driver calls in the 0.3 s that follow while
    the caller has not come. The caller's record then comes, and the job must complete whole."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "dma", plan, batch=False, give_way_ns=30 * 10**9,
                tune={**THREAD_ISSUES, "caller_coming_ns": coming_ns})
    gate, inside = threading.Event(), threading.Event()
    device, host = list(range(0, 16, 2)), list(range(1, 17, 2))
    try:
        h.fake.gate["cuMemcpyAsync"] = gate
        h.fake.entered["cuMemcpyAsync"] = inside
        h.handler.submit(0, device, host)  # 8 unmerged copies
        assert inside.wait(TIMEOUT_S)  # the thread is inside its first copy
        told = int(h.backend.lib.kvo_issuer_expect(h.backend._issuer))  # noqa: SLF001
        seen = len(h.fake.snapshot())
        del h.fake.gate["cuMemcpyAsync"]
        gate.set()  # the thread leaves its copy; the caller is still on its way
        wait_until(lambda: len(h.fake.snapshot()) > seen + 2, timeout_s=0.3)
        during = len(h.fake.snapshot()) - seen
        h.backend.release_fence(h.backend.fence(None))  # the caller's record ends the announcement
        (result,) = h.handler.wait([0], 5.0)  # not the 30 s each call would give way without it
        assert result.ok
        assert moved(h.fake, expected(plan, device, host)) == 0
        return told, during
    finally:
        gate.set()
        h.close()


def test_a_busy_thread_told_a_caller_is_coming_gives_way_until_its_record_or_for_a_bounded_time() -> None:
    # Control: a thread not told goes on issuing while the caller is on its way to its record.
    told, during = thread_calls_while_an_announced_caller_comes(0)
    assert (told, during > 2) == (0, True), "the control did not issue: the test proves nothing"
    # Told (for 30 s at most): no driver call until the caller's record, then the job goes on.
    assert thread_calls_while_an_announced_caller_comes(30 * 10**9) == (2, 0)
    # An announcement that lapses (1 ms) lets the thread go on though the caller never came.
    told, during = thread_calls_while_an_announced_caller_comes(1_000_000)
    assert (told, during > 2) == (2, True)


def thread_calls_while_a_caller_keeps_announcing(controls: int) -> int:
    """A thread mid-issue of a job of 8 copies, while a caller announces itself every ~20 us (its
    jobs declined, say) and never records: the thread's driver calls in the 0.3 s that follow.
    Each announcement holds the thread 20 ms (give_way_ns 30 s). The caller then stops and the job
    must complete whole (found by a review: the announcements kept the thread for as long as they
    came)."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "dma", plan, batch=False, give_way_ns=30 * 10**9, controls=controls,
                tune={**THREAD_ISSUES, "caller_coming_ns": 20_000_000})
    gate, inside, stop = threading.Event(), threading.Event(), threading.Event()
    device, host = list(range(0, 16, 2)), list(range(1, 17, 2))
    lib, issuer = h.backend.lib, h.backend._issuer  # noqa: SLF001

    def announce() -> None:
        while not stop.is_set():
            lib.kvo_issuer_expect(issuer)
            time.sleep(20e-6)

    announcer = threading.Thread(target=announce)
    try:
        h.fake.gate["cuMemcpyAsync"] = gate
        h.fake.entered["cuMemcpyAsync"] = inside
        h.handler.submit(0, device, host)
        assert inside.wait(TIMEOUT_S)  # the thread is inside its first copy
        announcer.start()
        time.sleep(0.01)
        seen = len(h.fake.snapshot())
        del h.fake.gate["cuMemcpyAsync"]
        gate.set()
        wait_until(lambda: len(h.fake.snapshot()) > seen + 2, timeout_s=0.3)
        during = len(h.fake.snapshot()) - seen
        stop.set()
        announcer.join(TIMEOUT_S)
        (result,) = h.handler.wait([0], 5.0)  # the last announcement lapses 20 ms after it
        assert result.ok
        assert moved(h.fake, expected(plan, device, host)) == 0
        return during
    finally:
        stop.set()
        gate.set()
        if announcer.is_alive():
            announcer.join(TIMEOUT_S)
        h.close()


def _held_in_event_create(h: Harness) -> tuple[native_backend.NativeTicket, threading.Event]:
    """Hand a job over whose issue begins with the thread's first timing events, and hold that
    driver call (cuEventCreate) until the returned event is set."""
    fence = h.backend.fence(None)  # its event is created now, before the driver holds the call
    gate, entered = threading.Event(), threading.Event()
    h.fake.gate["cuEventCreate"] = gate
    h.fake.entered["cuEventCreate"] = entered
    ids = np.arange(1, dtype=np.int64)
    ticket = h.backend.issue(h.plan, ids, ids, fence)
    h.backend.release_fence(fence)
    assert isinstance(ticket, native_backend.NativeTicket)
    assert entered.wait(TIMEOUT_S), "the thread never created an event"
    return ticket, gate


def test_a_driver_call_that_does_not_return_holds_no_wait_or_shutdown_past_its_deadline() -> None:
    """The driver holds the thread's event creation: a ticket's wait given 0.2 s, and a shutdown
    given 0.2 s, return at their deadlines (the shutdown saying the thread did not stop). The
    thread made that call under the issuer's lock, which both take: each returned only when the
    driver did (found by a review: 5 s for 5 s)."""
    h = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [256]), tune=THREAD_ISSUES)
    ticket, gate = _held_in_event_create(h)
    try:
        began = time.monotonic()
        assert not ticket.wait(0.2)
        assert time.monotonic() - began < 2.0
    finally:
        gate.set()
    assert ticket.wait(TIMEOUT_S)
    h.close()
    h = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [256]), tune=THREAD_ISSUES)
    ticket, gate = _held_in_event_create(h)
    try:
        began = time.monotonic()
        with pytest.raises(KVOffloadError, match="did not stop|before the shutdown deadline"):
            h.handler.shutdown(0.2)
        assert time.monotonic() - began < 2.0
    finally:
        gate.set()  # the thread then issues the rest of its job, sees the stop and exits
    # Joined before the test lets the fake driver go: the thread still calls it after the gate (a
    # callback freed under it crashed the sanitized run).
    assert h.backend.lib.kvo_issuer_stop(h.backend._issuer, 10**10) == 0


def test_fences_after_the_backend_was_released_never_reach_the_freed_issuer() -> None:
    """(Both called into the library with the issuer freed: a heap use-after-free under
    AddressSanitizer, found by a review. The sanitized run of these tests is the proof.)"""
    h = Harness(Direction.STORE, "sm", make_plan(Direction.STORE, [512, 256]))
    fence = h.backend.fence(None)  # taken before the shutdown
    h.handler.shutdown(10)  # releases the backend: the issuer is stopped and freed
    h.backend.release_fence(fence)  # gives nothing back to the freed issuer
    with pytest.raises(ClosedError, match="backend was released"):
        h.backend.fence(None)


def test_a_caller_that_keeps_announcing_without_recording_holds_the_thread_one_announcement_at_most() -> None:
    # Control: announcements that extend each other, honoured after a lapse: the thread stands still.
    assert thread_calls_while_a_caller_keeps_announcing(native.CONTROL_COMING_ALWAYS) <= 2, \
        "the control issued: the test proves nothing"
    assert thread_calls_while_a_caller_keeps_announcing(0) > 2


def issued_after_the_spin(controls: int) -> bool:
    """Whether a job handed over once the thread's idle spin ended (so it blocks) is done within
    0.5 s."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, controls=controls, idle_spin_ns=1_000_000, tune=THREAD_ISSUES)
    time.sleep(0.05)  # the 1 ms spin is over: the thread blocks
    h.handler.submit(0, [1], [2])
    try:
        (result,) = h.handler.wait([0], 0.5)
    except WaitTimeoutError:
        with pytest.raises(WaitTimeoutError):  # the drain gives the job up; the stop wakes the thread
            h.handler.shutdown(0.2)
        assert h.inner.released == 1
        return False
    h.close()
    return bool(result.ok)


def test_a_hand_off_wakes_a_thread_that_blocked_after_its_idle_spin() -> None:
    # Control: a hand-off that never signals leaves the job queued behind a blocked thread.
    assert not issued_after_the_spin(native.CONTROL_NEVER_SIGNAL), "the control ran the job: the test proves nothing"
    assert issued_after_the_spin(0)


def _issue(h: Harness, pairs: int) -> native_backend.NativeTicket:
    fence = h.backend.fence(None)
    ids = np.arange(pairs, dtype=np.int64)
    ticket = h.backend.issue(h.plan, ids, ids, fence)
    h.backend.release_fence(fence)
    assert isinstance(ticket, native_backend.NativeTicket)
    return ticket


def ended(h: Harness, *tickets: native_backend.NativeTicket) -> bool:
    """Let the jobs held in flight end (their queries say ready again); whether the last one's wait
    and then every other one find them done."""
    h.fake.not_ready = 0
    return tickets[-1].wait(TIMEOUT_S) and all(t.done() for t in tickets)


def test_a_job_in_flight_is_predicted_to_end_after_those_before_it_at_the_fastest_rate_seen() -> None:
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]))
    lib = h.backend.lib
    try:
        first = _issue(h, 1)
        assert first.wait(TIMEOUT_S)
        assert lib.kvo_job_expected_end(first._job) == 0  # nothing to predict from yet
        h.fake.elapsed_ms = 200.0  # a slower job does not slow the prediction down
        assert _issue(h, 1).wait(TIMEOUT_S)
        h.fake.elapsed_ms = 0.01  # nor does a short one speed it up (its time is mostly its launch)
        assert _issue(h, 1).wait(TIMEOUT_S)
        h.fake.not_ready = 1 << 40  # the next jobs stay in flight (their queries say not ready)
        second, third = _issue(h, 2), _issue(h, 3)
        assert wait_until(lambda: lib.kvo_job_expected_end(third._job) != 0)
        rate = 0.5e6 / 256  # ns per byte: 0.5 ms for the first job's 256 bytes
        began = second.times()[1] * 1e9
        second_end = lib.kvo_job_expected_end(second._job)
        assert 2 * 256 * rate - 1e3 <= second_end - began < 2 * 256 * rate + 50e6  # from its issue's start
        # The third runs after the second: predicted from the second's end at the latest.
        assert lib.kvo_job_expected_end(third._job) >= second_end + 3 * 256 * rate - 1e3
        assert ended(h, second, third)
    finally:
        h.fake.not_ready = 0
        h.close()


def test_the_jobs_in_flight_are_predicted_again_when_the_one_ahead_is_found_done() -> None:
    """Two jobs in flight, each predicted to run 50 ms; the first is found done 0.2 s late: the
    second's predicted end moves to 50 ms after that (it was chained on the first's predicted end:
    a waiter deep in a long flight woke, and spun, the sum of the errors ahead of its job early)."""
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]),
                tune={"poll_min_ns": 1_000_000, "poll_max_ns": 1_000_000})
    lib = h.backend.lib
    try:
        h.fake.elapsed_ms = 50.0  # 50 ms per pair, from a job long enough to teach it
        assert _issue(h, 1).wait(TIMEOUT_S)
        h.fake.not_ready = 1 << 40  # held in flight until their end events are let go below
        first = _issue(h, 1)
        assert wait_until(lambda: lib.kvo_job_expected_end(first._job) != 0)  # issued, in flight
        ends = [c[1] for c in h.fake.snapshot() if c[0] == "cuEventRecord"]  # its end's the last
        second = _issue(h, 1)
        assert wait_until(lambda: lib.kvo_job_expected_end(second._job) != 0)
        chained = lib.kvo_job_expected_end(second._job)
        first_end = lib.kvo_job_expected_end(first._job)
        assert chained >= first_end + 50e6 - 1e3  # after the first's predicted end
        time.sleep(max(0.0, (first_end - time.monotonic_ns()) / 1e9) + 0.2)
        h.fake.queries[ends[-1]] = 1 << 41  # the first's end event: its next query says done
        found_at = time.monotonic_ns()
        assert first.wait(TIMEOUT_S)
        rebased = lib.kvo_job_expected_end(second._job)
        assert rebased >= found_at + 50e6 - 1e3, (
            f"the second job's end stayed {(found_at - chained) / 1e6:.0f} ms before the first was found done")
        assert rebased < time.monotonic_ns() + 50e6 + 1e3
        h.fake.not_ready = 0
        assert second.wait(TIMEOUT_S)
    finally:
        h.fake.not_ready = 0
        h.close()


def test_a_job_too_short_for_the_longest_polling_sleep_is_given_no_predicted_end() -> None:
    # The fake's polls sleep at most 20 us: jobs predicted to run under 160 us are polled as ever.
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]))
    lib = h.backend.lib
    try:
        h.fake.elapsed_ms = 0.4  # 100 us per 256 bytes, from a job long enough to teach it
        assert _issue(h, 4).wait(TIMEOUT_S)
        h.fake.not_ready = 1 << 40
        short, long = _issue(h, 1), _issue(h, 2)
        assert wait_until(lambda: lib.kvo_job_expected_end(long._job) != 0)  # 200 us: predicted
        assert lib.kvo_job_expected_end(short._job) == 0
        assert ended(h, short, long)
    finally:
        h.fake.not_ready = 0
        h.close()


def test_a_job_handed_over_while_the_thread_queries_is_issued_without_waiting_out_its_poll() -> None:
    # The thread is inside a query of the job in flight (no one to signal) when the next job is
    # handed over; its polls sleep 5 s. It looks at the queue before it sleeps: issued at once.
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]),
                tune={"poll_min_ns": 5_000_000_000, "poll_max_ns": 5_000_000_000, "end_lead_ns": 0})
    querying, gate = threading.Event(), threading.Event()
    try:
        h.fake.not_ready = 1 << 40
        h.fake.entered["cuEventQuery"] = querying
        h.fake.gate["cuEventQuery"] = gate
        first = _issue(h, 1)
        assert querying.wait(TIMEOUT_S)
        second = _issue(h, 2)
        gate.set()  # the query says not ready; the thread would sleep 5 s
        assert wait_until(lambda: second.times()[2] != 0, 2.0), "the second job waited out the poll"
        h.fake.not_ready = 0
        third = _issue(h, 1)  # signals the sleeping thread, which then finds all three done
        assert third.wait(TIMEOUT_S) and second.done() and first.done()
    finally:
        h.fake.not_ready = 0
        h.fake.gate.clear()
        gate.set()
        h.close()


@contextlib.contextmanager
def waiter_harness(wait_query_ns: int) -> Iterator[Harness]:
    """A harness whose thread polls a job in flight every 30 s and whose waits spin for 10 s,
    querying the job's end every ``wait_query_ns`` (0: never); closed on exit, with every job let
    end and every gate open."""
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]),
                tune={"poll_min_ns": 30 * 10**9, "poll_max_ns": 30 * 10**9, "end_lead_ns": 0,
                      "wait_spin_ns": 10 * 10**9, "wait_query_ns": wait_query_ns})
    try:
        yield h
    finally:
        h.fake.not_ready = 0
        for gate in h.fake.gate.values():
            gate.set()
        h.fake.gate.clear()
        h.close()


def thread_queries(h: Harness) -> int:
    """The end-event queries the issuer's thread made so far (not the test's thread)."""
    main = threading.get_ident()
    return sum(1 for c, t in zip(h.fake.snapshot(), h.fake.threads) if c[0] == "cuEventQuery" and t != main)


def held_past_a_poll(h: Harness, *pairs: int) -> list[native_backend.NativeTicket]:
    """Jobs of ``pairs`` pairs each, issued and held in flight (their queries say not ready), once
    the thread queried the first and went to sleep for its next poll."""
    h.fake.not_ready = 1 << 40
    tickets = [_issue(h, n) for n in pairs]
    assert wait_until(lambda: thread_queries(h) > 0)
    time.sleep(0.05)  # past its query: the thread sleeps
    return tickets


def found_by_its_waiter(wait_query_ns: int) -> tuple[bool, int, int]:
    """A job whose end the thread found not ready (so it sleeps 30 s) and that then completes,
    waited for 1 s: whether the wait saw it done, the jobs waiters found done, and the thread's
    queries meanwhile."""
    with waiter_harness(wait_query_ns) as h:
        (ticket,) = held_past_a_poll(h, 2)
        before = thread_queries(h)
        h.fake.not_ready = 0  # the job completes: the next query says so
        done = ticket.wait(1.0)
        found = counts(h)[3]
        if done:
            assert ticket.done() and ticket.error is None and ticket.seconds() > 0
            assert moved(h.fake, expected(h.plan, [0, 1], [0, 1])) == 0
            ticket.release()
        return done, found, thread_queries(h) - before


def test_a_spinning_waiter_finds_its_job_done_without_waiting_for_the_threads_next_poll() -> None:
    # Control: without the waiter's queries the job is found at the thread's next poll, 30 s on.
    assert found_by_its_waiter(0) == (False, 0, 0), "the control found the job: the test proves nothing"
    assert found_by_its_waiter(1_000) == (True, 1, 0)


def waiter_queries_near_a_long_jobs_end(wait_lead_ns: int, *, queued: bool) -> tuple[bool, int]:
    """A job predicted to run 0.4 s (the rate a first job taught), waited for in a thread whose
    spin (1 ms) ends long before that, and completed at its predicted end (the thread's polls sleep
    up to 20 ms, and it polls nothing near the end): whether the wait saw it done, and the queries
    of the waiter's thread between 0.1 s into the job and its end (asserting none before 0.25 s
    ahead of the end, where the test looked in time to tell: the lead is at most 0.2 s).
    ``queued``: the job is held in its issue (not yet in flight) when the wait begins, for 0.05 s
    (its end is predicted only once it is in flight)."""
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]),
                tune={"poll_min_ns": 1_000_000, "poll_max_ns": 20_000_000, "end_lead_ns": 1,
                      "wait_spin_ns": 1_000_000, "wait_query_ns": 1_000, "wait_lead_ns": wait_lead_ns,
                      "caller_issue_max": 0})
    lib, gate = h.backend.lib, threading.Event()
    try:
        h.fake.elapsed_ms = 400.0  # 400 ms per pair, from a job long enough to teach it
        assert _issue(h, 1).wait(TIMEOUT_S)
        h.fake.not_ready = 1 << 40
        copy = "cuMemcpyAsync"  # one pair: one copy
        copies = len(h.fake.of(copy))
        if queued:
            h.fake.gate[copy] = gate  # the job is held in its issue
        ticket = _issue(h, 1)
        outcome: list[bool] = []
        waiter = threading.Thread(target=lambda: outcome.append(ticket.wait(TIMEOUT_S)))
        waiter.start()
        if queued:
            assert wait_until(lambda: len(h.fake.of(copy)) > copies)
            time.sleep(0.05)  # the waiter blocked while its job was not yet in flight
            assert lib.kvo_job_expected_end(ticket._job) == 0  # noqa: SLF001
            del h.fake.gate[copy]
            gate.set()
        assert wait_until(lambda: lib.kvo_job_expected_end(ticket._job) != 0)  # noqa: SLF001
        end = lib.kvo_job_expected_end(ticket._job)  # noqa: SLF001
        time.sleep(0.1)  # past the waiter's spin
        start = len(h.fake.snapshot())
        time.sleep(max(0.0, (end - 250_000_000 - time.monotonic_ns()) / 1e9))
        middle = len(h.fake.snapshot())  # before any lead's window (a late look proves nothing there)
        looked_early = time.monotonic_ns() < end - max(wait_lead_ns, 200_000_000)
        time.sleep(max(0.0, (end - time.monotonic_ns()) / 1e9))

        def waiters(first: int, last: int) -> int:
            calls, threads = h.fake.snapshot()[first:last], h.fake.threads[first:last]
            return sum(1 for c, t in zip(calls, threads) if c[0] == "cuEventQuery" and t == waiter.ident)

        queries, before = waiters(start, len(h.fake.snapshot())), waiters(start, middle)
        h.fake.not_ready = 0  # the job ends at its predicted end
        waiter.join(TIMEOUT_S)
        assert before == 0 or not looked_early, "the waiter spun long before its job's predicted end"
        return outcome == [True], queries
    finally:
        h.fake.not_ready = 0
        h.fake.gate.clear()
        gate.set()
        h.close()


@pytest.mark.parametrize("queued", [False, True], ids=["in flight", "queued when the wait began"])
def test_a_blocked_waiter_wakes_before_its_long_jobs_predicted_end_and_spins_through_it(queued: bool) -> None:
    # Control: without the lead the waiter sleeps through the end and is woken by the thread.
    done, queries = waiter_queries_near_a_long_jobs_end(0, queued=queued)
    assert done and queries == 0, "the control's waiter queried: the test proves nothing"
    done, queries = waiter_queries_near_a_long_jobs_end(200_000_000, queued=queued)
    assert done and queries > 0


@pytest.mark.parametrize("code", [700, 201], ids=["illegal address", "no context"])
def test_a_query_that_fails_in_a_waiters_hands_fails_the_job_unless_it_lacked_a_context(code: int) -> None:
    # The thread sleeps 30 s between polls, so the waiter's query is the one that fails (once, as
    # the fake driver fails a call). CUDA_ERROR_ILLEGAL_ADDRESS fails the job, not left to a later
    # query that passes; CUDA_ERROR_INVALID_CONTEXT (no context current on the waiter's thread)
    # fails nothing: the waiter stops querying and leaves the job to the thread's next poll.
    with waiter_harness(1_000) as h:
        (ticket,) = held_past_a_poll(h, 1)
        h.fake.fail["cuEventQuery"] = code
        h.fake.not_ready = 0
        start = len(h.fake.of("cuEventQuery"))
        if code == 700:
            with pytest.raises(CudaError, match="cuEventQuery"):
                ticket.wait(1.0)
        else:
            assert not ticket.wait(0.2)
            assert len(h.fake.of("cuEventQuery")) == start + 1 and counts(h)[3] == 0 and not ticket.done()
        assert "cuEventQuery" not in h.fake.fail  # the waiter's query was the one
        ticket.release()


def test_a_waiter_finds_nothing_done_behind_a_job_still_in_flight() -> None:
    # Jobs leave the flight in order: the second job's waiter does not query it (or anything) while
    # the first heads the flight, however its own end looks.
    with waiter_harness(1_000) as h:
        first, second = held_past_a_poll(h, 1, 2)
        queries = len(h.fake.of("cuEventQuery"))
        assert not second.wait(0.2) and not first.done()
        assert len(h.fake.of("cuEventQuery")) == queries  # no one queried meanwhile
        h.fake.not_ready = 0
        assert first.wait(1.0) and second.wait(1.0)  # each waiter finds its own, in order
        assert counts(h)[3] == 2
        first.release()
        second.release()


def test_while_a_waiter_queries_the_thread_issues_and_stops_without_querying() -> None:
    # A waiter held inside its query of the job in flight: the thread does not query that job
    # meanwhile, still issues the next job, and stops within its deadline.
    gate, inside = threading.Event(), threading.Event()
    with waiter_harness(1_000) as h:
        (first,) = held_past_a_poll(h, 1)
        h.fake.entered["cuEventQuery"] = inside
        h.fake.gate["cuEventQuery"] = gate
        waiter = threading.Thread(target=lambda: first.wait(TIMEOUT_S))
        waiter.start()
        assert inside.wait(TIMEOUT_S)  # the waiter is inside its query
        before = thread_queries(h) - 1  # that one is the waiter's (not the test's thread)
        second = _issue(h, 2)
        assert wait_until(lambda: second.times()[2] != 0, 5.0), "the next job was not issued"
        time.sleep(0.05)
        assert thread_queries(h) - 1 == before, "the thread queried the job its waiter queries"
        del h.fake.gate["cuEventQuery"]
        h.fake.not_ready = 0
        gate.set()
        waiter.join(TIMEOUT_S)
        assert first.done() and second.wait(1.0)
        first.release()
        second.release()


def test_waiters_and_the_thread_racing_to_find_jobs_done_find_each_once_in_order() -> None:
    # Jobs two at a time, each event not ready at its first queries; the thread polls every 20 us
    # and the waits query every microsecond: every job is found done once, every page lands. (With
    # the thread's first polls 2 us apart, a CI run under AddressSanitizer on a loaded 2-core
    # machine had the thread find all 120 jobs: no race to prove. 20 us leaves the waiters theirs.)
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]), not_ready=3,
                tune={"wait_query_ns": 1_000, "end_lead_ns": 0, "poll_min_ns": 20_000})
    try:
        want: dict[int, int] = {}
        for job in range(0, 120, 2):
            pairs = [(job % 60, 60 + job % 4), ((job + 1) % 60, 62 + (job + 1) % 2)]
            for k, (src, dst) in enumerate(pairs):
                h.handler.submit(job + k, [src], [dst])
            results = h.handler.wait([job, job + 1], TIMEOUT_S)
            assert all(r.ok for r in results)
            for src, dst in pairs:  # a later job's pages replace an earlier one's
                want.update(expected(h.plan, [src], [dst]))
        assert moved(h.fake, want) == 0
        assert 0 < counts(h)[3] <= 120
    finally:
        h.close()


def test_a_stop_that_comes_while_the_thread_queries_is_not_left_for_the_polling_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The thread is inside a query of a job that never ends, its polls sleeping 30 s, when the
    # owner stops it (nothing to signal): it looks before it sleeps and stops within the deadline.
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]),
                tune={"poll_min_ns": 30_000_000_000, "poll_max_ns": 30_000_000_000, "end_lead_ns": 0})
    querying, gate, stopping = threading.Event(), threading.Event(), threading.Event()
    stop = h.backend.lib.kvo_issuer_stop

    def announced_stop(issuer: int, timeout_ns: int) -> int:
        # The stop waits 5 s (the shutdown's drain used up its own 0.2 s): long enough for the
        # held query, far shorter than the 30 s polling sleep the thread must not take.
        stopping.set()
        return int(stop(issuer, 5_000_000_000))

    monkeypatch.setattr(h.backend.lib, "kvo_issuer_stop", announced_stop)
    h.fake.not_ready = 1 << 40
    try:
        h.fake.entered["cuEventQuery"] = querying
        h.fake.gate["cuEventQuery"] = gate
        h.handler.submit(0, [1], [2])
        assert querying.wait(TIMEOUT_S)
        outcome: list[BaseException] = []

        def shut() -> None:
            try:
                h.handler.shutdown(0.2)  # the drain gives the job up, then the thread is stopped
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome.append(exc)

        closer = threading.Thread(target=shut)
        closer.start()
        assert stopping.wait(TIMEOUT_S)
        time.sleep(0.2)  # the stop is set (under the issuer's lock) while the thread queries
        gate.set()
        closer.join(TIMEOUT_S)
        assert not closer.is_alive()
        assert [type(e) for e in outcome] == [WaitTimeoutError]  # not "did not stop"
        assert h.inner.released == 1
    finally:
        h.fake.not_ready = 0
        h.fake.gate.clear()
        gate.set()


def queries_around_the_predicted_end(lead_ns: int) -> tuple[int, int, int]:
    """Queries of a job's end event while it stays in flight, the thread's sleeping polls 20 ms
    apart and the job predicted to end 200 ms after its issue began: in its first 100 ms, from
    150 to 250 ms, and from 350 to 550 ms (the counts are read at those times by this thread)."""
    h = Harness(Direction.STORE, "dma", make_plan(Direction.STORE, [256]),
                tune={"poll_min_ns": 20_000_000, "poll_max_ns": 20_000_000, "end_lead_ns": lead_ns})
    try:
        h.fake.elapsed_ms = 200.0
        assert _issue(h, 1).wait(TIMEOUT_S)  # 200 ms per 256 bytes, as far as the thread knows
        h.fake.not_ready = 1 << 40
        before = len(h.fake.of("cuEventQuery"))
        ticket = _issue(h, 1)
        assert wait_until(lambda: ticket.times()[1] != 0)
        began = ticket.times()[1]
        counts = []
        for at in (0.1, 0.15, 0.25, 0.35, 0.55):
            time.sleep(max(0.0, began + at - time.monotonic()))
            counts.append(len(h.fake.of("cuEventQuery")) - before)
        return counts[0], counts[2] - counts[1], counts[4] - counts[3]
    finally:
        h.fake.not_ready = 0
        h.close()


def test_a_job_is_polled_without_sleeps_around_its_predicted_end_and_only_there() -> None:
    # Control: without a lead the thread polls every 20 ms throughout.
    early, near, late = queries_around_the_predicted_end(0)
    assert near <= 8, "the control polled without sleeps: the test proves nothing"
    early, near, late = queries_around_the_predicted_end(50_000_000)
    assert early <= 8  # asleep far from the end
    assert near >= 40  # around it (each query is a Python call here: still thousands)
    assert late <= 16  # 50 ms past the predicted end the sleeping polls resume


def test_completion_is_found_by_the_thread_and_signalled() -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, not_ready=5)
    try:
        result = h.run(0, [1, 2], [3, 4])
        assert result.ok
        assert result.seconds == pytest.approx(0.5e-3)
        assert len(h.fake.of("cuEventQuery")) >= 6
    finally:
        h.close()


@pytest.mark.parametrize(("call", "partly"), [("cuLaunchKernel", True), ("cuStreamWaitEvent", False)])
def test_a_failed_issue_comes_back_as_a_failed_result(call: str, partly: bool) -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        h.fake.fail[call] = 1  # CUDA_ERROR_INVALID_VALUE
        result = h.run(0, [1], [2])
        assert not result.ok
        assert isinstance(result.error, CudaError)
        assert call in str(result.error)
        assert bool(h.fake.of("cuEventQuery")) == partly  # only a partly issued job is waited for
        assert h.run(1, [1], [2]).ok  # the next job goes through
    finally:
        h.close()


def test_a_fence_the_hand_off_fails_to_record_fails_its_job_and_nothing_leaks() -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        h.fake.fail["cuEventRecord"] = 1  # the handler's fence, recorded in the hand-off's call
        result = h.run(0, [1], [2])
        assert not result.ok and isinstance(result.error, CudaError)
        assert "cuEventRecord" in str(result.error)
        assert not h.fake.of("cuLaunchKernel"), "a job whose fence failed was enqueued"
        assert h.run(1, [1], [2]).ok  # the next job goes through
    finally:
        h.close()
    assert h.fake.events_destroyed == h.fake.events_created  # the failed fence's event went back


def test_a_fence_recorded_without_a_current_context_is_recorded_again_in_the_issuers() -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        h.fake.fail["cuEventRecord"] = 201  # CUDA_ERROR_INVALID_CONTEXT on the caller's thread
        before = len(h.fake.of("cuCtxSetCurrent"))
        assert h.run(0, [1], [2]).ok
        calls = [c[0] for c in h.fake.snapshot()]
        first = calls.index("cuEventRecord")
        assert calls[first + 1: first + 3] == ["cuCtxSetCurrent", "cuEventRecord"]
        assert len(h.fake.of("cuCtxSetCurrent")) == before + 1
        h.fake.fail["cuEventRecord"] = 700  # any other code is the job's failure, not retried
        assert not h.run(1, [1], [2]).ok
    finally:
        h.close()


def test_a_failed_completion_comes_back_as_a_failed_result() -> None:
    plan = make_plan(Direction.LOAD, [256])
    h = Harness(Direction.LOAD, "dma", plan)
    try:
        h.fake.fail["cuEventQuery"] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
        result = h.run(0, [1], [2])
        assert not result.ok and isinstance(result.error, CudaError)
    finally:
        h.close()


def test_a_layer_waited_for_after_its_job_failed_says_it_did_not_land() -> None:
    """A layered load whose completion failed, its result not yet taken: the library's layer wait
    says the job failed (``JOB_FAILED``) and the marks' wait returns False, which tells
    ``LayerLoad.wait_layer`` that nothing landed (a shutdown that gave the job up is then a
    ``ClosedError``); before, the wait returned as for a layer that landed."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    h = Harness(Direction.LOAD, "sm", plan, tune=THREAD_ISSUES)
    try:
        h.fake.fail["cuEventQuery"] = 700  # CUDA_ERROR_ILLEGAL_ADDRESS: the completion fails
        marks = submit_layered(h, 0, [1, 2], [3, 4])
        assert wait_until(lambda: marks._job is not None)
        lib, job = native.library(), marks._job
        assert wait_until(lambda: lib.kvo_wait_layer(job, 0, IDLE, 10**8) == native.JOB_FAILED)
        assert marks.wait(2, IDLE, TIMEOUT_S) is False
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert not result.ok
        assert marks.wait(2, IDLE, TIMEOUT_S) is True  # published: its result says why
    finally:
        h.close()


@pytest.mark.parametrize("in_flight", [False, True], ids=["job done", "job in flight"])
def test_a_layer_its_partly_failed_issue_enqueued_landed_and_the_others_did_not(in_flight: bool) -> None:
    """Layer 1's launch fails after layer 0's ran: a wait for layer 0 says it landed and one for
    layer 2 says it did not (every layer of a failed job read as not landed, so a shutdown
    meanwhile failed a forward whose layer had landed: found by a review). So it does while the
    job's end is not complete yet (before, until the job was done, the wait enqueued a stream wait
    on the mark recorded for layer 2 after the failure and said it landed: found by a review)."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    h = Harness(Direction.LOAD, "sm", plan, tune=THREAD_ISSUES, not_ready=10**9 if in_flight else 0)
    try:
        gate = threading.Event()
        h.fake.gate["cuLaunchKernel"] = gate
        marks = submit_layered(h, 0, [1, 2], [3, 4])
        assert wait_until(lambda: len(h.fake.of("cuLaunchKernel")) >= 1)  # layer 0's launch
        h.fake.fail["cuLaunchKernel"] = 1  # the next launch (layer 1's) fails
        del h.fake.gate["cuLaunchKernel"]
        gate.set()
        assert wait_until(lambda: marks._job is not None)
        lib, job = native.library(), marks._job
        assert wait_until(lambda: lib.kvo_wait_layer(job, 2, IDLE, 10**8) == native.JOB_FAILED)
        assert marks.wait(0, IDLE, TIMEOUT_S) is True
        assert marks.wait(1, IDLE, TIMEOUT_S) is False and marks.wait(2, IDLE, TIMEOUT_S) is False
        if in_flight:
            with pytest.raises(WaitTimeoutError):
                h.handler.wait([0], 0.2)  # the job is not done: its end is not complete
            h.fake.not_ready = 0
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert not result.ok
    finally:
        h.close()


@pytest.mark.parametrize("path", ["sm", "staged"])
def test_a_job_whose_end_record_failed_once_ends_only_after_its_copies(path: str) -> None:
    """The end's record after the copies were enqueued fails once (the staged load's wait between
    its streams first, for ``staged``): the job failed, and it was done at once, its blocks free
    while its copies still ran (rule 5; found by a review). The end is recorded again with another
    event (after the refused wait too): the job ends only once its end is found complete."""
    direction = Direction.STORE if path == "sm" else Direction.LOAD
    plan = make_plan(direction, [256])
    h = Harness(direction, path, plan, not_ready=10**9, tune=THREAD_ISSUES)
    try:
        gate, entered = threading.Event(), threading.Event()
        h.fake.gate["cuLaunchKernel"] = gate  # the job's last launch (its scatter, for staged)
        h.fake.entered["cuLaunchKernel"] = entered
        h.handler.submit(0, [1], [2])
        assert entered.wait(TIMEOUT_S)
        if path == "staged":  # the copy stream's record for the kernel stream's wait on it (the
            h.fake.fail_on[("cuEventRecord", COPY)] = 1  # first there after the last scatter)
        else:
            h.fake.fail["cuEventRecord"] = 1  # CUDA_ERROR_INVALID_VALUE: the end's record
        del h.fake.gate["cuLaunchKernel"]
        gate.set()
        with pytest.raises(WaitTimeoutError):
            h.handler.wait([0], 0.3)  # its end not complete: still in flight
        h.fake.not_ready = 0
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert not result.ok and isinstance(result.error, CudaError)
        assert h.run(1, [1], [2]).ok  # the next job goes through
    finally:
        h.close()


def test_a_failed_staged_store_ends_after_the_gather_it_launched() -> None:
    """A staged store whose chunk failed after its gather was launched (the record for its DMA's
    wait refused) ends on the copy stream, which would not follow that gather: the gather could
    read the job's device blocks after the job ended (rule 5; found by a review). The copy stream
    now waits for the kernel stream before the end."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "staged", plan, tune=THREAD_ISSUES)
    try:
        gate, entered = threading.Event(), threading.Event()
        h.fake.gate["cuLaunchKernel"] = gate  # the chunk's gather
        h.fake.entered["cuLaunchKernel"] = entered
        h.handler.submit(0, [1], [2])
        assert entered.wait(TIMEOUT_S)
        h.fake.fail_on[("cuEventRecord", KERNEL)] = 1  # the slot's "filled", for the DMA's wait
        del h.fake.gate["cuLaunchKernel"]
        gate.set()
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert not result.ok and isinstance(result.error, CudaError)
        calls = h.fake.snapshot()
        launch = max(i for i, c in enumerate(calls) if c[0] == "cuLaunchKernel")
        end = max(i for i, c in enumerate(calls) if c[0] == "cuEventRecord" and c[2] == COPY)
        after_gather = {c[1] for c in calls[launch + 2:end] if c[0] == "cuEventRecord" and c[2] == KERNEL}
        joined = [c for c in calls[launch:end] if c[0] == "cuStreamWaitEvent" and c[1] == COPY
                  and c[2] in after_gather]
        assert joined, "the failed store's end on the copy stream does not follow its gather"
        assert h.run(1, [1], [2]).ok  # the next job goes through
    finally:
        h.close()


def test_shutdown_gives_up_a_job_that_never_completes_within_its_deadline() -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "dma", plan, not_ready=10**9)
    h.handler.submit(0, [1], [2])
    with pytest.raises(WaitTimeoutError):
        h.handler.shutdown(0.2)
    assert h.inner.released == 1  # the thread stopped and the streams went


def _stuck_in_a_launch(monkeypatch: pytest.MonkeyPatch, h: Harness) -> threading.Event:
    """Job 0 submitted, its thread held inside cuLaunchKernel until the returned gate is set; a
    stop waits 0.2 s for it at most."""
    gate, entered = threading.Event(), threading.Event()
    h.fake.gate["cuLaunchKernel"] = gate
    h.fake.entered["cuLaunchKernel"] = entered
    h.handler.submit(0, [1], [2])
    assert entered.wait(TIMEOUT_S)
    monkeypatch.setattr(native_backend, "STOP_TIMEOUT_S", 0.2)
    return gate


def test_release_is_bounded_while_the_thread_is_stuck_in_a_driver_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, tune=THREAD_ISSUES)
    gate = _stuck_in_a_launch(monkeypatch, h)
    with pytest.raises(ShutdownError) as raised:
        h.handler.shutdown(0.2)
    assert any(isinstance(e, TransferError) and "did not stop" in str(e)
               for e in raised.value.failures)
    assert h.inner.released == 0  # its streams are left to the thread
    gate.set()  # the driver call returns: the thread leaves
    assert h.backend.lib.kvo_issuer_stop(h.backend._issuer, 10**10) == 0


class _Region:
    """The worker's region as the teardown sees it: records whether it was released or left."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def cleanup(self) -> None:
        self.calls.append("cleanup")

    def abandon(self) -> None:
        self.calls.append("abandon")


class _OwnThreadAnswer:
    """The control: the handler as it answered when it ran a thread of its own beside the
    backend's (stopped as soon as the shutdown asked, whatever the backend's thread was doing)."""

    def __init__(self, handler: DirectionHandler) -> None:
        self.handler = handler
        self.thread_stopped = True

    def shutdown(self, timeout: float) -> None:
        self.handler.shutdown(timeout)


@pytest.mark.parametrize("control", [False, True])
def test_a_thread_stuck_in_a_driver_call_past_the_release_keeps_the_region_mapped(
    monkeypatch: pytest.MonkeyPatch, control: bool,
) -> None:
    """The handler over the native backend starts no thread; its ``thread_stopped`` is the native
    thread's. That thread, held inside a driver call past the shutdown's deadline, may still
    enqueue copies of the region's pages when the call returns: the worker's teardown, with the
    device proven idle, must leave the region mapped. Once the thread left, the handler says so
    (and the library joins the thread once, however often it is asked). The control answers as
    the handler's own thread did: the region is released under the stuck thread."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, tune=THREAD_ISSUES)

    def stopped() -> bool:
        return h.handler.thread_stopped

    assert h.handler._thread is None
    assert not h.handler.thread_stopped  # running
    gate = _stuck_in_a_launch(monkeypatch, h)
    region = _Region()
    part = _OwnThreadAnswer(h.handler) if control else h.handler
    teardown = Teardown([("store handler", part)], region,  # type: ignore[arg-type]
                        lambda _timeout: True)
    try:
        with pytest.raises(ShutdownError) as raised:
            teardown.run(0.2)
        if control:
            assert region.calls == ["cleanup"]  # the hazard: released under a live thread
            return
        assert region.calls == ["abandon"] and raised.value.region_left_mapped
        assert not stopped() and not stopped()  # asked twice: nothing joined
    finally:
        gate.set()  # the driver call returns: the thread leaves
    deadline = time.monotonic() + TIMEOUT_S
    while not stopped():
        assert time.monotonic() < deadline, "the thread never left"
        time.sleep(0.01)
    assert stopped()  # joined once; asking again joins nothing
    assert h.backend.lib.kvo_issuer_stop(h.backend._issuer, 0) == 0


def test_a_start_whose_thread_failed_and_does_not_stop_leaves_the_issuer_to_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread started but could not make the device's context current; the start stops it,
    and when that stop times out (the thread still inside a driver call) the issuer's memory is
    not freed under it: the start raises saying so. (It freed the issuer whatever the stop said.)"""
    lib = native.library()
    real_stop, real_free = lib.kvo_issuer_stop, lib.kvo_issuer_free
    stopped: list[int] = []
    freed: list[int] = []

    def stuck_stop(issuer: int, timeout_ns: int) -> int:
        stopped.append(issuer)
        return 1

    monkeypatch.setattr(lib, "kvo_issuer_stop", stuck_stop)
    monkeypatch.setattr(lib, "kvo_issuer_free", freed.append)
    fake = FakeDriver()
    fake.fail["cuCtxSetCurrent"] = 201
    keep: list[object] = []
    config = fake.config(store=True, slots=SLOT_BASES, slot_bytes=4096, batch=True, keep=keep)
    try:
        with pytest.raises(TransferError, match="did not stop within"):
            NativeBackend.start(Inner(Direction.STORE), config, index=0, choose=lambda _n: "dma",
                                path_names={"dma": "dma"}, tables=None, keep=keep)
        assert len(stopped) == 1 and not freed
    finally:
        monkeypatch.undo()
        for issuer in stopped:  # the thread leaves: the test frees what the start left
            assert real_stop(issuer, 10**10) == 0
            real_free(issuer)


@pytest.mark.parametrize("given", [True, False])
def test_a_shutdown_stops_a_stuck_thread_within_its_own_deadline(
    monkeypatch: pytest.MonkeyPatch, given: bool,
) -> None:
    """The stop waits for the shutdown's time left (at least ``ISSUER_JOIN_MIN_S``), not for
    ``STOP_TIMEOUT_S``: with that set to an hour, the handler's shutdown of 0.2 s gives the stop
    at most 0.2 s. The control, a release given no time (as before), waits the full bound."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, tune=THREAD_ISSUES)
    gate, entered = threading.Event(), threading.Event()
    h.fake.gate["cuLaunchKernel"] = gate
    h.fake.entered["cuLaunchKernel"] = entered
    stop = h.backend.lib.kvo_issuer_stop
    asked: list[int] = []

    def recorded_stop(issuer: int, timeout_ns: int) -> int:
        asked.append(timeout_ns)
        return int(stop(issuer, min(timeout_ns, 200_000_000)))  # never an hour in the control

    monkeypatch.setattr(native_backend, "STOP_TIMEOUT_S", 3600.0)
    monkeypatch.setattr(h.backend.lib, "kvo_issuer_stop", recorded_stop)
    h.handler.submit(0, [1], [2])
    assert entered.wait(TIMEOUT_S)
    try:
        if given:
            with pytest.raises(ShutdownError) as raised:
                h.handler.shutdown(0.2)
            assert any(isinstance(e, TransferError) and "did not stop" in str(e)
                       for e in raised.value.failures)
            assert len(asked) == 1 and ISSUER_JOIN_MIN_S * 1e9 <= asked[0] <= 0.2e9
        else:
            with pytest.raises(TransferError, match="did not stop within 3600.000 s"):
                h.backend.release()
            assert asked == [3600 * 10**9]
        assert h.inner.released == 0  # its streams are left to the thread
    finally:
        gate.set()  # the driver call returns: the thread leaves
        assert stop(h.backend._issuer, 10**10) == 0
        if not given:  # the job in flight when its backend was released fails the drain
            with pytest.raises(TransferError, match="released while the job was in flight"):
                h.handler.shutdown(TIMEOUT_S)


def test_every_event_is_destroyed_once_the_issuer_stopped() -> None:
    plan = make_plan(Direction.LOAD, [256, 512])
    h = Harness(Direction.LOAD, "staged", plan)
    for job in range(5):
        assert h.run(job, [job, job + 10], [job + 20, job + 30]).ok
    h.close()
    assert h.fake.events_created > 0
    assert h.fake.events_destroyed == h.fake.events_created
    assert h.inner.released == 1


#: The fake drivers of orphaned threads, kept to the end of the process: nothing joins such a
#: thread, which may still be returning from its last callback when its test ends.
_ORPHANS_DRIVERS: list[FakeDriver] = []


@pytest.mark.parametrize("call", ["cuCtxSetCurrent", "cuEventCreate"])
def test_a_thread_that_does_not_start_within_its_deadline_fails_the_start_and_frees_the_issuer_itself(
    call: str,
) -> None:
    """The driver holds the new thread's start (its context, or its slots' events): the start
    returns at its deadline with a TransferError and the caller still owns what it passed; once the
    driver returns, the thread destroys what it created and frees the library's memory (the
    sanitized run of this test is the proof that nothing is touched after). Control: the same
    start given 30 s is still waiting after 0.5 s (the start waited untimed for the thread before)."""
    fake, keep = FakeDriver(), list[object]()
    gate = threading.Event()
    fake.gate[call] = gate
    config = fake.config(store=True, slots=SLOT_BASES, slot_bytes=4096, keep=keep,
                         start_timeout_ns=200_000_000)
    inner = Inner(Direction.STORE)
    began = time.monotonic()
    try:
        with pytest.raises(TransferError, match="did not start within 0.2 s"):
            NativeBackend.start(inner, config, index=0, choose=lambda _n: "sm", path_names={"sm": "sm"},
                                tables=None, keep=keep)
        assert time.monotonic() - began < 2.0
        assert inner.released == 0  # the caller still owns it
    finally:
        gate.set()
    assert wait_until(lambda: fake.events_created == 2 * len(SLOT_BASES)
                      and fake.events_destroyed == fake.events_created), "the orphaned thread kept its events"
    _ORPHANS_DRIVERS.append(fake)  # its callbacks outlive the test: the thread may still be returning
    # Control: a start given 30 s waits for the driver as long as it holds the call.
    fake, keep = FakeDriver(), list[object]()
    gate = threading.Event()
    fake.gate[call] = gate
    config = fake.config(store=True, slots=SLOT_BASES, slot_bytes=4096, keep=keep,
                         start_timeout_ns=30 * 10**9)
    lib, error, out = native.library(), ctypes.c_int64(0), []
    starter = threading.Thread(target=lambda: out.append(lib.kvo_issuer_new(ctypes.byref(config),
                                                                            ctypes.byref(error))))
    starter.start()
    starter.join(0.5)
    still_waiting = starter.is_alive()
    gate.set()
    starter.join(TIMEOUT_S)
    assert still_waiting, "the control's start returned while the driver held its thread"
    assert out and out[0] and error.value == 0
    assert lib.kvo_issuer_stop(out[0], 10**10) == 0
    lib.kvo_issuer_free(out[0])


def test_the_librarys_layer_wait_refuses_what_is_not_a_layer_and_takes_a_negative_timeout_as_none() -> None:
    """``kvo_wait_layer`` called directly (the Python side checks first): a layer out of range, or a
    job that is not layered, is BAD_ARGUMENT without touching the marks; a negative timeout on a
    layer not marked yet is a TIMEOUT at once (a negative deadline made the wait's timespec invalid,
    and the wait looped on EINVAL)."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])  # three layers of two pages
    h = Harness(Direction.LOAD, "sm", plan, tune=THREAD_ISSUES)
    lib = native.library()
    try:
        held = threading.Event()  # the thread is held before it marks anything
        h.fake.gate["cuStreamWaitEvent"] = held
        h.handler._book.reserve(0, h.handler)
        marks = h.handler.submit_layered(0, np.array([1, 2], dtype=np.int64), np.array([3, 4], dtype=np.int64),
                                         layer_tables(plan))
        assert isinstance(marks, NativeLayerMarks)
        assert wait_until(lambda: marks._job is not None)
        job = marks._job
        for layer in (-1, 3, 1 << 40):
            assert lib.kvo_wait_layer(job, layer, IDLE, 10**9) == native.BAD_ARGUMENT
        ids = np.arange(1, dtype=np.int64)
        fence = h.backend.fence(None)
        ticket = h.backend.issue(plan, ids + 5, ids + 5, fence)  # queued behind the held load
        h.backend.release_fence(fence)
        assert isinstance(ticket, native_backend.NativeTicket) and not ticket.done()
        assert lib.kvo_wait_layer(ticket._job, 0, IDLE, 10**9) == native.BAD_ARGUMENT
        result: list[int] = []
        waiter = threading.Thread(target=lambda: result.append(lib.kvo_wait_layer(job, 0, IDLE, -5)))
        waiter.start()
        waiter.join(2.0)
        alive = waiter.is_alive()
        held.set()
        waiter.join(TIMEOUT_S)
        assert not alive and result == [native.TIMEOUT]
        del h.fake.gate["cuStreamWaitEvent"]
        (done,) = h.handler.wait([0], TIMEOUT_S)
        assert done.ok, done.error
        assert ticket.wait(TIMEOUT_S) and ticket.error is None
    finally:
        h.close()


def test_a_job_handed_over_after_release_fails_and_nothing_is_enqueued() -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "dma", plan)
    fence = h.backend.fence(None)
    h.backend.release()
    ticket = h.backend.issue(plan, np.array([1], dtype=np.int64), np.array([2], dtype=np.int64), fence)
    assert ticket.done() and isinstance(ticket.error, TransferError)
    h.handler.shutdown(TIMEOUT_S)


# ------------------------------------------------------------------------------- the build


def test_the_library_builds_into_a_directory_once(tmp_path: Path) -> None:
    first = native.build(tmp_path)
    assert first.exists() and first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left


def test_extra_compiler_flags_build_a_library_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = native.build(tmp_path)
    monkeypatch.setenv("KVOFFLOAD_NATIVE_CFLAGS", "-DKVO_EXTRA=1  -g")
    flagged = native.build(tmp_path)
    assert flagged != plain and sorted(p.name for p in tmp_path.iterdir()) == sorted([plain.name, flagged.name])
    monkeypatch.setenv("KVOFFLOAD_NATIVE_CFLAGS", "-fno-such-flag")
    with pytest.raises(NativeBuildError, match="fno-such-flag"):  # the flags reach the compiler
        native.build(tmp_path)


def test_a_failed_build_raises_with_the_compilers_word(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "false")
    with pytest.raises(NativeBuildError, match="could not build"):
        native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NativeBuildError, match="no C compiler"):
        native.build(tmp_path / "other")


@pytest.mark.parametrize("cut", [0, 1000, 4096, -1], ids=["empty", "1000", "4096", "one-byte-short"])
def test_a_library_cut_short_in_the_cache_is_built_again(tmp_path: Path, cut: int) -> None:
    """(A truncated library under the cached name was loaded: the process died with SIGBUS.)"""
    whole = native.build(tmp_path)
    size = whole.stat().st_size
    os.truncate(whole, cut if cut >= 0 else size - 1)
    assert native.build(tmp_path) == whole and whole.stat().st_size == size
    assert native._incomplete(whole) is None  # noqa: SLF001
    probe = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(whole)!r}).kvo_issuer_new"],
                           capture_output=True, check=False, timeout=60)
    assert probe.returncode == 0, probe.stderr


def test_a_compiler_that_writes_no_library_is_refused_and_nothing_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(``CC=true`` or ``-fsyntax-only`` exited 0 and the empty file was cached under the final name:
    the fallback stayed for good, whatever compiler came later.)"""
    monkeypatch.setenv("CC", "true")
    with pytest.raises(NativeBuildError, match="did not write a whole"):
        native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv("CC")
    assert native._incomplete(native.build(tmp_path)) is None  # noqa: SLF001


def test_a_killed_builds_temporary_file_is_removed_by_the_next_build_once_abandoned(tmp_path: Path) -> None:
    """(A build killed before its rename left its temporary file in the cache for good.) A recent
    one may be a build running in another process: it stays."""
    abandoned = tmp_path / ".kvoffload-issuer-killed.so"
    running = tmp_path / ".kvoffload-issuer-running.so"
    other = tmp_path / ".kvoffload-front-killed.so"
    for path in (abandoned, running, other):
        path.write_bytes(b"\x7fELF")
    old = time.time() - native.ABANDONED_AFTER_S - 1
    os.utime(abandoned, (old, old))
    os.utime(other, (old, old))
    built = native.build(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([built.name, running.name, other.name])


def test_another_library_under_the_cached_name_is_a_build_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(A whole shared object without the library's functions raised AttributeError.)"""
    name = native.build(tmp_path).name
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.c").write_text("int x(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(other / name), str(other / "x.c")], check=True, timeout=60)
    monkeypatch.setattr(native, "build", lambda directory=None: other / name)
    native.library.cache_clear()
    try:
        with pytest.raises(NativeBuildError, match="lacks kvo_issuer_new"):
            native.library()
    finally:
        native.library.cache_clear()


def test_a_cache_directory_that_cannot_be_searched_is_a_build_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(PermissionError escaped Worker.create where the cache's parent could not be searched.)"""
    def refuse(self: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "exists", refuse)
    with pytest.raises(NativeBuildError, match="cannot look for the native issuer"):
        native.build(tmp_path)


def test_worker_issuer_argument_is_checked_before_anything_is_built() -> None:
    layout = DeviceLayout.from_tensors([torch.zeros(8, 16, 64, dtype=torch.uint8)], block_dim=0)
    with pytest.raises(ArgumentTypeError, match="issuer"):
        Worker.create(layout, 4, issuer=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="one of auto, native, python"):
        Worker.create(layout, 4, issuer="fast")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="cuda backend only"):
        Worker.create(layout, 4, issuer="native")
    with Worker.create(layout, 4) as w:
        assert w.issuer == "python"  # the host backend copies on its own thread


def test_native_error_names_the_failure() -> None:
    assert "released before" in str(native_backend.native_error(native.RELEASED, "x"))
    assert "in flight" in str(native_backend.native_error(native.ABANDONED, "x"))
    assert "staging slot" in str(native_backend.native_error(native.RECORD_TOO_BIG, "x"))
    error = native_backend.native_error(1, "cuLaunchKernel")
    assert isinstance(error, CudaError) and "cuLaunchKernel" in str(error)
    assert ctypes.sizeof(native.Config) % 8 == 0


# --------------------------------------------------------------------- the worker's admission check


def _admit_outcome(book: Bookkeeping, job: int, direction: Direction, reads: I64, writes: I64) -> str:
    try:
        book.admit(job, direction, reads, writes, "src", "dst")
    except (InvalidBlockIdError, BlockConflictError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "admitted"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(
    st.sampled_from([Direction.STORE, Direction.LOAD, Direction.DEMOTE]),
    st.lists(st.integers(0, 11), min_size=0, max_size=20),
    st.lists(st.integers(0, 11), min_size=0, max_size=20),
    st.booleans(),
), min_size=1, max_size=25))
def test_native_admission_admits_refuses_and_counts_as_the_python_checks(
    jobs: list[tuple[Direction, list[int], list[int], bool]],
) -> None:
    sizes = {Memory.DEVICE: 12, Memory.HOST: 12, Memory.DISK: 12}
    fast, slow = Bookkeeping(sizes), Bookkeeping(sizes, native_checks=False)
    assert fast.checks_pairs and not slow.checks_pairs
    for job, (direction, src, dst, finish_one) in enumerate(jobs):
        n = min(len(src), len(dst)) if job % 5 else len(src)  # every fifth: lengths may differ
        reads, writes = np.array(src[:n], dtype=np.int64), np.array(dst[: n if job % 5 else len(dst)],
                                                                        dtype=np.int64)
        assert _admit_outcome(fast, job, direction, reads, writes) == _admit_outcome(
            slow, job, direction, reads, writes)
        if finish_one and fast.jobs:
            first = next(iter(fast.jobs))
            fast.remove(first)
            slow.remove(first)
        for memory in sizes:  # a block is busy in one exactly when it is in the other
            assert np.array_equal(fast.reads[memory] > 0, slow.reads[memory] > 0)
            assert np.array_equal(fast.writes[memory] > 0, slow.writes[memory] > 0)
    for job in list(fast.jobs):
        fast.remove(job)
    for memory in sizes:  # every count returns to zero, whatever each path counted
        assert not fast.reads[memory].any() and not fast.writes[memory].any()


def test_tune_sets_the_issuers_fields_from_the_module_constants_read_at_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(native_backend, "WAIT_QUERY_S", 3e-6)
    monkeypatch.setattr(native_backend, "CALLER_ISSUE_MAX", 7)
    monkeypatch.setattr(native_backend, "STRIDED_MIN_ROWS", 9)
    monkeypatch.setattr(native_backend, "STRIDED_ROW_BYTES", 33)
    c = native.Config()
    native_backend.tune(c)
    assert (c.wait_query_ns, c.caller_issue_max, c.strided_min_rows, c.strided_row_bytes) == (3000, 7, 9, 33)
    assert c.expect_spin_ns == round(native_backend.EXPECT_SPIN_S * 1e9)
    assert c.caller_coming_ns == round(native_backend.CALLER_COMING_S * 1e9)
    assert c.poll_max_ns == round(native_backend.POLL_MAX_S * 1e9)


# ------------------------------------------------------------------------------------- the book


def _in_flight_then_booked_failed(h: Harness) -> None:
    """Job 0 handed over and issued, its end never found (the fake's events stay not ready); job
    1's fence fails to record in its hand-off, so the library books it failed, done at once."""
    h.fake.not_ready = 1 << 40
    h.handler.submit(0, [1], [2])
    counts = (ctypes.c_int64 * 6)()
    h.backend.lib.kvo_issuer_counts(h.backend._issuer, counts)  # noqa: SLF001
    assert counts[2] == 1  # issued by its caller inside the hand-off: every record of it was made
    h.fake.fail["cuEventRecord"] = 1  # CUDA_ERROR_INVALID_VALUE, for job 1's fence
    h.handler.submit(1, [3], [4])


@pytest.mark.parametrize("control", [False, True])
def test_a_job_booked_failed_behind_one_in_flight_is_published_after_it(control: bool) -> None:
    """Results leave the book in hand-off order: job 1, failed at its hand-off, waits for job 0,
    still in flight, and both come back in that order. The control (``CONTROL_BOOK_ANY_ORDER``:
    the take looks past a job not done) publishes job 1 first."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, controls=native.CONTROL_BOOK_ANY_ORDER if control else 0)
    try:
        _in_flight_then_booked_failed(h)
        results: dict[int, Any] = {}
        order: list[int] = []

        def gathered() -> bool:
            for r in h.handler.poll():
                results[r.job_id] = r
                order.append(r.job_id)
            return len(order) == 2

        gathered()
        assert order == ([1] if control else [])  # job 0 is still in flight
        assert h.handler.stats().in_flight == 2 - len(order)
        h.fake.not_ready = 0
        assert wait_until(gathered)
        assert order == ([1, 0] if control else [0, 1])
        assert results[0].ok and not results[1].ok
        assert isinstance(results[1].error, CudaError) and "cuEventRecord" in str(results[1].error)
        assert h.handler.stats().in_flight == 0
    finally:
        h.close()


@pytest.mark.parametrize("control", [False, True])
def test_a_wait_for_a_job_booked_failed_behind_one_in_flight_blocks_in_the_library(
    control: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wait for job 1 (done, failed, behind job 0 in flight) blocks in the library on job 0, the
    first job before it not done: a handful of calls in 0.3 s. The control
    (``CONTROL_BOOK_WAIT_ITSELF``: the library's wait returns at once for a job done) spins through
    thousands."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan, controls=native.CONTROL_BOOK_WAIT_ITSELF if control else 0)
    try:
        _in_flight_then_booked_failed(h)
        calls = [0]
        book_wait = h.backend.book_wait

        def counted(job_id: int | None, timeout_s: float) -> bool:
            calls[0] += 1
            return book_wait(job_id, timeout_s)

        monkeypatch.setattr(h.backend, "book_wait", counted)
        with pytest.raises(WaitTimeoutError):
            h.handler.wait([1], 0.3)
        if control:
            assert calls[0] > 100
        else:
            assert 1 <= calls[0] <= 4  # one per slice of the job book's wait
        h.fake.not_ready = 0
        assert [r.ok for r in h.handler.wait([0, 1], TIMEOUT_S)] == [True, False]
    finally:
        h.close()


def test_a_release_while_a_book_call_is_inside_the_library_frees_the_issuer_once_it_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiter is inside the library's book wait when the backend is released: the issuer's memory
    stays until the waiter left, then goes, once (the release alone freed it under the waiter)."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    backend = h.backend
    lib = backend.lib
    issuer = backend._issuer  # noqa: SLF001
    freed: list[int] = []
    free = lib.kvo_issuer_free
    def recorded_free(pointer: int) -> None:
        freed.append(int(pointer))
        free(pointer)

    monkeypatch.setattr(lib, "kvo_issuer_free", recorded_free)
    inside, leave = threading.Event(), threading.Event()
    front = backend._front  # noqa: SLF001
    assert front is not None  # the call front is built on this machine (CI builds it)
    real = front.book_wait

    def held(*args: Any) -> int:
        done = int(real(*args))
        inside.set()
        assert leave.wait(TIMEOUT_S)
        return done

    monkeypatch.setattr(front, "book_wait", held)
    try:
        h.fake.not_ready = 1 << 40
        h.handler.submit(0, [1], [2])
        waiter = threading.Thread(target=backend.book_wait, args=(0, 0.01))
        waiter.start()
        assert inside.wait(TIMEOUT_S)
        backend.release_within(TIMEOUT_S)  # the thread stops (job 0 given up); the free waits
        assert freed == []
        leave.set()
        waiter.join(TIMEOUT_S)
        assert freed == [issuer]
        assert backend.book_take() == [] and backend.book_count()[:2] == (0, None)
    finally:
        leave.set()
        h.fake.not_ready = 0
        with contextlib.suppress(Exception):
            h.close()
    assert freed == [issuer]


def test_job_ids_outside_64_bits_are_booked_under_keys_of_their_own() -> None:
    """Ids past a signed 64-bit int, and an id equal to the key one of them took, each come back as
    themselves with their own pages."""
    plan = make_plan(Direction.LOAD, [256])
    h = Harness(Direction.LOAD, "dma", plan)
    try:
        jobs = {1 << 70: ([1], [2]), -(1 << 63): ([3], [4]), -(1 << 80): ([5], [6]), 7: ([7], [8])}
        h.fake.not_ready = 1 << 40  # all in flight together: the second's id is the first's key
        for job, (src, dst) in jobs.items():
            h.handler.submit(job, src, dst)
        h.fake.not_ready = 0
        results = h.handler.wait(list(jobs), TIMEOUT_S)
        assert [r.job_id for r in results] == list(jobs) and all(r.ok for r in results)
        for job, (src, dst) in jobs.items():
            assert moved(h.fake, expected(plan, dst, src)) == 0
    finally:
        h.close()


@pytest.mark.parametrize("control", [False, True])
def test_a_hand_off_that_lands_after_the_drains_last_look_is_refused_not_lost(
    control: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A submit passes the handler's closed check, then a shutdown's drain finds the book empty
    before the submit's hand-off lands: the hand-off is refused (``ClosedError``), never booked into
    an issuer about to go. The control (the drain closes no book) lets the submit return normally
    and its result is never published: the job stays open in the shared job book."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    first = h.handler  # (shut down last: its shutdown would release the backend)
    shared = JobBook()
    h.handler = DirectionHandler.create(direction=Direction.STORE, plan=plan, backend=h.backend,
                                        num_src_blocks=NUM_BLOCKS, num_dst_blocks=NUM_BLOCKS, book=shared)
    backend = h.backend
    if control:
        monkeypatch.setattr(backend, "close_book", lambda timeout_s: None)
    count, issue = backend.book_count, backend.issue_booked
    passed, looked, landed = threading.Event(), threading.Event(), threading.Event()

    def count_then_let_the_submit_land() -> tuple[int, int | None, int]:
        counted = count()
        if counted[0] == 0 and passed.is_set():
            looked.set()
            landed.wait(TIMEOUT_S)
        return counted

    def issue_late(*args: Any) -> int:
        passed.set()  # past the closed check
        looked.wait(TIMEOUT_S)
        return issue(*args)

    monkeypatch.setattr(backend, "book_count", count_then_let_the_submit_land)
    monkeypatch.setattr(backend, "issue_booked", issue_late)
    outcome: list[object] = []

    def submitter() -> None:
        shared.reserve(9, h.handler)
        try:
            h.handler.submit_validated(9, np.array([1]), np.array([2]))
            outcome.append("returned")
        except ClosedError as exc:
            outcome.append(exc)
            shared.forget(9)
        landed.set()

    thread = threading.Thread(target=submitter)
    thread.start()
    assert passed.wait(TIMEOUT_S)
    h.handler.shutdown(TIMEOUT_S)
    thread.join(TIMEOUT_S)
    first.shutdown(TIMEOUT_S)
    if control:
        assert outcome == ["returned"] and shared.known(9)  # lost: never published
    else:
        assert len(outcome) == 1 and isinstance(outcome[0], ClosedError) and not shared.known(9)


def test_a_wait_for_an_id_past_64_bits_whose_result_was_taken_meanwhile_returns() -> None:
    """``wait_progress`` for a job whose key went with its result (another thread's poll took it
    between the job book's look and the call) returns at once: it raised ``OverflowError`` passing
    the id itself to the library."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        big = 1 << 70
        h.handler.submit(big, [1], [2])
        def taken() -> bool:
            h.handler.advance()
            return bool(h.handler._book._done)  # noqa: SLF001

        assert wait_until(taken)
        h.handler.wait_progress(big, 0.1)  # its result taken: nothing to wait for, no error
        assert [r.job_id for r in h.handler.poll()] == [big]
    finally:
        h.close()


def test_stats_keep_the_jobs_submitted_after_a_shutdown_that_abandoned_them() -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    h.fake.not_ready = 1 << 40  # never done: the drain gives up
    h.handler.submit(0, [1], [2])
    h.handler.submit(1, [3], [4])
    assert (h.handler.stats().submitted, h.handler.stats().in_flight) == (2, 2)
    with pytest.raises(KVOffloadError):
        h.handler.shutdown(0.2)
    stats = h.handler.stats()
    assert (stats.submitted, stats.in_flight, stats.completed) == (2, 0, 0)


def test_a_job_reserved_while_a_key_is_made_for_its_id_gets_a_key_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key for an id past 64 bits is made while another thread reserves a job whose id is that key
    (right after the job book said no job in flight has it): the second job gets a key of its own.
    The key used to be entered after the look, so the second job took the same key on its fast
    path and the first result taken went to the wrong job."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        handler, book = h.handler, h.handler._book  # noqa: SLF001
        assert isinstance(handler, BookedHandler)
        first = -(1 << 63)  # the first key a handler makes
        keys: dict[str, int] = {}
        threads: list[threading.Thread] = []
        known = book.known

        def then_reserved(key: int) -> bool:
            answer = known(key)
            if key == first and not threads:
                book.reserve(first, handler)
                other = threading.Thread(target=lambda: keys.__setitem__("other", handler._key(first)))  # noqa: SLF001
                threads.append(other)
                other.start()
                other.join(0.2)  # returns at once on its fast path unless the key is entered
            return answer

        monkeypatch.setattr(book, "known", then_reserved)
        keys["wide"] = handler._key(1 << 70)  # noqa: SLF001
        threads[0].join(TIMEOUT_S)
        assert keys["wide"] == first and keys["other"] != first
    finally:
        h.close()


def test_marks_released_before_their_job_is_attached_drop_its_reference_at_once() -> None:
    """A layered job done in its hand-off can have its result taken (its marks released) before
    the hand-off attaches the job to them: the attach then drops the marks' reference (it was never
    dropped: the job and its issuer stayed for the rest of the process)."""
    released: list[int] = []
    backend: Any = type("B", (), {"lib": type("L", (), {"kvo_marks_release": staticmethod(released.append)})})()
    late = NativeLayerMarks(backend, 2)
    late.release()
    late.attach(1234)
    assert released == [1234]
    timely = NativeLayerMarks(backend, 2)
    timely.attach(99)
    assert released == [1234]
    timely.release()
    assert released == [1234, 99]

# ------------------------------------------------- the fast front's whole-job hand-off, branch by branch


def _booked(h: Harness) -> BookedHandler:
    assert isinstance(h.handler, BookedHandler)
    return h.handler


def _ids(*v: int) -> I64:
    return np.array(v, dtype=np.int64)


def front_submit(h: Harness, job: int, src: list[int], dst: list[int]) -> None:
    """What Worker._front does: reserve the id, then the booked whole-job hand-off."""
    h.handler._book.reserve(job, h.handler)  # noqa: SLF001
    try:
        _booked(h).submit_handed_off(job, _ids(*src), _ids(*dst), COMPUTE)
    except BaseException:
        h.handler._book.forget(job)  # noqa: SLF001
        raise


def test_a_failed_registration_fails_its_job_in_order_and_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        real, fails = h.backend._plan_array, [0]  # noqa: SLF001

        def flaky(*args: Any, **kwargs: Any) -> int:
            if fails[0]:
                fails[0] -= 1
                raise TransferError("injected registration failure")
            return real(*args, **kwargs)

        monkeypatch.setattr(h.backend, "_plan_array", flaky)
        h.fake.not_ready = 1 << 40
        h.handler.submit(0, [5], [6])  # in flight (the validating path), ahead of the rest
        fails[0] = 2  # at the fast call's creation and at job 1
        front_submit(h, 1, [1], [2])
        front_submit(h, 2, [3], [4])
        time.sleep(0.05)
        assert h.handler.poll() == []  # job 1 failed, booked behind job 0: not published before it
        h.fake.not_ready = 0
        r0, r1, r2 = h.handler.wait([0, 1, 2], TIMEOUT_S)
        assert r0.ok and not r1.ok and "injected" in str(r1.error) and r2.ok
        assert moved(h.fake, expected(plan, [3], [4])) == 0
    finally:
        h.close()


def test_a_hand_off_landing_after_the_shutdown_is_refused_not_booked(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        _refused_after_the_shutdown(h, monkeypatch)
    finally:
        h.close()


def _refused_after_the_shutdown(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shutdown runs between the submit's closed check and its hand-off: ``ClosedError``, the
    job neither booked nor handed to the library."""
    front = h.backend._front  # noqa: SLF001
    assert front is not None
    calls: list[int] = []
    library = front.hand_off_booked

    def counted(*args: Any) -> int:
        calls.append(args[1])
        return int(library(*args))

    monkeypatch.setattr(front, "hand_off_booked", counted)  # before the call is built
    front_submit(h, 1, [1], [2])  # builds the call
    real = _booked(h)._booked_call  # noqa: SLF001
    assert real is not None

    def shut_down_first(*args: Any) -> int:  # the submit passed its closed check; the shutdown ran
        h.handler.shutdown(TIMEOUT_S)
        return int(real(*args))

    _booked(h)._booked_call = shut_down_first  # noqa: SLF001
    with pytest.raises(ClosedError):
        front_submit(h, 2, [3], [4])
    assert not h.handler._book.known(2)  # noqa: SLF001
    assert calls == [1]  # job 2 never reached the (freed) issuer


@pytest.mark.parametrize("current", [1, 0], ids=["other device", "same device"])
def test_the_fence_is_recorded_with_the_backends_device_current(
    monkeypatch: pytest.MonkeyPatch, current: int,
) -> None:
    entered: list[int] = []

    @contextlib.contextmanager
    def device(index: int) -> Iterator[None]:
        entered.append(index)
        yield

    monkeypatch.setattr(native_backend, "current_device_reader", lambda: (lambda: current))
    monkeypatch.setattr(torch.cuda, "device", device)
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    h.backend._on_cuda = True  # noqa: SLF001 - as on a GPU, before the call is built
    try:
        front_submit(h, 1, [1], [2])
        front_submit(h, 2, [3], [4])
        assert all(r.ok for r in h.handler.wait([1, 2], TIMEOUT_S))
        assert entered == ([0, 0] if current != 0 else [])
    finally:
        h.backend._on_cuda = False  # noqa: SLF001
        h.close()


def test_ids_outside_64_bits_through_the_fast_front_get_keys_of_their_own() -> None:
    plan = make_plan(Direction.LOAD, [256])
    h = Harness(Direction.LOAD, "dma", plan)
    try:
        jobs = {1 << 70: ([1], [2]), -(1 << 63): ([3], [4]), -(1 << 80): ([5], [6]), 7: ([7], [8])}
        h.fake.not_ready = 1 << 40  # all in flight together: -(1 << 63) is the first's key
        for job, (src, dst) in jobs.items():
            front_submit(h, job, src, dst)
        assert _booked(h)._keys[1 << 70] == -(1 << 63)  # noqa: SLF001
        assert _booked(h)._keys[-(1 << 63)] != -(1 << 63)  # noqa: SLF001 - a key of its own
        h.fake.not_ready = 0
        results = h.handler.wait(list(jobs), TIMEOUT_S)
        assert [r.job_id for r in results] == list(jobs) and all(r.ok for r in results)
        for src, dst in jobs.values():
            assert moved(h.fake, expected(plan, dst, src)) == 0
        assert not _booked(h)._keys and not _booked(h)._synthetic  # noqa: SLF001 - keys let go
    finally:
        h.close()


def test_an_id_equal_to_a_key_being_made_gets_its_own_key_on_the_fast_front() -> None:
    """Job ``big`` (past 64 bits) has its key made; job ``first`` (its id equal to that key) is
    handed over through the fast front before it: it must not share the key (the first result taken
    would be published as ``big``'s)."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        big, first = 1 << 70, -(1 << 63)
        h.handler._book.reserve(big, h.handler)  # noqa: SLF001
        assert _booked(h)._key(big) == first  # noqa: SLF001 - big's submit is past its key
        front_submit(h, first, [1], [2])  # one pair
        _booked(h).submit_handed_off(big, _ids(3, 5), _ids(4, 6), COMPUTE)  # two pairs
        by_id = {r.job_id: r for r in h.handler.wait([first, big], TIMEOUT_S)}
        assert by_id[first].nbytes == 256 and by_id[big].nbytes == 512
    finally:
        h.close()


def test_a_job_booked_failed_whose_error_a_release_let_go_still_comes_back_failed() -> None:
    """A release clears the errors Python kept for jobs booked failed while a take (from another
    thread, counted in) holds such a job's result: the take gives the job a failure of its own
    (it raised ``KeyError``, losing every result it had taken)."""
    plan = make_plan(Direction.STORE, [256])
    h = Harness(Direction.STORE, "sm", plan)
    try:
        assert h.backend.book_fail(5, 1, RuntimeError("the job's own error"))
        h.backend._book_errors.clear()  # noqa: SLF001 - as release_within does meanwhile
        (outcome,) = h.backend.book_take()
        assert outcome.job_id == 5 and not outcome.ok and isinstance(outcome.error, TransferError)
        assert "went with the backend's release" in str(outcome.error)
    finally:
        h.close()
