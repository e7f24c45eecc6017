"""``bench --latency``'s host records for its isolated jobs (the rows themselves need CUDA)."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.cli.latency_bench import RECORDS, host_records


def test_in_order_records_follow_each_other() -> None:
    assert host_records("in order", 5).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["gapped", "shuffled"])
def test_scattered_records_never_follow_each_other(kind: str) -> None:
    got = host_records(kind, 300, seed=3)
    assert got.dtype == np.int64
    assert sorted(got.tolist()) == list(range(0, 600, 2))  # distinct, within a pool of 2 x blocks
    ascending = np.sort(got)
    assert (np.diff(ascending) > 1).all()  # no descriptor ever covers two records


def test_shuffled_records_are_not_ascending_and_repeat_by_seed() -> None:
    got = host_records("shuffled", 300, seed=3)
    assert (np.diff(got) < 0).any()
    assert host_records("shuffled", 300, seed=3).tolist() == got.tolist()


def test_every_kind_is_named_and_others_refused() -> None:
    assert RECORDS == ("in order", "gapped", "shuffled")
    with pytest.raises(ValueError, match="records must be one of"):
        host_records("random", 4)
