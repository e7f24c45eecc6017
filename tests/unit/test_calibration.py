"""The auto path's calibration on CPU: bucket lookup, persistence across processes, the order
paths are timed in, the cleared destination of each verified job, and the choice in a bulk bucket
on figures alone and both ways (a whole calibration over fake paths on a simulated clock)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import DeviceLayout, calibration
from kvoffload._descriptors import SHORT_RUNS_SHARE, CopyPlan, PageTable, rows_in_short_runs
from kvoffload.calibration import (
    BOTH_WAYS, SM_BUCKETS, SM_MAX_JOB_BYTES, AutoChoice, _check_bulk, _clear, _fastest, _load, _save,
    _scratch_pages, _verified, sm_competes, turns,
)
from kvoffload.errors import TransferError, UnknownJobError
from kvoffload.records import Direction, TransferResult
from kvoffload.cli._caches import build_cache
from tests.unit.test_expedited_loads import _Created


def choice(key: str = "H200|2097152|32768") -> AutoChoice:
    return AutoChoice(
        key=key,
        buckets=(1, 8, 32),
        paths={"store": ("dma", "staged", "staged"), "load": ("dma", "dma", "staged")},
        gbps={"store": {"dma": (5.0, 20.0, 30.0), "staged": (4.0, 30.0, 50.0)},
              "load": {"dma": (6.0, 25.0, 30.0), "staged": (3.0, 20.0, 50.0)}},
    )


def test_a_job_takes_the_bucket_of_the_largest_size_not_above_it() -> None:
    c = choice()
    assert [c.path_for(Direction.STORE, n) for n in (1, 7, 8, 31, 32, 10_000)] == [
        "dma", "dma", "staged", "staged", "staged", "staged"]
    assert [c.path_for(Direction.LOAD, n) for n in (1, 8, 31, 32)] == ["dma", "dma", "dma", "staged"]
    for direction in (Direction.STORE, Direction.LOAD):
        choose = c.chooser(direction)
        assert [choose(n) for n in range(0, 40)] == [c.path_for(direction, n) for n in range(0, 40)]


def test_a_choice_describes_the_path_kept_and_every_figure_alone_per_bucket() -> None:
    c = AutoChoice(key="H100|2097152|32768|sm", buckets=(1, 8),
                   paths={"store": ("sm", "dma"), "load": ("staged", "staged")},
                   gbps={"store": {"sm": (30.5, 0.0), "dma": (9.25, 40.0)},
                         "load": {"sm": (31.0, 0.0), "staged": (28.75, 50.0)}})
    assert c.describe() == (
        "H100|2097152|32768|sm; store 1 block: sm (sm 30.5, dma 9.2); store 8 blocks: dma (sm -, dma 40.0); "
        "load 1 block: staged (sm 31.0, staged 28.8); load 8 blocks: staged (sm -, staged 50.0)")
    short = AutoChoice(key="k", buckets=(1, 8), paths={"store": ("sm", "dma"), "load": ("dma", "dma")},
                       gbps={"store": {"sm": (30.0,)}})  # as a saved file may hold them
    assert short.describe() == ("k; store 1 block: sm (sm 30.0); store 8 blocks: dma (sm -); "
                                "load 1 block: dma (); load 8 blocks: dma ()")


def test_a_saved_choice_is_read_back_for_its_key_only(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "calibration.json")
    _save(path, choice())
    _save(path, choice("other|4096|4096"))
    assert _load(path, choice().key, PATHS) == choice()
    assert _load(path, "unknown|1|1", PATHS) is None
    assert set(json.loads(pathlib.Path(path).read_text())["choices"]) == {choice().key, "other|4096|4096"}


def test_the_both_ways_figures_are_saved_and_a_file_of_the_version_before_is_measured_again(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "calibration.json"
    c = choice()
    with_both = AutoChoice(key=c.key, buckets=c.buckets, paths=c.paths,
                           gbps={**c.gbps,
                                 BOTH_WAYS: {"dma": (0.0, 40.0, 60.0), "staged": (0.0, 45.0, 90.0)}})
    _save(str(path), with_both)
    assert _load(str(path), c.key, PATHS) == with_both
    data = json.loads(path.read_text())
    for version in (2, 3):  # chosen on figures alone; timed with the copy kernel's larger units
        data["version"] = version
        path.write_text(json.dumps(data))
        assert _load(str(path), c.key, PATHS) is None


#: The candidates of the choices above.
PATHS = ("dma", "staged")


@pytest.mark.parametrize("text", [
    "[]", "3", "null", '"x"', json.dumps({"version": calibration._FILE_VERSION, "choices": []}), "[" * 100_000 + "]" * 100_000,
], ids=["list", "number", "null", "string", "choices-list", "deep"])
def test_a_file_of_another_shape_is_measured_again(tmp_path: pathlib.Path, text: str) -> None:
    """(AttributeError and RecursionError escaped the worker's creation.)"""
    path = tmp_path / "calibration.json"
    path.write_text(text)
    assert _load(str(path), choice().key, PATHS) is None
    _save(str(path), choice())
    assert _load(str(path), choice().key, PATHS) == choice()


@pytest.mark.parametrize("damage", [
    lambda e: e["paths"].pop("load"), lambda e: e["paths"].update(store=["dma", "bogus", "staged"]),
    lambda e: e["paths"].update(store="dma"), lambda e: e["paths"].update(load=["dma", "dma"]),
    lambda e: e["paths"].update(store=["sm", "dma", "dma"]), lambda e: e.update(buckets=[8, 1, 32]),
    lambda e: e.update(paths=None), lambda e: e.update(buckets=[]),
], ids=["no-load", "unknown-path", "a-string", "fewer-paths", "not-a-candidate", "unsorted", "null", "none"])
def test_an_entry_this_worker_cannot_use_is_measured_again(tmp_path: pathlib.Path, damage: Any) -> None:
    """(It was taken, and the path chooser then failed a job with KeyError or IndexError.)"""
    path = tmp_path / "calibration.json"
    _save(str(path), choice())
    data = json.loads(path.read_text())
    damage(data["choices"][choice().key])
    path.write_text(json.dumps(data))
    assert _load(str(path), choice().key, PATHS) is None


def test_a_file_that_cannot_be_written_is_logged_and_the_choice_still_used(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """(IsADirectoryError, FileNotFoundError or PermissionError failed the worker's creation after
    measuring, and a temporary file was left behind.)"""
    for path in (tmp_path, tmp_path / "missing" / "calibration.json"):
        _save(str(path), choice())
    assert "could not be saved" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == []


def test_writers_in_threads_never_leave_a_torn_file(tmp_path: pathlib.Path) -> None:
    """(They shared one temporary name per process: a torn file was renamed into place.)"""
    path = str(tmp_path / "calibration.json")
    def writer(k: int) -> None:
        for i in range(20):
            _save(path, choice(f"k{k}|{i}"))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(json.loads(pathlib.Path(path).read_text())["choices"], dict)
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]


def test_a_damaged_or_foreign_file_is_ignored(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    assert _load(str(path), choice().key, PATHS) is None
    path.write_text(json.dumps({"version": 99, "choices": {}}))
    assert _load(str(path), choice().key, PATHS) is None
    _save(str(path), choice())  # a damaged file is replaced, not fatal
    assert _load(str(path), choice().key, PATHS) == choice()


def test_sm_competes_only_in_the_smallest_bucket() -> None:
    measured: dict[str, tuple[float, ...]] = {
        "dma": (5.0, 20.0, 30.0), "staged": (4.0, 30.0, 50.0), "sm": (9.0, 90.0, 90.0)}
    assert SM_BUCKETS == 1
    assert [_fastest(measured, i) for i in range(3)] == ["sm", "staged", "staged"]
    slow_sm: dict[str, tuple[float, ...]] = {"dma": (5.0, 1.0, 1.0), "sm": (4.0, 0.0, 0.0)}
    assert _fastest(slow_sm, 0) == "dma"
    no_bulk: dict[str, tuple[float, ...]] = {"dma": (0.0, 0.0, 0.0), "sm": (4.0, 0.0, 0.0)}
    assert _fastest(no_bulk, 1) == "dma"


def test_sm_competes_only_for_a_small_job_whatever_its_block_count() -> None:
    """One block of 64 pages of 32 KiB (2 MiB) is a latency job; one block of 16 pages of 2 MiB (32
    MiB) is a bulk job, where sm would hold SMs for the whole copy."""
    assert SM_MAX_JOB_BYTES == 8 << 20
    assert sm_competes(0, 2 << 20) and sm_competes(0, SM_MAX_JOB_BYTES)
    assert not sm_competes(0, SM_MAX_JOB_BYTES + 1) and not sm_competes(0, 32 << 20)
    assert not sm_competes(1, 1 << 20)  # beyond the first bucket, whatever the bytes


def test_a_bucket_where_sm_was_not_timed_takes_the_fastest_bulk_path() -> None:
    """A 32 MiB 1-block bucket (2 MiB pages) as calibrated on the H200, sm not timed there (0.0)."""
    measured: dict[str, tuple[float, ...]] = {"dma": (38.3, 50.5), "staged": (39.5, 49.7), "sm": (0.0, 0.0)}
    assert [_fastest(measured, i) for i in range(2)] == ["staged", "dma"]


def test_every_repeat_times_each_path_once_starting_one_later() -> None:
    order = turns(["dma", "staged", "sm"], 4)
    rounds = [order[i : i + 3] for i in range(0, len(order), 3)]
    assert all(sorted(r) == ["dma", "sm", "staged"] for r in rounds)
    assert [r[0] for r in rounds] == ["dma", "staged", "sm", "dma"]
    assert turns(["dma"], 2) == ["dma", "dma"]
    assert turns([], 3) == []


def _copy_pages(plan: CopyPlan, scratch: torch.Tensor, records: torch.Tensor, src: np.ndarray,
                dst: np.ndarray) -> None:
    """What a correct path does, on CPU tensors."""
    pages, base = plan.pages, scratch.data_ptr()
    store = plan.direction is Direction.STORE
    for s, d in zip(src.tolist(), dst.tolist()):
        dev, host = (s, d) if store else (d, s)
        for p in range(pages.num_pages):
            at = int(pages.dev_base[p]) - base + dev * int(pages.dev_stride[p])
            n, off = int(pages.nbytes[p]), int(pages.host_offset[p])
            if store:
                records[host, off : off + n] = scratch[at : at + n]
            else:
                scratch[at : at + n] = records[host, off : off + n]


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_path_that_copies_nothing_fails_its_check_once_the_destination_is_cleared(
    direction: Direction,
) -> None:
    """Paths take turns on one destination: without the clear, a path that skips its copies would
    pass on the bytes the path before it wrote."""
    tensors, block_dim = build_cache("per-layer", num_blocks=4, layers=3, kv_heads=2, head_dim=32,
                                     block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    pages = DeviceLayout.from_tensors(tensors, block_dim=block_dim).page_table
    blocks = 6
    scratch, table = _scratch_pages(torch.device("cpu"), pages, 2 * blocks)
    records = torch.randint(0, 256, (2 * blocks, pages.record_bytes), dtype=torch.uint8)
    plan = CopyPlan(table, records.data_ptr(), 2 * blocks, direction)
    ids = np.arange(3, dtype=np.int64)
    src, dst = (ids, ids + blocks) if direction is Direction.STORE else (ids + blocks, ids)

    def verified() -> bool:
        return _verified(plan, scratch, records, src, dst, blocks)

    _copy_pages(plan, scratch, records, src, dst)  # the path timed before
    assert verified()
    assert verified()  # a path that copied nothing: the earlier bytes still match (the hazard)
    _clear(plan, scratch, records, dst)
    assert not verified()  # cleared: the same no-op is caught
    _copy_pages(plan, scratch, records, src, dst)
    assert verified()  # a path that copies passes


def test_a_calibration_without_a_correct_bulk_path_is_refused() -> None:
    """auto never takes a path that failed its own check: with only sm left (or nothing), the
    worker cannot be built on auto, and the error says which direction and what passed."""
    _check_bulk({"dma": (1.0, 2.0, 3.0)}, "H200|x", Direction.STORE)
    _check_bulk({"staged": (1.0, 2.0, 3.0), "sm": (9.0, 0.0, 0.0)}, "H200|x", Direction.LOAD)
    with pytest.raises(TransferError, match=r"no bulk path .* store bytes .* passed: sm\)"):
        _check_bulk({"sm": (9.0, 0.0, 0.0)}, "H200|x", Direction.STORE)
    with pytest.raises(TransferError, match=r"load bytes correctly \(paths that passed: none\)"):
        _check_bulk({}, "H200|x", Direction.LOAD)


def test_a_bulk_bucket_keeps_the_path_whose_worse_ratio_alone_or_both_ways_is_highest() -> None:
    """At 2 MiB pages on some H200 hosts: dma a few percent ahead alone, well behind both ways."""
    alone: dict[str, tuple[float, ...]] = {"dma": (9.0, 50.0, 52.0), "staged": (8.0, 49.0, 50.0)}
    both: dict[str, tuple[float, ...]] = {"dma": (0.0, 100.0, 81.0), "staged": (0.0, 99.0, 93.0)}
    assert [_fastest(alone, i) for i in range(3)] == ["dma", "dma", "dma"]  # alone only (the control)
    # bucket 0 was not timed both ways (a latency bucket); in bucket 1 dma is ahead both ways too
    assert [_fastest(alone, i, both) for i in range(3)] == ["dma", "dma", "staged"]
    # a path not timed both ways in a bulk bucket (it passed alone one way only) is not kept there
    assert _fastest(alone, 2, {"staged": (0.0, 0.0, 93.0)}) == "staged"
    assert _fastest({"dma": (0.0,), "staged": (0.0,)}, 0, {"dma": (1.0,)}) == "dma"  # nothing moved


class _Link:
    """A simulated clock and link: a job's time is its bytes times its path's seconds per byte,
    alone or, where a job of the other direction is in flight at once, shared."""

    def __init__(self, alone: dict[str, float], shared: dict[str, float],
                 layered: dict[str, float] | None = None) -> None:
        self.now = 0.0
        self.alone, self.shared = alone, shared
        #: a layered load's seconds per byte (from records apart), per path; alone's where not given
        self.layered = layered or {}
        #: (handler, job) -> (its start, whether it shared the link, its ids)
        self.flight: dict[tuple[int, int], tuple[float, bool, np.ndarray, np.ndarray]] = {}
        self.pairs_timed: list[str] = []
        #: (path, host ids, layer tables) of every layered load submitted
        self.layered_jobs: list[tuple[str, np.ndarray, tuple[PageTable, ...]]] = []
        #: (path, direction, source ids, destination ids) of every whole job submitted
        self.whole_jobs: list[tuple[str, Direction, np.ndarray, np.ndarray]] = []


class _FakePath:
    """A path handler on the simulated link: a job's pages are copied when it is waited for,
    except with ``fault`` in a job that shared the link with the other direction: ``"wrong"``
    copies nothing, ``"fails"`` reports the job failed."""

    def __init__(self, link: _Link, path: str, plan: CopyPlan, scratch: torch.Tensor,
                 records: torch.Tensor, fault: str | None) -> None:
        self.link, self.path, self.plan = link, path, plan
        self.scratch, self.records, self.fault = scratch, records, fault
        self._layered: set[int] = set()

    def submit(self, job_id: int, src_blocks: np.ndarray, dst_blocks: np.ndarray) -> None:
        others = [key for key in self.link.flight if key[0] != id(self)]
        for key in others:
            start, _, src, dst = self.link.flight[key]
            self.link.flight[key] = (start, True, src, dst)
        if others:
            self.link.pairs_timed.append(self.path)
        self.link.whole_jobs.append((self.path, self.plan.direction, np.array(src_blocks), np.array(dst_blocks)))
        self.link.flight[(id(self), job_id)] = (self.link.now, bool(others), src_blocks, dst_blocks)

    def submit_by_layer(self, job_id: int, src: np.ndarray, dst: np.ndarray,
                        tables: tuple[PageTable, ...]) -> object:
        self.link.layered_jobs.append((self.path, src.copy(), tables))
        self.link.flight[(id(self), job_id)] = (self.link.now, False, src, dst)
        self._layered.add(job_id)
        return None

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[TransferResult]:
        results = []
        for job in job_ids:
            start, shared, src, dst = self.link.flight.pop((id(self), job))
            nbytes = int(src.shape[0]) * self.plan.pages.block_bytes
            cost = (self.link.shared if shared else self.link.alone)[self.path]
            if job in self._layered:
                self._layered.discard(job)
                cost = self.link.layered.get(self.path, cost)
                if self.fault == "layered-wrong":
                    results.append(TransferResult(job, self.plan.direction, True, nbytes, 0.0, self.path, None))
                    self.link.now = max(self.link.now, start + cost * nbytes)
                    continue
            self.link.now = max(self.link.now, start + cost * nbytes)
            fault = self.fault if shared else None
            if fault != "wrong" and fault != "fails":
                _copy_pages(self.plan, self.scratch, self.records, src, dst)
            error = TransferError("fake failure") if fault == "fails" else None
            results.append(TransferResult(job, self.plan.direction, error is None, nbytes, 0.0, self.path,
                                          error))
        return results


def _calibrate_fakes(
    monkeypatch: pytest.MonkeyPatch, link: _Link, faults: dict[tuple[str, Direction], str] | None = None,
    candidates: tuple[str, ...] = ("dma", "staged"), layered: bool = False,
) -> AutoChoice:
    """A whole calibration of ``candidates`` over :class:`_FakePath` on the CPU, on the link's
    clock (scratch tensors on the CPU device, shaped by a per-layer cache of 64 KiB blocks, two
    layers of 32 KiB: narrow); ``faults[(path, direction)]``: that handler's fault both ways
    (``"layered-wrong"``: its layered loads copy nothing); ``layered``: the layout's layers are
    given (a layered load is timed where sm is a candidate)."""
    tensors, block_dim = build_cache("per-layer", num_blocks=4, layers=2, kv_heads=2, head_dim=64,
                                     block_size=64, dtype=torch.bfloat16, device=torch.device("cpu"))
    layout = DeviceLayout.from_tensors(tensors, block_dim=block_dim)
    pages = layout.page_table
    made: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def pool(num_records: int, record_bytes: int) -> Iterator[types.SimpleNamespace]:
        records = torch.zeros((num_records, record_bytes), dtype=torch.uint8)
        made["records"] = records
        yield types.SimpleNamespace(base_ptr=records.data_ptr(), chunk_records=num_records,
                                    records=lambda: records)

    real_scratch = calibration._scratch_pages

    def scratch_pages(device: torch.device, table: PageTable, blocks: int) -> tuple[torch.Tensor, PageTable]:
        scratch, made_table = real_scratch(device, table, blocks)
        made["scratch"] = scratch
        return scratch, made_table

    @contextlib.contextmanager
    def handler_for(path: str, plan: CopyPlan, blocks: int) -> Iterator[_FakePath]:
        fault = (faults or {}).get((path, plan.direction))
        yield _FakePath(link, path, plan, made["scratch"], made["records"], fault)

    monkeypatch.setattr(calibration, "_scratch_pages", scratch_pages)
    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=lambda: link.now))
    monkeypatch.setattr(calibration, "LARGE_JOB_BYTES", 24 * pages.block_bytes)  # 24 blocks
    return calibration._measure(torch.device("cpu"), pages, "cpu|fake", candidates, pool, handler_for,
                                layout.layer_tables if layered else ())


def test_a_calibration_keeps_off_a_path_that_is_slow_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """dma 5% faster alone, half the rate both ways (its two directions never overlap): the bulk
    buckets take staged, the latency bucket (1 block, where sm would compete) stays on dma. The
    control: the same figures alone choose dma everywhere."""
    link = _Link(alone={"dma": 1.0, "staged": 1.05}, shared={"dma": 2.0, "staged": 1.1})
    choice = _calibrate_fakes(monkeypatch, link)
    assert choice.buckets == (1, 8, 24)
    for direction in ("store", "load"):
        assert choice.paths[direction] == ("dma", "staged", "staged")
        assert tuple(_fastest(choice.gbps[direction], i) for i in range(3)) == ("dma", "dma", "dma")
    both = choice.gbps[BOTH_WAYS]
    assert both["dma"][0] == both["staged"][0] == 0.0  # 1 block of 64 KiB: a latency bucket
    assert both["staged"][2] > 1.8 * both["dma"][2] > 0.0
    assert set(link.pairs_timed) == {"dma", "staged"}


def test_a_calibrations_jobs_take_records_in_order_into_blocks_out_of_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every timed job of more than one block, alone and both ways: the host records follow each
    other, the device blocks never do (dma moves pairs that follow on both sides as direct strided
    copies, which an engine's jobs seldom get: docs/design.md §16), and each is the whole set of
    its range, so the clear before the check covers it. The control: with ``scattered`` giving
    blocks in order, the same check finds blocks that follow each other."""
    def device_runs(link: _Link) -> int:
        runs = 0
        for path, direction, src, dst in link.whole_jobs:
            device, host = (src, dst) if direction is Direction.STORE else (dst, src)
            assert np.array_equal(np.diff(host), np.ones(host.shape[0] - 1)), (path, direction, host)
            assert np.array_equal(np.sort(device), np.arange(device.shape[0]) + int(device.min()))
            runs += int(np.count_nonzero(np.diff(device) == 1))
        return runs

    link = _Link(alone={"dma": 1.0, "staged": 1.05}, shared={"dma": 1.1, "staged": 1.1})
    _calibrate_fakes(monkeypatch, link)
    assert {int(src.shape[0]) for _, _, src, _ in link.whole_jobs} == {1, 8, 24}
    assert {(path, direction) for path, direction, _, _ in link.whole_jobs} == {
        (p, d) for p in ("dma", "staged") for d in (Direction.STORE, Direction.LOAD)}
    assert device_runs(link) == 0
    monkeypatch.setattr(calibration, "scattered", lambda n: np.arange(n, dtype=np.int64))
    control = _Link(alone=link.alone, shared=link.shared)
    _calibrate_fakes(monkeypatch, control)
    assert device_runs(control) > 0


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 8, 9, 24, 256, 2048, 4097])
def test_scattered_orders_every_id_once_with_none_followed_by_the_next(n: int) -> None:
    order = calibration.scattered(n)
    assert np.array_equal(np.sort(order), np.arange(n))
    assert not np.any(np.diff(order) == 1)


def test_a_bulk_first_bucket_is_timed_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2 MiB pages one block is a bulk job (sm does not compete): the 1-block bucket is timed
    both ways and chosen on both figures, as the larger ones."""
    monkeypatch.setattr(calibration, "SM_MAX_JOB_BYTES", 1)
    link = _Link(alone={"dma": 1.0, "staged": 1.05}, shared={"dma": 2.0, "staged": 1.1})
    choice = _calibrate_fakes(monkeypatch, link)
    assert choice.paths == {"store": ("staged",) * 3, "load": ("staged",) * 3}
    assert min(choice.gbps[BOTH_WAYS]["dma"]) > 0.0


def test_a_calibration_with_both_directions_at_full_rate_keeps_the_fastest_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    link = _Link(alone={"dma": 1.0, "staged": 1.05}, shared={"dma": 1.0, "staged": 1.05})
    choice = _calibrate_fakes(monkeypatch, link)
    assert choice.paths == {"store": ("dma", "dma", "dma"), "load": ("dma", "dma", "dma")}


@pytest.mark.parametrize("fault", ["wrong", "fails"])
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_path_that_fails_both_ways_is_never_chosen(
    monkeypatch: pytest.MonkeyPatch, direction: Direction, fault: str,
) -> None:
    """dma is correct alone and faster everywhere, but one of its directions copies nothing (or
    fails) while the other runs at once: the checked pair catches it and neither direction takes
    dma. The control: without the fault dma is kept everywhere."""
    link = _Link(alone={"dma": 1.0, "staged": 1.5}, shared={"dma": 1.0, "staged": 1.5})
    choice = _calibrate_fakes(monkeypatch, link, {("dma", direction): fault})
    assert choice.paths == {"store": ("staged",) * 3, "load": ("staged",) * 3}
    assert "dma" not in choice.gbps["store"] and "dma" not in choice.gbps["load"]
    assert "dma" not in choice.gbps[BOTH_WAYS]
    control = _calibrate_fakes(monkeypatch, _Link(alone=link.alone, shared=link.shared))
    assert control.paths == {"store": ("dma",) * 3, "load": ("dma",) * 3}


def test_a_calibration_whose_bulk_paths_all_fail_both_ways_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    link = _Link(alone={"dma": 1.0, "staged": 1.5}, shared={"dma": 1.0, "staged": 1.5})
    faults = {("dma", Direction.LOAD): "wrong", ("staged", Direction.STORE): "fails"}
    with pytest.raises(TransferError, match=r"no bulk path .* store bytes with both directions at once "
                                            r"\(dma, staged failed there\) \(paths that passed: none\)"):
        _calibrate_fakes(monkeypatch, link, faults)


def test_a_key_names_the_native_issuer_and_a_python_timed_key_stays_as_it_was() -> None:
    """Figures timed through the native issuer are kept under a key of their own, so a file saved by
    a Python-issued calibration is never read back for a native worker, and stays valid for a
    Python one."""
    pages = DeviceLayout.from_tensors([torch.zeros(2, 4096, dtype=torch.uint8)], block_dim=0).page_table
    before = "H200|4096|4096|sm"  # as saved before the issuer was named
    assert calibration.geometry_key("H200", pages, ("dma", "sm")) == before
    assert calibration.geometry_key("H200", pages, ("dma", "sm"), issuer="python") == before
    assert calibration.geometry_key("H200", pages, ("dma", "sm"), issuer="native") == before + "|native"


def _fake_cuda(method: Any) -> Any:
    copier = types.SimpleNamespace(path="dma", method=method)
    return types.SimpleNamespace(index=0, copier=copier,
                                 capabilities=types.SimpleNamespace(device_name="fake"))


@pytest.mark.parametrize(("issuer", "builds", "method", "timed_by"), [
    ("python", True, "batch-ctypes", "python"),
    ("auto", True, "batch-ctypes", "native"),
    ("auto", False, "batch-ctypes", "python"),  # the library does not build: Python issues
    ("auto", True, "batch-bindings", "python"),  # the cross-check is issued from Python
    ("native", True, "batch-ctypes", "native"),
])
@pytest.mark.parametrize("starts", [True, False])
def test_auto_times_its_paths_through_the_issuer_the_workers_jobs_take(
    monkeypatch: pytest.MonkeyPatch, issuer: str, builds: bool, method: str, timed_by: str, starts: bool,
) -> None:
    """``_cuda_backend`` (CUDA's calls replaced) calibrates with handlers issued as the worker's jobs
    will be, under a key that says so. Under "auto", a native issuer that does not start in a
    calibration handler has the calibration made again from Python, under the Python key (the
    worker then issues from Python); under "native" its error is ``Worker.create``'s."""
    from kvoffload import native
    from kvoffload.backends.cuda import CudaBackend
    from kvoffload.bindings import driver
    from kvoffload.bindings.types import CopyMethod
    from kvoffload.errors import NativeBuildError
    from kvoffload.worker import assembly
    from kvoffload.worker.assembly import WorkerOptions

    def library() -> object:
        if not builds:
            raise NativeBuildError("no compiler")
        return object()

    calls: list[tuple[str, str, bool]] = []

    def calibrate(device: object, pages: object, **kwargs: Any) -> Any:
        how, strict = kwargs["handler_for"].args[3], kwargs["handler_for"].keywords["strict"]
        calls.append((kwargs["key"], how, strict))
        if how == "native" and not starts:  # as the first handler finds it
            failure = TransferError("the thread did not start")
            if strict:
                raise failure
            raise assembly._NativeDidNotStart(str(failure)) from failure
        return types.SimpleNamespace(chooser=lambda direction: lambda blocks: "dma", layered=lambda: None)

    monkeypatch.setattr(CudaBackend, "create", _Created)
    monkeypatch.setattr(driver, "host_pointer_is_device_pointer", lambda index, ptr: False)
    monkeypatch.setattr(native, "library", library)
    monkeypatch.setattr(calibration, "calibrate", calibrate)
    layout = DeviceLayout.from_tensors([torch.zeros(2, 4096, dtype=torch.uint8)], block_dim=0)
    region: Any = types.SimpleNamespace(base_ptr=1 << 20)

    def build() -> Any:
        return assembly._cuda_backend(Direction.STORE, layout, region, _fake_cuda(CopyMethod(method)),
                                      WorkerOptions(path="auto"), issuer)

    if timed_by == "native" and not starts and issuer == "native":
        with pytest.raises(TransferError, match="did not start"):
            build()
        assert [(key.endswith("|native"), how, strict) for key, how, strict in calls] == [(True, "native", True)]
        return
    assert build().path_name == "auto"
    expected = [(timed_by == "native", timed_by, issuer == "native")]
    if timed_by == "native" and not starts:
        expected.append((False, "python", False))  # measured again, as the worker's jobs will run
    assert [(key.endswith("|native"), how, strict) for key, how, strict in calls] == expected


def _host_issuing(issued: list[tuple[Any, Any, str]], released: list[bool]) -> Callable[..., Any]:
    """An ``_issuing`` that records its arguments and gives a host backend whose release is
    counted."""
    from kvoffload.backends.host import HostBackend

    class Released(HostBackend):
        def release(self) -> None:
            released.append(True)
            super().release()

    def issuing(inner: Any, cuda: Any, how: str) -> Released:
        issued.append((inner, cuda, how))
        return Released(inner.direction)

    return issuing


@pytest.mark.parametrize("issuer", ["python", "native"])
def test_a_calibration_handler_issues_its_jobs_as_the_worker_does_and_releases_its_backend(
    monkeypatch: pytest.MonkeyPatch, issuer: Literal["native", "python"],
) -> None:
    """``_path_handler`` hands its path's backend to ``_issuing`` with the issuer it was given and
    runs a handler over what comes back (a host backend here), released when the block exits."""
    from kvoffload.backends.cuda import CudaBackend
    from kvoffload.bindings.types import CopyMethod
    from kvoffload.worker import assembly
    from kvoffload.worker.assembly import WorkerOptions

    issued: list[tuple[Any, Any, str]] = []
    released: list[bool] = []
    monkeypatch.setattr(CudaBackend, "create", _Created)
    monkeypatch.setattr(assembly, "_issuing", _host_issuing(issued, released))
    cache = torch.zeros(2, 4096, dtype=torch.uint8)
    layout = DeviceLayout.from_tensors([cache], block_dim=0)
    records = torch.zeros(2, 4096, dtype=torch.uint8)
    plan = CopyPlan(layout.page_table, records.data_ptr(), 2, Direction.STORE)
    cuda = _fake_cuda(CopyMethod.BATCH_CTYPES)
    with assembly._path_handler(cuda, WorkerOptions(), torch.device("cpu"), issuer, "dma", plan, 2) as handler:
        ((inner, given_cuda, how),) = issued
        assert isinstance(inner, _Created) and given_cuda is cuda and how == issuer
        cache[1].fill_(7)
        handler.submit(0, [1], [0])
        (result,) = handler.wait([0], 10.0)
        assert result.ok and bool((records[0] == 7).all())
        assert not released
    assert handler.closed and released == [True]


def test_a_calibration_handler_that_cannot_be_made_releases_its_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend ``_issuing`` gave (a native one holds a thread) is released once when the
    handler over it cannot be made, and the handler's error propagates."""
    from kvoffload.backends.cuda import CudaBackend
    from kvoffload.bindings.types import CopyMethod
    from kvoffload.handler import DirectionHandler
    from kvoffload.worker import assembly
    from kvoffload.worker.assembly import WorkerOptions

    issued: list[tuple[Any, Any, str]] = []
    released: list[bool] = []

    def failing(**kwargs: Any) -> DirectionHandler:
        raise MemoryError("no handler")

    monkeypatch.setattr(CudaBackend, "create", _Created)
    monkeypatch.setattr(assembly, "_issuing", _host_issuing(issued, released))
    monkeypatch.setattr(DirectionHandler, "create", failing)
    layout = DeviceLayout.from_tensors([torch.zeros(2, 4096, dtype=torch.uint8)], block_dim=0)
    plan = CopyPlan(layout.page_table, 1 << 20, 2, Direction.STORE)
    with pytest.raises(MemoryError, match="no handler"):
        with assembly._path_handler(_fake_cuda(CopyMethod.BATCH_CTYPES), WorkerOptions(), torch.device("cpu"),
                                    "native", "dma", plan, 2):
            pass
    assert len(issued) == 1 and released == [True]


@pytest.mark.parametrize("strict", [True, False])
def test_a_native_issuer_that_does_not_start_in_calibration_is_said_so_or_raised(
    monkeypatch: pytest.MonkeyPatch, strict: bool,
) -> None:
    """A calibration handler's native issuer that fails to start: the worker's error under
    "native" (``strict``), else ``_NativeDidNotStart`` with it as the cause, so that the caller
    times the paths from Python; nothing is left to release (``_issuing`` released the path's
    backend)."""
    from kvoffload.backends.cuda import CudaBackend
    from kvoffload.bindings.types import CopyMethod
    from kvoffload.worker import assembly
    from kvoffload.worker.assembly import WorkerOptions

    failure = TransferError("the thread did not start")

    def issuing(inner: Any, cuda: Any, how: str) -> Any:
        assert how == "native"
        raise failure

    monkeypatch.setattr(CudaBackend, "create", _Created)
    monkeypatch.setattr(assembly, "_issuing", issuing)
    layout = DeviceLayout.from_tensors([torch.zeros(2, 4096, dtype=torch.uint8)], block_dim=0)
    plan = CopyPlan(layout.page_table, 1 << 20, 2, Direction.STORE)
    expected = TransferError if strict else assembly._NativeDidNotStart
    with pytest.raises(expected) as caught:
        with assembly._path_handler(_fake_cuda(CopyMethod.BATCH_CTYPES), WorkerOptions(), torch.device("cpu"),
                                    "native", "dma", plan, 2, strict=strict):
            pass
    assert (caught.value is failure) if strict else (caught.value.__cause__ is failure)


# ------------------------------------------------------------------ auto's path of a layered load


def _layer_plan(span: int, runs: int = 1) -> CopyPlan:
    """A layer's plan whose pages fill ``runs`` byte ranges of ``span`` bytes of a record (runs
    apart from each other: each is a descriptor of its own)."""
    n = runs
    pages = PageTable(
        dev_base=np.array([(1 << 40) + i * (1 << 32) for i in range(n)], dtype=np.int64),
        dev_stride=np.full(n, span, dtype=np.int64), nbytes=np.full(n, span, dtype=np.int64),
        host_offset=np.arange(n, dtype=np.int64) * 2 * span, segment=np.arange(n, dtype=np.int64),
        record_bytes=2 * span * n,
    )
    return CopyPlan(pages, host_base=1 << 36, chunk_records=1 << 20, direction=Direction.LOAD)


def _ids(values: Iterable[int]) -> np.ndarray:
    return np.array(list(values), dtype=np.int64)


GAPPED = _ids(range(0, 512, 2))  # 256 records, none next to another
IN_ORDER = _ids(range(256))


def _choice(size_path: str, *plans: CopyPlan) -> calibration.LayeredChoice:
    """``auto``'s layered choice over a layout whose layers are ``plans``' pages."""
    return calibration.LayeredChoice(lambda _n: size_path, [plan.pages for plan in plans])


@pytest.mark.parametrize("size_path", ["staged", "dma"])
def test_a_layered_load_of_narrow_spans_from_records_apart_goes_through_sm(size_path: str) -> None:
    plan = _layer_plan(8 << 10)
    choice = _choice(size_path, plan)
    assert choice.path(GAPPED, 4) == "sm"
    assert choice.path(GAPPED, 0) == "sm"


def test_a_layered_staged_load_of_records_in_runs_the_issuer_moves_as_strided_copies_stays_staged() -> None:
    plan = _layer_plan(8 << 10)
    choice = _choice("staged", plan)
    assert choice.path(IN_ORDER, 4) == "staged"
    assert choice.path(IN_ORDER[::-1].copy(), 4) == "staged"  # the issuer sorts them
    # without strided copies (the Python issuer) every span is a descriptor: sm
    assert choice.path(IN_ORDER, 0) == "sm"
    # dma moves every span as a descriptor whatever the runs
    assert _choice("dma", plan).path(IN_ORDER, 4) == "sm"


def test_wide_spans_and_size_paths_of_sm_keep_the_size_bucket_path() -> None:
    wide = _layer_plan(calibration.NARROW_LAYER_BYTES)
    two_narrow_runs = _layer_plan(calibration.NARROW_LAYER_BYTES // 2, runs=2)  # 64 KiB a layer, 2 descriptors
    for size_path in ("staged", "dma"):
        assert _choice(size_path, wide).path(GAPPED, 4) == size_path
        assert _choice(size_path, two_narrow_runs).path(GAPPED, 4) == "sm"  # the descriptors are what is narrow
    narrow = _layer_plan(4096)
    assert _choice("sm", narrow).path(IN_ORDER, 4) == "sm"
    assert calibration.LayeredChoice(lambda _n: "staged", []).path(GAPPED, 4) == "staged"  # no layers


def test_the_layout_not_the_part_says_whether_layers_are_narrow() -> None:
    """The Python issuer issues a layered load's layer 0 apart from its other layers: both parts
    take one path, judged on every layer's copies (here a narrow layer 0 and two wide layers:
    (8 + 2 x 128) / 3 = 88 KiB on average, not narrow). The control, a layout of layer 0 alone,
    is narrow."""
    layer0, wide = _layer_plan(8 << 10), _layer_plan(128 << 10)
    choice = _choice("staged", layer0, wide, wide)
    assert not choice.narrow
    assert choice.path(GAPPED, 4) == "staged"  # whichever part of a job asks
    assert _choice("staged", layer0).narrow


def test_the_size_bucket_is_the_jobs_block_count() -> None:
    seen: list[int] = []
    plan = _layer_plan(8 << 10)
    choice = calibration.LayeredChoice(lambda n: seen.append(n) or "staged", [plan.pages])  # type: ignore[func-returns-value]
    choice.path(GAPPED[:7].copy(), 4)
    assert seen == [7]


@pytest.mark.parametrize("short", [127, 128, 129])
def test_a_staged_layered_load_goes_through_sm_once_over_half_its_rows_lie_in_short_runs(short: int) -> None:
    # `short` rows apart from each other (runs of 1), the other 256 - short in one run
    apart = _ids(range(10_000, 10_000 + 2 * short, 2))
    run = _ids(range(256 - short))
    host = np.concatenate((apart, run))
    plan = _layer_plan(8 << 10)
    expected = "sm" if short > SHORT_RUNS_SHARE * 256 else "staged"
    assert _choice("staged", plan).path(host, 4) == expected


@given(st.lists(st.integers(0, 60), max_size=40), st.integers(1, 6))  # a load may read a record twice
def test_rows_in_short_runs_counts_rows_of_runs_shorter_than_the_minimum(ids: list[int], min_rows: int) -> None:
    ordered = sorted(ids)
    runs: list[list[int]] = []
    for value in ordered:  # brute force: runs of ids that follow each other
        if runs and runs[-1][-1] + 1 == value:
            runs[-1].append(value)
        else:
            runs.append([value])
    want = sum(len(r) for r in runs if len(r) < min_rows)
    shuffled = list(reversed(ids))
    assert rows_in_short_runs(_ids(shuffled), min_rows) == want


# ------------------------------------------------------- the layered load the calibration times


def _fake_layers() -> tuple[PageTable, ...]:
    """The layer tables of :func:`_calibrate_fakes`' layout (two layers of 32 KiB a record)."""
    tensors, block_dim = build_cache("per-layer", num_blocks=4, layers=2, kv_heads=2, head_dim=64,
                                     block_size=64, dtype=torch.bfloat16, device=torch.device("cpu"))
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim).layer_tables


ALL_PATHS = ("dma", "staged", "sm")


@pytest.mark.parametrize(("staged_cost", "sm_cost", "expected"), [(3.0, 1.2, "sm"), (1.1, 1.6, "staged")])
def test_a_calibration_times_a_layered_load_from_records_apart_and_the_choice_follows_it(
    monkeypatch: pytest.MonkeyPatch, staged_cost: float, sm_cost: float, expected: str,
) -> None:
    """A layout of narrow layers (two of 32 KiB a record) where sm competes: the calibration times
    a layered load of the bulk size (24 blocks) from every other record over the layout's two
    layers through each path that passed its loads, and auto's layered choice takes sm only where
    sm moved it faster than the size bucket's path. The control, the rule without the figures,
    takes sm from records apart either way."""
    link = _Link(alone={"dma": 1.0, "staged": 1.0, "sm": 1.0}, shared={"dma": 1.0, "staged": 1.0, "sm": 1.0},
                 layered={"dma": 9.0, "staged": staged_cost, "sm": sm_cost})
    choice = _calibrate_fakes(monkeypatch, link, candidates=ALL_PATHS, layered=True)
    figures = choice.layered()
    assert figures is not None and set(figures) == set(ALL_PATHS)
    assert figures["staged"][0] / figures["sm"][0] == pytest.approx(sm_cost / staged_cost)
    assert {path for path, _, _ in link.layered_jobs} == set(ALL_PATHS)
    for _, host, tables in link.layered_jobs:
        assert np.array_equal(host, 2 * np.arange(24))  # no record follows another
        assert len(tables) == 2
    assert "layered load from records apart: " in choice.describe()
    layers = _fake_layers()
    assert calibration.LayeredChoice(lambda _n: "staged", layers, figures).path(GAPPED, 64) == expected
    assert calibration.LayeredChoice(lambda _n: "dma", layers, figures).path(GAPPED, 64) == "sm"  # dma slower
    assert calibration.LayeredChoice(lambda _n: "staged", layers).path(GAPPED, 64) == "sm"  # the rule alone


def test_a_layered_load_that_copies_nothing_is_never_chosen_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """sm's layered loads report success and copy nothing: its cleared destination shows it, sm has
    no layered figure, and narrow layered loads keep the size bucket's path although sm was timed
    faster. The control, without the fault, takes sm."""
    costs = {"alone": {"dma": 1.0, "staged": 1.0, "sm": 1.0}, "shared": {"dma": 1.0, "staged": 1.0, "sm": 1.0},
             "layered": {"dma": 9.0, "staged": 3.0, "sm": 1.0}}
    faulty = _calibrate_fakes(monkeypatch, _Link(**costs), {("sm", Direction.LOAD): "layered-wrong"},
                              candidates=ALL_PATHS, layered=True)
    figures = faulty.layered()
    assert figures is not None and "sm" not in figures and "staged" in figures
    assert "sm" in faulty.gbps["load"]  # its plain loads passed
    layers = _fake_layers()
    assert calibration.LayeredChoice(lambda _n: "staged", layers, figures).path(GAPPED, 64) == "staged"
    control = _calibrate_fakes(monkeypatch, _Link(**costs), candidates=ALL_PATHS, layered=True).layered()
    assert control is not None
    assert calibration.LayeredChoice(lambda _n: "staged", layers, control).path(GAPPED, 64) == "sm"


@pytest.mark.parametrize(("candidates", "layered"), [(("dma", "staged"), True), (ALL_PATHS, False)])
def test_no_layered_load_is_timed_without_sm_or_without_layers(
    monkeypatch: pytest.MonkeyPatch, candidates: tuple[str, ...], layered: bool,
) -> None:
    link = _Link(alone={"dma": 1.0, "staged": 1.0, "sm": 1.0}, shared={"dma": 1.0, "staged": 1.0, "sm": 1.0})
    choice = _calibrate_fakes(monkeypatch, link, candidates=candidates, layered=layered)
    assert choice.layered() is None and not link.layered_jobs
    assert "layered load" not in choice.describe()


def test_measured_layered_figures_keep_the_paths_no_slower_than_sm() -> None:
    plan = _layer_plan(8 << 10)
    layers = [plan.pages]

    def path(size_path: str, measured: dict[str, tuple[float, ...]] | None) -> str:
        return calibration.LayeredChoice(lambda _n: size_path, layers, measured).path(GAPPED, 64)

    assert path("staged", {"staged": (20.0,), "sm": (40.0,)}) == "sm"
    assert path("staged", {"staged": (40.0,), "sm": (40.0,)}) == "staged"  # a tie keeps the copy engine
    assert path("staged", {"staged": (20.0,)}) == "staged"  # sm failed its layered check
    assert path("staged", {"dma": (5.0,)}) == "staged"  # ... and so did the size bucket's path
    assert path("staged", {}) == "staged"
    assert path("dma", {"staged": (50.0,), "sm": (40.0,)}) == "sm"  # dma not measured faster
    assert path("staged", None) == "sm"  # not measured: the rule
    wide = _layer_plan(calibration.NARROW_LAYER_BYTES)
    assert calibration.LayeredChoice(lambda _n: "staged", [wide.pages], {"sm": (99.0,)}).path(GAPPED, 64) == "staged"


def test_the_key_names_the_layers_only_where_a_layered_load_is_timed() -> None:
    """Two groupings of the same pages time different layered loads: their keys differ. A layout
    without layers, with wide layers, or a calibration without sm keeps the key it had."""
    tensors = {f"layer{i}": torch.zeros(2, 4, 4096, dtype=torch.uint8) for i in range(4)}
    by_default = DeviceLayout.from_tensors(tensors, block_dim=1)
    in_pairs = DeviceLayout.from_tensors(tensors, block_dim=1,
                                         layers=[["layer0", "layer1"], ["layer2", "layer3"]])
    pages = by_default.page_table
    plain = calibration.geometry_key("H100", pages, ALL_PATHS)
    one = calibration.geometry_key("H100", pages, ALL_PATHS, layers=by_default.layer_tables)
    two = calibration.geometry_key("H100", pages, ALL_PATHS, layers=in_pairs.layer_tables)
    assert one.startswith(plain + "|layers=") and two.startswith(plain + "|layers=") and one != two
    assert calibration.geometry_key("H100", pages, ("dma", "staged"), layers=by_default.layer_tables) == \
        calibration.geometry_key("H100", pages, ("dma", "staged"))
    wide = {f"layer{i}": torch.zeros(2, 4, 64 << 10, dtype=torch.uint8) for i in range(2)}
    wide_layout = DeviceLayout.from_tensors(wide, block_dim=1)
    assert "|layers=" not in calibration.geometry_key("H100", wide_layout.page_table, ALL_PATHS,
                                                      layers=wide_layout.layer_tables)


def test_the_layered_figures_are_saved_and_read_back(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "auto.json")
    saved = choice("k|layers=abc")
    saved.gbps[calibration.LAYERED] = {"staged": (12.5,), "sm": (40.0,)}
    _save(path, saved)
    back = _load(path, "k|layers=abc", ("dma", "staged", "sm"))
    assert back is not None and back.layered() == {"staged": (12.5,), "sm": (40.0,)}
    assert choice().layered() is None


@pytest.mark.parametrize("kind", ["per-layer", "cross-layer"])
def test_the_layered_timing_books_its_jobs_on_a_real_calibration_handler(
    monkeypatch: pytest.MonkeyPatch, kind: str,
) -> None:
    """``_time_layered`` over the handler ``_path_handler`` makes (over a host backend here), as the
    calibration runs it: each layered job is validated and booked before it is submitted
    (``submit_by_layer``; a layered submit the handler has not booked is not found by its wait),
    lands layer by layer, and its bytes are checked into a cleared destination. The layers are
    whole pages (per-layer tensors) or slices of one page (a cross-layer tensor whose layer dim
    follows its block dim: each layer 8 KiB of a 16 KiB page), placed in the scratch pages."""
    from kvoffload.backends.cuda import CudaBackend
    from kvoffload.bindings.types import CopyMethod
    from kvoffload.worker import assembly
    from kvoffload.worker.assembly import WorkerOptions

    monkeypatch.setattr(CudaBackend, "create", _Created)
    monkeypatch.setattr(assembly, "_issuing", _host_issuing([], []))
    if kind == "per-layer":
        layout = DeviceLayout.from_tensors({f"layer{i}": torch.zeros(2, 4, 4096, dtype=torch.uint8) for i in range(2)},
                                           block_dim=1)
    else:
        layout = DeviceLayout.from_tensors({"kv": torch.zeros(4, 2, 8192, dtype=torch.uint8)}, block_dim=0, layer_dim=1)
        assert layout.page_table.num_pages == 1 and [t.nbytes.tolist() for t in layout.layer_tables] == [[8192]] * 2
    assert calibration.times_layered(ALL_PATHS, layout.layer_tables)
    blocks = 4
    scratch, table = _scratch_pages(torch.device("cpu"), layout.page_table, 2 * blocks)
    records = torch.randint(0, 256, (2 * blocks, layout.record_bytes), dtype=torch.uint8)
    region: Any = types.SimpleNamespace(base_ptr=records.data_ptr(), chunk_records=2 * blocks,
                                        records=lambda: records)
    plan = CopyPlan(table, records.data_ptr(), 2 * blocks, Direction.LOAD)
    tables = calibration._scratch_layers(layout.page_table, table, layout.layer_tables)  # noqa: SLF001
    assert [t.host_offset.tolist() for t in tables] == [t.host_offset.tolist() for t in layout.layer_tables]
    cuda = _fake_cuda(CopyMethod.BATCH_CTYPES)
    with assembly._path_handler(cuda, WorkerOptions(), torch.device("cpu"), "python", "dma", plan,
                                2 * blocks) as handler:
        figures = calibration._time_layered(torch.device("cpu"), {"dma": handler}, plan, tables, blocks,  # noqa: SLF001
                                            scratch, region)
        with pytest.raises(UnknownJobError):  # the control: a layered submit nobody booked
            handler.submit_layered(99, 2 * np.arange(blocks), blocks + np.arange(blocks), tables)
            handler.wait([99], 10.0)
    assert set(figures) == {"dma"} and figures["dma"][0] > 0.0
    assert _verified(plan, scratch, records, 2 * np.arange(blocks), blocks + np.arange(blocks), blocks)
