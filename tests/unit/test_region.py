"""RegionOwner on real mappings (anonymous and shared under /dev/shm), with pinning recorded by a
fake pinner: record-aligned chunks, rollback in reverse, cleanup exactly once in the order of
docs/design.md §6, never unmapping registered memory, never leaving a view over unmapped memory, and no
shared file left behind."""

from __future__ import annotations

import gc
import math
import mmap
import os
import subprocess
import sys
import types
import uuid
from collections.abc import Iterator
from typing import cast

import pytest
import torch

from kvoffload import InvalidArgumentError, SharedPool, ShutdownError
from kvoffload.bindings.pinning import pin_chunks
from kvoffload.errors import ClosedError, KVOffloadError
from kvoffload.pool import session as session_module
from kvoffload.pool.header import data_offset
from kvoffload.pool.session import PoolSession
from kvoffload.region import SHM_DIR, RegionOwner

RECORD = 8192


class RecordingPinner:
    """Records register/unregister calls; fails the n-th register or every unregister on request."""

    def __init__(self, fail_register_at: int | None = None, fail_unregister: bool = False) -> None:
        self.log: list[tuple[str, int, int]] = []
        self.fail_register_at = fail_register_at
        self.fail_unregister = fail_unregister
        self.registered: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail_register_at is not None and len(self.registered) == self.fail_register_at:
            raise KVOffloadError("injected register failure")
        self.log.append(("register", ptr, nbytes))
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        self.log.append(("unregister", ptr, self.registered.get(ptr, -1)))
        if self.fail_unregister:
            raise KVOffloadError("injected unregister failure")
        del self.registered[ptr]


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"kvoffload-test-{uuid.uuid4().hex}"
    yield name
    path = os.path.join(SHM_DIR, name)
    if os.path.exists(path):
        os.unlink(path)
        pytest.fail(f"{path} was left behind")


def test_anonymous_region_pins_record_aligned_chunks_and_unpins_them_in_reverse() -> None:
    pinner = RecordingPinner()
    region = RegionOwner.create(num_records=10, record_bytes=RECORD, pinner=pinner,
                                chunk_bytes=3 * RECORD + 100)
    records = region.records()
    assert records.shape == (10, RECORD) and records.dtype == torch.uint8
    assert records.data_ptr() == region.base_ptr
    sizes = [n for _, _, n in pinner.log]
    assert sizes == [3 * RECORD, 3 * RECORD, 3 * RECORD, RECORD]
    assert region.chunk_records == 3
    starts = [p for _, p, _ in pinner.log]
    assert starts == [region.base_ptr + i * 3 * RECORD for i in range(4)]
    records[7].fill_(0x5A)
    assert int(records[7, 123]) == 0x5A
    del records
    region.cleanup()
    unregisters = [p for op, p, _ in pinner.log if op == "unregister"]
    assert unregisters == list(reversed(starts))
    assert pinner.registered == {}
    with pytest.raises(ClosedError):
        region.records()


def test_cleanup_runs_once() -> None:
    pinner = RecordingPinner()
    region = RegionOwner.create(num_records=2, record_bytes=RECORD, pinner=pinner)
    region.cleanup()
    region.cleanup()
    assert [op for op, _, _ in pinner.log] == ["register", "unregister"]
    assert region.released


def test_pin_failure_rolls_back_registered_chunks_in_reverse() -> None:
    pinner = RecordingPinner(fail_register_at=2)
    with pytest.raises(KVOffloadError, match="injected register failure"):
        RegionOwner.create(num_records=4, record_bytes=RECORD, pinner=pinner, chunk_bytes=RECORD)
    ops = [(op, p) for op, p, _ in pinner.log]
    first, second = ops[0][1], ops[1][1]
    assert ops == [("register", first), ("register", second),
                   ("unregister", second), ("unregister", first)]
    assert pinner.registered == {}


def test_pin_chunks_reports_a_rollback_that_fails_too() -> None:
    pinner = RecordingPinner(fail_register_at=1, fail_unregister=True)
    with pytest.raises(KVOffloadError, match="could not be unregistered"):
        pin_chunks(pinner, 0x1000, 2 * RECORD, RECORD)


def test_failed_unpin_keeps_the_mapping_and_reports_it() -> None:
    pinner = RecordingPinner(fail_unregister=True)
    region = RegionOwner.create(num_records=2, record_bytes=RECORD, pinner=pinner)
    view = region.records()
    view.fill_(3)
    with pytest.raises(ShutdownError) as info:
        region.cleanup()
    assert info.value.region_left_mapped
    assert int(view.sum()) == 3 * 2 * RECORD  # still mapped: reading it is safe


def test_view_still_referenced_at_cleanup_defers_unmap_and_warns() -> None:
    region = RegionOwner.create(num_records=2, record_bytes=RECORD, pinner=RecordingPinner())
    kept = region.records()[1]
    kept.fill_(9)
    with pytest.warns(ResourceWarning, match="still referenced"):
        region.cleanup()
    assert int(kept[0]) == 9  # the memory under the view is still mapped
    kept.fill_(1)
    del kept
    gc.collect()


def test_abandon_leaves_memory_pinned_and_mapped() -> None:
    pinner = RecordingPinner()
    region = RegionOwner.create(num_records=2, record_bytes=RECORD, pinner=pinner)
    region.abandon()
    assert [op for op, _, _ in pinner.log] == ["register"]
    region.cleanup()  # a no-op after abandon
    assert [op for op, _, _ in pinner.log] == ["register"]


_DROPPED_WORKER = """
import gc, sys, threading, time, warnings
import torch, kvoffload
from kvoffload import region
from kvoffload.backends.host import HostBackend

started = threading.Event()

class Slow(HostBackend):
    def copy_one(self, dst, src, size):
        started.set()
        time.sleep(0.3)  # the worker is dropped meanwhile
        super().copy_one(dst, src, size)

warnings.simplefilter("ignore", ResourceWarning)
layout = kvoffload.DeviceLayout.from_tensors({"kv": torch.zeros(2, 8, 16, 64)}, block_dim=1)
w = kvoffload.Worker.create(layout, 8, backend_factory=Slow)
w.load(1, list(range(8)), list(range(8)))  # writes the device from the host pool
started.wait(10)
if sys.argv[1] == "control":
    region._MAPPED.clear()  # as before: the mapping's finalizer unmaps it with the worker
del w
gc.collect()
time.sleep(3)  # the copies end, reading the pool
print("survived")
"""


@pytest.mark.parametrize("control", [False, True], ids=["kept", "control"])
def test_a_worker_dropped_with_copies_running_keeps_its_pool_mapped(control: bool) -> None:
    """(A worker dropped without shutdown, its copy thread still running: the mapping's finalizer
    unmapped the pool under the copies and the process died with SIGSEGV, though the warning said
    the memory stays until the process exits.) The control drops the registry's reference."""
    done = subprocess.run([sys.executable, "-c", _DROPPED_WORKER, "control" if control else "kept"],
                          capture_output=True, text=True, timeout=120, check=False)
    if control:
        assert done.returncode == -11, (done.returncode, done.stderr[-2000:])
    else:
        assert done.returncode == 0 and "survived" in done.stdout, done.stderr[-2000:]


def test_a_forked_child_sees_zero_pages_where_the_anonymous_pool_is() -> None:
    """A fork must neither copy the pinned pool nor share its pages copy-on-write (the parent's later
    writes would then land on new pages while the device reads the old ones): the child gets zero
    pages at the same address, and its writes never reach the parent's pool."""
    region = RegionOwner.create(num_records=4, record_bytes=RECORD, pinner=RecordingPinner())
    try:
        records = region.records()
        records.fill_(7)
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status, never return into pytest
            zeros = bool((records == 0).all())
            records.fill_(9)
            os._exit(0 if zeros else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child saw the parent's pool"
        assert bool((records == 7).all())  # the child's writes stayed in the child
        records[0].fill_(5)  # and the parent still writes its own pages
        assert int(records[0, 0]) == 5
        del records
    finally:
        region.cleanup()


def test_one_rank_shared_region_is_unlinked_once_mapped(shm_name: str) -> None:
    pinner = RecordingPinner()
    region = RegionOwner.attach_shared(SharedPool(shm_name, 1).rank(0), num_records=3,
                                       record_bytes=RECORD, pinner=pinner)
    assert not os.path.exists(os.path.join(SHM_DIR, shm_name))
    assert (region.record_stride, region.shared_path) == (RECORD, os.path.join(SHM_DIR, shm_name))
    (ptr, nbytes), = region.chunks
    assert ptr == region.base_ptr and nbytes == 3 * RECORD  # the block area, not the header page
    region.records()[2].fill_(4)
    region.cleanup()
    assert pinner.registered == {}


def test_failed_shared_attach_leaves_no_file(shm_name: str) -> None:
    with pytest.raises(KVOffloadError, match="injected"):
        RegionOwner.attach_shared(SharedPool(shm_name, 1).rank(0), num_records=2,
                                  record_bytes=RECORD, pinner=RecordingPinner(fail_register_at=0))
    assert not os.path.exists(os.path.join(SHM_DIR, shm_name))


def test_killed_process_leaves_no_shared_file(shm_name: str) -> None:
    code = (
        "import os, signal\n"
        "from kvoffload import SharedPool\n"
        "from kvoffload.region import RegionOwner\n"
        "from kvoffload.bindings.pinning import NoPinner\n"
        f"RegionOwner.attach_shared(SharedPool({shm_name!r}, 1).rank(0), num_records=2, "
        f"record_bytes={RECORD}, pinner=NoPinner())\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    assert not os.path.exists(os.path.join(SHM_DIR, shm_name))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_records": 0}, "num_records"),
        ({"num_records": True}, "num_records"),
        ({"record_bytes": 4000}, "must be a multiple of 4096"),
        ({"record_bytes": -4096}, "record_bytes"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_mapped(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"num_records": 2, "record_bytes": RECORD, "pinner": RecordingPinner()}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=match):
        RegionOwner.create(**args)  # type: ignore[arg-type]
    pinner = args["pinner"]
    assert isinstance(pinner, RecordingPinner) and pinner.log == []


#: A host of 64 KiB pages (aarch64 servers often run them), simulated: the region reads the OS page
#: size from ``mmap.PAGESIZE`` when it plans, while the real kernel's 4 KiB pages divide every
#: range planned for 64 KiB ones.
BIG_PAGE = 65536
SMALL_RECORD = 3 * 4096  # a record of 4 KiB pages: no whole number of 64 KiB pages


def test_a_host_of_64k_pages_pins_chunks_of_whole_pages_and_whole_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mmap, "PAGESIZE", BIG_PAGE)
    pinner = RecordingPinner()
    region = RegionOwner.create(num_records=40, record_bytes=SMALL_RECORD, pinner=pinner, chunk_bytes=200_000)
    try:
        step = math.lcm(SMALL_RECORD, BIG_PAGE)  # 16 records, 3 pages
        assert [n for _, _, n in pinner.log] == [step, step, 40 * SMALL_RECORD - 2 * step]
        assert all((p - region.base_ptr) % BIG_PAGE == 0 for _, p, _ in pinner.log), \
            "a pin chunk starts inside a page: two registrations would share it"
        assert region.chunk_records == 16
        region.records()[39].fill_(7)
        assert int(region.records()[39, -1]) == 7
    finally:
        region.cleanup()
    assert pinner.registered == {}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("page", [4096, BIG_PAGE])
def test_the_ranks_populate_every_page_of_the_block_area_from_page_boundaries(
    world: int, page: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank's share starts on a page (``madvise`` refuses any other start), and the shares
    together cover the whole block area, its last partial page included."""
    monkeypatch.setattr(mmap, "PAGESIZE", page)
    data_bytes = 20 * world * SMALL_RECORD  # 20 blocks: 3.75 pages of 64 KiB a rank
    ranges: list[tuple[int, int]] = []
    monkeypatch.setattr(session_module, "populate",
                        lambda mapping, offset, nbytes, fd=None: ranges.append((offset, nbytes)))
    for rank in range(world):
        shard = types.SimpleNamespace(header=types.SimpleNamespace(data_bytes=data_bytes),
                                      spec=types.SimpleNamespace(rank=rank, world_size=world), _fd=None)
        PoolSession.populate_share(shard, cast(mmap.mmap, None))  # type: ignore[arg-type]
    start = data_offset()
    assert start == max(4096, page) and start % page == 0
    assert all(offset % page == 0 for offset, _ in ranges), f"a share starts inside a page: {ranges}"
    covered = start
    for offset, nbytes in ranges:
        assert offset == covered, f"shares {ranges} leave a gap or overlap at {covered}"
        covered += nbytes
    assert covered == start + data_bytes


def test_a_shared_pool_on_a_host_of_64k_pages_starts_its_blocks_on_a_page(
    shm_name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mmap, "PAGESIZE", BIG_PAGE)
    pinner = RecordingPinner()
    region = RegionOwner.attach_shared(SharedPool(shm_name, 1).rank(0), num_records=20,
                                       record_bytes=SMALL_RECORD, pinner=pinner)
    try:
        (ptr, nbytes), = region.chunks
        assert ptr == region.base_ptr and nbytes == 20 * SMALL_RECORD
        region.records()[19].fill_(3)
        fd = region._fd
        assert fd is not None  # the file's block area, where a view of the pool reads it, holds it
        assert os.pread(fd, 1, data_offset() + 19 * SMALL_RECORD) == b"\x03"
        assert data_offset() == BIG_PAGE
    finally:
        region.cleanup()
    assert pinner.registered == {}


@pytest.mark.parametrize("where", ["rollback", "pin-chunks"])
def test_a_failed_create_whose_unpin_fails_keeps_its_mapping(
    where: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A create that failed after pinning unregistered its chunks and then unmapped, even when an
    unregistration failed: memory that may still be registered was unmapped (found by an audit).
    It now stays mapped, as a cleanup whose unpin failed leaves it."""
    from kvoffload import region as region_module

    mapped = dict(region_module._MAPPED)
    pinner = RecordingPinner(fail_unregister=True, fail_register_at=2 if where == "pin-chunks" else None)
    if where == "rollback":
        def refuse(*args: object) -> torch.Tensor:
            raise RuntimeError("the view refused for the test")
        monkeypatch.setattr(region_module, "_records_view", refuse)
    with pytest.raises((RuntimeError, KVOffloadError)):
        RegionOwner.create(num_records=4, record_bytes=RECORD, pinner=pinner, chunk_bytes=RECORD)
    kept = [m for key, m in region_module._MAPPED.items() if key not in mapped]
    assert len(kept) == 1 and not kept[0].closed, "a mapping that may still be registered was unmapped"
    assert any(op == "unregister" for op, _, _ in pinner.log)
