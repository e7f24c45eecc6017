"""CopyPlan.build against a brute-force reference (one copy per (pair, page), built with a Python
loop), and the id validation helpers of the handler against simple references (docs/design.md §4)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import DeviceLayout, Direction
from kvoffload._descriptors import CopyPlan, Descriptors, PageTable
from kvoffload.errors import BlockIdTypeError, InvalidBlockIdError
from kvoffload._validate import as_block_ids, find_duplicate

I64Array = npt.NDArray[np.int64]

DEVICE_BASE = 1 << 32
HOST_BASE = 1 << 44
SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

Copy = tuple[int, int, int]  # (src, dst, size)


@attrs.frozen
class Case:
    table: PageTable
    num_device_blocks: int
    num_host_blocks: int
    chunk_records: int
    direction: Direction
    device_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]

    def plan(self, merge: bool = True) -> CopyPlan:
        return CopyPlan(self.table, HOST_BASE, self.chunk_records, self.direction, merge)

    def build(self, merge: bool = True) -> Descriptors:
        device = np.asarray(self.device_blocks, dtype=np.int64)
        host = np.asarray(self.host_blocks, dtype=np.int64)
        if self.direction is Direction.STORE:
            return self.plan(merge).build(device, host)
        return self.plan(merge).build(host, device)

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_records * self.table.record_bytes


# --------------------------------------------------------------------------------- strategies


def _gap(draw: st.DrawFn, dense: bool) -> int:
    return 0 if dense else draw(st.sampled_from([0, 0, 16, 48]) | st.integers(0, 40))


@st.composite
def page_tables(draw: st.DrawFn, num_device_blocks: int) -> PageTable:
    """A random page table whose pages never overlap, in either memory.

    Pages are grouped into segments (device allocations) laid out one after another, sometimes with
    no gap (adjacent addresses of two allocations must still not be merged). Inside a segment the
    pages are block-major (one block slot holds all its pages) or page-major (each page its own
    strided plane). Host offsets place the pages in a random order with random gaps. A *dense*
    table has no gaps anywhere, no record padding and host order = device order, so that copies
    continue each other often and merging (and its limits) is exercised.
    """
    dense = draw(st.booleans())
    num_pages = draw(st.integers(1, 4))
    sizes = draw(
        st.lists(
            st.integers(1, 8).map(lambda k: 16 * k) | st.integers(1, 100),
            min_size=num_pages, max_size=num_pages,
        )
    )
    num_segments = draw(st.integers(1, num_pages))
    segment = [p % num_segments for p in range(num_pages)]
    segment = draw(st.permutations(segment))
    dev_base = [0] * num_pages
    dev_stride = [0] * num_pages
    cursor = DEVICE_BASE
    for s in range(num_segments):
        cursor += 0 if dense else draw(st.sampled_from([0, 0, 16, 4096]))
        pages = [p for p in range(num_pages) if segment[p] == s]
        if not dense:
            pages = draw(st.permutations(pages))
        if draw(st.booleans()):  # block-major: one slot per block holds every page of the segment
            offset = 0
            for p in pages:
                offset += _gap(draw, dense)
                dev_base[p] = cursor + offset
                offset += sizes[p]
            slot = offset + _gap(draw, dense)
            for p in pages:
                dev_stride[p] = slot
            cursor += slot * num_device_blocks
        else:  # page-major: every page has its own plane of num_device_blocks strided pages
            for p in pages:
                cursor += _gap(draw, dense)
                stride = sizes[p] + _gap(draw, dense)
                dev_base[p] = cursor
                dev_stride[p] = stride
                cursor += stride * num_device_blocks
    host_offset = [0] * num_pages
    offset = 0
    host_order = sorted(range(num_pages), key=lambda p: dev_base[p])
    if not dense:
        host_order = draw(st.permutations(host_order))
    for p in host_order:
        offset += _gap(draw, dense)
        host_offset[p] = offset
        offset += sizes[p]
    pad = 0 if dense else draw(st.sampled_from([0, 0, 7, 4096]))
    order = host_order  # a page table lists its pages in host-record order
    return PageTable(
        dev_base=np.asarray([dev_base[p] for p in order], dtype=np.int64),
        dev_stride=np.asarray([dev_stride[p] for p in order], dtype=np.int64),
        nbytes=np.asarray([sizes[p] for p in order], dtype=np.int64),
        host_offset=np.asarray([host_offset[p] for p in order], dtype=np.int64),
        segment=np.asarray([segment[p] for p in order], dtype=np.int64),
        record_bytes=offset + pad,
    )


@st.composite
def cases(draw: st.DrawFn) -> Case:
    num_device_blocks = draw(st.just(1) | st.integers(1, 10))
    num_host_blocks = draw(st.integers(1, 10))
    table = draw(page_tables(num_device_blocks))
    direction = draw(st.sampled_from([Direction.STORE, Direction.LOAD]))
    chunk_records = draw(st.integers(1, num_host_blocks + 1))
    runs = draw(
        st.lists(
            st.tuples(
                st.integers(0, num_device_blocks - 1),
                st.integers(0, num_host_blocks - 1),
                st.integers(1, 6),
            ),
            min_size=1,
            max_size=5,
        )
    )
    device: list[int] = []
    host: list[int] = []
    written: set[int] = set()
    for d0, h0, length in runs:  # runs of consecutive ids on both sides, so that merging can happen
        for k in range(length):
            d, h = d0 + k, h0 + k
            if d >= num_device_blocks or h >= num_host_blocks:
                break
            dst = h if direction is Direction.STORE else d
            if dst in written:  # validated jobs never write one block twice
                continue
            written.add(dst)
            device.append(d)
            host.append(h)
    return Case(
        table, num_device_blocks, num_host_blocks, chunk_records, direction, tuple(device), tuple(host)
    )


# --------------------------------------------------------------------------------- reference


def reference_copies(case: Case) -> list[tuple[Copy, int]]:
    """One copy per (pair, page), pair-major, with the page's segment."""
    t = case.table
    out: list[tuple[Copy, int]] = []
    for d, h in zip(case.device_blocks, case.host_blocks):
        for p in range(t.num_pages):
            dev = int(t.dev_base[p]) + d * int(t.dev_stride[p])
            host = HOST_BASE + h * t.record_bytes + int(t.host_offset[p])
            size = int(t.nbytes[p])
            copy = (dev, host, size) if case.direction is Direction.STORE else (host, dev, size)
            out.append((copy, int(t.segment[p])))
    return out


def plan_copies(desc: Descriptors) -> list[Copy]:
    return list(zip(desc.srcs.tolist(), desc.dsts.tolist(), desc.sizes.tolist()))


def byte_map(copies: Sequence[Copy]) -> tuple[I64Array, I64Array]:
    """(dst byte, src byte) of every byte copied, sorted by destination."""
    if not copies:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    srcs = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, _, n in copies])
    dsts = np.concatenate([np.arange(d, d + n, dtype=np.int64) for _, d, n in copies])
    order = np.argsort(dsts, kind="stable")
    return dsts[order], srcs[order]


def host_side(case: Case, copy: Copy) -> int:
    src, dst, _ = copy
    return dst if case.direction is Direction.STORE else src


def device_side(case: Case, copy: Copy) -> int:
    src, dst, _ = copy
    return src if case.direction is Direction.STORE else dst


def device_segments(case: Case, copy: Copy, reference: list[tuple[Copy, int]]) -> set[int]:
    """Segments of every reference page whose device bytes the copy touches."""
    start = device_side(case, copy)
    end = start + copy[2]
    found = set()
    for ref, seg in reference:
        ref_start = device_side(case, ref)
        if ref_start < end and start < ref_start + ref[2]:
            found.add(seg)
    return found


def host_chunk(case: Case, address: int) -> int:
    return (address - HOST_BASE) // case.chunk_bytes


# ------------------------------------------------------------------------- properties of build


@SETTINGS
@given(cases())
def test_plan_moves_exactly_the_bytes_of_the_reference(case: Case) -> None:
    reference = reference_copies(case)
    desc = case.build()
    ref_dst, ref_src = byte_map([c for c, _ in reference])
    got_dst, got_src = byte_map(plan_copies(desc))
    assert np.array_equal(got_dst, ref_dst)
    assert np.array_equal(got_src, ref_src)
    assert desc.nbytes == sum(c[2] for c, _ in reference)


@SETTINGS
@given(cases())
def test_merged_copies_stay_inside_one_host_chunk_and_one_device_segment(case: Case) -> None:
    reference = reference_copies(case)
    for copy in plan_copies(case.build()):
        host = host_side(case, copy)
        assert host_chunk(case, host) == host_chunk(case, host + copy[2] - 1), copy
        assert len(device_segments(case, copy, reference)) == 1, copy


@SETTINGS
@given(cases())
def test_no_two_consecutive_copies_could_have_been_merged(case: Case) -> None:
    reference = reference_copies(case)
    copies = plan_copies(case.build())
    for a, b in zip(copies, copies[1:]):
        continues = b[0] == a[0] + a[2] and b[1] == a[1] + a[2]
        if continues:
            same_chunk = host_chunk(case, host_side(case, a)) == host_chunk(case, host_side(case, b))
            same_segment = device_segments(case, a, reference) == device_segments(case, b, reference)
            assert not (same_chunk and same_segment), (a, b)


@SETTINGS
@given(cases())
def test_merging_never_adds_copies_and_without_it_plan_equals_reference(case: Case) -> None:
    reference = [c for c, _ in reference_copies(case)]
    assert case.build().count <= len(reference)
    assert plan_copies(case.build(merge=False)) == reference


@SETTINGS
@given(cases())
def test_descriptor_arrays_are_c_contiguous_uint64_of_equal_length(case: Case) -> None:
    for merge in (True, False):
        desc = case.build(merge)
        for array in (desc.dsts, desc.srcs, desc.sizes):
            assert array.dtype == np.uint64
            assert array.flags.c_contiguous
            assert array.ndim == 1
            assert array.shape == (desc.count,)


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_empty_job_gives_empty_uint64_arrays(direction: Direction) -> None:
    table = PageTable(
        dev_base=np.asarray([DEVICE_BASE], dtype=np.int64),
        dev_stride=np.asarray([4096], dtype=np.int64),
        nbytes=np.asarray([4096], dtype=np.int64),
        host_offset=np.asarray([0], dtype=np.int64),
        segment=np.asarray([0], dtype=np.int64),
        record_bytes=4096,
    )
    empty = np.zeros(0, dtype=np.int64)
    desc = CopyPlan(table, HOST_BASE, 8, direction).build(empty, empty)
    assert desc.count == 0 and desc.nbytes == 0
    for array in (desc.dsts, desc.srcs, desc.sizes):
        assert array.dtype == np.uint64 and array.shape == (0,) and array.flags.c_contiguous


# ---------------------------------------------------------------------- merging where it should


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bfloat16)


def _ids(*values: int) -> I64Array:
    return np.asarray(values, dtype=np.int64)


def test_one_page_per_record_with_contiguous_ids_is_one_copy() -> None:
    layout = DeviceLayout.from_tensors({"kv": _bf16(8, 2, 16, 2, 32)}, block_dim=0)
    assert layout.block_bytes == layout.record_bytes == 4096
    base = int(layout.page_table.dev_base[0])
    store = CopyPlan(layout.page_table, HOST_BASE, 64, Direction.STORE)
    desc = store.build(_ids(1, 2, 3), _ids(4, 5, 6))
    assert plan_copies(desc) == [(base + 4096, HOST_BASE + 4 * 4096, 3 * 4096)]
    load = CopyPlan(layout.page_table, HOST_BASE, 64, Direction.LOAD)
    assert plan_copies(load.build(_ids(4, 5, 6), _ids(1, 2, 3))) == [
        (HOST_BASE + 4 * 4096, base + 4096, 3 * 4096)
    ]


def test_contiguous_run_is_split_at_a_pin_chunk_boundary() -> None:
    layout = DeviceLayout.from_tensors({"kv": _bf16(8, 2, 16, 2, 32)}, block_dim=0)
    base = int(layout.page_table.dev_base[0])
    plan = CopyPlan(layout.page_table, HOST_BASE, 4, Direction.STORE)  # chunks: records 0-3, 4-7
    desc = plan.build(_ids(0, 1, 2, 3), _ids(2, 3, 4, 5))
    assert plan_copies(desc) == [
        (base, HOST_BASE + 2 * 4096, 2 * 4096),
        (base + 2 * 4096, HOST_BASE + 4 * 4096, 2 * 4096),
    ]


def test_block_major_k_and_v_pages_adjacent_in_both_memories_merge() -> None:
    kv = _bf16(8, 2, 16, 2, 32)  # block-major: K then V of each block, 2048 bytes each
    layout = DeviceLayout.from_tensors({"k": kv[:, 0], "v": kv[:, 1]}, block_dim=0)
    assert layout.pages_per_block == 2
    assert layout.page_table.host_offset.tolist() == [0, 2048]
    base = kv.data_ptr()
    plan = CopyPlan(layout.page_table, HOST_BASE, 64, Direction.STORE)
    scattered = plan.build(_ids(5, 2), _ids(0, 3))
    assert plan_copies(scattered) == [
        (base + 5 * 4096, HOST_BASE, 4096),
        (base + 2 * 4096, HOST_BASE + 3 * 4096, 4096),
    ]
    assert plan.build(_ids(2, 3, 4), _ids(0, 1, 2)).count == 1


def test_adjacent_pages_of_two_allocations_are_not_merged() -> None:
    table = PageTable(
        dev_base=np.asarray([DEVICE_BASE, DEVICE_BASE + 2048], dtype=np.int64),
        dev_stride=np.asarray([4096, 4096], dtype=np.int64),
        nbytes=np.asarray([2048, 2048], dtype=np.int64),
        host_offset=np.asarray([0, 2048], dtype=np.int64),
        segment=np.asarray([0, 1], dtype=np.int64),
        record_bytes=4096,
    )
    desc = CopyPlan(table, HOST_BASE, 64, Direction.LOAD).build(_ids(0), _ids(0))
    assert plan_copies(desc) == [
        (HOST_BASE, DEVICE_BASE, 2048),
        (HOST_BASE + 2048, DEVICE_BASE + 2048, 2048),
    ]


# ------------------------------------------------------------------------- validation helpers


def reference_duplicate(ids: Sequence[int]) -> int | None:
    return next((i for i in range(len(ids)) if ids[i] in ids[:i]), None)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(-3, 6), max_size=12))
def test_find_duplicate_returns_first_index_repeating_an_earlier_id(ids: list[int]) -> None:
    assert find_duplicate(np.asarray(ids, dtype=np.int64)) == reference_duplicate(ids)


_INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    ids=st.lists(st.integers(-3, 12), max_size=40),  # past 16: the long-list branch
    limit=st.integers(1, 14),
    container=st.sampled_from(["list", "tuple", "numpy", "torch"]),
    dtype=st.sampled_from(_INT_DTYPES),
)
def test_as_block_ids_accepts_in_range_ids_and_names_the_first_bad_one(
    ids: list[int], limit: int, container: str, dtype: type[np.integer]
) -> None:
    if container == "numpy" and np.iinfo(dtype).min > min(ids, default=0):
        dtype = np.int64  # unsigned dtypes cannot hold the negative ids
    values: object
    if container == "list":
        values = list(ids)
    elif container == "tuple":
        values = tuple(ids)
    elif container == "numpy":
        values = np.asarray(ids, dtype=dtype)
    else:
        values = torch.tensor(ids, dtype=torch.int64)
    first_bad = next((i for i, v in enumerate(ids) if not 0 <= v < limit), None)
    if first_bad is None:
        out = as_block_ids("host_blocks", values, limit)
        assert out.dtype == np.int64 and out.ndim == 1 and out.flags.c_contiguous
        assert out.tolist() == ids
        return
    message = (
        rf"host_blocks\[{first_bad}\] = {ids[first_bad]} is out of range "
        rf"\(the pool has {limit} blocks: 0\.\.{limit - 1}\)"
    )
    with pytest.raises(InvalidBlockIdError, match=message) as info:
        as_block_ids("host_blocks", values, limit)
    assert type(info.value) is InvalidBlockIdError


_NOT_INTS = st.sampled_from([1.0, 2.5, True, False, "1", None, b"1", [1], np.float64(1.0)])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    ids=st.lists(st.integers(0, 7), max_size=30),
    bad=st.lists(st.tuples(st.integers(0, 30), _NOT_INTS), min_size=1, max_size=3),
)
def test_as_block_ids_refuses_any_non_int_element_naming_the_first(
    ids: list[int], bad: list[tuple[int, object]]
) -> None:
    values: list[object] = list(ids)
    for position, value in bad:
        values.insert(min(position, len(values)), value)
    first = next(i for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, int))
    prefix = rf"device_blocks\[{first}\] = "
    with pytest.raises(BlockIdTypeError, match=prefix) as info:
        as_block_ids("device_blocks", values, 8)
    assert f"is a {type(values[first]).__name__}, not an int" in str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "values",
    [
        pytest.param([2**63], id="list-2**63"),
        pytest.param(np.asarray([2**63], dtype=np.uint64), id="uint64-2**63"),
        pytest.param([2**70], id="list-2**70"),
        pytest.param([0] * 20 + [2**63], id="long-list-2**63"),
        pytest.param([0] * 20 + [2**70], id="long-list-2**70"),
        pytest.param([0] * 20 + [-1], id="long-list-negative"),
    ],
)
def test_as_block_ids_names_a_huge_id_by_its_value(values: object) -> None:
    at = len(values) - 1 if isinstance(values, list) else 0
    big = int(np.asarray(values, dtype=object)[at])
    with pytest.raises(InvalidBlockIdError, match=rf"host_blocks\[{at}\] = {big} is out of range"):
        as_block_ids("host_blocks", values, 8)
