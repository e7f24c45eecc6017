"""The rank processes of the GPU shared pool tests (``test_shared_pool.py``): each is a spawned
process with its own KV tensors on the one GPU and its own Worker over one shared pool.

``serve(rank, barrier, commands, results, spawned_at)`` is the process's target: it runs the
scenarios the test sends, one at a time, reporting each on ``results`` (with how long each named
phase took: figures, never asserted). The rank processes live across the module's tests: spawning
two CUDA processes costs seconds each time.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing.queues
import multiprocessing.synchronize
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Final

import numpy as np
import pytest
import torch

from kvoffload import DeviceLayout, PathName, SharedPool, Worker
from tests.gpu._helpers import TIMEOUT_S, cache, no_fence
from tests.gpu.test_races import load_race, store_race

WORLD: Final = 2
#: Bounds one scenario in the test; a rank still running shortly before it dumps its stacks and exits.
SCENARIO_BOUND_S: Final = 150.0
#: ... the survivor scenario's bound: it takes about 9 s on an H100 host, so that a rank hung after
#: its peer was killed shows its stacks well inside any runner's limit (it once ran past 120 s there,
#: the runner's limit cutting it before the stacks).
SURVIVOR_BOUND_S: Final = 60.0
#: What a rank's stack dump comes before the scenario's bound.
DUMP_LEAD_S: Final = 15.0
#: How long a rank process waits for its next command before it exits (a test runner gone quiet).
IDLE_S: Final = 600.0
#: A rank's share of the host's CPUs for torch's intra-op threads (the CPUs divided by this). Each
#: process would otherwise start one thread per CPU: with two ranks on a 16-CPU H100 host, the race
#: trials' byte checks (small CPU tensor ops) took 264-273 ms a trial against 6 ms for one process
#: alone, while the jobs' submit and wait were unchanged; with a quarter of the CPUs each (4
#: threads) they took 17-20 ms (19 for one process alone) and the shared-pool races test 2.5 s
#: instead of 12 (``python -m tests.gpu.probe_shared_trial``, an H100, 2026-12-07; the host had no
#: CPU quota and no throttling, so the cause is the threads' contention itself, not measured
#: apart). On the 2-CPU CI host, without a GPU, two processes' checks on CPU tensors took up to
#: twice one process's time with torch's default threads (``--cpu``), not forty times.
CPU_SHARE: Final = 2 * WORLD
HOST_BLOCKS: Final = 128
PATHS: Final[tuple[PathName, ...]] = ("dma", "staged", "sm")
#: This process's phases and their seconds (see :func:`phase`).
_PHASES: dict[str, float] = {}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Adds the seconds the block takes to this process's phase ``name``."""
    began = time.monotonic()
    try:
        yield
    finally:
        _PHASES[name] = round(_PHASES.get(name, 0.0) + time.monotonic() - began, 2)


def _pool(name: str, rank: int) -> Any:
    return SharedPool(name, WORLD, attach_timeout_s=TIMEOUT_S).rank(rank)


def _traffic(w: Worker, rounds: int, seed: int, barrier: multiprocessing.synchronize.Barrier | None,
             started: Callable[[], None] | None = None) -> int:
    """Rounds of random store + load through the shared host blocks, every byte checked."""
    layout = w.layout
    rng = np.random.default_rng(seed)
    half = layout.num_blocks // 2
    if barrier is not None:
        barrier.wait(TIMEOUT_S)
    moved = 0
    for i in range(rounds):
        n = int(rng.integers(1, 33))
        src = torch.as_tensor(rng.choice(half, n, replace=False), device=layout.device)
        dst = torch.as_tensor(half + rng.choice(half, n, replace=False), device=layout.device)
        host = rng.choice(HOST_BLOCKS, n, replace=False)
        layout.scatter_records(src, torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8,
                                                  device=layout.device))
        expected = layout.gather_records(src)
        torch.cuda.synchronize(layout.device)
        w.store(2 * i, src.cpu(), host)
        assert w.wait([2 * i], TIMEOUT_S)[0].ok
        assert torch.equal(w.host_records()[torch.as_tensor(host)], expected.cpu()), f"round {i}: host"
        w.load(2 * i + 1, host, dst.cpu())
        assert w.wait([2 * i + 1], TIMEOUT_S)[0].ok
        assert torch.equal(layout.gather_records(dst), expected), f"round {i}: device"
        moved += 2 * n
        if i == 0 and started is not None:
            started()
    return moved


def both_at_once(name: str, rank: int, barrier: multiprocessing.synchronize.Barrier,
                 results: multiprocessing.queues.Queue[Any], rounds: int) -> dict[str, int]:
    """Every path: attach, then store and load at the same time as the other rank, bit-exact."""
    device = torch.device("cuda", 0)
    moved: dict[str, int] = {}
    for path in PATHS:
        with phase("create"):
            layout = cache("per-layer", device, num_blocks=128, layers=4, seed=10 * rank + 1)
            w = Worker.create(layout, HOST_BLOCKS, shared=_pool(f"{name}-{path}", rank), path=path)
        with w:
            with phase("traffic"):
                moved[path] = _traffic(w, rounds, seed=rank, barrier=barrier)
            with phase("shutdown"):
                w.shutdown()
    return moved


def _race_trials(pool: str, rank: int, layout: DeviceLayout, path: PathName, trials: int,
                 barrier: multiprocessing.synchronize.Barrier, name: str) -> tuple[int, int, int]:
    """(stale pages, pages seen, pages not loaded) over ``trials`` store races and as many load
    races through a worker of its own over shared pool ``pool``, started with the other rank's; the
    trials' seconds go to phase ``name``."""
    with phase("create"):
        w = Worker.create(layout, 64, shared=_pool(pool, rank), path=path)
    with w:
        with phase("barrier"):
            barrier.wait(TIMEOUT_S)
        with phase(name):
            stale = store_race(w, layout, trials, 0)
            seen, not_loaded = load_race(w, layout, trials, 1000)
        with phase("shutdown"):
            w.shutdown()
    return stale, seen, not_loaded


def races(name: str, rank: int, barrier: multiprocessing.synchronize.Barrier,
          results: multiprocessing.queues.Queue[Any], trials: int, control_trials: int) -> dict[str, int]:
    """The store and load race tests of ``test_races`` on this rank, over a shared pool, while the
    other rank runs them too: the controls (no compute wait) must race, the workers must not."""
    layout = cache("per-layer", torch.device("cuda", 0), num_blocks=128, layers=8, seed=rank)
    found: dict[str, int] = {}
    for path in PATHS:
        with pytest.MonkeyPatch.context() as patch:
            no_fence(patch)
            stale, seen, _ = _race_trials(f"{name}-{path}-control", rank, layout, path, control_trials,
                                          barrier, "controls")
        found[f"{path} control stale"], found[f"{path} control seen"] = stale, seen
        found[f"{path} stale"], found[f"{path} seen"], found[f"{path} not loaded"] = _race_trials(
            f"{name}-{path}", rank, layout, path, trials, barrier, "trials")
    return found


def survivor(name: str, rank: int, barrier: multiprocessing.synchronize.Barrier,
             results: multiprocessing.queues.Queue[Any], rounds: int) -> int:
    """Rank 0 moves data (its jobs in flight) while rank 1, doing the same, is killed by the test."""
    with phase("create"):
        layout = cache("per-layer", torch.device("cuda", 0), num_blocks=128, layers=4, seed=rank + 7)
        w = Worker.create(layout, HOST_BLOCKS, shared=_pool(name, rank), path="auto")
    with w, phase("traffic"):
        return _traffic(w, rounds if rank == 0 else 10**9, seed=rank, barrier=barrier,
                        started=lambda: results.put((rank, "started", None)))


SCENARIOS: Final[dict[str, Callable[..., Any]]] = {
    "both_at_once": both_at_once, "races": races, "survivor": survivor,
}


def take_cpu_share() -> None:
    """Limit this process's torch intra-op threads to its share of the CPUs (:data:`CPU_SHARE`)."""
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // CPU_SHARE))


def _next(commands: multiprocessing.queues.Queue[Any]) -> Any:
    """The next command, or ``None`` after :data:`IDLE_S` without one."""
    try:
        return commands.get(timeout=IDLE_S)
    except queue.Empty:
        return None


def serve(rank: int, barrier: multiprocessing.synchronize.Barrier,
          commands: multiprocessing.queues.Queue[Any], results: multiprocessing.queues.Queue[Any],
          spawned_at: float) -> None:
    """A rank process: runs each scenario the test sends on ``commands`` as ``(scenario, name,
    bound_s, kwargs)``, one at a time, until ``None`` (or :data:`IDLE_S` without a command). Each
    puts ``(rank, "phases", seconds)`` then ``(rank, "ok", value)``, or ``(rank, "error", text)``;
    a scenario still running :data:`DUMP_LEAD_S` before its ``bound_s`` dumps the threads' stacks
    and exits the process. ``spawned_at`` (``time.time()`` in the parent when it started the
    process) times phase ``spawn`` (start-up and imports), reported with the first scenario."""
    faulthandler.enable()
    _PHASES["spawn"] = round(time.time() - spawned_at, 2)
    take_cpu_share()
    with phase("cuda"):
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")
    while (command := _next(commands)) is not None:
        scenario, name, bound_s, kwargs = command
        faulthandler.dump_traceback_later(bound_s - DUMP_LEAD_S, exit=True)
        try:
            with phase("scenario"):
                value = SCENARIOS[scenario](name, rank, barrier, results, **kwargs)
            results.put((rank, "phases", dict(_PHASES)))
            results.put((rank, "ok", value))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
            _PHASES.clear()
