"""What a native issuer thread would give a job: ``python -m tests.gpu.probe_native_issue`` (needs a
GPU and a C compiler).

Not a test (nothing is asserted; pytest does not collect it): a measurement for the fast-submit work
(docs/design.md §5, the handler's issuer thread). A C thread, blocked on a condition variable,
takes copy jobs handed over through one ctypes call, issues each with ``cuMemcpyAsync`` and
``cuEventRecord`` on a stream of its own (driver entry points resolved with ``cuGetProcAddress``,
the device's primary context made current in the thread), finds completion by querying the event
without the GIL, and wakes the waiter through a condition variable (a ctypes call that releases the
GIL). Printed, each median over the repeats, next to the figures the library gives in the same run:

* a 2 MiB job, call -> result: the native thread, the library's 1-block job (64 x 32 KiB pages,
  ``auto``), one pinned copy through torch;
* the caller's time of the hand-off, and how long after the call the native thread issued the copy,
  with the caller idle and with the caller busy in Python for 1 ms and 20 ms after the hand-off
  (where a Python issuer thread waits for the GIL: ``tests.gpu.probe_issuer_wakeup``);
* a 64 MiB job, call -> result, native and pinned copy.

The C source is compiled into a temporary directory, removed on exit. It moves one contiguous range
per job (what a staged chunk's DMA or one kernel launch is to the driver), not the library's plans.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from cuda.bindings import driver as _drv

from kvoffload.bindings import driver
from kvoffload.cli._torch import new_stream
from kvoffload.cli.latency_bench import PinnedCopy, one_block_jobs
from tests.gpu.probe_issuer_wakeup import busy, compile_probe

MIB = 1 << 20

_SOURCE = r"""
typedef int (*memcpy_fn)(uint64_t dst, uint64_t src, size_t n, void* stream);
typedef int (*record_fn)(void* event, void* stream);
typedef int (*query_fn)(void* event);
typedef int (*set_ctx_fn)(void* ctx);
enum { RING = 4096, NOT_READY = 600 };
struct job { uint64_t dst, src, n; void* stream; void* event; };

static struct job jobs[RING];
static int64_t call_ns[RING], issued_ns[RING], done_ns[RING];
static int result[RING];
static long head, issued, completed;
static int stop, ctx_error;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static memcpy_fn f_memcpy; static record_fn f_record; static query_fn f_query;
static set_ctx_fn f_set_ctx; static void* context;
static pthread_t thread;

static void* loop(void* arg) {
    (void)arg;
    ctx_error = f_set_ctx(context);
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!stop && issued == head && completed == issued) pthread_cond_wait(&work_cv, &mu);
        if (stop) break;
        while (issued < head) {
            struct job j = jobs[issued % RING];
            long at = issued;
            pthread_mutex_unlock(&mu);
            int r = f_memcpy(j.dst, j.src, j.n, j.stream);
            if (r == 0) r = f_record(j.event, j.stream);
            int64_t t = now_ns();
            pthread_mutex_lock(&mu);
            result[at % RING] = r;
            issued_ns[at % RING] = t;
            issued = at + 1;
        }
        if (completed < issued) {
            long at = completed;
            void* event = jobs[at % RING].event;
            int failed = result[at % RING] != 0;
            pthread_mutex_unlock(&mu);
            int q = failed ? 0 : f_query(event);
            pthread_mutex_lock(&mu);
            if (q == NOT_READY) {
                pthread_mutex_unlock(&mu);
                sched_yield();
                pthread_mutex_lock(&mu);
                continue;
            }
            if (q != 0) result[at % RING] = q;
            done_ns[at % RING] = now_ns();
            completed = at + 1;
            pthread_cond_broadcast(&done_cv);
        }
    }
    pthread_mutex_unlock(&mu);
    return 0;
}

int probe_start(void* memcpy_async, void* event_record, void* event_query, void* set_ctx, void* ctx) {
    f_memcpy = (memcpy_fn)memcpy_async; f_record = (record_fn)event_record;
    f_query = (query_fn)event_query; f_set_ctx = (set_ctx_fn)set_ctx; context = ctx;
    head = issued = completed = 0; stop = 0; ctx_error = 0;
    return pthread_create(&thread, 0, loop, 0);
}

long probe_submit(uint64_t dst, uint64_t src, uint64_t n, void* stream, void* event) {
    int64_t t = now_ns();
    pthread_mutex_lock(&mu);
    long at = head;
    if (at - completed >= RING) { pthread_mutex_unlock(&mu); return -1; }
    struct job j = {dst, src, n, stream, event};
    jobs[at % RING] = j;
    call_ns[at % RING] = t;
    head = at + 1;
    pthread_cond_signal(&work_cv);
    pthread_mutex_unlock(&mu);
    return at;
}

/* 0 and the job's CUresult once it completed; 1 past the deadline. */
int probe_wait(long at, int64_t timeout_ns, int* out) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += timeout_ns / 1000000000LL;
    deadline.tv_nsec += timeout_ns % 1000000000LL;
    if (deadline.tv_nsec >= 1000000000L) { deadline.tv_sec += 1; deadline.tv_nsec -= 1000000000L; }
    pthread_mutex_lock(&mu);
    while (completed <= at) {
        if (pthread_cond_timedwait(&done_cv, &mu, &deadline) != 0) { pthread_mutex_unlock(&mu); return 1; }
    }
    *out = result[at % RING];
    pthread_mutex_unlock(&mu);
    return 0;
}

void probe_times(long at, int64_t* out) {
    pthread_mutex_lock(&mu);
    out[0] = call_ns[at % RING]; out[1] = issued_ns[at % RING]; out[2] = done_ns[at % RING];
    pthread_mutex_unlock(&mu);
}

int probe_stop(void) {
    pthread_mutex_lock(&mu); stop = 1; pthread_cond_signal(&work_cv); pthread_mutex_unlock(&mu);
    pthread_join(thread, 0);
    return ctx_error;
}
"""

WAIT_NS = 10_000_000_000


def _address(name: bytes) -> int:
    """A driver entry point's address (``cuGetProcAddress`` at the ABI the library uses)."""
    code, address = _drv.cuGetProcAddress(name, driver.HOT_ABI_VERSION, 0)[:2]
    if int(code) != 0 or not address:
        raise RuntimeError(f"cuGetProcAddress({name!r}) failed: {code}")
    return int(address)


def _load(directory: Path) -> ctypes.CDLL:
    lib = compile_probe(directory, "native_issue", _SOURCE)
    p, u64 = ctypes.c_void_p, ctypes.c_uint64
    lib.probe_start.argtypes = [p, p, p, p, p]
    lib.probe_submit.argtypes = [u64, u64, u64, p, p]
    lib.probe_submit.restype = ctypes.c_long
    lib.probe_wait.argtypes = [ctypes.c_long, ctypes.c_int64, ctypes.POINTER(ctypes.c_int)]
    lib.probe_times.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_int64)]
    return lib


class NativeIssuer:
    """The C thread of the probe over one device buffer, one pinned buffer and one stream."""

    def __init__(self, lib: ctypes.CDLL, device: torch.device, nbytes: int) -> None:
        self.lib = lib
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.stream = new_stream(device)
        index = device.index or 0
        driver.make_context_current(index)
        self.pool = driver.EventPool(index, timing=False)
        self.event = self.pool.take()
        ctx = int(driver._primary_contexts[index])  # noqa: SLF001 - a probe of the library's own driver layer
        code = lib.probe_start(_address(b"cuMemcpyAsync"), _address(b"cuEventRecord"),
                               _address(b"cuEventQuery"), _address(b"cuCtxSetCurrent"), ctx)
        if code != 0:
            raise OSError(code, "pthread_create failed")

    def submit(self, store: bool, nbytes: int) -> int:
        """Hand one copy over; returns its index."""
        dst, src = (self.host, self.dev) if store else (self.dev, self.host)
        return int(self.lib.probe_submit(dst.data_ptr(), src.data_ptr(), nbytes,
                                         self.stream.cuda_stream, self.event))

    def wait(self, at: int) -> tuple[float, float, float]:
        """Wait for job ``at``; its (call, issued, done) times in seconds of CLOCK_MONOTONIC."""
        result = ctypes.c_int(0)
        if self.lib.probe_wait(at, WAIT_NS, ctypes.byref(result)) != 0:
            raise TimeoutError(f"native job {at} did not complete")
        if result.value != 0:
            raise RuntimeError(f"native job {at} failed: CUresult {result.value}")
        times = (ctypes.c_int64 * 3)()
        self.lib.probe_times(at, times)
        return times[0] / 1e9, times[1] / 1e9, times[2] / 1e9

    def stop(self) -> None:
        """Join the thread (it issues nothing more) and give the event back."""
        code = self.lib.probe_stop()
        self.pool.give(self.event)
        if code != 0:
            raise RuntimeError(f"cuCtxSetCurrent in the native thread: CUresult {code}")


def _us(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e6:8.1f}"


def native_rows(issuer: NativeIssuer, nbytes: int, repeats: int, busy_ms: tuple[float, ...]) -> list[str]:
    """Rows for jobs of ``nbytes``: call -> result with the caller waiting at once, then the issue
    lag with the caller busy in Python after the hand-off."""
    rows = []
    for store in (True, False):
        total, call, lag = [], [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            at = issuer.submit(store, nbytes)
            t1 = time.perf_counter()
            called, issued, _ = issuer.wait(at)
            t2 = time.perf_counter()
            total.append(t2 - t0)
            call.append(t1 - t0)
            lag.append(issued - called)
        rows.append(f"  native {'store' if store else 'load '} {nbytes // MIB:3d} MiB: call -> result {_us(total)} us "
                    f"(hand-off call {_us(call)} us, issued {_us(lag)} us after the call)")
        for pause_ms in busy_ms:
            lag, done = [], []
            for _ in range(max(5, repeats // 5)):
                torch.cuda.synchronize()
                at = issuer.submit(store, nbytes)
                busy(pause_ms / 1e3)
                called, issued, finished = issuer.wait(at)
                lag.append(issued - called)
                done.append(finished - called)
            rows.append(f"    caller busy {pause_ms:4g} ms after the hand-off: issued {_us(lag)} us, done {_us(done)} us "
                        "after the call")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.probe_native_issue", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("probe_native_issue: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    with tempfile.TemporaryDirectory(prefix="kvoffload-probe-") as directory:
        lib = _load(Path(directory))
        issuer = NativeIssuer(lib, device, 64 * MIB)
        try:
            for _ in range(10):  # warm-up
                issuer.wait(issuer.submit(True, 2 * MIB))
            rows = native_rows(issuer, 2 * MIB, args.repeats, (1.0, 20.0))
            rows += native_rows(issuer, 64 * MIB, max(10, args.repeats // 5), ())
        finally:
            issuer.stop()
    copies = []
    for nbytes in (2 * MIB, 64 * MIB):
        pinned = PinnedCopy(device, nbytes)
        for store in (True, False):
            seconds = [pinned.seconds(store) for _ in range(args.repeats)]
            copies.append(f"  pinned copy through torch {'store' if store else 'load '} {nbytes // MIB:3d} MiB: "
                          f"call -> synchronized {_us(seconds)} us")
    print(f"probe_native_issue on {torch.cuda.get_device_name(device)}: medians over {args.repeats} jobs")
    for row in rows + copies:
        print(row)
    print("  the library, same run: " + one_block_jobs(device, "auto", args.repeats).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
