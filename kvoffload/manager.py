"""The scheduler-side block manager: which KV blocks the host pool and the disk hold, and which move.

The :class:`Manager` decides *which* blocks move; a Worker moves the bytes. It owns only Python
memory: the key → block map of each tier, the free lists, the eviction policies, the copies each
outstanding plan still waits for, the counters and the undrained events. It borrows nothing, holds no
OS or GPU resource and so has no close method. It imports neither torch nor CUDA. It is not
thread-safe: call it from the scheduler thread.

A copy of a key in one tier (host, or disk when ``num_disk_blocks > 0``) is in one state::

    free --prepare_store--> pending --complete_store(ok)--> ready <--> loading (prepare/complete_load)
      ^                        |                              |
      +--complete_store(fail)--+----evicted by the policy-----+

- *pending*: a copy into the block is in flight. Not loadable, not evictable.
- *ready*: loadable and evictable.
- *loading*: ready with a reference count > 0 (loads of one key may overlap). Loadable, not evictable.

The engine's protocol, each step:

1. ``n = lookup(keys)``; ``plan = prepare_load(keys[:n])``; copy ``plan.blocks[i]`` of
   ``plan.tiers[i]`` to the GPU; ``complete_load(plan)`` (whether the copy succeeded or not).
2. ``plan = prepare_store(keys)``; None means "no room now" and changed nothing. Copy every
   ``plan.demotions`` entry host → disk *first*, then the GPU blocks of ``plan.keys`` into
   ``plan.host_blocks``; then ``complete_demote(plan, ok)`` and ``complete_store(plan, ok)``.
3. Forward ``events()`` to the router.

Keys are the engine's block hashes (``bytes``), held exactly as the engine passes them: a manager is
bound to one model/layout fingerprint for its whole life, starts empty and completes only its own
plans, so every key it holds was stored under that fingerprint, and it never serves KV written under
another one. What outlives a manager or is shared between fingerprints (a persistent tier's records)
must name a block by :meth:`Manager.namespaced` (:func:`namespaced_key`): the fingerprint's
fixed-length digest prefixed to the key. Policies, plans and events all carry the engine's keys. A key
twice in one ``prepare_store``, ``prepare_load`` or completion is refused
(:class:`~kvoffload.errors.DuplicateKeyError`: it would get two blocks, or two references one
completion could not tell apart); ``lookup`` and ``touch`` accept duplicates.

Write-back to disk: when ``prepare_store`` evicts a host block whose key has no disk copy and the disk
pool has room (possibly after evicting ready disk blocks by the disk policy), the plan lists a
:class:`Demotion` ``(key, host_block, disk_block)``. That host block is reused by the same plan's
store, so the store's copy may start only after the demotion's copy finished reading it. Demotion is
best effort: a busy disk pool never makes a store fail, the victim is then dropped. A disk hit is
loaded from disk directly; the manager does not promote it back to the host pool.

Fencing: every plan carries the manager's ``epoch``. :meth:`Manager.reset` starts a new epoch and
clears every key; completions of plans from an earlier epoch are then no-ops (counted in
``stale_completions``), so they can neither resurrect a cleared key nor complete the same key prepared
again after the reset. Each plan also has a process-unique ``plan_id`` that its pending copies
remember, so a duplicated completion is refused instead of completing a later plan's copy. By default
the blocks that earlier plans still copy into or out of are *fenced* at reset: they return to the free
list only when their stale completion arrives, so no new plan is handed a block an old DMA may touch.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from operator import attrgetter
from typing import Any, Final, NamedTuple, Protocol, cast

import attrs

from kvoffload.errors import (
    ArgumentTypeError,
    DuplicateKeyError,
    InvalidArgumentError,
    KeyStateError,
    KeyTypeError,
    PolicyError,
    UnknownKeyError,
    UnknownPolicyError,
)

__all__ = [
    "ARCPolicy",
    "BlockEvent",
    "Demotion",
    "EventKind",
    "EvictionPolicy",
    "LRUPolicy",
    "LoadPlan",
    "Manager",
    "ManagerStats",
    "NAMESPACE_PREFIX_BYTES",
    "POLICY_NAMES",
    "PolicyFactory",
    "StorePlan",
    "Tier",
    "TierStats",
    "namespaced_key",
]

NAMESPACE_PREFIX_BYTES: Final = 16
"""Length of the fingerprint digest that prefixes every namespaced key, in bytes."""

_NAMESPACE_PERSON: Final = b"kvoffload.ns.v1"  # blake2b personalisation: at most 16 bytes
_BYTES_ONLY: Final = frozenset({bytes})
_PLAN_IDS: Final = itertools.count(1)  # process-wide, so a plan never matches another plan's copy
_MANAGER_IDS: Final = itertools.count(1)


def namespaced_key(fingerprint: bytes | str, key: bytes) -> bytes:
    """Return ``key`` prefixed with the :data:`NAMESPACE_PREFIX_BYTES`-byte digest of ``fingerprint``.

    The prefix has a fixed length, so two (fingerprint, key) pairs map to the same namespaced key only
    if both are equal (up to a blake2b collision). Raises :class:`ArgumentTypeError` /
    :class:`InvalidArgumentError` for a bad fingerprint and :class:`KeyTypeError` for a non-bytes key.
    """
    if not isinstance(key, bytes):
        raise KeyTypeError(f"key = {key!r} is a {type(key).__name__}; keys must be bytes")
    return _namespace_prefix(_fingerprint_bytes(fingerprint)) + key


def _fingerprint_bytes(fingerprint: object) -> bytes:
    if isinstance(fingerprint, str):
        fingerprint = fingerprint.encode("utf-8")
    if not isinstance(fingerprint, bytes):
        raise ArgumentTypeError(
            f"fingerprint = {fingerprint!r} is a {type(fingerprint).__name__}; it must be bytes or str"
        )
    if not fingerprint:
        raise InvalidArgumentError("fingerprint = b'' is empty; it must name the model and KV layout")
    return fingerprint


def _namespace_prefix(fingerprint: bytes) -> bytes:
    return hashlib.blake2b(
        fingerprint, digest_size=NAMESPACE_PREFIX_BYTES, person=_NAMESPACE_PERSON
    ).digest()


class Tier(enum.Enum):
    """Where a copy of a block lives."""

    HOST = "host"
    DISK = "disk"


class EventKind(enum.Enum):
    """What happened to a key in one tier.

    ``STORED``: a copy became loadable. ``REMOVED``: a loadable copy stopped being loadable (evicted,
    demoted away from the host, or cleared by ``reset``). ``STORE_FAILED``: a store (host) or demotion
    (disk) failed; that copy never became loadable (no ``STORED`` was sent for it).
    """

    STORED = "stored"
    REMOVED = "removed"
    STORE_FAILED = "store_failed"


class BlockEvent(NamedTuple):
    """One change of the loadable copies, for the engine to forward to a router.

    ``key`` is the engine's key (not namespaced). A named tuple: immutable, compared by value (as
    the tuple ``(kind, key, tier)``), and cheap to build (a stored block costs two events).
    """

    kind: EventKind
    key: bytes
    tier: Tier


def _events_of(kind: EventKind, keys: Iterable[bytes], tier: Tier) -> Iterator[BlockEvent]:
    """``BlockEvent(kind, key, tier)`` for each of ``keys``, built in C (no Python frame per event)."""
    rows = zip(itertools.repeat(kind), keys, itertools.repeat(tier))
    return map(tuple.__new__, itertools.repeat(BlockEvent), rows)


@attrs.frozen
class Demotion:
    """A write-back the engine must copy: ``host_block`` → ``disk_block`` for ``key``.

    ``host_block`` is reused by the same plan's store: run the demotion first.
    """

    key: bytes
    host_block: int
    disk_block: int


@attrs.frozen
class StorePlan:
    """What one ``prepare_store`` decided.

    Attributes:
        owner: the id of the manager that prepared it (a plan is completed on that manager only).
        plan_id: process-unique id; the pending copies remember it.
        epoch: the manager's epoch at prepare time (see :meth:`Manager.reset`).
        keys: the keys to write, in request order, without the keys already held.
        host_blocks: the host block of each key, co-indexed with ``keys``.
        evicted: keys whose host copy this plan evicted (including the demoted ones).
        disk_evicted: keys whose disk copy this plan evicted to make room for demotions.
        demotions: the write-backs to run *before* the store (see :class:`Demotion`).
    """

    owner: int
    plan_id: int
    epoch: int
    keys: tuple[bytes, ...]
    host_blocks: tuple[int, ...]
    evicted: tuple[bytes, ...]
    disk_evicted: tuple[bytes, ...]
    demotions: tuple[Demotion, ...]


@attrs.frozen
class LoadPlan:
    """What one ``prepare_load`` decided: ``keys``, ``tiers`` and ``blocks`` are co-indexed.

    ``blocks[i]`` is a host block when ``tiers[i]`` is ``Tier.HOST`` and a disk block otherwise.
    """

    owner: int
    plan_id: int
    epoch: int
    keys: tuple[bytes, ...]
    tiers: tuple[Tier, ...]
    blocks: tuple[int, ...]


@attrs.frozen
class TierStats:
    """Blocks of one tier by state; ``free + pending + ready + loading + fenced == capacity``.

    ``ready`` excludes blocks that are loading. ``fenced`` blocks belong to plans from before the last
    ``reset`` whose completion has not arrived yet. A tier that does not exist has capacity 0.
    """

    tier: Tier
    capacity: int
    free: int
    pending: int
    ready: int
    loading: int
    fenced: int


@attrs.frozen
class ManagerStats:
    """A snapshot of a manager. Counters (all but ``host``/``disk``/``epoch``) survive ``reset``.

    ``lookup_keys`` counts keys passed to ``lookup``; ``lookup_hits`` the keys of the returned
    prefixes. Store, load, eviction and demotion counters count keys (blocks), not calls.
    """

    policy: str
    epoch: int
    host: TierStats
    disk: TierStats
    lookups: int
    lookup_keys: int
    lookup_hits: int
    stores_planned: int
    stores_completed: int
    stores_failed: int
    loads_planned: int
    loads_completed: int
    loads_failed: int
    disk_copies_dropped: int
    host_evictions: int
    disk_evictions: int
    demotions_planned: int
    demotions_completed: int
    demotions_failed: int
    stale_completions: int
    resets: int

    @property
    def hit_rate(self) -> float:
        """``lookup_hits / lookup_keys`` (0.0 before any lookup)."""
        return self.lookup_hits / self.lookup_keys if self.lookup_keys else 0.0


class EvictionPolicy(Protocol):
    """The seam for eviction policies: it orders the *evictable* keys of one tier.

    The manager calls it with the engine's keys (``bytes``) and guarantees: ``admit`` only for a key that
    is not resident; ``hit``/``hold``/``evict`` only for resident keys; ``release`` only for a held key;
    at most ``capacity`` resident (admitted, not evicted) keys. Every method must be O(1) amortised
    per key, except ``victims`` (O(returned + skipped excluded keys)) and ``clear``.
    """

    def admit(self, key: bytes) -> None:
        """``key`` became ready in this tier; it is evictable."""

    def hit(self, key: bytes) -> None:
        """``key`` (resident, held or not) was used: by ``touch`` or ``prepare_load``."""

    def hold(self, key: bytes) -> None:
        """``key`` started loading: it must not be proposed as a victim until ``release``."""

    def release(self, key: bytes) -> None:
        """The last load of ``key`` completed: it is evictable again."""

    def victims(self, count: int, exclude: Container[bytes]) -> list[bytes]:
        """Return up to ``count`` distinct evictable keys not in ``exclude``, next victim first.

        Must not change the policy: the manager may discard the answer (a refused plan).
        """

    def evict(self, key: bytes) -> None:
        """``key``, returned by the last ``victims`` call, was evicted (in that order)."""

    def clear(self) -> None:
        """Forget every key, including history (``reset``)."""


PolicyFactory = Callable[[int], EvictionPolicy]
"""Builds a policy for a tier of the given capacity (in blocks); :class:`LRUPolicy` is one."""


def _check_capacity(capacity: object) -> int:
    if not isinstance(capacity, int) or isinstance(capacity, bool):
        raise ArgumentTypeError(
            f"capacity = {capacity!r} is a {type(capacity).__name__}; it must be an int"
        )
    if capacity < 1:
        raise InvalidArgumentError(f"capacity = {capacity} must be >= 1 block")
    return capacity


class LRUPolicy:
    """Least recently used first. Admission, hits, holds and evictions are O(1).

    Owns an ``OrderedDict`` of evictable keys (least recent first) and a set of held keys. A released
    key counts as just used.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity: Final = _check_capacity(capacity)
        self._order: OrderedDict[bytes, None] = OrderedDict()
        self._held: set[bytes] = set()

    def __len__(self) -> int:
        """Resident keys (evictable and held)."""
        return len(self._order) + len(self._held)

    def admit(self, key: bytes) -> None:
        """Insert ``key`` (not resident, as the protocol guarantees) as the most recent."""
        self._order[key] = None

    def hit(self, key: bytes) -> None:
        """Make ``key`` the most recent (a held key becomes it at release)."""
        if key in self._order:
            self._order.move_to_end(key)

    def hold(self, key: bytes) -> None:
        """Take ``key`` out of the eviction order."""
        del self._order[key]
        self._held.add(key)

    def release(self, key: bytes) -> None:
        """Put ``key`` back as the most recent."""
        self._held.remove(key)
        self._order[key] = None

    def victims(self, count: int, exclude: Container[bytes]) -> list[bytes]:
        """Up to ``count`` least recent evictable keys not in ``exclude``."""
        if count <= 0:
            return []
        if not exclude:  # islice walks the links without touching the key objects
            return list(itertools.islice(self._order, count))
        out: list[bytes] = []
        for key in self._order:
            if key not in exclude:
                out.append(key)
                if len(out) == count:
                    break
        return out

    def evict(self, key: bytes) -> None:
        """Forget ``key``."""
        del self._order[key]

    def clear(self) -> None:
        """Forget every key."""
        self._order.clear()
        self._held.clear()


class ARCPolicy:
    """Adaptive replacement cache (Megiddo & Modha, FAST 2003), O(1) amortised per operation.

    Resident keys are split into T1 (seen once) and T2 (seen again); evicted keys are remembered in the
    ghost lists B1 and B2. A re-admitted ghost moves the target size ``p`` of T1 (towards recency after
    a B1 hit, towards frequency after a B2 hit) and lands in T2. Victims come from T1 while
    ``|T1| > p``, else from T2. Ghosts are bounded: ``|T1| + |B1| <= capacity`` and
    ``|B1| + |B2| <= capacity``; each trimmed ghost was pushed by an earlier eviction, hence O(1)
    amortised. Held (loading) keys keep their list membership but leave the eviction order.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity: Final = _check_capacity(capacity)
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._held: dict[bytes, bool] = {}  # key -> belongs to T2
        self._held_t1 = 0
        self._p = 0.0

    def __len__(self) -> int:
        """Resident keys (evictable and held)."""
        return len(self._t1) + len(self._t2) + len(self._held)

    @property
    def target_t1(self) -> float:
        """The adaptive target size ``p`` of T1, in blocks (0 <= p <= capacity)."""
        return self._p

    @property
    def ghost_sizes(self) -> tuple[int, int]:
        """``(|B1|, |B2|)``: evicted keys remembered for adaptation."""
        return len(self._b1), len(self._b2)

    @property
    def resident_sizes(self) -> tuple[int, int]:
        """``(|T1|, |T2|)`` including held keys."""
        held_t2 = len(self._held) - self._held_t1
        return len(self._t1) + self._held_t1, len(self._t2) + held_t2

    def admit(self, key: bytes) -> None:
        """Insert ``key``: into T1, or into T2 with adaptation when it is a ghost."""
        b1, b2 = self._b1, self._b2
        if key in b1:
            self._p = min(float(self.capacity), self._p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            self._t2[key] = None
        elif key in b2:
            self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def hit(self, key: bytes) -> None:
        """Move ``key`` to the most recent end of T2."""
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        elif key in self._held and not self._held[key]:
            self._held[key] = True
            self._held_t1 -= 1

    def hold(self, key: bytes) -> None:
        """Take ``key`` out of the eviction order, remembering its list."""
        if key in self._t1:
            del self._t1[key]
            self._held[key] = False
            self._held_t1 += 1
        else:
            del self._t2[key]
            self._held[key] = True

    def release(self, key: bytes) -> None:
        """Put ``key`` back at the most recent end of its list."""
        if self._held.pop(key):
            self._t2[key] = None
        else:
            self._held_t1 -= 1
            self._t1[key] = None

    def victims(self, count: int, exclude: Container[bytes]) -> list[bytes]:
        """Up to ``count`` keys in ARC's REPLACE order (T1 while ``|T1| > p``), skipping ``exclude``."""
        out: list[bytes] = []
        from_t1: Iterator[bytes] = (k for k in self._t1 if k not in exclude)
        from_t2: Iterator[bytes] = (k for k in self._t2 if k not in exclude)
        size_t1 = len(self._t1) + self._held_t1
        while len(out) < count:
            prefer_t1 = size_t1 > self._p
            key = next(from_t1 if prefer_t1 else from_t2, None)
            took_t1 = prefer_t1
            if key is None:
                key = next(from_t2 if prefer_t1 else from_t1, None)
                took_t1 = not prefer_t1
                if key is None:
                    break
            out.append(key)
            if took_t1:
                size_t1 -= 1
        return out

    def evict(self, key: bytes) -> None:
        """Move ``key`` from T1 to B1 or from T2 to B2, then trim the ghosts."""
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def clear(self) -> None:
        """Forget every key and reset ``p``."""
        for od in (self._t1, self._t2, self._b1, self._b2):
            od.clear()
        self._held.clear()
        self._held_t1 = 0
        self._p = 0.0

    def _trim_ghosts(self) -> None:
        """Forget the oldest ghosts until ``|T1| + |B1|`` and ``|B1| + |B2|`` are <= capacity."""
        b1, b2, capacity = self._b1, self._b2, self.capacity
        over = len(self._t1) + self._held_t1 + len(b1) - capacity
        while over > 0 and b1:
            b1.popitem(last=False)
            over -= 1
        over = len(b1) + len(b2) - capacity
        while over > 0 and b2:
            b2.popitem(last=False)
            over -= 1


POLICY_NAMES: Final[dict[str, PolicyFactory]] = {"lru": LRUPolicy, "arc": ARCPolicy}
"""The policies ``Manager.create(policy=...)`` knows by name."""


class _Copy(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"  # a load found it damaged: never offered again, dropped when its loads end


# Module-level names for the members the per-block loops use: reading a member off its enum class
# costs more than the rest of such a loop's step.
_PENDING: Final = _Copy.PENDING
_READY: Final = _Copy.READY
_FAILED: Final = _Copy.FAILED
_STORED: Final = EventKind.STORED
_REMOVED: Final = EventKind.REMOVED
_STORE_FAILED: Final = EventKind.STORE_FAILED
_HOST: Final = Tier.HOST
_DISK: Final = Tier.DISK
_NO_KEYS: Final[frozenset[bytes]] = frozenset()


class _Entry:
    """Per-key state in both tiers; ``None`` state means no copy in that tier.

    ``prepare_store`` creates one for a new key, with its host copy pending for that plan.
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
    )

    def __init__(self, host: int, plan_id: int) -> None:
        self.host = host
        self.host_state: _Copy | None = _PENDING
        self.host_plan = plan_id
        self.host_refs = 0
        self.disk = -1
        self.disk_state: _Copy | None = None
        self.disk_plan = 0
        self.disk_refs = 0
        self.demote_src = -1  # host block a pending demotion reads; fenced at reset


class _PlanCopies:
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
        self, keys: tuple[bytes, ...], host: list[_Entry], demotions: tuple[Demotion, ...], disk: list[_Entry]
    ) -> None:
        self.keys = keys
        self.host = host
        self.host_left = len(host)
        self.demotions = demotions
        self.disk = disk
        self.disk_left = len(disk)


class _Pool:
    """The blocks of one tier: free list, counters, fenced blocks and the tier's policy."""

    def __init__(self, tier: Tier, capacity: int, policy: EvictionPolicy) -> None:
        self.tier = tier
        on_host = tier is Tier.HOST
        # this tier's fields of an entry, read in C over a batch of entries
        self.state_of: Final[attrgetter[Any]] = attrgetter("host_state" if on_host else "disk_state")
        self.refs_of: Final[attrgetter[Any]] = attrgetter("host_refs" if on_host else "disk_refs")
        self.block_of: Final[attrgetter[Any]] = attrgetter("host" if on_host else "disk")
        self.capacity = capacity
        self.policy = policy
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


class _Fence(enum.Enum):
    STORE = "store"
    DEMOTE = "demote"
    LOAD = "load"


_FenceKey = tuple[int, _Fence, bytes]  # (plan_id, what the plan does, key)


class _ManagerParts(NamedTuple):
    fingerprint: bytes
    host: _Pool
    disk: _Pool | None
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
        self._namespace = _namespace_prefix(fingerprint)
        self._owner = next(_MANAGER_IDS)
        self._host = host
        self._disk = disk
        self._policy_name = policy_name
        self._record_events = record_events
        self._epoch = 0
        self._entries: dict[bytes, _Entry] = {}
        self._ready: set[bytes] = set()  # keys loadable from some tier
        self._stores: dict[int, _PlanCopies] = {}  # outstanding store plan -> its pending copies
        self._loads: dict[int, dict[bytes, Tier]] = {}  # outstanding load plan -> key -> tier
        self._fences: dict[_FenceKey, list[tuple[_Pool, int]]] = {}
        self._events: list[BlockEvent] = []
        self._lookups = 0
        self._lookup_keys = 0
        self._lookup_hits = 0
        self._stores_planned = 0
        self._stores_completed = 0
        self._stores_failed = 0
        self._loads_planned = 0
        self._loads_completed = 0
        self._loads_failed = 0
        self._disk_copies_dropped = 0
        self._host_evictions = 0
        self._disk_evictions = 0
        self._demotions_planned = 0
        self._demotions_completed = 0
        self._demotions_failed = 0
        self._stale_completions = 0
        self._resets = 0

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
        fp = _fingerprint_bytes(fingerprint)
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
        host = _Pool(Tier.HOST, num_host_blocks, factory(num_host_blocks))
        disk = _Pool(Tier.DISK, num_disk_blocks, factory(num_disk_blocks)) if num_disk_blocks else None
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
        self._check_keys("keys", keys)
        ready = self._ready
        if ready.issuperset(keys):  # one C loop when every key is ready
            hits = len(keys)
        else:  # the ready prefix, counted in C too
            hits = len(list(itertools.takewhile(ready.__contains__, keys)))
        self._lookups += 1
        self._lookup_keys += len(keys)
        self._lookup_hits += hits
        return hits

    def touch(self, keys: Sequence[bytes]) -> None:
        """Tell the policies that ``keys`` were used, in order.

        Keys that have no ready copy (unknown, pending, cleared) are ignored: touching is advisory and
        the scheduler may touch blocks it never offloaded. Duplicates are allowed.

        Raises:
            KeyTypeError: ``keys`` is not a sequence of bytes.
        """
        self._check_keys("keys", keys)
        entries = self._entries
        host_hit = self._host.policy.hit
        disk_policy = self._disk.policy if self._disk is not None else None
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                continue
            if entry.host_state is _READY:
                host_hit(key)
            if entry.disk_state is _READY and disk_policy is not None:
                disk_policy.hit(key)

    def events(self) -> list[BlockEvent]:
        """Return and forget the events recorded since the last call, oldest first."""
        out, self._events = self._events, []
        return out

    def stats(self) -> ManagerStats:
        """A snapshot of block states and counters (O(1))."""
        empty_disk = TierStats(Tier.DISK, 0, 0, 0, 0, 0, 0)
        return ManagerStats(
            policy=self._policy_name,
            epoch=self._epoch,
            host=self._host.stats(),
            disk=self._disk.stats() if self._disk is not None else empty_disk,
            lookups=self._lookups,
            lookup_keys=self._lookup_keys,
            lookup_hits=self._lookup_hits,
            stores_planned=self._stores_planned,
            stores_completed=self._stores_completed,
            stores_failed=self._stores_failed,
            loads_planned=self._loads_planned,
            loads_completed=self._loads_completed,
            loads_failed=self._loads_failed,
            disk_copies_dropped=self._disk_copies_dropped,
            host_evictions=self._host_evictions,
            disk_evictions=self._disk_evictions,
            demotions_planned=self._demotions_planned,
            demotions_completed=self._demotions_completed,
            demotions_failed=self._demotions_failed,
            stale_completions=self._stale_completions,
            resets=self._resets,
        )

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
        self._check_unique_keys("keys", keys)
        entries = self._entries
        host = self._host
        new = [key for key in keys if key not in entries]
        protected: AbstractSet[bytes] = _NO_KEYS
        if len(new) != len(keys):
            protected = {key for key in keys if key in entries}
        need = len(new) - len(host.free)
        host_victims: list[bytes] = []
        host_entries: list[_Entry] = []
        if need > 0:
            host_victims = host.policy.victims(need, protected)
            host_entries = self._victim_entries(host, host_victims, need, protected)
            if len(host_victims) < need:
                return None
        disk = self._disk
        demote_room = 0
        demotable: list[bool] = []  # co-indexed with host_victims: no disk copy, may be demoted
        disk_victims: list[bytes] = []
        disk_entries: list[_Entry] = []
        if disk is not None and host_victims:  # dry run: room on disk for the victims without a copy
            demotable = [entry.disk_state is None for entry in host_entries]
            candidates = sum(demotable)
            shortfall = candidates - len(disk.free)
            if shortfall > 0:
                disk_victims = disk.policy.victims(shortfall, protected)
                disk_entries = self._victim_entries(disk, disk_victims, shortfall, protected)
            demote_room = min(candidates, len(disk.free) + len(disk_victims))

        plan_id = next(_PLAN_IDS)
        if disk_victims:
            assert disk is not None  # disk victims exist only with a disk tier
            self._evict(disk, disk_victims, disk_entries)
            self._forget(disk_victims, disk_entries)
        demotions: list[Demotion] = []
        demoted: list[_Entry] = []
        if host_victims:
            self._evict(host, host_victims, host_entries)
            if demote_room:
                assert disk is not None  # room for demotions exists only with a disk tier
                for key, entry, may_demote in zip(host_victims, host_entries, demotable):
                    if may_demote:
                        entry.disk = disk.free.pop()
                        entry.disk_state = _PENDING
                        entry.disk_plan = plan_id
                        entry.demote_src = entry.host
                        demotions.append(Demotion(key, entry.host, entry.disk))
                        demoted.append(entry)
                        if len(demoted) == demote_room:
                            break
                disk.pending += len(demoted)
            self._forget(host_victims, host_entries)
        blocks = host.take(len(new))
        created = [_Entry(block, plan_id) for block in blocks]
        entries.update(zip(new, created))
        host.pending += len(new)
        plan_keys = tuple(new)
        plan_demotions = tuple(demotions)
        if created or demoted:
            self._stores[plan_id] = _PlanCopies(plan_keys, created, plan_demotions, demoted)
        self._stores_planned += len(new)
        self._host_evictions += len(host_victims)
        self._disk_evictions += len(disk_victims)
        self._demotions_planned += len(demotions)
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
        done = self._complete_copies(plan, ok, keys, plan.keys, _Fence.STORE)
        if ok:
            self._stores_completed += done
        else:
            self._stores_failed += done

    def complete_demote(self, plan: StorePlan, ok: bool, keys: Sequence[bytes] | None = None) -> None:
        """Finish the demotions of ``keys`` (default: every key of ``plan.demotions``).

        With ``ok`` the disk copies become ready (``STORED`` events on the disk tier); without, the
        disk blocks are freed and the keys dropped (``STORE_FAILED`` events on the disk tier). A plan
        from before the last :meth:`reset` is a no-op (it only unfences its blocks).

        Raises: as :meth:`complete_store`, for the demotion keys of ``plan``.
        """
        self._check_plan(plan, StorePlan, ok)
        done = self._complete_copies(plan, ok, keys, [d.key for d in plan.demotions], _Fence.DEMOTE)
        if ok:
            self._demotions_completed += done
        else:
            self._demotions_failed += done

    def _complete_copies(
        self,
        plan: StorePlan,
        ok: bool,
        keys: Sequence[bytes] | None,
        plan_keys: Sequence[bytes],
        what: _Fence,
    ) -> int:
        """The body of :meth:`complete_store` (``what`` STORE: host copies) and
        :meth:`complete_demote` (DEMOTE: disk copies) once the plan is checked; returns how many
        copies it completed (0 for a plan of an earlier epoch)."""
        if keys is not None:
            self._check_plan_keys(plan.plan_id, keys, plan_keys)
        if plan.epoch != self._epoch:
            self._complete_stale(plan.plan_id, what, plan_keys if keys is None else keys)
            return 0
        on_host = what is _Fence.STORE
        copies = self._stores.get(plan.plan_id)
        found: list[_Entry] | None = None
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
            found = self._pending_entries(plan.plan_id, keys, _HOST if on_host else _DISK)
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
                setattr(entry, state, _READY)
                admit(key)
            self._ready.update(keys)
        else:
            pool.free += map(pool.block_of, found)
            for entry in found:
                setattr(entry, state, None)
            self._forget(keys, found)
        if self._record_events:
            self._events += _events_of(_STORED if ok else _STORE_FAILED, keys, pool.tier)
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
        self._check_unique_keys("keys", keys)
        entries = self._entries
        ready = self._ready
        found: list[_Entry] = []
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
            if entry.host_state is _READY:
                tier, pool, block = _HOST, host, entry.host
                entry.host_refs += 1
                first = entry.host_refs == 1
            else:
                assert disk is not None  # ready and not on host: ready on disk
                tier, pool, block = _DISK, disk, entry.disk
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
        self._loads_planned += len(keys)
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
            self._check_plan_keys(plan.plan_id, keys, plan.keys)
        if plan.epoch != self._epoch:
            self._complete_stale(plan.plan_id, _Fence.LOAD, keys)
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
            if tier is _HOST:
                pool = self._host
                entry.host_refs -= 1
                last = entry.host_refs == 0
            else:
                assert self._disk is not None  # a disk load exists only with a disk tier
                pool = self._disk
                entry.disk_refs -= 1
                last = entry.disk_refs == 0
                if not ok and entry.disk_state is _READY:
                    entry.disk_state = _FAILED  # no longer offered
                    if entry.host_state is not _READY:
                        self._ready.discard(key)
            if last:
                pool.policy.release(key)
                pool.loading -= 1
                if tier is _DISK and entry.disk_state is _FAILED:
                    self._drop_failed_disk_copy(key, entry)
        if not outstanding:
            self._loads.pop(plan.plan_id, None)
        self._loads_completed += len(keys)
        if not ok:
            self._loads_failed += len(keys)

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
                if entry.host_state is _READY:
                    events.append(BlockEvent(_REMOVED, key, _HOST))
                if entry.disk_state is _READY:
                    events.append(BlockEvent(_REMOVED, key, _DISK))
        host, disk = self._host, self._disk
        if in_flight_done:
            self._fences.clear()
        else:
            for plan_id, copies in self._stores.items():  # every pending copy is in its plan's record
                for key, entry in zip(copies.keys, copies.host):
                    if entry.host_state is _PENDING and entry.host_plan == plan_id:
                        self._fence((plan_id, _Fence.STORE, key), [(host, entry.host)])
                for demotion, entry in zip(copies.demotions, copies.disk):
                    if entry.disk_state is _PENDING and entry.disk_plan == plan_id:
                        assert disk is not None  # a pending demotion exists only with a disk tier
                        holds = [(disk, entry.disk), (host, entry.demote_src)]
                        self._fence((plan_id, _Fence.DEMOTE, demotion.key), holds)
            for plan_id, outstanding in self._loads.items():
                for key, tier in outstanding.items():
                    entry = entries[key]
                    pool, block = (host, entry.host) if tier is _HOST else (disk, entry.disk)
                    assert pool is not None  # a disk load exists only with a disk tier
                    self._fence((plan_id, _Fence.LOAD, key), [(pool, block)])
        fenced: dict[_Pool, dict[int, int]] = {host: {}}
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
        self._resets += 1

    # ----------------------------------------------------------------- helpers

    def _check_keys(self, name: str, keys: object) -> None:
        if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence):
            raise KeyTypeError(
                f"{name} = {keys!r:.80} is a {type(keys).__name__}; it must be a sequence of bytes keys "
                "(pass [key] for one key)"
            )
        if _BYTES_ONLY.issuperset(map(type, keys)):
            return
        for i, key in enumerate(keys):
            if not isinstance(key, bytes):
                raise KeyTypeError(
                    f"{name}[{i}] = {key!r:.80} is a {type(key).__name__}; keys must be bytes"
                )

    def _check_unique_keys(self, name: str, keys: object) -> None:
        """``_check_keys``, and no key twice (:class:`DuplicateKeyError` naming both positions)."""
        self._check_keys(name, keys)
        assert isinstance(keys, Sequence)  # _check_keys proved it
        if len(set(keys)) == len(keys):
            return
        seen: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            if key in seen:
                raise DuplicateKeyError(
                    f"{name}[{i}] = {key!r} repeats {name}[{seen[key]}]; each key may appear once"
                )
            seen[key] = i

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

    def _check_plan_keys(self, plan_id: int, keys: Sequence[bytes], plan_keys: Sequence[bytes]) -> None:
        """Validate a completion's explicit ``keys`` against the plan's keys alone."""
        self._check_unique_keys("keys", keys)
        members = set(plan_keys)
        for i, key in enumerate(keys):
            if key not in members:
                raise UnknownKeyError(f"keys[{i}] = {key!r} is not one of plan {plan_id}'s keys")

    def _pending_entries(self, plan_id: int, keys: Sequence[bytes], tier: Tier) -> list[_Entry]:
        """The entries of ``keys`` whose ``tier`` copy is pending for ``plan_id``, or KeyStateError."""
        on_host = tier is _HOST
        entries = self._entries
        found: list[_Entry] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or not (
                entry.host_state is _PENDING and entry.host_plan == plan_id
                if on_host
                else entry.disk_state is _PENDING and entry.disk_plan == plan_id
            ):
                what = "store" if on_host else "demotion"
                raise KeyStateError(
                    f"key {key!r} of plan {plan_id} has no pending {what}: it was already completed"
                )
            found.append(entry)
        return found

    def _victim_entries(
        self, pool: _Pool, victims: list[bytes], count: int, protected: AbstractSet[bytes]
    ) -> list[_Entry]:
        """Check that the policy's ``victims`` are evictable (else :class:`PolicyError`); their entries."""
        if len(victims) > count or len(set(victims)) != len(victims):
            raise PolicyError(
                f"{type(pool.policy).__name__}.victims({count}) returned {len(victims)} keys "
                f"({len(set(victims))} distinct); expected at most {count} distinct keys"
            )
        # One C pass per check: the cache misses of a batch's lookups overlap a little in C.
        found = list(map(self._entries.get, victims))
        if (
            None not in found
            and protected.isdisjoint(victims)
            and list(map(pool.state_of, found)).count(_READY) == len(found)
            and not any(map(pool.refs_of, found))
        ):
            return cast("list[_Entry]", found)
        for key, entry in zip(victims, found):  # name the first victim that is not evictable
            if (
                entry is None
                or key in protected
                or pool.state_of(entry) is not _READY
                or pool.refs_of(entry) != 0
            ):
                raise PolicyError(
                    f"{type(pool.policy).__name__} proposed {key!r} as a {pool.tier.value} victim, but "
                    "it is not evictable (unknown, pending, loading or protected by the request)"
                )
        raise AssertionError("unreachable: some victim failed a check above")

    def _evict(self, pool: _Pool, victims: list[bytes], found: list[_Entry]) -> None:
        """Evict ``victims`` (checked, with their entries ``found``) from ``pool``: ``REMOVED`` events.

        Their copies in that tier are gone and their blocks free; see :meth:`_forget` for the rest.
        """
        evict = pool.policy.evict
        for key in victims:
            evict(key)
        pool.free += map(pool.block_of, found)
        if pool.tier is _HOST:
            for entry in found:
                entry.host_state = None
        else:
            for entry in found:
                entry.disk_state = None
        if self._record_events:
            self._events += _events_of(_REMOVED, victims, pool.tier)

    def _forget(self, keys: Sequence[bytes], found: list[_Entry]) -> None:
        """Drop the entries (``found``) of ``keys`` left with no copy; keep ``_ready`` exact for them."""
        entries = self._entries
        still_ready: list[bytes] = []
        for key, entry in zip(keys, found):
            if entry.host_state is None and entry.disk_state is None:
                del entries[key]
            elif entry.host_state is _READY or entry.disk_state is _READY:
                still_ready.append(key)
        self._ready.difference_update(keys)
        if still_ready:
            self._ready.update(still_ready)

    def _drop_failed_disk_copy(self, key: bytes, entry: _Entry) -> None:
        """Free the disk block of a copy a load found damaged, once no load holds it."""
        disk = self._disk
        assert disk is not None
        disk.policy.evict(key)
        disk.free.append(entry.disk)
        entry.disk_state = None
        self._disk_copies_dropped += 1
        if self._record_events:
            self._events.append(BlockEvent(_REMOVED, key, _DISK))
        self._forget([key], [entry])

    def _fence(self, key: _FenceKey, holds: list[tuple[_Pool, int]]) -> None:
        self._fences.setdefault(key, []).extend(holds)

    def _complete_stale(self, plan_id: int, what: _Fence, keys: Iterable[bytes]) -> None:
        """A completion from an earlier epoch: release the blocks it fenced, change nothing else."""
        for key in keys:
            for pool, block in self._fences.pop((plan_id, what, key), ()):
                left = pool.fenced[block] - 1
                if left:
                    pool.fenced[block] = left
                else:
                    del pool.fenced[block]
                    pool.free.append(block)
        self._stale_completions += 1
