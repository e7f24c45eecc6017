"""Property-based tests: random operation sequences against the Manager and a reference model.

The model does not predict *which* block a policy evicts (that is the policy's business); it checks
that every choice the manager makes is allowed, and predicts everything else exactly: whether a
store is refused, how many blocks are evicted and demoted, what is ready, the blocks per state, which
blocks are fenced after a reset. Invariants are checked after every operation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.errors import KeyStateError, UnknownKeyError
from kvoffload import ARCPolicy, LoadPlan, LRUPolicy, Manager, StorePlan, Tier

KEYS: list[bytes] = [bytes([i]) * 4 for i in range(6)]
MIN_OPS = 20
MAX_OPS = 80  # long enough to fill, evict, demote, reset and complete stale plans in one example
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)
index = st.integers(0, 7)  # which outstanding plan (modulo how many there are)


@attrs.frozen
class Store:
    keys: list[bytes]


@attrs.frozen
class CompleteStore:
    plan: int
    ok: bool
    only_one: bool
    whole: bool  # keys=None (refused while part of the plan was completed already)


@attrs.frozen
class CompleteDemote:
    plan: int
    ok: bool
    only_one: bool  # else keys=None (refused while part of the demotions were completed already)


@attrs.frozen
class CompleteTwice:
    plan: int


@attrs.frozen
class Load:
    keys: list[bytes]


@attrs.frozen
class LoadReady:
    """Load keys that are ready now: ``picks`` index the ready keys (modulo their number)."""

    picks: list[int]


@attrs.frozen
class CompleteLoad:
    plan: int
    only_one: bool


@attrs.frozen
class Touch:
    keys: list[bytes]


@attrs.frozen
class Lookup:
    keys: list[bytes]


@attrs.frozen
class Reset:
    in_flight_done: bool


Op = Union[
    Store, CompleteStore, CompleteDemote, CompleteTwice, Load, LoadReady, CompleteLoad, Touch, Lookup, Reset
]

# (weight, strategy): weighted towards the operations that fill the pools, so evictions, demotions
# and overlapping loads happen in most examples, with a reset every ~25 operations
WEIGHTED_OPS: list[tuple[int, st.SearchStrategy[Op]]] = [
    (5, st.builds(Store, key_lists)),
    (5, st.builds(CompleteStore, index, st.just(True), st.booleans(), st.booleans())),
    (1, st.builds(CompleteStore, index, st.just(False), st.booleans(), st.booleans())),
    (2, st.builds(CompleteDemote, index, st.booleans(), st.booleans())),
    (1, st.builds(CompleteTwice, index)),
    (1, st.builds(Load, key_lists)),
    (3, st.builds(LoadReady, st.lists(index, min_size=1, max_size=2))),
    (3, st.builds(CompleteLoad, index, st.booleans())),
    (1, st.builds(Touch, key_lists)),
    (1, st.builds(Lookup, st.lists(st.sampled_from(KEYS), max_size=5))),
    (1, st.builds(Reset, st.booleans())),
]
ops: st.SearchStrategy[Op] = st.sampled_from([s for w, s in WEIGHTED_OPS for _ in range(w)]).flatmap(
    lambda s: s
)


@attrs.define
class Copy:
    """The model's view of one key's copy in one tier."""

    block: int
    ready: bool = False
    refs: int = 0


@attrs.define
class Outstanding:
    """A plan whose completions have not all arrived yet (any epoch)."""

    plan: StorePlan | LoadPlan
    epoch: int
    stores: set[bytes] = attrs.Factory(set)
    demotions: set[bytes] = attrs.Factory(set)
    loads: set[bytes] = attrs.Factory(set)
    fenced: bool = False  # a reset fenced its blocks until its stale completions arrive


class Harness:
    """Runs operations on a Manager and on the model, checking each answer and every invariant."""

    def __init__(self, host: int, disk: int, policy: str) -> None:
        self.m = Manager.create(host, fingerprint="prop", num_disk_blocks=disk, policy=policy)
        self.host_cap, self.disk_cap = host, disk
        self.host: dict[bytes, Copy] = {}
        self.disk: dict[bytes, Copy] = {}
        self.epoch = 0
        self.fenced: dict[tuple[Tier, int], int] = {}
        self.stores: list[Outstanding] = []
        self.loads: list[Outstanding] = []
        self.finished_stores: list[StorePlan] = []
        self.finished_loads: list[LoadPlan] = []

    # ------------------------------------------------------------------ model helpers

    def held(self, key: bytes) -> bool:
        return key in self.host or key in self.disk

    def ready(self, key: bytes) -> bool:
        return (key in self.host and self.host[key].ready) or (key in self.disk and self.disk[key].ready)

    def used_blocks(self, tier: Tier) -> set[int]:
        copies = self.host if tier is Tier.HOST else self.disk
        return {c.block for c in copies.values()} | {b for t, b in self.fenced if t is tier}

    @staticmethod
    def evictable(copies: dict[bytes, Copy], protected: Sequence[bytes]) -> set[bytes]:
        return {k for k, c in copies.items() if c.ready and c.refs == 0 and k not in protected}

    def fence(self, tier: Tier, block: int) -> None:
        self.fenced[(tier, block)] = self.fenced.get((tier, block), 0) + 1

    def unfence(self, out: Outstanding, tier: Tier, block: int) -> None:
        if not out.fenced:
            return
        left = self.fenced[(tier, block)] - 1
        if left:
            self.fenced[(tier, block)] = left
        else:
            del self.fenced[(tier, block)]

    def retire(self, out: Outstanding) -> None:
        if out.stores or out.demotions or out.loads:
            return
        if isinstance(out.plan, StorePlan):
            self.stores.remove(out)
            self.finished_stores.append(out.plan)
        else:
            self.loads.remove(out)
            self.finished_loads.append(out.plan)

    # ------------------------------------------------------------------ operations

    def run(self, op: Op) -> None:
        if isinstance(op, Store):
            self.store(op.keys)
        elif isinstance(op, CompleteStore):
            self.complete_store(op)
        elif isinstance(op, CompleteDemote):
            self.complete_demote(op)
        elif isinstance(op, CompleteTwice):
            self.complete_twice(op)
        elif isinstance(op, Load):
            self.load(op.keys)
        elif isinstance(op, LoadReady):
            ready = [k for k in KEYS if self.ready(k)]
            if ready:
                self.load(sorted({ready[i % len(ready)] for i in op.picks}))
        elif isinstance(op, CompleteLoad):
            self.complete_load(op)
        elif isinstance(op, Touch):
            self.m.touch(op.keys)
        elif isinstance(op, Lookup):
            expect = 0
            for k in op.keys:
                if not self.ready(k):
                    break
                expect += 1
            assert self.m.lookup(op.keys) == expect
        else:
            self.reset(op.in_flight_done)
        self.check_invariants()

    def store(self, keys: list[bytes]) -> None:
        new = [k for k in keys if not self.held(k)]
        free_host = self.host_cap - len(self.used_blocks(Tier.HOST))
        evictable = self.evictable(self.host, keys)
        need = max(0, len(new) - free_host)
        before = self.m.stats()
        plan = self.m.prepare_store(keys)
        if need > len(evictable):
            assert plan is None
            assert self.m.stats() == before  # atomic: a refusal changes nothing
            return
        assert plan is not None
        assert plan.keys == tuple(new)
        assert len(plan.evicted) == need and len(set(plan.evicted)) == need
        assert set(plan.evicted) <= evictable  # never pending, loading, or one of the request's keys

        candidates = [k for k in plan.evicted if k not in self.disk]
        free_disk = self.disk_cap - len(self.used_blocks(Tier.DISK))
        disk_evictable = self.evictable(self.disk, keys)
        expect_disk_evictions = min(max(0, len(candidates) - free_disk), len(disk_evictable))
        assert len(plan.disk_evicted) == (expect_disk_evictions if self.disk_cap else 0)
        assert set(plan.disk_evicted) <= disk_evictable
        expect_demotions = min(len(candidates), free_disk + expect_disk_evictions) if self.disk_cap else 0
        assert len(plan.demotions) == expect_demotions
        assert {d.key for d in plan.demotions} <= set(candidates)

        busy_disk = self.used_blocks(Tier.DISK) - {self.disk[k].block for k in plan.disk_evicted}
        for k in plan.disk_evicted:
            del self.disk[k]
        assert len({d.disk_block for d in plan.demotions}) == len(plan.demotions)
        for d in plan.demotions:
            assert d.host_block == self.host[d.key].block
            assert 0 <= d.disk_block < self.disk_cap and d.disk_block not in busy_disk
            self.disk[d.key] = Copy(d.disk_block)
        busy_host = self.used_blocks(Tier.HOST) - {self.host[k].block for k in plan.evicted}
        for k in plan.evicted:
            del self.host[k]
        assert len(set(plan.host_blocks)) == len(plan.host_blocks)
        for k, block in zip(plan.keys, plan.host_blocks):
            assert 0 <= block < self.host_cap and block not in busy_host  # never two keys, never fenced
            self.host[k] = Copy(block)
        assert {d.host_block for d in plan.demotions} <= set(plan.host_blocks)  # why demotions go first
        self.stores.append(Outstanding(plan, self.epoch, set(plan.keys), {d.key for d in plan.demotions}))

    def complete_store(self, op: CompleteStore) -> None:
        pending = [o for o in self.stores if o.stores]
        if not pending:
            return
        out = pending[op.plan % len(pending)]
        plan = out.plan
        assert isinstance(plan, StorePlan)
        if op.whole:
            if out.stores != set(plan.keys) and out.epoch == self.epoch:
                before = self.m.stats()
                with pytest.raises(KeyStateError):  # a key of the plan was completed already
                    self.m.complete_store(plan, op.ok)
                assert self.m.stats() == before
                return
            keys = sorted(out.stores)  # a stale whole completion releases what is still fenced
            self.m.complete_store(plan, op.ok)
        else:
            keys = [min(out.stores)] if op.only_one else sorted(out.stores)
            self.m.complete_store(plan, op.ok, keys)
        for k in keys:
            if out.epoch != self.epoch:  # fenced: the completion only releases the block
                self.unfence(out, Tier.HOST, plan.host_blocks[plan.keys.index(k)])
            elif op.ok:
                self.host[k].ready = True
            else:
                del self.host[k]  # a failed store is never loadable
        out.stores -= set(keys)
        self.retire(out)

    def complete_demote(self, op: CompleteDemote) -> None:
        pending = [o for o in self.stores if o.demotions]
        if not pending:
            return
        out = pending[op.plan % len(pending)]
        plan = out.plan
        assert isinstance(plan, StorePlan)
        if op.only_one:
            keys = {min(out.demotions)}
            self.m.complete_demote(plan, op.ok, sorted(keys))
        elif out.demotions != {d.key for d in plan.demotions} and out.epoch == self.epoch:
            before = self.m.stats()
            with pytest.raises(KeyStateError):  # a demotion of the plan was completed already
                self.m.complete_demote(plan, op.ok)
            assert self.m.stats() == before
            return
        else:
            keys = set(out.demotions)  # a stale whole completion releases what is still fenced
            self.m.complete_demote(plan, op.ok)
        done = [d for d in plan.demotions if d.key in keys]
        for d in done:
            if out.epoch != self.epoch:
                self.unfence(out, Tier.DISK, d.disk_block)
                self.unfence(out, Tier.HOST, d.host_block)
            elif op.ok:
                self.disk[d.key].ready = True
            else:
                del self.disk[d.key]
        out.demotions -= {d.key for d in done}
        self.retire(out)

    def complete_twice(self, op: CompleteTwice) -> None:
        """A duplicated completion of a finished plan is refused (current epoch) or ignored (stale)."""
        if self.finished_stores:
            plan = self.finished_stores[op.plan % len(self.finished_stores)]
            before = self.m.stats()
            if plan.epoch == self.epoch and plan.keys:
                with pytest.raises(KeyStateError):
                    self.m.complete_store(plan, True)
                assert self.m.stats() == before
            elif plan.epoch != self.epoch:
                self.m.complete_store(plan, True)
                self.m.complete_demote(plan, True)
                stale = self.m.stats().stale_completions - before.stale_completions
                assert attrs.evolve(self.m.stats(), stale_completions=before.stale_completions) == before
                assert stale == 2
        if self.finished_loads:
            load = self.finished_loads[op.plan % len(self.finished_loads)]
            before = self.m.stats()
            if load.epoch == self.epoch:
                with pytest.raises(KeyStateError):  # no matching prepare_load any more
                    self.m.complete_load(load)
                assert self.m.stats() == before

    def load(self, keys: list[bytes]) -> None:
        if not all(self.ready(k) for k in keys):
            before = self.m.stats()
            with pytest.raises((UnknownKeyError, KeyStateError)):
                self.m.prepare_load(keys)
            assert self.m.stats() == before
            return
        plan = self.m.prepare_load(keys)
        for k, tier, block in zip(keys, plan.tiers, plan.blocks):
            assert tier is (Tier.HOST if k in self.host and self.host[k].ready else Tier.DISK)
            copy = (self.host if tier is Tier.HOST else self.disk)[k]
            assert block == copy.block
            copy.refs += 1
        self.loads.append(Outstanding(plan, self.epoch, loads=set(keys)))

    def complete_load(self, op: CompleteLoad) -> None:
        if not self.loads:
            return
        out = self.loads[op.plan % len(self.loads)]
        plan = out.plan
        assert isinstance(plan, LoadPlan)
        keys = [min(out.loads)] if op.only_one else sorted(out.loads)
        self.m.complete_load(plan, keys)
        for k in keys:
            i = plan.keys.index(k)
            if out.epoch != self.epoch:
                self.unfence(out, plan.tiers[i], plan.blocks[i])
            else:
                (self.host if plan.tiers[i] is Tier.HOST else self.disk)[k].refs -= 1
        out.loads -= set(keys)
        self.retire(out)

    def reset(self, in_flight_done: bool) -> None:
        self.m.reset(in_flight_done=in_flight_done)
        if in_flight_done:
            self.fenced.clear()
        for out in self.stores + self.loads:
            if in_flight_done:
                out.fenced = False
                continue
            if out.epoch != self.epoch:
                continue  # fenced (or released) by an earlier reset already
            out.fenced = True
            plan = out.plan
            if isinstance(plan, StorePlan):
                for k in out.stores:
                    self.fence(Tier.HOST, plan.host_blocks[plan.keys.index(k)])
                for d in plan.demotions:
                    if d.key in out.demotions:
                        self.fence(Tier.DISK, d.disk_block)
                        self.fence(Tier.HOST, d.host_block)
            else:
                for k in out.loads:
                    i = plan.keys.index(k)
                    self.fence(plan.tiers[i], plan.blocks[i])
        self.host.clear()
        self.disk.clear()
        self.epoch += 1

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        s = self.m.stats()
        assert s.epoch == self.epoch
        for tier, copies, cap, ts in (
            (Tier.HOST, self.host, self.host_cap, s.host),
            (Tier.DISK, self.disk, self.disk_cap, s.disk),
        ):
            pending = sum(1 for c in copies.values() if not c.ready)
            loading = sum(1 for c in copies.values() if c.ready and c.refs > 0)
            ready = sum(1 for c in copies.values() if c.ready and c.refs == 0)
            fenced = sum(1 for t, _ in self.fenced if t is tier)
            assert (ts.pending, ts.loading, ts.ready, ts.fenced) == (pending, loading, ready, fenced), tier
            assert ts.free == cap - pending - loading - ready - fenced >= 0  # capacity never exceeded
            assert all(c.refs >= 0 for c in copies.values())  # ref counts never go negative
            blocks = [c.block for c in copies.values()]
            assert len(set(blocks)) == len(blocks)  # a block is never assigned to two keys
        for k in KEYS:  # lookup never counts a block that is not ready
            assert self.m.lookup([k]) == int(self.ready(k))
        for policy, copies, cap in (
            (self.m.host_policy, self.host, self.host_cap),
            (self.m.disk_policy, self.disk, self.disk_cap),
        ):
            if policy is None:
                continue
            assert isinstance(policy, (LRUPolicy, ARCPolicy))
            assert len(policy) == sum(1 for c in copies.values() if c.ready)
            if isinstance(policy, ARCPolicy):  # ghost lists stay bounded by the capacity
                b1, b2 = policy.ghost_sizes
                t1, _ = policy.resident_sizes
                assert b1 + b2 <= cap and t1 + b1 <= cap
                assert 0.0 <= policy.target_t1 <= cap


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    host=st.integers(1, 3),
    disk=st.integers(0, 2),
    policy=st.sampled_from(["lru", "arc"]),
    sequence=st.lists(ops, min_size=MIN_OPS, max_size=MAX_OPS),
)
def test_random_operation_sequences_keep_every_invariant_of_the_model(
    host: int, disk: int, policy: str, sequence: list[Op]
) -> None:
    harness = Harness(host, disk, policy)
    for op in sequence:
        harness.run(op)


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 6),
    steps=st.lists(
        st.tuples(st.sampled_from(["store", "touch", "load"]), st.sampled_from(KEYS)),
        min_size=5,
        max_size=60,
    ),
)
def test_lru_evicts_exactly_the_least_recently_used_ready_block(
    capacity: int, steps: list[tuple[str, bytes]]
) -> None:
    m = Manager.create(capacity, fingerprint="lru")
    order: list[bytes] = []  # least recent first
    for op, key in steps:
        if op == "store":
            victim = order[0] if key not in order and len(order) == capacity else None
            plan = m.prepare_store([key])
            assert plan is not None
            assert plan.evicted == ((victim,) if victim is not None else ())
            if victim is not None:
                order.remove(victim)
            m.complete_store(plan, True)
            if key not in order:
                order.append(key)
        elif key in order:
            if op == "touch":
                m.touch([key])
            else:
                m.complete_load(m.prepare_load([key]))
            order.remove(key)
            order.append(key)
        assert m.host_policy.victims(capacity, ()) == order  # policies see the engine's keys


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 6),
    steps=st.lists(
        st.tuples(st.sampled_from(["admit", "hit", "hold", "release", "evict"]), st.sampled_from(KEYS))
    ),
)
def test_arc_ghost_lists_stay_bounded_and_victims_are_evictable(
    capacity: int, steps: list[tuple[str, bytes]]
) -> None:
    policy = ARCPolicy(capacity)
    evictable: set[bytes] = set()
    held: set[bytes] = set()
    for op, key in steps:
        if op == "admit" and key not in evictable | held and len(evictable | held) < capacity:
            policy.admit(key)
            evictable.add(key)
        elif op == "hit" and key in evictable | held:
            policy.hit(key)
        elif op == "hold" and key in evictable:
            policy.hold(key)
            evictable.remove(key)
            held.add(key)
        elif op == "release" and key in held:
            policy.release(key)
            held.remove(key)
            evictable.add(key)
        elif op == "evict" and evictable:
            victims = policy.victims(2, {key})
            assert len(victims) == len(set(victims)) == min(2, len(evictable - {key}))
            assert set(victims) <= evictable - {key}
            if victims:
                policy.evict(victims[0])
                evictable.remove(victims[0])
        b1, b2 = policy.ghost_sizes
        t1, t2 = policy.resident_sizes
        assert b1 + b2 <= capacity and t1 + b1 <= capacity
        assert t1 + t2 == len(policy) == len(evictable) + len(held)
