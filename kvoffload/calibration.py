"""Calibration of the ``auto`` transfer path: which path moves a job fastest, by direction and size.

Measures; builds nothing. The caller (the worker's assembly) hands it a factory of scratch host
pools and a factory of one-path handlers — the same components a worker is built from — and it
times them on scratch device tensors shaped like the layout's pages. Owns nothing after it returns
(the factories' context managers release what they made). The engine's device cache is never
touched.

For each direction it times the ``dma`` and ``staged`` paths on jobs of a few sizes (1 block, a few
blocks, about 64 MiB), and the ``sm`` path on the smallest bucket only, where that bucket's job is
small (:func:`sm_competes`; and where the host can map the pool). The paths take turns within
every repeat (see :func:`turns`), so that a shared host's drift weighs on all of them alike. Each
path's last job at each size writes into a cleared destination and every byte is checked; a path
that fails its own check is never chosen. In the *bulk* buckets (those where ``sm`` does not
compete) the bulk paths alive in both directions are timed a second way too, a store and a load of
the bucket's size at once: some hosts move a path fast one way and slowly both ways. Per size
bucket the path kept is the fastest alone in a latency bucket, and in a bulk bucket the one whose
worse ratio to the best figure, alone or both ways, is highest (:func:`_fastest`). Each direction
is chosen on its own: a bucket may take ``dma`` one way and ``staged`` the other, a pair not timed
together.

``sm`` is a latency path: one kernel launch and no DMA hand-off wins for jobs of a few small
blocks, and such a job holds its few CTAs for tens of microseconds; bulk jobs never take it (it
competes with compute for the SMs), whatever their block count (one block of 2 MiB pages is 32 MiB
in an 8-layer layout). The result is cached per process by (device, page geometry, whether ``sm``
was allowed, the issuer, and the layers where a layered load is timed: :func:`geometry_key`) and can
be persisted to a JSON file.

A layered load's path: :class:`LayeredChoice` takes the size bucket's path and sends the load
through ``sm`` where the copy engine would take its layers as many narrow descriptors and ``sm``
moves them faster. Whether it does differs between hosts (docs/design.md §12), so where a layout's
layers are narrow and ``sm`` competes, the calibration times one more job: a layered load of about
64 MiB from records apart (every other record: a descriptor per record and layer) through each
path that passed its load checks, bytes checked as the others' (:data:`LAYERED`).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import torch

from kvoffload._descriptors import CopyPlan, PageTable, mostly_apart
from kvoffload.errors import TransferError
from kvoffload.records import Direction, TransferResult

__all__ = [
    "BOTH_WAYS", "CANDIDATES", "LAYERED", "AutoChoice", "HandlerFactory", "LayeredChoice", "PoolFactory", "calibrate",
    "geometry_key", "scattered", "sm_competes",
]

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
#: 3: bulk buckets chosen on both-ways figures too; 4: the copy kernel's units cut to 4 KiB, which
#: made small `staged` jobs faster; 5: the device blocks of a timed job out of order (:func:`scattered`);
#: 6: a `staged` layered load of narrow layers from records apart moves them in groups, faster than
#: the figures of earlier files say (:mod:`kvoffload._layer_groups`); 7: ``sm`` runs 4 CTAs, not 8
#: (:data:`kvoffload.backends.kernel.SM_CTAS`) (a file of an earlier version is measured again).
_FILE_VERSION: Final = 7
#: The key of :attr:`AutoChoice.gbps` holding the both-ways figures.
BOTH_WAYS: Final = "both"
#: The key of :attr:`AutoChoice.gbps` holding a layered load's figures from records apart, one per
#: path (measured only for a layout of narrow layers where ``sm`` competes: :func:`times_layered`).
LAYERED: Final = "layered"
#: The paths ``auto`` chooses among, in order of preference on a tie.
CANDIDATES: Final = ("dma", "staged", "sm")
#: Size buckets (from the smallest) where the ``sm`` path competes.
SM_BUCKETS: Final = 1
#: ... and only where the bucket's job is at most this many bytes. On the H200 a 1-block job of 64
#: pages of 32 KiB (2 MiB) took 1.27x a pinned copy on ``sm`` against 1.48-1.69x on the other
#: paths, while a 1-block job of 2 MiB pages (32 MiB) calibrated ``sm``, ``staged`` and ``dma``
#: within 4% of each other and ``sm`` was chosen in some runs: a 64 MiB store alone then took 0.93x
#: a pinned copy against 0.97x on ``dma`` (docs/design.md §7).
SM_MAX_JOB_BYTES: Final = 8 << 20


#: A layered load whose layers' copies are host byte ranges narrower than this, on average, goes
#: through ``sm`` where its size bucket's path would copy them as that many descriptors
#: (:class:`LayeredChoice`), unless at most :data:`~kvoffload._descriptors.SHORT_RUNS_SHARE` of
#: its rows lies in runs of records too short for the issuer's strided copies
#: (:func:`~kvoffload._descriptors.mostly_apart`).
NARROW_LAYER_BYTES: Final = 64 << 10


class LayeredChoice:
    """``auto``'s path for a layered load (docs/design.md §12, *The path of a layered load*): the
    size bucket's path, but ``sm`` where that path would move each layer as one descriptor per
    record's narrow byte range. A layer's span of a record is its pages in that record (two pages
    of 4 KiB in a per-layer layout of K and V pages: 8 KiB); ``dma`` copies every span as a
    descriptor, ``staged`` too, but for records that follow each other in the pool in runs of at
    least ``strided_min_rows`` (the native issuer's strided copies; 0: none). Narrow descriptors
    are slow on the copy engine, while ``sm``'s kernel reads host memory at one pace at any page
    size (how fast is the host's: 0.59-0.62x a pinned copy on two H100 hosts): on one H100 host a
    16-layer load of 256 blocks at 8 KiB spans took 0.29x a pinned
    copy through ``staged`` from every other record, 0.33x from records picked at random, 0.15x
    through the Python issuer's ``staged`` from any records, and 0.83-0.84x through ``sm`` from
    any; from records in order (one strided copy a layer) ``staged`` took 0.84x too, without
    holding SMs (``python -m tests.gpu.probe_layered_records``).

    But on another H100 host ``sm`` took 0.61-0.62x at 8-32 KiB spans, where ``staged`` from
    records apart took 0.30x at 8 KiB and 0.88x at 32 KiB: which path is faster from scattered
    records is the host's. So where the calibration timed a layered load from records apart
    (``measured``: :data:`LAYERED`'s figures), ``sm`` is taken only if it moved that load faster
    than the size bucket's path; without figures (a layout calibrated before, or none) the rule
    alone decides.

    Whether the layers are narrow is the layout's (every layer's byte ranges of a record, judged
    once), so every part of a job (the Python issuer issues layer 0 apart from the others) takes
    the same path.

    A load whose pairs run on both sides is not turned over to ``dma``'s direct strided copies
    where the size bucket takes ``staged``: beside or after an SM kernel (the engine's compute)
    they moved the load slower than ``staged`` and made layer 0 later (docs/design.md §16, *Direct
    copies under auto, turned over*). Where the bucket takes ``dma``, its plans make them anyway.
    Owns nothing but that answer.
    """

    def __init__(self, size_choice: Callable[[int], str], layer_tables: Sequence[PageTable],
                 measured: Mapping[str, Sequence[float]] | None = None) -> None:
        self._size_choice = size_choice
        #: the layers' copies average under NARROW_LAYER_BYTES (False: no layers)
        self.narrow = narrow_layers(layer_tables)
        sm = measured.get("sm", ()) if measured is not None else ()
        #: the size paths that keep a narrow layered load: measured no slower than ``sm`` from
        #: records apart (every path, where ``sm`` has no figure: it failed its layered check);
        #: None: not measured
        self.keeps: frozenset[str] | None
        if measured is None:
            self.keeps = None
        elif len(sm) == 0 or float(sm[0]) <= 0.0:
            self.keeps = frozenset(CANDIDATES) - {"sm"}
        else:
            self.keeps = frozenset(path for path, g in measured.items()
                                   if path != "sm" and len(g) > 0 and float(g[0]) >= float(sm[0]))

    def path(self, host_blocks: npt.NDArray[np.int64], strided_min_rows: int) -> str:
        """The path of a layered load (of this choice's layout, any part of it) from host records
        ``host_blocks``, through an issuer whose staged rows in runs of at least
        ``strided_min_rows`` records go as strided copies (0: none)."""
        pairs = int(host_blocks.shape[0])
        name = self._size_choice(pairs)
        if not self.narrow or name not in ("dma", "staged") or (self.keeps is not None and name in self.keeps):
            return name
        if name == "staged" and not mostly_apart(host_blocks, strided_min_rows):
            return name
        return "sm"


def narrow_layers(layer_tables: Sequence[PageTable]) -> bool:
    """Whether layers' copies of a record (every layer's byte ranges) average under
    :data:`NARROW_LAYER_BYTES` (False for no layers)."""
    runs = [table.record_runs()[1] for table in layer_tables]
    count = sum(int(sizes.shape[0]) for sizes in runs)
    return count > 0 and sum(int(sizes.sum()) for sizes in runs) < NARROW_LAYER_BYTES * count


class ScratchPool(Protocol):
    """The host pool calibration copies to and from (a region, as the worker's)."""

    base_ptr: int

    @property
    def chunk_records(self) -> int:
        """Records per pin chunk."""

    def records(self) -> torch.Tensor:
        """The pool as ``uint8 [records, record_bytes]``."""


class PathHandler(Protocol):
    """A direction handler moving jobs on one path (what :class:`HandlerFactory` makes)."""

    def submit(self, job_id: int, src_blocks: npt.NDArray[np.int64],
               dst_blocks: npt.NDArray[np.int64]) -> None:
        """Submit one job."""

    def submit_by_layer(self, job_id: int, src_blocks: npt.NDArray[np.int64], dst_blocks: npt.NDArray[np.int64],
                        tables: tuple[PageTable, ...]) -> object:
        """Submit one job that lands layer after layer (``tables[i]``: layer ``i``'s pages)."""

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[TransferResult]:
        """Wait for jobs, with a deadline."""


#: ``(num_records, record_bytes)`` -> a scratch pool, released when the context exits.
PoolFactory = Callable[[int, int], contextlib.AbstractContextManager[ScratchPool]]
#: ``(path, plan, num_blocks)`` -> a handler of that path over the plan, shut down when the context
#: exits.
HandlerFactory = Callable[[str, CopyPlan, int], contextlib.AbstractContextManager[PathHandler]]

#: The jobs a path runs at once in one timing: each a handler and its plan (one: a direction alone;
#: a store's and a load's: both ways at once).
Lane = tuple[tuple[PathHandler, CopyPlan], ...]


@attrs.frozen
class AutoChoice:
    """The path ``auto`` uses, per direction, by job size.

    ``buckets`` are ascending block counts; ``paths[direction][i]`` is the path for jobs of at least
    ``buckets[i]`` blocks (and fewer than ``buckets[i+1]``). ``gbps`` keeps what was measured:
    ``gbps[direction][path]`` per bucket, and ``gbps["both"][path]`` (:data:`BOTH_WAYS`) the bytes
    of a store and a load at once over their time, 0.0 where not timed.
    """

    key: str
    buckets: tuple[int, ...]
    paths: dict[str, tuple[str, ...]]
    gbps: dict[str, dict[str, tuple[float, ...]]]

    def layered(self) -> dict[str, tuple[float, ...]] | None:
        """A layered load's GB/s from records apart per path (:data:`LAYERED`), or None where not
        measured (for :class:`LayeredChoice`)."""
        return self.gbps.get(LAYERED)

    def path_for(self, direction: Direction, blocks: int) -> str:
        """The path for a job of ``blocks`` blocks in ``direction``."""
        return self.paths[direction.value][max(0, bisect.bisect_right(self.buckets, blocks) - 1)]

    def chooser(self, direction: Direction) -> Callable[[int], str]:
        """:meth:`path_for` of one direction, as a function of the block count (looked up once)."""
        paths, buckets = self.paths[direction.value], self.buckets
        return lambda blocks: paths[max(0, bisect.bisect_right(buckets, blocks) - 1)]

    def describe(self) -> str:
        """One line: the key, then per direction and bucket the path kept and each path's GB/s
        alone (``-``: not timed there, or not in a saved file's figures), e.g.
        ``load 1 block: sm (sm 30.1, staged 28.7, dma 9.2)``."""
        parts = [self.key]
        for direction in ("store", "load"):
            figures = self.gbps.get(direction, {})
            for i, size in enumerate(self.buckets):
                timed = ", ".join(f"{path} {g[i]:.1f}" if i < len(g) and g[i] > 0.0 else f"{path} -"
                                  for path, g in figures.items())
                kept = self.paths[direction][i]
                parts.append(f"{direction} {size} block{'s' if size != 1 else ''}: {kept} ({timed})")
        layered = self.layered()
        if layered is not None:
            timed = ", ".join(f"{path} {g[0]:.1f}" if g and g[0] > 0.0 else f"{path} -" for path, g in layered.items())
            parts.append(f"layered load from records apart: {timed}")
        return "; ".join(parts)


_cache: dict[str, AutoChoice] = {}
_cache_lock = threading.Lock()


def geometry_key(
    device_name: str, pages: PageTable, candidates: Sequence[str], *, issuer: str = "python",
    layers: Sequence[PageTable] = (),
) -> str:
    """The cache key: device name, the page sizes of a record, ``|sm`` when the ``sm`` path
    competed, ``|native`` when the paths were timed through the native issuer (its jobs cost
    the host less than the Python issuer's, and not alike on every path: a small job's fastest path
    may differ), and ``|layers=`` a digest of the layers' byte ranges of a record where a layered
    load is timed too (:func:`times_layered`)."""
    sizes = ",".join(str(n) for n in pages.nbytes.tolist())
    key = (f"{device_name}|{pages.record_bytes}|{sizes}" + ("|sm" if "sm" in candidates else "")
           + ("|native" if issuer == "native" else ""))
    if times_layered(candidates, layers):
        ranges = ";".join(",".join(f"{o}+{n}" for o, n in zip(t.host_offset.tolist(), t.nbytes.tolist()))
                          for t in layers)
        key += "|layers=" + hashlib.sha256(ranges.encode()).hexdigest()[:16]
    return key


def times_layered(candidates: Sequence[str], layers: Sequence[PageTable]) -> bool:
    """Whether the calibration times a layered load too: the layers are narrow
    (:func:`narrow_layers`) and ``sm`` competes."""
    return "sm" in candidates and narrow_layers(layers)


def calibrate(
    device: torch.device,
    pages: PageTable,
    *,
    key: str,
    candidates: Sequence[str],
    scratch_pool: PoolFactory,
    handler_for: HandlerFactory,
    persist_path: str | None = None,
    layers: Sequence[PageTable] = (),
) -> AutoChoice:
    """The :class:`AutoChoice` for ``key`` (see :func:`geometry_key`, given the same ``layers``),
    measured once per process.

    ``candidates`` are the paths that may be chosen (``sm`` only where the caller's host pool is
    addressable by kernels as is; ``staged`` only where a record fits a staging slot). ``layers``:
    the layout's layer tables, for the layered load timed where :func:`times_layered`. With
    ``persist_path``, a choice saved there for the same key is reused, and a new one is saved.

    Raises:
        TransferError: no bulk path (``dma``, ``staged``) moved its bytes correctly in a direction,
            alone or with the other direction at once.
    """
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    choice = _load(persist_path, key, candidates) if persist_path else None
    if choice is None:
        choice = _measure(device, pages, key, candidates, scratch_pool, handler_for, layers)
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
    device: torch.device, pages: PageTable, key: str, candidates: Sequence[str],
    scratch_pool: PoolFactory, handler_for: HandlerFactory, layers: Sequence[PageTable] = (),
) -> AutoChoice:
    """Measure the choice for ``key``: each direction's paths alone, then the bulk paths that
    passed both directions with a store and a load at once, then the path each bucket keeps
    (:func:`_fastest`); and where :func:`times_layered`, a layered load from records apart through
    each path that passed its loads (:func:`_time_layered`). Scratch device memory and the scratch
    pool live for this call only.

    Raises:
        TransferError: as :func:`calibrate`.
    """
    blocks = max(SIZE_BUCKETS_BLOCKS[-1] + 1, LARGE_JOB_BYTES // max(1, pages.block_bytes))
    scratch, table = _scratch_pages(device, pages, 2 * blocks)
    sizes = (*SIZE_BUCKETS_BLOCKS, blocks)
    gbps: dict[str, dict[str, tuple[float, ...]]] = {}
    directions = (Direction.STORE, Direction.LOAD)
    try:
        with scratch_pool(2 * blocks, pages.record_bytes) as region:
            region.records().copy_(  # never all zeros: a path that copies nothing cannot pass
                torch.randint(0, 256, (2 * blocks, pages.record_bytes), dtype=torch.uint8))
            plans = {d: CopyPlan(table, region.base_ptr, region.chunk_records, d) for d in directions}
            for direction in directions:
                with contextlib.ExitStack() as handlers:
                    lanes: dict[str, Lane] = {
                        path: ((handlers.enter_context(handler_for(path, plans[direction], 2 * blocks)),
                                plans[direction]),)
                        for path in candidates
                    }
                    measured = _time_lanes(device, lanes, sizes, blocks, scratch, region, _alone)
                _check_bulk(measured, key, direction)
                gbps[direction.value] = measured
            bulk = [p for p in candidates if p != "sm" and all(p in gbps[d.value] for d in directions)]
            with contextlib.ExitStack() as handlers:
                lanes = {
                    path: tuple((handlers.enter_context(handler_for(path, plans[d], 2 * blocks)), plans[d])
                                for d in directions)
                    for path in bulk
                }
                both = _time_lanes(device, lanes, sizes, blocks, scratch, region, _both_ways)
            _drop_failed(gbps, set(bulk) - set(both), key)
            gbps[BOTH_WAYS] = both
            if times_layered(candidates, layers):
                tables = _scratch_layers(pages, table, layers)
                with contextlib.ExitStack() as handlers:
                    made = {path: handlers.enter_context(handler_for(path, plans[Direction.LOAD], 2 * blocks))
                            for path in candidates if path in gbps[Direction.LOAD.value]}
                    gbps[LAYERED] = _time_layered(device, made, plans[Direction.LOAD], tables, blocks,
                                                  scratch, region)
    finally:
        del scratch
    paths = {d.value: tuple(_fastest(gbps[d.value], i, both) for i in range(len(sizes))) for d in directions}
    choice = AutoChoice(key=key, buckets=sizes, paths=paths, gbps=gbps)
    _log.info("auto path calibration for %s: %s", key, paths)
    return choice


def _scratch_layers(pages: PageTable, table: PageTable, layers: Sequence[PageTable]) -> tuple[PageTable, ...]:
    """The layers of the layout's ``pages`` as tables of the scratch ``table`` (the same pages, in
    scratch device memory). A layer's piece is a whole page or a slice of one (a cross-layer
    tensor's ``layer_dim`` after its block dim): the page holding it is the one whose byte range of
    a record starts last at or before it, and the piece lies as far into the scratch page as into
    the record's (a page's bytes run alike on both sides)."""
    order = np.argsort(pages.host_offset, kind="stable")
    starts = pages.host_offset[order]
    made = []
    for layer in layers:
        at = order[np.searchsorted(starts, layer.host_offset, side="right") - 1]
        inside = layer.host_offset - pages.host_offset[at]
        made.append(PageTable(dev_base=table.dev_base[at] + inside, dev_stride=table.dev_stride[at],
                              nbytes=layer.nbytes.copy(), host_offset=layer.host_offset.copy(),
                              segment=table.segment[at], record_bytes=table.record_bytes))
    return tuple(made)


def _time_layered(
    device: torch.device, handlers: Mapping[str, PathHandler], plan: CopyPlan, tables: tuple[PageTable, ...],
    blocks: int, scratch: torch.Tensor, region: ScratchPool,
) -> dict[str, tuple[float, ...]]:
    """GB/s of a layered load of ``blocks`` blocks over ``tables`` from every other record (none
    follows another: every layer's span of every record is a descriptor of its own on ``dma`` and
    ``staged``) into device blocks ``blocks..2 * blocks``, per path, call to result, median of
    :data:`REPEATS` taken in :func:`turns`; a path whose job fails, or whose last job (into a
    cleared destination) leaves a byte wrong, is left out."""
    records = region.records()
    host = 2 * np.arange(blocks, dtype=np.int64)
    dst = blocks + np.arange(blocks, dtype=np.int64)
    times: dict[str, list[float]] = {path: [] for path in handlers}
    alive = list(handlers)
    job = 0

    def run(path: str) -> float | None:
        nonlocal job
        _synchronize(device)
        start = time.perf_counter()
        handlers[path].submit_by_layer(job, host, dst, tables)
        (result,) = handlers[path].wait([job], WAIT_S)
        job += 1
        if result.ok:
            return time.perf_counter() - start
        _log.warning("auto calibration: a layered load through %s failed: %s", path, result.error)
        alive.remove(path)
        return None

    try:
        for path in turns(list(handlers), REPEATS):
            if path in alive and (seconds := run(path)) is not None:
                times[path].append(seconds)
        for path in list(alive):
            _clear(plan, scratch, records, dst)
            if run(path) is not None and not _verified(plan, scratch, records, host, dst, blocks):
                _log.warning("auto calibration: a layered load through %s moved bytes wrong; never "
                             "chosen for one", path)
                alive.remove(path)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # as _time_lanes: no view of the pool survives
        raise
    finally:
        del records
    moved = blocks * plan.pages.block_bytes
    return {path: (moved / statistics.median(times[path]) / 1e9,) for path in alive}


def _drop_failed(gbps: dict[str, dict[str, tuple[float, ...]]], failed: set[str], key: str) -> None:
    """Leave the paths that ``failed`` both ways out of each direction's figures: they are never
    chosen, either way.

    Raises:
        TransferError: a direction left with no bulk path.
    """
    for direction in (Direction.STORE, Direction.LOAD):
        measured = {p: g for p, g in gbps[direction.value].items() if p not in failed}
        _check_bulk(measured, key, direction, both_ways=sorted(failed))
        gbps[direction.value] = measured


def _check_bulk(
    measured: dict[str, tuple[float, ...]], key: str, direction: Direction,
    both_ways: Sequence[str] = (),
) -> None:
    """Refuse a calibration in which no bulk path (``dma``, ``staged``) moved its bytes correctly:
    ``auto`` would have to take a path that failed its own check. ``both_ways``: the paths that
    passed alone and failed with both directions at once (the check after that timing).

    Raises:
        TransferError: naming the direction and the paths that passed.
    """
    if not any(p != "sm" for p in measured):
        passed = ", ".join(measured) or "none"
        how = (f"with both directions at once ({', '.join(both_ways)} failed there)" if both_ways
               else "correctly")
        raise TransferError(
            f"auto path calibration for {key}: no bulk path (dma, staged) moved its "
            f"{direction.value} bytes {how} (paths that passed: {passed}); the device or its "
            "driver is at fault - see the log for each path's failure"
        )


def sm_competes(index: int, job_bytes: int) -> bool:
    """Whether the ``sm`` path is timed and may be chosen in size bucket ``index``, whose job moves
    ``job_bytes``: in the first :data:`SM_BUCKETS` buckets, for a job of at most
    :data:`SM_MAX_JOB_BYTES`."""
    return index < SM_BUCKETS and job_bytes <= SM_MAX_JOB_BYTES


def _fastest(
    measured: dict[str, tuple[float, ...]], index: int,
    both: dict[str, tuple[float, ...]] | None = None,
) -> str:
    """The path kept at size ``index`` (the first listed on a tie); ``sm`` only in the first
    :data:`SM_BUCKETS` buckets (where :func:`sm_competes` said no, its figure is 0.0).

    Where no path has a both-ways figure at ``index`` (a latency bucket, or none given), or no path
    moved anything alone: the highest figure alone. Where some do (a bulk bucket): the highest
    *score*, a path's figure alone over the best alone or its figure both ways over the best both
    ways, whichever is lower — so a path a few percent ahead alone but well behind both ways is not
    kept. A path not timed both ways there (one that passed alone in one direction only) scores 0.
    """
    allowed = [p for p in measured if p != "sm" or index < SM_BUCKETS]
    best_alone = max(measured[p][index] for p in allowed)
    timed = {p: both[p][index] for p in allowed if both and p in both and both[p][index] > 0.0}
    if not timed or best_alone <= 0.0:
        return max(allowed, key=lambda path: measured[path][index])
    best_both = max(timed.values())

    def score(path: str) -> float:
        return min(measured[path][index] / best_alone, timed[path] / best_both) if path in timed else 0.0

    return max(allowed, key=score)


def turns(paths: Sequence[str], repeats: int) -> list[str]:
    """The order the paths are timed in: every repeat times each path once, starting one path
    later each time, so a drift in the host's speed (a shared machine) weighs on all of them
    alike and none is always timed first or last."""
    n = len(paths)
    return [paths[(r + k) % n] for r in range(repeats) for k in range(n)]


def _alone(path: str, index: int, job_bytes: int) -> bool:
    """Whether a direction alone times ``path`` at size ``index``: every path but ``sm``, which
    only where :func:`sm_competes`."""
    return path != "sm" or sm_competes(index, job_bytes)


def _both_ways(path: str, index: int, job_bytes: int) -> bool:
    """Whether both ways at once time a path at size ``index``: in the bulk buckets, where ``sm``
    does not compete (the latency buckets' jobs are chosen on their time alone)."""
    return not sm_competes(index, job_bytes)


def _repeats(size: int) -> int:
    """Repeats of a job of ``size`` blocks: the small buckets' jobs (tens of microseconds) need
    more samples on a shared host."""
    return REPEATS if size > SIZE_BUCKETS_BLOCKS[-1] else SMALL_REPEATS


def scattered(n: int) -> npt.NDArray[np.int64]:
    """``0..n-1`` in an order where no id is followed by the next one (a stride coprime to ``n``):
    the device blocks of a timed job. An engine's pool hands out blocks freed in any order, so its
    jobs' blocks rarely follow each other, and ``dma`` moves pairs that follow each other on both
    sides as direct strided copies, which run slower after any GEMM than on an idle device
    (docs/design.md §16, *What slows a strided copy*): timed on blocks in order, ``dma`` would be
    timed on copies an engine's jobs seldom get, in a state they seldom run in."""
    if n < 3:
        return np.arange(n - 1, -1, -1, dtype=np.int64)
    stride = next(s for s in range(max(2, math.isqrt(n)), n) if math.gcd(s, n) == 1)
    return np.arange(n, dtype=np.int64) * stride % n


def _time_lanes(
    device: torch.device, lanes: dict[str, Lane], sizes: Sequence[int], blocks: int,
    scratch: torch.Tensor, region: ScratchPool, timed: Callable[[str, int, int], bool],
) -> dict[str, tuple[float, ...]]:
    """GB/s of each path at each job size where ``timed(path, index, job_bytes)``, 0.0 elsewhere:
    the bytes of its lane's jobs (each of the size, submitted together: a store from device blocks
    ``scattered(size)`` to records ``blocks..blocks+size`` in order, a load from records
    ``0..size`` in order to device blocks ``blocks + scattered(size)``) over the time from the
    first submit to the last result, the paths
    timed in :func:`turns`. Lanes of a store and a load never meet: the store reads device blocks
    the load does not write and writes records the load does not read. A path that fails a job, or
    whose verified jobs — into destinations cleared just before — leave a byte wrong, is left out.
    The records hold random bytes (the caller's), so a path that copies nothing cannot pass."""
    records = region.records()
    alive = list(lanes)
    figures: dict[str, list[float]] = {path: [0.0] * len(sizes) for path in lanes}
    block_bytes = next(iter(lanes.values()))[0][1].pages.block_bytes if lanes else 0
    job = 0

    def run(path: str, pairs: Mapping[Direction, tuple[np.ndarray, np.ndarray]]) -> float | None:
        nonlocal job
        _synchronize(device)
        start = time.perf_counter()
        for handler, plan in lanes[path]:
            handler.submit(job, *pairs[plan.direction])
        results = [handler.wait([job], WAIT_S)[0] for handler, _ in lanes[path]]
        job += 1
        failed = [r for r in results if not r.ok]
        if not failed:
            return time.perf_counter() - start
        _log.warning("auto calibration: path %s failed%s: %s", path, _way(lanes[path]), failed[0].error)
        alive.remove(path)
        return None

    try:
        for index, size in enumerate(sizes):
            ids = np.arange(size, dtype=np.int64)
            order = scattered(size)  # each direction's (source, destination) ids, made once a size
            pairs = {Direction.STORE: (order, ids + blocks), Direction.LOAD: (ids, order + blocks)}
            here = [p for p in alive if timed(p, index, size * block_bytes)]
            times: dict[str, list[float]] = {path: [] for path in here}
            for path in turns(here, _repeats(size)):
                if path in alive:
                    seconds = run(path, pairs)
                    if seconds is not None:
                        times[path].append(seconds)
            for path in here:
                if path not in alive:
                    continue
                for _, plan in lanes[path]:
                    _clear(plan, scratch, records, ids + blocks)
                if run(path, pairs) is None:
                    continue
                if not all(_verified(plan, scratch, records, *pairs[plan.direction], blocks)
                           for _, plan in lanes[path]):
                    _log.warning("auto calibration: path %s moved bytes wrong%s; never chosen", path,
                                 _way(lanes[path]))
                    alive.remove(path)
                    continue
                moved = len(lanes[path]) * size * block_bytes
                figures[path][index] = moved / statistics.median(times[path]) / 1e9
    except BaseException as exc:
        # The traceback's frames (_clear's, _verified's) hold views of the pool: drop their locals
        # so that the region's cleanup can unmap it while the error propagates.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        del records  # a view of the pool must not outlive its cleanup
    return {path: tuple(figures[path]) for path in alive}


def _way(lane: Lane) -> str:
    """How a lane's jobs ran, for the log: nothing for a direction alone."""
    return " both ways at once" if len(lane) > 1 else ""


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU device, as in the tests)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _read(path: str) -> dict[str, Any]:
    """The calibration file's contents when it is one of this version; {} for anything else (no
    file, unreadable, not JSON, nested past the parser's depth, another shape or version)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _FILE_VERSION:
        return {}
    if not isinstance(data.get("choices"), dict):
        return {}
    return data


def _load(path: str, key: str, candidates: Sequence[str]) -> AutoChoice | None:
    """The saved choice for ``key``, or None (then measured again) when there is none or it is not
    one this worker can use: ascending positive block counts, and for each direction one of
    ``candidates`` per bucket."""
    data = _read(path)
    entry = data["choices"].get(key) if data else None
    if not isinstance(entry, dict):
        return None
    try:
        buckets = tuple(int(b) for b in entry["buckets"])
        paths = {d: tuple(str(p) for p in entry["paths"][d]) for d in (Direction.STORE.value, Direction.LOAD.value)}
        raw = entry["gbps"]
        gbps = {str(d): {str(p): tuple(float(x) for x in g) for p, g in v.items()} for d, v in raw.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if (not buckets or buckets[0] < 1 or list(buckets) != sorted(set(buckets))
            or any(isinstance(entry["paths"][d], str) or len(p) != len(buckets) or not set(p) <= set(candidates)
                   for d, p in paths.items())):
        return None
    return AutoChoice(key=key, buckets=buckets, paths=paths, gbps=gbps)


def _save(path: str, choice: AutoChoice) -> None:
    """Add ``choice`` to the calibration file (written whole under a name of its own, then renamed
    over it, so a reader never sees a torn file). A file that cannot be written is logged: the
    choice is still used by this process."""
    data = _read(path) or {"version": _FILE_VERSION, "choices": {}}
    data["choices"][choice.key] = {
        "buckets": list(choice.buckets), "paths": {d: list(p) for d, p in choice.paths.items()},
        "gbps": {d: {p: list(g) for p, g in v.items()} for d, v in choice.gbps.items()},
    }
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=os.path.dirname(path) or ".")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        _log.warning("the calibration could not be saved to %s (%s): it is measured again next time",
                     path, exc)
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
