"""DiskTier on real files: bit-exact round trips, the file format (one aligned call per run of
records), every failure kind reported as ``ok=False`` with its kind counted and nothing
invalid served, warm restart, recreate, and direct/buffered I/O.

Faults are injected by subclassing the tier (``FaultyTier`` overrides ``_pread``/``_pwrite``) or by
damaging the file on disk directly. Host rows come from a real ``RegionOwner`` with ``NoPinner``.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import select
import struct
import threading
import time
import types
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvoffload.disk.config import PAGE_BYTES, DiskConfig, DiskErrorKind
from kvoffload._record import HEADER_CRC_OFFSET, RECORD_HEADER
from kvoffload.disk.index import MAX_GENERATION
from kvoffload.disk.requests import DiskIO
from kvoffload.disk.tier import DiskTier
from kvoffload.disk import format as disk_format
from kvoffload.disk import tier as disk_tier
from kvoffload.errors import (
    DiskError, DiskFormatError, DiskInUseError, DiskIntegrityError, DiskIOError, DiskShutdownError,
)
from kvoffload.records import Direction
from kvoffload.region import RegionOwner
from tests.unit.test_disk_support import (
    DISK_BLOCKS,
    FINGERPRINT,
    RECORD,
    SLOT,
    WAIT_S,
    Fault,
    MakeTier,
    faulty,
    flip_byte,
    make_tier,
    one,
    raise_errno,
    region,
    short_call,
    slot_offset,
    snapshot,
    torn_header,
    torn_payload,
    write_ok,
)

__all__ = ["make_tier", "region"]  # fixtures, from test_disk_support


# ---------------------------------------------------------------------------------- round trips


def test_write_then_read_round_trips_bit_exact(make_tier: MakeTier, region: RegionOwner) -> None:
    tier = make_tier(io_bytes=2 * RECORD)
    before = snapshot(region)
    rows = [0, 1, 2, 3, 4, 5, 6, 7]
    blocks = [10, 11, 12, 40, 3, 4, 63, 20]  # runs and scattered blocks, out of order
    write_ok(tier, 1, rows, blocks)
    targets = [16, 17, 18, 19, 20, 21, 22, 23]
    tier.read(2, blocks[::-1], targets)
    result = one(tier, 2)
    assert result.ok and result.direction is Direction.PROMOTE and result.path == "disk-direct"
    assert result.nbytes == len(rows) * RECORD
    after = region.records()
    for row, target in zip(rows[::-1], targets):
        assert torch.equal(after[target], before[row])
    assert torch.equal(after[:16], before[:16])  # sources are never written


def test_valid_blocks_lists_written_records_with_increasing_generations_and_keys(
    make_tier: MakeTier,
) -> None:
    tier = make_tier()
    tier.write(1, [0, 1], [5, 6], keys=[b"alpha", b"beta"])
    assert one(tier, 1).ok
    tier.write(2, [2], [5])
    assert one(tier, 2).ok
    index = tier.valid_blocks()
    assert set(index) == {5, 6}
    assert index[6].key == b"beta" and index[5].key == b""  # the rewrite replaced the key
    assert index[5].generation > index[6].generation > 0


def test_contiguous_disk_blocks_go_out_in_one_aligned_call_per_io_bytes(make_tier: MakeTier) -> None:
    tier = faulty(make_tier, io_bytes=2 * RECORD)
    write_ok(tier, 1, [0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 30])
    writes = sorted(c for c in tier.calls if c[0] == "write")
    assert [c[1] for c in writes] == [slot_offset(7), slot_offset(9), slot_offset(11), slot_offset(30)]
    assert [len(c[2]) for c in writes] == [4, 4, 2, 2]  # [header, payload] per record
    for _, offset, sizes in writes:
        assert offset % PAGE_BYTES == 0
        assert sizes == [PAGE_BYTES, RECORD] * (len(sizes) // 2)


def test_host_rows_need_not_be_contiguous_for_one_call(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = faulty(make_tier)
    before = snapshot(region)
    write_ok(tier, 1, [9, 2, 30, 4], [0, 1, 2, 3])
    assert len([c for c in tier.calls if c[0] == "write"]) == 1
    tier.read(2, [0, 1, 2, 3], [5, 6, 7, 8])
    assert one(tier, 2).ok
    assert len([c for c in tier.calls if c[0] == "read"]) == 1
    for src, dst in zip([9, 2, 30, 4], [5, 6, 7, 8]):
        assert torch.equal(region.records()[dst], before[src])


def test_one_disk_block_read_into_two_rows_of_one_job(make_tier: MakeTier, region: RegionOwner) -> None:
    tier = make_tier()
    before = snapshot(region)
    write_ok(tier, 1, [3], [8])
    tier.read(2, [8, 8], [10, 11])
    assert one(tier, 2).ok
    assert torch.equal(region.records()[10], before[3]) and torch.equal(region.records()[11], before[3])


def test_records_handles_complete_and_release_rows(make_tier: MakeTier, region: RegionOwner) -> None:
    tier = make_tier()
    before = snapshot(region)
    io = tier.write_records([0, 1, 2], [20, 21, 22], keys=[b"a", b"b", b"c"])
    assert isinstance(io, DiskIO) and io.wait(WAIT_S) and io.ok and io.failed == ()
    io = tier.read_records([22, 21, 20], [12, 13, 14])
    assert io.wait(WAIT_S) and io.ok and io.error is None
    for src, dst in zip([2, 1, 0], [12, 13, 14]):
        assert torch.equal(region.records()[dst], before[src])
    assert tier.poll() == []  # handles are not jobs: nothing is polled
    stats = tier.stats()
    assert (stats.write_requests, stats.read_requests, stats.records_written, stats.records_read) == (
        1, 1, 3, 3)
    assert stats.bytes_written == stats.bytes_read == 3 * RECORD


def test_results_come_back_once_through_poll_or_wait(make_tier: MakeTier) -> None:
    tier = make_tier()
    tier.write(1, [0], [0])
    tier.write(2, [1], [1])
    tier.write(3, [], [])
    assert one(tier, 2).ok
    assert tier.wait([1], WAIT_S)[0].job_id == 1
    results = tier.poll()
    assert [(r.job_id, r.ok, r.path, r.nbytes) for r in results] == [(3, True, "none", 0)]
    assert tier.poll() == []


def test_concurrent_submitters_round_trip_bit_exact(make_tier: MakeTier, region: RegionOwner) -> None:
    tier = make_tier(io_threads=3, checksum_threads=2, io_bytes=2 * RECORD)
    before = snapshot(region)
    failures: list[BaseException] = []

    def submitter(k: int) -> None:
        rng = random.Random(k)
        sources, targets = list(range(8 * k, 8 * k + 4)), list(range(8 * k + 4, 8 * k + 8))
        try:
            for step in range(12):
                blocks = rng.sample(range(16 * k, 16 * k + 16), 4)
                if step % 2:
                    io = tier.write_records(sources, blocks)
                    assert io.wait(WAIT_S) and io.ok, io.error
                    io = tier.read_records(blocks[::-1], targets)
                    assert io.wait(WAIT_S) and io.ok, io.error
                else:
                    job = 1000 * k + 2 * step
                    tier.write(job, sources, blocks)
                    assert one(tier, job).ok
                    tier.read(job + 1, blocks[::-1], targets)
                    assert one(tier, job + 1).ok
                for source, target in zip(sources[::-1], targets):
                    assert torch.equal(region.records()[target], before[source])
        except BaseException as exc:  # re-raised by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not failures, failures[0]
    stats = tier.stats()
    assert (stats.write_requests, stats.read_requests, stats.in_flight) == (48, 48, 0)
    assert stats.records_written == stats.records_read == 4 * 48


# -------------------------------------------------------------------------- integrity failures


def test_flipped_payload_byte_fails_with_checksum_mismatch_and_zero_fills_only_that_row(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    before = snapshot(region)
    write_ok(tier, 1, [0, 1], [4, 5])
    flip_byte(tier.path, slot_offset(5) + PAGE_BYTES + 1000)
    tier.read(2, [4, 5], [10, 11])
    result = one(tier, 2)
    assert not result.ok
    assert isinstance(result.error, DiskIntegrityError)
    assert result.error.kind == DiskErrorKind.CHECKSUM_MISMATCH and result.error.blocks == (5,)
    assert torch.equal(region.records()[10], before[0])  # the block that verified
    assert int(region.records()[11].count_nonzero()) == 0  # never the damaged bytes
    assert tier.stats().checksum_mismatches == 1 and tier.stats().read_failed == 1
    assert 5 not in tier.valid_blocks()  # never served again


def test_flipped_header_byte_fails_with_header_invalid(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0], [4])
    flip_byte(tier.path, slot_offset(4) + 40)
    tier.read(2, [4], [10])
    result = one(tier, 2)
    assert not result.ok and isinstance(result.error, DiskIntegrityError)
    assert result.error.kind == DiskErrorKind.HEADER_INVALID
    assert int(region.records()[10].count_nonzero()) == 0
    assert tier.stats().failures("header_invalid") == 1


def test_a_record_moved_to_another_slot_is_never_served_as_that_block(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0, 1], [4, 9])
    with open(tier.path, "r+b") as f:  # slot 4's bytes (valid, verified record) land in slot 9
        f.seek(slot_offset(4))
        moved = f.read(SLOT)
        f.seek(slot_offset(9))
        f.write(moved)
    tier.read(2, [9], [10])
    result = one(tier, 2)
    assert not result.ok and isinstance(result.error, DiskIntegrityError)
    assert result.error.kind == DiskErrorKind.BLOCK_MISMATCH
    assert int(region.records()[10].count_nonzero()) == 0
    assert tier.stats().block_mismatches == 1


def test_a_stale_record_is_refused_as_a_generation_mismatch(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0], [4])
    with open(tier.path, "rb") as f:
        f.seek(slot_offset(4))
        old = f.read(SLOT)
    write_ok(tier, 2, [1], [4])
    with open(tier.path, "r+b") as f:  # the older write resurfaces (a lost write, a stale cache)
        f.seek(slot_offset(4))
        f.write(old)
    tier.read(3, [4], [10])
    result = one(tier, 3)
    assert not result.ok and isinstance(result.error, DiskIntegrityError)
    assert result.error.kind == DiskErrorKind.GENERATION_MISMATCH
    assert int(region.records()[10].count_nonzero()) == 0
    assert tier.stats().generation_mismatches == 1


def test_reading_a_block_never_written_fails_not_valid(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    io = tier.read_records([0, 1], [10, 11])
    assert io.wait(WAIT_S) and not io.ok and io.failed == (0, 1)
    assert isinstance(io.error, DiskIntegrityError) and io.error.kind == DiskErrorKind.NOT_VALID
    assert int(region.records()[10:12].count_nonzero()) == 0
    assert tier.stats().not_valid == 2


@pytest.mark.parametrize("fault", [torn_payload, torn_header], ids=["torn-payload", "torn-header"])
def test_a_torn_write_never_verifies(make_tier: MakeTier, region: RegionOwner, fault: Fault) -> None:
    tier = faulty(make_tier)
    write_ok(tier, 1, [0], [4])
    tier.write_faults = [fault]
    write_ok(tier, 2, [1], [4])  # the kernel "said" it wrote everything: the tier cannot know
    tier.read(3, [4], [10])
    result = one(tier, 3)
    assert not result.ok and isinstance(result.error, DiskIntegrityError)
    assert result.error.kind in (DiskErrorKind.CHECKSUM_MISMATCH, DiskErrorKind.GENERATION_MISMATCH)
    assert int(region.records()[10].count_nonzero()) == 0


def test_checksum_off_skips_the_payload_check_but_not_the_header_checks(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier(checksum=False)
    assert tier.checksum_threads == 0
    write_ok(tier, 1, [0, 1], [4, 5])
    flip_byte(tier.path, slot_offset(4) + PAGE_BYTES + 7)
    flip_byte(tier.path, slot_offset(5) + 40)
    tier.read(2, [4], [10])
    assert one(tier, 2).ok  # unverifiable by design: checksum=False
    tier.read(3, [5], [11])
    result = one(tier, 3)
    assert not result.ok and isinstance(result.error, DiskError)
    assert result.error.kind == DiskErrorKind.HEADER_INVALID


# ------------------------------------------------------------------------------ system-call faults


def test_a_truncated_file_fails_the_read_with_a_short_read(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0, 1], [4, 5])
    os.truncate(tier.path, slot_offset(5) + PAGE_BYTES + RECORD // 2)
    tier.read(2, [4, 5], [10, 11])
    result = one(tier, 2)
    assert not result.ok and isinstance(result.error, DiskIOError)
    assert result.error.kind == DiskErrorKind.SHORT_READ and result.error.blocks == (4, 5)
    assert int(region.records()[10:12].count_nonzero()) == 0  # every row of the short call
    assert tier.stats().short_reads == 1


@pytest.mark.parametrize(
    ("fault", "kind"),
    [(raise_errno(errno.EIO), DiskErrorKind.EIO), (short_call, DiskErrorKind.SHORT_READ),
     (raise_errno(errno.EBADMSG), DiskErrorKind.OS_ERROR)],
    ids=["eio", "short", "other-errno"],
)
def test_a_failed_read_call_fails_the_job_zero_fills_its_rows_and_unlists_its_blocks(
    make_tier: MakeTier, region: RegionOwner, fault: Fault, kind: DiskErrorKind,
) -> None:
    tier = faulty(make_tier, io_threads=1)  # one I/O thread: calls in queue order
    before = snapshot(region)
    write_ok(tier, 1, [0, 1, 2], [4, 5, 9])
    tier.read_faults = [fault]  # the first call: the run 4..5; block 9 is read by a second call
    tier.read(2, [4, 5, 9], [10, 11, 12])
    result = one(tier, 2)
    assert not result.ok and isinstance(result.error, DiskIOError) and result.error.kind == kind
    assert int(region.records()[10:12].count_nonzero()) == 0
    assert torch.equal(region.records()[12], before[2])
    assert tier.stats().failures(kind) == 1
    assert set(tier.valid_blocks()) == {9}  # the index never lists a block that failed a read


@pytest.mark.parametrize(
    ("fault", "kind"),
    [(raise_errno(errno.EIO), DiskErrorKind.EIO), (raise_errno(errno.ENOSPC), DiskErrorKind.ENOSPC),
     (short_call, DiskErrorKind.SHORT_WRITE), (raise_errno(errno.EROFS), DiskErrorKind.OS_ERROR)],
    ids=["eio", "enospc", "short", "other-errno"],
)
def test_a_failed_write_leaves_the_block_invalid_and_never_served(
    make_tier: MakeTier, region: RegionOwner, fault: Fault, kind: DiskErrorKind,
) -> None:
    tier = faulty(make_tier)
    write_ok(tier, 1, [0], [4])  # an older, valid record of the block
    tier.write_faults = [fault]
    tier.write(2, [1], [4])
    result = one(tier, 2)
    assert not result.ok and isinstance(result.error, DiskIOError)
    assert result.error.kind == kind and result.error.blocks == (4,)
    assert tier.stats().failures(kind) == 1 and tier.stats().write_failed == 1
    assert 4 not in tier.valid_blocks()
    tier.read(3, [4], [10])
    read = one(tier, 3)
    assert not read.ok and isinstance(read.error, DiskIntegrityError)
    assert read.error.kind == DiskErrorKind.NOT_VALID  # neither the old record nor a torn one
    assert int(region.records()[10].count_nonzero()) == 0


def test_a_failed_write_zeroes_the_slot_header_so_a_restart_does_not_revive_it(
    make_tier: MakeTier, tmp_path: Any,
) -> None:
    tier = faulty(make_tier)
    write_ok(tier, 1, [0, 1], [4, 5])
    tier.write_faults = [raise_errno(errno.EIO)]
    tier.write(2, [2], [4])
    assert not one(tier, 2).ok
    tier.shutdown()
    again = make_tier(reuse=True)
    assert set(again.valid_blocks()) == {5}


def test_one_failed_call_fails_the_whole_job_but_the_other_records_land(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = faulty(make_tier, io_bytes=RECORD)
    tier.write_faults = [None, raise_errno(errno.ENOSPC)]
    tier.write(1, [0, 1, 2], [4, 5, 6])
    result = one(tier, 1)
    assert not result.ok and isinstance(result.error, DiskIOError)
    assert result.error.kind == DiskErrorKind.ENOSPC
    assert len(tier.valid_blocks()) == 2  # the job failed as a whole; the index is per record


# ------------------------------------------------------------------------------- warm restart


def test_warm_restart_lists_the_records_and_reads_them_bit_exact(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    before = snapshot(region)
    tier.write(1, [0, 1, 2], [7, 8, 50], keys=[b"k0", b"k1", b"k2"])
    assert one(tier, 1).ok
    listed = tier.valid_blocks()
    tier.shutdown()
    again = make_tier(reuse=True)
    caps = again.capabilities()
    assert caps.reused and not caps.recreated and caps.indexed_records == 3
    assert again.valid_blocks() == listed
    again.read(2, [7, 8, 50], [20, 21, 22])
    assert one(again, 2).ok
    for src, dst in zip([0, 1, 2], [20, 21, 22]):
        assert torch.equal(region.records()[dst], before[src])
    again.write(3, [3], [9])
    assert one(again, 3).ok
    assert again.valid_blocks()[9].generation > max(info.generation for info in listed.values())


def test_warm_restart_does_not_index_damaged_headers(make_tier: MakeTier) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0, 1, 2], [7, 8, 9])
    tier.shutdown()
    flip_byte(tier.path, slot_offset(8) + 20)
    again = make_tier(reuse=True)
    assert set(again.valid_blocks()) == {7, 9}
    assert again.capabilities().rejected_records == 1


@pytest.mark.parametrize("generation", [2**64 - 1, 2**63, MAX_GENERATION + 1])
def test_a_header_past_the_highest_generation_is_rejected_and_writes_go_on(
    make_tier: MakeTier, generation: int,
) -> None:
    """(One header with a generation near 2**64 and a valid CRC — forged, or a fault no check could
    see — was taken as the newest: every later write of every restart failed with an untyped
    struct.error. Found by fuzzing the format.)"""
    tier = make_tier()
    write_ok(tier, 1, [0, 1], [7, 8])
    tier.shutdown()
    with open(tier.path, "r+b") as f:
        f.seek(slot_offset(8))
        page = bytearray(f.read(PAGE_BYTES))
        fields = list(RECORD_HEADER.unpack_from(page, 0))
        fields[5] = generation
        RECORD_HEADER.pack_into(page, 0, *fields)
        struct.pack_into("<I", page, HEADER_CRC_OFFSET, zlib.crc32(bytes(page[:HEADER_CRC_OFFSET])))
        f.seek(slot_offset(8))
        f.write(page)
    again = make_tier(reuse=True)
    assert set(again.valid_blocks()) == {7} and again.capabilities().rejected_records == 1
    write_ok(again, 2, [2], [9])
    assert again.valid_blocks()[9].generation < MAX_GENERATION


def test_warm_restart_indexes_by_header_and_verifies_payloads_on_read(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0], [7])
    tier.shutdown()
    flip_byte(tier.path, slot_offset(7) + PAGE_BYTES + 3)
    again = make_tier(reuse=True)
    assert 7 in again.valid_blocks()  # lazily verified
    again.read(2, [7], [20])
    result = one(again, 2)
    assert not result.ok and isinstance(result.error, DiskIntegrityError)
    assert result.error.kind == DiskErrorKind.CHECKSUM_MISMATCH
    assert 7 not in again.valid_blocks()


def test_reuse_of_another_fingerprint_is_refused_and_recreate_replaces_the_file(
    make_tier: MakeTier,
) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0], [7])
    tier.shutdown()
    with pytest.raises(DiskFormatError, match="another layout") as info:
        make_tier(reuse=True, fingerprint="layout-b")
    assert info.value.kind == DiskErrorKind.FINGERPRINT_MISMATCH
    recreated = make_tier(reuse=True, recreate=True, fingerprint="layout-b")
    caps = recreated.capabilities()
    assert caps.recreated and not caps.reused and "another layout" in caps.note
    assert recreated.valid_blocks() == {} and recreated.stats().fingerprint_mismatches == 1
    recreated.shutdown()
    back = make_tier(reuse=True, fingerprint="layout-b")  # the new fingerprint is now the file's
    assert back.capabilities().reused


@pytest.mark.parametrize(
    ("field", "value"), [("num_blocks", DISK_BLOCKS + 1), ("record_bytes", 2 * RECORD)]
)
def test_reuse_of_another_geometry_is_refused(
    make_tier: MakeTier, region: RegionOwner, tmp_path: Any, field: str, value: int,
) -> None:
    make_tier().shutdown()
    kwargs: dict[str, Any] = {"reuse": True, "path": str(tmp_path / "kv.bin")}
    if field == "num_blocks":
        kwargs["num_blocks"] = value
        with pytest.raises(DiskFormatError) as info:
            make_tier(**kwargs)
    else:
        records = torch.frombuffer(mmap.mmap(-1, 2 * value), dtype=torch.uint8).view(2, value)
        with pytest.raises(DiskFormatError) as info:
            DiskTier.create(DiskConfig(**kwargs, num_blocks=DISK_BLOCKS), fingerprint=FINGERPRINT,
                            record_bytes=value, records=records)
    assert info.value.kind == DiskErrorKind.GEOMETRY_MISMATCH


def test_a_file_that_is_not_a_tier_is_never_overwritten(make_tier: MakeTier, tmp_path: Any) -> None:
    path = tmp_path / "precious.txt"
    path.write_bytes(b"not a cache\n" * 1000)
    for config in ({}, {"reuse": True, "recreate": True}):
        with pytest.raises(DiskFormatError, match="never overwritten") as info:
            make_tier(path=str(path), **config)
        assert info.value.kind == DiskErrorKind.NOT_A_TIER
    assert path.read_bytes() == b"not a cache\n" * 1000


def test_without_reuse_an_existing_tier_file_is_recreated_empty(make_tier: MakeTier) -> None:
    tier = make_tier()
    write_ok(tier, 1, [0], [7])
    tier.shutdown()
    fresh = make_tier()
    assert fresh.valid_blocks() == {} and fresh.capabilities().recreated


def test_reuse_of_a_missing_file_creates_it(make_tier: MakeTier, tmp_path: Any) -> None:
    tier = make_tier(reuse=True, path=str(tmp_path / "new.bin"))
    caps = tier.capabilities()
    assert not caps.reused and not caps.recreated and os.path.getsize(caps.path) == caps.file_bytes


def test_reuse_of_a_cut_short_file_extends_it_and_lists_only_whole_records(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier()
    before = snapshot(region)
    write_ok(tier, 1, [0, 1, 2], [4, 5, 6])
    tier.shutdown()
    os.truncate(tier.path, slot_offset(5) + PAGE_BYTES + 100)  # block 5's payload cut, 6 gone
    again = make_tier(reuse=True)
    assert "extended" in again.capabilities().note
    assert os.path.getsize(again.path) == again.capabilities().file_bytes
    assert set(again.valid_blocks()) == {4}  # block 5's header is intact, its payload is not
    assert again.capabilities().rejected_records == 1
    again.read(2, [4], [10])
    assert one(again, 2).ok and torch.equal(region.records()[10], before[0])
    again.read(3, [5], [11])
    result = one(again, 3)
    assert not result.ok and isinstance(result.error, DiskIntegrityError)
    assert result.error.kind == DiskErrorKind.NOT_VALID and result.error.blocks == (5,)


def test_a_cut_records_header_is_cleared_before_the_file_is_extended(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The extension fills a cut payload's tail with zeros: the next restart must not list it."""
    for clear in (True, False):  # the control leaves the cut record's header as it was
        if not clear:
            monkeypatch.setattr(disk_format, "_clear_cut_record", lambda *args: 0)
        tier = make_tier(checksum=False)
        write_ok(tier, 1, [0, 1], [4, 5])
        tier.shutdown()
        os.truncate(tier.path, slot_offset(5) + PAGE_BYTES + 100)  # block 5's payload cut
        first = make_tier(reuse=True, checksum=False)
        assert set(first.valid_blocks()) == {4}
        first.shutdown()
        second = make_tier(reuse=True, checksum=False)  # the file is whole again
        assert (5 in second.valid_blocks()) is not clear, clear
        second.shutdown()


def test_a_tier_that_checks_checksums_does_not_list_records_written_without_one(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier(checksum=False)
    write_ok(tier, 1, [0, 1], [4, 5])
    tier.shutdown()
    flip_byte(tier.path, slot_offset(4) + PAGE_BYTES + 7)  # a payload no checksum can catch
    checked = make_tier(reuse=True, checksum=True)
    assert checked.valid_blocks() == {} and checked.capabilities().rejected_records == 2
    checked.read(2, [4], [10])
    result = one(checked, 2)
    assert not result.ok and isinstance(result.error, DiskIntegrityError)
    checked.shutdown()
    unchecked = make_tier(reuse=True, checksum=False)  # the control: the same file, no checks
    assert set(unchecked.valid_blocks()) == {4, 5}


def test_a_tier_without_checksums_still_verifies_records_written_with_one(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    """A tier with checksum=False reads records a checksum=True tier wrote (cut by a crash, or
    flipped): their CRC is checked (it was skipped, and a damaged payload served with ok=True)."""
    tier = make_tier(checksum=True)
    write_ok(tier, 1, [0, 1], [4, 5])
    tier.shutdown()
    flip_byte(tier.path, slot_offset(4) + PAGE_BYTES + 7)
    fast = make_tier(reuse=True, checksum=False)
    assert set(fast.valid_blocks()) == {4, 5}
    fast.read(2, [4], [10])
    result = one(fast, 2)
    assert not result.ok and isinstance(result.error, DiskIntegrityError)
    assert result.error.kind == DiskErrorKind.CHECKSUM_MISMATCH
    fast.read(3, [5], [11])
    assert one(fast, 3).ok


def test_a_record_without_a_checksum_is_listed_only_after_a_clean_shutdown(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    """A write a crash cut short looks whole without a checksum; a tier that did not shut down
    cleanly (the file header's CLEAN flag, cleared at open, set by a clean shutdown) lists none."""
    before = snapshot(region)
    tier = faulty(make_tier, checksum=False)
    write_ok(tier, 1, [0], [4])
    tier.write_faults = [torn_payload]  # as a crash inside the write: header whole, payload half
    write_ok(tier, 2, [1], [5])
    tier.shutdown()  # clean: the tier did not see its write torn
    # What a crash leaves: the flag cleared at open and never set again.
    crashed = DiskTier.create(DiskConfig(tier.path, num_blocks=DISK_BLOCKS, reuse=True, checksum=False),
                              fingerprint=FINGERPRINT, record_bytes=RECORD, records=region.records())
    assert set(crashed.valid_blocks()) == {4, 5}  # the control: after a clean shutdown block 5 is served
    crashed.read(3, [5], [10])
    assert one(crashed, 3).ok and not torch.equal(region.records()[10], before[1])  # torn, ok=True
    crashed._stages.abort()  # no shutdown: the file stays as a crash leaves it
    assert crashed._stages.stop(time.monotonic() + 10)
    assert crashed._fd is not None
    for fd in {crashed._fd, crashed._lock_fd} - {None}:  # as the process's exit closes them
        assert fd is not None
        os.close(fd)
    crashed._fd, crashed._lock_fd, crashed._closed = None, None, True
    again = make_tier(reuse=True, checksum=False)
    assert again.valid_blocks() == {} and again.capabilities().rejected_records == 2  # cleared
    again.write(4, [2], [6])
    assert one(again, 4).ok
    again.shutdown()
    back = make_tier(reuse=True, checksum=False)  # clean again: its own write is listed
    assert set(back.valid_blocks()) == {6}


def test_a_failed_write_leaves_the_file_unclean(make_tier: MakeTier) -> None:
    tier = faulty(make_tier, checksum=False)
    write_ok(tier, 1, [0], [4])
    tier.write_faults = [raise_errno(errno.EIO)]
    tier.write(2, [1], [5])
    assert not one(tier, 2).ok
    tier.shutdown()
    assert make_tier(reuse=True, checksum=False).valid_blocks() == {}


def test_a_clean_mark_that_does_not_return_keeps_the_shutdown_within_its_timeout(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mark syncs the file: on a disk that does not answer it may not return. The shutdown
    returns at its deadline, reporting the descriptor left open (the mark's thread may use it)."""
    release = threading.Event()
    real = disk_format.mark_clean

    def stuck(fd: int, path: str, clean: bool) -> None:
        release.wait(30)
        real(fd, path, clean)

    monkeypatch.setattr(disk_tier, "mark_clean", stuck)
    tier = make_tier()
    write_ok(tier, 1, [0], [4])
    began = time.monotonic()
    with pytest.raises(DiskShutdownError, match="shutdown failed") as info:
        tier.shutdown(timeout=0.3)
    assert time.monotonic() - began < 5.0 and info.value.fd_left_open
    assert any("marking" in str(f) for f in info.value.failures)
    release.set()


def test_a_second_tier_on_an_open_file_is_refused(
    make_tier: MakeTier, region: RegionOwner, monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = snapshot(region)
    first = make_tier()
    write_ok(first, 1, [0], [3])
    with pytest.raises(DiskInUseError, match="in use by another open disk tier") as info:
        make_tier(reuse=True)
    assert info.value.kind == DiskErrorKind.IN_USE
    first.read(2, [3], [10])  # the first tier is unchanged
    assert one(first, 2).ok and torch.equal(region.records()[10], before[0])
    first.shutdown()
    make_tier(reuse=True).shutdown()  # the lock went with the first tier's descriptor


def test_without_the_lock_two_tiers_on_one_file_serve_each_others_records(
    make_tier: MakeTier, region: RegionOwner, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control of the lock: the hazard it prevents (both tiers hand out the same generations)."""
    monkeypatch.setattr(disk_tier, "lock_file", lambda fd, path: "not locked: control")
    before = snapshot(region)
    make_tier().shutdown()
    a, b = make_tier(reuse=True), make_tier(reuse=True)
    write_ok(a, 1, [0], [3])
    write_ok(b, 1, [1], [3])
    a.read(2, [3], [10])
    assert one(a, 2).ok and torch.equal(region.records()[10], before[1])  # b's record, served as a's


def _tier_outlived_by_a_forked_child(
    make_tier: MakeTier, *, started: bool = True, before_reaping: Callable[[], None] | None = None,
) -> None:
    """Fork a child that outlives the tier (it waits on a pipe), shut the tier down, and open the
    file again while the child lives; with ``started``, once the child said it runs (its fork
    handlers ran), else at once. ``before_reaping`` runs before the child is waited for, whatever
    happened (a child held in its fork handler is let go there)."""
    first = make_tier()
    write_ok(first, 1, [0], [3])
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a process with threads
        pid = os.fork()
    if pid == 0:  # the child: say it runs, wait for the parent's word, never return into pytest
        os.close(write_end)
        os.write(ready_write, b"r")
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    os.close(ready_write)
    try:
        if started:
            assert select.select([ready_read], [], [], 30.0)[0], "the child did not start"
        first.shutdown()
        make_tier(reuse=True).shutdown()
    finally:
        os.close(write_end)
        os.close(ready_read)
        if before_reaping is not None:
            before_reaping()
        os.waitpid(pid, 0)


def test_a_forked_child_does_not_hold_the_tiers_lock(make_tier: MakeTier) -> None:
    """(A child forked without exec inherited the lock's descriptor: the file stayed locked after
    its tier shut down, until the child exited.)"""
    _tier_outlived_by_a_forked_child(make_tier)


@pytest.mark.parametrize("settle_s", [disk_format.FORK_SETTLE_S, 0.0], ids=["tried again", "control"])
def test_a_tier_opened_again_before_a_just_forked_child_let_go_waits_for_it(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch, settle_s: float,
) -> None:
    """A child forked without exec holds a copy of the lock until its fork handler runs; a host may
    run the parent first, which shut its tier down and opened the file again at once (CI saw
    ``DiskInUseError`` there). Here the child's handler lets go only once the parent's reopen was
    refused and retries (its first sleep says so): the lock is taken within ``FORK_SETTLE_S`` of
    the fork; the control, no retry, is refused."""
    real = disk_format._let_go_in_child
    go_read, go_write = os.pipe()
    sleeps: list[float] = []

    def late() -> None:  # in the child
        select.select([go_read], [], [], 30.0)
        real()

    def sleep(seconds: float) -> None:  # in the parent's retry
        if not sleeps:
            os.write(go_write, b"g")
        sleeps.append(seconds)
        time.sleep(seconds)

    def let_go() -> None:
        if not sleeps:
            os.write(go_write, b"g")

    monkeypatch.setattr(disk_format, "_let_go_in_child", late)
    monkeypatch.setattr(disk_format, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    monkeypatch.setattr(disk_format, "FORK_SETTLE_S", settle_s)
    monkeypatch.setattr(disk_format, "_forked_at", disk_format._forked_at)  # restored after the fork's
    try:
        if settle_s:
            _tier_outlived_by_a_forked_child(make_tier, started=False, before_reaping=let_go)
            assert sleeps  # it was refused once, and tried again
        else:
            with pytest.raises(DiskInUseError, match="in use by another open disk tier"):
                _tier_outlived_by_a_forked_child(make_tier, started=False, before_reaping=let_go)
            assert not sleeps
    finally:
        os.close(go_read)
        os.close(go_write)


def test_a_lock_held_with_no_fork_moments_ago_is_refused_at_once(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another open tier holds the lock and this process forked nothing within ``FORK_SETTLE_S``
    (never, or long ago): refused without a retry; the control, a fork just now, is tried again
    until ``FORK_SETTLE_S`` after it, and a fork during the retry does not extend it (on a clock
    that the retry's sleeps advance)."""
    first = make_tier()
    now = [1000.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds
        if len(slept) == 10:
            disk_format._forked_at = now[0]  # a fork during the retry

    monkeypatch.setattr(disk_format, "time", types.SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    try:
        for forked_at in (None, now[0] - 2 * disk_format.FORK_SETTLE_S):
            monkeypatch.setattr(disk_format, "_forked_at", forked_at)
            with pytest.raises(DiskInUseError, match="in use by another open disk tier"):
                make_tier(reuse=True)
        assert slept == []
        monkeypatch.setattr(disk_format, "_forked_at", now[0])  # the control: a fork just now
        with pytest.raises(DiskInUseError, match="in use by another open disk tier"):
            make_tier(reuse=True)
        assert slept and all(s == disk_format.FORK_RETRY_S for s in slept)
        assert sum(slept) == pytest.approx(disk_format.FORK_SETTLE_S, abs=2 * disk_format.FORK_RETRY_S)
    finally:
        first.shutdown()


def test_without_letting_go_in_the_child_the_lock_outlives_the_tier(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: nothing to let go of in the child, and the child holds the lock."""
    monkeypatch.setattr(disk_format, "_let_go_in_child", lambda: None)
    with pytest.raises(DiskInUseError, match="in use by another open disk tier"):
        _tier_outlived_by_a_forked_child(make_tier)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "control"])
def test_a_fork_while_the_tier_closes_its_lock_does_not_leave_the_child_holding_it(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch, guarded: bool,
) -> None:
    """A tier forgot its lock's descriptor (for the fork handler) and then closed it: a fork from
    another thread between the two left the child a copy it never let go of, and the file stayed
    locked while the child lived (found by a review). The forgetting and the close are one step
    now, which a fork waits for. Here the close is held until just after the fork began; the
    control lets the fork go ahead at once (no guard): the reopen is refused."""
    if not guarded:
        monkeypatch.setattr(disk_format, "_before_fork", lambda: None)
    tier = make_tier()
    write_ok(tier, 1, [0], [3])
    lock_fd = tier._lock_fd if tier._lock_fd is not None else tier._fd
    real_close = os.close
    in_gap, go = threading.Event(), threading.Event()

    def held_close(fd: int) -> None:
        if fd == lock_fd and not in_gap.is_set():
            in_gap.set()
            assert go.wait(WAIT_S)
        real_close(fd)

    monkeypatch.setattr(os, "close", held_close)
    closing = threading.Thread(target=tier.shutdown, name="test-shutdown")
    closing.start()
    read_end, write_end = os.pipe()
    try:
        assert in_gap.wait(WAIT_S)
        release = threading.Timer(0.3, go.set)  # the close goes on once the fork is under way
        release.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork of a process with threads
            pid = os.fork()
        if pid == 0:  # the child: wait for the parent's word, never return into pytest
            real_close(write_end)
            os.read(read_end, 1)
            os._exit(0)
        release.join(WAIT_S)
        closing.join(WAIT_S)
        assert not closing.is_alive()
        monkeypatch.setattr(os, "close", real_close)
        try:
            if guarded:
                make_tier(reuse=True).shutdown()
            else:
                with pytest.raises(DiskInUseError, match="in use by another open disk tier"):
                    make_tier(reuse=True)
        finally:
            os.write(write_end, b"x")
            os.waitpid(pid, 0)
    finally:
        go.set()
        real_close(read_end)
        real_close(write_end)


def test_a_new_files_header_is_durable_before_the_file_is_sized(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sized first, a crash could leave the file at its whole size with a first page of zeros (the
    header not written back yet): a file that is not a tier, never overwritten (found by a review).
    The header's sync comes between its write and the sizing."""
    calls: list[str] = []

    def recorded(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls.append(name)
            return real(*args)
        return call

    for name in ("pwrite", "fdatasync", "posix_fallocate", "ftruncate"):
        monkeypatch.setattr(os, name, recorded(name, getattr(os, name)))
    for preallocate in (True, False):
        calls.clear()
        make_tier(preallocate=preallocate, reuse=False).shutdown()
        sizing = calls.index("posix_fallocate" if preallocate else "ftruncate", calls.index("pwrite"))
        assert "fdatasync" in calls[calls.index("pwrite"):sizing], calls


def _clean_flag(path: str) -> bool:
    with open(path, "rb") as f:
        first = f.read(disk_format._FILE_HEADER.size)
    return bool(disk_format._FILE_HEADER.unpack_from(first, 0)[2] & disk_format._FILE_CLEAN)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "control"])
def test_a_forked_child_that_shuts_its_copy_down_does_not_mark_the_parents_file_clean(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch, guarded: bool,
) -> None:
    """A child forked without exec (here inside the tier's life) that shuts its copy of the tier
    down (a ``with Worker`` it unwinds) marked the file clean through the I/O descriptor while the
    parent still wrote: a crash of the parent then left a file that claimed a clean shutdown, whose
    records without a checksum a restart would serve unverified (found by an audit). The I/O
    descriptor here is a second one, as with O_DIRECT. The control drops both guards: the child's
    descriptor of the file, and the owner's process id."""
    def second_descriptor(path: str, direct: bool | None, setup_fd: int) -> tuple[int, bool, str]:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC), False, "a second descriptor (test)"

    monkeypatch.setattr(DiskTier, "_open_io_fd", staticmethod(second_descriptor))
    if not guarded:
        monkeypatch.setattr(disk_format, "_let_go_in_child", lambda: None)
    tier = make_tier(checksum=False, reuse=True)
    write_ok(tier, 1, [0], [4])
    assert tier._fd != tier._lock_fd and not _clean_flag(tier.path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a process with threads
        pid = os.fork()
    if pid == 0:  # the child: shut its copy down, never return into pytest
        code = 0
        try:
            if not guarded:
                tier._pid = os.getpid()
            tier.shutdown(timeout=5)
        except BaseException:  # noqa: BLE001 - reported by the exit code
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _clean_flag(tier.path) is not guarded  # the parent's tier is open and writes on
    write_ok(tier, 2, [1], [5])
    tier.shutdown()
    assert _clean_flag(tier.path)  # its own clean shutdown


# ---------------------------------------------------------------------------- direct / buffered


def test_direct_io_on_a_disk_file_system(make_tier: MakeTier, region: RegionOwner) -> None:
    tier = make_tier()
    caps = tier.capabilities()
    if not caps.direct:
        pytest.skip(f"the file system of {caps.path} refuses O_DIRECT: {caps.reason}")
    assert caps.transfer_path == "disk-direct" and caps.reason == "O_DIRECT accepted"
    before = snapshot(region)
    write_ok(tier, 1, [0, 1], [0, 1])
    tier.read(2, [0, 1], [2, 3])
    assert one(tier, 2).ok and torch.equal(region.records()[2:4], before[0:2])


def test_buffered_io_when_direct_is_false(make_tier: MakeTier, region: RegionOwner) -> None:
    tier = make_tier(direct=False)
    caps = tier.capabilities()
    assert not caps.direct and caps.transfer_path == "disk-buffered" and "direct = False" in caps.reason
    before = snapshot(region)
    write_ok(tier, 1, [0, 1], [0, 1])
    tier.read(2, [0, 1], [2, 3])
    result = one(tier, 2)
    assert result.ok and result.path == "disk-buffered"
    assert torch.equal(region.records()[2:4], before[0:2])


class RefusesDirect(DiskTier):
    """A file system that refuses O_DIRECT at open, as tmpfs did before Linux 6.6 (and overlayfs)."""

    @classmethod
    def _open_file(cls, path: str, flags: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return super()._open_file(path, flags)


def test_buffered_fallback_when_the_file_system_refuses_o_direct(
    make_tier: MakeTier, region: RegionOwner,
) -> None:
    tier = make_tier(RefusesDirect)
    caps = tier.capabilities()
    assert not caps.direct and "refused O_DIRECT" in caps.reason
    before = snapshot(region)
    write_ok(tier, 1, [0], [0])
    tier.read(2, [0], [1])
    assert one(tier, 2).ok and torch.equal(region.records()[1], before[0])


def test_direct_true_raises_when_o_direct_is_refused_and_leaves_no_file(
    make_tier: MakeTier, tmp_path: Any,
) -> None:
    with pytest.raises(DiskError, match="O_DIRECT") as info:
        make_tier(RefusesDirect, direct=True)
    assert info.value.kind == DiskErrorKind.DIRECT_REFUSED
    assert not (tmp_path / "kv.bin").exists()


def test_a_file_under_dev_shm_round_trips_in_the_mode_the_kernel_allows(
    region: RegionOwner,
) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = f"/dev/shm/kvoffload-test-disk-{os.getpid()}.bin"
    tier = DiskTier.create(DiskConfig(path, num_blocks=8, io_threads=2), fingerprint=FINGERPRINT,
                           record_bytes=RECORD, records=region.records())
    try:
        caps = tier.capabilities()
        assert caps.direct == (caps.reason == "O_DIRECT accepted")  # tmpfs takes O_DIRECT since 6.6
        before = snapshot(region)
        write_ok(tier, 1, [0], [0])
        tier.read(2, [0], [1])
        assert one(tier, 2).ok and torch.equal(region.records()[1], before[0])
    finally:
        tier.shutdown()
        os.unlink(path)
