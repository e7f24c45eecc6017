"""``python -m kvoffload demo``: store and reload a synthetic KV cache, verify every byte, report speed.

Builds a KV cache with a real model's geometry (default Llama-3.1-8B: 32 layers, 8 KV heads, head
dim 128, block size 16, bf16, per-layer ``[2, N, 16, 8, 128]``), fills it with random bytes, stores
random blocks to the host pool and loads them back into other blocks through a
:class:`~kvoffload.Worker`, and checks every byte of the host records and of the reloaded blocks
against an independent torch gather (:meth:`~kvoffload.DeviceLayout.gather_records`). It prints store
and load GB/s next to the link limit measured in the same run (one large pinned copy each way) and
exits non-zero on any mismatch or failed job. Without a GPU it runs the host backend and says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Final, TextIO, get_args

import attrs
import torch

from kvoffload import DeviceLayout, PathName, TransferResult, Worker
from kvoffload.cli._args import check_backend, check_device_memory, check_memory, int_in
from kvoffload.cli._caches import LAYOUTS, block_bytes, build_cache
from kvoffload.cli._torch import new_event, new_stream

__all__ = ["LAYOUTS", "DemoReport", "build_cache", "main", "measure_link", "run_demo"]

DTYPES: Final = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                 "uint8": torch.uint8}
#: Size of the single pinned copy that measures the link limit.
LINK_PROBE_BYTES: Final = 1 << 30
LINK_PROBE_REPEATS: Final = 3
WAIT_TIMEOUT_S: Final = 120.0
#: Written into the load destinations first, so that a load that copies nothing is caught.
POISON_BYTE: Final = 0xA5
_GB: Final = 1e9
_VERIFY_CHUNK_BLOCKS: Final = 256
#: The seeds ``torch.Generator.manual_seed`` takes.
SEED_RANGE: Final = (-(1 << 63), (1 << 64) - 1)


@attrs.frozen
class DemoReport:
    """What one demo run measured; ``ok`` is False on any mismatch or failed job."""

    backend: str
    path: str
    block_bytes: int
    blocks_stored: int
    blocks_loaded: int
    store_gbps: float
    load_gbps: float
    link_d2h_gbps: float
    link_h2d_gbps: float
    submit_us_per_job: float
    mismatched_blocks: int
    failed_jobs: int

    @property
    def ok(self) -> bool:
        """No mismatch and no failed job."""
        return self.mismatched_blocks == 0 and self.failed_jobs == 0


def measure_link(device: torch.device, nbytes: int = LINK_PROBE_BYTES) -> tuple[float, float]:
    """GB/s of one large pinned copy device->host and host->device (best of a few).

    On the host backend (``device`` is the CPU) it measures one large memcpy instead: the "link"
    there is host memory bandwidth.
    """
    if device.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        best = float("inf")
        for _ in range(LINK_PROBE_REPEATS):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return nbytes / best / _GB, nbytes / best / _GB
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = new_stream(device)
    results = []
    for dst, src in ((host, dev), (dev, host)):
        best = float("inf")
        for _ in range(LINK_PROBE_REPEATS):
            began, ended = new_event(timing=True), new_event(timing=True)
            with torch.cuda.stream(stream):
                began.record(stream)
                dst.copy_(src, non_blocking=True)
                ended.record(stream)
            ended.synchronize()
            best = min(best, began.elapsed_time(ended) / 1e3)
        results.append(nbytes / best / _GB)
    return results[0], results[1]


def _log(out: TextIO, quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=out, flush=True)


def _wait_all(worker: Worker, job_ids: Sequence[int]) -> list[TransferResult]:
    return worker.wait(job_ids, timeout=WAIT_TIMEOUT_S)


def run_demo(args: argparse.Namespace, progress: TextIO | None = None) -> DemoReport:
    """Run the demo described by parsed ``args``; progress goes to ``progress`` (stderr)."""
    progress = sys.stderr if progress is None else progress
    use_cuda = args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not use_cuda:
        print(
            "kvoffload demo: no CUDA device in use - running the host backend (CPU tensors, copies by "
            "memmove on a worker thread); figures are host memory speeds, not a host link",
            file=sys.stderr, flush=True,
        )
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    _log(progress, args.quiet, f"building a {args.layout} cache of {args.device_blocks} blocks on {device}")
    tensors, block_dim = build_cache(
        args.layout, num_blocks=args.device_blocks, layers=args.layers, kv_heads=args.kv_heads,
        head_dim=args.head_dim, block_size=args.block_size, dtype=dtype, device=device,
        seed=args.seed,
    )
    layout = DeviceLayout.from_tensors(tensors, block_dim=block_dim)
    probe = "pinned copy" if use_cuda else "memcpy"
    _log(progress, args.quiet, f"measuring the link limit (one {args.link_bytes >> 20} MiB {probe})")
    link_d2h, link_h2d = measure_link(device, args.link_bytes)
    per_job = args.blocks_per_job
    n_stored = min(args.host_blocks, args.device_blocks // 2) // per_job * per_job
    if n_stored == 0:
        raise SystemExit("demo: too few blocks for one job; raise --host-blocks/--device-blocks")
    perm = torch.randperm(args.device_blocks, generator=gen)
    src_dev = perm[:n_stored]
    dst_dev = perm[n_stored : 2 * n_stored]
    host = torch.randperm(args.host_blocks, generator=gen)[:n_stored]
    _log(progress, args.quiet, f"worker: {n_stored} blocks of {layout.block_bytes} bytes, "
         f"{layout.pages_per_block} pages each, jobs of {per_job} blocks")
    failed = 0
    with Worker.create(layout, args.host_blocks, backend="cuda" if use_cuda else "host",
                       path=args.path if use_cuda else "auto") as worker:
        path = worker.stats().path
        # Warm-up job: first-use costs (thread start, event creation) stay out of the figures.
        worker.store(-1, src_dev[:1].tolist(), host[:1].tolist())
        failed += sum(not r.ok for r in _wait_all(worker, [-1]))
        start, submit_s, ids = _run_jobs(worker, "store", src_dev, host, per_job, device)
        results = _wait_all(worker, ids)
        store_s = time.perf_counter() - start
        failed += sum(not r.ok for r in results)
        _log(progress, args.quiet, f"stored {n_stored} blocks; verifying host records")
        mismatched = _verify_records(worker, layout, src_dev, host)
        poison = torch.full((1, layout.record_bytes), POISON_BYTE, dtype=torch.uint8)
        layout.scatter_records(dst_dev, poison.expand(n_stored, -1))
        start, submit_load_s, ids = _run_jobs(
            worker, "load", host, dst_dev, per_job, device, first_id=len(ids)
        )
        results = _wait_all(worker, ids)
        load_s = time.perf_counter() - start
        failed += sum(not r.ok for r in results)
        _log(progress, args.quiet, f"loaded {n_stored} blocks; verifying device blocks")
        mismatched += _verify_reload(layout, src_dev, dst_dev)
    total = n_stored * layout.block_bytes
    jobs = 2 * (n_stored // per_job)
    return DemoReport(
        backend="cuda" if use_cuda else "host", path=path, block_bytes=layout.block_bytes,
        blocks_stored=n_stored, blocks_loaded=n_stored, store_gbps=total / store_s / _GB,
        load_gbps=total / load_s / _GB, link_d2h_gbps=link_d2h, link_h2d_gbps=link_h2d,
        submit_us_per_job=(submit_s + submit_load_s) / jobs * 1e6, mismatched_blocks=mismatched,
        failed_jobs=failed,
    )


def _run_jobs(
    worker: Worker, kind: str, src: torch.Tensor, dst: torch.Tensor, per_job: int,
    device: torch.device, first_id: int = 0,
) -> tuple[float, float, list[int]]:
    """Submit all jobs back to back; returns (start clock, host seconds spent submitting, ids).

    The clock starts after the device finished the set-up work, so only the jobs are timed.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    submit = 0.0
    ids = []
    for i, at in enumerate(range(0, src.shape[0], per_job)):
        job = first_id + i
        s = src[at : at + per_job].numpy()
        d = dst[at : at + per_job].numpy()
        t0 = time.perf_counter()
        if kind == "store":
            worker.store(job, s, d)
        else:
            worker.load(job, s, d)
        submit += time.perf_counter() - t0
        ids.append(job)
    return start, submit, ids


def _verify_records(worker: Worker, layout: DeviceLayout, dev: torch.Tensor, host: torch.Tensor) -> int:
    """Blocks whose host record differs from the torch gather of the device block."""
    records = worker.host_records()
    bad = 0
    for at in range(0, dev.shape[0], _VERIFY_CHUNK_BLOCKS):
        want = layout.gather_records(dev[at : at + _VERIFY_CHUNK_BLOCKS])
        got = records[host[at : at + _VERIFY_CHUNK_BLOCKS]].to(layout.device)
        bad += int((want != got).any(dim=1).sum())
    del records
    return bad


def _verify_reload(layout: DeviceLayout, src: torch.Tensor, dst: torch.Tensor) -> int:
    """Blocks whose reloaded copy differs from its original."""
    bad = 0
    for at in range(0, src.shape[0], _VERIFY_CHUNK_BLOCKS):
        a = layout.gather_records(src[at : at + _VERIFY_CHUNK_BLOCKS])
        b = layout.gather_records(dst[at : at + _VERIFY_CHUNK_BLOCKS])
        bad += int((a != b).any(dim=1).sum())
    return bad


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options (each value checked as it is parsed)."""
    gpu = torch.cuda.is_available()
    positive = int_in(1)
    parser.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    parser.add_argument("--path", choices=get_args(PathName), default="auto",
                        help="transfer path of the cuda backend")
    parser.add_argument("--layout", choices=LAYOUTS, default="per-layer")
    parser.add_argument("--layers", type=positive, default=32)
    parser.add_argument("--kv-heads", type=positive, default=8)
    parser.add_argument("--head-dim", type=positive, default=128)
    parser.add_argument("--block-size", type=positive, default=16)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--device-blocks", type=positive, default=4096 if gpu else 256,
                        help="blocks in the device cache (default 4096 with a GPU, 256 without)")
    parser.add_argument("--host-blocks", type=positive, default=2048 if gpu else 128,
                        help="records in the host pool (default 2048 with a GPU, 128 without)")
    parser.add_argument("--blocks-per-job", type=positive, default=256 if gpu else 32)
    parser.add_argument("--seed", type=int_in(*SEED_RANGE), default=0)
    parser.add_argument("--link-bytes", type=positive, default=LINK_PROBE_BYTES,
                        help="size of the copy that measures the link limit")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks across flags, run before anything is allocated (``parser.error`` on the first)."""
    use_cuda = check_backend(parser, args)
    if min(args.host_blocks, args.device_blocks // 2) < args.blocks_per_job:
        parser.error(f"too few blocks for one job: min(--host-blocks {args.host_blocks}, --device-blocks "
                     f"{args.device_blocks} / 2) < --blocks-per-job {args.blocks_per_job}; raise "
                     "--host-blocks/--device-blocks or lower --blocks-per-job")
    block = block_bytes(args.layout, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        block_size=args.block_size, dtype=DTYPES[args.dtype])
    cache, pool = args.device_blocks * block, args.host_blocks * block
    lower = "--host-blocks, --device-blocks, --link-bytes or the block's geometry"
    if use_cuda:
        check_memory(parser, pool + args.link_bytes, "the host pool and the link probe", lower)
        device = torch.device("cuda", torch.cuda.current_device())
        check_device_memory(parser, device, cache + args.link_bytes, "the device cache and the link probe",
                            lower)
    else:
        check_memory(parser, cache + pool + 2 * args.link_bytes,
                     "the cache, the host pool and the memcpy probe", lower)


def print_report(report: DemoReport, out: TextIO | None = None) -> None:
    """Print the demo's summary table to ``out`` (stdout)."""
    out = sys.stdout if out is None else out
    link = "pinned copy" if report.backend == "cuda" else "memcpy"
    rows = [
        ("link limit d2h", f"{report.link_d2h_gbps:7.1f} GB/s", f"one large {link}"),
        ("link limit h2d", f"{report.link_h2d_gbps:7.1f} GB/s", f"one large {link}"),
        ("store", f"{report.store_gbps:7.1f} GB/s",
         f"{report.store_gbps / report.link_d2h_gbps:5.2f} x link, path {report.path}"),
        ("load", f"{report.load_gbps:7.1f} GB/s",
         f"{report.load_gbps / report.link_h2d_gbps:5.2f} x link, path {report.path}"),
        ("submit", f"{report.submit_us_per_job:7.1f} us/job", "host time in store()/load()"),
        ("verified", f"{report.blocks_stored + report.blocks_loaded} blocks",
         f"{report.block_bytes} bytes each"),
        ("mismatched", f"{report.mismatched_blocks} blocks", f"failed jobs: {report.failed_jobs}"),
    ]
    print(f"kvoffload demo ({report.backend} backend)", file=out)
    for name, value, note in rows:
        print(f"  {name:<15} {value:>18}   {note}", file=out)
    print("  result          " + ("OK" if report.ok else "FAILED"), file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m kvoffload demo``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m kvoffload demo", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    report = run_demo(args)
    print_report(report)
    return 0 if report.ok else 1
