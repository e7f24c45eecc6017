"""The adapter's mapping of every vLLM manager and worker method, called directly.

The spec is built from vLLM's own ``OffloadingConfig``; the worker from vLLM's ``CanonicalKVCaches``
over CPU tensors (kvoffload's host backend moves the bytes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch

from tests.integration.vllm.conftest import VLLM_REASON

pytest.importorskip("vllm", reason=VLLM_REASON)

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

import kvoffload  # noqa: E402
from kvoffload import ClosedError, Direction, UnknownKeyError, WaitTimeoutError  # noqa: E402
from kvoffload.integrations.vllm import (  # noqa: E402
    HostChunkSpec,
    KVOffloadManager,
    KVOffloadSpec,
    KVOffloadWorker,
    Metrics,
    UnsupportedVLLMFeatureError,
    UnsupportedVLLMVersionError,
    VLLMConfigError,
    VLLMTransferError,
)
from tests.integration.vllm.faulty_spec import FaultySpec  # noqa: E402

PAGE = 1024  # bytes of one block of one KV tensor
RECORD = 4096
CTX = ReqContext(req_id="r")


def offloading_config(
    *,
    host_chunks: int = 8,
    blocks_per_chunk: int = 1,
    kv_bytes_per_block: int = 2 * PAGE,
    world_size: int = 1,
    tp_size: int | None = None,
    pp_size: int = 1,
    rank: int = 0,
    engine_id: str = "engine-0",
    events: bool = True,
    **extra: Any,
) -> OffloadingConfig:
    extra_config = {"host_bytes": host_chunks * blocks_per_chunk * RECORD * world_size, **extra}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=engine_id,
        model=OffloadingModelConfig(name="tiny", dtype="float16", max_model_len=2048),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=world_size, tp_size=world_size if tp_size is None else tp_size,
            pp_size=pp_size, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def stored(manager: KVOffloadManager, keys: list[bytes]) -> list[int]:
    """Store ``keys`` as one request's one job (a request of its own)."""
    ctx = ReqContext(req_id=f"stored-{uuid.uuid4()}")
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    assert isinstance(out.store_spec, HostChunkSpec)
    return [int(chunk) for chunk in out.store_spec.chunk_ids]


# --------------------------------------------------------------------------------- manager


@pytest.fixture
def manager() -> KVOffloadManager:
    return KVOffloadSpec(offloading_config(host_chunks=4)).get_manager()


def test_lookup_is_miss_then_hit_pending_then_hit(manager: KVOffloadManager) -> None:
    k = key(1)
    assert manager.lookup(k, CTX) is LookupResult.MISS
    out = manager.prepare_store([k], CTX)
    assert out is not None and out.keys_to_store == [k] and out.evicted_keys == []
    assert manager.lookup(k, CTX) is LookupResult.HIT_PENDING
    manager.complete_store([k], CTX)
    assert manager.lookup(k, CTX) is LookupResult.HIT
    assert manager.get_load_source(k, CTX) is CacheHitSource.HOST


def test_prepare_store_skips_held_keys_and_evicts_lru_never_the_requests_own(
    manager: KVOffloadManager,
) -> None:
    stored(manager, [key(i) for i in range(4)])  # one job: admitted from its tail, key 3 first
    manager.touch([key(3)], CTX)  # key 2 is now the least recently used
    out = manager.prepare_store([key(1), key(9)], CTX)  # key 1 is held: skipped and protected
    assert out is not None
    assert out.keys_to_store == [key(9)] and out.evicted_keys == [key(2)]
    assert manager.lookup(key(2), CTX) is LookupResult.MISS


def test_a_jobs_keys_completed_in_any_order_leave_its_head_evicted_last(manager: KVOffloadManager) -> None:
    """vLLM completes a job's keys as a set: admitted from the plan's tail whatever that order, the
    first eviction takes the tail, never the head a lookup starts from (in the set's order it took
    any of them, the head too: found by an audit)."""
    chain, ctx = [key(i) for i in range(4)], ReqContext(req_id="chain")
    out = manager.prepare_store(chain, ctx)
    assert out is not None and out.keys_to_store == chain
    manager.complete_store([chain[0], chain[2], chain[1], chain[3]], ctx)
    out = manager.prepare_store([key(9)], CTX)
    assert out is not None and out.evicted_keys == [chain[3]]
    assert [manager.lookup(k, CTX) for k in chain[:3]] == [LookupResult.HIT] * 3


def _long_request(steps: list[list[int]]) -> tuple[KVOffloadManager, ReqContext]:
    """A manager of 6 chunks and a request whose chunks 0-3 (token positions 16-64) its ``steps``
    stored, one job a step."""
    big = KVOffloadSpec(offloading_config(host_chunks=6)).get_manager()
    ctx = ReqContext(req_id="long")
    for i in range(4):
        ctx.set_offload_key_position(key(i), 16 * (i + 1))
    for step in steps:
        chunk = [key(i) for i in step]
        out = big.prepare_store(chunk, ctx)
        assert out is not None and out.keys_to_store == chunk
        big.complete_store(chunk, ctx)
    return big, ctx


@pytest.mark.parametrize("steps", [[[0, 1], [2, 3]], [[2, 3], [0, 1]]])
def test_a_finished_requests_chunks_go_tail_first_whichever_step_stored_them(
    manager: KVOffloadManager, steps: list[list[int]],
) -> None:
    """vLLM offers each step's new chunks only (and a backfill stores earlier chunks later): once
    the request finished, its chunks are ranked by token position, so the first evictions take
    its tail, 3 then 2, never its head (a later step's chunks were newer than the head an earlier
    step stored: found by a review)."""
    big, ctx = _long_request(steps)
    big.on_request_finished(ctx)
    stored(big, [key(7), key(8)])  # another request, after: the pool is full
    out = big.prepare_store([key(9)], CTX)
    assert out is not None and out.evicted_keys == [key(3)]
    out = big.prepare_store([key(10)], CTX)
    assert out is not None and out.evicted_keys == [key(2)]
    assert [big.lookup(key(i), CTX) for i in (0, 1)] == [LookupResult.HIT] * 2


@pytest.mark.parametrize("steps", [[[0, 1], [2, 3]], [[2, 3], [0, 1]]], ids=["in order", "backfill"])
def test_a_running_requests_chunks_go_tail_first_whichever_step_stored_them(steps: list[list[int]]) -> None:
    """While a request runs, its chunks rank with the request and by token position, as vLLM's own
    LRU ranks them: evictions for another request take its tail, 3 then 2, never the head an
    earlier step stored (ranked by recency, the first step's chunks were older than the second's,
    and an eviction took key 1 from the middle of the prefix: 2 and 3 could never be hit again).
    A request that started later keeps its chunks longer than this one's."""
    big, _ = _long_request(steps)
    later = ReqContext(req_id="later")
    for i in (7, 8):
        later.set_offload_key_position(key(i), 16 * (i - 6))
    out = big.prepare_store([key(7), key(8)], later)
    assert out is not None
    big.complete_store([key(7), key(8)], later)
    out = big.prepare_store([key(9)], CTX)
    assert out is not None and out.evicted_keys == [key(3)]
    out = big.prepare_store([key(10)], CTX)
    assert out is not None and out.evicted_keys == [key(2)]
    assert [big.lookup(key(i), CTX) for i in (0, 1, 7, 8)] == [LookupResult.HIT] * 4


def test_a_prefix_a_request_loaded_is_ranked_again_with_it_when_it_finishes() -> None:
    """vLLM offers a request only the chunks it stores, never the prefix it loaded: when it
    finishes, that prefix is used again with the rest, head last (as vLLM's own manager does), so
    evictions take the request's own tail first; the head stayed below the tail before, and an
    eviction left the tail, which no lookup reaches without it (found by a review)."""
    big, first = _long_request([[0, 1, 2, 3]])
    big.on_request_finished(first)
    second = ReqContext(req_id="second")
    for i, position in ((0, 16), (1, 32), (10, 48), (11, 64)):
        second.set_offload_key_position(key(i), position)
    big.prepare_load([key(0), key(1)], second)
    big.complete_load([key(0), key(1)], second)
    out = big.prepare_store([key(10), key(11)], second)
    assert out is not None
    big.complete_store(out.keys_to_store, second)
    big.on_request_finished(second)
    evicted: list[bytes] = []
    for i in range(20, 24):
        out = big.prepare_store([key(i)], CTX)
        assert out is not None
        evicted += out.evicted_keys
        big.complete_store(out.keys_to_store, CTX)
    assert evicted == [key(3), key(2), key(11), key(10)]
    assert [big.lookup(key(i), CTX) for i in (0, 1)] == [LookupResult.HIT] * 2


def test_held_keys_offered_again_are_used_again(manager: KVOffloadManager) -> None:
    """A request that offers a key the pool holds (a prefix it reused) makes it the most recent, as
    vLLM's own manager does (vLLM never calls touch): the next eviction takes another (it took the
    reused key: found by an audit)."""
    for i in range(4):
        stored(manager, [key(i)])  # key 0 is the least recently used
    out = manager.prepare_store([key(0)], CTX)  # held: nothing to store, used again
    assert out is not None and out.keys_to_store == [] and out.evicted_keys == []
    out = manager.prepare_store([key(9)], CTX)
    assert out is not None and out.evicted_keys == [key(1)]
    assert manager.lookup(key(0), CTX) is LookupResult.HIT


def test_prepare_store_returns_none_when_nothing_is_evictable(manager: KVOffloadManager) -> None:
    stored(manager, [key(i) for i in range(4)])
    manager.prepare_load([key(0), key(1), key(2), key(3)], CTX)  # loading: not evictable
    assert manager.prepare_store([key(5)], CTX) is None
    assert manager.lookup(key(5), CTX) is LookupResult.MISS


def test_failed_store_frees_its_chunks_and_is_a_metadata_only_removal(
    manager: KVOffloadManager,
) -> None:
    list(manager.take_events())
    out = manager.prepare_store([key(1), key(2)], CTX)
    assert out is not None
    manager.complete_store([key(1)], CTX, success=True)
    manager.complete_store([key(2)], CTX, success=False)
    assert manager.lookup(key(2), CTX) is LookupResult.MISS
    assert manager.stats().host.free == 3
    events = list(manager.take_events())
    assert [(e.keys, e.removed, e.metadata_only) for e in events] == [
        ([key(1)], False, False),
        ([key(2)], True, True),
    ]


def test_events_are_batched_by_kind(manager: KVOffloadManager) -> None:
    stored(manager, [key(i) for i in range(4)])
    out = manager.prepare_store([key(7), key(8)], CTX)  # evicts two
    assert out is not None
    events = list(manager.take_events())
    assert [(len(e.keys), e.removed) for e in events] == [(4, False), (2, True)]
    assert events[1].keys == out.evicted_keys
    assert list(manager.take_events()) == []


def test_no_events_when_vllm_does_not_publish_them() -> None:
    manager = KVOffloadSpec(offloading_config(events=False)).get_manager()
    stored(manager, [key(1)])
    assert list(manager.take_events()) == []


def test_overlapping_loads_of_a_key_complete_one_by_one(manager: KVOffloadManager) -> None:
    (chunk,) = stored(manager, [key(1)])
    spec_a = manager.prepare_load([key(1)], CTX)
    spec_b = manager.prepare_load([key(1)], CTX)
    assert isinstance(spec_a, HostChunkSpec) and spec_a.chunk_ids.tolist() == [chunk]
    assert isinstance(spec_b, HostChunkSpec) and spec_b.chunk_ids.tolist() == [chunk]
    manager.complete_load([key(1)], CTX)
    assert manager.stats().host.loading == 1
    manager.complete_load([key(1)], CTX)
    assert manager.stats().host.loading == 0
    with pytest.raises(UnknownKeyError, match="no outstanding load"):
        manager.complete_load([key(1)], CTX)


def test_reset_fences_in_flight_chunks_until_on_reset_flushed(manager: KVOffloadManager) -> None:
    stored(manager, [key(1)])
    manager.prepare_load([key(1)], CTX)
    pending = manager.prepare_store([key(2), key(3)], CTX)
    assert pending is not None
    manager.reset_cache()
    assert manager.lookup(key(1), CTX) is LookupResult.MISS
    assert manager.lookup(key(2), CTX) is LookupResult.MISS
    assert manager.stats().host.fenced == 3 and manager.unsettled_plans == 2
    fresh = manager.prepare_store([key(4)], CTX)
    assert fresh is not None and isinstance(fresh.store_spec, HostChunkSpec)
    assert isinstance(pending.store_spec, HostChunkSpec)
    old = set(pending.store_spec.chunk_ids.tolist())
    assert old.isdisjoint(fresh.store_spec.chunk_ids.tolist()), "a chunk an old store writes was reused"
    manager.complete_store([key(2), key(3)], CTX)  # a late completion of the old plan: ignored
    assert manager.lookup(key(2), CTX) is LookupResult.MISS

    manager.on_reset_flushed()

    stats = manager.stats()
    assert stats.host.fenced == 0 and stats.host.free == 3 and manager.unsettled_plans == 0
    assert stats.stale_completions == 2


def test_get_stats_reports_declared_metrics_with_counters_since_last_call(
    manager: KVOffloadManager,
) -> None:
    declared = KVOffloadSpec.build_metric_definitions({})
    stored(manager, [key(i) for i in range(4)])
    manager.prepare_store([key(8)], CTX)  # one eviction, one pending
    first = manager.get_stats()
    types, values = first.metric_sections()
    assert set(values) <= set(declared)
    assert values[Metrics.EVICTIONS][()] == 1
    assert values[Metrics.HOST_USAGE][()] == 1.0 and values[Metrics.HOST_WRITE_USAGE][()] == 0.25
    second_values = manager.get_stats().metric_sections()[1]
    assert Metrics.EVICTIONS not in second_values, "a counter was reported twice"


def test_config_info_fills_the_declared_labels(manager: KVOffloadManager) -> None:
    (info,) = manager.config_info()
    assert tuple(info) == KVOffloadSpec.config_info_keys({})
    assert info["host_num_chunks"] == 4 and info["eviction_policy"] == "lru"


def test_on_new_request_offloads_chunk_by_chunk_and_shutdown_is_quiet(
    manager: KVOffloadManager,
) -> None:
    assert isinstance(manager.on_new_request(CTX), RequestOffloadingContext)
    manager.shutdown()


# ---------------------------------------------------------------------------------- worker


def caches(num_blocks: int = 16, tensors: int = 2, groups: list[list[int]] | None = None) -> CanonicalKVCaches:
    data = [torch.zeros(num_blocks, PAGE, dtype=torch.int8) for _ in range(tensors)]
    refs = [[CanonicalKVCacheRef(i, PAGE) for i in group] for group in (groups or [list(range(tensors))])]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, PAGE) for t in data], refs)


@pytest.fixture
def worker_and_caches() -> Iterator[tuple[KVOffloadWorker, CanonicalKVCaches]]:
    kv = caches()
    worker = KVOffloadSpec(offloading_config(host_chunks=4, blocks_per_chunk=2)).get_worker(kv)
    yield worker, kv
    worker.shutdown()


def fill(kv: CanonicalKVCaches, blocks: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.tensors:
        for b in blocks:
            t.tensor[b] = torch.randint(-128, 128, (PAGE,), dtype=torch.int8, generator=gen)


def finished(worker: KVOffloadWorker, job_id: int) -> Any:
    worker.wait({job_id})
    (result,) = worker.get_finished()
    return result


def test_store_then_unaligned_load_round_trips_every_byte(
    worker_and_caches: tuple[KVOffloadWorker, CanonicalKVCaches],
) -> None:
    worker, kv = worker_and_caches
    fill(kv, [3, 4, 5, 6], seed=1)
    original = [t.tensor[[3, 4, 5, 6]].clone() for t in kv.tensors]
    gpu = GPULoadStoreSpec([3, 4, 5, 6], group_sizes=[4], block_indices=[0])
    assert worker.submit_store(7, gpu, HostChunkSpec([2, 0]))
    result = finished(worker, 7)
    assert result.job_id == 7 and result.success and result.transfer_size == 4 * 2 * PAGE
    for t in kv.tensors:
        t.tensor.zero_()
    # blocks 1..3 of the request: chunk 2 from its second record, then all of chunk 0
    target = GPULoadStoreSpec([9, 10, 11], group_sizes=[3], block_indices=[1])
    assert worker.submit_load(8, HostChunkSpec([2, 0]), target, expedited=True)
    assert finished(worker, 8).success
    for t, before in zip(kv.tensors, original):
        assert torch.equal(t.tensor[[9, 10, 11]], before[1:]), "a reloaded byte differs"
        assert not t.tensor[:9].any() and not t.tensor[12:].any(), "a load wrote outside its blocks"


@pytest.mark.parametrize("lane", [True, False])
def test_expedited_loads_take_the_workers_second_lane(lane: bool) -> None:
    """vLLM's expedited loads go through the worker's expedited lane (``expedited_loads``, on by
    default), the others through the regular lane; with the option false the worker has no lane and
    every load takes the regular one. Either way every byte lands."""
    kv = caches()
    config = offloading_config(host_chunks=4, blocks_per_chunk=2, expedited_loads=lane)
    worker = KVOffloadSpec(config).get_worker(kv)
    try:
        engine = worker.engine
        assert isinstance(engine, kvoffload.Worker) and engine.expedited_loads is lane
        fill(kv, [3, 4], seed=2)
        original = [t.tensor[[3, 4]].clone() for t in kv.tensors]
        gpu = GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0])
        assert worker.submit_store(1, gpu, HostChunkSpec([1]))
        assert finished(worker, 1).success
        assert worker.submit_load(2, HostChunkSpec([1]), GPULoadStoreSpec([5, 6], group_sizes=[2],
                                                                          block_indices=[0]), expedited=True)
        assert worker.submit_load(3, HostChunkSpec([1]), GPULoadStoreSpec([7, 8], group_sizes=[2],
                                                                          block_indices=[0]))
        worker.wait({2, 3})
        assert sorted((r.job_id, r.success) for r in worker.get_finished()) == [(2, True), (3, True)]
        for t, before in zip(kv.tensors, original):
            assert torch.equal(t.tensor[[5, 6]], before) and torch.equal(t.tensor[[7, 8]], before)
        stats = engine.stats()
        if lane:
            assert stats.expedited is not None
            assert (stats.load.completed, stats.expedited.completed) == (1, 1)
        else:
            assert stats.expedited is None and stats.load.completed == 2
    finally:
        worker.shutdown()


def test_a_failed_expedited_load_is_retried_through_the_expedited_lane() -> None:
    """The retry of a failed expedited load (``_settle``) keeps its lane, and its bytes land."""
    FaultySpec.configure(fail_loads={0})
    kv = caches()
    worker = FaultySpec(offloading_config(host_chunks=4, blocks_per_chunk=2)).get_worker(kv)
    try:
        fill(kv, [3, 4], seed=3)
        original = [t.tensor[[3, 4]].clone() for t in kv.tensors]
        assert worker.submit_store(1, GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0]),
                                   HostChunkSpec([1]))
        assert finished(worker, 1).success
        assert worker.submit_load(2, HostChunkSpec([1]), GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0]),
                                  expedited=True)
        assert finished(worker, 2).success
        engine = FaultySpec.engines[-1]
        loads = [job for job in engine.submitted if job.direction is Direction.LOAD]
        assert len(engine.failed) == 1 and [job.expedited for job in loads] == [True, True]
        for t, before in zip(kv.tensors, original):
            assert torch.equal(t.tensor[[5, 6]], before)
        stats = engine.worker.stats()
        assert stats.expedited is not None and stats.expedited.completed == 2 and stats.load.completed == 0
    finally:
        worker.shutdown()
        FaultySpec.configure()


def test_wait_ignores_jobs_it_does_not_hold_and_results_come_once(
    worker_and_caches: tuple[KVOffloadWorker, CanonicalKVCaches],
) -> None:
    worker, _ = worker_and_caches
    worker.wait({123})  # never submitted here (another rank's job, or one already reported)
    worker.submit_store(1, GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0]), HostChunkSpec([1]))
    worker.wait({1})
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert worker.get_finished() == []


def test_shutdown_is_idempotent_and_later_calls_raise_closed(
    worker_and_caches: tuple[KVOffloadWorker, CanonicalKVCaches],
) -> None:
    worker, _ = worker_and_caches
    worker.shutdown()
    worker.shutdown()
    with pytest.raises(ClosedError):
        worker.get_finished()


class StalledEngine:
    """A real worker whose ``wait`` never sees its jobs finish (a device that stopped): it sleeps
    out the deadline and raises as kvoffload's ``wait`` does then."""

    def __init__(self, worker: kvoffload.Worker) -> None:
        self.worker = worker

    def store(self, job_id: int, device_blocks: Any, host_blocks: Any) -> None:
        self.worker.store(job_id, device_blocks, host_blocks)

    def load(self, job_id: int, host_blocks: Any, device_blocks: Any, *, expedited: bool = False) -> None:
        self.worker.load(job_id, host_blocks, device_blocks, expedited=expedited)

    def poll(self) -> list[kvoffload.TransferResult]:
        return []

    def wait(self, job_ids: Iterable[int], timeout: float) -> list[kvoffload.TransferResult]:
        time.sleep(timeout)
        ids = list(job_ids)
        raise WaitTimeoutError(f"job(s) {ids} did not finish within {timeout} s", pending=ids)

    def shutdown(self, timeout: float = 30.0) -> None:
        self.worker.shutdown(timeout)


def test_wait_has_a_deadline_and_names_the_late_jobs() -> None:
    spec = KVOffloadSpec(offloading_config(wait_timeout_s=0.2))
    layout = spec.build_layout(caches())
    worker = KVOffloadWorker(
        StalledEngine(kvoffload.Worker.create(layout, 8)), blocks_per_chunk=1, transfer_retries=1,
        wait_timeout_s=0.2,
    )
    try:
        worker.submit_store(41, GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0]), HostChunkSpec([3]))
        started = time.monotonic()
        with pytest.raises(VLLMTransferError, match=r"vLLM job\(s\) \[41\] did not finish within") as info:
            worker.wait({41})
        assert info.value.job_id == 41 and time.monotonic() - started < 30
    finally:
        worker.shutdown()


def test_spec_with_the_wrong_chunk_count_is_refused(
    worker_and_caches: tuple[KVOffloadWorker, CanonicalKVCaches],
) -> None:
    worker, _ = worker_and_caches
    gpu = GPULoadStoreSpec([0, 1, 2], group_sizes=[3], block_indices=[0])
    with pytest.raises(VLLMConfigError, match="needs 2 host chunk"):
        worker.submit_store(1, gpu, HostChunkSpec([0]))
    assert worker.get_finished() == []


def test_a_group_covering_only_some_tensors_is_refused() -> None:
    spec = KVOffloadSpec(offloading_config())
    with pytest.raises(UnsupportedVLLMFeatureError, match=r"group 1 covers only some .*tensor\(s\) \[0\]"):
        spec.get_worker(caches(groups=[[0, 1], [1]]))


# ----------------------------------------------------------------------- tensor parallelism


def test_tensor_parallel_ranks_share_one_pool_each_rank_its_own_slice_of_every_chunk() -> None:
    engine_id = f"engine-tp-{uuid.uuid4().hex[:8]}"
    specs = [KVOffloadSpec(offloading_config(host_chunks=4, blocks_per_chunk=2, world_size=2, rank=r,
                                             engine_id=engine_id)) for r in range(2)]
    assert [s.num_chunks for s in specs] == [4, 4]  # host_bytes holds both ranks' slices
    pool = specs[0].shared_pool
    assert pool is not None and pool == specs[1].shared_pool and pool.world_size == 2
    kvs = [caches(), caches()]
    workers: dict[int, KVOffloadWorker] = {}
    errors: list[BaseException] = []

    def attach(r: int) -> None:  # one process per rank in vLLM; threads stand in here
        try:
            workers[r] = specs[r].get_worker(kvs[r])  # returns once both ranks mapped the pool
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=attach, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(workers) == [0, 1], errors
    try:
        originals = []
        for r in range(2):
            fill(kvs[r], [3, 4, 5, 6], seed=10 + r)  # other bytes on each rank (its own heads)
            originals.append([t.tensor[[3, 4, 5, 6]].clone() for t in kvs[r].tensors])
            gpu = GPULoadStoreSpec([3, 4, 5, 6], group_sizes=[4], block_indices=[0])
            assert workers[r].submit_store(7, gpu, HostChunkSpec([2, 0]))  # the same chunks on both
            assert finished(workers[r], 7).success
        with kvoffload.SharedPool.inspect(pool.name) as view:
            blocks = view.blocks()  # uint8 [records, ranks, record_bytes]
            for r in range(2):
                # chunk 2 is records 4 and 5, chunk 0 records 0 and 1; a record holds both tensors
                for record, block in zip([4, 5, 0, 1], range(4)):
                    expected = torch.cat([o[block].view(torch.uint8) for o in originals[r]])
                    assert torch.equal(torch.from_numpy(blocks[record, r, :2 * PAGE].copy()), expected), (r, record)
            del blocks
        for r in range(2):
            for t in kvs[r].tensors:
                t.tensor.zero_()
            target = GPULoadStoreSpec([9, 10, 11, 12], group_sizes=[4], block_indices=[0])
            assert workers[r].submit_load(8, HostChunkSpec([2, 0]), target, expedited=True)
            assert finished(workers[r], 8).success
            for t, before in zip(kvs[r].tensors, originals[r]):
                assert torch.equal(t.tensor[[9, 10, 11, 12]], before), f"rank {r} reloaded other bytes"
    finally:
        for w in workers.values():
            w.shutdown()


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"world_size": 2, "tp_size": 1, "pp_size": 2}, UnsupportedVLLMFeatureError, "tensor parallelism alone"),
        ({"canonical_layout": True}, UnsupportedVLLMFeatureError, "canonical_layout"),
        ({"attach_timeout_s": -1}, VLLMConfigError, "attach_timeout_s"),
        ({"cpu_bytes_to_use": 1 << 30}, UnsupportedVLLMFeatureError, "give the host pool size"),
        ({"disk_path": "/tmp/x"}, UnsupportedVLLMFeatureError, "disk tier"),
        ({"store_threshold": 2}, UnsupportedVLLMFeatureError, "store_threshold"),
        ({"eviction_policy": "fifo"}, VLLMConfigError, "eviction_policy"),
        ({"host_bytes": 100}, VLLMConfigError, "holds no chunk"),
        ({"kv_bytes_per_block": 0}, UnsupportedVLLMFeatureError, "worker_kv_bytes_per_block = 0"),
    ],
)
def test_unsupported_configurations_are_refused_when_the_spec_is_built(
    overrides: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        KVOffloadSpec(offloading_config(**overrides))


def test_a_replicated_layout_is_declined_every_rank_keeps_its_own_copy() -> None:
    config = offloading_config(world_size=2, rank=1)
    object.__setattr__(config, "replicated_layout", True)  # what vLLM offers for MLA under TP
    spec = KVOffloadSpec(config)
    assert spec.replicated_layout is False  # vLLM's connector then lets every rank write its copy
    assert spec.shared_pool is not None and spec.num_chunks == 8


def test_importing_the_adapter_with_another_vllm_version_fails_clearly() -> None:
    code = (
        "import vllm; vllm.__version__ = '0.34.0'\n"
        "try:\n"
        "    import kvoffload.integrations.vllm\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
    )
    assert done.returncode == 0, done.stderr
    assert f"{UnsupportedVLLMVersionError.__name__} vllm 0.34.0 is not supported" in done.stdout
