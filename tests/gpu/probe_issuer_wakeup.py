"""How long a job handed to an issuer thread waits before that thread runs, while the caller goes on
running Python: ``python -m tests.gpu.probe_issuer_wakeup`` (no GPU needed; a C compiler is).

Not a test (nothing is asserted; pytest does not collect it): a measurement for the fast-submit work
(the issuer thread of the handler, docs/design.md §5). An engine calls ``store``/``load`` between
the Python of its scheduler and of its model's forward, so the caller keeps the GIL after handing a
job over. It compares a Python thread blocked on a queue (what the handler's issuer thread is) with
a native thread blocked on a condition variable and signalled through ctypes (what an issuer
written in C would be), for a caller busy in Python for a given time after the hand-off, at the
interpreter's switch interval or one given by ``--switch-interval-ms``. The C
source is compiled into a temporary directory, removed on exit.
"""

from __future__ import annotations

import argparse
import ctypes
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: The C both probes start with: the headers they use, and ``now_ns`` (CLOCK_MONOTONIC, the clock of
#: ``time.monotonic_ns``).
C_PRELUDE = r"""
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}
"""

_SOURCE = r"""
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int pending = 0, stop = 0, count = 0;
static int64_t woke_ns[4096];
static pthread_t thread;
static void* loop(void* arg) {
    (void)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!pending && !stop) pthread_cond_wait(&cv, &mu);
        if (stop) break;
        pending--;
        if (count < 4096) woke_ns[count++] = now_ns();
    }
    pthread_mutex_unlock(&mu);
    return 0;
}
int probe_start(void) { pending = 0; stop = 0; count = 0; return pthread_create(&thread, 0, loop, 0); }
void probe_notify(void) { pthread_mutex_lock(&mu); pending++; pthread_cond_signal(&cv); pthread_mutex_unlock(&mu); }
int64_t probe_woke(int i) { return i < count ? woke_ns[i] : -1; }
void probe_stop(void) {
    pthread_mutex_lock(&mu); stop = 1; pthread_cond_signal(&cv); pthread_mutex_unlock(&mu);
    pthread_join(thread, 0);
}
"""


def busy(seconds: float) -> int:
    """Pure Python work for ``seconds`` (the caller's scheduler or forward)."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(100):
            x += i
    return x


def compile_probe(directory: Path, name: str, source: str) -> ctypes.CDLL:
    """Compile :data:`C_PRELUDE` + ``source`` into a shared library in ``directory`` and load it."""
    path, library = directory / f"{name}.c", directory / f"lib{name}.so"
    path.write_text(C_PRELUDE + source)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-pthread", "-o", str(library), str(path)], check=True)
    return ctypes.CDLL(str(library))


def _load(directory: Path) -> ctypes.CDLL:
    lib = compile_probe(directory, "issuer_wakeup", _SOURCE)
    lib.probe_woke.restype = ctypes.c_int64
    lib.probe_woke.argtypes = [ctypes.c_int]
    return lib


def measure(lib: ctypes.CDLL, busy_s: float, rounds: int) -> dict[str, list[float]]:
    """Microseconds from the hand-off to the issuer thread running, and of the hand-off call, for
    each kind of thread (one hand-off of each per round, the caller busy ``busy_s`` after each)."""
    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    woke: list[int] = []

    def python_issuer() -> None:
        while (item := jobs.get()) is not None:
            woke.append(time.monotonic_ns())

    thread = threading.Thread(target=python_issuer, name="probe-python-issuer")
    thread.start()
    if lib.probe_start() != 0:
        raise OSError("pthread_create failed")
    out: dict[str, list[float]] = {"python": [], "native": [], "python call": [], "native call": []}
    try:
        for i in range(rounds):
            busy(0.002)
            t0 = time.monotonic_ns()
            jobs.put(i)
            out["python call"].append((time.monotonic_ns() - t0) / 1e3)
            busy(busy_s)
            deadline = time.monotonic() + 10.0
            while len(woke) <= i and time.monotonic() < deadline:
                time.sleep(1e-4)
            out["python"].append((woke[i] - t0) / 1e3)
            busy(0.002)
            t0 = time.monotonic_ns()
            lib.probe_notify()
            out["native call"].append((time.monotonic_ns() - t0) / 1e3)
            busy(busy_s)
            out["native"].append((lib.probe_woke(i) - t0) / 1e3)
    finally:
        jobs.put(None)
        thread.join(10.0)
        lib.probe_stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.probe_issuer_wakeup", description=__doc__.split("\n")[0])
    parser.add_argument("--busy-ms", default="0.2,1,20", help="the caller's Python after each hand-off (ms, comma-separated)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="set the interpreter's switch interval first (sys.setswitchinterval)")
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    with tempfile.TemporaryDirectory(prefix="kvoffload-probe-") as directory:
        lib = _load(Path(directory))
        print(f"switch interval {sys.getswitchinterval() * 1e3:g} ms; medians (max) in us over {args.rounds} hand-offs")
        for busy_ms in (float(v) for v in args.busy_ms.split(",")):
            r = measure(lib, busy_ms / 1e3, args.rounds)
            print(f"  caller busy {busy_ms:5g} ms: issuer starts after python {statistics.median(r['python']):8.1f} "
                  f"({max(r['python']):8.1f}), native {statistics.median(r['native']):6.1f} ({max(r['native']):6.1f}); "
                  f"hand-off call python {statistics.median(r['python call']):4.1f}, native "
                  f"{statistics.median(r['native call']):4.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
