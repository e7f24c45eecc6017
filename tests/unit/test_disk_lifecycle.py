"""DiskTier's lifecycle and input checks: shutdown drains in-flight I/O before the descriptor is closed
(exactly once), a stuck I/O thread keeps the descriptor open and the ShutdownError says so,
shutdown is idempotent and every later call raises ClosedError; bad configs, paths, record sizes,
block ids, job ids and conflicting requests raise typed errors and leave the tier unchanged.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvoffload.disk.config import PAGE_BYTES, DiskConfig, DiskErrorKind
from kvoffload.disk.tier import DiskTier
from kvoffload.errors import (
    ArgumentTypeError,
    BlockConflictError,
    BlockIdTypeError,
    ClosedError,
    DiskIOError,
    DiskPathError,
    DiskShutdownError,
    InvalidArgumentError,
    InvalidBlockIdError,
    JobIdError,
    KeyTypeError,
    ShutdownError,
    UnknownJobError,
    WaitTimeoutError,
)
from tests.unit.test_disk_support import (
    DISK_BLOCKS,
    FINGERPRINT,
    HOST_ROWS,
    RECORD,
    WAIT_S,
    FaultyTier,
    MakeTier,
    faulty,
    make_tier,
    one,
    region,
    snapshot,
    write_ok,
)

__all__ = ["make_tier", "region"]  # fixtures, from test_disk_support


def mmap_records(rows: int, record_bytes: int = RECORD) -> torch.Tensor:
    """An anonymous, page-aligned host pool (released by the garbage collector, not by a region)."""
    mapping = mmap.mmap(-1, rows * record_bytes)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(rows, record_bytes)


@pytest.fixture
def gated(make_tier: MakeTier) -> Iterator[FaultyTier]:
    """A tier whose writes wait at a gate (released at teardown at the latest)."""
    tier = faulty(make_tier, io_threads=1)
    tier.gate = threading.Event()
    yield tier
    tier.gate.set()


# ------------------------------------------------------------------------------------ shutdown


def test_shutdown_drains_in_flight_writes_before_closing_the_descriptor(
    make_tier: MakeTier, region: Any,
) -> None:
    tier = faulty(make_tier, io_threads=1, io_bytes=RECORD)
    tier.gate = threading.Event()
    tier.write(1, [0, 1, 2], [4, 5, 6])
    io = tier.write_records([3], [7])
    assert tier.entered.wait(WAIT_S)
    threading.Timer(0.2, tier.gate.set).start()
    tier.shutdown(timeout=WAIT_S)
    assert io.done() and io.ok
    stats = tier.stats()
    assert (stats.records_written, stats.write_failed, stats.in_flight) == (4, 0, 0)
    assert tier.thread_stopped and tier.closed
    again = make_tier(reuse=True)
    assert set(again.valid_blocks()) == {4, 5, 6, 7}


def test_the_descriptor_is_closed_exactly_once(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier = make_tier()
    fd = tier._fd
    closed: list[int] = []
    real_close = os.close

    def counting_close(number: int) -> None:
        if number == fd:
            closed.append(number)
        real_close(number)

    monkeypatch.setattr(os, "close", counting_close)
    tier.shutdown()
    tier.shutdown()
    assert closed == [fd]


def test_a_stuck_io_thread_keeps_the_descriptor_open_and_shutdown_says_so(tmp_path: Any) -> None:
    records = mmap_records(4)
    config = DiskConfig(str(tmp_path / "kv.bin"), num_blocks=8, io_threads=1)
    tier = FaultyTier.create(config, fingerprint=FINGERPRINT, record_bytes=RECORD, records=records)
    assert isinstance(tier, FaultyTier)
    gate = tier.gate = threading.Event()
    fd = tier._fd
    assert fd is not None
    try:
        tier.write(1, [0], [0])
        tier.write(2, [1], [1])  # queued behind the stuck call: abandoned
        assert tier.entered.wait(WAIT_S)
        with pytest.raises(DiskShutdownError, match="kept open") as info:
            tier.shutdown(timeout=0.2)
        assert info.value.fd_left_open and isinstance(info.value, ShutdownError)
        assert any(isinstance(f, WaitTimeoutError) for f in info.value.failures)
        assert not tier.thread_stopped
        os.fstat(fd)  # still open: the stuck thread may still use it
        tier.shutdown()  # idempotent, even after a failed shutdown
        with pytest.raises(ClosedError):
            tier.poll()
    finally:
        gate.set()
        for thread in tier._stages._threads:
            thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in tier._stages._threads)
    os.close(fd)  # the test's job now: the tier never closes a descriptor it left open


def test_shutdown_is_idempotent_and_every_later_call_raises_closed(make_tier: MakeTier) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0], [4])
    tier.shutdown()
    tier.shutdown()
    calls: list[Callable[[], object]] = [
        lambda: tier.write(2, [0], [5]),
        lambda: tier.read(3, [4], [1]),
        lambda: tier.write_records([0], [5]),
        lambda: tier.read_records([4], [1]),
        tier.poll,
        lambda: tier.wait([1], 1.0),
        tier.valid_blocks,
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            call()
    assert tier.stats().records_written == 1  # statistics stay readable
    assert tier.capabilities().num_blocks == DISK_BLOCKS


def test_a_malformed_shutdown_timeout_changes_nothing(make_tier: MakeTier) -> None:
    tier = make_tier()
    with pytest.raises(InvalidArgumentError):
        tier.shutdown(timeout=-1.0)
    assert not tier.closed
    write_ok(tier, 1, [0], [4])


def test_wait_passes_its_deadline_with_the_pending_ids_and_the_job_stays_in_flight(
    gated: FaultyTier,
) -> None:
    gated.write(1, [0], [4])
    with pytest.raises(WaitTimeoutError) as info:
        gated.wait([1], 0.05)
    assert info.value.pending == (1,)
    assert gated.gate is not None
    gated.gate.set()
    assert one(gated, 1).ok


# --------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_blocks": 0}, InvalidArgumentError, "num_blocks = 0"),
        ({"num_blocks": True}, ArgumentTypeError, "num_blocks"),
        ({"num_blocks": "8"}, ArgumentTypeError, "num_blocks"),
        ({"io_threads": 0}, InvalidArgumentError, "io_threads = 0"),
        ({"checksum_threads": 0}, InvalidArgumentError, "checksum_threads = 0"),
        ({"io_bytes": 1000}, InvalidArgumentError, "io_bytes = 1000"),
        ({"io_bytes": 4096 + 512}, InvalidArgumentError, "multiple of 4096"),
        ({"direct": "yes"}, ArgumentTypeError, "direct"),
        ({"reuse": 1}, ArgumentTypeError, "reuse"),
        ({"recreate": True}, InvalidArgumentError, "only applies with reuse"),
        ({"path": 3}, ArgumentTypeError, "path"),
        ({"path": ""}, InvalidArgumentError, "path"),
    ],
)
def test_config_refuses_bad_values_with_typed_errors(
    kwargs: dict[str, Any], error: type[Exception], match: str,
) -> None:
    base: dict[str, Any] = {"path": "/tmp/kv.bin", "num_blocks": 8}
    with pytest.raises(error, match=match):
        DiskConfig(**{**base, **kwargs})


def test_config_accepts_a_path_like(tmp_path: Any) -> None:
    assert DiskConfig(tmp_path / "kv.bin", num_blocks=1).path == str(tmp_path / "kv.bin")


def test_a_path_that_is_a_directory_is_refused(make_tier: MakeTier, tmp_path: Any) -> None:
    with pytest.raises(DiskPathError, match="is a directory"):
        make_tier(path=str(tmp_path))


def test_a_path_whose_parent_is_missing_is_refused(make_tier: MakeTier, tmp_path: Any) -> None:
    with pytest.raises(DiskPathError, match="does not exist"):
        make_tier(path=str(tmp_path / "missing" / "kv.bin"))


def test_a_path_that_is_not_a_regular_file_is_refused(make_tier: MakeTier, tmp_path: Any) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(DiskPathError, match="not a regular file"):
        make_tier(path=str(fifo))


def test_a_file_that_cannot_be_sized_is_reported_by_create_and_removed(tmp_path: Any) -> None:
    path = tmp_path / "huge.bin"
    config = DiskConfig(str(path), num_blocks=1 << 33)  # 160 TiB of 16 KiB records
    with pytest.raises(DiskIOError, match="cannot size") as info:
        DiskTier.create(config, fingerprint=FINGERPRINT, record_bytes=RECORD, records=mmap_records(2))
    assert info.value.kind in (DiskErrorKind.ENOSPC, DiskErrorKind.OS_ERROR)
    assert not path.exists()


@pytest.mark.parametrize("record_bytes", [5000, 0, PAGE_BYTES + 1])
def test_unaligned_record_sizes_are_refused(tmp_path: Any, record_bytes: int) -> None:
    records = mmap_records(2)
    with pytest.raises(InvalidArgumentError, match="record_bytes"):
        DiskTier.create(DiskConfig(str(tmp_path / "kv.bin"), num_blocks=4), fingerprint=FINGERPRINT,
                        record_bytes=record_bytes, records=records)
    assert not (tmp_path / "kv.bin").exists()


def test_records_that_do_not_fit_o_direct_are_refused(tmp_path: Any) -> None:
    config = DiskConfig(str(tmp_path / "kv.bin"), num_blocks=4)
    flat = torch.frombuffer(mmap.mmap(-1, 4 * RECORD), dtype=torch.uint8)
    cases: list[tuple[object, str]] = [
        (flat[16 : 16 + 2 * RECORD].view(2, RECORD), "multiple of 4096"),
        (flat[: 2 * RECORD].view(4, RECORD // 2), "shape"),
        (flat.as_strided((2, RECORD), (RECORD + 16, 1)), "contiguous and 4096-aligned"),
        (flat.as_strided((2, RECORD), (RECORD // 2, 1)), "contiguous and 4096-aligned"),
        (flat[: 2 * RECORD].view(2, RECORD).t(), "shape"),
        (flat[: 2 * RECORD].view(torch.int16).view(2, RECORD // 2), "uint8"),
        (flat[: 2 * RECORD].view(2, RECORD).tolist(), "torch.Tensor"),
    ]
    for records, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            DiskTier.create(config, fingerprint=FINGERPRINT, record_bytes=RECORD,
                            records=records)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="fingerprint"):
        DiskTier.create(config, fingerprint="", record_bytes=RECORD, records=flat.view(4, RECORD))


def assert_unchanged(tier: DiskTier, before: tuple[object, ...]) -> None:
    assert (tier.stats(), tier.valid_blocks(), tier.poll()) == before


def state(tier: DiskTier) -> tuple[object, ...]:
    return (tier.stats(), tier.valid_blocks(), [])


def test_bad_block_ids_are_refused_and_nothing_changes(make_tier: MakeTier) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0], [4])
    before = state(tier)
    with pytest.raises(InvalidBlockIdError, match=rf"disk_blocks\[1\] = {DISK_BLOCKS} is out of range"):
        tier.write(2, [0, 1], [5, DISK_BLOCKS])
    with pytest.raises(InvalidBlockIdError, match=r"host_blocks\[0\] = -1"):
        tier.read(3, [4], [-1])
    with pytest.raises(InvalidBlockIdError, match=rf"host_rows\[0\] = {HOST_ROWS}"):
        tier.write_records([HOST_ROWS], [5])
    with pytest.raises(BlockIdTypeError):
        tier.read_records([4.0], [1])  # type: ignore[list-item]
    with pytest.raises(InvalidBlockIdError, match="equal lengths"):
        tier.write(4, [0, 1], [5])
    assert_unchanged(tier, before)
    with pytest.raises(UnknownJobError):
        tier.wait([2], 1.0)


def test_duplicate_destinations_are_refused(make_tier: MakeTier) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0, 1], [4, 5])
    before = state(tier)
    with pytest.raises(InvalidBlockIdError, match=r"disk_blocks\[1\] = 6 repeats"):
        tier.write(2, [0, 1], [6, 6])
    with pytest.raises(InvalidBlockIdError, match=r"host_blocks\[1\] = 9 repeats"):
        tier.read(3, [4, 5], [9, 9])
    assert_unchanged(tier, before)


def test_a_job_id_in_flight_or_unreturned_is_refused(gated: FaultyTier) -> None:
    gated.write(1, [0], [4])
    with pytest.raises(JobIdError, match="job 1 is already in flight"):
        gated.read(1, [9], [3])
    with pytest.raises(JobIdError, match="must be an int"):
        gated.write("2", [0], [5])  # type: ignore[arg-type]
    assert gated.gate is not None
    gated.gate.set()
    gated.write(2, [1], [5])
    assert one(gated, 2).ok
    with pytest.raises(JobIdError):
        gated.write(1, [2], [6])  # finished but not yet returned
    assert one(gated, 1).ok
    gated.write(1, [2], [6])  # returned: the id is free again
    assert one(gated, 1).ok


def test_requests_on_disk_blocks_in_flight_are_refused(gated: FaultyTier) -> None:
    gated.write(1, [0, 1], [4, 5])
    before_requests = gated.stats().write_requests
    with pytest.raises(BlockConflictError, match=r"disk_blocks\[1\] = 5 is being written"):
        gated.read(2, [6, 5], [3, 4])
    with pytest.raises(BlockConflictError, match="being written"):
        gated.write_records([2], [4])
    gated.read(3, [9], [3])  # other blocks are free (it fails: never written, but it runs)
    assert gated.stats().write_requests == before_requests
    assert gated.gate is not None
    gated.gate.set()
    assert one(gated, 1).ok
    gated.read(2, [6, 5], [3, 4])  # no longer in flight
    assert not one(gated, 3).ok


def test_a_write_onto_a_block_being_read_is_refused(make_tier: MakeTier) -> None:
    tier = faulty(make_tier, io_threads=1)
    write_ok(tier, 1, [0], [4])
    hold = threading.Event()
    tier.gate = hold  # holds the next write; the read below queues behind it on the one I/O thread
    tier.write_records([1], [8])
    assert tier.entered.wait(WAIT_S)
    tier.read(2, [4], [10])
    with pytest.raises(BlockConflictError, match="being read"):
        tier.write(3, [2], [4])
    hold.set()
    assert one(tier, 2).ok


def test_keys_are_checked(make_tier: MakeTier) -> None:
    tier = make_tier()
    with pytest.raises(KeyTypeError, match=r"keys\[1\]"):
        tier.write(1, [0, 1], [4, 5], keys=[b"a", "b"])  # type: ignore[list-item]
    with pytest.raises(KeyTypeError):
        tier.write(1, [0], [4], keys=b"a")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="keys has 1 entries"):
        tier.write(1, [0, 1], [4, 5], keys=[b"a"])
    with pytest.raises(InvalidArgumentError, match="at most 1024"):
        tier.write(1, [0], [4], keys=[b"x" * 1025])
    assert tier.stats().write_requests == 0


def test_failed_read_never_leaves_stale_destination_bytes(make_tier: MakeTier, region: Any) -> None:
    tier = make_tier()
    before = snapshot(region)
    assert int(before[10].count_nonzero()) > 0
    tier.read(1, [33], [10])  # never written
    assert not one(tier, 1).ok
    assert int(region.records()[10].count_nonzero()) == 0
