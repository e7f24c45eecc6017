"""The auto path: each job takes the path the calibration chose for its size, results name it, jobs
finish in order across paths, and a path that fails its own check (bytes wrong, or none moved) is
never chosen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload import SrcAccessOrder, Worker, calibration
from kvoffload._descriptors import CopyPlan, StagedChunk
from kvoffload.backends.cuda import CudaStreams, CudaTicket, PathTicket
from kvoffload.backends.kernel import SmPath, StagedPath
from kvoffload.bindings import driver
from tests.gpu._helpers import TIMEOUT_S, cache
from tests.gpu.conftest import Figures


def test_auto_jobs_report_the_path_the_calibration_chose(device: torch.device, figures: Figures) -> None:
    layout = cache("per-layer", device, num_blocks=256, layers=8)
    with Worker.create(layout, 128, path="auto") as w:
        issuer, capabilities = w.issuer, w.capabilities
        store = w._store._backend
        choose = store._choose  # type: ignore[union-attr]
        sizes = (1, 8, 64)
        starts = (0, 1, 9)
        for job, (size, at) in enumerate(zip(sizes, starts)):
            w.store(job, list(range(at, at + size)), list(range(at, at + size)))
        results = w.wait(list(range(len(sizes))), TIMEOUT_S)
        assert all(r.ok for r in results)
        assert [r.path for r in results] == [choose(size) for size in sizes]
        assert torch.equal(w.host_records()[:73].to(device), layout.gather_records(list(range(73))))
    assert capabilities is not None
    geometry = calibration.geometry_key(capabilities.device_name, layout.page_table, ())
    (choice,) = [c for c in calibration._cache.values() if c.key.startswith(geometry)  # this worker's,
                 and c.key.endswith("|native") == (issuer == "native")]  # timed as its jobs are issued
    both = choice.gbps[calibration.BOTH_WAYS]
    assert sorted(both) == ["dma", "staged"]  # the bulk paths, timed both ways in the bulk buckets
    assert all(g[0] == 0.0 and min(g[1:]) > 0.0 for g in both.values())
    figures.add(f"auto calibration (per-layer, 8 layers, 32 KiB pages; {issuer} issuer)",
                f"{choice.describe()}; both ways GB/s {both}")


def test_auto_mixes_paths_and_still_finishes_jobs_in_order(device: torch.device) -> None:
    layout = cache("per-layer", device, num_blocks=256, layers=8)
    rng = np.random.default_rng(1)
    original = layout.gather_records(list(range(128)))
    with Worker.create(layout, 128, path="auto") as w:
        sizes = [1, 40, 1, 2, 60, 1, 23]
        at = 0
        for job, size in enumerate(sizes):
            w.store(job, list(range(at, at + size)), list(range(at, at + size)))
            at += size
        done = [r.job_id for r in w.wait(list(range(len(sizes))), TIMEOUT_S)]
        assert done == list(range(len(sizes)))
        dst = 128 + rng.permutation(128)[:at]
        at = 0
        for job, size in enumerate(sizes):  # loads of mixed paths: staged ends on the kernel stream
            w.load(100 + job, list(range(at, at + size)), dst[at : at + size])
            at += size
        loads = w.wait([100 + job for job in range(len(sizes))], TIMEOUT_S)
        assert [r.job_id for r in loads] == [100 + job for job in range(len(sizes))]
        choose = w._load._backend._choose  # type: ignore[union-attr]
        assert all(r.ok for r in loads) and [r.path for r in loads] == [choose(n) for n in sizes]
    assert torch.equal(layout.gather_records(dst), original[:at])


def test_auto_moves_every_byte_whichever_path_each_job_takes(device: torch.device) -> None:
    """Every pair of consecutive paths (dma, sm, staged) in both directions: the streams a job ends
    on differ by path, and each job must still move exactly its bytes."""
    layout = cache("per-layer", device, num_blocks=256, layers=8, seed=4)
    forced = {1: "sm", 2: "dma", 3: "staged"}
    sizes = [1, 3, 2, 1, 3, 1, 2, 2, 1, 1, 3, 3, 2]
    total = sum(sizes)
    rng = np.random.default_rng(3)
    src = rng.permutation(128)[:total]
    dst = 128 + rng.permutation(128)[:total]
    host = rng.permutation(128)[:total]
    original = layout.gather_records(src)
    with Worker.create(layout, 128, path="auto") as w:
        for handler in (w._store, w._load):
            handler._backend._choose = forced.__getitem__  # type: ignore[union-attr]
        for base, submit, a, b in ((0, w.store, src, host), (100, w.load, host, dst)):
            at = 0
            for job, size in enumerate(sizes):
                submit(base + job, a[at : at + size], b[at : at + size])
                at += size
            results = w.wait([base + job for job in range(len(sizes))], TIMEOUT_S)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok]
            assert [r.path for r in results] == [forced[n] for n in sizes]
    assert torch.equal(layout.gather_records(dst), original)


def corrupting_store_chunk(
    self: StagedPath, streams: CudaStreams, chunk: StagedChunk, plan: CopyPlan,
    segments: tuple[int, int],
) -> None:
    """A broken staged store: the kernel never fills the slot, the DMA copies stale staging."""
    stream = streams.copy
    self._drained[chunk.slot].wait_on(stream)
    self.copier.copy(chunk.dma.dsts, chunk.dma.srcs, chunk.dma.sizes,
                     SrcAccessOrder.STREAM, stream)
    self._drained[chunk.slot].record(stream)


def test_auto_never_chooses_a_path_that_failed_its_own_check(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibration, "_cache", {})
    monkeypatch.setattr(StagedPath, "_store_chunk", corrupting_store_chunk)
    layout = cache("per-layer", device, num_blocks=256, layers=8, seed=9)
    # the Python issuer, which issues through the replaced method (its calibration is timed so too)
    with Worker.create(layout, 64, path="auto", issuer="python") as w:
        choose = w._store._backend._choose  # type: ignore[union-attr]
        assert all(choose(size) != "staged" for size in (1, 8, 64, 1000))
        assert all(choose(size) == "dma" for size in (8, 64, 1000))  # sm competes below 8 only
        w.store(1, list(range(40)), list(range(40)))
        (result,) = w.wait([1], TIMEOUT_S)
        assert result.ok and result.path == "dma"
        assert torch.equal(w.host_records()[:40].to(device), layout.gather_records(list(range(40))))


def copying_nothing(
    self: SmPath, streams: CudaStreams, plan: CopyPlan, src: object, dst: object,
    fence: driver.Event,
) -> PathTicket:
    """An sm job that waits for its fence and completes, but moves no byte (the fastest "path")."""
    kstream = streams.kernel
    start, end = driver.Event(streams.timing_events), driver.Event(streams.timing_events)
    fence.wait_on(kstream)
    start.record(kstream)
    end.record(kstream)
    return CudaTicket(start, end, None, self.name)


def test_auto_never_chooses_a_path_that_copies_nothing(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paths are timed in turns on one destination: a path that skips its copies must not pass
    its check on the bytes another path wrote there before it (its verified job writes into a
    cleared destination)."""
    monkeypatch.setattr(calibration, "_cache", {})
    monkeypatch.setattr(SmPath, "issue", copying_nothing)
    layout = cache("per-layer", device, num_blocks=256, layers=8, seed=11)
    # the Python issuer, which issues through the replaced method (its calibration is timed so too)
    with Worker.create(layout, 64, path="auto", issuer="python") as w:
        for handler in (w._store, w._load):
            choose = handler._backend._choose  # type: ignore[union-attr]
            assert all(choose(size) != "sm" for size in (1, 2, 7))
        w.store(1, [3], [4])
        (result,) = w.wait([1], TIMEOUT_S)
        assert result.ok and result.path in ("dma", "staged")
        assert torch.equal(w.host_records()[4:5].to(device), layout.gather_records([3]))
    (choice,) = calibration._cache.values()
    assert choice.key.endswith("|sm")  # sm competed, and was dropped in both directions
    assert all("sm" not in measured for measured in choice.gbps.values())
