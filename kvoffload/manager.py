"""The scheduler-side block manager: which KV blocks the host pool and the disk hold, and which move.

The :class:`Manager` decides *which* blocks move; a Worker moves the bytes. It owns only Python
memory: the key → block map of each tier, the free lists, the eviction policies, the counters and the
undrained events. It borrows nothing, holds no OS or GPU resource and so has no close method. It
imports neither torch nor CUDA. It is not thread-safe: call it from the scheduler thread.

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

Keys are the engine's block hashes (``bytes``). Internally every key is namespaced by the model/layout
fingerprint given at creation (:func:`namespaced_key`): the fingerprint's digest is a fixed-length
prefix of every stored key, so a manager (or a persistent tier that names records by
:meth:`Manager.namespaced`) never serves KV written under another fingerprint. Plans and events carry
the engine's keys. A key twice in one ``prepare_store``, ``prepare_load`` or completion is refused
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
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Final, Protocol

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


@attrs.frozen
class BlockEvent:
    """One change of the loadable copies, for the engine to forward to a router.

    ``key`` is the engine's key (not namespaced).
    """

    kind: EventKind
    key: bytes
    tier: Tier


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

    The manager calls it with namespaced keys (``bytes``) and guarantees: ``admit`` only for a key that
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
        """Insert ``key`` as the most recent."""
        self._order[key] = None
        self._order.move_to_end(key)

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
        if key in self._b1:
            self._p = min(float(self.capacity), self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
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
        while self._b1 and len(self._t1) + self._held_t1 + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self._b1) + len(self._b2) > self.capacity:
            self._b2.popitem(last=False)


POLICY_NAMES: Final[dict[str, PolicyFactory]] = {"lru": LRUPolicy, "arc": ARCPolicy}
"""The policies ``Manager.create(policy=...)`` knows by name."""


class _Copy(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"  # a load found it damaged: never offered again, dropped when its loads end


class _Entry:
    """Per-key state in both tiers; ``None`` state means no copy in that tier."""

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

    def __init__(self) -> None:
        self.host = -1
        self.host_state: _Copy | None = None
        self.host_plan = 0
        self.host_refs = 0
        self.disk = -1
        self.disk_state: _Copy | None = None
        self.disk_plan = 0
        self.disk_refs = 0
        self.demote_src = -1  # host block a pending demotion reads; fenced at reset


class _Pool:
    """The blocks of one tier: free list, counters, fenced blocks and the tier's policy."""

    def __init__(self, tier: Tier, capacity: int, policy: EvictionPolicy) -> None:
        self.tier = tier
        self.capacity = capacity
        self.policy = policy
        self.free: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.pending = 0
        self.loading = 0
        self.fenced: dict[int, int] = {}  # block -> stale plans still holding it

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


_FenceKey = tuple[int, _Fence, bytes]  # (plan_id, what the plan does, namespaced key)


class Manager:
    """The host (and optional disk) block pool of one model/layout fingerprint.

    Owns Python state only (see the module docstring); nothing to close. Every method either does all
    it says or raises before changing anything (state, policy order, counters, events). Not
    thread-safe. Build it with :meth:`create`.
    """

    def __init__(
        self,
        fingerprint: bytes,
        host: _Pool,
        disk: _Pool | None,
        policy_name: str,
        record_events: bool,
    ) -> None:
        self._fingerprint = fingerprint
        self._namespace = _namespace_prefix(fingerprint)
        self._owner = next(_MANAGER_IDS)
        self._host = host
        self._disk = disk
        self._policy_name = policy_name
        self._record_events = record_events
        self._epoch = 0
        self._entries: dict[bytes, _Entry] = {}
        self._ready: set[bytes] = set()  # namespaced keys loadable from some tier
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
        return cls(fp, host, disk, policy_name, record_events)

    # ----------------------------------------------------------------- read-only views

    @property
    def fingerprint(self) -> bytes:
        """The model/layout fingerprint every key is namespaced by."""
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
        ns = self._namespace
        ready = self._ready
        hits = 0
        for key in keys:
            if ns + key not in ready:
                break
            hits += 1
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
        ns = self._namespace
        entries = self._entries
        disk_policy = self._disk.policy if self._disk is not None else None
        for key in keys:
            nk = ns + key
            entry = entries.get(nk)
            if entry is None:
                continue
            if entry.host_state is _Copy.READY:
                self._host.policy.hit(nk)
            if entry.disk_state is _Copy.READY and disk_policy is not None:
                disk_policy.hit(nk)

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
        nkeys = self._namespaced_keys("keys", keys, unique=True)
        entries = self._entries
        host = self._host
        new = [i for i, nk in enumerate(nkeys) if nk not in entries]
        protected = {nk for nk in nkeys if nk in entries}
        need = len(new) - len(host.free)
        host_victims: list[bytes] = []
        if need > 0:
            host_victims = host.policy.victims(need, protected)
            self._check_victims(host, host_victims, need, protected)
            if len(host_victims) < need:
                return None
        demote, disk_victims = self._plan_demotions(host_victims, protected)

        plan_id = next(_PLAN_IDS)
        ns_len = len(self._namespace)
        record = self._record_events
        events = self._events
        disk = self._disk
        disk_evicted: list[bytes] = []
        for nk in disk_victims:
            assert disk is not None  # disk victims exist only with a disk tier
            entry = entries[nk]
            disk_evicted.append(nk[ns_len:])
            disk.policy.evict(nk)
            disk.free.append(entry.disk)
            entry.disk_state = None
            if record:
                events.append(BlockEvent(EventKind.REMOVED, nk[ns_len:], Tier.DISK))
            self._forget_if_empty(nk, entry)
        demotions: list[Demotion] = []
        evicted: list[bytes] = []
        for nk in host_victims:
            entry = entries[nk]
            host.policy.evict(nk)
            host.free.append(entry.host)
            entry.host_state = None
            key = nk[ns_len:]
            evicted.append(key)
            if record:
                events.append(BlockEvent(EventKind.REMOVED, key, Tier.HOST))
            if nk in demote:
                assert disk is not None  # demotions exist only with a disk tier
                entry.disk = disk.free.pop()
                entry.disk_state = _Copy.PENDING
                entry.disk_plan = plan_id
                entry.demote_src = entry.host
                disk.pending += 1
                demotions.append(Demotion(key, entry.host, entry.disk))
            self._forget_if_empty(nk, entry)
        blocks: list[int] = []
        for i in new:
            nk = nkeys[i]
            entry = _Entry()
            entry.host = host.free.pop()
            entry.host_state = _Copy.PENDING
            entry.host_plan = plan_id
            entries[nk] = entry
            blocks.append(entry.host)
        host.pending += len(new)
        self._stores_planned += len(new)
        self._host_evictions += len(host_victims)
        self._disk_evictions += len(disk_victims)
        self._demotions_planned += len(demotions)
        return StorePlan(
            owner=self._owner,
            plan_id=plan_id,
            epoch=self._epoch,
            keys=tuple(keys[i] for i in new),
            host_blocks=tuple(blocks),
            evicted=tuple(evicted),
            disk_evicted=tuple(disk_evicted),
            demotions=tuple(demotions),
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
        nkeys = self._plan_keys(plan, StorePlan, ok, keys, plan.keys if isinstance(plan, StorePlan) else ())
        if plan.epoch != self._epoch:
            self._complete_stale(plan.plan_id, _Fence.STORE, nkeys)
            return
        ns_len = len(self._namespace)
        found: list[_Entry] = []
        for nk in nkeys:
            entry = self._entries.get(nk)
            if entry is None or entry.host_state is not _Copy.PENDING or entry.host_plan != plan.plan_id:
                raise KeyStateError(
                    f"key {nk[ns_len:]!r} of plan {plan.plan_id} has no pending store: it was already "
                    "completed"
                )
            found.append(entry)
        host = self._host
        host.pending -= len(nkeys)
        for nk, entry in zip(nkeys, found):
            if ok:
                entry.host_state = _Copy.READY
                host.policy.admit(nk)
                self._ready.add(nk)
            else:
                entry.host_state = None
                host.free.append(entry.host)
                self._forget_if_empty(nk, entry)
            if self._record_events:
                kind = EventKind.STORED if ok else EventKind.STORE_FAILED
                self._events.append(BlockEvent(kind, nk[ns_len:], Tier.HOST))
        if ok:
            self._stores_completed += len(nkeys)
        else:
            self._stores_failed += len(nkeys)

    def complete_demote(self, plan: StorePlan, ok: bool, keys: Sequence[bytes] | None = None) -> None:
        """Finish the demotions of ``keys`` (default: every key of ``plan.demotions``).

        With ``ok`` the disk copies become ready (``STORED`` events on the disk tier); without, the
        disk blocks are freed and the keys dropped (``STORE_FAILED`` events on the disk tier). A plan
        from before the last :meth:`reset` is a no-op (it only unfences its blocks).

        Raises: as :meth:`complete_store`, for the demotion keys of ``plan``.
        """
        plan_keys = tuple(d.key for d in plan.demotions) if isinstance(plan, StorePlan) else ()
        nkeys = self._plan_keys(plan, StorePlan, ok, keys, plan_keys)
        if plan.epoch != self._epoch:
            self._complete_stale(plan.plan_id, _Fence.DEMOTE, nkeys)
            return
        if not nkeys:
            return
        ns_len = len(self._namespace)
        found: list[_Entry] = []
        for nk in nkeys:
            entry = self._entries.get(nk)
            if entry is None or entry.disk_state is not _Copy.PENDING or entry.disk_plan != plan.plan_id:
                raise KeyStateError(
                    f"key {nk[ns_len:]!r} of plan {plan.plan_id} has no pending demotion: it was already "
                    "completed"
                )
            found.append(entry)
        disk = self._disk
        assert disk is not None  # a pending demotion exists only with a disk tier
        disk.pending -= len(nkeys)
        for nk, entry in zip(nkeys, found):
            if ok:
                entry.disk_state = _Copy.READY
                disk.policy.admit(nk)
                self._ready.add(nk)
            else:
                entry.disk_state = None
                disk.free.append(entry.disk)
                self._forget_if_empty(nk, entry)
            if self._record_events:
                kind = EventKind.STORED if ok else EventKind.STORE_FAILED
                self._events.append(BlockEvent(kind, nk[ns_len:], Tier.DISK))
        if ok:
            self._demotions_completed += len(nkeys)
        else:
            self._demotions_failed += len(nkeys)

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
        nkeys = self._namespaced_keys("keys", keys, unique=True)
        entries = self._entries
        ns_len = len(self._namespace)
        for i, nk in enumerate(nkeys):
            entry = entries.get(nk)
            if entry is None:
                raise UnknownKeyError(f"keys[{i}] = {nk[ns_len:]!r} is not held in any tier")
            if nk not in self._ready:
                raise KeyStateError(
                    f"keys[{i}] = {nk[ns_len:]!r} is not ready (its store or demotion is pending)"
                )
        host, disk = self._host, self._disk
        tiers: list[Tier] = []
        blocks: list[int] = []
        outstanding: dict[bytes, Tier] = {}
        for nk in nkeys:
            entry = entries[nk]
            if entry.host_state is _Copy.READY:
                tier, pool, block = Tier.HOST, host, entry.host
                entry.host_refs += 1
                first = entry.host_refs == 1
            else:
                assert disk is not None  # ready and not on host: ready on disk
                tier, pool, block = Tier.DISK, disk, entry.disk
                entry.disk_refs += 1
                first = entry.disk_refs == 1
            pool.policy.hit(nk)
            if first:
                pool.policy.hold(nk)
                pool.loading += 1
            tiers.append(tier)
            blocks.append(block)
            outstanding[nk] = tier
        plan_id = next(_PLAN_IDS)
        if outstanding:
            self._loads[plan_id] = outstanding
        self._loads_planned += len(nkeys)
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
        nkeys = self._plan_keys(plan, LoadPlan, True, keys, plan.keys if isinstance(plan, LoadPlan) else ())
        if plan.epoch != self._epoch:
            self._complete_stale(plan.plan_id, _Fence.LOAD, nkeys)
            return
        outstanding = self._loads.get(plan.plan_id, {})
        for nk in nkeys:
            if nk not in outstanding:
                raise KeyStateError(
                    f"key {nk[len(self._namespace) :]!r} of plan {plan.plan_id} has no outstanding "
                    "prepare_load: it was already completed"
                )
        for nk in nkeys:
            tier = outstanding.pop(nk)
            entry = self._entries[nk]
            if tier is Tier.HOST:
                pool = self._host
                entry.host_refs -= 1
                last = entry.host_refs == 0
            else:
                assert self._disk is not None  # a disk load exists only with a disk tier
                pool = self._disk
                entry.disk_refs -= 1
                last = entry.disk_refs == 0
                if not ok and entry.disk_state is _Copy.READY:
                    entry.disk_state = _Copy.FAILED
                    self._forget_if_empty(nk, entry)  # no longer offered
            if last:
                pool.policy.release(nk)
                pool.loading -= 1
                if tier is Tier.DISK and entry.disk_state is _Copy.FAILED:
                    self._drop_failed_disk_copy(nk, entry)
        if not outstanding:
            self._loads.pop(plan.plan_id, None)
        self._loads_completed += len(nkeys)
        if not ok:
            self._loads_failed += len(nkeys)

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
            ns_len = len(self._namespace)
            for nk in self._ready:
                entry = entries[nk]
                if entry.host_state is _Copy.READY:
                    self._events.append(BlockEvent(EventKind.REMOVED, nk[ns_len:], Tier.HOST))
                if entry.disk_state is _Copy.READY:
                    self._events.append(BlockEvent(EventKind.REMOVED, nk[ns_len:], Tier.DISK))
        host, disk = self._host, self._disk
        if in_flight_done:
            self._fences.clear()
        else:
            for nk, entry in entries.items():
                if entry.host_state is _Copy.PENDING:
                    self._fence((entry.host_plan, _Fence.STORE, nk), [(host, entry.host)])
                if entry.disk_state is _Copy.PENDING:
                    assert disk is not None  # a pending demotion exists only with a disk tier
                    self._fence(
                        (entry.disk_plan, _Fence.DEMOTE, nk), [(disk, entry.disk), (host, entry.demote_src)]
                    )
            for plan_id, outstanding in self._loads.items():
                for nk, tier in outstanding.items():
                    entry = entries[nk]
                    pool, block = (host, entry.host) if tier is Tier.HOST else (disk, entry.disk)
                    assert pool is not None  # a disk load exists only with a disk tier
                    self._fence((plan_id, _Fence.LOAD, nk), [(pool, block)])
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

    def _namespaced_keys(self, name: str, keys: object, *, unique: bool) -> list[bytes]:
        self._check_keys(name, keys)
        assert isinstance(keys, Sequence)  # _check_keys proved it
        ns = self._namespace
        nkeys = [ns + key for key in keys]
        if unique and len(set(nkeys)) != len(nkeys):
            seen: dict[bytes, int] = {}
            for i, nk in enumerate(nkeys):
                if nk in seen:
                    raise DuplicateKeyError(
                        f"{name}[{i}] = {keys[i]!r} repeats {name}[{seen[nk]}]; each key may appear once"
                    )
                seen[nk] = i
        return nkeys

    def _plan_keys(
        self,
        plan: object,
        kind: type[StorePlan] | type[LoadPlan],
        ok: object,
        keys: Sequence[bytes] | None,
        plan_keys: tuple[bytes, ...],
    ) -> list[bytes]:
        """Validate a completion's arguments against the plan alone; return the namespaced keys."""
        if not isinstance(plan, kind):
            raise ArgumentTypeError(
                f"plan = {plan!r:.80} is a {type(plan).__name__}; expected a {kind.__name__}"
            )
        if plan.owner != self._owner:
            raise InvalidArgumentError(f"plan {plan.plan_id} was prepared by another Manager")
        if not isinstance(ok, bool):
            raise ArgumentTypeError(f"ok = {ok!r} is a {type(ok).__name__}; it must be a bool")
        if keys is None:
            return [self._namespace + key for key in plan_keys]
        nkeys = self._namespaced_keys("keys", keys, unique=True)
        members = set(plan_keys)
        for i, key in enumerate(keys):
            if key not in members:
                raise UnknownKeyError(f"keys[{i}] = {key!r} is not one of plan {plan.plan_id}'s keys")
        return nkeys

    def _check_victims(self, pool: _Pool, victims: list[bytes], count: int, protected: set[bytes]) -> None:
        if len(victims) > count or len(set(victims)) != len(victims):
            raise PolicyError(
                f"{type(pool.policy).__name__}.victims({count}) returned {len(victims)} keys "
                f"({len(set(victims))} distinct); expected at most {count} distinct keys"
            )
        on_host = pool.tier is Tier.HOST
        for nk in victims:
            entry = self._entries.get(nk)
            ok = (
                entry is not None
                and nk not in protected
                and (entry.host_state if on_host else entry.disk_state) is _Copy.READY
                and (entry.host_refs if on_host else entry.disk_refs) == 0
            )
            if not ok:
                raise PolicyError(
                    f"{type(pool.policy).__name__} proposed {nk[len(self._namespace) :]!r} as a "
                    f"{pool.tier.value} victim, but it is not evictable (unknown, pending, loading or "
                    "protected by the request)"
                )

    def _plan_demotions(
        self, host_victims: list[bytes], protected: set[bytes]
    ) -> tuple[set[bytes], list[bytes]]:
        """Dry run: which host victims are demoted, and which disk blocks are evicted for them."""
        disk = self._disk
        if disk is None or not host_victims:
            return set(), []
        entries = self._entries
        candidates = [nk for nk in host_victims if entries[nk].disk_state is None]
        shortfall = len(candidates) - len(disk.free)
        disk_victims: list[bytes] = []
        if shortfall > 0:
            disk_victims = disk.policy.victims(shortfall, protected)
            self._check_victims(disk, disk_victims, shortfall, protected)
        room = len(disk.free) + len(disk_victims)
        return set(candidates[:room]), disk_victims

    def _drop_failed_disk_copy(self, nk: bytes, entry: _Entry) -> None:
        """Free the disk block of a copy a load found damaged, once no load holds it."""
        disk = self._disk
        assert disk is not None
        disk.policy.evict(nk)
        disk.free.append(entry.disk)
        entry.disk_state = None
        self._disk_copies_dropped += 1
        if self._record_events:
            self._events.append(BlockEvent(EventKind.REMOVED, nk[len(self._namespace) :], Tier.DISK))
        self._forget_if_empty(nk, entry)

    def _forget_if_empty(self, nk: bytes, entry: _Entry) -> None:
        """Drop the entry when no tier holds a copy; keep ``_ready`` exact either way."""
        if entry.host_state is None and entry.disk_state is None:
            del self._entries[nk]
        if entry.host_state is not _Copy.READY and entry.disk_state is not _Copy.READY:
            self._ready.discard(nk)

    def _fence(self, key: _FenceKey, holds: list[tuple[_Pool, int]]) -> None:
        self._fences.setdefault(key, []).extend(holds)

    def _complete_stale(self, plan_id: int, what: _Fence, nkeys: list[bytes]) -> None:
        """A completion from an earlier epoch: release the blocks it fenced, change nothing else."""
        for nk in nkeys:
            for pool, block in self._fences.pop((plan_id, what, nk), ()):
                left = pool.fenced[block] - 1
                if left:
                    pool.fenced[block] = left
                else:
                    del pool.fenced[block]
                    pool.free.append(block)
        self._stale_completions += 1
