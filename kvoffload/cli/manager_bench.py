"""Benchmark of the scheduler-side :class:`~kvoffload.manager.Manager` (CPU only, one core).

Measures the per-block cost of ``lookup``, ``prepare_store`` (with one eviction per block: the pool is
full) and ``complete_store`` at a small and a large pool, for each policy, and prints a table with the
large/small ratio. ``lookup`` asks for keys spread at random over the whole pool (each one a likely
cache miss once the pool outgrows the CPU caches); ``lookup (hot)`` asks for a fixed working set of
:data:`HOT_BLOCKS` keys, the same at both sizes, so its ratio shows the algorithmic scaling alone (an
O(1)-per-block manager stays near 1). Numbers are reported, never asserted.

The *floor* rows time bare Python operations with the same keys, access pattern, batches and pool
sizes, each in C as cheaply as CPython allows: a membership test per key on a set of the resident keys
for the lookups; for a store, one dict insert and one set insert of the new key, plus the delete of
an old key from each (the tables keep the pool's size). The floor's ratio is what hash tables of
that many entries cost in CPython on this machine (cache and TLB misses), with no manager around
them; each manager row shows it next to its own ratio.

Run: ``python -m kvoffload manager-bench [--quick]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final

import attrs

from kvoffload import POLICY_NAMES, Manager, StorePlan

KEY_BYTES: Final = 32  # an engine block hash (sha256-sized)
BATCH_BLOCKS: Final = 256  # blocks per call, about one long request's worth of blocks
POOL_BLOCKS: Final = (10_000, 1_000_000)
QUICK_POOL_BLOCKS: Final = (10_000, 100_000)
HOT_BLOCKS: Final = 2_000  # a working set of recent requests' keys, the same at every pool size
MEASURED_BLOCKS: Final = 200_000  # blocks timed per operation and pool (capped by the pool size)
QUICK_MEASURED_BLOCKS: Final = 20_000
REPEATS: Final = 3  # the best of these is reported (least disturbed by other load)
SEED: Final = 1234
FLOOR: Final = "floor"
"""The ``policy`` of the rows that time bare Python operations instead of a manager."""
FLOOR_OPS: Final[dict[str, str]] = {
    "lookup": "lookup",
    "lookup (hot)": "lookup (hot)",
    "prepare_store": "store",
    "complete_store": "store",
}
"""The floor operation each manager operation is compared with."""


@attrs.frozen
class Row:
    """Best per-block cost of one operation, in nanoseconds, for one policy (or the floor) and pool."""

    policy: str
    pool_blocks: int
    op: str
    ns_per_block: float


@attrs.frozen
class Workload:
    """The keys one pool size is measured with, shared by the floor and every policy.

    ``resident`` fills the pool. ``spread`` and ``hot`` are the lookup batches: fresh objects equal
    to resident keys (as an engine hashing its requests passes them), spread over the whole pool or
    drawn from a fixed working set, each repeated up to the measured block count so that small
    pools are timed as long as large ones.
    """

    pool_blocks: int
    resident: list[bytes]
    spread: list[Sequence[bytes]]
    hot: list[Sequence[bytes]]


def _keys(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(KEY_BYTES) for _ in range(n)]


def _batches(keys: Sequence[bytes]) -> list[Sequence[bytes]]:
    return [keys[i : i + BATCH_BLOCKS] for i in range(0, len(keys), BATCH_BLOCKS)]


def _fresh(keys: Sequence[bytes]) -> list[bytes]:
    """Equal keys in new objects (a lookup cannot match them by identity)."""
    return [bytes(bytearray(k)) for k in keys]


def workload(pool_blocks: int, measured_blocks: int, rng: random.Random) -> Workload:
    """Draw the resident keys of a pool of ``pool_blocks`` and its lookup batches.

    About ``measured_blocks`` keys are looked up per run (at least one pass over each working set);
    the hot working set is :data:`HOT_BLOCKS` keys, or the whole pool when it is smaller.
    """
    resident = _keys(rng, pool_blocks)
    count = min(measured_blocks, pool_blocks)
    spread_set = _fresh(rng.sample(resident, count))
    hot_set = _fresh(rng.sample(resident, min(HOT_BLOCKS, pool_blocks)))
    spread = _batches(spread_set * max(1, measured_blocks // count))
    hot = _batches(hot_set * max(1, measured_blocks // len(hot_set)))
    return Workload(pool_blocks, resident, spread, hot)


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


def measure(
    policy: str, work: Workload, measured_blocks: int, rng: random.Random, repeats: int = REPEATS
) -> list[Row]:
    """Fill a manager with ``work.resident`` (all ready), then time the three operations on it.

    The stores write ``min(measured_blocks, pool)`` new keys per run, each evicting a ready block.
    """
    pool_blocks = work.pool_blocks
    manager = Manager.create(pool_blocks, fingerprint=b"bench", policy=policy)
    print(f"  {policy} {pool_blocks:>9,} blocks: filling", file=sys.stderr, flush=True)
    _fill(manager, work.resident)

    def lookups(batches: list[Sequence[bytes]]) -> Callable[[], int]:
        def run() -> int:
            hits = 0
            for batch in batches:
                hits += manager.lookup(batch)
            assert hits == sum(map(len, batches))  # every key is ready: each batch is its prefix
            return hits

        return run

    rows = [
        Row(policy, pool_blocks, "lookup", _best_ns(lookups(work.spread), repeats)),
        Row(policy, pool_blocks, "lookup (hot)", _best_ns(lookups(work.hot), repeats)),
    ]
    count = min(measured_blocks, pool_blocks)
    store_ns = float("inf")
    complete_ns = float("inf")
    for _ in range(repeats):
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


def measure_floor(
    work: Workload, measured_blocks: int, rng: random.Random, repeats: int = REPEATS
) -> list[Row]:
    """Time the bare table operations of the floor (see the module docstring) on ``work``.

    Each runs in C over a batch of :data:`BATCH_BLOCKS` keys, as cheaply as CPython can do it.
    ``lookup`` / ``lookup (hot)``: ``ready.issuperset(batch)`` for the manager's batches, on a set of
    the resident keys. ``store``: per batch of new keys, pop the blocks of as many old keys from a
    dict and insert the new keys with them, then take the old keys out of a set and add the new
    ones; both tables hold the pool's keys, and the old keys are the oldest (first in, first out, as
    an LRU pool that nobody touches evicts).
    """
    pool_blocks = work.pool_blocks
    print(f"  {FLOOR} {pool_blocks:>9,} blocks", file=sys.stderr, flush=True)
    ready = set(work.resident)

    def lookups(batches: list[Sequence[bytes]]) -> Callable[[], int]:
        def run() -> int:
            for batch in batches:
                if not ready.issuperset(batch):
                    raise AssertionError("every key is resident")
            return sum(map(len, batches))

        return run

    rows = [
        Row(FLOOR, pool_blocks, "lookup", _best_ns(lookups(work.spread), repeats)),
        Row(FLOOR, pool_blocks, "lookup (hot)", _best_ns(lookups(work.hot), repeats)),
    ]
    blocks = {key: block for block, key in enumerate(work.resident)}
    oldest_first = list(work.resident)
    count = min(measured_blocks, pool_blocks)
    store_ns = float("inf")
    for run in range(repeats):
        new = _batches(_keys(rng, count))
        old = _batches(oldest_first[run * count : (run + 1) * count])
        for batch in new:
            oldest_first.extend(batch)
        start = time.perf_counter_ns()
        for new_batch, old_batch in zip(new, old):
            blocks.update(zip(new_batch, map(blocks.pop, old_batch)))
            ready.difference_update(old_batch)
            ready.update(new_batch)
        store_ns = min(store_ns, (time.perf_counter_ns() - start) / count)
    rows.append(Row(FLOOR, pool_blocks, "store", store_ns))
    return rows


def format_table(rows: Sequence[Row], small: int, large: int) -> str:
    """One line per (policy, op): ns/block at both pool sizes, their ratio, and the floor's ratio.

    Floor rows (policy :data:`FLOOR`) are listed last; a manager row's ``floor ratio`` is that of
    its :data:`FLOOR_OPS` operation, ``-`` when the rows have no floor.
    """
    by_key = {(r.policy, r.op, r.pool_blocks): r.ns_per_block for r in rows}

    def ratio(policy: str, op: str) -> float:
        return by_key[(policy, op, large)] / by_key[(policy, op, small)]

    head = (
        f"{'policy':<6} {'op':<15} {f'{small:,} ns/blk':>16} {f'{large:,} ns/blk':>18} {'ratio':>6}"
        f" {'floor ratio':>12}"
    )
    lines = [head, "-" * len(head)]
    pairs = list(dict.fromkeys((r.policy, r.op) for r in rows))
    pairs.sort(key=lambda pair: pair[0] == FLOOR)  # stable: the floor rows last
    for policy, op in pairs:
        a, b = by_key[(policy, op, small)], by_key[(policy, op, large)]
        floor_op = FLOOR_OPS.get(op, op)
        has_floor = policy != FLOOR and (FLOOR, floor_op, small) in by_key
        floor = f"{ratio(FLOOR, floor_op):>12.2f}" if has_floor else f"{'-':>12}"
        lines.append(f"{policy:<6} {op:<15} {a:>16.0f} {b:>18.0f} {b / a:>6.2f} {floor}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table and the lookup rate; returns the exit status (0)."""
    parser = argparse.ArgumentParser(prog="python -m kvoffload manager-bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="pools of 10k and 100k blocks, fewer ops")
    args = parser.parse_args(argv)
    pools = QUICK_POOL_BLOCKS if args.quick else POOL_BLOCKS
    measured = QUICK_MEASURED_BLOCKS if args.quick else MEASURED_BLOCKS
    rng = random.Random(SEED)
    rows: list[Row] = []
    for pool in pools:
        work = workload(pool, measured, rng)
        rows.extend(measure_floor(work, measured, rng))
        for policy in POLICY_NAMES:
            rows.extend(measure(policy, work, measured, rng))
        del work
    small, large = pools
    print(f"batch of {BATCH_BLOCKS} keys per call, {KEY_BYTES}-byte keys, best of {REPEATS}")
    print(format_table(rows, small, large))
    for r in rows:
        if r.op.startswith("lookup") and r.pool_blocks == large and r.policy != FLOOR:
            rate = 1e9 / r.ns_per_block
            print(f"{r.op} of ready keys, {r.policy}, {large:,}-block pool: {rate:,.0f} keys/s on one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
