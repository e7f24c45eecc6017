"""The reusable worker contract (kvoffload.testing) on the cuda backend, for every transfer path."""

from __future__ import annotations

import pytest
import torch

from kvoffload import Worker
from kvoffload.testing import check_worker_contract
from kvoffload import PathName
from tests.gpu._helpers import cache


@pytest.mark.parametrize("path", ["dma", "staged", "sm", "auto"])
def test_every_path_keeps_the_worker_contract(path: PathName, device: torch.device) -> None:
    layout = cache("kv-separate", device, num_blocks=128, layers=2)
    check_worker_contract(lambda: Worker.create(layout, 64, path=path))
