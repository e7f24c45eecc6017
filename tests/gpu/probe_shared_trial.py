"""Where a store-race trial's time goes when two rank processes share the one GPU:
``python -m tests.gpu.probe_shared_trial``.

Not a test (nothing is asserted but the trials' own correctness; pytest does not collect it): a
measurement for the GPU suite's shared-pool tests (``test_shared_pool.py``), whose trials took
about 160 ms each against 12-15 ms in ``test_races``. Each configuration runs 20 trials of
``test_races.store_race``'s steps per process on the ``dma`` path, timing each step (the median in
ms): fill the blocks and synchronise, queue the stall and the writes, submit the store, wait for
it, check the host records' bytes. Configurations: one process alone, two at once with private
pools, two at once over one shared pool, each with torch's default intra-op threads and with
a share of the CPUs per process (``_shared_ranks.take_cpu_share``). Each configuration's line also
gives the host's CPU quota and how often and how long the scheduler throttled the probe's control
group meanwhile (cgroup v2 or v1 files; "no quota" and 0 where there are none): two
processes of one torch thread per CPU may spend a quota faster than it refills, which would stop
every thread of both until the next period.

``--cpu`` runs only the byte checks, on CPU tensors of the same layout with no GPU, for a host
without one: one process, then two at once, with torch's default threads and with the share.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
import statistics
import sys
import time
import uuid
from typing import Any

import torch

#: The steps of a trial, in order.
STEPS = ("fill+sync", "queue", "store", "wait", "check", "trial")
TRIALS = 20
WARMUP_TRIALS = 3


def _cgroup_cpu_files() -> tuple[str, str, str] | None:
    """The CPU controller's quota, period and stat files of this process's control group (v2's
    ``cpu.max`` names both quota and period), or None where there are none."""
    with open("/proc/self/cgroup") as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in entries:
        if controllers == "":  # v2
            base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            if os.path.exists(os.path.join(base, "cpu.max")):
                return os.path.join(base, "cpu.max"), "", os.path.join(base, "cpu.stat")
        elif "cpu" in controllers.split(","):  # v1
            base = os.path.join("/sys/fs/cgroup/cpu", path.lstrip("/"))
            if not os.path.exists(base):
                base = "/sys/fs/cgroup/cpu"
            quota = os.path.join(base, "cpu.cfs_quota_us")
            if os.path.exists(quota):
                return quota, os.path.join(base, "cpu.cfs_period_us"), os.path.join(base, "cpu.stat")
    return None


def cpu_quota() -> str:
    """The control group's CPU quota in CPUs ("no quota" where it has none)."""
    files = _cgroup_cpu_files()
    if files is None:
        return "no quota"
    quota_file, period_file, _ = files
    with open(quota_file) as f:
        words = f.read().split()
    if period_file:
        with open(period_file) as f:
            words.append(f.read().strip())
    if words[0] in ("max", "-1"):
        return "no quota"
    return f"{int(words[0]) / int(words[1]):g} CPUs"


def throttling() -> tuple[int, float]:
    """The control group's throttled periods and seconds so far ((0, 0.0) where it has no counts)."""
    files = _cgroup_cpu_files()
    if files is None:
        return 0, 0.0
    with open(files[2]) as f:
        stat = dict(line.split() for line in f if line.strip())
    if "throttled_usec" in stat:
        return int(stat.get("nr_throttled", 0)), int(stat["throttled_usec"]) / 1e6
    return int(stat.get("nr_throttled", 0)), int(stat.get("throttled_time", 0)) / 1e9


def timed_trials(w: Any, layout: Any, trials: int, first_job: int) -> dict[str, float]:
    """``trials`` store-race trials through ``w`` with its compute wait; the median ms of each step."""
    from tests.gpu._helpers import TIMEOUT_S, stall
    from tests.gpu.test_races import BLOCKS, HOST, both_doors, fill_blocks, mismatched_pages

    compute = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
    index = torch.tensor(BLOCKS, device=layout.device)
    times: dict[str, list[float]] = {step: [] for step in STEPS}
    for trial in range(trials):
        t0 = time.perf_counter()
        with torch.cuda.stream(compute):
            fill_blocks(layout, index, 1)
        torch.cuda.synchronize(layout.device)
        t1 = time.perf_counter()
        with torch.cuda.stream(compute):
            stall()
            fill_blocks(layout, index, 2)
        t2 = time.perf_counter()
        w.store(first_job + trial, *both_doors(trial, BLOCKS, HOST), stream=compute)
        t3 = time.perf_counter()
        (result,) = w.wait([first_job + trial], TIMEOUT_S)
        assert result.ok, result.error
        t4 = time.perf_counter()
        assert mismatched_pages(layout, w.host_records()[HOST], 2) == 0, "a stale page"
        t5 = time.perf_counter()
        for step, seconds in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            times[step].append(seconds)
    return {step: round(statistics.median(v) * 1e3, 2) for step, v in times.items()}


def rank(shared: bool, cpu_share: bool, name: str, r: int, world: int,
         barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.queues.Queue[Any]) -> None:
    """One process of a configuration: its trials, after a warm-up, started with the others'."""
    from kvoffload import SharedPool, Worker
    from tests.gpu._helpers import TIMEOUT_S, cache
    from tests.gpu._shared_ranks import take_cpu_share

    if cpu_share:
        take_cpu_share()
    torch.cuda.set_device(0)
    layout = cache("per-layer", torch.device("cuda", 0), num_blocks=128, layers=8, seed=r)
    pool = SharedPool(name, world, attach_timeout_s=TIMEOUT_S).rank(r) if shared else None
    with Worker.create(layout, 64, shared=pool, path="dma") as w:
        timed_trials(w, layout, WARMUP_TRIALS, 10_000)
        barrier.wait(TIMEOUT_S)
        out.put((r, torch.get_num_threads(), timed_trials(w, layout, TRIALS, 0)))


def cpu_rank(cpu_share: bool, r: int, world: int, barrier: multiprocessing.synchronize.Barrier,
             out: multiprocessing.queues.Queue[Any]) -> None:
    """One process of a ``--cpu`` configuration: the median ms of a trial's byte checks alone."""
    from tests.gpu._helpers import TIMEOUT_S, cache
    from tests.gpu._shared_ranks import take_cpu_share
    from tests.gpu.test_races import HOST, mismatched_pages

    if cpu_share:
        take_cpu_share()
    layout = cache("per-layer", torch.device("cpu"), num_blocks=128, layers=8, seed=r)
    records = torch.full((len(HOST), layout.record_bytes), 2, dtype=torch.uint8)
    times = []
    for trial in range(WARMUP_TRIALS + TRIALS):
        if trial == WARMUP_TRIALS:
            barrier.wait(TIMEOUT_S)
        began = time.perf_counter()
        assert mismatched_pages(layout, records, 2) == 0
        times.append(time.perf_counter() - began)
    out.put((r, torch.get_num_threads(), round(statistics.median(times[WARMUP_TRIALS:]) * 1e3, 2)))


def main() -> None:
    print(f"CPUs {len(os.sched_getaffinity(0))}, quota: {cpu_quota()}", flush=True)
    context = multiprocessing.get_context("spawn")
    cpu_only = "--cpu" in sys.argv[1:]
    # (a shared pool, processes, a CPU share)
    configurations = (
        ((False, 1, False), (False, 2, False), (False, 2, True), (False, 1, True)) if cpu_only else
        ((False, 1, False), (False, 2, False), (True, 2, False), (False, 2, True), (True, 2, True), (False, 1, True))
    )
    for shared, world, cpu_share in configurations:
        barrier, out = context.Barrier(world), context.Queue()
        name = f"kvoffload-probe-{uuid.uuid4().hex}"
        procs = [context.Process(target=cpu_rank, args=(cpu_share, r, world, barrier, out)) if cpu_only else
                 context.Process(target=rank, args=(shared, cpu_share, name, r, world, barrier, out))
                 for r in range(world)]
        began, throttled = time.monotonic(), throttling()
        for p in procs:
            p.start()
        got = sorted(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
        periods, seconds = (after - before for after, before in zip(throttling(), throttled))
        pool = "" if cpu_only else "shared " if shared else "private "
        label = f"{pool}x{world}, {'a CPU share' if cpu_share else 'default threads'}"
        print(f"{label} ({time.monotonic() - began:.1f} s; throttled {periods} times, {seconds:.2f} s): "
              f"(rank, torch threads, {'median ms per check' if cpu_only else 'median ms per step'}) {got}", flush=True)


if __name__ == "__main__":
    main()
