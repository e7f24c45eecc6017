"""The SM path launches with the plan's host stride, whole jobs and layer by layer: a rank of a
shared pool (docs/design.md §13) addresses its own slice of each block (docs/design.md §12 for the
layers). The launches are captured (no device: the kernel's addressing of a launch's arguments is
the GPU suite's); needs the ``cuda`` extra to import the path."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

pytest.importorskip("cuda.bindings", reason="the SM path needs the 'cuda' extra (cuda-bindings)")

from kvoffload.backends import kernel as kernel_path  # noqa: E402
from kvoffload.bindings import driver  # noqa: E402
from kvoffload.records import Direction  # noqa: E402
from tests.unit.test_shared_pool import strided_plan  # noqa: E402


class _Event:
    def __init__(self, *_: object) -> None:
        self.recorded = 0

    def record(self, stream: int) -> None:
        self.recorded += 1

    def release(self) -> None:
        pass


class _Launcher:
    def __init__(self) -> None:
        self.strides: list[int] = []
        self.bases: list[int] = []

    def launch(self, segments: int, count: int, device_blocks: Any, host_rows: Any, host_base: int,
               record_bytes: int, to_host: bool, ctas: int, stream: int) -> None:
        self.strides.append(record_bytes)
        self.bases.append(host_base)


class _Anything:
    """Streams, fence, tables and marks: every call answers."""

    kernel = 7
    timing_events = False

    def wait_on(self, stream: int) -> None:
        pass

    def timing_event(self) -> _Event:
        return _Event()

    def job_events(self) -> tuple[_Event, _Event]:
        return _Event(), _Event()

    def get(self, plan: object) -> tuple[int, int]:
        return 0, 1

    def record(self, layer: int, stream: int) -> None:
        pass

    def record_rest(self, stream: int, upto: int) -> None:
        pass


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_the_sm_path_launches_with_the_pools_stride_whole_and_by_layer(
    direction: Direction, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(driver, "Event", _Event)
    plan = strided_plan(direction, [512, 1024], 3, 1)  # rank 1 of 3: blocks 3 records apart
    assert plan.host_stride == 3 * plan.pages.record_bytes
    path = kernel_path.SmPath.__new__(kernel_path.SmPath)
    launcher = _Launcher()
    path.direction, path.ctas = direction, 8
    path.launcher = launcher  # type: ignore[assignment]
    path.tables = _Anything()  # type: ignore[assignment]
    ids = np.arange(4, dtype=np.int64)
    anything: Any = _Anything()
    ticket = path.issue(anything, plan, ids, ids, anything)
    assert getattr(ticket, "error", None) is None
    layers = (attrs.evolve(plan), attrs.evolve(plan))
    ticket = path.issue_layers(anything, layers, ids, ids, anything, anything, 0)
    assert getattr(ticket, "error", None) is None
    assert launcher.strides == [plan.host_stride] * 3
    assert launcher.bases == [plan.host_base] * 3
