"""The native issuer backend: a :class:`~kvoffload.backends.cuda.CudaBackend`'s paths, planned,
enqueued and completed by a C thread that never needs the GIL (docs/design.md §16).

A job costs its caller one hand-off: the fence is recorded on the compute stream (one call into
the library), the block ids are copied into the library and the thread is woken. The thread plans
the job exactly as the Python paths do (the copy kernel's rows, batched-DMA descriptors merged where
they continue, staged chunks over the staging ring), enqueues it behind the fence, polls its end
event with short sleeps and wakes the job's waiters. The engine's Python, busy or not, never delays
the link's start, and the caller never pays for the issue.

Owns: the native issuer (its thread, events, plans and book; stopped exactly once by
:meth:`NativeBackend.release`, and freed exactly once: by the release, or, when a call into the
book was inside the library then, by that call as it leaves) and the :class:`CudaBackend` it was
built over (its streams, ring and kernel tables, released after the thread was joined). The book
owns its jobs' references until their results are taken; a :class:`NativeTicket` owns its job's
reference, a :class:`NativeFence` its taker's, a :class:`NativeLayerMarks` its marks'.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Final, Protocol, cast

import numpy as np
import numpy.typing as npt
import torch

from kvoffload import native
from kvoffload._descriptors import CopyPlan
from kvoffload._jobs import BookedResult, FailedTicket, Ticket
from kvoffload._layer_load import LayerMarks
from kvoffload.backends.cuda import (
    CudaBackend,
    LayeredChooser,
    current_device_index,
    current_device_reader,
    current_stream_reader,
)
from kvoffload.backends.kernel import SmPath, StagedPath
from kvoffload.bindings import driver
from kvoffload.bindings import copier as copier_module
from kvoffload.bindings.copier import Copier
from kvoffload.bindings.kernel import COPY_KERNEL_THREADS, LAUNCH_ABI_VERSION
from kvoffload.bindings.types import CopyMethod
from kvoffload.errors import ClosedError, CudaError, TransferError, WaitTimeoutError
from kvoffload.records import Direction, DriverCallStats

__all__ = [
    "CALLER_COMING_S",
    "CALLER_ISSUE_MAX",
    "CONTROLS",
    "END_LEAD_S",
    "EXPECT_SPIN_S",
    "GIVE_WAY_S",
    "IDLE_LIGHT_S",
    "IDLE_NAP_S",
    "IDLE_SPIN_S",
    "POLL_MAX_S",
    "POLL_MIN_S",
    "SHARE_CPU",
    "STAGED_EDGE_BYTES",
    "START_TIMEOUT_S",
    "STOP_TIMEOUT_S",
    "WAIT_LEAD_S",
    "WAIT_QUERY_S",
    "WAIT_SPIN_S",
    "NativeBackend",
    "NativeFence",
    "NativeLayerMarks",
    "NativeTicket",
    "native_error",
    "tune",
]

_log = logging.getLogger("kvoffload.native")
I64Array = npt.NDArray[np.int64]

#: The issuer thread polls a job's end event first after this long, then after an eighth of the
#: time the job has been in flight, never less than this nor more than :data:`POLL_MAX_S`: a job
#: is found done within about 12% of its time (and 20 us) at a few thousand queries per second.
POLL_MIN_S: Final = 4e-6
POLL_MAX_S: Final = 20e-6
#: How long a wait for a job spins (without the GIL) before it blocks: waking a blocked thread costs
#: tens of microseconds on some hosts, more than a short job's copy.
WAIT_SPIN_S: Final = 2e-3
#: The longest the issuer thread holds back its next driver call while a caller's thread is inside
#: one of its own (the fence's record, a layer's stream wait): the driver serialises a context's
#: calls, and a thread issuing call after call kept the engine's thread waiting behind several.
GIVE_WAY_S: Final = 200e-6
#: How long the issuer thread, out of work, keeps looking for the next job (without the lock, not
#: blocked) before it blocks; 0 (the default): it blocks at once. With it, a job handed over
#: meanwhile starts without a wake-up and its hand-off signals nothing, but it is off: on the H200
#: (docs/design.md §16) 0.5 ms of it removed the 5-36 us wake-up of jobs handed over soon after
#: the last, and the caller's own code ran slower beside the spinning thread (a 1-block job's
#: result came back 88.6-98.4 us after the call against 79.8-81.5 us without it).
IDLE_SPIN_S: Final = 0.0
#: Out of work, the issuer thread blocks in naps of :data:`IDLE_NAP_S` for :data:`IDLE_LIGHT_S`
#: after its last job, then until woken; 0 (the default): it blocks until woken at once. A short
#: timed sleep should keep its core out of a deep idle state (the likely reason why waking the
#: thread took 20-45 us on the H200 hosts after it blocked for a millisecond, 5 us after tens of
#: microseconds). Off: on the H200 50 us naps shortened that wake-up (17 to 9 us) but not a job's
#: call -> result, and on the 2-core CI machine naps that ended into the blocking wait delayed the
#: next job by about 2 ms (docs/design.md §16).
IDLE_NAP_S: Final = 0.0
IDLE_LIGHT_S: Final = 2e-3
#: A job of at most this many pages handed to an issuer thread that is out of work and blocked is
#: issued by the caller's thread inside the hand-off (without the GIL), so that the thread's wake-up
#: (5-90 us on the H200 hosts) is not on its path; 0: the thread issues every job. On the H200
#: (docs/design.md §16) a 1-block job's call -> result went from 108-113 us to 89-93 us with it, a
#: 64 MiB job's at 2 MiB pages from 0.88-0.91x to 0.93-0.97x a pinned copy's. A larger job (a
#: 256-block store of 16384 pages) stays the thread's: its issue would lengthen the caller's call.
#: With it on, a layered load's first layer is issued by its caller too when it costs few driver
#: calls (``sm``, or ``staged`` with strided copies), the rest by the thread.
CALLER_ISSUE_MAX: Final = 1024
#: A wait that spins (:data:`WAIT_SPIN_S`) queries its job's end event itself at most this often
#: once the job heads the issuer's flight, instead of waiting for the thread's next poll (its
#: sleeps of 4-20 us come with their wake-ups); 0: only the thread queries. On the H200
#: (docs/design.md §16) a 1-block job was found done 9.0-10.5 us after its issue's start plus its
#: device time with it, 15.5-17.5 us without.
WAIT_QUERY_S: Final = 1e-6
#: The worker's fast front wakes an issuer thread that is out of work and blocked as soon as it
#: takes a job too large for its caller to issue (:data:`CALLER_ISSUE_MAX`), before its checks and
#: bookkeeping, and the thread then looks for the hand-off for this long before it blocks again:
#: its wake-up overlaps the caller's work instead of following the hand-off. 0: no early wake. On
#: the H200 a 64 MiB store at 4 KiB pages began 12.2 us after its hand-off with it, 46.2 us without
#: (docs/design.md §16).
EXPECT_SPIN_S: Final = 200e-6
#: The same call tells a thread with work (issuing or polling) that the caller's hand-off is coming:
#: the thread gives way before each of its driver calls until the caller's fence is recorded, for
#: this long at most (an announced caller that does not come costs the issue that much once), so
#: the record finds no call of the thread's in progress to wait for. 0: the thread is not told.
#: Measured on the H200 in docs/design.md §16 (*A caller announced to a busy thread*).
CALLER_COMING_S: Final = 50e-6
#: Where the issuer thread and a caller share a CPU (a host of few cores, an engine's threads pinned
#: together), the thread gives the CPU back once when it takes up a job its caller handed over on
#: that CPU, and every spin that waits for the other side yields its CPU (a waiter's while its job
#: is not issued yet; the thread's for an announced hand-off or a caller's driver call). Without it,
#: on the two-CPU CI host, the thread woken by a hand-off preempted its caller for the whole issue
#: (a 256-block store's call 350-400 us against 13 with a CPU each), and a waiter's spin held the
#: CPU the thread needed (call -> result 2.2 ms at p90). False: never (docs/design.md §16).
SHARE_CPU: Final = True
#: A wait that blocked past its spin (:data:`WAIT_SPIN_S`: a job longer than that) wakes this long
#: before the end the thread predicts for its job and spins (querying, :data:`WAIT_QUERY_S`) to as
#: long after it plus an eighth of the job's predicted device time, then blocks until woken; 0:
#: it blocks until woken. The thread predicts ends only where :data:`END_LEAD_S` is not 0. A core
#: that slept through most of a long job takes long to wake: on an H100 host a 256-block store's
#: (10 ms) blocked wait returned 96-186 us after the thread found the job done, where a spinning
#: one returns within 1-2 us (docs/design.md §16). It errs early, not late: the prediction is the
#: fastest rate seen.
WAIT_LEAD_S: Final = 300e-6
#: The issuer thread polls a job without sleeps from this long before the end it predicts for it
#: (from the fastest device time per byte it has seen) to as long after, for jobs predicted to run
#: at least 8 x :data:`POLL_MAX_S`: sleeping polls (and their wake-ups) found 64 MiB jobs' ends a
#: median 32 us after them on the H200 hosts, 18.6 us with this (docs/design.md §16).
END_LEAD_S: Final = 50e-6
#: A staged chunk's rows of at least this many records that follow each other in the host pool,
#: where a row is narrower than a record (a layer's span of each record in a layered load), go to
#: the driver as one strided copy (``cuMemcpy2DAsync``) per byte range of the record instead of one
#: batched descriptor per row; 0: never. On the H200 a layer of 256 spans of 64 KiB host -> device
#: took 1.36x a contiguous copy of its bytes as descriptors (114 us of the driver's time) and 1.00x
#: as one strided copy (3 us); spans of 8 KiB 12.1x against 1.06x
#: (``python -m tests.gpu.probe_strided_copy``). But a strided copy costs the copy engine 2.4-2.8
#: us whatever its rows: on one H100 host a 16-layer layered load of 256 blocks from records in
#: runs of 4 took 0.19x a pinned copy at 8 KiB spans and 0.62x at 64 KiB (runs of 16: 0.47x and
#: 0.87x) with strided copies from runs of 4 records, against 0.29x and 0.96x from records apart
#: (descriptors) and 0.84x and 0.99x from records in order (one strided copy a layer)
#: (``python -m tests.gpu.probe_layered_records``; docs/design.md §12). The most records a run
#: needs: narrower copies need fewer (:data:`STRIDED_ROW_BYTES`).
STRIDED_MIN_ROWS: Final = 64
#: A staged layer's runs of records go as strided copies from one record per this many bytes of its
#: copies' mean width (ceil; at least 8 records, at most :data:`STRIDED_MIN_ROWS`): a narrow
#: descriptor costs the copy engine about as much as a wide one up to 32 KiB, so the narrower the
#: copies the shorter the run that one strided copy beats. On one H100 host (the first of two in
#: docs/design.md §12), 16 layers of 256 blocks from records in runs of R, as descriptors / as
#: strided copies (ratios to a pinned copy):
#: 8 KiB spans R = 8 0.15 / 0.32, R = 32 0.25 / 0.64; 16 KiB R = 16 0.54 / 0.60, R = 32 0.51 /
#: 0.71; 32 KiB R = 32 0.64 / 0.83; 64 KiB R = 32 0.95 / 0.93, R = 64 0.95 / 0.96 (docs/design.md
#: §12). 0: :data:`STRIDED_MIN_ROWS` at any width.
STRIDED_ROW_BYTES: Final = 1 << 10
#: Bytes of the staged chunk at the edge of a job alone (a store's first, a load's last; nothing of
#: its direction in flight or queued when its issue is taken up): a store's first DMA waits for its
#: first chunk's gather, a load's end for its last chunk's scatter (on the H200 15 us for 16 MiB,
#: about 60 for 64 MiB), so the chunk there is small and the chunks grow from it by 8 to whole
#: slots; jobs behind others keep whole slots. 0: never (docs/design.md §7).
STAGED_EDGE_BYTES: Final = 1 << 20
#: How long :meth:`NativeBackend.release` waits at most for the thread to leave a driver call (a
#: shutdown gives it the time it has left, if less).
STOP_TIMEOUT_S: Final = 10.0
#: How long :meth:`NativeBackend.start` waits at most for the thread to make the device's context
#: current and create its slots' events (driver calls); past it the start fails and the thread lets
#: go of the library's memory when the driver returns.
START_TIMEOUT_S: Final = 10.0
#: CONTROL ONLY: the rules :meth:`NativeBackend.over` breaks on purpose (``native.CONTROL_*``): 0
#: except in a test whose control proves that a rule is needed.
CONTROLS = 0
_RELEASED: Final = "the backend was released before the job was issued"
_RESULT_LOST: Final = ("the job finished but its result could not be read (a MemoryError while the "
                       "library handed it over): whether its copies completed is unknown")
#: Made in advance, for when even the error cannot be made.
_RESULT_LOST_ERROR: Final = TransferError(_RESULT_LOST)
#: The most results :meth:`NativeBackend.book_take` takes in one call into the library.
_TAKE_MAX: Final = 64
#: A taken result as the call front's ``book_take`` gives it: id, code, failure, pairs, tag, device
#: seconds, failed call, and four times in ns.
_Raw = tuple[int, int, int, int, int, float, str, int, int, int, int]
_PATHS: Final = {"dma": native.PATH_DMA, "dma-loop": native.PATH_DMA, "sm": native.PATH_SM,
                 "staged": native.PATH_STAGED}


def native_error(code: int, call: str) -> BaseException:
    """The exception for a code the library reported for ``call`` (a ``CUresult`` or its own)."""
    if code == native.RELEASED:
        return TransferError(_RELEASED)
    if code == native.ABANDONED:
        return TransferError("the backend was released while the job was in flight")
    if code == native.NO_MEMORY:
        return TransferError("the native issuer could not allocate host memory for the job")
    if code == native.RECORD_TOO_BIG:
        return TransferError("a host record does not fit a staging slot")
    try:
        driver.checked_code(call, code)
    except CudaError as exc:
        return exc
    return TransferError(f"{call} failed with code {code}")


def _ns(seconds: float) -> int:
    return max(0, min(int(seconds * 1e9), 1 << 62))


def tune(c: native.Config) -> None:
    """Set the issuer's timing and tuning fields of ``c`` from this module's constants (read now):
    the polls, the waits' spin, queries and lead, the thread's give-way, idle spin, naps, end lead,
    early wake and announced callers, the caller's-issue limit, the staged rows' strided copies
    and edge chunks, the start's deadline, the longest copy (``copier.COPY_PIECE_BYTES``), and the
    controls. ``ctx_get_current``, which the caller's issue needs, is the
    caller's to resolve."""
    c.poll_min_ns = _ns(POLL_MIN_S)
    c.poll_max_ns = _ns(POLL_MAX_S)
    c.controls = CONTROLS
    c.wait_spin_ns = _ns(WAIT_SPIN_S)
    c.give_way_ns = _ns(GIVE_WAY_S)
    c.idle_spin_ns = _ns(IDLE_SPIN_S)
    c.end_lead_ns = _ns(END_LEAD_S)
    c.idle_nap_ns = _ns(IDLE_NAP_S)
    c.idle_light_ns = _ns(IDLE_LIGHT_S)
    c.wait_query_ns = _ns(WAIT_QUERY_S)
    c.expect_spin_ns = _ns(EXPECT_SPIN_S)
    c.caller_issue_max = max(0, int(CALLER_ISSUE_MAX))
    c.strided_min_rows = max(0, int(STRIDED_MIN_ROWS))
    c.strided_row_bytes = max(0, int(STRIDED_ROW_BYTES))
    c.edge_bytes = max(0, int(STAGED_EDGE_BYTES))
    c.caller_coming_ns = _ns(CALLER_COMING_S)
    c.start_timeout_ns = _ns(START_TIMEOUT_S)
    c.piece_bytes = max(0, int(copier_module.COPY_PIECE_BYTES))
    c.wait_lead_ns = _ns(WAIT_LEAD_S)
    c.share_cpu = int(bool(SHARE_CPU))


class NativeTicket:
    """One job handed to the native issuer. Owns the ticket's reference to the job until
    :meth:`release`, or until :meth:`done` finds the job done with no call inside the library (the
    same call into the library drops it). ``error`` is known once the job is done (the thread
    issues it later).

    Thread-safe: a wait may block in the library while another thread finds the job done and
    releases the ticket; the reference is dropped only once no call is inside the library (the job
    must not be freed under a waiter). The library is called through the call front where it is
    built (``front``: the module, its spec's address and the spec, which the ticket keeps alive:
    a ticket may outlive its backend), else through ctypes. A result that cannot be read after the
    library let go of its job (a ``MemoryError``) fails the job, and the ticket calls no more."""

    __slots__ = ("_lib", "_job", "error", "path", "_done", "_seconds", "_released", "_failure",
                 "_times", "_guard", "_users", "_front", "_spec", "_spec_owner")

    def __init__(self, lib: ctypes.CDLL, job: int, path: str,
                 front: tuple[ModuleType, int, object] | None = None) -> None:
        self._lib = lib
        self._job = job
        self.error: BaseException | None = None
        self.path: str | None = path
        self._done = False
        self._seconds = 0.0
        self._released = False
        self._failure: BaseException | None = None
        self._times = (0.0, 0.0, 0.0, 0.0)
        self._guard = threading.Lock()
        self._users = 0  # calls inside the library
        self._front: ModuleType | None = front[0] if front is not None else None
        self._spec = front[1] if front is not None else 0
        # the spec at that address: the backend's, kept alive while the ticket may call through it
        # (a ticket can outlive its backend; the job holds its own reference to the issuer)
        self._spec_owner = front[2] if front is not None else None

    def _enter(self) -> bool:
        """Count a call into the library; False once released (the job may be gone)."""
        with self._guard:
            if self._released:
                return False
            self._users += 1
            return True

    def _leave(self) -> None:
        with self._guard:
            self._users -= 1
            last = self._released and self._users == 0
        if last:
            self._drop()

    def _drop(self) -> None:
        """The ticket's reference goes (kvo_job_release)."""
        if self._front is not None:
            self._front.job_release(self._spec, self._job)
        else:
            self._lib.kvo_job_release(self._job)

    def _take(self, release: bool) -> bool:
        """Whether the job is done; once it is, keep its outcome, its device time and its timeline
        and, with ``release`` (no other call inside the library), drop the ticket's reference in
        the same call into the library (kvo_job_take)."""
        if self._front is not None:
            try:
                taken = self._front.job_take(self._spec, self._job, release)
            except MemoryError:  # only its result's tuple can fail, after the library took the job
                if release:
                    self._lose_result()
                raise
            if taken is None:
                return False
            if release:
                self._released = True
            code, fail, handed, began, issued, found, seconds, name = taken
        else:
            out = (ctypes.c_int64 * 6)()
            c_seconds, c_name = ctypes.c_double(0.0), ctypes.c_char_p()
            if self._lib.kvo_job_take(self._job, int(release), out, ctypes.byref(c_seconds),
                                      ctypes.byref(c_name)) != native.JOB_DONE:
                return False
            if release:
                self._released = True  # the library let go of the job: never again through this ticket
            try:
                code, fail, handed, began, issued, found = out
                seconds, name = c_seconds.value, (c_name.value or b"").decode()
            except MemoryError:
                if release:
                    self._lose_result()
                raise
        self._times = (handed / 1e9, began / 1e9, issued / 1e9, found / 1e9)
        self._seconds = seconds
        if fail == native.FAIL_COMPLETION:
            self._failure = native_error(int(code), name or "native issuer")
        elif fail != native.FAIL_NONE:
            self.error = native_error(int(code), name or "native issuer")
        self._done = True
        return True

    def _lose_result(self) -> None:
        """The library let go of the done job but its result could not be read (a MemoryError):
        the ticket is released (never again through the library: the job may be freed) and done,
        failed, so that its job is reported rather than waited for forever."""
        self._released = True
        try:
            self.error = TransferError(_RESULT_LOST)
        except MemoryError:
            self.error = _RESULT_LOST_ERROR
        self._done = True

    def _outcome(self) -> bool:
        if self._failure is not None:
            raise self._failure
        return True

    def done(self) -> bool:
        """Whether the thread found the job complete; never blocks. Raises the completion's
        failure (at every call, as a failed event query does). The call that finds the job done
        also drops the ticket's reference unless a wait is inside the library: its result is kept,
        and :meth:`release` then has nothing left to do."""
        if not self._done:
            with self._guard:  # the library's call never waits long (the issuer's lock)
                if not self._released and not self._take(release=self._users == 0):
                    return False
        return self._outcome()

    def wait(self, timeout_s: float) -> bool:
        """Block, without the GIL, until the thread found the job complete or ``timeout_s``
        passed; True when done. Raises as :meth:`done`."""
        if not self._done and self._enter():
            try:
                done = (self._front.job_wait(self._spec, self._job, _ns(timeout_s)) if self._front is not None
                        else self._lib.kvo_job_wait(self._job, _ns(timeout_s)))
                if not done or not self._take(release=False):
                    return False
            finally:
                self._leave()
        return self._outcome()

    def times(self) -> tuple[float, float, float, float]:
        """When the job was handed over, its issue began, it was issued and found done
        (``time.monotonic()`` seconds; 0.0 for what has not happened yet; kept once the job is
        done, so also valid after :meth:`release`): where a job's time goes."""
        if self._done or not self._enter():
            return self._times
        try:
            return self._fetch_times()
        finally:
            self._leave()

    def _fetch_times(self) -> tuple[float, float, float, float]:
        out = (ctypes.c_int64 * 4)()
        self._lib.kvo_job_times(self._job, out)
        return out[0] / 1e9, out[1] / 1e9, out[2] / 1e9, out[3] / 1e9

    def seconds(self) -> float:
        """Device time between the job's start and end events (0.0 for a failed job)."""
        return self._seconds if self.error is None else 0.0

    def release(self) -> None:
        """Drop the ticket's reference (the job's events go back to the issuer's pools) once no
        call is inside the library. Once; later calls do nothing."""
        if self._released:  # never unset: the call that found the job done may have dropped it
            return
        with self._guard:
            last = not self._released and self._users == 0
            self._released = True
        if last:
            self._drop()


class NativeFence:
    """A compute-stream position taken by the native issuer. Owns its taker's reference until
    :meth:`NativeBackend.release_fence`; each job handed over with it holds one more until the
    thread enqueued its stream wait, so giving it back early never lets a job wait for a later
    record.

    A fence of :meth:`NativeBackend.position` (``pointer`` 0) is not recorded yet: the hand-off
    records it on ``stream`` in the same call into the library, and the job is its only taker."""

    __slots__ = ("pointer", "stream", "_released")

    def __init__(self, pointer: int, stream: int = 0) -> None:
        self.pointer = pointer
        self.stream = stream
        self._released = False


class NativeLayerMarks:
    """The layers of one layered job on the native issuer: the thread records an event per layer as
    its last copy is enqueued; :meth:`wait` enqueues the stream wait in the library under its lock.

    Owns the marks' reference to the job from :meth:`attach` until :meth:`release` (dropped once no
    wait is inside the library: a wait returns as soon as the job is done, which the result that
    leads to the release implies). A lock guards the state; the condition a wait blocks on is made
    on it by the first wait that must block (one before the hand-off returned): the fast front makes
    marks for every layered job before its layer 0 is issued, and most are never waited for so.
    """

    __slots__ = ("_backend", "_count", "_job", "_settled", "_released", "_waiters", "_lock", "_cond")

    on_device = True

    def __init__(self, backend: NativeBackend, count: int) -> None:
        self._backend = backend
        self._count = count
        self._job: int | None = None
        self._settled = False
        self._released = False
        self._waiters = 0
        self._lock = threading.Lock()
        self._cond: threading.Condition | None = None  # on _lock, made by a wait that blocks

    @property
    def count(self) -> int:
        """Layers of the job."""
        return self._count

    def attach(self, job: int) -> None:
        """The job was handed over: waits go to the library. Marks released meanwhile (the job's
        result was taken before this call: a job done in its hand-off) drop the reference at once."""
        with self._lock:
            if self._released:
                job_gone = job
            else:
                job_gone = 0
                self._job = job
                if self._cond is not None:
                    self._cond.notify_all()
        if job_gone:
            self._backend.lib.kvo_marks_release(job_gone)

    def settle(self) -> None:
        """The hand-off returned: a job never handed over has nothing to wait for."""
        with self._lock:
            self._settled = True
            if self._cond is not None:
                self._cond.notify_all()

    def wait(self, layer: int, stream: object | None, timeout_s: float) -> bool:
        """Make ``stream`` (default: the device's current stream) wait on the device for layer
        ``layer``; blocks the host only until the thread marked it. False when the job ended
        without the layer (never handed over, or failed or given up before the wait).

        Raises:
            DeviceMismatchError: a stream of another device, or not a stream.
            WaitTimeoutError: the layer was not marked within ``timeout_s``.
            CudaError: the driver refused the stream wait.
        """
        backend = self._backend
        handle = backend.stream_handle(stream)
        with self._lock:
            if self._job is None and not self._settled and not self._released:
                if self._cond is None:
                    self._cond = threading.Condition(self._lock)
                if not self._cond.wait_for(lambda: self._job is not None or self._settled or self._released,
                                           timeout_s):
                    raise WaitTimeoutError(f"layer {layer} was not handed to the issuer within {timeout_s} s")
            job = self._job
            if self._released:  # its result was published: everything landed or it says why not
                return True
            if job is None:  # settled without a hand-off: nothing was issued
                return False
            self._waiters += 1
        try:
            if not backend.switches_device():
                code = backend.lib.kvo_wait_layer(job, layer, handle, _ns(timeout_s))
            else:
                with torch.cuda.device(backend.index):
                    code = backend.lib.kvo_wait_layer(job, layer, handle, _ns(timeout_s))
        finally:
            with self._lock:
                self._waiters -= 1
                last = self._last_out()
            if last:
                backend.lib.kvo_marks_release(job)
        if code == native.TIMEOUT:
            raise WaitTimeoutError(
                f"layer {layer} was not handed to the device within {timeout_s} s (earlier jobs "
                "were still being issued)"
            )
        if code == native.JOB_FAILED:
            return False
        driver.checked_code("cuStreamWaitEvent", int(code))
        return True

    def _last_out(self) -> bool:
        """Whether the marks were released and no wait is inside the library any more: then the
        job is detached here, and the caller drops the marks' reference (caller holds the lock)."""
        if self._waiters or not self._released or self._job is None:
            return False
        self._job = None
        return True

    def release(self) -> None:
        """The job's result was published: waits return at once; the marks' reference goes once no
        wait is inside the library. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            if self._cond is not None:
                self._cond.notify_all()
            job = self._job if self._waiters == 0 else None
            if job is not None:
                self._job = None
        if job is not None:
            self._backend.lib.kvo_marks_release(job)


class Wrapped(Protocol):
    """What a :class:`NativeBackend` takes over: a backend whose streams (and buffers) its thread
    uses, released after the thread was joined."""

    direction: Direction
    device: torch.device

    @property
    def path(self) -> str:
        """The path name results report."""

    def stream_handle(self, stream: object | None) -> int:
        """The handle of a stream of the device (None: its current stream)."""

    def release(self) -> None:
        """Release the streams and buffers."""


#: ``plan -> (device address, rows)`` of the plan's copy-kernel table.
TableSource = Callable[[CopyPlan], "tuple[int, int]"]


class BookedHandOff(Protocol):
    """A call of :meth:`NativeBackend.booked_hand_off_call`."""

    def __call__(self, job_id: int, src: I64Array, dst: I64Array, stream: int,
                 marks: LayerMarks | None = None) -> int:
        """Hand the job over as booked: 0, or the code it failed with unbooked; never raises."""


class NativeBackend:
    """One direction's copies issued by the native thread over a :class:`CudaBackend`'s streams and
    paths (see the module docstring). Build it with :meth:`over`.

    It only hands jobs over (``hands_off``) and books them (``books``): its handler
    (:class:`kvoffload.handler.BookedHandler`) hands every job over on the caller's thread, never
    splits one, and takes results from the library's book; ``issue`` still returns a
    :class:`NativeTicket` per job (the library's job handle) to a handler that does not book.
    """

    name = "cuda"
    #: ``issue`` hands the job to a thread of the backend's own: cheap, whatever the job's size.
    hands_off = True
    #: Jobs handed over as booked stay in the library's book, in hand-off order, until their
    #: results are taken in one call (:meth:`book_take`): the handler keeps no object per job
    #: (:class:`kvoffload.handler.BookedHandler`; docs/design.md §16).
    books = True

    def __init__(
        self, inner: Wrapped, lib: ctypes.CDLL, issuer: int, *, index: int,
        choose: Callable[[int], str], path_names: Mapping[str, str], tables: TableSource | None,
        config: native.Config, keep: object, layered: LayeredChooser | None = None,
    ) -> None:
        self.direction: Direction = inner.direction
        self.device = inner.device
        self.index = index
        self._on_cuda = self.device.type == "cuda"  # (the CPU tests' fake device is not)
        self.lib = lib
        self._inner = inner
        self._issuer = issuer
        self._keep = (config, keep)  # the issuer's config and what it points to
        self._choose = choose
        self._layered = layered
        # a staged layer's rows in runs of this many records go as one strided copy whatever the
        # layer's width (narrower layers' shorter runs too: STRIDED_ROW_BYTES); auto's layered choice
        # counts shorter runs as short (0: no strided copies; and taken as none where copies are
        # cut in pieces, which may leave a run no strided copy)
        self._strided_min_rows = (int(config.strided_min_rows)
                                  if config.memcpy_2d and config.piece_bytes <= 0 else 0)
        self._path_names = dict(path_names)
        self._tables = tables
        self._plans: dict[tuple[CopyPlan, bool], int] = {}
        self._plan_arrays: dict[tuple[int, ...], tuple[ctypes.Array[ctypes.c_void_p], int]] = {}
        self._single: dict[tuple[CopyPlan, bool], int] = {}
        self._lock = threading.Lock()
        self._released = False
        # The book (docs/design.md §16): calls inside the library that need the issuer (a wait may
        # block), and whether release_within left the issuer's free to the last of them; counted
        # under a lock of their own (taken inside _lock, never around it), not under _lock, which
        # a hand-off holds through its fence's record: a poll never waits behind one.
        self._count_lock = threading.Lock()
        self._book_users = 0
        self._free_deferred = False
        self._freed = False  # the issuer's memory went (a release whose stop failed keeps it)
        self._joined = False  # the issuer's thread stopped and was joined (under _stop_lock)
        self._stop_lock = threading.Lock()  # one stop at a time: the thread is joined once
        self._book_closed = False  # a drain's last look: no job is booked any more
        self._book_totals = (0, 0)  # (jobs in the book, jobs ever booked) when the issuer went
        self._book_errors: dict[int, BaseException] = {}  # booked failed in Python (kvo_book_fail)
        self._tag_names = tuple(dict.fromkeys(path_names.values()))  # a booked job's tag -> its path
        self._tags = {name: self._tag_names.index(shown) for name, shown in path_names.items()}
        self._take_out = (ctypes.c_int64 * (native.BOOK_FIELDS * _TAKE_MAX))()
        self._take_seconds = (ctypes.c_double * _TAKE_MAX)()
        self._take_calls = (ctypes.c_char_p * _TAKE_MAX)()
        self._book_out = (ctypes.c_int64 * 2)()
        self._take_lock = threading.Lock()  # the ctypes take's out-arrays
        # The hand-off's fixed arguments, built once: ctypes converts them at no call.
        self._hand_off = lib.kvo_hand_off
        self._hand_off_booked = lib.kvo_hand_off_booked
        self._fence_take = lib.kvo_fence_take
        self._issuer_arg = ctypes.c_void_p(issuer)
        self._error = ctypes.c_int64(0)
        self._error_arg = ctypes.byref(self._error)
        # The call front's hand-off, where it is built (the same call without ctypes).
        front = native.front()
        self._front = front
        self._front_hand_off = front.hand_off if front is not None else None
        self._front_spec = native.front_spec(lib, issuer=issuer)
        self._front_at = ctypes.addressof(self._front_spec)
        # The tickets' calls: the module, the spec's address and the spec (each ticket keeps it alive).
        self._front_calls = (front, self._front_at, self._front_spec) if front is not None else None
        self._stores = self.direction is Direction.STORE
        # The early wake's (see early_wake): the largest job its caller issues, and whether it is on.
        self._caller_issue_max = int(config.caller_issue_max)
        self._expect: Callable[[object], object] | None = None
        self._expect_arg: object = None
        if config.expect_spin_ns > 0 or config.caller_coming_ns > 0:  # through the call front where it is built
            self._expect, self._expect_arg = ((front.expect, self._front_at) if front is not None
                                              else (lib.kvo_issuer_expect, self._issuer_arg))

    @classmethod
    def start(
        cls, inner: Wrapped, config: native.Config, *, index: int, choose: Callable[[int], str],
        path_names: Mapping[str, str], tables: TableSource | None, keep: object = None,
        layered: LayeredChooser | None = None,
    ) -> NativeBackend:
        """Start the library's thread with ``config`` (driver entry points, streams, paths) over
        ``inner``; on success the new backend owns ``inner``, on failure the caller still does.

        ``choose`` maps a job's block count to a path name, ``path_names`` a path name to what
        results report, ``tables`` a plan to its copy-kernel table in device memory (None: no
        kernel path); ``keep`` is whatever ``config`` points into; ``layered`` chooses a layered
        load's path (default: ``choose``'s for its size).

        Raises:
            NativeBuildError: the library could not be built or loaded.
            TransferError: the thread could not be started, or did not start within its deadline.
            CudaError: the thread could not make the device's context current or create its events.
        """
        lib = native.library()
        error = ctypes.c_int64(0)
        issuer = lib.kvo_issuer_new(ctypes.byref(config), ctypes.byref(error))
        if not issuer and error.value == native.TIMEOUT:
            raise TransferError(
                f"the native issuer's thread did not start within {config.start_timeout_ns / 1e9:g} s "
                "(still inside cuCtxSetCurrent or cuEventCreate; it lets go of its memory when the "
                "driver returns)")
        if not issuer:
            raise TransferError(f"the native issuer could not start (code {error.value})")
        if error.value:
            if lib.kvo_issuer_stop(issuer, _ns(STOP_TIMEOUT_S)):  # still inside a driver call: its
                raise TransferError(                             # memory is left to the process
                    f"the native issuer's thread failed its start (code {error.value}) and did not "
                    f"stop within {STOP_TIMEOUT_S:g} s; its memory is left to the process")
            lib.kvo_issuer_free(issuer)
            raise native_error(int(error.value), "cuCtxSetCurrent")
        return cls(inner, lib, int(issuer), index=index, choose=choose, path_names=path_names,
                   tables=tables, config=config, keep=keep, layered=layered)

    @classmethod
    def over(cls, inner: CudaBackend, copier: Copier) -> NativeBackend:
        """:meth:`start` over a :class:`CudaBackend`'s streams and paths (``copier``: the paths'
        DMA method), with the device's driver entry points.

        Raises:
            TransferError: the copy method is ``batch-bindings`` (a cross-check of the Python call
                path, which the native issuer does not take); and as :meth:`start`.
        """
        if copier.method is CopyMethod.BATCH_BINDINGS:
            raise TransferError("the native issuer calls the driver itself: copy method "
                                "'batch-bindings' needs issuer='python'")
        native.library()  # a machine that cannot build it fails before any driver work
        index = inner.streams.index
        hot = driver.HOT_ABI_VERSION
        c = native.Config()
        c.ctx_set_current = driver.entry_point(b"cuCtxSetCurrent", hot)
        c.context = driver.primary_context(index)
        for field, symbol in (("event_create", b"cuEventCreate"), ("event_destroy", b"cuEventDestroy"),
                              ("event_record", b"cuEventRecord"), ("event_query", b"cuEventQuery"),
                              ("event_elapsed", b"cuEventElapsedTime"),
                              ("stream_wait_event", b"cuStreamWaitEvent"),
                              ("memcpy_async", b"cuMemcpyAsync"), ("memcpy_2d", b"cuMemcpy2DAsync")):
            setattr(c, field, driver.entry_point(symbol, hot))
        if copier.method is CopyMethod.BATCH_CTYPES and copier.symbol and copier.abi_version:
            c.memcpy_batch = copier.symbol
            c.batch_abi = copier.abi_version
        store = inner.direction is Direction.STORE
        c.batch_attrs = copier.attrs_pointer(
            driver.SrcAccessOrder.STREAM if store else driver.SrcAccessOrder.ANY)
        c.copy_stream = inner.streams.copy
        c.kernel_stream = inner.streams.kernel or None
        c.store = int(store)
        bases = (ctypes.c_uint64 * 1)(0)
        tables: TableSource | None = None
        for path in inner.paths.values():
            if isinstance(path, (SmPath, StagedPath)):
                functions = path.launcher.kernel.functions
                c.launch = driver.entry_point(b"cuLaunchKernel", LAUNCH_ABI_VERSION)
                for i, (function, rows) in enumerate(functions):
                    c.functions[i] = function
                    c.function_rows[i] = rows
                c.nfunctions = len(functions)
                c.threads = COPY_KERNEL_THREADS
                tables = path.tables.get
            if isinstance(path, SmPath):
                c.sm_ctas = path.ctas
            if isinstance(path, StagedPath):
                c.staged_ctas = path.ctas
                c.slots = path.slots
                c.slot_bytes = path.slot_bytes
                bases = (ctypes.c_uint64 * path.slots)(*path.slot_bases)
        c.slot_bases = ctypes.cast(bases, ctypes.c_void_p)
        tune(c)
        if CALLER_ISSUE_MAX > 0:
            c.ctx_get_current = driver.entry_point(b"cuCtxGetCurrent", hot)
        return cls.start(
            inner, c, index=index, choose=inner._choose,  # noqa: SLF001 - the backend it takes over
            path_names={name: path.name for name, path in inner.paths.items()}, tables=tables,
            keep=bases, layered=inner._layered,  # noqa: SLF001
        )

    # --------------------------------------------------------------------------- the Backend seam

    @property
    def path(self) -> str:
        """The path name results report (``"auto"`` for a calibrated choice)."""
        return self._inner.path

    def stream_handle(self, stream: object | None) -> int:
        """The handle of ``stream`` (see :meth:`CudaBackend.stream_handle`)."""
        return self._inner.stream_handle(stream)

    def switches_device(self) -> bool:
        """Whether a call that records or waits on a stream must make this backend's device current
        first (the caller's current CUDA device is another one)."""
        return self._on_cuda and current_device_index() != self.index

    def fence(self, stream: object | None) -> object:
        """Record a fence on the compute stream (default: the device's current stream) in the
        library, with this backend's device current for the call.

        Raises:
            DeviceMismatchError: a stream of another device, or not a stream.
            CudaError: the driver refused the record.
            ClosedError: the backend was released (the issuer is gone).
        """
        handle = self.stream_handle(stream)
        error = ctypes.c_int64(0)
        with self._lock:  # as a hand-off: release_within frees the issuer only after it
            if self._released:
                raise ClosedError(f"the native {self.direction.value} backend was released")
            if not self.switches_device():
                pointer = self._fence_take(self._issuer_arg, handle, ctypes.byref(error))
            else:
                with torch.cuda.device(self.index):
                    pointer = self._fence_take(self._issuer_arg, handle, ctypes.byref(error))
        if not pointer:
            raise native_error(int(error.value), "cuEventRecord")
        return NativeFence(int(pointer))

    def position(self, stream: object | None) -> NativeFence:
        """The fence of a job handed over right away on this thread (the handler's own fence of a
        job): the stream is checked now and the hand-off records the fence in the same call into
        the library, one call instead of three (take, hand over, give back).

        Raises:
            DeviceMismatchError: a stream of another device, or not a stream.
        """
        return NativeFence(0, self.stream_handle(stream))

    def current_stream_reader(self) -> Callable[[], int]:
        """A call without arguments that returns the handle of the calling thread's current stream
        on this backend's device (the fast front's stream when none is given): torch's raw
        accessor bound to the device where it has one, else :meth:`stream_handle` of None."""
        if self._on_cuda:
            return current_stream_reader(self.index)
        return functools.partial(self.stream_handle, None)

    def release_fence(self, fence: object) -> None:
        """Drop the taker's reference to a fence of :meth:`fence` (once; nothing for one of
        :meth:`position`, which the job took)."""
        if isinstance(fence, NativeFence) and fence.pointer:
            with self._lock:  # the issuer is freed after release_within set _released under it;
                # the fence's flag is looked at and set under it too: two threads releasing one
                # fence at once would both drop the reference
                if fence._released:  # noqa: SLF001 - its owner
                    return
                fence._released = True  # noqa: SLF001
                if not self._released:  # else the issuer, and its fences' pool, are gone
                    self.lib.kvo_fence_release(self._issuer, fence.pointer)

    def start_thread(self) -> None:
        """Nothing: a handler over this backend starts no thread (it hands jobs over itself)."""

    def thread_stopped_reader(self) -> Callable[[], bool]:
        """:attr:`thread_stopped`'s reader, for the handler (which lets go of the backend)."""
        return lambda: self.thread_stopped

    @property
    def thread_stopped(self) -> bool:
        """True once the issuer's thread stopped, so it can enqueue no more copies: after a release
        that joined it, or, when the release's stop timed out (the thread was inside a driver
        call), as soon as the thread left its loop since (asked of the library, which never waits
        here). False while the backend is not released."""
        with self._stop_lock:
            if self._released and not self._joined:
                self._joined = not self.lib.kvo_issuer_stop(self._issuer, 0)
            return self._joined

    def can_issue_here(self) -> bool:
        """Always: a hand-off works from any thread."""
        return True

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """None on the caller's thread: the native thread plans and issues."""
        return 0

    @property
    def strided_min_rows(self) -> int:
        """A staged layer's rows in runs of at least this many records count as strided copies
        (0: none), as :meth:`layered_path_for` counts them."""
        return self._strided_min_rows

    def layered_path_for(self, host_blocks: I64Array) -> str:
        """The path a layered load from ``host_blocks`` takes: ``auto``'s
        :meth:`~kvoffload.calibration.LayeredChoice.path` where the worker has one (staged rows in
        runs of at least ``STRIDED_MIN_ROWS`` records count as strided copies: shorter runs of
        narrow layers go strided too, but slower than ``sm`` on the host the rule was drawn from,
        docs/design.md §12), else as a whole job's."""
        if self._layered is not None:
            return self._layered(host_blocks, self._strided_min_rows)
        return self._choose(int(host_blocks.shape[0]))

    def layer_marks(self, count: int) -> LayerMarks:
        """Marks for a layered job of ``count`` layers, attached at the hand-off."""
        return NativeLayerMarks(self, count)

    def early_wake(self, pages: int) -> tuple[int, Callable[[], object]] | None:
        """For the worker's fast front, whose jobs copy ``pages`` pages per pair: the fewest pairs
        of a job its caller does not issue, and a call that wakes the thread when it is out of work
        and blocked, or tells it that the caller is coming when it has work, to be made as soon as
        such a job is taken, before its checks and its hand-off (:data:`EXPECT_SPIN_S`,
        :data:`CALLER_COMING_S`; kvo_issuer_expect); None when both are off."""
        if self._expect is None or pages <= 0:
            return None
        return self._caller_issue_max // pages + 1, self._wake_early

    def _wake_early(self) -> None:
        """kvo_issuer_expect, unless the backend was released (the issuer may be gone): under the
        lock :meth:`release` takes, as a hand-off."""
        with self._lock:
            if not self._released and self._expect is not None:
                self._expect(self._expect_arg)

    def issue(self, plan: CopyPlan, src: I64Array, dst: I64Array, fence: object) -> Ticket:
        """Hand the job to the native thread on the path chosen for its size; never raises."""
        assert isinstance(fence, NativeFence)
        return self._submit((plan,), src, dst, fence.stream, fence.pointer, None, 0)

    def issue_layers(
        self, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array, fence: object,
        marks: LayerMarks, first: int = 0,
    ) -> Ticket:
        """Hand a layered job over: the thread marks each layer once its copies are enqueued."""
        assert isinstance(marks, NativeLayerMarks)
        assert isinstance(fence, NativeFence)
        return self._submit(plans, src, dst, fence.stream, fence.pointer, marks, first)

    def _submit(
        self, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array, stream: int, pointer: int,
        marks: NativeLayerMarks | None, first: int,
    ) -> Ticket:
        """Hand a job over behind the fence ``pointer`` (one of :meth:`fence`), or, when it is 0,
        behind a fence the call records on ``stream``."""
        n = int(src.shape[0])
        device, host = (src, dst) if self._stores else (dst, src)
        whole = marks is None
        name = self._choose(n) if whole else self.layered_path_for(host)
        with self._lock:
            if self._released:
                return FailedTicket(TransferError(_RELEASED))
            plans_address = self._single.get((plans[0], whole)) if len(plans) == 1 else None
            if plans_address is None:
                try:
                    plans_address = self._plan_array(plans, whole=whole)
                except Exception as exc:  # nothing was handed over: the job fails at once
                    return FailedTicket(exc)
            front = self._front_hand_off
            call: Callable[..., int | None]
            if front is not None:
                call = front
                args: tuple[object, ...] = (
                    self._front_at, stream, pointer, _PATHS[name], device, host, len(plans),
                    plans_address, first, int(not whole))
            else:
                call = self._hand_off
                args = (self._issuer_arg, stream, pointer, _PATHS[name], n, native.address(device),
                        native.address(host), len(plans), plans_address, first, int(not whole),
                        self._error_arg)
            if pointer or not self.switches_device():
                job = call(*args)
            else:  # the fence is recorded in the call: with this backend's device current
                with torch.cuda.device(self.index):
                    job = call(*args)
            code = self._front_spec.error if front is not None else self._error.value
        if job and marks is not None:
            marks.attach(int(job))
        return self._ticket(job, code, name)

    def _ticket(self, job: int | None, code: int, name: str) -> Ticket:
        """The ticket of a hand-off that returned ``job`` (0 or None: it failed with ``code``) on
        the path ``name``."""
        if not job:
            return FailedTicket(native_error(int(code), "cuEventRecord" if code > 0 else "native hand-off"))
        return NativeTicket(self.lib, int(job), self._path_names[name], self._front_calls)

    def _plan_array(self, plans: tuple[CopyPlan, ...], *, whole: bool) -> int:
        """The address of a C array of the library's plans for ``plans`` (each registered once;
        caller holds the lock; :meth:`_submit` looks a single plan's up in ``_single`` first).
        ``whole``: staged rows are whole records (a job of whole blocks), else the compact rows of
        a layer's part of each record."""
        pointers = tuple(self._native_plan(p, whole) for p in plans)
        cached = self._plan_arrays.get(pointers)
        if cached is None:
            array = (ctypes.c_void_p * len(pointers))(*pointers)
            cached = self._plan_arrays[pointers] = (array, ctypes.addressof(array))
        if len(plans) == 1:
            self._single[(plans[0], whole)] = cached[1]
        return cached[1]

    def _native_plan(self, plan: CopyPlan, whole: bool) -> int:
        pointer = self._plans.get((plan, whole))
        if pointer is not None:
            return pointer
        pages = plan.pages
        keep: list[I64Array] = []

        def address(values: object) -> int:
            array = np.ascontiguousarray(values, dtype=np.int64)
            keep.append(array)
            return int(array.ctypes.data)

        spec = native.PlanSpec(
            pages=pages.num_pages, dev_base=address(pages.dev_base), dev_stride=address(pages.dev_stride),
            nbytes=address(pages.nbytes), host_offset=address(pages.host_offset),
            segment=address(pages.segment), record_bytes=pages.record_bytes, host_base=plan.host_base,
            host_stride=plan.host_stride, chunk_records=plan.chunk_records, merge=int(plan.merge),
        )
        compact = plan if whole else plan.compact
        if self._tables is not None:
            spec.kseg, spec.kseg_rows = self._tables(plan)
            spec.cseg, spec.cseg_rows = self._tables(compact)
        if compact is plan:
            spec.pitch, spec.runs = pages.record_bytes, 1
            spec.run_offset, spec.run_size = address([0]), address([pages.record_bytes])
        else:
            offsets, sizes = plan.record_runs
            spec.pitch, spec.runs = compact.pages.record_bytes, int(offsets.shape[0])
            spec.run_offset, spec.run_size = address(offsets), address(sizes)
        created = self.lib.kvo_plan_new(ctypes.byref(spec))
        if not created:
            raise TransferError("the native issuer could not allocate a plan")
        self._plans[(plan, whole)] = int(created)
        return int(created)

    def call_stats(self) -> DriverCallStats:
        """The issuer's :class:`DriverCallStats` so far.

        Raises:
            TransferError: the backend was released (its issuer is gone).
        """
        kinds = native.CALL_KINDS
        out = (ctypes.c_int64 * (2 * len(kinds) + 2))()
        with self._lock:
            if self._released:
                raise TransferError("the native backend was released: it has no driver call statistics")
            self.lib.kvo_issuer_call_stats(self._issuer, out)
        n = len(kinds)
        return DriverCallStats(
            longest_ns={kinds[k]: int(out[k]) for k in range(1, n)},
            slow_caller_calls={kinds[k]: int(out[n + k]) for k in range(n)},
            caller_calls=int(out[2 * n]), caller_longest_ns=int(out[2 * n + 1]),
        )

    def direct_copies(self) -> int:
        """How many direct strided copies the issuer's dma plans made so far: one per page group
        of a run of pairs whose host records and device blocks both follow each other
        (docs/design.md §16, *Direct strided copies*).

        Raises:
            TransferError: the backend was released (its issuer is gone).
        """
        with self._lock:
            if self._released:
                raise TransferError("the native backend was released: it has no copy counts")
            return int(self.lib.kvo_issuer_direct_copies(self._issuer))

    # ------------------------------------------------------------------------------------ the book

    def booked_hand_off_call(self, plans: tuple[CopyPlan, ...], *, whole: bool) -> BookedHandOff:
        """A call ``(job_id, src, dst, stream, marks)`` that hands a job of ``plans`` (``whole``:
        one plan of whole blocks; else layer ``i``'s plan ``plans[i]``, the job's layer marks in
        ``marks``) over as booked, its fence recorded on ``stream`` in the same call into the
        library, the plans registered once (here, or at a later job if that fails). It returns 0
        when the job is in the book (where its result comes, failed if its fence could not be
        recorded or its plans registered), else the job was not booked and failed with the returned
        code (:func:`native_error`); it never raises."""
        count, layered = len(plans), int(not whole)
        registered: list[int] = []

        def register() -> int | None:
            """The plans' array (registered now if not yet), None once the backend was released."""
            if not registered:
                with self._lock:
                    if self._released:
                        return None
                    registered.append(self._plan_array(plans, whole=whole))
            return registered[0]

        with contextlib.suppress(Exception):  # a failed registration is tried again per job
            register()
        if self._front is not None:
            return self._front_hand_off_call(registered, register, count, layered)

        def hand_off(job_id: int, src: I64Array, dst: I64Array, stream: int,
                     marks: LayerMarks | None = None) -> int:
            try:
                address = register()
            except Exception as exc:  # noqa: BLE001 - the job fails with it, through the book
                return 0 if self.book_fail(job_id, int(src.shape[0]), exc) else native.RELEASED
            return self._booked(job_id, address, count, src, dst, stream, 0, 0, layered,
                                cast("NativeLayerMarks | None", marks))

        return hand_off

    def _front_hand_off_call(self, registered: list[int], register: Callable[[], int | None],
                             count: int, layered: int) -> BookedHandOff:
        """:meth:`booked_hand_off_call`'s call through the call front: the steps of :meth:`_booked`
        in one frame, every lookup made here once (the fast front makes this call for every job, a
        layered one before its layer 0 is issued, and a cold call pays for each function and object
        it touches: design §16). ``registered``/``register``: the plans' array once registered, and
        the registration; ``count`` plans, ``layered`` (0 or 1) as the library's hand-off takes."""
        front = self._front
        assert front is not None
        call, at, tags, paths, spec = front.hand_off_booked, self._front_at, self._tags, _PATHS, self._front_spec
        lock, stores, index = self._lock, self._stores, self.index
        device_now = current_device_reader() if self._on_cuda else None
        # the path: a whole job's by its size, a layered one's as layered_path_for chooses it
        choose, layered_choice, min_rows = self._choose, self._layered if layered else None, self._strided_min_rows

        def hand_off(job_id: int, src: I64Array, dst: I64Array, stream: int,
                     marks: LayerMarks | None = None) -> int:
            if registered:
                address: int | None = registered[0]
            else:
                try:
                    address = register()
                except Exception as exc:  # noqa: BLE001 - the job fails with it, through the book
                    return 0 if self.book_fail(job_id, int(src.shape[0]), exc) else native.RELEASED
            device, host = (src, dst) if stores else (dst, src)
            name = choose(src.shape[0]) if layered_choice is None else layered_choice(host, min_rows)
            args = (at, job_id, tags[name], stream, paths[name], device, host, count, address, 0, layered)
            with lock:
                if self._released or self._book_closed or address is None:
                    return native.RELEASED
                if device_now is not None and device_now() != index:  # the fence is recorded in
                    with torch.cuda.device(index):                    # the call
                        code = int(call(*args))
                else:
                    code = int(call(*args))
                job = int(spec.marks_job or 0) if layered else 0  # the spec is the next call's
            if job and marks is not None:
                marks.attach(job)  # type: ignore[attr-defined]  # (this backend's: layer_marks)
            return code

        return hand_off

    def issue_booked(
        self, job_id: int, plans: tuple[CopyPlan, ...], src: I64Array, dst: I64Array,
        fence: object, marks: LayerMarks | None, first: int = 0,
    ) -> int:
        """Hand a job over as booked behind ``fence`` (:meth:`fence` or :meth:`position`): a whole
        job of ``plans[0]`` when ``marks`` is None, else a layered one from layer ``first``. Returns
        as :meth:`booked_hand_off_call`'s call; never raises."""
        assert isinstance(fence, NativeFence)
        whole = marks is None
        try:
            with self._lock:
                address = None if self._released else self._plan_array(plans, whole=whole)
        except Exception as exc:  # noqa: BLE001 - nothing was handed over: the job fails at once
            return 0 if self.book_fail(job_id, int(src.shape[0]), exc) else native.RELEASED
        return self._booked(job_id, address, len(plans), src, dst, fence.stream, fence.pointer, first,
                            int(not whole), cast("NativeLayerMarks | None", marks))

    def _booked(
        self, job_id: int, address: int | None, count: int, src: I64Array, dst: I64Array, stream: int,
        pointer: int, first: int, layered: int, marks: NativeLayerMarks | None,
    ) -> int:
        """kvo_hand_off_booked (the plans' array at ``address``; None: the backend was released),
        through the call front where it is built and the fence is recorded in the call."""
        n = int(src.shape[0])
        device, host = (src, dst) if self._stores else (dst, src)
        name = self.layered_path_for(host) if layered else self._choose(n)
        front = self._front

        def hand_off() -> tuple[int, int]:
            """The library's call: its code, and the layered job for the marks (0: none)."""
            if front is not None and not pointer:
                code = int(front.hand_off_booked(
                    self._front_at, job_id, self._tags[name], stream, _PATHS[name], device, host,
                    count, address, first, layered))
                return code, int(self._front_spec.marks_job or 0) if layered else 0
            out = ctypes.c_void_p(0)
            code = int(self._hand_off_booked(
                self._issuer_arg, job_id, self._tags[name], stream, pointer, _PATHS[name], n,
                native.address(device), native.address(host), count, address, first, layered,
                ctypes.byref(out)))
            return code, int(out.value or 0)

        with self._lock:
            if self._released or self._book_closed or address is None:
                return native.RELEASED
            if not pointer and self.switches_device():  # the fence is recorded in the call
                with torch.cuda.device(self.index):
                    code, job = hand_off()
            else:
                code, job = hand_off()
        if marks is not None and job:
            marks.attach(job)
        return code

    def book_fail(self, job_id: int, pairs: int, error: BaseException) -> bool:
        """Book job ``job_id`` of ``pairs`` pairs as failed with ``error`` before it was handed
        over, in order among the booked jobs; False (not booked) once the backend was released or
        when the library has no memory for it."""
        with self._lock:
            if self._released or self._book_closed:
                return False
            self._book_errors[job_id] = error
            if self.lib.kvo_book_fail(self._issuer, job_id, pairs, native.PYTHON_ERROR):
                del self._book_errors[job_id]
                return False
        return True

    def book_take(self) -> list[BookedResult]:
        """The results of the finished jobs at the head of the book, in hand-off order (each taken
        once; the book lets go of them); nothing once the issuer was freed."""
        if not self._book_enter():
            return []
        try:
            front = self._front
            if front is not None:  # (a results list built in C: a MemoryError there loses the
                raw: list[_Raw] = front.book_take(self._front_at)  # results it took: design §16)
            else:
                with self._take_lock:  # the ctypes out-arrays are the backend's: one take at a time
                    raw = self._take_ctypes()
            return [self._outcome(*r) for r in raw] if raw else []
        finally:
            self._book_left()

    def _take_ctypes(self) -> list[_Raw]:
        """kvo_book_take through ctypes, as the call front's ``book_take`` (caller holds
        ``_take_lock``)."""
        out, seconds, calls = self._take_out, self._take_seconds, self._take_calls
        fields = native.BOOK_FIELDS
        raw: list[_Raw] = []
        while True:
            count = int(self.lib.kvo_book_take(self._issuer, _TAKE_MAX, out, seconds, calls))
            for k in range(count):
                job_id, code, fail, pairs, tag, handed, began, issued, found = out[k * fields:(k + 1) * fields]
                raw.append((job_id, code, fail, pairs, tag, seconds[k], (calls[k] or b"").decode(),
                            handed, began, issued, found))
            if count < _TAKE_MAX:
                return raw

    def _outcome(self, job_id: int, code: int, fail: int, pairs: int, tag: int, seconds: float,
                 call: str, *times: int) -> BookedResult:
        """A taken result's :class:`BookedResult`."""
        error: BaseException | None = None
        if code == native.PYTHON_ERROR:  # (a release meanwhile let go of the errors it kept)
            error = self._book_errors.pop(job_id, None) or TransferError(
                "the job failed before its hand-off; its error went with the backend's release")
        elif fail != native.FAIL_NONE:
            error = native_error(code, call or "native issuer")
        completion = fail == native.FAIL_COMPLETION
        path = self._tag_names[tag] if tag >= 0 and not completion else None
        return BookedResult(job_id, pairs, error is None, seconds if error is None else 0.0, path,
                            error, completion, times)  # type: ignore[arg-type]

    def book_wait(self, job_id: int | None, timeout_s: float) -> bool:
        """Block, without the GIL, until the first job not done among booked job ``job_id`` (None:
        the last one booked) and those booked before it is done, or ``timeout_s`` passed; True when
        it is done (or none is left, the job is not in the book, the issuer was freed): call again
        while the job's result is not taken."""
        if not self._book_enter():
            return True
        try:
            last = job_id is None
            key = 0 if job_id is None else job_id
            deadline = time.monotonic() + max(0.0, timeout_s)
            done = self._book_wait_once(key, last, timeout_s)
            if done < 0 and not last and self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                # Not in the book: perhaps being handed over now. A hand-off holds the lock through
                # its call; once it is let go, the job is in the book (or never will be): a wait
                # blocks (within its deadline) where it would look again and again meanwhile.
                self._lock.release()
                done = self._book_wait_once(key, last, max(0.0, deadline - time.monotonic()))
            return done != 0
        finally:
            self._book_left()

    def _book_wait_once(self, key: int, last: bool, timeout_s: float) -> int:
        """kvo_book_wait (a book call counted in): 1 done, 0 not yet, -1 not in the book."""
        if self._front is not None:
            return int(self._front.book_wait(self._front_at, key, int(last), _ns(timeout_s)))
        return int(self.lib.kvo_book_wait(self._issuer, key, int(last), _ns(timeout_s)))

    def close_book(self, timeout_s: float) -> None:
        """Book no job any more (a drain's last look): a booked hand-off, or a job booked failed,
        returns :data:`native.RELEASED` from now on. Waits at most ``timeout_s`` for a hand-off in
        progress (which holds the lock across its fence's record, a driver call).

        Raises:
            WaitTimeoutError: the hand-off in progress did not return in time (its driver call
                held); the book is closed to the hand-offs after it all the same.
        """
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            self._book_closed = True  # looked at under the lock by each hand-off that takes it
            raise WaitTimeoutError(
                f"a hand-off to the native issuer did not return within {timeout_s:.3f} s of the "
                "shutdown's drain (its caller's driver call, the fence's record, was held)"
            )
        try:
            self._book_closed = True
        finally:
            self._lock.release()

    def book_count(self) -> tuple[int, int | None, int]:
        """The jobs in the book (handed over, results not taken), the first one's id (None when
        there is none) and how many jobs were ever booked; once the issuer was freed, none in the
        book and the total it had."""
        if not self._book_enter():
            return 0, None, self._book_totals[1]
        try:
            out = (ctypes.c_int64 * 2)()
            count = int(self.lib.kvo_book_count(self._issuer, out))
            return count, (int(out[0]) if count else None), int(out[1])
        finally:
            self._book_left()

    def book_error(self, code: int) -> BaseException:
        """The error of a job a booked hand-off did not book (it returned ``code``)."""
        return native_error(code, "native hand-off")

    def book_times(self, job_id: int) -> tuple[float, float, float, float] | None:
        """Booked job ``job_id``'s timeline so far (as :attr:`BookedResult.times`), or None when it
        is not in the book (its result taken, or never booked): a profile's view of a job."""
        out = (ctypes.c_int64 * 4)()
        if not self._book_enter():
            return None
        try:
            if not self.lib.kvo_book_times(self._issuer, job_id, out):
                return None
        finally:
            self._book_left()
        return out[0] / 1e9, out[1] / 1e9, out[2] / 1e9, out[3] / 1e9

    def _book_enter(self) -> bool:
        """Count a call into the book (the issuer stays until it left: :meth:`_book_left`); False
        once the issuer was freed. The lock is held only for the count: a take or a wait never
        waits behind a hand-off's fence record."""
        with self._count_lock:
            if self._freed or self._free_deferred:
                return False
            self._book_users += 1
            return True

    def _book_left(self) -> None:
        """A book call left the library: the last one frees the issuer if the release left it."""
        with self._count_lock:
            self._book_users -= 1
            free = self._free_deferred and self._book_users == 0
            if free:
                self._free_deferred, self._freed = False, True
        if free:
            self.lib.kvo_issuer_free(self._issuer)

    def release(self) -> None:
        """:meth:`release_within` :data:`STOP_TIMEOUT_S`.

        Raises:
            TransferError: the thread did not stop in time.
            CudaError: the driver refused to destroy a stream.
        """
        self.release_within(STOP_TIMEOUT_S)

    def release_within(self, timeout: float) -> None:
        """Stop the thread (jobs not issued yet fail), free the plans and the issuer, then release
        the wrapped backend (its streams, ring and tables). Once; a thread still inside a driver call
        after ``timeout`` seconds (at most :data:`STOP_TIMEOUT_S`; a handler's shutdown gives its
        time left) keeps everything it may use, and the call raises.

        Raises:
            TransferError: the thread did not stop in time.
            CudaError: the driver refused to destroy a stream.
        """
        seconds = min(STOP_TIMEOUT_S, max(0.0, timeout))
        # A hand-off holds the lock across its fence's record (a driver call): one held past the
        # time leaves the issuer as it is, its thread running, to the process.
        if not self._lock.acquire(timeout=seconds):
            raise TransferError(
                f"a hand-off to the native issuer held its lock past {seconds:.3f} s (its caller's "
                "driver call): the issuer thread was not stopped; its streams and buffers are left "
                "to the process"
            )
        try:
            if self._released:
                return
            self._released = True
        finally:
            self._lock.release()
        with self._stop_lock:  # a look of thread_stopped's meanwhile may have joined it
            stuck = not self._joined and self.lib.kvo_issuer_stop(self._issuer, _ns(seconds))
            self._joined = not stuck
        if stuck:
            _log.error("the native issuer thread did not stop within %.3f s", seconds)
            raise TransferError(
                f"the native issuer thread did not stop within {seconds:.3f} s; its streams and "
                "buffers are left to the process"
            )
        plans, self._plans = self._plans, {}
        self._plan_arrays.clear()
        self._single.clear()
        for pointer in plans.values():
            self.lib.kvo_plan_free(pointer)
        with self._lock:  # a book wait still inside the library frees the issuer as it leaves
            out = self._book_out
            self._book_totals = (int(self.lib.kvo_book_count(self._issuer, out)), int(out[1]))
            self._book_errors.clear()  # the book's jobs go with the issuer
            with self._count_lock:
                deferred = self._free_deferred = self._book_users > 0
                self._freed = not deferred
        if not deferred:
            self.lib.kvo_issuer_free(self._issuer)
        self._inner.release()
