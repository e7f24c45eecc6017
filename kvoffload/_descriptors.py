"""Copy descriptors: which bytes a job moves, as numpy arrays the driver takes directly.

Owns the arithmetic from (block ids) to (destination, source, size) triples. Pure numpy; no CUDA and
no torch, so it is tested on CPU against a brute-force reference. Everything that depends only on
the layout and the host pool (page addresses, strides, sizes, record offsets) is computed once per
(layout, direction) in a :class:`CopyPlan`; a job's descriptors are then a few vectorised numpy
operations, never a Python loop per page.

Contiguous runs are merged: two consecutive copies whose sources and destinations both continue
each other become one copy. A run never crosses a host pin-chunk boundary, because a copy must lie
inside one host registration.
"""

from __future__ import annotations

import functools
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from kvoffload.records import Direction

__all__ = [
    "SHORT_RUNS_SHARE", "STAGED_EDGE_GROWTH", "UNIT_MAX_BYTES", "CopyPlan", "Descriptors", "PageTable", "StagedChunk",
    "kernel_segments", "mostly_apart", "plan_staged", "plan_staged_part", "rows_in_short_runs", "staged_chunk_rows",
]

I64Array = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]

_EMPTY_U64: Final = np.zeros(0, dtype=np.uint64)
#: A staged job's chunks grow by this factor from its edge chunk (:func:`staged_chunk_rows`): the
#: copy kernel moves a chunk through HBM about 20x faster than the link moves it, so the kernel of
#: a chunk 8x the edge's still finishes within the edge chunk's DMA.
STAGED_EDGE_GROWTH: Final = 8


def staged_chunk_rows(count: int, rows_per_slot: int, edge_rows: int, store: bool) -> list[int]:
    """The rows of each chunk of a staged job of ``count`` rows, in issue order (docs/design.md §7).

    A chunk waits for the whole of its neighbour's other half: a store's first DMA for the gather
    of its whole first chunk, a load's last scatter for the DMA of its whole last chunk. So the
    chunk at the job's edge (a store's first, a load's last) holds ``edge_rows`` rows, and the
    chunks grow from it by :data:`STAGED_EDGE_GROWTH` up to ``rows_per_slot``; the rest are whole
    slots and the remainder (a store's last chunk, a load's first). ``edge_rows`` 0: every chunk a
    whole slot but the last. ``issuer.c``'s ``staged_chunks`` makes the same chunks, with an edge
    for a job alone; the Python issuer plans whole slots (``edge_rows`` 0).

    Raises:
        ValueError: ``rows_per_slot`` below 1.
    """
    if rows_per_slot <= 0:
        raise ValueError("a staged plan needs at least one slot of at least one row")
    size = rows_per_slot if edge_rows <= 0 else min(edge_rows, rows_per_slot)
    rows: list[int] = []
    left = count
    while left > 0:
        take = min(size, left)
        rows.append(take)
        left -= take
        size = min(size * STAGED_EDGE_GROWTH, rows_per_slot)
    return rows if store or edge_rows <= 0 else rows[::-1]


@attrs.frozen(eq=False)
class PageTable:
    """The pages of one block, in host-record order.

    For page ``p``: the device address of its block-0 instance is ``dev_base[p]``, block ``d``'s
    instance is at ``dev_base[p] + d * dev_stride[p]``, it has ``nbytes[p]`` bytes, and it lives at
    ``host_offset[p]`` inside a host record of ``record_bytes`` bytes. ``segment[p]`` names the
    device allocation (tensor) the page belongs to: copies are never merged across two of them,
    since adjacent addresses of two allocations are not one allocation. Pages never overlap, in
    either memory.
    """

    dev_base: I64Array
    dev_stride: I64Array
    nbytes: I64Array
    host_offset: I64Array
    segment: I64Array
    record_bytes: int

    @property
    def num_pages(self) -> int:
        """Pages per block."""
        return int(self.nbytes.shape[0])

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block (the sum of its page sizes)."""
        return int(self.nbytes.sum())

    def record_runs(self) -> tuple[I64Array, I64Array]:
        """(offsets, sizes) of the byte ranges of a host record these pages fill, merged where
        they follow each other, in record order."""
        order = np.argsort(self.host_offset, kind="stable")
        starts, sizes = self.host_offset[order], self.nbytes[order]
        if starts.shape[0] == 0:
            return starts, sizes
        continues = starts[1:] == starts[:-1] + sizes[:-1]
        first = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(~continues) + 1))
        return starts[first], np.add.reduceat(sizes, first)


@attrs.frozen(eq=False)
class Descriptors:
    """One job's copies: C-contiguous ``uint64`` arrays of equal length."""

    dsts: U64Array
    srcs: U64Array
    sizes: U64Array

    @property
    def count(self) -> int:
        """Number of copies."""
        return int(self.sizes.shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes copied."""
        return int(self.sizes.sum(dtype=np.uint64))


@attrs.frozen(eq=False, cache_hash=False)
class CopyPlan:
    """Precomputed parameters of one direction over one layout and one host pool.

    ``host_base`` is the address of host record 0; ``chunk_records`` is how many records one pin
    chunk holds (runs are not merged across a chunk boundary). ``direction`` says which side is the
    source: STORE copies device pages to host records, LOAD the reverse. ``host_stride`` is the bytes
    from one host record to the next: ``record_bytes`` by default, a shared pool's whole block
    (every rank's slice) for one rank's plan, whose records are then this rank's slices only
    (docs/design.md §13).
    """

    pages: PageTable
    host_base: int
    chunk_records: int
    direction: Direction = attrs.field(validator=attrs.validators.in_((Direction.STORE, Direction.LOAD)))
    merge: bool = True
    host_stride: int = attrs.field(
        default=attrs.Factory(lambda plan: plan.pages.record_bytes, takes_self=True), kw_only=True
    )

    @host_stride.validator
    def _check_stride(self, _attribute: object, value: int) -> None:
        if value < self.pages.record_bytes:
            raise ValueError(
                f"host_stride = {value} is less than a record ({self.pages.record_bytes} bytes)"
            )

    def for_pages(self, pages: PageTable) -> CopyPlan:
        """The same plan over other pages of the same records (one layer's, docs/design.md §12)."""
        return attrs.evolve(self, pages=pages)

    @functools.cached_property
    def record_runs(self) -> tuple[I64Array, I64Array]:
        """(offsets, sizes) of the byte ranges of a host record this plan's pages fill, merged
        where they follow each other, in record order (:meth:`PageTable.record_runs`)."""
        return self.pages.record_runs()

    @functools.cached_property
    def compact(self) -> CopyPlan:
        """This plan over rows that hold only the span of the record its pages fill: page offsets
        shifted down by the span's start, rows of the span's size rounded up to 16 bytes (the
        staged path's slot rows for one layer). A plan of whole records is its own."""
        starts, sizes = self.record_runs
        lo = int(starts[0]) if starts.shape[0] else 0
        span = -(-(int(starts[-1] + sizes[-1]) - lo) // 16) * 16 if starts.shape[0] else 16
        if lo == 0 and span >= self.pages.record_bytes:
            return self
        p = self.pages
        pages = PageTable(dev_base=p.dev_base, dev_stride=p.dev_stride, nbytes=p.nbytes,
                          host_offset=p.host_offset - lo, segment=p.segment, record_bytes=span)
        return attrs.evolve(self, pages=pages)

    def build(self, src_blocks: I64Array, dst_blocks: I64Array) -> Descriptors:
        """Descriptors for the pairs ``(src_blocks[i], dst_blocks[i])``.

        For a store the sources are device blocks and the destinations host blocks; for a load the
        reverse. The ids must already be validated (same length, in range).
        """
        if self.direction is Direction.STORE:
            return self.build_device_host(src_blocks, self.host_base, dst_blocks, self.chunk_records,
                                          self.host_stride)
        return self.build_device_host(dst_blocks, self.host_base, src_blocks, self.chunk_records,
                                      self.host_stride)

    def build_device_host(
        self, device_blocks: I64Array, host_base: int, host_rows: I64Array, chunk_records: int,
        host_stride: int | None = None,
    ) -> Descriptors:
        """Descriptors between ``device_blocks[i]`` and row ``host_rows[i]`` of a record array at
        ``host_base`` whose rows are ``host_stride`` bytes apart (default: back to back, like a
        staging slot), in this plan's direction.
        """
        if device_blocks.shape[0] == 0:
            return Descriptors(_EMPTY_U64, _EMPTY_U64, _EMPTY_U64)
        pages = self.pages
        stride = pages.record_bytes if host_stride is None else host_stride
        dev = (pages.dev_base[None, :] + device_blocks[:, None] * pages.dev_stride[None, :]).ravel()
        host = (
            host_base + host_rows[:, None] * stride + pages.host_offset[None, :]
        ).ravel()
        sizes = np.broadcast_to(pages.nbytes, (host_rows.shape[0], pages.num_pages)).ravel()
        if self.direction is Direction.STORE:
            srcs, dsts = dev, host
        else:
            srcs, dsts = host, dev
        if self.merge and sizes.shape[0] > 1 and self._mergeable:
            num_segments = int(pages.segment.max()) + 1
            area = (
                (host_rows // chunk_records)[:, None] * num_segments + pages.segment[None, :]
            ).ravel()
            srcs, dsts, sizes = _merge_runs(srcs, dsts, sizes, area)
        return Descriptors(_as_u64(dsts), _as_u64(srcs), _as_u64(sizes))

    @functools.cached_property
    def _mergeable(self) -> bool:
        """Whether any two copies of a job could ever merge (decided once per plan).

        Two pages of one record merge only if they follow each other on both sides in one device
        allocation; the last page of one record and the first of the next only if both are in one
        device allocation and the record has no padding after its last page and no gap before its
        first.
        """
        p = self.pages
        if p.num_pages > 1:
            # Page p+1 follows page p on the device for block d when gap == d * (stride_p - stride_p+1).
            gap = p.dev_base[1:] - (p.dev_base[:-1] + p.nbytes[:-1])
            slope = p.dev_stride[:-1] - p.dev_stride[1:]
            safe = np.where(slope == 0, 1, slope)
            some_block = np.where(slope == 0, gap == 0, (gap % safe == 0) & (gap // safe >= 0))
            follows = (
                some_block
                & (p.host_offset[1:] == p.host_offset[:-1] + p.nbytes[:-1])
                & (p.segment[1:] == p.segment[:-1])
            )
            if bool(follows.any()):
                return True
        last_end = int(p.host_offset[-1] + p.nbytes[-1])
        same_allocation = int(p.segment[-1]) == int(p.segment[0])
        return (same_allocation and int(p.host_offset[0]) == 0 and last_end == p.record_bytes
                and self.host_stride == p.record_bytes)


def _as_u64(values: I64Array) -> U64Array:
    """The same bytes as ``uint64`` (addresses and sizes are non-negative), C-contiguous."""
    return np.ascontiguousarray(values).view(np.uint64)


def _merge_runs(
    srcs: I64Array, dsts: I64Array, sizes: I64Array, area: I64Array
) -> tuple[I64Array, I64Array, I64Array]:
    """Merge consecutive copies that continue each other on both sides, inside one ``area``
    (one host pin chunk and one device allocation)."""
    continues = (
        (srcs[1:] == srcs[:-1] + sizes[:-1])
        & (dsts[1:] == dsts[:-1] + sizes[:-1])
        & (area[1:] == area[:-1])
    )
    if not continues.any():
        return srcs, dsts, sizes
    starts = np.flatnonzero(~continues) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), starts))
    return srcs[starts], dsts[starts], np.add.reduceat(sizes, starts)


#: Largest unit of work of the copy kernel (one warp's item): longer runs are split so that warps
#: share the work. Small, so that a small job keeps many warps busy: one warp moves 2 KiB per round
#: trip to memory, and a 1-block job of 64 pages of 32 KiB as 64-KiB-bounded units kept 64 warps busy
#: for 16 round trips each (design §16, *The copy kernel's unit*).
UNIT_MAX_BYTES: Final = 4 << 10


def kernel_segments(pages: PageTable, unit_max: int = UNIT_MAX_BYTES) -> I64Array:
    """The copy kernel's per-block work table: ``int64 [n, 4]`` rows ``(dev_base, dev_stride,
    host_offset, nbytes)``.

    Row ``s`` describes the same bytes of every block: for device block ``d`` and host row ``r`` of
    a record array at ``host_base`` it copies ``nbytes`` bytes between ``dev_base + d * dev_stride``
    and ``host_base + r * record_bytes + host_offset``. Pages that follow each other on both sides
    in one device allocation with one stride are merged; every run is then split into pieces of at
    most ``unit_max`` bytes (16-byte multiples except a page's last piece), so the warps of the
    kernel share long pages. Computed once per layout; a job then passes only its block ids.
    """
    if unit_max <= 0 or unit_max % 16:
        raise ValueError(f"unit_max = {unit_max} must be a positive multiple of 16")
    p = pages
    continues = (
        (p.dev_base[1:] == p.dev_base[:-1] + p.nbytes[:-1])
        & (p.dev_stride[1:] == p.dev_stride[:-1])
        & (p.segment[1:] == p.segment[:-1])
        & (p.host_offset[1:] == p.host_offset[:-1] + p.nbytes[:-1])
    )
    starts = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(~continues) + 1))
    sizes = np.add.reduceat(p.nbytes, starts)
    pieces = np.maximum(1, (sizes + unit_max - 1) // unit_max)
    owner = np.repeat(np.arange(starts.shape[0]), pieces)
    first = np.cumsum(pieces) - pieces
    offset = (np.arange(owner.shape[0]) - first[owner]) * unit_max
    table = np.empty((owner.shape[0], 4), dtype=np.int64)
    table[:, 0] = p.dev_base[starts][owner] + offset
    table[:, 1] = p.dev_stride[starts][owner]
    table[:, 2] = p.host_offset[starts][owner] + offset
    table[:, 3] = np.minimum(sizes[owner] - offset, unit_max)
    return table


@attrs.frozen(eq=False)
class StagedChunk:
    """One chunk of a staged job: the records of ``pairs`` go through staging slot ``slot``.

    ``device_blocks[r]`` is the device block whose pages the copy kernel moves to or from row ``r``
    of the slot (device -> slot for a store, slot -> device for a load; the rows are laid out like
    host records, see :func:`kernel_segments`); ``dma`` are the record copies between the slot and
    the host pool (slot -> host for a store, host -> slot for a load).
    """

    slot: int
    pairs: slice
    device_blocks: I64Array
    dma: Descriptors


def plan_staged(
    plan: CopyPlan,
    src_blocks: I64Array,
    dst_blocks: I64Array,
    slot_bases: tuple[int, ...],
    rows_per_slot: int,
    first_slot: int = 0,
    *,
    edge_bytes: int = 0,
) -> list[StagedChunk]:
    """Split a job into chunks of at most ``rows_per_slot`` records that rotate over the slots, the
    chunk at its edge of ``edge_bytes`` (:func:`staged_chunk_rows`; at least one record; 0: none).

    Inside a slot the job's records lie back to back in host-block order, each laid out exactly like
    a host record, so a slot <-> host copy is one copy per record, merged when host blocks are
    consecutive. ``pairs`` indexes the job's pairs in that order.
    """
    if rows_per_slot <= 0 or not slot_bases:
        raise ValueError("a staged plan needs at least one slot of at least one record")
    store = plan.direction is Direction.STORE
    device_blocks, host_blocks = (src_blocks, dst_blocks) if store else (dst_blocks, src_blocks)
    count = int(device_blocks.shape[0])
    record = plan.pages.record_bytes
    if count <= 1:  # one record (or none): no order to choose and no run to merge
        slot = first_slot % len(slot_bases)
        records = _single_record_copy(slot_bases[slot], plan.host_base, record, plan.host_stride,
                                      host_blocks, to_host=store)
        return [StagedChunk(slot, slice(0, count), device_blocks, records)]
    # In host order, consecutive host records become one DMA; the pairing is unchanged.
    order = np.argsort(host_blocks, kind="stable")
    device_blocks, host_blocks = device_blocks[order], host_blocks[order]
    # The record copies of every chunk at once: row r of the job is row r - bounds[c] of the chunk
    # c it falls in, whose slot rotates from first_slot. A run never crosses a chunk (its slot) or a
    # pin chunk of the host pool.
    rows = staged_chunk_rows(count, rows_per_slot, _edge_rows(edge_bytes, record), store)
    bounds_at = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(rows, dtype=np.int64)))
    index = np.arange(count, dtype=np.int64)
    one_chunk = len(rows) == 1
    host_addr = plan.host_base + host_blocks * plan.host_stride
    area = host_blocks // plan.chunk_records
    if one_chunk:
        slot_addr = slot_bases[first_slot % len(slot_bases)] + index * record
    else:
        chunk_of = np.searchsorted(bounds_at, index, side="right") - 1
        bases = np.asarray(slot_bases, dtype=np.int64)
        slot_addr = bases[(first_slot + chunk_of) % len(slot_bases)] + (index - bounds_at[chunk_of]) * record
        area = area * (len(rows) + 1) + chunk_of  # one area per (pin chunk, job chunk)
    srcs, dsts = (slot_addr, host_addr) if store else (host_addr, slot_addr)
    continues = (
        (srcs[1:] == srcs[:-1] + record) & (dsts[1:] == dsts[:-1] + record) & (area[1:] == area[:-1])
    )
    starts = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(~continues) + 1))
    sizes = np.diff(np.append(starts, count)) * record
    copy_srcs, copy_dsts = _as_u64(srcs[starts]), _as_u64(dsts[starts])
    copy_sizes = _as_u64(sizes)
    bounds = (
        [0, int(starts.shape[0])] if one_chunk
        else np.searchsorted(chunk_of[starts], np.arange(len(rows) + 1)).tolist()
    )
    chunks: list[StagedChunk] = []
    for index_, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        start, stop = int(bounds_at[index_]), int(bounds_at[index_ + 1])
        chunks.append(StagedChunk(
            (first_slot + index_) % len(slot_bases), slice(start, stop), device_blocks[start:stop],
            Descriptors(copy_dsts[lo:hi], copy_srcs[lo:hi], copy_sizes[lo:hi]),
        ))
    return chunks


def plan_staged_part(
    plan: CopyPlan,
    src_blocks: I64Array,
    dst_blocks: I64Array,
    slot_bases: tuple[int, ...],
    slot_bytes: int,
    first_slot: int = 0,
    *,
    edge_bytes: int = 0,
) -> list[StagedChunk]:
    """:func:`plan_staged` for a plan whose pages fill only part of each record (one layer's): the
    DMA moves only those byte ranges (:attr:`CopyPlan.record_runs`) of each record, into slot rows
    laid out as :attr:`CopyPlan.compact` (the ranges' span: as many rows per slot as it allows).
    The copy kernel then moves row ``r`` of a chunk with the compact plan. A plan of whole records
    is :func:`plan_staged`'s, with rows of a record.
    """
    compact = plan.compact
    pitch = compact.pages.record_bytes
    rows_per_slot = slot_bytes // pitch
    if compact is plan:
        return plan_staged(plan, src_blocks, dst_blocks, slot_bases, rows_per_slot, first_slot,
                           edge_bytes=edge_bytes)
    if rows_per_slot <= 0 or not slot_bases:
        raise ValueError("a staged plan needs at least one slot of at least one row")
    offsets, sizes = plan.record_runs
    in_row = offsets - int(offsets[0])
    store = plan.direction is Direction.STORE
    device_blocks, host_blocks = (src_blocks, dst_blocks) if store else (dst_blocks, src_blocks)
    count = int(device_blocks.shape[0])
    order = np.argsort(host_blocks, kind="stable")
    device_blocks, host_blocks = device_blocks[order], host_blocks[order]
    chunks: list[StagedChunk] = []
    start = 0
    taking = staged_chunk_rows(count, rows_per_slot, _edge_rows(edge_bytes, pitch), store)
    for index, taken in enumerate(taking):
        stop = start + taken
        slot = (first_slot + index) % len(slot_bases)
        rows = np.arange(stop - start, dtype=np.int64)
        slot_addr = (slot_bases[slot] + rows[:, None] * pitch + in_row[None, :]).ravel()
        host_addr = (plan.host_base + host_blocks[start:stop, None] * plan.host_stride
                     + offsets[None, :]).ravel()
        srcs, dsts = (slot_addr, host_addr) if store else (host_addr, slot_addr)
        run_sizes = np.broadcast_to(sizes, (stop - start, sizes.shape[0])).ravel()
        chunks.append(StagedChunk(slot, slice(start, stop), device_blocks[start:stop],
                                  Descriptors(_as_u64(dsts), _as_u64(srcs), _as_u64(run_sizes))))
        start = stop
    return chunks


def _edge_rows(edge_bytes: int, row_bytes: int) -> int:
    """Rows of a staged job's edge chunk of ``edge_bytes`` (at least one; 0 when there is none)."""
    return max(1, edge_bytes // row_bytes) if edge_bytes > 0 else 0


def _single_record_copy(
    slot_base: int, host_base: int, record: int, host_stride: int, host_blocks: I64Array, *,
    to_host: bool,
) -> Descriptors:
    """The record copy of a job of at most one record (none for an empty job), in row 0 of its slot."""
    if host_blocks.shape[0] == 0:
        return Descriptors(_EMPTY_U64, _EMPTY_U64, _EMPTY_U64)
    host_one = host_base + int(host_blocks[0]) * host_stride
    src_one, dst_one = (slot_base, host_one) if to_host else (host_one, slot_base)
    return Descriptors(np.array([dst_one], dtype=np.uint64), np.array([src_one], dtype=np.uint64),
                       np.array([record], dtype=np.uint64))


#: A staged layer's rows count as moved apart, a descriptor per record, where over this share of
#: them lies in runs of records too short for the issuer's strided copies (docs/design.md §12).
SHORT_RUNS_SHARE: Final = 0.5


def rows_in_short_runs(host_blocks: I64Array, min_rows: int) -> int:
    """How many of ``host_blocks`` lie in runs of fewer than ``min_rows`` records that follow each
    other (the ids taken in ascending order, as the staged path takes them). On the caller's
    thread: few numpy calls (2.8 us for 256 ids in order or all apart, 5 us in runs, on the CI
    host)."""
    n = int(host_blocks.shape[0])
    if n == 0:
        return 0
    ordered = np.sort(host_blocks)
    ends = np.flatnonzero(ordered[1:] != ordered[:-1] + 1)  # the last record of every run but the last
    runs = int(ends.shape[0]) + 1
    if runs == 1:
        return n if n < min_rows else 0
    if runs == n:  # every run one record
        return n if min_rows > 1 else 0
    bounds = np.empty(runs + 1, dtype=np.int64)
    bounds[0], bounds[1:runs], bounds[runs] = -1, ends, n - 1
    lengths = bounds[1:] - bounds[:-1]
    return n - int(lengths[lengths >= min_rows].sum())


def mostly_apart(host_blocks: I64Array, strided_min_rows: int) -> bool:
    """Whether a staged layered load from ``host_blocks`` moves over :data:`SHORT_RUNS_SHARE` of
    its rows as descriptors, through an issuer whose rows in runs of at least ``strided_min_rows``
    records go as strided copies (0: the issuer has none, so every row counts)."""
    if strided_min_rows <= 0:
        return True
    return rows_in_short_runs(host_blocks, strided_min_rows) > SHORT_RUNS_SHARE * int(host_blocks.shape[0])
