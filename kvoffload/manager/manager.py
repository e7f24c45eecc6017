"""Manager: the scheduler-side block pool — which KV blocks the host pool and the disk hold, and
which move.

The :class:`Manager` decides *which* blocks move; a Worker moves the bytes. It owns only Python
memory (the key → block map of each tier, free lists, eviction policies, the copies each outstanding
plan still waits for, counters and undrained events), holds no OS or GPU resource and so has no
close method (a remote index it is given is borrowed: its creator closes it), and imports neither
torch, numpy nor CUDA. Not thread-safe: call it from the scheduler thread. It takes one call at a
time: a call made inside another (from a policy's notification or a remote index) raises
:class:`~kvoffload.errors.PolicyError` and does nothing (so do most calls that overlap from two
threads, but that check is not a lock).

A key's copy in a tier is *pending* (a copy into it is in flight: not loadable, not evictable),
*ready* (loadable, evictable) or *loading* (ready, with loads holding it: not evictable). The engine's
protocol — ``lookup`` / ``prepare_load`` / ``complete_load``, ``prepare_store`` (with write-back
demotions to disk) / ``complete_demote`` / ``complete_store``, ``events`` — and the fencing of plans
across :meth:`Manager.reset` are described in docs/design.md §11; with a remote index, lookups and
loads reach the remote store and ``prepare_remote_put`` / ``complete_remote_put`` write stores
through to it (§14). The manager's state and the moves several operations share are in
:mod:`kvoffload.manager.base`. Every method either does all it says or raises before changing
anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Final

from kvoffload._memory import host_memory_available
from kvoffload.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    KeyStateError,
    KeyTypeError,
    PolicyError,
    UnknownKeyError,
)
from kvoffload.manager.base import ManagerBase, ManagerParts
from kvoffload.manager.policies import EvictionPolicy, PolicyFactory, resolve_policy
from kvoffload.manager.records import (
    BlockEvent,
    Demotion,
    DiskRecord,
    LoadPlan,
    ManagerStats,
    RemotePutPlan,
    StorePlan,
    Tier,
    TierStats,
    events_of,
    fingerprint_bytes,
    namespace_prefix,
)
from kvoffload.manager.remote import (
    DEFAULT_REMOTE_TIMEOUT_S,
    RemoteIndex,
    RemoteLink,
    check_remote_timeout,
    eligible_for_put,
    hold_for_put,
    release_put,
)
from kvoffload.manager.state import (
    DISK,
    FAILED,
    HOST,
    NO_KEYS,
    PENDING,
    READY,
    REMOTE,
    STORE_FAILED,
    STORED,
    Entry,
    FenceKind,
    PlanCopies,
    Pool,
    check_keys,
    check_plan_keys,
    check_unique_keys,
    pending_entries,
    victim_entries,
)

__all__ = ["MAX_TIER_BLOCKS", "Manager"]

_PLAN_IDS: Final = itertools.count(1)  # process-wide, so a plan never matches another plan's copy

#: The most blocks a tier may have. A tier's free list is a Python list of its block ids (about 40
#: bytes a block), so 2**31 blocks already take 80 GiB of the scheduler's memory; a larger size is a
#: mistake (bytes for blocks, a unit slip), refused before anything is built.
MAX_TIER_BLOCKS: Final = 2**31
_LIST_BYTES_PER_BLOCK: Final = 40


def _made(factory: PolicyFactory, name: str, capacity: int) -> EvictionPolicy:
    """``factory(capacity)``, what it raises typed.

    Raises:
        PolicyError: the factory raised (a factory that takes no capacity raised ``TypeError``).
    """
    try:
        return factory(capacity)
    except MemoryError:
        raise
    except Exception as exc:
        raise PolicyError(
            f"the policy factory {name}({capacity}) raised {exc!r}: a factory takes the tier's "
            "capacity in blocks and returns an EvictionPolicy"
        ) from exc


def _disk_records(records: object) -> list[tuple[int, int, bytes]]:
    """``(block, generation, name)`` of each of ``records`` (:class:`DiskRecord`).

    Raises:
        ArgumentTypeError: not iterable, or a record whose block or generation is not an int.
        KeyTypeError: a record whose name is not bytes.
    """
    if isinstance(records, (str, bytes)) or not isinstance(records, Iterable):
        raise ArgumentTypeError(
            f"records = {records!r:.80} must be an iterable of disk records "
            "(Worker.disk_valid_blocks().values())"
        )
    out: list[tuple[int, int, bytes]] = []
    for i, record in enumerate(records):
        block, generation, name = (getattr(record, f, None) for f in ("block", "generation", "key"))
        for field, value in (("block", block), ("generation", generation)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentTypeError(
                    f"records[{i}] = {record!r:.80} has {field} {value!r:.40}; a disk record's "
                    "block and generation are ints (kvoffload.DiskRecordInfo)"
                )
        if not isinstance(name, bytes):
            raise KeyTypeError(f"records[{i}] = {record!r:.80} has key {name!r:.40}; names are bytes")
        assert isinstance(block, int) and isinstance(generation, int)
        out.append((block, generation, name))
    return out


class Manager(ManagerBase):
    """The host (and optional disk) block pool of one model/layout fingerprint.

    Build it with ``Manager.create(num_host_blocks, fingerprint=..., ...)``.

    Owns Python state only (see the module docstring); nothing to close. Every method either does all
    it says or raises before changing anything (state, policy order, counters, events) — but for a
    custom policy that raises from a notification (``admit``, ``hit``, ``hold``, ``release``,
    ``evict``, ``clear``): the call then completes whole, makes its other notifications, and raises
    :class:`PolicyError` (its ``result`` is what the call returns), so the manager's state is never
    left half-changed. Not thread-safe; one call at a time (a policy that calls its manager from a
    notification gets :class:`PolicyError` there, which the call it is in raises in turn).
    """

    @classmethod
    def create(
        cls,
        num_host_blocks: int,
        *,
        fingerprint: bytes | str,
        num_disk_blocks: int = 0,
        policy: str | PolicyFactory = "lru",
        record_events: bool = True,
        remote: RemoteIndex | None = None,
        remote_timeout_s: float = DEFAULT_REMOTE_TIMEOUT_S,
    ) -> Manager:
        """Build a manager with every block free.

        Args:
            num_host_blocks: host pool size, in blocks (1 .. :data:`MAX_TIER_BLOCKS`); blocks are
                ``0 .. num_host_blocks - 1``.
            fingerprint: names the model and KV layout (non-empty bytes, or str encoded as UTF-8).
            num_disk_blocks: disk pool size, in blocks (0 .. :data:`MAX_TIER_BLOCKS`; 0 means no disk
                tier).
            policy: ``"lru"``, ``"arc"`` or a factory ``capacity -> EvictionPolicy`` (called once per
                tier).
            record_events: keep events for :meth:`events`; with False nothing is recorded (an engine
                that never drains them should pass False, the list is unbounded).
            remote: a remote store shared by engine instances (anything with a batched
                ``exists(keys, *, timeout)``, e.g. ``kvoffload.open_remote_index(...)``): lookups
                extend past the local tiers into it, and keys not held locally load from it.
            remote_timeout_s: deadline of the remote existence check of one :meth:`lookup`.

        Raises:
            ArgumentTypeError: a size is not an int, ``record_events`` not a bool, a bad fingerprint,
                a ``remote`` without ``exists``, ``remote_timeout_s`` not a number, or a policy
                factory that returned something without an EvictionPolicy's methods.
            InvalidArgumentError: ``num_host_blocks < 1``, ``num_disk_blocks < 0``, a size over
                :data:`MAX_TIER_BLOCKS` or one whose free list this process cannot hold, empty fingerprint,
                ``remote_timeout_s`` not a finite number > 0 (with or without ``remote``).
            UnknownPolicyError: ``policy`` is a name not in :data:`POLICY_NAMES`.
            PolicyError: the policy factory raised.
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
            if value > MAX_TIER_BLOCKS:
                raise InvalidArgumentError(
                    f"{name} = {value} is over the most blocks a tier may have, {MAX_TIER_BLOCKS} "
                    "(a size in blocks, not bytes)"
                )
        available = host_memory_available()
        need = _LIST_BYTES_PER_BLOCK * (num_host_blocks + num_disk_blocks)
        if available is not None and need > available[0]:  # overcommit: no MemoryError, a kill
            raise InvalidArgumentError(
                f"num_host_blocks = {num_host_blocks} and num_disk_blocks = {num_disk_blocks}: their "
                f"free lists need about {need / 2**30:.1f} GiB ({_LIST_BYTES_PER_BLOCK} bytes a block), "
                f"over the {available[0] / 2**30:.1f} GiB this process can populate ({available[1]})"
            )
        if not isinstance(record_events, bool):
            raise ArgumentTypeError(f"record_events = {record_events!r} must be a bool")
        factory, policy_name = resolve_policy(policy)
        check_remote_timeout(remote_timeout_s)  # a bad one is refused with or without a remote index
        link = None if remote is None else RemoteLink.create(remote, remote_timeout_s, namespace_prefix(fp))
        try:
            host = Pool(Tier.HOST, num_host_blocks, _made(factory, policy_name, num_host_blocks))
            disk = (Pool(Tier.DISK, num_disk_blocks, _made(factory, policy_name, num_disk_blocks))
                    if num_disk_blocks else None)
        except MemoryError:  # the free lists of a size under the bound, on a small machine
            raise InvalidArgumentError(
                f"num_host_blocks = {num_host_blocks} and num_disk_blocks = {num_disk_blocks}: this "
                f"process cannot hold their free lists (about {_LIST_BYTES_PER_BLOCK} bytes a block)"
            ) from None
        return cls(ManagerParts(fp, host, disk, policy_name, record_events, link))


    # ----------------------------------------------------------------- queries

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Return how many leading ``keys`` are ready (loadable) in some tier.

        Pending stores and pending demotions do not count; loading keys do (loads may overlap). With
        a remote index, the keys after the local prefix that no local tier holds are checked in the
        remote store (one batched call, at most ``remote_timeout_s``; any failure is a miss). Does
        not count as a use for the policy (see :meth:`touch`). Duplicates are allowed.

        Raises:
            KeyTypeError: ``keys`` is not a sequence of bytes (checked for every key, not just the
                prefix).
        """
        self._enter("lookup")
        try:
            check_keys("keys", keys)
            ready = self._ready
            if ready.issuperset(keys):  # one C loop when every key is ready
                hits = len(keys)
            else:  # the ready prefix, counted in C too
                hits = len(list(itertools.takewhile(ready.__contains__, keys)))
                if self._remote is not None:  # then the keys held nowhere here that the store holds
                    hits += self._remote.extend(keys, hits, self._entries, self._n)
            self._n.lookups += 1
            self._n.lookup_keys += len(keys)
            self._n.lookup_hits += hits
            return hits
        finally:
            self._calling = None

    def touch(self, keys: Sequence[bytes]) -> None:
        """Tell the policies that ``keys`` were used, in order.

        Keys that have no ready copy (unknown, pending, cleared) are ignored: touching is advisory and
        the scheduler may touch blocks it never offloaded. Duplicates are allowed.

        Raises:
            KeyTypeError: ``keys`` is not a sequence of bytes.
            PolicyError: a custom policy's notification raised (after the call's change, which stands).
        """
        self._enter("touch")
        try:
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
            self._check_policies()
        finally:
            self._calling = None

    def events(self) -> list[BlockEvent]:
        """Return and forget the events recorded since the last call, oldest first."""
        self._enter("events")
        try:
            out, self._events = self._events, []
            return out
        finally:
            self._calling = None

    def stats(self) -> ManagerStats:
        """A snapshot of block states and counters (O(1))."""
        disk = self._disk.stats() if self._disk is not None else TierStats(Tier.DISK, 0, 0, 0, 0, 0, 0)
        return self._n.snapshot(self._policy_name, self._epoch, self._host.stats(), disk)

    # ----------------------------------------------------------------- warm restart

    def adopt_disk(self, records: Iterable[DiskRecord]) -> list[bytes]:
        """Take the records a warm-restarted disk tier holds under this manager's names as ready
        disk copies: ``records`` as ``Worker.disk_valid_blocks().values()`` lists them
        (:class:`DiskRecord`), each named :meth:`namespaced` of its key by
        ``Worker.demote(..., keys=...)``, so that no other model's record of the same block hash is
        ever taken. Call it before this manager plans its first demotion (then its own writes may
        have replaced what the list says), with a list read from the tier after the Worker opened
        it and before any job wrote to it.

        A record of another fingerprint, or without a name, is left alone: its block stays free and
        later demotions overwrite it. Of records with the same name, the newest write (the highest
        generation) is taken and the others are left alone. The keys taken become loadable from
        the disk tier (``STORED`` events on it) and are admitted to its policy oldest write first
        (the first victim under LRU); their blocks are no longer free. The manager trusts that each
        block holds its name's record; the Worker verifies every record's checksum when it reads
        it, and its name when the read is given ``keys=[namespaced(key)]``.

        Returns: the keys taken (names without this manager's prefix), oldest write first.

        Raises (nothing changed):
            InvalidArgumentError: no disk tier; this manager already planned a demotion; a record
                to take whose block is out of this manager's range, not free, or that of another
                record to take.
            ArgumentTypeError: ``records`` not iterable, or a record whose block or generation is
                not an int.
            KeyTypeError: a record whose name is not bytes.
            KeyStateError: a key to take that the manager already holds.
            PolicyError: the disk policy's ``admit`` raised (after the call's change, which stands;
                the error's ``result`` is what the call returns).
        """
        self._enter("adopt_disk")
        try:
            pool = self._disk
            if pool is None:
                raise InvalidArgumentError(
                    "adopt_disk needs a disk tier: Manager.create(..., num_disk_blocks=...)"
                )
            if self._n.demotions_planned:
                raise InvalidArgumentError(
                    "adopt_disk must come before the manager's first demotion: its own writes may "
                    "have replaced the records listed; adopt with a new manager right after the "
                    "Worker opened its disk tier"
                )
            listed = _disk_records(records)
            prefix, entries, capacity = self._namespace, self._entries, pool.capacity
            newest: dict[bytes, tuple[int, int, int]] = {}  # key -> (generation, block, position)
            for i, (block, generation, name) in enumerate(listed):
                if not name.startswith(prefix):
                    continue  # another model's record, or one without a name
                key = name[len(prefix):]
                if key in entries:
                    raise KeyStateError(
                        f"records[{i}] names key {key!r}, which the manager already holds"
                    )
                kept = newest.get(key)
                if kept is None or generation > kept[0]:
                    newest[key] = (generation, block, i)
            free = set(pool.free)
            owner: dict[int, int] = {}
            for generation, block, i in newest.values():  # the records to take
                if not 0 <= block < capacity:
                    raise InvalidArgumentError(
                        f"records[{i}] (block {block}) is out of this manager's disk blocks [0, "
                        f"{capacity}): create it with the tier's num_disk_blocks"
                    )
                if block not in free:
                    raise InvalidArgumentError(
                        f"records[{i}] (block {block}) is not a free block (a copy or a plan holds it)"
                    )
                if block in owner:
                    raise InvalidArgumentError(
                        f"records[{i}] and records[{owner[block]}] are both in block {block}"
                    )
                owner[block] = i
            order = sorted(newest.items(), key=lambda item: item[1])  # oldest write first
            keys = [key for key, _ in order]
            taken = set(owner)
            pool.free = [b for b in pool.free if b not in taken]
            admit = pool.policy.admit
            for key, (_, block, _) in order:
                entry = Entry(-1, 0)
                entry.host_state = None
                entry.disk = block
                entry.disk_state = READY
                entries[key] = entry
                admit(key)
            self._ready.update(keys)
            if self._record_events:
                self._events += events_of(STORED, keys, DISK)
            self._check_policies(keys)
            return keys
        finally:
            self._calling = None

    # ----------------------------------------------------------------- stores

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Allocate host blocks for the ``keys`` not held yet, evicting ready blocks if needed.

        Keys already held in any tier and any state (pending, ready, loading) are skipped; they are
        also protected: neither their host nor their disk copy is evicted by this plan. A key whose
        only copy is a disk copy a load found damaged (no longer offered, dropped when the loads
        holding it end) is not held: it is stored again. Only ready, non-loading blocks are
        evicted, in the policy's order. With a disk tier, evicted host copies that have no disk
        copy are demoted while the disk pool has room, evicting ready disk blocks by the disk
        policy for it; the rest are dropped.

        Returns the plan (possibly with no keys, when all are held), or None when the free and
        evictable host blocks cannot take every new key; then nothing changed. The engine must run
        ``plan.demotions`` before the store's copy overwrites their host blocks, then call
        :meth:`complete_demote` and :meth:`complete_store`.

        Raises:
            KeyTypeError: ``keys`` is not a sequence of bytes.
            DuplicateKeyError: a key appears twice (it would get two blocks).
            PolicyError: a custom policy proposed a victim that is not evictable (nothing changed),
                or raised from a notification (the plan was made and is ``result``).
        """
        self._enter("prepare_store")
        try:
            check_unique_keys("keys", keys)
            entries = self._entries
            host = self._host
            new = [key for key in keys if key not in entries]
            protected: AbstractSet[bytes] = NO_KEYS
            revived: dict[bytes, Entry] = {}
            if len(new) != len(keys):
                protected = {key for key in keys if key in entries}
                revived = {key: e for key in protected if (e := entries[key]).host_state is None
                           and e.disk_state is FAILED}
                if revived:  # their damaged disk copies are not offered: store the keys again
                    new = [key for key in keys if key not in entries or key in revived]
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
            for i, key in enumerate(new):
                if key in revived:  # the entry keeps its failed disk copy until its loads end
                    entry = created[i] = revived[key]
                    entry.host, entry.host_state, entry.host_plan = blocks[i], PENDING, plan_id
                    entry.host_refs = 0
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
            plan = StorePlan(
                owner=self._owner,
                plan_id=plan_id,
                epoch=self._epoch,
                keys=plan_keys,
                host_blocks=tuple(blocks),
                evicted=tuple(host_victims),
                disk_evicted=tuple(disk_victims),
                demotions=plan_demotions,
            )
            self._check_policies(plan)
            return plan
        finally:
            self._calling = None

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
            PolicyError: a custom policy's notification raised (after the call's change, which stands).
        """
        self._enter("complete_store")
        try:
            self._check_plan(plan, StorePlan, ok)
            done = self._complete_copies(plan, ok, keys, plan.keys, FenceKind.STORE)
            if ok:
                self._n.stores_completed += done
            else:
                self._n.stores_failed += done
            self._check_policies()
        finally:
            self._calling = None

    def complete_demote(self, plan: StorePlan, ok: bool, keys: Sequence[bytes] | None = None) -> None:
        """Finish the demotions of ``keys`` (default: every key of ``plan.demotions``).

        With ``ok`` the disk copies become ready (``STORED`` events on the disk tier); without, the
        disk blocks are freed and the keys dropped (``STORE_FAILED`` events on the disk tier). A plan
        from before the last :meth:`reset` is a no-op (it only unfences its blocks).

        Raises: as :meth:`complete_store`, for the demotion keys of ``plan``.
        """
        self._enter("complete_demote")
        try:
            self._check_plan(plan, StorePlan, ok)
            done = self._complete_copies(plan, ok, keys, [d.key for d in plan.demotions], FenceKind.DEMOTE)
            if ok:
                self._n.demotions_completed += done
            else:
                self._n.demotions_failed += done
            self._check_policies()
        finally:
            self._calling = None

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
        count in that tier grows by one, and the load counts as a use for the policy. With a remote
        index, a key held in no local tier comes from the remote store (``Tier.REMOTE``): it gets a
        host block (free, or evicted by the host policy, never one of ``keys``) as a pending host
        copy, which the engine reads the record into and loads from; when no more host blocks can
        be had, the plan stops before that key (``plan.keys`` is then a prefix of ``keys``).

        Raises:
            KeyTypeError / DuplicateKeyError: bad ``keys`` (one key twice would be ambiguous to
                complete).
            UnknownKeyError: a key is not held in any tier, and there is no remote index, or the
                remote store cannot serve it (its remote load failed, or its name is too long:
                ``lookup`` counts neither); nothing is evicted then.
            KeyStateError: a key is held but not ready (its store or demotion is pending).
            PolicyError: a custom policy proposed a victim that is not evictable (nothing changed),
                or raised from a notification (the plan was made and is ``result``).
        """
        self._enter("prepare_load")
        try:
            check_unique_keys("keys", keys)
            entries = self._entries
            ready = self._ready
            found: list[Entry | None] = []
            for i, key in enumerate(keys):
                entry = entries.get(key)
                if entry is None:
                    remote = self._remote
                    if remote is None:
                        raise UnknownKeyError(f"keys[{i}] = {key!r} is not held in any tier")
                    why = remote.refusal(key)
                    if why is not None:  # before any host copy is evicted for it
                        raise UnknownKeyError(f"keys[{i}] = {key!r} is held in no tier, and the remote "
                                              f"store cannot serve it: {why}")
                if entry is not None and key not in ready:
                    why = ("its only copy, on disk, failed a load's check (it is dropped when the loads "
                           "holding it end): store it again" if entry.host_state is None
                           and entry.disk_state is FAILED else "its store or demotion is pending")
                    raise KeyStateError(f"keys[{i}] = {key!r} is not ready ({why})")
                found.append(entry)
            plan_id = next(_PLAN_IDS)
            fetched = self._remote_blocks(keys, found) if None in found else []
            host, disk = self._host, self._disk
            tiers: list[Tier] = []
            blocks: list[int] = []
            outstanding: dict[bytes, Tier] = {}
            for key, entry in zip(keys, found):
                if entry is None:  # from the remote store, into a pending host copy
                    if not fetched:
                        break
                    entry = entries[key] = Entry(fetched.pop(), plan_id)
                    host.pending += 1
                    tiers.append(REMOTE)
                    blocks.append(entry.host)
                    outstanding[key] = REMOTE
                    continue
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
            if outstanding:
                self._loads[plan_id] = outstanding
            self._n.loads_planned += len(tiers)
            self._n.remote_loads_planned += tiers.count(REMOTE)
            plan = LoadPlan(self._owner, plan_id, self._epoch, tuple(keys[: len(tiers)]), tuple(tiers), tuple(blocks))
            self._check_policies(plan)
            return plan
        finally:
            self._calling = None

    def _remote_blocks(self, keys: Sequence[bytes], found: list[Entry | None]) -> list[int]:
        """Host blocks for the remote keys of a load (``found`` None), evicting ready host copies the
        load does not reference; fewer when the host cannot give them. Popped from the end."""
        host = self._host
        need = found.count(None) - len(host.free)
        if need > 0:
            protected = {key for key, entry in zip(keys, found) if entry is not None}
            victims = host.policy.victims(need, protected)
            victim_found = victim_entries(self._entries, host, victims, need, protected)
            self._evict(host, victims, victim_found)
            self._forget(victims, victim_found)
            self._n.host_evictions += len(victims)
        blocks = host.take(min(found.count(None), len(host.free)))
        blocks.reverse()
        return blocks

    def complete_load(
        self, plan: LoadPlan, keys: Sequence[bytes] | None = None, *, ok: bool = True
    ) -> None:
        """Drop the references ``plan`` took on ``keys`` (default: all of ``plan.keys``).

        With ``ok=False`` (the load failed) a key's host copy stays (host memory is unchanged by a
        failed copy), but its disk copy is dropped: the disk tier drops a record that fails its
        check, so offering it again would fail every later load. It stops being offered at once
        and its disk block is freed when the last load holding it completed (event ``REMOVED``).
        A key of ``Tier.REMOTE`` (read into its host block, then loaded) becomes a ready host copy
        with ``ok`` (event ``STORED``); without, its host block is freed, the key forgotten, and
        not offered from the remote store again.
        A plan from before the last :meth:`reset` is a no-op (it only unfences its blocks).

        Raises:
            ArgumentTypeError: ``plan`` is not a LoadPlan.
            InvalidArgumentError: ``plan`` was prepared by another manager.
            KeyTypeError / DuplicateKeyError: bad ``keys``.
            UnknownKeyError: a key is not in ``plan.keys``.
            KeyStateError: a key of this plan was already completed (no matching ``prepare_load``).
            ArgumentTypeError: ``ok`` is not a bool.
            PolicyError: a custom policy's notification raised (after the call's change, which stands).
        """
        self._enter("complete_load")
        try:
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
                if tier is REMOTE:
                    self._finish_remote_load(key, entry, ok)
                    continue
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
            self._check_policies()
        finally:
            self._calling = None

    def _finish_remote_load(self, key: bytes, entry: Entry, ok: bool) -> None:
        """A remote key's read and load finished: its pending host copy becomes ready, or goes."""
        host = self._host
        host.pending -= 1
        if ok:
            entry.host_state = READY
            entry.remote = True
            host.policy.admit(key)
            self._ready.add(key)
            if self._record_events:
                self._events.append(BlockEvent(STORED, key, HOST))
            self._n.remote_loads_completed += 1
        else:
            host.free.append(entry.host)
            del self._entries[key]
            self._require_remote().forget_key(key)
            self._n.remote_loads_failed += 1

    # ----------------------------------------------------------------- remote puts

    def prepare_remote_put(self, keys: Sequence[bytes]) -> RemotePutPlan:
        """Pick the ``keys`` whose host copies to write to the remote store (write-through).

        A key qualifies when its host copy is ready, the store is not known to hold it (this manager
        neither put it nor read it from there) and no put of it is outstanding; others are skipped.
        Each qualifying host copy is held (not evictable, as in a load) until
        :meth:`complete_remote_put`. Call it after :meth:`complete_store`, then run
        ``Worker.put_remote(job, plan.host_blocks, plan.remote_keys)``.

        Raises:
            InvalidArgumentError: the manager has no remote index.
            KeyTypeError / DuplicateKeyError: bad ``keys``.
            PolicyError: a custom policy's notification raised (the plan was made and is
                ``result``).
        """
        self._enter("prepare_remote_put")
        try:
            check_unique_keys("keys", keys)
            remote = self._require_remote()
            picked = [(key, e) for key in keys if eligible_for_put(e := self._entries.get(key)) and e is not None]
            for key, entry in picked:
                hold_for_put(self._host, key, entry)
            plan_id = next(_PLAN_IDS)
            if picked:
                remote.puts[plan_id] = [key for key, _ in picked]
            self._n.remote_puts_planned += len(picked)
            plan = RemotePutPlan(
                self._owner, plan_id, self._epoch, tuple(k for k, _ in picked),
                tuple(remote.namespace + k for k, _ in picked), tuple(e.host for _, e in picked),
            )
            self._check_policies(plan)
            return plan
        finally:
            self._calling = None

    def complete_remote_put(self, plan: RemotePutPlan, ok: bool) -> None:
        """Release the host copies ``plan`` held; with ``ok`` the store holds its keys (this manager
        never puts them again). A plan from before the last :meth:`reset` only unfences its blocks.

        Raises:
            ArgumentTypeError: ``plan`` is not a RemotePutPlan or ``ok`` not a bool.
            InvalidArgumentError: ``plan`` was prepared by another manager, or no remote index.
            KeyStateError: the plan was already completed.
            PolicyError: a custom policy's notification raised (after the call's change, which stands).
        """
        self._enter("complete_remote_put")
        try:
            self._check_plan(plan, RemotePutPlan, ok)
            remote = self._require_remote()
            if plan.epoch != self._epoch:
                self._complete_stale(plan.plan_id, FenceKind.PUT, plan.keys)
                return
            keys = remote.puts.pop(plan.plan_id, None)
            if keys is None:
                if plan.keys:
                    raise KeyStateError(f"remote put plan {plan.plan_id} was already completed")
                return
            for key in keys:
                release_put(self._host, key, self._entries[key], ok)
            if ok:
                self._n.remote_puts_completed += len(keys)
            else:
                self._n.remote_puts_failed += len(keys)
            self._check_policies()
        finally:
            self._calling = None

    def _require_remote(self) -> RemoteLink:
        if self._remote is None:
            raise InvalidArgumentError("the manager has no remote index: Manager.create(..., remote=...)")
        return self._remote
