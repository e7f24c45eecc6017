"""The expedited load lane on CUDA (docs/design.md §4, *Two load lanes*).

* Rule 2 (a load waits for the compute queued before it) holds through the lane, with the race
  test's control: without the fence the compute-stream reader sees loaded bytes; with it, none.
* An expedited load lands, bit-exact, while a regular load waits on the device behind a stalled
  stream; the control sends the same load through the regular lane: it is still not done 0.2 s
  later (its copies queue behind the stalled load's on the lane's copy stream).
* The lane's small loads (``sm`` by default where the pool is mapped) are not held by the copy
  engine: a load of 4 blocks lands while a 4 GiB host-to-device copy on another stream still
  runs; the controls, the lane through ``dma`` and through ``staged``, finish only after that copy
  (on the H100s measured the copy engine took one direction's copies in the order they came,
  whichever stream they came from).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvoffload import DeviceLayout, IssuerName, PathName, WaitTimeoutError, Worker
from tests.gpu._helpers import TIMEOUT_S, cache, no_fence, stall
from tests.gpu.conftest import Figures
from tests.gpu.test_races import (
    BLOCKS, CONTROL_TRIALS, ISSUERS, PATHS, TRIALS, by_door, load_race, mismatched_pages,
    raced_through_both_doors,
)

#: A stall of about half a second or more on the H200's clocks: far longer than any wait below.
LONG_STALL_CYCLES = 10**9


@pytest.fixture
def layout(device: torch.device) -> DeviceLayout:
    return cache("per-layer", device, num_blocks=128, layers=8)


#: The copy that keeps the copy engine busy: about 80 ms over a link of 50-55 GB/s.
BUSY_BYTES = 4 << 30
#: Blocks of a lane load over EXPEDITED_SM_MAX_BYTES (8 MiB) in the fixture's layout (512 KiB a block).
LARGE_LANE_BLOCKS = 20


@pytest.mark.parametrize("path", [*PATHS, None], ids=[*PATHS, "default"])
def test_an_expedited_load_waits_for_compute_reads(layout: DeviceLayout, monkeypatch: pytest.MonkeyPatch,
                                                   figures: Figures, path: PathName | None) -> None:
    """The lane at each path for every load, and at its default on an ``auto`` worker (the race's
    loads, 32 blocks of 512 KiB, are over 8 MiB: auto's bulk choice; ``sm``'s route is the "sm"
    case)."""
    pages = CONTROL_TRIALS * len(BLOCKS) * layout.pages_per_block
    worker_path: PathName = path or "auto"
    doors = [0, 0]
    with monkeypatch.context() as patch:
        front = no_fence(patch)
        with Worker.create(layout, 64, path=worker_path, issuer="native", expedited_loads=True,
                           expedited_path=path) as control:
            control_seen, _ = load_race(control, layout, CONTROL_TRIALS, 0, expedited=True, doors=doors)
    name = path or "default"
    figures.add(f"expedited load race [{name}], control without the compute wait: reader saw new pages",
                f"{control_seen} of {pages} {by_door(doors)}")
    raced_through_both_doors(doors, front, CONTROL_TRIALS, "native")
    with Worker.create(layout, 64, path=worker_path, issuer="native", expedited_loads=True,
                       expedited_path=path) as w:
        seen, not_loaded = load_race(w, layout, TRIALS, 0, expedited=True)
        stats = w.stats()
    figures.add(f"expedited load race [{name}], worker: reader saw new pages over {TRIALS} trials", f"{seen}")
    assert seen == 0
    assert not_loaded == 0
    assert stats.expedited is not None and stats.expedited.completed == TRIALS
    assert stats.load.completed == 0


@pytest.mark.parametrize("expedite", [True, False], ids=["expedited", "control-regular-lane"])
@pytest.mark.parametrize("issuer", ISSUERS)
def test_an_expedited_load_lands_while_a_regular_load_waits_behind_a_stalled_stream(
    layout: DeviceLayout, issuer: IssuerName, expedite: bool,
) -> None:
    held_blocks, held_host = BLOCKS[:8], list(range(8))
    blocks, host = BLOCKS[8:16], list(range(8, 16))
    with Worker.create(layout, 64, issuer=issuer, expedited_loads=True) as w:
        records = w.host_records()
        records[held_host] = 7
        records[host] = 9
        held = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
        free = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
        held_index = torch.tensor(held_blocks, device=layout.device)  # (built before the stall)
        index = torch.tensor(blocks, device=layout.device)
        with torch.cuda.stream(held):
            stall(LONG_STALL_CYCLES)
        w.load(1, held_host, held_blocks, stream=held)  # its copies wait for the stall on the device
        w.load(2, host, blocks, stream=free, expedited=expedite)
        if expedite:
            (result,) = w.wait([2], TIMEOUT_S)
            assert result.ok, result.error
            assert [r.job_id for r in w.poll()] == [], "the stalled regular load finished first"
            with torch.cuda.stream(free):
                landed = layout.gather_records(index)
            free.synchronize()
            assert mismatched_pages(layout, landed, 9) == 0
        else:
            with pytest.raises(WaitTimeoutError):
                w.wait([2], 0.2)
        assert all(r.ok for r in w.wait([1] if expedite else [1, 2], TIMEOUT_S))
        torch.cuda.synchronize(layout.device)
        assert mismatched_pages(layout, layout.gather_records(held_index), 7) == 0
        assert mismatched_pages(layout, layout.gather_records(index), 9) == 0


@pytest.fixture(scope="module")
def busy_copy() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A pinned host buffer and a device buffer of BUSY_BYTES each (one pair for the module)."""
    device = torch.device("cuda", torch.cuda.current_device())
    pair = (torch.empty(BUSY_BYTES, dtype=torch.uint8, pin_memory=True),
            torch.empty(BUSY_BYTES, dtype=torch.uint8, device=device))
    yield pair
    torch.cuda.synchronize(device)
    del pair


@pytest.mark.parametrize("lane", [None, "dma", "staged"], ids=["default", "control-dma", "control-staged"])
@pytest.mark.parametrize("issuer", ISSUERS)
def test_the_default_lane_is_not_held_by_the_copy_engine(
    layout: DeviceLayout, busy_copy: tuple[torch.Tensor, torch.Tensor], issuer: IssuerName,
    lane: PathName | None, figures: Figures,
) -> None:
    host_buffer, device_buffer = busy_copy
    blocks, host = BLOCKS[:4], list(range(4))
    with Worker.create(layout, 64, issuer=issuer, expedited_loads=True, expedited_path=lane) as w:
        w.host_records()[host] = 11
        index = torch.tensor(blocks, device=layout.device)
        w.load(1, host, blocks, expedited=True)  # warm: the lane's first load builds its tables
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
        torch.cuda.synchronize(layout.device)
        w.host_records()[host] = 12
        busy = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(busy):
            device_buffer.copy_(host_buffer, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(busy)
        w.load(2, host, blocks, expedited=True)
        (result,) = w.wait([2], TIMEOUT_S)
        copy_running = not done.query()  # type: ignore[no-untyped-call]
        done.synchronize()
        assert result.ok, result.error
        assert result.path == (lane or "sm"), result.path
        torch.cuda.synchronize(layout.device)
        assert mismatched_pages(layout, layout.gather_records(index), 12) == 0
        if lane is None:  # the default's larger loads go through the worker's path (auto: not sm)
            many = list(range(16, 16 + LARGE_LANE_BLOCKS))
            w.load(3, many, many, expedited=True)
            (large,) = w.wait([3], TIMEOUT_S)
            assert large.ok and large.path in ("dma", "staged"), (large.path, large.error)
    name = f"lane through {lane or 'sm (default)'} [{issuer}]"
    figures.add(f"expedited load beside a 4 GiB host-to-device copy, {name}: result while the copy ran",
                str(copy_running))
    if lane is None:
        assert copy_running, "the lane's load waited for the other stream's copy"
    else:
        assert not copy_running, "the control was not held by the copy engine: the test cannot prove the lane"


@pytest.mark.parametrize("path", ["dma", "staged"])
def test_the_default_lane_takes_small_loads_through_sm_beside_a_fixed_path(layout: DeviceLayout,
                                                                           path: PathName) -> None:
    with Worker.create(layout, 64, path=path, expedited_loads=True) as w:
        w.host_records()[:4] = 5
        w.load(1, [0, 1, 2, 3], BLOCKS[:4], expedited=True)  # 2 MiB
        many = list(range(16, 16 + LARGE_LANE_BLOCKS))
        w.load(2, many, many, expedited=True)  # 10 MiB
        small, large = w.wait([1, 2], TIMEOUT_S)
        assert (small.ok, small.path, large.ok, large.path) == (True, "sm", True, path), (small, large)
        torch.cuda.synchronize(layout.device)
        index = torch.tensor(BLOCKS[:4], device=layout.device)
        assert mismatched_pages(layout, layout.gather_records(index), 5) == 0
