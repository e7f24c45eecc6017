"""Where a job's time goes on the host: ``python -m tests.gpu.profile_submit`` (needs a GPU).

Not a test (nothing is asserted; pytest does not collect it): a measurement for the fast-submit
work. It wraps the phases of a submit and of a wait with timers (each wrapper costs a fraction of a
microsecond) and prints, per path and job size, the median microseconds of each phase on the
caller's thread and on the issuer thread; then the split of an isolated 64 MiB job (caller's time,
device time, call -> result) with the library as it is and with candidate settings (a longer spin
before the completion poll sleeps; smaller staged chunks), each next to a pinned copy of the same
bytes measured in the same run. ``timeline`` and ``timeline64`` show where a native job's time goes
(the call, the hand-off, the thread's start, the issue, the completion found, the wait's return),
for 1- and 256-block stores and for isolated 64 MiB jobs per page size; ``ab`` alternates variants
of the native issuer job by job in one process; ``before`` times a burst's first call against what
the caller ran just before it, and ``floor`` against the same steps in one flat function and
against the library's calls alone; ``trace`` lists the device's copies and kernels of a layered
load and of isolated 64 MiB staged jobs, op by op; ``outliers`` splits the caller's time of
256-block calls by whether a garbage collection of the interpreter ran inside the call, and says
where the slow calls' time went (the Python before the hand-off, the fence's record inside it, and
what the issuer thread was doing in the driver meanwhile).
"""

from __future__ import annotations

import collections
import functools
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

import kvoffload.backends.cuda as cuda_backend
import kvoffload.backends.native as native_backend
import kvoffload.worker.worker as worker_module
from kvoffload import DeviceLayout, Direction, TransferResult, Worker
from kvoffload._jobs import JobBook
from kvoffload.backends.cuda import CudaBackend, CudaTicket
from kvoffload.backends.native import NativeBackend
from kvoffload.handler import BookedHandler, DirectionHandler
from kvoffload.worker.booking import Bookkeeping

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SPIN_S = cuda_backend.WAIT_SPIN_S
TIMES: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
#: Appended to the caller's phase names while the first job of a burst is submitted.
WHICH = [""]


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            caller = threading.current_thread() is threading.main_thread()
            TIMES[(name + WHICH[0] if caller else name, "caller" if caller else "issuer")].append(time.perf_counter() - t0)
    return wrapper


@contextmanager
def instrumented() -> Iterator[None]:
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        patches.append((owner, attr, original))
        setattr(owner, attr, timed(name, original))

    patch(Worker, "store", "0 Worker.store (total)")
    patch(Worker, "load", "0 Worker.load (total)")
    patch(worker_module, "as_block_ids", "1 validate: as_block_ids")
    patch(worker_module, "check_pairs", "1 validate: check_pairs")
    patch(worker_module, "as_job_id", "1 validate: as_job_id")
    patch(Bookkeeping, "admit", "2 book: admit (checks and counts)")
    patch(DirectionHandler, "_enqueue", "3 handler: enqueue (fence+issue)")
    patch(NativeBackend, "stream_handle", "4 fence: stream handle")
    patch(NativeBackend, "switches_device", "4 fence: device check")
    patch(NativeBackend, "_booked", "5 issue: hand-off (pack and call)")
    patch(Bookkeeping, "check", "2 book: conflicts check")
    patch(Bookkeeping, "add", "2 book: add")
    patch(JobBook, "reserve", "2 book: reserve id")
    patch(DirectionHandler, "submit_validated", "3 handler submit (fence+issue)")
    patch(CudaBackend, "fence", "4 fence (event record)")
    patch(CudaBackend, "issue", "5 issue (whole)")
    patch(NativeBackend, "position", "4 fence: position (recorded in the hand-off)")
    patch(NativeBackend, "issue_booked", "5 issue (whole)")
    patch(NativeBackend, "book_wait", "7 wait: book wait")
    patch(BookedHandler, "_take_locked", "3 handler: advance (results)")
    patch(JobBook, "wait", "7 wait (total)")
    patch(BookedHandler, "wait_progress", "7 wait: wait_progress")
    patch(BookedHandler, "advance", "7 wait: advance")
    patch(CudaTicket, "seconds", "8 result: event elapsed")
    for path_cls in _path_classes():
        patch(path_cls, "issue", f"6 {path_cls.__name__}.issue")
    try:
        yield
    finally:
        for owner, attr, original in reversed(patches):
            setattr(owner, attr, original)


def _path_classes() -> list[type]:
    from kvoffload.backends.cuda import DmaPath
    from kvoffload.backends.kernel import SmPath, StagedPath
    return [DmaPath, SmPath, StagedPath]


def per_layer(device: torch.device, layers: int, page: int, blocks: int) -> DeviceLayout:
    tensors = {f"layer{i}": torch.zeros(2, blocks, page, dtype=torch.uint8, device=device) for i in range(layers)}
    return DeviceLayout.from_tensors(tensors, 1)


def report(title: str) -> None:
    print(f"\n== {title}: median us (count) per phase")
    for (name, where), values in sorted(TIMES.items()):
        print(f"  {name:<40} {where:<6} {statistics.median(values) * 1e6:9.1f}  p90 "
              f"{np.percentile(values, 90) * 1e6:9.1f}  ({len(values)})")
    TIMES.clear()


def phases(device: torch.device) -> None:
    for path, issuer in (("auto", "native"), ("auto", "python"), ("sm", "native")):
        for label, layers, page, blocks, burst in (("1 block x 64 x 32 KiB", 32, 32 * KIB, 1, 1),
                                                    ("256 blocks x 64 x 32 KiB", 32, 32 * KIB, 256, 4)):
            layout = per_layer(device, layers, page, 4 * blocks)
            with Worker.create(layout, 4 * blocks, path=path, issuer=issuer) as w:  # type: ignore[arg-type]
                backend = w._store._backend  # noqa: SLF001 - a measurement of its calls
                if isinstance(backend, NativeBackend) and backend._front is not None:  # noqa: SLF001 - its calls, one by one
                    backend._front = FrontWith(backend._front, hand_off_booked=timed(  # type: ignore[assignment]  # noqa: SLF001
                        "5 issue: library call (hand-off, fence)", backend._front.hand_off_booked))  # noqa: SLF001
                job = 0
                for _ in range(3):  # warm-up
                    w.store(job, [0], [0])
                    w.wait([job], 60)
                    job += 1
                with instrumented():
                    for _ in range(20 if blocks > 1 else 60):
                        torch.cuda.synchronize(device)
                        ids = []
                        for k in range(burst):
                            ids.append(job)
                            dev = np.arange(k * blocks, (k + 1) * blocks, dtype=np.int64)
                            WHICH[0] = " [first of burst]" if k == 0 else ""
                            t0 = time.perf_counter()
                            _reference_work()  # the host's own speed at this point of a burst
                            TIMES[("0 reference: fixed Python work" + WHICH[0], "caller")].append(
                                time.perf_counter() - t0)
                            t0 = time.perf_counter()
                            w.store(job, dev, dev)
                            WHICH[0] = ""
                            TIMES[("0 store call, first of burst" if k == 0 else "0 store call, jobs 2-4", "caller")].append(time.perf_counter() - t0)
                            job += 1
                        t0 = time.perf_counter()
                        w.wait(ids, 60)
                        TIMES[("9 store burst: last call -> results", "caller")].append(time.perf_counter() - t0)
                report(f"{path}/{w.issuer}: store, {label}, bursts of {burst}")


def _reference_work() -> int:
    """A fixed piece of Python (about as many bytecodes as a few of the library's checks): its time
    first of a burst against later shows how much slower the host runs any Python after an idle
    wait, whatever the library does."""
    total = 0
    for i in range(100):
        total += i * i
    return total


def one_job(w: Worker, store: bool, job: int, ids: npt.NDArray[np.int64], tickets: list[BookedTicket],
            ) -> tuple[float, float, float, TransferResult, tuple[float, float, float, float]]:
    """One isolated job of ``w`` through its public calls, its ticket kept alone in ``tickets``:
    monotonic times of the call, of its return and of the wait's return, the result, and the
    ticket's times (handed over, issue began, issued, found done)."""
    tickets.clear()
    t0 = time.monotonic()
    (w.store if store else w.load)(job, ids, ids)
    t1 = time.monotonic()
    (result,) = w.wait([job], 60)
    t2 = time.monotonic()
    return t0, t1, t2, result, tickets[-1].times()


def pinned_copy_s(device: torch.device, stream: torch.cuda.Stream, host: torch.Tensor, buf: torch.Tensor,
                  store: bool) -> float:
    """One pinned copy of ``buf`` to ``host`` (``store``) or back on ``stream``, timed call ->
    synchronized, after the device is idle: the reference a job is measured against."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        (host.copy_(buf, non_blocking=True) if store else buf.copy_(host, non_blocking=True))
    stream.synchronize()
    return time.perf_counter() - t0


class FrontWith:
    """The call front with some of its calls replaced (a profile's timed ones)."""

    def __init__(self, module: Any, **calls: Callable[..., Any]) -> None:
        self._module, self._calls = module, calls

    def __getattr__(self, name: str) -> Any:
        return self._calls[name] if name in self._calls else getattr(self._module, name)


class BookedTicket:
    """A profile's view of one booked job (the native issuer keeps no ticket per job): its timeline
    so far from the library's book, or, once its result was taken, as taken."""

    def __init__(self, backend: NativeBackend, key: int, taken: dict[tuple[int, int], tuple[float, ...]]) -> None:
        self._backend, self._key, self._taken = backend, key, taken

    def times(self) -> tuple[float, float, float, float]:
        """When the job was handed over, its issue began, it was issued and found done
        (``time.monotonic()`` seconds, 0.0 for what has not happened yet)."""
        kept = self._taken.get((id(self._backend), self._key))
        if kept is not None:
            return kept  # type: ignore[return-value]
        now = self._backend.book_times(self._key)
        return now if now is not None else (0.0, 0.0, 0.0, 0.0)


@contextmanager
def kept_tickets() -> Iterator[list[BookedTicket]]:
    """A view of every job the native backends booked meanwhile (through either door), in a list
    the caller may clear."""
    tickets: list[BookedTicket] = []
    taken: dict[tuple[int, int], tuple[float, ...]] = {}
    booked, take = NativeBackend._booked, NativeBackend.book_take  # noqa: SLF001
    submit = BookedHandler.submit_handed_off
    seen = threading.local()  # whether the job being handed over went through _booked

    def keeping(self: NativeBackend, job_id: int, *args: Any) -> int:
        code = booked(self, job_id, *args)
        if not code:
            tickets.append(BookedTicket(self, job_id, taken))
            seen.booked = True
        return code

    def handing_off(self: BookedHandler, job_id: int, *args: Any) -> None:
        # the whole-job hand-off of the fast front does not go through _booked (the method is
        # looked up at every call, unlike the hand-off call the handler keeps)
        seen.booked = False
        submit(self, job_id, *args)
        if not seen.booked:
            backend = cast(NativeBackend, self._booking())  # noqa: SLF001
            tickets.append(BookedTicket(backend, self._keys.get(job_id, job_id), taken))  # noqa: SLF001

    def taking(self: NativeBackend) -> Any:
        results = take(self)
        for r in results:
            taken[(id(self), r.job_id)] = r.times
        return results

    NativeBackend._booked = keeping  # type: ignore[method-assign,assignment]  # noqa: SLF001
    NativeBackend.book_take = taking  # type: ignore[method-assign]
    BookedHandler.submit_handed_off = handing_off  # type: ignore[method-assign,assignment]
    try:
        yield tickets
    finally:
        NativeBackend._booked = booked  # type: ignore[method-assign]  # noqa: SLF001
        NativeBackend.book_take = take  # type: ignore[method-assign]
        BookedHandler.submit_handed_off = submit  # type: ignore[method-assign]


@contextmanager
def returns_of(*names: str) -> Iterator[dict[str, float]]:
    """When each of NativeBackend's named methods last returned (``time.monotonic()``), by name."""
    last: dict[str, float] = {}
    kept = {name: getattr(NativeBackend, name) for name in names}

    def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def returning(*args: Any) -> Any:
            out = call(*args)
            last[name] = time.monotonic()
            return out
        return returning

    for name, call in kept.items():
        setattr(NativeBackend, name, timed(name, call))
    try:
        yield last
    finally:
        for name, call in kept.items():
            setattr(NativeBackend, name, call)


def timeline(device: torch.device) -> None:
    """Where a native job's time goes: the call, the hand-off to the thread's start, the issue, the
    device, the completion found, the library's wait and take returning, the wait's return (median
    us from the call)."""
    layout = per_layer(device, 32, 32 * KIB, 1024)
    with kept_tickets() as tickets, returns_of("book_wait", "book_take") as last:
        for blocks, bursts in ((1, 60), (256, 20)):
            with Worker.create(layout, 1024, path="auto", issuer="native") as w:
                rows = []
                for i in range(bursts + 3):
                    torch.cuda.synchronize(device)
                    tickets.clear()
                    dev = np.arange(blocks, dtype=np.int64)
                    t0 = time.monotonic()
                    w.store(i, dev, dev)
                    t1 = time.monotonic()
                    ticket = tickets[-1]
                    handed, began, issued, _ = ticket.times()  # valid fields so far
                    last.clear()
                    (r,) = w.wait([i], 60)
                    t2 = time.monotonic()
                    handed, began, issued, found = ticket.times()
                    waited, taken = last.get("book_wait", t0), last.get("book_take", t0)
                    if i >= 3:
                        rows.append((t1 - t0, handed - t0, began - t0, issued - t0, found - t0, t2 - t0, r.seconds,
                                     waited - t0, taken - t0))
                med = [statistics.median(x[k] for x in rows) * 1e6 for k in range(9)]
                print(f"\n== native timeline, store of {blocks} block(s) x 64 x 32 KiB (auto), median us from the call:"
                      f" call returned {med[0]:.1f}; handed over {med[1]:.1f}; thread began {med[2]:.1f}; issued "
                      f"{med[3]:.1f}; found done {med[4]:.1f}; library's wait returned {med[7]:.1f} (0: none); "
                      f"take returned {med[8]:.1f}; wait returned {med[5]:.1f}; device time {med[6]:.1f}")


def timeline64(device: torch.device) -> None:
    """Where an isolated 64 MiB native job's time goes (auto; the per-layer layout of
    ``bench --latency``: 8 layers, K and V), per page size, store and load: median us from the call,
    next to one pinned copy of the same bytes timed call -> synchronized in the same rounds."""
    host = torch.empty(64 * MIB, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with kept_tickets() as tickets:
        for page in (4 * KIB, 64 * KIB, 2 * MIB):
            blocks = 64 * MIB // (16 * page)
            layout = per_layer(device, 8, page, 2 * blocks)
            ids = np.arange(blocks, dtype=np.int64)
            with Worker.create(layout, blocks, path="auto", issuer="native") as w:
                for store in (True, False):
                    rows = []
                    for i in range(10):
                        torch.cuda.synchronize(device)
                        t0, t1, t2, r, (handed, began, issued, found) = one_job(
                            w, store, i + (0 if store else 100), ids, tickets)
                        copy = pinned_copy_s(device, stream, host, buf, store)
                        if i >= 2:
                            rows.append((t1 - t0, handed - t0, began - t0, issued - t0, found - t0, t2 - t0,
                                         r.seconds, copy))
                    med = [statistics.median(x[k] for x in rows) * 1e6 for k in range(8)]
                    print(f"== native timeline, 64 MiB {'store' if store else 'load'} at {page // KIB} KiB pages "
                          f"({blocks} blocks), median us from the call: call returned {med[0]:.1f}; handed over "
                          f"{med[1]:.1f}; thread began {med[2]:.1f}; issued {med[3]:.1f}; found done {med[4]:.1f}; "
                          f"wait returned {med[5]:.1f}; device time {med[6]:.1f}; pinned copy {med[7]:.1f} "
                          f"(ratio {med[7] / med[5]:.3f})")


def isolated(device: torch.device) -> None:
    page, layers = 64 * KIB, 8
    block = 2 * layers * page
    blocks = 64 * MIB // block
    layout = per_layer(device, layers, page, 2 * blocks)
    host = torch.empty(64 * MIB, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(64 * MIB, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    variants: list[tuple[str, dict[str, Any], float]] = [
        ("spin 0.1 ms (as before)", {}, 100e-6),
        (f"as is (spin {cuda_backend.WAIT_SPIN_S * 1e3:g} ms)", {}, cuda_backend.WAIT_SPIN_S),
        ("staged 8 slots (16 MiB chunks)", {"staging_slots": 8}, cuda_backend.WAIT_SPIN_S),
    ]
    ids = np.arange(blocks, dtype=np.int64)
    print(f"\n== isolated 64 MiB job ({blocks} blocks, per-layer {layers} layers, 64 KiB pages): "
          "median us; ratio = pinned copy / job")
    for path in ("staged", "dma", "auto"):
        for name, options, spin in variants:
            if path != "staged" and "slots" in name:
                continue
            setattr(cuda_backend, 'WAIT_SPIN_S', spin)
            try:
                with Worker.create(layout, blocks, path=path, **options) as w:
                    for store in (True, False):
                        rows = []
                        for i in range(12):
                            torch.cuda.synchronize(device)
                            t0 = time.perf_counter()
                            (w.store if store else w.load)(i + (0 if store else 100), ids, ids)
                            t1 = time.perf_counter()
                            (r,) = w.wait([i + (0 if store else 100)], 60)
                            t2 = time.perf_counter()
                            copy = pinned_copy_s(device, stream, host, buf, store)
                            if i >= 2:
                                rows.append((t2 - t0, t1 - t0, r.seconds, copy))
                        med = [statistics.median(x[k] for x in rows) for k in range(4)]
                        print(f"  [{path:<6}] {name:<38} {'store' if store else 'load ':<5} call->result "
                              f"{med[0] * 1e6:7.1f} (call {med[1] * 1e6:6.1f}, device {med[2] * 1e6:7.1f}) "
                              f"copy {med[3] * 1e6:7.1f}  ratio {med[3] / med[0]:4.2f}x")
            except Exception as exc:  # a variant that cannot be built is reported, not fatal
                print(f"  [{path}] {name}: {type(exc).__name__}: {exc}")
            finally:
                setattr(cuda_backend, 'WAIT_SPIN_S', DEFAULT_SPIN_S)


def small(device: torch.device) -> None:
    layout = per_layer(device, 32, 32 * KIB, 64)
    host = torch.empty(2 * MIB, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(2 * MIB, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    print("\n== 1-block job (64 x 32 KiB), call -> result vs one 2 MiB pinned copy: median us")
    for path in ("sm", "staged", "dma", "auto"):
        for spin in (100e-6, DEFAULT_SPIN_S):
            setattr(cuda_backend, 'WAIT_SPIN_S', spin)
            try:
                with Worker.create(layout, 8, path=path) as w:
                    for store in (True, False):
                        rows = []
                        for i in range(40):
                            torch.cuda.synchronize(device)
                            t0 = time.perf_counter()
                            if store:
                                w.store(i, [i % 32], [i % 8])
                            else:
                                w.load(i, [i % 8], [32 + i % 32])
                            t1 = time.perf_counter()
                            (r,) = w.wait([i], 60)
                            t2 = time.perf_counter()
                            copy = pinned_copy_s(device, stream, host, buf, store)
                            if i >= 4:
                                rows.append((t2 - t0, t1 - t0, r.seconds, copy))
                        med = [statistics.median(x[k] for x in rows) for k in range(4)]
                        print(f"  [{path:<6}] spin {spin * 1e3:5.1f} ms {'store' if store else 'load ':<5} "
                              f"call->result {med[0] * 1e6:6.1f} (call {med[1] * 1e6:5.1f}, device "
                              f"{med[2] * 1e6:6.1f}) copy {med[3] * 1e6:5.1f} ratio {med[0] / med[3]:4.2f}x job/copy")
            finally:
                setattr(cuda_backend, 'WAIT_SPIN_S', DEFAULT_SPIN_S)


def front(device: torch.device) -> None:
    """The caller's time of a 256-block store through the fast front and through the validating
    path (jobs 2-4 of bursts of 4, native issuer, auto), with the front's phases timed, and the
    fixed costs of a ctypes call and of the host's Python at that point."""
    import ctypes

    from kvoffload import native
    blocks = 256
    layout = per_layer(device, 32, 32 * KIB, 4 * blocks)
    with Worker.create(layout, 4 * blocks, path="auto", issuer="native") as w:
        fronts = w._fronts  # noqa: SLF001 - the measurement switches the front off and on
        backend = w._store._backend  # noqa: SLF001
        assert isinstance(backend, NativeBackend)
        plain = backend._hand_off_booked  # noqa: SLF001
        front = backend._front  # noqa: SLF001
        front_call = front.hand_off_booked if front is not None else None
        job = 0
        for _ in range(3):
            w.store(job, [0], [0])
            w.wait([job], 60)
            job += 1
        handler = w._store  # noqa: SLF001
        assert isinstance(handler, BookedHandler)
        hand_off_call = handler._booked_call or backend.booked_hand_off_call((handler._plan,), whole=True)  # noqa: SLF001
        timed_fronts = {direction: (*lane[:3], timed("2 native admission (one library call)", lane[3]))
                        for direction, lane in fronts.items()}
        for label, table in (("front", timed_fronts), ("validating path", {})):
            w._fronts = table  # noqa: SLF001
            handler._booked_call = timed("5 backend hand-off (Python and call)", hand_off_call)  # noqa: SLF001
            backend._hand_off_booked = timed("5 library call (hand-off, fence)", plain)  # type: ignore[assignment]  # noqa: SLF001
            if front is not None and front_call is not None:
                backend._front = FrontWith(front, hand_off_booked=timed(  # type: ignore[assignment]  # noqa: SLF001
                    "6 call front's hand_off_booked (fence, hand-off)", front_call))
            patches = [(Bookkeeping, "admit", "2 admit (validating path)"),
                       (BookedHandler, "submit_handed_off", "4 handler.submit_handed_off"),
                       (DirectionHandler, "submit_validated", "4 handler.submit_validated"),
                       (JobBook, "reserve", "2 reserve id"),
                       (NativeBackend, "issue_booked", "5 backend issue (validating path)"),
                       (Worker, "_front", "1 Worker._front")]
            originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
            for owner, attr, name in patches:
                setattr(owner, attr, timed(name, getattr(owner, attr)))
            try:
                for _ in range(40):
                    torch.cuda.synchronize(device)
                    ids = []
                    for k in range(4):
                        dev = np.arange(k * blocks, (k + 1) * blocks, dtype=np.int64)
                        WHICH[0] = " [first of burst]" if k == 0 else ""
                        t0 = time.perf_counter()
                        _reference_work()
                        TIMES[("0 reference: fixed Python work" + WHICH[0], "caller")].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        w.store(job, dev, dev)
                        TIMES[("0 store call" + WHICH[0], "caller")].append(time.perf_counter() - t0)
                        ids.append(job)
                        job += 1
                    WHICH[0] = ""
                    w.wait(ids, 60)
            finally:
                for owner, attr, original in originals:
                    setattr(owner, attr, original)
                backend._hand_off_booked = plain  # noqa: SLF001
                backend._front = front  # noqa: SLF001
                handler._booked_call = hand_off_call  # noqa: SLF001
            report(f"auto/native: store, 256 blocks, bursts of 4, {label}")
        w._fronts = fronts  # noqa: SLF001
        fences: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(40):  # a fence alone (its record on the current stream), in bursts of 4
            torch.cuda.synchronize(device)
            for k in range(4):
                t0 = time.perf_counter()
                fence = backend.fence(None)
                backend.release_fence(fence)
                fences[k == 0].append(time.perf_counter() - t0)
        print(f"  a fence taken and given back (NativeBackend.fence, release_fence): median "
              f"{statistics.median(fences[False]) * 1e6:.2f} us, first of burst "
              f"{statistics.median(fences[True]) * 1e6:.2f} us")
    lib = native.library()
    scratch = np.zeros(256, dtype=np.int64)
    at = ctypes.c_void_p(native.address(scratch))
    samples = []
    for _ in range(5000):
        t0 = time.perf_counter()
        lib.kvo_unadmit(at, at, 0, at, at)
        samples.append(time.perf_counter() - t0)
    print(f"  a ctypes call of 5 arguments that does nothing: median {statistics.median(samples) * 1e6:.2f} us")
    samples = []
    for _ in range(5000):
        t0 = time.perf_counter()
        native.address(scratch)
        samples.append(time.perf_counter() - t0)
    print(f"  native.address: median {statistics.median(samples) * 1e6:.2f} us")


def _poll_until(w: Worker, ids: list[int]) -> None:
    """Poll (never blocking) until every job of ``ids`` is back: an engine's step loop."""
    left = set(ids)
    while left:
        for r in w.poll():
            left.discard(r.job_id)


def _pinned_copy(w: Worker, other: Worker, copy: Callable[[], float]) -> None:
    copy()


def _other_job(w: Worker, other: Worker, copy: Callable[[], float]) -> None:
    other.store(1 << 40, [0], [0])
    other.wait([1 << 40], 60)


def _own_job(w: Worker, other: Worker, copy: Callable[[], float]) -> None:
    w.store(1 << 40, [1024], [1024])
    w.wait([1 << 40], 60)


#: What the caller did in ``before`` after the poll loop that took the last burst's results back,
#: right before the next burst (the worker, a second worker of the same layout, a pinned copy).
BEFORE_PRELUDES: tuple[tuple[str, Callable[[Worker, Worker, Callable[[], float]], None]], ...] = (
    ("nothing", lambda w, other, copy: None),
    ("a 2 MiB pinned copy", _pinned_copy),
    ("a 1-block store of another worker", _other_job),
    ("a 1-block store of this worker", _own_job),
)


def before(device: torch.device) -> None:
    """The first call of a burst (256-block stores of 64 pages of 32 KiB, bursts of 4, fast front,
    no timers inside the library) after a poll loop took the burst before back and the caller then
    did one of ``BEFORE_PRELUDES`` (nothing; a pinned copy: the device busy, no library code; a
    1-block job of another worker: the library's code run, not this worker's objects; one of this
    worker), alternated burst by burst in one process: median us of the first call, of jobs 2-4,
    and of the fixed piece of Python just before the first call."""
    blocks = 256
    layout = per_layer(device, 32, 32 * KIB, 4 * blocks + 1)  # the last block: _own_job's
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    host = torch.empty(2 * MIB, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(2 * MIB, dtype=torch.uint8, device=device)
    rows: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    with Worker.create(layout, 4 * blocks + 1, path="auto", issuer="native") as w, \
            Worker.create(per_layer(device, 32, 32 * KIB, 1), 1, path="auto", issuer="native") as other:
        for x in (w, other):
            x.store(0, [0], [0])
            x.wait([0], 60)
        job = 1
        pending: list[int] = []
        for i in range(32):
            for name, prelude in BEFORE_PRELUDES:
                _poll_until(w, pending)
                prelude(w, other, lambda: pinned_copy_s(device, stream, host, buf, True))
                pending = []
                first = later = ref = 0.0
                for k in range(4):
                    dev = np.arange(k * blocks, (k + 1) * blocks, dtype=np.int64)
                    t0 = time.perf_counter()
                    _reference_work()
                    t1 = time.perf_counter()
                    w.store(job, dev, dev)
                    t2 = time.perf_counter()
                    if k == 0:
                        first, ref = t2 - t1, t1 - t0
                    else:
                        later += (t2 - t1) / 3
                    pending.append(job)
                    job += 1
                if i >= 2:
                    rows[name].append((first, later, ref))
        w.wait(pending, 60)
    print("\n== before: 256-block stores in bursts of 4; after a poll loop took the burst before back, the "
          "caller did ...: median us of the first call (p90), of jobs 2-4 (their mean per burst), of the fixed "
          "Python piece before the first call")
    for name, got in rows.items():
        med = [statistics.median(x[k] for x in got) * 1e6 for k in range(3)]
        p90 = float(np.percentile([x[0] for x in got], 90)) * 1e6
        print(f"  {name:<36} first {med[0]:7.1f} (p90 {p90:7.1f})  jobs 2-4 {med[1]:6.1f}  "
              f"fixed Python {med[2]:5.1f}")


def _flat_store(w: Worker) -> Callable[[int, npt.NDArray[np.int64], npt.NDArray[np.int64]], None]:
    """The fast front's store of ``w`` as one flat function: the same checks, copies, locks,
    bookkeeping entry, reservation and booked hand-off as ``Worker.store`` makes through its
    layers, inline (``flat``)."""
    from kvoffload import native
    from kvoffload.backends.cuda import current_device_index
    from kvoffload.records import Direction
    from kvoffload.worker.booking import _Job

    front = native.front()
    assert front is not None
    handler = w._store  # noqa: SLF001 - the measurement inlines the layers' steps
    backend = handler._backend  # noqa: SLF001
    assert isinstance(backend, NativeBackend)
    _, current_stream, wake, _ = w._fronts[Direction.STORE]  # noqa: SLF001
    book, jobs, lock = w._book, w._jobs, w._lock  # noqa: SLF001
    spec_admit = book._front_specs[Direction.STORE][1]  # noqa: SLF001
    front_at = backend._front_at  # noqa: SLF001
    plans = backend._single[(handler._plan, True)]  # noqa: SLF001
    choose, tags = backend._choose, backend._tags  # noqa: SLF001
    jobs_lock, open_ = jobs._lock, jobs._open  # noqa: SLF001
    admit, hand_off_booked, expect = front.admit, front.hand_off_booked, front.expect
    index, i64 = backend.index, np.dtype(np.int64)
    on_cuda = backend._on_cuda  # noqa: SLF001
    threshold = wake[0] if wake is not None else 1 << 62

    def store(job_id: int, src_blocks: npt.NDArray[np.int64], dst_blocks: npt.NDArray[np.int64]) -> None:
        if (type(job_id) is not int or type(src_blocks) is not np.ndarray or type(dst_blocks) is not np.ndarray
                or src_blocks.dtype is not i64 or dst_blocks.dtype is not i64 or src_blocks.ndim != 1
                or dst_blocks.ndim != 1 or w._closed):  # noqa: SLF001
            raise RuntimeError("flat: not a fast-front job")
        n = src_blocks.shape[0]
        if n >= threshold:
            expect(front_at)
        handle = current_stream()
        src, dst = src_blocks.copy(), dst_blocks.copy()
        with lock:
            if w._holds or job_id in book.jobs or not admit(spec_admit, src, dst):  # noqa: SLF001
                raise RuntimeError("flat: not admitted")
            book.jobs[job_id] = _Job(Direction.STORE, src, dst, True)
            with jobs_lock:
                open_[job_id] = handler
        if handler._closed:  # noqa: SLF001
            raise RuntimeError("flat: closed")
        name = choose(n)
        with backend._lock:  # noqa: SLF001
            if on_cuda and current_device_index() != index:
                raise RuntimeError("flat: another device")
            code = hand_off_booked(front_at, job_id, tags[name], handle, native_backend._PATHS[name],  # noqa: SLF001
                                   src, dst, 1, plans, 0, 0)
        if code:
            raise RuntimeError(f"flat: hand-off failed ({code})")

    return store


#: The three ways ``floor_rows`` submits a 256-block store.
FLOOR_WAYS: tuple[str, ...] = ("Worker.store", "one flat function", "the library's calls alone")


def floor_rows(w: Worker, blocks: int, rounds: int, between: Callable[[], object] = lambda: None,
               ) -> tuple[dict[str, list[tuple[float, float]]], dict[bool, list[list[float]]]]:
    """Bursts of 4 stores of ``blocks`` blocks on ``w`` (a native store issuer with the call front;
    4 x ``blocks`` blocks on each side), each burst after a poll loop took the one before back and
    ``between`` ran, alternating ``FLOOR_WAYS``: the worker's ``store``, the same steps in one flat
    function (:func:`_flat_store`), and the library's calls alone (the call front's early wake,
    torch's current-stream read, the admission and the hand-off with the fence's record, as
    ``store`` makes them, and nothing else: no checks, copies, id reservation, queue entry or
    ticket). Per way, (first call, mean of calls 2-4) of every burst after the first two; and the
    library's calls one by one (early wake, stream, admission, hand-off), first of a burst (True)
    and later (False)."""
    from kvoffload import native
    from kvoffload.records import Direction

    front = native.front()
    assert front is not None, "no call front on this host"
    w.store(0, np.arange(blocks, dtype=np.int64), np.arange(blocks, dtype=np.int64))
    w.wait([0], 60)
    handler = w._store  # noqa: SLF001 - the measurement calls the library as the lane does
    backend = handler._backend  # noqa: SLF001
    assert isinstance(backend, NativeBackend)
    current_stream = w._fronts[Direction.STORE][1]  # noqa: SLF001
    spec_admit = w._book._front_spec(Direction.STORE)[1]  # noqa: SLF001 - the lane's own spec
    front_at = backend._front_at  # noqa: SLF001
    plans = backend._single[(handler._plan, True)]  # noqa: SLF001
    name = backend._choose(blocks)  # noqa: SLF001
    path = native_backend._PATHS[name]  # noqa: SLF001
    expect, admit, hand_off_booked = front.expect, front.admit, front.hand_off_booked
    tag = backend._tags[name]  # noqa: SLF001
    keys = itertools.count(-(1 << 62))  # the library calls' own jobs: ids no worker call uses
    steps: list[list[float]] = []

    def library_calls(ids: npt.NDArray[np.int64]) -> int:
        t0 = time.perf_counter()
        expect(front_at)
        t1 = time.perf_counter()
        stream = current_stream()
        t2 = time.perf_counter()
        if not admit(spec_admit, ids, ids):
            raise RuntimeError("not admitted")
        t3 = time.perf_counter()
        key = next(keys)
        if hand_off_booked(front_at, key, tag, stream, path, ids, ids, 1, plans, 0, 0):
            raise RuntimeError("not booked")
        steps.append([t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3])
        return key

    flat = _flat_store(w)
    rows: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    split: dict[bool, list[list[float]]] = {True: [], False: []}
    job = 1
    for i in range(rounds):
        for way in FLOOR_WAYS:
            between()
            times = []
            if way != "the library's calls alone":
                ids = []
                call = w.store if way == "Worker.store" else flat
                for k in range(4):
                    dev = np.arange(k * blocks, (k + 1) * blocks, dtype=np.int64)
                    t0 = time.perf_counter()
                    call(job, dev, dev)
                    times.append(time.perf_counter() - t0)
                    ids.append(job)
                    job += 1
                _poll_until(w, ids)
            else:
                held = []
                for k in range(4):
                    dev = np.arange(k * blocks, (k + 1) * blocks, dtype=np.int64)
                    t0 = time.perf_counter()
                    library_calls(dev)
                    times.append(time.perf_counter() - t0)
                    held.append(dev)
                taken = 0  # taken here, before the worker's next call could take them
                while taken < len(held):
                    taken += len(backend.book_take())
                for dev in held:
                    front.unadmit(spec_admit, dev, dev)
            if i >= 2:
                rows[way].append((times[0], sum(times[1:]) / 3))
                if way == "the library's calls alone":
                    split[True].append(steps[-4])
                    split[False].extend(steps[-3:])
    return rows, split


def print_floor(rows: dict[str, list[tuple[float, float]]], split: dict[bool, list[list[float]]]) -> None:
    """Print :func:`floor_rows`' figures (medians, us)."""
    for way, got in rows.items():
        p90 = float(np.percentile([x[0] for x in got], 90)) * 1e6
        print(f"  {way:<28} first {statistics.median(x[0] for x in got) * 1e6:7.1f} (p90 {p90:7.1f})  "
              f"jobs 2-4 {statistics.median(x[1] for x in got) * 1e6:6.1f}")
    for first, label in ((True, "first of burst"), (False, "jobs 2-4")):
        med = [statistics.median(x[k] for x in split[first]) * 1e6 for k in range(4)]
        print(f"  the library's calls, {label:<14}: early wake {med[0]:5.1f}  stream handle {med[1]:5.1f}  "
              f"admission {med[2]:5.1f}  hand-off with the fence {med[3]:5.1f}")


def floor(device: torch.device) -> None:
    """:func:`floor_rows` on the H200: 256-block stores (64 pages of 32 KiB), native issuer, auto."""
    blocks = 256
    with Worker.create(per_layer(device, 32, 32 * KIB, 4 * blocks), 4 * blocks, path="auto",
                       issuer="native") as w:
        rows, split = floor_rows(w, blocks, 30)
    print("\n== floor: 256-block stores in bursts of 4, each burst after a poll loop took the one before back: "
          "median us of the first call (p90) and of jobs 2-4 (their mean per burst)")
    print_floor(rows, split)


def native_worker(layout: DeviceLayout, blocks: int, path: str, overrides: dict[str, float]) -> Worker:
    """A native-issuer worker on ``path`` built with ``overrides`` of the native backend's module
    constants (restored once it is built): one variant of ``ab`` or ``layered``."""
    saved = {name: getattr(native_backend, name) for name in overrides}
    for name, value in overrides.items():
        setattr(native_backend, name, value)
    try:
        return Worker.create(layout, blocks, path=path, issuer="native")  # type: ignore[arg-type]
    finally:
        for name, value in saved.items():
            setattr(native_backend, name, value)


#: The workers ``layered`` alternates: a label, the path, the native backend's constants to override.
LAYERED_VARIANTS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("auto", "auto", {}),
    ("auto, validating path", "auto", {}),  # the worker's fast front off (see layered)
    ("auto, thread issues", "auto", {"CALLER_ISSUE_MAX": 0}),
    ("auto, descriptors", "auto", {"STRIDED_MIN_ROWS": 0}),
    ("sm", "sm", {}),
)


def layered(device: torch.device) -> None:
    """Where a layered load's start goes (``bench --layerwise``'s load: 16 layers x 2 pages of 32
    KiB, 256 blocks, native issuer), per variant (``LAYERED_VARIANTS``, alternated round by round
    in one process): median us after the call of its return, of the hand-off, of the thread's issue
    start and of the issue's end (all layers); on the device, from an event recorded on the compute
    stream just before the call, when each layer landed (that stream's wait for it), and the job's
    device time."""
    from kvoffload.cli._torch import new_event, new_stream
    from kvoffload.cli.latency_bench import _per_layer

    layers, blocks = 16, 256
    layout, _ = _per_layer(device, layers, 32 * KIB, 2 * blocks)
    src = np.arange(blocks, dtype=np.int64)
    dst = src + blocks
    compute = new_stream(device)
    rows: dict[str, list[tuple[float, ...]]] = collections.defaultdict(list)
    landed_at: dict[str, list[list[float]]] = collections.defaultdict(list)
    workers: list[Worker] = []
    try:
        for label, path, overrides in LAYERED_VARIANTS:
            workers.append(native_worker(layout, blocks, path, overrides))
            if "validating" in label:
                workers[-1]._fronts = {}  # noqa: SLF001 - every job through the validating path
        with kept_tickets() as tickets:
            for w in workers:
                w.store(0, src, src)
                w.wait([0], 60)
            job = 1
            for i in range(14):
                for (label, _, _), w in zip(LAYERED_VARIANTS, workers):
                    torch.cuda.synchronize(device)
                    tickets.clear()
                    begin = new_event(timing=True)
                    landed = [new_event(timing=True) for _ in range(layers)]
                    begin.record(compute)
                    t0 = time.monotonic()
                    load = w.load_by_layer(job, src, dst, stream=compute)
                    t1 = time.monotonic()
                    for layer in range(layers):
                        load.wait_layer(layer, compute)
                        landed[layer].record(compute)
                    (result,) = w.wait([job], 60)
                    landed[-1].synchronize()
                    handed, began, issued, _ = tickets[-1].times()
                    if i >= 2:
                        rows[label].append((t1 - t0, handed - t0, began - t0, issued - t0, result.seconds))
                        landed_at[label].append([float(begin.elapsed_time(e)) * 1e3 for e in landed])
                    job += 1
    finally:
        for w in workers:
            w.shutdown()
    print("\n== layered: load_by_layer of 256 blocks x 16 layers x 2 pages of 32 KiB: median us after the call of "
          "its return, the hand-off, the thread's issue start, its end (all layers), the job's device time; then "
          "when each layer landed on the compute stream")
    for label, got in rows.items():
        med = [statistics.median(x[k] for x in got) * 1e6 for k in range(5)]
        print(f"  {label:<20} return {med[0]:7.1f}  hand-off {med[1]:7.1f}  issue began {med[2]:7.1f}  "
              f"issued {med[3]:7.1f}  device {med[4]:8.1f}")
        print(f"  {'':<20} layer i landed: " + " ".join(
            f"{statistics.median(x[k] for x in landed_at[label]):.0f}" for k in range(layers)))


#: The builds ``ab`` compares: the native backend's module constants each overrides.
AB_VARIANTS: tuple[tuple[str, dict[str, float]], ...] = (
    ("as is", {}),
    ("no early wake", {"EXPECT_SPIN_S": 0.0, "CALLER_COMING_S": 0.0}),
    ("no waiter queries", {"WAIT_QUERY_S": 0.0}),
    ("thread issues all", {"CALLER_ISSUE_MAX": 0}),
)


def ab(device: torch.device) -> None:
    """Variants of the native issuer side by side in one process (``AB_VARIANTS``), their isolated
    jobs alternated one by one, each after a pinned copy of the same bytes: where builds measured in
    separate processes differ by less than runs do, alternating job by job leaves the host's drift
    to every variant alike. Per workload and variant: median us of call -> result and its ratio to
    the copy, and where the time went (the caller until the hand-off, the thread's wake-up, the
    completion found after the issue's start plus the device time, the result after that, the
    caller's time in the call)."""
    workloads = (("1-block store (64 x 32 KiB)", 32, 32 * KIB, 1, True),
                 ("64 MiB store, 2 MiB pages", 8, 2 * MIB, 2, True),
                 ("64 MiB load, 2 MiB pages", 8, 2 * MIB, 2, False),
                 ("64 MiB store, 4 KiB pages", 8, 4 * KIB, 1024, True))
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with kept_tickets() as tickets:
        for label, layers, page, blocks, store in workloads:
            nbytes = blocks * 2 * layers * page
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            layout = per_layer(device, layers, page, blocks)
            ids = np.arange(blocks, dtype=np.int64)
            workers: list[Worker] = []
            try:
                for _, overrides in AB_VARIANTS:
                    workers.append(native_worker(layout, blocks, "auto", overrides))
                rows: list[list[tuple[float, ...]]] = [[] for _ in AB_VARIANTS]
                for i in range(44):
                    for v, w in enumerate(workers):
                        copy = pinned_copy_s(device, stream, host, buf, store)
                        t0, t1, t2, r, (handed, began, _, found) = one_job(w, store, i, ids, tickets)
                        if i >= 4:
                            rows[v].append((t2 - t0, copy, handed - t0, began - handed,
                                            found - began - r.seconds, t2 - found, t1 - t0))
                print(f"\n== ab, {label}: median us (call -> result, its ratio to the pinned copy; hand-off "
                      "after the call, wake-up, found after issue start + device, result after found; the caller's "
                      "time in the call)")
                for (name, _), got in zip(AB_VARIANTS, rows):
                    med = [statistics.median(x[k] for x in got) * 1e6 for k in range(7)]
                    print(f"  {name:<22} {med[0]:8.1f} ({med[1] / med[0]:.3f}x)  hand-off {med[2]:5.1f}  "
                          f"wake-up {med[3]:5.1f}  found {med[4]:5.1f}  result {med[5]:5.1f}  "
                          f"call {med[6]:5.1f}")
            finally:
                for w in workers:
                    w.shutdown()


def _device_ops(run: Callable[[], None]) -> list[list[tuple[str, float, float, int]]]:
    """The copies and kernels ``run`` put on the device (torch.profiler's CUDA activity), as jobs:
    runs of ops with less than 100 us of idle device between them; per op its name, start (us after
    its job's first op), duration (us) and bytes."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    handle, name = tempfile.mkstemp(suffix=".json", prefix="kvoffload-trace-")
    os.close(handle)
    try:
        prof.export_chrome_trace(name)
        with open(name, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(name)
    ops = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")), key=lambda e: e["ts"])
    jobs: list[list[tuple[str, float, float, int]]] = []
    end = -1e18
    for e in ops:
        if e["ts"] > end + 100:
            jobs.append([])
            first = e["ts"]
        kind = "kernel" if e["cat"] == "kernel" else e["name"].split(" ")[1]
        jobs[-1].append((kind, e["ts"] - first, e["dur"], int(e["args"].get("bytes", 0))))
        end = max(end, e["ts"] + e["dur"])
    return jobs


def _traced(device: torch.device, w: Worker, submit: Callable[[int], None]) -> list[tuple[str, float, float, int]]:
    """The device's ops of the last of three jobs ``submit(job_id)`` submits to ``w`` one at a time
    (after three unprofiled ones), each waited for and the device synchronized around it."""
    job = [10_000]

    def three() -> None:
        for _ in range(3):
            torch.cuda.synchronize(device)
            submit(job[0])
            w.wait([job[0]], 60)
            job[0] += 1
            torch.cuda.synchronize(device)

    three()  # warm
    return _device_ops(three)[-1]


def _ops_line(ops: list[tuple[str, float, float, int]]) -> str:
    return "; ".join(f"{k} {t:.1f} +{d:.1f}" + (f" {n / MIB:.2f}" if n else "") for k, t, d, n in ops)


def trace(device: torch.device) -> None:
    """The device's side of a job, op by op: a layered load's first two layers (``bench
    --layerwise``'s load, 16 layers x 2 pages of 32 KiB, 256 blocks, on ``staged`` and ``sm``) and an
    isolated 64 MiB ``staged`` store and load (8 layers x 2 pages of 4 KiB, the staged chunks
    growing from the job's edge chunk: a store's first, a load's last), the last of three jobs each."""
    from kvoffload.cli._torch import new_stream
    from kvoffload.cli.latency_bench import _per_layer

    print("\n== trace: the device's ops of one job (kind, start us after the job's first op, duration us, MiB)")
    layers, blocks = 16, 256
    layout, _ = _per_layer(device, layers, 32 * KIB, 2 * blocks)
    src = np.arange(blocks, dtype=np.int64)
    compute = new_stream(device)
    for path in ("staged", "sm"):
        with Worker.create(layout, blocks, path=path, issuer="native") as w:
            w.store(0, src, src)
            w.wait([0], 60)
            ops = _traced(device, w, lambda j: w.load_by_layer(j, src, src + blocks, stream=compute)
                          .wait_layer(layers - 1, compute))
        print(f"  layered load, {path}: " + _ops_line([op for op in ops if op[1] < 2.2 * ops[-1][1] / layers]))
    page = 4 * KIB
    nb = (64 * MIB) // (2 * 8 * page)
    layout, _ = _per_layer(device, 8, page, 2 * nb)
    ids = np.arange(nb, dtype=np.int64)
    with Worker.create(layout, nb, path="staged", issuer="native") as w:
        print("  64 MiB store alone, staged: " + _ops_line(_traced(device, w, lambda j: w.store(j, ids, ids))))
        print("  64 MiB load alone, staged: " + _ops_line(_traced(device, w, lambda j: w.load(j, ids, ids))))


def outliers(device: torch.device) -> None:
    """What the caller's time's outliers are: ``bench --latency``'s caller-time workload (256-block
    stores and loads in bursts of 4, ``auto``, native issuer) for 100 bursts a direction, each call
    classified by whether one of the interpreter's garbage collections ran inside it
    (``gc.callbacks``): the calls without one (median, p99, max, how many over 150 us), the calls
    with one (their count and times by the collection's generation), and the collections' own
    times; each call over 150 us with where its time went; the backend's driver-call statistics
    (``Worker.driver_call_stats``); then the net GC-tracked allocations per job of that loop (the
    young generation's count over 200 jobs with collection off)."""
    import gc
    import resource

    from kvoffload.cli.latency_bench import BURST, BURST_BLOCKS, BURST_LAYERS, _per_layer

    blocks = BURST * BURST_BLOCKS
    layout, _ = _per_layer(device, BURST_LAYERS, 32 * KIB, blocks)
    ran: list[tuple[int, float, float]] = []  # (generation, start, stop)
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            started.append(now)
        else:
            ran.append((info["generation"], started.pop() if started else now, now))

    slow: list[str] = []
    in_library: list[tuple[float, float, float]] = []  # the library's hand-off calls: (entry, return, CPU s)

    def watch(w: Worker) -> None:
        """Time every call into the library's hand-off (through the call front) of ``w``."""
        for handler in (w._store, w._load):  # noqa: SLF001
            backend = handler._backend  # noqa: SLF001
            assert isinstance(backend, NativeBackend)
            front = backend._front  # noqa: SLF001
            assert front is not None, "no call front on this host"
            call = front.hand_off_booked

            def timed_call(*args: Any, call: Callable[..., Any] = call) -> Any:
                c0 = time.thread_time()
                t0 = time.perf_counter()
                try:
                    return call(*args)
                finally:
                    in_library.append((t0, time.perf_counter(), time.thread_time() - c0))

            backend._front = FrontWith(front, hand_off_booked=timed_call)  # type: ignore[assignment]  # noqa: SLF001

    def burst(w: Worker, store: bool, job: int) -> list[tuple[float, float, int]]:
        torch.cuda.synchronize(device)
        calls = []
        with kept_tickets() as tickets:
            for k in range(BURST):
                dev = np.arange(k * BURST_BLOCKS, (k + 1) * BURST_BLOCKS, dtype=np.int64)
                u0 = resource.getrusage(resource.RUSAGE_THREAD)
                c0 = time.thread_time()
                t0 = time.perf_counter()
                (w.store if store else w.load)(job + k, dev, dev)
                t1 = time.perf_counter()
                c1 = time.thread_time()
                u1 = resource.getrusage(resource.RUSAGE_THREAD)
                calls.append((t0, t1, job + k))
                if t1 - t0 > 150e-6:  # where an outlier's time went
                    handed = tickets[-1].times()[0] - t0 if tickets else float("nan")
                    entry, left, cpu = in_library[-1] if in_library else (t0, t0, 0.0)
                    slow.append(f"job {k + 1} of its burst: {(t1 - t0) * 1e6:.0f} us, on the CPU {(c1 - c0) * 1e6:.0f}; "
                                f"the library's hand-off call entered at {(entry - t0) * 1e6:.0f}, its fence "
                                f"recorded at {handed * 1e6:.0f}, returned at {(left - t0) * 1e6:.0f} (on the CPU "
                                f"{cpu * 1e6:.0f}); minor faults {u1.ru_minflt - u0.ru_minflt}, "
                                f"switches {u1.ru_nvcsw - u0.ru_nvcsw} voluntary {u1.ru_nivcsw - u0.ru_nivcsw} "
                                f"involuntary")
            if not all(r.ok for r in w.wait([c[2] for c in calls], 60)):
                raise RuntimeError("a job of the burst failed")
        return calls

    print("\n== outliers: the caller's time per 256-block call in bursts of 4 (auto, native), split by "
          "whether a garbage collection ran inside the call")
    gc.callbacks.append(on_gc)
    try:
        with Worker.create(layout, blocks, path="auto", issuer="native") as w:
            watch(w)
            print(f"  paths: store {w._store.path}, load {w._load.path}")  # noqa: SLF001
            job = 0
            for store in (True, False):
                burst(w, store, job)  # warm
                job += BURST
                ran.clear()
                calls: list[tuple[float, float, int]] = []
                for _ in range(100):
                    calls += burst(w, store, job)
                    job += BURST
                inside: dict[int, list[float]] = collections.defaultdict(list)
                clean: list[float] = []
                for t0, t1, _ in calls:
                    gens = [g for g, a, b in ran if a >= t0 and b <= t1]
                    (inside[max(gens)] if gens else clean).append(t1 - t0)
                clean.sort()
                print(f"  {'store' if store else 'load '}: {len(calls)} calls; without a collection median "
                      f"{statistics.median(clean) * 1e6:.1f} p99 {clean[int(0.99 * (len(clean) - 1))] * 1e6:.1f} "
                      f"max {clean[-1] * 1e6:.1f} us, {sum(t > 150e-6 for t in clean)} over 150 us")
                for gen in sorted(inside):
                    got = sorted(inside[gen])
                    print(f"         with a generation-{gen} collection: {len(got)} calls, median "
                          f"{statistics.median(got) * 1e6:.1f} max {got[-1] * 1e6:.1f} us")
                by_gen: dict[int, list[float]] = collections.defaultdict(list)
                for g, a, b in ran:
                    by_gen[g].append(b - a)
                print("         collections during the loop: " + "; ".join(
                    f"generation {g}: {len(d)}, median {statistics.median(d) * 1e6:.1f} max {max(d) * 1e6:.1f} us"
                    for g, d in sorted(by_gen.items())))
                for line in slow[:40]:
                    print("         " + line)
                slow.clear()
                stats = w.driver_call_stats()[Direction.STORE if store else Direction.LOAD]
                print(f"         the callers' driver calls: {stats.caller_calls}, the longest "
                      f"{stats.caller_longest_ns / 1e3:.0f} us; over 100 us by the issuing side's call then: "
                      + ", ".join(f"{k} {v}" for k, v in stats.slow_caller_calls.items())
                      + "; the issuing side's longest calls: "
                      + ", ".join(f"{k} {v / 1e3:.0f} us" for k, v in stats.longest_ns.items()))
            gc.disable()
            try:
                before = gc.get_count()[0]
                for _ in range(50):
                    burst(w, True, job)
                    job += BURST
                print(f"  net GC-tracked allocations per job of this loop (its own included): "
                      f"{(gc.get_count()[0] - before) / 200:.1f}; thresholds {gc.get_threshold()}")
            finally:
                gc.enable()
    finally:
        gc.callbacks.remove(on_gc)


def main() -> int:
    if not torch.cuda.is_available():
        print("profile_submit: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    wanted = sys.argv[1:] or ["small", "isolated", "phases", "timeline"]
    sections = {"small": small, "isolated": isolated, "phases": phases, "timeline": timeline,
                "timeline64": timeline64, "front": front, "ab": ab,
                "before": before, "floor": floor, "layered": layered, "trace": trace,
                "outliers": outliers}
    for section in (sections[name] for name in wanted):
        t0 = time.perf_counter()
        try:
            section(device)
        except Exception as exc:  # one section failing must not hide the others
            print(f"section {section.__name__} failed: {type(exc).__name__}: {exc}")
        print(f"  ({section.__name__}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
