"""Calibration of the ``auto`` transfer path: which path moves a job fastest, by direction and size.

Owns nothing after it returns: it measures with scratch device tensors shaped like the layout's
pages and a scratch host pool, through short-lived :class:`~kvoffload.worker.Worker`-free handlers of
its own, and releases them. The engine's device cache is never touched.

For each direction it times the ``dma`` and ``staged`` paths on jobs of a few sizes (1 block, a few
blocks, about 64 MiB), and the ``sm`` path on the smallest bucket only (where the host can map the
pool). The paths take turns within every repeat (see :func:`turns`), so that a shared host's
drift weighs on all of them alike. Each path's last job at each size writes into a cleared
destination and every byte is checked; per size bucket the fastest path that moved its bytes
correctly is kept — a path that fails its own check is never chosen. ``sm`` is a latency path: one
kernel launch and no DMA hand-off wins for jobs of a few blocks, and such a job holds its few CTAs
for tens of microseconds; bulk jobs never take it (it competes with compute for the SMs). The
result is cached per process by (device, page geometry, whether ``sm`` was allowed) and can be
persisted to a JSON file.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import attrs
import numpy as np
import torch

from kvoffload import bindings
from kvoffload.backends import CudaBackend, SmBackend, StagedBackend
from kvoffload.errors import TransferError
from kvoffload.handler import DirectionHandler
from kvoffload._descriptors import CopyPlan, PageTable
from kvoffload.records import Direction
from kvoffload.region import RegionOwner

__all__ = ["AutoChoice", "calibrate"]

_log = logging.getLogger("kvoffload.calibration")

#: Job sizes (in blocks) measured; a job uses the bucket of the largest size not above it.
SIZE_BUCKETS_BLOCKS: Final = (1, 8)
#: Bytes of the largest calibration job (it also bounds the scratch memory: twice this).
LARGE_JOB_BYTES: Final = 64 << 20
REPEATS: Final = 3
#: Repeats of the small-bucket jobs (tens of microseconds each: their median needs more samples on
#: a shared host).
SMALL_REPEATS: Final = 15
WAIT_S: Final = 60.0
_FILE_VERSION: Final = 1
_CANDIDATES: Final = ("dma", "staged", "sm")
#: Size buckets (from the smallest) where the ``sm`` path competes.
SM_BUCKETS: Final = 1
#: CTAs of the ``sm`` path's kernel under ``auto`` (the ``sm`` path's default cap).
SM_CTAS: Final = 8


@attrs.frozen
class AutoChoice:
    """The path ``auto`` uses, per direction, by job size.

    ``buckets`` are ascending block counts; ``paths[direction][i]`` is the path for jobs of at least
    ``buckets[i]`` blocks (and fewer than ``buckets[i+1]``). ``gbps`` keeps what was measured.
    """

    key: str
    buckets: tuple[int, ...]
    paths: dict[str, tuple[str, ...]]
    gbps: dict[str, dict[str, tuple[float, ...]]]

    def path_for(self, direction: Direction, blocks: int) -> str:
        """The path for a job of ``blocks`` blocks in ``direction``."""
        return self.paths[direction.value][max(0, bisect.bisect_right(self.buckets, blocks) - 1)]

    def chooser(self, direction: Direction) -> Callable[[int], str]:
        """:meth:`path_for` of one direction, as a function of the block count (looked up once)."""
        paths, buckets = self.paths[direction.value], self.buckets
        return lambda blocks: paths[max(0, bisect.bisect_right(buckets, blocks) - 1)]


_cache: dict[str, AutoChoice] = {}
_cache_lock = threading.Lock()


def geometry_key(device_index: int, pages: PageTable, allow_sm: bool = False) -> str:
    """The cache key: device name, the page sizes of a record, and ``|sm`` when the ``sm`` path
    competed."""
    name = bindings.capabilities(device_index).device_name
    sizes = ",".join(str(n) for n in pages.nbytes.tolist())
    return f"{name}|{pages.record_bytes}|{sizes}" + ("|sm" if allow_sm else "")


def calibrate(
    device: torch.device,
    pages: PageTable,
    *,
    copier: bindings.Copier,
    staging_bytes_per_direction: int,
    staging_slots: int,
    kernel_ctas: int,
    persist_path: str | None = None,
    allow_sm: bool = False,
) -> AutoChoice:
    """The :class:`AutoChoice` for this device and page geometry (measured once per process).

    With ``persist_path``, a choice saved there for the same key is reused, and a new one is saved.
    ``allow_sm``: the ``sm`` path competes for the smallest jobs (the caller's host pool must be
    addressable by kernels as is).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = geometry_key(index, pages, allow_sm)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    choice = _load(persist_path, key) if persist_path else None
    if choice is None:
        choice = _measure(device, index, pages, key, copier, staging_bytes_per_direction,
                          staging_slots, kernel_ctas, allow_sm)
        if persist_path:
            _save(persist_path, choice)
    with _cache_lock:
        _cache[key] = choice
    return choice


def _scratch_pages(device: torch.device, pages: PageTable, blocks: int) -> tuple[torch.Tensor, PageTable]:
    """A device tensor holding ``blocks`` blocks with the layout's page sizes, each page in its own
    region (as in a per-layer cache: pages of one block are far apart, nothing merges)."""
    strides = [(int(n) + 15) // 16 * 16 for n in pages.nbytes.tolist()]
    offsets = np.cumsum([0] + [s * blocks for s in strides[:-1]]).astype(np.int64)
    total = int(offsets[-1]) + strides[-1] * blocks
    scratch = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
    table = PageTable(
        dev_base=scratch.data_ptr() + offsets,
        dev_stride=np.asarray(strides, dtype=np.int64),
        nbytes=pages.nbytes.copy(),
        host_offset=pages.host_offset.copy(),
        segment=np.arange(len(strides), dtype=np.int64),
        record_bytes=pages.record_bytes,
    )
    return scratch, table


def _measure(
    device: torch.device, index: int, pages: PageTable, key: str, copier: bindings.Copier,
    staging_bytes: int, slots: int, ctas: int, allow_sm: bool,
) -> AutoChoice:
    blocks = max(SIZE_BUCKETS_BLOCKS[-1] + 1, LARGE_JOB_BYTES // max(1, pages.block_bytes))
    slot_bytes = staging_bytes // slots // 4096 * 4096
    candidates = [
        p for p in _CANDIDATES
        if (p != "staged" or slot_bytes >= pages.record_bytes) and (p != "sm" or allow_sm)
    ]
    scratch, table = _scratch_pages(device, pages, 2 * blocks)
    region = RegionOwner.create(num_records=2 * blocks, record_bytes=pages.record_bytes,
                                pinner=bindings.CudaHostPinner(index))
    sizes = (*SIZE_BUCKETS_BLOCKS, blocks)
    gbps: dict[str, dict[str, tuple[float, ...]]] = {}
    paths: dict[str, tuple[str, ...]] = {}
    try:
        for direction in (Direction.STORE, Direction.LOAD):
            plan = CopyPlan(table, region.base_ptr, region.chunk_records, direction)
            with contextlib.ExitStack() as handlers:
                made = {
                    path: handlers.enter_context(
                        _handler(device, plan, path, copier, slot_bytes, slots, ctas, blocks))
                    for path in candidates
                }
                measured = _time_paths(device, plan, made, sizes, blocks, scratch, region)
            _check_bulk(measured, key, direction)
            gbps[direction.value] = measured
            paths[direction.value] = tuple(_fastest(measured, i) for i in range(len(sizes)))
    finally:
        region.cleanup()
        del scratch
    buckets = (*SIZE_BUCKETS_BLOCKS, blocks)
    choice = AutoChoice(key=key, buckets=buckets, paths=paths, gbps=gbps)
    _log.info("auto path calibration for %s: %s", key, paths)
    return choice


def _check_bulk(measured: dict[str, tuple[float, ...]], key: str, direction: Direction) -> None:
    """Refuse a calibration in which no bulk path (``dma``, ``staged``) moved its bytes correctly:
    ``auto`` would have to take a path that failed its own check.

    Raises:
        TransferError: naming the direction and the paths that passed.
    """
    if not any(p != "sm" for p in measured):
        passed = ", ".join(measured) or "none"
        raise TransferError(
            f"auto path calibration for {key}: no bulk path (dma, staged) moved its "
            f"{direction.value} bytes correctly (paths that passed: {passed}); the device or its "
            "driver is at fault - see the log for each path's failure"
        )


def _fastest(measured: dict[str, tuple[float, ...]], index: int) -> str:
    """The path with the highest figure at size ``index`` (the first listed on a tie); ``sm`` only
    in the first :data:`SM_BUCKETS` buckets."""
    allowed = [p for p in measured if p != "sm" or index < SM_BUCKETS]
    return max(allowed, key=lambda path: measured[path][index])


@contextlib.contextmanager
def _handler(
    device: torch.device, plan: CopyPlan, path: str, copier: bindings.Copier, slot_bytes: int,
    slots: int, ctas: int, blocks: int,
) -> Iterator[DirectionHandler]:
    """A handler of ``path`` over the scratch pool, shut down when the block exits."""
    backend: CudaBackend
    if path == "dma":
        backend = CudaBackend.create(plan.direction, device, copier)
    elif path == "sm":
        backend = SmBackend.create_sm(plan.direction, device, copier, SM_CTAS)
    else:
        backend = StagedBackend.create_staged(plan.direction, device, copier, ctas, slots, slot_bytes)
    handler = DirectionHandler.create(direction=plan.direction, plan=plan, backend=backend,
                                      num_src_blocks=2 * blocks, num_dst_blocks=2 * blocks)
    try:
        yield handler
    finally:
        handler.shutdown(WAIT_S)


def turns(paths: Sequence[str], repeats: int) -> list[str]:
    """The order the paths are timed in: every repeat times each path once, starting one path
    later each time, so a drift in the host's speed (a shared machine) weighs on all of them
    alike and none is always timed first or last."""
    n = len(paths)
    return [paths[(r + k) % n] for r in range(repeats) for k in range(n)]


def _time_paths(
    device: torch.device, plan: CopyPlan, handlers: dict[str, DirectionHandler],
    sizes: Sequence[int], blocks: int, scratch: torch.Tensor, region: RegionOwner,
) -> dict[str, tuple[float, ...]]:
    """GB/s of each path at each job size (``sm`` at the first :data:`SM_BUCKETS` sizes only, 0.0
    above), the paths timed in :func:`turns`. A path that fails a job, or whose verified job — into
    a destination cleared just before it — leaves a byte wrong, is left out."""
    records = region.records()
    alive = list(handlers)
    figures: dict[str, list[float]] = {path: [] for path in handlers}
    job = 0

    def run(path: str, ids: np.ndarray) -> float | None:
        nonlocal job
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        handlers[path].submit(job, ids, ids + blocks)
        (result,) = handlers[path].wait([job], WAIT_S)
        job += 1
        if result.ok:
            return time.perf_counter() - start
        _log.warning("auto calibration: path %s failed: %s", path, result.error)
        alive.remove(path)
        return None

    try:
        records.copy_(torch.randint(0, 256, records.shape, dtype=torch.uint8))  # never all zeros
        for index, size in enumerate(sizes):
            ids = np.arange(size, dtype=np.int64)
            here = [p for p in alive if p != "sm" or index < SM_BUCKETS]
            times: dict[str, list[float]] = {path: [] for path in here}
            repeats = REPEATS if size > SIZE_BUCKETS_BLOCKS[-1] else SMALL_REPEATS
            for path in turns(here, repeats):
                if path in alive:
                    seconds = run(path, ids)
                    if seconds is not None:
                        times[path].append(seconds)
            for path in here:
                if path not in alive:
                    continue
                _clear(plan, scratch, records, ids + blocks)
                if run(path, ids) is None:
                    continue
                if not _verified(plan, scratch, records, ids, ids + blocks, blocks):
                    _log.warning("auto calibration: path %s moved bytes wrong; never chosen", path)
                    alive.remove(path)
                    continue
                figures[path].append(size * plan.pages.block_bytes / statistics.median(times[path]) / 1e9)
    except BaseException as exc:
        # The traceback's frames (_clear's, _verified's) hold views of the pool: drop their locals
        # so that the region's cleanup can unmap it while the error propagates.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        del records  # a view of the pool must not outlive its cleanup
    return {path: tuple(figures[path]) + (0.0,) * (len(sizes) - len(figures[path]))
            for path in alive}


def _clear(plan: CopyPlan, scratch: torch.Tensor, records: torch.Tensor, dst: np.ndarray) -> None:
    """Zero the destination of a job writing ``dst`` (host records for a store, device blocks of
    ``scratch`` for a load), so that a path that skips a page cannot pass on an earlier job's
    bytes. ``dst`` is a contiguous range of ids."""
    first, count = int(dst[0]), int(dst.shape[0])
    if plan.direction is Direction.STORE:
        records[first : first + count].zero_()
        return
    pages, base = plan.pages, int(scratch.data_ptr())
    for p in range(pages.num_pages):
        stride = int(pages.dev_stride[p])
        at = int(pages.dev_base[p]) - base + first * stride
        scratch[at : at + count * stride].zero_()


def _verified(
    plan: CopyPlan, scratch: torch.Tensor, records: torch.Tensor, src: np.ndarray,
    dst: np.ndarray, blocks: int,
) -> bool:
    """Whether every page the job moved arrived intact (compared on the CPU, page by page)."""
    device_bytes = scratch.cpu().numpy()
    base = int(scratch.data_ptr())
    host = records.numpy()
    store = plan.direction is Direction.STORE
    dev_blocks, host_blocks = (src, dst) if store else (dst, src)
    pages = plan.pages
    for d, h in zip(dev_blocks.tolist(), host_blocks.tolist()):
        for p in range(pages.num_pages):
            at = int(pages.dev_base[p]) - base + d * int(pages.dev_stride[p])
            n = int(pages.nbytes[p])
            off = int(pages.host_offset[p])
            if not np.array_equal(device_bytes[at : at + n], host[h, off : off + n]):
                return False
    return True


def _load(path: str, key: str) -> AutoChoice | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    entry = data.get("choices", {}).get(key) if data.get("version") == _FILE_VERSION else None
    if not isinstance(entry, dict):
        return None
    try:
        return AutoChoice(
            key=key, buckets=tuple(int(b) for b in entry["buckets"]),
            paths={d: tuple(str(p) for p in v) for d, v in entry["paths"].items()},
            gbps={d: {p: tuple(float(x) for x in g) for p, g in v.items()}
                  for d, v in entry["gbps"].items()},
        )
    except (KeyError, TypeError, ValueError):
        return None


def _save(path: str, choice: AutoChoice) -> None:
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != _FILE_VERSION:
            data = {}
    except (OSError, ValueError):
        data = {}
    data["version"] = _FILE_VERSION
    data.setdefault("choices", {})[choice.key] = {
        "buckets": list(choice.buckets), "paths": {d: list(p) for d, p in choice.paths.items()},
        "gbps": {d: {p: list(g) for p, g in v.items()} for d, v in choice.gbps.items()},
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
