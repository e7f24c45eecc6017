"""The Manager's remote tier: which keys the remote store holds, loads from it, and write-through puts.

Python state only (no torch, no numpy): the remote index the manager asks (any object with a
batched ``exists(keys, *, timeout)``, such as a remote store), its deadline, and the helpers the
:class:`~kvoffload.manager.Manager` runs on its own state for the three remote steps
(docs/design.md §11 and §14):

* **lookup** past the local tiers: the keys after the locally ready prefix that the manager does not
  hold at all are checked in one batched, deadline-bounded existence call under their namespaced
  names; the leading present ones are hits. A call that raises, fails or passes its deadline counts
  every key as a miss — a remote lookup never fails a request and never hangs it;
* **loads** from the remote store: ``prepare_load`` gives each key not held locally a host block
  (free, or evicted by the host policy; evicted copies are dropped, not demoted: the write-through
  policy means the store has them, but for a key whose put was refused, which is then lost here:
  docs/design.md §14) as a pending host copy of tier ``REMOTE``; the engine reads the
  record into it (``Worker.get_remote``) and loads it from there; ``complete_load`` makes it a ready
  host copy, or frees the block when the read or the load failed — and the manager no longer offers
  that key from the store (a damaged record stays there: the first writer wins);
* **write-through puts**: after a store completed, ``prepare_remote_put`` holds the ready host copies
  the store does not hold yet (as a load would: not evictable) and names them; the engine puts them
  (``Worker.put_remote``) and ``complete_remote_put`` releases them, remembering the keys it put.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Final, Protocol, cast

from kvoffload._seconds import MAX_TIMEOUT_S
from kvoffload.errors import ArgumentTypeError, InvalidArgumentError
from kvoffload.manager.state import READY, Counts, Entry, Pool

__all__ = [
    "DEFAULT_REMOTE_TIMEOUT_S",
    "FAILED_KEYS_MAX",
    "REMOTE_NAME_MAX_BYTES",
    "ExistsAnswer",
    "RemoteIndex",
    "RemoteLink",
    "check_remote_timeout",
    "eligible_for_put",
    "hold_for_put",
    "release_put",
]

#: Deadline of one batched existence check unless configured (a lookup waits at most this long).
DEFAULT_REMOTE_TIMEOUT_S: Final = 0.5
#: Keys whose remote load failed that a manager remembers, newest first, so as not to offer them
#: again (a damaged record stays on the store: the first writer wins).
FAILED_KEYS_MAX: Final = 4096
#: The longest name a remote record has (``kvoffload._record.MAX_KEY_BYTES``, not imported here: that
#: module imports numpy, which the Manager is used without). A key whose namespaced name is longer
#: cannot be in the store: it ends a lookup's run there, and is never asked (the store would refuse
#: the whole batch, and every key of the lookup would count as a miss).
REMOTE_NAME_MAX_BYTES: Final = 1024


class ExistsAnswer(Protocol):
    """The answer of an existence check, key by key (a ``kvoffload.RemoteResult`` is one)."""

    @property
    def succeeded(self) -> Sequence[bool]:
        """Per key: present."""
        ...

    @property
    def errors(self) -> Sequence[object | None]:
        """Per key: why the check of that key failed, or None."""
        ...


class RemoteIndex(Protocol):
    """What a Manager asks the remote store: which keys it holds, in one call with a deadline.

    A remote store (``kvoffload.MooncakeStore``, ``kvoffload.RedisClusterStore``) is one; so is any
    object with this method. It must return within about ``timeout`` seconds.
    """

    def exists(self, keys: Sequence[bytes], *, timeout: float) -> ExistsAnswer:
        """Which of ``keys`` the store holds."""
        ...


def check_remote_timeout(timeout_s: object) -> float:
    """A Manager's ``remote_timeout_s``, checked whether or not it has a remote index.

    Raises:
        ArgumentTypeError: not a number.
        InvalidArgumentError: not a finite number > 0.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ArgumentTypeError(f"remote_timeout_s = {timeout_s!r} must be a number of seconds")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:  # NaN and inf fail it too
        raise InvalidArgumentError(f"remote_timeout_s = {timeout_s!r} must be finite and > 0")
    return float(timeout_s)


class RemoteLink:
    """A manager's remote index, its deadline and the namespace of its keys (owns nothing else)."""

    def __init__(self, index: RemoteIndex, timeout_s: float, namespace: bytes) -> None:
        self.index = index
        self.timeout_s = timeout_s
        self.namespace = namespace
        self.puts: dict[int, list[bytes]] = {}  # outstanding put plan -> its keys
        self.failed: dict[bytes, None] = {}  # keys whose remote load failed, oldest first

    def forget_key(self, key: bytes) -> None:
        """A remote load of ``key`` failed: never offer it again (up to :data:`FAILED_KEYS_MAX`)."""
        self.failed[key] = None
        if len(self.failed) > FAILED_KEYS_MAX:
            del self.failed[next(iter(self.failed))]

    @classmethod
    def create(cls, index: object, timeout_s: object, namespace: bytes) -> RemoteLink:
        """Check a Manager's ``remote`` and ``remote_timeout_s`` arguments.

        Raises:
            ArgumentTypeError: ``index`` has no callable ``exists``, or ``timeout_s`` is not a number.
            InvalidArgumentError: ``timeout_s`` is not a finite number > 0.
        """
        if not callable(getattr(index, "exists", None)):
            raise ArgumentTypeError(
                f"remote = {index!r:.80} must have a batched exists(keys, *, timeout) (a remote store)"
            )
        return cls(cast(RemoteIndex, index), check_remote_timeout(timeout_s), namespace)

    def refusal(self, key: bytes) -> str | None:
        """Why the store cannot serve ``key`` whatever it holds (its remote load failed, or its
        name would be too long), or None."""
        if key in self.failed:
            return "its remote load failed, and it is not offered again: store it again"
        name = len(self.namespace) + len(key)
        if name > REMOTE_NAME_MAX_BYTES:
            return f"its remote name would have {name} bytes, over {REMOTE_NAME_MAX_BYTES}"
        return None

    def extend(self, keys: Sequence[bytes], start: int, entries: dict[bytes, Entry], n: Counts) -> int:
        """How many keys from ``keys[start]`` on the store holds, in order, among those the manager
        holds in no tier (the first held key ends the run: its local copy is pending) and whose
        remote load never failed. A miss on any error (module docstring)."""
        candidates = list(itertools.takewhile(
            lambda key: key not in entries and self.refusal(key) is None, keys[start:]))
        if not candidates:
            return 0
        n.remote_lookup_keys += len(candidates)
        try:
            answer = self.index.exists([self.namespace + key for key in candidates], timeout=self.timeout_s)
            present = [ok and error is None for ok, error in zip(answer.succeeded, answer.errors)]
        except Exception:  # noqa: BLE001 - a remote lookup is advisory: any failure is a miss
            n.remote_lookup_errors += 1
            return 0
        if len(present) != len(candidates):  # an answer of another length: which key is which?
            n.remote_lookup_errors += 1
            return 0
        if any(e is not None for e in answer.errors):
            n.remote_lookup_errors += 1
        hits = len(list(itertools.takewhile(bool, present)))
        n.remote_lookup_hits += hits
        return hits


def hold_for_put(host: Pool, key: bytes, entry: Entry) -> None:
    """A put reads the host copy: not evictable until :func:`release_put`."""
    entry.host_refs += 1
    entry.putting = True
    if entry.host_refs == 1:
        host.policy.hold(key)
        host.loading += 1


def release_put(host: Pool, key: bytes, entry: Entry, ok: bool) -> None:
    """The put of ``key`` finished: release its hold; with ``ok`` the store holds the key."""
    entry.putting = False
    entry.remote = entry.remote or ok
    entry.host_refs -= 1
    if entry.host_refs == 0:
        host.policy.release(key)
        host.loading -= 1


def eligible_for_put(entry: Entry | None) -> bool:
    """A ready host copy the store does not hold yet, with no put outstanding."""
    return entry is not None and entry.host_state is READY and not entry.remote and not entry.putting
