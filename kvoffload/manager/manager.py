"""Manager: the scheduler-side block pool — which KV blocks the host pool and the disk hold, and
which move.

The :class:`Manager` decides *which* blocks move; a Worker moves the bytes. It owns only Python
memory (the key → block map of each tier, free lists, eviction policies, the copies each outstanding
plan still waits for, counters and undrained events), holds no OS or GPU resource and so has no
close method, and imports neither torch nor CUDA. Not thread-safe: call it from the scheduler thread.

A key's copy in a tier is *pending* (a copy into it is in flight: not loadable, not evictable),
*ready* (loadable, evictable) or *loading* (ready, with loads holding it: not evictable). The engine's
protocol — ``lookup`` / ``prepare_load`` / ``complete_load``, ``prepare_store`` (with write-back
demotions to disk) / ``complete_demote`` / ``complete_store``, ``events`` — and the fencing of plans
across :meth:`Manager.reset` are described in docs/design.md §11. Every method either does all it
says or raises before changing anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Final, NamedTuple

from kvoffload.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    KeyStateError,
    KeyTypeError,
    UnknownKeyError,
    UnknownPolicyError,
)
from kvoffload.manager.policies import POLICY_NAMES, EvictionPolicy, PolicyFactory
from kvoffload.manager.records import (
    BlockEvent,
    Demotion,
    LoadPlan,
    ManagerStats,
    StorePlan,
    Tier,
    TierStats,
    events_of,
    fingerprint_bytes,
    namespace_prefix,
)
from kvoffload.manager.state import (
    DISK,
    FAILED,
    HOST,
    NO_KEYS,
    PENDING,
    READY,
    REMOVED,
    STORE_FAILED,
    STORED,
    Counts,
    Entry,
    FenceKey,
    FenceKind,
    PlanCopies,
    Pool,
    check_keys,
    check_plan_keys,
    check_unique_keys,
    evict_entries,
    pending_entries,
    release_fenced,
    victim_entries,
)

__all__ = ["Manager"]

_PLAN_IDS: Final = itertools.count(1)  # process-wide, so a plan never matches another plan's copy
_MANAGER_IDS: Final = itertools.count(1)


class _ManagerParts(NamedTuple):
    fingerprint: bytes
    host: Pool
    disk: Pool | None
    policy_name: str
    record_events: bool


class Manager:
    """The host (and optional disk) block pool of one model/layout fingerprint.

    Build it with ``Manager.create(num_host_blocks, fingerprint=..., ...)``.

    Owns Python state only (see the module docstring); nothing to close. Every method either does all
    it says or raises before changing anything (state, policy order, counters, events). Not
    thread-safe.
    """

    def __init__(self, parts: _ManagerParts) -> None:
        """Take the pools :meth:`create` built (use :meth:`create`).

        Raises:
            ArgumentTypeError: ``parts`` is not what :meth:`create` builds.
        """
        if not isinstance(parts, _ManagerParts):
            raise ArgumentTypeError(
                "a Manager is built with Manager.create(num_host_blocks, fingerprint=..., ...), not "
                f"Manager({type(parts).__name__})"
            )
        fingerprint, host, disk = parts.fingerprint, parts.host, parts.disk
        policy_name, record_events = parts.policy_name, parts.record_events
        self._fingerprint = fingerprint
        self._namespace = namespace_prefix(fingerprint)
        self._owner = next(_MANAGER_IDS)
        self._host = host
        self._disk = disk
        self._policy_name = policy_name
        self._record_events = record_events
        self._epoch = 0
        self._entries: dict[bytes, Entry] = {}
        self._ready: set[bytes] = set()  # keys loadable from some tier
        self._stores: dict[int, PlanCopies] = {}  # outstanding store plan -> its pending copies
        self._loads: dict[int, dict[bytes, Tier]] = {}  # outstanding load plan -> key -> tier
        self._fences: dict[FenceKey, list[tuple[Pool, int]]] = {}
        self._events: list[BlockEvent] = []
        self._n = Counts()

    @classmethod
    def create(
        cls,
        num_host_blocks: int,
        *,
        fingerprint: bytes | str,
        num_disk_blocks: int = 0,
        policy: str | PolicyFactory = "lru",
        record_events: bool = True,
    ) -> Manager:
        """Build a manager with every block free.

        Args:
            num_host_blocks: host pool size, in blocks (>= 1); blocks are ``0 .. num_host_blocks - 1``.
            fingerprint: names the model and KV layout (non-empty bytes, or str encoded as UTF-8).
            num_disk_blocks: disk pool size, in blocks (>= 0; 0 means no disk tier).
            policy: ``"lru"``, ``"arc"`` or a factory ``capacity -> EvictionPolicy`` (called once per
                tier).
            record_events: keep events for :meth:`events`; with False nothing is recorded (an engine
                that never drains them should pass False, the list is unbounded).

        Raises:
            ArgumentTypeError: a size is not an int, ``record_events`` not a bool, or a bad fingerprint.
            InvalidArgumentError: ``num_host_blocks < 1``, ``num_disk_blocks < 0``, empty fingerprint.
            UnknownPolicyError: ``policy`` is a name not in :data:`POLICY_NAMES`.
        """
        fp = fingerprint_bytes(fingerprint)
        sizes = (("num_host_blocks", num_host_blocks, 1), ("num_disk_blocks", num_disk_blocks, 0))
        for name, value, low in sizes:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ArgumentTypeError(
                    f"{name} = {value!r} is a {type(value).__name__}; it must be an int"
                )
            if value < low:
                raise InvalidArgumentError(f"{name} = {value} must be >= {low}")
        if not isinstance(record_events, bool):
            raise ArgumentTypeError(f"record_events = {record_events!r} must be a bool")
        if isinstance(policy, str):
            factory = POLICY_NAMES.get(policy)
            if factory is None:
                raise UnknownPolicyError(f"policy = {policy!r} is not one of {sorted(POLICY_NAMES)}")
            policy_name = policy
        elif callable(policy):
            factory = policy
            policy_name = getattr(policy, "__name__", type(policy).__name__)
        else:
            raise ArgumentTypeError(f"policy = {policy!r} must be a policy name or a factory")
        host = Pool(Tier.HOST, num_host_blocks, factory(num_host_blocks))
        disk = Pool(Tier.DISK, num_disk_blocks, factory(num_disk_blocks)) if num_disk_blocks else None
        return cls(_ManagerParts(fp, host, disk, policy_name, record_events))

    # ----------------------------------------------------------------- read-only views

    @property
    def fingerprint(self) -> bytes:
        """The model/layout fingerprint this manager is bound to (see :meth:`namespaced`)."""
        return self._fingerprint

    @property
    def epoch(self) -> int:
        """Incremented by every :meth:`reset`; plans from an earlier epoch are fenced."""
        return self._epoch

    @property
    def num_host_blocks(self) -> int:
        """Host pool size, in blocks."""
        return self._host.capacity

    @property
    def num_disk_blocks(self) -> int:
        """Disk pool size, in blocks (0: no disk tier)."""
        return self._disk.capacity if self._disk is not None else 0

    @property
    def host_policy(self) -> EvictionPolicy:
        """The host tier's policy, for inspection: call only ``victims`` (it changes nothing)."""
        return self._host.policy

    @property
    def disk_policy(self) -> EvictionPolicy | None:
        """The disk tier's policy (for inspection, as :attr:`host_policy`), or None without a disk tier."""
        return self._disk.policy if self._disk is not None else None

    def namespaced(self, key: bytes) -> bytes:
        """``namespaced_key(self.fingerprint, key)``: the name a persistent tier should store under."""
        if not isinstance(key, bytes):
            raise KeyTypeError(f"key = {key!r} is a {type(key).__name__}; keys must be bytes")
        return self._namespace + key

    # ----------------------------------------------------------------- queries

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Return how many leading ``keys`` are ready (loadable) in some tier.

        Pending stores and pending demotions do not count; loading keys do (loads may overlap). Does
        not count as a use for the policy (see :meth:`touch`). Duplicates are allowed.

        Raises:
            KeyTypeError: ``keys`` is not a sequence of bytes (checked for every key, not just the
                prefix).
        """
        check_keys("keys", keys)
        ready = self._ready
        if ready.issuperset(keys):  # one C loop when every key is ready
            hits = len(keys)
        else:  # the ready prefix, counted in C too
            hits = len(list(itertools.takewhile(ready.__contains__, keys)))
        self._n.lookups += 1
        self._n.lookup_keys += len(keys)
        self._n.lookup_hits += hits
        return hits

    def touch(self, keys: Sequence[bytes]) -> None:
        """Tell the policies that ``keys`` were used, in order.

        Keys that have no ready copy (unknown, pending, cleared) are ignored: touching is advisory and
        the scheduler may touch blocks it never offloaded. Duplicates are allowed.

        Raises:
            KeyTypeError: ``keys`` is not a sequence of bytes.
        """
        check_keys("keys", keys)
        entries = self._entries
        host_hit = self._host.policy.hit
        disk_policy = self._disk.policy if self._disk is not None else None
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                continue
            if entry.host_state is READY:
                host_hit(key)
            if entry.disk_state is READY and disk_policy is not None:
                disk_policy.hit(key)

    def events(self) -> list[BlockEvent]:
        """Return and forget the events recorded since the last call, oldest first."""
        out, self._events = self._events, []
        return out

    def stats(self) -> ManagerStats:
        """A snapshot of block states and counters (O(1))."""
        disk = self._disk.stats() if self._disk is not None else TierStats(Tier.DISK, 0, 0, 0, 0, 0, 0)
        return self._n.snapshot(self._policy_name, self._epoch, self._host.stats(), disk)

    # ----------------------------------------------------------------- stores

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Allocate host blocks for the ``keys`` not held yet, evicting ready blocks if needed.

        Keys already held in any tier and any state (pending, ready, loading) are skipped; they are
        also protected: neither their host nor their disk copy is evicted by this plan. Only ready,
        non-loading blocks are evicted, in the policy's order. With a disk tier, evicted host copies
        that have no disk copy are demoted while the disk pool has room, evicting ready disk blocks
        by the disk policy for it; the rest are dropped.

        Returns the plan (possibly with no keys, when all are held), or None when the free and
        evictable host blocks cannot take every new key; then nothing changed. The engine must run
        ``plan.demotions`` before the store's copy overwrites their host blocks, then call
        :meth:`complete_demote` and :meth:`complete_store`.

        Raises:
            KeyTypeError: ``keys`` is not a sequence of bytes.
            DuplicateKeyError: a key appears twice (it would get two blocks).
            PolicyError: a custom policy proposed a victim that is not evictable.
        """
        check_unique_keys("keys", keys)
        entries = self._entries
        host = self._host
        new = [key for key in keys if key not in entries]
        protected: AbstractSet[bytes] = NO_KEYS
        if len(new) != len(keys):
            protected = {key for key in keys if key in entries}
        need = len(new) - len(host.free)
        host_victims: list[bytes] = []
        host_entries: list[Entry] = []
        if need > 0:
            host_victims = host.policy.victims(need, protected)
            host_entries = victim_entries(self._entries, host, host_victims, need, protected)
            if len(host_victims) < need:
                return None
        disk = self._disk
        demote_room = 0
        demotable: list[bool] = []  # co-indexed with host_victims: no disk copy, may be demoted
        disk_victims: list[bytes] = []
        disk_entries: list[Entry] = []
        if disk is not None and host_victims:  # dry run: room on disk for the victims without a copy
            demotable = [entry.disk_state is None for entry in host_entries]
            candidates = sum(demotable)
            shortfall = candidates - len(disk.free)
            if shortfall > 0:
                disk_victims = disk.policy.victims(shortfall, protected)
                disk_entries = victim_entries(self._entries, disk, disk_victims, shortfall, protected)
            demote_room = min(candidates, len(disk.free) + len(disk_victims))

        plan_id = next(_PLAN_IDS)
        if disk_victims:
            assert disk is not None  # disk victims exist only with a disk tier
            self._evict(disk, disk_victims, disk_entries)
            self._forget(disk_victims, disk_entries)
        demotions: list[Demotion] = []
        demoted: list[Entry] = []
        if host_victims:
            self._evict(host, host_victims, host_entries)
            if demote_room:
                assert disk is not None  # room for demotions exists only with a disk tier
                for key, entry, may_demote in zip(host_victims, host_entries, demotable):
                    if may_demote:
                        entry.disk = disk.free.pop()
                        entry.disk_state = PENDING
                        entry.disk_plan = plan_id
                        entry.demote_src = entry.host
                        demotions.append(Demotion(key, entry.host, entry.disk))
                        demoted.append(entry)
                        if len(demoted) == demote_room:
                            break
                disk.pending += len(demoted)
            self._forget(host_victims, host_entries)
        blocks = host.take(len(new))
        created = [Entry(block, plan_id) for block in blocks]
        entries.update(zip(new, created))
        host.pending += len(new)
        plan_keys = tuple(new)
        plan_demotions = tuple(demotions)
        if created or demoted:
            self._stores[plan_id] = PlanCopies(plan_keys, created, plan_demotions, demoted)
        self._n.stores_planned += len(new)
        self._n.host_evictions += len(host_victims)
        self._n.disk_evictions += len(disk_victims)
        self._n.demotions_planned += len(demotions)
        return StorePlan(
            owner=self._owner,
            plan_id=plan_id,
            epoch=self._epoch,
            keys=plan_keys,
            host_blocks=tuple(blocks),
            evicted=tuple(host_victims),
            disk_evicted=tuple(disk_victims),
            demotions=plan_demotions,
        )

    def complete_store(self, plan: StorePlan, ok: bool, keys: Sequence[bytes] | None = None) -> None:
        """Finish the store of ``keys`` (default: all of ``plan.keys``) of ``plan``.

        With ``ok`` the host copies become ready (``STORED`` events); without, their blocks are freed
        and the keys are not held anywhere (``STORE_FAILED`` events): a failed store is never
        loadable. A plan from before the last :meth:`reset` is a no-op (it only unfences its blocks).

        Raises:
            ArgumentTypeError: ``plan`` is not a StorePlan or ``ok`` not a bool.
            InvalidArgumentError: ``plan`` was prepared by another manager.
            KeyTypeError / DuplicateKeyError: bad ``keys``.
            UnknownKeyError: a key is not in ``plan.keys``.
            KeyStateError: a key's store from this plan was already completed.
        """
        self._check_plan(plan, StorePlan, ok)
        done = self._complete_copies(plan, ok, keys, plan.keys, FenceKind.STORE)
        if ok:
            self._n.stores_completed += done
        else:
            self._n.stores_failed += done

    def complete_demote(self, plan: StorePlan, ok: bool, keys: Sequence[bytes] | None = None) -> None:
        """Finish the demotions of ``keys`` (default: every key of ``plan.demotions``).

        With ``ok`` the disk copies become ready (``STORED`` events on the disk tier); without, the
        disk blocks are freed and the keys dropped (``STORE_FAILED`` events on the disk tier). A plan
        from before the last :meth:`reset` is a no-op (it only unfences its blocks).

        Raises: as :meth:`complete_store`, for the demotion keys of ``plan``.
        """
        self._check_plan(plan, StorePlan, ok)
        done = self._complete_copies(plan, ok, keys, [d.key for d in plan.demotions], FenceKind.DEMOTE)
        if ok:
            self._n.demotions_completed += done
        else:
            self._n.demotions_failed += done

    def _complete_copies(
        self,
        plan: StorePlan,
        ok: bool,
        keys: Sequence[bytes] | None,
        plan_keys: Sequence[bytes],
        what: FenceKind,
    ) -> int:
        """The body of :meth:`complete_store` (``what`` STORE: host copies) and
        :meth:`complete_demote` (DEMOTE: disk copies) once the plan is checked; returns how many
        copies it completed (0 for a plan of an earlier epoch)."""
        if keys is not None:
            check_plan_keys(plan.plan_id, keys, plan_keys)
        if plan.epoch != self._epoch:
            self._complete_stale(plan.plan_id, what, plan_keys if keys is None else keys)
            return 0
        on_host = what is FenceKind.STORE
        copies = self._stores.get(plan.plan_id)
        found: list[Entry] | None = None
        if keys is None and copies is not None:
            recorded, left, whole = (
                (copies.host, copies.host_left, copies.keys is plan.keys)
                if on_host
                else (copies.disk, copies.disk_left, copies.demotions is plan.demotions)
            )
            if whole and left == len(recorded):  # the whole plan, every copy still pending
                keys, found = plan_keys, recorded
        if found is None:
            keys = plan_keys if keys is None else keys
            found = pending_entries(self._entries, plan.plan_id, keys, HOST if on_host else DISK)
        if not found:
            return 0
        assert copies is not None and keys is not None  # a pending copy belongs to a recorded plan
        pool = self._host if on_host else self._disk
        assert pool is not None  # a pending demotion exists only with a disk tier
        state = "host_state" if on_host else "disk_state"
        pool.pending -= len(found)
        if ok:
            admit = pool.policy.admit
            for key, entry in zip(keys, found):
                setattr(entry, state, READY)
                admit(key)
            self._ready.update(keys)
        else:
            pool.free += map(pool.block_of, found)
            for entry in found:
                setattr(entry, state, None)
            self._forget(keys, found)
        if self._record_events:
            self._events += events_of(STORED if ok else STORE_FAILED, keys, pool.tier)
        if on_host:
            copies.host_left -= len(found)
        else:
            copies.disk_left -= len(found)
        if not copies.host_left and not copies.disk_left:
            del self._stores[plan.plan_id]
        return len(found)

    # ----------------------------------------------------------------- loads

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Reference the ready copies of ``keys`` for loading; they stay unevictable until completed.

        Each key is loaded from the host when its host copy is ready, else from disk. Its reference
        count in that tier grows by one, and the load counts as a use for the policy.

        Raises:
            KeyTypeError / DuplicateKeyError: bad ``keys`` (one key twice would be ambiguous to
                complete).
            UnknownKeyError: a key is not held in any tier.
            KeyStateError: a key is held but not ready (its store or demotion is pending).
        """
        check_unique_keys("keys", keys)
        entries = self._entries
        ready = self._ready
        found: list[Entry] = []
        for i, key in enumerate(keys):
            entry = entries.get(key)
            if entry is None:
                raise UnknownKeyError(f"keys[{i}] = {key!r} is not held in any tier")
            if key not in ready:
                raise KeyStateError(f"keys[{i}] = {key!r} is not ready (its store or demotion is pending)")
            found.append(entry)
        host, disk = self._host, self._disk
        tiers: list[Tier] = []
        blocks: list[int] = []
        outstanding: dict[bytes, Tier] = {}
        for key, entry in zip(keys, found):
            if entry.host_state is READY:
                tier, pool, block = HOST, host, entry.host
                entry.host_refs += 1
                first = entry.host_refs == 1
            else:
                assert disk is not None  # ready and not on host: ready on disk
                tier, pool, block = DISK, disk, entry.disk
                entry.disk_refs += 1
                first = entry.disk_refs == 1
            pool.policy.hit(key)
            if first:
                pool.policy.hold(key)
                pool.loading += 1
            tiers.append(tier)
            blocks.append(block)
            outstanding[key] = tier
        plan_id = next(_PLAN_IDS)
        if outstanding:
            self._loads[plan_id] = outstanding
        self._n.loads_planned += len(keys)
        return LoadPlan(self._owner, plan_id, self._epoch, tuple(keys), tuple(tiers), tuple(blocks))

    def complete_load(
        self, plan: LoadPlan, keys: Sequence[bytes] | None = None, *, ok: bool = True
    ) -> None:
        """Drop the references ``plan`` took on ``keys`` (default: all of ``plan.keys``).

        With ``ok=False`` (the load failed) a key's host copy stays (host memory is unchanged by a
        failed copy), but its disk copy is dropped: the disk tier drops a record that fails its
        check, so offering it again would fail every later load. It stops being offered at once
        and its disk block is freed when the last load holding it completed (event ``REMOVED``).
        A plan from before the last :meth:`reset` is a no-op (it only unfences its blocks).

        Raises:
            ArgumentTypeError: ``plan`` is not a LoadPlan.
            InvalidArgumentError: ``plan`` was prepared by another manager.
            KeyTypeError / DuplicateKeyError: bad ``keys``.
            UnknownKeyError: a key is not in ``plan.keys``.
            KeyStateError: a key of this plan was already completed (no matching ``prepare_load``).
            ArgumentTypeError: ``ok`` is not a bool.
        """
        if not isinstance(ok, bool):
            raise ArgumentTypeError(f"ok = {ok!r} must be a bool")
        self._check_plan(plan, LoadPlan, True)
        if keys is None:
            keys = plan.keys
        else:
            check_plan_keys(plan.plan_id, keys, plan.keys)
        if plan.epoch != self._epoch:
            self._complete_stale(plan.plan_id, FenceKind.LOAD, keys)
            return
        outstanding = self._loads.get(plan.plan_id, {})
        for key in keys:
            if key not in outstanding:
                raise KeyStateError(
                    f"key {key!r} of plan {plan.plan_id} has no outstanding prepare_load: it was "
                    "already completed"
                )
        entries = self._entries
        for key in keys:
            tier = outstanding.pop(key)
            entry = entries[key]
            if tier is HOST:
                pool = self._host
                entry.host_refs -= 1
                last = entry.host_refs == 0
            else:
                assert self._disk is not None  # a disk load exists only with a disk tier
                pool = self._disk
                entry.disk_refs -= 1
                last = entry.disk_refs == 0
                if not ok and entry.disk_state is READY:
                    entry.disk_state = FAILED  # no longer offered
                    if entry.host_state is not READY:
                        self._ready.discard(key)
            if last:
                pool.policy.release(key)
                pool.loading -= 1
                if tier is DISK and entry.disk_state is FAILED:
                    self._drop_failed_disk_copy(key, entry)
        if not outstanding:
            self._loads.pop(plan.plan_id, None)
        self._n.loads_completed += len(keys)
        if not ok:
            self._n.loads_failed += len(keys)

    # ----------------------------------------------------------------- reset

    def reset(self, *, in_flight_done: bool = False) -> None:
        """Forget every key and start a new epoch; plans prepared before are fenced.

        Emits ``REMOVED`` for every loadable copy. Completions of earlier plans become no-ops. By
        default, blocks that earlier plans copy into or out of (pending stores and demotions, loads
        not completed) stay *fenced* (not free) until their stale completion arrives, so no new plan
        gets a block an old DMA may still touch; the engine must keep calling ``complete_*`` for those
        plans. Pass ``in_flight_done=True`` when no copy of an earlier plan can still run (e.g. the
        worker was shut down): every block is free at once. Counters survive the reset.

        Raises:
            ArgumentTypeError: ``in_flight_done`` is not a bool.
        """
        if not isinstance(in_flight_done, bool):
            raise ArgumentTypeError(f"in_flight_done = {in_flight_done!r} must be a bool")
        entries = self._entries
        if self._record_events:
            events = self._events
            for key in self._ready:
                entry = entries[key]
                if entry.host_state is READY:
                    events.append(BlockEvent(REMOVED, key, HOST))
                if entry.disk_state is READY:
                    events.append(BlockEvent(REMOVED, key, DISK))
        host, disk = self._host, self._disk
        if in_flight_done:
            self._fences.clear()
        else:
            for plan_id, copies in self._stores.items():  # every pending copy is in its plan's record
                for key, entry in zip(copies.keys, copies.host):
                    if entry.host_state is PENDING and entry.host_plan == plan_id:
                        self._fence((plan_id, FenceKind.STORE, key), [(host, entry.host)])
                for demotion, entry in zip(copies.demotions, copies.disk):
                    if entry.disk_state is PENDING and entry.disk_plan == plan_id:
                        assert disk is not None  # a pending demotion exists only with a disk tier
                        holds = [(disk, entry.disk), (host, entry.demote_src)]
                        self._fence((plan_id, FenceKind.DEMOTE, demotion.key), holds)
            for plan_id, outstanding in self._loads.items():
                for key, tier in outstanding.items():
                    entry = entries[key]
                    pool, block = (host, entry.host) if tier is HOST else (disk, entry.disk)
                    assert pool is not None  # a disk load exists only with a disk tier
                    self._fence((plan_id, FenceKind.LOAD, key), [(pool, block)])
        fenced: dict[Pool, dict[int, int]] = {host: {}}
        if disk is not None:
            fenced[disk] = {}
        for holds in self._fences.values():
            for pool, block in holds:
                fenced[pool][block] = fenced[pool].get(block, 0) + 1
        host.reset(fenced[host])
        if disk is not None:
            disk.reset(fenced[disk])
        entries.clear()
        self._ready.clear()
        self._stores.clear()
        self._loads.clear()
        self._epoch += 1
        self._n.resets += 1

    # ----------------------------------------------------------------- helpers

    def _check_plan(self, plan: object, kind: type[StorePlan] | type[LoadPlan], ok: object) -> None:
        """Validate a completion's plan and ``ok`` (before its keys)."""
        if not isinstance(plan, kind):
            raise ArgumentTypeError(
                f"plan = {plan!r:.80} is a {type(plan).__name__}; expected a {kind.__name__}"
            )
        if plan.owner != self._owner:
            raise InvalidArgumentError(f"plan {plan.plan_id} was prepared by another Manager")
        if not isinstance(ok, bool):
            raise ArgumentTypeError(f"ok = {ok!r} is a {type(ok).__name__}; it must be a bool")

    def _evict(self, pool: Pool, victims: list[bytes], found: list[Entry]) -> None:
        """Evict ``victims`` (checked, with their entries ``found``) from ``pool``: ``REMOVED`` events.
        See :meth:`_forget` for the rest."""
        evict_entries(pool, victims, found)
        if self._record_events:
            self._events += events_of(REMOVED, victims, pool.tier)

    def _forget(self, keys: Sequence[bytes], found: list[Entry]) -> None:
        """Drop the entries (``found``) of ``keys`` left with no copy; keep ``_ready`` exact for them."""
        entries = self._entries
        still_ready: list[bytes] = []
        for key, entry in zip(keys, found):
            if entry.host_state is None and entry.disk_state is None:
                del entries[key]
            elif entry.host_state is READY or entry.disk_state is READY:
                still_ready.append(key)
        self._ready.difference_update(keys)
        if still_ready:
            self._ready.update(still_ready)

    def _drop_failed_disk_copy(self, key: bytes, entry: Entry) -> None:
        """Free the disk block of a copy a load found damaged, once no load holds it."""
        disk = self._disk
        assert disk is not None
        disk.policy.evict(key)
        disk.free.append(entry.disk)
        entry.disk_state = None
        self._n.disk_copies_dropped += 1
        if self._record_events:
            self._events.append(BlockEvent(REMOVED, key, DISK))
        self._forget([key], [entry])

    def _fence(self, key: FenceKey, holds: list[tuple[Pool, int]]) -> None:
        self._fences.setdefault(key, []).extend(holds)

    def _complete_stale(self, plan_id: int, what: FenceKind, keys: Iterable[bytes]) -> None:
        """A completion from an earlier epoch: release the blocks it fenced, change nothing else."""
        release_fenced(self._fences, plan_id, what, keys)
        self._n.stale_completions += 1
