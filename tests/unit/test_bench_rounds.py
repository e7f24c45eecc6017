"""``bench --rounds``: how the transfer bench takes turns between paths and what a row reports (the
transfers themselves need CUDA). One round measures the paths one after the other, each worker shut
down before the next is made; more rounds keep every path's worker open and measure the paths in
turns, round by round, each figure the median of its rounds with its range."""

from __future__ import annotations

import io
import types
from typing import Any

import pytest

from kvoffload.cli import bench

MIB = 1 << 20


class _Run:
    """A scripted :class:`bench.PathRun`: it logs what the bench asks of it."""

    log: list[tuple[str, str]] = []
    fail_round: str | None = None

    def __init__(self, _layout: object, path: str, num: int, span: int, page_bytes: int,
                 _kernel_ctas: int | None) -> None:
        self.path, self.num, self.span, self.page_bytes = path, num, span, page_bytes

    def __enter__(self) -> _Run:
        self.log.append(("open", self.path))
        return self

    def __exit__(self, *_exc: object) -> None:
        self.log.append(("shut", self.path))

    def round(self) -> None:
        self.log.append(("round", self.path))
        if self.path == self.fail_round:
            raise RuntimeError(f"{self.path} failed")

    def row(self, page_bytes: int, _gemm: object) -> bench.BenchRow:
        self.log.append(("row", self.path))
        return bench.BenchRow(page_bytes=page_bytes, path=self.path, taken=self.path, store_gbps=1.0,
                              load_gbps=1.0, both_gbps=1.0, gemm_slowdown=None, gemm_quartiles=None,
                              gemm_store_gbps=None, verified_bytes=0, mismatched_blocks=0)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    log: list[tuple[str, str]] = []
    monkeypatch.setattr(_Run, "log", log)
    monkeypatch.setattr(_Run, "fail_round", None)
    monkeypatch.setattr(bench, "PathRun", _Run)
    monkeypatch.setattr(bench, "_layout", lambda _device, _page, _blocks: None)
    return log


def _measure(rounds: int, totals: dict[str, int] | None = None) -> list[bench.BenchRow]:
    device: Any = None
    return bench.measure_page(device, 4096, totals or {"dma": 64 * MIB, "staged": 64 * MIB}, rounds, None,
                              io.StringIO())


def test_one_round_measures_the_paths_one_after_the_other(runs: list[tuple[str, str]]) -> None:
    rows = _measure(1)
    assert [r.path for r in rows] == ["dma", "staged"]
    assert runs == [("open", "dma"), ("round", "dma"), ("row", "dma"), ("shut", "dma"),
                    ("open", "staged"), ("round", "staged"), ("row", "staged"), ("shut", "staged")]


def test_more_rounds_keep_every_worker_open_and_take_turns(runs: list[tuple[str, str]]) -> None:
    rows = _measure(3)
    assert [r.path for r in rows] == ["dma", "staged"]
    assert runs == [("open", "dma"), ("open", "staged"),
                    *[("round", p) for _ in range(3) for p in ("dma", "staged")],
                    ("row", "dma"), ("row", "staged"), ("shut", "staged"), ("shut", "dma")]


def test_a_failed_round_shuts_every_open_worker_down(runs: list[tuple[str, str]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Run, "fail_round", "staged")
    with pytest.raises(RuntimeError, match="staged failed"):
        _measure(3)
    assert runs[-2:] == [("shut", "staged"), ("shut", "dma")]
    assert ("row", "dma") not in runs


def test_paths_moving_fewer_bytes_share_the_layout_of_the_largest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-page loop moves less under --quick: its blocks lie inside the layout of the others,
    its device blocks ``dev_b`` above every path's ``dev_a``."""
    made: list[int] = []
    monkeypatch.setattr(bench, "_layout", lambda _device, _page, blocks: made.append(blocks))
    seen: list[_Run] = []

    class _Seen(_Run):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            seen.append(self)

    monkeypatch.setattr(_Run, "log", [])
    monkeypatch.setattr(bench, "PathRun", _Seen)
    _measure(2, {"loop": 256 * MIB, "dma": 1024 * MIB})
    assert made == [2 * 512]
    assert [(r.path, r.num, r.span) for r in seen] == [("loop", 128, 512), ("dma", 512, 512)]


def test_ids_of_a_path_run_never_meet() -> None:
    layout: Any = types.SimpleNamespace(block_bytes=2 * MIB)
    run = bench.PathRun(layout, "dma", 128, 512, 4096, None)
    assert sorted(run.dev_a.tolist()) == list(range(128))
    assert sorted(run.dev_b.tolist()) == list(range(512, 640))
    assert sorted(run.host.tolist()) == list(range(256))
    again = bench.PathRun(layout, "staged", 128, 512, 4096, None)
    assert (again.dev_a == run.dev_a).all() and (again.host == run.host).all()  # the page size's ids


def test_a_row_reports_the_median_of_its_rounds_and_their_range() -> None:
    layout: Any = types.SimpleNamespace(block_bytes=2 * MIB)
    run = bench.PathRun(layout, "dma", 500, 500, 4096, None)
    moved = 500 * 2 * MIB / 1e9  # GB a measurement moves
    run.seconds = [(moved / 50, moved / 40, moved / 90), (moved / 54, moved / 44, moved / 70),
                   (moved / 52, moved / 42, moved / 80)]
    run.verified, run.taken = 123, {"dma"}
    run._worker = types.SimpleNamespace()  # type: ignore[assignment]  # noqa: SLF001 (row needs it open)
    row = run.row(4096, None)
    assert (row.store_gbps, row.load_gbps, row.both_gbps) == pytest.approx((52.0, 42.0, 80.0))
    assert row.rounds == 3 and row.verified_bytes == 123 and row.taken == "dma"
    assert row.spread is not None
    assert [value for pair in row.spread for value in pair] == pytest.approx([50.0, 54.0, 40.0, 44.0, 70.0, 90.0])
    assert row.gemm_slowdown is None


class _Worker:
    """A worker the real :class:`bench.PathRun` drives: its jobs logged, its shutdowns counted."""

    def __init__(self, path: str, log: list[tuple[str, str]]) -> None:
        self.path, self.log = path, log

    def __exit__(self, *_exc: object) -> None:
        self.log.append(("shut", self.path))


def test_the_real_path_runs_shut_every_worker_once_when_a_warm_up_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three paths with --rounds: the second path's warm-up fails; the first path's worker and the
    second's are shut down once each, newest first, and the third is never made."""
    log: list[tuple[str, str]] = []
    monkeypatch.setattr(bench, "_layout", lambda _device, _page, _blocks: types.SimpleNamespace(block_bytes=2 * MIB))

    def worker(_layout: object, _records: int, path: str, _ctas: int | None = None) -> _Worker:
        log.append(("made", path))
        return _Worker(path, log)

    def run(w: _Worker, _jobs: object, _first: int, _taken: object = None) -> float:
        if w.path == "staged":
            raise RuntimeError("staged failed its warm-up")
        return 1.0

    monkeypatch.setattr(bench, "_worker", worker)
    monkeypatch.setattr(bench, "_run", run)
    with pytest.raises(RuntimeError, match="warm-up"):
        _measure(3, {"dma": 64 * MIB, "staged": 64 * MIB, "sm": 64 * MIB})
    assert log == [("made", "dma"), ("made", "staged"), ("shut", "staged"), ("shut", "dma")]
