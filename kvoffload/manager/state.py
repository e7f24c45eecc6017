"""The Manager's state: one entry per key, the pool of each tier, the copies of outstanding plans,
and the checks and moves on them that need no manager (victims, evictions, fenced blocks).

Private to the manager package; not thread-safe (the manager is called from one thread).
"""

from __future__ import annotations

import enum
from collections.abc import Container, Iterable, Sequence
from collections.abc import Set as AbstractSet
from operator import attrgetter
from typing import Any, Final, cast

import attrs

from kvoffload.errors import (
    ArgumentTypeError, DuplicateKeyError, KeyStateError, KeyTypeError, PolicyError, UnknownKeyError,
)
from kvoffload.manager.policies import EvictionPolicy
from kvoffload.manager.records import Demotion, EventKind, ManagerStats, Tier, TierStats

__all__ = [
    "BYTES_ONLY",
    "Counts",
    "Copy",
    "Entry",
    "FenceKey",
    "FenceKind",
    "PlanCopies",
    "Pool",
    "check_keys",
    "check_plan_keys",
    "check_unique_keys",
    "evict_entries",
    "pending_entries",
    "release_fenced",
    "victim_entries",
]

#: The one type a key may have (checked for a whole batch in C).
BYTES_ONLY: Final = frozenset({bytes})


class Copy(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"  # a load found it damaged: never offered again, dropped when its loads end


# Module-level names for the members the per-block loops use: reading a member off its enum class
# costs more than the rest of such a loop's step.
PENDING: Final = Copy.PENDING
READY: Final = Copy.READY
FAILED: Final = Copy.FAILED
STORED: Final = EventKind.STORED
REMOVED: Final = EventKind.REMOVED
STORE_FAILED: Final = EventKind.STORE_FAILED
HOST: Final = Tier.HOST
DISK: Final = Tier.DISK
REMOTE: Final = Tier.REMOTE
NO_KEYS: Final[frozenset[bytes]] = frozenset()


class Entry:
    """Per-key state in the local tiers; ``None`` state means no copy in that tier. ``remote``: the
    remote store holds the key (this manager put it, or read it from there); ``putting``: a remote
    put of its host copy is outstanding.

    ``prepare_store`` creates one for a new key, with its host copy pending for that plan;
    ``prepare_load`` for a key read from the remote store, likewise.
    """

    __slots__ = (
        "demote_src",
        "disk",
        "disk_plan",
        "disk_refs",
        "disk_state",
        "host",
        "host_plan",
        "host_refs",
        "host_state",
        "putting",
        "remote",
    )

    def __init__(self, host: int, plan_id: int) -> None:
        self.host = host
        self.host_state: Copy | None = PENDING
        self.host_plan = plan_id
        self.host_refs = 0
        self.disk = -1
        self.disk_state: Copy | None = None
        self.disk_plan = 0
        self.disk_refs = 0
        self.demote_src = -1  # host block a pending demotion reads; fenced at reset
        self.remote = False  # the remote store holds the key (put by this manager, or read from it)
        self.putting = False  # a remote put of the host copy is outstanding


class PlanCopies:
    """The entries of one outstanding :class:`StorePlan`, so its completions need no key lookups.

    Owns lists of entries (shared with the manager's key map): ``host`` co-indexed with the plan's
    ``keys`` (its pending stores), ``disk`` with its ``demotions`` (its pending demotions), and the
    counts of those copies not completed yet. A pending copy stops being pending only by its
    completion (which counts it down exactly once) or by ``reset`` (which drops every record), so
    while ``host_left == len(host)`` every store of the plan is still pending, and likewise for
    ``disk``. The manager drops the record when both counts reach 0. ``keys`` and ``demotions`` are
    the plan's own tuples: a completion of the whole plan uses the record only when it is handed
    those very tuples; a copy of the plan (same values, other objects) looks its keys up instead.
    """

    __slots__ = ("demotions", "disk", "disk_left", "host", "host_left", "keys")

    def __init__(
        self, keys: tuple[bytes, ...], host: list[Entry], demotions: tuple[Demotion, ...], disk: list[Entry]
    ) -> None:
        self.keys = keys
        self.host = host
        self.host_left = len(host)
        self.demotions = demotions
        self.disk = disk
        self.disk_left = len(disk)


class GuardedPolicy:
    """A tier's policy as the manager calls it: a notification that raises is kept (the first of
    them) and not propagated, so that the manager's own change always completes whole; the manager
    raises :class:`PolicyError` once the call is done (:meth:`ManagerBase._check_policies`).
    ``victims``, which the manager calls before it changes anything, passes its exceptions on."""

    __slots__ = ("failure", "name", "policy")

    def __init__(self, policy: EvictionPolicy) -> None:
        """Guard ``policy`` (what a policy factory returned).

        Raises:
            ArgumentTypeError: ``policy`` lacks a method of :class:`EvictionPolicy`.
        """
        missing = [name for name in ("admit", "hit", "hold", "release", "victims", "evict", "clear")
                   if not callable(getattr(policy, name, None))]
        if missing:
            raise ArgumentTypeError(
                f"the policy factory returned {policy!r:.80}, which has no {', '.join(missing)}: it "
                "must return an EvictionPolicy"
            )
        self.policy = policy
        self.name = type(policy).__name__
        #: (the method, the key or None, the exception) of the first notification that raised.
        self.failure: tuple[str, bytes | None, Exception] | None = None

    def _kept(self, method: str, key: bytes | None, exc: Exception) -> None:
        if self.failure is None:
            self.failure = (method, key, exc)

    # Each notification writes its guard out: one shared helper per call made complete_store 30%
    # slower (428-437 against 326-334 ns a block, 10,000-block LRU pool, `python -m kvoffload
    # manager-bench --quick`, two runs each, alternated, on the CI machine).

    def admit(self, key: bytes) -> None:
        """The policy's ``admit``, its exception kept."""
        try:
            self.policy.admit(key)
        except Exception as exc:  # noqa: BLE001 - kept for the PolicyError after the call
            self._kept("admit", key, exc)

    def hit(self, key: bytes) -> None:
        """The policy's ``hit``, its exception kept."""
        try:
            self.policy.hit(key)
        except Exception as exc:  # noqa: BLE001 - kept for the PolicyError after the call
            self._kept("hit", key, exc)

    def hold(self, key: bytes) -> None:
        """The policy's ``hold``, its exception kept."""
        try:
            self.policy.hold(key)
        except Exception as exc:  # noqa: BLE001 - kept for the PolicyError after the call
            self._kept("hold", key, exc)

    def release(self, key: bytes) -> None:
        """The policy's ``release``, its exception kept."""
        try:
            self.policy.release(key)
        except Exception as exc:  # noqa: BLE001 - kept for the PolicyError after the call
            self._kept("release", key, exc)

    def evict(self, key: bytes) -> None:
        """The policy's ``evict``, its exception kept."""
        try:
            self.policy.evict(key)
        except Exception as exc:  # noqa: BLE001 - kept for the PolicyError after the call
            self._kept("evict", key, exc)

    def clear(self) -> None:
        """The policy's ``clear``, its exception kept."""
        try:
            self.policy.clear()
        except Exception as exc:  # noqa: BLE001 - kept for the PolicyError after the call
            self._kept("clear", None, exc)

    def victims(self, count: int, exclude: Container[bytes]) -> list[bytes]:
        """The policy's ``victims`` (checked by the caller; its exceptions pass: nothing changed
        yet)."""
        return self.policy.victims(count, exclude)

    def take_failure(self) -> tuple[str, bytes | None, Exception] | None:
        """The kept failure, forgotten here."""
        failure, self.failure = self.failure, None
        return failure


class Pool:
    """The blocks of one tier: free list, counters, fenced blocks and the tier's policy (guarded:
    :class:`GuardedPolicy`)."""

    def __init__(self, tier: Tier, capacity: int, policy: EvictionPolicy) -> None:
        self.tier = tier
        on_host = tier is Tier.HOST
        # this tier's fields of an entry, read in C over a batch of entries
        self.state_of: Final[attrgetter[Any]] = attrgetter("host_state" if on_host else "disk_state")
        self.refs_of: Final[attrgetter[Any]] = attrgetter("host_refs" if on_host else "disk_refs")
        self.block_of: Final[attrgetter[Any]] = attrgetter("host" if on_host else "disk")
        self.capacity = capacity
        self.policy = GuardedPolicy(policy)
        self.free: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.pending = 0
        self.loading = 0
        self.fenced: dict[int, int] = {}  # block -> stale plans still holding it

    def take(self, count: int) -> list[int]:
        """Remove ``count`` (<= free) blocks from the free list, in the order ``pop()`` gives them."""
        free = self.free
        start = len(free) - count
        blocks = free[start:]
        del free[start:]
        blocks.reverse()
        return blocks

    def stats(self) -> TierStats:
        fenced = len(self.fenced)
        ready = self.capacity - len(self.free) - self.pending - self.loading - fenced
        free = len(self.free)
        return TierStats(self.tier, self.capacity, free, self.pending, ready, self.loading, fenced)

    def reset(self, keep_fenced: dict[int, int]) -> None:
        self.fenced = keep_fenced
        self.free = [b for b in range(self.capacity - 1, -1, -1) if b not in keep_fenced]
        self.pending = 0
        self.loading = 0
        self.policy.clear()


class FenceKind(enum.Enum):
    STORE = "store"
    DEMOTE = "demote"
    LOAD = "load"
    PUT = "put"


FenceKey = tuple[int, FenceKind, bytes]  # (plan_id, what the plan does, key)


def pending_entries(entries: dict[bytes, Entry], plan_id: int, keys: Sequence[bytes], tier: Tier) -> list[Entry]:
    """The entries of ``keys`` whose ``tier`` copy is pending for ``plan_id``.

    Raises:
        KeyStateError: a key's copy is not pending for that plan (it was already completed).
    """
    on_host = tier is HOST
    found: list[Entry] = []
    for key in keys:
        entry = entries.get(key)
        if entry is None or not (
            entry.host_state is PENDING and entry.host_plan == plan_id
            if on_host
            else entry.disk_state is PENDING and entry.disk_plan == plan_id
        ):
            what = "store" if on_host else "demotion"
            raise KeyStateError(
                f"key {key!r} of plan {plan_id} has no pending {what}: it was already completed"
            )
        found.append(entry)
    return found


def victim_entries(
    entries: dict[bytes, Entry], pool: Pool, victims: list[bytes], count: int,
    protected: AbstractSet[bytes],
) -> list[Entry]:
    """The entries of the policy's ``victims``, after checking that they are evictable.

    Raises:
        PolicyError: more or fewer distinct keys than asked for, or a key that is not evictable
            (unknown, pending, loading, or protected by the request).
    """
    if len(victims) > count or len(set(victims)) != len(victims):
        raise PolicyError(
            f"{pool.policy.name}.victims({count}) returned {len(victims)} keys "
            f"({len(set(victims))} distinct); expected at most {count} distinct keys"
        )
    # One C pass per check: the cache misses of a batch's lookups overlap a little in C.
    found = list(map(entries.get, victims))
    if (
        None not in found
        and protected.isdisjoint(victims)
        and list(map(pool.state_of, found)).count(READY) == len(found)
        and not any(map(pool.refs_of, found))
    ):
        return cast("list[Entry]", found)
    for key, entry in zip(victims, found):  # name the first victim that is not evictable
        if (
            entry is None
            or key in protected
            or pool.state_of(entry) is not READY
            or pool.refs_of(entry) != 0
        ):
            raise PolicyError(
                f"{pool.policy.name} proposed {key!r} as a {pool.tier.value} victim, but "
                "it is not evictable (unknown, pending, loading or protected by the request)"
            )
    raise AssertionError("unreachable: some victim failed a check above")


def evict_entries(pool: Pool, victims: list[bytes], found: list[Entry]) -> None:
    """Evict ``victims`` (checked, with their entries ``found``) from ``pool``: the policy forgets
    them, their blocks are free and their copies in that tier are gone."""
    evict = pool.policy.evict
    for key in victims:
        evict(key)
    pool.free += map(pool.block_of, found)
    if pool.tier is HOST:
        for entry in found:
            entry.host_state = None
    else:
        for entry in found:
            entry.disk_state = None


def release_fenced(
    fences: dict[FenceKey, list[tuple[Pool, int]]], plan_id: int, what: FenceKind, keys: Iterable[bytes]
) -> None:
    """A completion from an earlier epoch: the blocks its plan fenced return to their free lists
    once no stale plan holds them."""
    for key in keys:
        for pool, block in fences.pop((plan_id, what, key), ()):
            left = pool.fenced[block] - 1
            if left:
                pool.fenced[block] = left
            else:
                del pool.fenced[block]
                pool.free.append(block)


def check_keys(name: str, keys: object) -> None:
    """Refuse ``keys`` unless it is a sequence of ``bytes``.

    Raises:
    KeyTypeError: naming the argument or the first key that is not bytes.
    """
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence):
        raise KeyTypeError(
            f"{name} = {keys!r:.80} is a {type(keys).__name__}; it must be a sequence of bytes keys "
            "(pass [key] for one key)"
        )
    if BYTES_ONLY.issuperset(map(type, keys)):
        return
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise KeyTypeError(
                f"{name}[{i}] = {key!r:.80} is a {type(key).__name__}; keys must be bytes"
            )

def check_unique_keys(name: str, keys: object) -> None:
    """:func:`check_keys`, and no key twice.

    Raises:
    KeyTypeError: as :func:`check_keys`.
    DuplicateKeyError: naming both positions of the first repeated key.
    """
    check_keys(name, keys)
    assert isinstance(keys, Sequence)  # check_keys proved it
    if len(set(keys)) == len(keys):
        return
    seen: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        if key in seen:
            raise DuplicateKeyError(
                f"{name}[{i}] = {key!r} repeats {name}[{seen[key]}]; each key may appear once"
            )
        seen[key] = i

def check_plan_keys(plan_id: int, keys: Sequence[bytes], plan_keys: Sequence[bytes]) -> None:
    """Validate a completion's explicit ``keys`` against the plan's keys alone.

    Raises:
    KeyTypeError, DuplicateKeyError: as :func:`check_unique_keys`.
    UnknownKeyError: a key that is not one of the plan's.
    """
    check_unique_keys("keys", keys)
    members = set(plan_keys)
    for i, key in enumerate(keys):
        if key not in members:
            raise UnknownKeyError(f"keys[{i}] = {key!r} is not one of plan {plan_id}'s keys")


@attrs.define(slots=True)
class Counts:
    """The manager's counters (keys, not calls; see :class:`ManagerStats`); they survive ``reset``."""

    lookups: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    stores_planned: int = 0
    stores_completed: int = 0
    stores_failed: int = 0
    loads_planned: int = 0
    loads_completed: int = 0
    loads_failed: int = 0
    disk_copies_dropped: int = 0
    host_evictions: int = 0
    disk_evictions: int = 0
    demotions_planned: int = 0
    demotions_completed: int = 0
    demotions_failed: int = 0
    stale_completions: int = 0
    resets: int = 0
    remote_lookup_keys: int = 0
    remote_lookup_hits: int = 0
    remote_lookup_errors: int = 0
    remote_loads_planned: int = 0
    remote_loads_completed: int = 0
    remote_loads_failed: int = 0
    remote_puts_planned: int = 0
    remote_puts_completed: int = 0
    remote_puts_failed: int = 0

    def snapshot(self, policy: str, epoch: int, host: TierStats, disk: TierStats) -> ManagerStats:
        """The counters with the tiers' states, as the manager's statistics."""
        return ManagerStats(policy=policy, epoch=epoch, host=host, disk=disk, **attrs.asdict(self))
