"""Shared pieces of the disk tier's tests: sizes, the fault-injecting ``FaultyTier``, the faults it
injects, and the ``region``/``make_tier`` fixtures (tiers on temp files over a real ``RegionOwner``
with ``NoPinner``, shut down at teardown). No tests here.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvoffload.bindings.pinning import NoPinner
from kvoffload.disk.config import PAGE_BYTES, DiskConfig
from kvoffload.disk.tier import DiskTier
from kvoffload.errors import DiskError
from kvoffload.records import TransferResult
from kvoffload.region import RegionOwner

__all__ = [
    "DISK_BLOCKS", "FINGERPRINT", "GATE_S", "HOST_ROWS", "RECORD", "SLOT", "WAIT_S", "FaultyTier",
    "Fault", "MakeTier", "faulty", "flip_byte", "make_tier", "one", "raise_errno", "region",
    "short_call", "slot_offset", "snapshot", "torn_header", "torn_payload", "write_ok",
]

RECORD = 4 * PAGE_BYTES
HOST_ROWS = 32
DISK_BLOCKS = 64
SLOT = PAGE_BYTES + RECORD
FINGERPRINT = "layout-a"
WAIT_S = 30.0
GATE_S = 30.0

U8Array = npt.NDArray[np.uint8]
WriteCall = Callable[[int, list[U8Array], int], int]
Fault = Callable[[int, list[U8Array], int, WriteCall], int]


# ------------------------------------------------------------------------------------- helpers


class FaultyTier(DiskTier):
    """A tier whose system calls can be failed, shortened, torn or held, one call at a time.

    ``write_faults``/``read_faults`` are consumed one per call (None: a normal call); ``gate`` holds
    every write until it is set; ``calls`` records (kind, offset, buffer sizes) of every call.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.write_faults: list[Fault | None] = []
        self.read_faults: list[Fault | None] = []
        self.calls: list[tuple[str, int, list[int]]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def _pwrite(self, fd: int, buffers: list[U8Array], offset: int) -> int:
        self.calls.append(("write", offset, [int(b.nbytes) for b in buffers]))
        if self.gate is not None:
            self.entered.set()
            self.gate.wait(GATE_S)
        fault = self.write_faults.pop(0) if self.write_faults else None
        real = super()._pwrite
        return real(fd, buffers, offset) if fault is None else fault(fd, buffers, offset, real)

    def _pread(self, fd: int, buffers: list[U8Array], offset: int) -> int:
        self.calls.append(("read", offset, [int(b.nbytes) for b in buffers]))
        fault = self.read_faults.pop(0) if self.read_faults else None
        real = super()._pread
        return real(fd, buffers, offset) if fault is None else fault(fd, buffers, offset, real)


def raise_errno(code: int) -> Fault:
    def fault(fd: int, buffers: list[U8Array], offset: int, real: WriteCall) -> int:
        raise OSError(code, os.strerror(code))

    return fault


def short_call(fd: int, buffers: list[U8Array], offset: int, real: WriteCall) -> int:
    """Move every buffer but the last (as a call cut short by the kernel would)."""
    return real(fd, buffers[:-1], offset)


def torn_payload(fd: int, buffers: list[U8Array], offset: int, real: WriteCall) -> int:
    """Write the header page and half the first payload, then claim the whole call succeeded."""
    total = sum(int(b.nbytes) for b in buffers)
    real(fd, [buffers[0], buffers[1][: RECORD // 2]], offset)
    return total


def torn_header(fd: int, buffers: list[U8Array], offset: int, real: WriteCall) -> int:
    """Write the payloads but not the header pages (they keep their previous contents)."""
    total = sum(int(b.nbytes) for b in buffers)
    for i in range(0, len(buffers), 2):
        real(fd, [buffers[i + 1]], offset + (i // 2) * SLOT + PAGE_BYTES)
    return total


@pytest.fixture
def region() -> Iterator[RegionOwner]:
    owner = RegionOwner.create(num_records=HOST_ROWS, record_bytes=RECORD, pinner=NoPinner())
    gen = torch.Generator().manual_seed(1234)
    owner.records().copy_(torch.randint(0, 256, (HOST_ROWS, RECORD), dtype=torch.uint8, generator=gen))
    yield owner
    owner.cleanup()


MakeTier = Callable[..., DiskTier]


@pytest.fixture
def make_tier(region: RegionOwner, tmp_path: Any) -> Iterator[MakeTier]:
    """Create tiers on ``tmp_path/kv.bin`` (by default) over the region; shut them down afterwards."""
    made: list[DiskTier] = []
    create_failed = False

    def make(cls: type[DiskTier] = DiskTier, *, fingerprint: str = FINGERPRINT,
             record_bytes: int = RECORD, **config: Any) -> DiskTier:
        config.setdefault("path", str(tmp_path / "kv.bin"))
        config.setdefault("num_blocks", DISK_BLOCKS)
        config.setdefault("io_threads", 2)
        nonlocal create_failed
        try:
            tier = cls.create(DiskConfig(**config), fingerprint=fingerprint,
                              record_bytes=record_bytes, records=region.records())
        except BaseException:
            create_failed = True
            raise
        made.append(tier)
        return tier

    yield make
    for tier in made:
        try:
            tier.shutdown(timeout=10.0)
        except DiskError:
            pass
    made.clear()
    if create_failed:
        gc.collect()  # a failed create's traceback (kept by pytest.raises in a cycle) holds the records


def faulty(make_tier: MakeTier, **config: Any) -> FaultyTier:
    tier = make_tier(FaultyTier, **config)
    assert isinstance(tier, FaultyTier)
    return tier


def one(tier: DiskTier, job_id: int) -> TransferResult:
    (result,) = tier.wait([job_id], WAIT_S)
    return result


def write_ok(tier: DiskTier, job_id: int, rows: list[int], blocks: list[int]) -> None:
    tier.write(job_id, rows, blocks)
    result = one(tier, job_id)
    assert result.ok, result.error


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def slot_offset(block: int) -> int:
    return PAGE_BYTES + block * SLOT


def snapshot(region: RegionOwner) -> torch.Tensor:
    return region.records().clone()


