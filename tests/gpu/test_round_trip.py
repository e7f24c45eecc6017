"""Bit-exact round trips on the cuda backend: every layout, fresh random data, random (scattered and
contiguous) block ids; the three copy methods give identical bytes; large jobs and small pin chunks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvoffload import CopyMethod, DeviceLayout, Worker
from kvoffload.cli.demo import LAYOUTS
from kvoffload import PathName
from tests.gpu._helpers import TIMEOUT_S, cache
from tests.gpu.conftest import Figures

SUBMIT_REPEATS = 12
PATHS: tuple[PathName, ...] = ("dma", "staged", "sm")


def pick(rng: np.random.Generator, n: int, count: int, contiguous: bool) -> np.ndarray:
    if contiguous:
        start = int(rng.integers(0, n - count + 1))
        return np.arange(start, start + count)
    return rng.choice(n, size=count, replace=False)


def round_trip(w: Worker, layout: DeviceLayout, rng: np.random.Generator, count: int,
               contiguous: bool, job: int, path: str = "dma") -> None:
    src = pick(rng, layout.num_blocks // 2, count, contiguous)
    dst = layout.num_blocks // 2 + pick(rng, layout.num_blocks // 2, count, contiguous)
    host = pick(rng, w.num_host_blocks, count, contiguous)
    original = layout.gather_records(src)
    layout.scatter_records(dst, torch.full_like(original, 0xA5))  # poison: a no-op load shows
    w.store(job, src, host)
    assert all(r.ok for r in w.wait([job], TIMEOUT_S))
    assert torch.equal(w.host_records()[host].to(layout.device), original)
    w.load(job + 1, host, dst)
    (result,) = w.wait([job + 1], TIMEOUT_S)
    assert result.ok, result.error
    assert result.path == path
    assert torch.equal(layout.gather_records(dst), original)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("contiguous", [False, True], ids=["scattered", "contiguous"])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_round_trip_is_bit_exact(kind: str, contiguous: bool, path: PathName,
                                 device: torch.device) -> None:
    layout = cache(kind, device, seed=len(kind))
    rng = np.random.default_rng(len(kind) + int(contiguous))
    # Small slots: jobs span several chunks and every slot is reused within a job.
    with Worker.create(layout, 160, path=path, staging_bytes=4 * 4 * layout.record_bytes) as w:
        for trial in range(3):
            round_trip(w, layout, rng, count=int(rng.integers(1, 64)), contiguous=contiguous,
                       job=2 * trial, path=path)


def test_pages_that_are_not_a_multiple_of_16_bytes_take_the_byte_tail(device: torch.device) -> None:
    # 3-byte elements are impossible in torch; a 4-byte-element page of 4 * 13 = 52 bytes needs a
    # 16-byte-aligned stride, so pad the block stride: [N, 64] uint8 viewed as pages of 52 bytes.
    base = torch.randint(0, 256, (128, 64), dtype=torch.uint8, device=device)
    pages = base[:, :52]
    layout = DeviceLayout.from_tensors({"odd": pages}, block_dim=0)
    assert layout.page_table.nbytes.tolist() == [52]
    for path in PATHS:
        with Worker.create(layout, 64, path=path) as w:
            w.store(1, list(range(0, 40)), list(range(0, 40)))
            assert all(r.ok for r in w.wait([1], TIMEOUT_S))
            assert torch.equal(w.host_records()[:40, :52].to(device), pages[:40]), path
            w.load(2, list(range(0, 40)), list(range(64, 104)))
            assert all(r.ok for r in w.wait([2], TIMEOUT_S))
        assert torch.equal(pages[64:104], pages[:40]), path
        pages[64:104].zero_()


def test_copy_methods_give_identical_bytes(device: torch.device) -> None:
    layout = cache("per-layer", device, seed=11)
    rng = np.random.default_rng(5)
    src = rng.choice(layout.num_blocks, size=40, replace=False)
    host = rng.choice(64, size=40, replace=False)
    snapshots = {}
    for method in CopyMethod:
        with Worker.create(layout, 64, copy_method=method, path="dma") as w:
            w.host_records().fill_(0)
            w.store(1, src, host)
            assert all(r.ok for r in w.wait([1], TIMEOUT_S))
            snapshots[method] = w.host_records().clone()
            assert (w.stats().path == "dma-loop") == (method is CopyMethod.PER_COPY)
    reference = snapshots[CopyMethod.BATCH_CTYPES]
    assert torch.equal(reference[host].to(device), layout.gather_records(src))
    for method, snap in snapshots.items():
        assert torch.equal(snap, reference), method


def test_copy_methods_load_identical_bytes(device: torch.device) -> None:
    layout = cache("kv-separate", device, seed=12)
    rng = np.random.default_rng(6)
    src = rng.choice(layout.num_blocks // 2, size=30, replace=False)
    dst = layout.num_blocks // 2 + rng.choice(layout.num_blocks // 2, size=30, replace=False)
    host = rng.choice(64, size=30, replace=False)
    original = layout.gather_records(src)
    for job, method in enumerate(CopyMethod):
        layout.scatter_records(dst, torch.zeros_like(original))
        with Worker.create(layout, 64, copy_method=method, path="dma") as w:
            w.store(2 * job, src, host)
            w.wait([2 * job], TIMEOUT_S)
            w.load(2 * job + 1, host, dst)
            assert all(r.ok for r in w.wait([2 * job + 1], TIMEOUT_S))
        assert torch.equal(layout.gather_records(dst), original), method


def test_large_job_of_256_blocks_by_64_pages(device: torch.device, figures: Figures) -> None:
    layout = cache("per-layer", device, num_blocks=640, layers=32, seed=3)
    assert layout.pages_per_block == 64
    rng = np.random.default_rng(9)
    src = rng.choice(320, size=256, replace=False)
    dst = 320 + rng.choice(320, size=256, replace=False)
    host = rng.choice(300, size=256, replace=False)
    original = layout.gather_records(src)
    submit_s: list[float] = []
    with Worker.create(layout, 300, path="dma") as w:
        for job in range(SUBMIT_REPEATS):  # the first jobs also warm up first-use costs
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            w.store(job, src, host)
            submit_s.append(time.perf_counter() - t0)
            (stored,) = w.wait([job], TIMEOUT_S)
            assert stored.ok, stored.error
        w.load(SUBMIT_REPEATS, host, dst)
        (loaded,) = w.wait([SUBMIT_REPEATS], TIMEOUT_S)
        assert loaded.ok, loaded.error
        assert torch.equal(w.host_records()[host].to(device), original)
    assert torch.equal(layout.gather_records(dst), original)
    figures.add("submit, one store job of 256 blocks x 64 pages, alone after a sync (median)",
                f"{float(np.median(submit_s[2:])) * 1e6:8.1f} us")
    figures.add("submit, 256 x 64-page store jobs back to back (median)",
                f"{back_to_back_submit_us(layout, src, host):8.1f} us")
    figures.add("submit, 256 x 64-page store jobs back to back, staged (the first of a burst is "
                "issued on the caller's thread)",
                f"{back_to_back_submit_us(layout, src, host, 'staged'):8.1f} us")
    figures.add("store 256 x 64 x 32 KiB, one job alone, dma (copy-stream time)",
                f"{stored.nbytes / stored.seconds / 1e9:8.1f} GB/s")
    figures.add("load 256 x 64 x 32 KiB, one job alone, dma (copy-stream time)",
                f"{loaded.nbytes / loaded.seconds / 1e9:8.1f} GB/s")


def back_to_back_submit_us(
    layout: DeviceLayout, src: np.ndarray, host: np.ndarray, path: PathName = "dma"
) -> float:
    """Median caller time of store() for jobs submitted one after another, as an engine does."""
    jobs = 4
    times = []
    rng = np.random.default_rng(4)
    with Worker.create(layout, jobs * src.shape[0], path=path) as w:
        for rep in range(2):
            for job in range(jobs):
                hosts = job * src.shape[0] + rng.permutation(src.shape[0])  # disjoint per job
                t0 = time.perf_counter()
                w.store(rep * jobs + job, src, hosts)
                times.append(time.perf_counter() - t0)
            w.wait([rep * jobs + j for j in range(jobs)], TIMEOUT_S)
    return float(np.median(times[jobs:])) * 1e6


def test_merged_runs_never_cross_a_pin_chunk(device: torch.device) -> None:
    # One page per record equal to the record: consecutive blocks merge into runs across records,
    # which must split at every chunk of 3 records.
    kv = torch.randint(0, 256, (64, 4096), dtype=torch.uint8, device=device)
    layout = DeviceLayout.from_tensors({"kv": kv}, block_dim=0)
    assert layout.record_bytes == 4096
    with Worker.create(layout, 32, pin_chunk_bytes=3 * 4096) as w:
        w.store(1, list(range(10, 30)), list(range(2, 22)))
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
        # clone first: one device copy of a view that spans several registrations is refused
        assert torch.equal(w.host_records()[2:22].clone().to(device), kv[10:30])
        kv[40:60].zero_()
        w.load(2, list(range(2, 22)), list(range(40, 60)))
        assert all(r.ok for r in w.wait([2], TIMEOUT_S))
    assert torch.equal(kv[40:60], kv[10:30])


def test_shared_region_round_trip(device: torch.device) -> None:
    layout = cache("mla", device, seed=4)
    rng = np.random.default_rng(2)
    with Worker.create(layout, 64, shared_name=f"kvoffload-gpu-test-{rng.integers(1 << 30)}",
                       path="dma") as w:
        round_trip(w, layout, rng, count=20, contiguous=False, job=0)
