"""What a layered load's structure costs the copy engine: ``python -m tests.gpu.probe_layer_marks``
(needs a GPU).

Not a test (nothing is asserted; pytest does not collect it): a measurement for layer-by-layer
loads through direct strided copies (docs/design.md §16, *Direct strided copies*). ``bench
--layerwise`` had such a load of 16 layers take 5-7% longer from its call to its last layer than
the same bytes as one job. Two parts, each variant's device time a median over ``--rounds``, the
variants alternated round by round:

* **The driver alone.** ``--blocks`` host records of ``--layers`` layers of K and V pages of
  ``--page-kib`` KiB move into per-layer device tensors as one ``cuMemcpy2DAsync`` per layer's K and
  V (what the native issuer's ``dma`` plans make of records and blocks in order): with no event
  between layers, with an event recorded after each layer (the layer marks), with another stream
  waiting on each mark, and in halves; each next to one contiguous copy of the same bytes, and the
  contiguous copy and the strided copies again with a GEMM running beside them on another stream
  (a prefill's compute).
* **The library.** The same load through a :class:`~kvoffload.Worker` of path ``dma`` and of
  ``staged``, four ways alternated: as one job (``load``), and layered (``load_by_layer``) on the
  default stream with another stream waiting on every layer, on a stream of its own with that
  stream waiting on the last layer only, and on that stream waiting on every layer (as a prefill
  does). Each way's time from the call to its result on the host, ``TransferResult.seconds`` (the
  job's device time from its start event to its end event) and, for the layered ones, the device's
  time from an event recorded on the waiting stream just before the call to that stream passing
  the last layer's wait. ``--parts`` picks the parts to run.
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

from kvoffload import DeviceLayout, Worker
from kvoffload.bindings.driver import check, entry_point
from kvoffload.cli._torch import new_event, new_stream
from kvoffload.native import MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, Memcpy2D

KIB = 1 << 10
TIMEOUT_S = 60.0
PARTS = frozenset({"driver", "library"})

#: A layered way's events on its waiting stream: before the call, and after the last layer's wait.
WayEvents = tuple[torch.cuda.Event, torch.cuda.Event] | None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--page-kib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--parts", default="driver,library",
                        help="the parts to run, comma-separated: driver, library")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= PARTS:
        unknown, known = ", ".join(sorted(parts - PARTS)), ", ".join(sorted(PARTS))
        parser.error(f"--parts: {unknown} is not one of {known}")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print(f"probe_layer_marks on {torch.cuda.get_device_name(device)}: {args.blocks} records of "
          f"{args.layers} layers x (K, V) pages of {args.page_kib} KiB, host -> device; median of "
          f"{args.rounds} rounds, the variants alternated")
    if "driver" in parts:
        driver_alone(args, device)
    if "library" in parts:
        library(args, device)
    return 0


def driver_alone(args: argparse.Namespace, device: torch.device) -> None:
    """The first part (see the module docstring), printed."""
    layers, blocks, page = args.layers, args.blocks, args.page_kib * KIB
    record = layers * 2 * page
    fn2d = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
        entry_point(b"cuMemcpy2DAsync", 12000))
    host = torch.randint(0, 255, (blocks * record,), dtype=torch.uint8).pin_memory()
    flat = torch.empty(blocks * record, dtype=torch.uint8).pin_memory()
    whole = torch.empty(blocks * record, dtype=torch.uint8, device=device)
    tensors = [torch.zeros(2, blocks, page, dtype=torch.uint8, device=device) for _ in range(layers)]
    copy, other, beside = new_stream(device), new_stream(device), new_stream(device)
    marks = [new_event(timing=False) for _ in range(layers)]

    def desc(layer: int, kv: int, first: int, rows: int) -> Memcpy2D:
        return Memcpy2D(srcMemoryType=MEMORYTYPE_HOST, srcHost=host.data_ptr() + first * record
                        + (layer * 2 + kv) * page, srcPitch=record, dstMemoryType=MEMORYTYPE_DEVICE,
                        dstDevice=tensors[layer][kv].data_ptr() + first * page, dstPitch=page,
                        WidthInBytes=page, Height=rows)

    def plans(parts: int) -> list[list[Memcpy2D]]:
        rows = blocks // parts
        return [[desc(layer, kv, p * rows, rows) for kv in range(2) for p in range(parts)]
                for layer in range(layers)]

    one, halves = plans(1), plans(2)

    def strided(by_layer: list[list[Memcpy2D]], mark: bool, wait: bool) -> Callable[[], None]:
        def run() -> None:
            for layer, copies in enumerate(by_layer):
                for d in copies:
                    code = fn2d(ctypes.addressof(d), copy.cuda_stream)
                    if code:
                        raise RuntimeError(f"cuMemcpy2DAsync: {code}")
                if mark:
                    marks[layer].record(copy)
                    if wait:
                        other.wait_event(marks[layer])
        return run

    def contiguous() -> None:
        check("cuMemcpyAsync", drv.cuMemcpyAsync(whole.data_ptr(), flat.data_ptr(), blocks * record,
                                                 copy.cuda_stream))

    gemm = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(gemm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(beside):
        for _ in range(3):
            torch.matmul(gemm, gemm, out=out)
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph, stream=beside):
        for _ in range(40):
            torch.matmul(gemm, gemm, out=out)
    begin, end = new_event(timing=True), new_event(timing=True)
    begin.record(beside)
    graph.replay()
    end.record(beside)
    end.synchronize()
    per_graph = float(begin.elapsed_time(end))

    def with_gemm(call: Callable[[], None], replays: int) -> Callable[[], None]:
        def run() -> None:
            with torch.cuda.stream(beside):
                for _ in range(replays):
                    graph.replay()
            call()
        return run

    variants: dict[str, Callable[[], None]] = {
        "one contiguous copy": contiguous,
        f"{2 * layers} strided copies": strided(one, False, False),
        f"{2 * layers} strided copies, a mark a layer": strided(one, True, False),
        "  the same, another stream waiting on each": strided(one, True, True),
        f"{4 * layers} strided copies (halves), a mark a layer": strided(halves, True, False),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2 + args.rounds):
        for name, call in variants.items():
            times[name].append(_device_ms(copy, call, device))
    load_ms = statistics.median(times["one contiguous copy"][2:])
    replays = max(1, int(1.5 * load_ms / per_graph) + 1)
    gemmed = {
        "one contiguous copy, GEMM beside": with_gemm(contiguous, replays),
        f"{2 * layers} strided copies, GEMM beside": with_gemm(strided(one, False, False), replays),
        f"{2 * layers} strided copies, a mark a layer, GEMM beside": with_gemm(strided(one, True, False), replays),
    }
    for name in gemmed:
        times[name] = []
    for _ in range(2 + args.rounds):
        for name, call in gemmed.items():
            times[name].append(_device_ms(copy, call, device))
    print(f"== the driver alone ({blocks * record / (1 << 20):.0f} MiB; the GEMM beside: {replays} "
          f"graphs of 40 2048-square products, {per_graph:.2f} ms each)")
    for name, samples in times.items():
        ms = statistics.median(samples[2:])
        print(f"   {name:<56} {ms:7.3f} ms ({ms / load_ms:.3f}x the contiguous copy alone; "
              f"range {min(samples[2:]):.3f}-{max(samples[2:]):.3f})")
    strided(one, True, False)()
    copy.synchronize()
    right = all(torch.equal(tensors[layer][kv].cpu(),
                            host.view(blocks, record)[:, (layer * 2 + kv) * page:(layer * 2 + kv + 1) * page])
                for layer in range(layers) for kv in range(2))
    print(f"   bytes right: {right}")


def _device_ms(stream: torch.cuda.Stream, call: Callable[[], None], device: torch.device) -> float:
    """Milliseconds between events recorded on ``stream`` just before and after ``call`` (the
    device idle before)."""
    torch.cuda.synchronize(device)
    begin, end = new_event(timing=True), new_event(timing=True)
    begin.record(stream)
    call()
    end.record(stream)
    end.synchronize()
    return float(begin.elapsed_time(end))


def library(args: argparse.Namespace, device: torch.device) -> None:
    """The second part (see the module docstring), printed."""
    layers, blocks, page = args.layers, args.blocks, args.page_kib * KIB
    tensors = {f"layer{i}": torch.zeros(2, 2 * blocks, page, dtype=torch.uint8, device=device)
               for i in range(layers)}
    layout = DeviceLayout.from_tensors(tensors, block_dim=1, num_blocks=2 * blocks)
    src = np.arange(blocks, dtype=np.int64)
    dst = src + blocks
    waiter, compute = new_stream(device), new_stream(device)
    print("== the library, four ways alternated: call -> result (host), TransferResult.seconds (the "
          "job's device time from its start event to its end event) and, for the layered ones, from "
          "an event recorded on the stream the load follows just before the call to that stream "
          "passing the last layer's wait; median ms")
    for path in ("dma", "staged"):
        with Worker.create(layout, 2 * blocks, path=path, issuer="native") as w:
            w.store(0, src, src)
            if not all(r.ok for r in w.wait([0], TIMEOUT_S)):
                raise RuntimeError("the store failed")
            job = 1

            def whole() -> WayEvents:
                w.load(job, src, dst)
                return None

            def layered(on: torch.cuda.Stream | None, every: bool) -> Callable[[], WayEvents]:
                def run() -> WayEvents:
                    target = waiter if on is None else on
                    begin, done = new_event(timing=True), new_event(timing=True)
                    begin.record(target)
                    load = w.load_by_layer(job, src, dst, stream=on)
                    for i in range(layers) if every else (layers - 1,):
                        load.wait_layer(i, target)
                    done.record(target)
                    return begin, done  # read after the result came: no host wait inside the timing
                return run

            ways: dict[str, Callable[[], WayEvents]] = {
                "whole (load)": whole,
                "layered, default stream, every layer waited": layered(None, True),
                "layered on a stream, the last layer waited": layered(compute, False),
                "layered on a stream, every layer waited": layered(compute, True),
            }
            rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
            paths: dict[str, set[str]] = {name: set() for name in ways}
            for _ in range(2 + args.rounds):
                for name, call in ways.items():
                    torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    events = call()
                    (r,) = w.wait([job], TIMEOUT_S)
                    host = time.perf_counter() - t0
                    if not r.ok:
                        raise RuntimeError(f"a load failed: {r.error}")
                    to_last = 0.0
                    if events is not None:
                        events[1].synchronize()
                        to_last = float(events[0].elapsed_time(events[1]))
                    rows[name].append((host * 1e3, r.seconds * 1e3, to_last))
                    paths[name].add(r.path)
                    job += 1
            print(f"   worker path {path}")
            for name, samples in rows.items():
                kept = samples[2:]
                h, d, t = (statistics.median(x[k] for x in kept) for k in range(3))
                print(f"     {name:<46} call -> result {h:6.3f}  device {d:6.3f}"
                      + (f"  stream before the call -> last layer {t:6.3f}" if t else "")
                      + f"  (took {', '.join(sorted(paths[name]))})")


if __name__ == "__main__":
    sys.exit(main())
