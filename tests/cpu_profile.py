"""What a native job costs its caller on a machine without a GPU (``python -m tests.cpu_profile``).

The native issuer runs over a no-op driver compiled here (every driver call returns at once; an
event completes ``DEVICE_US`` after its record), so what is timed is the library's and Python's own
work on the caller's thread (``NAME=VALUE`` arguments set constants of
:mod:`kvoffload.backends.native` first, e.g. ``EXPECT_SPIN_S=0 CALLER_COMING_S=0``): the call of a 256-block store in bursts of 4 (the first after a wait,
and jobs 2-4), a 1-block store's call -> result, the wait of a job already done, the 256-block
store's first call and later ones through the worker, one flat function of the same steps and the
library's calls alone (``profile_submit``'s ``floor``), a 256-block load's call -> result as one
job and layer by layer (:func:`layered_alone`); then the Python functions those calls run (cProfile,
by own time). Device time is spent on none of it, so
a change to the submit or result path can be measured here first, side by side with the tree it
changes (run both in one session; the CI machine's spread between runs is large). Figures here are
the host's, not the H200 host's: only ratios between builds measured together mean anything.
"""

from __future__ import annotations

import contextlib
import cProfile
import ctypes
import io
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kvoffload import DeviceLayout, Worker, native
from kvoffload.backends.native import NativeBackend, tune
from kvoffload.records import Direction
from tests.gpu.profile_submit import floor_rows, print_floor
from tests.unit._native_fake import FUNCTIONS

#: The no-op driver's device time of every job (from an event's record to its completion).
DEVICE_US = 50
LAYERS = 32
PAGE = 16 * 1024
BLOCKS = 1024
COPY, KERNEL, COMPUTE = 0x1000, 0x2000, 0x3000

_DRIVER = r"""
#include <stdint.h>
#include <time.h>
typedef int CUresult;
enum { NOT_READY = 600, EVENTS = 1 << 16 };
static int64_t due[EVENTS];
static uint64_t next_event = 1;
static int64_t device_ns;
static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
void noop_device_ns(int64_t ns) { device_ns = ns; }
CUresult noop_ctx_set(void *c) { (void)c; return 0; }
CUresult noop_ctx_get(void **c) { *c = 0; return 0; }
CUresult noop_event_create(uint64_t *out, unsigned f) {
    (void)f; *out = __atomic_fetch_add(&next_event, 1, __ATOMIC_RELAXED) % EVENTS; return 0;
}
CUresult noop_event_destroy(uint64_t e) { (void)e; return 0; }
CUresult noop_event_record(uint64_t e, void *s) {
    (void)s; __atomic_store_n(&due[e % EVENTS], now_ns() + device_ns, __ATOMIC_RELEASE); return 0;
}
CUresult noop_event_query(uint64_t e) {
    return now_ns() >= __atomic_load_n(&due[e % EVENTS], __ATOMIC_ACQUIRE) ? 0 : NOT_READY;
}
CUresult noop_event_elapsed(float *ms, uint64_t a, uint64_t b) {
    (void)a; (void)b; *ms = (float)device_ns / 1e6f; return 0;
}
CUresult noop_stream_wait(void *s, uint64_t e, unsigned f) { (void)s; (void)e; (void)f; return 0; }
CUresult noop_memcpy(uint64_t d, uint64_t s, size_t n, void *st) { (void)d; (void)s; (void)n; (void)st; return 0; }
CUresult noop_batch(void *d, void *s, void *n, size_t c, void *a, void *i, size_t na, void *st) {
    (void)d; (void)s; (void)n; (void)c; (void)a; (void)i; (void)na; (void)st; return 0;
}
CUresult noop_memcpy2d(void *p, void *st) { (void)p; (void)st; return 0; }
CUresult noop_launch(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
                     unsigned h, void *s, void *p, void *x) {
    (void)f; (void)a; (void)b; (void)c; (void)d; (void)e; (void)g; (void)h; (void)s; (void)p; (void)x;
    return 0;
}
"""


def _driver() -> ctypes.CDLL:
    """The no-op driver, compiled into a temporary directory (removed once loaded)."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-noop-") as scratch:
        source, library = Path(scratch) / "noop.c", Path(scratch) / "noop.so"
        source.write_text(_DRIVER)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True,
                       timeout=120)
        lib = ctypes.CDLL(str(library))
    lib.noop_device_ns(ctypes.c_int64(DEVICE_US * 1000))
    return lib


class _Inner:
    """What the native backend takes over: streams are ints, the default one the compute stream."""

    path = "dma"

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.device = torch.device("cpu")

    def stream_handle(self, stream: object | None) -> int:
        return COMPUTE if stream is None else int(stream)  # type: ignore[call-overload]

    def release(self) -> None:
        pass


def _worker(lib: ctypes.CDLL, keep: list[object], backends: list[NativeBackend] | None = None) -> Worker:
    """A worker of LAYERS K and V tensors of PAGE-byte pages, both directions native over ``lib``
    (each direction's backend appended to ``backends`` where given)."""
    def entry(name: str) -> int:
        return int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)

    def factory(direction: Direction) -> Any:
        c = native.Config()
        for field, name in (("ctx_set_current", "noop_ctx_set"), ("ctx_get_current", "noop_ctx_get"),
                            ("event_create", "noop_event_create"), ("event_destroy", "noop_event_destroy"),
                            ("event_record", "noop_event_record"), ("event_query", "noop_event_query"),
                            ("event_elapsed", "noop_event_elapsed"), ("stream_wait_event", "noop_stream_wait"),
                            ("memcpy_async", "noop_memcpy"), ("memcpy_batch", "noop_batch"),
                            ("launch", "noop_launch"), ("memcpy_2d", "noop_memcpy2d")):
            setattr(c, field, entry(name))
        c.batch_abi = 13000
        for i, (function, rows) in enumerate(FUNCTIONS):
            c.functions[i] = function
            c.function_rows[i] = rows
        c.nfunctions, c.threads = len(FUNCTIONS), 512
        c.copy_stream, c.kernel_stream = COPY, KERNEL
        c.store = int(direction is Direction.STORE)
        c.sm_ctas, c.staged_ctas = 8, 132
        bases = (ctypes.c_uint64 * 1)(0)
        keep.append(bases)
        c.slot_bases = ctypes.cast(bases, ctypes.c_void_p)
        tune(c)  # the library's constants, as set for this run
        backend = NativeBackend.start(_Inner(direction), c, index=0, choose=lambda _n: "dma",
                                      path_names={"dma": "dma"}, tables=None, keep=keep)
        if backends is not None:
            backends.append(backend)
        return backend

    tensors = {f"{side}{layer}": torch.empty(BLOCKS, PAGE, dtype=torch.uint8)
               for layer in range(LAYERS) for side in "kv"}  # LAYERS layers of a K and a V tensor
    keep.append(tensors)
    layout = DeviceLayout.from_tensors(tensors, block_dim=0)
    return Worker.create(layout, BLOCKS, backend_factory=factory)


class SharedRun(NamedTuple):
    """What :func:`shared_cpu_run` measured."""

    calls: list[float]  #: each call's seconds
    results: list[float]  #: each call -> result, seconds
    yields: tuple[int, int, int]  #: kvo_issuer_yields summed over the directions


def shared_cpu_run(lib: ctypes.CDLL, *, share: bool, together: bool, jobs: int) -> SharedRun:
    """Stores of 256 blocks, one at a time after a 1 ms sleep, the caller's thread on one CPU and
    the worker's threads on the same CPU (``together``) or on another, with
    :data:`kvoffload.backends.native.SHARE_CPU` set to ``share``: each call's seconds, each call ->
    result, and the issuers' yields summed (``kvo_issuer_yields``: the thread to its caller,
    waiters for a job not issued, the issuing side's spins). The caller's affinity, the constant's
    value and the affinity of threads made meanwhile that outlive the run are restored. Linux
    only."""
    from kvoffload.backends import native as nb

    mine, saved = os.sched_getaffinity(0), nb.SHARE_CPU
    cpus = sorted(mine)
    before = set(os.listdir("/proc/self/task"))
    setattr(nb, "SHARE_CPU", share)  # read by tune() as each issuer is made
    # The worker's threads inherit this thread's CPU as they are made, so they never run (and note
    # a CPU) elsewhere; then this thread goes to the first CPU.
    os.sched_setaffinity(0, {cpus[0] if together else cpus[-1]})
    calls: list[float] = []
    results: list[float] = []
    counts = [0, 0, 0]
    try:
        keep: list[object] = []
        backends: list[NativeBackend] = []
        w = _worker(lib, keep, backends)
        try:
            os.sched_setaffinity(0, {cpus[0]})
            blocks = np.arange(256, dtype=np.int64)
            for job in range(jobs):
                time.sleep(0.001)
                t0 = time.perf_counter()
                w.store(job, blocks, blocks)
                t1 = time.perf_counter()
                (result,) = w.wait([job], 60)
                results.append(time.perf_counter() - t0)
                calls.append(t1 - t0)
                if not result.ok:
                    raise RuntimeError(f"job {job} failed: {result.error}")
            for backend in backends:
                out = (ctypes.c_int64 * 3)()
                backend.lib.kvo_issuer_yields(backend._issuer, out)  # noqa: SLF001
                counts = [c + int(v) for c, v in zip(counts, out)]
        finally:
            w.shutdown(60)
    finally:
        os.sched_setaffinity(0, mine)
        setattr(nb, "SHARE_CPU", saved)
        for tid in set(os.listdir("/proc/self/task")) - before:
            with contextlib.suppress(OSError):  # ended meanwhile
                os.sched_setaffinity(int(tid), mine)
    return SharedRun(calls, results, (counts[0], counts[1], counts[2]))


#: Rounds of :func:`layered_alone` (a whole load and a layered one each) and the device time of
#: each of their jobs, from an event's record to its completion.
LAYERED_ROUNDS = 40
LAYERED_DEVICE_US = 5000


def layered_alone(lib: ctypes.CDLL, w: Worker, first_job: int) -> int:
    """Print a 256-block load's call -> result (and the call alone) as one job and layer by layer
    (``load_by_layer``, no wait on a layer), alternated, each after a 2 ms sleep, with the no-op
    driver's device time at LAYERED_DEVICE_US (put back to DEVICE_US after): an event of the layered
    job's end is recorded after its last layer's copies are issued, so what the layered load adds
    here is the library's host side, its whole issue included (on a GPU the copies run while later
    layers are issued). Returns the next free job id."""
    blocks = np.arange(256, dtype=np.int64)
    times: dict[str, list[float]] = {"whole": [], "layered": []}  # call -> result
    calls: dict[str, list[float]] = {"whole": [], "layered": []}  # the call alone
    paths: set[str] = set()
    job = first_job
    lib.noop_device_ns(ctypes.c_int64(LAYERED_DEVICE_US * 1000))
    try:
        for _ in range(LAYERED_ROUNDS):
            for name in times:
                time.sleep(0.002)
                t0 = time.perf_counter()
                if name == "whole":
                    w.load(job, blocks, blocks)
                else:
                    w.load_by_layer(job, blocks, blocks)
                calls[name].append(time.perf_counter() - t0)
                (result,) = w.wait([job], 60)
                times[name].append(time.perf_counter() - t0)
                if not result.ok:
                    raise RuntimeError(f"load {job} failed: {result.error}")
                paths.add(result.path)
                job += 1
    finally:
        lib.noop_device_ns(ctypes.c_int64(DEVICE_US * 1000))
    whole, layered = (statistics.median(times[name][5:]) for name in ("whole", "layered"))
    whole_call, layered_call = (statistics.median(calls[name][5:]) for name in ("whole", "layered"))
    print(f"\na load of 256 blocks x {LAYERS} layers (K, V) as one job and layer by layer, call -> result, "
          f"alternated (device {LAYERED_DEVICE_US} us a job; path {', '.join(sorted(paths))}): "
          f"whole {whole * 1e6:7.1f} us, layered {layered * 1e6:7.1f} us (+ {(layered - whole) * 1e6:.1f}); "
          f"the caller's time in load {whole_call * 1e6:6.1f} us, in load_by_layer {layered_call * 1e6:6.1f} us "
          "(medians)")
    return job


def _us(samples: list[float]) -> str:
    ordered = sorted(samples)
    return (f"median {statistics.median(ordered) * 1e6:7.1f} us, "
            f"p90 {ordered[int(0.9 * (len(ordered) - 1))] * 1e6:7.1f} us")


def main() -> int:
    """Set the constants given, then measure and print (see the module docstring)."""
    from kvoffload.backends import native as nb
    for setting in sys.argv[1:]:  # NAME=VALUE: a constant of kvoffload.backends.native, for A/B runs
        name, _, value = setting.partition("=")
        if not hasattr(nb, name) or not value:
            print(f"usage: python -m tests.cpu_profile [NAME=VALUE ...] (NAME one of {nb.__all__})",
                  file=sys.stderr)
            return 2
        setattr(nb, name, type(getattr(nb, name))(float(value)))
        print(f"{name} = {getattr(nb, name)}")
    keep: list[object] = []
    lib = _driver()
    w = _worker(lib, keep)
    try:
        job = 0
        first: list[float] = []
        rest: list[float] = []
        for _ in range(60):  # bursts of 4 stores of 256 blocks, each burst after the last finished
            ids = []
            for k in range(4):
                blocks = np.arange(k * 256, (k + 1) * 256, dtype=np.int64)
                t0 = time.perf_counter()
                w.store(job, blocks, blocks)
                (first if k == 0 else rest).append(time.perf_counter() - t0)
                ids.append(job)
                job += 1
            w.wait(ids, 60)
            time.sleep(0.001)
        print(f"caller's time per store of 256 blocks x {2 * LAYERS} pages: first of a burst {_us(first[5:])}")
        print(f"                                                 jobs 2-4 {_us(rest[15:])}")
        one = np.arange(1, dtype=np.int64)
        whole: list[float] = []
        waits: list[float] = []
        for _ in range(300):
            time.sleep(0.001)
            t0 = time.perf_counter()
            w.store(job, one, one)
            w.wait([job], 60)
            whole.append(time.perf_counter() - t0)
            job += 1
            w.store(job, one, one)
            time.sleep(0.002)  # done meanwhile (device time DEVICE_US)
            t0 = time.perf_counter()
            w.wait([job], 60)
            waits.append(time.perf_counter() - t0)
            job += 1
        print(f"1-block store, call -> result (device {DEVICE_US} us): {_us(whole[20:])}")
        print(f"wait of a 1-block job already done: {_us(waits[20:])}")
        print("\n256-block stores one at a time (after a 1 ms sleep), the caller on one CPU and the issuer threads on "
              "the same CPU or on another, SHARE_CPU on and off alternated: the call, call -> result (medians, p90)")
        places = (True, False) if len(os.sched_getaffinity(0)) > 1 else (True,)
        for _ in range(2):
            for together in places:
                for share in (True, False):
                    calls, results, yields = shared_cpu_run(lib, share=share, together=together, jobs=60)
                    print(f"  {'one CPU ' if together else 'two CPUs'} SHARE_CPU={share!s:<5}: call {_us(calls[10:])}; "
                          f"call -> result {_us(results[10:])}; yields {yields}")
        rows, split = floor_rows(w, 256, 60, lambda: time.sleep(0.001))
        print("\n256-block stores in bursts of 4, each after a poll loop and a 1 ms sleep, three ways alternated"
              " (tests.gpu.profile_submit.floor_rows): median us of the first call (p90) and of jobs 2-4")
        print_floor(rows, split)
        job = layered_alone(lib, w, job)
        profile = cProfile.Profile()
        for _ in range(200):
            blocks = np.arange(256, dtype=np.int64)
            profile.enable()
            w.store(job, blocks, blocks)
            w.wait([job], 60)
            profile.disable()
            job += 1
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(20)
        print("\nthe Python of 200 stores of 256 blocks and their waits, by own time:")
        print(out.getvalue())
    finally:
        w.shutdown(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
