"""What a layer's span of many host records costs to move to the device, one way or another:
``python -m tests.gpu.probe_strided_copy`` (needs a GPU).

Not a test (nothing is asserted; pytest does not collect it): a measurement for layer-by-layer loads
(docs/design.md §12). A staged layered load DMAs one layer's span of each host record into a slot
of the staging ring: ``rows`` spans of ``width`` bytes, ``pitch`` bytes apart in the host pool (a
record holds every layer), packed in the slot. It compares, each next to one contiguous copy of the
same bytes:

* ``batch``: one descriptor per span in one ``cuMemcpyBatchAsync`` (what the issuer does);
* ``batch/4``: the same descriptors in four calls;
* ``2d``: one ``cuMemcpy2DAsync`` (``height`` = the spans, the host pitch and the slot's pitch).

Each figure is a median over ``--trials`` on an idle stream: the host's time inside the call, and
the device's time from an event recorded just before the call to one recorded after it (so the
call's own time counts wherever the copy waits for it).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from cuda.bindings import driver as drv

from kvoffload.bindings.copier import Copier
from kvoffload.bindings.driver import SrcAccessOrder, capabilities, check, entry_point
from kvoffload.native import MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, Memcpy2D

KIB = 1 << 10


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def measure(stream: torch.cuda.Stream, call: Callable[[], None], trials: int) -> tuple[float, float]:
    """Median host time inside ``call`` and device time around it, in µs."""
    host: list[float] = []
    device: list[float] = []
    for _ in range(trials + 2):
        stream.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(stream)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        end.record(stream)
        end.synchronize()
        host.append(t1 - t0)
        device.append(start.elapsed_time(end) * 1e-3)
    return _median_us(host[2:]), _median_us(device[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--widths-kib", default="8,64,512")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--directions", default="h2d,d2h")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    copier = Copier.create(capabilities(0))
    fn2d = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
        entry_point(b"cuMemcpy2DAsync", 12000))
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    for to_device in (d == "h2d" for d in args.directions.split(",")):
        print(f"== {args.rows} spans of a layer ({args.layers} layers a record), "
              f"{'host -> device' if to_device else 'device -> host'}; median µs of {args.trials}: "
              "host's time in the call / device's time around it")
        for width in (int(w) * KIB for w in args.widths_kib.split(",")):
            one_size(args, copier, fn2d, stream, to_device, width)
    return 0


def one_size(args: argparse.Namespace, copier: Copier, fn2d: Callable[[int, int], int],
             stream: torch.cuda.Stream, to_device: bool, width: int) -> None:
    """The variants for spans of ``width`` bytes in one direction, printed."""
    handle, order = stream.cuda_stream, SrcAccessOrder.STREAM
    pitch, rows = width * args.layers, args.rows
    host = torch.zeros(rows * pitch, dtype=torch.uint8).pin_memory()
    flat = torch.empty(rows * width, dtype=torch.uint8).pin_memory()
    slot = torch.empty(rows * width, dtype=torch.uint8, device=stream.device)
    (host if to_device else slot).random_(0, 255)
    hosts = np.array([host.data_ptr() + r * pitch for r in range(rows)], dtype=np.uint64)
    slots = np.array([slot.data_ptr() + r * width for r in range(rows)], dtype=np.uint64)
    srcs, dsts = (hosts, slots) if to_device else (slots, hosts)
    sizes = np.full(rows, width, dtype=np.uint64)
    quarter = max(1, rows // 4)
    if to_device:
        desc = Memcpy2D(srcMemoryType=MEMORYTYPE_HOST, srcHost=host.data_ptr(), srcPitch=pitch,
                        dstMemoryType=MEMORYTYPE_DEVICE, dstDevice=slot.data_ptr(), dstPitch=width,
                        WidthInBytes=width, Height=rows)
    else:
        desc = Memcpy2D(srcMemoryType=MEMORYTYPE_DEVICE, srcDevice=slot.data_ptr(), srcPitch=width,
                        dstMemoryType=MEMORYTYPE_HOST, dstHost=host.data_ptr(), dstPitch=pitch,
                        WidthInBytes=width, Height=rows)

    def batch() -> None:
        copier.copy(dsts, srcs, sizes, order, handle)

    def batch4() -> None:
        for s in range(0, rows, quarter):
            copier.copy(dsts[s:s + quarter], srcs[s:s + quarter], sizes[s:s + quarter], order, handle)

    def two_d() -> None:
        code = fn2d(ctypes.addressof(desc), handle)
        if code:
            raise RuntimeError(f"cuMemcpy2DAsync: {code}")

    def contiguous() -> None:
        src, dst = (flat, slot) if to_device else (slot, flat)
        check("cuMemcpyAsync", drv.cuMemcpyAsync(dst.data_ptr(), src.data_ptr(), rows * width, handle))

    figures: dict[str, tuple[float, float]] = {}
    for _ in range(2):  # the variants alternated twice; the second round kept
        for name, call in (("contiguous", contiguous), ("batch", batch), ("batch/4", batch4), ("2d", two_d)):
            figures[name] = measure(stream, call, args.trials)
    spans = host.view(rows, pitch)[:, :width]
    truth = spans.reshape(-1).clone() if to_device else slot.cpu()

    def result(call: Callable[[], None]) -> torch.Tensor:
        (slot if to_device else host).zero_()
        torch.cuda.synchronize()
        call()
        stream.synchronize()
        return slot.cpu() if to_device else spans.reshape(-1).clone()

    by_2d, by_batch = result(two_d), result(batch)
    print(f"-- spans of {width // KIB} KiB, pitch {pitch // KIB} KiB ({rows * width / (1 << 20):.1f} MiB); "
          f"bytes right: 2d {bool(torch.equal(by_2d, truth))}, batch {bool(torch.equal(by_batch, truth))}")
    ref = figures["contiguous"][1]
    for name, (h, d) in figures.items():
        print(f"   {name:<11} host {h:8.1f}  device {d:8.1f}  ({d / ref:.2f}x contiguous)")


if __name__ == "__main__":
    sys.exit(main())
