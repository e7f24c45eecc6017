"""``bench --latency``'s isolated jobs: their host records, and how the variants take turns (the
transfers themselves need CUDA)."""

from __future__ import annotations

import io
import types
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload import Worker
from kvoffload.cli import latency_bench
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


class _Copy:
    """A scripted :class:`latency_bench.PinnedCopy` of 64 MiB: 1 ms each way."""

    dev = types.SimpleNamespace(device="cpu")
    host = types.SimpleNamespace(numel=lambda: 64 << 20)

    def seconds(self, _store: bool) -> float:
        return 1e-3


def test_isolated_jobs_take_turns_and_check_each_last_load_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker's store jobs, then its loads, the workers in turns job by job; before each
    worker's last load the destination is zeroed, and checked right after that load (before the
    next worker's job), so that each check sees its own worker's bytes."""
    log: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda _device=None: None)
    monkeypatch.setattr(latency_bench, "_zero_blocks", lambda _t, _b: log.append(("zero", -1)))

    def job(w: Any, store: bool, _job: int, _dev: object, _host: object) -> tuple[float, float, Any]:
        log.append(("store" if store else "load", w.index))
        return 2e-3 * (w.index + 1), 1e-5, types.SimpleNamespace(seconds=1e-3, path=w.taken)

    def mismatched(layout: Any, _a: object, _b: object) -> int:
        log.append(("check", layout.index))
        return int(layout.index)  # worker i reports i bad blocks: each row must carry its own

    monkeypatch.setattr(latency_bench, "_job", job)
    monkeypatch.setattr(latency_bench, "_mismatched", mismatched)
    workers: list[Any] = [types.SimpleNamespace(index=i, issuer="native", taken=taken,
                                                layout=types.SimpleNamespace(index=i))
                          for i, taken in enumerate(("staged", "dma"))]
    copy: Any = _Copy()
    rows = latency_bench._isolated_rows(workers, ["auto", "dma"], copy, 4096, 2, np.arange(4), np.arange(4) + 4,  # noqa: SLF001
                                        np.arange(4), "in order", {})
    turns = 2 + 2  # two warm-ups and two repeats
    assert log[: 2 * turns] == [("store", v) for _ in range(turns) for v in (0, 1)]
    loads = log[2 * turns:]
    assert loads[: 2 * (turns - 1)] == [("load", v) for _ in range(turns - 1) for v in (0, 1)]
    assert loads[2 * (turns - 1):] == [("zero", -1), ("load", 0), ("check", 0), ("zero", -1), ("load", 1), ("check", 1)]
    assert [len(r) for r in rows] == [2, 2]  # a store row and a load row per worker
    assert "auto(staged)/native" in rows[0][0] and "dma/native" in rows[1][0]
    assert rows[0][0].split()[-1] == "0" and rows[0][1].split()[-1] == "0" and rows[1][1].split()[-1] == "1"
    assert "0.50x" in rows[0][0] and "0.25x" in rows[1][0]  # each its own jobs over the copies


def test_isolated_jobs_open_every_variant_at_once_and_shut_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variant's worker is open while the rows are measured, the rows come variant by
    variant (each variant's record kinds in order), and every worker is shut down once, also when
    a measurement fails."""
    log: list[str] = []

    class _W:
        def __init__(self, path: str) -> None:
            self.path = path

        def __enter__(self) -> _W:
            log.append(f"open {self.path}")
            return self

        def __exit__(self, *_exc: object) -> None:
            log.append(f"shut {self.path}")

    fail: list[str] = []

    def rows(workers: Any, paths: Any, *_args: Any) -> list[list[str]]:
        kind = _args[-2]
        log.append(f"rows {kind} over {len(workers)}")
        if kind in fail:
            raise RuntimeError("a job failed")
        return [[f"{p} {kind} store", f"{p} {kind} load"] for p in paths]

    monkeypatch.setattr(latency_bench, "_per_layer", lambda *_a: (None, {}))
    monkeypatch.setattr(latency_bench, "PinnedCopy", lambda *_a: None)
    monkeypatch.setattr(Worker, "create", lambda _layout, _n, path, issuer, kernel_ctas=None: _W(path))
    monkeypatch.setattr(latency_bench, "_isolated_rows", rows)
    device: Any = None
    got = latency_bench.isolated_jobs(device, 4096, 64 << 20, [("auto", "native"), ("dma", "native")], 2,
                                      io.StringIO(), ("in order", "gapped"))
    assert got == ["auto in order store", "auto in order load", "auto gapped store", "auto gapped load",
                   "dma in order store", "dma in order load", "dma gapped store", "dma gapped load"]
    assert log == ["open auto", "open dma", "rows in order over 2", "rows gapped over 2", "shut dma", "shut auto"]
    log.clear()
    fail.append("gapped")
    with pytest.raises(RuntimeError, match="a job failed"):
        latency_bench.isolated_jobs(device, 4096, 64 << 20, [("auto", "native"), ("dma", "native")], 2,
                                    io.StringIO(), ("in order", "gapped"))
    assert log[-2:] == ["shut dma", "shut auto"]


def test_latency_main_opens_one_issuers_workers_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The isolated-job table is measured issuer by issuer: no call mixes issuers' workers (a
    Python issuer's open workers slow a native caller), and the rows keep their order (page,
    job size, issuer, path)."""
    calls: list[tuple[int, list[tuple[str, str]], tuple[str, ...]]] = []

    def isolated(_device: object, page: int, _size: int, variants: list[tuple[str, str]], _repeats: int,
                 _out: object, records: tuple[str, ...]) -> list[str]:
        calls.append((page, list(variants), tuple(records)))
        return [f"{page} {path}/{issuer} 0" for path, issuer in variants]

    monkeypatch.setattr(latency_bench, "isolated_jobs", isolated)
    monkeypatch.setattr(latency_bench, "one_block_jobs", lambda *_a: "one block")
    monkeypatch.setattr(latency_bench, "expedited_jobs", lambda *_a: "expedited")
    monkeypatch.setattr(latency_bench, "caller_time", lambda *_a: ["caller"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: "a device")
    printed = io.StringIO()
    monkeypatch.setattr("sys.stdout", printed)
    device: Any = None
    status = latency_bench.latency_main(device, ("auto", "dma"), (4096, 65536), True, io.StringIO(),
                                        ("native", "python"))
    assert status == 0
    assert [(page, variants) for page, variants, _ in calls] == [
        (4096, [("auto", "native"), ("dma", "native")]), (4096, [("auto", "python"), ("dma", "python")]),
        (65536, [("auto", "native"), ("dma", "native")]), (65536, [("auto", "python"), ("dma", "python")]),
    ]
    assert [records for _, _, records in calls] == [RECORDS, RECORDS, RECORDS[:1], RECORDS[:1]]
    table = [line for line in printed.getvalue().splitlines() if line[:1].isdigit()]
    assert table == ["4096 auto/native 0", "4096 dma/native 0", "4096 auto/python 0", "4096 dma/python 0",
                     "65536 auto/native 0", "65536 dma/native 0", "65536 auto/python 0", "65536 dma/python 0"]
