"""The vLLM adapter's LRU: chunks ranked by request and token position, as vLLM's own LRU ranks them.

Owns one host tier's ranks (no OS or GPU resource). A chunk's rank is a pair compared in order,
the lowest evicted first:

* a chunk a running request offers or loads takes ``(request rank, -position)``: every chunk of
  the request shares the request's rank, drawn when the request first touches the cache, and
  within it the tail goes before the head, whichever step stored them (a prefix without its head
  is never hit again);
* ``refresh`` (vLLM's ``touch``, and a request's end from its tail to its head) gives each chunk
  a fresh rank above every rank given before;
* a chunk admitted with no rank waiting for it takes a fresh one.

A rank only rises while a request runs. The Manager calls the :class:`EvictionPolicy` methods
(``hit`` changes nothing here: ranks come from the adapter, which knows the request and the
positions); the adapter calls :meth:`RequestRankedLRU.access` and :meth:`RequestRankedLRU.refresh`.
Evictable chunks sit in a min-heap whose stale entries are skipped (and rebuilt away when they
outnumber the live ones), so every call is O(log n) amortised a chunk.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Container, Iterable, Sequence

__all__ = ["RequestRankedLRU"]

Rank = tuple[int, int]


class RequestRankedLRU:
    """An :class:`~kvoffload.EvictionPolicy` for the vLLM adapter's host tier (see the module
    docstring). Not thread-safe: the Manager's lock, or vLLM's scheduler thread, serialises it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ranks: dict[bytes, Rank] = {}  # resident key -> rank
        self._waiting: dict[bytes, Rank] = {}  # key not yet admitted -> the rank it will take
        self._evictable: set[bytes] = set()
        self._heap: list[tuple[Rank, bytes]] = []
        self._counter = itertools.count(1)
        #: Bumped by ``clear``: a request rank drawn before it is not used after it.
        self.generation = 0

    # ------------------------------------------------------------------ the adapter's calls

    def request_rank(self) -> int:
        """A new request's rank, above every rank given so far."""
        return next(self._counter)

    def access(self, ranked: Sequence[tuple[bytes, int]], request_rank: int) -> None:
        """A running request of rank ``request_rank`` offered or loaded these ``(key, position)``
        chunks: each resident one rises to ``(request_rank, -position)`` if that is higher (others
        are ignored)."""
        for key, position in ranked:
            rank = (request_rank, -position)
            current = self._ranks.get(key)
            if current is not None and current < rank:
                self._set(key, rank)

    def expect(self, ranked: Sequence[tuple[bytes, int]], request_rank: int) -> None:
        """A store of a request of rank ``request_rank`` will admit these ``(key, position)``
        chunks: each takes ``(request_rank, -position)`` when admitted (until then, or until
        :meth:`forget`, the rank waits)."""
        for key, position in ranked:
            self._waiting[key] = (request_rank, -position)

    def forget(self, keys: Iterable[bytes]) -> None:
        """The waiting ranks of ``keys`` (a store that failed: they are not admitted)."""
        for key in keys:
            self._waiting.pop(key, None)

    @property
    def waiting(self) -> int:
        """Ranks waiting for a store to admit their key."""
        return len(self._waiting)

    def refresh(self, keys: Iterable[bytes]) -> None:
        """Each resident key in turn takes a fresh rank (the last one the highest), and so does
        the waiting rank of a key whose store is pending (vLLM's own LRU holds a chunk from its
        store's start); others are ignored."""
        for key in keys:
            if key in self._ranks:
                self._set(key, (next(self._counter), 0))
            elif key in self._waiting:
                self._waiting[key] = (next(self._counter), 0)

    def rank_of(self, key: bytes) -> Rank | None:
        """The resident ``key``'s rank (None when it is not resident)."""
        return self._ranks.get(key)

    # ------------------------------------------------------------------ EvictionPolicy

    def admit(self, key: bytes) -> None:
        """``key`` became ready: the rank waiting for it, else a fresh one; evictable."""
        rank = self._waiting.pop(key, None)
        self._ranks[key] = rank if rank is not None else (next(self._counter), 0)
        self._evictable.add(key)
        heapq.heappush(self._heap, (self._ranks[key], key))
        self._compact()

    def hit(self, key: bytes) -> None:
        """Nothing: the adapter ranks a used chunk (``access``, ``refresh``)."""

    def hold(self, key: bytes) -> None:
        """``key`` is being loaded: not a victim until ``release``."""
        self._evictable.discard(key)
        self._compact()

    def release(self, key: bytes) -> None:
        """``key``'s last load completed: evictable again, at its rank."""
        self._evictable.add(key)
        heapq.heappush(self._heap, (self._ranks[key], key))
        self._compact()

    def victims(self, count: int, exclude: Container[bytes]) -> list[bytes]:
        """Up to ``count`` evictable keys not in ``exclude``, lowest rank first (the policy is left
        as it was: the live entries looked at go back to the heap; stale ones, of a key re-ranked,
        held or evicted since, and second entries of a key, are dropped, so that no later call
        walks them again)."""
        found: list[bytes] = []
        live: list[tuple[Rank, bytes]] = []
        seen: set[bytes] = set()
        while self._heap and len(found) < count:
            entry = heapq.heappop(self._heap)
            rank, key = entry
            if key in seen or key not in self._evictable or self._ranks.get(key) != rank:
                continue
            seen.add(key)
            live.append(entry)
            if key not in exclude:
                found.append(key)
        for entry in live:
            heapq.heappush(self._heap, entry)
        return found

    def evict(self, key: bytes) -> None:
        """``key`` left the tier (its heap entries go stale)."""
        del self._ranks[key]
        self._evictable.discard(key)
        self._compact()

    def clear(self) -> None:
        """Forget every key and every waiting rank (``reset``)."""
        self._ranks.clear()
        self._waiting.clear()
        self._evictable.clear()
        self._heap.clear()
        self.generation += 1

    # ------------------------------------------------------------------ inside

    def _set(self, key: bytes, rank: Rank) -> None:
        self._ranks[key] = rank
        if key in self._evictable:
            heapq.heappush(self._heap, (rank, key))
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the live entries once stale ones outnumber them."""
        if len(self._heap) > 2 * len(self._evictable) + 64:
            self._heap = [(self._ranks[key], key) for key in self._evictable]
            heapq.heapify(self._heap)
