"""``python -m kvoffload bench``: every transfer path side by side with the link limit, in one run.

Measured on the same buffers in one process: the link limit (one large pinned copy each way, and
both at once), a per-page ``cuMemcpyAsync`` loop (what engines did before batching), and the
worker's ``dma``, ``staged``, ``sm`` and ``auto`` paths, over page sizes from 4 KiB to 2 MiB, for
store, load and both directions at once; optionally beside a bf16 GEMM stream, reporting the GEMM's
slowdown per path. Every transferred byte is checked. Figures are printed as GB/s and as a ratio to
the link limit measured in the same run; ``--json`` writes them all. ``--rounds N`` measures each
path N times, the paths taking turns round by round over one layout (each figure the median, with
its range): single measurements of one path differ by up to about 10% between runs on one host, so
two paths a few percent apart need it. Instead of that:
``--latency`` and ``--layerwise`` measure what one job costs (:mod:`kvoffload.cli.latency_bench`),
``--disk DIR`` the disk tier against raw O_DIRECT, ``--ranks N`` a host pool shared by N rank
processes (:mod:`kvoffload.cli.ranks_bench`), ``--remote mooncake|redis`` the remote tier against the
store's own client (:mod:`kvoffload.cli.remote_bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Final, TextIO, get_args

import attrs
import numpy as np
import torch

from kvoffload import DeviceLayout, IssuerName, Worker
from kvoffload.cli._args import (check_device_memory, check_memory, finite_float, int_in, int_list, names,
                                writable_file)
from kvoffload.cli._torch import new_event, new_stream

__all__ = ["BenchRow", "main"]

_GB: Final = 1e9
KIB: Final = 1 << 10
MIB: Final = 1 << 20
PAGE_SIZES: Final = (4 * KIB, 16 * KIB, 32 * KIB, 64 * KIB, 256 * KIB, 2 * MIB)
QUICK_PAGE_SIZES: Final = (4 * KIB, 32 * KIB, 2 * MIB)
PATHS: Final = ("loop", "dma", "staged", "sm", "auto")
#: A block is about this large whatever the page size (pages per block = this / page size).
BLOCK_BYTES: Final = 2 * MIB
JOB_BYTES: Final = 64 * MIB
#: Bytes moved per measurement (16 jobs of 64 MiB with ``--quick``, which finishes within a minute).
TOTAL_BYTES: Final = 2048 * MIB
QUICK_TOTAL_BYTES: Final = 1024 * MIB
#: With ``--quick``, the per-page copy loop moves at most this much per measurement: it runs at a
#: few GB/s at small pages, where this is already a measurement of tens of milliseconds.
QUICK_LOOP_BYTES: Final = 256 * MIB
TIMEOUT_S: Final = 300.0
#: The most ``--rounds``.
MAX_ROUNDS: Final = 100
GEMM_N: Final = 8192
#: Products per GEMM window (about 30 ms on an H100) and store jobs kept in flight beside it.
GEMM_WINDOW_PRODUCTS: Final = 20
GEMM_JOBS_IN_FLIGHT: Final = 4
#: Rounds of (GEMM alone, GEMM beside transfers, GEMM alone) per figure; the median and the
#: quartiles are reported. Single rounds on one H100 host ranged from -3.6% to +14.1% beside the
#: same stores (the GEMM alone from 56 to 75 ms between rounds), so a median of 5 could not tell
#: 2% from 5%: many short rounds instead of a few long ones.
GEMM_ROUNDS: Final = 15
SMALL_JOB_REPEATS: Final = 20
#: Bytes of each pinned copy that measures the link limit.
LINK_PROBE_BYTES: Final = 1 << 30
#: Largest ``--pages`` entry, KiB: a block is about :data:`BLOCK_BYTES` whatever the page size.
MAX_PAGE_KIB: Final = BLOCK_BYTES // KIB


@attrs.frozen
class BenchRow:
    """One path at one page size; GB/s, and GEMM slowdown (None when not measured)."""

    page_bytes: int
    path: str
    #: The paths the jobs took (``auto`` chooses per job), sorted and comma-separated.
    taken: str
    store_gbps: float
    load_gbps: float
    both_gbps: float
    gemm_slowdown: float | None
    #: the rounds' slowdowns' first and third quartiles (None when not measured)
    gemm_quartiles: tuple[float, float] | None
    gemm_store_gbps: float | None
    verified_bytes: int
    mismatched_blocks: int
    #: rounds measured (each figure their median)
    rounds: int = 1
    #: the lowest and highest GB/s over the rounds: store, load, both at once
    spread: tuple[tuple[float, float], tuple[float, float], tuple[float, float]] | None = None


def _log(out: TextIO, message: str) -> None:
    print(message, file=out, flush=True)


def link_limits(device: torch.device, nbytes: int) -> tuple[float, float, float]:
    """GB/s of one large pinned copy d2h, h2d, and both at once (separate buffers, two streams)."""
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    streams = [new_stream(device), new_stream(device)]

    def timed(pairs: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]]) -> float:
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for dst, src, stream in pairs:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return len(pairs) * nbytes / best / _GB

    d2h = timed([(hosts[0], devs[0], streams[0])])
    h2d = timed([(devs[1], hosts[1], streams[1])])
    both = timed([(hosts[0], devs[0], streams[0]), (devs[1], hosts[1], streams[1])])
    return d2h, h2d, both


def _layout(device: torch.device, page_bytes: int, num_blocks: int) -> DeviceLayout:
    pages = max(1, BLOCK_BYTES // page_bytes)
    cache = torch.randint(0, 256, (pages, num_blocks, page_bytes), dtype=torch.uint8, device=device)
    return DeviceLayout.from_tensors({"kv": cache}, block_dim=1)


def _worker(layout: DeviceLayout, num_host: int, path: str, kernel_ctas: int | None = None) -> Worker:
    if path == "loop":
        return Worker.create(layout, num_host, path="dma", copy_method="per-copy")
    return Worker.create(layout, num_host, path=path, kernel_ctas=kernel_ctas)  # type: ignore[arg-type]


def _run(w: Worker, jobs: list[tuple[str, np.ndarray, np.ndarray]], first: int,
         taken: set[str] | None = None) -> float:
    """Submit the jobs back to back, wait for all; wall seconds from first submit to last result
    (the paths the jobs took added to ``taken``)."""
    torch.cuda.synchronize(w.layout.device)
    start = time.perf_counter()
    for i, (kind, src, dst) in enumerate(jobs):
        (w.store if kind == "store" else w.load)(first + i, src, dst)
    results = w.wait(list(range(first, first + len(jobs))), TIMEOUT_S)
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} job(s) failed: {failed[0].error}")
    if taken is not None:
        taken.update(r.path for r in results)
    return elapsed


def _split(kind: str, src: np.ndarray, dst: np.ndarray, per_job: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    return [(kind, src[i : i + per_job], dst[i : i + per_job]) for i in range(0, src.shape[0], per_job)]


def _mismatches_host(w: Worker, layout: DeviceLayout, dev: np.ndarray, host: np.ndarray) -> int:
    """Blocks whose host record ``host[i]`` differs from device block ``dev[i]``, compared on the
    device (the whole pool crosses the link once, from its pinned pages)."""
    records = w.host_records()
    pool = records.to(layout.device)
    del records  # no view of the pool outlives this call
    rows = torch.from_numpy(np.ascontiguousarray(host)).to(layout.device)
    bad = 0
    for i in range(0, dev.shape[0], 64):
        got = pool.index_select(0, rows[i : i + 64])
        bad += int((got != layout.gather_records(dev[i : i + 64])).any(dim=1).sum())
    return bad


def _mismatches_device(layout: DeviceLayout, a: np.ndarray, b: np.ndarray) -> int:
    bad = 0
    for i in range(0, a.shape[0], 64):
        bad += int((layout.gather_records(a[i : i + 64]) != layout.gather_records(b[i : i + 64]))
                   .any(dim=1).sum())
    return bad


class GemmLoad:
    """A bf16 GEMM stream: ``count`` products of ``GEMM_N``-square matrices queued on a stream of
    its own, timed with events. Owns its operands (allocated once, warmed up once)."""

    def __init__(self, device: torch.device, count: int = GEMM_WINDOW_PRODUCTS) -> None:
        self.count = count
        self.stream = new_stream(device)
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
            self.b = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
            for _ in range(3):
                torch.mm(self.a, self.b)
        self.stream.synchronize()

    def start(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue one window of products; returns its (start, end) events."""
        begin, end = new_event(timing=True), new_event(timing=True)
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            for _ in range(self.count):
                torch.mm(self.a, self.b)
            end.record(self.stream)
        return begin, end

    def alone_ms(self) -> float:
        """Milliseconds of one window with nothing else running."""
        begin, end = self.start()
        end.synchronize()
        return float(begin.elapsed_time(end))


class PathRun:
    """One path's worker over a page size's layout, and its figures round by round (see
    :func:`measure_page`). Owns its worker from :meth:`__enter__` to :meth:`__exit__`.

    The ids are drawn from the page size (the same for every path moving as many blocks): device
    blocks ``dev_a`` stored to host records ``host[:num]``, loaded back into ``dev_b``, then both at
    once (``dev_b`` stored to ``host[num:]`` while ``host[:num]`` is loaded into ``dev_a``). A
    correct path leaves ``dev_a``'s bytes as they were and writes ``dev_b`` before each check that
    reads it, so the paths can share the layout."""

    def __init__(self, layout: DeviceLayout, path: str, num: int, span: int, page_bytes: int,
                 kernel_ctas: int | None) -> None:
        self.layout = layout
        self.path = path
        self.num = num
        rng = np.random.default_rng(page_bytes)
        self.dev_a = rng.permutation(num)
        self.dev_b = span + rng.permutation(num)
        self.host = rng.permutation(2 * num)
        self.per_job = max(1, JOB_BYTES // layout.block_bytes)
        self._kernel_ctas = kernel_ctas
        self._worker: Worker | None = None
        #: seconds of each round: (store, load, both at once)
        self.seconds: list[tuple[float, float, float]] = []
        self.taken: set[str] = set()
        self.mismatched = 0
        self.verified = 0
        self._job = 0

    def __enter__(self) -> PathRun:
        self._worker = _worker(self.layout, 2 * self.num, self.path, self._kernel_ctas)
        try:
            self._run(_split("store", self.dev_a[:self.per_job], self.host[:self.per_job], self.per_job))  # warm-up
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Shut the worker down (as ``Worker.__exit__``: an exception of the body stays the one
        seen); a second call does nothing."""
        w, self._worker = self._worker, None
        if w is not None:
            w.__exit__(exc_type, exc, tb)

    def _run(self, jobs: list[tuple[str, np.ndarray, np.ndarray]], taken: set[str] | None = None) -> float:
        assert self._worker is not None, "PathRun used outside its with block"
        first, self._job = self._job, self._job + len(jobs)
        return _run(self._worker, jobs, first, taken)

    def round(self) -> None:
        """Store, load, and both at once, each timed and checked."""
        w, layout, num, per_job = self._worker, self.layout, self.num, self.per_job
        assert w is not None, "PathRun used outside its with block"
        dev_a, dev_b, host = self.dev_a, self.dev_b, self.host
        store_s = self._run(_split("store", dev_a, host[:num], per_job), self.taken)
        bad = _mismatches_host(w, layout, dev_a, host[:num])
        load_s = self._run(_split("load", host[:num], dev_b, per_job), self.taken)
        bad += _mismatches_device(layout, dev_a, dev_b)
        # both at once: store dev_b (just loaded) to fresh records while loading the first half back
        mixed = _split("store", dev_b, host[num:], per_job)
        mixed_load = _split("load", host[:num], dev_a, per_job)
        both_s = self._run([job for pair in zip(mixed, mixed_load) for job in pair], self.taken) / 2
        bad += _mismatches_host(w, layout, dev_b, host[num:])
        bad += _mismatches_device(layout, dev_a, dev_b)
        self.seconds.append((store_s, load_s, both_s))
        self.mismatched += bad
        self.verified += 4 * num * layout.block_bytes

    def row(self, page_bytes: int, gemm: GemmLoad | None) -> BenchRow:
        """The path's row: each figure the median of its rounds' GB/s, with its lowest and
        highest (and, with ``gemm``, the GEMM beside this path's stores, measured now)."""
        assert self._worker is not None, "PathRun used outside its with block"
        moved = self.num * self.layout.block_bytes
        rates = [tuple(moved / s / _GB for s in seconds) for seconds in self.seconds]
        store, load, both = (sorted(r[i] for r in rates) for i in range(3))
        beside = (_with_gemm(self._worker, self.layout, self.dev_a, self.host[:self.num], self.per_job, gemm)
                  if gemm is not None else None)
        return BenchRow(
            page_bytes=page_bytes, path=self.path, taken=",".join(sorted(self.taken)),
            store_gbps=statistics.median(store), load_gbps=statistics.median(load),
            both_gbps=statistics.median(both), gemm_slowdown=beside.slowdown if beside else None,
            gemm_quartiles=beside.quartiles if beside else None, gemm_store_gbps=beside.gbps if beside else None,
            verified_bytes=self.verified, mismatched_blocks=self.mismatched, rounds=len(rates),
            spread=((store[0], store[-1]), (load[0], load[-1]), (both[0], both[-1])),
        )


def measure_path(
    device: torch.device, page_bytes: int, path: str, total_bytes: int, gemm: GemmLoad | None,
    out: TextIO, kernel_ctas: int | None = None,
) -> BenchRow:
    """All figures of one path at one page size, one round (:func:`measure_page`)."""
    return measure_page(device, page_bytes, {path: total_bytes}, 1, gemm, out, kernel_ctas)[0]


def measure_page(
    device: torch.device, page_bytes: int, totals: dict[str, int], rounds: int, gemm: GemmLoad | None,
    out: TextIO, kernel_ctas: int | None = None,
) -> list[BenchRow]:
    """Every figure of the paths of ``totals`` (bytes moved per measurement, by path) at one page
    size, over one layout. With one round the paths are measured one after the other, each
    worker shut down before the next is made. With more, every path's worker stays open and the
    paths take turns round by round, so that a host's drift between paths weighs on each alike
    (each figure the median of its rounds; :attr:`BenchRow.spread` its lowest and highest)."""
    began = time.perf_counter()
    nums = {path: max(4, total // BLOCK_BYTES) for path, total in totals.items()}
    span = max(nums.values())
    layout = _layout(device, page_bytes, 2 * span)

    def run_of(path: str) -> PathRun:
        return PathRun(layout, path, nums[path], span, page_bytes, kernel_ctas)

    def logged(row: BenchRow) -> BenchRow:
        _log(out, f"  {page_bytes // KIB:>5} KiB {row.path:<7} store {row.store_gbps:6.1f}  load "
                  f"{row.load_gbps:6.1f}  both {row.both_gbps:6.1f} GB/s  mismatched {row.mismatched_blocks}  "
                  f"({time.perf_counter() - began:.1f} s)")
        return row

    rows: list[BenchRow] = []
    if rounds == 1:
        for path in totals:
            with run_of(path) as run:
                run.round()
                rows.append(logged(run.row(page_bytes, gemm)))
        return rows
    with contextlib.ExitStack() as stack:
        runs = [stack.enter_context(run_of(path)) for path in totals]
        for _ in range(rounds):
            for run in runs:
                run.round()
        rows = [logged(run.row(page_bytes, gemm)) for run in runs]
    return rows


@attrs.frozen
class GemmFigure:
    """A GEMM window's slowdown beside transfers over :data:`GEMM_ROUNDS` rounds (fractions: 0.05
    is 5% slower): the median, the first and third quartiles, and the median GB/s moved beside."""

    slowdown: float
    quartiles: tuple[float, float]
    gbps: float

    def describe(self) -> str:
        """``5.1% [+2.0, +7.3]``: the median and the quartiles, in percent."""
        low, high = self.quartiles
        return f"{100 * self.slowdown:.1f}% [{100 * low:+.1f}, {100 * high:+.1f}]"


def _with_gemm(
    w: Worker, layout: DeviceLayout, dev: np.ndarray, host: np.ndarray, per_job: int, gemm: GemmLoad,
) -> GemmFigure:
    """The GEMM's slowdown and the store GB/s over :data:`GEMM_ROUNDS` rounds of stores kept in
    flight beside a GEMM window (see :func:`_gemm_rounds`).

    Up to ``GEMM_JOBS_IN_FLIGHT`` store jobs run at once, on rotating host blocks so that no two
    in-flight jobs write one record.
    """
    jobs = _split("store", dev, host, per_job)
    job = 10**7

    def beside(end: torch.cuda.Event) -> int:
        nonlocal job
        in_flight: list[int] = []
        moved = 0
        while not _done(end):
            if len(in_flight) >= GEMM_JOBS_IN_FLIGHT:
                w.wait([in_flight.pop(0)], TIMEOUT_S)
            _, s, d = jobs[job % len(jobs)]
            w.store(job, s, d)
            in_flight.append(job)
            moved += s.shape[0] * layout.block_bytes
            job += 1
        w.wait(in_flight, TIMEOUT_S)
        return moved

    return _gemm_rounds(gemm, beside)


def _gemm_rounds(gemm: GemmLoad, beside: Callable[[torch.cuda.Event], int]) -> GemmFigure:
    """The GEMM's slowdown (median and quartiles) and the median GB/s over :data:`GEMM_ROUNDS`
    rounds. Each round times a GEMM window alone, one with ``beside(end)`` moving bytes until the
    window's end event, and one alone again; the mean of the two alone windows is that round's
    reference, so clock drift shows up as noise on both sides rather than as a bias, and the median
    drops a round another tenant disturbed; the quartiles say how far the rounds spread."""
    slowdowns: list[float] = []
    rates: list[float] = []
    for _ in range(GEMM_ROUNDS):
        before = gemm.alone_ms()
        begin, end = gemm.start()
        t0 = time.perf_counter()
        moved = beside(end)
        elapsed = time.perf_counter() - t0
        with_ms = float(begin.elapsed_time(end))
        after = gemm.alone_ms()
        slowdowns.append(with_ms / ((before + after) / 2) - 1.0)
        rates.append(moved / elapsed / _GB)
    low, _, high = statistics.quantiles(slowdowns, n=4) if len(slowdowns) > 1 else (slowdowns * 3)
    return GemmFigure(statistics.median(slowdowns), (low, high), statistics.median(rates))


def gemm_beside_link(gemm: GemmLoad, device: torch.device) -> GemmFigure:
    """The GEMM's slowdown and GB/s beside back-to-back 64 MiB pinned copies: the cost of host-link
    traffic itself, the floor any path's slowdown is compared with (as :func:`_with_gemm`)."""
    host = torch.empty(JOB_BYTES, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(JOB_BYTES, dtype=torch.uint8, device=device)
    stream = new_stream(device)

    def beside(end: torch.cuda.Event) -> int:
        moved = 0
        while not _done(end):
            with torch.cuda.stream(stream):
                host.copy_(buf, non_blocking=True)
            stream.synchronize()
            moved += JOB_BYTES
        return moved

    return _gemm_rounds(gemm, beside)


def small_job_ratio(
    device: torch.device, path: str, kernel_ctas: int | None = None
) -> tuple[float, float]:
    """(median seconds of a 1-block job of 64 pages of 32 KiB, of one 2 MiB pinned copy)."""
    layout = _layout(device, 32 * KIB, 64)
    host = torch.empty(2 * MIB, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(2 * MIB, dtype=torch.uint8, device=device)
    stream = new_stream(device)
    copies, jobs = [], []
    with _worker(layout, 8, path, kernel_ctas) as w:
        for i in range(SMALL_JOB_REPEATS + 2):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            w.store(i, [i % 32], [i % 8])
            w.wait([i], TIMEOUT_S)
            jobs.append(time.perf_counter() - t0)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                host.copy_(buf, non_blocking=True)
            stream.synchronize()
            copies.append(time.perf_counter() - t0)
    return statistics.median(jobs[2:]), statistics.median(copies[2:])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's command-line options (each value checked as it is parsed; a flag left out is None)."""
    parser.add_argument("--quick", action="store_true",
                        help="fewer page sizes and bytes, the copy loop 256 MiB (< 1 min)")
    parser.add_argument("--paths", type=names(PATHS), default=None,
                        help=f"comma-separated paths (default {','.join(PATHS)})")
    parser.add_argument("--pages", type=int_list(1, MAX_PAGE_KIB), default=None,
                        help="comma-separated page sizes in KiB")
    parser.add_argument("--total-mib", type=int_in(1), default=None, help="bytes moved per measurement")
    parser.add_argument("--rounds", type=int_in(1, MAX_ROUNDS), default=None,
                        help="measure store, load and both at once this many times per path, the paths "
                             "taking turns round by round, every path's worker open at once; each "
                             "figure the median, with its range (default 1: the paths one after the other)")
    parser.add_argument("--gemm", action="store_true", help="also measure beside a bf16 GEMM stream")
    parser.add_argument("--kernel-ctas", type=int_in(1), default=None,
                        help="CTAs of the copy kernel (default: the worker's, every SM for staged, 4 for sm)")
    parser.add_argument("--json", type=writable_file, default=None, help="write every figure to this file")
    parser.add_argument("--disk", default=None, metavar="DIR",
                        help="instead: the disk tier against raw O_DIRECT on DIR, and disk -> GPU")
    parser.add_argument("--latency", action="store_true",
                        help="instead: a job alone (call -> result) per page and job size, 1-block jobs, "
                             "the caller's time per call, each next to one pinned copy")
    parser.add_argument("--layerwise", action="store_true",
                        help="instead: a synthetic L-layer prefill, load then compute vs load_by_layer")
    parser.add_argument("--layers", type=int_in(1), default=None, help="layers of the --layerwise prefill (16)")
    parser.add_argument("--compute", type=finite_float(0.0, 16.0, low_open=True), default=None,
                        help="--layerwise: a layer's compute as a multiple of a layer's load (1: about "
                             "as long; 2: the load hides behind the compute)")
    parser.add_argument("--issuers", type=names(get_args(IssuerName)), default=None,
                        help="--latency and --layerwise: comma-separated issuers, each path measured "
                             "with each (native, python, auto; default native,python)")
    parser.add_argument("--ranks", type=int, default=None, metavar="N",
                        help="instead: a host pool shared by N rank processes (attach time, and "
                             "throughput of ranks at once); --ranks N --help lists its options")
    parser.add_argument("--remote", choices=("mooncake", "redis"), default=None,
                        help="instead: the remote tier's put/get against the store's own client "
                             "(python -m kvoffload bench --remote X --help for its options)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags the chosen mode would ignore (``parser.error``), before the GPU check."""
    given = {flag for flag, value in (
        ("--paths", args.paths), ("--pages", args.pages), ("--total-mib", args.total_mib),
        ("--gemm", args.gemm or None), ("--kernel-ctas", args.kernel_ctas), ("--json", args.json),
        ("--rounds", args.rounds),
        ("--latency", args.latency or None), ("--layerwise", args.layerwise or None),
        ("--layers", args.layers), ("--compute", args.compute), ("--issuers", args.issuers),
    ) if value is not None}
    if args.disk is not None:
        mode, takes = "--disk", {"--total-mib", "--json"}
        if not os.path.isdir(args.disk):
            parser.error(f"--disk {args.disk!r} is not a directory")
    elif args.latency or args.layerwise:
        mode = "--latency/--layerwise"
        takes = {"--paths", "--issuers", "--latency", "--layerwise"}
        takes |= {"--pages"} if args.latency else set()
        takes |= {"--layers", "--compute"} if args.layerwise else set()
        if args.paths is not None and not set(args.paths) - {"loop"}:
            parser.error("argument --paths: --latency/--layerwise measure the worker's paths, not loop")
    else:
        mode = "the transfer bench"
        takes = {"--paths", "--pages", "--total-mib", "--gemm", "--kernel-ctas", "--json", "--rounds"}
    ignored = sorted(given - takes)
    if ignored:
        parser.error(f"{', '.join(ignored)} cannot be combined with {mode}: it would be ignored")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kvoffload bench``; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--ranks" or a.startswith("--ranks=") for a in arguments):
        from kvoffload.cli import ranks_bench

        return ranks_bench.main(arguments)
    if any(a == "--remote" or a.startswith("--remote=") for a in arguments):
        from kvoffload.cli import remote_bench  # its own options; starts the store's services

        return remote_bench.main(arguments)
    parser = argparse.ArgumentParser(prog="python -m kvoffload bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(arguments)
    check_arguments(parser, args)
    if args.disk is not None:
        from kvoffload.cli import disk_bench

        extra = ["--quick"] if args.quick else []
        if args.json:
            extra += ["--json", args.json]
        if args.total_mib:
            extra += ["--gib", str(args.total_mib / 1024)]
        return disk_bench.main(["--path", args.disk, "--pipeline", *extra])
    if not torch.cuda.is_available():
        print("kvoffload bench: no CUDA device - the bench measures the host link and needs a GPU",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    progress = sys.stderr
    if args.latency or args.layerwise:
        from kvoffload.cli import latency_bench

        chosen = (tuple(p for p in args.paths if p != "loop") if args.paths is not None
                  else ("auto", "staged", "dma", "sm"))
        issuers = args.issuers or ("native", "python")
        status = 0
        if args.latency:
            wanted = tuple(p * KIB for p in args.pages) if args.pages else None
            status |= latency_bench.latency_main(device, chosen, wanted, args.quick, progress, issuers)
        if args.layerwise:
            status |= latency_bench.layerwise_main(device, chosen, args.layers or 0, progress, issuers,
                                                   args.compute or 1.0)
        return status
    pages = (tuple(p * KIB for p in args.pages) if args.pages
             else QUICK_PAGE_SIZES if args.quick else PAGE_SIZES)
    paths = args.paths or PATHS
    total = (args.total_mib * MIB if args.total_mib
             else QUICK_TOTAL_BYTES if args.quick else TOTAL_BYTES)
    totals = {path: min(total, QUICK_LOOP_BYTES) if args.quick and path == "loop" else total for path in paths}
    rounds = args.rounds or 1
    # a cache of twice the bytes moved, a host pool as large per worker open at once (one, or with
    # --rounds every path's), beside the link probe's two 1 GiB pairs (the workers' staging rings
    # in device memory, some MiB each, are not counted)
    cache = 2 * max(total, 4 * BLOCK_BYTES)
    pools = sum(2 * max(t, 4 * BLOCK_BYTES) for t in totals.values()) if rounds > 1 else cache
    what, fix = ((f"--total-mib {total // MIB} over {len(paths)} paths open at once (--rounds {rounds})",
                  "--total-mib or --paths, or leave --rounds out") if rounds > 1
                 else (f"--total-mib {total // MIB}", "--total-mib"))
    check_memory(parser, pools + 2 * LINK_PROBE_BYTES, what, fix)
    check_device_memory(parser, device, cache + 2 * LINK_PROBE_BYTES, f"--total-mib {total // MIB}", "--total-mib")
    began = time.perf_counter()
    _log(progress, "measuring the link limit")
    d2h, h2d, both = link_limits(device, LINK_PROBE_BYTES)
    gemm = GemmLoad(device) if args.gemm else None
    rows = []
    for page in pages:
        rows += measure_page(device, page, totals, rounds, gemm, progress, args.kernel_ctas)
    _log(progress, f"1-block jobs ({time.perf_counter() - began:.1f} s so far)")
    small = {path: small_job_ratio(device, path, args.kernel_ctas) for path in paths if path != "loop"}
    link_gemm = gemm_beside_link(gemm, device) if gemm is not None else None
    _log(progress, f"done in {time.perf_counter() - began:.1f} s")
    print(f"kvoffload bench on {torch.cuda.get_device_name(device)}")
    print(f"link limit: d2h {d2h:.1f} GB/s, h2d {h2d:.1f} GB/s, both at once {both:.1f} GB/s")
    header = f"{'page':>8} {'path':<14} {'store GB/s':>16} {'load GB/s':>16} {'both GB/s':>16}"
    if args.gemm:
        header += f" {'GEMM slower [quartiles]':>24} {'store beside GEMM':>18}"
    print(header)
    if rounds > 1:
        print(f"  (each figure the median of {rounds} rounds, the paths taking turns; [lowest-highest GB/s])")
    for r in rows:
        shown = f"auto({r.taken})" if r.path == "auto" else r.path
        line = (f"{_size(r.page_bytes):>8} {shown:<14} {r.store_gbps:6.1f} ({r.store_gbps / d2h:4.2f}x)"
                f"    {r.load_gbps:6.1f} ({r.load_gbps / h2d:4.2f}x)    "
                f"{r.both_gbps:6.1f} ({r.both_gbps / both:4.2f}x)")
        if r.gemm_slowdown is not None and r.gemm_quartiles is not None and r.gemm_store_gbps is not None:
            shown = GemmFigure(r.gemm_slowdown, r.gemm_quartiles, r.gemm_store_gbps).describe()
            line += f" {shown:>24} {r.gemm_store_gbps:8.1f} ({r.gemm_store_gbps / d2h:4.2f}x)"
        if r.spread is not None and r.rounds > 1:
            line += "  [" + ", ".join(f"{name} {low:.1f}-{high:.1f}" for name, (low, high)
                                      in zip(("store", "load", "both"), r.spread)) + "]"
        print(line)
    if link_gemm is not None:
        print(f"GEMM beside plain 64 MiB pinned copies (the link's own cost): {link_gemm.describe()} "
              f"slower, {link_gemm.gbps:.1f} GB/s (median [quartiles] of {GEMM_ROUNDS} rounds)")
    for path, (job_s, copy_s) in small.items():
        print(f"1-block job (64 x 32 KiB) [{path}]: {job_s * 1e6:7.1f} us = {job_s / copy_s:4.2f}x "
              f"one 2 MiB pinned copy ({copy_s * 1e6:.1f} us)")
    mismatched = sum(r.mismatched_blocks for r in rows)
    print(f"verified {sum(r.verified_bytes for r in rows) / _GB:.1f} GB, mismatched blocks: {mismatched}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"link": {"d2h": d2h, "h2d": h2d, "both": both},
                       "gemm_beside_link": attrs.asdict(link_gemm) if link_gemm is not None else None,
                       "rows": [attrs.asdict(r) for r in rows],
                       "small_job": {p: {"job_s": j, "copy_s": c} for p, (j, c) in small.items()}},
                      f, indent=2)
    return 0 if mismatched == 0 else 1


def _done(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"
