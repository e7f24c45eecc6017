"""One host pool shared by two rank processes on the one GPU (docs/design.md §13): each process has
its own KV tensors and its own Worker over the shared pool. Both store and load at once on every
path, bit-exact; the store and load race tests of ``test_races`` pass on each rank while the other
runs them too (their controls still race); a rank killed while the other's jobs are in flight leaves
the other unaffected. Nothing is left in /dev/shm."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.region import SHM_DIR
from tests.gpu._helpers import TIMEOUT_S
from tests.gpu._shared_ranks import PATHS, SCENARIO_BOUND_S, SURVIVOR_BOUND_S, WORLD, run_rank
from tests.gpu.conftest import Figures

#: Bounds the whole of one scenario (spawning, CUDA start-up, attaching, the work); a rank process
#: dumps its threads' stacks and exits a little before it (see ``run_rank``).
SCENARIO_S = SCENARIO_BOUND_S
#: The workers' trials per path and rank. The controls run ``CONTROL_TRIALS`` (10) each and found
#: 4608-5120 of their 5120 pages bad per path and rank (an H100, 2026-12-07, both doors racing:
#: ``no_fence``), so each worker runs more trials than its control needed to show the hazard (at
#: 40 this test took 55 s on a slow host; at 16, 27 s on two others).
TRIALS = 16
#: Rounds of store + load per path and rank at once (each a random 1-32 blocks, every byte checked).
ROUNDS_AT_ONCE = 100


@pytest.fixture
def name() -> Iterator[str]:
    prefix = f"kvoffload-gpu-shared-{uuid.uuid4().hex}"
    yield prefix
    left = [f for f in os.listdir(SHM_DIR) if f.startswith(prefix)]
    for f in left:
        os.unlink(os.path.join(SHM_DIR, f))
    assert not left, f"left in {SHM_DIR}: {left}"


def start(scenario: str, name: str, bound_s: float = SCENARIO_S, **kwargs: Any) -> tuple[list[Any], Any, Any]:
    """Both rank processes of ``scenario``, bounded by ``bound_s`` (see ``run_rank``); returns them,
    the results queue and the barrier (the caller keeps it alive: ``Process.start`` drops its
    arguments, and a barrier collected in this process unlinks its semaphore before a
    slow-starting rank has opened it)."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WORLD)
    results = context.Queue()
    procs = [context.Process(target=run_rank, args=(scenario, name, r, barrier, results),
                             kwargs={"bound_s": bound_s, **kwargs}, daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    return procs, results, barrier


def collect(procs: list[Any], results: Any, ranks: list[int], bound_s: float = SCENARIO_S) -> dict[int, Any]:
    """The values the given ranks returned (a rank's error, a rank that exits without a result and a
    scenario past ``bound_s`` fail the test at once); then reap everyone."""
    out: dict[int, Any] = {}
    deadline = time.monotonic() + bound_s
    try:
        while len(out) < len(ranks):
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                gone = {r: procs[r].exitcode for r in ranks if r not in out and procs[r].exitcode is not None}
                if gone:  # a result put just before the exit may still be in the pipe
                    try:
                        rank, status, value = results.get(timeout=5.0)
                    except queue.Empty:
                        raise AssertionError(f"rank(s) exited without a result (exit codes {gone})") from None
                else:
                    assert time.monotonic() < deadline, f"the scenario did not finish within {bound_s} s"
                    continue
            if status == "started":
                continue
            assert status == "ok", f"rank {rank} failed:\n{value}"
            out[rank] = value
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT_S)
    return out


def test_two_ranks_store_and_load_at_once_bit_exact_on_every_path(name: str, figures: Figures) -> None:
    procs, results, _barrier = start("both_at_once", name, rounds=ROUNDS_AT_ONCE)
    moved = collect(procs, results, [0, 1])
    for rank in range(WORLD):
        for path in PATHS:
            assert moved[rank][path] > 0
    figures.add("shared pool, 2 ranks at once: blocks moved per rank and path", f"{moved}")


def test_race_tests_pass_per_rank_over_a_shared_pool(name: str, figures: Figures) -> None:
    procs, results, _barrier = start("races", name, trials=TRIALS)
    found = collect(procs, results, [0, 1])
    for rank in range(WORLD):
        figures.add(f"shared pool races, rank {rank}", f"{found[rank]}")
        for path in PATHS:
            counts = found[rank]
            assert counts[f"{path} control stale"] > 0 and counts[f"{path} control seen"] > 0, (
                "a control did not race: the test cannot prove the rules")
            assert counts[f"{path} stale"] == counts[f"{path} seen"] == counts[f"{path} not loaded"] == 0


def test_a_killed_rank_leaves_the_other_ranks_jobs_unaffected(name: str) -> None:
    procs, results, _barrier = start("survivor", name, SURVIVOR_BOUND_S, rounds=300)
    started: set[int] = set()
    while started != {0, 1}:
        rank, status, value = results.get(timeout=SURVIVOR_BOUND_S)
        assert status == "started", f"rank {rank}: {status}\n{value}"
        started.add(rank)
    victim = procs[1]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)  # in the middle of its traffic, rank 0's jobs in flight
    victim.join(TIMEOUT_S)
    moved = collect(procs, results, [0], SURVIVOR_BOUND_S)
    assert moved[0] > 0
