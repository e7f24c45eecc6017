"""The reusable worker contract (kvoffload.testing) on the cuda backend, for every transfer path,
and its held-job clause catching workers that break it (each control an engine's wrapper over a
real worker with one defect, which the suite's other clauses let through)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import attrs
import pytest
import torch

import kvoffload.testing
from kvoffload import LayerLoad, PathName, TransferResult, Worker
from kvoffload.testing import DeviceHold, check_worker_contract
from tests.gpu._helpers import cache
from tests.unit._wrappers import Wrapper

HELD = "a job held on the device keeps its deadlines, counters and layer order"
#: The hold's limit for the broken wrappers: a ``wait`` that ignores its timeout and a
#: ``wait_layer`` that blocks the host each return only when the hold ends (at the default 5 s
#: those two cases took 10 s of the GPU suite).
BROKEN_HOLD_LIMIT_S = 2.5


@pytest.mark.parametrize("path", ["dma", "staged", "sm", "auto"])
def test_every_path_keeps_the_worker_contract(path: PathName, device: torch.device) -> None:
    layout = cache("kv-separate", device, num_blocks=128, layers=2)
    assert layout.layers is not None  # the layer clauses run
    check_worker_contract(lambda: Worker.create(layout, 64, path=path))


class WaitIgnoresItsTimeout(Wrapper):
    """``wait`` waits as long as it takes (at least 30 s), whatever its timeout."""

    def wait(self, job_ids: Sequence[int], timeout: float) -> list[TransferResult]:
        return self.inner.wait(job_ids, max(timeout, 30.0))


class InFlightNotCounted(Wrapper):
    """``stats()`` counts no load in flight."""

    def stats(self) -> Any:
        s = self.inner.stats()
        return attrs.evolve(s, load=attrs.evolve(s.load, in_flight=0))


class _Layers:
    def __init__(self, inner: LayerLoad, *, skip: bool) -> None:
        self.inner, self.skip = inner, skip

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def wait_layer(self, i: int, stream: Any = None, *, timeout: float = 60.0) -> None:
        if self.skip:  # returns without ordering the stream
            return
        self.inner.wait_layer(i, stream, timeout=timeout)
        torch.cuda.synchronize()  # and then blocks the host until the device ran everything


class WaitLayerDoesNothing(Wrapper):
    """``wait_layer`` returns without making the stream wait."""

    def load_by_layer(self, *args: Any, **kwargs: Any) -> Any:
        return _Layers(self.inner.load_by_layer(*args, **kwargs), skip=True)


class WaitLayerBlocksTheHost(Wrapper):
    """``wait_layer`` orders the stream, then waits on the host for the device."""

    def load_by_layer(self, *args: Any, **kwargs: Any) -> Any:
        return _Layers(self.inner.load_by_layer(*args, **kwargs), skip=False)


@pytest.mark.parametrize(("wrapper", "what"), [
    (WaitIgnoresItsTimeout, r"returned \[2\] after .* s: it outlived its timeout"),
    (InFlightNotCounted, r"stats\(\)\.load\.in_flight rose by 0, not 1"),
    (WaitLayerDoesNothing, r"found layer 0 not landed"),
    (WaitLayerBlocksTheHost, r"wait_layer blocked the host"),
], ids=lambda v: getattr(v, "__name__", None))
def test_the_held_job_clause_catches_a_broken_wrapper(wrapper: type[Wrapper], what: str,
                                                      device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    # two of the defects hold the caller until the hold ends at its limit: a shorter one here
    monkeypatch.setattr(kvoffload.testing, "HOLD_LIMIT_S", BROKEN_HOLD_LIMIT_S)
    layout = cache("kv-separate", device, num_blocks=128, layers=2)
    with pytest.raises(AssertionError, match=rf"worker contract, '{HELD}': .*{what}"):
        check_worker_contract(lambda: cast(Worker, wrapper(Worker.create(layout, 64))), clauses=[HELD])


def test_a_cuda_layered_load_orders_its_streams_on_the_device(device: torch.device) -> None:
    layout = cache("kv-separate", device, num_blocks=64, layers=2)
    with Worker.create(layout, 16) as w:
        load = w.load_by_layer(1, [0, 1], [2, 3])
        assert load.on_device is True
        assert all(r.ok for r in w.wait([1], 60.0))


def test_a_device_hold_holds_a_stream_until_released_or_its_limit(device: torch.device) -> None:
    """Work behind the hold waits for the release, then runs; a hold never released ends at its limit."""
    x = torch.zeros(1, device=device)
    with DeviceHold(device, limit_s=60.0) as hold:
        with torch.cuda.stream(hold.stream):
            x.fill_(1.0)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        time.sleep(0.2)
        assert hold.held() and not done.query(), "work behind the hold ran before its release"  # type: ignore[no-untyped-call]
        hold.release()
    assert done.query() and x.item() == 1.0  # type: ignore[no-untyped-call]
    assert not hold.released_by_limit
    began = time.monotonic()
    with DeviceHold(device, limit_s=0.3) as hold:
        while hold.held() and time.monotonic() - began < 30:
            time.sleep(0.01)
    assert hold.released_by_limit and time.monotonic() - began >= 0.3
