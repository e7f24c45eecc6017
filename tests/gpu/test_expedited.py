"""The expedited load lane on CUDA (docs/design.md §4, *Two load lanes*).

* Rule 2 (a load waits for the compute queued before it) holds through the lane, with the race
  test's control: without the fence the compute-stream reader sees loaded bytes; with it, none.
* An expedited load lands, bit-exact, while a regular load waits on the device behind a stalled
  stream; the control sends the same load through the regular lane: it is still not done 0.2 s
  later (its copies queue behind the stalled load's on the lane's copy stream).
"""

from __future__ import annotations

import pytest
import torch

from kvoffload import DeviceLayout, IssuerName, PathName, WaitTimeoutError, Worker
from tests.gpu._helpers import TIMEOUT_S, cache, no_fence, stall
from tests.gpu.conftest import Figures
from tests.gpu.test_races import BLOCKS, CONTROL_TRIALS, ISSUERS, PATHS, load_race, mismatched_pages

#: Trials of the lane's load race (the regular lane's test runs 200 per path and issuer).
TRIALS = 100
#: A stall of about half a second or more on the H200's clocks: far longer than any wait below.
LONG_STALL_CYCLES = 10**9


@pytest.fixture
def layout(device: torch.device) -> DeviceLayout:
    return cache("per-layer", device, num_blocks=128, layers=8)


@pytest.mark.parametrize("path", PATHS)
def test_an_expedited_load_waits_for_compute_reads(layout: DeviceLayout, monkeypatch: pytest.MonkeyPatch,
                                                   figures: Figures, path: PathName) -> None:
    pages = CONTROL_TRIALS * len(BLOCKS) * layout.pages_per_block
    with monkeypatch.context() as patch:
        no_fence(patch)
        with Worker.create(layout, 64, path=path, issuer="native", expedited_loads=True) as control:
            control_seen, _ = load_race(control, layout, CONTROL_TRIALS, 0, expedited=True)
    figures.add(f"expedited load race [{path}], control without the compute wait: reader saw new pages",
                f"{control_seen} of {pages}")
    assert control_seen > 0, "the control did not race: the test cannot prove the rule"
    with Worker.create(layout, 64, path=path, issuer="native", expedited_loads=True) as w:
        seen, not_loaded = load_race(w, layout, TRIALS, 0, expedited=True)
        stats = w.stats()
    figures.add(f"expedited load race [{path}], worker: reader saw new pages over {TRIALS} trials", f"{seen}")
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
