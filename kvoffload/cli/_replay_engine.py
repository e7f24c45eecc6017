"""The replay's engine: requests through the Manager's protocol and a Worker, a compute stream that
writes every computed block, loads and stores overlapping it, every loaded byte verified (see
:mod:`kvoffload.cli.replay`).
"""

from __future__ import annotations

import time
from typing import TextIO

import attrs
import torch

from kvoffload import (
    Direction,
    EventKind,
    LoadPlan,
    Manager,
    RemoteError,
    RemotePutPlan,
    StorePlan,
    Tier,
    TransferResult,
    Worker,
)
from kvoffload import DeviceLayout
from kvoffload.cli._replay_model import (
    PROGRESS_INTERVAL_S,
    PatternGenerator,
    ReplayConfig,
    WAIT_TIMEOUT_S,
    Workload,
    _DRAIN_BATCHES,
    _MAX_EXAMPLES,
)



#: What a load job's result may be: a load from host or disk, or the read of remote hits (a failed one).
_LOAD_DIRECTIONS = (Direction.LOAD, Direction.LOAD_FROM_DISK, Direction.GET_REMOTE)


# ------------------------------------------------------------------------------------------- engine


@attrs.define(eq=False)
class _Request:
    rid: int
    keys: tuple[bytes, ...]
    device_blocks: list[int]
    hits: int
    load_plan: LoadPlan | None = None
    loads_pending: int = 0
    #: Positions among the hits whose load failed: recomputed with the misses, never verified.
    failed: list[int] = attrs.field(factory=list)

    def computed_positions(self) -> list[int]:
        """The positions the compute stream writes: failed loads, then the misses (request order)."""
        return sorted(self.failed) + list(range(self.hits, len(self.keys)))


@attrs.define(eq=False)
class _LoadJob:
    request: _Request
    tier: Tier
    positions: list[int]


@attrs.define(eq=False)
class _FetchJob:
    """The remote read of a request's ``Tier.REMOTE`` hits into their host blocks; a load from those
    host blocks follows once it succeeded."""

    request: _Request
    positions: list[int]


@attrs.define(eq=False)
class _StoreJob:
    plan: StorePlan
    device_blocks: list[int]


@attrs.define(eq=False)
class _PutJob:
    """The write-through of a completed store's host copies to the remote store."""

    plan: RemotePutPlan


@attrs.define(eq=False)
class _DemoteJob:
    """The demotions of ``store.plan``; the store is submitted once they no longer read its host blocks."""

    store: _StoreJob


@attrs.define(eq=False)
class _TierLoads:
    """Load counters of one tier; ``busy_s`` is summed copy time (host), or the wall time with a load
    in flight (disk and remote: their jobs queue behind each other, so their own times would
    overlap; a remote hit is in flight from its read to the end of its load)."""

    jobs: int = 0
    hits: int = 0
    failed_jobs: int = 0
    failed_blocks: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    in_flight: int = 0
    busy_since: float = 0.0


class _Replay:
    """One run: the scheduler loop over a Manager and a Worker (both borrowed), counting as it goes."""

    def __init__(
        self, config: ReplayConfig, layout: DeviceLayout, manager: Manager, worker: Worker,
        compute: torch.cuda.Stream | None, progress: TextIO | None,
    ) -> None:
        self.c = config
        self.layout = layout
        self.manager = manager
        self.worker = worker
        self.compute = compute
        self.progress = progress
        self.patterns = PatternGenerator(layout)
        self.workload = Workload(config)
        self.free: list[int] = list(range(layout.num_blocks - 1, -1, -1))
        self.jobs: dict[int, _LoadJob | _FetchJob | _StoreJob | _DemoteJob | _PutJob] = {}
        self.ready: list[_Request] = []
        self.next_job = 0
        self.next_request: tuple[bytes, ...] | None = None
        self.checks: list[tuple[list[int], tuple[bytes, ...], torch.Tensor]] = []
        self.requests = 0
        self.lookup_blocks = 0
        tiers = [Tier.HOST] + ([Tier.DISK] if manager.num_disk_blocks else [])
        self.remote = config.remote is not None
        self.tiers = {tier: _TierLoads() for tier in tiers + ([Tier.REMOTE] if self.remote else [])}
        self.put_jobs = 0
        self.put_blocks = 0
        self.put_failed_blocks = 0
        self.put_refused_blocks = 0
        self.failed_puts = 0
        self.load_submitted = 0
        self.verified = 0
        self.corrupted = 0
        self.examples: list[str] = []
        self.computed = 0
        self.failed_load_blocks = 0
        self.failed_loads = 0
        self.failed_stores = 0
        self.store_failed_blocks = 0
        self.stores_skipped = 0
        self.load_jobs = 0
        self.store_jobs = 0
        self.blocks_loaded = 0
        self.blocks_stored = 0
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.store_busy_s = 0.0
        self.demote_jobs = 0
        self.demoted_blocks = 0
        self.bytes_demoted = 0
        self.demote_busy_s = 0.0
        self.demote_failed_blocks = 0
        self.failed_demotes = 0
        self.disk_io = ""
        self.compute_batches = 0
        self.overlapped_batches = 0
        self.events = {kind.value: 0 for kind in EventKind}
        self.errors: list[str] = []
        self.deadline = float("inf")

    # ------------------------------------------------------------------ main loop

    def run(self) -> float:
        """Run until the limits are reached and every job drained; return the wall seconds."""
        start = time.perf_counter()
        last_progress = start
        self.deadline = start + self.c.max_seconds if self.c.max_seconds else float("inf")
        while True:
            admitting = self._admitting()
            if not admitting and not self.jobs and not self.ready:
                break
            progressed = self._handle(self.worker.poll())
            settled = not self.c.settle or (not self.jobs and not self.ready)
            progressed |= admitting and settled and self._admit()
            progressed |= self._compute_ready()
            self._forward_events()
            if len(self.checks) >= _DRAIN_BATCHES:
                self._drain_checks()
            now = time.perf_counter()
            if now - last_progress >= PROGRESS_INTERVAL_S:
                last_progress = now
                self._drain_checks()
                self._report_progress()
            if not progressed and self.jobs:
                oldest = next(iter(self.jobs))
                self._handle(self.worker.wait([oldest], WAIT_TIMEOUT_S))
        self._forward_events()
        self._drain_checks()
        return time.perf_counter() - start

    def _report_progress(self) -> None:
        if self.progress is None:
            return
        looked = max(1, self.lookup_blocks)
        disk = self.tiers.get(Tier.DISK)
        from_disk = (f" ({100 * disk.hits / looked:.1f} % from disk), {self.demoted_blocks} demoted"
                     if disk is not None else "")
        remote = self.tiers.get(Tier.REMOTE)
        if remote is not None:
            from_disk += f", {100 * remote.hits / looked:.1f} % from the remote store, {self.put_blocks} put"
        print(f"replay: {self.requests} requests, {self.load_submitted} block loads "
              f"(target {self.c.blocks_to_load}), hit rate {100 * self.verified / looked:.1f} %{from_disk}, "
              f"{self.blocks_stored} stored, corrupted {self.corrupted}",
              file=self.progress, flush=True)

    def _job_id(self) -> int:
        self.next_job += 1
        return self.next_job

    # ------------------------------------------------------------------ admission and loads

    def _admitting(self) -> bool:
        """Whether no limit of the run (requests, block loads, time) was reached yet."""
        c = self.c
        return not (
            self.requests >= (c.requests or c.blocks_to_load)
            or (c.blocks_to_load and self.load_submitted >= c.blocks_to_load)
            or time.perf_counter() >= self.deadline
        )

    def _admit(self) -> bool:
        """Admit requests while device blocks and load slots last; submit their loads."""
        loading = len({id(j.request) for j in self.jobs.values() if isinstance(j, _LoadJob)})
        first = self.requests
        admitted: list[_Request] = []
        limit = 1 if self.c.settle else self.c.inflight_requests
        while loading + len(admitted) < limit and self._admitting():
            if self.next_request is None:
                self.next_request = self.workload.next_request()
            keys = self.next_request
            if len(keys) > len(self.free):
                break
            self.next_request = None
            self.requests += 1
            self.lookup_blocks += len(keys)
            hits = self.manager.lookup(keys)
            plan = self.manager.prepare_load(keys[:hits]) if hits else None
            if plan is not None:  # it stops short when no host block is left to read a remote hit
                hits = len(plan.keys)  # into: the rest are misses, computed like the others
            blocks = [self.free.pop() for _ in keys]
            request = _Request(self.requests, keys, blocks, hits)
            if hits:
                request.load_plan = plan
                admitted.append(request)
            else:
                self.ready.append(request)
            self.load_submitted += hits
        if not admitted:
            return self.requests > first
        # One batch of poison for every new load, queued before the loads (which wait for it).
        self.patterns.poison([b for r in admitted for b in r.device_blocks[: r.hits]])
        for request in admitted:
            plan = request.load_plan
            assert plan is not None
            by_tier: dict[Tier, list[int]] = {}
            for i, tier in enumerate(plan.tiers):
                by_tier.setdefault(tier, []).append(i)
            for tier, positions in by_tier.items():  # one job per tier: they come back separately
                job = self._job_id()
                source = [plan.blocks[i] for i in positions]
                target = [request.device_blocks[i] for i in positions]
                if tier is Tier.HOST:
                    self.worker.load(job, source, target, stream=self.compute)
                elif tier is Tier.DISK:
                    names = [self.manager.namespaced(request.keys[i]) for i in positions]
                    self.worker.load_from_disk(job, source, target, stream=self.compute, keys=names)
                else:  # read into host blocks first; the load follows in _fetch_done
                    names = [self.manager.namespaced(request.keys[i]) for i in positions]
                    self.worker.get_remote(job, names, source)
                self.jobs[job] = (_FetchJob(request, positions) if tier is Tier.REMOTE
                                  else _LoadJob(request, tier, positions))
                request.loads_pending += 1
                loads = self.tiers[tier]
                loads.jobs += 1
                if loads.in_flight == 0:
                    loads.busy_since = time.perf_counter()
                loads.in_flight += 1
                self.load_jobs += 1
        return True

    # ------------------------------------------------------------------ completions

    def _handle(self, results: list[TransferResult]) -> bool:
        """Apply finished jobs: loads are verified (or become misses), stores complete in the manager,
        finished demotions complete and release their plan's store."""
        verify_blocks: list[int] = []
        verify_keys: list[bytes] = []
        for result in results:
            job = self.jobs.pop(result.job_id)
            if isinstance(job, _StoreJob):
                self._store_done(job, result)
                continue
            if isinstance(job, _DemoteJob):
                self._demote_done(job, result)
                continue
            if isinstance(job, _PutJob):
                self._put_done(job, result)
                continue
            if isinstance(job, _FetchJob):
                if self._fetch_done(job, result):
                    continue
                job = _LoadJob(job.request, Tier.REMOTE, job.positions)  # failed: as a failed load
            request, plan = job.request, job.request.load_plan
            assert plan is not None and result.direction in _LOAD_DIRECTIONS
            keys = [request.keys[i] for i in job.positions]
            # A failed disk load drops that disk copy in the manager (the tier dropped the record).
            self.manager.complete_load(plan, keys, ok=result.ok)
            tier = self.tiers[job.tier]
            tier.in_flight -= 1
            if job.tier is Tier.HOST:
                tier.busy_s += result.seconds
            elif tier.in_flight == 0:  # disk, remote
                tier.busy_s += time.perf_counter() - tier.busy_since
            if result.ok:
                self.blocks_loaded += len(keys)
                self.bytes_loaded += result.nbytes
                tier.hits += len(keys)
                tier.bytes += result.nbytes
                verify_blocks.extend(request.device_blocks[i] for i in job.positions)
                verify_keys.extend(keys)
            else:
                self.failed_loads += 1
                self.failed_load_blocks += len(keys)
                tier.failed_jobs += 1
                tier.failed_blocks += len(keys)
                request.failed.extend(job.positions)  # misses: recomputed below, never verified
            request.loads_pending -= 1
            if request.loads_pending == 0:
                self.ready.append(request)
        if verify_blocks:
            # Runs on the compute stream after the loads completed: the prefill's read of the prefix.
            flags = self.patterns.mismatches(verify_blocks, verify_keys)
            self.checks.append((verify_blocks, tuple(verify_keys), flags))
            self.verified += len(verify_blocks)
        return bool(results)

    def _fetch_done(self, job: _FetchJob, result: TransferResult) -> bool:
        """A remote read finished: on success load its host blocks to the request's device blocks
        (True); a failed read is handled as a failed load of that tier (False)."""
        if not result.ok:
            return False
        plan = job.request.load_plan
        assert plan is not None
        load = self._job_id()
        self.worker.load(load, [plan.blocks[i] for i in job.positions],
                         [job.request.device_blocks[i] for i in job.positions], stream=self.compute)
        self.jobs[load] = _LoadJob(job.request, Tier.REMOTE, job.positions)
        return True

    def _put_done(self, job: _PutJob, result: TransferResult) -> None:
        self.manager.complete_remote_put(job.plan, result.ok)  # ok: never put again by this manager
        error = result.error
        failed = 0 if result.ok else len(error.keys) if isinstance(error, RemoteError) else len(job.plan.keys)
        self.put_blocks += len(job.plan.keys) - failed
        if isinstance(error, RemoteError) and set(error.kinds) == {"store_full"}:
            self.put_refused_blocks += failed  # the store's policy: those blocks are not shared
        elif failed:
            self.failed_puts += 1
            self.put_failed_blocks += failed

    def _store_done(self, job: _StoreJob, result: TransferResult) -> None:
        self.manager.complete_store(job.plan, result.ok)
        if self.remote and result.ok:  # write-through: the store's host copies to the remote store
            put = self.manager.prepare_remote_put(job.plan.keys)
            if put.keys:
                jid = self._job_id()
                self.worker.put_remote(jid, put.host_blocks, put.remote_keys)
                self.jobs[jid] = _PutJob(put)
                self.put_jobs += 1
        self.store_busy_s += result.seconds
        if result.ok:
            self.blocks_stored += len(job.plan.keys)
            self.bytes_stored += result.nbytes
        else:
            self.failed_stores += 1
            self.store_failed_blocks += len(job.plan.keys)
        self.free.extend(job.device_blocks)  # the store no longer reads them: safe to overwrite

    def _demote_done(self, job: _DemoteJob, result: TransferResult) -> None:
        plan = job.store.plan
        self.manager.complete_demote(plan, result.ok)  # failed: the disk copy is dropped, never loadable
        self.demote_busy_s += result.seconds
        if result.ok:
            self.demoted_blocks += len(plan.demotions)
            self.bytes_demoted += result.nbytes
            self.disk_io = result.path
        else:
            self.failed_demotes += 1
            self.demote_failed_blocks += len(plan.demotions)
        self._submit_store(job.store)  # its result came back: nothing reads those host blocks now

    # ------------------------------------------------------------------ compute and stores

    def _compute_ready(self) -> bool:
        """Compute every ready request's missing blocks in one batch, then submit their stores."""
        if not self.ready:
            return False
        batch, self.ready = self.ready, []
        blocks: list[int] = []
        keys: list[bytes] = []
        for request in batch:
            positions = request.computed_positions()
            blocks.extend(request.device_blocks[i] for i in positions)
            keys.extend(request.keys[i] for i in positions)
        if blocks:
            self.compute_batches += 1
            self.overlapped_batches += bool(self.jobs)
            if self.c.stall_cycles_per_block:
                torch.cuda._sleep(self.c.stall_cycles_per_block * len(blocks))  # type: ignore[no-untyped-call]
            self.patterns.write(blocks, keys)
            self.computed += len(blocks)
        for request in batch:
            self._store(request)
        return True

    def _store(self, request: _Request) -> None:
        """Offload the request's computed blocks (demotions first); free every device block no store
        reads."""
        computed = [request.keys[i] for i in request.computed_positions()]
        plan = self.manager.prepare_store(computed) if computed else None
        if computed and plan is None:
            self.stores_skipped += len(computed)
        if plan is None or not (plan.keys or plan.demotions):
            self.free.extend(request.device_blocks)
            return
        index = {key: i for i, key in enumerate(request.keys)}
        stored = [request.device_blocks[index[key]] for key in plan.keys]
        kept = set(stored)
        store = _StoreJob(plan, stored)
        if plan.demotions:
            self._demote_then_store(store)
        else:
            self._submit_store(store)
        self.free.extend(b for b in request.device_blocks if b not in kept)

    def _demote_then_store(self, store: _StoreJob) -> None:
        """Submit the plan's demotions; its store follows in :meth:`_demote_done` (it overwrites the
        host blocks the demotions read, so it may start only once their result came back)."""
        demotions = store.plan.demotions
        job = self._job_id()
        self.worker.demote(job, [d.host_block for d in demotions], [d.disk_block for d in demotions],
                           keys=[self.manager.namespaced(d.key) for d in demotions])
        self.jobs[job] = _DemoteJob(store)
        self.demote_jobs += 1

    def _submit_store(self, store: _StoreJob) -> None:
        if not store.plan.keys:
            return
        job = self._job_id()
        self.worker.store(job, store.device_blocks, store.plan.host_blocks, stream=self.compute)
        self.jobs[job] = store
        self.store_jobs += 1

    def _forward_events(self) -> None:
        for event in self.manager.events():
            self.events[event.kind.value] += 1

    # ------------------------------------------------------------------ verification results

    def _drain_checks(self) -> None:
        """Read the queued verification results back (syncs the compute stream up to them)."""
        if not self.checks:
            return
        checks, self.checks = self.checks, []
        flags = torch.cat([f for _, _, f in checks]).cpu().tolist()
        at = 0
        for blocks, keys, _ in checks:
            for block, key in zip(blocks, keys):
                if flags[at]:
                    self.corrupted += 1
                    if len(self.examples) < _MAX_EXAMPLES:
                        self.examples.append(f"key {key.hex()} in device block {block}")
                at += 1

    def abort(self, error: BaseException) -> None:
        """Record why the run stopped early; in-flight loads will never be verified."""
        self.errors.append(f"{type(error).__name__}: {error}")
        self._drain_checks()


def _unverified(replay: _Replay) -> int:
    """Blocks submitted for loading that were neither verified nor reported as a failed load."""
    return replay.load_submitted - replay.verified - replay.failed_load_blocks
