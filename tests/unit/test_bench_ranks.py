"""``python -m kvoffload bench --ranks N`` (``kvoffload.cli.ranks_bench``): its rank functions run
here as threads (the command spawns a process per rank; that is measured, not tested), each over a
real shared pool on the host backend, reporting what the command prints from; bad options are
refused."""

from __future__ import annotations

import os
import queue
import threading
import uuid
from typing import Any

import pytest

from kvoffload import SharedPool
from kvoffload.cli import bench, ranks_bench
from kvoffload.region import SHM_DIR


def run_ranks(target: Any, jobs: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    barrier = threading.Barrier(len(jobs))
    results: queue.Queue[tuple[Any, ...]] = queue.Queue()
    threads = [threading.Thread(target=target, args=(*job, barrier, results)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ranks_bench.TIMEOUT_S)
    got = sorted(results.get_nowait() for _ in jobs)
    assert all(g[1] is not None for g in got), got
    return got


def test_attach_ranks_report_when_each_call_began_and_returned() -> None:
    pool = SharedPool(f"kvoffload-test-{uuid.uuid4().hex}", 2, attach_timeout_s=60)
    got = run_ranks(ranks_bench.attach_rank, [(pool, r, 8192, 16) for r in range(2)])
    assert [g[0] for g in got] == [0, 1] and all(g[2] >= g[1] for g in got)
    assert not os.path.exists(os.path.join(SHM_DIR, pool.name))


def test_traffic_ranks_move_their_bytes_and_check_them() -> None:
    pool = SharedPool(f"kvoffload-test-{uuid.uuid4().hex}", 2, attach_timeout_s=60)
    got = run_ranks(ranks_bench.traffic_rank, [(pool, r, 256 << 10, ranks_bench.JOB_BLOCKS, "auto")
                                               for r in range(2)])
    for rank, store_s, load_s, nbytes, mismatched in got:
        assert store_s > 0 and load_s > 0 and mismatched == 0
        assert nbytes == ranks_bench.JOB_BLOCKS * ranks_bench.TRAFFIC_BLOCK_BYTES


def test_a_failing_rank_reports_its_error() -> None:
    pool = SharedPool(f"kvoffload-test-{uuid.uuid4().hex}", 2, attach_timeout_s=0.2)
    barrier = threading.Barrier(1)
    results: queue.Queue[tuple[Any, ...]] = queue.Queue()
    ranks_bench.attach_rank(pool, 0, 8192, 16, barrier, results)  # rank 1 never comes
    rank, began, error = results.get_nowait()
    assert (rank, began) == (0, None) and error.startswith("PoolTimeoutError")


@pytest.mark.parametrize("argv", [["--ranks", "0"], ["--ranks", "2", "--traffic-ranks", "-1"]])
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        bench.main(argv)  # the bench hands --ranks to ranks_bench
    assert caught.value.code == 2
