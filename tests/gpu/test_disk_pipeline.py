"""The GPU <-> disk pipeline through bounce slots on the real device: round trips are bit-exact, and
docs/design.md §5 rule 5 holds over 100 back-to-back loads — a control that neither waits for a set's last
copy nor drains the trailing copies corrupts the next call's data; the real pipeline shows none."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
import torch

from kvoffload import DeviceLayout, DiskConfig, SrcAccessOrder, Worker
from kvoffload.backends.cuda import CudaBackend, DmaPath
from kvoffload.handler import DirectionHandler
from kvoffload.worker.pipeline import DiskPipeline
from tests.gpu._helpers import TIMEOUT_S, cache, stall
from tests.gpu.conftest import Figures

CALLS = 100
PER_CALL = 4
SOURCES = 40
#: About 50 ms: most of the calls' disk reads happen while the copies wait behind compute.
STALL_CYCLES = 10**8


#: How long the controls' own waits wait for a disk request or a copy.
CONTROL_WAIT_S = 120.0


def load_without_rule_5(self: DiskPipeline, job: Any) -> None:
    """CONTROL ONLY: reads into a set while its last copy may still read it, and returns without
    draining the job's trailing copies."""
    for index, part in enumerate(self._rounds(job)):
        rows = self._sets[index % len(self._sets)][: part.stop - part.start]
        io = self._tier.read_records(job.disk_blocks[part], rows)
        io.wait(CONTROL_WAIT_S)
        self._from_slots.submit(next(self._ids), rows, job.device_blocks[part], fence=job.fence)


def corrupted_after_back_to_back_loads(
    layout: DeviceLayout, path: str, order: SrcAccessOrder = SrcAccessOrder.ANY
) -> int:
    rng = np.random.default_rng(11)
    src = np.arange(SOURCES)
    dst = SOURCES + rng.permutation(layout.num_blocks - SOURCES)[: CALLS * PER_CALL].reshape(CALLS, PER_CALL)
    which = rng.integers(0, SOURCES, size=(CALLS, PER_CALL))
    for row in which:  # distinct disk records within a call
        row[:] = rng.choice(SOURCES, PER_CALL, replace=False)
    compute = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
    with Worker.create(layout, 8, disk=DiskConfig(path, SOURCES), bounce_slots=8) as w:
        bounce_load = dict(w._teardown.parts)["bounce load handler"]
        assert isinstance(bounce_load, DirectionHandler)
        backend = bounce_load._backend
        assert isinstance(backend, CudaBackend)
        dma = backend.paths["dma"]
        assert isinstance(dma, DmaPath)
        dma.order = order
        w.store_to_disk(0, src, src)
        assert w.wait([0], TIMEOUT_S)[0].ok
        with torch.cuda.stream(compute):
            stall(STALL_CYCLES)  # every copy to the device waits here while the disk reads go on
        for call in range(CALLS):
            w.load_from_disk(1 + call, which[call], dst[call], stream=compute)
        results = w.wait(list(range(1, CALLS + 1)), TIMEOUT_S)
        torch.cuda.synchronize(layout.device)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:1]
    got = layout.gather_records(dst.reshape(-1))
    want = layout.gather_records(which.reshape(-1))
    return int((got != want).any(dim=1).sum())


@pytest.fixture
def layout(device: torch.device) -> DeviceLayout:
    return cache("per-layer", device, num_blocks=SOURCES + CALLS * PER_CALL + 8, layers=2)


def test_device_disk_round_trip_is_bit_exact(layout: DeviceLayout, tmp_path: pathlib.Path) -> None:
    src = list(range(0, 30))
    dst = list(range(100, 130))
    with Worker.create(layout, 8, disk=DiskConfig(str(tmp_path / "kv.bin"), 64)) as w:
        w.store_to_disk(1, src, src)
        assert w.wait([1], TIMEOUT_S)[0].ok
        w.load_from_disk(2, src, dst)
        (result,) = w.wait([2], TIMEOUT_S)
        assert result.ok, result.error
    assert torch.equal(layout.gather_records(dst), layout.gather_records(src))


def test_bounce_slots_are_reused_only_after_their_last_copy(
    layout: DeviceLayout, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    figures: Figures,
) -> None:
    # The control's copies read their source in stream order: with ANY the driver on this machine
    # reads the slot at the call, which hides the race, but no driver promises to.
    with monkeypatch.context() as patch:
        patch.setattr(DiskPipeline, "_load", load_without_rule_5)
        control = corrupted_after_back_to_back_loads(layout, str(tmp_path / "control.bin"),
                                                     SrcAccessOrder.STREAM)
        control_any = corrupted_after_back_to_back_loads(layout, str(tmp_path / "control-any.bin"))
    figures.add(f"disk loads, control without rule 5 (STREAM / ANY): corrupted over {CALLS} calls",
                f"{control} / {control_any} of {CALLS * PER_CALL}")
    assert control > 0, "the control did not race: the test cannot prove the rule"
    for order in (SrcAccessOrder.STREAM, SrcAccessOrder.ANY):
        real = corrupted_after_back_to_back_loads(layout, str(tmp_path / f"real-{order.name}.bin"),
                                                  order)
        figures.add(f"disk loads, worker ({order.name}): corrupted over {CALLS} back-to-back calls",
                    f"{real}")
        assert real == 0
