"""What the work before a layered load does to its copies: ``python -m tests.gpu.probe_copies_after``
(needs a GPU).

Not a test (nothing is asserted; pytest does not collect it): the measurement behind ``auto``'s
layered path (docs/design.md §16, *What slows a strided copy*). A layered load of ``--blocks``
records of ``--layers`` layers of K and V pages of ``--page-kib`` KiB, records and blocks in order,
moves through ``dma`` (direct strided copies) or ``staged`` right after other work, the device
idle between: a whole ``dma`` load (the copy engine only), a small kernel, a bf16 GEMM on another
stream, a whole ``staged`` load (its copy kernel on every SM), that load and then an idle pause,
and that load and then the copy engine writing 4 bytes every 2 MiB of the destination blocks
(their translations made the copy engine's again). The variants alternate round by round; each
prints its medians over ``--rounds`` (the first two rounds not counted): the layered load's call
to result on the host, its device time (``TransferResult.seconds``), when layer 0 and the last
layer landed (another stream waiting on each layer in turn, from an event recorded on it just
before the call), and the mean time a layer after layer 0.

``--part whole``: instead, whole jobs of the same bytes right after a whole ``dma`` load or after
the GEMM: a ``dma`` load and store into blocks in order (direct strided copies) and shuffled (a
descriptor a page), a ``staged`` load and store, and one pinned contiguous copy each way of the same
bytes (torch's ``copy_``); each one's call to result and device time (the pinned copy's from events
around it).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kvoffload import Worker
from kvoffload.cli._torch import new_event, new_stream
from kvoffload.cli.latency_bench import _per_layer

KIB = 1 << 10
MIB = 1 << 20
TIMEOUT_S = 60.0
#: Rounds measured first and not counted (calibration, warm-up).
WARMUP_ROUNDS = 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--page-kib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--part", choices=("layered", "whole"), default="layered")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_copies_after: no CUDA device", file=sys.stderr)
        return 2
    if min(args.blocks, args.layers, args.page_kib) < 1 or args.rounds <= WARMUP_ROUNDS:
        parser.error(f"--blocks, --layers and --page-kib must be >= 1, --rounds > {WARMUP_ROUNDS}")
    Probe(torch.device("cuda", torch.cuda.current_device()), args.blocks, args.layers,
          args.page_kib * KIB).run(args.rounds, args.part)
    return 0


class Probe:
    """The load's tensors, host records, workers (``dma`` and ``staged``) and the work put before
    a layered load. Owns its workers: :meth:`run` shuts them down."""

    def __init__(self, device: torch.device, blocks: int, layers: int, page: int) -> None:
        self.device, self.blocks, self.layers, self.page = device, blocks, layers, page
        self.layout, self.tensors = _per_layer(device, layers, page, 2 * blocks)
        self.src = np.arange(blocks, dtype=np.int64)
        self.dst, self.host = self.src + blocks, self.src.copy()
        self.waiting = new_stream(device)
        self.side = new_stream(device)
        self.operand = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        self.small = torch.empty(MIB, dtype=torch.uint8, device=device)
        self.pinned = torch.zeros(4, dtype=torch.uint8).pin_memory()
        self.jobs: Iterator[int] = iter(range(1, 1 << 62))
        self.host_copy = self.dev_copy = torch.empty(0, dtype=torch.uint8)  # --part whole's (whole_variants)
        self.shuffled = self.dst
        self.workers: dict[str, Worker] = {}
        try:
            for path in ("dma", "staged"):
                self.workers[path] = w = Worker.create(self.layout, 2 * blocks, path=path, issuer="native")
                w.store(0, self.src, self.host)
                if not w.wait([0], TIMEOUT_S)[0].ok:
                    raise RuntimeError("the store failed")
        except BaseException:
            self.shutdown()
            raise

    def whole(self, path: str) -> None:
        """A whole load of the same records into the same blocks, waited for."""
        torch.cuda.synchronize(self.device)
        job = next(self.jobs)
        self.workers[path].load(job, self.host, self.dst)
        (result,) = self.workers[path].wait([job], TIMEOUT_S)
        if not result.ok:
            raise RuntimeError(f"a whole load failed: {result.error}")

    def gemm(self, products: int) -> None:
        """``products`` 4096-square bf16 products on another stream."""
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.side):
            for _ in range(products):
                torch.mm(self.operand, self.operand)
        self.side.synchronize()

    def fill(self) -> None:
        """One small kernel: 1 MiB filled."""
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.side):
            self.small.fill_(1)
        self.side.synchronize()

    def touch(self, step: int) -> None:
        """The copy engine writes 4 bytes every ``step`` bytes of the destination blocks."""
        torch.cuda.synchronize(self.device)
        half = self.blocks * self.page  # one of K or V of the destination blocks, in a layer tensor
        with torch.cuda.stream(self.side):
            for tensor in self.tensors.values():
                flat = tensor.view(-1)
                for kv in (0, 1):
                    begin = kv * 2 * half + half
                    for offset in range(begin, begin + half, step):
                        flat[offset:offset + 4].copy_(self.pinned, non_blocking=True)
        self.side.synchronize()

    def layered(self, path: str) -> dict[str, float]:
        """A layered load timed: call -> result, device time, layer 0, the last, a layer (us)."""
        torch.cuda.synchronize(self.device)
        begin = new_event(timing=True)
        landed = [new_event(timing=True) for _ in range(self.layers)]
        w, job = self.workers[path], next(self.jobs)
        begin.record(self.waiting)
        t0 = time.perf_counter()
        load = w.load_by_layer(job, self.host, self.dst, stream=self.waiting)
        for i in range(self.layers):
            load.wait_layer(i, self.waiting)
            landed[i].record(self.waiting)
        (result,) = w.wait([job], TIMEOUT_S)
        total = time.perf_counter() - t0
        if not result.ok:
            raise RuntimeError(f"a layered load failed: {result.error}")
        landed[-1].synchronize()
        at = [float(begin.elapsed_time(e)) * 1e3 for e in landed]
        return {"call -> result": total * 1e6, "device": result.seconds * 1e6, "layer 0": at[0],
                "last layer": at[-1], "a layer": (at[-1] - at[0]) / max(1, self.layers - 1)}

    def timed_job(self, path: str, store: bool, shuffled: bool) -> dict[str, float]:
        """A whole load or store timed: call -> result and device time (us)."""
        torch.cuda.synchronize(self.device)
        w, job = self.workers[path], next(self.jobs)
        blocks = self.shuffled if shuffled else self.dst
        t0 = time.perf_counter()
        if store:
            w.store(job, blocks, self.host)
        else:
            w.load(job, self.host, blocks)
        (result,) = w.wait([job], TIMEOUT_S)
        total = time.perf_counter() - t0
        if not result.ok:
            raise RuntimeError(f"a whole job failed: {result.error}")
        return {"call -> result": total * 1e6, "device": result.seconds * 1e6}

    def pinned_copy(self, store: bool) -> dict[str, float]:
        """One pinned contiguous copy of the job's bytes, timed: call -> synchronized, and events."""
        torch.cuda.synchronize(self.device)
        begin, end = new_event(timing=True), new_event(timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.side):
            begin.record(self.side)
            if store:
                self.host_copy.copy_(self.dev_copy, non_blocking=True)
            else:
                self.dev_copy.copy_(self.host_copy, non_blocking=True)
            end.record(self.side)
        end.synchronize()
        return {"call -> result": (time.perf_counter() - t0) * 1e6, "device": float(begin.elapsed_time(end)) * 1e3}

    def whole_variants(self) -> dict[str, Callable[[], dict[str, float]]]:
        """Each whole job after a whole ``dma`` load (the copy engine only) and after the GEMM."""
        nbytes = self.blocks * self.layers * 2 * self.page
        self.host_copy = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.dev_copy = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.shuffled = self.blocks + np.random.default_rng(7).permutation(self.blocks).astype(np.int64)
        jobs: dict[str, Callable[[], dict[str, float]]] = {}
        for way, store in (("load", False), ("store", True)):
            def of(path: str, shuffled: bool, store: bool = store) -> Callable[[], dict[str, float]]:
                return lambda: self.timed_job(path, store, shuffled)
            jobs[f"dma {way}, in order"] = of("dma", False)
            jobs[f"dma {way}, shuffled"] = of("dma", True)
            jobs[f"staged {way}"] = of("staged", False)
            jobs[f"pinned copy {way}"] = functools.partial(self.pinned_copy, store)
        variants: dict[str, Callable[[], dict[str, float]]] = {}
        for name, job in jobs.items():
            variants[f"dma load -> {name}"] = _after(job, lambda: self.whole("dma"))
            variants[f"GEMM -> {name}"] = _after(job, lambda: self.whole("dma"), lambda: self.gemm(5))
        return variants

    def variants(self) -> dict[str, Callable[[], dict[str, float]]]:
        """Each variant: the work before, then the layered load."""
        def after(path: str, *before: Callable[[], None]) -> Callable[[], dict[str, float]]:
            return _after(functools.partial(self.layered, path), *before)

        return {
            "dma load -> dma layered": after("dma", lambda: self.whole("dma")),
            "1 MiB fill -> dma layered": after("dma", lambda: self.whole("dma"), self.fill),
            "GEMM (5 products) -> dma layered": after("dma", lambda: self.whole("dma"), lambda: self.gemm(5)),
            "staged load -> dma layered": after("dma", lambda: self.whole("staged")),
            "staged load, 5 ms idle -> dma layered": after("dma", lambda: self.whole("staged"),
                                                           lambda: time.sleep(0.005)),
            "staged load, engine touch -> dma layered": after("dma", lambda: self.whole("staged"),
                                                              lambda: self.touch(2 * MIB)),
            "dma load -> staged layered": after("staged", lambda: self.whole("dma")),
            "GEMM (5 products) -> staged layered": after("staged", lambda: self.whole("dma"), lambda: self.gemm(5)),
        }

    def run(self, rounds: int, part: str = "layered") -> None:
        """Every variant of ``part`` ``rounds`` times, alternated; print the medians; shut the
        workers down."""
        try:
            variants = self.variants() if part == "layered" else self.whole_variants()
            figures: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
            for r in range(rounds):
                for name, variant in variants.items():
                    got = variant()
                    if r >= WARMUP_ROUNDS:
                        for key, value in got.items():
                            figures[name].setdefault(key, []).append(value)
            print(f"{torch.cuda.get_device_name(self.device)}: {self.blocks} records of {self.layers} "
                  f"layers of K and V pages of {self.page // KIB} KiB, in order; medians over "
                  f"{rounds - WARMUP_ROUNDS} rounds, us")
            for name, values in figures.items():
                print(f"  {name:42s} " + "; ".join(f"{key} {statistics.median(v):7.1f}" for key, v in values.items()))
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Shut every worker made so far down (each once)."""
        while self.workers:
            self.workers.popitem()[1].shutdown(TIMEOUT_S)


def _after(measure: Callable[[], dict[str, float]], *before: Callable[[], None]) -> Callable[[], dict[str, float]]:
    """A variant: the steps of ``before`` in order, then ``measure``'s figures."""
    def run() -> dict[str, float]:
        for step in before:
            step()
        return measure()
    return run


if __name__ == "__main__":
    sys.exit(main())
