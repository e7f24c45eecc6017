"""Benchmark of the disk tier against the raw speed of the same file system, in one run.

Measures, with the same I/O size and thread count:

* raw: plain ``os.pwritev``/``os.preadv`` of page-aligned buffers on an O_DIRECT file (no headers, no
  checksum), each thread moving ``--io-mib`` per call over its share of the file;
* tier: ``Worker.demote``/``Worker.promote`` jobs between the host pool of a host-backend worker and
  its disk tier, a file of the same payload size, with checksums on and off (to show what the CRC
  costs);
* ``zlib.crc32`` alone over the pool on the same number of threads.

Tier jobs are half a pool each, at most two in flight, alternating halves, so no two jobs in flight
write the same host rows; every read job verifies every record (``ok=True``) and the pool is compared
with its original bytes at the end. Each repeat measures every row back to back; the table gives
each row's best throughput, its ratio to the best raw figure (``x raw``), and the median over the
repeats of the ratio to the raw figure *of the same repeat* (``median``): when the two disagree,
other load on the machine disturbed the run. Per-repeat figures go to stderr. Numbers are reported,
never asserted. When the file system refuses O_DIRECT, both sides run buffered and the report says
so (reads may then come from the page cache).

The data size is capped by the memory the machine can give (the pipeline's device cache lives in host
memory without a GPU). Every file the benchmark creates is named ``kvoffload-bench-*-<pid>.bin`` and
removed on every exit (SIGTERM and SIGHUP included); files left by a run that was killed outright are
removed by the next run once their process is gone.

Run: ``python -m kvoffload bench --disk DIR [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Final, cast

import attrs
import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import Buffer

from kvoffload import DeviceLayout, DiskConfig, Worker, host_memory_available
from kvoffload.cli._args import finite_float, int_in, writable_file

__all__ = ["main"]

GIB: Final = 1 << 30
MIB: Final = 1 << 20
KIB: Final = 1 << 10
PAGE_BYTES: Final = 4096
DEFAULT_DATA_GIB: Final = 4.0
QUICK_DATA_GIB: Final = 1.0
DEFAULT_POOL_GIB: Final = 1.0
DEFAULT_RECORD_KIB: Final = 1024  # e.g. one 16-token block of a Llama-3.1-8B-sized model is 2 MiB
WAIT_S: Final = 600.0
FINGERPRINT: Final = "kvoffload.disk_bench"
#: Share of the available memory the benchmark may use (the rest stays for the page cache and
#: everything else on the machine).
MEMORY_SHARE: Final = 0.5
#: The disk tier's limits (``DiskConfig``): I/O and checksum threads, MiB per system call.
MAX_THREADS: Final = 64
MAX_IO_MIB: Final = 1024
_FILE_PATTERN: Final = re.compile(r"kvoffload-bench-[a-z]+-(\d+)\.bin")

U8Array = npt.NDArray[np.uint8]


@attrs.frozen
class Figures:
    """One row of the table: best throughput in GB/s (write = host -> disk), its ratio to the best
    raw figure, and the median ratio to the raw figure of the same repeat."""

    name: str
    write_gbps: float
    read_gbps: float
    write_ratio: float
    read_ratio: float
    write_ratio_median: float
    read_ratio_median: float


def _figures(name: str, runs: list[tuple[float, float]], raw: list[tuple[float, float]]) -> Figures:
    write, read = max(w for w, _ in runs), max(r for _, r in runs)
    return Figures(
        name, write, read, write / max(w for w, _ in raw), read / max(r for _, r in raw),
        float(np.median([w / rw for (w, _), (rw, _) in zip(runs, raw)])),
        float(np.median([r / rr for (_, r), (_, rr) in zip(runs, raw)])),
    )


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def _aligned(nbytes: int) -> U8Array:
    raw = np.zeros(nbytes + PAGE_BYTES, dtype=np.uint8)
    shift = (-raw.ctypes.data) % PAGE_BYTES
    return raw[shift : shift + nbytes]


def _raw(path: str, data_bytes: int, io_bytes: int, threads: int) -> tuple[float, float, bool]:
    """Raw write and read GB/s of ``data_bytes`` in calls of ``io_bytes``; and whether O_DIRECT."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    direct = True
    fd = -1
    # The file is removed at the end unless it was there before this call (the first open, with
    # O_EXCL, says so). The opens stand inside the ``try``: a signal raised as one returns (the
    # file made, ``fd`` not yet set) still removes the file.
    made = True
    try:
        try:
            fd = os.open(path, flags | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
        except FileExistsError:
            made = False  # another's (or a leftover): never this call's to remove
            raise
        except OSError:  # O_DIRECT refused (a file system may make the file first): any file
            direct = False  # there now is this call's
            fd = os.open(path, flags, 0o600)
        os.posix_fallocate(fd, 0, data_bytes)
        buffers = [_aligned(io_bytes) for _ in range(threads)]
        for b in buffers:
            b[:] = np.frombuffer(os.urandom(io_bytes), dtype=np.uint8)
        calls = data_bytes // io_bytes

        def run(write: bool) -> float:
            def work(k: int) -> None:
                view = [cast(Buffer, buffers[k])]
                for i in range(k, calls, threads):
                    done = (os.pwritev if write else os.preadv)(fd, view, i * io_bytes)
                    if done != io_bytes:
                        raise OSError(f"raw {'write' if write else 'read'} moved {done} bytes")

            return _timed_threads(work, threads, calls * io_bytes)

        try:
            return run(True), run(False), direct
        except StuckThreadsError:
            fd = -1  # a stuck thread may still use it: left to the process, never reused under it
            raise
    finally:
        if fd >= 0:
            os.close(fd)
        if made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class StuckThreadsError(RuntimeError):
    """A measurement's threads did not finish by their deadline (a disk that stopped answering):
    they are left running, and what they use is left to the process."""


def _timed_threads(work: Callable[[int], None], threads: int, nbytes: int,
                   deadline_s: float | None = None) -> float:
    """GB/s of ``nbytes`` moved by ``work(k)`` on ``threads`` threads at once.

    Raises:
        StuckThreadsError: a thread still ran ``deadline_s`` (default :data:`WAIT_S`) after the
            start (the threads are daemons: the process can still exit).
        BaseException: the first error a thread raised.
    """
    deadline_s = WAIT_S if deadline_s is None else deadline_s
    errors: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            work(k)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    pool = [threading.Thread(target=guarded, args=(k,), name=f"kvoffload-bench-io-{k}", daemon=True)
            for k in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join(max(0.0, start + deadline_s - time.perf_counter()))
    elapsed = time.perf_counter() - start
    stuck = sum(t.is_alive() for t in pool)
    if stuck:
        raise StuckThreadsError(f"{stuck} of {threads} threads did not finish within {deadline_s:g} s")
    if errors:
        raise errors[0]
    return nbytes / elapsed / 1e9


def _tier_pass(tier: Worker, num_blocks: int, half: int, write: bool, first_job: int) -> float:
    """Move ``num_blocks`` records in jobs of ``half`` rows, two in flight; GB/s of payload."""
    jobs: list[int] = []
    start = time.perf_counter()
    for k, block in enumerate(range(0, num_blocks, half)):
        n = min(half, num_blocks - block)
        rows = list(range((k % 2) * half, (k % 2) * half + n))
        blocks = list(range(block, block + n))
        if len(jobs) >= 2:
            _expect_ok(tier.wait([jobs.pop(0)], WAIT_S))
        job = first_job + k
        if write:
            tier.demote(job, rows, blocks)
        else:
            tier.promote(job, blocks, rows)
        jobs.append(job)
    _expect_ok(tier.wait(jobs, WAIT_S))
    return num_blocks * tier.layout.record_bytes / (time.perf_counter() - start) / 1e9


def _expect_ok(results: Sequence[object]) -> None:
    for result in results:
        if not getattr(result, "ok", False):
            raise RuntimeError(f"a benchmark job failed: {result}")


def _crc_gbps(pool: U8Array, threads: int) -> float:
    rows = pool.shape[0]

    def work(k: int) -> None:
        for i in range(k, rows, threads):
            zlib.crc32(cast(Buffer, pool[i]))

    return _timed_threads(work, threads, pool.nbytes)


def _mismatched(layout: object, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> int:
    """Blocks of ``dst`` whose records differ from ``src``'s, compared a slice at a time (never two
    whole copies of the data in memory)."""
    assert isinstance(layout, DeviceLayout)
    step = max(1, (64 << 20) // layout.record_bytes)
    bad = 0
    for i in range(0, len(src), step):
        a, b = layout.gather_records(src[i : i + step]), layout.gather_records(dst[i : i + step])
        bad += int((a != b).any(dim=1).sum())
    return bad


def fit_to_memory(data_bytes: int, pool_bytes: int, cpu_cache: bool) -> int:
    """``data_bytes``, or less so that the run fits :data:`MEMORY_SHARE` of the available memory:
    the pool and its copy, plus (without a GPU) the pipeline's device cache of twice the data in
    host memory. Says so on stderr when it shrinks it."""
    available = host_memory_available()
    if available is None:
        return data_bytes
    budget = int(available[0] * MEMORY_SHARE) - 2 * pool_bytes
    fitted = max(16 * MIB, budget // (3 if cpu_cache else 1))
    if fitted >= data_bytes:
        return data_bytes
    _progress(f"{data_bytes / GIB:.2f} GiB per pass does not fit this machine ({available[0] / GIB:.1f} "
              f"GiB {available[1]}): measuring {fitted / GIB:.2f} GiB")
    return fitted


def _sweep_stale_files(directory: str) -> None:
    """Remove benchmark files left by runs whose process is gone (killed outright)."""
    for name in os.listdir(directory):
        match = _FILE_PATTERN.fullmatch(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                _progress(f"removed {name}, left by a run that was killed")
        except PermissionError:
            pass  # another user's live process


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM/SIGHUP, so that every ``finally`` removes its file."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def pipeline_figures(
    path: str, data_bytes: int, threads: int, repeats: int = 3, progress: bool = True
) -> dict[str, float]:
    """Disk -> device through a Worker's bounce slots, next to raw O_DIRECT reads of the same bytes.

    Uses the cuda backend when a GPU is present (else the host backend, and says so in the result):
    a synthetic Llama-like cache (per-layer, 2 MiB blocks) is stored to disk once, then loaded back
    into other blocks ``repeats`` times, each load right after a raw read pass (so that both see the
    disk in the same state), and checked byte for byte. Reports the best of each and the median of
    the per-repeat ratios.
    """
    from kvoffload.cli._caches import build_cache

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    layers = 32 if cuda else 2
    probe = build_cache("per-layer", num_blocks=1, layers=layers, kv_heads=8, head_dim=128,
                        block_size=16, dtype=torch.bfloat16, device=device)[0]
    block_bytes = sum(t.numel() * t.element_size() for t in probe.values())
    blocks = max(8, data_bytes // block_bytes)
    tensors, block_dim = build_cache("per-layer", num_blocks=2 * blocks, layers=layers, kv_heads=8,
                                     head_dim=128, block_size=16, dtype=torch.bfloat16, device=device)
    layout = DeviceLayout.from_tensors(tensors, block_dim=block_dim)
    moved = blocks * layout.block_bytes
    raw_path = os.path.join(path, f"kvoffload-bench-raw-{os.getpid()}.bin")
    disk_path = os.path.join(path, f"kvoffload-bench-pipeline-{os.getpid()}.bin")
    config = DiskConfig(disk_path, num_blocks=blocks, io_threads=threads)
    src = np.arange(blocks, dtype=np.int64)
    dst = src + blocks
    raw_runs: list[float] = []
    pipe_runs: list[float] = []
    bad = 0
    try:
        with Worker.create(layout, 8, disk=config) as w:
            w.store_to_disk(1, src, src)
            stored = w.wait([1], 600.0)[0]
            if not stored.ok:
                raise RuntimeError(f"store_to_disk failed: {stored.error}")
            for rep in range(repeats):
                _, raw_read, _ = _raw(raw_path, blocks * layout.record_bytes, 8 * MIB, threads)
                layout.scatter_records(dst, torch.zeros(1, layout.record_bytes, dtype=torch.uint8)
                                       .expand(blocks, -1))
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                w.load_from_disk(2 + rep, src, dst)
                loaded = w.wait([2 + rep], 600.0)[0]
                seconds = time.perf_counter() - start
                if not loaded.ok:
                    raise RuntimeError(f"load_from_disk failed: {loaded.error}")
                bad += _mismatched(layout, src, dst)
                raw_runs.append(raw_read)
                pipe_runs.append(moved / seconds / 1e9)
                if progress:
                    _progress(f"pipeline repeat {rep + 1}/{repeats}: raw read {raw_read:.2f} GB/s, "
                              f"disk -> device {pipe_runs[-1]:.2f} GB/s")
    finally:
        if os.path.exists(disk_path):
            os.unlink(disk_path)
    ratios = sorted(p / r for p, r in zip(pipe_runs, raw_runs))
    return {"backend_cuda": float(cuda), "raw_read_gbps": max(raw_runs),
            "pipeline_gbps": max(pipe_runs), "ratio": max(pipe_runs) / max(raw_runs),
            "ratio_median": ratios[len(ratios) // 2], "bytes": float(moved),
            "mismatched_blocks": float(bad)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table (or JSON with ``--json``); progress goes to stderr."""
    parser = argparse.ArgumentParser(prog="kvoffload.disk_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", required=True, help="a directory on the file system to measure")
    parser.add_argument("--gib", type=finite_float(0, low_open=True), default=None,
                        help=f"GiB moved per pass (default {DEFAULT_DATA_GIB}, quick {QUICK_DATA_GIB})")
    parser.add_argument("--pool-gib", type=finite_float(0, low_open=True), default=DEFAULT_POOL_GIB, help="host pool size")
    parser.add_argument("--record-kib", type=int_in(1), default=DEFAULT_RECORD_KIB, help="bytes per record")
    parser.add_argument("--io-mib", type=int_in(1, MAX_IO_MIB), default=8, help="payload bytes per system call")
    parser.add_argument("--threads", type=int_in(1, MAX_THREADS), default=4, help="I/O threads (raw and tier)")
    parser.add_argument("--checksum-threads", type=int_in(1, MAX_THREADS), default=None,
                        help="the tier's CRC threads, beside its I/O threads (default: --threads)")
    parser.add_argument("--repeats", type=int_in(1), default=None,
                        help="repeats of every row (default 3, quick 1)")
    parser.add_argument("--quick", action="store_true", help="1 GiB per pass, one repeat")
    parser.add_argument("--json", type=writable_file, default=None, metavar="FILE",
                        help="also write every figure to FILE as JSON")
    parser.add_argument("--pipeline", action="store_true",
                        help="also time disk -> device loads through a Worker's bounce slots")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.path):
        parser.error(f"{args.path!r} is not a directory")
    if (args.record_kib * KIB) % PAGE_BYTES or (args.io_mib * MIB) % (args.record_kib * KIB):
        parser.error(f"--record-kib {args.record_kib} must be a multiple of 4 and divide --io-mib "
                     f"{args.io_mib} (in KiB)")
    handlers = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args)
    except _Terminated as stop:
        _progress(f"stopped by signal {stop.args[0]}; files removed")
        return 128 + int(stop.args[0])
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)


def _run(args: argparse.Namespace) -> int:
    _sweep_stale_files(args.path)
    record_bytes = args.record_kib * KIB
    io_bytes = args.io_mib * MIB
    default_gib = QUICK_DATA_GIB if args.quick else DEFAULT_DATA_GIB
    data_gib = args.gib if args.gib is not None else default_gib
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    wanted = fit_to_memory(int(data_gib * GIB), int(args.pool_gib * GIB),
                           cpu_cache=args.pipeline and not torch.cuda.is_available())
    num_blocks = max(2, wanted // record_bytes)
    pool_rows = max(2, min(num_blocks, int(args.pool_gib * GIB) // record_bytes) // 2 * 2)
    half = pool_rows // 2
    data_bytes = num_blocks * record_bytes
    raw_path = os.path.join(args.path, f"kvoffload-bench-raw-{os.getpid()}.bin")
    tier_path = os.path.join(args.path, f"kvoffload-bench-tier-{os.getpid()}.bin")

    # The tier moves host records of a host-backend worker; its one-page "device cache" is unused.
    layout = DeviceLayout.from_tensors({"record": torch.zeros(1, record_bytes, dtype=torch.uint8)}, 0,
                                       model_id=FINGERPRINT)
    runs: dict[str, list[tuple[float, float]]] = {}
    direct_raw = True
    tier_reason = ""
    job = 0
    for rep in range(repeats):
        _progress(f"repeat {rep + 1}/{repeats}: raw, {data_bytes / GIB:.2f} GiB")
        w, r, direct_raw = _raw(raw_path, data_bytes, io_bytes, args.threads)
        runs.setdefault("raw", []).append((w, r))
        _progress(f"  raw: {w:.2f} / {r:.2f} GB/s")
        for checksum in (True, False):
            name = f"tier, checksum {'on' if checksum else 'off'}"
            _progress(f"repeat {rep + 1}/{repeats}: {name}")
            config = DiskConfig(tier_path, num_blocks=num_blocks, io_threads=args.threads,
                                checksum_threads=args.checksum_threads, io_bytes=io_bytes,
                                checksum=checksum)
            try:
                with Worker.create(layout, pool_rows, disk=config, bounce_slots=2) as tier:
                    caps = tier.disk_capabilities()
                    assert caps is not None
                    tier_reason = caps.reason
                    records = tier.host_records()
                    records.copy_(torch.randint(0, 256, records.shape, dtype=torch.uint8))
                    original = records.clone()
                    w = _tier_pass(tier, num_blocks, half, True, job)
                    job += num_blocks
                    r = _tier_pass(tier, num_blocks, half, False, job)
                    job += num_blocks
                    intact = torch.equal(records, original)
                    del records, original
            finally:
                if os.path.exists(tier_path):
                    os.unlink(tier_path)
            if not intact:
                raise RuntimeError("the host pool differs from its original bytes after reading")
            runs.setdefault(name, []).append((w, r))
            _progress(f"  {name}: {w:.2f} / {r:.2f} GB/s")
    sample = np.frombuffer(os.urandom(pool_rows * record_bytes), dtype=np.uint8).reshape(pool_rows, -1)
    crc = max(_crc_gbps(sample, args.threads) for _ in range(repeats))

    rows = [_figures(name, got, runs["raw"]) for name, got in runs.items()]
    pipe = pipeline_figures(args.path, data_bytes, args.threads, repeats) if args.pipeline else None
    report = {
        "path": args.path,
        "raw_o_direct": direct_raw,
        "tier_io": tier_reason,
        "data_bytes": data_bytes,
        "record_bytes": record_bytes,
        "io_bytes": io_bytes,
        "threads": args.threads,
        "checksum_threads": args.checksum_threads or args.threads,
        "repeats": repeats,
        "crc32_gbps": crc,
        "pipeline": pipe,
        "rows": [
            attrs.asdict(f) | {"runs": runs[f.name]} for f in rows
        ],
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    mode = "O_DIRECT" if direct_raw else "buffered (O_DIRECT refused)"
    print(f"disk tier benchmark on {args.path}: {data_bytes / GIB:.2f} GiB per pass, records of "
          f"{record_bytes // KIB} KiB, {io_bytes // MIB} MiB per call, {args.threads} I/O threads "
          f"(+{args.checksum_threads or args.threads} CRC threads in the tier), {repeats} repeats; "
          f"raw {mode}; tier {tier_reason}")
    print("best GB/s; x raw = best / best raw; median = median of per-repeat ratios to raw")
    print(f"{'':<20} {'host->disk GB/s':>15} {'x raw':>6} {'median':>6} "
          f"{'disk->host GB/s':>15} {'x raw':>6} {'median':>6}")
    for f in rows:
        print(f"{f.name:<20} {f.write_gbps:>15.2f} {f.write_ratio:>6.2f} {f.write_ratio_median:>6.2f} "
              f"{f.read_gbps:>15.2f} {f.read_ratio:>6.2f} {f.read_ratio_median:>6.2f}")
    print(f"zlib.crc32 alone on {args.threads} threads: {crc:.2f} GB/s; {os.cpu_count()} CPUs")
    if pipe is not None:
        where = "GPU" if pipe["backend_cuda"] else "CPU tensors (no GPU: host backend)"
        print(f"disk -> {where} through bounce slots: best {pipe['pipeline_gbps']:.2f} GB/s = "
              f"{pipe['ratio']:.2f} x best raw read ({pipe['raw_read_gbps']:.2f} GB/s); median of "
              f"per-repeat ratios {pipe['ratio_median']:.2f}; mismatched blocks "
              f"{int(pipe['mismatched_blocks'])}")
        return 0 if pipe["mismatched_blocks"] == 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
