"""docs/design.md §5 rule 5 for the staged path: a staging slot is reused only after the event of its last
use. Controls that skip that wait corrupt data across back-to-back jobs; the real path shows none.
And the backend's device buffers (the ring, the kernel's segment table) are allocated on its kernel
stream: a control that allocates them on the caller's stream gets a block the caller's pending work
still writes.

The compute stream is stalled so that the kernel side of every chunk waits while the DMA side runs
ahead (load), or so that all gathers run back to back once released while the DMAs trail (store).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvoffload import DeviceLayout, IssuerName, SrcAccessOrder, Worker
from kvoffload import native
from kvoffload._descriptors import CopyPlan, StagedChunk
from kvoffload.backends import kernel as kernel_paths
from kvoffload.backends.cuda import CudaStreams
from kvoffload.backends import native as native_backend
from kvoffload.backends.kernel import StagedPath
from tests.gpu._helpers import TIMEOUT_S, cache, stall
from tests.gpu.conftest import Figures

JOBS = 10
BLOCKS_PER_JOB = 24


def store_chunk_without_slot_wait(
    self: StagedPath, streams: CudaStreams, chunk: StagedChunk, plan: CopyPlan,
    segments: tuple[int, int],
) -> None:
    """CONTROL ONLY: the store chunk without waiting for the slot's previous DMA."""
    stream, kstream = streams.copy, streams.kernel
    self._gather(streams, chunk, plan, segments)
    self._filled[chunk.slot].record(kstream)
    self._filled[chunk.slot].wait_on(stream)
    self.copier.copy(chunk.dma.dsts, chunk.dma.srcs, chunk.dma.sizes, SrcAccessOrder.STREAM, stream)
    self._drained[chunk.slot].record(stream)


def load_chunk_without_slot_wait(
    self: StagedPath, streams: CudaStreams, chunk: StagedChunk, plan: CopyPlan,
    segments: tuple[int, int],
) -> None:
    """CONTROL ONLY: the load chunk without waiting for the slot's previous kernel."""
    stream, kstream = streams.copy, streams.kernel
    self.copier.copy(chunk.dma.dsts, chunk.dma.srcs, chunk.dma.sizes, SrcAccessOrder.ANY, stream)
    self._filled[chunk.slot].record(stream)
    self._filled[chunk.slot].wait_on(kstream)
    self._gather(streams, chunk, plan, segments)
    self._drained[chunk.slot].record(kstream)


def no_slot_wait(patch: pytest.MonkeyPatch) -> None:
    """CONTROL ONLY: staged chunks rewrite a slot without waiting for its last read, whoever issues
    (the Python path's chunk methods, and the native issuer's control flag)."""
    patch.setattr(StagedPath, "_store_chunk", store_chunk_without_slot_wait)
    patch.setattr(StagedPath, "_load_chunk", load_chunk_without_slot_wait)
    patch.setattr(native_backend, "CONTROLS", native.CONTROL_SKIP_SLOT_WAIT)


ISSUERS: tuple[IssuerName, ...] = ("native", "python")


def small_ring(layout: DeviceLayout) -> int:
    """staging_bytes for 2 slots of 2 records per direction: every job spans many chunks."""
    return 2 * 2 * 2 * layout.record_bytes


def warm_up(w: Worker) -> None:
    """One store and one load, so that the jobs of a test are issued within the compute stall (the
    first job of a backend uploads the kernel's segment table)."""
    w.store(10**6, [0], [0])
    assert all(r.ok for r in w.wait([10**6], TIMEOUT_S))
    w.load(10**6 + 1, [0], [0])
    assert all(r.ok for r in w.wait([10**6 + 1], TIMEOUT_S))


def back_to_back_stores(layout: DeviceLayout, issuer: IssuerName) -> int:
    """Corrupted host records after JOBS stores submitted back to back behind a stalled compute."""
    rng = np.random.default_rng(3)
    compute = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
    src = [rng.choice(layout.num_blocks, BLOCKS_PER_JOB, replace=False) for _ in range(JOBS)]
    host = np.arange(JOBS * BLOCKS_PER_JOB).reshape(JOBS, BLOCKS_PER_JOB)
    with Worker.create(layout, JOBS * BLOCKS_PER_JOB, path="staged",
                       staging_bytes=small_ring(layout), issuer=issuer) as w:
        warm_up(w)
        with torch.cuda.stream(compute):
            stall()
        for job in range(JOBS):
            w.store(job, src[job], host[job], stream=compute)
        assert all(r.ok for r in w.wait(list(range(JOBS)), TIMEOUT_S))
        records = w.host_records()
        bad = 0
        for job in range(JOBS):
            want = layout.gather_records(src[job])
            bad += int((records[host[job]].to(layout.device) != want).any(dim=1).sum())
        del records
    return bad


def back_to_back_loads(layout: DeviceLayout, issuer: IssuerName) -> int:
    """Corrupted device blocks after JOBS loads submitted back to back behind a stalled compute."""
    rng = np.random.default_rng(4)
    compute = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
    n = JOBS * BLOCKS_PER_JOB
    dst = rng.permutation(layout.num_blocks)[:n].reshape(JOBS, BLOCKS_PER_JOB)
    host = rng.permutation(n).reshape(JOBS, BLOCKS_PER_JOB)
    with Worker.create(layout, n, path="staged", staging_bytes=small_ring(layout), issuer=issuer) as w:
        records = torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8)
        warm_up(w)
        w.host_records().copy_(records)
        with torch.cuda.stream(compute):
            stall()
        for job in range(JOBS):
            w.load(job, host[job], dst[job], stream=compute)
        assert all(r.ok for r in w.wait(list(range(JOBS)), TIMEOUT_S))
    return sum(bad_pages(layout, dst[job], records[host[job]]) for job in range(JOBS))


def bad_pages(layout: DeviceLayout, device_blocks: np.ndarray, want: torch.Tensor) -> int:
    """Pages of ``device_blocks`` whose bytes differ from the host records ``want`` (padding aside)."""
    got = layout.gather_records(device_blocks).cpu()
    table = layout.page_table
    bad = 0
    for offset, size in zip(table.host_offset.tolist(), table.nbytes.tolist()):
        bad += int((got[:, offset : offset + size] != want[:, offset : offset + size]).any(dim=1).sum())
    return bad


@pytest.fixture
def layout(device: torch.device) -> DeviceLayout:
    return cache("per-layer", device, num_blocks=JOBS * BLOCKS_PER_JOB + 16, layers=8)


@pytest.mark.parametrize("issuer", ISSUERS)
def test_store_reuses_a_slot_only_after_its_dma_finished(
    layout: DeviceLayout, monkeypatch: pytest.MonkeyPatch, figures: Figures, issuer: IssuerName
) -> None:
    with monkeypatch.context() as patch:
        no_slot_wait(patch)
        control = back_to_back_stores(layout, issuer)
    figures.add(f"staged store ring reuse [{issuer}], control without the slot wait: bad records",
                f"{control} of {JOBS * BLOCKS_PER_JOB}")
    assert control > 0, "the control did not race: the test cannot prove the rule"
    real = back_to_back_stores(layout, issuer)
    figures.add(f"staged store ring reuse [{issuer}], worker: bad records", f"{real}")
    assert real == 0


@pytest.mark.parametrize("issuer", ISSUERS)
def test_load_reuses_a_slot_only_after_its_kernel_finished(
    layout: DeviceLayout, monkeypatch: pytest.MonkeyPatch, figures: Figures, issuer: IssuerName
) -> None:
    with monkeypatch.context() as patch:
        no_slot_wait(patch)
        control = back_to_back_loads(layout, issuer)
    figures.add(f"staged load ring reuse [{issuer}], control without the slot wait: bad pages",
                f"{control} of {JOBS * BLOCKS_PER_JOB * layout.pages_per_block}")
    assert control > 0, "the control did not race: the test cannot prove the rule"
    real = back_to_back_loads(layout, issuer)
    figures.add(f"staged load ring reuse [{issuer}], worker: bad pages", f"{real}")
    assert real == 0


def buffer_on_callers_stream(
    streams: CudaStreams, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """CONTROL ONLY: the backend's device buffers allocated on the caller's current stream."""
    return torch.empty(shape, dtype=dtype, device=streams.device)


def first_load_behind_a_freed_block(layout: DeviceLayout) -> int:
    """Corrupted pages of a fresh worker's first load (which uploads the kernel's segment table),
    submitted under a compute stream whose stalled work still zeroes a freed block of the table's
    size."""
    rng = np.random.default_rng(5)
    compute = torch.cuda.Stream(layout.device)  # type: ignore[no-untyped-call]
    n = BLOCKS_PER_JOB
    dst = rng.permutation(layout.num_blocks)[:n]
    host = rng.permutation(n)
    records = torch.randint(0, 256, (n, layout.record_bytes), dtype=torch.uint8)
    table_rows = layout.pages_per_block  # per-layer pages never merge: one segment per page
    with Worker.create(layout, n, path="staged", staging_bytes=small_ring(layout)) as w:
        w.host_records().copy_(records)
        with torch.cuda.stream(compute):
            stall()
            freed = torch.empty((table_rows, 4), dtype=torch.int64, device=layout.device)
            freed.zero_()  # queued behind the stall; the block returns to this stream's pool now
            del freed
            w.load(0, host, dst, stream=compute)
        assert all(r.ok for r in w.wait([0], TIMEOUT_S))
    return bad_pages(layout, dst, records[host])


def test_kernel_buffers_are_never_a_block_the_callers_pending_work_still_writes(
    layout: DeviceLayout, monkeypatch: pytest.MonkeyPatch, figures: Figures
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(kernel_paths, "device_buffer", buffer_on_callers_stream)
        control = first_load_behind_a_freed_block(layout)
    figures.add("kernel segment table, control allocated on the caller's stream: bad pages",
                f"{control} of {BLOCKS_PER_JOB * layout.pages_per_block}")
    assert control > 0, "the control did not race: the test cannot prove the rule"
    real = first_load_behind_a_freed_block(layout)
    figures.add("kernel segment table, worker: bad pages", f"{real}")
    assert real == 0
