"""The remote tier on a CUDA worker (pinned host pool): device -> host -> store -> host -> device is
bit-exact on every path, and a get that failed never reaches a device block. The store is the
in-memory one (the real store machinery); the real stores run against real services in
tests/remote and through ``python -m kvoffload bench --remote`` / ``replay --remote``."""

from __future__ import annotations

import pytest
import torch

from kvoffload import PathName, RemoteConfig, RemoteMissError, Worker
from kvoffload.testing import MemoryCluster
from tests.gpu._helpers import TIMEOUT_S, cache

BLOCKS = 32


@pytest.mark.parametrize("path", ["dma", "staged", "auto"])
def test_store_put_get_load_round_trip_is_bit_exact(path: PathName) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    layout = cache("per-layer", device, num_blocks=4 * BLOCKS)
    cluster = MemoryCluster(batch=8)
    with Worker.create(layout, 2 * BLOCKS, path=path, remote=RemoteConfig(store=cluster.factory)) as w:
        keys = [f"gpu-{i}".encode() for i in range(BLOCKS)]
        w.store(1, list(range(BLOCKS)), list(range(BLOCKS)))
        assert w.wait([1], TIMEOUT_S)[0].ok
        w.put_remote(2, list(range(BLOCKS)), keys)
        assert w.wait([2], TIMEOUT_S)[0].ok
        w.get_remote(3, keys, list(range(BLOCKS, 2 * BLOCKS)))
        assert w.wait([3], TIMEOUT_S)[0].ok
        w.load(4, list(range(BLOCKS, 2 * BLOCKS)), list(range(2 * BLOCKS, 3 * BLOCKS)))
        assert w.wait([4], TIMEOUT_S)[0].ok
        torch.cuda.synchronize(device)
        got = layout.gather_records(list(range(2 * BLOCKS, 3 * BLOCKS))).cpu()
        want = layout.gather_records(list(range(BLOCKS))).cpu()
        assert torch.equal(got, want)


def test_a_failed_get_is_never_loaded_as_valid() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    layout = cache("per-layer", device, num_blocks=8)
    with Worker.create(layout, 4, remote=RemoteConfig(store=MemoryCluster().factory)) as w:
        w.get_remote(1, [b"never-stored"], [0])
        (result,) = w.wait([1], TIMEOUT_S)
        assert isinstance(result.error, RemoteMissError)
        assert not w.host_records()[0].any(), "the failed key's host record is zero-filled"
