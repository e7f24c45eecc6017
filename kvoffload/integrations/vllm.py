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
- eviction (``eviction_policy``): ``"lru"`` ranks chunks as vLLM's own LRU does (each chunk a
  running request offers or loads ranks with the request and, within it, by token position, tail
  first; a finished request's chunks are used again tail to head:
  :class:`~kvoffload.integrations._vllm_policy.RequestRankedLRU`); ``"arc"`` is kvoffload's ARC;
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
start inside a chunk (vLLM's ``block_indices``) skip its leading records. Expedited loads (vLLM
waits for them within the step) go through the worker's second load lane, its own streams and
issuer thread, so they never queue behind the regular loads (``expedited_loads``, default true;
the lane's loads of up to 8 MiB go through ``sm``, which no copy engine holds: docs/design.md §4).

Failed jobs: vLLM 0.33's connector asserts that every submit and every job succeeds. The adapter
resubmits a failed store or load up to ``transfer_retries`` times (a store's GPU blocks and a load's
host chunk stay untouched until the job is reported, so the retry copies the same bytes). When every
attempt failed it raises :class:`VLLMTransferError` from ``get_finished`` or ``wait``: the engine
stops with a message naming the job, the blocks and kvoffload's error, instead of an assertion deep
in vLLM. A failed store is never reported as done, so its keys never become loadable; a failed load
never lets its request run on undefined KV. ``wait`` gets a deadline (``wait_timeout_s``).

Tensor parallelism: the worker of each rank maps one kvoffload :class:`~kvoffload.SharedPool`
named after the engine (``engine_id``), every host chunk holding each rank's slice of its blocks
side by side in rank order (vLLM's direct layout: the ranks' bytes of a block concatenated), so the
scheduler's one chunk id serves every rank. ``host_bytes`` is the whole pool's budget (all ranks);
the ranks attach within ``attach_timeout_s`` of each other (default 300 s) or every one of them
fails with a kvoffload ``PoolTimeoutError`` naming the missing ranks. When vLLM offers the
single-copy layout (an MLA model whose KV every rank holds identically), the spec declines it
(``replicated_layout`` stays False), so every rank stores and loads its own copy: correct, at
``world_size`` times the host memory of a single copy.

Not supported yet (refused with :class:`UnsupportedVLLMFeatureError`): pipeline and context
parallelism; the canonical host layout; KV cache groups that cover only some of the KV tensors; the
disk tier; vLLM's CPU-spec options (``cpu_bytes_to_use``, ``store_threshold``,
``cache_policy_module_path``). The spec builds its pool through :meth:`KVOffloadSpec.create_engine`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch
import vllm

import kvoffload
from kvoffload import (
    DeviceLayout,
    EventKind,
    LoadPlan,
    Manager,
    ManagerStats,
    SharedPool,
    StorePlan,
    UnknownKeyError,
    Worker,
)
from kvoffload.integrations._vllm_policy import RequestRankedLRU
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
    num_host_chunks,
    record_bytes_estimate,
)

check_vllm_version(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvoffload.integrations._vllm_worker import (  # noqa: E402
    HostChunkSpec,
    KVOffloadWorker,
    TransferEngine,
)

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


# ------------------------------------------------------------------------------------ manager


class _RequestKeys:
    """The keys one request offered to store, in its chunks' order, and its rank in the ranked LRU
    (the policy's generation it was drawn in, and the rank); kept in vLLM's ``ReqContext``, which
    lives as long as the request."""

    def __init__(self) -> None:
        self.keys: dict[bytes, None] = {}
        self.rank: tuple[int, int] | None = None


def _head_to_tail(keys: Iterable[bytes], req_context: ReqContext) -> list[bytes]:
    """``keys`` from the request's head to its tail: by the token position vLLM recorded for each
    (chunks of several KV cache groups interleave, and a backfill stores earlier chunks later),
    or as given when a key has none."""
    ordered = list(keys)
    positions = [req_context.get_offload_key_position(key) for key in ordered]
    if ordered and all(position is not None for position in positions):
        rank = dict(zip(ordered, positions))
        ordered.sort(key=rank.__getitem__)
    return ordered


def _request_state(req_context: ReqContext) -> _RequestKeys:
    state: _RequestKeys | None = req_context.get_state(_RequestKeys)
    if state is None:
        state = _RequestKeys()
        req_context.set_state(state)
    return state


def _request_keys(req_context: ReqContext) -> dict[bytes, None]:
    return _request_state(req_context).keys


def _positioned(keys: Iterable[bytes], req_context: ReqContext) -> list[tuple[bytes, int]]:
    """``(key, token position)`` of the keys vLLM recorded a position for."""
    out = []
    for key in keys:
        position = req_context.get_offload_key_position(key)
        if position is not None:
            out.append((key, position))
    return out


class KVOffloadManager(OffloadingManager):
    """vLLM's scheduler-side manager backed by a :class:`kvoffload.Manager` (see the module docstring).

    Owns the kvoffload manager and the book of outstanding plans (the plan of every pending store
    key, the outstanding loads of every key, and the plans a reset left to settle). Holds no OS or
    GPU resource. Called from vLLM's scheduler thread only (its ``lock`` is vLLM's no-op default).
    """

    def __init__(self, manager: Manager, *, events: bool, info: Mapping[str, str | int],
                 ranked: RequestRankedLRU | None = None) -> None:
        """``ranked``: the host tier's policy when it is the request-ranked LRU (``"lru"``): the
        adapter then ranks chunks by request and token position, as vLLM's own LRU does."""
        self._manager = manager
        self._ranked = ranked
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
        # Ranked again when the request finishes, with the chunks it stores (vLLM never offers a
        # loaded chunk to store: its shared head stayed below the request's own tail).
        _request_keys(req_context).update(dict.fromkeys(ordered))
        if self._ranked is not None:
            self._ranked.access(_positioned(ordered, req_context), self._request_rank(req_context))
        for key in ordered:
            self._load_plans.setdefault(key, deque()).append(plan)
        if ordered:
            self._load_left[plan.plan_id] = (plan, set(ordered))
        return HostChunkSpec(plan.blocks)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Tell the eviction policy that ``keys`` were used (unknown keys are ignored; the ranked
        LRU ranks them fresh, the last key the most recent, as vLLM's own)."""
        ordered = list(keys)
        self._manager.touch(ordered)
        if self._ranked is not None:
            self._ranked.refresh(ordered[::-1])

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
        keys); None when the pool cannot take them (nothing changed but the held keys' recency:
        they are used again, the head of the request's keys the most recent)."""
        ordered = list(dict.fromkeys(keys))  # vLLM may name a key twice across groups: store it once
        ranked = self._ranked
        if ranked is not None:
            # vLLM's own LRU: every chunk the running request offers ranks with the request, its
            # tail below its head, whichever step offered it (a prefix without its head can never
            # be hit again); the new ones take that rank when their store admits them.
            # Keys vLLM recorded no position for are used again fresh, the head last.
            positioned = _positioned(ordered, req_context)
            if len(positioned) < len(ordered):
                placed = {kp[0] for kp in positioned}
                ranked.refresh([k for k in ordered[::-1] if k not in placed])
            ranked.access(positioned, self._request_rank(req_context))
        else:
            # The keys the request holds already are used again: the most recent, the head last.
            self._manager.touch(ordered[::-1])
        _request_keys(req_context).update(dict.fromkeys(ordered))
        plan = self._manager.prepare_store(ordered)
        if plan is None:
            return None
        if ranked is not None and plan.keys:
            new = set(plan.keys)
            ranked.expect([kp for kp in positioned if kp[0] in new], self._request_rank(req_context))
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
        """Finish the stores of ``keys``: loadable with ``success``, freed (never loadable) without,
        from its tail to its head (by token position where vLLM recorded one, else in the plan's
        order), so its head is the most recent. Keys with no pending store (completed already, or
        cleared by a reset) are ignored."""
        by_plan: dict[int, list[bytes]] = {}
        for key in keys:
            plan = self._store_plan.pop(key, None)
            if plan is not None:
                by_plan.setdefault(plan.plan_id, []).append(key)
        for plan_id, plan_keys in by_plan.items():
            plan, left = self._store_left[plan_id]
            # vLLM passes a job's keys as a set: admitted from the tail, the head is the most
            # recent (as vLLM's own LRU ranks a request's chunks), whatever the set's order (in
            # hash order an eviction took a prefix's head and stranded its tail).
            rank = {key: i for i, key in enumerate(_head_to_tail(plan.keys, req_context))}
            plan_keys.sort(key=rank.__getitem__, reverse=True)
            self._manager.complete_store(plan, bool(success), plan_keys)
            if not success and self._ranked is not None:
                self._ranked.forget(plan_keys)
            left.difference_update(plan_keys)
            if not left:
                del self._store_left[plan_id]

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Rank every chunk the request offered once more, from its tail to its head (only ready
        ones count), so that its tail goes first and its head last, whichever step stored them
        (vLLM's own LRU does so when a request finishes; while it ran, the ranked LRU kept its
        chunks by request and position, and ARC by recency). Once per request: after every store
        it cost O(request) per step (0.7 ms a step for a request of 4,000 chunks, measured by a
        review)."""
        keys = _request_keys(req_context)
        if keys:
            tail_first = _head_to_tail(keys, req_context)[::-1]
            if self._ranked is not None:
                self._ranked.refresh(tail_first)
            else:
                self._manager.touch(tail_first)

    def _request_rank(self, req_context: ReqContext) -> int:
        """The request's rank in the ranked LRU, drawn at its first use (again after a reset)."""
        ranked = self._ranked
        assert ranked is not None
        state = _request_state(req_context)
        if state.rank is None or state.rank[0] != ranked.generation:
            state.rank = (ranked.generation, ranked.request_rank())
        return state.rank[1]

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
            world_size=int(parallel.world_size), tp_size=int(parallel.tp_size), pp_size=int(parallel.pp_size),
            pcp_size=int(parallel.pcp_size), dcp_size=int(parallel.dcp_size),
        )
        if config.replicated_layout:  # self.replicated_layout stays False: every rank writes its copy
            _log.info("kvoffload: vLLM offers the single-copy host layout (KV replicated across the "
                      "tensor-parallel ranks); KVOffloadSpec keeps the direct layout, a copy per rank")
        self.rank = int(parallel.rank)
        self.world_size = int(parallel.world_size)
        self.blocks_per_chunk: int = int(self.blocks_per_chunk)
        self.kv_bytes_per_block = int(config.worker_kv_bytes_per_block)
        self.num_chunks = num_host_chunks(  # host_bytes holds every rank's slices
            self.options.host_bytes // self.world_size, self.kv_bytes_per_block, self.blocks_per_chunk
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
            made: list[RequestRankedLRU] = []

            def ranked_lru(capacity: int) -> RequestRankedLRU:
                made.append(RequestRankedLRU(capacity))
                return made[-1]

            manager = Manager.create(
                self.num_chunks,
                fingerprint=self.fingerprint,
                policy=ranked_lru if self.options.eviction_policy == "lru" else self.options.eviction_policy,
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
                manager, events=bool(self.kv_events_config.enable_kv_cache_events), info=info,
                ranked=made[0] if made else None,
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
                expedited_lane=getattr(engine, "expedited_loads", False) is True,
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

    @property
    def shared_pool(self) -> SharedPool | None:
        """The host pool the tensor-parallel ranks of this engine share (None for one worker): named
        after ``engine_id``, which vLLM keeps distinct per engine (and per data-parallel rank)."""
        if self.world_size == 1:
            return None
        digest = hashlib.blake2b(str(self.config.engine_id).encode(), digest_size=12).hexdigest()
        return SharedPool(f"kvoffload-vllm-{digest}", self.world_size,
                          attach_timeout_s=self.options.attach_timeout_s)

    def create_engine(self, layout: DeviceLayout, num_host_records: int) -> TransferEngine:
        """Build the engine that moves the bytes: a :class:`kvoffload.Worker` with a pool of
        ``num_host_records`` records (the backend follows the layout's device); with tensor
        parallelism, this rank's slices of :attr:`shared_pool` (returns once every rank mapped it);
        with the expedited load lane unless ``expedited_loads`` is false. Override to wrap it (tests
        inject faults here); expedited loads take the engine's second lane when its
        ``expedited_loads`` attribute is True (a :class:`kvoffload.Worker`'s says whether it has
        one), else the regular lane."""
        pool = self.shared_pool
        shared = pool.rank(self.rank) if pool is not None else None
        return Worker.create(layout, num_host_records, shared=shared,
                             expedited_loads=self.options.expedited_loads)

