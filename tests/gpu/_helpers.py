"""Helpers shared by the GPU tests: small random caches and backends that break one rule on purpose
(the control cases that prove a hazard is real)."""

from __future__ import annotations

import pytest
import torch

from kvoffload import DeviceLayout, Worker
from kvoffload._descriptors import I64Array, PageTable
from kvoffload._layer_load import LayerMarks
from kvoffload.backends.cuda import CudaBackend
from kvoffload.backends.native import NativeBackend
from kvoffload.bindings import driver
from kvoffload.cli._caches import build_cache
from kvoffload.cli._torch import new_stream
from kvoffload.handler import BookedHandler, DirectionHandler

#: ~5 ms of GPU time on the H200 test machine: long enough for a copy to overtake queued compute.
SLEEP_CYCLES = 10**7
TIMEOUT_S = 60.0


def cache(kind: str, device: torch.device, *, num_blocks: int = 256, layers: int = 4,
          seed: int = 0) -> DeviceLayout:
    """A random cache of one of the demo's layouts (Llama-8B-like pages: 8 heads x 128, bs 16)."""
    tensors, block_dim = build_cache(
        kind, num_blocks=num_blocks, layers=layers, kv_heads=8, head_dim=128, block_size=16,
        dtype=torch.bfloat16, device=device, seed=seed,
    )
    return DeviceLayout.from_tensors(tensors, block_dim=block_dim)


def stall(cycles: int = SLEEP_CYCLES) -> None:
    """Queue a busy-wait kernel on the current stream (the compute stream of a race test)."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def _idle_fence(self: CudaBackend, stream: object | None) -> object:
    """CONTROL ONLY: a fence on an idle stream instead of the compute stream, so the job's copies do
    not wait for queued compute (docs/design.md §5 rule 1 and 2 broken on purpose)."""
    idle = new_stream(self.device)
    event = driver.Event(driver.event_pool(idle.device.index or 0, timing=False))
    event.record(idle.cuda_stream)
    return event


_native_fence = NativeBackend.fence
_native_position = NativeBackend.position


def _idle_native_fence(self: NativeBackend, stream: object | None) -> object:
    """CONTROL ONLY: :func:`_idle_fence` for the native issuer (its fence, on an idle stream)."""
    return _native_fence(self, new_stream(self.device))


def _idle_native_position(self: NativeBackend, stream: object | None) -> object:
    """CONTROL ONLY: the handler's own fence of a native job (recorded by the hand-off) on an idle
    stream (torch keeps its pool's streams: the handle outlives the stream object)."""
    return _native_position(self, new_stream(self.device))


_front_submit = BookedHandler.submit_handed_off
_front_submit_layered = BookedHandler.submit_handed_off_layered


class FrontHandOffs:
    """How many jobs the worker's fast front (int64 numpy ids, docs/design.md §16) handed over
    under :func:`no_fence`, each with an idle stream for its fence: whole jobs and layered ones."""

    def __init__(self) -> None:
        self.whole = 0
        self.layered = 0


def _idle_handle(handler: BookedHandler) -> int:
    """An idle stream's handle on the device of ``handler``'s backend."""
    return int(new_stream(cuda_backend(handler).device).cuda_stream)


def no_fence(patch: pytest.MonkeyPatch) -> FrontHandOffs:
    """Make every cuda backend created under ``patch``, whoever issues, use an idle fence: the fences
    handlers take (``fence``, and ``position`` on the native issuer, whose hand-off records it), and
    the stream the worker's fast front hands over for its fence, so that a control breaks the rule
    through both doors. Returns the count of the fast front's hand-offs, which grows while the
    patch holds (a race test checks that its control's int64 ids took that door)."""
    count = FrontHandOffs()

    def idle_front_submit(self: BookedHandler, job_id: int, src: I64Array, dst: I64Array, stream: int) -> None:
        """CONTROL ONLY: the fast front's hand-off, its fence recorded on an idle stream instead
        of the caller's."""
        count.whole += 1
        _front_submit(self, job_id, src, dst, _idle_handle(self))

    def idle_front_submit_layered(self: BookedHandler, job_id: int, src: I64Array, dst: I64Array, stream: int,
                                  tables: tuple[PageTable, ...]) -> LayerMarks:
        """CONTROL ONLY: the same for the fast front's ``load_by_layer``."""
        count.layered += 1
        return _front_submit_layered(self, job_id, src, dst, _idle_handle(self), tables)

    patch.setattr(CudaBackend, "fence", _idle_fence)
    patch.setattr(NativeBackend, "fence", _idle_native_fence)
    patch.setattr(NativeBackend, "position", _idle_native_position)
    patch.setattr(BookedHandler, "submit_handed_off", idle_front_submit)
    patch.setattr(BookedHandler, "submit_handed_off_layered", idle_front_submit_layered)
    return count


def cuda_backend(handler: DirectionHandler) -> CudaBackend:
    """The handler's CUDA backend (the one a native issuer took over, if any)."""
    backend = handler._backend
    if isinstance(backend, NativeBackend):
        backend = backend._inner  # type: ignore[assignment]
    assert isinstance(backend, CudaBackend)
    return backend


def direct_copies(w: Worker) -> tuple[int, int]:
    """The direct strided copies (store, load) the worker's native issuers made so far (0 for a
    direction whose jobs are issued from Python)."""
    counts = []
    for handler in (w._store, w._load):
        backend = handler._backend
        counts.append(backend.direct_copies() if isinstance(backend, NativeBackend) else 0)
    return counts[0], counts[1]
