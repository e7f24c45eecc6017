"""The engine replay with a disk tier, on the host backend (tier files under tmp_path): host eviction
demotes to disk, disk hits are loaded and verified like host hits, a damaged disk record is a
recomputed miss and never a hit, a failed demotion is never loadable from disk, and a plan's store
waits for the demotions that read its host blocks (the control that does not wait is refused)."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import threading
from collections.abc import Callable

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvoffload import DeviceLayout, Worker
from kvoffload.cli._caches import build_cache
from kvoffload.disk.config import PAGE_BYTES, DiskConfig
from kvoffload.disk.tier import DiskTier
from kvoffload import Manager, StorePlan, Tier
from kvoffload.cli._replay_engine import _Replay, _StoreJob
from kvoffload.cli._replay_model import DISK_FAILURE_COUNTERS
from kvoffload.cli.replay import EXIT_FAILED, EXIT_OK, ReplayConfig, ReplayReport, main, run_replay

U8Array = npt.NDArray[np.uint8]
TIMEOUT_S = 60.0
#: The small geometry of tests/unit/test_replay.py (4096-byte records), with a host pool far smaller
#: than the working set and a disk pool larger than it: most reuse has to come back from disk.
SMALL_DISK = ReplayConfig(
    backend="host", layers=2, kv_heads=2, head_dim=32, block_size=4, device_blocks=256,
    host_blocks=48, documents=40, doc_blocks_min=2, doc_blocks_max=12, suffix_blocks_min=1,
    suffix_blocks_max=4, max_request_blocks=40, inflight_requests=8, blocks_to_load=1500, seed=1,
    disk_blocks=1024,
)
SMALL_DISK_ARGS = [
    "--backend", "host", "--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--block-size", "4",
    "--device-blocks", "256", "--host-blocks", "48", "--documents", "40", "--doc-blocks-min", "2",
    "--doc-blocks-max", "12", "--suffix-blocks-max", "4", "--max-request-blocks", "40",
    "--inflight-requests", "8", "--seed", "1", "--quiet",
]
#: Distinct disk records the damage test corrupts.
DAMAGED_RECORDS = 3


def with_disk(tmp_path: pathlib.Path, config: ReplayConfig = SMALL_DISK) -> ReplayConfig:
    return attrs.evolve(config, disk_path=str(tmp_path / "kv.bin"))


def assert_every_served_block_verified(report: ReplayReport) -> None:
    assert report.corrupted_blocks == 0 and report.unverified_blocks == 0
    assert report.verified_blocks == report.blocks_loaded == report.hit_blocks
    assert sum(report.hits_by_tier.values()) == report.hit_blocks
    assert report.lookup_blocks == report.hit_blocks + report.computed_blocks


def flip_byte(path: str, offset: int) -> None:
    """Invert one byte of the file in place (through the page cache; O_DIRECT reads see it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ 0xFF]), offset)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ clean runs


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_replay_with_a_disk_tier_demotes_and_serves_disk_hits_with_zero_corruption(
    tmp_path: pathlib.Path, policy: str
) -> None:
    report = run_replay(with_disk(tmp_path, attrs.evolve(SMALL_DISK, policy=policy)))
    assert report.failures() == [] and report.ok
    assert_every_served_block_verified(report)
    assert report.blocks_loaded >= SMALL_DISK.blocks_to_load and report.target_reached
    assert set(report.hits_by_tier) == {"host", "disk"}
    assert report.hits_by_tier["disk"] > 0 and report.hits_by_tier["host"] > 0
    assert sum(report.hit_rate_by_tier.values()) == pytest.approx(report.hit_rate)
    assert report.hit_rate == pytest.approx(report.manager_hit_rate)  # no failed load here
    assert report.load_jobs == sum(report.load_jobs_by_tier.values())
    assert report.bytes_loaded_by_tier["disk"] == report.hits_by_tier["disk"] * report.block_bytes
    assert not any(report.failed_load_jobs_by_tier.values())
    assert report.demote_jobs > 0 and report.demoted_blocks > 0
    assert report.failed_demote_jobs == report.demote_failed_blocks == 0
    assert report.bytes_demoted == report.demoted_blocks * report.record_bytes
    assert report.disk_bytes_written == report.bytes_demoted
    assert report.disk_bytes_read == report.hits_by_tier["disk"] * report.record_bytes
    assert report.disk_io in ("disk-direct", "disk-buffered")
    assert set(report.disk_failures) == set(DISK_FAILURE_COUNTERS)
    assert not any(report.disk_failures.values())
    # Every successful store and demotion made one copy loadable (a "stored" event on its tier).
    assert report.events["stored"] == report.blocks_stored + report.demoted_blocks


def test_the_disk_tier_raises_the_hit_rate_of_the_same_requests(tmp_path: pathlib.Path) -> None:
    # Settled: a pool busy with pending stores skips offloads, which would make both hit rates
    # depend on timing; one settled request at a time gives the manager the same sequence each run.
    same_requests = attrs.evolve(SMALL_DISK, requests=250, blocks_to_load=0, host_blocks=96,
                                 inflight_requests=2, settle=True)
    host_only = run_replay(attrs.evolve(same_requests, disk_blocks=0))
    with_tier = run_replay(with_disk(tmp_path, same_requests))
    assert host_only.ok and with_tier.ok
    assert host_only.lookup_blocks == with_tier.lookup_blocks  # the same request sequence
    assert host_only.hits_by_tier == {"host": host_only.hit_blocks}
    assert host_only.disk_blocks == 0 and host_only.demote_jobs == 0 and host_only.disk_failures == {}
    assert with_tier.hit_rate > host_only.hit_rate + 0.1, (with_tier.hit_rate, host_only.hit_rate)


def test_main_with_a_disk_tier_prints_each_tier_and_writes_json(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replay.json"
    disk = tmp_path / "kv.bin"
    status = main([*SMALL_DISK_ARGS, "--blocks-to-load", "600", "--disk-path", str(disk),
                   "--disk-blocks", "1024", "--disk-direct", "off", "--json", str(out)])
    text = capsys.readouterr().out
    assert status == EXIT_OK, text
    for label in ("    host ", "    disk ", "    all tiers", "disk tier", "demotions", "disk evictions",
                  "disk bytes", "disk failures", "disk-buffered", "result                 OK"):
        assert label in text, label
    data = json.loads(out.read_text())
    assert data["config"]["disk_path"] == str(disk) and data["config"]["disk_blocks"] == 1024
    report = data["report"]
    for attribute in attrs.fields(ReplayReport):
        assert attribute.name in report
    assert report["ok"] is True and report["corrupted_blocks"] == 0
    assert report["hits_by_tier"]["disk"] > 0
    assert sum(report["hits_by_tier"].values()) == report["hit_blocks"]
    for field in ("hit_rate_by_tier", "load_jobs_by_tier", "failed_load_jobs_by_tier",
                  "failed_load_blocks_by_tier", "bytes_loaded_by_tier", "load_gbps_by_tier"):
        assert set(report[field]) == {"host", "disk"}, field
    assert report["disk_io"] == "disk-buffered" and report["disk_blocks"] == 1024
    assert report["demoted_blocks"] > 0 and report["disk_bytes_written"] > 0
    assert report["disk_failures"] == {name: 0 for name in DISK_FAILURE_COUNTERS}


@pytest.mark.parametrize("reuse", [True, False], ids=["warm", "cold-control"])
def test_a_second_run_opened_warm_serves_and_verifies_the_records_the_first_run_demoted(
    tmp_path: pathlib.Path, reuse: bool
) -> None:
    """A restart that keeps its disk cache: the second run (the same workload, one request at a time
    so that both runs see the same sequence) adopts the first run's records and serves more of its
    requests from disk, every block verified against its key's pattern. The control recreates the
    file and repeats the first run exactly."""
    config = attrs.evolve(with_disk(tmp_path), settle=True, blocks_to_load=600)
    first = run_replay(config)
    assert first.ok and first.demoted_blocks > 0 and first.disk_adopted_blocks == 0
    second = run_replay(attrs.evolve(config, disk_reuse=reuse))
    assert second.ok, second.failures()
    assert_every_served_block_verified(second)
    if reuse:
        assert second.disk_reuse and 0 < second.disk_adopted_blocks <= config.disk_blocks
        assert second.hits_by_tier["disk"] > first.hits_by_tier["disk"]
        assert second.computed_blocks < first.computed_blocks
    else:
        assert second.disk_adopted_blocks == 0
        assert (second.hits_by_tier, second.computed_blocks) == (first.hits_by_tier, first.computed_blocks)


def test_main_with_disk_reuse_says_how_many_records_it_adopted(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*SMALL_DISK_ARGS, "--blocks-to-load", "300", "--disk-path", str(tmp_path / "kv.bin"),
            "--disk-blocks", "1024", "--disk-direct", "off"]
    assert main(args) == EXIT_OK
    capsys.readouterr()
    assert main([*args, "--disk-reuse"]) == EXIT_OK
    text = capsys.readouterr().out
    adopted = re.search(r"opened warm, (\d+) records adopted", text)
    assert adopted is not None and int(adopted.group(1)) > 0, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-blocks", "64"], "need disk_path"),
        (["--disk-direct", "on"], "need disk_path"),
        (["--disk-reuse"], "need disk_path"),
        (["--disk-path", "{tmp}/kv.bin", "--disk-blocks", "64", "--disk-reuse", "--remote", "redis"],
         "disk_reuse with remote"),
        (["--disk-path", "{tmp}/kv.bin"], "disk_blocks = 0 must be >= 1"),
        (["--disk-path", "{tmp}/missing/kv.bin", "--disk-blocks", "64"], "does not exist"),
        (["--disk-path", "{tmp}", "--disk-blocks", "64"], "not a directory"),
    ],
)
def test_bad_disk_options_are_usage_errors(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL_DISK_ARGS, *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_file_that_is_not_a_tier_is_refused_and_left_alone(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_bytes(b"not a kvoffload tier")
    status = main([*SMALL_DISK_ARGS, "--disk-path", str(precious), "--disk-blocks", "64"])
    assert status == EXIT_FAILED
    assert "the disk tier could not be created" in capsys.readouterr().err
    assert precious.read_bytes() == b"not a kvoffload tier"


# ------------------------------------------------------------------------------------ fault injection


def test_a_damaged_disk_record_is_a_recomputed_miss_never_a_hit(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read of each of DAMAGED_RECORDS disk records finds a payload byte flipped in the file
    (after its demotion wrote it): the load fails its checksum, and the replay recomputes it."""
    damaged: set[int] = set()
    lock = threading.Lock()
    real_pread = DiskTier._pread

    def damaging_pread(self: DiskTier, fd: int, buffers: list[U8Array], offset: int) -> int:
        block = (offset - PAGE_BYTES) // self.slot_bytes  # the first record of this system call
        with lock:
            if len(damaged) < DAMAGED_RECORDS and block not in damaged:
                damaged.add(block)
                flip_byte(self.path, offset + PAGE_BYTES + 100)  # its payload, past the header page
        return real_pread(self, fd, buffers, offset)

    monkeypatch.setattr(DiskTier, "_pread", damaging_pread)
    report = run_replay(with_disk(tmp_path))
    assert len(damaged) == DAMAGED_RECORDS, "the damage was not exercised"
    assert report.disk_failures["checksum_mismatches"] == DAMAGED_RECORDS
    assert report.failed_load_jobs_by_tier["disk"] >= DAMAGED_RECORDS
    assert report.failed_load_blocks_by_tier["disk"] >= DAMAGED_RECORDS
    assert report.failed_load_jobs_by_tier["host"] == 0
    # Failed loads are misses: recomputed, never verified or counted as hits; everything served was.
    assert_every_served_block_verified(report)
    assert report.failed_load_blocks == sum(report.failed_load_blocks_by_tier.values())
    assert report.hit_rate < report.manager_hit_rate
    assert report.hits_by_tier["disk"] > 0
    assert not report.ok and "failed jobs" in "; ".join(report.failures())


def failing_pwrite(every: int) -> Callable[[DiskTier, int, list[U8Array], int], int]:
    """A ``DiskTier._pwrite`` whose every ``every``-th call fails with EIO."""
    calls = [0]
    lock = threading.Lock()
    real_pwrite = DiskTier._pwrite

    def pwrite(self: DiskTier, fd: int, buffers: list[U8Array], offset: int) -> int:
        with lock:
            calls[0] += 1
            fail = calls[0] % every == 0
        if fail:
            raise OSError(errno.EIO, "injected write failure")
        return real_pwrite(self, fd, buffers, offset)

    return pwrite


def test_a_failed_demotion_is_never_loadable_from_disk(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(DiskTier, "_pwrite", failing_pwrite(4))
    with monkeypatch.context() as patch:
        real = Manager.complete_demote

        def always_ok(self: Manager, plan: StorePlan, ok: bool, keys: list[bytes] | None = None) -> None:
            real(self, plan, True, keys)  # CONTROL ONLY: a failed demotion reported as done

        patch.setattr(Manager, "complete_demote", always_ok)
        control = run_replay(attrs.evolve(SMALL_DISK, disk_path=str(tmp_path / "control.bin")))
    assert control.failed_demote_jobs > 0
    assert control.failed_load_jobs_by_tier["disk"] > 0 and control.disk_failures["not_valid"] > 0, (
        "the control never loaded a key whose demotion failed: the test cannot prove the rule"
    )
    assert_every_served_block_verified(control)  # the tier refuses what its index does not hold

    report = run_replay(with_disk(tmp_path))
    assert report.failed_demote_jobs > 0 and report.demote_failed_blocks > 0
    assert report.disk_failures["eio"] > 0
    assert report.failed_load_jobs_by_tier["disk"] == 0 and report.disk_failures["not_valid"] == 0
    assert report.hits_by_tier["disk"] > 0  # the demotions that succeeded are served
    assert_every_served_block_verified(report)
    assert report.events["store_failed"] == report.demote_failed_blocks  # no host store failed
    assert not report.ok and "demote" in "; ".join(report.failures())


def test_a_store_waits_for_the_demotions_that_read_its_host_blocks(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: submitting a plan's store right after its demotions (without waiting for their result)
    is refused by the worker, because the store would overwrite host blocks the demotion still reads;
    the replay's own order runs clean (the first test)."""
    real = _Replay._demote_then_store

    def demote_and_store_at_once(self: _Replay, store: _StoreJob) -> None:
        real(self, store)
        self._submit_store(store)  # CONTROL ONLY: the store does not wait for the demotion

    monkeypatch.setattr(_Replay, "_demote_then_store", demote_and_store_at_once)
    report = run_replay(with_disk(tmp_path, attrs.evolve(SMALL_DISK, blocks_to_load=300)))
    assert not report.ok
    assert any("BlockConflictError" in e and "(demote)" in e for e in report.errors), report.errors


# ------------------------------------------------------------------------------------ known bug


def tiny_layout() -> DeviceLayout:
    tensors, block_dim = build_cache("per-layer", num_blocks=8, layers=2, kv_heads=2, head_dim=32,
                                     block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim)


def test_a_disk_copy_that_failed_its_check_is_not_offered_again(tmp_path: pathlib.Path) -> None:
    layout = tiny_layout()
    path = str(tmp_path / "kv.bin")
    manager = Manager.create(1, fingerprint=layout.fingerprint, num_disk_blocks=4)
    key_a, key_b = b"a" * 16, b"b" * 16
    with Worker.create(layout, 1, disk=DiskConfig(path, 4, direct=False), bounce_slots=2) as worker:
        first = manager.prepare_store([key_a])
        assert first is not None
        worker.store(1, [0], first.host_blocks)
        assert worker.wait([1], TIMEOUT_S)[0].ok
        manager.complete_store(first, True)
        second = manager.prepare_store([key_b])  # the one host block: key_a is demoted
        assert second is not None and len(second.demotions) == 1
        demotion = second.demotions[0]
        worker.demote(2, [demotion.host_block], [demotion.disk_block])
        assert worker.wait([2], TIMEOUT_S)[0].ok
        manager.complete_demote(second, True)
        worker.store(3, [1], second.host_blocks)
        assert worker.wait([3], TIMEOUT_S)[0].ok
        manager.complete_store(second, True)

        slot = PAGE_BYTES + layout.record_bytes
        flip_byte(path, PAGE_BYTES + demotion.disk_block * slot + PAGE_BYTES + 100)
        plan = manager.prepare_load([key_a])
        assert plan.tiers == (Tier.DISK,)
        worker.load_from_disk(4, plan.blocks, [2])
        (result,) = worker.wait([4], TIMEOUT_S)
        manager.complete_load(plan, ok=result.ok)
        assert not result.ok
        assert demotion.disk_block not in worker.disk_valid_blocks()  # the tier dropped the record
        assert manager.lookup([key_a]) == 0  # the damaged disk copy is never offered again
        assert manager.stats().disk_copies_dropped == 1


def test_settled_replays_give_the_same_hit_rates_every_run(tmp_path: pathlib.Path) -> None:
    config = attrs.evolve(SMALL_DISK, requests=120, blocks_to_load=0, host_blocks=64, settle=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = run_replay(with_disk(tmp_path / "a", config))
    second = run_replay(with_disk(tmp_path / "b", config))
    assert (first.hits_by_tier, first.demoted_blocks) == (second.hits_by_tier, second.demoted_blocks)
