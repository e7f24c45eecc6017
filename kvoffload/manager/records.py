"""The Manager's records: tiers, events, plans, statistics, and key namespacing.

Plain values (frozen attrs classes and named tuples): safe to keep, log or hand to another thread.
Imports neither torch nor numpy.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Final, NamedTuple, Protocol

import attrs

from kvoffload.errors import ArgumentTypeError, InvalidArgumentError, KeyTypeError

__all__ = [
    "NAMESPACE_PREFIX_BYTES",
    "BlockEvent",
    "Demotion",
    "DiskRecord",
    "EventKind",
    "LoadPlan",
    "ManagerStats",
    "RemotePutPlan",
    "StorePlan",
    "Tier",
    "TierStats",
    "events_of",
    "fingerprint_bytes",
    "namespace_prefix",
    "namespaced_key",
]

NAMESPACE_PREFIX_BYTES: Final = 16
"""Length of the fingerprint digest that prefixes every namespaced key, in bytes."""

_NAMESPACE_PERSON: Final = b"kvoffload.ns.v1"  # blake2b personalisation: at most 16 bytes


def namespaced_key(fingerprint: bytes | str, key: bytes) -> bytes:
    """Return ``key`` prefixed with the :data:`NAMESPACE_PREFIX_BYTES`-byte digest of ``fingerprint``.

    The prefix has a fixed length, so two (fingerprint, key) pairs map to the same namespaced key only
    if both are equal (up to a blake2b collision). Raises :class:`ArgumentTypeError` /
    :class:`InvalidArgumentError` for a bad fingerprint and :class:`KeyTypeError` for a non-bytes key.
    """
    if not isinstance(key, bytes):
        raise KeyTypeError(f"key = {key!r} is a {type(key).__name__}; keys must be bytes")
    return namespace_prefix(fingerprint_bytes(fingerprint)) + key


def fingerprint_bytes(fingerprint: object) -> bytes:
    if isinstance(fingerprint, str):
        try:
            fingerprint = fingerprint.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(
                f"fingerprint = {fingerprint!r:.80} is not valid UTF-8 ({exc.reason} at {exc.start})"
            ) from None
    if not isinstance(fingerprint, bytes):
        raise ArgumentTypeError(
            f"fingerprint = {fingerprint!r} is a {type(fingerprint).__name__}; it must be bytes or str"
        )
    if not fingerprint:
        raise InvalidArgumentError("fingerprint = b'' is empty; it must name the model and KV layout")
    return fingerprint


def namespace_prefix(fingerprint: bytes) -> bytes:
    return hashlib.blake2b(
        fingerprint, digest_size=NAMESPACE_PREFIX_BYTES, person=_NAMESPACE_PERSON
    ).digest()


class DiskRecord(Protocol):
    """One record a disk tier holds, as ``Worker.disk_valid_blocks()`` lists it
    (``kvoffload.DiskRecordInfo``): its disk block, the generation of its write (later writes have
    higher ones) and the name in its header. What :meth:`Manager.adopt_disk` reads."""

    @property
    def block(self) -> int:
        """The disk block."""

    @property
    def generation(self) -> int:
        """The write's generation."""

    @property
    def key(self) -> bytes:
        """The name in the record's header (``b""``: none)."""


class Tier(enum.Enum):
    """Where a copy of a block lives. ``REMOTE``: the remote store shared by engine instances (a
    :class:`LoadPlan` entry of this tier is read into a host block first)."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


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


def events_of(kind: EventKind, keys: Iterable[bytes], tier: Tier) -> Iterator[BlockEvent]:
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

    ``blocks[i]`` is a host block when ``tiers[i]`` is ``Tier.HOST``, a disk block when it is
    ``Tier.DISK``; for ``Tier.REMOTE`` it is the host block the record is read into
    (``Worker.get_remote`` of ``Manager.namespaced(keys[i])``) before it is loaded from there.
    """

    owner: int
    plan_id: int
    epoch: int
    keys: tuple[bytes, ...]
    tiers: tuple[Tier, ...]
    blocks: tuple[int, ...]


@attrs.frozen
class RemotePutPlan:
    """What one ``prepare_remote_put`` decided: write the host blocks of ``keys`` to the remote store.

    ``remote_keys[i]`` is the name to store ``keys[i]`` under (``Manager.namespaced``), and
    ``host_blocks[i]`` its host block, held (not evictable) until ``complete_remote_put``.
    """

    owner: int
    plan_id: int
    epoch: int
    keys: tuple[bytes, ...]
    remote_keys: tuple[bytes, ...]
    host_blocks: tuple[int, ...]


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
    prefixes (``remote_lookup_hits`` of them found in the remote store; ``remote_lookup_errors``
    counts existence checks that failed or passed their deadline, whose keys counted as misses).
    Store, load, eviction, demotion and remote counters count keys (blocks), not calls.
    ``stale_completions`` counts calls: each ``complete_*`` given a plan from before the last
    ``reset`` (a no-op but for the blocks it unfences). A duplicated call counts again, as the
    manager keeps nothing of an old plan but the blocks it fences.
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
    remote_lookup_keys: int = 0
    remote_lookup_hits: int = 0
    remote_lookup_errors: int = 0
    remote_loads_planned: int = 0
    remote_loads_completed: int = 0
    remote_loads_failed: int = 0
    remote_puts_planned: int = 0
    remote_puts_completed: int = 0
    remote_puts_failed: int = 0

    @property
    def hit_rate(self) -> float:
        """``lookup_hits / lookup_keys`` (0.0 before any lookup)."""
        return self.lookup_hits / self.lookup_keys if self.lookup_keys else 0.0
