"""The reusable worker contract (kvoffload.testing) holds for the host backend, and it catches a
worker that breaks a clause."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvoffload import DeviceLayout, Direction, Worker
from kvoffload.cli._caches import build_cache
from kvoffload.backends.host import HostBackend
from kvoffload.testing import check_worker_contract


def make(backend: Callable[[Direction], HostBackend] = HostBackend) -> Worker:
    tensors, block_dim = build_cache("per-layer", num_blocks=64, layers=2, kv_heads=2, head_dim=32,
                                     block_size=4, dtype=torch.bfloat16, device=torch.device("cpu"))
    return Worker.create(DeviceLayout.from_tensors(tensors, block_dim=block_dim), 32,
                         backend_factory=backend)


def test_the_host_backend_keeps_the_worker_contract() -> None:
    check_worker_contract(make)


class DroppingBackend(HostBackend):
    """Broken on purpose: skips every other page."""

    count = 0

    def copy_one(self, dst: int, src: int, size: int) -> None:
        DroppingBackend.count += 1
        if DroppingBackend.count % 2:
            super().copy_one(dst, src, size)


def test_the_contract_catches_a_worker_that_drops_pages() -> None:
    with pytest.raises(AssertionError, match="round trip is bit-exact"):
        check_worker_contract(lambda: make(DroppingBackend))
