"""Benchmark of the scheduler-side :class:`~kvoffload.manager.Manager` (CPU only, one core).

Measures the per-block cost of ``lookup``, ``prepare_store`` (with one eviction per block: the pool is
full) and ``complete_store`` at a small and a large pool, for each policy, and prints a table with the
large/small ratio. ``lookup`` asks for keys spread at random over the whole pool (each one a likely
cache miss once the pool outgrows the CPU caches); ``lookup (hot)`` asks for a fixed working set of
:data:`HOT_BLOCKS` keys, the same at both sizes, so its ratio shows the algorithmic scaling alone (an
O(1)-per-block manager stays near 1). Numbers are reported, never asserted.

Run: ``python3 -m kvoffload.manager_bench [--quick]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final

import attrs

from kvoffload.manager import POLICY_NAMES, Manager, StorePlan

KEY_BYTES: Final = 32  # an engine block hash (sha256-sized)
BATCH_BLOCKS: Final = 256  # blocks per call, about one long request's worth of blocks
POOL_BLOCKS: Final = (10_000, 1_000_000)
QUICK_POOL_BLOCKS: Final = (10_000, 100_000)
HOT_BLOCKS: Final = 2_000  # a working set of recent requests' keys, the same at every pool size
MEASURED_BLOCKS: Final = 200_000  # blocks timed per operation and pool (capped by the pool size)
QUICK_MEASURED_BLOCKS: Final = 20_000
REPEATS: Final = 3  # the best of these is reported (least disturbed by other load)
SEED: Final = 1234


@attrs.frozen
class Row:
    """Best per-block cost of one operation, in nanoseconds, for one policy and pool size."""

    policy: str
    pool_blocks: int
    op: str
    ns_per_block: float


def _keys(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(KEY_BYTES) for _ in range(n)]


def _batches(keys: Sequence[bytes]) -> list[Sequence[bytes]]:
    return [keys[i : i + BATCH_BLOCKS] for i in range(0, len(keys), BATCH_BLOCKS)]


def _fill(manager: Manager, keys: list[bytes]) -> None:
    for batch in _batches(keys):
        plan = manager.prepare_store(batch)
        assert plan is not None  # the pool is sized for the keys
        manager.complete_store(plan, True)
        manager.events()


def _best_ns(run: Callable[[], int], repeats: int) -> float:
    """Best ns per block over ``repeats`` runs of ``run`` (which returns the blocks it handled)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        blocks = run()
        best = min(best, (time.perf_counter_ns() - start) / blocks)
    return best


def measure(policy: str, pool_blocks: int, measured_blocks: int, rng: random.Random) -> list[Row]:
    """Fill a pool of ``pool_blocks`` ready blocks, then time the three operations on it."""
    manager = Manager.create(pool_blocks, fingerprint=b"bench", policy=policy)
    resident = _keys(rng, pool_blocks)
    print(f"  {policy} {pool_blocks:>9,} blocks: filling", file=sys.stderr, flush=True)
    _fill(manager, resident)
    count = min(measured_blocks, pool_blocks)
    # fresh equal objects, as an engine hashing its requests passes them
    # (each list is repeated up to measured_blocks lookups, so small pools are timed as long)
    spread_set = [bytes(bytearray(k)) for k in rng.sample(resident, count)]
    spread = _batches(spread_set * (measured_blocks // count))
    hot_set = [bytes(bytearray(k)) for k in rng.sample(resident, HOT_BLOCKS)]
    hot = _batches(hot_set * (measured_blocks // HOT_BLOCKS))

    def lookups(batches: list[Sequence[bytes]]) -> Callable[[], int]:
        def run() -> int:
            hits = 0
            for batch in batches:
                hits += manager.lookup(batch)
            assert hits == sum(map(len, batches))  # every key is ready: each batch is its prefix
            return hits

        return run

    rows = [
        Row(policy, pool_blocks, "lookup", _best_ns(lookups(spread), REPEATS)),
        Row(policy, pool_blocks, "lookup (hot)", _best_ns(lookups(hot), REPEATS)),
    ]
    store_ns = float("inf")
    complete_ns = float("inf")
    for _ in range(REPEATS):
        print(f"  {policy} {pool_blocks:>9,} blocks: stores", file=sys.stderr, flush=True)
        new_batches = _batches(_keys(rng, count))
        plans: list[StorePlan] = []
        start = time.perf_counter_ns()
        for batch in new_batches:
            plan = manager.prepare_store(batch)
            assert plan is not None  # ready blocks are evictable
            plans.append(plan)
            manager.events()  # an engine drains events every step
        store_ns = min(store_ns, (time.perf_counter_ns() - start) / count)
        start = time.perf_counter_ns()
        for plan in plans:
            manager.complete_store(plan, True)
            manager.events()
        complete_ns = min(complete_ns, (time.perf_counter_ns() - start) / count)
    rows.append(Row(policy, pool_blocks, "prepare_store", store_ns))
    rows.append(Row(policy, pool_blocks, "complete_store", complete_ns))
    return rows


def format_table(rows: Sequence[Row], small: int, large: int) -> str:
    """One line per (policy, op): ns/block at both pool sizes and their ratio."""
    by_key = {(r.policy, r.op, r.pool_blocks): r.ns_per_block for r in rows}
    head = f"{'policy':<6} {'op':<15} {f'{small:,} ns/blk':>16} {f'{large:,} ns/blk':>18} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for policy, op in dict.fromkeys((r.policy, r.op) for r in rows):
        a, b = by_key[(policy, op, small)], by_key[(policy, op, large)]
        lines.append(f"{policy:<6} {op:<15} {a:>16.0f} {b:>18.0f} {b / a:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table and the lookup rate; returns the exit status (0)."""
    parser = argparse.ArgumentParser(prog="kvoffload.manager_bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="pools of 10k and 100k blocks, fewer ops")
    args = parser.parse_args(argv)
    pools = QUICK_POOL_BLOCKS if args.quick else POOL_BLOCKS
    measured = QUICK_MEASURED_BLOCKS if args.quick else MEASURED_BLOCKS
    rng = random.Random(SEED)
    rows: list[Row] = []
    for policy in POLICY_NAMES:
        for pool in pools:
            rows.extend(measure(policy, pool, measured, rng))
    small, large = pools
    print(f"batch of {BATCH_BLOCKS} keys per call, {KEY_BYTES}-byte keys, best of {REPEATS}")
    print(format_table(rows, small, large))
    for r in rows:
        if r.op.startswith("lookup") and r.pool_blocks == large:
            rate = 1e9 / r.ns_per_block
            print(f"{r.op} of ready keys, {r.policy}, {large:,}-block pool: {rate:,.0f} keys/s on one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
