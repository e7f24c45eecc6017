"""Where a store-race trial's time goes when two rank processes share the one GPU:
``python -m tests.gpu.probe_shared_trial``.

Not a test (nothing is asserted but the trials' own correctness; pytest does not collect it): a
measurement for the GPU suite's shared-pool tests (``test_shared_pool.py``), whose trials took
about 160 ms each against 12-15 ms in ``test_races``. Each configuration runs 20 trials of
``test_races.store_race``'s steps per process on the ``dma`` path, timing each step (the median in
ms): fill the blocks and synchronise, queue the stall and the writes, submit the store, wait for
it, check the host records' bytes. Configurations: one process alone, two at once with private
pools, two at once over one shared pool, each with torch's default intra-op threads and with
a share of the CPUs per process (``_shared_ranks.take_cpu_share``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import statistics
import time
import uuid
from typing import Any

import torch

#: The steps of a trial, in order.
STEPS = ("fill+sync", "queue", "store", "wait", "check", "trial")
TRIALS = 20
WARMUP_TRIALS = 3


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


def main() -> None:
    context = multiprocessing.get_context("spawn")
    for shared, world, cpu_share in ((False, 1, False), (False, 2, False), (True, 2, False),
                                     (False, 2, True), (True, 2, True), (False, 1, True)):
        barrier, out = context.Barrier(world), context.Queue()
        name = f"kvoffload-probe-{uuid.uuid4().hex}"
        procs = [context.Process(target=rank, args=(shared, cpu_share, name, r, world, barrier, out))
                 for r in range(world)]
        began = time.monotonic()
        for p in procs:
            p.start()
        got = sorted(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
        label = f"{'shared' if shared else 'private'} x{world}, {'a CPU share' if cpu_share else 'default threads'}"
        print(f"{label} ({time.monotonic() - began:.1f} s): (rank, torch threads, median ms per step) {got}",
              flush=True)


if __name__ == "__main__":
    main()
