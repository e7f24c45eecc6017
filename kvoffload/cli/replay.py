"""``python -m kvoffload replay``: an engine-shaped workload through Manager + Worker, every load verified.

What it simulates. An inference engine with a paged device KV cache, a scheduler-side
:class:`~kvoffload.manager.Manager` over a pinned host pool and a :class:`~kvoffload.Worker` that moves
the bytes. Requests arrive one after another; each is a chain of KV blocks:

* a *system prompt* shared by every request (``--system-blocks``),
* a *document* drawn from a pool of ``--documents`` with a Zipf(``--zipf``) skew (document ``d`` has
  weight ``(d + 1) ** -s``), ``--doc-blocks-min`` .. ``--doc-blocks-max`` blocks long,
* a unique suffix of ``--suffix-blocks-min`` .. ``--suffix-blocks-max`` blocks (the user's turn);

or, with probability ``--continue-prob``, the next turn of an active conversation: its whole previous
chain plus a new unique suffix (multi-turn reuse), until it would exceed ``--max-request-blocks``. A
block's key is ``blake2b(parent key, position, content id)`` (16 bytes), so equal prefixes have equal
keys and a key names its whole prefix.

Each request follows the Manager's protocol: ``lookup`` gives the ready prefix; those blocks are hits:
``prepare_load``, the destination device blocks are poisoned on the compute stream, ``Worker.load``
(ordered after the compute stream), and on completion the blocks are verified and ``complete_load`` is
called (with a disk tier, per tier: see below). A failed load is a miss: its blocks are recomputed,
never counted or verified as hits (counting a failed load as loaded would serve another request's
KV). The misses are "computed": the compute stream writes every byte of each
block with the key's pattern; then ``prepare_store`` (None: the pool has no room now, the blocks are
not offloaded) and ``Worker.store`` ordered after those writes (``stream=`` the compute stream),
``complete_store(plan, ok)`` when its result arrives; evictions happen inside the manager. Device
blocks come from a free list (last freed, first reused, to stress recycling): a block is recycled only
after its store finished, and a loaded block is read only after its load finished. Up to
``--inflight-requests`` wait for loads at once; the loop submits and keeps going, polling the Worker
every step, so loads and stores overlap the compute of other requests. On the cuda backend the compute
stream is a real side stream and every kernel of the replay (poison, pattern, verification) runs on it;
on the host backend it is the program order of the main thread while the Worker copies on its threads.

Disk tier (``--disk-path``, ``--disk-blocks``). The manager gets a disk pool and the Worker a disk tier
(:class:`~kvoffload.disk.DiskConfig`; the file is created, or recreated empty, and left in place; with
``--disk-reuse`` it is opened warm and the manager adopts the records an earlier run of the same
layout demoted, which are then served and verified as disk hits: a restart that keeps its cache).
Each record is written under its key's name (``Manager.namespaced``) and every disk load checks it.
Host eviction then demotes to disk as the manager's sequence says: each ``StorePlan.demotions`` is one
``Worker.demote`` job, and the store into those host blocks is submitted only once the demotion's
result came back (it read them), after ``complete_demote(plan, ok)``; a failed demotion is never
loadable from disk. Meanwhile the loop goes on, so demotions overlap compute as well. A request's hits
are loaded per tier: one ``Worker.load`` job for its host hits and one ``Worker.load_from_disk`` job
for its disk hits (``LoadPlan.tiers``), each completed in the manager (``complete_load`` of its keys)
when its result arrives. Blocks of a job that succeeded are verified as hits of that tier; blocks of a
failed job (an I/O error, a record failing its checksum) are recomputed misses, whichever tier; the
job is completed in the manager with ``ok=False``, which drops the keys' disk copies, so a record
that failed its check is never offered again.

Verification. A key's pattern fills the whole record: with ``lo``, ``hi`` the 32-bit halves of the
key's 64-bit seed (a blake2b digest of the key), 32-bit word ``j`` of the record is
``(t_j * (hi | 1) + lo) mod 2**32``, where the ``t_j`` are distinct odd constants, computed with torch
integer ops on the layout's device. For a fixed ``j`` the word is injective in ``lo`` (and in ``hi``
but for its lowest bit), so a block of another key, a stale block or a torn one differs in almost every
word; within one record distinct ``t_j`` times an odd number give distinct words, so a page copied to
the wrong offset is caught too, and so is a single flipped byte. Every loaded block is compared byte
for byte (padding excluded) with the pattern regenerated on the same device, on the compute stream,
after its load completed; mismatches are counted as corrupted blocks. A block whose load was submitted
but that was neither verified nor reported failed (the run aborted) is counted as unverified. Loads
write into blocks poisoned first, so a load that copies nothing is caught as well. The exit status is
0 only with no corrupted block, no unverified block, no failed job (load from either tier, store or
demotion: each was handled safely, but none should fail on healthy hardware) and a clean shutdown.

Remote tier (``--remote mooncake|redis``): two engine instances share hits through the store
(:mod:`kvoffload.cli._replay_remote`). Each completed store is written through
(``Manager.prepare_remote_put``, ``Worker.put_remote``); a lookup past the local tiers asks the store,
and its hits (``LoadPlan.tiers`` ``REMOTE``) are read into host blocks (``Worker.get_remote``), then
loaded and verified like every hit; a failed read is a miss, recomputed. Instance A (this process)
runs the workload; instance B (another process, the same workload, an empty host pool) then finds
A's blocks in the store.

Prefill model (an estimate, stated): a verified hit saves recomputing its tokens. With ``T`` hit
tokens (verified hit blocks x block size), a prefill rate ``R`` (``--prefill-tokens-per-s``, tokens per
second of the model whose KV geometry is simulated) and ``L`` the load time (the summed copy time of
the host loads, plus the wall time during which disk loads were in flight: the disk pipeline runs its
jobs one after another, so their own times would count the queueing), the saving is ``T / R - L``. It
assumes every load is on the critical path (none hidden behind compute) and a rate that does not
fall with context length; both make it conservative. ``R`` must be the rate of a model with the
simulated geometry: with fewer layers than the real model (the small default), the loads move fewer
bytes per token than the real model's would, and ``L`` is too small in proportion.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, TextIO, get_args

import attrs
import torch

from kvoffload import (
    POLICY_NAMES,
    Direction,
    DiskConfig,
    DiskError,
    DiskStats,
    InvalidArgumentError,
    KVOffloadError,
    Manager,
    MooncakeConfig,
    PathName,
    RedisClusterConfig,
    RemoteConfig,
    RemoteTierStats,
    Worker,
    open_remote_index,
)
from kvoffload import DeviceLayout
from kvoffload.cli._args import (
    GIB,
    check_backend,
    check_device_memory,
    check_memory,
    finite_float,
    host_port,
    host_ports,
    int_in,
    writable_file,
)
from kvoffload.cli._caches import LAYOUTS, block_bytes, build_cache
from kvoffload.cli._torch import new_stream
from kvoffload.cli._replay_model import (
    DISK_DIRECT,
    DISK_FAILURE_COUNTERS,
    DTYPES,
    EXIT_FAILED,
    EXIT_OK,
    REMOTES,
    ReplayConfig,
    ReplayReport,
    _GB,
)

from kvoffload.cli._replay_engine import _Replay, _unverified
from kvoffload.cli._replay_remote import two_instances

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "ReplayConfig",
    "ReplayReport",
    "add_arguments",
    "config_from_args",
    "main",
    "print_report",
    "run_replay",
]

#: The most ``torch.cuda._sleep`` cycles per computed block (minutes of stall: more is a typo).
MAX_STALL_CYCLES_PER_BLOCK: Final = 10**12

def run_replay(
    config: ReplayConfig, progress: TextIO | None = None, *,
    backend_factory: Callable[[Direction], Any] | None = None,
) -> ReplayReport:
    """Run the replay described by ``config``; progress lines go to ``progress`` (None: silent).
    ``backend_factory`` is passed to ``Worker.create`` (fault injection in tests).

    Raises:
        InvalidArgumentError: a bad configuration (see :meth:`ReplayConfig.check`), or ``backend``
            "cuda" without a CUDA device.
        DiskError: the disk tier could not be created (e.g. ``disk_path`` exists and is not a
            kvoffload tier file, the file system refuses O_DIRECT with ``disk_direct="on"``, no room).
    """
    config.check()
    use_cuda = config.backend == "cuda" or (config.backend == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise InvalidArgumentError("backend = 'cuda' but torch sees no CUDA device")
    if not use_cuda and config.path != "auto":
        raise InvalidArgumentError(f"path = {config.path!r} applies to the cuda backend only")
    if not use_cuda and config.stall_cycles_per_block:
        raise InvalidArgumentError("stall_cycles_per_block applies to the cuda backend only")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    tensors, block_dim = build_cache(
        config.layout, num_blocks=config.device_blocks, layers=config.layers, kv_heads=config.kv_heads,
        head_dim=config.head_dim, block_size=config.block_size, dtype=DTYPES[config.dtype],
        device=device, fill=False,  # the replay writes every block before it reads it
    )
    layout = DeviceLayout.from_tensors(tensors, block_dim=block_dim)
    disk = (None if config.disk_path is None else
            DiskConfig(config.disk_path, config.disk_blocks, direct=DISK_DIRECT[config.disk_direct],
                       reuse=config.disk_reuse))
    remote = remote_config(config)
    index = open_remote_index(remote, fingerprint=layout.fingerprint) if remote is not None else None
    manager = Manager.create(config.host_blocks, fingerprint=layout.fingerprint, policy=config.policy,
                             num_disk_blocks=config.disk_blocks if disk is not None else 0, remote=index)
    if progress is not None:
        disk_pool = (f", disk pool {config.disk_blocks} blocks "
                     f"({config.disk_blocks * layout.record_bytes / _GB:.2f} GB) in {config.disk_path}"
                     if disk is not None else "")
        print(f"replay: {config.layout} cache of {config.device_blocks} blocks on {device}, "
              f"{layout.block_bytes} bytes a block, host pool {config.host_blocks} blocks "
              f"({config.host_blocks * layout.record_bytes / _GB:.2f} GB){disk_pool}, "
              f"policy {config.policy}", file=progress, flush=True)
    compute = new_stream(device) if use_cuda else None
    wall = 0.0
    shutdown_errors: list[str] = []
    try:
        worker = Worker.create(layout, config.host_blocks, backend="cuda" if use_cuda else "host",
                               path=config.path, disk=disk, remote=remote, backend_factory=backend_factory)
    except BaseException:
        if index is not None:
            index.close()
        raise
    try:
        adopted = len(manager.adopt_disk(worker.disk_valid_blocks().values())) if config.disk_reuse else 0
        replay = _Replay(config, layout, manager, worker, compute, progress)
        path = worker.stats().path
        if use_cuda:
            torch.cuda.synchronize(device)  # the cache and pattern tables were made on the default stream
        with contextlib.ExitStack() as scope:
            if compute is not None:  # every kernel of the replay runs on the compute stream
                scope.enter_context(torch.cuda.stream(compute))
            try:
                wall = replay.run()
            except KVOffloadError as exc:  # a wait timeout, or a refused job (a replay bug)
                replay.abort(exc)
    finally:
        try:
            worker.shutdown()
        except KVOffloadError as exc:
            shutdown_errors.append(f"shutdown: {type(exc).__name__}: {exc}")
        if index is not None:
            try:
                index.close()
            except KVOffloadError as exc:
                shutdown_errors.append(f"remote index: {type(exc).__name__}: {exc}")
    replay.errors.extend(shutdown_errors)
    if use_cuda:
        torch.cuda.synchronize(device)
    return _report(config, replay, layout, device, path, wall, worker.disk_stats(), worker.remote_stats(),
                   adopted=adopted)


def remote_config(config: ReplayConfig) -> RemoteConfig | None:
    """The remote tier of ``config`` (None without one): its store at ``config.remote_address``."""
    if config.remote is None:
        return None
    if config.remote == "mooncake":
        return RemoteConfig(store=MooncakeConfig(master_address=config.remote_address))
    nodes = tuple((host, int(port)) for host, port in (n.rsplit(":", 1) for n in config.remote_address.split(",")))
    return RemoteConfig(store=RedisClusterConfig(nodes=nodes))


def _report(
    config: ReplayConfig, r: _Replay, layout: DeviceLayout, device: torch.device, path: str, wall: float,
    disk: DiskStats | None, remote: RemoteTierStats | None = None, *, adopted: int = 0,
) -> ReplayReport:
    stats = r.manager.stats()
    hit_tokens = r.verified * config.block_size
    recompute_s = hit_tokens / config.prefill_tokens_per_s
    looked = max(1, r.lookup_blocks)
    tiers = {tier.value: loads for tier, loads in r.tiers.items()}
    load_busy_s = sum(t.busy_s for t in tiers.values())
    return ReplayReport(
        backend="cuda" if device.type == "cuda" else "host", path=path, policy=config.policy,
        device=str(device), record_bytes=layout.record_bytes, block_bytes=layout.block_bytes,
        block_tokens=config.block_size, device_blocks=config.device_blocks, host_blocks=config.host_blocks,
        requests=r.requests, continued_requests=r.workload.continued, lookup_blocks=r.lookup_blocks,
        hit_blocks=r.verified, hits_by_tier={name: t.hits for name, t in tiers.items()},
        hit_rate_by_tier={name: t.hits / looked for name, t in tiers.items()},
        load_jobs_by_tier={name: t.jobs for name, t in tiers.items()},
        failed_load_jobs_by_tier={name: t.failed_jobs for name, t in tiers.items()},
        failed_load_blocks_by_tier={name: t.failed_blocks for name, t in tiers.items()},
        bytes_loaded_by_tier={name: t.bytes for name, t in tiers.items()},
        load_gbps_by_tier={name: t.bytes / t.busy_s / _GB if t.busy_s > 0 else 0.0
                           for name, t in tiers.items()},
        hit_rate=r.verified / looked,
        manager_hit_rate=stats.hit_rate, computed_blocks=r.computed, failed_load_blocks=r.failed_load_blocks,
        load_jobs=r.load_jobs, store_jobs=r.store_jobs, blocks_loaded=r.blocks_loaded,
        blocks_stored=r.blocks_stored, store_failed_blocks=r.store_failed_blocks,
        stores_skipped_blocks=r.stores_skipped, host_evictions=stats.host_evictions,
        bytes_loaded=r.bytes_loaded, bytes_stored=r.bytes_stored,
        load_gbps=r.bytes_loaded / load_busy_s / _GB if load_busy_s > 0 else 0.0,
        store_gbps=r.bytes_stored / r.store_busy_s / _GB if r.store_busy_s > 0 else 0.0,
        load_wall_gbps=r.bytes_loaded / wall / _GB if wall > 0 else 0.0,
        store_wall_gbps=r.bytes_stored / wall / _GB if wall > 0 else 0.0,
        wall_s=wall, load_busy_s=load_busy_s, store_busy_s=r.store_busy_s,
        overlap_fraction=r.overlapped_batches / r.compute_batches if r.compute_batches else 0.0,
        prefill_tokens_per_s=config.prefill_tokens_per_s, hit_tokens=hit_tokens, recompute_s=recompute_s,
        prefill_saved_s=recompute_s - load_busy_s, verified_blocks=r.verified,
        corrupted_blocks=r.corrupted, unverified_blocks=_unverified(r), failed_load_jobs=r.failed_loads,
        failed_store_jobs=r.failed_stores,
        disk_path=config.disk_path or "", disk_blocks=config.disk_blocks if disk is not None else 0,
        disk_reuse=config.disk_reuse, disk_adopted_blocks=adopted,
        disk_io=r.disk_io, disk_evictions=stats.disk_evictions, demote_jobs=r.demote_jobs,
        demoted_blocks=r.demoted_blocks, bytes_demoted=r.bytes_demoted, demote_busy_s=r.demote_busy_s,
        demote_failed_blocks=r.demote_failed_blocks, failed_demote_jobs=r.failed_demotes,
        disk_bytes_written=disk.bytes_written if disk is not None else 0,
        disk_bytes_read=disk.bytes_read if disk is not None else 0,
        disk_write_gbps=disk.write_gbps if disk is not None else 0.0,
        disk_read_gbps=disk.read_gbps if disk is not None else 0.0,
        disk_failures={name: int(getattr(disk, name)) for name in DISK_FAILURE_COUNTERS}
        if disk is not None else {},
        remote=config.remote or "", remote_put_jobs=r.put_jobs, remote_put_blocks=r.put_blocks,
        remote_put_failed_blocks=r.put_failed_blocks, failed_remote_put_jobs=r.failed_puts,
        remote_put_refused_blocks=r.put_refused_blocks,
        remote_lookup_errors=stats.remote_lookup_errors,
        remote_failures={k: n for k, n in remote.failures.items() if n} if remote is not None else {},
        events=dict(r.events), target_blocks=config.blocks_to_load,
        target_reached=r.load_submitted >= config.blocks_to_load,
        corrupted_examples=tuple(r.examples), errors=tuple(r.errors),
    )


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replay's command-line options (defaults: the GPU's sizes with a GPU, small ones without)."""
    gpu = torch.cuda.is_available()
    d = ReplayConfig()
    positive, natural = int_in(1), int_in(0)
    parser.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto")
    parser.add_argument("--path", choices=get_args(PathName), default="auto",
                        help="transfer path of the cuda backend")
    geometry = parser.add_argument_group("KV cache geometry")
    geometry.add_argument("--layout", choices=LAYOUTS, default=d.layout)
    geometry.add_argument("--layers", type=positive, default=d.layers)
    geometry.add_argument("--kv-heads", type=positive, default=d.kv_heads)
    geometry.add_argument("--head-dim", type=positive, default=d.head_dim)
    geometry.add_argument("--block-size", type=positive, default=d.block_size, help="tokens per block")
    geometry.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype)
    geometry.add_argument("--device-blocks", type=positive, default=8192 if gpu else d.device_blocks,
                          help=f"blocks in the device cache (default 8192 with a GPU, {d.device_blocks} without)")
    geometry.add_argument("--host-blocks", type=positive, default=16384 if gpu else d.host_blocks,
                          help=f"records in the host pool (default 16384 with a GPU, {d.host_blocks} without)")
    geometry.add_argument("--policy", choices=sorted(POLICY_NAMES), default=d.policy,
                          help="host pool eviction policy")
    size = parser.add_argument_group("run length (the first limit reached ends admission)")
    size.add_argument("--requests", type=natural, default=d.requests, help="requests to run (0: no limit)")
    size.add_argument("--blocks-to-load", type=natural, default=100_000 if gpu else d.blocks_to_load,
                      help="stop admitting once this many block loads were submitted (0: no target; "
                           f"default 100000 with a GPU, {d.blocks_to_load} without)")
    size.add_argument("--max-seconds", type=finite_float(0), default=d.max_seconds, help="time limit (0: none)")
    work = parser.add_argument_group("workload")
    work.add_argument("--documents", type=positive, default=1000 if gpu else d.documents,
                      help="shared prefix documents")
    work.add_argument("--zipf", type=finite_float(0), default=d.zipf, help="skew s of document popularity (0: uniform)")
    work.add_argument("--system-blocks", type=natural, default=d.system_blocks,
                      help="system-prompt blocks shared by every request")
    work.add_argument("--doc-blocks-min", type=positive, default=d.doc_blocks_min)
    work.add_argument("--doc-blocks-max", type=positive, default=d.doc_blocks_max)
    work.add_argument("--suffix-blocks-min", type=positive, default=d.suffix_blocks_min,
                      help="unique blocks a turn adds")
    work.add_argument("--suffix-blocks-max", type=positive, default=d.suffix_blocks_max)
    work.add_argument("--continue-prob", type=finite_float(0, 1), default=d.continue_prob,
                      help="probability that a request continues an active conversation")
    work.add_argument("--max-conversations", type=positive, default=d.max_conversations,
                      help="active conversations remembered (oldest dropped)")
    work.add_argument("--max-request-blocks", type=positive, default=d.max_request_blocks,
                      help="longest request chain; a conversation that would exceed it ends")
    work.add_argument("--inflight-requests", type=positive, default=d.inflight_requests,
                      help="requests waiting for their loads at once")
    work.add_argument("--settle", action="store_true",
                      help="one request at a time, each finished before the next: reproducible "
                           "hit rates (not representative throughput)")
    work.add_argument("--prefill-tokens-per-s", type=finite_float(0, low_open=True), default=d.prefill_tokens_per_s,
                      help="prefill rate of the simulated model, for the time-saved estimate")
    work.add_argument("--stall-cycles-per-block", type=int_in(0, MAX_STALL_CYCLES_PER_BLOCK), default=d.stall_cycles_per_block,
                      help="cuda only: torch.cuda._sleep cycles per computed block, queued on the "
                           "compute stream before each compute batch (heavier compute)")
    tier = parser.add_argument_group("disk tier (below the host pool; none without --disk-path)")
    tier.add_argument("--disk-path", metavar="PATH", default=d.disk_path,
                      help="the tier file (its directory must exist); created, or recreated empty (but "
                           "with --disk-reuse), and left in place")
    tier.add_argument("--disk-blocks", type=natural, default=d.disk_blocks,
                      help="records in the disk pool (required with --disk-path)")
    tier.add_argument("--disk-direct", choices=tuple(DISK_DIRECT), default=d.disk_direct,
                      help="O_DIRECT: on (or fail), off (buffered), auto (where the file system takes it)")
    tier.add_argument("--disk-reuse", action="store_true", default=d.disk_reuse,
                      help="open the tier file warm: adopt the records an earlier run of the same layout "
                           "demoted (a restart that keeps its disk cache) and verify them as disk hits")
    remote = parser.add_argument_group("remote tier: two engine instances sharing hits (none without --remote)")
    remote.add_argument("--remote", choices=REMOTES, default=None,
                        help="write every store through to this store; then run a second instance (another "
                             "process, same workload, empty host pool) that loads from it")
    remote.add_argument("--remote-address", default="", metavar="ADDRESS",
                        help="use this running store (mooncake: master HOST:PORT; redis: HOST:PORT,...) "
                             "instead of starting one on this machine")
    remote.add_argument("--remote-mib", type=positive, default=2048,
                        help="memory the store started here holds, MiB (a full store evicts; default 2048)")
    remote.add_argument("--instance-only", action="store_true",
                        help="run one instance against --remote-address (what the second instance runs)")
    parser.add_argument("--seed", type=natural, default=d.seed)
    parser.add_argument("--json", metavar="PATH", type=writable_file, default=None, help="also write the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks across flags that :meth:`ReplayConfig.check` leaves to the command line (the
    backend this machine has, the store's address, the memory the run needs), then the notice of
    the host backend; ``parser.error`` on the first that fails."""
    use_cuda = check_backend(parser, args)
    if not use_cuda and args.stall_cycles_per_block:
        parser.error(f"argument --stall-cycles-per-block: {args.stall_cycles_per_block} applies to the cuda "
                     "backend only (this run uses the host backend)")
    if args.remote is not None and args.remote_address:
        try:
            (host_port if args.remote == "mooncake" else host_ports)(args.remote_address)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"argument --remote-address: {exc}")
    block = block_bytes(args.layout, layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        block_size=args.block_size, dtype=DTYPES[args.dtype])
    lower = "--host-blocks, --device-blocks or the block's geometry"
    if use_cuda:
        check_memory(parser, args.host_blocks * block, "the host pool", lower)
        check_device_memory(parser, torch.device("cuda", torch.cuda.current_device()),
                            args.device_blocks * block, "the device cache", lower)
    else:
        check_memory(parser, (args.host_blocks + args.device_blocks) * block, "the cache and the host pool",
                     lower)
    if args.disk_path is not None:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(args.disk_path))).free
        with contextlib.suppress(OSError):  # a tier file there is sized again: its space comes back
            if os.path.isfile(args.disk_path):  # what it holds, not its length (it may be sparse)
                free += os.stat(args.disk_path).st_blocks * 512
        if args.disk_blocks * block > free:
            parser.error(f"argument --disk-blocks: {args.disk_blocks} blocks need {args.disk_blocks * block / GIB:.2f} "
                         f"GiB, the file system of --disk-path has {free / GIB:.2f} GiB free")
    if not use_cuda:
        print("kvoffload replay: no CUDA device in use - running the host backend (CPU tensors, copies "
              "by memmove on worker threads, compute in program order); figures are host memory speeds",
              flush=True)


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    """The :class:`ReplayConfig` of parsed arguments (not checked yet)."""
    names = [f.name for f in attrs.fields(ReplayConfig)]
    return ReplayConfig(**{name: getattr(args, name) for name in names})


def print_report(report: ReplayReport, out: TextIO | None = None) -> None:
    """Print the replay's summary to ``out`` (stdout)."""
    out = sys.stdout if out is None else out
    looked = max(1, report.lookup_blocks)

    def row(name: str, value: str, note: str = "") -> None:
        print(f"  {name:<22} {value:>16}   {note}".rstrip(), file=out)

    print(f"kvoffload replay ({report.backend} backend, path {report.path}, policy {report.policy}, "
          f"{report.device})", file=out)
    row("requests", f"{report.requests}", f"{report.continued_requests} continued a conversation")
    row("blocks looked up", f"{report.lookup_blocks}",
        f"{report.block_tokens} tokens, {report.block_bytes} bytes a block")
    print(f"  {'tier':<22} {'hit blocks':>16}   hit rate   loads", file=out)
    for tier, count in report.hits_by_tier.items():
        print(f"  {'  ' + tier:<22} {count:>16}   {100 * count / looked:5.1f} %   "
              f"{report.load_jobs_by_tier[tier]} jobs, {report.bytes_loaded_by_tier[tier] / _GB:.3f} GB, "
              f"{report.load_gbps_by_tier[tier]:.2f} GB/s; failed {report.failed_load_jobs_by_tier[tier]} "
              f"jobs, {report.failed_load_blocks_by_tier[tier]} blocks", file=out)
    print(f"  {'  all tiers':<22} {report.hit_blocks:>16}   {100 * report.hit_rate:5.1f} %   "
          f"(manager lookups: {100 * report.manager_hit_rate:.1f} %)", file=out)
    row("failed loads", f"{report.failed_load_blocks} blocks", "recomputed as misses")
    row("computed", f"{report.computed_blocks} blocks", "misses written by the compute stream")
    row("block loads", f"{report.blocks_loaded}", f"{report.load_jobs} jobs")
    row("block stores", f"{report.blocks_stored}",
        f"{report.store_jobs} jobs; {report.stores_skipped_blocks} blocks not offloaded (pool busy)")
    row("host evictions", f"{report.host_evictions}")
    if report.disk_blocks:
        disk_failed = {name: n for name, n in report.disk_failures.items() if n}
        row("disk tier", f"{report.disk_blocks} blocks", f"{report.disk_path} ({report.disk_io or 'no I/O'})"
            + (f"; opened warm, {report.disk_adopted_blocks} records adopted" if report.disk_reuse else ""))
        row("demotions", f"{report.demoted_blocks} blocks",
            f"{report.demote_jobs} jobs, {report.bytes_demoted / _GB:.3f} GB; failed "
            f"{report.failed_demote_jobs} jobs, {report.demote_failed_blocks} blocks")
        row("disk evictions", f"{report.disk_evictions}")
        row("disk bytes", f"{(report.disk_bytes_written + report.disk_bytes_read) / _GB:.3f} GB",
            f"written {report.disk_bytes_written / _GB:.3f} at {report.disk_write_gbps:.2f} GB/s, read "
            f"{report.disk_bytes_read / _GB:.3f} at {report.disk_read_gbps:.2f} GB/s (the tier's counters)")
        row("disk failures", f"{sum(disk_failed.values())}",
            ", ".join(f"{name} {n}" for name, n in disk_failed.items()) or "none")
    if report.remote:
        row("remote puts", f"{report.remote_put_blocks} blocks",
            f"{report.remote_put_jobs} jobs written through to {report.remote}; refused (store full) "
            f"{report.remote_put_refused_blocks} blocks; failed {report.failed_remote_put_jobs} jobs, "
            f"{report.remote_put_failed_blocks} blocks; {report.remote_lookup_errors} lookups failed (misses)")
        row("remote failures", f"{sum(report.remote_failures.values())}",
            ", ".join(f"{name} {n}" for name, n in report.remote_failures.items()) or "none")
    row("bytes moved", f"{(report.bytes_loaded + report.bytes_stored) / _GB:.3f} GB",
        f"loaded {report.bytes_loaded / _GB:.3f}, stored {report.bytes_stored / _GB:.3f}")
    row("load", f"{report.load_gbps:7.2f} GB/s", f"copy time; {report.load_wall_gbps:.2f} GB/s over the run")
    row("store", f"{report.store_gbps:7.2f} GB/s", f"copy time; {report.store_wall_gbps:.2f} GB/s over the run")
    row("overlap", f"{100 * report.overlap_fraction:5.1f} %", "compute batches issued with copies in flight")
    row("prefill saved", f"{report.prefill_saved_s:.3f} s",
        f"{report.hit_tokens} hit tokens / {report.prefill_tokens_per_s:g} tok/s "
        f"- {report.load_busy_s:.3f} s of loads")
    row("wall", f"{report.wall_s:.2f} s")
    row("verified", f"{report.verified_blocks} blocks", "every loaded byte against its key's pattern")
    row("corrupted", f"{report.corrupted_blocks} blocks", f"unverified: {report.unverified_blocks}")
    failed = report.failed_load_jobs + report.failed_store_jobs + report.failed_demote_jobs
    row("failed jobs", f"{failed + report.failed_remote_put_jobs}",
        f"{report.failed_load_jobs} load, {report.failed_store_jobs} store"
        + (f", {report.failed_demote_jobs} demote" if report.disk_blocks else "")
        + (f", {report.failed_remote_put_jobs} remote put" if report.remote else ""))
    for example in report.corrupted_examples:
        row("  corrupted", example)
    if report.target_blocks and not report.target_reached:
        row("target", "NOT reached", f"{report.blocks_loaded} of {report.target_blocks} block loads")
    failures = report.failures()
    print("  result                 " + ("OK" if not failures else "FAILED: " + "; ".join(failures)),
          file=out, flush=True)


def main(
    argv: Sequence[str] | None = None, *, backend_factory: Callable[[Direction], Any] | None = None
) -> int:
    """Entry point of ``python -m kvoffload replay``; returns the exit status (0: all verified)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload replay", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_list)
    config = config_from_args(args)
    two = config.remote is not None and not args.instance_only
    try:  # the address of a store started below is not known yet
        (attrs.evolve(config, remote_address=config.remote_address or "-") if two else config).check()
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    if args.instance_only and config.remote is None:
        parser.error("--instance-only needs --remote and --remote-address")
    check_arguments(parser, args)
    if two:
        return two_instances(args, args_list, config, lambda c, progress: run_replay(
            c, progress, backend_factory=backend_factory), print_report)
    try:
        report = run_replay(config, progress=None if args.quiet else sys.stderr,
                            backend_factory=backend_factory)
    except DiskError as exc:  # the tier file could not be created or opened: nothing ran
        print(f"kvoffload replay: the disk tier could not be created: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except KVOffloadError as exc:  # set-up failed (e.g. the remote store is unreachable): nothing ran
        print(f"kvoffload replay: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": attrs.asdict(config), "report": report.to_json()}, f, indent=2,
                      sort_keys=True)
            f.write("\n")
    return EXIT_OK if report.ok else EXIT_FAILED
