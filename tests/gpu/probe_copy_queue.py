"""Whether a small host-to-device copy on one stream waits for the copies of the same direction
issued just before it on another stream: ``python -m tests.gpu.probe_copy_queue`` (needs a GPU).

Not a test (nothing is asserted; pytest does not collect it): the measurement behind the expedited
lane's default path (docs/design.md §4, *A lane no copy engine holds*). Plain torch copies, no
kvoffload: 64 MiB of pinned host memory goes to the device on stream A as 0 (nothing in the way), 1,
8 or 32 copies, then a 2 MiB copy on stream B (priority 0, then -1); printed is the
median, over ``--trials``, of B's copy from its call to B synchronized. If the copy engine took the
copies of several streams in turns, B would finish in about its time alone; if it takes one
direction's copies in the order they came, B takes about the time of A's 64 MiB.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    """Print one row per (B's priority, A's copy count)."""
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.probe_copy_queue", description=__doc__)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.empty(64 * MIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
    small_host = torch.empty(2 * MIB, dtype=torch.uint8, pin_memory=True)
    small_dev = torch.empty(2 * MIB, dtype=torch.uint8, device=device)
    print(f"{torch.cuda.get_device_name(device)}: a 2 MiB host-to-device copy on stream B right after "
          f"64 MiB of host-to-device copies on stream A (median of {args.trials})")
    for priority in (0, -1):  # the default, and a higher one (CUDA: lower numbers go first)
        a = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        b = torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]
        for copies in (0, 1, 8, 32):
            step = 64 * MIB // max(copies, 1)
            times = []
            for trial in range(args.trials + 1):
                torch.cuda.synchronize(device)
                with torch.cuda.stream(a):
                    for i in range(copies):
                        dev[i * step:(i + 1) * step].copy_(host[i * step:(i + 1) * step], non_blocking=True)
                began = time.perf_counter()
                with torch.cuda.stream(b):
                    small_dev.copy_(small_host, non_blocking=True)
                b.synchronize()
                if trial:  # the first warms up
                    times.append(time.perf_counter() - began)
            print(f"  B's priority {priority:2d}, A's 64 MiB as {copies:2d} copies: "
                  f"{statistics.median(times) * 1e6:8.1f} us")
    torch.cuda.synchronize(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
