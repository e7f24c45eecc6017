"""The engine replay on the host backend: zero corruption at small sizes, and proof that its
verification catches what it must (a flipped byte, a skipped store copy, a wrong host block from the
scheduler), that a failed load is a miss and never a hit, that a failed store never becomes
loadable, and that the keys a load plan stops short of are computed as misses."""

from __future__ import annotations

import ctypes
import json
import pathlib
from typing import ClassVar

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvoffload import DeviceLayout, Direction, TransferError
from kvoffload._descriptors import CopyPlan
from kvoffload.backends.host import HostBackend, HostTicket
from kvoffload import LoadPlan, Manager
from kvoffload.cli._caches import build_cache
from kvoffload.cli._replay_model import PatternGenerator, Workload, block_key
from kvoffload.cli import replay as replay_module
from kvoffload.cli.replay import EXIT_FAILED, EXIT_OK, ReplayConfig, ReplayReport, main, run_replay
from kvoffload.remote import RemoteConfig
from kvoffload.testing import MemoryCluster

I64Array = npt.NDArray[np.int64]
#: Small records (4 pages of 512 bytes: 4096-byte records) so that a run takes about a second.
SMALL = ReplayConfig(
    backend="host", layers=2, kv_heads=2, head_dim=32, block_size=4, device_blocks=256,
    host_blocks=160, documents=40, doc_blocks_min=2, doc_blocks_max=12, suffix_blocks_min=1,
    suffix_blocks_max=4, max_request_blocks=40, inflight_requests=8, blocks_to_load=1500, seed=1,
)
SMALL_ARGS = [
    "--backend", "host", "--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--block-size", "4",
    "--device-blocks", "256", "--host-blocks", "160", "--documents", "40", "--doc-blocks-min", "2",
    "--doc-blocks-max", "12", "--suffix-blocks-max", "4", "--max-request-blocks", "40",
    "--inflight-requests", "8", "--seed", "1", "--quiet",
]


def small_layout() -> DeviceLayout:
    tensors, block_dim = build_cache(
        "per-layer", num_blocks=8, layers=2, kv_heads=2, head_dim=32, block_size=4,
        dtype=torch.bfloat16, device=torch.device("cpu"),
    )
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim)


def assert_clean(report: ReplayReport) -> None:
    assert report.failures() == []
    assert report.ok
    assert report.corrupted_blocks == 0 and report.unverified_blocks == 0
    assert report.verified_blocks == report.blocks_loaded == report.hit_blocks


# ------------------------------------------------------------------------------------ clean runs


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_replay_verifies_every_load_with_zero_corruption(policy: str) -> None:
    report = run_replay(attrs.evolve(SMALL, policy=policy))
    assert_clean(report)
    assert report.policy == policy and report.backend == "host" and report.path == "host"
    assert report.blocks_loaded >= SMALL.blocks_to_load and report.target_reached
    assert report.hits_by_tier == {"host": report.hit_blocks}
    assert report.hit_rate_by_tier == {"host": pytest.approx(report.hit_rate)}
    assert report.disk_blocks == 0 and report.demote_jobs == 0 and report.disk_failures == {}
    assert 0.2 < report.hit_rate < 0.95, report.hit_rate
    assert report.hit_rate == pytest.approx(report.manager_hit_rate)  # no failed load here
    assert report.host_evictions > 0  # the pool is smaller than the working set
    assert report.continued_requests > 0
    assert report.blocks_stored > 0 and report.bytes_loaded == report.blocks_loaded * report.block_bytes
    assert report.lookup_blocks == report.hit_blocks + report.computed_blocks


def test_prefill_estimate_follows_the_stated_model() -> None:
    report = run_replay(attrs.evolve(SMALL, blocks_to_load=300, prefill_tokens_per_s=1000.0))
    assert report.hit_tokens == report.hit_blocks * SMALL.block_size
    assert report.recompute_s == pytest.approx(report.hit_tokens / 1000.0)
    assert report.prefill_saved_s == pytest.approx(report.recompute_s - report.load_busy_s)


def test_main_prints_the_summary_and_writes_json(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replay.json"
    status = main([*SMALL_ARGS, "--blocks-to-load", "400", "--policy", "arc", "--json", str(out)])
    text = capsys.readouterr().out
    assert status == EXIT_OK, text
    assert "running the host backend" in text
    for label in ("requests", "blocks looked up", "hit rate", "host", "block loads", "block stores",
                  "bytes moved", "GB/s", "prefill saved", "corrupted", "result                 OK"):
        assert label in text
    data = json.loads(out.read_text())
    assert data["config"]["policy"] == "arc" and data["config"]["blocks_to_load"] == 400
    report = data["report"]
    for attribute in attrs.fields(ReplayReport):
        assert attribute.name in report
    assert report["ok"] is True and report["corrupted_blocks"] == 0
    assert report["hits_by_tier"] == {"host": report["hit_blocks"]}
    for field in ("load_gbps", "store_gbps", "bytes_loaded", "bytes_stored", "prefill_saved_s"):
        assert report[field] > 0


def test_bad_options_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SMALL_ARGS, "--max-request-blocks", "4"])
    assert exc.value.code == 2
    assert "max_request_blocks = 4" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the pattern


def test_pattern_differs_between_keys_in_every_payload_word() -> None:
    layout = small_layout()
    gen = PatternGenerator(layout)
    keys = [block_key(b"", i, b"k") for i in range(64)]
    records = gen.records(keys)
    assert torch.equal(records, gen.records(keys))  # deterministic
    words = records[:, : layout.block_bytes].contiguous().view(torch.int32)
    same = (words.unsqueeze(0) == words.unsqueeze(1)).sum(dim=-1).fill_diagonal_(0)
    assert int(same.max()) == 0
    assert int(records[:, layout.block_bytes :].count_nonzero()) == 0  # padding is zero


def test_verification_catches_a_single_flipped_byte_and_a_wrong_key() -> None:
    layout = small_layout()
    gen = PatternGenerator(layout)
    keys = [block_key(b"", i, b"k") for i in range(6)]
    gen.write(range(6), keys)
    assert not gen.mismatches(range(6), keys).any()
    raw = layout.tensors["layer1"].view(torch.uint8)
    raw[1, 4, 0, 0, 7] ^= 1  # one byte of layer 1's V page of block 4
    assert gen.mismatches(range(6), keys).tolist() == [False] * 4 + [True, False]
    assert gen.mismatches(range(6), keys[1:] + keys[:1]).all()


def test_workload_shares_prefixes_and_continues_conversations() -> None:
    config = attrs.evolve(SMALL, continue_prob=0.5)
    first = [Workload(config).next_request() for _ in range(1)]
    workload = Workload(config)
    chains = [workload.next_request() for _ in range(300)]
    assert chains[0] == first[0]  # deterministic for a seed
    system = chains[0][: config.system_blocks]
    assert all(c[: config.system_blocks] == system for c in chains)
    assert all(len(c) <= config.max_request_blocks for c in chains)
    continued = [c for i, c in enumerate(chains) if any(c[: len(p)] == p and len(c) > len(p)
                                                       for p in chains[:i])]
    assert workload.continued > 0 and len(continued) >= workload.continued
    keys = [k for c in chains for k in c]
    assert all(len(k) == 16 for k in keys)
    assert len({c[-1] for c in chains}) == len(chains)  # every request ends in new blocks


# ------------------------------------------------------------------------------------ fault injection


class FlipLoadedByte(HostBackend):
    """Flips the first byte of every ``EVERY``-th page a load writes (after copying it)."""

    EVERY: ClassVar[int] = 97
    copies: ClassVar[int] = 0
    flips: ClassVar[int] = 0

    def copy_one(self, dst: int, src: int, size: int) -> None:
        super().copy_one(dst, src, size)
        if self.direction is Direction.LOAD:
            FlipLoadedByte.copies += 1
            if FlipLoadedByte.copies % self.EVERY == 0:
                byte = ctypes.c_uint8.from_address(dst)
                byte.value ^= 0xFF
                FlipLoadedByte.flips += 1


class SkipStoreCopy(HostBackend):
    """Reports every store as done without copying anything."""

    def copy_one(self, dst: int, src: int, size: int) -> None:
        if self.direction is not Direction.STORE:
            super().copy_one(dst, src, size)


class FailEveryThirdLoad(HostBackend):
    """Fails every third load job: copies its first page, then raises (a torn, failed copy)."""

    jobs: ClassVar[int] = 0

    def issue(self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> HostTicket:
        if self.direction is Direction.LOAD:
            FailEveryThirdLoad.jobs += 1
        return super().issue(plan, src, dst, fence)

    def copy_one(self, dst: int, src: int, size: int) -> None:
        super().copy_one(dst, src, size)
        if self.direction is Direction.LOAD and FailEveryThirdLoad.jobs % 3 == 0:
            raise TransferError("injected load failure")


class FailStores(HostBackend):
    """Fails every store copy."""

    def copy_one(self, dst: int, src: int, size: int) -> None:
        if self.direction is Direction.STORE:
            raise TransferError("injected store failure")
        super().copy_one(dst, src, size)


def test_a_flipped_byte_in_a_loaded_block_is_counted_and_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(FlipLoadedByte, "copies", 0)
    monkeypatch.setattr(FlipLoadedByte, "flips", 0)
    out = tmp_path / "replay.json"
    status = main([*SMALL_ARGS, "--blocks-to-load", "600", "--json", str(out)],
                  backend_factory=FlipLoadedByte)
    text = capsys.readouterr().out
    assert status == EXIT_FAILED
    assert FlipLoadedByte.flips > 0
    report = json.loads(out.read_text())["report"]
    assert report["corrupted_blocks"] == FlipLoadedByte.flips  # each flip lands in its own block
    assert report["ok"] is False and report["failed_load_jobs"] == 0
    assert "FAILED" in text and "corrupted blocks" in text


def test_a_store_that_copies_nothing_is_caught_when_its_blocks_are_loaded() -> None:
    report = run_replay(attrs.evolve(SMALL, blocks_to_load=300), backend_factory=SkipStoreCopy)
    assert report.verified_blocks > 0
    assert report.corrupted_blocks == report.verified_blocks  # every stale record is caught
    assert not report.ok and len(report.corrupted_examples) > 0


def test_a_wrong_host_block_from_the_scheduler_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = Manager.prepare_load

    def rotated(self: Manager, keys: list[bytes]) -> LoadPlan:
        plan = real(self, keys)
        return attrs.evolve(plan, blocks=plan.blocks[1:] + plan.blocks[:1])

    monkeypatch.setattr(Manager, "prepare_load", rotated)
    report = run_replay(attrs.evolve(SMALL, blocks_to_load=300))
    assert report.corrupted_blocks > 0 and not report.ok


def test_a_failed_load_is_a_recomputed_miss_never_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FailEveryThirdLoad, "jobs", 0)
    report = run_replay(attrs.evolve(SMALL, blocks_to_load=600), backend_factory=FailEveryThirdLoad)
    assert report.failed_load_jobs > 0 and report.failed_load_blocks > 0
    assert report.corrupted_blocks == 0 and report.unverified_blocks == 0
    # Hits are the verified loads only; the failed ones were recomputed like any miss.
    assert report.hit_blocks == report.verified_blocks == report.blocks_loaded
    assert report.lookup_blocks == report.hit_blocks + report.computed_blocks
    assert report.hit_rate < report.manager_hit_rate  # the manager counted them at lookup
    assert report.hits_by_tier == {"host": report.hit_blocks}
    assert not report.ok and "failed jobs" in "; ".join(report.failures())


def test_a_failed_store_never_becomes_loadable() -> None:
    report = run_replay(attrs.evolve(SMALL, requests=80), backend_factory=FailStores)
    assert report.requests == 80
    assert report.failed_store_jobs > 0 and report.store_failed_blocks > 0
    assert report.blocks_stored == 0
    assert report.load_jobs == 0 and report.hit_blocks == 0 and report.manager_hit_rate == 0.0
    assert report.corrupted_blocks == 0 and not report.ok
    assert report.events["store_failed"] == report.store_failed_blocks


def test_a_load_plan_that_stops_short_leaves_the_rest_to_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    # A remote tier on the project's in-memory store (the real services' runs are tests/remote).
    cluster = MemoryCluster()
    monkeypatch.setattr(replay_module, "remote_config",
                        lambda config: RemoteConfig(store=cluster.factory) if config.remote else None)
    real = Manager.prepare_load
    short: list[int] = []

    def counting(self: Manager, keys: list[bytes]) -> LoadPlan:
        plan = real(self, keys)
        if len(plan.keys) < len(keys):
            short.append(len(keys) - len(plan.keys))
        return plan

    monkeypatch.setattr(Manager, "prepare_load", counting)
    remote = attrs.evolve(SMALL, remote="redis", remote_address="127.0.0.1:1")
    assert_clean(run_replay(remote))  # instance A fills the store through its write-through puts
    # Instance B, with a host pool too small to read every remote hit into: plans stop short, and
    # the keys after the stop are misses the compute writes, never blocks left unwritten.
    report = run_replay(attrs.evolve(remote, host_blocks=8, seed=2))
    assert short, "no plan stopped short: the test proves nothing"
    assert report.hits_by_tier["remote"] > 0
    assert_clean(report)
    assert report.lookup_blocks == report.hit_blocks + report.computed_blocks
