"""A late disk load of the transformers binding, collected while the next prompt makes room for the
same prefix: its outcome reaches the Manager as it is, and the prompt's match looks again after
making room (found by a review: a late load that landed was completed as failed, which dropped its
good disk copies, and the next ``prepare_load`` of the keys the lookup had just counted raised
inside the engine's scheduler).

Drives the binding's session with a real Manager (a disk tier) and a fake engine cache and worker:
the engine's own scheduling is exercised by ``test_transformers_integration``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import pytest

import kvoffload
from kvoffload.integrations._transformers_session import _Counters, _key, _Session


class _Owner:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._counts = _Counters()
        self.load_timeout = 1.0
        self._graphs_seen = False
        self._compute_stream = None


class _Cache:
    """The engine's cache as the session sees it: a block per hash, a free list, references."""

    tokens_per_block = 4

    def __init__(self, free: int) -> None:
        self.free = list(range(100, 100 + free))
        self.ledger: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.cached: list[int] = []

    def block_hashes(self, prompt: Sequence[int]) -> list[int]:
        return list(prompt)  # the prompts here list their blocks' hashes

    def resident_prefix(self, hashes: Sequence[int]) -> list[int]:
        out = []
        for h in hashes:
            if h not in self.ledger.values():
                break
            out.append(h)
        return out

    def available_blocks(self) -> int:
        return len(self.free)

    def evict_cached(self, count: int, keep: Iterable[int] = ()) -> int:
        kept = set(keep)
        victims = [b for b in self.cached if self.ledger.get(b) not in kept][:count]
        for b in victims:
            self.cached.remove(b)
            del self.ledger[b]
        self.free += victims
        return len(victims)

    def take_blocks(self, count: int) -> list[int]:
        out, self.free = self.free[:count], self.free[count:]
        return out

    def return_blocks(self, blocks: Iterable[int]) -> None:
        self.free += list(blocks)

    def register_held(self, blocks: Sequence[int], hashes: Sequence[int]) -> int:
        for b, h in zip(blocks, hashes):
            self.ledger[b] = h
        return len(blocks)

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0 and block in self.ledger:
            self.cached.append(block)

    def hold(self, block: int) -> None:
        self.refs[block] = self.refs.get(block, 0) + 1

    def hash_of(self, block: int) -> int | None:
        return self.ledger.get(block)

    def forget(self, block: int) -> None:
        self.ledger.pop(block, None)

    def stop_intercepting(self) -> None:
        pass


@attrs.frozen
class _Result:
    job_id: int
    ok: bool = True
    error: object = None


class _Worker:
    """The first disk load is late (its wait times out) and finishes, with ``late_ok``, after."""

    def __init__(self, late_ok: bool) -> None:
        self.late_ok = late_ok
        self.late: int | None = None
        self.done: list[int] = []

    def load_from_disk(self, job: int, src: Any, dst: Any, *, stream: object = None, keys: object = None) -> None:
        if self.late is None:
            self.late = job
        else:
            self.done.append(job)

    def load(self, job: int, src: Any, dst: Any, *, stream: object = None) -> None:
        self.done.append(job)

    def store(self, job: int, dev: Any, host: Any, *, stream: object = None) -> None:
        pass  # in flight until a wait returns it

    def wait(self, jobs: Sequence[int], timeout: float) -> list[_Result]:
        late = self.late
        if late is not None and late in jobs and late not in self.done:
            self.done.append(late)  # it finishes after this wait gave up
            raise kvoffload.WaitTimeoutError("late (the test's)", pending=[late])
        return [_Result(j, ok=self.late_ok or j != self.late) for j in jobs]

    def poll(self) -> list[_Result]:
        return []

    def shutdown(self, timeout: float = 0) -> None:
        pass


@pytest.mark.parametrize("late_ok", [True, False], ids=["landed", "failed"])
def test_a_late_disk_load_collected_while_making_room_for_the_same_prefix(late_ok: bool) -> None:
    manager = kvoffload.Manager.create(4, fingerprint=b"fp", num_disk_blocks=8)
    record = attrs.make_class("Record", ["block", "generation", "key"])
    h1, h2 = 11, 12
    manager.adopt_disk([record(0, 1, manager.namespaced(_key(h1))), record(1, 2, manager.namespaced(_key(h2)))])
    cache = _Cache(free=5)
    session = _Session(_Owner(), cache, manager, _Worker(late_ok), layer_of=None)  # type: ignore[arg-type]
    for block, h in ((100, 51), (101, 52)):  # two blocks a running request completed: stored next
        cache.free.remove(block)
        cache.ledger[block] = h
        cache.refs[block] = 1
        session.on_new_hash(block, h)
    session.before_schedule()  # their store is submitted, holding them
    for block in (100, 101):
        cache.release(block)  # the request finished: only the store holds them
    session.before_prefix_match([h1, h2, 99])  # its disk load is late: recomputed, blocks kept out
    assert manager.lookup([_key(h1), _key(h2)]) == 2
    session.before_prefix_match([h1, h2, 98])  # the cache is short: making room collects the load
    stats = manager.stats()
    assert stats.disk_copies_dropped == (0 if late_ok else 2)
    assert manager.lookup([_key(h1), _key(h2)]) == (2 if late_ok else 0)
