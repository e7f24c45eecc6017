"""Unit tests of the scheduler-side block manager.

Bad inputs (typed error, state unchanged), atomicity, eviction order, demotions, events, fencing.
"""

from __future__ import annotations

import ast
import pathlib
import pickle
import re
from collections.abc import Callable, Container, Sequence
from typing import Any

import attrs
import numpy as np
import pytest

from kvoffload.errors import (
    ArgumentTypeError,
    DuplicateKeyError,
    InvalidArgumentError,
    KeyStateError,
    KeyTypeError,
    KVOffloadError,
    PolicyError,
    UnknownKeyError,
    UnknownPolicyError,
)
from kvoffload import (
    ARCPolicy,
    DiskRecordInfo,
    BlockEvent,
    EventKind,
    EvictionPolicy,
    LoadPlan,
    LRUPolicy,
    Manager,
    ManagerStats,
    StorePlan,
    Tier,
    namespaced_key,
)

A, B, C, D, E = (bytes([i]) * 8 for i in range(1, 6))
ALL = [A, B, C, D, E]


def make(host: int = 2, disk: int = 0, policy: str = "lru") -> Manager:
    return Manager.create(host, fingerprint="model-a/layout-1", num_disk_blocks=disk, policy=policy)


def stored(m: Manager, keys: Sequence[bytes]) -> StorePlan:
    """prepare_store + complete_store(ok) of ``keys``; returns the plan."""
    plan = m.prepare_store(keys)
    assert plan is not None
    m.complete_demote(plan, True)
    m.complete_store(plan, True)
    return plan


def snapshot(m: Manager) -> tuple[ManagerStats, list[bool], list[BlockEvent]]:
    """Everything observable, without leaving a trace of the observation in the counters."""
    stats = m.stats()
    ready = [m.lookup([k]) == 1 for k in ALL]
    stats_after = m.stats()
    assert stats_after.lookups == stats.lookups + len(ALL)
    return stats, ready, m.events()


def assert_unchanged(m: Manager, before: tuple[ManagerStats, list[bool], list[BlockEvent]]) -> None:
    stats, ready, _ = snapshot(m)
    lookups = len(ALL)
    expected = attrs.evolve(
        before[0],
        lookups=before[0].lookups + lookups,
        lookup_keys=before[0].lookup_keys + lookups,
        lookup_hits=before[0].lookup_hits + sum(before[1]),
    )
    assert stats == expected
    assert ready == before[1]


# ---------------------------------------------------------------------------- creation


@pytest.mark.parametrize("n", [0, -1])
def test_create_rejects_host_pool_without_blocks(n: int) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"num_host_blocks = {n} must be >= 1"):
        Manager.create(n, fingerprint="f")


def test_a_fingerprint_that_is_not_utf8_is_refused_by_name() -> None:
    """A lone surrogate raised a bare UnicodeEncodeError (found by an audit)."""
    with pytest.raises(InvalidArgumentError, match=r"fingerprint = '\\ud800' is not valid UTF-8"):
        Manager.create(2, fingerprint="\ud800")
    with pytest.raises(InvalidArgumentError, match="is not valid UTF-8"):
        namespaced_key("\ud800", b"k")


@pytest.mark.parametrize("name", ["num_host_blocks", "num_disk_blocks"])
def test_create_rejects_a_tier_over_the_most_blocks(name: str) -> None:
    from kvoffload.manager.manager import MAX_TIER_BLOCKS
    sizes = {"num_host_blocks": 4, "num_disk_blocks": 0, name: 10**12}
    with pytest.raises(InvalidArgumentError, match=rf"{name} = {10**12} is over the most blocks a tier may have"):
        Manager.create(sizes["num_host_blocks"], fingerprint="f", num_disk_blocks=sizes["num_disk_blocks"])
    sizes[name] = MAX_TIER_BLOCKS + 1
    with pytest.raises(InvalidArgumentError, match=rf"{name} = {MAX_TIER_BLOCKS + 1} is over"):
        Manager.create(sizes["num_host_blocks"], fingerprint="f", num_disk_blocks=sizes["num_disk_blocks"])


def test_create_refuses_free_lists_the_process_cannot_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvoffload.manager.manager as manager_module

    def no_memory(*args: object) -> object:
        raise MemoryError

    monkeypatch.setattr(manager_module, "Pool", no_memory)
    monkeypatch.setattr(manager_module, "host_memory_available", lambda: None)  # not Linux
    with pytest.raises(InvalidArgumentError, match=r"cannot hold their free lists"):
        Manager.create(2**30, fingerprint="f")


def test_create_refuses_free_lists_over_the_memory_available_before_building_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(2**31 blocks, under the bound, got no MemoryError on a machine that overcommits: the
    kernel killed the process while the free list was built.)"""
    import kvoffload.manager.manager as manager_module

    built: list[object] = []
    monkeypatch.setattr(manager_module, "Pool", lambda *args: built.append(args))
    monkeypatch.setattr(manager_module, "host_memory_available", lambda: (2**30, "MemAvailable"))
    with pytest.raises(InvalidArgumentError, match=r"num_host_blocks = 16777216 and num_disk_blocks = "
                       r"16777216: their free lists need about 1\.2 GiB \(40 bytes a block\), over the "
                       r"1\.0 GiB this process can populate \(MemAvailable\)"):
        Manager.create(2**24, fingerprint="f", num_disk_blocks=2**24)
    assert built == []
    Manager.create(2**24, fingerprint="f")  # 0.6 GiB: built
    assert len(built) == 1


@pytest.mark.parametrize("factory", [lambda: LRUPolicy(4), lambda capacity: 1 / 0], ids=["no-capacity", "raises"])
def test_a_policy_factory_that_raises_is_a_policy_error(factory: Any) -> None:
    """(A factory that takes no capacity raised an untyped TypeError.)"""
    with pytest.raises(PolicyError, match=r"the policy factory <lambda>\(4\) raised .*: a factory takes "
                       r"the tier's capacity"):
        Manager.create(4, fingerprint="f", policy=factory)


def test_create_rejects_negative_disk_pool() -> None:
    with pytest.raises(InvalidArgumentError, match=r"num_disk_blocks = -3 must be >= 0"):
        Manager.create(4, fingerprint="f", num_disk_blocks=-3)


@pytest.mark.parametrize("n", [1.5, "4", True, None])
def test_create_rejects_pool_sizes_that_are_not_ints(n: object) -> None:
    with pytest.raises(ArgumentTypeError, match=r"num_host_blocks = .* must be an int"):
        Manager.create(n, fingerprint="f")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Manager.create(4, fingerprint="f", num_disk_blocks=n)  # type: ignore[arg-type]


def test_create_rejects_unknown_policy_name_listing_the_known_ones() -> None:
    with pytest.raises(UnknownPolicyError, match=r"policy = 'lfu' is not one of \['arc', 'lru'\]"):
        Manager.create(4, fingerprint="f", policy="lfu")


@pytest.mark.parametrize("fp", [b"", "", None, 7])
def test_create_rejects_empty_or_non_text_fingerprint(fp: object) -> None:
    with pytest.raises(InvalidArgumentError, match="fingerprint"):
        Manager.create(4, fingerprint=fp)  # type: ignore[arg-type]


def test_policy_capacity_must_be_positive() -> None:
    with pytest.raises(InvalidArgumentError, match=r"capacity = 0 must be >= 1"):
        LRUPolicy(0)
    with pytest.raises(ArgumentTypeError):
        ARCPolicy("8")  # type: ignore[arg-type]


def test_manager_module_imports_neither_torch_nor_cuda() -> None:
    import kvoffload.manager as package

    imported: set[str] = set()
    for path in pathlib.Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                imported.add(node.module)
    assert not {name for name in imported if name.split(".")[0] in {"torch", "cuda", "numpy"}}
    ours = {name for name in imported if name.startswith("kvoffload")}
    modules = ("base", "policies", "records", "remote", "state")
    assert ours - {"kvoffload.errors", "kvoffload._seconds", "kvoffload._memory"} <= {f"kvoffload.manager.{m}" for m in modules}


# ---------------------------------------------------------------------------- namespacing


def test_namespaced_keys_differ_between_fingerprints() -> None:
    assert namespaced_key("model-a", A) != namespaced_key("model-b", A)
    assert namespaced_key("model-a", A) == namespaced_key(b"model-a", A)
    m = make()
    assert m.fingerprint == b"model-a/layout-1"
    assert m.namespaced(A) == namespaced_key("model-a/layout-1", A)
    assert m.namespaced(A).endswith(A)


def test_namespace_prefix_has_fixed_length_so_boundaries_cannot_shift() -> None:
    assert namespaced_key("a", b"bc") != namespaced_key("ab", b"c")


def test_a_plan_from_a_manager_with_another_fingerprint_is_rejected() -> None:
    m1, m2 = make(), Manager.create(2, fingerprint="model-b/layout-1")
    plan = m1.prepare_store([A])
    assert plan is not None
    before = snapshot(m2)
    with pytest.raises(InvalidArgumentError, match="prepared by another Manager"):
        m2.complete_store(plan, True)
    assert_unchanged(m2, before)


def test_policies_plans_and_events_carry_the_engine_keys() -> None:
    m = make(host=1)
    stored(m, [A])
    assert m.host_policy.victims(1, ()) == [A]
    plan = m.prepare_store([B])
    assert plan is not None and (plan.keys, plan.evicted) == ((B,), (A,))
    m.complete_store(plan, True)
    assert [e.key for e in m.events()] == [A, A, B]


def test_a_manager_serves_only_keys_stored_under_its_own_fingerprint() -> None:
    m1, m2 = make(), Manager.create(2, fingerprint="model-b/layout-1")
    stored(m1, [A])
    assert (m1.lookup([A]), m2.lookup([A])) == (1, 0)
    with pytest.raises(UnknownKeyError):
        m2.prepare_load([A])


def test_block_event_is_an_immutable_value_with_a_readable_repr() -> None:
    event = BlockEvent(EventKind.STORED, A, Tier.HOST)
    assert (event.kind, event.key, event.tier) == (EventKind.STORED, A, Tier.HOST)
    assert event == BlockEvent(EventKind.STORED, A, Tier.HOST) != BlockEvent(EventKind.REMOVED, A, Tier.HOST)
    assert hash(event) == hash(BlockEvent(EventKind.STORED, A, Tier.HOST))
    with pytest.raises(AttributeError):
        event.kind = EventKind.REMOVED  # type: ignore[misc]
    assert repr(event) == f"BlockEvent(kind={EventKind.STORED!r}, key={A!r}, tier={Tier.HOST!r})"
    m = make()
    stored(m, [A])
    assert all(type(e) is BlockEvent for e in m.events())


# ---------------------------------------------------------------------------- bad keys


BAD_KEYS: list[object] = [["not bytes"], [None], [17], [A, "x"], [bytearray(b"abc")], A, "AB", 5]
CALLS: dict[str, Callable[[Manager, object], object]] = {
    "lookup": lambda m, k: m.lookup(k),  # type: ignore[arg-type]
    "touch": lambda m, k: m.touch(k),  # type: ignore[arg-type]
    "prepare_store": lambda m, k: m.prepare_store(k),  # type: ignore[arg-type]
    "prepare_load": lambda m, k: m.prepare_load(k),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("keys", BAD_KEYS, ids=repr)
def test_keys_that_are_not_a_sequence_of_bytes_raise_key_type_error_and_change_nothing(
    call: str, keys: object
) -> None:
    m = make()
    stored(m, [A])
    before = snapshot(m)
    with pytest.raises(KeyTypeError, match=r"keys(\[\d\])? = .* (keys must be bytes|sequence of bytes)"):
        CALLS[call](m, keys)
    assert_unchanged(m, before)


def test_key_type_error_names_the_index_of_the_bad_key() -> None:
    with pytest.raises(KeyTypeError, match=r"keys\[2\] = 'x' is a str; keys must be bytes"):
        make().lookup([A, B, "x"])  # type: ignore[list-item]


def test_key_type_error_is_a_type_error_and_a_kvoffload_error() -> None:
    with pytest.raises(TypeError):
        make().lookup([None])  # type: ignore[list-item]
    with pytest.raises(KVOffloadError):
        make().lookup([None])  # type: ignore[list-item]


def test_lookup_checks_the_type_of_keys_past_the_first_miss() -> None:
    with pytest.raises(KeyTypeError, match=r"keys\[1\]"):
        make().lookup([A, 3])  # type: ignore[list-item]


@pytest.mark.parametrize("call", ["prepare_store", "prepare_load"])
def test_duplicate_keys_raise_and_change_nothing(call: str) -> None:
    m = make(host=4)
    stored(m, [A, B])
    before = snapshot(m)
    with pytest.raises(DuplicateKeyError, match=r"keys\[2\] = .* repeats keys\[0\]"):
        CALLS[call](m, [A, B, A])
    assert_unchanged(m, before)


def test_lookup_and_touch_accept_duplicate_keys() -> None:
    m = make()
    stored(m, [A])
    assert m.lookup([A, A, B]) == 2
    m.touch([A, A, C])


# ---------------------------------------------------------------------------- completions


def test_complete_store_twice_raises_key_state_error_and_changes_nothing() -> None:
    m = make()
    plan = stored(m, [A])
    before = snapshot(m)
    with pytest.raises(KeyStateError, match=r"of plan \d+ has no pending store: it was already completed"):
        m.complete_store(plan, True)
    with pytest.raises(KeyStateError):
        m.complete_store(plan, False)
    assert_unchanged(m, before)


def test_duplicated_completion_of_a_failed_store_cannot_complete_a_later_plan_of_the_same_key() -> None:
    m = make()
    first = m.prepare_store([A])
    assert first is not None
    m.complete_store(first, False)
    second = m.prepare_store([A])
    assert second is not None and second.keys == (A,)
    before = snapshot(m)
    with pytest.raises(KeyStateError):
        m.complete_store(first, True)
    assert_unchanged(m, before)
    assert m.lookup([A]) == 0


def test_complete_store_of_a_key_not_in_the_plan_raises_unknown_key_and_changes_nothing() -> None:
    m = make(host=4)
    plan = m.prepare_store([A, B])
    assert plan is not None
    before = snapshot(m)
    with pytest.raises(UnknownKeyError, match=r"keys\[1\] = .* is not one of plan \d+'s keys"):
        m.complete_store(plan, True, keys=[A, C])
    assert_unchanged(m, before)
    assert isinstance(UnknownKeyError("x"), KeyError)


def test_complete_store_of_a_subset_completes_only_that_subset() -> None:
    m = make(host=4)
    plan = m.prepare_store([A, B])
    assert plan is not None
    m.complete_store(plan, True, keys=[B])
    assert (m.lookup([B]), m.lookup([A])) == (1, 0)
    m.complete_store(plan, False, keys=[A])
    assert m.stats().host.free == 3


def test_complete_store_of_the_whole_plan_after_part_of_it_raises_and_changes_nothing() -> None:
    m = make(host=4)
    plan = m.prepare_store([A, B, C])
    assert plan is not None
    m.complete_store(plan, True, keys=[B])
    before = snapshot(m)
    message = f"key {B!r} of plan {plan.plan_id} has no pending store"
    with pytest.raises(KeyStateError, match=re.escape(message)):
        m.complete_store(plan, True)  # keys=None means all of plan.keys, and B was completed
    assert_unchanged(m, before)
    m.complete_store(plan, False, keys=[A])
    m.complete_store(plan, True, keys=[C])
    assert m.lookup([B, C]) == 2 and m.lookup([A]) == 0
    with pytest.raises(KeyStateError):
        m.complete_store(plan, True, keys=[C])
    assert m.stats().host.pending == 0


def test_a_copy_of_a_plan_completes_like_the_plan_itself() -> None:
    m = make(host=1, disk=1)
    stored(m, [A])
    plan = m.prepare_store([B])  # demotes A
    assert plan is not None
    copy = pickle.loads(pickle.dumps(plan))  # equal keys in new objects
    assert copy == plan and copy.keys is not plan.keys
    m.complete_demote(copy, True)
    m.complete_store(copy, True)
    assert m.lookup([A]) == 1 and m.lookup([B]) == 1
    before = snapshot(m)
    for twice in (plan, copy):
        with pytest.raises(KeyStateError):
            m.complete_store(twice, True)
        with pytest.raises(KeyStateError):
            m.complete_demote(twice, True)
    assert_unchanged(m, before)


@pytest.mark.parametrize("ok", [1, None, "yes", np.bool_(True)])
def test_complete_store_requires_ok_to_be_a_bool(ok: object) -> None:
    m = make()
    plan = m.prepare_store([A])
    assert plan is not None
    before = snapshot(m)
    kind = type(ok)  # named in full: numpy's bool was "a bool; it must be a bool"
    with pytest.raises(ArgumentTypeError, match=rf"ok = .* is a {kind.__module__}\.{kind.__qualname__}; "
                       r"it must be a bool \(True or False\)"):
        m.complete_store(plan, ok)  # type: ignore[arg-type]
    assert_unchanged(m, before)


def test_complete_store_requires_a_store_plan() -> None:
    m = make()
    stored(m, [A])
    load = m.prepare_load([A])
    with pytest.raises(ArgumentTypeError, match=r"plan is a \w+; expected a StorePlan \(from the matching prepare_store\)"):
        m.complete_store(load, True)  # type: ignore[arg-type]


def test_complete_load_without_matching_prepare_load_raises_and_changes_nothing() -> None:
    m = make()
    stored(m, [A, B])
    plan = m.prepare_load([A])
    m.complete_load(plan)
    before = snapshot(m)
    with pytest.raises(KeyStateError, match="has no outstanding prepare_load"):
        m.complete_load(plan)
    with pytest.raises(UnknownKeyError):
        m.complete_load(plan, keys=[B])
    assert_unchanged(m, before)


def test_failed_store_is_never_loadable() -> None:
    m = make()
    plan = m.prepare_store([A])
    assert plan is not None
    m.complete_store(plan, False)
    assert m.lookup([A]) == 0
    with pytest.raises(UnknownKeyError, match=r"keys\[0\] = .* is not held in any tier"):
        m.prepare_load([A])
    assert m.stats().host.free == 2
    assert m.stats().stores_failed == 1


# ---------------------------------------------------------------------------- lookup / load


def test_lookup_counts_only_the_ready_prefix() -> None:
    m = make(host=4)
    stored(m, [A, B])
    pending = m.prepare_store([C])
    assert pending is not None
    assert m.lookup([A, B, C]) == 2  # C is pending
    assert m.lookup([A, D, B]) == 1
    m.prepare_load([A])
    assert m.lookup([A, B]) == 2  # a loading key stays loadable
    stats = m.stats()
    assert (stats.lookups, stats.lookup_keys, stats.lookup_hits) == (3, 8, 5)


def test_prepare_load_of_unknown_or_pending_key_raises_and_changes_nothing() -> None:
    m = make(host=4)
    stored(m, [A])
    assert m.prepare_store([B]) is not None
    before = snapshot(m)
    with pytest.raises(UnknownKeyError):
        m.prepare_load([A, C])
    with pytest.raises(KeyStateError, match=r"keys\[1\] = .* is not ready"):
        m.prepare_load([A, B])
    assert_unchanged(m, before)


def test_concurrent_loads_keep_a_block_unevictable_until_the_last_completes() -> None:
    m = make(host=1)
    stored(m, [A])
    first, second = m.prepare_load([A]), m.prepare_load([A])
    assert first.blocks == second.blocks == (0,)
    assert m.stats().host.loading == 1
    assert m.prepare_store([B]) is None
    m.complete_load(first)
    assert m.prepare_store([B]) is None
    m.complete_load(second)
    plan = m.prepare_store([B])
    assert plan is not None and plan.evicted == (A,)


# ---------------------------------------------------------------------------- prepare_store


def test_prepare_store_returns_none_and_changes_nothing_when_every_block_is_pending_or_loading() -> None:
    m = make(host=2)
    stored(m, [A])
    m.prepare_load([A])
    assert m.prepare_store([B]) is not None  # B pending
    before = snapshot(m)
    order_before = m.host_policy.victims(2, ())
    assert m.prepare_store([C]) is None
    assert m.prepare_store([C, D]) is None
    assert_unchanged(m, before)
    assert m.host_policy.victims(2, ()) == order_before


def test_prepare_store_refusal_leaves_evictable_blocks_and_policy_order_alone() -> None:
    m = make(host=2)
    stored(m, [A, B])
    before = snapshot(m)
    assert m.prepare_store([C, D, E]) is None  # needs 3 blocks, the pool has 2
    assert_unchanged(m, before)
    plan = m.prepare_store([C])
    assert plan is not None and plan.evicted == (A,)


def test_prepare_store_never_evicts_its_own_keys() -> None:
    m = make(host=2)
    stored(m, [A, B])  # A is least recently used
    plan = m.prepare_store([A, C])
    assert plan is not None
    assert plan.keys == (C,)
    assert plan.evicted == (B,)
    assert m.lookup([A]) == 1


def test_prepare_store_refuses_rather_than_evicting_its_own_keys() -> None:
    m = make(host=2)
    stored(m, [A, B])
    before = snapshot(m)
    assert m.prepare_store([A, B, C]) is None
    assert_unchanged(m, before)


def test_prepare_store_skips_keys_held_in_any_state_or_tier() -> None:
    m = make(host=2, disk=2)
    stored(m, [A, E])
    stored(m, [B])  # A demoted: ready on disk
    assert m.prepare_store([C]) is not None  # C pending on host, E's demotion pending on disk
    m.prepare_load([B])  # B loading on host
    before = snapshot(m)
    plan = m.prepare_store([A, B, C, E])
    assert plan is not None
    assert (plan.keys, plan.evicted, plan.demotions, plan.disk_evicted) == ((), (), (), ())
    assert_unchanged(m, before)


def test_prepare_store_of_held_keys_only_returns_an_empty_plan() -> None:
    m = make()
    stored(m, [A])
    plan = m.prepare_store([A])
    assert plan is not None
    assert (plan.keys, plan.host_blocks, plan.evicted, plan.demotions) == ((), (), (), ())


def test_custom_policy_proposing_a_protected_victim_raises_policy_error_and_changes_nothing() -> None:
    class Reckless(LRUPolicy):
        def victims(self, count: int, exclude: Container[bytes]) -> list[bytes]:
            return list(self._order)[:count]  # ignores exclude: would evict the request's own key

    m = Manager.create(2, fingerprint="f", policy=Reckless)
    stored(m, [A, B])
    before = snapshot(m)
    with pytest.raises(PolicyError, match="not evictable"):
        m.prepare_store([A, C])
    assert m.lookup([A, B]) == 2
    assert m.stats().host_evictions == before[0].host_evictions


class Faulty(LRUPolicy):
    """LRU whose ``method`` raises on its ``nth`` call (1-based), after doing its work (so the
    policy itself stays consistent and what is tested is the manager); every call is recorded."""

    def __init__(self, capacity: int, method: str, nth: int = 1) -> None:
        super().__init__(capacity)
        self.method, self.nth, self.calls = method, nth, 0
        self.seen: list[tuple[str, bytes | None]] = []

    def _maybe_raise(self, method: str, key: bytes | None) -> None:
        self.seen.append((method, key))
        if method == self.method:
            self.calls += 1
            if self.calls == self.nth:
                raise RuntimeError(f"{method} broke")

    def admit(self, key: bytes) -> None:
        super().admit(key)
        self._maybe_raise("admit", key)

    def hit(self, key: bytes) -> None:
        super().hit(key)
        self._maybe_raise("hit", key)

    def hold(self, key: bytes) -> None:
        super().hold(key)
        self._maybe_raise("hold", key)

    def release(self, key: bytes) -> None:
        super().release(key)
        self._maybe_raise("release", key)

    def evict(self, key: bytes) -> None:
        super().evict(key)
        self._maybe_raise("evict", key)

    def clear(self) -> None:
        super().clear()
        self._maybe_raise("clear", None)


def faulty(method: str, nth: int = 1, host: int = 4) -> tuple[Manager, Faulty]:
    made: list[Faulty] = []

    def factory(capacity: int) -> Faulty:
        made.append(Faulty(capacity, method, nth))
        return made[-1]

    return Manager.create(host, fingerprint="f", policy=factory), made[0]


def test_a_policy_whose_admit_raises_leaves_the_store_whole_and_a_retry_refused() -> None:
    """The store completes for every key (B's admit raised after A's was made), then PolicyError;
    a second completion of the same plan is refused. Without the guard the exception left the
    pool's pending count lowered with neither key offered, and the retry was taken: pending -2
    (the control below)."""
    m, policy = faulty("admit", nth=2)
    plan = m.prepare_store([A, B])
    assert plan is not None
    with pytest.raises(PolicyError, match=r"Faulty\.admit\(.*\) raised RuntimeError\('admit broke'\)") as info:
        m.complete_store(plan, True)
    assert isinstance(info.value.__cause__, RuntimeError) and info.value.result is None
    assert m.lookup([A, B]) == 2
    stats = m.stats().host
    assert (stats.pending, stats.ready, stats.free) == (0, 2, 2)
    assert [k for what, k in policy.seen if what == "admit"] == [A, B]  # B's admit still made
    with pytest.raises(KeyStateError):
        m.complete_store(plan, True)
    assert m.stats().host.pending == 0
    assert stored(m, [C]).keys == (C,)  # the manager goes on


def test_without_the_guard_a_raising_admit_corrupts_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: a guard that lets the exception through (as the manager did before)."""
    from kvoffload.manager.state import GuardedPolicy

    def through(self: GuardedPolicy, method: str, key: bytes | None, exc: Exception) -> None:
        raise exc

    monkeypatch.setattr(GuardedPolicy, "_kept", through)
    m, _ = faulty("admit", nth=2)
    plan = m.prepare_store([A, B])
    assert plan is not None
    with pytest.raises(RuntimeError):
        m.complete_store(plan, True)
    assert m.lookup([A, B]) == 0  # neither key offered, though A's admit went through
    with pytest.raises(KeyStateError):  # a retry is taken (the policy refuses A's second admit) ...
        m.complete_store(plan, True)
    assert m.stats().host.pending < 0  # ... and the pool's counts go wrong


def _reentrant_manager() -> tuple[Manager, StorePlan]:
    """A manager of 2 host blocks whose policy's ``admit(A)`` prepares a store of C (which evicts A:
    both blocks are taken), and a store plan of A and B to complete."""
    inner: list[Manager] = []

    class Reentrant(LRUPolicy):
        def admit(self, key: bytes) -> None:
            super().admit(key)
            if key == A:
                inner[0].prepare_store([C])

    m = Manager.create(2, fingerprint="f", policy=Reentrant)
    inner.append(m)
    plan = m.prepare_store([A, B])
    assert plan is not None
    return m, plan


def test_a_policy_that_calls_its_manager_from_a_notification_is_refused() -> None:
    """The call inside is refused and changes nothing; the call it is in completes whole and raises
    PolicyError (the control below: the call inside evicted A while the store then marked A
    loadable)."""
    m, plan = _reentrant_manager()
    with pytest.raises(PolicyError, match=r"Reentrant\.admit.*Manager\.prepare_store was called while "
                       r"Manager\.complete_store runs") as info:
        m.complete_store(plan, True)
    assert isinstance(info.value.__cause__, PolicyError)
    assert m.lookup([A, B]) == 2 and m.prepare_load([A, B]).keys == (A, B)
    assert [(e.kind, e.key) for e in m.events()] == [(EventKind.STORED, A), (EventKind.STORED, B)]


def test_without_one_call_at_a_time_a_reentrant_policy_corrupts_the_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: calls let in while another runs."""
    monkeypatch.setattr(Manager, "_enter", lambda self, name: None)
    m, plan = _reentrant_manager()
    m.complete_store(plan, True)
    assert m.lookup([A]) == 1  # A is offered as loadable ...
    with pytest.raises(UnknownKeyError):
        m.prepare_load([A])  # ... and unknown: its block went to C


@pytest.mark.parametrize("in_flight_done", [False, True])
def test_reset_removes_a_disk_copy_a_failed_load_left_to_the_loads_holding_it(in_flight_done: bool) -> None:
    """(Its REMOVED waits for the last load holding it; reset cleared the entry without it, so a
    router kept the copy for good. Found by a model-based test.)"""
    m = Manager.create(1, fingerprint="f", num_disk_blocks=2)
    stored(m, [A])
    plan = m.prepare_store([B])  # demotes A to disk
    assert plan is not None
    m.complete_demote(plan, True)
    m.complete_store(plan, True)
    first, second = m.prepare_load([A]), m.prepare_load([A])
    assert first.tiers == (Tier.DISK,)
    m.complete_load(first, ok=False)  # the disk copy failed its check; second still holds it
    m.reset(in_flight_done=in_flight_done)
    m.complete_load(second)  # stale: a no-op
    live: dict[tuple[bytes, Tier], int] = {}
    for event in m.events():
        step = {EventKind.STORED: 1, EventKind.REMOVED: -1}.get(event.kind, 0)
        live[(event.key, event.tier)] = live.get((event.key, event.tier), 0) + step
    assert {k: n for k, n in live.items() if n} == {}


def test_a_policy_whose_hold_raises_still_gives_the_load_plan_to_complete() -> None:
    m, policy = faulty("hold", nth=1)
    stored(m, [A, B])
    with pytest.raises(PolicyError, match="hold") as info:
        m.prepare_load([A, B])
    plan = info.value.result
    assert isinstance(plan, LoadPlan) and plan.keys == (A, B)
    assert m.stats().host.loading == 2  # both referenced, as the plan says
    m.complete_load(plan)
    assert m.stats().host.loading == 0
    assert [k for what, k in policy.seen if what == "release"] == [A, B]


def test_a_policy_whose_evict_raises_still_gives_the_store_plan() -> None:
    m, _ = faulty("evict", nth=1, host=2)
    stored(m, [A, B])
    with pytest.raises(PolicyError, match="evict") as info:
        m.prepare_store([C])
    plan = info.value.result
    assert isinstance(plan, StorePlan) and plan.keys == (C,) and len(plan.evicted) == 1
    m.complete_store(plan, True)
    assert m.lookup([C]) == 1 and m.stats().host.free == 0


def test_a_policy_whose_hit_raises_still_hears_every_touch_and_a_failed_clear_still_resets() -> None:
    m, policy = faulty("hit", nth=1)
    stored(m, [A, B, C])
    with pytest.raises(PolicyError, match=r"hit\(b'"):
        m.touch([A, B, C])
    assert [k for what, k in policy.seen if what == "hit"] == [A, B, C]
    m.touch([A])  # one failure per call: the next call is clean
    m2, _ = faulty("clear", nth=1)
    stored(m2, [A])
    with pytest.raises(PolicyError, match=r"clear\(\) raised"):
        m2.reset(in_flight_done=True)
    assert m2.lookup([A]) == 0 and m2.stats().host.free == 4 and m2.epoch == 1


def test_failures_of_both_tiers_in_one_call_are_raised_by_that_call() -> None:
    """A load of a disk key and a host key whose releases both raise: one PolicyError names both,
    and nothing is kept for the next call."""
    made: list[Faulty] = []

    def factory(capacity: int) -> Faulty:
        made.append(Faulty(capacity, "release", nth=1))
        return made[-1]

    m = Manager.create(1, fingerprint="f", num_disk_blocks=2, policy=factory)
    stored(m, [A])
    stored(m, [B])  # A is demoted to disk, B on host
    plan = m.prepare_load([A, B])
    assert plan.tiers == (Tier.DISK, Tier.HOST)
    with pytest.raises(PolicyError, match=r"release\(b'\\x02.*host tier\); .*release\(b'\\x01.*disk tier\)"):
        m.complete_load(plan)
    m.touch([A, B])  # clean


def test_a_policy_factory_that_returns_no_policy_is_refused_at_create() -> None:
    with pytest.raises(ArgumentTypeError, match=r"returned <object object at .*>, which has no admit, hit, "
                                                r"hold, release, victims, evict, clear"):
        Manager.create(4, fingerprint="f", policy=lambda cap: object())  # type: ignore[arg-type, return-value]


def test_create_accepts_a_policy_factory() -> None:
    policy: EvictionPolicy = LRUPolicy(4)
    m = Manager.create(4, fingerprint="f", policy=lambda cap: policy)
    assert m.host_policy is policy


# ---------------------------------------------------------------------------- eviction order


def test_lru_and_arc_evict_differently_on_a_known_sequence() -> None:
    victims = {}
    for policy in ("lru", "arc"):
        m = make(host=3, policy=policy)
        stored(m, [A, B])
        m.touch([A])
        m.touch([B])  # both seen twice: ARC moves them to T2
        stored(m, [C])  # seen once: T1
        m.touch([A])
        plan = m.prepare_store([D])
        assert plan is not None
        victims[policy] = plan.evicted
    assert victims == {"lru": (B,), "arc": (C,)}  # LRU: least recent; ARC: seen-once first


def test_lru_evicts_in_order_of_last_use() -> None:
    m = make(host=3)
    stored(m, [A, B, C])
    m.touch([A])
    load = m.prepare_load([B])
    m.complete_load(load)
    plan = m.prepare_store([D, E])
    assert plan is not None and plan.evicted == (C, A)


def test_arc_ghost_hit_grows_the_recency_target() -> None:
    m = make(host=2, policy="arc")
    stored(m, [A, B])
    m.touch([B])  # T1 = [A], T2 = [B]
    plan = m.prepare_store([C])
    assert plan is not None and plan.evicted == (A,)
    m.complete_store(plan, True)
    policy = m.host_policy
    assert isinstance(policy, ARCPolicy)
    assert policy.ghost_sizes == (1, 0)
    assert policy.target_t1 == 0.0
    plan = m.prepare_store([A])  # A comes back from ghost list B1
    assert plan is not None and plan.evicted == (C,)
    m.complete_store(plan, True)
    assert policy.target_t1 == 1.0
    assert policy.resident_sizes == (0, 2)  # A re-admitted into T2
    assert policy.ghost_sizes == (1, 0)


def test_arc_ghost_lists_stay_bounded_by_capacity_over_many_evictions() -> None:
    policy = ARCPolicy(8)
    for i in range(1000):
        key = i.to_bytes(4, "big")
        if len(policy) == 8:
            (victim,) = policy.victims(1, ())
            policy.evict(victim)
        policy.admit(key)
        if i % 3 == 0:
            policy.hit(key)
        b1, b2 = policy.ghost_sizes
        t1, _ = policy.resident_sizes
        assert b1 + b2 <= 8 and t1 + b1 <= 8


# ---------------------------------------------------------------------------- demotions (disk tier)


def test_demotion_is_planned_for_an_evicted_block_without_disk_copy() -> None:
    m = make(host=1, disk=2)
    stored(m, [A])
    plan = m.prepare_store([B])
    assert plan is not None
    assert plan.evicted == (A,)
    assert [(d.key, d.host_block, d.disk_block) for d in plan.demotions] == [(A, 0, 0)]
    assert plan.host_blocks == (0,)  # the block the demotion reads: demote first
    assert m.lookup([A]) == 0  # the disk copy is pending
    m.complete_demote(plan, True)
    assert m.lookup([A]) == 1
    load = m.prepare_load([A])
    assert (load.tiers, load.blocks) == ((Tier.DISK,), (0,))
    assert m.stats().demotions_completed == 1


def test_failed_demotion_drops_the_key_and_emits_an_event() -> None:
    m = make(host=1, disk=2)
    stored(m, [A])
    m.events()
    plan = m.prepare_store([B])
    assert plan is not None
    m.complete_demote(plan, False)
    assert m.lookup([A]) == 0
    assert m.stats().disk.free == 2
    assert m.events() == [
        BlockEvent(EventKind.REMOVED, A, Tier.HOST),
        BlockEvent(EventKind.STORE_FAILED, A, Tier.DISK),
    ]
    with pytest.raises(KeyStateError):
        m.complete_demote(plan, True)


def test_demotion_evicts_disk_blocks_by_policy_when_the_disk_is_full() -> None:
    m = make(host=1, disk=1)
    stored(m, [A])
    stored(m, [B])  # demotes A to disk
    plan = m.prepare_store([C])  # demotes B, evicting A from disk
    assert plan is not None
    assert plan.disk_evicted == (A,)
    assert [d.key for d in plan.demotions] == [B]
    assert m.stats().disk_evictions == 1


def test_demotion_is_skipped_but_the_store_proceeds_when_disk_blocks_are_busy() -> None:
    m = make(host=1, disk=1)
    stored(m, [A])
    stored(m, [B])  # A on disk
    m.prepare_load([A])  # disk block loading: not evictable
    plan = m.prepare_store([C])
    assert plan is not None
    assert plan.evicted == (B,) and plan.demotions == () and plan.disk_evicted == ()


def test_prepare_store_skips_a_key_held_only_on_disk() -> None:
    m = make(host=1, disk=2)
    stored(m, [A])
    stored(m, [B])  # A demoted
    plan = m.prepare_store([A])
    assert plan is not None and plan.keys == () and plan.evicted == ()  # no promotion back to host
    assert m.prepare_load([A]).tiers == (Tier.DISK,)


def test_prepare_store_does_not_evict_the_disk_copy_of_its_own_keys() -> None:
    m = make(host=1, disk=1)
    stored(m, [A])
    stored(m, [B])  # A on disk, B on host
    plan = m.prepare_store([A, C])  # B must be demoted; A's disk copy is protected
    assert plan is not None
    assert plan.keys == (C,) and plan.evicted == (B,)
    assert plan.demotions == () and plan.disk_evicted == ()
    assert m.lookup([A]) == 1


def test_complete_demote_of_all_demotions_after_part_of_them_raises_and_changes_nothing() -> None:
    m = make(host=2, disk=2)
    stored(m, [A, B])
    plan = m.prepare_store([C, D])  # demotes A and B
    assert plan is not None and {d.key for d in plan.demotions} == {A, B}
    m.complete_store(plan, True)
    m.complete_demote(plan, True, keys=[A])
    before = snapshot(m)
    message = f"key {A!r} of plan {plan.plan_id} has no pending demotion"
    with pytest.raises(KeyStateError, match=re.escape(message)):
        m.complete_demote(plan, True)
    assert_unchanged(m, before)
    m.complete_demote(plan, False, keys=[B])
    assert m.lookup([A]) == 1 and m.lookup([B]) == 0
    s = m.stats()
    assert (s.disk.pending, s.disk.ready, s.disk.free) == (0, 1, 1)
    assert (s.demotions_completed, s.demotions_failed) == (1, 1)


def test_complete_demote_of_a_plan_without_demotions_is_a_no_op() -> None:
    m = make(host=2)
    plan = m.prepare_store([A])
    assert plan is not None
    m.complete_demote(plan, True)
    assert m.stats().demotions_completed == 0


# ---------------------------------------------------------------------------- touch / events / stats


def test_touch_ignores_unknown_and_pending_keys() -> None:
    m = make(host=2)
    stored(m, [A])
    assert m.prepare_store([B]) is not None
    before = snapshot(m)
    m.touch([C, B, D])
    assert_unchanged(m, before)


def test_events_report_stores_evictions_and_failures_with_their_tier_once() -> None:
    m = make(host=1)
    plan = m.prepare_store([A])
    assert plan is not None
    assert m.events() == []  # pending is not announced
    m.complete_store(plan, True)
    plan = m.prepare_store([B])
    assert plan is not None
    m.complete_store(plan, False)
    assert m.events() == [
        BlockEvent(EventKind.STORED, A, Tier.HOST),
        BlockEvent(EventKind.REMOVED, A, Tier.HOST),
        BlockEvent(EventKind.STORE_FAILED, B, Tier.HOST),
    ]
    assert m.events() == []


def test_events_are_not_recorded_when_disabled() -> None:
    m = Manager.create(2, fingerprint="f", record_events=False)
    stored(m, [A])
    assert m.events() == []


def test_stats_count_blocks_per_state_and_tier() -> None:
    m = make(host=4, disk=2)
    stored(m, [A, B])
    assert m.prepare_store([C]) is not None
    m.prepare_load([A])
    s = m.stats()
    assert (s.host.free, s.host.pending, s.host.ready, s.host.loading, s.host.fenced) == (1, 1, 1, 1, 0)
    assert (s.disk.capacity, s.disk.free) == (2, 2)
    assert (s.stores_planned, s.stores_completed, s.loads_planned, s.policy) == (3, 2, 1, "lru")
    assert make().stats().disk.capacity == 0


# ---------------------------------------------------------------------------- reset fencing


def test_reset_clears_every_key_and_emits_removed_events() -> None:
    m = make(host=2)
    stored(m, [A, B])
    m.events()
    m.reset()
    assert m.lookup([A]) == 0 and m.lookup([B]) == 0
    assert sorted(e.key for e in m.events() if e.kind is EventKind.REMOVED) == [A, B]
    assert m.stats().epoch == 1 and m.stats().host.free == 2


def test_completion_from_before_reset_cannot_resurrect_a_cleared_key() -> None:
    m = make(host=2)
    plan = m.prepare_store([A])
    assert plan is not None
    m.reset()
    m.complete_store(plan, True)
    assert m.lookup([A]) == 0
    assert m.stats().stale_completions == 1


def test_completion_from_before_reset_cannot_complete_the_same_key_prepared_again() -> None:
    m = make(host=2)
    old = m.prepare_store([A])
    assert old is not None
    m.reset()
    new = m.prepare_store([A])
    assert new is not None and new.keys == (A,)
    m.complete_store(old, True)
    assert m.lookup([A]) == 0  # still pending: the new copy has not landed
    m.complete_store(new, True)
    assert m.lookup([A]) == 1


def test_stale_load_completion_does_not_drop_a_new_load_reference() -> None:
    m = make(host=2)
    stored(m, [A])
    old = m.prepare_load([A])
    m.reset(in_flight_done=True)
    stored(m, [A])
    new = m.prepare_load([A])
    m.complete_load(old)
    assert m.stats().host.loading == 1
    m.complete_load(new)
    assert m.stats().host.loading == 0


def test_reset_keeps_blocks_of_in_flight_plans_fenced_until_their_stale_completion() -> None:
    m = make(host=2)
    stored(m, [A])
    store = m.prepare_store([B])  # block 1 being written
    load = m.prepare_load([A])  # block 0 being read
    assert store is not None
    m.reset()
    assert m.stats().host.fenced == 2
    assert m.prepare_store([C]) is None  # no block an old DMA may touch is handed out
    m.complete_load(load)
    plan = m.prepare_store([C])
    assert plan is not None and plan.host_blocks == load.blocks
    m.complete_store(store, False)
    assert m.stats().host.fenced == 0 and m.stats().host.free == 1


def test_reset_with_in_flight_done_frees_every_block_at_once() -> None:
    m = make(host=2)
    stored(m, [A])
    assert m.prepare_store([B]) is not None
    m.prepare_load([A])
    m.reset(in_flight_done=True)
    assert m.stats().host.free == 2 and m.stats().host.fenced == 0


def test_reset_fences_both_blocks_of_an_in_flight_demotion() -> None:
    m = make(host=1, disk=1)
    stored(m, [A])
    plan = m.prepare_store([B])
    assert plan is not None and len(plan.demotions) == 1
    m.complete_store(plan, True)  # the demotion's completion has not arrived yet
    m.reset()
    s = m.stats()
    assert (s.host.fenced, s.disk.fenced) == (1, 1)
    m.complete_demote(plan, True)
    assert m.lookup([A]) == 0
    s = m.stats()
    assert (s.host.fenced, s.disk.fenced, s.host.free, s.disk.free) == (0, 0, 1, 1)


def test_reset_keeps_a_block_fenced_until_every_stale_plan_using_it_completed() -> None:
    m = make(host=1, disk=1)
    stored(m, [A])
    plan = m.prepare_store([B])  # block 0: read by the demotion, written by the store
    assert plan is not None
    m.reset()
    m.complete_demote(plan, True)
    assert (m.stats().host.fenced, m.stats().disk.fenced) == (1, 0)  # the store still writes block 0
    m.complete_store(plan, True)
    assert m.stats().host.free == 1 and m.lookup([B]) == 0


def test_reset_requires_a_bool_flag() -> None:
    m = make()
    with pytest.raises(ArgumentTypeError, match="in_flight_done"):
        m.reset(in_flight_done=1)  # type: ignore[arg-type]
    assert m.epoch == 0


def test_load_plan_reports_tier_and_block_per_key() -> None:
    m = make(host=2)
    plan = stored(m, [A, B])
    load = m.prepare_load([B, A])
    assert isinstance(load, LoadPlan)
    assert load.keys == (B, A)
    assert load.tiers == (Tier.HOST, Tier.HOST)
    assert load.blocks == (plan.host_blocks[1], plan.host_blocks[0])


def test_empty_requests_are_valid_no_ops() -> None:
    m = make()
    before = snapshot(m)
    plan = m.prepare_store([])
    assert plan is not None and plan.keys == ()
    m.complete_store(plan, True)
    load = m.prepare_load([])
    m.complete_load(load)
    assert m.lookup([]) == 0
    after = m.stats()
    assert (after.host, after.stores_completed, after.loads_completed) == (
        before[0].host,
        before[0].stores_completed,
        before[0].loads_completed,
    )


def _disk_only_key(manager: Manager, key: bytes, filler: bytes) -> None:
    """Store ``key``, then push it to disk by storing ``filler`` into the one host block."""
    first = manager.prepare_store([key])
    assert first is not None
    manager.complete_store(first, True)
    second = manager.prepare_store([filler])
    assert second is not None and len(second.demotions) == 1
    manager.complete_demote(second, True)
    manager.complete_store(second, True)


def test_a_failed_disk_load_drops_the_disk_copy_once_no_load_holds_it() -> None:
    manager = Manager.create(1, fingerprint=b"fp", num_disk_blocks=4)
    _disk_only_key(manager, b"a", b"b")
    first = manager.prepare_load([b"a"])
    second = manager.prepare_load([b"a"])
    assert first.tiers == (Tier.DISK,)
    manager.events()
    manager.complete_load(first, ok=False)
    assert manager.lookup([b"a"]) == 0  # never offered again, even while a load still holds it
    assert manager.stats().disk.free == 3
    manager.complete_load(second)
    assert manager.stats().disk.free == 4 and manager.stats().disk_copies_dropped == 1
    assert [(e.kind, e.key, e.tier) for e in manager.events()] == [
        (EventKind.REMOVED, b"a", Tier.DISK)]
    assert manager.stats().loads_failed == 1


def test_a_key_whose_only_copy_failed_a_disk_load_is_stored_again_while_a_load_still_holds_it() -> None:
    """(It was skipped as held: the store the engine asked for never happened and nothing said
    so, and the key was forgotten when the last load ended. Found by an API audit.)"""
    manager = Manager.create(1, fingerprint=b"fp", num_disk_blocks=4)
    _disk_only_key(manager, b"a", b"b")
    first, second = manager.prepare_load([b"a"]), manager.prepare_load([b"a"])
    manager.complete_load(first, ok=False)
    with pytest.raises(KeyStateError, match="failed a load's check .* store it again"):
        manager.prepare_load([b"a"])
    plan = manager.prepare_store([b"a"])
    assert plan is not None and plan.keys == (b"a",)
    manager.complete_load(second)  # the damaged disk copy goes; the new host copy stays
    assert manager.lookup([b"a"]) == 0  # its store is pending
    manager.complete_demote(plan, True)
    manager.complete_store(plan, True)
    assert manager.lookup([b"a"]) == 1
    load = manager.prepare_load([b"a"])
    assert load.tiers == (Tier.HOST,) and load.blocks == plan.host_blocks
    manager.complete_load(load)
    stats = manager.stats()
    assert stats.disk_copies_dropped == 1 and stats.disk.loading == 0 and stats.host.loading == 0
    assert stats.host.ready + stats.host.free + stats.host.pending == stats.host.capacity


def test_a_failed_host_load_keeps_the_host_copy() -> None:
    manager = Manager.create(2, fingerprint=b"fp")
    plan = manager.prepare_store([b"a"])
    assert plan is not None
    manager.complete_store(plan, True)
    load = manager.prepare_load([b"a"])
    manager.complete_load(load, ok=False)
    assert manager.lookup([b"a"]) == 1


def test_complete_load_refuses_an_ok_that_is_not_a_bool() -> None:
    manager = Manager.create(2, fingerprint=b"fp")
    plan = manager.prepare_store([b"a"])
    assert plan is not None
    manager.complete_store(plan, True)
    load = manager.prepare_load([b"a"])
    with pytest.raises(ArgumentTypeError, match="ok"):
        manager.complete_load(load, ok=1)  # type: ignore[arg-type]
    manager.complete_load(load)


def rec(block: int, generation: int, name: bytes) -> DiskRecordInfo:
    return DiskRecordInfo(block=block, generation=generation, key=name)


def test_adopted_disk_records_are_loadable_from_the_disk_tier_and_their_blocks_are_taken() -> None:
    m = make(host=2, disk=6)
    other = namespaced_key("model-b/layout-1", C)  # another model's record of the same block hash
    records = [rec(3, 5, m.namespaced(A)), rec(0, 9, other), rec(2, 1, b""), rec(4, 3, b""),
               rec(1, 2, m.namespaced(B)), rec(5, 7, m.namespaced(A)),  # A's newest write: block 5
               rec(70, 6, other),  # past this manager's blocks, but not its record: left alone
               rec(90, 1, m.namespaced(B))]  # B's older write past its blocks: not taken, no error
    assert m.adopt_disk(records) == [B, A]  # oldest write first
    assert m.events() == [BlockEvent(EventKind.STORED, B, Tier.DISK),
                          BlockEvent(EventKind.STORED, A, Tier.DISK)]
    assert m.lookup([A, B]) == 2 and m.lookup([C]) == 0
    plan = m.prepare_load([A, B])
    assert (plan.tiers, plan.blocks) == ((Tier.DISK, Tier.DISK), (5, 1))
    m.complete_load(plan)
    assert m.stats().disk.ready == 2 and m.stats().disk.free == 4  # 0, 2, 3, 4 left free
    # Demotions take the free blocks, then evict by the policy.
    stored(m, [C, D])  # host full
    demoted = []
    for key in (E, b"f" * 8, b"g" * 8, b"h" * 8, b"i" * 8):
        store = m.prepare_store([key])
        assert store is not None
        demoted += [(d.key, d.disk_block) for d in store.demotions]
        m.complete_demote(store, True)
        m.complete_store(store, True)
    # the free blocks first, then B's: the load used A, then B, so A is the least recently used
    assert [block for _, block in demoted] == [0, 2, 3, 4, 5]
    assert m.lookup([A]) == 0 and m.lookup([B]) == 1
    with pytest.raises(InvalidArgumentError, match="must come before the manager's first demotion"):
        m.adopt_disk([rec(1, 1, m.namespaced(b"x"))])


def test_adopt_disk_refuses_bad_input_and_changes_nothing() -> None:
    m = make(host=2, disk=4)
    stored(m, [A, B])  # no demotion yet: adoption is still allowed
    before = snapshot(m)
    d, e = m.namespaced(D), m.namespaced(E)
    cases: list[tuple[Any, type[Exception], str]] = [
        ([rec(0, 1, m.namespaced(A))], KeyStateError, r"records\[0\] names key .* which the manager already holds"),
        ([rec(1, 1, d), rec(1, 2, e)], InvalidArgumentError, r"records\[1\] and records\[0\] are both in block 1"),
        ([rec(0, 1, d), rec(4, 1, e)], InvalidArgumentError, r"records\[1\] \(block 4\) is out of this manager's disk blocks \[0, 4\)"),
        ([rec(0, 1, d), rec(True, 1, e)], ArgumentTypeError, r"records\[1\] = .* has block True"),
        ([rec(0, 1, d), (1, 2, e)], ArgumentTypeError, r"records\[1\] = .* has block None"),
        ([rec(0, 1, "e")], KeyTypeError, r"records\[0\] = .* has key 'e'; names are bytes"),  # type: ignore[arg-type]
        (b"records", ArgumentTypeError, "must be an iterable of disk records"),
    ]
    for records, error, message in cases:
        with pytest.raises(error, match=message):
            m.adopt_disk(records)
    assert_unchanged(m, before)
    with pytest.raises(InvalidArgumentError, match="adopt_disk needs a disk tier"):
        make(host=2).adopt_disk([rec(0, 1, m.namespaced(A))])
