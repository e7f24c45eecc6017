"""``python -m kvoffload bench --latency`` and ``--layerwise``: what one job costs an engine, next to
what the link alone costs, measured side by side in one run.

``--latency``:

- *a job alone, call -> result*: one job with nothing else in flight, from the ``store``/``load``
  call to its result from ``wait``, per page size and job size, next to one pinned copy of the same
  bytes timed the same way (call -> stream synchronized) in the same run; the job's device time
  (``TransferResult.seconds``) and the caller's time in the call are shown beside it; every path's
  worker of one issuer open at once, taking turns job by job (each figure the median of its jobs),
  the issuers one after the other (a Python issuer's workers open beside native ones added about
  10-35 us to the native callers' time: docs/design.md §16);
  host records in order, and at the smallest page size (every page size without ``--quick``) also
  *gapped* (every other record of the pool, ascending) and *shuffled* (those records in random
  order), as an engine's pool hands out records in the order they were freed;
- *1-block jobs* (64 pages of 32 KiB), call -> result, next to one 2 MiB pinned copy, and the job's
  device time next to the copy's, each from an event recorded before it to one after it (so it
  holds the host's time to enqueue the work after the first event, too);
- *a load the caller waits for*: a 1-block load, call -> result, alone and right after a 64 MiB
  load was handed over, through the regular load lane (behind it) and through the expedited lane
  (``Worker.create(expedited_loads=True)``), alternated round by round; the lane at its default
  path and, for comparison, at the regular lanes' (``expedited_path``);
- *the caller's time per call*: bursts of jobs of 256 blocks x 64 pages submitted back to back, the
  time each ``store``/``load`` call takes — the first of each burst (nothing in flight) apart from
  the later ones — median, p90, p99 and max over every call, and how many calls took over 100 us.

``--layerwise``: a synthetic L-layer prefill whose layer ``i`` reads layer ``i``'s loaded blocks, its
compute per layer about the load's per layer (``--compute R``: R times it; a CUDA graph a layer, its
products chosen by timing them, so that the compute runs at the device's pace and not at the
host's), for each case of
:data:`PREFILL_CASES` (32 KiB pages from host records in order into device blocks in order and
shuffled; 4 KiB pages in order and from every other record): *load then compute* (``load``, wait
for the result, then every layer's compute) against ``load_by_layer`` (layer ``i``'s compute after ``wait_layer(i)``), with the ideal
``max(load, compute) + one layer's load``, when layer 0 was ready against ``1/L`` of the whole
load, and the caller's time in ``load_by_layer`` and in each ``wait_layer``. Where the prefill's time
goes is printed beside it, from events on the compute stream around each layer's wait: how long it
waited for the layers after layer 0 (the load behind the compute) and how long its compute took
beside the load against alone (the two slowing each other); with layer 0's time they add up to
the prefill's. And the layered load alone (no compute), from its call to its result, beside the
whole load timed the same way in the same rounds: what landing layer by layer costs by itself.

Every figure is printed as measured and as a ratio to its reference; nothing is asserted. Every
loaded byte is checked. Public API only.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence
from typing import Final, TextIO

import numpy as np
import torch

from kvoffload import DeviceLayout, LayerLoad, TransferResult, Worker
from kvoffload.cli._torch import new_event, new_stream

__all__ = ["latency_main", "layerwise_main"]

KIB: Final = 1 << 10
MIB: Final = 1 << 20
LATENCY_PAGES: Final = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 2 * MIB)
QUICK_LATENCY_PAGES: Final = (4 * KIB, 64 * KIB, 2 * MIB)
JOB_SIZES: Final = (2 * MIB, 16 * MIB, 64 * MIB)
QUICK_JOB_SIZES: Final = (64 * MIB,)
#: Layers of the per-layer layout of the isolated-job figures (2 pages, K and V, per layer).
LATENCY_LAYERS: Final = 8
#: The host records an isolated job takes: in order (records back to back), every other record
#: ascending, and those records shuffled.
RECORDS: Final = ("in order", "gapped", "shuffled")
REPEATS: Final = 15
QUICK_REPEATS: Final = 7
#: The caller's-time figure: bursts of BURST jobs of BURST_BLOCKS blocks of 64 pages of 32 KiB,
#: BURSTS of them a direction (half with ``--quick``): 400 calls (200), so that the p99 is not the
#: largest call (a dozen bursts made it so).
BURST: Final = 4
BURSTS: Final = 100
BURST_BLOCKS: Final = 256
BURST_LAYERS: Final = 32
#: The layer-wise prefill: layers, blocks per load, page size of each of K and V.
PREFILL_LAYERS: Final = 16
PREFILL_BLOCKS: Final = 256
PREFILL_PAGE: Final = 32 * KIB
#: The layer-wise prefill's cases, (page size of each of K and V, host records, device blocks): 32
#: KiB pages from records in order into blocks in order (the issue's figure; explicit ``dma`` moves
#: its runs of pairs as direct strided copies, docs/design.md §16) and into blocks shuffled (an
#: engine's pool hands out blocks freed in any order: no direct copy), and 4 KiB pages (8 KiB of a
#: record a layer) in order and from every other record (where ``auto`` takes ``sm`` for the
#: layered load, docs/design.md §12).
PREFILL_CASES: Final = ((PREFILL_PAGE, "in order", "in order"), (PREFILL_PAGE, "in order", "shuffled"),
                        (4 * KIB, "in order", "in order"), (4 * KIB, "gapped", "in order"))
PREFILL_ROUNDS: Final = 7
#: The sides of the prefill's square bf16 products (the smaller fills out a layer's compute) and how
#: many products a graph times to measure one.
PREFILL_GEMM_SIDES: Final = (1024, 2048)
PREFILL_GEMM_PROBE: Final = 16
TIMEOUT_S: Final = 120.0


def _log(out: TextIO, message: str) -> None:
    print(message, file=out, flush=True)


def _per_layer(device: torch.device, layers: int, page: int, blocks: int) -> tuple[DeviceLayout, dict[str, torch.Tensor]]:
    tensors = {f"layer{i}": torch.randint(0, 256, (2, blocks, page), dtype=torch.uint8, device=device)
               for i in range(layers)}
    return DeviceLayout.from_tensors(tensors, block_dim=1, num_blocks=blocks), tensors


class PinnedCopy:
    """One pinned copy of ``nbytes`` each way on a stream of its own, timed call -> synchronized.
    Owns its buffers, stream and events."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.stream = new_stream(device)
        self._begin, self._end = new_event(timing=True), new_event(timing=True)

    def seconds(self, store: bool) -> float:
        """Wall seconds of one copy (d2h when ``store``), from the call to the stream's sync."""
        dst, src = (self.host, self.dev) if store else (self.dev, self.host)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self.stream.synchronize()
        return time.perf_counter() - t0

    def device_seconds(self, store: bool) -> float:
        """Seconds between events recorded on the copy's stream just before and after another copy
        (d2h when ``store``): its device time, plus the host's time to enqueue it after the first
        event (the stream is idle), as ``TransferResult.seconds`` holds its job's enqueueing after
        its start event. Kept apart from :meth:`seconds`, whose copy it does not slow."""
        dst, src = (self.host, self.dev) if store else (self.dev, self.host)
        with torch.cuda.stream(self.stream):
            self._begin.record(self.stream)
            dst.copy_(src, non_blocking=True)
            self._end.record(self.stream)
        self._end.synchronize()
        return float(self._begin.elapsed_time(self._end)) / 1e3


def _job(w: Worker, store: bool, job: int, device_blocks: np.ndarray, host_blocks: np.ndarray) -> tuple[float, float, TransferResult]:
    """(call -> result seconds, seconds in the call, result) of one job with nothing in flight."""
    t0 = time.perf_counter()
    if store:
        w.store(job, device_blocks, host_blocks)
    else:
        w.load(job, host_blocks, device_blocks)
    t1 = time.perf_counter()
    (result,) = w.wait([job], TIMEOUT_S)
    t2 = time.perf_counter()
    if not result.ok:
        raise RuntimeError(f"job {job} failed: {result.error}")
    return t2 - t0, t1 - t0, result


def host_records(records: str, blocks: int, seed: int = 0) -> np.ndarray:
    """The host records of an isolated job of ``blocks`` blocks in a pool of ``2 * blocks``
    records: ``"in order"`` (0, 1, ...), ``"gapped"`` (0, 2, 4, ...: no two follow each other) or
    ``"shuffled"`` (the gapped records in a random order drawn from ``seed``)."""
    if records == "in order":
        return np.arange(blocks, dtype=np.int64)
    gapped = 2 * np.arange(blocks, dtype=np.int64)
    if records == "gapped":
        return gapped
    if records == "shuffled":
        return np.random.default_rng(seed).permutation(gapped)
    raise ValueError(f"records must be one of {RECORDS}, not {records!r}")


def isolated_jobs(device: torch.device, page: int, job_bytes: int, variants: Sequence[tuple[str, str]],
                  repeats: int, out: TextIO, records: Sequence[str] = RECORDS[:1],
                  kernel_ctas: Sequence[int | None] | None = None) -> list[str]:
    """Rows of the isolated-job table for one page size and job size: per ``(path, issuer)`` of
    ``variants``, in that order, a store's and a load's row for each of ``records`` (see
    :func:`host_records`); ``kernel_ctas``: each variant's copy-kernel CTAs (default: the
    worker's). Every variant's worker is open at once over one layout, and the variants take
    turns job by job (each job followed by the pinned copy it is compared with), so that a host's
    drift weighs on each alike: measured one after the other, two variants on the same path were
    0.77x and 0.91x apart (docs/design.md §7, *One measurement is not a figure*). Pass one
    issuer's variants: :func:`latency_main` measures the issuers one after the other."""
    block = 2 * LATENCY_LAYERS * page
    blocks = max(1, job_bytes // block)
    layout, tensors = _per_layer(device, LATENCY_LAYERS, page, 2 * blocks)
    copy = PinnedCopy(device, blocks * block)
    dev_a = np.arange(blocks, dtype=np.int64)
    with contextlib.ExitStack() as stack:
        ctas = kernel_ctas if kernel_ctas is not None else [None] * len(variants)
        workers = [stack.enter_context(Worker.create(layout, 2 * blocks, path=path,  # type: ignore[arg-type]
                                                     issuer=issuer, kernel_ctas=n))  # type: ignore[arg-type]
                   for (path, issuer), n in zip(variants, ctas, strict=True)]
        found = {kind: _isolated_rows(workers, [path for path, _ in variants], copy, page, repeats, dev_a,
                                      dev_a + blocks, host_records(kind, blocks), kind, tensors)
                 for kind in records}
    del tensors
    rows = [row for v in range(len(variants)) for kind in records for row in found[kind][v]]
    for row in rows:
        _log(out, "  " + row)
    return rows


def _isolated_rows(workers: Sequence[Worker], paths: Sequence[str], copy: PinnedCopy, page: int, repeats: int,
                   dev_a: np.ndarray, dev_b: np.ndarray, host: np.ndarray, records: str,
                   tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Each worker's store row and load row of the isolated-job table (``paths[i]``: the path
    ``workers[i]`` was asked for): device blocks ``dev_a`` stored to host records ``host`` and
    loaded back into ``dev_b``, the workers taking turns job by job. Before a worker's last load
    ``dev_b`` is zeroed, and checked right after it, so that the check sees that load's bytes."""
    device = copy.dev.device
    zeroed = torch.as_tensor(dev_b, device=device)
    rows: list[list[str]] = [[] for _ in workers]
    job = 0
    for store in (True, False):
        samples: list[list[tuple[float, float, float]]] = [[] for _ in workers]
        copies: list[list[float]] = [[] for _ in workers]
        taken: list[set[str]] = [set() for _ in workers]  # the paths the jobs took (auto's choice)
        bad = [0 for _ in workers]
        for i in range(repeats + 2):  # two warm-ups
            for v, w in enumerate(workers):
                last_load = not store and i == repeats + 1
                if last_load:
                    _zero_blocks(tensors, zeroed)
                torch.cuda.synchronize(device)
                total, call, result = _job(w, store, job, dev_a if store else dev_b, host)
                job += 1
                if last_load:
                    bad[v] = _mismatched(w.layout, dev_a, dev_b)
                torch.cuda.synchronize(device)
                c = copy.seconds(store)
                if i >= 2:
                    samples[v].append((total, call, result.seconds))
                    copies[v].append(c)
                    taken[v].add(result.path)
        for v, w in enumerate(workers):
            shown = _taken_label(_label(paths[v], w), paths[v], taken[v])
            t = statistics.median(x[0] for x in samples[v])
            c = statistics.median(copies[v])
            rows[v].append(
                f"{_size(page):>8} {_size(copy.host.numel()):>8} {'store' if store else 'load':<6} {records:<9}"
                f" {shown:<20} {t * 1e6:9.1f} {c * 1e6:9.1f}   {c / t:5.2f}x"
                f" {statistics.median(x[1] for x in samples[v]) * 1e6:9.1f}"
                f" {statistics.median(x[2] for x in samples[v]) * 1e6:9.1f}   {bad[v]}"
            )
    return rows


def _zero_blocks(tensors: dict[str, torch.Tensor], blocks: torch.Tensor) -> None:
    """Zero device blocks ``blocks`` of :func:`_per_layer`'s tensors (block dim 1), so that a byte
    check sees only what the next load writes there."""
    for tensor in tensors.values():
        tensor.index_fill_(1, blocks, 0)


def _taken_label(label: str, path: str, taken: set[str]) -> str:
    """A row's label: for ``auto``, the paths its jobs took (``auto(staged)``)."""
    return label.replace("auto", f"auto({','.join(sorted(taken))})", 1) if path == "auto" else label


def _mismatched(layout: DeviceLayout, a: np.ndarray, b: np.ndarray) -> int:
    bad = 0
    for i in range(0, a.shape[0], 64):
        bad += int((layout.gather_records(a[i : i + 64]) != layout.gather_records(b[i : i + 64]))
                   .any(dim=1).sum())
    return bad


def one_block_jobs(device: torch.device, path: str, repeats: int, issuer: str = "auto") -> str:
    """A row: 1-block jobs (64 x 32 KiB) store and load, call -> result, against one 2 MiB pinned
    copy; then the job's device time (``TransferResult.seconds``) against another copy's (events
    recorded around it: see :meth:`PinnedCopy.device_seconds`)."""
    layout, _ = _per_layer(device, 32, 32 * KIB, 64)
    copy = PinnedCopy(device, 2 * MIB)
    parts = []
    with Worker.create(layout, 8, path=path, issuer=issuer) as w:  # type: ignore[arg-type]
        label = _label(path, w)
        job = 0
        for store in (True, False):
            jobs, copies, on_device, copies_on_device = [], [], [], []
            taken: set[str] = set()  # the paths the timed jobs took (``auto`` says which it chose)
            for i in range(3 * repeats + 2):
                torch.cuda.synchronize(device)
                blocks = np.array([i % 32 + (0 if store else 32)], dtype=np.int64)
                total, _, result = _job(w, store, job, blocks, np.array([i % 8], dtype=np.int64))
                job += 1
                torch.cuda.synchronize(device)
                c = copy.seconds(store)
                c_device = copy.device_seconds(store)
                if i >= 2:
                    taken.add(result.path)
                    jobs.append(total)
                    copies.append(c)
                    on_device.append(result.seconds)
                    copies_on_device.append(c_device)
            t, c = statistics.median(jobs), statistics.median(copies)
            d, cd = statistics.median(on_device), statistics.median(copies_on_device)
            parts.append(f"{'store' if store else 'load'} {t * 1e6:7.1f} us = {t / c:4.2f}x "
                         f"({c * 1e6:5.1f} us copy; device {d * 1e6:5.1f} / {cd * 1e6:5.1f} us = "
                         f"{d / cd:4.2f}x; took {'/'.join(sorted(taken))})")
    return f"1-block job (64 x 32 KiB) [{label:<13}] " + ";  ".join(parts)


def expedited_jobs(device: torch.device, path: str, repeats: int, issuer: str = "auto",
                   lane: str | None = None) -> str:
    """A row: a 1-block load (64 x 32 KiB) the caller waits for, call -> result, alone and right
    after a 64 MiB load was handed over (still in flight): through the regular load lane (behind
    it) and through the expedited lane (docs/design.md §4), each lane's load alone timed beside
    it, the four alternated round by round. ``lane``: the lane's ``expedited_path`` (None: its
    default)."""
    big = 32  # blocks of 2 MiB: 64 MiB
    layout, _ = _per_layer(device, 32, 32 * KIB, big + 2)
    lanes = ("regular lane", "expedited lane")
    kinds = [(lane_name, behind) for lane_name in lanes for behind in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {k: [] for k in kinds}
    large = np.arange(big, dtype=np.int64)
    with Worker.create(layout, big + 1, path=path, issuer=issuer,  # type: ignore[arg-type]
                       expedited_loads=True, expedited_path=lane) as w:  # type: ignore[arg-type]
        label = f"{_label(path, w)}, lane {lane or 'default'}"
        # host record h holds device block (h + 1) mod (big + 1): every load below changes its blocks
        hosts = np.arange(big + 1, dtype=np.int64)
        w.store(-1, (hosts + 1) % (big + 1), hosts)
        if not all(r.ok for r in w.wait([-1], TIMEOUT_S)):
            raise RuntimeError("the store of the expedited-lane rounds' records failed")
        taken: dict[str, set[str]] = {name: set() for name in lanes}
        job = 0
        for i in range(2 * repeats + 1):
            for kind in kinds:
                torch.cuda.synchronize(device)
                ids = []
                if kind[1]:
                    w.load(job, large, large)
                    ids.append(job)
                    job += 1
                t0 = time.perf_counter()
                w.load(job, np.array([big], dtype=np.int64), np.array([big + 1], dtype=np.int64),
                       expedited=kind[0] == "expedited lane")
                (result,) = w.wait([job], TIMEOUT_S)
                dt = time.perf_counter() - t0
                ids.append(job)
                job += 1
                if not result.ok or not all(r.ok for r in w.wait(ids[:-1], TIMEOUT_S)):
                    raise RuntimeError("a load of the expedited-lane rounds failed")
                if i:  # the first round warms up
                    times[kind].append(dt)
                    taken[kind[0]].add(result.path)
        torch.cuda.synchronize(device)
        loaded = layout.gather_records(np.arange(big + 2, dtype=np.int64)).cpu()
        records = w.host_records()
        if not (torch.equal(loaded[:big], records[:big]) and torch.equal(loaded[big + 1], records[big])):
            raise RuntimeError("a block the expedited-lane rounds loaded differs from its host record")
    median = {k: statistics.median(v) for k, v in times.items()}
    return (f"1-block load (64 x 32 KiB) the caller waits for [{label:<22}] alone / right after a 64 MiB load: "
            + ";  ".join(f"{name} {median[name, False] * 1e6:6.1f} / {median[name, True] * 1e6:7.1f} us = "
                         f"{median[name, True] / median[name, False]:5.2f}x (took {'/'.join(sorted(taken[name]))})"
                         for name in lanes))


def _lanes(path: str) -> tuple[str | None, ...]:
    """The expedited lane's settings a row is measured with: its default (small loads through
    ``sm``), and the regular lanes' path for every load (for comparison) where that is another."""
    return (None,) if path == "sm" else (None, path)


def caller_time(device: torch.device, path: str, bursts: int, issuer: str = "auto") -> list[str]:
    """Rows: the caller's time per ``store``/``load`` of 256 blocks x 64 pages of 32 KiB, in
    bursts of BURST jobs back to back."""
    blocks = BURST * BURST_BLOCKS
    layout, _ = _per_layer(device, BURST_LAYERS, 32 * KIB, blocks)
    rows = []
    with Worker.create(layout, blocks, path=path, issuer=issuer) as w:  # type: ignore[arg-type]
        label = _label(path, w)
        job = 0
        for store in (True, False):
            first: list[float] = []
            later: list[float] = []
            for burst in range(bursts + 1):
                torch.cuda.synchronize(device)
                ids = []
                for k in range(BURST):
                    dev = np.arange(k * BURST_BLOCKS, (k + 1) * BURST_BLOCKS, dtype=np.int64)
                    t0 = time.perf_counter()
                    if store:
                        w.store(job, dev, dev)
                    else:
                        w.load(job, dev, dev)
                    dt = time.perf_counter() - t0
                    ids.append(job)
                    job += 1
                    if burst:  # the first burst warms up
                        (first if k == 0 else later).append(dt)
                if not all(r.ok for r in w.wait(ids, TIMEOUT_S)):
                    raise RuntimeError("a job of the burst failed")
            every = sorted(first + later)
            rows.append(
                f"caller's time per {'store' if store else 'load '} [{label:<13}] first of burst "
                f"{statistics.median(first) * 1e6:7.1f} us, jobs 2-{BURST} {statistics.median(later) * 1e6:7.1f}"
                f" us (medians); all calls p90 {_pct(every, 90) * 1e6:7.1f} p99 {_pct(every, 99) * 1e6:7.1f}"
                f" max {every[-1] * 1e6:7.1f} us; {sum(t > 100e-6 for t in every)} of {len(every)} over 100 us"
            )
    return rows


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def latency_main(device: torch.device, paths: Sequence[str], pages: Sequence[int] | None, quick: bool,
                 out: TextIO, issuers: Sequence[str] = ("auto",)) -> int:
    """``bench --latency``: print every figure (see the module docstring); returns the exit status
    (1 when a loaded byte differed)."""
    pages = pages or (QUICK_LATENCY_PAGES if quick else LATENCY_PAGES)
    sizes = QUICK_JOB_SIZES if quick else JOB_SIZES
    repeats = QUICK_REPEATS if quick else REPEATS
    _log(out, "isolated jobs (one at a time, nothing else in flight)")
    rows = []
    for page in pages:
        for size in sizes:
            scattered = not quick or page == pages[0]
            for issuer in issuers:  # one issuer's workers open at a time (see the module docstring)
                rows += isolated_jobs(device, page, size, _variants(paths, (issuer,)), repeats, out,
                                      RECORDS if scattered else RECORDS[:1])
    _log(out, "1-block jobs, caller's time per call")
    small = [one_block_jobs(device, path, repeats, issuer) for path, issuer in _variants(paths, issuers)]
    small += [expedited_jobs(device, path, repeats, issuer, lane) for path, issuer in _variants(paths, issuers)
              for lane in _lanes(path)]
    callers = [row for path, issuer in _variants(paths, issuers)
               for row in caller_time(device, path, BURSTS // 2 if quick else BURSTS, issuer)]
    print(f"kvoffload bench --latency on {torch.cuda.get_device_name(device)}; per-layer layouts of "
          f"{LATENCY_LAYERS} layers (K and V pages)")
    print(f"{'page':>8} {'job':>8} {'dir':<6} {'records':<9} {'path/issuer':<20} {'job us':>9} {'copy us':>9}   {'ratio':>6}"
          f" {'call us':>9} {'device us':>9}   bad")
    print("  (a job alone, call -> result, vs one pinned copy of the same bytes timed the same way; "
          "ratio = copy / job; call = caller's time in store/load; device = TransferResult.seconds; auto(p): "
          "the path auto took)")
    for row in rows:
        print(row)
    for row in small + callers:
        print(row)
    bad = sum(int(r.rsplit(maxsplit=1)[-1]) for r in rows)
    print(f"mismatched blocks: {bad}")
    return 0 if bad == 0 else 1


# ----------------------------------------------------------------------------- the layer-wise prefill


class Prefill:
    """A synthetic prefill: layer ``i`` reads its K and V pages of the loaded blocks (a gather and a
    reduction into an accumulator) and then runs bf16 products, on the compute stream. Each layer's
    compute is one CUDA graph, replayed with one launch, so that a layer takes the device the time
    its work takes: launched kernel by kernel from Python, a layer of a gather, a reduction and one
    product took the host about 100 us against about 35 us of the device's, and the compute ran at
    the host's pace, under the load's whatever its products. Owns its operands and graphs."""

    def __init__(self, device: torch.device, tensors: dict[str, torch.Tensor], blocks: torch.Tensor,
                 stream: torch.cuda.Stream) -> None:
        self.tensors = [tensors[f"layer{i}"] for i in range(len(tensors))]
        self.blocks = blocks
        self.stream = stream
        self._operands: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        with torch.cuda.stream(stream):
            for side in PREFILL_GEMM_SIDES:
                a = torch.randn(side, side, device=device, dtype=torch.bfloat16)
                b = torch.randn(side, side, device=device, dtype=torch.bfloat16)
                self._operands[side] = (a, b, torch.mm(a, b))  # cuBLAS set up before any capture
            self.acc = torch.zeros((), dtype=torch.int64, device=device)
            self.acc += self.tensors[0].index_select(1, blocks).view(torch.int64).sum()
        stream.synchronize()
        #: Products per layer, by side (set by :meth:`calibrate`).
        self.products: dict[int, int] = {}
        self._graphs: list[torch.cuda.CUDAGraph] = []

    def _capture(self, i: int, products: dict[int, int]) -> torch.cuda.CUDAGraph:
        """Layer ``i``'s compute with ``products`` (a count by side) as one graph."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
            if i >= 0:
                kv = self.tensors[i].index_select(1, self.blocks)
                self.acc += kv.view(torch.int64).sum()
            for side, count in products.items():
                a, b, out = self._operands[side]
                for _ in range(count):
                    torch.mm(a, b, out=out)
        return graph

    def _replay_s(self, graphs: Sequence[torch.cuda.CUDAGraph]) -> float:
        """Device seconds of ``graphs`` replayed in order with nothing else running (median of 5)."""
        times = []
        for _ in range(5):
            begin, end = new_event(timing=True), new_event(timing=True)
            with torch.cuda.stream(self.stream):
                begin.record(self.stream)
                for graph in graphs:
                    graph.replay()
                end.record(self.stream)
            end.synchronize()
            times.append(float(begin.elapsed_time(end)) / 1e3)
        return statistics.median(times)

    def calibrate(self, per_layer_s: float) -> None:
        """Capture every layer's graph with the products that make a layer's device time about
        ``per_layer_s``: as many of the larger side as fit after the layer's read, the rest in
        products of the smaller one (at least one product a layer)."""
        layers = len(self.tensors)
        reads = self._replay_s([self._capture(i, {}) for i in range(layers)]) / layers
        each = {side: self._replay_s([self._capture(-1, {side: PREFILL_GEMM_PROBE})]) / PREFILL_GEMM_PROBE
                for side in PREFILL_GEMM_SIDES}
        small, large = PREFILL_GEMM_SIDES
        left = max(0.0, per_layer_s - reads)
        big = int(left // each[large])
        rest = round((left - big * each[large]) / each[small])
        self.products = {large: big, small: max(rest, 1 if big == 0 else 0)}
        self._graphs = [self._capture(i, self.products) for i in range(layers)]

    def layer(self, i: int) -> None:
        """Queue layer ``i``'s compute on the stream (one graph launch)."""
        with torch.cuda.stream(self.stream):
            self._graphs[i].replay()

    def seconds(self) -> float:
        """Device seconds of every layer's compute, nothing else running (median of 5)."""
        return self._replay_s(self._graphs)


def layerwise_main(device: torch.device, paths: Sequence[str], layers: int, out: TextIO,
                   issuers: Sequence[str] = ("auto",), compute: float = 1.0) -> int:
    """``bench --layerwise``: print the figures (see the module docstring) for every case of
    :data:`PREFILL_CASES`, a layer's compute ``compute`` times a layer's load; returns the exit
    status (1 when a loaded byte differed)."""
    layers = layers or PREFILL_LAYERS
    lines: list[str] = []
    bad = 0
    for page, records, blocks in PREFILL_CASES:
        got, wrong = _prefill_case(device, paths, issuers, layers, page, records, blocks, out, compute)
        lines += got
        bad += wrong
    print(f"kvoffload bench --layerwise on {torch.cuda.get_device_name(device)}: {layers} layers, "
          f"{PREFILL_BLOCKS} blocks of {layers} x 2 pages (K and V) per load, a layer's compute "
          f"{compute:g}x a layer's load")
    for line in lines:
        print(line)
    print(f"mismatched blocks: {bad}")
    return 0 if bad == 0 else 1


def _prefill_case(device: torch.device, paths: Sequence[str], issuers: Sequence[str], layers: int,
                  page: int, records: str, order: str, out: TextIO, ratio: float = 1.0) -> tuple[list[str], int]:
    """The layer-wise prefill's rows at pages of ``page`` bytes loaded from host records
    ``records`` (:func:`host_records`) into device blocks in ``order`` ("in order" or "shuffled"),
    a layer's compute ``ratio`` times a layer's load, one per path and issuer, and its mismatched
    blocks (the last layered load of each lands in zeroed blocks)."""
    blocks = PREFILL_BLOCKS
    layout, tensors = _per_layer(device, layers, page, 2 * blocks)
    src = np.arange(blocks, dtype=np.int64)
    dst = src + blocks if order == "in order" else blocks + np.random.default_rng(7).permutation(blocks)
    dst_index = torch.as_tensor(dst, device=device)
    host = host_records(records, blocks)
    compute = new_stream(device)
    prefill = Prefill(device, tensors, dst_index, compute)
    lines = []
    bad = 0
    for path, issuer in _variants(paths, issuers):
        with Worker.create(layout, 2 * blocks, path=path, issuer=issuer) as w:  # type: ignore[arg-type]
            label = _label(path, w)
            w.store(0, src, host)
            if not all(r.ok for r in w.wait([0], TIMEOUT_S)):
                raise RuntimeError("the store failed")
            job = 1
            loads = []
            for _ in range(PREFILL_ROUNDS):
                torch.cuda.synchronize(device)
                total, _, result = _job(w, False, job, dst, host)
                job += 1
                loads.append(total)
            load_s = statistics.median(loads)
            prefill.calibrate(ratio * load_s / layers)  # the compute: ratio x one layer's load a layer
            compute_s = prefill.seconds()
            serial, overlapped, first, full, call, waits = [], [], [], [], [], []
            alone: list[float] = []  # the layered load alone, call -> result
            whole: list[float] = []  # the whole load in the same rounds, call -> result
            stalls: list[float] = []  # the compute stream's waits for layers 1.. (after layer 0)
            beside: list[float] = []  # its compute beside the load (from each wait passed)
            taken: set[str] = set()  # the paths the layered loads took
            for rnd in range(PREFILL_ROUNDS):
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                w.load(job, host, dst, stream=compute)
                if not all(r.ok for r in w.wait([job], TIMEOUT_S)):
                    raise RuntimeError("a load failed")
                for i in range(layers):
                    prefill.layer(i)
                compute.synchronize()
                serial.append(time.perf_counter() - t0)
                job += 1
                torch.cuda.synchronize(device)
                begin, end = new_event(timing=True), new_event(timing=True)
                # on the compute stream, around each layer's wait: when it reached the wait (the
                # layer before computed) and when it passed it (the layer landed)
                reached = [new_event(timing=True) for _ in range(layers)]
                passed = [new_event(timing=True) for _ in range(layers)]
                t0 = time.perf_counter()
                begin.record(compute)
                t1 = time.perf_counter()
                load: LayerLoad = w.load_by_layer(job, host, dst, stream=compute)
                call.append(time.perf_counter() - t1)
                for i in range(layers):
                    reached[i].record(compute)
                    t1 = time.perf_counter()
                    load.wait_layer(i, compute)
                    waits.append(time.perf_counter() - t1)
                    passed[i].record(compute)
                    prefill.layer(i)
                end.record(compute)
                compute.synchronize()
                overlapped.append(time.perf_counter() - t0)
                stalls.append(sum(float(reached[i].elapsed_time(passed[i])) for i in range(1, layers)) / 1e3)
                beside.append(sum(float(passed[i].elapsed_time(reached[i + 1] if i + 1 < layers else end))
                                  for i in range(layers)) / 1e3)
                (layered,) = w.wait([job], TIMEOUT_S)
                if not layered.ok:
                    raise RuntimeError(f"a layered load failed: {layered.error}")
                taken.add(layered.path)
                job += 1
                first.append(float(begin.elapsed_time(passed[0])) / 1e3)
                torch.cuda.synchronize(device)  # the whole load again, beside the layered one below
                whole.append(_job(w, False, job, dst, host)[0])
                job += 1
                if rnd == PREFILL_ROUNDS - 1:  # the check below sees this round's bytes
                    _zero_blocks(tensors, dst_index)
                # when the whole load landed, as the device saw it (a wait for the last layer)
                begin2, done = new_event(timing=True), new_event(timing=True)
                torch.cuda.synchronize(device)
                begin2.record(compute)
                t0 = time.perf_counter()
                load = w.load_by_layer(job, host, dst, stream=compute)
                load.wait_layer(layers - 1, compute)
                done.record(compute)
                if not all(r.ok for r in w.wait([job], TIMEOUT_S)):
                    raise RuntimeError("a layered load failed")
                alone.append(time.perf_counter() - t0)  # call -> result, as the whole load's
                job += 1
                done.synchronize()
                full.append(float(begin2.elapsed_time(done)) / 1e3)
            bad += _mismatched(layout, src, dst)
        s, o = statistics.median(serial), statistics.median(overlapped)
        ideal = max(load_s, compute_s) + load_s / layers
        f0, fl = statistics.median(first), statistics.median(full)
        shown = _taken_label(label, path, taken)
        lines.append(
            f"[{shown:<13}] {_size(page)} pages, records {records}, blocks {order}: load {load_s * 1e3:6.2f} ms, compute "
            f"{compute_s * 1e3:6.2f} ms; load then compute {s * 1e3:6.2f} ms; load_by_layer {o * 1e3:6.2f} "
            f"ms ({s / o:4.2f}x faster); ideal max(load, compute) + one layer {ideal * 1e3:6.2f} ms "
            f"(load_by_layer = ideal + {(o - ideal) * 1e6:7.1f} us); layer 0 ready after {f0 * 1e6:7.1f} "
            f"us, all after {fl * 1e6:7.1f} us (1/L of it + 50 us = {(fl / layers) * 1e6 + 50:7.1f} us); "
            f"the layered load alone, call -> result {statistics.median(alone) * 1e3:6.2f} ms (the whole "
            f"load's in the same rounds {statistics.median(whole) * 1e3:6.2f}); "
            f"the caller's time in load_by_layer {statistics.median(call) * 1e6:6.1f} us, in wait_layer "
            f"{statistics.median(waits) * 1e6:5.1f} us (medians); products a layer {_products(prefill)}; on "
            f"the compute stream after layer 0: waits for layers {statistics.median(stalls) * 1e6:6.1f} us, "
            f"compute {statistics.median(beside) * 1e3:5.2f} ms beside the load ({compute_s * 1e3:5.2f} alone)"
        )
        _log(out, "  " + lines[-1])
    return lines, bad


def _products(prefill: Prefill) -> str:
    """``3 x 2048 + 5 x 1024``: a layer's products of each side."""
    return " + ".join(f"{n} x {side}" for side, n in sorted(prefill.products.items(), reverse=True) if n)


def _variants(paths: Sequence[str], issuers: Sequence[str]) -> list[tuple[str, str]]:
    """Every (path, issuer) to measure, issuer by issuer."""
    return [(path, issuer) for issuer in issuers for path in paths]


def _label(path: str, w: Worker) -> str:
    """``path/issuer`` as the worker runs it."""
    return f"{path}/{w.issuer}"


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"
