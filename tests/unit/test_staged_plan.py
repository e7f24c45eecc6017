"""Chunk planning of the staged path and the copy kernel's segment table, on CPU: composing a job's
kernel copies (device <-> slot) with its record DMAs (slot <-> host) moves exactly the bytes the plain
plan moves; slots rotate and each holds at most its rows; the segment table, expanded for any blocks
the way the kernel expands it, moves exactly the bytes of the plain descriptors."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload._descriptors import (
    STAGED_EDGE_GROWTH,
    UNIT_MAX_BYTES,
    CopyPlan,
    Descriptors,
    PageTable,
    kernel_segments,
    plan_staged,
    staged_chunk_rows,
)
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


def plan_for(
    direction: Direction, page_sizes: list[int], *, block_major: bool = False, record: int = RECORD
) -> CopyPlan:
    """Pages in separate allocations (per-tensor layouts), or, with ``block_major``, one allocation
    holding each block's pages back to back (pages of one block then merge)."""
    padded = [(p + 15) // 16 * 16 for p in page_sizes]
    offsets = np.cumsum([0] + padded[:-1]).astype(np.int64)
    n = len(page_sizes)
    if block_major:
        dev_base = (1 << 40) + offsets
        dev_stride = np.full(n, sum(padded), dtype=np.int64)
        segment = np.zeros(n, dtype=np.int64)
    else:
        dev_base = np.array([(1 << 40) + i * (1 << 32) for i in range(n)], dtype=np.int64)
        dev_stride = np.array(padded, dtype=np.int64)
        segment = np.arange(n, dtype=np.int64)
    pages = PageTable(
        dev_base=dev_base, dev_stride=dev_stride, nbytes=np.array(page_sizes, dtype=np.int64),
        host_offset=offsets, segment=segment, record_bytes=record,
    )
    return CopyPlan(pages, host_base=1 << 36, chunk_records=5, direction=direction)


def kernel_byte_map(
    plan: CopyPlan, device_blocks: npt.NDArray[np.int64], host_base: int,
    host_rows: npt.NDArray[np.int64], unit_max: int = 64 << 10,
) -> dict[int, int]:
    """What the copy kernel does with ``kernel_segments``: destination -> source, 4-byte granules."""
    table = kernel_segments(plan.pages, unit_max)
    store = plan.direction is Direction.STORE
    out: dict[int, int] = {}
    for d, r in zip(device_blocks.tolist(), host_rows.tolist()):
        for dev_base, stride, offset, nbytes in table.tolist():
            dev = dev_base + d * stride
            host = host_base + r * plan.pages.record_bytes + offset
            src, dst = (dev, host) if store else (host, dev)
            for k in range(0, nbytes, 4):
                out[dst + k] = src + k
    return out


jobs = st.tuples(
    st.sampled_from([Direction.STORE, Direction.LOAD]),
    st.lists(st.sampled_from([16, 100, 512, 1024]), min_size=1, max_size=3),
    st.lists(st.integers(0, 63), min_size=1, max_size=20, unique=True),
    st.randoms(use_true_random=False),
    st.integers(1, 6),
    st.integers(0, 2),
    st.integers(0, 3),  # the edge chunk's records (0: none)
)
Job = tuple[Direction, list[int], list[int], object, int, int, int]


@settings(max_examples=150, deadline=None)
@given(jobs)
def test_kernel_and_dma_together_move_the_bytes_of_the_plain_plan(job: Job) -> None:
    direction, page_sizes, device_ids, rnd, rows, first, edge = job
    plan = plan_for(direction, page_sizes)
    device = np.array(device_ids, dtype=np.int64)
    host = np.array(sorted(device_ids, key=lambda _: rnd.random()), dtype=np.int64)  # type: ignore[attr-defined]
    src, dst = (device, host) if direction is Direction.STORE else (host, device)
    expected = byte_map(*_triple(plan.build(src, dst)))
    chunks = plan_staged(plan, src, dst, SLOT_BASES, rows, first, edge_bytes=edge * RECORD)
    composed: dict[int, int] = {}
    for chunk in chunks:
        slot_rows = np.arange(chunk.device_blocks.shape[0], dtype=np.int64)
        kernel = kernel_byte_map(plan, chunk.device_blocks, SLOT_BASES[chunk.slot], slot_rows)
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
def test_chunks_rotate_over_slots_and_hold_at_most_their_rows(job: Job) -> None:
    direction, page_sizes, device_ids, _, rows, first, edge = job
    plan = plan_for(direction, page_sizes)
    ids = np.array(device_ids, dtype=np.int64)
    chunks = plan_staged(plan, ids, ids[::-1].copy(), SLOT_BASES, rows, first, edge_bytes=edge * RECORD)
    assert [c.slot for c in chunks] == [(first + i) % len(SLOT_BASES) for i in range(len(chunks))]
    assert sum(c.pairs.stop - c.pairs.start for c in chunks) == len(device_ids)
    if len(device_ids) > 1:  # (one record is one chunk, whatever the rule)
        store = direction is Direction.STORE
        assert [c.pairs.stop - c.pairs.start for c in chunks] == staged_chunk_rows(len(device_ids), rows, edge, store)
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


def test_record_dma_never_crosses_into_the_next_chunk_even_when_slots_are_adjacent() -> None:
    plan = plan_for(Direction.STORE, [1024])
    rows = 2
    adjacent = (SLOT_BASES[0], SLOT_BASES[0] + rows * RECORD)  # slot 1 starts where slot 0 ends
    chunks = plan_staged(plan, np.arange(4), np.arange(10, 14), adjacent, rows)
    assert [c.dma.sizes.tolist() for c in chunks] == [[2 * RECORD], [2 * RECORD]]
    assert [int(c.dma.srcs[0]) for c in chunks] == list(adjacent)


segment_jobs = st.tuples(
    st.sampled_from([Direction.STORE, Direction.LOAD]),
    st.lists(st.sampled_from([16, 52, 100, 512, 4096, 5000]), min_size=1, max_size=4),
    st.booleans(),
    st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
    st.sampled_from([16, 256, 4096]),
)


@settings(max_examples=150, deadline=None)
@given(segment_jobs)
def test_segments_expanded_per_block_move_exactly_the_plain_descriptors(
    job: tuple[Direction, list[int], bool, list[int], int],
) -> None:
    direction, page_sizes, block_major, blocks, unit_max = job
    padded = sum((p + 15) // 16 * 16 for p in page_sizes)
    plan = plan_for(direction, page_sizes, block_major=block_major, record=(padded + 4095) // 4096 * 4096)
    device = np.array(blocks, dtype=np.int64)
    host = device[::-1].copy()
    expected = byte_map(*_triple(plan.build_device_host(device, plan.host_base, host, 5)))
    assert kernel_byte_map(plan, device, plan.host_base, host, unit_max) == expected
    table = kernel_segments(plan.pages, unit_max)
    assert (table[:, 3] > 0).all() and (table[:, 3] <= unit_max).all()
    assert (table[:, 0] % 16 == 0).all() and (table[:, 2] % 16 == 0).all()  # 16-byte accesses


def test_pages_of_a_block_major_layout_merge_into_unit_sized_segments() -> None:
    plan = plan_for(Direction.STORE, [4096] * 64, block_major=True, record=64 * 4096)
    table = kernel_segments(plan.pages, 64 << 10)
    assert table[:, 3].tolist() == [64 << 10] * 4  # 256 KiB contiguous per block -> 4 units
    default = kernel_segments(plan.pages)
    assert default[:, 3].tolist() == [UNIT_MAX_BYTES] * ((256 << 10) // UNIT_MAX_BYTES)
    separate = kernel_segments(plan_for(Direction.STORE, [4096] * 64).pages)
    assert separate.shape[0] == 64  # one allocation per page: nothing merges


def test_a_small_job_is_cut_into_many_units() -> None:
    """A block of 64 pages of 32 KiB is 512 units of 4 KiB, for up to 512 warps of the kernel (the
    staged path's grid has more; the sm path's 128 take four each); as 64-KiB-bounded units 64
    warps moved it, each through 16 round trips (docs/design.md §16)."""
    table = kernel_segments(plan_for(Direction.LOAD, [32 << 10] * 64).pages)
    assert table.shape[0] == 512 and (table[:, 3] == 4096).all()


def test_unit_max_must_be_a_positive_multiple_of_16() -> None:
    plan = plan_for(Direction.STORE, [1024])
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel_segments(plan.pages, 100)


@settings(max_examples=300, deadline=None)
@given(count=st.integers(0, 2000), per_slot=st.integers(1, 300), edge=st.integers(0, 400),
       store=st.booleans())
def test_a_staged_jobs_chunks_grow_from_a_small_edge_chunk_up_to_whole_slots(
    count: int, per_slot: int, edge: int, store: bool,
) -> None:
    """Every row in one chunk of at most a slot; a store's first chunk (a load's last) holds the
    edge's rows, and each chunk after it (before it) at most STAGED_EDGE_GROWTH times as many, so
    the copy kernel of the next chunk finishes within the edge chunk's DMA; between the growth and
    the rest, whole slots. Without an edge, whole slots, then the rest, either way."""
    rows = staged_chunk_rows(count, per_slot, edge, store)
    assert sum(rows) == count and all(1 <= r <= per_slot for r in rows)
    if count == 0:
        return
    if edge == 0:
        assert rows[:-1] == [per_slot] * (len(rows) - 1)
        return
    assert rows == staged_chunk_rows(count, per_slot, edge, not store)[::-1]
    grown = rows if store else rows[::-1]  # from the edge on
    assert grown[0] == min(edge, per_slot, count)
    for before, after in zip(grown[:-2], grown[1:-1]):  # (the last: the rest)
        assert after == min(before * STAGED_EDGE_GROWTH, per_slot)
    assert len(grown) <= -(-count // per_slot) + 1 + len(bin(per_slot)) // 3 + 1  # log8 more at most


def test_a_staged_plan_of_16_layers_worth_of_rows_takes_a_small_last_chunk_for_a_load() -> None:
    """A job alone of 256 rows of 64 KiB (one layer of the H200's layer-wise prefill), slots of 64
    MiB, an edge of 1 MiB: a store gathers 16 rows before its first DMA, a load scatters 16 after
    its last."""
    assert staged_chunk_rows(256, 1024, 16, True) == [16, 128, 112]
    assert staged_chunk_rows(256, 1024, 16, False) == [112, 128, 16]
    assert staged_chunk_rows(256, 1024, 0, False) == [256]
    assert staged_chunk_rows(100, 8, 1, True) == [1, 8] + [8] * 11 + [3]
