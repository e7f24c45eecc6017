"""The shipped eviction policies driven directly, as an engine may: every call outside the protocol's
guarantees gets a typed error and leaves the policy as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoffload import ARCPolicy, LRUPolicy
from kvoffload.errors import KeyStateError, KVOffloadError, UnknownKeyError

A, B, C, D = (bytes([i]) * 4 for i in range(1, 5))
Policy = LRUPolicy | ARCPolicy
FACTORIES: list[Callable[[int], Policy]] = [LRUPolicy, ARCPolicy]


def snapshot(policy: Policy) -> tuple[object, ...]:
    """What the policy would answer: its size, its victim order and (ARC) its adaptation state."""
    state: tuple[object, ...] = (len(policy), policy.victims(policy.capacity, ()))
    if isinstance(policy, ARCPolicy):
        state += (policy.target_t1, policy.ghost_sizes, policy.resident_sizes)
    return state


def populated(factory: Callable[[int], Policy]) -> Policy:
    """Capacity 3: A and B resident, B held, C admitted and evicted (a ghost for ARC)."""
    policy = factory(3)
    for key in (A, B, C):
        policy.admit(key)
    policy.evict(C)
    policy.hold(B)
    return policy


MISUSES: list[tuple[str, Callable[[Policy], None], type[KVOffloadError], str]] = [
    ("admit-resident", lambda p: p.admit(A), KeyStateError, "already resident"),
    ("admit-held", lambda p: p.admit(B), KeyStateError, "already resident"),
    ("hit-unknown", lambda p: p.hit(D), UnknownKeyError, "not resident"),
    ("hit-evicted", lambda p: p.hit(C), UnknownKeyError, "not resident"),
    ("hold-unknown", lambda p: p.hold(D), UnknownKeyError, "not resident"),
    ("hold-held", lambda p: p.hold(B), KeyStateError, "already held"),
    ("release-unknown", lambda p: p.release(D), UnknownKeyError, "not resident"),
    ("release-not-held", lambda p: p.release(A), KeyStateError, "not held"),
    ("evict-unknown", lambda p: p.evict(D), UnknownKeyError, "not resident"),
    ("evict-evicted", lambda p: p.evict(C), UnknownKeyError, "not resident"),
    ("evict-held", lambda p: p.evict(B), KeyStateError, "release it first"),
]


@pytest.mark.parametrize("factory", FACTORIES, ids=["lru", "arc"])
@pytest.mark.parametrize(("call", "error", "match"), [m[1:] for m in MISUSES], ids=[m[0] for m in MISUSES])
def test_a_call_outside_the_protocol_is_refused_and_changes_nothing(
    factory: Callable[[int], Policy],
    call: Callable[[Policy], None],
    error: type[KVOffloadError],
    match: str,
) -> None:
    policy = populated(factory)
    before = snapshot(policy)
    with pytest.raises(error, match=match):
        call(policy)
    assert snapshot(policy) == before
    policy.release(B)  # the policy still works: B is back in the order, then evictable
    assert B in policy.victims(3, ())
    policy.evict(B)


@pytest.mark.parametrize("factory", FACTORIES, ids=["lru", "arc"])
def test_a_held_key_may_be_hit_and_joins_the_order_at_release(factory: Callable[[int], Policy]) -> None:
    """Hitting a held key is inside the protocol (``prepare_load`` of a loading key): no error."""
    policy = factory(3)
    policy.admit(A)
    policy.admit(B)
    policy.hold(A)
    policy.hit(A)
    assert policy.victims(3, ()) == [B]
    policy.release(A)
    assert policy.victims(3, ())[-1] == A  # the most recently used comes last


def test_the_errors_are_the_manager_key_errors() -> None:
    """An engine catching the manager's key errors catches the policies' too."""
    assert issubclass(UnknownKeyError, KeyError)
    policy = LRUPolicy(1)
    with pytest.raises(KeyError):
        policy.evict(A)


@pytest.mark.parametrize(("name", "cls"), [("lru", LRUPolicy), ("arc", ARCPolicy)])
def test_a_manager_built_by_name_uses_the_shipped_policy_and_keeps_its_protocol(
    name: str, cls: type[Policy]
) -> None:
    """The Manager's own policy (built by name) skips ``admit``'s checks, as the Manager admits only
    keys that are not resident; it is still the shipped class, and its other calls still check."""
    from kvoffload import Manager

    m = Manager.create(2, fingerprint="f", num_disk_blocks=2, policy=name)
    assert isinstance(m.host_policy, cls) and isinstance(m.disk_policy, cls)
    plan = m.prepare_store([A, B])
    assert plan is not None
    m.complete_store(plan, True)
    assert sorted(m.host_policy.victims(2, ())) == [A, B]
    with pytest.raises(UnknownKeyError):
        m.host_policy.evict(C)
