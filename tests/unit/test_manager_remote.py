"""The Manager's remote tier: lookups past the local tiers (batched, deadline-bounded, a miss on any
error), loads from the remote store into host blocks, write-through puts, and fencing across reset."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs
import numpy as np
import pytest

from kvoffload import (
    DuplicateKeyError,
    EventKind,
    InvalidArgumentError,
    KeyStateError,
    Manager,
    RemotePutPlan,
    Tier,
    UnknownKeyError,
    namespaced_key,
)
from kvoffload.errors import ArgumentTypeError, RemoteUnavailableError
from kvoffload.testing import MemoryCluster as Cluster

FP = b"layout-fp"


@attrs.frozen
class Answer:
    succeeded: tuple[bool, ...]
    errors: tuple[object | None, ...]


class FakeIndex:
    """Holds a set of namespaced keys; records every call; may raise or fail keys on demand."""

    def __init__(self, keys: Sequence[bytes] = ()) -> None:
        self.held = {namespaced_key(FP, k) for k in keys}
        self.calls: list[tuple[list[bytes], float]] = []
        self.raise_error: Exception | None = None
        self.fail_keys: set[bytes] = set()

    def exists(self, keys: Sequence[bytes], *, timeout: float) -> Answer:
        self.calls.append((list(keys), timeout))
        if self.raise_error is not None:
            raise self.raise_error
        errors = tuple(
            RemoteUnavailableError("down", kind="unavailable") if k in self.fail_keys else None for k in keys
        )
        return Answer(tuple(k in self.held for k in keys), errors)


def store_keys(m: Manager, keys: list[bytes]) -> None:
    plan = m.prepare_store(keys)
    assert plan is not None
    m.complete_store(plan, True)


def test_lookup_extends_past_the_local_prefix_into_the_store_in_one_call() -> None:
    index = FakeIndex([b"r1", b"r2", b"r4"])
    m = Manager.create(8, fingerprint=FP, remote=index, remote_timeout_s=0.25)
    store_keys(m, [b"a"])
    assert m.lookup([b"a", b"r1", b"r2", b"r3", b"r4"]) == 3
    assert index.calls == [([namespaced_key(FP, k) for k in (b"r1", b"r2", b"r3", b"r4")], 0.25)]
    assert m.lookup([b"a"]) == 1 and len(index.calls) == 1, "a local hit of every key asks nothing"
    stats = m.stats()
    assert (stats.lookup_hits, stats.remote_lookup_keys, stats.remote_lookup_hits) == (4, 4, 2)


def test_a_key_held_locally_but_not_ready_ends_the_remote_run() -> None:
    index = FakeIndex([b"r1", b"p", b"r2"])
    m = Manager.create(8, fingerprint=FP, remote=index)
    pending = m.prepare_store([b"p"])
    assert pending is not None
    assert m.lookup([b"r1", b"p", b"r2"]) == 1
    assert index.calls[-1][0] == [namespaced_key(FP, b"r1")]
    assert m.lookup([b"p", b"r2"]) == 0 and len(index.calls) == 1, "nothing to ask: the first key is pending"


@pytest.mark.parametrize("fault", ["raises", "key-error"])
def test_a_failing_index_is_a_miss_never_an_error(fault: str) -> None:
    index = FakeIndex([b"r1", b"r2"])
    if fault == "raises":
        index.raise_error = TimeoutError("the store did not answer")
    else:
        index.fail_keys = {namespaced_key(FP, b"r1")}
    m = Manager.create(8, fingerprint=FP, remote=index)
    assert m.lookup([b"r1", b"r2"]) == 0
    assert m.stats().remote_lookup_errors == 1


def test_a_lookup_against_a_stuck_store_returns_at_its_deadline_as_a_miss() -> None:
    cluster = Cluster()
    store = cluster.factory(np.zeros((1, 4096), np.uint8), "fp")
    gate = threading.Event()
    cluster.client.gate = gate
    m = Manager.create(8, fingerprint=FP, remote=store, remote_timeout_s=0.2)
    out: list[int] = []
    thread = threading.Thread(target=lambda: out.append(m.lookup([b"k"])))
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and out == [0], "the lookup returned (a miss) while the store hung"
    assert m.stats().remote_lookup_errors == 1
    gate.set()
    store.close()


def test_prepare_load_reads_remote_keys_into_pending_host_blocks() -> None:
    index = FakeIndex([b"r1", b"r2"])
    m = Manager.create(4, fingerprint=FP, remote=index)
    store_keys(m, [b"a"])
    n = m.lookup([b"a", b"r1", b"r2"])
    plan = m.prepare_load([b"a", b"r1", b"r2"][:n])
    assert plan.tiers == (Tier.HOST, Tier.REMOTE, Tier.REMOTE)
    assert len(set(plan.blocks)) == 3
    assert m.stats().host.pending == 2 and m.stats().host.loading == 1
    with pytest.raises(KeyStateError):
        m.prepare_load([b"r1"])  # its read is in flight
    assert m.lookup([b"r1"]) == 0, "a pending remote load is not a hit for another request"
    m.complete_load(plan, [b"r1", b"a"], ok=True)
    m.complete_load(plan, [b"r2"], ok=False)
    calls = len(index.calls)
    assert m.lookup([b"r1"]) == 1 and m.lookup([b"r2"]) == 0
    assert len(index.calls) == calls, "r1 is a local hit now; r2 failed: not asked again"
    assert [e for e in m.events() if e.key != b"a"] == [(EventKind.STORED, b"r1", Tier.HOST)]
    host = m.stats().host
    assert (host.free, host.pending, host.ready, host.loading) == (2, 0, 2, 0)
    stats = m.stats()
    assert (stats.remote_loads_planned, stats.remote_loads_completed, stats.remote_loads_failed) == (2, 1, 1)
    again = m.prepare_load([b"r1"])
    assert again.tiers == (Tier.HOST,), "once read, a key is a local hit"


def test_remote_loads_evict_other_host_copies_never_the_requests_and_stop_when_full() -> None:
    index = FakeIndex([b"r1", b"r2", b"r3"])
    m = Manager.create(3, fingerprint=FP, remote=index)
    store_keys(m, [b"a", b"b", b"c"])
    m.events()
    plan = m.prepare_load([b"a", b"r1", b"r2"])
    assert plan.tiers == (Tier.HOST, Tier.REMOTE, Tier.REMOTE)
    assert {e.key for e in m.events() if e.kind is EventKind.REMOVED} == {b"b", b"c"}
    held = m.prepare_load([b"r3"])
    assert held.keys == () and held.tiers == (), "no host block to read into: the plan stops before it"
    m.complete_load(plan, ok=True)
    m.complete_load(held)


def test_without_a_remote_index_an_unknown_key_is_refused() -> None:
    m = Manager.create(4, fingerprint=FP)
    with pytest.raises(UnknownKeyError):
        m.prepare_load([b"nowhere"])
    with pytest.raises(InvalidArgumentError, match="no remote index"):
        m.prepare_remote_put([b"a"])
    with pytest.raises(ArgumentTypeError, match="exists"):
        Manager.create(4, fingerprint=FP, remote=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="remote_timeout_s"):
        Manager.create(4, fingerprint=FP, remote=FakeIndex(), remote_timeout_s=0)
    for bad in (float("nan"), 10**400):  # refused without a remote index too
        with pytest.raises(InvalidArgumentError, match="remote_timeout_s = .* must be finite and > 0"):
            Manager.create(4, fingerprint=FP, remote_timeout_s=bad)
    with pytest.raises(ArgumentTypeError, match="remote_timeout_s = 'x' must be a number"):
        Manager.create(4, fingerprint=FP, remote_timeout_s="x")  # type: ignore[arg-type]


def test_open_remote_index_checks_its_fingerprint() -> None:
    from kvoffload.remote import RemoteConfig
    from kvoffload.remote.config import open_remote_index

    config = RemoteConfig(store=lambda rows, fp: FakeIndex())  # type: ignore[arg-type, return-value]
    with pytest.raises(ArgumentTypeError, match=r"fingerprint = b'f' must be a str"):
        open_remote_index(config, fingerprint=b"f")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="fingerprint = '' must not be empty"):
        open_remote_index(config, fingerprint="")


def test_a_policy_that_raises_in_a_remote_put_raises_from_that_call_not_a_later_one() -> None:
    from kvoffload import LRUPolicy, PolicyError, RemotePutPlan

    class BadHold(LRUPolicy):
        def hold(self, key: bytes) -> None:
            super().hold(key)
            raise RuntimeError("hold broke")

    m = Manager.create(4, fingerprint=FP, remote=FakeIndex(), policy=BadHold)
    store_keys(m, [b"a", b"b"])
    with pytest.raises(PolicyError, match="hold") as info:
        m.prepare_remote_put([b"a"])
    put = info.value.result
    assert isinstance(put, RemotePutPlan) and put.keys == (b"a",)
    m.touch([b"b"])  # nothing kept for a later call
    m.complete_remote_put(put, True)
    assert m.prepare_remote_put([b"a"]).keys == ()  # the store holds it now


def test_write_through_puts_hold_the_host_copies_and_remember_what_the_store_holds() -> None:
    m = Manager.create(2, fingerprint=FP, remote=FakeIndex())
    store_keys(m, [b"a", b"b"])
    put = m.prepare_remote_put([b"a", b"b", b"unknown"])
    assert put.keys == (b"a", b"b")
    assert put.remote_keys == (namespaced_key(FP, b"a"), namespaced_key(FP, b"b"))
    assert m.prepare_remote_put([b"a"]).keys == (), "a put of it is outstanding"
    assert m.prepare_store([b"c"]) is None, "held host copies are not evictable"
    with pytest.raises(DuplicateKeyError):
        m.prepare_remote_put([b"a", b"a"])
    m.complete_remote_put(put, ok=False)
    retry = m.prepare_remote_put([b"a", b"b"])
    assert retry.keys == (b"a", b"b"), "a failed put is tried again"
    m.complete_remote_put(retry, ok=True)
    assert m.prepare_remote_put([b"a", b"b"]).keys == (), "the store holds them"
    with pytest.raises(KeyStateError, match="already completed"):
        m.complete_remote_put(retry, ok=True)
    stats = m.stats()
    assert (stats.remote_puts_planned, stats.remote_puts_completed, stats.remote_puts_failed) == (4, 2, 2)
    assert m.prepare_store([b"c"]) is not None, "released: evictable again"


def test_a_key_read_from_the_store_is_never_put_back() -> None:
    m = Manager.create(2, fingerprint=FP, remote=FakeIndex([b"r"]))
    plan = m.prepare_load([b"r"])
    m.complete_load(plan, ok=True)
    assert m.prepare_remote_put([b"r"]).keys == ()


def test_reset_fences_the_blocks_of_outstanding_remote_reads_and_puts() -> None:
    m = Manager.create(3, fingerprint=FP, remote=FakeIndex([b"r"]))
    store_keys(m, [b"a"])
    put = m.prepare_remote_put([b"a"])
    load = m.prepare_load([b"r"])
    m.reset()
    host = m.stats().host
    assert host.fenced == 2 and host.free == 1, "a put still reads, a get still writes, their blocks"
    m.complete_remote_put(put, ok=True)  # stale: only unfences
    m.complete_load(load, ok=True)
    host = m.stats().host
    assert (host.fenced, host.free) == (0, 3)
    assert m.lookup([b"a"]) == 0


def test_remote_put_plans_belong_to_their_manager() -> None:
    a = Manager.create(2, fingerprint=FP, remote=FakeIndex())
    b = Manager.create(2, fingerprint=FP, remote=FakeIndex())
    store_keys(a, [b"k"])
    plan = a.prepare_remote_put([b"k"])
    assert isinstance(plan, RemotePutPlan)
    with pytest.raises(InvalidArgumentError, match="another Manager"):
        b.complete_remote_put(plan, ok=True)
    with pytest.raises(ArgumentTypeError):
        a.complete_remote_put(plan, ok=1)  # type: ignore[arg-type]


def test_the_keys_whose_remote_load_failed_are_remembered_up_to_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.manager import remote

    monkeypatch.setattr(remote, "FAILED_KEYS_MAX", 2)
    index = FakeIndex([b"x", b"y", b"z"])
    m = Manager.create(4, fingerprint=FP, remote=index)
    for key in (b"x", b"y", b"z"):
        m.complete_load(m.prepare_load([key]), ok=False)
    assert m.lookup([b"y"]) == 0 and m.lookup([b"z"]) == 0
    assert m.lookup([b"x"]) == 1, "the oldest failure was forgotten: x is offered again"


def test_a_key_too_long_for_a_remote_name_ends_the_lookup_run_and_is_never_asked() -> None:
    """(The store refused the whole batch for it, so the hits before it counted as misses too:
    found by an audit.)"""
    from kvoffload._record import MAX_KEY_BYTES
    from kvoffload.manager.remote import REMOTE_NAME_MAX_BYTES

    assert REMOTE_NAME_MAX_BYTES == MAX_KEY_BYTES
    long_key = b"x" * REMOTE_NAME_MAX_BYTES
    index = FakeIndex([b"r1", b"r2", long_key])
    m = Manager.create(8, fingerprint=FP, remote=index)
    assert m.lookup([b"r1", b"r2", long_key, b"r3"]) == 2
    assert index.calls[-1][0] == [namespaced_key(FP, b"r1"), namespaced_key(FP, b"r2")]
    assert all(len(name) <= REMOTE_NAME_MAX_BYTES for call, _ in index.calls for name in call)


@pytest.mark.parametrize("why", ["failed", "too-long"])
def test_prepare_load_refuses_a_key_the_store_cannot_serve_before_it_evicts_anything(why: str) -> None:
    """A key whose remote load failed, or whose remote name would be too long, is one ``lookup``
    never counts; ``prepare_load`` took it all the same and evicted ready host copies to read it
    into (found by an audit). Now it is refused first, and nothing changes."""
    from kvoffload.manager.remote import REMOTE_NAME_MAX_BYTES

    key = b"gone" if why == "failed" else b"x" * REMOTE_NAME_MAX_BYTES
    m = Manager.create(2, fingerprint=FP, remote=FakeIndex([b"gone", key]))
    if why == "failed":
        m.complete_load(m.prepare_load([key]), ok=False)
    store_keys(m, [b"a", b"b"])
    m.events()
    before = m.stats()
    with pytest.raises(UnknownKeyError, match=r"keys\[1\] = .* remote store cannot serve it: its "
                       + ("remote load failed" if why == "failed" else "remote name would have")):
        m.prepare_load([b"a", key])
    assert m.stats() == before and m.events() == [], "the refused call evicted or counted something"
    assert m.prepare_load([b"a", b"b"]).tiers == (Tier.HOST, Tier.HOST)


@pytest.mark.parametrize("rows", [0, 1, 4], ids=["none", "fewer", "more"])
def test_an_answer_of_another_length_than_the_keys_asked_is_a_miss(rows: int) -> None:
    """(An answer with more rows than keys made a lookup of one key count 4 hits: found by an
    audit.)"""
    class Garbled(FakeIndex):
        def exists(self, keys: Sequence[bytes], *, timeout: float) -> Answer:
            return Answer((True,) * rows, (None,) * rows)

    m = Manager.create(8, fingerprint=FP, remote=Garbled())
    assert m.lookup([b"a", b"b"]) == 0
    stats = m.stats()
    assert (stats.lookup_hits, stats.remote_lookup_hits, stats.remote_lookup_errors) == (0, 0, 1)
