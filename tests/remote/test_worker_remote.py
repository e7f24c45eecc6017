"""A Worker's remote tier (and a Manager's remote lookups) against real Mooncake and Redis Cluster
services: round trips, a damaged record never served, another layout refused, a server killed or
paused mid-traffic, a full store, and clean shutdowns."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvoffload import (
    BlockConflictError,
    DeviceLayout,
    Manager,
    RemoteError,
    RemoteIntegrityError,
    RemoteTimeoutError,
    TransferResult,
    Tier,
    Worker,
    open_remote_index,
)
from kvoffload._record import PAGE_BYTES
from tests.remote.conftest import BACKENDS, Cluster

RECORD = 64 << 10
HOST_BLOCKS = 32
WAIT_S = 60.0


def make_layout(model_id: str = "remote-test", record: int = RECORD, blocks: int = 32) -> DeviceLayout:
    g = torch.Generator().manual_seed(hash(model_id) & 0xFFFF)
    cache = torch.randint(0, 256, (blocks, record), dtype=torch.uint8, generator=g)
    return DeviceLayout.from_tensors({"kv": cache}, 0, model_id=model_id)


@pytest.fixture
def worker(cluster: Cluster, prefix: str) -> Iterator[Worker]:
    with Worker.create(make_layout(), HOST_BLOCKS, remote=cluster.remote_config(prefix, batch_records=4)) as w:
        yield w


def one(w: Worker, job: int) -> TransferResult:
    (result,) = w.wait([job], WAIT_S)
    return result


def test_store_put_get_load_is_bit_exact(worker: Worker) -> None:
    layout = worker.layout
    keys = [f"k{i}".encode() for i in range(10)]
    worker.store(1, list(range(10)), list(range(10)))
    assert one(worker, 1).ok
    worker.put_remote(2, list(range(10)), keys)
    put = one(worker, 2)
    assert put.ok, put.error
    worker.host_records()[10:20] = 0x5A
    worker.get_remote(3, keys, list(range(10, 20)))
    got = one(worker, 3)
    assert got.ok, got.error
    worker.load(4, list(range(10, 20)), list(range(20, 30)))
    assert one(worker, 4).ok
    assert torch.equal(layout.gather_records(list(range(20, 30))), layout.gather_records(list(range(10))))
    stats = worker.remote_stats()
    assert stats is not None and (stats.records_put, stats.records_got) == (10, 10)


def test_a_flipped_byte_is_never_served(worker: Worker, cluster: Cluster, prefix: str) -> None:
    worker.store(1, [0], [0])
    one(worker, 1)
    worker.put_remote(2, [0], [b"victim"])
    assert one(worker, 2).ok
    value = bytearray(cluster.raw_get(prefix, b"victim"))
    value[PAGE_BYTES + 4321] ^= 0x04
    cluster.raw_set(prefix, b"victim", bytes(value))
    worker.host_records()[5] = 0xEE
    worker.get_remote(3, [b"victim"], [5])
    result = one(worker, 3)
    assert isinstance(result.error, RemoteIntegrityError) and result.error.kind == "checksum_mismatch"
    assert not worker.host_records()[5].any()
    stats = worker.remote_stats()
    assert stats is not None and stats.failures["checksum_mismatch"] == 1


def test_a_record_written_by_another_layout_is_refused(cluster: Cluster, prefix: str) -> None:
    config = cluster.remote_config(prefix)
    with Worker.create(make_layout("model-a"), 4, remote=config) as a, \
            Worker.create(make_layout("model-b"), 4, remote=config) as b:
        a.store(1, [3], [0])
        one(a, 1)
        a.put_remote(2, [0], [b"shared"])
        assert one(a, 2).ok
        b.get_remote(1, [b"shared"], [1])
        result = one(b, 1)
        assert isinstance(result.error, RemoteIntegrityError) and result.error.kind == "fingerprint_mismatch"
        assert not b.host_records()[1].any()


def test_a_manager_finds_another_managers_blocks_through_the_store(cluster: Cluster, prefix: str) -> None:
    layout = make_layout()
    config = cluster.remote_config(prefix)
    keys = [f"block-{i}".encode() for i in range(6)]
    index = open_remote_index(config, fingerprint=layout.fingerprint)
    try:
        writer = Manager.create(HOST_BLOCKS, fingerprint=layout.fingerprint, remote=index)
        with Worker.create(layout, HOST_BLOCKS, remote=config) as w:
            plan = writer.prepare_store(keys)
            assert plan is not None
            w.store(1, list(range(6)), list(plan.host_blocks))
            writer.complete_store(plan, one(w, 1).ok)
            put = writer.prepare_remote_put(keys)
            w.put_remote(2, list(put.host_blocks), list(put.remote_keys))
            writer.complete_remote_put(put, one(w, 2).ok)
        reader = Manager.create(HOST_BLOCKS, fingerprint=layout.fingerprint, remote=index)
        assert reader.lookup(keys + [b"never-stored"]) == 6
        load = reader.prepare_load(keys)
        assert set(load.tiers) == {Tier.REMOTE}
        with Worker.create(layout, HOST_BLOCKS, remote=config) as w:
            w.get_remote(1, [reader.namespaced(k) for k in keys], list(load.blocks))
            assert one(w, 1).ok
            w.load(2, list(load.blocks), list(range(10, 16)))
            ok = one(w, 2).ok
            reader.complete_load(load, ok=ok)
            assert ok and torch.equal(layout.gather_records(list(range(10, 16))), layout.gather_records(list(range(6))))
        assert reader.lookup(keys) == 6 and reader.stats().remote_lookup_hits == 6
    finally:
        index.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_server_killed_mid_traffic_fails_every_job_within_its_deadline_and_shutdown_is_clean(
    backend: str, fresh_cluster: Callable[..., Cluster], prefix: str
) -> None:
    c = fresh_cluster(backend)
    config = c.remote_config(prefix, batch_records=4, job_timeout_s=3.0)
    index = open_remote_index(c.remote_config(prefix), fingerprint="fp")
    w = Worker.create(make_layout(), HOST_BLOCKS, remote=config)
    w.store(1, list(range(16)), list(range(16)))
    one(w, 1)
    keys = [f"k{i}".encode() for i in range(16)]
    w.put_remote(2, list(range(16)), keys)
    assert one(w, 2).ok
    results: list[TransferResult] = []
    stop = threading.Event()

    def traffic() -> None:
        job = 10
        while not stop.is_set():
            w.put_remote(job, list(range(8)), [f"p{job}-{i}".encode() for i in range(8)])
            try:
                w.get_remote(job + 1, keys, list(range(16, 32)))
            except BlockConflictError:  # an abandoned get still holds the rows: wait until it returned
                results.extend(w.wait([job], WAIT_S))
                assert w.remote_wait_idle(WAIT_S)
                job += 2
                continue
            results.extend(w.wait([job, job + 1], WAIT_S))
            job += 2

    thread = threading.Thread(target=traffic)
    thread.start()
    time.sleep(0.5)
    c.services.kill()
    killed_at = len(results)
    time.sleep(8.0)
    stop.set()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "a job did not finish: waits are bounded by each job's deadline"
    after = results[killed_at + 2 :]
    assert after and all(not r.ok for r in after)
    manager = Manager.create(4, fingerprint=b"fp", remote=index, remote_timeout_s=0.5)
    assert manager.lookup([b"k0"]) == 0, "a lookup against a dead store is a miss"
    assert w.remote_wait_idle(WAIT_S), "every abandoned call returned"
    w.shutdown(30)  # clean: no ShutdownError
    stats = w.remote_stats()
    assert stats is not None and stats.failed_get_jobs >= 1
    index.close(timeout=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_paused_server_keeps_a_timed_out_gets_rows_booked_until_its_call_returned(
    backend: str, fresh_cluster: Callable[..., Cluster], prefix: str
) -> None:
    c = fresh_cluster(backend)
    extra = {"socket_timeout_s": 3.0} if backend == "redis" else {}
    with Worker.create(make_layout(), HOST_BLOCKS, remote=c.remote_config(prefix, job_timeout_s=0.5, **extra)) as w:
        w.store(1, [0, 1], [0, 1])
        one(w, 1)
        w.put_remote(2, [0, 1], [b"a", b"b"])
        assert one(w, 2).ok
        c.services.pause()
        try:
            w.get_remote(3, [b"a", b"b"], [4, 5])
            result = one(w, 3)
            assert isinstance(result.error, RemoteTimeoutError)
            if not result.error.settled:
                stats = w.remote_stats()
                assert stats is not None and stats.held_jobs == 1
                with pytest.raises(BlockConflictError, match="abandoned store call"):
                    w.store(4, [9], [4])
        finally:
            c.services.resume()
        assert w.remote_wait_idle(WAIT_S)
        assert not w.host_records()[4:6].any()
        w.store(4, [9], [4])
        assert one(w, 4).ok


def test_a_full_store_fails_the_puts_store_full(fresh_cluster: Callable[..., Cluster], prefix: str) -> None:
    c = fresh_cluster("redis", maxmemory_bytes=4 << 20, policy="noeviction")
    layout = make_layout(record=256 << 10, blocks=64)
    with Worker.create(layout, 64, remote=c.remote_config(prefix, batch_records=8)) as w:
        w.store(1, list(range(64)), list(range(64)))
        one(w, 1)
        w.put_remote(2, list(range(64)), [f"f{i}".encode() for i in range(64)])
        result = one(w, 2)
        assert not result.ok and isinstance(result.error, RemoteError) and result.error.kind == "store_full"
        stats = w.remote_stats()
        assert stats is not None and stats.failures["store_full"] > 0 and stats.records_put > 0
        w.get_remote(3, [f"f{i}".encode() for i in range(64)], list(range(64)))
        got = one(w, 3)
        assert isinstance(got.error, RemoteError) and got.error.kind == "not_found", "never stored: a clean miss"
