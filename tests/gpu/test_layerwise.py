"""Layer-by-layer loads on CUDA (docs/design.md §12), on every path.

- Every layout bit-exact through ``load_by_layer``, each layer read on the compute stream right
  after its ``wait_layer``.
- ``wait_layer`` ordering, proven with controls on a layout whose last layer is large (its copy is
  still in flight long after layer 0 landed) and whose load waits for a stalled side stream: a
  compute stream that waits for nothing reads layer 0 stale; one that waits for the whole job reads
  layer 0 only after the last layer landed; the real one reads layer 0 correct while the last layer
  is still being copied.
- Rule 2 per layer: a control whose fence ignores the compute stream lets a reader queued before the
  call see loaded bytes; the real worker never does.
- Narrow layers from records apart through ``staged`` land in groups of layers, each layer read
  correct right after its wait (a control that does not wait reads stale pages), and every group
  waits for compute reads queued before the call (rule 2; a control without the fence races).
- Rule 5 for the staged path's layered chunks: a control that skips the slot wait corrupts
  back-to-back layered loads through a small ring; the real path never does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload import DeviceLayout, IssuerName, LayerLoad, PathName, Worker, calibration
from kvoffload._layer_groups import GroupedMarks
from kvoffload.cli._caches import LAYOUTS, build_cache
from tests.gpu._helpers import TIMEOUT_S, direct_copies, no_fence, stall
from tests.gpu.conftest import Figures
from tests.gpu.test_races import (
    BLOCKS, HOST, RUN_BLOCKS, RUN_HOST, both_doors, by_door, by_trial_door, fill_blocks,
    raced_through_both_doors,
)
from tests.gpu.test_staging import ISSUERS, no_slot_wait

PATHS: tuple[PathName, ...] = ("dma", "staged", "sm")
LAYERS = 4
CONTROL_TRIALS = 5
TRIALS = 30
ORDER_TRIALS = 12


def layered_cache(kind: str, device: torch.device, *, num_blocks: int = 96, seed: int = 0) -> DeviceLayout:
    tensors, block_dim = build_cache(kind, num_blocks=num_blocks, layers=LAYERS, kv_heads=8,
                                     head_dim=128, block_size=16, dtype=torch.bfloat16,
                                     device=device, seed=seed)
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim,
                                     layer_dim=1 if kind == "cross-layer" else None)


def layer_ranges(layout: DeviceLayout, layer: int) -> list[tuple[int, int]]:
    table = layout.layer_tables[layer]
    return list(zip(table.host_offset.tolist(), table.nbytes.tolist()))


def bad_layer_pages(layout: DeviceLayout, layer: int, got: torch.Tensor, want: torch.Tensor) -> int:
    """Pieces of layer ``layer`` whose bytes differ between two record tensors."""
    return sum(int((got[:, o : o + n] != want[:, o : o + n]).any(dim=1).sum())
               for o, n in layer_ranges(layout, layer))


@pytest.mark.parametrize("in_order", [False, True])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_load_by_layer_is_bit_exact_layer_by_layer(kind: str, path: PathName, in_order: bool,
                                                   device: torch.device) -> None:
    """``in_order``: 64 pairs whose records and blocks both follow each other, which the native
    issuer's dma path moves as direct strided copies (asserted); else 40 pairs picked at random."""
    layout = layered_cache(kind, device, seed=len(kind), num_blocks=128)
    assert layout.num_layers == LAYERS
    rng = np.random.default_rng(11)
    if in_order:
        src, dst, host = np.arange(64), 64 + np.arange(64), np.arange(64)
    else:
        src = rng.choice(64, 40, replace=False)
        dst = 64 + rng.choice(64, 40, replace=False)
        host = rng.choice(64, 40, replace=False)
    want = layout.gather_records(src)
    compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    index = torch.as_tensor(dst, device=device)
    with Worker.create(layout, 64, path=path) as w:
        w.store(1, src, host)
        assert all(r.ok for r in w.wait([1], TIMEOUT_S))
        for job in range(2, 6):  # several jobs: marks are released and their events reused
            layout.scatter_records(dst, torch.zeros_like(want))
            torch.cuda.synchronize(device)
            load = w.load_by_layer(job, host, dst, stream=compute)
            snaps = []
            with torch.cuda.stream(compute):
                for layer in range(LAYERS):
                    load.wait_layer(layer, compute)
                    snaps.append(layout.gather_records(index))  # read right after its wait
            (result,) = w.wait([job], TIMEOUT_S)
            assert result.ok, result.error
            torch.cuda.synchronize(device)
            for layer, snap in enumerate(snaps):
                assert bad_layer_pages(layout, layer, snap, want) == 0, f"layer {layer} read stale"
            assert torch.equal(layout.gather_records(dst), want)
            load.wait_layer(0, compute)  # after the result: nothing to wait for
        direct = direct_copies(w)[1]
        assert (direct > 0) == (in_order and path == "dma" and w.issuer == "native"), direct


def big_last_layer(device: torch.device) -> DeviceLayout:
    """Three small layers (2 x 32 KiB pages) and a last one of 2 x 4 MiB pages per block."""
    n = 64
    tensors = {f"layer{i}": torch.zeros(2, n, 16, 8, 128, dtype=torch.bfloat16, device=device)
               for i in range(LAYERS - 1)}
    tensors[f"layer{LAYERS - 1}"] = torch.zeros(2, n, 4 << 20, dtype=torch.uint8, device=device)
    return DeviceLayout.from_tensors(tensors, block_dim=1)


def ordering_trials(w: Worker, layout: DeviceLayout, how: str, trials: int, first: int) -> tuple[int, int, float]:
    """(layer-0 pieces read stale, trials whose last layer was read complete, ms from layer 0 ready
    to the last layer ready, median) with the compute stream waiting as ``how`` says: ``nothing``,
    ``whole`` (for the last layer, which ends the job) or ``layer`` (for layer 0)."""
    device = layout.device
    dst = list(range(8, 56))
    host = list(range(48))
    index = torch.as_tensor(dst, device=device)
    compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stale0 = complete_last = 0
    gaps = []
    last = LAYERS - 1
    for trial in range(trials):
        old, new = (2 * trial) % 251, (2 * trial + 1) % 251
        fill_blocks(layout, index, old)
        w.host_records()[host] = new
        torch.cuda.synchronize(device)
        with torch.cuda.stream(side):
            stall()  # the load starts only after this: a reader that does not wait runs first
        load: LayerLoad = w.load_by_layer(first + trial, *both_doors(trial, host, dst), stream=side)
        ready0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ready_last = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(compute):
            if how == "layer":
                load.wait_layer(0, compute)
            elif how == "whole":
                load.wait_layer(last, compute)
            ready0.record(compute)
            snap = layout.gather_records(index)
            load.wait_layer(last, compute)
            ready_last.record(compute)
        (result,) = w.wait([first + trial], TIMEOUT_S)
        assert result.ok, result.error
        torch.cuda.synchronize(device)
        full = torch.full_like(snap, new)
        stale0 += bad_layer_pages(layout, 0, snap, full)
        complete_last += int(bad_layer_pages(layout, last, snap, full) == 0)
        gaps.append(float(ready0.elapsed_time(ready_last)))
    return stale0, complete_last, float(np.median(gaps))


@pytest.mark.parametrize("issuer", ISSUERS)
@pytest.mark.parametrize("path", PATHS)
def test_wait_layer_orders_the_stream_after_that_layer_only(
    path: PathName, issuer: IssuerName, device: torch.device, figures: Figures
) -> None:
    layout = big_last_layer(device)
    pieces0 = 48 * len(layer_ranges(layout, 0))
    with Worker.create(layout, 48, path=path, issuer=issuer) as w:
        w.load_by_layer(10**6, [0], [0])  # warm-up: segment tables, events
        assert all(r.ok for r in w.wait([10**6], TIMEOUT_S))
        stale, _, _ = ordering_trials(w, layout, "nothing", CONTROL_TRIALS, 0)
        figures.add(f"wait_layer [{path}/{issuer}], control waiting for nothing: layer-0 pieces stale",
                    f"{stale} of {CONTROL_TRIALS * pieces0}")
        assert stale > 0, "the control did not race: the test cannot prove the rule"
        stale, complete, _ = ordering_trials(w, layout, "whole", CONTROL_TRIALS, 100)
        figures.add(f"wait_layer [{path}/{issuer}], control waiting for the whole job: last layer read complete",
                    f"{complete} of {CONTROL_TRIALS} trials")
        assert stale == 0 and complete == CONTROL_TRIALS, "waiting for the whole job reads every layer late"
        stale, complete, gap = ordering_trials(w, layout, "layer", ORDER_TRIALS, 200)
        figures.add(f"wait_layer [{path}/{issuer}], layer 0: stale pieces / trials whose last layer was done",
                    f"{stale} / {complete} of {ORDER_TRIALS}; layer 0 ready {gap:.2f} ms before the last")
    assert stale == 0, "a stream that waited for layer 0 read it stale"
    assert complete < ORDER_TRIALS, "layer 0 was never read while the last layer was still in flight"


def layered_load_race(w: Worker, layout: DeviceLayout, trials: int, first_job: int,
                      blocks: list[int] = BLOCKS, host: list[int] = HOST,
                      doors: list[int] | None = None) -> tuple[int, int]:
    """As the load race of test_races, through ``load_by_layer`` (waiting for every layer on the
    compute stream after its read), through both doors (``doors``, when given, gets each door's
    pieces seen added)."""
    compute = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
    index = torch.tensor(blocks, device=layout.device)
    seen_new = not_loaded = 0
    for trial in range(trials):
        old, new = (2 * trial) % 251, (2 * trial + 1) % 251
        with torch.cuda.stream(compute):
            fill_blocks(layout, index, old)
        torch.cuda.synchronize(layout.device)
        w.host_records()[host] = new
        with torch.cuda.stream(compute):
            stall()
            snapshot = layout.gather_records(index)  # queued compute still reading the blocks
        load = w.load_by_layer(first_job + trial, *both_doors(trial, host, blocks), stream=compute)
        for layer in range(load.num_layers):
            load.wait_layer(layer, compute)
        (result,) = w.wait([first_job + trial], TIMEOUT_S)
        assert result.ok, result.error
        torch.cuda.synchronize(layout.device)
        full_old = torch.full_like(snapshot, old)
        seen_new += by_trial_door(
            doors, trial, sum(bad_layer_pages(layout, i, snapshot, full_old) for i in range(load.num_layers)))
        after = layout.gather_records(index)
        not_loaded += sum(bad_layer_pages(layout, i, after, torch.full_like(after, new))
                          for i in range(load.num_layers))
    return seen_new, not_loaded


@pytest.mark.parametrize("issuer", ISSUERS)
@pytest.mark.parametrize("path", PATHS)
def test_every_layer_waits_for_compute_reads(
    path: PathName, issuer: IssuerName, device: torch.device, monkeypatch: pytest.MonkeyPatch,
    figures: Figures,
) -> None:
    layout = layered_cache("per-layer", device, num_blocks=128)
    doors = [0, 0]
    with monkeypatch.context() as patch:
        front = no_fence(patch)
        with Worker.create(layout, 64, path=path, issuer=issuer) as control:
            control_seen, _ = layered_load_race(control, layout, CONTROL_TRIALS, 0, doors=doors)
    figures.add(f"layered load race [{path}/{issuer}], control without the compute wait: reader saw new",
                f"{control_seen} pieces {by_door(doors)}")
    raced_through_both_doors(doors, front, CONTROL_TRIALS, issuer, layered=True)
    with Worker.create(layout, 64, path=path, issuer=issuer) as w:
        seen, not_loaded = layered_load_race(w, layout, TRIALS, 0)
    figures.add(f"layered load race [{path}/{issuer}], worker over {TRIALS} trials: reader saw new", f"{seen}")
    assert seen == 0 and not_loaded == 0


def test_every_layer_of_direct_strided_copies_waits_for_compute_reads(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, figures: Figures,
) -> None:
    """Rule 2 per layer through the native dma path's direct strided copies (records and blocks
    that both follow each other): the control races, the worker never; the copies went direct."""
    layout = layered_cache("per-layer", device, num_blocks=128)
    doors = [0, 0]
    with monkeypatch.context() as patch:
        front = no_fence(patch)
        with Worker.create(layout, 64, path="dma", issuer="native") as control:
            control_seen, _ = layered_load_race(control, layout, CONTROL_TRIALS, 0, RUN_BLOCKS, RUN_HOST, doors)
            assert direct_copies(control)[1] > 0
    figures.add("layered load race [dma direct/native], control without the compute wait: reader saw new",
                f"{control_seen} pieces {by_door(doors)}")
    raced_through_both_doors(doors, front, CONTROL_TRIALS, "native", layered=True)
    with Worker.create(layout, 64, path="dma", issuer="native") as w:
        seen, not_loaded = layered_load_race(w, layout, TRIALS, 0, RUN_BLOCKS, RUN_HOST)
        assert direct_copies(w)[1] > 0
    figures.add(f"layered load race [dma direct/native], worker over {TRIALS} trials: reader saw new", f"{seen}")
    assert seen == 0 and not_loaded == 0


JOBS = 8
PER_JOB = 16


def back_to_back_layered_loads(layout: DeviceLayout, issuer: IssuerName) -> int:
    """Bad pieces after JOBS layered staged loads back to back through a ring of 2 x 2 records,
    behind a stalled compute stream."""
    rng = np.random.default_rng(4)
    device = layout.device
    compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    n = JOBS * PER_JOB
    dst = rng.permutation(layout.num_blocks)[:n].reshape(JOBS, PER_JOB)
    host = rng.permutation(n).reshape(JOBS, PER_JOB)
    records = torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8)
    with Worker.create(layout, n, path="staged", staging_bytes=8 * layout.record_bytes,
                       issuer=issuer) as w:
        w.host_records().copy_(records)
        w.load_by_layer(10**6, [0], [0])
        assert all(r.ok for r in w.wait([10**6], TIMEOUT_S))
        with torch.cuda.stream(compute):
            stall()
        for job in range(JOBS):
            w.load_by_layer(job, host[job], dst[job], stream=compute)
        assert all(r.ok for r in w.wait(list(range(JOBS)), TIMEOUT_S))
    bad = 0
    for job in range(JOBS):
        got = layout.gather_records(dst[job]).cpu()
        want = records[host[job]]
        bad += sum(bad_layer_pages(layout, i, got, want) for i in range(LAYERS))
    return bad


@pytest.mark.parametrize("issuer", ISSUERS)
def test_layered_staged_loads_reuse_a_slot_only_after_its_kernel_finished(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, figures: Figures, issuer: IssuerName
) -> None:
    layout = layered_cache("per-layer", device, num_blocks=JOBS * PER_JOB + 8)
    with monkeypatch.context() as patch:
        no_slot_wait(patch)
        control = back_to_back_layered_loads(layout, issuer)
    figures.add(f"layered staged ring reuse [{issuer}], control without the slot wait: bad pieces",
                f"{control}")
    assert control > 0, "the control did not race: the test cannot prove the rule"
    real = back_to_back_layered_loads(layout, issuer)
    figures.add(f"layered staged ring reuse [{issuer}], worker: bad pieces", f"{real}")
    assert real == 0


@pytest.mark.parametrize("issuer", ISSUERS)
def test_auto_moves_a_layered_load_of_narrow_spans_from_records_apart_through_sm(
    issuer: IssuerName, device: torch.device, figures: Figures,
) -> None:
    """``auto``'s layered path (docs/design.md §12, *The path of a layered load*): a layer's span
    of a record is 8 KiB here (K and V pages of 4 KiB), so the calibration timed a layered load
    from records apart through each path. From every other record each span is a descriptor of
    its own on ``dma`` and ``staged``: the load takes ``sm`` where ``sm`` moved the timed load
    faster than the size bucket's path. From records in order the native issuer moves a staged
    layer as one strided copy: the size bucket's path stays; the Python issuer has no strided
    copies. Every load lands bit-exact."""
    blocks = 256
    tensors = {f"layer{i}": torch.randint(0, 256, (2, 2 * blocks, 4096), dtype=torch.uint8, device=device)
               for i in range(LAYERS)}
    layout = DeviceLayout.from_tensors(tensors, block_dim=1, num_blocks=2 * blocks)
    src = np.arange(blocks, dtype=np.int64)
    dst = src + blocks
    want = layout.gather_records(src)
    compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with Worker.create(layout, 2 * blocks, path="auto", issuer=issuer) as w:
        assert w.capabilities is not None
        key = calibration.geometry_key(w.capabilities.device_name, layout.page_table, ("dma", "staged", "sm"),
                                       issuer=w.issuer, layers=layout.layer_tables)
        measured = calibration._cache[key].layered()  # noqa: SLF001 - this worker's calibration
        assert measured is not None and "sm" in measured, key
        figures.add(f"layered load from records apart, 8 KiB spans, calibration [{issuer}]",
                    ", ".join(f"{path} {g[0]:.1f} GB/s" for path, g in measured.items()))
        job = 1
        for apart, host in ((True, 2 * src), (False, src.copy())):
            w.store(job, src, host)
            (store,) = w.wait([job], TIMEOUT_S)
            w.load(job + 1, host, dst)
            (whole,) = w.wait([job + 1], TIMEOUT_S)
            assert store.ok and whole.ok, (store.error, whole.error)
            layout.scatter_records(dst, torch.zeros_like(want))
            torch.cuda.synchronize(device)
            load = w.load_by_layer(job + 2, host, dst, stream=compute)
            load.wait_layer(LAYERS - 1, compute)
            (result,) = w.wait([job + 2], TIMEOUT_S)
            assert result.ok, result.error
            compute.synchronize()
            assert torch.equal(layout.gather_records(dst), want)
            strided = whole.path == "staged" and issuer == "native" and not apart
            size_path = "dma" if whole.path.startswith("dma") else whole.path  # results may say "dma-loop"
            slower = measured.get(size_path, (0.0,))[0] < measured["sm"][0]  # than sm, from records apart
            keeps = whole.path == "sm" or strided or not slower
            assert result.path == (whole.path if keeps else "sm"), (apart, whole.path, measured)
            job += 3


def narrow_layers(device: torch.device, num_blocks: int = 128) -> DeviceLayout:
    """16 layers of K and V pages of 4 KiB: 8 KiB of a record a layer, side by side."""
    tensors = {f"layer{i}": torch.zeros(2, num_blocks, 4096, dtype=torch.uint8, device=device) for i in range(16)}
    return DeviceLayout.from_tensors(tensors, block_dim=1)


@pytest.mark.parametrize("issuer", ISSUERS)
def test_a_staged_load_of_narrow_layers_from_records_apart_lands_in_groups(
    issuer: IssuerName, device: torch.device, figures: Figures,
) -> None:
    """16 layers of 8 KiB of a record loaded through ``staged`` from every other record are handed
    over as groups of four (32 KiB of a record; docs/design.md §12, *Narrow layers grouped for
    staged*). Behind a stalled side stream, through both doors: a control reading every layer
    without waiting reads stale pages; reading each layer right after its ``wait_layer`` reads it
    whole, and the job lands bit-exact."""
    layout = narrow_layers(device)
    host = [2 * i for i in range(48)]
    dst = list(range(64, 112))
    index = torch.as_tensor(dst, device=device)
    compute = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stale = {"control": 0, "waited": 0}
    with Worker.create(layout, 128, path="staged", issuer=issuer) as w:
        for trial in range(2 * CONTROL_TRIALS):
            waits = trial >= CONTROL_TRIALS
            old, new = (2 * trial) % 251, (2 * trial + 1) % 251
            fill_blocks(layout, index, old)
            w.host_records()[host] = new
            torch.cuda.synchronize(device)
            with torch.cuda.stream(side):
                stall()  # the load starts only after this
            load = w.load_by_layer(trial, *both_doors(trial, host, dst), stream=side)
            marks = load._marks  # noqa: SLF001 - how the job was handed over
            assert isinstance(marks, GroupedMarks) and marks.size == 4 and marks.inner.count == 4
            snaps = []
            with torch.cuda.stream(compute):
                for layer in range(16):
                    if waits:
                        load.wait_layer(layer, compute)
                    snaps.append(layout.gather_records(index))
            (result,) = w.wait([trial], TIMEOUT_S)
            assert result.ok, result.error
            torch.cuda.synchronize(device)
            full = torch.full_like(snaps[0], new)
            stale["waited" if waits else "control"] += sum(
                bad_layer_pages(layout, layer, snap, full) for layer, snap in enumerate(snaps))
            assert torch.equal(layout.gather_records(index), full)
    figures.add(f"staged layered load in groups [{issuer}]: stale layer pieces, control / waited",
                f"{stale['control']} / {stale['waited']}")
    assert stale["control"] > 0, "the control did not race: the test cannot prove the marks"
    assert stale["waited"] == 0, "a layer read right after its wait_layer was stale"


@pytest.mark.parametrize("issuer", ISSUERS)
def test_every_group_of_narrow_layers_waits_for_compute_reads(
    issuer: IssuerName, device: torch.device, monkeypatch: pytest.MonkeyPatch, figures: Figures,
) -> None:
    """Rule 2 for a ``staged`` load handed over in groups of layers (16 layers of 8 KiB from every
    other record): a control whose fence ignores the compute stream lets a reader queued before
    the call see loaded bytes; the worker never does, and every byte lands."""
    layout = narrow_layers(device)
    host = [2 * i for i in range(len(BLOCKS))]
    doors = [0, 0]
    with monkeypatch.context() as patch:
        front = no_fence(patch)
        with Worker.create(layout, 128, path="staged", issuer=issuer) as control:
            control_seen, _ = layered_load_race(control, layout, CONTROL_TRIALS, 0, BLOCKS, host, doors)
    figures.add(f"grouped layered load race [staged/{issuer}], control without the compute wait: reader saw new",
                f"{control_seen} pieces {by_door(doors)}")
    raced_through_both_doors(doors, front, CONTROL_TRIALS, issuer, layered=True)
    with Worker.create(layout, 128, path="staged", issuer=issuer) as w:
        seen, not_loaded = layered_load_race(w, layout, TRIALS, 0, BLOCKS, host)
        load = w.load_by_layer(10**6, host, BLOCKS)
        assert isinstance(load._marks, GroupedMarks), "the load was not handed over in groups"  # noqa: SLF001
        assert w.wait([10**6], TIMEOUT_S)[0].ok
    figures.add(f"grouped layered load race [staged/{issuer}], worker over {TRIALS} trials: reader saw new", f"{seen}")
    assert seen == 0 and not_loaded == 0
