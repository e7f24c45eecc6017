"""The manager benchmark's measuring and formatting code, on tiny pools (no timing is asserted)."""

from __future__ import annotations

import random

import pytest

from kvoffload import POLICY_NAMES
from kvoffload.cli.manager_bench import (
    FLOOR,
    FLOOR_OPS,
    Row,
    format_table,
    measure,
    measure_floor,
    workload,
)

SMALL, LARGE = 100, 1000
MEASURED = 300  # more than the small pool: its batches repeat, its stores are capped at the pool


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    rng = random.Random(7)
    out: list[Row] = []
    for pool in (SMALL, LARGE):
        work = workload(pool, MEASURED, rng)
        out.extend(measure_floor(work, MEASURED, rng, repeats=2))
        for policy in POLICY_NAMES:
            out.extend(measure(policy, work, MEASURED, rng, repeats=2))
    return out


def test_workload_draws_fresh_copies_of_resident_keys() -> None:
    work = workload(SMALL, MEASURED, random.Random(1))
    assert len(work.resident) == len(set(work.resident)) == SMALL
    resident = set(work.resident)
    ids = {id(k) for k in work.resident}
    for batches in (work.spread, work.hot):
        keys = [k for batch in batches for k in batch]
        assert len(keys) >= MEASURED // 2 and set(keys) <= resident
        assert not ids & {id(k) for k in keys}  # equal, never the same objects


def test_every_policy_and_the_floor_report_each_operation_at_both_pool_sizes(rows: list[Row]) -> None:
    got = {(r.policy, r.op, r.pool_blocks) for r in rows}
    manager_ops = set(FLOOR_OPS)
    for pool in (SMALL, LARGE):
        for policy in POLICY_NAMES:
            assert {(policy, op, pool) for op in manager_ops} <= got
        assert {(FLOOR, op, pool) for op in FLOOR_OPS.values()} <= got
    assert len(got) == len(rows)
    assert all(r.ns_per_block > 0 for r in rows)


def test_table_has_a_line_per_policy_and_op_with_the_floor_ratio_next_to_the_manager_ratio(
    rows: list[Row],
) -> None:
    table = format_table(rows, SMALL, LARGE).splitlines()
    assert "floor ratio" in table[0] and f"{LARGE:,} ns/blk" in table[0]
    body = table[2:]
    assert len(body) == len(POLICY_NAMES) * len(FLOOR_OPS) + len(set(FLOOR_OPS.values()))
    floor_lines = [line for line in body if line.startswith(FLOOR)]
    assert body[-len(floor_lines) :] == floor_lines  # the floor rows come last
    assert all(line.endswith("-") for line in floor_lines)
    for line in body[: -len(floor_lines)]:
        float(line.split()[-1])  # a manager row shows its floor's ratio


def test_table_without_floor_rows_shows_no_floor_ratio() -> None:
    rows = [Row("lru", SMALL, "lookup", 10.0), Row("lru", LARGE, "lookup", 25.0)]
    line = format_table(rows, SMALL, LARGE).splitlines()[2]
    assert line.split()[-2:] == ["2.50", "-"]
