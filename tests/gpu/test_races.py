"""Self-validating race tests for docs/design.md §5 rule 1 and 2.

The compute stream is stalled with ``torch.cuda._sleep`` and then writes (store case) or reads
(load case) the blocks a job touches. Each test first runs a control worker whose fence ignores the
compute stream: the hazard must show (stale pages stored; the reader sees loaded data), through
both doors of the worker (list ids, and int64 arrays, which a native issuer's fast front takes).
Then the real worker must show zero over many trials.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload import BlockIds, DeviceLayout, Worker
from kvoffload import IssuerName, PathName
from kvoffload.handler import INLINE_ISSUE_MAX_DESCRIPTORS
from tests.gpu._helpers import TIMEOUT_S, FrontHandOffs, cache, direct_copies, no_fence, stall
from tests.gpu.conftest import Figures

BLOCKS = list(range(8, 72, 2))  # 32 scattered device blocks
HOST = list(range(32))
#: The controls' trials (each raced on most of its pages on every GPU host measured), and the real
#: workers': ten times as many, every one of them with the compute stalled over the job as the
#: control's were (200 until 2026-12-07; the suite ran past its three minutes).
CONTROL_TRIALS = 10
TRIALS = 100
PATHS: tuple[PathName, ...] = ("dma", "staged", "sm")
#: Who issues: the native thread, and the Python fallback (the same rules, the same tests).
ISSUERS: tuple[IssuerName, ...] = ("native", "python")


def fill_blocks(layout: DeviceLayout, blocks: torch.Tensor, value: int) -> None:
    """Set every byte of the blocks to ``value`` with kernels on the current stream.

    ``blocks`` is a device tensor: building it from a list would copy it to the device and
    synchronise the stream, which would end the stall before the job is even submitted.
    """
    pattern = torch.full((blocks.shape[0], layout.record_bytes), value, dtype=torch.uint8,
                         device=layout.device)
    layout.scatter_records(blocks, pattern)


def mismatched_pages(layout: DeviceLayout, records: torch.Tensor, value: int) -> int:
    """Pages of ``records`` (uint8 [n, record_bytes]) not entirely equal to ``value``."""
    table = layout.page_table
    bad = 0
    for offset, size in zip(table.host_offset.tolist(), table.nbytes.tolist()):
        bad += int((records[:, offset : offset + size] != value).any(dim=1).sum())
    return bad


def both_doors(trial: int, src: list[int], dst: list[int]) -> tuple[BlockIds, BlockIds]:
    """The ids of one trial: lists on even trials (the validating path), int64 numpy arrays on odd
    ones (a native issuer's fast front, docs/design.md §16), so every race runs through both."""
    if trial % 2:
        return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    return src, dst


def by_trial_door(doors: list[int] | None, trial: int, count: int) -> int:
    """``count`` (a trial's hazard count), added to its door's in ``doors`` when given (index
    ``trial % 2``, as :func:`both_doors` chooses the door)."""
    if doors is not None:
        doors[trial % 2] += count
    return count


def store_race(w: Worker, layout: DeviceLayout, trials: int, first_job: int,
               blocks: list[int] = BLOCKS, host: list[int] = HOST, doors: list[int] | None = None) -> int:
    """Stale pages over ``trials`` stores issued while the compute stream still writes the blocks;
    ``doors`` (two counts), when given, gets each door's stale pages added (see :func:`both_doors`)."""
    compute = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
    index = torch.tensor(blocks, device=layout.device)
    stale = 0
    for trial in range(trials):
        old, new = (2 * trial) % 251, (2 * trial + 1) % 251
        with torch.cuda.stream(compute):
            fill_blocks(layout, index, old)
        torch.cuda.synchronize(layout.device)
        with torch.cuda.stream(compute):
            stall()
            fill_blocks(layout, index, new)  # the writes the store must see
        w.store(first_job + trial, *both_doors(trial, blocks, host), stream=compute)
        (result,) = w.wait([first_job + trial], TIMEOUT_S)
        assert result.ok, result.error
        stale += by_trial_door(doors, trial, mismatched_pages(layout, w.host_records()[host], new))
    return stale


def load_race(w: Worker, layout: DeviceLayout, trials: int, first_job: int,
              blocks: list[int] = BLOCKS, host: list[int] = HOST, *,
              expedited: bool = False, doors: list[int] | None = None) -> tuple[int, int]:
    """(pages where the compute-stream reader saw loaded bytes, pages the load failed to write);
    ``expedited``: every load through the worker's expedited lane; ``doors`` (two counts), when
    given, gets each door's pages seen added (see :func:`both_doors`)."""
    compute = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
    index = torch.tensor(blocks, device=layout.device)
    seen_new = 0
    not_loaded = 0
    for trial in range(trials):
        old, new = (2 * trial) % 251, (2 * trial + 1) % 251
        with torch.cuda.stream(compute):
            fill_blocks(layout, index, old)
        torch.cuda.synchronize(layout.device)
        w.host_records()[host] = new
        with torch.cuda.stream(compute):
            stall()
            snapshot = layout.gather_records(index)  # queued compute still reading the blocks
        w.load(first_job + trial, *both_doors(trial, host, blocks), stream=compute, expedited=expedited)
        (result,) = w.wait([first_job + trial], TIMEOUT_S)
        assert result.ok, result.error
        torch.cuda.synchronize(layout.device)
        seen_new += by_trial_door(doors, trial, mismatched_pages(layout, snapshot, old))
        not_loaded += mismatched_pages(layout, layout.gather_records(index), new)
    return seen_new, not_loaded


def by_door(doors: list[int]) -> str:
    """A control's hazard count per door, for its figure."""
    return f"(lists / int64 arrays: {doors[0]} / {doors[1]})"


def raced_through_both_doors(doors: list[int], front: FrontHandOffs, trials: int, issuer: IssuerName, *,
                             layered: bool = False) -> None:
    """Assert that a control of ``trials`` (run under :func:`no_fence` with ``doors`` counted)
    showed the hazard through both doors, and that a native issuer's fast front handed over each of
    its odd trials (its int64 ids: :func:`both_doors`) with the fence it broke."""
    assert doors[0] > 0 and doors[1] > 0, \
        f"the control did not race through both doors {by_door(doors)}: the test cannot prove the rule"
    handed = front.layered if layered else front.whole
    expected = trials // 2 if issuer == "native" else 0  # the Python issuer has no fast front
    assert handed == expected, f"the fast front handed over {handed} of the control's jobs, not {expected}"


@pytest.fixture
def layout(device: torch.device) -> DeviceLayout:
    return cache("per-layer", device, num_blocks=128, layers=8)


#: A job this large is split when nothing is in flight (its issue costs more than
#: INLINE_ISSUE_MAX_DESCRIPTORS on every path): the head on the caller's thread, the rest on the
#: issuer thread, both behind the one fence.
SPLIT_BLOCKS = list(range(0, 600, 2))
SPLIT_HOST = list(range(300))


@pytest.mark.parametrize("path", PATHS)
def test_a_split_job_waits_for_compute_in_both_parts(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, figures: Figures, path: PathName
) -> None:
    layout = cache("per-layer", device, num_blocks=600, layers=8)
    with monkeypatch.context() as patch:
        no_fence(patch)
        with Worker.create(layout, 300, path=path, issuer="python") as control:
            stale = store_race(control, layout, 3, 0, SPLIT_BLOCKS, SPLIT_HOST)
            seen, _ = load_race(control, layout, 3, 100, SPLIT_BLOCKS, SPLIT_HOST)
    figures.add(f"split job race [{path}/python], control without the compute wait: stale / seen pages",
                f"{stale} / {seen}")
    assert stale > 0 and seen > 0, "the control did not race: the test cannot prove the rule"
    with Worker.create(layout, 300, path=path, issuer="python") as w:
        handler = w._store  # the job splits: its issue is over the caller's-thread limit
        assert handler._backend is not None
        assert handler._backend.issue_cost(handler._plan, len(SPLIT_BLOCKS)) > INLINE_ISSUE_MAX_DESCRIPTORS
        stale = store_race(w, layout, TRIALS // 10, 0, SPLIT_BLOCKS, SPLIT_HOST)
        seen, not_loaded = load_race(w, layout, TRIALS // 10, 100, SPLIT_BLOCKS, SPLIT_HOST)
    figures.add(f"split job race [{path}/python], worker over {TRIALS // 10} trials: stale / seen / not loaded",
                f"{stale} / {seen} / {not_loaded}")
    assert stale == 0 and seen == 0 and not_loaded == 0


@pytest.mark.parametrize("issuer", ISSUERS)
@pytest.mark.parametrize("path", PATHS)
def test_store_waits_for_compute_writes(layout: DeviceLayout, monkeypatch: pytest.MonkeyPatch, issuer: IssuerName,
                                        figures: Figures, path: PathName) -> None:
    pages = CONTROL_TRIALS * len(BLOCKS) * layout.pages_per_block
    doors = [0, 0]
    with monkeypatch.context() as patch:
        front = no_fence(patch)
        with Worker.create(layout, 64, path=path, issuer=issuer) as control:
            control_stale = store_race(control, layout, CONTROL_TRIALS, 0, doors=doors)
    figures.add(f"store race [{path}/{issuer}], control without the compute wait: stale pages",
                f"{control_stale} of {pages} {by_door(doors)}")
    raced_through_both_doors(doors, front, CONTROL_TRIALS, issuer)
    with Worker.create(layout, 64, path=path, issuer=issuer) as w:
        stale = store_race(w, layout, TRIALS, 0)
    figures.add(f"store race [{path}/{issuer}], worker: stale pages over {TRIALS} trials", f"{stale}")
    assert stale == 0


@pytest.mark.parametrize("issuer", ISSUERS)
@pytest.mark.parametrize("path", PATHS)
def test_load_waits_for_compute_reads(layout: DeviceLayout, monkeypatch: pytest.MonkeyPatch, issuer: IssuerName,
                                      figures: Figures, path: PathName) -> None:
    pages = CONTROL_TRIALS * len(BLOCKS) * layout.pages_per_block
    doors = [0, 0]
    with monkeypatch.context() as patch:
        front = no_fence(patch)
        with Worker.create(layout, 64, path=path, issuer=issuer) as control:
            control_seen, _ = load_race(control, layout, CONTROL_TRIALS, 0, doors=doors)
    figures.add(f"load race [{path}/{issuer}], control without the compute wait: reader saw new pages",
                f"{control_seen} of {pages} {by_door(doors)}")
    raced_through_both_doors(doors, front, CONTROL_TRIALS, issuer)
    with Worker.create(layout, 64, path=path, issuer=issuer) as w:
        seen, not_loaded = load_race(w, layout, TRIALS, 0)
    figures.add(f"load race [{path}/{issuer}], worker: reader saw new pages over {TRIALS} trials", f"{seen}")
    assert seen == 0
    assert not_loaded == 0


#: 64 device blocks and host records that both follow each other: through the native issuer's dma
#: path each page moves as one direct strided copy (docs/design.md §16, *Direct strided copies*).
RUN_BLOCKS = list(range(8, 72))
RUN_HOST = list(range(64))


def direct_race(w: Worker, layout: DeviceLayout, store: bool, trials: int) -> int:
    """Stale pages stored (``store``), or pages the reader saw loaded, over ``trials`` jobs of
    :data:`RUN_BLOCKS` and :data:`RUN_HOST`; asserts the jobs' copies went direct."""
    before = direct_copies(w)[0 if store else 1]
    if store:
        hazard = store_race(w, layout, trials, 0, RUN_BLOCKS, RUN_HOST)
    else:
        hazard, not_loaded = load_race(w, layout, trials, 0, RUN_BLOCKS, RUN_HOST)
        assert not_loaded == 0
    assert direct_copies(w)[0 if store else 1] > before, "the jobs' copies did not go direct"
    return hazard


@pytest.mark.parametrize("direction", ["store", "load"])
def test_direct_strided_copies_wait_for_compute(layout: DeviceLayout, monkeypatch: pytest.MonkeyPatch,
                                                figures: Figures, direction: str) -> None:
    """Rules 1 and 2 through dma pairs whose records and blocks both follow each other (strided
    copies straight between the pool and the blocks): the control races, the worker never."""
    store = direction == "store"
    with monkeypatch.context() as patch:
        no_fence(patch)
        with Worker.create(layout, 64, path="dma", issuer="native") as control:
            control_hazard = direct_race(control, layout, store, CONTROL_TRIALS)
    figures.add(f"{direction} race [dma direct/native], control without the compute wait: bad pages",
                f"{control_hazard}")
    assert control_hazard > 0, "the control did not race: the test cannot prove the rule"
    with Worker.create(layout, 64, path="dma", issuer="native") as w:
        hazard = direct_race(w, layout, store, TRIALS)
    figures.add(f"{direction} race [dma direct/native], worker: bad pages over {TRIALS} trials", f"{hazard}")
    assert hazard == 0


def current_stream_store_race(w: Worker, layout: DeviceLayout, trials: int, first_job: int) -> int:
    """As :func:`store_race`, with the compute work on the layout device's *current* stream and the
    job submitted with ``stream=None`` while another device is the caller's current one."""
    index = torch.tensor(BLOCKS, device=layout.device)
    stale = 0
    for trial in range(trials):
        old, new = (2 * trial) % 251, (2 * trial + 1) % 251
        with torch.cuda.device(layout.device):
            fill_blocks(layout, index, old)
            torch.cuda.synchronize(layout.device)
            stall()
            fill_blocks(layout, index, new)  # the writes the store must see
        assert torch.cuda.current_device() != layout.device.index
        w.store(first_job + trial, *both_doors(trial, BLOCKS, HOST))
        (result,) = w.wait([first_job + trial], TIMEOUT_S)
        assert result.ok, result.error
        stale += mismatched_pages(layout, w.host_records()[HOST], new)
    return stale


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("issuer", ISSUERS)
@pytest.mark.parametrize("path", PATHS)
def test_a_caller_on_another_device_still_fences_the_layouts_device(path: PathName, issuer: IssuerName) -> None:
    """The fence is created and recorded on the layout's device whatever device the calling thread
    has current: with ``stream=None`` it is that device's current stream (not the caller's device's
    legacy stream, which handle 0 would name), and with an explicit stream the event is one of its
    device."""
    original = torch.cuda.current_device()
    layout = cache("per-layer", torch.device("cuda", 1), num_blocks=128, layers=8)
    try:
        with Worker.create(layout, 64, path=path, issuer=issuer) as w:
            torch.cuda.set_device(0)  # the caller's current device is another one from here on
            assert current_stream_store_race(w, layout, TRIALS // 4, 0) == 0
            assert store_race(w, layout, TRIALS // 4, 1000) == 0
    finally:
        torch.cuda.set_device(original)
