"""Chunk planning of the staged path and the copy kernel's units, on CPU: composing a job's kernel
copies (device <-> slot) with its record DMAs (slot <-> host) moves exactly the bytes the plain plan
moves; slots rotate and each holds at most its rows; units cover copies exactly."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload._descriptors import CopyPlan, Descriptors, PageTable, plan_staged, split_units
from kvoffload.records import Direction

U64 = npt.NDArray[np.uint64]
RECORD = 4096
SLOT_BASES = (1 << 44, (1 << 44) + (1 << 30), (1 << 44) + (2 << 30))


def byte_map(dsts: U64, srcs: U64, sizes: U64) -> dict[int, int]:
    out: dict[int, int] = {}
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        for k in range(0, n, 4):  # 4-byte granules: every page size here is a multiple of 4
            out[d + k] = s + k
    return out


def plan_for(direction: Direction, page_sizes: list[int]) -> CopyPlan:
    offsets = np.cumsum([0] + [(p + 15) // 16 * 16 for p in page_sizes[:-1]])
    pages = PageTable(
        dev_base=np.array([(1 << 40) + i * (1 << 32) for i in range(len(page_sizes))], dtype=np.int64),
        dev_stride=np.array([(p + 15) // 16 * 16 for p in page_sizes], dtype=np.int64),
        nbytes=np.array(page_sizes, dtype=np.int64),
        host_offset=offsets.astype(np.int64),
        segment=np.arange(len(page_sizes), dtype=np.int64),
        record_bytes=RECORD,
    )
    return CopyPlan(pages, host_base=1 << 36, chunk_records=5, direction=direction)


jobs = st.tuples(
    st.sampled_from([Direction.STORE, Direction.LOAD]),
    st.lists(st.sampled_from([16, 100, 512, 1024]), min_size=1, max_size=3),
    st.lists(st.integers(0, 63), min_size=1, max_size=20, unique=True),
    st.randoms(use_true_random=False),
    st.integers(1, 6),
    st.integers(0, 2),
)


@settings(max_examples=150, deadline=None)
@given(jobs)
def test_kernel_and_dma_together_move_the_bytes_of_the_plain_plan(
    job: tuple[Direction, list[int], list[int], object, int, int],
) -> None:
    direction, page_sizes, device_ids, rnd, rows, first = job
    plan = plan_for(direction, page_sizes)
    device = np.array(device_ids, dtype=np.int64)
    host = np.array(sorted(device_ids, key=lambda _: rnd.random()), dtype=np.int64)  # type: ignore[attr-defined]
    src, dst = (device, host) if direction is Direction.STORE else (host, device)
    expected = byte_map(*_triple(plan.build(src, dst)))
    chunks = plan_staged(plan, src, dst, SLOT_BASES, rows, first)
    composed: dict[int, int] = {}
    for chunk in chunks:
        kernel = byte_map(chunk.kernel[:, 1], chunk.kernel[:, 0], chunk.kernel[:, 2])
        dma = byte_map(*_triple(chunk.dma))
        if direction is Direction.STORE:  # device -> slot (kernel), then slot -> host (dma)
            # The DMA moves whole records: bytes the kernel did not write are record padding.
            composed.update({h: kernel[slot] for h, slot in dma.items() if slot in kernel})
        else:  # host -> slot (dma), then slot -> device (kernel)
            composed.update({dev_addr: dma[slot] for dev_addr, slot in kernel.items()})
    assert composed == expected


def _triple(d: Descriptors) -> tuple[U64, U64, U64]:
    return d.dsts, d.srcs, d.sizes


@settings(max_examples=100, deadline=None)
@given(jobs)
def test_chunks_rotate_over_slots_and_hold_at_most_their_rows(
    job: tuple[Direction, list[int], list[int], object, int, int],
) -> None:
    direction, page_sizes, device_ids, _, rows, first = job
    plan = plan_for(direction, page_sizes)
    ids = np.array(device_ids, dtype=np.int64)
    chunks = plan_staged(plan, ids, ids[::-1].copy(), SLOT_BASES, rows, first)
    assert [c.slot for c in chunks] == [(first + i) % len(SLOT_BASES) for i in range(len(chunks))]
    assert sum(c.pairs.stop - c.pairs.start for c in chunks) == len(device_ids)
    for chunk in chunks:
        assert chunk.pairs.stop - chunk.pairs.start <= rows
        base = SLOT_BASES[chunk.slot]
        slot_side = chunk.dma.srcs if direction is Direction.STORE else chunk.dma.dsts
        ends = slot_side + chunk.dma.sizes
        assert (slot_side >= base).all() and (ends <= base + rows * RECORD).all()


def test_consecutive_host_blocks_become_one_record_dma() -> None:
    plan = plan_for(Direction.STORE, [1024, 1024])
    chunks = plan_staged(plan, np.array([9, 3, 5]), np.array([12, 10, 11]), SLOT_BASES, 8)
    (chunk,) = chunks
    assert chunk.dma.count == 1 and int(chunk.dma.sizes[0]) == 3 * RECORD


def test_record_dma_never_crosses_a_pin_chunk() -> None:
    plan = plan_for(Direction.STORE, [1024])  # chunk_records = 5
    (chunk,) = plan_staged(plan, np.arange(4), np.arange(3, 7), SLOT_BASES, 8)
    assert chunk.dma.sizes.tolist() == [2 * RECORD, 2 * RECORD]  # records 3-4 | 5-6


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300_000), min_size=0, max_size=8), st.sampled_from([16, 4096, 65536]))
def test_units_cover_each_copy_exactly_in_pieces_of_at_most_unit_max(
    sizes: list[int], unit_max: int
) -> None:
    n = len(sizes)
    srcs = np.array([(1 << 40) + i * (1 << 24) for i in range(n)], dtype=np.uint64)
    dsts = np.array([(1 << 41) + i * (1 << 24) for i in range(n)], dtype=np.uint64)
    desc = Descriptors(dsts, srcs, np.array(sizes, dtype=np.uint64))
    units = split_units(desc, unit_max)
    assert units.dtype == np.uint64 and units.shape[1] == 4
    assert (units[:, 2] <= unit_max).all() and (units[:, 3] == 0).all()
    covered: list[tuple[int, int, int]] = sorted(
        (int(u[0]), int(u[1]), int(u[2])) for u in units
    )
    spans: list[tuple[int, int, int]] = []
    for s, d, size in covered:
        if spans and spans[-1][0] + spans[-1][2] == s and spans[-1][1] + spans[-1][2] == d:
            spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + size)
        else:
            spans.append((s, d, size))
    assert spans == sorted(zip(srcs.tolist(), dsts.tolist(), sizes))


def test_unit_max_must_be_a_positive_multiple_of_16() -> None:
    empty = np.zeros(0, dtype=np.uint64)
    with pytest.raises(ValueError, match="multiple of 16"):
        split_units(Descriptors(empty, empty, empty), 100)
