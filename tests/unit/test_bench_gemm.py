"""``bench --gemm``'s figure from its rounds (the GEMM and the transfers themselves need CUDA): the
slowdown of each round against the mean of the windows alone around it, reported as the median and
the quartiles of the rounds."""

from __future__ import annotations

import types
from typing import Any

import pytest

from kvoffload.cli import bench


class _Window:
    """A GEMM window's events: ``begin.elapsed_time(end)`` is the window's milliseconds."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, _end: object) -> float:
        return self.ms


class _Gemm:
    """Scripted windows: each round, one alone, one beside, one alone."""

    def __init__(self, rounds: list[tuple[float, float, float]]) -> None:
        self.alone = [ms for before, _, after in rounds for ms in (before, after)]
        self.beside = [with_ms for _, with_ms, _ in rounds]

    def alone_ms(self) -> float:
        return self.alone.pop(0)

    def start(self) -> tuple[_Window, None]:
        return _Window(self.beside.pop(0)), None


def test_each_round_is_judged_against_the_windows_alone_around_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose GEMM drifts from 50 to 75 ms: each round's slowdown is its window beside over
    the mean of its two windows alone, so the drift is no slowdown (the control: against the first
    window alone the last rounds would look 50% slower)."""
    rounds = [(50.0 + 5 * i, (50.0 + 5 * i) * (1.0 + 0.01 * i), 50.0 + 5 * i) for i in range(6)]
    monkeypatch.setattr(bench, "GEMM_ROUNDS", 6)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=iter(range(100)).__next__))
    gemm: Any = _Gemm(rounds)
    figure = bench._gemm_rounds(gemm, lambda _end: 2 * 10**9)  # noqa: SLF001
    assert figure.slowdown == pytest.approx(0.025)  # the median of 0%, 1%, ..., 5%
    low, high = figure.quartiles
    assert low == pytest.approx(0.0075) and high == pytest.approx(0.0425)  # statistics.quantiles, n=4
    assert figure.gbps == pytest.approx(2.0)  # 2 GB over one second a round
    assert figure.describe() == f"2.5% [{100 * low:+.1f}, {100 * high:+.1f}]"
    naive = [with_ms / rounds[0][0] - 1.0 for _, with_ms, _ in rounds]
    assert max(naive) > 0.5


def test_one_round_has_no_spread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "GEMM_ROUNDS", 1)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=iter(range(10)).__next__))
    gemm: Any = _Gemm([(40.0, 44.0, 40.0)])
    figure = bench._gemm_rounds(gemm, lambda _end: 10**9)  # noqa: SLF001
    assert figure.slowdown == pytest.approx(0.1) and figure.quartiles == pytest.approx((0.1, 0.1))
