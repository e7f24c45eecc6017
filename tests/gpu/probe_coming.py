"""Whether telling a busy issuer thread that a caller is coming shortens the caller's time.

``python -m tests.gpu.probe_coming [rounds]`` (needs CUDA): ``bench --latency``'s caller's-time
rows (256-block stores and loads in bursts of four) and the transfer bench's back-to-back rates at
4 KiB pages, with ``CALLER_COMING_S`` at 0 (the thread is not told) and at its default, alternated
round by round in one process so that the host's drift falls on both alike.
"""

from __future__ import annotations

import sys

import torch

import kvoffload.backends.native as native_backend
from kvoffload.cli import bench, latency_bench

DEFAULT = native_backend.CALLER_COMING_S


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    device = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name(device)}; CALLER_COMING_S default {DEFAULT * 1e6:.0f} us", flush=True)
    for r in range(rounds):
        for coming in (0.0, DEFAULT):
            setattr(native_backend, "CALLER_COMING_S", coming)
            for path in ("auto", "dma"):
                for row in latency_bench.caller_time(device, path, 50):
                    print(f"round {r} coming {coming * 1e6:3.0f} us {row}", flush=True)
            got = bench.measure_path(device, 4096, "auto", 1 << 30, None, sys.stderr)
            assert got.mismatched_blocks == 0
            print(f"round {r} coming {coming * 1e6:3.0f} us back to back 4 KiB auto: store "
                  f"{got.store_gbps:.1f} load {got.load_gbps:.1f} both {got.both_gbps:.1f} GB/s", flush=True)
    setattr(native_backend, "CALLER_COMING_S", DEFAULT)


if __name__ == "__main__":
    main()
