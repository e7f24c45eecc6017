"""Both remote stores against real services: round trips, verification, failures, deadlines, close."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvoffload.errors import (
    ArgumentTypeError,
    BlockIdTypeError,
    ClosedError,
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidBlockIdError,
    KeyTypeError,
    KVOffloadError,
    RemoteIntegrityError,
    RemoteMissError,
    RemoteTimeoutError,
)
from kvoffload.remote import RemoteOp, RemoteResult
from kvoffload._record import PAGE_BYTES
from kvoffload.testing import RedisClusterServices
from tests.remote.conftest import BACKENDS, Cluster, random_rows

RECORD = 64 << 10
#: How far past its deadline a call may return: the lane notices a passed deadline between chunks.
DEADLINE_SLACK_S = 2.0

U8 = np.ndarray[Any, np.dtype[np.uint8]]


def keys_for(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def assert_zero_rows(rows: U8, ids: list[int]) -> None:
    for r in ids:
        assert not rows[r].any(), f"row {r} of a failed get is not zero-filled"


def test_round_trip_is_bit_exact_over_several_chunks(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(96, RECORD)
    store = cluster.store(rows, prefix=prefix, batch_records=8)
    keys = keys_for(40)
    put = store.put(keys, list(range(40)), timeout=30)
    assert put.ok, put.error
    assert all(put.succeeded) and all(g > 0 for g in put.generations)
    rows[48:88] = 0x5A
    got = store.get(keys, list(range(48, 88)), timeout=30)
    assert got.ok, got.error
    assert np.array_equal(rows[48:88], rows[:40])
    assert got.generations == put.generations
    assert got.nbytes == 40 * (PAGE_BYTES + RECORD)
    stats = store.stats()
    assert (stats.records_put, stats.records_got) == (40, 40)
    assert sum(stats.failures.values()) == 0


def test_missing_key_is_a_clean_miss_and_its_row_is_zero_filled(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(8, RECORD)
    store = cluster.store(rows, prefix=prefix)
    assert store.put([b"here"], [0], timeout=30).ok
    result = store.get([b"here", b"never-stored"], [1, 2], timeout=30)
    assert result.succeeded == (True, False) and result.failed == (1,)
    assert isinstance(result.errors[1], RemoteMissError) and result.errors[1].kind == "not_found"
    assert np.array_equal(rows[1], rows[0])
    assert_zero_rows(rows, [2])
    assert store.stats().failures["not_found"] == 1


def test_a_flipped_payload_byte_is_never_served(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(4, RECORD)
    store = cluster.store(rows, prefix=prefix)
    assert store.put([b"victim"], [0], timeout=30).ok
    value = bytearray(cluster.raw_get(prefix, b"victim"))
    assert len(value) == PAGE_BYTES + RECORD
    value[PAGE_BYTES + 12345] ^= 0x01
    cluster.raw_set(prefix, b"victim", bytes(value))
    rows[1] = 0xEE
    result = store.get([b"victim"], [1], timeout=30)
    assert not result.ok
    assert isinstance(result.error, RemoteIntegrityError) and result.error.kind == "checksum_mismatch"
    assert_zero_rows(rows, [1])
    assert store.stats().failures["checksum_mismatch"] == 1


def test_a_flipped_header_byte_is_never_served(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(4, RECORD)
    store = cluster.store(rows, prefix=prefix)
    assert store.put([b"victim"], [0], timeout=30).ok
    value = bytearray(cluster.raw_get(prefix, b"victim"))
    value[60] ^= 0x80  # inside the key: only the header CRC can tell
    cluster.raw_set(prefix, b"victim", bytes(value))
    result = store.get([b"victim"], [1], timeout=30)
    assert result.error is not None and result.error.kind == "header_invalid"
    assert_zero_rows(rows, [1])


def test_a_record_of_another_fingerprint_is_refused(cluster: Cluster, prefix: str) -> None:
    rows_a = random_rows(4, RECORD, seed=1)
    rows_b = random_rows(4, RECORD, seed=2)
    writer = cluster.store(rows_a, "layout-A", prefix=prefix)
    reader = cluster.store(rows_b, "layout-B", prefix=prefix)
    assert writer.put([b"shared"], [0], timeout=30).ok
    result = reader.get([b"shared"], [0], timeout=30)
    assert result.error is not None and result.error.kind == "fingerprint_mismatch"
    assert_zero_rows(rows_b, [0])
    same = cluster.store(rows_b, "layout-A", prefix=prefix)
    assert same.get([b"shared"], [1], timeout=30).ok
    assert np.array_equal(rows_b[1], rows_a[0])


def test_a_record_stored_under_another_key_is_refused(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(4, RECORD)
    store = cluster.store(rows, prefix=prefix)
    assert store.put([b"one"], [0], timeout=30).ok
    cluster.raw_set(prefix, b"two", cluster.raw_get(prefix, b"one"))
    result = store.get([b"two"], [1], timeout=30)
    assert result.error is not None and result.error.kind == "key_mismatch"
    assert_zero_rows(rows, [1])


def test_a_value_of_another_size_is_refused(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(4, RECORD)
    store = cluster.store(rows, prefix=prefix)
    cluster.raw_set(prefix, b"short", b"x" * 1000)
    rows[1] = 0xEE
    result = store.get([b"short"], [1], timeout=30)
    assert result.error is not None and result.error.kind == "size_mismatch"
    assert_zero_rows(rows, [1])


def test_an_unexpected_generation_is_refused(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(4, RECORD)
    store = cluster.store(rows, prefix=prefix)
    put = store.put([b"g"], [0], timeout=30)
    assert put.ok
    wrong = store.get([b"g"], [1], timeout=30, generations=[put.generations[0] + 1])
    assert wrong.error is not None and wrong.error.kind == "generation_mismatch"
    assert_zero_rows(rows, [1])
    right = store.get([b"g"], [2], timeout=30, generations=[put.generations[0]])
    assert right.ok and np.array_equal(rows[2], rows[0])


def test_a_put_never_replaces_a_stored_record(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(4, RECORD)
    store = cluster.store(rows, prefix=prefix)
    first = store.put([b"k"], [0], timeout=30)
    second = store.put([b"k"], [1], timeout=30)
    assert first.ok and second.ok
    got = store.get([b"k"], [2], timeout=30)
    assert got.ok and got.generations == first.generations
    assert np.array_equal(rows[2], rows[0])


def test_exists_and_remove_report_key_by_key(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(4, RECORD)
    store = cluster.store(rows, prefix=prefix)
    assert store.put([b"a", b"b"], [0, 1], timeout=30).ok
    found = store.exists([b"a", b"b", b"c"], timeout=30)
    assert found.ok and found.succeeded == (True, True, False) and found.op is RemoteOp.EXISTS
    removed = store.remove([b"a", b"c"], timeout=30)
    assert removed.ok and removed.succeeded == (True, True)
    assert store.exists([b"a", b"b"], timeout=30).succeeded == (False, True)
    miss = store.get([b"a"], [2], timeout=30)
    assert isinstance(miss.error, RemoteMissError)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.put("abc", [0], timeout=1), KeyTypeError),
        (lambda s: s.put([b"a", "b"], [0, 1], timeout=1), KeyTypeError),
        (lambda s: s.put([b""], [0], timeout=1), InvalidArgumentError),
        (lambda s: s.put([b"x" * 1025], [0], timeout=1), InvalidArgumentError),
        (lambda s: s.put([b"a", b"a"], [0, 1], timeout=1), DuplicateKeyError),
        (lambda s: s.put([b"a"], [0, 1], timeout=1), InvalidBlockIdError),
        (lambda s: s.put([b"a"], [8], timeout=1), InvalidBlockIdError),
        (lambda s: s.put([b"a"], [-1], timeout=1), InvalidBlockIdError),
        (lambda s: s.put([b"a"], [0.5], timeout=1), BlockIdTypeError),
        (lambda s: s.put([b"a"], [True], timeout=1), BlockIdTypeError),
        (lambda s: s.get([b"a", b"b"], [1, 1], timeout=1), InvalidBlockIdError),
        (lambda s: s.get([b"a"], [0], timeout=-1), InvalidArgumentError),
        (lambda s: s.get([b"a"], [0], timeout=math.nan), InvalidArgumentError),
        (lambda s: s.get([b"a"], [0], timeout=math.inf), InvalidArgumentError),
        (lambda s: s.get([b"a"], [0], timeout="1"), ArgumentTypeError),
        (lambda s: s.get([b"a"], [0], timeout=1, generations=[0]), InvalidArgumentError),
        (lambda s: s.get([b"a"], [0], timeout=1, generations=[1, 2]), InvalidArgumentError),
        (lambda s: s.exists(b"a", timeout=1), KeyTypeError),
        (lambda s: s.remove([None], timeout=1), KeyTypeError),
    ],
)
def test_bad_inputs_raise_typed_errors_before_anything_is_submitted(
    cluster: Cluster, prefix: str, call: Callable[[Any], object], error: type[Exception]
) -> None:
    rows = random_rows(8, RECORD)
    before = rows.copy()
    store = cluster.store(rows, prefix=prefix)
    with pytest.raises(error):
        call(store)
    assert store.stats().calls == 0
    assert np.array_equal(rows, before)


def test_calls_after_close_raise_closed_error_and_close_is_idempotent(cluster: Cluster, prefix: str) -> None:
    rows = random_rows(4, RECORD)
    store = cluster.store(rows, prefix=prefix)
    store.close()
    store.close()
    with pytest.raises(ClosedError):
        store.put([b"a"], [0], timeout=1)
    with pytest.raises(ClosedError):
        store.exists([b"a"], timeout=1)
    assert store.stats().closed


def _within_deadline(result: RemoteResult, timeout: float) -> None:
    assert result.seconds <= timeout + DEADLINE_SLACK_S, f"a call took {result.seconds:.2f} s with a {timeout} s deadline"


@pytest.mark.parametrize("backend", BACKENDS)
def test_server_killed_mid_traffic_fails_every_call_within_its_deadline_and_close_is_clean(
    backend: str, fresh_cluster: Callable[..., Cluster], prefix: str
) -> None:
    c = fresh_cluster(backend)
    rows = random_rows(64, RECORD)
    expected = rows[:32].copy()
    store = c.store(rows, prefix=prefix, batch_records=4)
    keys = keys_for(32)
    assert store.put(keys, list(range(32)), timeout=30).ok
    timeout = 3.0
    results: list[RemoteResult] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            results.append(store.put(keys_for(8, "p"), list(range(8)), timeout=timeout))
            results.append(store.get(keys, list(range(32, 64)), timeout=timeout))
            got = results[-1]
            for i, ok in enumerate(got.succeeded):
                if ok:
                    assert np.array_equal(rows[32 + i], expected[i]), "a served row differs from its record"
            if got.settled:
                assert_zero_rows(rows, [32 + i for i in got.failed])

    thread = threading.Thread(target=traffic)
    thread.start()
    time.sleep(0.5)
    c.services.kill()
    killed_at = len(results)
    time.sleep(2 * timeout + 2 * DEADLINE_SLACK_S)
    stop.set()
    thread.join(60)
    assert not thread.is_alive()
    after = results[killed_at + 2 :]  # the two calls in flight at the kill may still have succeeded
    assert after, "no call was made after the kill"
    for result in results:
        _within_deadline(result, timeout)
    for result in after:
        assert not result.ok and not any(result.succeeded)
        assert {e.kind for e in result.errors if e is not None} <= {"unavailable", "timeout", "not_found", "transfer_failed", "rejected"}
    assert store.wait_idle(30)
    store.close(timeout=30)
    stats = store.stats()
    assert stats.closed and stats.busy == 0


@pytest.mark.parametrize("failed", [False, True], ids=["at-once", "after-the-cluster-marked-it-failed"])
def test_a_dead_redis_node_fails_only_its_own_keys_of_a_chunk(
    failed: bool, fresh_cluster: Callable[..., Cluster], prefix: str
) -> None:
    """One of three nodes killed: every chunk spans all three, and the keys of the live nodes are
    still put and served bit-exact; the dead node's keys fail as ``unavailable``, their rows zero.
    (A chunk used to fail whole: the cluster pipeline raised for the one refused connection.)"""
    c = fresh_cluster("redis", require_full_coverage=False)
    assert isinstance(c.services, RedisClusterServices)
    n = 48
    rows = random_rows(2 * n, RECORD)
    expected = rows[:n].copy()
    store = c.store(rows, prefix=prefix, batch_records=n)
    keys = keys_for(n)
    assert store.put(keys, list(range(n)), timeout=30).ok
    dead_port = c.services.ports[1]
    on_dead = [c.raw().get_node_from_key(prefix.encode() + key).port == dead_port for key in keys]
    assert 0 < sum(on_dead) < n, "the keys span the killed node and the others"
    c.services.kill_node(1)
    if failed:  # past the cluster's node timeout (2 s): the live nodes have marked it failed
        time.sleep(4.0)
    got = store.get(keys, list(range(n, 2 * n)), timeout=30)
    assert list(got.succeeded) == [not dead for dead in on_dead]
    for i, dead in enumerate(on_dead):
        if dead:
            error = got.errors[i]
            assert error is not None and error.kind == "unavailable", error
        else:
            assert np.array_equal(rows[n + i], expected[i]), f"key {i} served wrong bytes"
    assert_zero_rows(rows, [n + i for i, dead in enumerate(on_dead) if dead])
    assert list(store.exists(keys, timeout=30).succeeded) == [not dead for dead in on_dead]
    fresh = keys_for(n, "new")
    on_dead = [c.raw().get_node_from_key(prefix.encode() + key).port == dead_port for key in fresh]
    put = store.put(fresh, list(range(n)), timeout=30)
    assert list(put.succeeded) == [not dead for dead in on_dead]
    store.close(timeout=30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_paused_server_times_out_unsettled_and_the_rows_are_zero_once_idle(
    backend: str, fresh_cluster: Callable[..., Cluster], prefix: str
) -> None:
    c = fresh_cluster(backend)
    rows = random_rows(8, RECORD)
    config: dict[str, Any] = {"socket_timeout_s": 3.0} if backend == "redis" else {}
    store = c.store(rows, prefix=prefix, **config)
    assert store.put([b"a", b"b"], [0, 1], timeout=30).ok
    c.services.pause()
    try:
        result = store.get([b"a", b"b"], [4, 5], timeout=0.5)
        _within_deadline(result, 0.5)
        assert not result.ok
        assert all(isinstance(e, RemoteTimeoutError) for e in result.errors)
        queued = store.get([b"a"], [6], timeout=0.2)  # behind the stuck call: never started
        assert queued.settled and isinstance(queued.error, RemoteTimeoutError)
        assert_zero_rows(rows, [6])
        # A put that never started leaves its source row as it was (it was zero-filled, a host
        # copy the Manager still offered: found by an audit). Row 7 is not a get's row.
        source = rows[7].copy()
        queued_put = store.put([b"c"], [7], timeout=0.2)
        assert queued_put.settled and isinstance(queued_put.error, RemoteTimeoutError)
        assert np.array_equal(rows[7], source), "a put that never ran changed its source row"
        if not result.settled:
            assert store.stats().busy == 1
    finally:
        c.services.resume()
    assert store.wait_idle(60)
    assert_zero_rows(rows, [4, 5])
    assert np.array_equal(rows[7], source)
    assert store.stats().busy == 0
    store.close(timeout=30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_close_that_cancels_a_queued_put_leaves_its_source_row(
    backend: str, fresh_cluster: Callable[..., Cluster], prefix: str
) -> None:
    """(A put cancelled by ``close`` zero-filled the rows it was to read: found by an audit.)"""
    c = fresh_cluster(backend)
    rows = random_rows(4, RECORD)
    config: dict[str, Any] = {"socket_timeout_s": 3.0} if backend == "redis" else {}
    store = c.store(rows, prefix=prefix, **config)
    assert store.put([b"warm"], [3], timeout=30).ok
    source = rows[:2].copy()
    c.services.pause()
    results: list[RemoteResult] = []
    try:
        stuck = threading.Thread(target=lambda: results.append(store.get([b"warm"], [2], timeout=30)))
        stuck.start()
        wait_busy = time.monotonic() + 10
        while store.stats().busy == 0 and time.monotonic() < wait_busy:
            time.sleep(0.01)
        queued = threading.Thread(target=lambda: results.append(store.put([b"a", b"b"], [0, 1], timeout=30)))
        queued.start()
        time.sleep(0.2)  # the put waits behind the stuck get
        with contextlib.suppress(KVOffloadError):
            store.close(timeout=0.3)
        queued.join(30)
        assert not queued.is_alive()
        assert np.array_equal(rows[:2], source), "a cancelled put changed its source rows"
    finally:
        c.services.resume()
    stuck.join(60)
    assert not stuck.is_alive()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_store_fails_or_evicts_and_an_evicted_key_is_a_clean_miss(
    backend: str, fresh_cluster: Callable[..., Cluster], prefix: str
) -> None:
    record = 256 << 10
    if backend == "mooncake":
        c = fresh_cluster(backend, segment_bytes=16 << 20, lease_ttl_ms=50)
    else:
        c = fresh_cluster(backend, maxmemory_bytes=8 << 20, policy="allkeys-lru")
    total = 200  # ~50 MiB of records into ~16-24 MiB of store
    rows = random_rows(total + 8, record)
    originals = rows[:total].copy()
    store = c.store(rows, prefix=prefix, batch_records=8)
    keys = keys_for(total)
    put_ok: list[bool] = []
    for start in range(0, total, 8):
        result = store.put(keys[start : start + 8], list(range(start, start + 8)), timeout=30)
        for e in result.errors:
            assert e is None or e.kind == "store_full", e
        put_ok.extend(result.succeeded)
        time.sleep(0.06)  # let leases run out so that the master may evict
    got_ok = []
    for i, key in enumerate(keys):
        rows[total] = 0xEE
        got = store.get([key], [total], timeout=30)
        if got.ok:
            assert put_ok[i], "a key whose put failed was served"
            assert np.array_equal(rows[total], originals[i])
        else:
            assert got.error is not None and got.error.kind == "not_found", got.error
            assert_zero_rows(rows, [total])
        got_ok.append(got.ok)
    refused = put_ok.count(False)
    evicted = sum(1 for p, g in zip(put_ok, got_ok) if p and not g)
    assert refused + evicted > 0, "the store never became full"
    if backend == "redis":
        assert evicted > 0, "allkeys-lru should have evicted"
    stats = store.stats()
    assert stats.failures["store_full"] == refused
    assert stats.failures["not_found"] == got_ok.count(False)
