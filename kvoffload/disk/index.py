"""DiskIndex: which disk records hold data a read may return.

Owns, per disk block: whether it is listed, the generation the next read must find in the record's
header, and the record's key; and the next generation to hand out (above every generation ever seen
in the file, so a stale record never matches). Thread-safe (a lock of its own; no call blocks).

The index is the authority: a block it does not list is refused whatever the file says. A write
unlists its blocks when it starts and lists them, under new generations, only when it completed; a
read that fails in any way unlists the blocks it failed — unless a write replaced them meanwhile.
After a warm restart it is *header-verified* (docs/design.md §9.4): it lists the records whose
header verified and whose slot lay wholly inside the file; payloads are verified on every read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from kvoffload.disk.config import PAGE_BYTES, DiskRecordInfo
from kvoffload.disk.format import RecordCodec, aligned

__all__ = ["MAX_GENERATION", "DiskIndex", "scan_headers"]

_log = logging.getLogger("kvoffload.disk")

#: The highest generation a record header may carry: a tier hands out one per record written, so
#: none reaches it (2**62 writes), and the generations handed out after the newest a warm restart saw
#: stay inside the header's 64-bit field. A header above it is rejected, not taken as the newest.
MAX_GENERATION: Final = 1 << 62

BoolArray = npt.NDArray[np.bool_]
U64Array = npt.NDArray[np.uint64]


class DiskIndex:
    """The listed records of one tier file (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        self._lock = threading.Lock()
        self._valid = np.zeros(num_blocks, dtype=np.bool_)
        self._generation = np.zeros(num_blocks, dtype=np.uint64)
        self._keys: dict[int, bytes] = {}
        self._next_generation = 1
        self.indexed = 0
        self.rejected = 0

    def load(self, found: list[tuple[int, int, bytes]], rejected: int, newest: int) -> None:
        """Take the records a warm-restart scan found valid (``(block, generation, key)``), the count
        it rejected, and the newest generation it saw in any header."""
        with self._lock:
            for block, generation, key in found:
                self._valid[block] = True
                self._generation[block] = generation
                if key:
                    self._keys[block] = key
            self.indexed += len(found)
            self.rejected += rejected
            self._next_generation = max(self._next_generation, newest + 1)

    def snapshot(self, first: int, n: int) -> tuple[BoolArray, U64Array]:
        """What a read of blocks ``first..first + n - 1`` expects: listed, and which generation."""
        with self._lock:
            return self._valid[first : first + n].copy(), self._generation[first : first + n].copy()

    def begin_write(self, first: int, n: int) -> int:
        """Unlist blocks ``first..`` and hand out ``n`` generations; returns the first."""
        with self._lock:
            generation = self._next_generation
            self._next_generation += n
            self._valid[first : first + n] = False
        return generation

    def publish(self, first: int, generation: int, keys: list[bytes] | None, n: int) -> None:
        """List blocks ``first..`` under generations ``generation..`` once their write completed."""
        with self._lock:
            self._valid[first : first + n] = True
            self._generation[first : first + n] = np.arange(generation, generation + n, dtype=np.uint64)
            for i in range(n):
                key = keys[i] if keys is not None else b""
                if key:
                    self._keys[first + i] = key
                else:
                    self._keys.pop(first + i, None)

    def unlist_unchanged(self, first: int, valid: BoolArray, generation: U64Array) -> None:
        """Unlist the blocks ``first..`` a read failed on, as they were when it was issued (a block
        rewritten since keeps its new record)."""
        n = int(valid.shape[0])
        with self._lock:
            same = (
                valid & self._valid[first : first + n]
                & (self._generation[first : first + n] == generation)
            )
            self._valid[first : first + n] &= ~same
            for i in np.flatnonzero(same).tolist():
                self._keys.pop(first + i, None)

    def unlist(self, failed: list[tuple[int, int]]) -> None:
        """Unlist ``(block, generation)`` pairs whose record failed its checks (a block rewritten
        since keeps its new record)."""
        with self._lock:
            for block, generation in failed:
                if self._valid[block] and int(self._generation[block]) == generation:
                    self._valid[block] = False
                    self._keys.pop(block, None)

    def records(self) -> dict[int, DiskRecordInfo]:
        """Every listed block with its generation and key (a snapshot)."""
        with self._lock:
            blocks = np.flatnonzero(self._valid)
            gens = self._generation[blocks]
            return {
                int(b): DiskRecordInfo(int(b), int(g), self._keys.get(int(b), b""))
                for b, g in zip(blocks, gens)
            }


def scan_headers(
    pread: Callable[[int, list[npt.NDArray[np.uint8]], int], int], fd: int, codec: RecordCodec,
    file_size: int, start: int, stop: int,
) -> tuple[list[tuple[int, int, bytes]], int, int, list[tuple[int, int, bytes]]]:
    """Read the record headers of blocks ``[start, stop)`` (a warm restart): the valid ones written
    with a checksum as ``(block, generation, key)``, the count rejected (a damaged header, another
    block's, one not marked valid, or a slot the file ends inside of — a cut payload), the newest
    generation seen in any header, and the valid ones written without a checksum (the tier decides
    whether it may list them, docs/design.md §9.4)."""
    page = aligned(PAGE_BYTES)
    slot_bytes = PAGE_BYTES + codec.record_bytes
    found: list[tuple[int, int, bytes]] = []
    unchecked: list[tuple[int, int, bytes]] = []
    rejected = 0
    newest = 0
    for block in range(start, stop):
        try:
            got = pread(fd, [page], codec.slot_offset(block))
        except OSError as exc:
            _log.warning("disk tier %s: header of block %d unreadable: %s", codec.path, block,
                         exc.strerror)
            rejected += 1
            continue
        if got != PAGE_BYTES:
            continue  # past the end of a file that was cut short: never written
        header = codec.parse(page, 0)
        if isinstance(header, str):
            if codec.has_magic(page):
                rejected += 1
            continue
        flags, hdr_block, generation, _crc, key = header
        if generation > MAX_GENERATION:  # no tier writes one: a forged or damaged header
            rejected += 1
            continue
        newest = max(newest, generation)
        cut = codec.slot_offset(block) + slot_bytes > file_size
        if hdr_block != block or not codec.header_is_valid(flags) or cut:
            rejected += 1
            continue
        (found if codec.has_checksum(flags) else unchecked).append((block, generation, key))
    return found, rejected, newest, unchecked
