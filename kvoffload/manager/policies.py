"""Eviction policies: the seam (:class:`EvictionPolicy`) and the two the Manager ships, LRU and ARC.

A policy orders the *evictable* keys of one tier; the manager decides what is evictable. Each holds
only Python containers of keys, O(1) amortised per operation. The two shipped policies check the
protocol's guarantees on the keys of every call, so an engine that drives one directly gets a typed
error (:class:`~kvoffload.errors.UnknownKeyError` for a key that is not resident,
:class:`~kvoffload.errors.KeyStateError` for one in the wrong state) and the policy unchanged. The
checks ride on the probes each call makes anyway (a failed delete, an insert that did not grow the
table), so the Manager's calls cost what they did. ``capacity`` is the Manager's to keep: a policy
driven directly orders what it is given.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from typing import Final, NoReturn, Protocol

from kvoffload.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    KeyStateError,
    KVOffloadError,
    UnknownKeyError,
    UnknownPolicyError,
)

__all__ = ["POLICY_NAMES", "ARCPolicy", "EvictionPolicy", "LRUPolicy", "PolicyFactory", "resolve_policy"]


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


def _not_resident(policy: str, method: str, key: bytes) -> UnknownKeyError:
    return UnknownKeyError(f"{policy}.{method}({key!r}): the key is not resident (never admitted, or evicted)")


def _wrong_state(policy: str, method: str, key: bytes, why: str) -> KeyStateError:
    return KeyStateError(f"{policy}.{method}({key!r}): {why}; nothing changed")


def _refused(policy: str, method: str, key: bytes, resident: bool, why: str) -> KVOffloadError:
    """The error of a call on a key in the wrong state (``why``) when ``resident``, else on a key
    that is not resident."""
    return _wrong_state(policy, method, key, why) if resident else _not_resident(policy, method, key)


def _refuse_admit(policy: str, key: bytes) -> NoReturn:
    raise _wrong_state(policy, "admit", key, "the key is already resident")


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
        """Insert ``key`` as the most recent.

        Raises:
            KeyStateError: ``key`` is already resident.
        """
        order = self._order
        resident = len(order)
        order[key] = None  # a key in the order already keeps its place: nothing changed
        if len(order) == resident or key in self._held:
            if len(order) != resident:  # held: take the new entry back out
                del order[key]
            _refuse_admit("LRUPolicy", key)

    def _admit(self, key: bytes) -> None:
        """:meth:`admit` for a caller that keeps the protocol (the Manager): no checks."""
        self._order[key] = None

    def hit(self, key: bytes) -> None:
        """Make ``key`` the most recent (a held key becomes it at release).

        Raises:
            UnknownKeyError: ``key`` is not resident.
        """
        try:
            self._order.move_to_end(key)
        except KeyError:
            if key not in self._held:
                raise _not_resident("LRUPolicy", "hit", key) from None

    def hold(self, key: bytes) -> None:
        """Take ``key`` out of the eviction order.

        Raises:
            UnknownKeyError: ``key`` is not resident.
            KeyStateError: ``key`` is already held.
        """
        try:
            del self._order[key]
        except KeyError:
            raise _refused("LRUPolicy", "hold", key, key in self._held,
                           "the key is already held") from None
        self._held.add(key)

    def release(self, key: bytes) -> None:
        """Put ``key`` back as the most recent.

        Raises:
            UnknownKeyError: ``key`` is not resident.
            KeyStateError: ``key`` is resident but not held.
        """
        try:
            self._held.remove(key)
        except KeyError:
            raise _refused("LRUPolicy", "release", key, key in self._order,
                           "the key is not held") from None
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
        """Forget ``key``.

        Raises:
            UnknownKeyError: ``key`` is not resident.
            KeyStateError: ``key`` is held (loading); release it first.
        """
        try:
            del self._order[key]
        except KeyError:
            raise _refused("LRUPolicy", "evict", key, key in self._held,
                           "the key is held (loading); release it first") from None

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
        """Insert ``key``: into T1, or into T2 with adaptation when it is a ghost.

        Raises:
            KeyStateError: ``key`` is already resident.
        """
        if key in self._t1 or key in self._t2 or key in self._held:
            _refuse_admit("ARCPolicy", key)
        self._admit(key)

    def _admit(self, key: bytes) -> None:
        """:meth:`admit` for a caller that keeps the protocol (the Manager): no checks."""
        t2 = self._t2
        b1, b2 = self._b1, self._b2
        if key in b1:  # a ghost is not resident
            self._p = min(float(self.capacity), self._p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            t2[key] = None
        elif key in b2:
            self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def hit(self, key: bytes) -> None:
        """Move ``key`` to the most recent end of T2 (a held key joins T2 at release).

        Raises:
            UnknownKeyError: ``key`` is not resident.
        """
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        elif key in self._held:
            if not self._held[key]:
                self._held[key] = True
                self._held_t1 -= 1
        else:
            raise _not_resident("ARCPolicy", "hit", key)

    def hold(self, key: bytes) -> None:
        """Take ``key`` out of the eviction order, remembering its list.

        Raises:
            UnknownKeyError: ``key`` is not resident.
            KeyStateError: ``key`` is already held.
        """
        if key in self._t1:
            del self._t1[key]
            self._held[key] = False
            self._held_t1 += 1
            return
        try:
            del self._t2[key]
        except KeyError:
            raise _refused("ARCPolicy", "hold", key, key in self._held,
                           "the key is already held") from None
        self._held[key] = True

    def release(self, key: bytes) -> None:
        """Put ``key`` back at the most recent end of its list.

        Raises:
            UnknownKeyError: ``key`` is not resident.
            KeyStateError: ``key`` is resident but not held.
        """
        try:
            in_t2 = self._held.pop(key)
        except KeyError:
            raise _refused("ARCPolicy", "release", key, key in self._t1 or key in self._t2,
                           "the key is not held") from None
        if in_t2:
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
        """Move ``key`` from T1 to B1 or from T2 to B2, then trim the ghosts.

        Raises:
            UnknownKeyError: ``key`` is not resident.
            KeyStateError: ``key`` is held (loading); release it first.
        """
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        else:
            try:
                del self._t2[key]
            except KeyError:
                raise _refused("ARCPolicy", "evict", key, key in self._held,
                               "the key is held (loading); release it first") from None
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


class _ManagedLRU(LRUPolicy):
    """The :class:`LRUPolicy` a Manager builds for ``policy="lru"``: the Manager keeps the protocol
    (it admits only keys that are not resident), so ``admit`` skips the checks, which cost a
    quarter of ``complete_store``'s time per key (``manager-bench``)."""

    admit = LRUPolicy._admit


class _ManagedARC(ARCPolicy):
    """The :class:`ARCPolicy` a Manager builds for ``policy="arc"`` (as :class:`_ManagedLRU`)."""

    admit = ARCPolicy._admit


POLICY_NAMES: Final[dict[str, PolicyFactory]] = {"lru": _ManagedLRU, "arc": _ManagedARC}


def resolve_policy(policy: object) -> tuple[PolicyFactory, str]:
    """The factory and name of a Manager's ``policy`` argument: a name in :data:`POLICY_NAMES` or a
    factory ``capacity -> EvictionPolicy``.

    Raises:
        UnknownPolicyError: a name that is not in :data:`POLICY_NAMES`.
        ArgumentTypeError: neither a name nor a callable.
    """
    if isinstance(policy, str):
        factory = POLICY_NAMES.get(policy)
        if factory is None:
            raise UnknownPolicyError(f"policy = {policy!r} is not one of {sorted(POLICY_NAMES)}")
        return factory, policy
    if callable(policy):
        return policy, getattr(policy, "__name__", type(policy).__name__)
    raise ArgumentTypeError(f"policy = {policy!r} must be a policy name or a factory")
