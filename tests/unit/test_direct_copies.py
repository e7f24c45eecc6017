"""Direct strided copies of the native issuer's dma path, on CPU through the fake driver
(:mod:`tests.unit._native_fake`): a run of pairs whose host records and device blocks both follow
each other, inside one pinned area, moves as one ``cuMemcpy2DAsync`` per page group (pages back to
back on both sides), straight between the records and the blocks; everything else stays a
descriptor. Each test has its control, and every byte is checked by provenance
(docs/design.md §16, *Direct strided copies*)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import Direction
from kvoffload._descriptors import CopyPlan
from kvoffload.calibration import LayeredChoice
from tests.unit._native_fake import COPY, FakeDriver
from tests.unit.test_native_issuer import (
    NUM_BLOCKS,
    THREAD_ISSUES,
    TIMEOUT_S,
    Harness,
    callers_copies_of_a_layered_load,
    expected,
    layer_tables,
    make_plan,
    moved,
    submit_layered,
)

DIRECTIONS = [Direction.STORE, Direction.LOAD]


def run_dma(plan: CopyPlan, device: list[int], host: list[int], **tune: int) -> tuple[FakeDriver, int]:
    """One dma job of ``plan`` between ``device`` blocks and ``host`` records (by the thread);
    the fake driver after it and the issuer's direct copies. Asserts every byte landed."""
    h = Harness(plan.direction, "dma", plan, tune={**THREAD_ISSUES, **tune})
    try:
        src, dst = (device, host) if plan.direction is Direction.STORE else (host, device)
        result = h.run(0, src, dst)
        assert result.ok, result.error
        assert moved(h.fake, expected(plan, device, host)) == 0
        return h.fake, h.backend.direct_copies()
    finally:
        h.close()


def strided(fake: FakeDriver) -> list[tuple[Any, ...]]:
    """The strided copies the fake saw: (name, stream, rows)."""
    return fake.of("cuMemcpy2DAsync")


def descriptors(fake: FakeDriver) -> int:
    return int(sum(c[2] for c in fake.of("cuMemcpyBatchAsync")) + len(fake.of("cuMemcpyAsync")))


# chunk_records is 5 in make_plan's plans: a run of records stays inside one pinned area of 5.
RUN_HOST, RUN_DEVICE = [10, 11, 12, 13, 14], [40, 41, 42, 43, 44]


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_run_that_follows_on_both_sides_moves_as_one_strided_copy_per_page(direction: Direction) -> None:
    plan = make_plan(direction, [512, 256, 1024, 128])  # four tensors: four page groups
    fake, direct = run_dma(plan, RUN_DEVICE, RUN_HOST)
    assert [c[2] for c in strided(fake)] == [5, 5, 5, 5] and direct == 4
    assert descriptors(fake) == 0
    assert {c[1] for c in strided(fake)} == {COPY}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(("device", "host"), [
    ([40, 42, 41, 43, 44], RUN_HOST),  # records follow each other, blocks do not
    (RUN_DEVICE, [10, 12, 11, 13, 14]),  # blocks do, records not
    ([40, 41, 42, 43, 44, 45, 46], [13, 14, 15, 16, 17, 18, 19]),  # a pinned area ends at 15
])
def test_pairs_that_follow_on_one_side_only_stay_descriptors(
    direction: Direction, device: list[int], host: list[int],
) -> None:
    """Runs end where either side stops following, and at a pinned area's end (areas of 5
    records here): 13, 14 | 15..19 is a run of 2 (descriptors) and one of 5 (a copy per page)."""
    plan = make_plan(direction, [512, 256])
    fake, direct = run_dma(plan, device, host)
    if len(host) == 7:
        assert [c[2] for c in strided(fake)] == [5, 5] and direct == 2
        assert descriptors(fake) == 4
    else:
        assert not strided(fake) and direct == 0
        assert descriptors(fake) == 10


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_strided_copies_off_or_runs_too_short_leave_every_page_a_descriptor(direction: Direction) -> None:
    plan = make_plan(direction, [512, 256])
    for tune in ({"strided_min_rows": 0}, {"strided_min_rows": 6}):  # off; runs of 5 too short
        fake, direct = run_dma(plan, RUN_DEVICE, RUN_HOST, **tune)
        assert not strided(fake) and direct == 0 and descriptors(fake) == 10, tune
    fake, direct = run_dma(plan, RUN_DEVICE, RUN_HOST, strided_min_rows=5)  # control: long enough
    assert [c[2] for c in strided(fake)] == [5, 5] and direct == 2


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pages_back_to_back_on_both_sides_go_as_one_wider_copy(direction: Direction) -> None:
    """Block-major pages (one allocation, a block's pages back to back) in records three records
    apart (a pool shared by ranks): one page group, one copy per run, as wide as the block. The
    control, per-tensor pages, takes a copy per page."""
    wide = make_plan(direction, [512, 256, 1024], block_major=True)
    wide = attrs.evolve(wide, host_stride=3 * wide.pages.record_bytes, chunk_records=64)
    fake, _ = run_dma(wide, RUN_DEVICE, [1, 2, 3, 4, 5])
    (copy,) = strided(fake)
    assert copy[2] == 5 and descriptors(fake) == 0
    control = attrs.evolve(make_plan(direction, [512, 256, 1024]), chunk_records=64)
    fake, _ = run_dma(control, RUN_DEVICE, [1, 2, 3, 4, 5])
    assert len(strided(fake)) == 3


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_layout_whose_records_are_whole_blocks_keeps_its_merged_descriptors(direction: Direction) -> None:
    """Block-major pages in records exactly a block long: a run's descriptors already merge into
    one copy, so no strided copy is made (control: records three apart take one)."""
    plan = make_plan(direction, [512, 256, 1024], block_major=True)
    fake, direct = run_dma(plan, RUN_DEVICE, RUN_HOST)
    assert not strided(fake) and direct == 0
    assert descriptors(fake) == 1  # the whole run, merged
    apart = attrs.evolve(plan, host_stride=3 * plan.pages.record_bytes, chunk_records=64)
    fake, direct = run_dma(apart, RUN_DEVICE, [1, 2, 3, 4, 5])
    assert direct == 1


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_copies_in_pieces_hold_as_many_rows_as_a_piece_holds(direction: Direction) -> None:
    """With ``piece_bytes`` no copy is longer: a run's strided copy is cut every piece's rows (512 B
    rows, pieces of 2 KiB: 4 rows, a run of 5 as 4 + 1), and where a piece holds fewer rows than a
    run needs the run goes as descriptors (pieces of 1 KiB: 2 rows)."""
    plan = make_plan(direction, [512])
    plan = attrs.evolve(plan, host_stride=2 * plan.pages.record_bytes)  # not whole: rows apart
    fake, _ = run_dma(plan, RUN_DEVICE, RUN_HOST, piece_bytes=2048)
    assert [c[2] for c in strided(fake)] == [4, 1]
    assert all(size <= 2048 for size in fake.copy_sizes)
    fake, direct = run_dma(plan, RUN_DEVICE, RUN_HOST, piece_bytes=1024)
    assert not strided(fake) and direct == 0 and descriptors(fake) == 5


def test_pages_of_512_kib_or_wider_stay_descriptors() -> None:
    """Copies that wide move at the link's pace as descriptors (control: 256 KiB pages go strided)."""
    for page, copies in ((512 << 10, 0), (256 << 10, 1)):
        plan = make_plan(Direction.LOAD, [page])
        plan = attrs.evolve(plan, host_stride=2 * plan.pages.record_bytes, chunk_records=64)
        fake, direct = run_dma(plan, list(range(4, 8)), list(range(4)), strided_min_rows=4,
                               strided_row_bytes=0)
        assert direct == copies == len(strided(fake)), page


def test_a_narrow_pages_run_needs_fewer_rows_than_a_wide_ones() -> None:
    """The fewest rows of a direct copy scale with its width, as staged rows' do: at 32 B a row
    unit, a 256 B group needs 8 rows, a 4 KiB one 64 (the ceiling): a run of 10 goes strided in
    the narrow tensor only."""
    plan = attrs.evolve(make_plan(Direction.LOAD, [256, 4096]), chunk_records=64)
    fake, _ = run_dma(plan, list(range(20, 30)), list(range(10)), strided_min_rows=64, strided_row_bytes=32)
    assert [c[2] for c in strided(fake)] == [10] and descriptors(fake) == 10


def test_a_layered_dma_load_moves_each_layers_run_as_direct_copies_and_its_caller_issues_layer_0() -> None:
    """Three layers of two pages: each layer's run of 5 pairs is two strided copies; the caller of
    a load handed to an idle thread issues layer 0's two (control: callers issue nothing)."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    for tune, mine in (({"caller_issue_max": 0}, 0), ({}, 2)):
        h = Harness(Direction.LOAD, "dma", plan, tune=tune)
        try:
            copies = callers_copies_of_a_layered_load(h, plan, RUN_HOST, RUN_DEVICE)
            assert [c[2] for c in strided(h.fake)] == [5] * 6 and descriptors(h.fake) == 0
            assert [c[0] for c in copies] == ["cuMemcpy2DAsync"] * mine, tune
            assert h.backend.direct_copies() == 6
        finally:
            h.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    direction=st.sampled_from(DIRECTIONS),
    block_major=st.booleans(),
    apart=st.sampled_from([1, 3]),
    pages=st.lists(st.sampled_from([64, 128, 256, 1024]), min_size=1, max_size=3),
    area=st.integers(1, 1024),
    runs=st.lists(st.tuples(st.integers(1, 9), st.booleans(), st.booleans()), min_size=1, max_size=6),
    piece=st.sampled_from([0, 512, 4096]),
    seed=st.integers(0, 2**16),
)
def test_any_job_moves_exactly_its_bytes_and_writes_nothing_else(
    direction: Direction, block_major: bool, apart: int, pages: list[int], area: int,
    runs: list[tuple[int, bool, bool]], piece: int, seed: int,
) -> None:
    """Jobs of runs of records and of blocks (each run following on one side, both, or neither),
    pinned areas of 1-1024 records, copies in pieces or not: every page lands from its source, and
    no byte outside the job's pages is written."""
    plan = make_plan(direction, pages, block_major=block_major)
    plan = attrs.evolve(plan, host_stride=apart * plan.pages.record_bytes, chunk_records=area)
    rng = np.random.default_rng(seed)
    free_host = list(rng.permutation(NUM_BLOCKS).tolist())
    free_dev = list(rng.permutation(NUM_BLOCKS).tolist())
    host: list[int] = []
    device: list[int] = []
    for length, host_follows, dev_follows in runs:
        for ids, free, follows in ((host, free_host, host_follows), (device, free_dev, dev_follows)):
            start = next((a for a in free if all(a + k in free for k in range(length))), None)
            if follows and start is not None:
                picked = [start + k for k in range(length)]
            else:
                picked = free[:length]
            for x in picked:
                free.remove(x)
            ids.extend(picked)
    n = min(len(host), len(device))
    host, device = host[:n], device[:n]
    h = Harness(direction, "dma", plan, tune={"piece_bytes": piece})
    try:
        src, dst = (device, host) if direction is Direction.STORE else (host, device)
        result = h.run(0, src, dst)
        assert result.ok, result.error
        want = expected(plan, device, host)
        assert moved(h.fake, want) == 0
        assert set(h.fake.provenance) == set(want), "a byte outside the job's pages was written"
        if piece:
            assert all(size <= piece for size in h.fake.copy_sizes)
    finally:
        h.close()


@pytest.mark.parametrize("order", ["in order", "shuffled"])
def test_auto_keeps_staged_for_a_layered_load_whose_pairs_run_on_both_sides(order: str) -> None:
    """``auto``'s layered load whose size bucket takes ``staged`` stays ``staged`` where its pairs
    run on both sides too, with no direct copy: beside or after an engine's compute they moved the
    load slower than ``staged`` (docs/design.md §16, *Direct copies under auto, turned over*). Its
    records follow each other, so ``staged`` moves each layer as strided copies into its slots.
    Every byte lands."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    host = list(range(0, 8))
    blocks = list(range(40, 48)) if order == "in order" else [41, 40, 43, 42, 45, 44, 47, 46]
    rule = LayeredChoice(lambda _n: "staged", layer_tables(plan)).path
    h = Harness(Direction.LOAD, "staged", plan, layered=rule)
    try:
        submit_layered(h, 0, host, blocks)
        (result,) = h.handler.wait([0], TIMEOUT_S)
        assert result.ok, result.error
        assert result.path == "staged"
        assert moved(h.fake, expected(plan, blocks, host)) == 0
        assert h.backend.direct_copies() == 0
        assert strided(h.fake), "staged moved no layer as strided copies into its slots"
    finally:
        h.close()


@pytest.mark.parametrize(("piece", "cheap"), [(0, True), (64, False)])
def test_a_callers_dma_first_layer_counts_each_pages_pieces(piece: int, cheap: bool) -> None:
    """Five pairs apart, two 256 B pages a layer: 10 descriptors, which the caller issues; cut in
    pieces of 64 B they are 40, over its 16, and the thread issues every layer."""
    plan = make_plan(Direction.LOAD, [256, 256, 512, 512, 128, 128])
    h = Harness(Direction.LOAD, "dma", plan, tune={"piece_bytes": piece})
    try:
        mine = callers_copies_of_a_layered_load(h, plan, [3, 14, 7, 22, 9], [40, 41, 42, 43, 44])
        assert bool(mine) == cheap, mine
        assert all(size <= piece for size in h.fake.copy_sizes) or not piece
    finally:
        h.close()
