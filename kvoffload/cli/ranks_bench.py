"""``python -m kvoffload bench --ranks N``: one host pool shared by N rank processes.

Two figures, each measured side by side in one run, every rank a real process (spawned):

* **attach**: N processes attach one ``SharedPool`` of ``--pool-gib`` GiB (each holds a 1/N slice of
  every block, and populates 1/N of the pages), timed from the moment all of them call
  ``Worker.create`` (a barrier) to the last return; against one process creating the same bytes
  alone, as a one-rank shared pool and as the private pool a worker of its own maps. With a GPU
  each rank pins the whole pool (registration is per process); without one the host backend maps
  and populates it only.
* **throughput** (``--traffic-ranks``, default 2): store then load GB/s of the ranks at once over
  one shared pool, each with its own cache, against one rank alone; every byte checked. On one
  GPU the ranks share the host link: the figures say what share each gets. Without a GPU it is the
  host backend (``memmove``), which says nothing about a link, and is labelled so.

The memory both figures need is checked before any rank starts. Stopped by SIGINT, SIGTERM or SIGHUP,
it kills its rank processes and removes the pool files they were attaching
(``/dev/shm/kvoffload-bench-<pid>-*``) before it exits with status 128 + the signal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any, Final, Protocol, get_args

import numpy as np
import torch

from kvoffload import DeviceLayout, PathName, SharedPool, Worker
from kvoffload.cli._args import GIB, check_memory, finite_float, int_in, writable_file

__all__ = ["main"]

_GB: Final = 1e9
MIB: Final = 1 << 20
#: Host blocks of the attach measurement (the record size follows from the pool size).
ATTACH_BLOCKS: Final = 1024
#: Throughput: bytes of one block, blocks per job.
TRAFFIC_BLOCK_BYTES: Final = 2 * MIB
JOB_BLOCKS: Final = 32
#: Bounds every wait of the bench (spawning, CUDA start-up, attaching, moving the bytes).
TIMEOUT_S: Final = 600.0
#: How long a rank process stopped by an interrupted run may take to exit after SIGKILL.
STOP_WAIT_S: Final = 10.0
#: Where a pool's file lives while its ranks attach.
SHM_DIR: Final = "/dev/shm"
MAX_RANKS: Final = 64


STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Terminated(BaseException):
    """Raised in the main thread by one of :data:`STOP_SIGNALS`, so that every ``finally`` stops
    its ranks and removes its pool's file."""


def _raise_terminated(signum: int, frame: object) -> None:
    for sig in STOP_SIGNALS:  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise _Terminated(signum)


class Barrier(Protocol):
    """A barrier of the rank processes (``multiprocessing``'s; ``threading``'s in tests)."""

    def wait(self, timeout: float | None = None) -> int: ...

    def abort(self) -> None: ...


class Results(Protocol):
    """Where the ranks put their figures (a ``multiprocessing`` queue; a ``queue.Queue`` in tests)."""

    def put(self, item: Any) -> None: ...


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _layout(device: torch.device, page_bytes: int, pages: int, num_blocks: int) -> DeviceLayout:
    """A cache of ``num_blocks`` blocks of ``pages`` pages of ``page_bytes`` (random bytes)."""
    cache = torch.randint(0, 256, (pages, num_blocks, page_bytes), dtype=torch.uint8, device=device)
    return DeviceLayout.from_tensors({"kv": cache}, block_dim=1)


def _create(layout: DeviceLayout, blocks: int, pool: SharedPool | None, rank: int, path: str) -> Worker:
    shared = pool.rank(rank) if pool is not None else None
    if layout.device.type == "cuda":
        return Worker.create(layout, blocks, shared=shared, path=path)  # type: ignore[arg-type]
    return Worker.create(layout, blocks, shared=shared)


def attach_rank(pool: SharedPool | None, rank: int, record_bytes: int, blocks: int,
                barrier: Barrier, results: Results) -> None:
    """One rank of the attach figure: ``(rank, start, end)`` of its ``Worker.create`` (monotonic
    clock, which every process of the machine shares), or ``(rank, None, error)``."""
    try:
        device = _device()
        layout = _layout(device, record_bytes, 1, 4)  # the pool is what is measured, not the cache
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the CUDA context exists before the clock starts
        barrier.wait(TIMEOUT_S)
        began = time.monotonic()
        worker = _create(layout, blocks, pool, rank, "dma")
        results.put((rank, began, time.monotonic()))
        barrier.wait(TIMEOUT_S)  # every rank attached before any releases
        worker.shutdown()
    except BaseException as exc:
        barrier.abort()
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))


def traffic_rank(pool: SharedPool, rank: int, page_bytes: int, blocks: int, path: str,
                 barrier: Barrier, results: Results) -> None:
    """One rank of the throughput figure: ``(rank, store_s, load_s, bytes, mismatched blocks)``,
    or ``(rank, None, error)``. Stores ``blocks`` device blocks, then loads them into the others,
    in jobs of :data:`JOB_BLOCKS` submitted back to back, started with the other ranks."""
    try:
        device = _device()
        layout = _layout(device, page_bytes, TRAFFIC_BLOCK_BYTES // page_bytes, 2 * blocks)
        worker = _create(layout, blocks, pool, rank, path)
        rng = np.random.default_rng(rank)
        dev_a, dev_b, host = rng.permutation(blocks), blocks + rng.permutation(blocks), rng.permutation(blocks)
        _run(worker, "store", dev_a[:JOB_BLOCKS], host[:JOB_BLOCKS], 10**6)  # warm-up
        barrier.wait(TIMEOUT_S)
        store_s = _run(worker, "store", dev_a, host, 0)
        barrier.wait(TIMEOUT_S)
        load_s = _run(worker, "load", host, dev_b, 10**5)
        bad = _mismatches(layout, dev_a, dev_b)
        results.put((rank, store_s, load_s, blocks * layout.block_bytes, bad))
        barrier.wait(TIMEOUT_S)
        worker.shutdown()
    except BaseException as exc:
        barrier.abort()
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))


def _run(w: Worker, kind: str, src: np.ndarray, dst: np.ndarray, first: int) -> float:
    """Jobs of :data:`JOB_BLOCKS` back to back, then wait for all: wall seconds."""
    if w.layout.device.type == "cuda":
        torch.cuda.synchronize(w.layout.device)
    began = time.perf_counter()
    ids = []
    for i, start in enumerate(range(0, src.shape[0], JOB_BLOCKS)):
        (w.store if kind == "store" else w.load)(first + i, src[start : start + JOB_BLOCKS],
                                                 dst[start : start + JOB_BLOCKS])
        ids.append(first + i)
    results = w.wait(ids, TIMEOUT_S)
    elapsed = time.perf_counter() - began
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} job(s) failed: {failed[0].error}")
    return elapsed


def _mismatches(layout: DeviceLayout, a: np.ndarray, b: np.ndarray) -> int:
    bad = 0
    for i in range(0, a.shape[0], 64):
        bad += int((layout.gather_records(a[i : i + 64]) != layout.gather_records(b[i : i + 64]))
                   .any(dim=1).sum())
    return bad


def _spawn(target: Any, jobs: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Run ``target(*job, barrier, results)`` in one process per job; their results by rank.

    However it ends (a rank's error, a signal), every rank process has exited and the file of each
    job's pool is gone when it returns or raises: an interrupted run kills its ranks at once.
    """
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(jobs))
    results = context.Queue()
    procs = [context.Process(target=target, args=(*job, barrier, results), daemon=True) for job in jobs]
    finished = False
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=TIMEOUT_S) for _ in jobs]
        finished = True
    finally:
        for p in procs:
            if p.pid is None:
                continue
            if not finished:
                p.kill()
            p.join(TIMEOUT_S if finished else STOP_WAIT_S)
            if p.is_alive():
                p.kill()
                p.join(STOP_WAIT_S)
        results.close()
        results.join_thread()
        for job in jobs:  # gone once every rank mapped it; left when a rank died attaching
            if isinstance(job[0], SharedPool):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, job[0].name))
    errors = [g for g in got if g[1] is None]
    if errors:
        raise RuntimeError(f"rank {errors[0][0]}: {errors[0][2]}")
    return sorted(got)


def _name() -> str:
    return f"kvoffload-bench-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _attach_record_bytes(ranks: int, pool_bytes: int) -> int:
    """Bytes of each rank's slice of a block of the attach figure's pool."""
    return max(4096, pool_bytes // (ATTACH_BLOCKS * ranks) // 4096 * 4096)


def _traffic_blocks(traffic_bytes: int) -> int:
    return max(JOB_BLOCKS, traffic_bytes // TRAFFIC_BLOCK_BYTES)


def measure_attach(ranks: int, pool_bytes: int) -> dict[str, float]:
    """Seconds to attach a pool of ``pool_bytes`` by ``ranks`` processes, and by one alone."""
    record = _attach_record_bytes(ranks, pool_bytes)
    alone_private = _spawn(attach_rank, [(None, 0, record * ranks, ATTACH_BLOCKS)])
    alone_shared = _spawn(attach_rank, [(SharedPool(_name(), 1, attach_timeout_s=TIMEOUT_S), 0,
                                         record * ranks, ATTACH_BLOCKS)])
    pool = SharedPool(_name(), ranks, attach_timeout_s=TIMEOUT_S)
    together = _spawn(attach_rank, [(pool, r, record, ATTACH_BLOCKS) for r in range(ranks)])

    def wall(got: list[tuple[Any, ...]]) -> float:
        return float(max(g[2] for g in got) - min(g[1] for g in got))

    return {
        "pool_bytes": float(record * ranks * ATTACH_BLOCKS), "ranks": float(ranks),
        "alone_private_s": wall(alone_private), "alone_shared_s": wall(alone_shared),
        "ranks_s": wall(together),
        "slowest_rank_s": max(float(g[2] - g[1]) for g in together),
    }


def measure_traffic(ranks: int, traffic_bytes: int, page_bytes: int, path: str) -> dict[str, Any]:
    """Store and load GB/s of one rank alone, then of ``ranks`` ranks at once (each ``traffic_bytes``)."""
    blocks = _traffic_blocks(traffic_bytes)
    alone = _spawn(traffic_rank, [(SharedPool(_name(), 1, attach_timeout_s=TIMEOUT_S), 0,
                                   page_bytes, blocks, path)])
    pool = SharedPool(_name(), ranks, attach_timeout_s=TIMEOUT_S)
    together = _spawn(traffic_rank, [(pool, r, page_bytes, blocks, path) for r in range(ranks)])

    def rates(got: tuple[Any, ...]) -> dict[str, float]:
        _, store_s, load_s, nbytes, _ = got
        return {"store_gbps": nbytes / store_s / _GB, "load_gbps": nbytes / load_s / _GB}

    return {
        "alone": rates(alone[0]), "ranks": [rates(g) for g in together],
        "mismatched_blocks": sum(int(g[4]) for g in alone + together),
        "bytes_per_rank": int(alone[0][3]),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvoffload bench --ranks N", description=__doc__)
    parser.add_argument("--ranks", type=int_in(1, MAX_RANKS), required=True,
                        help="rank processes that attach the pool")
    parser.add_argument("--pool-gib", type=finite_float(0, low_open=True), default=8.0,
                        help="size of the pool to attach")
    parser.add_argument("--traffic-ranks", type=int_in(0, MAX_RANKS), default=2,
                        help="ranks moving data at once (0: skip)")
    parser.add_argument("--traffic-mib", type=int_in(1), default=4096, help="bytes each rank stores and loads")
    parser.add_argument("--page-kib", type=_page_kib, default=32,
                        help=f"page size of the throughput cache (divides {TRAFFIC_BLOCK_BYTES >> 10})")
    parser.add_argument("--path", choices=get_args(PathName), default="staged",
                        help="transfer path of the throughput figure (GPU)")
    parser.add_argument("--json", type=writable_file, default=None, help="write every figure to this file")
    return parser


def _page_kib(text: str) -> int:
    value = int_in(1, TRAFFIC_BLOCK_BYTES >> 10)(text)
    if TRAFFIC_BLOCK_BYTES % (value << 10):
        raise argparse.ArgumentTypeError(f"{value} must divide a block of {TRAFFIC_BLOCK_BYTES >> 10} KiB")
    return value


def _check_memory(parser: argparse.ArgumentParser, args: argparse.Namespace, cuda: bool) -> None:
    """Refuse a run whose pool or traffic does not fit the host memory (the figures are run one
    after the other: each is checked alone)."""
    pool = _attach_record_bytes(args.ranks, int(args.pool_gib * GIB)) * args.ranks * ATTACH_BLOCKS
    check_memory(parser, pool, f"--pool-gib {args.pool_gib:g}", "--pool-gib")
    if args.traffic_ranks:
        per_rank = _traffic_blocks(args.traffic_mib * MIB) * TRAFFIC_BLOCK_BYTES
        # its pool share, plus (without a GPU) its cache of twice as many blocks in host memory
        check_memory(parser, args.traffic_ranks * per_rank * (1 if cuda else 3),
                     f"--traffic-mib {args.traffic_mib} on {args.traffic_ranks} ranks",
                     "--traffic-mib (or --traffic-ranks)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kvoffload bench --ranks N``; returns the exit status (128 + the
    signal when stopped by one, after its ranks were stopped and their pool files removed)."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check_memory(parser, args, torch.cuda.is_available())
    handlers = {sig: signal.signal(sig, _raise_terminated) for sig in STOP_SIGNALS}
    try:
        return _bench(args)
    except _Terminated as stop:
        signum = int(stop.args[0])
        print(f"kvoffload bench --ranks: stopped by signal {signum}; rank processes stopped, pool files "
              "removed", file=sys.stderr, flush=True)
        return 128 + signum
    except RuntimeError as exc:  # a rank failed (its error, one line); the others were stopped
        print(f"kvoffload bench --ranks: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)


def _bench(args: argparse.Namespace) -> int:
    device = _device()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, host backend (no GPU)"
    print(f"kvoffload bench --ranks {args.ranks} on {where}")
    attach = measure_attach(args.ranks, int(args.pool_gib * (1 << 30)))
    figures: dict[str, Any] = {"device": where, "attach": attach}
    gib = attach["pool_bytes"] / (1 << 30)
    print(f"attach a {gib:.2f} GiB pool: {args.ranks} ranks {attach['ranks_s']:.3f} s (slowest rank "
          f"{attach['slowest_rank_s']:.3f} s); one process alone {attach['alone_shared_s']:.3f} s as a "
          f"shared pool ({attach['ranks_s'] / attach['alone_shared_s']:.2f}x), "
          f"{attach['alone_private_s']:.3f} s as a private pool "
          f"({attach['ranks_s'] / attach['alone_private_s']:.2f}x)")
    status = 0
    if args.traffic_ranks:
        traffic = measure_traffic(args.traffic_ranks, args.traffic_mib * MIB, args.page_kib * 1024, args.path)
        figures["traffic"] = traffic
        label = f"path {args.path}" if device.type == "cuda" else "host backend (memmove), not a link"
        alone = traffic["alone"]
        print(f"throughput, {traffic['bytes_per_rank'] / _GB:.2f} GB per rank, {args.page_kib} KiB pages, "
              f"{label}:")
        print(f"  one rank alone:        store {alone['store_gbps']:6.1f} GB/s, load {alone['load_gbps']:6.1f} GB/s")
        for kind in ("store", "load"):
            each = [r[f"{kind}_gbps"] for r in traffic["ranks"]]
            shares = ", ".join(f"{x:.1f} ({x / alone[f'{kind}_gbps']:.2f}x alone)" for x in each)
            print(f"  {args.traffic_ranks} ranks at once, {kind}: {shares}; together {sum(each):.1f} GB/s "
                  f"({sum(each) / alone[f'{kind}_gbps']:.2f}x one alone)")
        print(f"  mismatched blocks: {traffic['mismatched_blocks']}")
        status = 1 if traffic["mismatched_blocks"] else 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    sys.stdout.flush()
    return status
