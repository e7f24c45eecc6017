"""A fake CUDA driver for the native issuer on CPU: ctypes callbacks the C thread calls in place of
the driver's entry points. Copies are not made: every copy and copy-kernel launch updates a
*provenance* map (destination granule -> the address its bytes came from), so a test checks that
the bytes of every host record (store) or device page (load) came from the right place, through a
staging slot or not. Every call is logged in order with its stream; a test may make a call block
(``gate``) or fail (``fail``).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvoffload import native
from kvoffload.native import MEMORYTYPE_HOST, Memcpy2D
from kvoffload.backends import native as native_backend

GRANULE = 4
COPY, KERNEL, COMPUTE, IDLE = 0x1000, 0x2000, 0x3000, 0x4000
NOT_READY = 600
#: Fake kernel entry points: handle -> rows per launch (as the real kernel's three).
FUNCTIONS = ((0xF1, 32), (0xF2, 128), (0xF3, 1024))
#: The fake's issuers move staged rows in runs of this many records as strided copies: the tests'
#: host records are chosen for it (runs of a few records), whatever the library's default.
TEST_STRIDED_MIN_ROWS = 4

_p, _u, _i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
_u64 = ctypes.c_uint64
PROTOTYPES: dict[str, Any] = {
    "ctx_set_current": ctypes.CFUNCTYPE(_i, _p),
    "ctx_get_current": ctypes.CFUNCTYPE(_i, ctypes.POINTER(_p)),
    "event_create": ctypes.CFUNCTYPE(_i, ctypes.POINTER(_p), _u),
    "event_destroy": ctypes.CFUNCTYPE(_i, _p),
    "event_record": ctypes.CFUNCTYPE(_i, _p, _p),
    "event_query": ctypes.CFUNCTYPE(_i, _p),
    "event_elapsed": ctypes.CFUNCTYPE(_i, ctypes.POINTER(ctypes.c_float), _p, _p),
    "stream_wait_event": ctypes.CFUNCTYPE(_i, _p, _p, _u),
    "memcpy_async": ctypes.CFUNCTYPE(_i, _u64, _u64, ctypes.c_size_t, _p),
    "memcpy_batch": ctypes.CFUNCTYPE(_i, _p, _p, _p, ctypes.c_size_t, _p, _p, ctypes.c_size_t, _p),
    "memcpy_2d": ctypes.CFUNCTYPE(_i, _p, _p),
    "launch": ctypes.CFUNCTYPE(_i, _p, _u, _u, _u, _u, _u, _u, _u, _p, _p, _p),
}


class FakeDriver:
    """The driver the C thread sees (see the module docstring)."""

    def __init__(self, *, not_ready: int = 0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.provenance: dict[int, int] = {}
        self.not_ready = not_ready  # NOT_READY answers to each event's first queries
        self.elapsed_ms = 0.5  # every job's device time
        self.current: dict[int, int] = {}  # thread ident -> its current context (0: none)
        self.threads: list[int] = []  # the thread ident of each logged call
        self.queries: dict[int, int] = {}
        self.fail: dict[str, int] = {}  # call -> CUresult to return (once)
        self.fail_on: dict[tuple[str, int], int] = {}  # (call, its last argument) -> CUresult (once)
        self.gate: dict[str, threading.Event] = {}  # call -> event it waits for before returning
        self.gate_on: dict[tuple[str, int], threading.Event] = {}  # (call, its last argument) -> event
        self.entered: dict[str, threading.Event] = {}
        self.entered_on: dict[tuple[str, int], threading.Event] = {}  # (call, its last argument)
        self.events_created = 0
        self.events_destroyed = 0
        self.copy_sizes: list[int] = []  # bytes of every copy command, in order (a strided one's all rows)
        self._next_event = 0x100
        self._lock = threading.Lock()
        self.callbacks = {name: proto(getattr(self, "_" + name)) for name, proto in PROTOTYPES.items()}

    def address(self, name: str) -> int:
        """The callback's address, for the issuer's config."""
        return int(ctypes.cast(self.callbacks[name], ctypes.c_void_p).value or 0)

    def _enter(self, call: str, *args: Any) -> int:
        with self._lock:
            self.calls.append((call, *args))
            self.threads.append(threading.get_ident())
            entered = self.entered.get(call) or (self.entered_on.get((call, args[-1])) if args else None)
            gate = self.gate.get(call) or (self.gate_on.get((call, args[-1])) if args else None)
            code = self.fail.pop(call, 0) or (self.fail_on.pop((call, args[-1]), 0) if args else 0)
        if entered is not None:
            entered.set()
        if gate is not None:
            gate.wait(30)
        return code

    # ------------------------------------------------------------------------------ the calls

    def _ctx_set_current(self, ctx: int | None) -> int:
        code = self._enter("cuCtxSetCurrent", ctx)
        if not code:
            with self._lock:
                self.current[threading.get_ident()] = ctx or 0
        return code

    def _ctx_get_current(self, out: Any) -> int:
        with self._lock:
            out[0] = self.current.get(threading.get_ident(), 0) or None
        return 0

    def _event_create(self, out: Any, flags: int) -> int:
        code = self._enter("cuEventCreate", flags)
        if code:
            return code
        with self._lock:
            self._next_event += 1
            out[0] = self._next_event
            self.events_created += 1
        return 0

    def _event_destroy(self, event: int | None) -> int:
        with self._lock:
            self.events_destroyed += 1
        return 0

    def _event_record(self, event: int | None, stream: int | None) -> int:
        return self._enter("cuEventRecord", event, stream)

    def _event_query(self, event: int | None) -> int:
        code = self._enter("cuEventQuery", event)
        if code:
            return code
        with self._lock:
            seen = self.queries[event or 0] = self.queries.get(event or 0, 0) + 1
        return NOT_READY if seen <= self.not_ready else 0

    def _event_elapsed(self, out: Any, start: int | None, end: int | None) -> int:
        out[0] = self.elapsed_ms
        return 0

    def _stream_wait_event(self, stream: int | None, event: int | None, flags: int) -> int:
        return self._enter("cuStreamWaitEvent", stream, event)

    def _move(self, dst: int, src: int, size: int) -> None:
        with self._lock:
            prov = self.provenance
            for k in range(0, size, GRANULE):
                prov[dst + k] = prov.get(src + k, src + k)

    def _memcpy_async(self, dst: int, src: int, size: int, stream: int | None) -> int:
        code = self._enter("cuMemcpyAsync", stream, 1)
        if not code:
            self.copy_sizes.append(size)
            self._move(dst, src, size)
        return code

    def _memcpy_batch(self, dsts: int | None, srcs: int | None, sizes: int | None, count: int,
                      attrs: int | None, idx: int | None, nattrs: int, stream: int | None) -> int:
        code = self._enter("cuMemcpyBatchAsync", stream, count)
        if code:
            return code
        d = np.ctypeslib.as_array(ctypes.cast(dsts or 0, ctypes.POINTER(_u64)), (count,))
        s = np.ctypeslib.as_array(ctypes.cast(srcs or 0, ctypes.POINTER(_u64)), (count,))
        n = np.ctypeslib.as_array(ctypes.cast(sizes or 0, ctypes.POINTER(_u64)), (count,))
        for dst, src, size in zip(d.tolist(), s.tolist(), n.tolist()):
            self.copy_sizes.append(size)
            self._move(dst, src, size)
        return 0

    def _memcpy_2d(self, copy: int | None, stream: int | None) -> int:
        d = Memcpy2D.from_address(copy or 0)
        code = self._enter("cuMemcpy2DAsync", stream, int(d.Height))
        if code:
            return code
        src = d.srcHost if d.srcMemoryType == MEMORYTYPE_HOST else d.srcDevice
        dst = d.dstHost if d.dstMemoryType == MEMORYTYPE_HOST else d.dstDevice
        self.copy_sizes.append(d.Height * d.WidthInBytes)
        for row in range(d.Height):
            self._move(dst + row * d.dstPitch, src + row * d.srcPitch, d.WidthInBytes)
        return 0

    def _launch(self, function: int | None, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                shared: int, stream: int | None, params: int | None, extra: int | None) -> int:
        width = dict(FUNCTIONS)[function or 0]
        pointers = ctypes.cast(params or 0, ctypes.POINTER(_p))
        scalars = [ctypes.cast(pointers[i], ctypes.POINTER(_u64))[0] for i in range(5)]
        table_ptr, table_rows, rows, host_base, record = scalars
        to_host = ctypes.cast(pointers[5], ctypes.POINTER(ctypes.c_int32))[0]
        ids = np.ctypeslib.as_array(ctypes.cast(pointers[6], ctypes.POINTER(ctypes.c_int64)), (2 * width,)).copy()
        table = np.ctypeslib.as_array(ctypes.cast(table_ptr, ctypes.POINTER(ctypes.c_int64)), (table_rows, 4))
        code = self._enter("cuLaunchKernel", stream, gx, int(rows))  # logged: (name, stream, CTAs, rows)
        if code:
            return code
        for r in range(rows):
            for dev_base, dev_stride, host_offset, nbytes in table.tolist():
                dev = dev_base + int(ids[r]) * dev_stride
                host = host_base + int(ids[width + r]) * record + host_offset
                if to_host:
                    self._move(host, dev, nbytes)
                else:
                    self._move(dev, host, nbytes)
        return 0

    # ------------------------------------------------------------------------------- helpers

    def config(self, *, store: bool, slots: tuple[int, ...] = (), slot_bytes: int = 0,
               batch: bool = True, keep: list[object],
               strided_min_rows: int = TEST_STRIDED_MIN_ROWS, give_way_ns: int = 200_000,
               idle_spin_ns: int = 0, end_lead_ns: int = 50_000,
               caller_issue_max: int = native_backend.CALLER_ISSUE_MAX,
               wait_query_ns: int = round(native_backend.WAIT_QUERY_S * 1e9),
               expect_spin_ns: int = round(native_backend.EXPECT_SPIN_S * 1e9),
               caller_coming_ns: int = round(native_backend.CALLER_COMING_S * 1e9),
               start_timeout_ns: int = round(native_backend.START_TIMEOUT_S * 1e9)) -> native.Config:
        """An issuer config over this driver: copy stream COPY, kernel stream KERNEL; the rest as
        the library's defaults (small jobs handed to an idle thread issued by their callers,
        spinning waiters querying, the early wake and announced callers, staged rows of consecutive records as strided
        copies) but for staged chunks: every one a whole slot (``edge_bytes`` 0; a test tunes it)."""
        c = native.Config()
        for name in ("ctx_set_current", "ctx_get_current", "event_create", "event_destroy", "event_record",
                     "event_query", "event_elapsed", "stream_wait_event", "memcpy_async"):
            setattr(c, name, self.address(name))
        if batch:
            c.memcpy_batch = self.address("memcpy_batch")
            c.batch_abi = 13000
        c.launch = self.address("launch")
        for i, (function, rows) in enumerate(FUNCTIONS):
            c.functions[i] = function
            c.function_rows[i] = rows
        c.nfunctions = len(FUNCTIONS)
        c.threads = 512
        c.copy_stream, c.kernel_stream = COPY, KERNEL
        c.store = int(store)
        c.sm_ctas, c.staged_ctas = 8, 132
        bases = (ctypes.c_uint64 * max(1, len(slots)))(*slots)
        keep.append(bases)
        c.slots, c.slot_bytes = len(slots), slot_bytes
        c.slot_bases = ctypes.cast(bases, ctypes.c_void_p)
        c.poll_min_ns, c.poll_max_ns = 2000, 20000
        c.wait_spin_ns = 100_000
        c.give_way_ns = give_way_ns
        c.idle_spin_ns = idle_spin_ns
        c.end_lead_ns = end_lead_ns
        c.caller_issue_max = caller_issue_max
        c.wait_query_ns = wait_query_ns
        c.expect_spin_ns = expect_spin_ns
        c.caller_coming_ns = caller_coming_ns
        c.start_timeout_ns = start_timeout_ns
        c.memcpy_2d = self.address("memcpy_2d")
        c.strided_min_rows = strided_min_rows
        c.edge_bytes = 0
        c.share_cpu = 1  # the library's default (SHARE_CPU): its yields run under every test here
        return c

    def of(self, name: str) -> list[tuple[Any, ...]]:
        """The logged calls named ``name``."""
        with self._lock:
            return [c for c in self.calls if c[0] == name]

    def snapshot(self) -> list[tuple[Any, ...]]:
        """Every call so far, in order."""
        with self._lock:
            return list(self.calls)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` for up to ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
