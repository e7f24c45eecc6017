"""The state every Manager operation works on, and the moves they share.

:class:`ManagerBase` owns the manager's Python state (the key map, the pools of each tier with their
policies, the copies outstanding plans wait for, the fences of plans from earlier epochs, counters,
events, the remote index) and the moves several operations make on it: evicting and forgetting
entries, fencing and unfencing blocks, and :meth:`ManagerBase.reset`. The operations themselves —
lookups, store, load and remote-put plans and their completions — are
:class:`~kvoffload.manager.Manager`'s (docs/design.md §11). Python only: no torch, no numpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Final, NamedTuple

from kvoffload.errors import ArgumentTypeError, InvalidArgumentError, KeyTypeError, PolicyError
from kvoffload.manager.policies import EvictionPolicy
from kvoffload.manager.records import (
    BlockEvent,
    LoadPlan,
    RemotePutPlan,
    StorePlan,
    Tier,
    events_of,
    namespace_prefix,
)
from kvoffload.manager.remote import RemoteLink
from kvoffload.manager.state import (
    DISK,
    FAILED,
    HOST,
    PENDING,
    READY,
    REMOVED,
    Counts,
    Entry,
    FenceKey,
    FenceKind,
    PlanCopies,
    Pool,
    evict_entries,
    release_fenced,
)

__all__ = ["ManagerBase", "ManagerParts"]

_MANAGER_IDS: Final = itertools.count(1)


class ManagerParts(NamedTuple):
    """What ``Manager.create`` validated and built, handed to the manager."""

    fingerprint: bytes
    host: Pool
    disk: Pool | None
    policy_name: str
    record_events: bool
    remote: RemoteLink | None


class ManagerBase:
    """The manager's state and shared moves (see the module docstring); use ``Manager``."""

    def __init__(self, parts: ManagerParts) -> None:
        """Take the pools :meth:`create` built (use :meth:`create`).

        Raises:
            ArgumentTypeError: ``parts`` is not what :meth:`create` builds.
        """
        if not isinstance(parts, ManagerParts):
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
        self._remote = parts.remote
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
        self._calling: str | None = None  # the public call that runs (see _enter)

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
        return self._host.policy.policy

    @property
    def disk_policy(self) -> EvictionPolicy | None:
        """The disk tier's policy (for inspection, as :attr:`host_policy`), or None without a disk tier."""
        return self._disk.policy.policy if self._disk is not None else None

    def namespaced(self, key: bytes) -> bytes:
        """``namespaced_key(self.fingerprint, key)``: the name a persistent tier should store under."""
        if not isinstance(key, bytes):
            raise KeyTypeError(f"key = {key!r} is a {type(key).__name__}; keys must be bytes")
        return self._namespace + key

    # ----------------------------------------------------------------- reset

    def reset(self, *, in_flight_done: bool = False) -> None:
        """Forget every key and start a new epoch; plans prepared before are fenced.

        Emits ``REMOVED`` for every loadable copy, and for every disk copy a failed load left to the
        loads still holding it (whose ``REMOVED`` waited for them). Completions of earlier plans become no-ops. By
        default, blocks that earlier plans copy into or out of (pending stores and demotions, loads
        not completed) stay *fenced* (not free) until their stale completion arrives, so no new plan
        gets a block an old DMA may still touch; the engine must keep calling ``complete_*`` for those
        plans. Pass ``in_flight_done=True`` when no copy of an earlier plan can still run (e.g. the
        worker was shut down): every block is free at once. Counters survive the reset.

        Raises:
            ArgumentTypeError: ``in_flight_done`` is not a bool.
            PolicyError: a custom policy's ``clear`` raised (after the reset, which stands).
        """
        self._enter("reset")
        try:
            if not isinstance(in_flight_done, bool):
                raise ArgumentTypeError(f"in_flight_done = {in_flight_done!r} must be a bool")
            entries = self._entries
            if self._record_events:
                events = self._events
                for key, entry in entries.items():
                    if entry.host_state is READY:
                        events.append(BlockEvent(REMOVED, key, HOST))
                    if entry.disk_state is READY or entry.disk_state is FAILED:  # FAILED: REMOVED
                        events.append(BlockEvent(REMOVED, key, DISK))  # held back for its loads
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
                    for key, tier in outstanding.items():  # a remote load writes its host block
                        entry = entries[key]
                        pool, block = (disk, entry.disk) if tier is DISK else (host, entry.host)
                        assert pool is not None  # a disk load exists only with a disk tier
                        self._fence((plan_id, FenceKind.LOAD, key), [(pool, block)])
                for plan_id, put_keys in (self._remote.puts if self._remote is not None else {}).items():
                    for key in put_keys:
                        self._fence((plan_id, FenceKind.PUT, key), [(host, entries[key].host)])
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
            if self._remote is not None:
                self._remote.puts.clear()
            self._epoch += 1
            self._n.resets += 1
            self._check_policies()
        finally:
            self._calling = None

    # ----------------------------------------------------------------- helpers

    def _enter(self, name: str) -> None:
        """Start public call ``name``, which clears ``_calling`` when it returns or raises. A
        manager takes one call at a time: a call made inside another — from a policy's notification
        or a remote index — would change the state the running call is in the middle of changing
        (a policy's ``admit`` that prepared a store evicted the key the running call then marked
        loadable: a lookup hit that ``prepare_load`` called unknown). The check also refuses most
        calls that overlap from two threads, but it is not a lock (the manager is not
        thread-safe; a lock cost about three times as much a call).

        Raises:
            PolicyError: another call of this manager runs; nothing is done.
        """
        if self._calling is not None:
            raise PolicyError(
                f"Manager.{name} was called while Manager.{self._calling} runs (from a policy's "
                "notification or a remote index inside it, or from another thread): a manager takes "
                "one call at a time; nothing was done"
            )
        self._calling = name

    def _check_plan(
        self, plan: object, kind: type[StorePlan] | type[LoadPlan] | type[RemotePutPlan], ok: object
    ) -> None:
        """Validate a completion's plan and ``ok`` (before its keys)."""
        if not isinstance(plan, kind):
            raise ArgumentTypeError(
                f"plan is a {type(plan).__name__}; expected a {kind.__name__} (from the matching "
                f"prepare_{'store' if kind is StorePlan else 'load' if kind is LoadPlan else 'remote_put'})"
            )
        if plan.owner != self._owner:
            raise InvalidArgumentError(f"plan {plan.plan_id} was prepared by another Manager")
        if not isinstance(ok, bool):
            of = type(ok)
            raise ArgumentTypeError(
                f"ok = {ok!r} is a {of.__module__}.{of.__qualname__}; it must be a bool (True or False)"
            )

    def _check_policies(self, result: object = None) -> None:
        """End a call whose policy notification raised (:class:`GuardedPolicy` kept it) with
        :class:`PolicyError`; the call's own change was made whole and stands, and ``result``
        (what it returns) rides on the error.

        Raises:
            PolicyError: from the first notification that raised in this call.
        """
        failures = [(pool, failure) for pool in (self._host, self._disk)
                    if pool is not None and (failure := pool.policy.take_failure()) is not None]
        if not failures:
            return
        described = [
            f"{pool.policy.name}.{method}({'' if key is None else repr(key)}) raised {exc!r} "
            f"({pool.tier.value} tier)"
            for pool, (method, key, exc) in failures
        ]
        raise PolicyError(
            f"{'; '.join(described)}: the manager's change was made whole and stands (the error's "
            "result is what the call returns); the policy may have missed this notification", result,
        ) from failures[0][1][2]

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
