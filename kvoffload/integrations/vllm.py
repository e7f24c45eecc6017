"""kvoffload as vLLM's offloading spec: ``KVOffloadSpec`` for vLLM's ``OffloadingConnector``.

vLLM loads the spec from ``kv_connector_extra_config`` (``"spec_name": "KVOffloadSpec"``,
``"spec_module_path": "kvoffload.integrations.vllm"``) in its scheduler process and in every worker
process; see the README's "Use with vLLM" section for the exact ``--kv-transfer-config``. Importing
this module with a vLLM version other than :data:`SUPPORTED_VLLM_VERSIONS` raises
:class:`UnsupportedVLLMVersionError`: vLLM marks the spec interface experimental.

Scheduler side, :class:`KVOffloadManager` maps vLLM's manager calls onto a :class:`kvoffload.Manager`
whose host blocks are vLLM's chunks (one ``OffloadKey`` each):

- ``lookup(key)``: HIT when the key is ready, HIT_PENDING while its store is in flight, else MISS
  (never RETRY: every answer is known at once);
- ``prepare_store(keys)`` / ``complete_store(keys, success)``: one kvoffload plan per call; a
  completion names keys only, so the adapter keeps the plan of every pending key and completes each
  plan for the keys given. A failed store (``success=False``) frees its chunks and never makes its
  keys loadable;
- ``prepare_load(keys)`` / ``complete_load(keys)``: loads of one key may overlap; each completion
  drops the oldest outstanding load of each key;
- ``reset_cache()`` clears every key at once; chunks that jobs of earlier plans may still copy into
  or out of stay fenced (never handed to a new store) until vLLM calls ``on_reset_flushed()``, which
  settles those plans (vLLM drops their completions);
- ``take_events()``: kvoffload's events batched by kind into vLLM's ``OffloadingEvent`` (CPU medium):
  stored, removed (evicted or reset), and failed stores as removed with ``metadata_only``;
- ``get_stats()``: host usage gauges and counters of evictions, failed stores and settled plans
  (declared by :meth:`KVOffloadSpec.build_metric_definitions`).

Worker side, :class:`KVOffloadWorker` runs a :class:`kvoffload.Worker` over a
:class:`kvoffload.DeviceLayout` built from vLLM's ``CanonicalKVCaches`` (one int8 ``(num_blocks,
page)`` view per KV tensor; aliased layers share a tensor, so their pages are copied once). A chunk of
``blocks_per_chunk`` GPU blocks is ``blocks_per_chunk`` consecutive host records, and transfers that
start inside a chunk (vLLM's ``block_indices``) skip its leading records. Expedited loads share the
load direction's queue.

Failed jobs: vLLM 0.33's connector asserts that every submit and every job succeeds. The adapter
resubmits a failed store or load up to ``transfer_retries`` times (a store's GPU blocks and a load's
host chunk stay untouched until the job is reported, so the retry copies the same bytes). When every
attempt failed it raises :class:`VLLMTransferError` from ``get_finished`` or ``wait``: the engine
stops with a message naming the job, the blocks and kvoffload's error, instead of an assertion deep
in vLLM. A failed store is never reported as done, so its keys never become loadable; a failed load
never lets its request run on undefined KV. ``wait`` gets a deadline (``wait_timeout_s``).

Not supported yet (refused with :class:`UnsupportedVLLMFeatureError`): more than one worker per
engine (tensor/pipeline parallelism) and the canonical or replicated host layouts, which need
kvoffload's shared pool for tensor-parallel ranks; KV cache groups that cover only some of the KV
tensors; the disk tier; vLLM's CPU-spec options (``cpu_bytes_to_use``, ``store_threshold``,
``cache_policy_module_path``). The spec builds its pool through :meth:`KVOffloadSpec.create_engine`,
the one place a shared pool will plug in.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import torch
import vllm

import kvoffload
from kvoffload import (
    DeviceLayout,
    Direction,
    EventKind,
    LoadPlan,
    Manager,
    ManagerStats,
    StorePlan,
    UnknownKeyError,
    WaitTimeoutError,
    Worker,
)
from kvoffload.integrations.vllm_support import (
    SUPPORTED_VLLM_VERSIONS,
    AdapterOptions,
    UnsupportedVLLMFeatureError,
    UnsupportedVLLMVersionError,
    VLLMConfigError,
    VLLMIntegrationError,
    VLLMTransferError,
    check_parallel_layout,
    check_vllm_version,
    group_page_bytes,
    job_records,
    num_host_chunks,
    record_bytes_estimate,
)

check_vllm_version(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.base import TransferResult as VLLMTransferResult  # noqa: E402
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

__all__ = [
    "SUPPORTED_VLLM_VERSIONS",
    "HostChunkSpec",
    "KVOffloadManager",
    "KVOffloadSpec",
    "KVOffloadWorker",
    "Metrics",
    "TransferEngine",
    "UnsupportedVLLMFeatureError",
    "UnsupportedVLLMVersionError",
    "VLLMConfigError",
    "VLLMIntegrationError",
    "VLLMTransferError",
]

_log = logging.getLogger("kvoffload.integrations.vllm")

I64Array = npt.NDArray[np.int64]


class Metrics:
    """The Prometheus metrics the adapter's manager reports through vLLM's stats (names as
    vLLM publishes them)."""

    HOST_USAGE: Final = "vllm:kvoffload_host_usage_perc"
    HOST_WRITE_USAGE: Final = "vllm:kvoffload_host_write_usage_perc"
    HOST_READ_USAGE: Final = "vllm:kvoffload_host_read_usage_perc"
    EVICTIONS: Final = "vllm:kvoffload_evictions"
    STORES_FAILED: Final = "vllm:kvoffload_stores_failed"
    SETTLED_AFTER_RESET: Final = "vllm:kvoffload_settled_after_reset"


#: Label names of vLLM's ``vllm:kv_offload_config_info`` series that the manager fills.
_INFO_KEYS: Final = (
    "kvoffload_version",
    "host_num_chunks",
    "host_blocks_per_chunk",
    "host_bytes",
    "eviction_policy",
)


class HostChunkSpec(LoadStoreSpec):
    """Where a transfer's chunks live in the host pool: one chunk id per offloaded key, in the order
    of the keys (and so of the GPU spec's groups). Built by the manager, read by the worker."""

    def __init__(self, chunk_ids: Sequence[int]) -> None:
        self.chunk_ids: I64Array = np.asarray(chunk_ids, dtype=np.int64).reshape(-1)

    def __repr__(self) -> str:
        return f"HostChunkSpec({self.chunk_ids.tolist()})"


# ------------------------------------------------------------------------------------ manager


class KVOffloadManager(OffloadingManager):
    """vLLM's scheduler-side manager backed by a :class:`kvoffload.Manager` (see the module docstring).

    Owns the kvoffload manager and the book of outstanding plans (the plan of every pending store
    key, the outstanding loads of every key, and the plans a reset left to settle). Holds no OS or
    GPU resource. Called from vLLM's scheduler thread only (its ``lock`` is vLLM's no-op default).
    """

    def __init__(self, manager: Manager, *, events: bool, info: Mapping[str, str | int]) -> None:
        self._manager = manager
        self._events = events
        self._info = dict(info)
        self._store_plan: dict[bytes, StorePlan] = {}  # pending store key -> its plan
        self._store_left: dict[int, tuple[StorePlan, set[bytes]]] = {}  # plan id -> pending keys
        self._load_plans: dict[bytes, deque[LoadPlan]] = {}  # key -> outstanding loads, oldest first
        self._load_left: dict[int, tuple[LoadPlan, set[bytes]]] = {}  # plan id -> keys not completed
        self._unsettled: list[tuple[StorePlan | LoadPlan, set[bytes]]] = []  # left by reset_cache
        self._reported = manager.stats()

    @property
    def manager(self) -> Manager:
        """The kvoffload manager (for inspection: call only ``stats`` and ``lookup``)."""
        return self._manager

    @property
    def unsettled_plans(self) -> int:
        """Plans a reset left in flight that ``on_reset_flushed`` has not settled yet."""
        return len(self._unsettled)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when ``key`` is loadable, HIT_PENDING while its store is in flight, else MISS."""
        if key in self._store_plan:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT if self._manager.lookup([key]) else LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Every hit is served from host memory."""
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Reference ``keys`` (all loadable, as ``lookup`` said) until ``complete_load``; return their
        chunks in key order. Raises kvoffload's ``UnknownKeyError``/``KeyStateError`` for a key that
        is not loadable (a caller that skipped ``lookup``)."""
        ordered = list(keys)
        plan = self._manager.prepare_load(ordered)
        for key in ordered:
            self._load_plans.setdefault(key, deque()).append(plan)
        if ordered:
            self._load_left[plan.plan_id] = (plan, set(ordered))
        return HostChunkSpec(plan.blocks)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Tell the eviction policy that ``keys`` were used (unknown keys are ignored)."""
        self._manager.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Drop the oldest outstanding load of each of ``keys``.

        Raises:
            UnknownKeyError: a key has no outstanding load (nothing is changed then).
        """
        ordered = list(keys)
        missing = [key for key in ordered if not self._load_plans.get(key)]
        if missing:
            raise UnknownKeyError(f"complete_load: key(s) {missing[:4]!r} have no outstanding load")
        by_plan: dict[int, tuple[LoadPlan, list[bytes]]] = {}
        for key in ordered:
            queue = self._load_plans[key]
            plan = queue.popleft()
            if not queue:
                del self._load_plans[key]
            by_plan.setdefault(plan.plan_id, (plan, []))[1].append(key)
        for plan_id, (plan, plan_keys) in by_plan.items():
            self._manager.complete_load(plan, plan_keys)
            left = self._load_left[plan_id][1]
            left.difference_update(plan_keys)
            if not left:
                del self._load_left[plan_id]

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate chunks for the keys not held yet (evicting ready chunks, never the request's own
        keys); None when the pool cannot take them (nothing changed)."""
        ordered = list(dict.fromkeys(keys))  # vLLM may name a key twice across groups: store it once
        plan = self._manager.prepare_store(ordered)
        if plan is None:
            return None
        if plan.keys:
            for key in plan.keys:
                self._store_plan[key] = plan
            self._store_left[plan.plan_id] = (plan, set(plan.keys))
        return PrepareStoreOutput(
            keys_to_store=list(plan.keys),
            store_spec=HostChunkSpec(plan.host_blocks),
            evicted_keys=list(plan.evicted),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Finish the stores of ``keys``: loadable with ``success``, freed (never loadable) without.
        Keys with no pending store (completed already, or cleared by a reset) are ignored."""
        by_plan: dict[int, list[bytes]] = {}
        for key in keys:
            plan = self._store_plan.pop(key, None)
            if plan is not None:
                by_plan.setdefault(plan.plan_id, []).append(key)
        for plan_id, plan_keys in by_plan.items():
            plan, left = self._store_left[plan_id]
            self._manager.complete_store(plan, bool(success), plan_keys)
            left.difference_update(plan_keys)
            if not left:
                del self._store_left[plan_id]

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Every request offloads its new chunks (vLLM's chunk-level policy)."""
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """kvoffload's events since the last call, consecutive ones of a kind batched into one
        ``OffloadingEvent``; a failed store is a ``metadata_only`` removal (it was never announced
        as stored), dropped for keys a later store already took again."""
        if not self._events:
            return []
        out: list[OffloadingEvent] = []
        for kind, group in itertools.groupby(self._manager.events(), key=lambda e: e.kind):
            keys = [event.key for event in group]
            if kind is EventKind.STORE_FAILED:
                keys = [key for key in keys if key not in self._store_plan]
                if not keys:
                    continue
            out.append(
                OffloadingEvent(
                    keys=keys,
                    medium=Medium.CPU,
                    removed=kind is not EventKind.STORED,
                    metadata_only=kind is EventKind.STORE_FAILED,
                )
            )
        return out

    def reset_cache(self) -> None:
        """Forget every key; the chunks of plans still in flight stay fenced until
        :meth:`on_reset_flushed` (vLLM drops the completions of jobs from before a reset)."""
        self._unsettled += list(self._store_left.values())
        self._unsettled += list(self._load_left.values())
        self._store_plan.clear()
        self._store_left.clear()
        self._load_plans.clear()
        self._load_left.clear()
        self._manager.reset()

    def on_reset_flushed(self) -> None:
        """Every job in flight at the last reset has finished: settle their plans, so that the
        chunks they fenced return to the free list."""
        unsettled, self._unsettled = self._unsettled, []
        for plan, keys in unsettled:
            if isinstance(plan, StorePlan):
                self._manager.complete_store(plan, False, sorted(keys))
            else:
                self._manager.complete_load(plan, sorted(keys))

    def get_stats(self) -> OffloadingConnectorStats:
        """Host usage gauges (now) and counters (since the last call)."""
        now = self._manager.stats()
        host = now.host
        capacity = max(host.capacity, 1)
        stats = OffloadingConnectorStats()
        stats.set_gauge(Metrics.HOST_USAGE, (host.capacity - host.free) / capacity)
        stats.set_gauge(Metrics.HOST_WRITE_USAGE, host.pending / capacity)
        stats.set_gauge(Metrics.HOST_READ_USAGE, host.loading / capacity)
        before = self._reported
        for name, value in (
            (Metrics.EVICTIONS, now.host_evictions - before.host_evictions),
            (Metrics.STORES_FAILED, now.stores_failed - before.stores_failed),
            (Metrics.SETTLED_AFTER_RESET, now.stale_completions - before.stale_completions),
        ):
            if value:
                stats.increase_counter(name, value)
        self._reported = now
        return stats

    def config_info(self) -> Sequence[Mapping[str, str | int]]:
        """The values of the labels :meth:`KVOffloadSpec.config_info_keys` declares."""
        return [dict(self._info)]

    def stats(self) -> ManagerStats:
        """The kvoffload manager's snapshot (block states and cumulative counters)."""
        return self._manager.stats()


# ------------------------------------------------------------------------------------- worker


class TransferEngine(Protocol):
    """What :class:`KVOffloadWorker` needs from the engine that moves the bytes: the job calls of
    :class:`kvoffload.Worker` (which is one). The seam where tests inject faults and where a pool
    shared by tensor-parallel ranks will plug in."""

    def store(self, job_id: int, device_blocks: I64Array, host_blocks: I64Array) -> None: ...

    def load(self, job_id: int, host_blocks: I64Array, device_blocks: I64Array) -> None: ...

    def poll(self) -> list[kvoffload.TransferResult]: ...

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[kvoffload.TransferResult]: ...

    def shutdown(self, timeout: float = ...) -> None: ...


@attrs.define(eq=False)
class _Attempt:
    vllm_job: int
    direction: Direction
    device: I64Array
    host: I64Array
    attempt: int


class KVOffloadWorker(OffloadingWorker):
    """vLLM's worker-side transfers, run by a :class:`TransferEngine` (a :class:`kvoffload.Worker`).

    Owns the engine (shut down by :meth:`shutdown`, once) and the book of attempts in flight.
    Called from vLLM's worker thread only. See the module docstring for failures and retries.
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        blocks_per_chunk: int,
        transfer_retries: int,
        wait_timeout_s: float,
    ) -> None:
        self._engine = engine
        self._blocks_per_chunk = blocks_per_chunk
        self._retries = transfer_retries
        self._wait_timeout_s = wait_timeout_s
        self._ids = itertools.count()
        self._attempts: dict[int, _Attempt] = {}  # engine job id -> attempt
        self._current: dict[int, int] = {}  # vLLM job id -> engine job id of its current attempt
        self._finished: list[VLLMTransferResult] = []  # returned by wait, reported by get_finished
        self._closed = False

    @property
    def engine(self) -> TransferEngine:
        """The engine that moves the bytes (borrowed for inspection)."""
        return self._engine

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Copy the GPU blocks of ``src_spec`` into the host records of ``dst_spec``'s chunks, after
        the work queued on the current stream. Returns True; a spec that does not add up raises
        :class:`VLLMConfigError` and kvoffload's validation errors propagate (nothing submitted)."""
        device, host = job_records(
            src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices,
            _chunk_ids(dst_spec), self._blocks_per_chunk,
        )
        self._submit(_Attempt(job_id, Direction.STORE, device, host, 0))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Copy the host records of ``src_spec``'s chunks into the GPU blocks of ``dst_spec``, after
        the work queued on the current stream. ``expedited`` loads share the load queue. Returns
        True; raises as :meth:`submit_store`."""
        device, host = job_records(
            dst_spec.block_ids, dst_spec.group_sizes, dst_spec.block_indices,
            _chunk_ids(src_spec), self._blocks_per_chunk,
        )
        self._submit(_Attempt(job_id, Direction.LOAD, device, host, 0))
        return True

    def get_finished(self) -> list[VLLMTransferResult]:
        """The jobs finished since the last call (including those ``wait`` saw finish).

        Raises:
            VLLMTransferError: a job failed on every attempt.
        """
        self._check_open()
        finished, self._finished = self._finished, []
        return finished + self._settle(self._engine.poll())

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (their results come from the next ``get_finished``);
        ids this worker does not hold in flight are ignored.

        Raises:
            VLLMTransferError: a job failed on every attempt, or the jobs did not finish within
                ``wait_timeout_s``.
        """
        self._check_open()
        deadline = time.monotonic() + self._wait_timeout_s
        while True:
            pending = [self._current[j] for j in job_ids if j in self._current]
            if not pending:
                return
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise WaitTimeoutError("the deadline passed", pending)
                done = self._engine.wait(pending, left)
            except WaitTimeoutError as exc:
                late = sorted(self._attempts[i].vllm_job for i in exc.pending if i in self._attempts)
                raise VLLMTransferError(
                    f"vLLM job(s) {late} did not finish within wait_timeout_s = "
                    f"{self._wait_timeout_s} s",
                    late[0] if late else -1,
                ) from exc
            self._finished += self._settle(done)

    def shutdown(self) -> None:
        """Drain and release the engine (kvoffload's shutdown contract), once; later calls do
        nothing. Raises kvoffload's ``ShutdownError`` after all cleanup when something failed."""
        if self._closed:
            return
        self._closed = True
        self._attempts.clear()
        self._current.clear()
        self._finished.clear()
        self._engine.shutdown(self._wait_timeout_s)

    def _submit(self, attempt: _Attempt) -> None:
        self._check_open()
        internal = next(self._ids)
        if attempt.direction is Direction.STORE:
            self._engine.store(internal, attempt.device, attempt.host)
        else:
            self._engine.load(internal, attempt.host, attempt.device)
        self._attempts[internal] = attempt
        self._current[attempt.vllm_job] = internal

    def _settle(self, results: Iterable[kvoffload.TransferResult]) -> list[VLLMTransferResult]:
        out: list[VLLMTransferResult] = []
        for result in results:
            attempt = self._attempts.pop(result.job_id)
            if result.ok:
                del self._current[attempt.vllm_job]
                out.append(VLLMTransferResult(attempt.vllm_job, True, result.nbytes, result.seconds))
                continue
            what = attempt.direction.value
            if attempt.attempt < self._retries:
                _log.warning(
                    "kvoffload %s of vLLM job %d failed (attempt %d of %d), resubmitting: %s",
                    what, attempt.vllm_job, attempt.attempt + 1, self._retries + 1, result.error,
                )
                self._submit(attrs.evolve(attempt, attempt=attempt.attempt + 1))
                continue
            del self._current[attempt.vllm_job]
            consequence = (
                "its keys were never reported stored, so they never become loadable"
                if attempt.direction is Direction.STORE
                else "its GPU blocks hold undefined bytes"
            )
            raise VLLMTransferError(
                f"kvoffload {what} of vLLM job {attempt.vllm_job} failed on all "
                f"{attempt.attempt + 1} attempt(s) (GPU blocks {attempt.device[:8].tolist()}, host "
                f"records {attempt.host[:8].tolist()}): {result.error}; {consequence}. vLLM's "
                "OffloadingConnector cannot take a failed job, so the engine stops here",
                attempt.vllm_job,
            ) from result.error
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise kvoffload.ClosedError("the KVOffloadWorker was shut down")


def _chunk_ids(spec: object) -> I64Array:
    if not isinstance(spec, HostChunkSpec):
        raise VLLMConfigError(
            f"a transfer's host side is a {type(spec).__name__}, not a HostChunkSpec: the scheduler "
            "and the workers must both use KVOffloadSpec"
        )
    return spec.chunk_ids


# --------------------------------------------------------------------------------------- spec


class KVOffloadSpec(OffloadingSpec):
    """The offloading spec vLLM builds in its scheduler and in each worker (see the module docstring).

    Reads the adapter's options from ``kv_connector_extra_config`` and refuses what it does not
    support before anything is allocated. Owns the manager it builds (scheduler side) and the
    worker it builds (worker side), each built once.

    Raises (from ``__init__``):
        VLLMConfigError: a missing or bad option, or a pool budget that holds no chunk.
        UnsupportedVLLMFeatureError: an unsupported option or parallel layout (named).
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The metrics :meth:`KVOffloadManager.get_stats` reports."""
        return {
            Metrics.HOST_USAGE: OffloadingGaugeMetadata(
                documentation="Fraction of the kvoffload host pool's chunks in use (stored, being "
                "stored or loaded, or fenced by a cache reset)."
            ),
            Metrics.HOST_WRITE_USAGE: OffloadingGaugeMetadata(
                documentation="Fraction of the kvoffload host pool's chunks with a store in flight."
            ),
            Metrics.HOST_READ_USAGE: OffloadingGaugeMetadata(
                documentation="Fraction of the kvoffload host pool's chunks with a load in flight."
            ),
            Metrics.EVICTIONS: OffloadingCounterMetadata(
                documentation="Chunks evicted from the kvoffload host pool to make room for stores."
            ),
            Metrics.STORES_FAILED: OffloadingCounterMetadata(
                documentation="Chunk stores completed as failed (never made loadable)."
            ),
            Metrics.SETTLED_AFTER_RESET: OffloadingCounterMetadata(
                documentation="Plans in flight at a cache reset, settled once the workers "
                "reported them (their chunks were fenced until then)."
            ),
        }

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of ``vllm:kv_offload_config_info`` the manager fills."""
        return _INFO_KEYS

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options = AdapterOptions.from_extra_config(self.extra_config)
        parallel = config.parallel
        check_parallel_layout(
            world_size=int(parallel.world_size), replicated_layout=bool(config.replicated_layout)
        )
        self.blocks_per_chunk: int = int(self.blocks_per_chunk)
        self.kv_bytes_per_block = int(config.worker_kv_bytes_per_block)
        self.num_chunks = num_host_chunks(
            self.options.host_bytes, self.kv_bytes_per_block, self.blocks_per_chunk
        )
        self._manager: KVOffloadManager | None = None
        self._worker: KVOffloadWorker | None = None

    @property
    def fingerprint(self) -> str:
        """Names the engine, model and KV geometry the manager's keys belong to."""
        config = self.config
        return (
            f"vllm|{config.engine_id}|{config.model.name}|{config.model.dtype}|"
            f"{self.kv_bytes_per_block}B|{self.blocks_per_chunk}bpc"
        )

    def get_manager(self) -> KVOffloadManager:
        """The scheduler-side manager (built on the first call)."""
        if self._manager is None:
            manager = Manager.create(
                self.num_chunks,
                fingerprint=self.fingerprint,
                policy=self.options.eviction_policy,
                record_events=bool(self.kv_events_config.enable_kv_cache_events),
            )
            info: dict[str, str | int] = {
                "kvoffload_version": kvoffload.__version__,
                "host_num_chunks": self.num_chunks,
                "host_blocks_per_chunk": self.blocks_per_chunk,
                "host_bytes": self.options.host_bytes,
                "eviction_policy": self.options.eviction_policy,
            }
            self._manager = KVOffloadManager(
                manager, events=bool(self.kv_events_config.enable_kv_cache_events), info=info
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KVOffloadWorker:
        """The worker-side transfers over ``kv_caches`` (built on the first call; later calls return
        it). Raises :class:`UnsupportedVLLMFeatureError` for a group that covers only some tensors
        and kvoffload's ``LayoutError``/``RegionError`` when the layout or the pool cannot be built
        (nothing is left allocated)."""
        if self._worker is None:
            layout = self.build_layout(kv_caches)
            records = self.num_chunks * self.blocks_per_chunk
            if layout.record_bytes > record_bytes_estimate(self.kv_bytes_per_block):
                _log.warning(
                    "kvoffload: a GPU block's host record takes %d bytes, more than the %d bytes "
                    "vLLM's worker_kv_bytes_per_block (%d) implies: the pool of %d chunks takes %d "
                    "bytes, over host_bytes = %d",
                    layout.record_bytes, record_bytes_estimate(self.kv_bytes_per_block),
                    self.kv_bytes_per_block, self.num_chunks, records * layout.record_bytes,
                    self.options.host_bytes,
                )
            engine = self.create_engine(layout, records)
            self._worker = KVOffloadWorker(
                engine,
                blocks_per_chunk=self.blocks_per_chunk,
                transfer_retries=self.options.transfer_retries,
                wait_timeout_s=self.options.wait_timeout_s,
            )
        return self._worker

    def build_layout(self, kv_caches: CanonicalKVCaches) -> DeviceLayout:
        """One ``(num_blocks, page)`` byte view per KV tensor, ``page`` the largest unpadded page a
        layer uses in it; raises as :meth:`get_worker`."""
        tensors: list[torch.Tensor] = [t.tensor for t in kv_caches.tensors]
        for i, t in enumerate(tensors):
            if t.dim() != 2:
                raise VLLMConfigError(
                    f"KV tensor {i} has shape {tuple(t.shape)}; vLLM hands the spec (num_blocks, "
                    "page) tensors"
                )
        groups = [
            [(int(ref.tensor_idx), int(ref.page_size_bytes)) for ref in refs]
            for refs in kv_caches.group_data_refs
        ]
        pages = group_page_bytes([int(t.page_size_bytes) for t in kv_caches.tensors], groups)
        views = {
            f"kv{i}": t.view(torch.int8)[:, :page]
            for i, (t, page) in enumerate(zip(tensors, pages))
        }
        return DeviceLayout.from_tensors(views, block_dim=0)

    def create_engine(self, layout: DeviceLayout, num_host_records: int) -> TransferEngine:
        """Build the engine that moves the bytes: a :class:`kvoffload.Worker` with a private pool of
        ``num_host_records`` records (the backend follows the layout's device). Override to wrap it
        (tests inject faults here)."""
        return Worker.create(layout, num_host_records)

