"""Narrow layers grouped for a ``staged`` layered load from records apart (docs/design.md §12,
*Narrow layers grouped for staged*): how many layers a group holds, the groups' pages, the marks
that show a grouped job as its layers, and the handler's choice over the fake driver — grouped only
through ``staged``, only from records apart, through both of the worker's doors, every byte moved."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload import DeviceLayout, Worker, _layer_groups
from kvoffload._descriptors import CopyPlan, PageTable, kernel_segments
from kvoffload._layer_groups import GroupedMarks, group_size, grouped
from kvoffload.backends.native import NativeBackend
from kvoffload.errors import WaitTimeoutError
from kvoffload.records import Direction
from tests.unit._native_fake import IDLE, KERNEL, FakeDriver
from tests.unit.test_native_issuer import (SLOT_BASES, TIMEOUT_S, Harness, Inner, expected, layer_tables, make_plan,
                                          moved)

KIB = 1 << 10
I64 = np.int64


def per_layer(layers: int, page: int) -> tuple[PageTable, ...]:
    """The layer tables of a per-layer layout: K and V pages of ``page`` bytes a layer, side by
    side in the record, layer after layer."""
    layout = DeviceLayout.from_tensors({f"layer{i}": torch.zeros(2, 4, page, dtype=torch.uint8) for i in range(layers)},
                                       block_dim=1, num_blocks=4)
    return layout.require_layers()


@pytest.mark.parametrize(("page", "layers", "size"), [
    (4 * KIB, 16, 4),  # 8 KiB layers: four make 32 KiB
    (2 * KIB, 16, 8),  # 4 KiB layers: eight
    (12 * KIB, 16, 2),  # 24 KiB layers: two make 48 KiB
    (16 * KIB, 16, 1),  # 32 KiB layers: wide enough as they are
    (4 * KIB, 1, 1),  # one layer: nothing to group
    (1 * KIB, 3, 1),  # 2 KiB layers, 6 KiB in all: no group gets there
])
def test_a_group_holds_the_fewest_layers_whose_span_reaches_the_minimum(page: int, layers: int, size: int) -> None:
    assert group_size(per_layer(layers, page)) == size


def test_layers_whose_spans_do_not_follow_each_other_are_not_grouped() -> None:
    """Layers interleaved with gaps in the record (every layer's pages 64 KiB apart from the next
    layer's): a group's ranges are no wider than a layer's."""
    tables = tuple(PageTable(dev_base=np.array([i << 30], dtype=I64), dev_stride=np.array([4 * KIB], dtype=I64),
                             nbytes=np.array([4 * KIB], dtype=I64), host_offset=np.array([i * 64 * KIB], dtype=I64),
                             segment=np.array([i], dtype=I64), record_bytes=16 * 64 * KIB) for i in range(16))
    assert group_size(tables) == 1


def test_groups_hold_their_layers_pages_in_record_order_the_last_perhaps_fewer() -> None:
    tables = per_layer(10, 4 * KIB)
    groups = grouped(tables, 4)
    assert [g.num_pages for g in groups] == [8, 8, 4]
    for g, first in zip(groups, (0, 4, 8)):
        part = tables[first:first + 4]
        assert g.host_offset.tolist() == [o for t in part for o in t.host_offset.tolist()]
        assert g.dev_base.tolist() == [b for t in part for b in t.dev_base.tolist()]
        assert g.record_bytes == tables[0].record_bytes
        offsets, sizes = g.record_runs()
        assert sizes.tolist() == [sum(t.block_bytes for t in part)]  # one range a record
    assert [g.num_pages for g in grouped(tables, 1)] == [2] * 10
    with pytest.raises(ValueError, match="at least 1"):
        grouped(tables, 0)


class _Marks:
    """Group marks that log the groups waited for."""

    on_device = True

    def __init__(self, count: int, late: int | None = None) -> None:
        self.count = count
        self.waited: list[int] = []
        self.late = late
        self.released = 0

    def wait(self, layer: int, _stream: object | None, timeout_s: float) -> bool:
        if layer == self.late:
            raise WaitTimeoutError(f"layer {layer} was not handed to the issuer within {timeout_s} s")
        self.waited.append(layer)
        return True

    def settle(self) -> None:
        pass

    def release(self) -> None:
        self.released += 1


def test_grouped_marks_show_every_layer_each_waiting_for_its_group() -> None:
    inner = _Marks(3, late=2)
    marks = GroupedMarks(inner, 4, 10)
    assert marks.count == 10 and marks.on_device
    for layer in (0, 3, 4, 7, 1):
        assert marks.wait(layer, None, 1.0)
    assert inner.waited == [0, 0, 1, 1, 0]
    with pytest.raises(WaitTimeoutError, match=r"layer 9 \(moved with layers 8-9\) was not handed"):
        marks.wait(9, None, 1.0)
    marks.release()
    assert inner.released == 1
    with pytest.raises(ValueError):
        GroupedMarks(_Marks(2), 4, 9)  # two groups of four hold eight layers


def eight_layer_plan() -> tuple[CopyPlan, tuple[PageTable, ...]]:
    """A load plan of 16 pages of 256 bytes, eight layers of two (512-byte spans, side by side)."""
    plan = make_plan(Direction.LOAD, [256] * 16)
    return plan, layer_tables(plan)


def host_copies(fake: FakeDriver) -> int:
    """Host copies the driver was given: batched descriptors, single and strided copies."""
    return (sum(int(c[2]) for c in fake.of("cuMemcpyBatchAsync")) + len(fake.of("cuMemcpyAsync"))
            + len(fake.of("cuMemcpy2DAsync")))


@pytest.mark.parametrize(("path", "host", "grouped_in"), [
    ("staged", [1, 3, 5, 7, 9, 11], 2),  # records apart: two groups of four layers
    ("staged", [5, 6, 7, 8, 9, 20], 8),  # a run of strided copies for most rows: the layers
    ("dma", [1, 3, 5, 7, 9, 11], 8),  # dma copies a descriptor a page either way
    ("sm", [1, 3, 5, 7, 9, 11], 8),  # sm has no descriptors
])
def test_a_staged_layered_load_from_records_apart_is_issued_in_groups(
    path: str, host: list[int], grouped_in: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Groups of at least 2 KiB (four of the plan's 512-byte layers): the load is handed over as
    two groups only through ``staged`` from records apart, its marks shown as eight layers; every
    byte lands. The control, no groups (a minimum of 0), hands the same load over as eight layers
    with four times the host copies."""
    device = [10, 11, 12, 13, 14, 15]
    copies = {}
    for minimum in (2 * KIB, 0):
        monkeypatch.setattr(_layer_groups, "GROUP_MIN_SPAN_BYTES", minimum)
        plan, tables = eight_layer_plan()
        h = Harness(Direction.LOAD, path, plan, tune={"edge_bytes": 0})
        try:
            in_flight = threading.Event()  # the job stays in flight until the waits were enqueued
            h.fake.gate["cuEventQuery"] = in_flight
            h.handler._book.reserve(0, h.handler)  # noqa: SLF001 - what the worker does before a layered submit
            marks = h.handler.submit_layered(0, np.array(host, dtype=I64), np.array(device, dtype=I64), tables)
            assert marks.count == 8
            issued = marks.inner.count if isinstance(marks, GroupedMarks) else marks.count
            assert issued == (grouped_in if minimum else 8), (path, host, minimum)
            for layer in range(8):
                assert marks.wait(layer, IDLE, TIMEOUT_S)
            del h.fake.gate["cuEventQuery"]
            in_flight.set()
            (result,) = h.handler.wait([0], TIMEOUT_S)
            assert result.ok, result.error
            assert moved(h.fake, expected(plan, device, host)) == 0
            copies[minimum] = host_copies(h.fake)
            if path == "staged" and issued == 2:
                assert marked_after_scatters(h.fake.snapshot()) == [0, 0, 0, 0, 1, 1, 1, 1]
        finally:
            h.close()
    if grouped_in == 2:
        assert copies[0] == 4 * copies[2 * KIB] == 48  # a copy per record and layer, then per group


def marked_after_scatters(calls: list[tuple[Any, ...]]) -> list[int]:
    """For each wait enqueued on IDLE (one a layer, in layer order): how many of the job's groups'
    scatters (kernel launches, one a group here) came before the record of the event it waits for,
    checking that this record comes before the next group's scatter (rule: a group is marked after
    its own copies, and before any of the next's)."""
    launches = [i for i, c in enumerate(calls) if c[0] == "cuLaunchKernel" and c[1] == KERNEL]
    out = []
    for w in (i for i, c in enumerate(calls) if c[0] == "cuStreamWaitEvent" and c[1] == IDLE):
        record = max(i for i, c in enumerate(calls[:w]) if c[0] == "cuEventRecord" and c[1] == calls[w][2])
        before = [i for i in launches if i < record]
        assert before, "a group was marked before any scatter"
        out.append(len(before) - 1)
    return out


def _staged_worker(keep: list[object], layers: int) -> tuple[Worker, FakeDriver]:
    """A worker whose directions are native ``staged`` issuers over one fake driver, over a cache
    of 16 blocks whose ``layers`` rows of 512 bytes are its layers."""
    fake = FakeDriver()
    keep.append(fake)
    segments: dict[int, Any] = {}

    def table(plan: CopyPlan) -> tuple[int, int]:
        array = segments.setdefault(id(plan), kernel_segments(plan.pages))
        keep.append(plan)
        return int(array.ctypes.data), int(array.shape[0])

    def factory(direction: Direction) -> Any:
        config = fake.config(store=direction is Direction.STORE, slots=SLOT_BASES, slot_bytes=16 * layers * 512,
                             keep=keep)
        config.edge_bytes = 0
        return NativeBackend.start(Inner(direction), config, index=0, choose=lambda _n: "staged",
                                   path_names={"staged": "staged"}, tables=table, keep=keep)

    layout = DeviceLayout.from_tensors([torch.zeros(16, layers, 512, dtype=torch.uint8)], block_dim=0, layer_dim=1)
    return Worker.create(layout, 16, backend_factory=factory), fake


@pytest.mark.parametrize("door", ["fast front", "validating"])
def test_both_doors_of_the_worker_issue_a_staged_load_from_records_apart_in_groups(
    door: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the worker (numpy ids take the fast front, a list the validating path): a layered
    load of eight 512-byte layers from every other record is handed over as two groups of four,
    every layer waited for; the same load from consecutive records keeps its eight layers."""
    monkeypatch.setattr(_layer_groups, "GROUP_MIN_SPAN_BYTES", 2 * KIB)
    keep: list[object] = []
    w, fake = _staged_worker(keep, 8)
    counts: list[int] = []
    backend: Any = w._load._backend  # noqa: SLF001
    made = backend.layer_marks

    def counted(count: int) -> Any:
        counts.append(count)
        return made(count)

    monkeypatch.setattr(backend, "layer_marks", counted)
    try:
        for job, host in enumerate(([1, 3, 5, 7, 9, 11], [4, 5, 6, 7, 8, 9])):
            device = [0, 1, 2, 3, 4, 5]
            ids: Any = (np.array(host, dtype=I64), np.array(device, dtype=I64)) if door == "fast front" else (host, device)
            load = w.load_by_layer(job, *ids, stream=None)
            assert load.num_layers == 8
            for layer in range(8):
                load.wait_layer(layer)
            (result,) = w.wait([job], TIMEOUT_S)
            assert result.ok, result.error
        assert counts == [2, 8]
    finally:
        w.shutdown(TIMEOUT_S)
    assert fake.events_destroyed == fake.events_created


def test_layers_split_in_two_parts_of_the_record_need_twice_the_layers_a_group() -> None:
    """K pages of every layer first, then V pages (two ranges a layer of 4 KiB each): a group of
    ``g`` layers fills two ranges of ``g`` x 4 KiB, so eight layers make one 32 KiB-average group;
    its pages come in record order."""
    page = 4 * KIB
    tables = tuple(PageTable(dev_base=np.array([i << 30, (i << 30) + (1 << 29)], dtype=I64),
                             dev_stride=np.array([page, page], dtype=I64), nbytes=np.array([page, page], dtype=I64),
                             host_offset=np.array([i * page, (8 + i) * page], dtype=I64),
                             segment=np.array([2 * i, 2 * i + 1], dtype=I64), record_bytes=16 * page)
                   for i in range(8))
    assert group_size(tables) == 8
    (group,) = grouped(tables, 8)
    assert group.host_offset.tolist() == [k * page for k in range(16)]
    assert group.segment.tolist() == [2 * i for i in range(8)] + [2 * i + 1 for i in range(8)]  # moved with them
    assert group.record_runs()[1].tolist() == [16 * page]
