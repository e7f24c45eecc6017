"""A host pool shared by tensor-parallel ranks, with real processes (docs/design.md §13): each rank
is a spawned process with its own Worker on the host backend (``_pool_ranks``). Four ranks attach
and each reads back its own data; they use the memory of one pool, measured from /proc; a missing
rank fails the others within the deadline; a rank that dies during the attach fails it at once; a
rank killed with SIGKILL in the middle of traffic leaves the others working; a stale file of a
killed creator is replaced; two live engines under one name collide. Nothing is left in /dev/shm."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvoffload import SharedPool
from kvoffload.region import SHM_DIR
from tests.unit._pool_ranks import HOST_BLOCKS, RankError, RankProcesses, layout_of, records_of

#: Deadline of the attaches that must succeed, and of those that must time out.
ATTACH_S = 60.0
SHORT_S = 1.5
RECORD = layout_of(0).record_bytes
POOL_BYTES = HOST_BLOCKS * 4 * RECORD


@pytest.fixture(scope="module")
def procs() -> Iterator[RankProcesses]:
    ranks = RankProcesses(4)
    try:
        yield ranks
    finally:
        ranks.close()


@pytest.fixture
def name(procs: RankProcesses) -> Iterator[str]:
    """A fresh pool name; afterwards every rank process releases its workers, and the test fails if
    anything is left under the name in /dev/shm."""
    pool_name = f"kvoffload-test-{uuid.uuid4().hex}"
    yield pool_name
    for i in range(4):
        procs[i].call("release_all")
    path = os.path.join(SHM_DIR, pool_name)
    if os.path.exists(path):
        os.unlink(path)
        pytest.fail(f"{path} was left behind")


def attach(procs: RankProcesses, name: str, ranks: list[int], world: int, timeout: float,
           **kwargs: object) -> dict[int, object]:
    """Rank ``r`` attaches in process ``r``, all at once; what each answered (or its RankError)."""
    for r in ranks:
        procs[r].send("attach", name=name, world=world, rank=r, timeout=timeout, **kwargs)
    out: dict[int, object] = {}
    for r in ranks:
        try:
            out[r] = procs[r].answer()
        except RankError as exc:
            out[r] = exc
    return out


def wait_for_file(path: str) -> None:
    deadline = time.monotonic() + ATTACH_S
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def pool_mapping(pid: int, name: str) -> dict[str, int]:
    """Size, Rss and Pss in bytes of process ``pid``'s mapping of the pool ``name`` (/proc/pid/smaps)."""
    target = os.path.join(SHM_DIR, name)
    found: dict[str, int] = {}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: address range ... path
                inside = " ".join(fields[5:]) in (target, target + " (deleted)")
            elif inside and fields[0] in ("Size:", "Rss:", "Pss:"):
                found[fields[0][:-1]] = found.get(fields[0][:-1], 0) + int(fields[1]) * 1024
    return found


def test_four_rank_processes_attach_and_each_reads_back_its_own_slices(procs: RankProcesses, name: str) -> None:
    answers = attach(procs, name, [0, 1, 2, 3], 4, ATTACH_S)
    assert all(isinstance(a, dict) for a in answers.values()), answers
    assert not os.path.exists(os.path.join(SHM_DIR, name))  # unlinked once all mapped it
    blocks = [0, 7, 8, 9, 63]
    for r in range(4):
        procs[r].send("write", name=name, host_blocks=blocks)  # the same host blocks on every rank
    for r in range(4):
        procs[r].answer()
    with SharedPool.inspect(name, pid=procs[0].pid) as view:
        info = view.info
        assert (info.world_size, info.num_records, info.record_bytes) == (4, HOST_BLOCKS, RECORD)
        assert sorted(i.pid for i in info.ranks) == sorted(procs[r].pid for r in range(4))
        data = view.blocks()
        for r in range(4):  # block b holds every rank's own slice, side by side
            assert np.array_equal(data[blocks, r], records_of(r, blocks, RECORD).numpy())
        del data
    for r in range(4):
        assert procs[r].call("read", name=name, host_blocks=blocks) is True


def test_four_ranks_use_the_memory_of_one_pool(procs: RankProcesses, name: str) -> None:
    answers = attach(procs, name, [0, 1, 2, 3], 4, ATTACH_S)
    assert all(isinstance(a, dict) for a in answers.values()), answers
    for r in range(4):
        procs[r].call("write", name=name, host_blocks=list(range(HOST_BLOCKS)))  # every block
    maps = [pool_mapping(procs[r].pid, name) for r in range(4)]
    # every rank maps the whole pool ...
    assert all(m["Size"] >= POOL_BYTES for m in maps), maps
    # ... and the memory they hold together, each page counted once over the processes that map it
    # (proportional set size), is one pool: four pools of their own would be four times this
    total_pss = sum(m["Pss"] for m in maps)
    assert POOL_BYTES * 0.9 <= total_pss <= POOL_BYTES * 1.1, (total_pss, POOL_BYTES, maps)
    # and the pool's file holds one pool's pages (four separate pools would be four times this)
    fd_dir = f"/proc/{procs[0].pid}/fd"
    held = [os.path.join(fd_dir, e) for e in os.listdir(fd_dir)
            if os.readlink(os.path.join(fd_dir, e)).startswith(os.path.join(SHM_DIR, name))]
    assert held
    allocated = os.stat(held[0]).st_blocks * 512
    assert POOL_BYTES <= allocated <= POOL_BYTES + (1 << 20), allocated


def test_a_missing_rank_fails_every_other_rank_within_the_deadline(procs: RankProcesses, name: str) -> None:
    began = time.monotonic()
    answers = attach(procs, name, [0, 1, 2], 4, SHORT_S)
    elapsed = time.monotonic() - began
    for r in range(3):
        error = answers[r]
        assert isinstance(error, RankError) and error.kind == "PoolTimeoutError", error
        assert error.ranks == (3,) and "rank(s) 3 of 4 did not arrive" in str(error)
    assert elapsed < ATTACH_S  # they gave up at their deadline, not at the harness's
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_rank_killed_during_the_attach_fails_the_others_at_once(procs: RankProcesses, name: str) -> None:
    for r in (0, 1):
        procs[r].send("attach", name=name, world=3, rank=r, timeout=ATTACH_S)
    path = os.path.join(SHM_DIR, name)
    wait_for_file(path)
    deadline = time.monotonic() + ATTACH_S
    while True:  # both registered, both waiting for rank 2
        with SharedPool.inspect(name) as view:
            if [i.arrived for i in view.info.ranks] == [True, True, False]:
                break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    procs[1].kill()
    with pytest.raises(RankError, match=r"PoolRankFailedError: .*rank\(s\) 1 .* died") as caught:
        procs[0].answer(ATTACH_S / 2)  # long before its deadline
    assert caught.value.ranks == (1,)
    assert not os.path.exists(path)


def test_kill_9_of_a_rank_during_traffic_leaves_the_other_ranks_working(procs: RankProcesses, name: str) -> None:
    answers = attach(procs, name, [0, 1, 2, 3], 4, ATTACH_S)
    assert all(isinstance(a, dict) for a in answers.values()), answers
    victim = procs[3]
    victim.send("traffic", name=name, rounds=100_000, seed=3)
    assert victim.answer() == "started"
    for r in range(3):
        procs[r].send("traffic", name=name, rounds=30, seed=r)
    for r in range(3):
        assert procs[r].answer() == "started"
    victim.kill()  # in the middle of its traffic, while the others' jobs are in flight
    assert [procs[r].answer() for r in range(3)] == [60, 60, 60]
    for r in range(3):
        procs[r].call("release", name=name)
        assert pool_mapping(procs[r].pid, name) == {}  # its mapping is gone
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert not any(pool_mapping(pid, name) for pid in procs.pids())


@pytest.mark.parametrize("launches", [(None, None), ("earlier", "later"), ("job-7", "job-7")],
                         ids=["no launch", "launches named", "a restart reusing its launch"])
def test_a_stale_file_of_a_killed_creator_is_replaced(procs: RankProcesses, name: str,
                                                      launches: tuple[str | None, str | None]) -> None:
    creator = procs[0]
    creator.send("attach", name=name, world=2, rank=0, timeout=ATTACH_S, launch=launches[0])
    path = os.path.join(SHM_DIR, name)
    wait_for_file(path)
    creator.kill()  # the file stays: its only rank died while waiting for the other
    assert os.path.exists(path)
    answers = attach(procs, name, [0, 1], 2, ATTACH_S, launch=launches[1])  # a new engine under the same name
    assert all(isinstance(a, dict) for a in answers.values()), answers
    assert not os.path.exists(path)
    for r in range(2):
        procs[r].call("write", name=name, host_blocks=[3])
        assert procs[r].call("read", name=name, host_blocks=[3]) is True


def test_two_live_engines_with_one_name_collide(procs: RankProcesses, name: str) -> None:
    procs[0].send("attach", name=name, world=2, rank=0, timeout=2.5, generation=1)
    wait_for_file(os.path.join(SHM_DIR, name))
    other = attach(procs, name, [1], 2, ATTACH_S, generation=2)[1]  # another engine's rank 1
    assert isinstance(other, RankError) and other.kind == "PoolCollisionError", other
    assert other.ranks == (0,) and str(procs[0].pid) in str(other)
    twin = procs[2]  # the same engine's rank 0 started twice
    twin.send("attach", name=name, world=2, rank=0, timeout=ATTACH_S, generation=1)
    with pytest.raises(RankError, match="PoolCollisionError: rank 0 of shared pool .* already held"):
        twin.answer()
    with pytest.raises(RankError, match="PoolTimeoutError") as first:  # nobody else came
        procs[0].answer()
    assert first.value.ranks == (1,)


@pytest.mark.parametrize("launches", [("a", "b"), ("a", None), (None, None)],
                         ids=["two launches", "one names none", "control: no launch"])
def test_two_engines_started_at_once_under_one_name_do_not_take_each_others_ranks(
        procs: RankProcesses, name: str, launches: tuple[str | None, str | None]) -> None:
    """(An audit started engine A's rank 0 and engine B's rank 1 under one name, generation and
    world size: B's rank joined A's pool, no error. Named launches tell them apart; the control,
    with none, shows the mixed pool.)"""
    a, b = launches
    procs[0].send("attach", name=name, world=2, rank=0, timeout=ATTACH_S, launch=a)  # A0
    wait_for_file(os.path.join(SHM_DIR, name))
    b1 = attach(procs, name, [1], 2, ATTACH_S, launch=b)[1]
    if a is None and b is None:  # the hazard: B1 took A's rank 1
        assert isinstance(b1, dict), b1
        assert isinstance(procs[0].answer(), dict)
        return
    assert isinstance(b1, RankError) and b1.kind == "PoolCollisionError", b1
    assert "held by another launch of an engine" in str(b1) and b1.ranks == (0,) and str(procs[0].pid) in str(b1)
    a1 = attach(procs, name, [1], 2, ATTACH_S, launch=a)[1]  # A's own rank 1 (in a fresh process)
    assert isinstance(a1, dict) and isinstance(procs[0].answer(), dict), a1
    for r in range(2):
        procs[r].call("write", name=name, host_blocks=[5])
        assert procs[r].call("read", name=name, host_blocks=[5]) is True
