"""The worker with a remote tier, on the host backend over a scripted store (the real store
machinery): round trips, every failure kind a typed job error with its counter, the conflict rules
on host blocks, a timed-out get's rows held until its call returned (proved against the hazard),
bad inputs, creation and the shutdown order.

The stores against real services are in tests/remote."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvoffload import (
    BlockConflictError,
    ClosedError,
    DeviceLayout,
    Direction,
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidBlockIdError,
    JobIdError,
    KeyTypeError,
    RemoteConfig,
    RemoteIntegrityError,
    RemoteMissError,
    RemoteShutdownError,
    RemoteTimeoutError,
    RemoteUnavailableError,
    ShutdownError,
    TransferResult,
    Worker,
)
from kvoffload._record import PAGE_BYTES
from kvoffload.cli._caches import build_cache
from kvoffload.remote.tier import RemoteTier
from kvoffload.testing import MemoryCluster as Cluster

TIMEOUT_S = 60.0
NUM_BLOCKS = 32
HOST_BLOCKS = 16


def make_layout(seed: int = 0, model_id: str = "") -> DeviceLayout:
    tensors, block_dim = build_cache("per-layer", num_blocks=NUM_BLOCKS, layers=2, kv_heads=2,
                                     head_dim=64, block_size=8, dtype=torch.bfloat16,
                                     device=torch.device("cpu"), seed=seed)
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim, model_id=model_id)


def make_worker(cluster: Cluster, *, job_timeout_s: float = TIMEOUT_S, seed: int = 0,
                model_id: str = "") -> Worker:
    return Worker.create(make_layout(seed, model_id), HOST_BLOCKS,
                         remote=RemoteConfig(store=cluster.factory, job_timeout_s=job_timeout_s))


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


@pytest.fixture
def worker(cluster: Cluster) -> Iterator[Worker]:
    with make_worker(cluster) as w:
        yield w


def one(worker: Worker, job_id: int) -> TransferResult:
    (result,) = worker.wait([job_id], TIMEOUT_S)
    return result


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_put_then_get_then_load_is_bit_exact(worker: Worker) -> None:
    worker.store(1, [3, 4, 5, 6], [0, 1, 2, 3])
    assert one(worker, 1).ok
    worker.put_remote(2, [0, 1, 2, 3], keys(4))
    put = one(worker, 2)
    assert put.ok and put.direction is Direction.PUT_REMOTE and put.path == "memory"
    assert put.nbytes == 4 * worker.layout.record_bytes
    records = worker.host_records()
    records[8:12] = 0x5A
    worker.get_remote(3, keys(4), [8, 9, 10, 11])
    got = one(worker, 3)
    assert got.ok and got.direction is Direction.GET_REMOTE and got.error is None
    assert torch.equal(records[8:12], records[0:4])
    worker.load(4, [8, 9, 10, 11], [20, 21, 22, 23])
    assert one(worker, 4).ok
    layout = worker.layout
    assert torch.equal(layout.gather_records([20, 21, 22, 23]), layout.gather_records([3, 4, 5, 6]))
    stats = worker.remote_stats()
    assert stats is not None
    assert (stats.put_jobs, stats.get_jobs, stats.records_put, stats.records_got) == (1, 1, 4, 4)
    assert sum(stats.failures.values()) == 0 and stats.held_jobs == 0


def test_a_miss_fails_the_job_with_every_failed_key_and_zero_fills_its_rows(worker: Worker) -> None:
    worker.store(1, [0], [0])
    one(worker, 1)
    worker.put_remote(2, [0], [b"here"])
    assert one(worker, 2).ok
    records = worker.host_records()
    records[5:8] = 0xEE
    worker.get_remote(3, [b"gone", b"here", b"never"], [5, 6, 7])
    result = one(worker, 3)
    assert not result.ok
    assert isinstance(result.error, RemoteMissError) and result.error.kind == "not_found"
    assert result.error.keys == (b"gone", b"never")
    assert "2 of 3 keys failed (not_found 2)" in str(result.error) and result.error.kinds == {"not_found": 2}
    assert not records[5].any() and not records[7].any(), "a failed key's row is zero-filled"
    assert torch.equal(records[6], records[0]), "a key that succeeded holds its verified record"
    stats = worker.remote_stats()
    assert stats is not None and stats.failures["not_found"] == 2 and stats.failed_get_jobs == 1


@pytest.mark.parametrize("kind", ["store_full", "rejected", "transfer_failed"])
def test_one_keys_failure_fails_the_job_naming_that_key_and_the_others_go_through(
    worker: Worker, cluster: Cluster, kind: str,
) -> None:
    """The memory store's per-key faults, as a store reports a key it could not take."""
    from kvoffload import RemoteErrorKind, RemoteStoreError

    worker.store(1, [0, 1, 2], [0, 1, 2])
    one(worker, 1)
    cluster.faults[b"bad"] = RemoteErrorKind(kind)
    worker.put_remote(2, [0, 1, 2], [b"a", b"bad", b"c"])
    put = one(worker, 2)
    assert not put.ok and isinstance(put.error, RemoteStoreError) and put.error.kind == kind
    assert put.error.keys == (b"bad",) and sorted(cluster.data) == [b"a", b"c"]
    records = worker.host_records()
    worker.get_remote(3, [b"a", b"bad", b"c"], [5, 6, 7])
    got = one(worker, 3)
    assert not got.ok and isinstance(got.error, RemoteStoreError) and got.error.keys == (b"bad",)
    assert torch.equal(records[5], records[0]) and torch.equal(records[7], records[2])
    assert not records[6].any(), "the failed key's row is zero-filled"
    stats = worker.remote_stats()
    assert stats is not None and stats.failures[kind] == 2


@pytest.mark.parametrize("cut", [PAGE_BYTES + 1, PAGE_BYTES - 1, None], ids=["short", "no-payload", "long"])
def test_a_value_of_another_size_fails_its_key_alone(worker: Worker, cluster: Cluster, cut: int | None) -> None:
    """(The memory store copied a 1-byte payload across the whole row by broadcasting — a uniform
    record then passed its checksum — and any other wrong size failed every key of the call.)"""
    worker.host_records()[0:3] = 0  # uniform records: a payload broadcast from one byte passes its CRC
    worker.put_remote(1, [0, 1, 2], [b"a", b"b", b"c"])
    assert one(worker, 1).ok
    value = cluster.data[b"b"]
    cluster.data[b"b"] = value[:cut] if cut is not None else value + b"\0"
    worker.get_remote(2, [b"a", b"b", b"c"], [5, 6, 7])
    got = one(worker, 2)
    assert not got.ok and isinstance(got.error, RemoteIntegrityError)
    assert got.error.keys == (b"b",) and got.error.kinds == {"size_mismatch": 1}


def test_a_flipped_byte_or_another_key_is_never_served(worker: Worker, cluster: Cluster) -> None:
    worker.store(1, [0, 1], [0, 1])
    one(worker, 1)
    worker.put_remote(2, [0, 1], [b"a", b"b"])
    assert one(worker, 2).ok
    value = bytearray(cluster.data[b"a"])
    value[PAGE_BYTES + 777] ^= 0x10
    cluster.data[b"a"] = bytes(value)
    cluster.data[b"c"] = cluster.data[b"b"]  # a record stored under another key
    records = worker.host_records()
    records[4:6] = 0xEE
    worker.get_remote(3, [b"a", b"c"], [4, 5])
    result = one(worker, 3)
    assert isinstance(result.error, RemoteIntegrityError)
    assert result.error.kind == "checksum_mismatch" and result.error.keys == (b"a", b"c")
    assert result.error.kinds == {"checksum_mismatch": 1, "key_mismatch": 1}
    assert not records[4:6].any()
    stats = worker.remote_stats()
    assert stats is not None
    assert (stats.failures["checksum_mismatch"], stats.failures["key_mismatch"]) == (1, 1)


def test_a_record_of_another_layout_is_refused(cluster: Cluster) -> None:
    with make_worker(cluster, model_id="model-A") as a, make_worker(cluster, model_id="model-B") as b:
        a.store(1, [2], [0])
        one(a, 1)
        a.put_remote(2, [0], [b"shared"])
        assert one(a, 2).ok
        b.get_remote(1, [b"shared"], [3])
        result = one(b, 1)
        assert isinstance(result.error, RemoteIntegrityError)
        assert result.error.kind == "fingerprint_mismatch"
        assert not b.host_records()[3].any()


def test_a_store_that_is_down_fails_the_jobs_unavailable(worker: Worker, cluster: Cluster) -> None:
    cluster.client.down = True
    worker.put_remote(1, [0, 1], keys(2))
    worker.get_remote(2, keys(2), [2, 3])
    put, get = worker.wait([1, 2], TIMEOUT_S)
    assert isinstance(put.error, RemoteUnavailableError) and put.error.kind == "unavailable"
    assert isinstance(get.error, RemoteUnavailableError)
    stats = worker.remote_stats()
    assert stats is not None and stats.failures["unavailable"] == 4
    assert (stats.failed_put_jobs, stats.failed_get_jobs) == (1, 1)


def test_a_job_queued_past_its_deadline_fails_before_the_store_is_called(cluster: Cluster) -> None:
    with make_worker(cluster, job_timeout_s=0.3) as w:
        cluster.client.gate = threading.Event()
        w.get_remote(1, [b"x"], [0])  # holds the store until the gate opens
        w.get_remote(2, [b"y"], [1])  # waits in the tier's queue past its deadline
        first, second = w.wait([1, 2], TIMEOUT_S)
        cluster.client.gate.set()
        assert isinstance(second.error, RemoteTimeoutError)
        assert isinstance(first.error, RemoteTimeoutError) and not first.error.settled
        assert w.remote_wait_idle(TIMEOUT_S)
        stats = w.remote_stats()
        assert stats is not None and stats.failures["timeout"] == 2


def test_conflicts_on_host_blocks_are_refused_while_remote_jobs_run(worker: Worker, cluster: Cluster) -> None:
    cluster.client.gate = threading.Event()
    worker.put_remote(1, [0, 1], keys(2))  # reads host blocks 0, 1
    worker.get_remote(2, keys(2, "g"), [2, 3])  # writes host blocks 2, 3
    with pytest.raises(BlockConflictError, match=r"host_blocks\[1\] = 1 is in use by in-flight job 1"):
        worker.store(3, [0, 1], [5, 1])  # a store may not overwrite what a put reads
    with pytest.raises(BlockConflictError, match="being written by in-flight job 2"):
        worker.load(3, [3], [9])  # a load may not read what a get writes
    with pytest.raises(BlockConflictError, match="being written by in-flight job 2"):
        worker.put_remote(3, [2], [b"z"])
    with pytest.raises(BlockConflictError, match="in use by in-flight job 2"):
        worker.get_remote(3, [b"z"], [3])
    worker.load(3, [0], [9])  # reading what a put reads is fine
    worker.put_remote(4, [1], [b"again"])
    cluster.client.gate.set()
    results = {r.job_id: r for r in worker.wait([1, 2, 3, 4], TIMEOUT_S)}
    assert results[1].ok and results[3].ok and results[4].ok
    assert isinstance(results[2].error, RemoteMissError)
    worker.store(5, [0, 1], [0, 1])  # free once the results were returned
    assert one(worker, 5).ok


@pytest.mark.parametrize("rule", [False, True], ids=["control-without-the-hold", "with-the-hold"])
def test_the_rows_of_a_timed_out_get_stay_booked_until_its_call_returned(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, rule: bool
) -> None:
    """The hazard: a get abandoned at its deadline is still inside the store client, which writes
    (then zero-fills) the job's host rows after the result came back; a store into those rows
    accepted meanwhile is overwritten. The rule: the rows stay booked until the call returned."""
    if not rule:
        monkeypatch.setattr(RemoteTier, "take_unsettled", lambda self, job_id: None)
    with make_worker(cluster, job_timeout_s=0.3) as w:
        w.store(1, [7], [0])
        one(w, 1)
        w.put_remote(2, [0], [b"k"])
        assert one(w, 2).ok
        cluster.client.gate = threading.Event()
        w.get_remote(3, [b"k"], [4])
        result = one(w, 3)
        assert isinstance(result.error, RemoteTimeoutError) and not result.error.settled
        stats = w.remote_stats()
        assert stats is not None and stats.held_jobs == 1
        if rule:
            with pytest.raises(BlockConflictError, match="abandoned store call"):
                w.store(4, [9], [4])
            with pytest.raises(BlockConflictError, match="abandoned store call"):
                w.load(4, [4], [10])
        else:
            w.store(4, [9], [4])  # accepted: nothing keeps the row booked
            assert one(w, 4).ok
        cluster.client.gate.set()
        assert w.remote_wait_idle(TIMEOUT_S)
        records = w.host_records()
        assert not records[4].any(), "the abandoned get's row is zero-filled once its call returned"
        if rule:
            w.store(4, [9], [4])  # free now
            assert one(w, 4).ok
            assert torch.equal(records[4], w.layout.gather_records([9])[0]), "the store is intact"
        else:
            assert not torch.equal(records[4], w.layout.gather_records([9])[0]), "the store was lost"


def test_bad_inputs_raise_typed_errors_and_change_nothing(worker: Worker) -> None:
    with pytest.raises(InvalidArgumentError, match="keys has 1 entries but host_blocks has 2"):
        worker.put_remote(1, [0, 1], [b"a"])
    with pytest.raises(DuplicateKeyError):
        worker.put_remote(1, [0, 1], [b"a", b"a"])
    with pytest.raises(KeyTypeError):
        worker.put_remote(1, [0], ["a"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="1..1024"):
        worker.get_remote(1, [b"x" * 1025], [0])
    with pytest.raises(InvalidArgumentError, match="1..1024"):
        worker.get_remote(1, [b""], [0])
    with pytest.raises(InvalidBlockIdError, match=r"host_blocks\[1\] = 0 repeats"):
        worker.get_remote(1, [b"a", b"b"], [0, 0])
    with pytest.raises(InvalidBlockIdError, match="out of range"):
        worker.put_remote(1, [HOST_BLOCKS], [b"a"])
    with pytest.raises(JobIdError):
        worker.put_remote("1", [0], [b"a"])  # type: ignore[arg-type]
    worker.put_remote(1, [0, 0], [b"a", b"b"])  # one host record under two keys is fine
    assert one(worker, 1).ok
    stats = worker.remote_stats()
    assert stats is not None and stats.put_jobs == 1


def test_remote_jobs_need_a_remote_tier() -> None:
    with Worker.create(make_layout(), HOST_BLOCKS) as w:
        with pytest.raises(InvalidArgumentError, match="needs a remote tier"):
            w.put_remote(1, [0], [b"a"])
        with pytest.raises(InvalidArgumentError, match="needs a remote tier"):
            w.get_remote(1, [b"a"], [0])
        assert w.remote_stats() is None
        with pytest.raises(InvalidArgumentError, match="no remote tier"):
            w.remote_wait_idle(1.0)
    with pytest.raises(ClosedError):
        w.put_remote(1, [0], [b"a"])


def test_a_store_that_cannot_be_created_leaves_nothing_behind() -> None:
    def refuse(host_rows: object, fingerprint: str) -> object:
        raise RemoteUnavailableError("the cluster cannot be joined", kind="unavailable")

    before = threading.active_count()
    with pytest.raises(RemoteUnavailableError):
        Worker.create(make_layout(), HOST_BLOCKS, remote=RemoteConfig(store=refuse))  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before
    with pytest.raises(TypeError):
        Worker.create(make_layout(), HOST_BLOCKS, remote="redis")  # type: ignore[arg-type]


def test_shutdown_drains_the_remote_tier_after_the_handlers_and_before_the_region(cluster: Cluster) -> None:
    w = make_worker(cluster)
    region = w._region
    seen: dict[str, bool] = {}
    client = cluster.client
    original_close = client.close

    def close() -> None:
        seen["region released when the store closed"] = region.released
        seen["handlers stopped"] = w._store.closed and w._load.closed
        original_close()

    client.close = close  # type: ignore[method-assign]
    w.store(1, [0], [0])
    one(w, 1)
    w.put_remote(2, [0], [b"k"])
    w.shutdown(TIMEOUT_S)
    assert client.closed == 1 and region.released
    assert seen == {"region released when the store closed": False, "handlers stopped": True}
    assert cluster.data.keys() == {b"k"}, "the queued put ran before the store closed"


def test_a_store_call_stuck_at_shutdown_leaves_the_region_mapped(cluster: Cluster) -> None:
    w = make_worker(cluster)
    client = cluster.client
    client.gate = threading.Event()
    w.get_remote(1, [b"x"], [0])
    assert client.entered.wait(TIMEOUT_S)
    w.get_remote(2, [b"y"], [1])
    with pytest.raises(ShutdownError) as info:
        w.shutdown(0.5)
    assert info.value.region_left_mapped, "the client may still write the host rows"
    assert any(isinstance(f, RemoteShutdownError) and f.client_left_open for f in info.value.failures)
    assert client.closed == 0
    client.gate.set()
    deadline = time.monotonic() + TIMEOUT_S
    while client.closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.closed == 1, "the store's lane releases the client when the stuck call returns"
    w.shutdown()  # idempotent


def test_a_hold_of_one_job_does_not_outlive_a_reuse_of_its_id(cluster: Cluster) -> None:
    with make_worker(cluster, job_timeout_s=0.3) as w:
        client = cluster.client
        client.gate = threading.Event()
        w.get_remote(1, [b"x"], [0])
        assert not one(w, 1).ok
        client.gate.set()
        assert w.remote_wait_idle(TIMEOUT_S)
        client.gate = None
        w.get_remote(1, [b"x"], [1])  # the id is free again; block 0 too
        assert isinstance(one(w, 1).error, RemoteMissError)
        w.store(2, [0], [0])
        assert one(w, 2).ok
        assert np.all(w.host_records()[1].numpy() == 0)


def test_shutdown_drops_every_view_of_the_host_pool_so_the_region_is_unmapped(cluster: Cluster) -> None:
    import warnings

    w = make_worker(cluster)
    w.store(1, [0], [0])
    one(w, 1)
    w.put_remote(2, [0], [b"k"])
    w.get_remote(3, [b"k"], [1])
    w.wait([2, 3], TIMEOUT_S)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # a view still referenced would warn
        w.shutdown(TIMEOUT_S)
    assert w._region.released


def test_a_remote_job_id_being_returned_is_refused_and_its_blocks_stay_booked(worker: Worker) -> None:
    """Another thread's ``wait`` took get 7's result from the job book and has not freed its host
    block yet: a put of id 7 is refused, and a store into that block is still refused (before, the
    put was accepted and took the get's place in the bookkeeping; the get's return then freed the
    put's blocks while the put was in flight)."""
    from kvoffload import JobIdError
    worker.put_remote(1, [0], [b"k"])
    assert one(worker, 1).ok
    worker.get_remote(7, [b"k"], [1])
    results = worker._jobs.wait([7], TIMEOUT_S)  # the first step of another thread's wait
    with pytest.raises(JobIdError, match="being returned by another thread"):
        worker.put_remote(7, [2], [b"other"])
    with pytest.raises(BlockConflictError):
        worker.store(8, [0], [1])  # the get's host block is not free until its return completed
    worker._release(results)
    worker.put_remote(7, [2], [b"other"])
    worker.store(8, [0], [1])
    assert all(r.ok for r in worker.wait([7, 8], TIMEOUT_S))
