"""The engine replay on the cuda backend: a few thousand verified block loads with zero corruption on
the dma and staged paths, with the compute stream stalled so that copies overlap real device work;
the same with a disk tier below a small host pool (disk hits loaded through the bounce slots and
verified like host hits); and the control case that proves the replay's verification sees the race
when copies ignore the compute stream (docs/design.md §5 rule 1 and 2 broken on purpose)."""

from __future__ import annotations

import pathlib

import attrs
import pytest
import torch

from kvoffload.cli.replay import EXIT_OK, ReplayConfig, ReplayReport, main, run_replay
from kvoffload import PathName
from tests.gpu._helpers import no_fence
from tests.gpu.conftest import Figures

#: Llama-8B-like pages (8 KV heads x 128, block size 16, bf16) but 2 layers: 128 KiB records.
GPU_SMALL = ReplayConfig(
    backend="cuda", layers=2, kv_heads=8, head_dim=128, block_size=16, device_blocks=2048,
    host_blocks=2048, documents=300, doc_blocks_min=4, doc_blocks_max=48, suffix_blocks_max=8,
    max_request_blocks=96, inflight_requests=16, blocks_to_load=4000, seed=3,
)
#: ~10 us of GPU time per computed block on the H200: compute that copies must wait for.
STALL_CYCLES_PER_BLOCK = 20_000
PATHS: tuple[PathName, ...] = ("dma", "staged")
#: A host pool far smaller than the working set over a disk pool larger than it (4096 records of
#: 132 KiB in the file: about 0.54 GB under tmp_path).
DISK_HOST_BLOCKS = 512
DISK_BLOCKS = 4096


def describe(report: ReplayReport) -> str:
    return (f"{report.blocks_loaded} loads, hit {100 * report.hit_rate:.1f} %, load "
            f"{report.load_gbps:.1f} GB/s, store {report.store_gbps:.1f} GB/s, overlap "
            f"{100 * report.overlap_fraction:.0f} %, corrupted {report.corrupted_blocks}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_replay_on_cuda_loads_thousands_of_blocks_with_zero_corruption(
    path: PathName, policy: str, device: torch.device, figures: Figures
) -> None:
    config = attrs.evolve(GPU_SMALL, path=path, policy=policy,
                          stall_cycles_per_block=STALL_CYCLES_PER_BLOCK)
    report = run_replay(config)
    figures.add(f"replay cuda {path} {policy}", describe(report))
    assert report.failures() == []
    assert report.backend == "cuda" and report.path == path
    assert report.corrupted_blocks == 0 and report.unverified_blocks == 0
    assert report.verified_blocks == report.blocks_loaded >= config.blocks_to_load
    assert report.hits_by_tier == {"host": report.hit_blocks}
    assert report.host_evictions > 0 and report.blocks_stored > 0
    assert report.overlap_fraction > 0.5


def test_replay_cli_on_cuda_exits_zero(device: torch.device) -> None:
    status = main(["--backend", "cuda", "--path", "dma", "--layers", "2", "--device-blocks", "1024",
                   "--host-blocks", "1024", "--documents", "100", "--blocks-to-load", "2000", "--quiet"])
    assert status == EXIT_OK


def test_replay_on_cuda_with_a_disk_tier_verifies_disk_hits_with_zero_corruption(
    device: torch.device, figures: Figures, tmp_path: pathlib.Path
) -> None:
    config = attrs.evolve(GPU_SMALL, host_blocks=DISK_HOST_BLOCKS, disk_blocks=DISK_BLOCKS,
                          disk_path=str(tmp_path / "kv.bin"), stall_cycles_per_block=STALL_CYCLES_PER_BLOCK)
    report = run_replay(config)
    figures.add("replay cuda with disk tier",
                f"{describe(report)}, disk hits {100 * report.hit_rate_by_tier['disk']:.1f} % at "
                f"{report.load_gbps_by_tier['disk']:.1f} GB/s, {report.demoted_blocks} demoted "
                f"({report.disk_io})")
    assert report.failures() == []
    assert report.corrupted_blocks == 0 and report.unverified_blocks == 0
    assert report.verified_blocks == report.blocks_loaded == report.hit_blocks >= config.blocks_to_load
    assert set(report.hits_by_tier) == {"host", "disk"}
    assert report.hits_by_tier["disk"] > 0 and report.demoted_blocks > 0
    assert not any(report.failed_load_jobs_by_tier.values()) and report.failed_demote_jobs == 0
    assert not any(report.disk_failures.values())


@pytest.mark.parametrize("path", PATHS)
def test_control_copies_that_ignore_the_compute_stream_are_caught(
    path: PathName, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: fences on an idle stream let stores read blocks before compute wrote them and loads
    land before the poison queued ahead of them; the verification must see corrupted blocks."""
    no_fence(monkeypatch)
    config = attrs.evolve(GPU_SMALL, path=path, blocks_to_load=2000,
                          stall_cycles_per_block=10 * STALL_CYCLES_PER_BLOCK)
    report = run_replay(config)
    assert report.corrupted_blocks > 0, "the control case must corrupt: the hazard was not exercised"
    assert not report.ok
