"""The longest copy a path issues (``copier.COPY_PIECE_BYTES``, docs/design.md §4, *Copies in
pieces*): the copy engine can take another stream's copy in the same direction only between
copies.

* :func:`kvoffload.bindings.copier.in_pieces` (the Python paths, in ``Copier.copy``) splits a copy
  into pieces that cover exactly its bytes, in order;
* the native issuer cuts its descriptors into pieces (the dma path's pages, the staged path's
  records, and the runs merged from them) and strided copies to the rows a piece holds, sending
  the rows as descriptors where ``strided_min_rows`` of them do not fit a piece; every job still
  moves exactly its bytes. Each control, with no bound,
  issues a longer copy, so the bound is what keeps them short.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import native
from kvoffload._descriptors import CopyPlan
from kvoffload.backends import native as native_backend
from kvoffload.bindings import copier as copier_module
from kvoffload.bindings.copier import COPY_PIECE_BYTES, Copier, in_pieces
from kvoffload.bindings.types import CopyMethod, SrcAccessOrder
from kvoffload.records import Direction
from tests.unit._native_fake import FakeDriver
from tests.unit.test_native_issuer import THREAD_ISSUES, Harness, expected, make_plan, moved, strided_plan

U64 = np.uint64


def _bytes(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
    """(destination, source) of every byte, in order."""
    out = []
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        out += [(d + k, s + k) for k in range(n)]
    return out


def _run_exactly(h: Harness, plan: CopyPlan, device: list[int], host: list[int]) -> None:
    """Run job 0 between ``device`` and ``host`` blocks through ``h``: it succeeds and every page
    comes from where it should."""
    store = plan.direction is Direction.STORE
    assert h.run(0, device if store else host, host if store else device).ok
    assert moved(h.fake, expected(plan, device, host)) == 0


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 70), min_size=0, max_size=12),
    piece=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_pieces_cover_exactly_the_copies_bytes_in_order(sizes: list[int], piece: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = len(sizes)
    dsts = rng.integers(0, 1 << 40, n).astype(U64)
    srcs = rng.integers(0, 1 << 40, n).astype(U64)
    size = np.array(sizes, dtype=U64)
    d, s, z = in_pieces(dsts, srcs, size, piece)
    assert d.dtype == s.dtype == z.dtype == U64
    assert d.flags.c_contiguous and s.flags.c_contiguous and z.flags.c_contiguous
    assert _bytes(d, s, z) == _bytes(dsts, srcs, size)
    if piece:
        assert all(0 < x <= piece for x in z.tolist())
        assert len(z) == sum(-(-x // piece) for x in sizes)
    else:
        assert d is dsts and s is srcs and z is size


def test_no_bound_by_default_and_a_bound_set_reaches_the_native_issuer(monkeypatch: pytest.MonkeyPatch) -> None:
    assert COPY_PIECE_BYTES == 0
    config = native.Config()
    native_backend.tune(config)
    assert config.piece_bytes == 0
    monkeypatch.setattr(copier_module, "COPY_PIECE_BYTES", 2 << 20)
    native_backend.tune(config)
    assert config.piece_bytes == 2 << 20


@pytest.mark.parametrize("piece", [0, 1 << 20], ids=["control-no-bound", "bounded"])
def test_the_python_paths_copier_issues_copies_in_pieces(monkeypatch: pytest.MonkeyPatch, piece: int) -> None:
    """Copier.copy (every copy of the Python issuer's paths) hands the driver pieces of at most
    COPY_PIECE_BYTES, covering the same bytes."""
    monkeypatch.setattr(copier_module, "COPY_PIECE_BYTES", piece)
    fake = FakeDriver()
    copier = Copier(CopyMethod.BATCH_CTYPES, 13000, fake.address("memcpy_batch"))
    mib = 1 << 20
    dsts = np.array([1 << 40, 2 << 40], dtype=U64)
    srcs = np.array([3 << 40, 4 << 40], dtype=U64)
    sizes = np.array([5 * mib // 2, mib], dtype=U64)
    copier.copy(dsts, srcs, sizes, SrcAccessOrder.STREAM, 7)
    if piece:
        assert fake.copy_sizes == [mib, mib, mib // 2, mib]
    else:
        assert fake.copy_sizes == [5 * mib // 2, mib]
    assert fake.provenance[(1 << 40) + 2 * mib] == (3 << 40) + 2 * mib


@pytest.mark.parametrize(("count", "calls"), [(64, [64]), (1000, [64, 128, 256, 512, 40])])
def test_the_python_paths_copier_issues_copies_in_growing_calls(count: int, calls: list[int]) -> None:
    """Copier.copy's first driver call takes BATCH_FIRST_COPIES copies and each next one twice as
    many: the copy engine starts on a call's copies only once it returned (docs/design.md §16)."""
    assert copier_module.BATCH_FIRST_COPIES == 64
    fake = FakeDriver()
    copier = Copier(CopyMethod.BATCH_CTYPES, 13000, fake.address("memcpy_batch"))
    offsets = np.arange(count, dtype=U64) * 4096
    copier.copy((1 << 40) + offsets, (2 << 40) + offsets, np.full(count, 4096, dtype=U64),
                SrcAccessOrder.STREAM, 7)
    assert [c[2] for c in fake.of("cuMemcpyBatchAsync")] == calls
    assert fake.copy_sizes == [4096] * count
    assert fake.provenance[(1 << 40) + 4096 * (count - 1)] == (2 << 40) + 4096 * (count - 1)


@pytest.mark.parametrize("piece", [0, 2], ids=["control-no-bound", "bounded"])
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_staged_job_of_consecutive_records_goes_in_pieces(direction: Direction, piece: int) -> None:
    """Consecutive records merge into one copy per chunk (6 records a slot); with a bound of two
    records every copy holds at most two."""
    plan = attrs.evolve(make_plan(direction, [256, 256]), chunk_records=64)  # one pinned area
    record = plan.pages.record_bytes
    h = Harness(direction, "staged", plan, slot_bytes=6 * record,
                tune={**THREAD_ISSUES, "piece_bytes": piece * record})
    try:
        device = np.random.default_rng(5).permutation(40)[:12].tolist()
        host = list(range(20, 32))
        _run_exactly(h, plan, device, host)
        if piece:
            assert max(h.fake.copy_sizes) <= piece * record and len(h.fake.copy_sizes) == 6
        else:
            assert max(h.fake.copy_sizes) == 6 * record
    finally:
        h.close()


@pytest.mark.parametrize("piece", [0, 3], ids=["control-no-bound", "bounded"])
def test_dma_pages_that_continue_each_other_merge_up_to_a_piece(piece: int) -> None:
    """Block-major pages of consecutive blocks continue each other on both sides: one copy for the
    whole job without a bound, at most three blocks' pages per copy with it."""
    plan = attrs.evolve(make_plan(Direction.LOAD, [256, 256], block_major=True), chunk_records=64)
    block = plan.pages.record_bytes
    h = Harness(Direction.LOAD, "dma", plan, tune={**THREAD_ISSUES, "piece_bytes": piece * block})
    try:
        _run_exactly(h, plan, list(range(10, 20)), list(range(30, 40)))
        if piece:
            assert max(h.fake.copy_sizes) <= piece * block and sum(h.fake.copy_sizes) == 10 * block
        else:
            assert h.fake.copy_sizes == [10 * block]
    finally:
        h.close()


@pytest.mark.parametrize(("piece_rows", "heights"), [(0, [10]), (3, []), (5, [5, 5])],
                         ids=["control-no-bound", "below-min-rows", "bounded"])
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_strided_copy_holds_at_most_a_piece_of_rows_and_never_fewer_than_min_rows(
    direction: Direction, piece_rows: int, heights: list[int],
) -> None:
    """Ten consecutive records of a strided plan (records three apart) go as one strided copy of 10
    rows; a piece of 5 rows makes two of 5; a piece of 3 rows, below strided_min_rows (4), sends
    every row as descriptors (no copy over the piece either way)."""
    plan = attrs.evolve(strided_plan(direction, [256, 256]), chunk_records=64)
    pitch = plan.pages.record_bytes
    h = Harness(direction, "staged", plan, slot_bytes=16 * pitch,
                tune={**THREAD_ISSUES, "strided_min_rows": 4, "piece_bytes": piece_rows * pitch})
    try:
        device = np.random.default_rng(7).permutation(40)[:10].tolist()
        host = list(range(10, 20))
        _run_exactly(h, plan, device, host)
        strided = [c[2] for c in h.fake.of("cuMemcpy2DAsync")]
        assert strided == heights
        if piece_rows:
            assert max(h.fake.copy_sizes) <= piece_rows * pitch
    finally:
        h.close()


@pytest.mark.parametrize("path", ["dma", "staged"])
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_page_or_record_longer_than_a_piece_goes_in_pieces(direction: Direction, path: str) -> None:
    """A page (dma) or a record (staged) of 1024 bytes with a piece of 256 goes as four copies of
    256, and a run merged from several continues in pieces cut from its start."""
    plan = attrs.evolve(make_plan(direction, [1024]), chunk_records=64)
    h = Harness(direction, path, plan, slot_bytes=8 * 1024, tune={**THREAD_ISSUES, "piece_bytes": 256})
    try:
        device, host = [3, 9, 4], [10, 11, 20]
        _run_exactly(h, plan, device, host)
        assert h.fake.copy_sizes == [256] * 12
    finally:
        h.close()
