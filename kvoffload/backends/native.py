"""The native issuer backend: a :class:`~kvoffload.backends.cuda.CudaBackend`'s paths, planned,
enqueued and completed by a C thread that never needs the GIL (docs/design.md §16).

A job costs its caller one hand-off: the fence is recorded on the compute stream (one call into
the library), the block ids are copied into the library and the thread is woken. The thread plans
the job exactly as the Python paths do (the copy kernel's rows, batched-DMA descriptors merged where
they continue, staged chunks over the staging ring), enqueues it behind the fence, polls its end
event with short sleeps and wakes the job's waiters. The engine's Python, busy or not, never delays
the link's start, and the caller never pays for the issue.

Owns: the native issuer (its thread, events and plans; stopped and freed exactly once by
:meth:`NativeBackend.release`) and the :class:`CudaBackend` it was built over (its streams, ring and
kernel tables, released after the thread was joined). A :class:`NativeTicket` owns its job's
reference, a :class:`NativeFence` its taker's, a :class:`NativeLayerMarks` its marks'.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Final, Protocol, cast

import numpy as np
import numpy.typing as npt
import torch

from kvoffload import native
from kvoffload._descriptors import CopyPlan
from kvoffload._jobs import FailedTicket, Ticket
from kvoffload._layer_load import LayerMarks
from kvoffload.backends.cuda import CudaBackend, current_device_index, current_stream_reader
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
    "STAGED_EDGE_BYTES",
    "START_TIMEOUT_S",
    "STOP_TIMEOUT_S",
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
#: (``python -m tests.gpu.probe_strided_copy``; docs/design.md §12).
STRIDED_MIN_ROWS: Final = 4
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
    the polls, the waits' spin and queries, the thread's give-way, idle spin, naps, end lead,
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
    c.edge_bytes = max(0, int(STAGED_EDGE_BYTES))
    c.caller_coming_ns = _ns(CALLER_COMING_S)
    c.start_timeout_ns = _ns(START_TIMEOUT_S)
    c.piece_bytes = max(0, int(copier_module.COPY_PIECE_BYTES))


class NativeTicket:
    """One job handed to the native issuer. Owns the ticket's reference to the job until
    :meth:`release`, or until :meth:`done` finds the job done with no call inside the library (the
    same call into the library drops it). ``error`` is known once the job is done (the thread
    issues it later).

    Thread-safe: a wait may block in the library while another thread finds the job done and
    releases the ticket; the reference is dropped only once no call is inside the library (the job
    must not be freed under a waiter). The library is called through the call front where it is
    built (``front``: the module and its spec's address), else through ctypes."""

    __slots__ = ("_lib", "_job", "error", "path", "_done", "_seconds", "_released", "_failure",
                 "_times", "_guard", "_users", "_front", "_spec")

    def __init__(self, lib: ctypes.CDLL, job: int, path: str,
                 front: tuple[ModuleType, int] | None = None) -> None:
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
            taken = self._front.job_take(self._spec, self._job, release)
            if taken is None:
                return False
            code, fail, handed, began, issued, found, seconds, name = taken
        else:
            out = (ctypes.c_int64 * 6)()
            c_seconds, c_name = ctypes.c_double(0.0), ctypes.c_char_p()
            if self._lib.kvo_job_take(self._job, int(release), out, ctypes.byref(c_seconds),
                                      ctypes.byref(c_name)) != native.JOB_DONE:
                return False
            code, fail, handed, began, issued, found = out
            seconds, name = c_seconds.value, (c_name.value or b"").decode()
        if release:
            self._released = True
        self._times = (handed / 1e9, began / 1e9, issued / 1e9, found / 1e9)
        self._seconds = seconds
        if fail == native.FAIL_COMPLETION:
            self._failure = native_error(int(code), name or "native issuer")
        elif fail != native.FAIL_NONE:
            self.error = native_error(int(code), name or "native issuer")
        self._done = True
        return True

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
    leads to the release implies).
    """

    on_device = True

    def __init__(self, backend: NativeBackend, count: int) -> None:
        self._backend = backend
        self._count = count
        self._job: int | None = None
        self._settled = False
        self._released = False
        self._waiters = 0
        self._cond = threading.Condition()

    @property
    def count(self) -> int:
        """Layers of the job."""
        return self._count

    def attach(self, job: int) -> None:
        """The job was handed over: waits go to the library."""
        with self._cond:
            self._job = job
            self._cond.notify_all()

    def settle(self) -> None:
        """The hand-off returned: a job never handed over has nothing to wait for."""
        with self._cond:
            self._settled = True
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
        with self._cond:
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
            with self._cond:
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
        with self._cond:
            if self._released:
                return
            self._released = True
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


class _HandOff(Protocol):
    """A bound hand-off of :meth:`NativeBackend._bind_hand_off` (``marks``: a layered job's)."""

    def __call__(self, src: I64Array, dst: I64Array, stream: int, marks: LayerMarks | None = None) -> Ticket:
        """Hand the job over; never raises."""


class NativeBackend:
    """One direction's copies issued by the native thread over a :class:`CudaBackend`'s streams and
    paths (see the module docstring). Build it with :meth:`over`.

    Its ``issue`` only hands the job over (``hands_off``): the handler issues every job on the
    caller's thread, never splits one, and waits for completion through the ticket, which the
    thread signals.
    """

    name = "cuda"
    #: ``issue`` hands the job to a thread of the backend's own: cheap, whatever the job's size.
    hands_off = True

    def __init__(
        self, inner: Wrapped, lib: ctypes.CDLL, issuer: int, *, index: int,
        choose: Callable[[int], str], path_names: Mapping[str, str], tables: TableSource | None,
        config: native.Config, keep: object,
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
        self._path_names = dict(path_names)
        self._tables = tables
        self._plans: dict[tuple[CopyPlan, bool], int] = {}
        self._plan_arrays: dict[tuple[int, ...], tuple[ctypes.Array[ctypes.c_void_p], int]] = {}
        self._single: dict[tuple[CopyPlan, bool], int] = {}
        self._lock = threading.Lock()
        self._released = False
        # The hand-off's fixed arguments, built once: ctypes converts them at no call.
        self._hand_off = lib.kvo_hand_off
        self._fence_take = lib.kvo_fence_take
        self._issuer_arg = ctypes.c_void_p(issuer)
        self._error = ctypes.c_int64(0)
        self._error_arg = ctypes.byref(self._error)
        # The call front's hand-off, where it is built (the same call without ctypes).
        front = native.front()
        self._front_hand_off = front.hand_off if front is not None else None
        self._front_spec = native.front_spec(lib, issuer=issuer)
        self._front_at = ctypes.addressof(self._front_spec)
        self._front_calls = (front, self._front_at) if front is not None else None  # the tickets'
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
    ) -> NativeBackend:
        """Start the library's thread with ``config`` (driver entry points, streams, paths) over
        ``inner``; on success the new backend owns ``inner``, on failure the caller still does.

        ``choose`` maps a job's block count to a path name, ``path_names`` a path name to what
        results report, ``tables`` a plan to its copy-kernel table in device memory (None: no
        kernel path); ``keep`` is whatever ``config`` points into.

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
            lib.kvo_issuer_stop(issuer, _ns(STOP_TIMEOUT_S))
            lib.kvo_issuer_free(issuer)
            raise native_error(int(error.value), "cuCtxSetCurrent")
        return cls(inner, lib, int(issuer), index=index, choose=choose, path_names=path_names,
                   tables=tables, config=config, keep=keep)

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
            keep=bases,
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
        if isinstance(fence, NativeFence) and fence.pointer and not fence._released:  # noqa: SLF001 - its owner
            fence._released = True  # noqa: SLF001
            with self._lock:  # the issuer is freed after release_within set _released under it
                if not self._released:  # else the issuer, and its fences' pool, are gone
                    self.lib.kvo_fence_release(self._issuer, fence.pointer)

    def start_thread(self) -> None:
        """Nothing: the handler's own thread only hands jobs over, which needs no context."""

    def can_issue_here(self) -> bool:
        """Always: a hand-off works from any thread."""
        return True

    def issue_cost(self, plan: CopyPlan, pairs: int) -> int:
        """None on the caller's thread: the native thread plans and issues."""
        return 0

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

    def hand_off_call(self, plan: CopyPlan) -> Callable[[I64Array, I64Array, int], Ticket]:
        """:meth:`issue` for the fast front (docs/design.md §16), bound to ``plan``: a call
        ``(src, dst, stream)`` that hands a whole job over with its fence recorded on ``stream`` (a
        handle of this backend's device) in the same call into the library; never raises. With the
        call front, the call is :meth:`_submit`'s work for such a job with the plan registered here,
        once: the fast front's every job runs it on the engine's thread."""
        return self._bind_hand_off((plan,), whole=True)

    def hand_off_layers_call(
        self, plans: tuple[CopyPlan, ...],
    ) -> Callable[[I64Array, I64Array, int, LayerMarks], Ticket]:
        """:meth:`issue_layers` for the fast front, bound to ``plans`` (layer ``i``'s plan
        ``plans[i]``, from layer 0): a call ``(src, dst, stream, marks)`` that hands a layered job
        over as :meth:`hand_off_call`'s call hands a whole one, the marks (of :meth:`layer_marks`)
        attached to the job it hands over; never raises."""
        return self._bind_hand_off(plans, whole=False)

    def _bind_hand_off(
        self, plans: tuple[CopyPlan, ...], *, whole: bool,
    ) -> _HandOff:
        """The call of :meth:`hand_off_call` (``whole``) or :meth:`hand_off_layers_call`: the plans
        registered once, here; without the call front, or when that fails, :meth:`_submit`."""
        def submit(src: I64Array, dst: I64Array, stream: int, marks: LayerMarks | None = None) -> Ticket:
            return self._submit(plans, src, dst, stream, 0, cast("NativeLayerMarks | None", marks), 0)

        with self._lock:
            if self._front_hand_off is None or self._released:
                return submit
            try:
                address = self._plan_array(plans, whole=whole)
            except Exception:  # each job fails with the registration's error, through _submit
                return submit
        choose, stores, lock = self._choose, self._stores, self._lock
        front_at, spec, on_cuda, index = self._front_at, self._front_spec, self._on_cuda, self.index
        count, layered = len(plans), int(not whole)

        def hand_off(src: I64Array, dst: I64Array, stream: int, marks: LayerMarks | None = None) -> Ticket:
            name = choose(src.shape[0])
            device, host = (src, dst) if stores else (dst, src)
            with lock:
                if self._released:
                    return FailedTicket(TransferError(_RELEASED))
                call = self._front_hand_off  # (looked up per call: a profile may wrap it)
                assert call is not None
                if on_cuda and current_device_index() != index:  # the fence is recorded in the call
                    with torch.cuda.device(index):
                        job = call(front_at, stream, 0, _PATHS[name], device, host, count, address, 0, layered)
                else:
                    job = call(front_at, stream, 0, _PATHS[name], device, host, count, address, 0, layered)
                code = spec.error
            if job and marks is not None:
                cast(NativeLayerMarks, marks).attach(int(job))
            return self._ticket(job, code, name)

        return hand_off

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
        name = self._choose(n)
        device, host = (src, dst) if self._stores else (dst, src)
        whole = marks is None
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
        with self._lock:
            if self._released:
                return
            self._released = True
        seconds = min(STOP_TIMEOUT_S, max(0.0, timeout))
        if self.lib.kvo_issuer_stop(self._issuer, _ns(seconds)):
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
        self.lib.kvo_issuer_free(self._issuer)
        self._inner.release()
