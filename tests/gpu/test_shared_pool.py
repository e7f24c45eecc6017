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
from tests.gpu._shared_ranks import PATHS, SCENARIO_BOUND_S, SURVIVOR_BOUND_S, WORLD, serve
from tests.gpu.conftest import Figures

#: Bounds the whole of one scenario (spawning and CUDA start-up when the ranks start, attaching, the
#: work); a rank process dumps its threads' stacks and exits a little before it (see ``serve``).
SCENARIO_S = SCENARIO_BOUND_S
#: The controls' trials per path and rank, as ``test_races.CONTROL_TRIALS``: they found 4096-5120
#: of their 5120 pages bad (80-100%) per path and rank with both doors racing (``no_fence``); at 4,
#: 1536-2048 of 2048 (H100 hosts, 2026-12-07).
CONTROL_TRIALS = 10
#: The workers' trials per path and rank: more than a control needed to show the hazard, eight
#: through each door. Before the ranks took a share of the CPUs (``_shared_ranks.CPU_SHARE``) a
#: trial took about 160 ms against 12-15 ms in ``test_races``, and this test 25.6 s of a 215 s suite
#: at 10 controls and 16 trials; with the share, 2.5 s at 4 and 10 and 4.1 s at 10 and 16 (H100
#: hosts, 2026-12-07: trials 2.3 s, controls 1.4 s per rank; the controls found 5120 of 5120 bad).
TRIALS = 16
#: Rounds of store + load per path and rank at once (each a random 1-32 blocks, every byte
#: checked): before the CPU share 100 took 7.6 s of traffic per rank; with it 2.0-2.2 s.
ROUNDS_AT_ONCE = 100


@pytest.fixture
def name() -> Iterator[str]:
    prefix = f"kvoffload-gpu-shared-{uuid.uuid4().hex}"
    yield prefix
    left = [f for f in os.listdir(SHM_DIR) if f.startswith(prefix)]
    for f in left:
        os.unlink(os.path.join(SHM_DIR, f))
    assert not left, f"left in {SHM_DIR}: {left}"


class Ranks:
    """The two rank processes (``_shared_ranks.serve``), started once for the module's tests and
    sent one scenario at a time: spawning two CUDA processes costs seconds each time. Started
    again when one is gone (the survivor test kills one) or after a scenario that failed (its
    processes' state unknown). :meth:`stop` is the one release path; the module fixture calls it."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.commands: list[Any] = []
        self.results: Any = None
        # kept here while the ranks live: a barrier collected in this process unlinks its
        # semaphore before a slow-starting rank has opened it
        self.barrier: Any = None

    def start(self, scenario: str, name: str, bound_s: float = SCENARIO_S, **kwargs: Any) -> None:
        """Send ``scenario`` to both ranks (spawning them first if needed), bounded by ``bound_s``
        (see ``serve``); :meth:`collect` gets the results."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.stop()
            context = multiprocessing.get_context("spawn")
            self.barrier = context.Barrier(WORLD)
            self.results = context.Queue()
            self.commands = [context.Queue() for _ in range(WORLD)]
            self.procs = [context.Process(target=serve, daemon=True,
                                          args=(r, self.barrier, self.commands[r], self.results, time.time()))
                          for r in range(WORLD)]
            for p in self.procs:
                p.start()
        for commands in self.commands:
            commands.put((scenario, name, bound_s, kwargs))

    def collect(self, ranks: list[int], bound_s: float = SCENARIO_S,
                figures: tuple[Figures, str] | None = None) -> dict[int, Any]:
        """The values the given ranks returned (a rank's error, a rank that exits without a
        result and a scenario past ``bound_s`` fail the test at once, and stop the processes).
        ``figures``: where to report each rank's phase times, and the scenario's label there."""
        out: dict[int, Any] = {}
        deadline = time.monotonic() + bound_s
        try:
            while len(out) < len(ranks):
                try:
                    rank, status, value = self.results.get(timeout=1.0)
                except queue.Empty:
                    gone = {r: self.procs[r].exitcode for r in ranks
                            if r not in out and self.procs[r].exitcode is not None}
                    if gone:  # a result put just before the exit may still be in the pipe
                        try:
                            rank, status, value = self.results.get(timeout=5.0)
                        except queue.Empty:
                            raise AssertionError(f"rank(s) exited without a result (exit codes {gone})") from None
                    else:
                        assert time.monotonic() < deadline, f"the scenario did not finish within {bound_s} s"
                        continue
                if status == "started":
                    continue
                if status == "phases":
                    if figures is not None:
                        figures[0].add(f"shared pool {figures[1]}, rank {rank}: seconds per phase", f"{value}")
                    continue
                assert status == "ok", f"rank {rank} failed:\n{value}"
                out[rank] = value
        except BaseException:
            self.stop()
            raise
        return out

    def stop(self) -> None:
        """Tell every live rank to exit, reap them all (killing one that does not exit), and close
        the queues."""
        for commands, p in zip(self.commands, self.procs):
            if p.is_alive():
                commands.put(None)
        for p in self.procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT_S)
        for q in self.commands:
            q.close()
            q.join_thread()
        if self.results is not None:
            self.results.close()
        self.procs, self.commands, self.results, self.barrier = [], [], None, None


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    pair = Ranks()
    try:
        yield pair
    finally:
        pair.stop()


def test_two_ranks_store_and_load_at_once_bit_exact_on_every_path(ranks: Ranks, name: str,
                                                                   figures: Figures) -> None:
    ranks.start("both_at_once", name, rounds=ROUNDS_AT_ONCE)
    moved = ranks.collect([0, 1], figures=(figures, "at once"))
    for rank in range(WORLD):
        for path in PATHS:
            assert moved[rank][path] > 0
    figures.add("shared pool, 2 ranks at once: blocks moved per rank and path", f"{moved}")


def test_race_tests_pass_per_rank_over_a_shared_pool(ranks: Ranks, name: str, figures: Figures) -> None:
    ranks.start("races", name, trials=TRIALS, control_trials=CONTROL_TRIALS)
    found = ranks.collect([0, 1], figures=(figures, "races"))
    for rank in range(WORLD):
        figures.add(f"shared pool races, rank {rank}", f"{found[rank]}")
        for path in PATHS:
            counts = found[rank]
            assert counts[f"{path} control stale"] > 0 and counts[f"{path} control seen"] > 0, (
                "a control did not race: the test cannot prove the rules")
            assert counts[f"{path} stale"] == counts[f"{path} seen"] == counts[f"{path} not loaded"] == 0


def test_a_killed_rank_leaves_the_other_ranks_jobs_unaffected(ranks: Ranks, name: str, figures: Figures) -> None:
    ranks.start("survivor", name, SURVIVOR_BOUND_S, rounds=300)
    try:
        started: set[int] = set()
        while started != {0, 1}:
            rank, status, value = ranks.results.get(timeout=SURVIVOR_BOUND_S)
            assert status == "started", f"rank {rank}: {status}\n{value}"
            started.add(rank)
        victim = ranks.procs[1]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)  # in the middle of its traffic, rank 0's jobs in flight
        victim.join(TIMEOUT_S)
        moved = ranks.collect([0], SURVIVOR_BOUND_S, figures=(figures, "survivor"))
    finally:
        ranks.stop()  # the pair is broken: a later test starts another
    assert moved[0] > 0
